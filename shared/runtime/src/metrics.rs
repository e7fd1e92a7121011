//! Prometheus metrics: the process-wide recorder, the shared metric names (Dynamo's, so
//! dashboards carry over), and the small status HTTP server every Tandem process runs.
//!
//! Services record with the `metrics` macros using the constants in [`names`]; histograms get
//! buckets by name suffix (`_seconds`, `_ms`, `_tokens`, ...) from [`install_recorder`].

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
/// The recorder handle a status server renders `/metrics` from.
pub use metrics_exporter_prometheus::PrometheusHandle as StatusMetrics;
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::shutdown::ShutdownToken;

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("building the Prometheus recorder: {0}")]
    Build(#[from] BuildError),
    #[error("starting the metrics upkeep thread: {0}")]
    Upkeep(#[source] std::io::Error),
    #[error("binding the status server to {addr}: {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
}

/// Latency buckets in seconds: from 1 ms (router overhead, ITL on small models) to 5 min
/// (long generations).
pub const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
    3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0,
];
/// Millisecond buckets for the `*_ms` overhead histograms (sub-ms hashing to slow scheduling).
pub const MS_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0,
];
/// Token-count buckets: powers of two up to 128k (context lengths).
pub const TOKEN_BUCKETS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
    16384.0, 32768.0, 65536.0, 131072.0,
];
/// Ratio buckets for hit rates in [0, 1].
pub const RATIO_BUCKETS: &[f64] = &[
    0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0,
];
/// Byte buckets for KV transfers: 4 KiB to 4 GiB.
pub const BYTES_BUCKETS: &[f64] = &[
    4096.0,
    16384.0,
    65536.0,
    262144.0,
    1048576.0,
    4194304.0,
    16777216.0,
    67108864.0,
    268435456.0,
    1073741824.0,
    4294967296.0,
];
/// Transfer speed buckets in GB/s (loopback TCP to NVLink).
pub const GBPS_BUCKETS: &[f64] = &[
    0.01, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0, 400.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

fn builder() -> Result<PrometheusBuilder, BuildError> {
    PrometheusBuilder::new()
        // Anything unmatched is most likely a duration; without a default the exporter would
        // render it as a summary, which cannot be aggregated across workers.
        .set_buckets(SECONDS_BUCKETS)?
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)?
        .set_buckets_for_metric(Matcher::Suffix("_ms".into()), MS_BUCKETS)?
        .set_buckets_for_metric(Matcher::Suffix("_tokens".into()), TOKEN_BUCKETS)?
        .set_buckets_for_metric(Matcher::Suffix("_hit_rate".into()), RATIO_BUCKETS)?
        .set_buckets_for_metric(Matcher::Suffix("_bytes".into()), BYTES_BUCKETS)?
        .set_buckets_for_metric(Matcher::Suffix("_gb_s".into()), GBPS_BUCKETS)
}

/// Installs the global Prometheus recorder once per process and returns its handle (later
/// calls return the same handle). Also starts a background thread that runs the exporter's
/// upkeep every 5 s, which keeps histogram memory bounded between scrapes.
pub fn install_recorder() -> Result<PrometheusHandle, MetricsError> {
    static INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = INIT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(h) = HANDLE.get() {
        return Ok(h.clone());
    }
    let handle = builder()?.install_recorder()?;
    let upkeep = handle.clone();
    std::thread::Builder::new()
        .name("metrics-upkeep".into())
        .spawn(move || loop {
            std::thread::sleep(Duration::from_secs(5));
            upkeep.run_upkeep();
        })
        .map_err(MetricsError::Upkeep)?;
    let _ = HANDLE.set(handle.clone());
    Ok(handle)
}

/// A recorder that is not installed globally, with the same buckets (for tests, or for
/// processes that compose recorders).
pub fn build_recorder() -> Result<metrics_exporter_prometheus::PrometheusRecorder, MetricsError> {
    Ok(builder()?.build_recorder())
}

/// Decides what `/health` reports: `true` = ready to serve.
pub type HealthFn = Arc<dyn Fn() -> bool + Send + Sync>;

#[derive(Clone)]
struct StatusState {
    handle: PrometheusHandle,
    health: HealthFn,
    started: Instant,
}

/// `GET /metrics`, `GET /health`, `GET /live`, for merging into a service's own router (the
/// HTTP frontend serves them on its main port).
pub fn status_router(handle: PrometheusHandle, health: HealthFn) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/health", get(health_handler))
        .route("/live", get(live_handler))
        .with_state(StatusState {
            handle,
            health,
            started: Instant::now(),
        })
}

async fn metrics_handler(State(s): State<StatusState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.handle.render(),
    )
}

async fn health_handler(State(s): State<StatusState>) -> impl IntoResponse {
    let healthy = (s.health)();
    let status = if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = serde_json::json!({
        "status": if healthy { "healthy" } else { "unhealthy" },
        "uptime_seconds": s.started.elapsed().as_secs_f64(),
    });
    (status, Json(body))
}

/// Liveness only says the process answers; readiness is `/health`.
async fn live_handler() -> impl IntoResponse {
    Json(serde_json::json!({ "status": "live" }))
}

/// Binds `bind_addr` (`host:port`, port 0 = ephemeral), serves [`status_router`] in the
/// background for the rest of the process, and returns the bound address.
pub async fn serve_status(
    bind_addr: &str,
    handle: PrometheusHandle,
    health: HealthFn,
) -> Result<SocketAddr, MetricsError> {
    serve(bind_addr, status_router(handle, health), None).await
}

/// Like [`serve_status`], but stops when `shutdown` fires. Services usually keep the status
/// server up while draining (so `/health` can report 503) and stop it last.
pub async fn serve_status_until(
    bind_addr: &str,
    handle: PrometheusHandle,
    health: HealthFn,
    shutdown: ShutdownToken,
) -> Result<SocketAddr, MetricsError> {
    serve(bind_addr, status_router(handle, health), Some(shutdown)).await
}

async fn serve(
    bind_addr: &str,
    app: Router,
    shutdown: Option<ShutdownToken>,
) -> Result<SocketAddr, MetricsError> {
    let bind_err = |source| MetricsError::Bind {
        addr: bind_addr.to_string(),
        source,
    };
    let listener = tokio::net::TcpListener::bind(bind_addr)
        .await
        .map_err(bind_err)?;
    let addr = listener.local_addr().map_err(bind_err)?;
    tokio::spawn(async move {
        let server = axum::serve(listener, app);
        let result = match shutdown {
            Some(token) => {
                server
                    .with_graceful_shutdown(async move { token.cancelled().await })
                    .await
            }
            None => server.await,
        };
        if let Err(err) = result {
            tracing::error!(%err, %addr, "status server stopped");
        }
    });
    Ok(addr)
}

/// Metric names, per Dynamo's `prometheus_names.rs`. Use these, never literals,
/// so the router and every worker export the same series.
pub mod names {
    /// Label keys.
    pub mod labels {
        pub const MODEL: &str = "model";
        pub const MODEL_NAME: &str = "model_name";
        pub const WORKER_ID: &str = "worker_id";
        pub const DP_RANK: &str = "dp_rank";
        pub const WORKER_TYPE: &str = "worker_type";
        pub const ROUTER_ID: &str = "router_id";
        pub const NAMESPACE: &str = "dynamo_namespace";
        pub const COMPONENT: &str = "dynamo_component";
        pub const ENDPOINT: &str = "dynamo_endpoint";
        pub const REQUEST_TYPE: &str = "request_type";
        pub const STATUS: &str = "status";
        pub const ERROR_TYPE: &str = "error_type";
        pub const MIGRATION_TYPE: &str = "migration_type";
        pub const STAGE: &str = "stage";
        pub const ENGINE_TYPE: &str = "engine_type";
        pub const DISAGGREGATION_MODE: &str = "disaggregation_mode";
    }

    /// Values of the `error_type` label.
    pub mod error_types {
        pub const VALIDATION: &str = "validation";
        pub const NOT_FOUND: &str = "not_found";
        pub const OVERLOAD: &str = "overload";
        pub const CANCELLED: &str = "cancelled";
        pub const RESPONSE_TIMEOUT: &str = "response_timeout";
        pub const INTERNAL: &str = "internal";
        pub const NOT_IMPLEMENTED: &str = "not_implemented";
    }

    /// The HTTP frontend (router process, port 8000).
    pub mod frontend {
        pub const REQUESTS_TOTAL: &str = "dynamo_frontend_requests_total";
        pub const QUEUED_REQUESTS: &str = "dynamo_frontend_queued_requests";
        pub const INFLIGHT_REQUESTS: &str = "dynamo_frontend_inflight_requests";
        pub const ACTIVE_REQUESTS: &str = "dynamo_frontend_active_requests";
        pub const DISCONNECTED_CLIENTS: &str = "dynamo_frontend_disconnected_clients";
        pub const REQUEST_DURATION_SECONDS: &str = "dynamo_frontend_request_duration_seconds";
        pub const INPUT_SEQUENCE_TOKENS: &str = "dynamo_frontend_input_sequence_tokens";
        pub const OUTPUT_SEQUENCE_TOKENS: &str = "dynamo_frontend_output_sequence_tokens";
        pub const OUTPUT_TOKENS_TOTAL: &str = "dynamo_frontend_output_tokens_total";
        pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "dynamo_frontend_time_to_first_token_seconds";
        pub const INTER_TOKEN_LATENCY_SECONDS: &str = "dynamo_frontend_inter_token_latency_seconds";
        pub const KV_HIT_RATE: &str = "dynamo_frontend_kv_hit_rate";
        pub const CACHED_TOKENS: &str = "dynamo_frontend_cached_tokens";
        pub const KV_TRANSFER_ESTIMATED_LATENCY_SECONDS: &str =
            "dynamo_frontend_kv_transfer_estimated_latency_seconds";
        pub const TOKENIZER_LATENCY_MS: &str = "dynamo_frontend_tokenizer_latency_ms";
        // Model configuration gauges.
        pub const MODEL_TOTAL_KV_BLOCKS: &str = "dynamo_frontend_model_total_kv_blocks";
        pub const MODEL_MAX_NUM_SEQS: &str = "dynamo_frontend_model_max_num_seqs";
        pub const MODEL_MAX_NUM_BATCHED_TOKENS: &str =
            "dynamo_frontend_model_max_num_batched_tokens";
        pub const MODEL_CONTEXT_LENGTH: &str = "dynamo_frontend_model_context_length";
        pub const MODEL_KV_CACHE_BLOCK_SIZE: &str = "dynamo_frontend_model_kv_cache_block_size";
        pub const MODEL_MIGRATION_LIMIT: &str = "dynamo_frontend_model_migration_limit";
        // Model counters.
        pub const MODEL_MIGRATION_TOTAL: &str = "dynamo_frontend_model_migration_total";
        pub const MODEL_MIGRATION_MAX_SEQ_LEN_EXCEEDED_TOTAL: &str =
            "dynamo_frontend_model_migration_max_seq_len_exceeded_total";
        pub const MODEL_CANCELLATION_TOTAL: &str = "dynamo_frontend_model_cancellation_total";
        pub const MODEL_REJECTION_TOTAL: &str = "dynamo_frontend_model_rejection_total";
        // Per-worker gauges (label `worker_id`).
        pub const WORKER_ACTIVE_DECODE_BLOCKS: &str = "dynamo_frontend_worker_active_decode_blocks";
        pub const WORKER_ACTIVE_PREFILL_TOKENS: &str =
            "dynamo_frontend_worker_active_prefill_tokens";
        pub const WORKER_LAST_TIME_TO_FIRST_TOKEN_SECONDS: &str =
            "dynamo_frontend_worker_last_time_to_first_token_seconds";
        pub const WORKER_LAST_INPUT_SEQUENCE_TOKENS: &str =
            "dynamo_frontend_worker_last_input_sequence_tokens";
        pub const WORKER_LAST_INTER_TOKEN_LATENCY_SECONDS: &str =
            "dynamo_frontend_worker_last_inter_token_latency_seconds";
        pub const ROUTER_QUEUE_PENDING_REQUESTS: &str =
            "dynamo_frontend_router_queue_pending_requests";
        // Frontend performance (label `stage` = preprocess | route | dispatch).
        pub const STAGE_DURATION_SECONDS: &str = "dynamo_frontend_stage_duration_seconds";
        pub const TOKENIZE_SECONDS: &str = "dynamo_frontend_tokenize_seconds";
        pub const TEMPLATE_SECONDS: &str = "dynamo_frontend_template_seconds";
        pub const EVENT_LOOP_DELAY_SECONDS: &str = "dynamo_frontend_event_loop_delay_seconds";
    }

    /// Router-side metrics in the component hierarchy.
    pub mod router {
        pub const REQUESTS_TOTAL: &str = "dynamo_component_router_requests_total";
        pub const TIME_TO_FIRST_TOKEN_SECONDS: &str =
            "dynamo_component_router_time_to_first_token_seconds";
        pub const INTER_TOKEN_LATENCY_SECONDS: &str =
            "dynamo_component_router_inter_token_latency_seconds";
        pub const INPUT_SEQUENCE_TOKENS: &str = "dynamo_component_router_input_sequence_tokens";
        pub const OUTPUT_SEQUENCE_TOKENS: &str = "dynamo_component_router_output_sequence_tokens";
        pub const KV_HIT_RATE: &str = "dynamo_component_router_kv_hit_rate";
        pub const KV_CACHE_EVENTS_APPLIED: &str = "dynamo_component_kv_cache_events_applied";
        /// Event-id gaps seen per worker (label `worker_id`).
        pub const KV_PUBLISHER_ENGINES_DROPPED_EVENTS_TOTAL: &str =
            "dynamo_component_kv_publisher_engines_dropped_events_total";
    }

    /// Router overhead per phase, in milliseconds (frontend only).
    pub mod router_overhead {
        pub const BLOCK_HASHING_MS: &str = "dynamo_router_overhead_block_hashing_ms";
        pub const INDEXER_FIND_MATCHES_MS: &str = "dynamo_router_overhead_indexer_find_matches_ms";
        pub const SEQ_HASHING_MS: &str = "dynamo_router_overhead_seq_hashing_ms";
        pub const SCHEDULING_MS: &str = "dynamo_router_overhead_scheduling_ms";
        pub const TOTAL_MS: &str = "dynamo_router_overhead_total_ms";
    }

    /// Worker / runtime metrics (each worker's status port).
    pub mod component {
        pub const REQUESTS_TOTAL: &str = "dynamo_component_requests_total";
        pub const REQUEST_BYTES_TOTAL: &str = "dynamo_component_request_bytes_total";
        pub const RESPONSE_BYTES_TOTAL: &str = "dynamo_component_response_bytes_total";
        pub const INFLIGHT_REQUESTS: &str = "dynamo_component_inflight_requests";
        pub const REQUEST_DURATION_SECONDS: &str = "dynamo_component_request_duration_seconds";
        /// Label `error_type`.
        pub const ERRORS_TOTAL: &str = "dynamo_component_errors_total";
        pub const CANCELLATION_TOTAL: &str = "dynamo_component_cancellation_total";
        pub const UPTIME_SECONDS: &str = "dynamo_component_uptime_seconds";
        pub const NETWORK_TRANSIT_SECONDS: &str = "dynamo_component_network_transit_seconds";
        pub const TIME_TO_FIRST_RESPONSE_SECONDS: &str =
            "dynamo_component_time_to_first_response_seconds";
        pub const TOTAL_BLOCKS: &str = "dynamo_component_total_blocks";
        pub const GPU_CACHE_USAGE_PERCENT: &str = "dynamo_component_gpu_cache_usage_percent";
        pub const MODEL_LOAD_TIME_SECONDS: &str = "dynamo_component_model_load_time_seconds";
        /// Sequences in the engine's running batch and waiting for it (label `worker_id`).
        pub const RUNNING_REQUESTS: &str = "dynamo_component_running_requests";
        pub const WAITING_REQUESTS: &str = "dynamo_component_waiting_requests";
        // The load report the planner scales on (Dynamo's forward-pass metrics, as gauges
        // labelled `worker_id`).
        /// Prompt tokens not prefilled yet.
        pub const QUEUED_PREFILL_TOKENS: &str = "dynamo_component_queued_prefill_tokens";
        /// KV tokens held by scheduled sequences (referenced blocks × block size).
        pub const SCHEDULED_KV_TOKENS: &str = "dynamo_component_scheduled_kv_tokens";
        /// KV tokens waiting sequences will need.
        pub const QUEUED_KV_TOKENS: &str = "dynamo_component_queued_kv_tokens";
        /// KV tokens the pool holds (blocks × block size).
        pub const KV_CAPACITY_TOKENS: &str = "dynamo_component_kv_capacity_tokens";
        /// Longest sequence the engine takes (`max_seq_len`).
        pub const CONTEXT_LENGTH: &str = "dynamo_component_context_length";
        /// Sequences one step may hold (`max_batch_size`).
        pub const MAX_NUM_SEQS: &str = "dynamo_component_max_num_seqs";
        /// New tokens one step may compute (`max_num_tokens`).
        pub const MAX_NUM_BATCHED_TOKENS: &str = "dynamo_component_max_num_batched_tokens";
    }

    /// TensorRT-LLM passthrough names, kept for the engine's equivalents (labels
    /// `model_name`, `engine_type`, `disaggregation_mode`).
    pub mod trtllm {
        pub const REQUEST_SUCCESS_TOTAL: &str = "trtllm_request_success_total";
        pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "trtllm_time_to_first_token_seconds";
        pub const E2E_REQUEST_LATENCY_SECONDS: &str = "trtllm_e2e_request_latency_seconds";
        pub const TIME_PER_OUTPUT_TOKEN_SECONDS: &str = "trtllm_time_per_output_token_seconds";
        pub const REQUEST_QUEUE_TIME_SECONDS: &str = "trtllm_request_queue_time_seconds";
        pub const NUM_ABORTED_REQUESTS_TOTAL: &str = "trtllm_num_aborted_requests_total";
        pub const KV_TRANSFER_SUCCESS_TOTAL: &str = "trtllm_kv_transfer_success_total";
        pub const KV_TRANSFER_LATENCY_SECONDS: &str = "trtllm_kv_transfer_latency_seconds";
        pub const KV_TRANSFER_BYTES: &str = "trtllm_kv_transfer_bytes";
        pub const KV_TRANSFER_SPEED_GB_S: &str = "trtllm_kv_transfer_speed_gb_s";
    }
}
