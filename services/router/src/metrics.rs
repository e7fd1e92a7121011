//! Metric names the router records (Dynamo's, from `tandem-runtime`).

pub use tandem_runtime::metrics::names::frontend::{
    DISCONNECTED_CLIENTS, INFLIGHT_REQUESTS, INPUT_SEQUENCE_TOKENS,
    INTER_TOKEN_LATENCY_SECONDS as ITL, MODEL_CANCELLATION_TOTAL as CANCELLATIONS,
    MODEL_MIGRATION_MAX_SEQ_LEN_EXCEEDED_TOTAL as MIGRATION_MAX_SEQ_LEN_EXCEEDED,
    MODEL_MIGRATION_TOTAL as MIGRATIONS, OUTPUT_SEQUENCE_TOKENS, OUTPUT_TOKENS_TOTAL,
    REQUESTS_TOTAL, REQUEST_DURATION_SECONDS, TIME_TO_FIRST_TOKEN_SECONDS as TTFT,
};
pub use tandem_runtime::metrics::names::router_overhead::{
    BLOCK_HASHING_MS, SCHEDULING_MS, TOTAL_MS as OVERHEAD_TOTAL_MS,
};

/// Prefill placement decisions, `decision="remote|local"`, `reason=...` (see `disagg`).
pub const DISAGG_DECISIONS: &str = "tandem_router_disagg_decisions_total";

/// Requests waiting in the router's queue (Dynamo's name).
pub const QUEUE_PENDING: &str = "dynamo_frontend_router_queue_pending_requests";
/// How long admitted requests waited in the router's queue.
pub const QUEUE_WAIT_SECONDS: &str = "tandem_router_queue_wait_seconds";
/// Requests refused by the rate limits, `limit="requests|tokens"`.
pub const RATE_LIMITED: &str = "tandem_router_rate_limited_total";
/// Requests refused for a missing or wrong API key, `listener="public|admin"`,
/// `reason="missing|invalid"` (see `auth`).
pub const UNAUTHORIZED: &str = "tandem_router_unauthorized_total";
/// Requests a worker refused before starting them (draining, stopped, unreachable) and the
/// router sent to another worker.
pub const REDISPATCHED_TOTAL: &str = "tandem_router_redispatched_total";
