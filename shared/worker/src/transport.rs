//! Opening the KV transport a worker's config names (`cache_transceiver_config.backend`, or
//! `--kv-transport`), and the decode worker's KV pool allocated through it so that prefill
//! workers can write blocks straight into it.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tandem_config::engine_options::TransceiverBackend;
use tandem_config::WorkerConfig;
use tandem_kv_transfer::{AnyTransport, Backend, KvTransport, Registration, TransportConfig};

/// The transport of this worker.
pub fn backend(cfg: &WorkerConfig) -> anyhow::Result<Backend> {
    match cfg.engine.cache_transceiver_config.backend {
        TransceiverBackend::Default | TransceiverBackend::Ucx => Ok(Backend::Ucx),
        TransceiverBackend::Tcp => Ok(Backend::Tcp),
        // Refused by the config crate's validation; kept as an error, not a panic.
        other => anyhow::bail!(
            "cache_transceiver_config.backend {other:?} is not implemented yet (use UCX or TCP)"
        ),
    }
}

/// Opens the transport (UCX that cannot start is an error naming TCP, never a fallback).
pub async fn open(cfg: &WorkerConfig) -> anyhow::Result<Arc<AnyTransport>> {
    let backend = backend(cfg)?;
    let mut tc = TransportConfig::new(backend);
    // The transfer listener binds where the gRPC listener does, so a multi-host deployment
    // that opened --rpc-host to the network reaches it too.
    let host: std::net::IpAddr = cfg
        .network
        .rpc_host
        .parse()
        .unwrap_or(std::net::IpAddr::from([0, 0, 0, 0]));
    tc.tcp_listen = std::net::SocketAddr::new(host, 0);
    tc.op_timeout = Duration::from_secs(cfg.disaggregation.kv_lease_ttl_secs.max(1).into());
    tc.metric_labels = vec![
        ("engine_type".into(), "tandem".into()),
        (
            "disaggregation_mode".into(),
            cfg.disaggregation.disaggregation_mode.name().into(),
        ),
    ];
    let t = tandem_kv_transfer::open(tc)
        .await
        .with_context(|| format!("cannot open the {backend} KV transport"))?;
    tracing::info!(%backend, "KV transport open");
    Ok(Arc::new(t))
}

/// A decode worker's KV pool: memory allocated and registered by the transport, and the
/// descriptor prefill workers write into.
pub struct RegisteredPool {
    pub descriptor: tandem_kv_transfer::RemoteRegion,
    pub ptr: *mut u8,
    pub len: usize,
    pub registration: tandem_kv_transfer::AnyRegistration,
}

// SAFETY: the pointer is only handed to the engine's pool (which owns the registration from
// then on); this struct is a carrier between the async set-up and the engine builder.
unsafe impl Send for RegisteredPool {}

pub async fn allocate_pool(t: &AnyTransport, len: usize) -> anyhow::Result<RegisteredPool> {
    let (registration, ptr) = t
        .allocate(len)
        .await
        .with_context(|| format!("cannot allocate a {len}-byte KV pool through the transport"))?;
    Ok(RegisteredPool {
        descriptor: registration.descriptor().clone(),
        ptr,
        len,
        registration,
    })
}
