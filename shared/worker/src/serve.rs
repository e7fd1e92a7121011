//! The life of a worker process: build the engine, open the gRPC and status listeners,
//! register in discovery, serve, and on SIGTERM deregister first, drain, then exit.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tandem_pki::ChannelSecurity;
use tandem_runtime::events::EventSigner;

use anyhow::Context;
use tandem_config::runtime::EventPlane;
use tandem_config::WorkerConfig;
use tandem_protocol::worker::worker_server::WorkerServer;
use tandem_protocol::ModelCard;
use tandem_runtime::discovery::{self, DiscoveryOptions, Instance};
use tandem_runtime::net::advertised_addr;

use crate::card::model_card;
use crate::decode::DecodeSide;
use crate::encode::client::{RemoteEncoder, RemoteEncoderConfig};
use crate::grpc::{ModelFilesSource, WorkerService};
use crate::media::MediaEncoder;
use crate::prefill::PrefillSide;
use crate::transport::KvWriter;
use crate::BuiltEngine;
use tandem_config::DisaggregationMode;
use tandem_kv_transfer::AnyTransport;

pub fn discovery_options(
    rt: &tandem_config::RuntimeConfig,
    security: &ChannelSecurity,
) -> DiscoveryOptions {
    DiscoveryOptions::from_config(rt).with_security(security)
}

/// Builds the engine a worker serves: [`crate::engine_setup::build_engine_on`] for the real
/// one; the mocker passes its own (same engine, simulated backend). Decode workers of
/// disaggregated serving get the KV transport, to allocate their pool through it.
pub type EngineBuilder =
    Box<dyn FnOnce(&WorkerConfig, Option<Arc<AnyTransport>>) -> anyhow::Result<BuiltEngine> + Send>;

/// Runs a worker until SIGTERM / SIGINT, then drains.
pub async fn run(cfg: WorkerConfig) -> anyhow::Result<()> {
    let shutdown = tandem_runtime::shutdown::on_signals();
    run_with(
        cfg,
        Box::new(crate::engine_setup::build_engine_on),
        shutdown,
    )
    .await
}

/// How the KV blocks of disaggregated serving move between workers.
#[derive(Clone)]
pub enum KvTransfer {
    /// Through the transport the config names, into transport-registered pool memory.
    Transport,
    /// Not at all: a prefill worker's writes take simulated time on this link, and a decode
    /// worker's engine builder supplies a [`crate::transport::simulated_region`] as its
    /// `kv_region` (the mocker's simulated engines). Leases, fencing, the first-token handoff
    /// and activation are the same code as with a transport.
    Simulated(Arc<crate::transport::SimulatedLink>),
}

/// Like [`run`] with the engine from `build` and an outside shutdown token, so that one
/// process can host several workers (each its own instance id, listeners and registration).
pub async fn run_with(
    cfg: WorkerConfig,
    build: EngineBuilder,
    shutdown: tandem_runtime::shutdown::ShutdownToken,
) -> anyhow::Result<()> {
    run_with_transfer(cfg, build, shutdown, KvTransfer::Transport).await
}

/// The gRPC service over the engine, its disaggregation sides and, for a model that takes
/// images, where its embeddings come from (shared with the prefill side, which encodes in
/// EP/D or asks encode workers in E/P/D).
fn worker_service(
    built: &BuiltEngine,
    sides: &DisaggSides,
    media: Option<Arc<MediaEncoder>>,
) -> WorkerService {
    if let (Some(prefill), Some(m)) = (&sides.prefill, &media) {
        prefill.set_media(m.clone());
    }
    WorkerService::new(
        built.engine.clone(),
        ModelFilesSource {
            folder: built.model.path.clone(),
            tokenizer_hash: built.model.tokenizer_hash.clone(),
            // The template served (the model's own, or --custom-jinja-template's), which
            // the tokenizer hash covers.
            chat_template: built
                .model
                .chat_template
                .as_ref()
                .map(|t| t.source().to_string()),
        },
    )
    .with_decode(sides.decode.clone())
    .with_prefill(sides.prefill.clone())
    .with_media(media)
}

/// What a worker needs to reach encode workers.
struct MediaSetup<'a> {
    instance_id: u64,
    transport: Option<&'a Arc<AnyTransport>>,
    security: &'a ChannelSecurity,
}

/// Where this worker's image embeddings come from: none for a text model or without
/// `--enable-multimodal`; the encode workers of `--encode-endpoint`; else its own tower.
async fn media_encoder(
    cfg: &WorkerConfig,
    built: &BuiltEngine,
    with: MediaSetup<'_>,
) -> anyhow::Result<Option<Arc<MediaEncoder>>> {
    let enabled = cfg.disaggregation.enable_multimodal;
    let Some(vision) = built.model.config.vision.clone() else {
        anyhow::ensure!(
            !enabled,
            "--enable-multimodal: model {} is not multimodal (its config.json names no vision \
             tower)",
            built.model.path.display()
        );
        return Ok(None);
    };
    if !enabled {
        tracing::warn!(
            "the model takes images but --enable-multimodal is off: image inputs are refused"
        );
        return Ok(None);
    }
    let Some(endpoint) = cfg.disaggregation.encode_endpoint.clone() else {
        let device = crate::engine_setup::choose_device(cfg.model.device)?;
        return Ok(MediaEncoder::for_model(&built.model, device)?.map(Arc::new));
    };
    let transport = with
        .transport
        .context("--encode-endpoint needs the transfer layer, which did not open")?
        .clone();
    let store = discovery::connect(&discovery_options(&cfg.runtime, with.security)).await?;
    let row_bytes = vision.tokens_per_image() * vision.text_hidden_size * 4;
    let client = RemoteEncoder::new(RemoteEncoderConfig {
        endpoint,
        store,
        security: with.security.clone(),
        transport,
        instance_id: with.instance_id,
        model_id: built.model.model_id.clone(),
        row_bytes,
        timeout: Duration::from_secs(cfg.disaggregation.kv_lease_ttl_secs.max(1).into()),
    });
    let m = MediaEncoder::remote(vision, Arc::new(client));
    tracing::info!(encode_endpoint = %m.source(), "images are encoded by encode workers");
    Ok(Some(Arc::new(m)))
}

/// Like [`run_with`], with the KV blocks of disaggregated serving moved as `kv` says.
pub async fn run_with_transfer(
    cfg: WorkerConfig,
    build: EngineBuilder,
    shutdown: tandem_runtime::shutdown::ShutdownToken,
    kv: KvTransfer,
) -> anyhow::Result<()> {
    // Idempotent: every worker of a process shares the one recorder.
    let metrics_handle = tandem_runtime::metrics::install_recorder()?;
    let cfg = Arc::new(cfg);
    let security = ChannelSecurity::from_dir(cfg.runtime.internal_tls()?)?;
    let (built, transport) = start_engine(&cfg, build, &kv).await?;
    let instance_id = discovery::new_instance_id();
    // Signs the KV events this worker publishes on NATS; the public half goes in its card.
    let signer = Arc::new(EventSigner::generate()?);
    let sides = DisaggSides::new(&cfg, &built, instance_id, transport, kv, &security)?;
    // A decode side dials only the prefill workers discovery lists in its namespace.
    if let Some(decode) = &sides.decode {
        let store = discovery::connect(&discovery_options(&cfg.runtime, &security)).await?;
        decode.set_known_prefills(crate::known_prefills::KnownPrefills::new(
            store,
            cfg.endpoint().namespace.clone(),
        ));
    }
    let (listener, grpc_addr) = bind_grpc(&cfg).await?;
    let media = MediaSetup {
        instance_id,
        transport: sides.transport.as_ref(),
        security: &security,
    };
    let service = worker_service(&built, &sides, media_encoder(&cfg, &built, media).await?);
    let accepting = service.accepting_flag();
    let health_flag = accepting.clone();
    let health_engine = built.engine.clone();
    // Healthy while accepting work and while the engine thread runs: a dead engine fails
    // `/health` at once.
    let health = Arc::new(move || health_flag.load(Ordering::SeqCst) && health_engine.is_running());
    let http_addr = serve_status(&cfg, metrics_handle, health, &shutdown).await?;
    let mut card = model_card(&cfg, &built, instance_id, grpc_addr, http_addr);
    card.kv_event_key = signer.public_key_hex();
    let registration = register(&cfg, &card, &security).await?;
    let publishing = Publishing {
        security: &security,
        signer: &signer,
    };
    start_publishing(&cfg, &built, instance_id, &shutdown, publishing).await?;
    announce_ready(&cfg, &card);
    let routes = tonic::service::Routes::new(
        WorkerServer::new(service)
            .max_decoding_message_size(tandem_protocol::MAX_GRPC_MESSAGE_BYTES)
            .max_encoding_message_size(tandem_protocol::MAX_GRPC_MESSAGE_BYTES),
    );
    let (server_shutdown, server) = spawn_server(routes, listener, &security)?;

    tokio::select! {
        _ = shutdown.cancelled() => {}
        _ = built.engine.stopped() => {
            return engine_died(&accepting, registration, server_shutdown, server).await;
        }
    }
    tracing::info!("shutting down: deregistering, then draining in-flight requests");
    accepting.store(false, Ordering::SeqCst);
    if let Err(e) = registration.deregister().await {
        tracing::warn!("deregistration failed (the entry will expire by TTL): {e}");
    }
    let deregistered = Instant::now();
    drain(&cfg, &built, &sides, deregistered).await;
    server_shutdown.trigger();
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    built.engine.shutdown();
    // Everything that uses the transport (connections, the engine's registered pool) goes
    // before it.
    let DisaggSides {
        decode,
        prefill,
        transport,
    } = sides;
    drop((decode, prefill));
    drop(built);
    drop(transport);
    tracing::info!("worker stopped");
    Ok(())
}

/// The engine thread ended while the worker serves (a panic outside one request's work, or
/// an engine that stopped on its own): stop accepting (`/health` already fails, as the
/// engine is not running), leave discovery at once so routers stop sending work here, stop
/// the gRPC server and return an error, so the process exits non-zero and its supervisor
/// (the launcher, Kubernetes) can restart it. Requests in flight already ended with
/// `UNAVAILABLE`.
async fn engine_died(
    accepting: &std::sync::atomic::AtomicBool,
    registration: tandem_runtime::discovery::Registration,
    server_shutdown: tandem_runtime::shutdown::Shutdown,
    server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
) -> anyhow::Result<()> {
    accepting.store(false, Ordering::SeqCst);
    tracing::error!("the engine thread stopped unexpectedly; deregistering and exiting");
    if let Err(e) = registration.deregister().await {
        tracing::warn!("deregistration failed (the entry will expire by TTL): {e}");
    }
    // Graceful: the streams in flight deliver their UNAVAILABLE first.
    server_shutdown.trigger();
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    anyhow::bail!("the engine thread stopped unexpectedly; the worker deregistered and exits")
}

/// Opens the KV transport a disaggregated role needs and builds the engine (its pool
/// allocated through the transport on decode workers).
async fn start_engine(
    cfg: &Arc<WorkerConfig>,
    build: EngineBuilder,
    kv: &KvTransfer,
) -> anyhow::Result<(BuiltEngine, Option<Arc<AnyTransport>>)> {
    let mode = cfg.disaggregation.disaggregation_mode;
    // Encode workers write image embeddings through it too (`--encode-endpoint`).
    let encode_client = cfg.disaggregation.encode_endpoint.is_some();
    let transport = match (mode, kv) {
        (
            DisaggregationMode::Pd | DisaggregationMode::Decode | DisaggregationMode::Prefill,
            KvTransfer::Transport,
        ) => Some(crate::transport::open(cfg).await?),
        _ if encode_client => Some(crate::transport::open(cfg).await?),
        _ => None,
    };
    let build_cfg = cfg.clone();
    let pool_transport = match mode {
        DisaggregationMode::Pd | DisaggregationMode::Decode => transport.clone(),
        _ => None,
    };
    let built = tokio::task::spawn_blocking(move || build(&build_cfg, pool_transport))
        .await
        .context("engine start-up task failed")??;
    Ok((built, transport))
}

/// The decode or prefill side of disaggregated serving this worker's mode runs, if any, and
/// the KV transport they use.
struct DisaggSides {
    decode: Option<Arc<DecodeSide>>,
    prefill: Option<Arc<PrefillSide>>,
    /// Open for as long as the worker runs: prefill workers reach a decode worker's pool
    /// through its listener.
    transport: Option<Arc<AnyTransport>>,
}

impl DisaggSides {
    fn new(
        cfg: &WorkerConfig,
        built: &BuiltEngine,
        instance_id: u64,
        transport: Option<Arc<AnyTransport>>,
        kv: KvTransfer,
        security: &ChannelSecurity,
    ) -> anyhow::Result<Self> {
        let mode = cfg.disaggregation.disaggregation_mode;
        let layout_id = crate::card::layout_id(built.engine.layout());
        let decode = match mode {
            DisaggregationMode::Pd | DisaggregationMode::Decode => {
                let region = built.kv_region.clone().context(
                    "this engine's KV pool is not in transport-registered memory (nor a \
                     simulated region), so it cannot serve --disaggregation-mode pd/decode",
                )?;
                Some(Arc::new(DecodeSide::new(
                    built.engine.clone(),
                    instance_id,
                    layout_id.clone(),
                    region,
                    crate::decode::LeaseTimes {
                        ttl: Duration::from_secs(cfg.disaggregation.kv_lease_ttl_secs.into()),
                        reclaim_margin: Duration::from_secs(
                            cfg.disaggregation.kv_lease_reclaim_margin_secs.into(),
                        ),
                    },
                    security.clone(),
                )))
            }
            _ => None,
        };
        let writer = match (mode, &transport, kv) {
            (DisaggregationMode::Prefill, Some(t), _) => Some(KvWriter::Transport(t.clone())),
            (DisaggregationMode::Prefill, None, KvTransfer::Simulated(link)) => {
                Some(KvWriter::Simulated(link))
            }
            _ => None,
        };
        let prefill = writer.map(|writer| {
            Arc::new(
                PrefillSide::with_writer(built.engine.clone(), writer, layout_id)
                    .with_layer_groups(cfg.disaggregation.kv_transfer_layer_groups as usize)
                    .with_first_token_early(cfg.disaggregation.first_token_before_kv_writes),
            )
        });
        Ok(DisaggSides {
            decode,
            prefill,
            transport,
        })
    }

    /// Leases in flight (decode) or writes in flight (prefill).
    fn handoffs(&self) -> bool {
        self.decode
            .as_ref()
            .map(|d| !d.leases.is_empty())
            .unwrap_or(false)
            || self
                .prefill
                .as_ref()
                .map(|p| p.active() > 0)
                .unwrap_or(false)
    }
}

/// Binds the gRPC listener; returns it and the address to advertise.
pub(crate) async fn bind_grpc(
    cfg: &WorkerConfig,
) -> anyhow::Result<(tokio::net::TcpListener, String)> {
    let rpc_bind = format!("{}:{}", cfg.network.rpc_host, cfg.network.rpc_port);
    let listener = tokio::net::TcpListener::bind(&rpc_bind)
        .await
        .with_context(|| {
            format!("cannot bind the gRPC listener on {rpc_bind} (--rpc-host/--rpc-port)")
        })?;
    let rpc_bound = listener.local_addr()?;
    let grpc_addr = advertised_addr(rpc_bound, cfg.network.rpc_advertise_host.as_deref())?;
    Ok((listener, grpc_addr))
}

/// Starts the status server (`/health` as `health` says, `/metrics`) on `--system-host` /
/// `--system-port`; returns its advertised address.
pub(crate) async fn serve_status(
    cfg: &WorkerConfig,
    metrics: tandem_runtime::metrics::StatusMetrics,
    health: tandem_runtime::metrics::HealthFn,
    shutdown: &tandem_runtime::shutdown::ShutdownToken,
) -> anyhow::Result<String> {
    let status_bind = format!("{}:{}", cfg.network.system_host, cfg.network.system_port);
    let status_bound = tandem_runtime::metrics::serve_status_until(
        &status_bind,
        metrics,
        health,
        shutdown.clone(),
    )
    .await
    .with_context(|| {
        format!("cannot bind the status server on {status_bind} (--system-host/--system-port)")
    })?;
    Ok(advertised_addr(
        status_bound,
        cfg.network.rpc_advertise_host.as_deref(),
    )?)
}

/// Publishes the worker and its model card in discovery.
pub(crate) async fn register(
    cfg: &WorkerConfig,
    card: &ModelCard,
    security: &ChannelSecurity,
) -> anyhow::Result<tandem_runtime::discovery::Registration> {
    let endpoint = cfg.endpoint();
    let store = discovery::connect(&discovery_options(&cfg.runtime, security)).await?;
    store
        .register(
            Instance {
                namespace: endpoint.namespace.clone(),
                component: endpoint.component.clone(),
                endpoint: endpoint.endpoint.clone(),
                instance_id: card.instance_id,
                grpc_addr: card.grpc_addr.clone(),
                http_addr: Some(card.http_addr.clone()),
                role: card.role.as_str().into(),
            },
            serde_json::to_value(card)?,
        )
        .await
        .context("cannot register in discovery")
}

/// What publishing events needs beside the config: the channels' security and the signing key.
struct Publishing<'a> {
    security: &'a ChannelSecurity,
    signer: &'a Arc<EventSigner>,
}

/// Starts the KV event publisher on NATS (with `--event-plane nats`) and the engine gauges.
async fn start_publishing(
    cfg: &WorkerConfig,
    built: &BuiltEngine,
    instance_id: u64,
    shutdown: &tandem_runtime::shutdown::ShutdownToken,
    with: Publishing<'_>,
) -> anyhow::Result<()> {
    if cfg.runtime.event_plane == EventPlane::Nats {
        let endpoint = cfg.endpoint();
        let engine = built.engine.clone();
        let signer = with.signer.clone();
        crate::nats::spawn_publisher(cfg, &endpoint, instance_id, engine, with.security, signer)
            .await?;
    }
    crate::stats::spawn_gauges(built.engine.clone(), instance_id, shutdown.clone());
    Ok(())
}

/// One line on stdout that launchers and tests wait for instead of sleeping.
pub(crate) fn announce_ready(cfg: &WorkerConfig, card: &ModelCard) {
    println!(
        "TANDEM_WORKER_READY instance_id={} grpc={} http={} model={}",
        card.instance_id, card.grpc_addr, card.http_addr, card.served_model_name
    );
    tracing::info!(
        grpc_addr = %card.grpc_addr,
        http_addr = %card.http_addr,
        instance_id = card.instance_id,
        endpoint = %cfg.endpoint(),
        "worker ready"
    );
}

/// Serves the gRPC services `routes` on `listener` until the returned trigger fires.
pub(crate) fn spawn_server(
    routes: tonic::service::Routes,
    listener: tokio::net::TcpListener,
    security: &ChannelSecurity,
) -> anyhow::Result<(
    tandem_runtime::shutdown::Shutdown,
    tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
)> {
    let (server_shutdown, server_token) = tandem_runtime::shutdown::channel();
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = security.server_tls() {
        builder = builder
            .tls_config(tls)
            .context("cannot use the internal TLS certificate for the gRPC server")?;
    }
    let server = tokio::spawn(
        builder
            .tcp_nodelay(true)
            .add_routes(routes)
            .serve_with_incoming_shutdown(
                // Accepted streams need TCP_NODELAY themselves (the builder's setting only
                // applies to listeners tonic binds): without it each streamed token after the
                // first waits for the peer's delayed ACK (~40 ms).
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                async move { server_token.cancelled().await },
            ),
    );
    Ok((server_shutdown, server))
}

/// How long a draining worker keeps its server up after deregistering, refusing new requests
/// with UNAVAILABLE (which routers retry on another worker): routers learn of the
/// deregistration through their discovery watch, and a request one of them sent before that
/// must meet a refusal, not a connection closing under it (a compose scale-down under load lost
/// one request in 199 that way).
const DEREGISTRATION_GRACE: Duration = Duration::from_secs(1);

/// Waits until the engine has no request left and no hand-off is in flight (nothing may be
/// left writing into a pool that goes away) and [`DEREGISTRATION_GRACE`] has passed since
/// `deregistered`, or the drain deadline passes.
async fn drain(
    cfg: &WorkerConfig,
    built: &BuiltEngine,
    sides: &DisaggSides,
    deregistered: Instant,
) {
    let deadline = Instant::now() + Duration::from_secs(cfg.runtime.drain_timeout_secs.into());
    let grace_ends = deregistered + DEREGISTRATION_GRACE;
    loop {
        let handoffs = sides.handoffs();
        let Ok(s) = built.engine.stats().await else {
            break;
        };
        let idle = s.running + s.waiting == 0 && !handoffs;
        let now = Instant::now();
        if idle && now >= grace_ends {
            break;
        }
        if now >= deadline {
            if !idle {
                tracing::warn!(
                    running = s.running,
                    waiting = s.waiting,
                    "drain deadline passed; aborting the rest"
                );
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
