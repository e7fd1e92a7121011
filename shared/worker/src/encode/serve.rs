//! The life of an encode worker process: load the vision tower, open the transfer layer and
//! the gRPC and status listeners, register in discovery (role `encode`), serve, and on
//! SIGTERM deregister first, drain the writes in flight, then exit.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tandem_config::WorkerConfig;
use tandem_pki::ChannelSecurity;
use tandem_protocol::worker::encoder_server::EncoderServer;
use tandem_protocol::{ModelCard, MultimodalCard, WorkerRole, WORKER_PROTOCOL_VERSION};
use tandem_runtime::discovery;

use super::cache::EmbeddingCache;
use super::{EncodeParts, EncodeService, EncoderGrpc};
use crate::media::{ImagePrep, MAX_IMAGES_PER_REQUEST};
use crate::serve::{announce_ready, bind_grpc, register, serve_status, spawn_server};

/// Images per tower run at most.
pub const MAX_BATCH_IMAGES: usize = 32;

/// Runs an encode worker until SIGTERM / SIGINT, then drains.
pub async fn run(cfg: WorkerConfig) -> anyhow::Result<()> {
    run_with(cfg, tandem_runtime::shutdown::on_signals()).await
}

/// Like [`run`] with an outside shutdown token.
pub async fn run_with(
    cfg: WorkerConfig,
    shutdown: tandem_runtime::shutdown::ShutdownToken,
) -> anyhow::Result<()> {
    let metrics_handle = tandem_runtime::metrics::install_recorder()?;
    let security = ChannelSecurity::from_dir(cfg.runtime.internal_tls()?)?;
    let parts = load(&cfg).await?;
    let multimodal = MultimodalCard {
        image_token_id: parts.encoder.config.image_token_index,
        tokens_per_image: parts.encoder.config.tokens_per_image() as u32,
        max_images_per_request: MAX_IMAGES_PER_REQUEST as u32,
    };
    let transport = crate::transport::open(&cfg).await?;
    let service = EncodeService::new(parts, transport.clone());
    let (listener, grpc_addr) = bind_grpc(&cfg).await?;
    let accepting = service.accepting_flag();
    let health_flag = accepting.clone();
    let health = Arc::new(move || health_flag.load(Ordering::SeqCst));
    let http_addr = serve_status(&cfg, metrics_handle, health, &shutdown).await?;
    let card = encode_card(&cfg, grpc_addr, http_addr, multimodal);
    let registration = register(&cfg, &card, &security).await?;
    announce_ready(&cfg, &card);
    let routes = tonic::service::Routes::new(
        EncoderServer::new(EncoderGrpc(service.clone()))
            .max_decoding_message_size(tandem_protocol::MAX_GRPC_MESSAGE_BYTES)
            .max_encoding_message_size(tandem_protocol::MAX_GRPC_MESSAGE_BYTES),
    );
    let (server_shutdown, server) = spawn_server(routes, listener, &security)?;

    shutdown.cancelled().await;
    tracing::info!("shutting down: deregistering, then draining the writes in flight");
    accepting.store(false, Ordering::SeqCst);
    if let Err(e) = registration.deregister().await {
        tracing::warn!("deregistration failed (the entry will expire by TTL): {e}");
    }
    let deadline = Instant::now() + Duration::from_secs(cfg.runtime.drain_timeout_secs.into());
    while service.active() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server_shutdown.trigger();
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    drop(service);
    drop(transport);
    tracing::info!("encode worker stopped");
    Ok(())
}

/// The tower, its preprocessing and the cache of the model the config names.
async fn load(cfg: &WorkerConfig) -> anyhow::Result<EncodeParts> {
    let folder = crate::engine_setup::model_folder(cfg)?;
    let f = folder.clone();
    let device = crate::engine_setup::choose_device(cfg.model.device)?;
    let (encoder, model_id) = tokio::task::spawn_blocking(move || {
        let (encoder, model_id) = tandem_engine::model::load_vision(&f)?;
        let encoder = crate::engine_setup::place_vision(Arc::new(encoder), device)?;
        anyhow::Ok((encoder, model_id))
    })
    .await
    .context("model loading task failed")??;
    let prep = ImagePrep::for_folder(&folder, &encoder.config)?;
    let gb = cfg.runtime.multimodal_embedding_cache_capacity_gb;
    let capacity = (gb * 1e9) as usize;
    tracing::info!(
        model_id = %model_id,
        device = encoder.device(),
        tokens_per_image = encoder.config.tokens_per_image(),
        cache_bytes = capacity,
        "vision tower loaded"
    );
    Ok(EncodeParts {
        encoder,
        prep,
        model_id,
        cache: EmbeddingCache::new(capacity),
        max_batch_images: MAX_BATCH_IMAGES,
    })
}

/// An encode worker's card: its role and image shape; it serves no text model (routers do
/// not route requests to it).
fn encode_card(
    cfg: &WorkerConfig,
    grpc_addr: String,
    http_addr: String,
    multimodal: MultimodalCard,
) -> ModelCard {
    ModelCard {
        protocol_version: WORKER_PROTOCOL_VERSION,
        served_model_name: cfg.served_model_name(),
        tokenizer_hash: String::new(),
        context_length: 0,
        kv_cache_block_size: 0,
        kv_dtype: tandem_protocol::KvDtype::Float32,
        kv_layout_id: String::new(),
        total_kv_blocks: 0,
        max_num_seqs: 0,
        max_num_batched_tokens: 0,
        role: WorkerRole::Encode,
        grpc_addr,
        http_addr,
        instance_id: discovery::new_instance_id(),
        eos_token_ids: Vec::new(),
        kv_event_key: String::new(),
        multimodal: Some(multimodal),
        tool_call_parser: None,
        reasoning_parser: None,
    }
}
