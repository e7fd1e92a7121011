//! Metric names (Dynamo's) and the helpers this crate records through the `metrics`
//! facade. No exporter here: the serving process installs one, and until it does every call
//! is a cheap no-op.
//!
//! Recorded by this crate: applied events and event-id gaps. Offered to the router: KV hit
//! rate and per-worker load. The `dynamo_router_overhead_*` names are listed so the router
//! measures its phases under the same names.

use crate::protocols::{KvCacheEventData, WorkerId};
use crate::sequences::WorkerLoad;

pub const KV_CACHE_EVENTS_APPLIED: &str = "dynamo_component_kv_cache_events_applied";
pub const KV_PUBLISHER_DROPPED_EVENTS: &str =
    "dynamo_component_kv_publisher_engines_dropped_events_total";
pub const ROUTER_KV_HIT_RATE: &str = "dynamo_component_router_kv_hit_rate";
pub const FRONTEND_KV_HIT_RATE: &str = "dynamo_frontend_kv_hit_rate";
pub const FRONTEND_CACHED_TOKENS: &str = "dynamo_frontend_cached_tokens";
pub const WORKER_ACTIVE_DECODE_BLOCKS: &str = "dynamo_frontend_worker_active_decode_blocks";
pub const WORKER_ACTIVE_PREFILL_TOKENS: &str = "dynamo_frontend_worker_active_prefill_tokens";
pub const OVERHEAD_BLOCK_HASHING_MS: &str = "dynamo_router_overhead_block_hashing_ms";
pub const OVERHEAD_INDEXER_FIND_MATCHES_MS: &str = "dynamo_router_overhead_indexer_find_matches_ms";
pub const OVERHEAD_SEQ_HASHING_MS: &str = "dynamo_router_overhead_seq_hashing_ms";
pub const OVERHEAD_SCHEDULING_MS: &str = "dynamo_router_overhead_scheduling_ms";
pub const OVERHEAD_TOTAL_MS: &str = "dynamo_router_overhead_total_ms";

pub const STATUS_OK: &str = "ok";
pub const STATUS_DUPLICATE: &str = "duplicate";
pub const STATUS_ERROR: &str = "error";

/// Registers descriptions for the metrics above (call once after installing an exporter).
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        KV_CACHE_EVENTS_APPLIED,
        "KV cache events applied to the router's index, by event_type and status"
    );
    describe_counter!(
        KV_PUBLISHER_DROPPED_EVENTS,
        "KV events the router never received (event_id gaps), per worker"
    );
    describe_histogram!(
        ROUTER_KV_HIT_RATE,
        "Fraction of a request's prompt blocks already cached on the chosen worker"
    );
    describe_histogram!(
        FRONTEND_KV_HIT_RATE,
        "Fraction of a request's prompt blocks already cached on the chosen worker"
    );
    describe_histogram!(
        FRONTEND_CACHED_TOKENS,
        Unit::Count,
        "Prompt tokens already cached on the chosen worker"
    );
    describe_gauge!(
        WORKER_ACTIVE_DECODE_BLOCKS,
        Unit::Count,
        "KV blocks of requests the router has in flight on the worker"
    );
    describe_gauge!(
        WORKER_ACTIVE_PREFILL_TOKENS,
        Unit::Count,
        "Prompt tokens the router has sent to the worker and not yet seen prefilled"
    );
    for name in [
        OVERHEAD_BLOCK_HASHING_MS,
        OVERHEAD_INDEXER_FIND_MATCHES_MS,
        OVERHEAD_SEQ_HASHING_MS,
        OVERHEAD_SCHEDULING_MS,
        OVERHEAD_TOTAL_MS,
    ] {
        describe_histogram!(
            name,
            Unit::Milliseconds,
            "Router overhead per request phase"
        );
    }
}

fn event_type(data: &KvCacheEventData) -> &'static str {
    match data {
        KvCacheEventData::Stored(_) => "stored",
        KvCacheEventData::Removed(_) => "removed",
        KvCacheEventData::Cleared => "cleared",
    }
}

pub(crate) fn event_applied(data: &KvCacheEventData, status: &'static str) {
    metrics::counter!(KV_CACHE_EVENTS_APPLIED, "event_type" => event_type(data), "status" => status)
        .increment(1);
}

pub(crate) fn dropped_events(worker: WorkerId, missing: u64) {
    metrics::counter!(KV_PUBLISHER_DROPPED_EVENTS, "worker_id" => worker.to_string())
        .increment(missing);
}

/// Records the cache hit of one routed request: `overlap_blocks` of its `isl_blocks` full
/// prompt blocks were already on the chosen worker.
pub fn record_kv_hit(overlap_blocks: u32, isl_blocks: usize, block_size: u32) {
    if isl_blocks == 0 {
        return;
    }
    let rate = f64::from(overlap_blocks) / isl_blocks as f64;
    metrics::histogram!(ROUTER_KV_HIT_RATE).record(rate);
    metrics::histogram!(FRONTEND_KV_HIT_RATE).record(rate);
    metrics::histogram!(FRONTEND_CACHED_TOKENS)
        .record(f64::from(overlap_blocks) * f64::from(block_size));
}

/// Publishes a worker's tracked load as the per-worker frontend gauges.
pub fn record_worker_load(worker: WorkerId, load: &WorkerLoad) {
    let id = worker.to_string();
    metrics::gauge!(WORKER_ACTIVE_DECODE_BLOCKS, "worker_id" => id.clone())
        .set(load.active_decode_blocks as f64);
    metrics::gauge!(WORKER_ACTIVE_PREFILL_TOKENS, "worker_id" => id)
        .set(load.active_prefill_tokens as f64);
}
