//! Opening the KV transport a worker's config names (`cache_transceiver_config.backend`, or
//! `--kv-transport`), and the decode worker's KV pool allocated through it so that prefill
//! workers can write blocks straight into it.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tandem_config::engine_options::TransceiverBackend;
use tandem_config::WorkerConfig;
use tandem_kv_transfer::{AnyConnection, AnyTransport, Backend, KvTransport, PeerAddress};
use tandem_kv_transfer::{Registration, TransportConfig};

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
    // The transfer listener binds where the gRPC listener does (--rpc-host, which defaults to
    // the advertised interface), and its descriptors name the advertised host, so a prefill
    // worker on another host dials this one rather than itself.
    tc.tcp_listen = bind_addr(&cfg.network.rpc_host).await?;
    tc.tcp_listen.set_port(cfg.network.kv_transfer_port);
    tc.tcp_advertise_host = cfg
        .network
        .rpc_advertise_host
        .as_deref()
        .and_then(tandem_config::worker::advertise_host_part)
        .map(str::to_owned);
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

/// The address (port 0, set by the caller) the transfer listener binds for `--rpc-host` `host`: an IP, or a name
/// resolved like the gRPC listener's (never a silent wildcard).
async fn bind_addr(host: &str) -> anyhow::Result<std::net::SocketAddr> {
    let host = host.trim();
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if let Ok(ip) = bare.parse::<std::net::IpAddr>() {
        return Ok(std::net::SocketAddr::new(ip, 0));
    }
    tokio::net::lookup_host((bare, 0))
        .await
        .with_context(|| {
            format!("cannot resolve --rpc-host {host:?} for the KV transfer listener")
        })?
        .next()
        .with_context(|| format!("--rpc-host {host:?} resolves to no address"))
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

/// A writer's open connections, one per receiving peer, made on first use and dropped after a
/// failed write (prefill workers writing KV, encode workers writing embeddings).
#[derive(Default)]
pub struct Connections {
    open: tokio::sync::Mutex<std::collections::HashMap<PeerAddress, Arc<AnyConnection>>>,
}

impl Connections {
    /// The connection to `peer` through `transport`, connecting on first use.
    pub async fn get(
        &self,
        transport: &AnyTransport,
        peer: &PeerAddress,
    ) -> Result<Arc<AnyConnection>, tandem_kv_transfer::TransferError> {
        let mut m = self.open.lock().await;
        if let Some(c) = m.get(peer) {
            return Ok(c.clone());
        }
        let c = Arc::new(transport.connect(peer).await?);
        m.insert(peer.clone(), c.clone());
        Ok(c)
    }

    /// Drops the connection to `peer` (the next write reconnects).
    pub async fn forget(&self, peer: &PeerAddress) {
        self.open.lock().await.remove(peer);
    }
}

/// How a prefill worker's KV writes reach decode workers.
#[derive(Clone)]
pub enum KvWriter {
    /// Real puts through the KV transport into the decode worker's registered memory.
    Transport(Arc<AnyTransport>),
    /// No bytes move: each write takes the time its bytes need on a simulated link (the
    /// simulated engine of `tandem-mocker`).
    Simulated(Arc<SimulatedLink>),
}

/// The peer address that marks a simulated decode worker's KV region: a simulated writer
/// writes only into such regions (and a real transport cannot connect to one), so a mixed
/// fleet can never hand real KV to a simulated writer or the reverse.
pub const SIMULATED_PEER: &[u8] = b"simulated-kv-region";

/// The KV region a simulated decode worker advertises: `len` bytes (its pool's size in the
/// layout's block bytes, so that lease offsets are bounds-checked as for a real one), no
/// memory behind it.
pub fn simulated_region(region_id: u64, len: u64) -> tandem_kv_transfer::RemoteRegion {
    let mut r = tandem_kv_transfer::RemoteRegion {
        backend: Backend::Tcp,
        peer: tandem_kv_transfer::PeerAddress(SIMULATED_PEER.to_vec()),
        region_id,
        base: 0,
        len,
        rkey: Vec::new(),
        secret: tandem_kv_transfer::RegionSecret::default(),
        memory: tandem_kv_transfer::MemoryKind::Host,
        check: 0,
    };
    r.seal();
    r
}

/// The transports' `trtllm_kv_transfer_*` metrics, with a real prefill worker's labels, for a
/// simulated write (latency includes waiting for the link, as a real put's includes queueing).
fn record_simulated_transfer(bytes: u64, elapsed: Duration) {
    let labels = [
        ("engine_type", "tandem"),
        ("disaggregation_mode", "prefill"),
        ("memory_type", "host"),
    ];
    let secs = elapsed.as_secs_f64();
    metrics::counter!("trtllm_kv_transfer_success_total", &labels).increment(1);
    metrics::histogram!("trtllm_kv_transfer_latency_seconds", &labels).record(secs);
    metrics::histogram!("trtllm_kv_transfer_bytes", &labels).record(bytes as f64);
    if secs > 0.0 {
        metrics::histogram!("trtllm_kv_transfer_speed_gb_s", &labels)
            .record(bytes as f64 / secs / 1e9);
    }
}

/// A prefill worker's simulated outbound link: one link per worker, shared by its concurrent
/// writes (they queue on it FIFO, as on one NIC), at `bytes_per_sec`. A write of `b` bytes
/// that finds the link free at `t` completes at `t + b / bytes_per_sec`.
pub struct SimulatedLink {
    bytes_per_sec: f64,
    /// Bytes one block is on the wire; `None`: the layout's block size.
    wire_block_bytes: Option<u64>,
    free_at: std::sync::Mutex<tokio::time::Instant>,
}

impl SimulatedLink {
    /// `bytes_per_sec` of simulated bandwidth (the caller folds any speed-up into it);
    /// `wire_block_bytes` overrides the bytes a block counts for.
    pub fn new(bytes_per_sec: f64, wire_block_bytes: Option<u64>) -> anyhow::Result<Self> {
        anyhow::ensure!(
            bytes_per_sec.is_finite() && bytes_per_sec > 0.0,
            "the simulated KV transfer bandwidth must be > 0 (got {bytes_per_sec} bytes/s)"
        );
        anyhow::ensure!(
            wire_block_bytes != Some(0),
            "a simulated KV block must be > 0 bytes"
        );
        Ok(SimulatedLink {
            bytes_per_sec,
            wire_block_bytes,
            free_at: std::sync::Mutex::new(tokio::time::Instant::now()),
        })
    }

    pub fn bytes_per_sec(&self) -> f64 {
        self.bytes_per_sec
    }

    /// The time `bytes` take on this link, alone.
    pub fn duration_of(&self, bytes: u64) -> Duration {
        Duration::from_secs_f64(bytes as f64 / self.bytes_per_sec)
    }

    /// "Writes" blocks of `block_bytes` (the layout's) at `offsets` of `region`: checks them
    /// as a real write would (a simulated region, every block inside it), waits for the
    /// link, and returns the bytes that moved on the simulated wire.
    pub async fn write(
        &self,
        region: &tandem_kv_transfer::RemoteRegion,
        offsets: &[u64],
        block_bytes: u64,
    ) -> anyhow::Result<u64> {
        anyhow::ensure!(
            region.peer.0 == SIMULATED_PEER,
            "the decode worker's KV region is real memory; a simulated prefill worker cannot \
             write into it (do not mix simulated and real workers)"
        );
        for &o in offsets {
            region.check_bounds(o, block_bytes)?;
        }
        let bytes = offsets.len() as u64 * self.wire_block_bytes.unwrap_or(block_bytes);
        let called = tokio::time::Instant::now();
        let end = {
            let mut free = self.free_at.lock().unwrap_or_else(|p| p.into_inner());
            let start = (*free).max(tokio::time::Instant::now());
            *free = start + self.duration_of(bytes);
            *free
        };
        tokio::time::sleep_until(end).await;
        record_simulated_transfer(bytes, called.elapsed());
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_transfer_listener_binds_the_rpc_host_and_advertises_the_advertised_one() {
        assert_eq!(
            bind_addr("127.0.0.1").await.unwrap(),
            std::net::SocketAddr::from(([127, 0, 0, 1], 0))
        );
        assert_eq!(
            bind_addr("[::1]").await.unwrap(),
            "[::1]:0".parse::<std::net::SocketAddr>().unwrap()
        );
        assert!(bind_addr("localhost").await.unwrap().ip().is_loopback());
        assert!(bind_addr("no-such-host.invalid").await.is_err());
        // A listener on the wildcard whose descriptors name the advertised host, not 0.0.0.0.
        let mut tc = TransportConfig::new(Backend::Tcp);
        tc.tcp_listen = std::net::SocketAddr::from(([0, 0, 0, 0], 0));
        tc.tcp_advertise_host =
            tandem_config::worker::advertise_host_part("192.0.2.9:7000").map(str::to_owned);
        let t = tandem_kv_transfer::open(tc).await.unwrap();
        let port = match &t {
            AnyTransport::Tcp(t) => t.local_addr().port(),
            AnyTransport::Ucx(_) => unreachable!(),
        };
        assert_eq!(
            t.address().0,
            format!("192.0.2.9:{port}").into_bytes(),
            "the descriptor names the advertised host with the listener's port"
        );
    }

    #[tokio::test]
    async fn simulated_link_checks_like_a_write_and_counts_wire_bytes() {
        let region = simulated_region(7, 4 * 100);
        region.validate().expect("sealed");
        let link = SimulatedLink::new(1e12, None).unwrap();
        assert_eq!(link.write(&region, &[0, 300], 100).await.unwrap(), 200);
        let wide = SimulatedLink::new(1e12, Some(5000)).unwrap();
        assert_eq!(wide.write(&region, &[100], 100).await.unwrap(), 5000);
        // Past the pool's end: refused as a real put would be.
        assert!(link.write(&region, &[350], 100).await.is_err());
        // A real decode worker's region: never "written" by a simulated writer.
        let mut real = region.clone();
        real.peer = tandem_kv_transfer::PeerAddress(b"127.0.0.1:1".to_vec());
        real.seal();
        let e = link.write(&real, &[0], 100).await.unwrap_err();
        assert!(e.to_string().contains("real memory"), "{e}");
        assert!(SimulatedLink::new(0.0, None).is_err());
        assert!(SimulatedLink::new(1.0, Some(0)).is_err());
        assert_eq!(link.duration_of(2_000_000_000_000), Duration::from_secs(2));
    }
}
