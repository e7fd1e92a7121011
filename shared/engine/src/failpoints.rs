//! Env-controlled faults inside the engine thread, for the fault tests, compiled in only with
//! the `failpoints` feature (forwarded from `tandem-worker/failpoints`); without it every
//! failpoint is a no-op and no variable is read.
//!
//! - `TANDEM_FAILPOINT_PANIC_REQUEST=<substring>`: sampling a token for a request whose id
//!   contains the substring panics (a bug in one request's per-request work: the engine fails
//!   that request only).
//! - `TANDEM_FAILPOINT_ENGINE_DIE_AFTER_STEPS=<n>`: the engine thread panics in its step
//!   after `n` steps ran (a fatal fault in the batched part: the thread dies, and the worker
//!   must say so).

#[cfg(feature = "failpoints")]
use enabled as imp;

#[cfg(not(feature = "failpoints"))]
use disabled as imp;

/// Called with a request's id before its token is appended.
pub fn panic_request(request_id: &str) {
    #[cfg(test)]
    unit::panic_request(request_id);
    imp::panic_request(request_id);
}

/// Called with the number of steps run so far, in each step before its forward pass.
pub fn die_after_steps(steps: u64) {
    imp::die_after_steps(steps);
}

/// The engine's own unit tests panic for request ids containing [`unit::PANIC_MARK`], without
/// environment variables (which one process's tests would share).
#[cfg(test)]
pub(crate) mod unit {
    pub(crate) const PANIC_MARK: &str = "unit-test-panics-here";

    pub(super) fn panic_request(request_id: &str) {
        if request_id.contains(PANIC_MARK) {
            panic!("unit-test failpoint: request {request_id} panics");
        }
    }
}

#[cfg(not(feature = "failpoints"))]
mod disabled {
    /// Panics for a chosen request: never in this build.
    pub fn panic_request(_request_id: &str) {}

    /// Kills the engine thread after some steps: never in this build.
    pub fn die_after_steps(_steps: u64) {}
}

#[cfg(feature = "failpoints")]
mod enabled {
    use std::sync::OnceLock;

    pub fn panic_request(request_id: &str) {
        static WHO: OnceLock<Option<String>> = OnceLock::new();
        let who = WHO.get_or_init(|| {
            std::env::var("TANDEM_FAILPOINT_PANIC_REQUEST")
                .ok()
                .filter(|s| !s.is_empty())
        });
        if let Some(w) = who {
            if request_id.contains(w.as_str()) {
                panic!("failpoint: TANDEM_FAILPOINT_PANIC_REQUEST hit request {request_id}");
            }
        }
    }

    pub fn die_after_steps(steps: u64) {
        static AFTER: OnceLock<Option<u64>> = OnceLock::new();
        let after = AFTER.get_or_init(|| {
            std::env::var("TANDEM_FAILPOINT_ENGINE_DIE_AFTER_STEPS")
                .ok()
                .and_then(|v| v.trim().parse().ok())
        });
        if after.is_some_and(|n| steps > n) {
            panic!("failpoint: TANDEM_FAILPOINT_ENGINE_DIE_AFTER_STEPS after {steps} steps");
        }
    }
}
