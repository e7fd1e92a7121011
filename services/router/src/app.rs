//! The router process: shared state, the HTTP app, and start-up / shutdown.

use std::sync::Arc;
use tandem_pki::ChannelSecurity;
use tandem_runtime::task::restart_forever;

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Extension, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tandem_config::RouterConfig;
use tandem_kv_router::{KvRouter, KvRouterConfig, RouterMode};

use crate::auth::{self, ApiKeys, Caller, Guard};
use crate::error::ApiError;
use crate::handlers;
use crate::limits::CallerLimits;
use crate::models::Registry;
use crate::queue::AdmissionQueue;
use crate::tenancy::Tenant;

#[derive(Clone)]
pub struct AppState {
    pub config: Arc<RouterConfig>,
    pub registry: Arc<Registry>,
    /// The decode side: the workers that serve `Generate` (agg, pd, decode).
    pub kv: Arc<KvRouter>,
    /// The prefill workers' index and load (same config as `kv`).
    pub prefill_kv: Arc<KvRouter>,
    pub dumps: crate::events_nats::DumpsInFlight,
    /// Requests waiting for a worker with room.
    pub queue: Arc<AdmissionQueue>,
    /// The rate limits, per API key when keys are set.
    pub limits: Arc<CallerLimits>,
    /// The API keys of both listeners (none: open).
    pub keys: Arc<ApiKeys>,
    /// How the router's gRPC channels to workers (and etcd, NATS) are secured.
    pub channels: Arc<ChannelSecurity>,
    /// Fetches http(s) image URLs.
    pub fetcher: Arc<crate::media_fetch::Fetcher>,
    /// This router among its replicas (`--router-replica-sync`).
    pub replicas: Option<Arc<crate::replicas::Replicas>>,
}

impl AppState {
    /// The state for `cfg`, with no workers known yet.
    pub fn new(
        cfg: RouterConfig,
        security: ChannelSecurity,
        seed: Option<u64>,
    ) -> anyhow::Result<Self> {
        let kv = Arc::new(KvRouter::new(kv_router_config(&cfg)?, seed));
        let prefill_kv = Arc::new(KvRouter::new(kv_router_config(&cfg)?, seed));
        let a = &cfg.admission;
        let queue = Arc::new(AdmissionQueue::new(
            a.queue_threshold.is_some(),
            a.queue_shortest_first,
            a.queue_max_requests as usize,
        ));
        let keys = Arc::new(ApiKeys::new(cfg.security.api_keys.keys()));
        let fetcher = Arc::new(crate::media::fetcher(&cfg.media)?);
        let replicas = cfg
            .routing
            .replica_sync
            .then(crate::replicas::Replicas::new)
            .transpose()?
            .map(Arc::new);
        Ok(AppState {
            replicas,
            fetcher,
            limits: Arc::new(CallerLimits::new(a, keys.len())),
            keys,
            config: Arc::new(cfg),
            registry: Arc::new(Registry::default()),
            kv,
            prefill_kv,
            dumps: Default::default(),
            queue,
            channels: Arc::new(security),
        })
    }

    /// What `caller` shares the router under: its rate limits and, with
    /// `--cache-salt-per-api-key`, its key's cache salt.
    pub fn tenant(&self, caller: Caller) -> Tenant {
        Tenant {
            limits: self.limits.of(caller).clone(),
            key_digest: self
                .config
                .security
                .cache_salt_per_api_key
                .then(|| self.keys.digest_of(caller))
                .flatten(),
        }
    }

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
        router_queue_threshold: cfg.admission.queue_threshold,
        router_event_threads: 1,
        // A request lives up to its deadline: its load must not be forgotten before (the
        // stream stage frees it at the end; expiry only catches what was lost).
        active_request_expiry_secs: KvRouterConfig::default()
            .active_request_expiry_secs
            .max(u64::from(cfg.request_timeout_secs) + 60),
        ..KvRouterConfig::default()
    };
    kv.validate()?;
    Ok(kv)
}

/// The largest body a route takes: `--http-body-limit-mb`; for chat completions at least
/// `--max-images-per-request` images at `--max-file-size-mb` as base64 `data:` URLs (4/3 of
/// each) and 1 MiB of text, so a request the media limits accept always fits.
pub fn body_limit(cfg: &RouterConfig, chat: bool) -> usize {
    const MIB: usize = 1024 * 1024;
    let configured = cfg.http_body_limit_mb as usize * MIB;
    if !chat {
        return configured;
    }
    let image = (cfg.media.max_file_size_mb as usize * MIB).div_ceil(3) * 4;
    let images = cfg.media.max_images_per_request as usize;
    configured.max(images.saturating_mul(image).saturating_add(MIB))
}

/// The body of a JSON request: `content-type` must say JSON (415), the body must fit
/// [`body_limit`] (413) and arrive within `--http-body-read-timeout-secs` (408).
async fn json_body(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<Bytes, ApiError> {
    check_json_content_type(headers)?;
    let secs = state.config.http.body_read_timeout_secs;
    let read = Limited::new(body, limit).collect();
    match tokio::time::timeout(Duration::from_secs(secs.into()), read).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!(
                "request body too large: over {limit} bytes (--http-body-limit-mb; chat \
                 completions take --max-images-per-request images of --max-file-size-mb)"
            ),
        )),
        Ok(Err(e)) => Err(ApiError::bad_request(
            format!("cannot read the request body: {e}"),
            None,
        )),
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!(
                "the request body did not arrive within {secs} s (--http-body-read-timeout-secs)"
            ),
        )),
    }
}

/// `application/json`, or another JSON media type (`application/*+json`), any parameters.
fn check_json_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let value = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let media = value.split(';').next().unwrap_or_default().trim();
    let media = media.to_ascii_lowercase();
    if media == "application/json"
        || (media.starts_with("application/") && media.ends_with("+json"))
    {
        return Ok(());
    }
    let got = if value.is_empty() {
        "none".to_string()
    } else {
        format!("`{value}`")
    };
    Err(ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "invalid_request_error",
        format!("the body must be JSON with `content-type: application/json` (got {got})"),
    ))
}

/// The caller `auth::require_key` let through (the shared one when keys are off).
fn caller_of(caller: Option<Extension<Caller>>) -> Caller {
    caller.map(|Extension(c)| c).unwrap_or_default()
}

async fn chat(
    state: State<AppState>,
    caller: Option<Extension<Caller>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let limit = body_limit(&state.config, true);
    match json_body(&state, &headers, body, limit).await {
        Ok(b) => handlers::chat_completions(state, caller_of(caller), headers, b).await,
        Err(e) => handlers::refused_early(e, &headers, "chat_completions"),
    }
}

async fn completions(
    state: State<AppState>,
    caller: Option<Extension<Caller>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let limit = body_limit(&state.config, false);
    match json_body(&state, &headers, body, limit).await {
        Ok(b) => handlers::completions(state, caller_of(caller), headers, b).await,
        Err(e) => handlers::refused_early(e, &headers, "completions"),
    }
}

async fn not_found() -> Response {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route").into_response()
}

/// The public port: the OpenAI API, `/metrics`, and the probes `/health` and `/live`. With
/// API keys, everything but the probes needs a key (unknown paths included, so nothing is
/// learnt without one). `/debug/*` is not here: see [`admin_app`].
pub fn app(state: AppState, metrics: metrics_exporter_prometheus::PrometheusHandle) -> Router {
    let min_workers = state.config.routing.router_min_initial_workers.max(1) as usize;
    let registry = state.registry.clone();
    let status = tandem_runtime::metrics::status_router(
        metrics,
        Arc::new(move || registry.worker_count() >= min_workers),
    );
    let guard = Guard {
        keys: state.keys.clone(),
        listener: "public",
        open_paths: auth::OPEN_PATHS,
    };
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(handlers::list_models))
        .with_state(state)
        .merge(status)
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(guard, auth::require_key))
}

/// The admin listener (`--admin-port`): `/debug/kv_index`, behind the same API keys.
pub fn admin_app(state: AppState) -> Router {
    let guard = Guard {
        keys: state.keys.clone(),
        listener: "admin",
        open_paths: &[],
    };
    Router::new()
        .route("/debug/kv_index", get(handlers::debug_kv_index))
        .with_state(state)
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(guard, auth::require_key))
}

/// Runs the router until SIGTERM / SIGINT.
pub async fn run(cfg: RouterConfig) -> anyhow::Result<()> {
    // Bad TLS files stop the router before it connects to anything.
    let tls = cfg
        .security
        .tls
        .as_ref()
        .map(crate::tls::acceptor)
        .transpose()?;
    let metrics = tandem_runtime::metrics::install_recorder()?;
    let shutdown = tandem_runtime::shutdown::on_signals();
    let tls_dir = cfg.runtime.internal_tls()?;
    let security = ChannelSecurity::from_dir(tls_dir)?;
    let state = AppState::new(cfg, security, None)?;
    state.queue.spawn_ticker();
    if state.config.routing.use_kv_events
        && state.config.runtime.event_plane == tandem_config::runtime::EventPlane::Nats
    {
        let st = state.clone();
        let dumps = state.dumps.clone();
        tokio::spawn(restart_forever("the NATS KV-event follower", move || {
            crate::events_nats::run(st.clone(), dumps.clone())
        }));
    }
    let discovery = tandem_runtime::discovery::connect(
        &tandem_runtime::discovery::DiscoveryOptions::from_config(&state.config.runtime)
            .with_security(&state.channels),
    )
    .await?;
    let replica_registration = match &state.replicas {
        Some(r) => Some(crate::replicas::start(&state, r.clone(), &discovery).await?),
        None => None,
    };
    tokio::spawn({
        let state = state.clone();
        restart_forever("the discovery watcher", move || {
            crate::watcher::run(state.clone(), discovery.clone())
        })
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
    let listeners = bind(&state.config, tls).await?;
    let http = state.config.http.clone();
    let public = crate::server::serve(
        listeners.public,
        app(state.clone(), metrics),
        &http,
        listeners.tls,
        shutdown.clone(),
    );
    match listeners.admin {
        None => public.await,
        Some(admin) => {
            let admin =
                crate::server::serve(admin, admin_app(state), &http, None, shutdown.clone());
            tokio::join!(public, admin);
        }
    }
    if let Some(r) = replica_registration {
        // Peers drop this router's load now rather than when its lease runs out.
        if let Err(e) = r.deregister().await {
            tracing::warn!("leaving the router replicas: {e}");
        }
    }
    Ok(())
}

/// The listeners of a router, bound.
struct Listeners {
    public: tokio::net::TcpListener,
    /// `--tls-cert-path`: the public port speaks HTTPS.
    tls: Option<tokio_rustls::TlsAcceptor>,
    admin: Option<tokio::net::TcpListener>,
}

/// Binds the public port and the admin listener, and prints the READY
/// line: `TANDEM_ROUTER_READY http=ADDR [admin=ADDR] [tls=on]`.
async fn bind(
    cfg: &RouterConfig,
    tls: Option<tokio_rustls::TlsAcceptor>,
) -> anyhow::Result<Listeners> {
    let sec = &cfg.security;
    let bind = format!("{}:{}", cfg.http_host, cfg.http_port);
    let public = tokio::net::TcpListener::bind(&bind).await.map_err(|e| {
        anyhow::anyhow!("cannot bind the HTTP API on {bind} (--http-host/--http-port): {e}")
    })?;
    let addr = public.local_addr()?;
    let mut ready = format!("TANDEM_ROUTER_READY http={addr}");
    let admin = match &sec.admin {
        None => None,
        Some(a) => {
            let bind = format!("{}:{}", a.host, a.port);
            let l = tokio::net::TcpListener::bind(&bind).await.map_err(|e| {
                anyhow::anyhow!(
                    "cannot bind the admin listener on {bind} (--admin-host/--admin-port): {e}"
                )
            })?;
            let admin_addr = l.local_addr()?;
            ready.push_str(&format!(" admin={admin_addr}"));
            tracing::info!(%admin_addr, "admin listener (/debug/*)");
            Some(l)
        }
    };
    if tls.is_some() {
        ready.push_str(" tls=on");
    }
    if sec.api_keys.is_empty() {
        tracing::warn!(
            "no API key (--api-key, --api-key-file): the API is open to anyone who reaches it"
        );
    } else {
        tracing::info!(keys = sec.api_keys.len(), "API keys required");
    }
    println!("{ready}");
    tracing::info!(%addr, tls = tls.is_some(), "router listening");
    Ok(Listeners { public, tls, admin })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(args: &[&str]) -> RouterConfig {
        let mut all = vec!["tandem-router".to_string()];
        all.extend(args.iter().map(|a| a.to_string()));
        tandem_config::parse_router(&all, &|_| None).expect("config")
    }

    #[test]
    fn chat_bodies_fit_every_image_at_the_size_cap() {
        const MIB: usize = 1024 * 1024;
        // Defaults: 32 MiB bodies, 4 images of 50 MiB: 4 x 4/3 x 50 MiB + 1 MiB.
        let c = config(&[]);
        assert_eq!(body_limit(&c, false), 32 * MIB);
        assert_eq!(body_limit(&c, true), 4 * (50 * MIB).div_ceil(3) * 4 + MIB);
        let c = config(&["--max-images-per-request", "1"]);
        assert_eq!(body_limit(&c, true), (50 * MIB).div_ceil(3) * 4 + MIB);
        // A larger configured limit wins; small images leave it alone.
        let c = config(&["--http-body-limit-mb", "200", "--max-file-size-mb", "1"]);
        assert_eq!(body_limit(&c, true), 200 * MIB);
        let c = config(&["--max-file-size-mb", "1"]);
        assert_eq!(body_limit(&c, true), 32 * MIB);
    }

    #[test]
    fn load_tracking_outlives_the_request_deadline() {
        let expiry = |args: &[&str]| {
            kv_router_config(&config(args))
                .expect("kv config")
                .active_request_expiry_secs
        };
        // The default deadline is 600 s: a request's load is kept at least 660 s.
        assert_eq!(expiry(&[]), 660);
        assert_eq!(expiry(&["--request-timeout-secs", "30"]), 300);
        assert_eq!(expiry(&["--request-timeout-secs", "3600"]), 3660);
    }
}
