//! Env-controlled faults for deterministic fault tests, compiled in only with the
//! `failpoints` feature (the fault tests' builds: `scripts/test`); without it every failpoint
//! is a no-op and no variable is read.
//!
//! - `TANDEM_FAILPOINT_SKIP_KV_EVENT_IDS=3,4`: the live KV event streams (gRPC and NATS) leave
//!   out these event ids, as a lossy network would; replays and dumps still include them.
//! - `TANDEM_FAILPOINT_PREFILL_HOLD_DIR` and `TANDEM_FAILPOINT_PREFILL_HOLD_AT_BLOCK`: see
//!   [`prefill_hold`].
//! - `TANDEM_FAILPOINT_ENCODE_HOLD_DIR`: see [`encode_hold`].
//! - `TANDEM_FAILPOINT_PREFILL_SILENT_FILE`: see [`prefill_silent`].

#[cfg(feature = "failpoints")]
pub use enabled::{encode_hold, prefill_hold, prefill_silent, skipped_kv_event};

#[cfg(not(feature = "failpoints"))]
pub use disabled::{encode_hold, prefill_hold, prefill_silent, skipped_kv_event};

#[cfg(not(feature = "failpoints"))]
mod disabled {
    /// Whether the live KV event streams leave out this event: never in this build.
    pub fn skipped_kv_event(_event_id: u64) -> bool {
        false
    }

    /// Holds a prefill write: never in this build.
    pub async fn prefill_hold(_request_id: &str, _batch_last_block: usize) {}

    /// Holds an encode worker's write: never in this build.
    pub async fn encode_hold() {}

    /// Stalls a prefill worker before it writes: never in this build.
    pub async fn prefill_silent() {}
}

#[cfg(feature = "failpoints")]
mod enabled {
    use std::sync::OnceLock;

    pub fn skipped_kv_event(event_id: u64) -> bool {
        static SKIP: OnceLock<Vec<u64>> = OnceLock::new();
        SKIP.get_or_init(|| {
            std::env::var("TANDEM_FAILPOINT_SKIP_KV_EVENT_IDS")
                .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
                .unwrap_or_default()
        })
        .contains(&event_id)
    }

    /// `TANDEM_FAILPOINT_PREFILL_HOLD_DIR=/dir` with `TANDEM_FAILPOINT_PREFILL_HOLD_AT_BLOCK=k`: a
    /// prefill worker about to write, for a request whose id starts with `hold-`, a batch that
    /// reaches prompt block `k` first creates `/dir/<request id>.reached`, then waits until
    /// `/dir/<request id>.release` exists, then issues the write. While held it does not look at
    /// revocations: it stands for a one-sided put already in flight, which no message can recall
    /// — exactly what lease quarantine must survive.
    pub async fn prefill_hold(request_id: &str, batch_last_block: usize) {
        if !request_id.starts_with("hold-") {
            return;
        }
        let Ok(dir) = std::env::var("TANDEM_FAILPOINT_PREFILL_HOLD_DIR") else {
            return;
        };
        let at = std::env::var("TANDEM_FAILPOINT_PREFILL_HOLD_AT_BLOCK")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(0);
        if batch_last_block < at {
            return;
        }
        let dir = std::path::PathBuf::from(dir);
        let release = dir.join(format!("{request_id}.release"));
        if release.exists() {
            return;
        }
        if let Err(e) = std::fs::write(dir.join(format!("{request_id}.reached")), b"") {
            tracing::warn!(
                "failpoint: cannot create the .reached marker in {}: {e}",
                dir.display()
            );
        }
        tracing::warn!(
            request_id,
            block = batch_last_block,
            "failpoint: prefill write held"
        );
        // A test-only hold: polling a file keeps the harness free of any IPC.
        while !release.exists() {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        tracing::warn!(request_id, "failpoint: prefill write released");
    }

    /// `TANDEM_FAILPOINT_ENCODE_HOLD_DIR=/dir`: while `/dir/hold` exists, an encode worker
    /// about to write a call's embeddings creates `/dir/reached` and waits until `/dir/hold`
    /// is gone, then writes. Like [`prefill_hold`] it stands for a put already in flight: it
    /// does not look at fences while held.
    pub async fn encode_hold() {
        let Ok(dir) = std::env::var("TANDEM_FAILPOINT_ENCODE_HOLD_DIR") else {
            return;
        };
        let dir = std::path::PathBuf::from(dir);
        let hold = dir.join("hold");
        if !hold.exists() {
            return;
        }
        if let Err(e) = std::fs::write(dir.join("reached"), b"") {
            tracing::warn!(
                "failpoint: cannot create the reached marker in {}: {e}",
                dir.display()
            );
        }
        tracing::warn!("failpoint: encode write held");
        // A test-only hold: polling a file keeps the harness free of any IPC.
        while hold.exists() {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        tracing::warn!("failpoint: encode write released");
    }

    /// `TANDEM_FAILPOINT_PREFILL_SILENT_FILE=/path`: while `/path` exists, a prefill worker
    /// that has accepted a lease stalls before each write (any request): a silent writer, as a
    /// hung or partitioned host would be, still answering `Health` but neither writing nor
    /// answering `FenceLease` for those leases. Once the file is gone it goes on, and by its
    /// own clock refuses to write for a lease that has ended.
    pub async fn prefill_silent() {
        let Ok(path) = std::env::var("TANDEM_FAILPOINT_PREFILL_SILENT_FILE") else {
            return;
        };
        let path = std::path::PathBuf::from(path);
        if !path.exists() {
            return;
        }
        tracing::warn!("failpoint: prefill writer silent");
        // A test-only stall: polling a file keeps the harness free of any IPC.
        while path.exists() {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        tracing::warn!("failpoint: prefill writer speaks again");
    }
}
