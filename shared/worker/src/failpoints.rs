//! Env-controlled faults for deterministic fault tests. Unset in production.
//!
//! - `TANDEM_FAILPOINT_SKIP_KV_EVENT_IDS=3,4`: the live KV event streams (gRPC and NATS) leave
//!   out these event ids, as a lossy network would; replays and dumps still include them.

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
