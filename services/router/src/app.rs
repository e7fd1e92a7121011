//! The router process: shared state, the HTTP app, and start-up / shutdown.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::Router;
use tandem_config::RouterConfig;
use tandem_kv_router::{KvRouter, KvRouterConfig, RouterMode};

use crate::error::ApiError;
use crate::handlers;
use crate::models::Registry;

#[derive(Clone)]
pub struct AppState {
    pub config: Arc<RouterConfig>,
    pub registry: Arc<Registry>,
    /// The decode side: the workers that serve `Generate` (agg, pd, decode).
    pub kv: Arc<KvRouter>,
    /// The prefill workers' index and load (same config as `kv`).
    pub prefill_kv: Arc<KvRouter>,
    pub dumps: crate::events_nats::DumpsInFlight,
}

impl AppState {
    /// The KV router that follows worker `id`: `prefill_kv` for a prefill worker, else `kv`.
    pub fn kv_of(&self, id: u64) -> &Arc<KvRouter> {
        if self.registry.is_prefill_worker(id) == Some(true) {
            &self.prefill_kv
        } else {
            &self.kv
        }
    }
}

pub fn kv_router_config(cfg: &RouterConfig) -> anyhow::Result<KvRouterConfig> {
    let r = &cfg.routing;
    let kv = KvRouterConfig {
        router_mode: r.router_mode.parse::<RouterMode>()?,
        overlap_score_weight: r.overlap_score_weight,
        router_temperature: r.router_temperature,
        use_kv_events: r.use_kv_events,
        router_track_active_blocks: r.track_active_blocks,
        router_assume_kv_reuse: r.assume_kv_reuse,
        router_track_prefill_tokens: r.track_prefill_tokens,
        active_decode_blocks_threshold: Some(r.active_decode_blocks_threshold),
        active_prefill_tokens_threshold: Some(r.active_prefill_tokens_threshold.into()),
        active_prefill_tokens_threshold_frac: Some(r.active_prefill_tokens_threshold_frac),
        router_ttl_secs: r.router_ttl_secs,
        router_max_tree_size: r.router_max_tree_size as usize,
        router_prune_target_ratio: r.router_prune_target_ratio,
        // Tandem has no request queue yet (the flag refuses other values): busy means 503.
        router_queue_threshold: None,
        router_event_threads: 1,
        ..KvRouterConfig::default()
    };
    kv.validate()?;
    Ok(kv)
}

/// Bodies over the limit get an OpenAI-style 413, not axum's plain text.
fn body_or_error(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        let status = rejection.status();
        let err = if status == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError {
                status,
                kind: "invalid_request_error",
                message: "request body too large (see --http-body-limit-mb)".into(),
                param: None,
            }
        } else {
            ApiError::bad_request(format!("cannot read the request body: {rejection}"), None)
        };
        err
    })
}

async fn chat(
    state: State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match body_or_error(body) {
        Ok(b) => handlers::chat_completions(state, headers, b).await,
        Err(e) => e.into_response(),
    }
}

async fn completions(
    state: State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match body_or_error(body) {
        Ok(b) => handlers::completions(state, headers, b).await,
        Err(e) => e.into_response(),
    }
}

async fn not_found() -> Response {
    ApiError {
        status: StatusCode::NOT_FOUND,
        kind: "not_found",
        message: "no such route".into(),
        param: None,
    }
    .into_response()
}

pub fn app(state: AppState, metrics: metrics_exporter_prometheus::PrometheusHandle) -> Router {
    let limit = state.config.http_body_limit_mb as usize * 1024 * 1024;
    let min_workers = state.config.routing.router_min_initial_workers.max(1) as usize;
    let registry = state.registry.clone();
    let status = tandem_runtime::metrics::status_router(
        metrics,
        Arc::new(move || registry.worker_count() >= min_workers),
    );
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(handlers::list_models))
        .route("/debug/kv_index", get(handlers::debug_kv_index))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
        .merge(status)
        .fallback(not_found)
}

/// Runs the router until SIGTERM / SIGINT.
pub async fn run(cfg: RouterConfig) -> anyhow::Result<()> {
    let metrics = tandem_runtime::metrics::install_recorder()?;
    let shutdown = tandem_runtime::shutdown::on_signals();
    let kv = Arc::new(KvRouter::new(kv_router_config(&cfg)?, None));
    let prefill_kv = Arc::new(KvRouter::new(kv_router_config(&cfg)?, None));
    let state = AppState {
        config: Arc::new(cfg),
        registry: Arc::new(Registry::default()),
        kv,
        prefill_kv,
        dumps: Default::default(),
    };
    if state.config.routing.use_kv_events
        && state.config.runtime.event_plane == tandem_config::runtime::EventPlane::Nats
    {
        let st = state.clone();
        let dumps = state.dumps.clone();
        tokio::spawn(async move {
            if let Err(e) = crate::events_nats::run(st, dumps).await {
                tracing::error!("KV events over NATS stopped: {e:#}");
            }
        });
    }
    let discovery = tandem_runtime::discovery::connect(
        &tandem_runtime::discovery::DiscoveryOptions::from_config(&state.config.runtime),
    )
    .await?;
    tokio::spawn({
        let state = state.clone();
        async move {
            if let Err(e) = crate::watcher::run(state, discovery).await {
                tracing::error!("discovery watcher stopped: {e:#}");
            }
        }
    });
    tokio::spawn({
        // Requests whose stream was lost without a Free are expired here.
        let kv = state.kv.clone();
        let prefill_kv = state.prefill_kv.clone();
        async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(30));
            loop {
                tick.tick().await;
                kv.expire_stale();
                prefill_kv.expire_stale();
            }
        }
    });
    let bind = format!("{}:{}", state.config.http_host, state.config.http_port);
    let listener = tokio::net::TcpListener::bind(&bind).await.map_err(|e| {
        anyhow::anyhow!("cannot bind the HTTP API on {bind} (--http-host/--http-port): {e}")
    })?;
    let addr = listener.local_addr()?;
    // The first token of a kept-alive stream must not wait for Nagle's algorithm.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    println!("TANDEM_ROUTER_READY http={addr}");
    tracing::info!(%addr, "router listening");
    axum::serve(listener, app(state, metrics))
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await?;
    Ok(())
}
