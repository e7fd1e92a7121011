//! KV block movement between workers.
//!
//! A decode worker (the *receiver*) registers the memory of its KV pool with a [`KvTransport`]
//! and gets a [`RemoteRegion`] descriptor — plain data (serde) to put in a gRPC/JSON message.
//! A prefill worker (the *sender*) connects to the receiver's [`PeerAddress`] and writes blocks
//! straight into that region with one-sided puts ([`KvConnection::write`]: many puts, one
//! completion), then sends a small notification ([`KvConnection::notify`], e.g. "lease X,
//! layer k done") that the receiver reads from its [`Notifications`] stream. A notification is
//! always delivered after every `write` that completed before it was sent.
//!
//! Two transports implement the same protocol:
//! - [`UcxTransport`] over our own UCP bindings (`tandem-ucx-sys`): RMA put + flush, active
//!   message for notifications; a write batch is striped over several UCX workers (lanes,
//!   [`TransportConfig::ucx_lanes`]) so its copies run on several cores. Host memory, and
//!   GPU memory ([`MemoryKind::Cuda`]) too with a CUDA-enabled UCX: a decode worker registers
//!   its GPU pool, and a prefill worker writes into it from its own GPU pool
//!   ([`KvConnection::write_device`]), GPU to GPU.
//! - [`TcpTransport`] over plain TCP for machines without UCX: a put is a frame the receiver
//!   copies into its registered region after checking bounds itself.
//!
//! The choice follows TensorRT-LLM's `cache_transceiver_config.backend` ([`Backend`]): `UCX`
//! (also `DEFAULT`) or `TCP`. There is no silent fallback: [`open`] with `UCX` fails with an
//! error naming `TCP` when UCX cannot be initialised.
//!
//! Safety model: the sender checks every put against the descriptor (offset + len within
//! `len`), and a descriptor that is malformed (checksum mismatch — which guards the UCX rkey,
//! since UCX crashes on a mangled one —, overflowing range, wrong backend or peer) is an error. The TCP receiver checks again against its own
//! registration table, so a hostile sender cannot write outside what was registered. Over TCP
//! a region is also a capability: [`TcpTransport::register`] draws a random region id and a
//! random 256-bit [`RegionSecret`] from the OS RNG, both carried in the descriptor (which
//! travels over the authenticated gRPC control channel), and the receiver refuses every put
//! into a region whose secret the connection has not presented (see [`tcp`]). Over UCX
//! the receiver relies on the remote key (enforced by the NIC on RDMA transports; on tcp/shm
//! UCX trusts the sender), so peers must be trusted cluster members, as in Dynamo/NIXL.

use std::fmt;
use std::future::Future;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

mod any;
mod metrics;
pub mod tcp;
pub mod ucx;

pub use any::{open, AnyConnection, AnyRegistration, AnyTransport};
pub use bytes::Bytes;
pub use metrics::{Refusal, REFUSED_TOTAL};
pub use tcp::TcpTransport;
pub use ucx::UcxTransport;

/// Largest notification payload: notifications are control messages, not data.
pub const MAX_NOTIFICATION_BYTES: usize = 64 * 1024;

/// Events ([`Event`]) a receiver queues for its [`Notifications`] stream at most. A
/// notification that finds the queue full is refused (TCP: the sender's connection is closed)
/// and counted, so a sender cannot grow the receiver's memory when nobody drains the stream.
pub const EVENT_QUEUE: usize = 1024;

/// Everything that can go wrong moving KV blocks.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error(
        "UCX cannot be initialised: {0}. Install UCX (libucp.so.0) or select the TCP transport \
         (cache_transceiver_config.backend: TCP, or --kv-transport tcp)"
    )]
    UcxUnavailable(String),
    #[error("UCX {op} failed: {msg}")]
    Ucx { op: &'static str, msg: String },
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error(
        "put out of bounds: offset {offset} + len {len} exceeds the region's {region_len} bytes"
    )]
    OutOfBounds {
        offset: u64,
        len: u64,
        region_len: u64,
    },
    #[error("malformed remote region descriptor: {0}")]
    BadDescriptor(String),
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout { after: Duration, what: &'static str },
    #[error("peer failed: {0}")]
    PeerFailed(String),
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("the transport is shut down")]
    Closed,
    #[error("unknown cache_transceiver_config.backend {0:?}: expected UCX, DEFAULT or TCP")]
    UnknownBackend(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// GPU memory where the transport (or this build of UCX) cannot take it: never a silent
    /// fallback through host memory.
    #[error("GPU memory over {backend}: {missing}")]
    GpuMemoryUnsupported {
        backend: Backend,
        missing: &'static str,
    },
    #[error("notification of {0} bytes exceeds the {MAX_NOTIFICATION_BYTES}-byte limit")]
    NotificationTooLarge(usize),
    #[error("the OS random number generator failed: {0}")]
    Rng(String),
    #[error("not authenticated: {0}")]
    NotAuthenticated(String),
}

pub type Result<T, E = TransferError> = std::result::Result<T, E>;

/// `cache_transceiver_config.backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Backend {
    #[serde(rename = "UCX")]
    Ucx,
    #[serde(rename = "TCP")]
    Tcp,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Ucx => "UCX",
            Backend::Tcp => "TCP",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Backend {
    type Err = TransferError;
    /// TensorRT-LLM spellings, case-insensitive: `UCX`, `DEFAULT` (= UCX), `TCP`.
    /// `NIXL`/`MPI` are TensorRT-LLM backends we do not implement: an error, not a fallback.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_uppercase().as_str() {
            "UCX" | "DEFAULT" => Ok(Backend::Ucx),
            "TCP" => Ok(Backend::Tcp),
            _ => Err(TransferError::UnknownBackend(s.to_string())),
        }
    }
}

/// Where registered memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum MemoryKind {
    #[default]
    Host,
    /// GPU memory of a CUDA device: registered only by a UCX built with CUDA support
    /// (PyPI `libucx-cu13`: `cuda_copy`, `cuda_ipc`); TCP refuses it.
    Cuda { device: u32 },
}

impl MemoryKind {
    /// The `memory_type` label of the transfer metrics.
    pub fn label(self) -> &'static str {
        match self {
            MemoryKind::Host => "host",
            MemoryKind::Cuda { .. } => "cuda",
        }
    }
}

/// A region of this process's memory to expose to remote writers.
#[derive(Debug)]
pub struct LocalMemory {
    ptr: *mut u8,
    len: usize,
    kind: MemoryKind,
}

// SAFETY: LocalMemory is an address range; the `host` contract makes the caller responsible
// for the memory staying valid and for tolerating concurrent remote writes, from any thread.
unsafe impl Send for LocalMemory {}
unsafe impl Sync for LocalMemory {}

impl LocalMemory {
    /// Host memory `[ptr, ptr + len)`.
    ///
    /// # Safety
    /// The range must be valid, writable memory that stays allocated (and is not moved) until
    /// the [`KvTransport::Registration`] made from it is dropped **and** every writer that was
    /// given its descriptor has stopped (the lease layer's job). Remote peers write into it
    /// concurrently with this process, so Rust must not hold `&`/`&mut` references to bytes a
    /// transfer may touch while it is in progress; read them after the notification.
    pub unsafe fn host(ptr: *mut u8, len: usize) -> Self {
        LocalMemory {
            ptr,
            len,
            kind: MemoryKind::Host,
        }
    }

    /// GPU memory `[ptr, ptr + len)` of CUDA device `device` (a device pointer).
    ///
    /// # Safety
    /// As [`LocalMemory::host`], for device memory: the allocation stays valid until the
    /// registration is dropped and every writer given its descriptor has stopped.
    pub unsafe fn cuda(ptr: *mut u8, len: usize, device: u32) -> Self {
        LocalMemory {
            ptr,
            len,
            kind: MemoryKind::Cuda { device },
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    fn check(&self) -> Result<()> {
        if self.ptr.is_null() || self.len == 0 {
            return Err(TransferError::BadDescriptor("empty or null region".into()));
        }
        if (self.ptr as u64).checked_add(self.len as u64).is_none() {
            return Err(TransferError::BadDescriptor(
                "region wraps the address space".into(),
            ));
        }
        Ok(())
    }
}

/// How to reach a peer: a UCX worker address blob, or `host:port` (UTF-8) for TCP.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PeerAddress(pub Vec<u8>);

/// The capability to write into a TCP region: [`RegionSecret::LEN`] random bytes from the OS
/// RNG, drawn when the region is registered (empty for UCX, whose rkey is its capability).
///
/// Never printed: `Debug` shows only its length, and it is compared in constant time.
#[derive(Clone, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RegionSecret(Vec<u8>);

impl RegionSecret {
    /// Bytes of a TCP region's secret (256 bits).
    pub const LEN: usize = 32;

    /// A fresh secret from the OS RNG.
    pub fn generate() -> Result<Self> {
        let mut b = vec![0u8; Self::LEN];
        getrandom::fill(&mut b).map_err(|e| TransferError::Rng(e.to_string()))?;
        Ok(RegionSecret(b))
    }

    /// A secret received from a peer (a descriptor on the wire).
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        RegionSecret(bytes)
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `presented` is this secret, in time independent of where they differ. An
    /// empty secret matches nothing.
    pub fn matches(&self, presented: &[u8]) -> bool {
        use subtle::ConstantTimeEq;
        !self.0.is_empty() && bool::from(self.0.as_slice().ct_eq(presented))
    }
}

impl PartialEq for RegionSecret {
    fn eq(&self, other: &Self) -> bool {
        use subtle::ConstantTimeEq;
        bool::from(self.0.as_slice().ct_eq(other.0.as_slice()))
    }
}

impl Eq for RegionSecret {}

impl fmt::Debug for RegionSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RegionSecret(<redacted, {} bytes>)", self.0.len())
    }
}

/// A random non-zero `u64` from the OS RNG (region ids).
pub(crate) fn random_u64() -> Result<u64> {
    loop {
        let mut b = [0u8; 8];
        getrandom::fill(&mut b).map_err(|e| TransferError::Rng(e.to_string()))?;
        let v = u64::from_le_bytes(b);
        if v != 0 {
            return Ok(v);
        }
    }
}

/// Descriptor of a registered region, sent from the receiver to the sender.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteRegion {
    pub backend: Backend,
    /// The receiver's address (what [`KvTransport::connect`] takes).
    pub peer: PeerAddress,
    /// The receiver's id for this registration (TCP checks it; informative for UCX).
    pub region_id: u64,
    /// Address of the region's first byte in the receiver's address space.
    pub base: u64,
    pub len: u64,
    /// Packed UCX remote key (empty for TCP).
    pub rkey: Vec<u8>,
    /// TCP: the capability a sender presents before writing (empty for UCX). Not covered by
    /// `check`: the receiver verifies it itself, and the checksum must reveal nothing of it.
    #[serde(default)]
    pub secret: RegionSecret,
    pub memory: MemoryKind,
    /// Checksum over every other field, set by the receiver ([`RemoteRegion::seal`]). UCX
    /// does not validate packed remote keys (a truncated or mangled one crashes it), so a
    /// sender refuses a descriptor whose checksum does not match before UCX sees it. This
    /// catches corruption and mix-ups, not forgery: peers are trusted cluster members.
    pub check: u64,
}

impl RemoteRegion {
    /// Structural validity: a non-empty range that does not wrap.
    fn checksum(&self) -> u64 {
        let mut h = Fnv::default();
        h.write(self.backend.as_str().as_bytes());
        h.write(&(self.peer.0.len() as u64).to_le_bytes());
        h.write(&self.peer.0);
        for v in [self.region_id, self.base, self.len, self.rkey.len() as u64] {
            h.write(&v.to_le_bytes());
        }
        h.write(&self.rkey);
        match self.memory {
            MemoryKind::Host => h.write(&[0]),
            MemoryKind::Cuda { device } => {
                h.write(&[1]);
                h.write(&device.to_le_bytes())
            }
        }
        h.0
    }

    /// Sets `check` from the other fields (done by the receiver that registered the region).
    pub fn seal(&mut self) {
        self.check = self.checksum();
    }

    pub(crate) fn sealed(mut self) -> Self {
        self.seal();
        self
    }

    /// Structural validity: the checksum matches, and the range is non-empty and does not wrap.
    pub fn validate(&self) -> Result<()> {
        if self.check != self.checksum() {
            return Err(TransferError::BadDescriptor(
                "checksum mismatch (corrupted or altered descriptor)".into(),
            ));
        }
        if self.len == 0 {
            return Err(TransferError::BadDescriptor("zero-length region".into()));
        }
        if self.base.checked_add(self.len).is_none() {
            return Err(TransferError::BadDescriptor(format!(
                "base {:#x} + len {} overflows",
                self.base, self.len
            )));
        }
        Ok(())
    }

    /// `[offset, offset + len)` lies inside the region.
    pub fn check_bounds(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(TransferError::OutOfBounds {
                offset,
                len,
                region_len: self.len,
            }),
        }
    }
}

/// One put of a batch: `local` lands at `offset` bytes into the remote region.
///
/// `local` is owned ([`Bytes`]) rather than borrowed because the transfer may outlive a
/// cancelled future: the transport keeps the bytes alive until the hardware/kernel has read
/// them. A KV pool can lend zero-copy views with `Bytes::from_owner`.
#[derive(Debug, Clone)]
pub struct Put {
    pub local: Bytes,
    pub offset: u64,
}

/// One put of a [`DeviceBatch`]: `len` bytes of GPU memory at device address `src` land at
/// `offset` bytes into the remote region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevicePut {
    pub src: u64,
    pub len: u64,
    pub offset: u64,
}

/// A write batch whose sources are GPU memory of this process (a prefill worker's KV pool),
/// for a region that is GPU memory too: the bytes go GPU to GPU (UCX `cuda_ipc` on one host,
/// GPUDirect RDMA across hosts), never through host memory.
///
/// `keep` owns whatever keeps the source memory valid and unchanged (the engine's pin on the
/// blocks); the transport holds it until UCX has finished reading, even when the caller's
/// future is dropped first.
pub struct DeviceBatch {
    device: u32,
    puts: Vec<DevicePut>,
    keep: Box<dyn std::any::Any + Send>,
}

impl fmt::Debug for DeviceBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBatch")
            .field("device", &self.device)
            .field("puts", &self.puts)
            .finish_non_exhaustive()
    }
}

impl DeviceBatch {
    /// A batch of `puts` from memory of CUDA device `device`; puts that continue each other
    /// on both sides (source and destination adjacent) are merged into one, so consecutive
    /// blocks travel as one large message.
    ///
    /// # Safety
    /// Every `[src, src + len)` must be device memory of `device`, valid and not written by
    /// anyone for as long as `keep` lives, and any work that produced it must be complete.
    pub unsafe fn new(
        device: u32,
        puts: Vec<DevicePut>,
        keep: Box<dyn std::any::Any + Send>,
    ) -> Self {
        DeviceBatch {
            device,
            puts: coalesce(puts),
            keep,
        }
    }

    pub fn device(&self) -> u32 {
        self.device
    }

    pub fn puts(&self) -> &[DevicePut] {
        &self.puts
    }

    pub fn bytes(&self) -> u64 {
        self.puts.iter().map(|p| p.len).sum()
    }

    pub(crate) fn into_parts(self) -> (u32, Vec<DevicePut>, Box<dyn std::any::Any + Send>) {
        (self.device, self.puts, self.keep)
    }
}

/// Merges puts that continue the previous one on both sides, keeping batch order.
fn coalesce(puts: Vec<DevicePut>) -> Vec<DevicePut> {
    let mut out: Vec<DevicePut> = Vec::with_capacity(puts.len());
    for p in puts.into_iter().filter(|p| p.len > 0) {
        if let Some(last) = out.last_mut() {
            if last.src.checked_add(last.len) == Some(p.src)
                && last.offset.checked_add(last.len) == Some(p.offset)
            {
                last.len += p.len;
                continue;
            }
        }
        out.push(p);
    }
    out
}

/// What a receiver hears from its senders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A notification, delivered after all puts its sender completed before sending it.
    Notification(Vec<u8>),
    /// A sender's connection ended (TCP only; `error` is `None` on a clean close).
    PeerClosed { peer: String, error: Option<String> },
}

/// The receiver's stream of [`Event`]s (one per transport, see `take_notifications`), at
/// most [`EVENT_QUEUE`] of them queued.
#[derive(Debug)]
pub struct Notifications {
    rx: mpsc::Receiver<Event>,
}

impl Notifications {
    fn channel() -> (mpsc::Sender<Event>, Notifications) {
        let (tx, rx) = mpsc::channel(EVENT_QUEUE);
        (tx, Notifications { rx })
    }

    /// The next event; `None` once the transport is gone.
    pub async fn recv(&mut self) -> Option<Event> {
        self.rx.recv().await
    }

    /// The next event within `after`.
    pub async fn recv_timeout(&mut self, after: Duration) -> Result<Event> {
        match tokio::time::timeout(after, self.rx.recv()).await {
            Ok(Some(ev)) => Ok(ev),
            Ok(None) => Err(TransferError::Closed),
            Err(_) => Err(TransferError::Timeout {
                after,
                what: "a notification",
            }),
        }
    }

    /// The next notification payload within `after`; a closed peer is an error.
    pub async fn next_notification(&mut self, after: Duration) -> Result<Vec<u8>> {
        match self.recv_timeout(after).await? {
            Event::Notification(p) => Ok(p),
            Event::PeerClosed { peer, error } => Err(TransferError::PeerFailed(format!(
                "{peer} closed its connection: {}",
                error.as_deref().unwrap_or("clean close")
            ))),
        }
    }
}

/// Settings shared by both transports.
#[derive(Debug, Clone)]
pub struct TransportConfig {
    pub backend: Backend,
    /// TCP: where the receiver listens (`127.0.0.1:0` picks a free loopback port).
    pub tcp_listen: std::net::SocketAddr,
    /// TCP: the host the receiver's descriptors name (a worker's `--rpc-advertise-host`), with
    /// the listener's port; `None`: the bound address (loopback for a wildcard bind).
    pub tcp_advertise_host: Option<String>,
    /// Upper bound on any single operation (connect, a write batch, a notification).
    pub op_timeout: Duration,
    /// Extra labels on the `trtllm_kv_transfer_*` metrics (`model_name`, `engine_type`,
    /// `disaggregation_mode`).
    pub metric_labels: Vec<(String, String)>,
    /// UCX: create endpoints with `UCP_ERR_HANDLING_MODE_PEER` (a dead peer fails requests at
    /// once). Off by default because UCX then refuses the transports that cannot detect peer
    /// failure — on one host that means tcp instead of shared memory/cma (about 10x slower
    /// here). Without it a dead peer is detected by `op_timeout`. Every worker of a
    /// deployment must use the same setting: UCX refuses endpoints between two workers whose
    /// error modes differ ("asymmetric endpoint configuration").
    pub ucx_peer_error_handling: bool,
    /// UCX: lanes a connection stripes each write batch over. A lane is a UCX worker of its
    /// own (context, worker, progress thread) with its own endpoint to the receiver; a batch
    /// is cut into one contiguous share per lane (whole puts, or pieces of large ones), the
    /// lanes copy in parallel, and the batch completes when every lane's flush has completed.
    /// On one host a put through shared memory is a memcpy by the sending thread, so one lane
    /// moves data at one core's memory bandwidth; more lanes use more cores. `1` disables
    /// striping. Small batches (under 1 MiB per lane) use fewer lanes. The extra lanes are
    /// started on the first `connect`, so a receiver-only transport runs one thread. Default:
    /// [`default_ucx_lanes`].
    pub ucx_lanes: usize,
    /// UCX: configuration overrides applied with `ucp_config_modify` to every lane's context,
    /// as (name without the `UCX_` prefix, value), e.g. `("PROTOS", "^put/offload/zcopy")`.
    /// Applied after the `UCX_*` environment variables, so they win over them. A name the
    /// loaded UCX does not know fails `open`. Default: none.
    pub ucx_config: Vec<(String, String)>,
}

/// The default [`TransportConfig::ucx_lanes`]: `min(4, available cores)`.
pub fn default_ucx_lanes() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 4)
}

impl TransportConfig {
    pub fn new(backend: Backend) -> Self {
        TransportConfig {
            backend,
            tcp_listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            tcp_advertise_host: None,
            op_timeout: Duration::from_secs(30),
            metric_labels: Vec::new(),
            ucx_peer_error_handling: false,
            ucx_lanes: default_ucx_lanes(),
            ucx_config: Vec::new(),
        }
    }
}

/// A registration handle; dropping it unregisters the memory.
pub trait Registration: Send + Sync {
    fn descriptor(&self) -> &RemoteRegion;
}

/// The sender's side of a connection to one receiver.
pub trait KvConnection: Send + Sync {
    /// Writes every put into `remote`, returning once all of them are complete at the
    /// receiver (one flush for the batch). All puts are bounds-checked before any is issued.
    fn write(
        &self,
        remote: &RemoteRegion,
        puts: Vec<Put>,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Writes a batch from this process's GPU memory into `remote` (GPU memory too), GPU to
    /// GPU, returning once every put is complete at the receiver. Transports that cannot
    /// move GPU memory refuse it ([`TransferError::GpuMemoryUnsupported`]) rather than stage
    /// it through host memory.
    fn write_device(
        &self,
        remote: &RemoteRegion,
        batch: DeviceBatch,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Sends a small notification; the receiver sees it after every completed `write`.
    fn notify(&self, payload: Bytes) -> impl Future<Output = Result<()>> + Send;
}

/// A transport endpoint: receiver (register + notifications) and sender (connect) at once.
pub trait KvTransport: Send + Sync {
    type Registration: Registration;
    type Connection: KvConnection;

    fn backend(&self) -> Backend;

    /// What peers pass to `connect` to reach this transport.
    fn address(&self) -> PeerAddress;

    /// Exposes `mem` to remote writers until the returned handle is dropped.
    fn register(&self, mem: LocalMemory)
        -> impl Future<Output = Result<Self::Registration>> + Send;

    /// Allocates `len` bytes of host memory that the transport picks for the fastest remote
    /// writes, registered like [`KvTransport::register`]: UCX allocates it itself
    /// (`UCP_MEM_MAP_ALLOCATE`, shared memory where available, so a sender on the same host
    /// writes with a plain memcpy instead of a cross-process syscall). The memory is valid,
    /// and exclusively the caller's apart from remote writes, until the registration is
    /// dropped; its contents are unspecified (not necessarily zero).
    fn allocate(
        &self,
        len: usize,
    ) -> impl Future<Output = Result<(Self::Registration, *mut u8)>> + Send;

    /// Connects to the receiver at `peer`.
    fn connect(&self, peer: &PeerAddress) -> impl Future<Output = Result<Self::Connection>> + Send;

    /// The receiver's event stream; `Some` once, `None` afterwards.
    fn take_notifications(&self) -> Option<Notifications>;
}

/// FNV-1a, for descriptor checksums.
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn write(&mut self, data: &[u8]) {
        for &b in data {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
}

/// The descriptor is sealed, for this backend and for this connection's peer.
fn check_peer(remote: &RemoteRegion, backend: Backend, peer: &PeerAddress) -> Result<()> {
    remote.validate()?;
    if remote.backend != backend {
        return Err(TransferError::BadDescriptor(format!(
            "descriptor is for {}, this connection is {backend}",
            remote.backend
        )));
    }
    if &remote.peer != peer {
        return Err(TransferError::BadDescriptor(
            "descriptor belongs to another peer".into(),
        ));
    }
    Ok(())
}

/// Checks a whole batch before anything is sent, so a refused batch writes nothing.
fn check_batch(
    remote: &RemoteRegion,
    backend: Backend,
    peer: &PeerAddress,
    puts: &[Put],
) -> Result<u64> {
    check_peer(remote, backend, peer)?;
    if remote.memory != MemoryKind::Host {
        // Puts carry host bytes: a GPU pool takes writes from a GPU pool only, so a
        // host-to-GPU pair is refused rather than staged.
        return Err(TransferError::GpuMemoryUnsupported {
            backend,
            missing: "the region is GPU memory and these blocks are in host memory; a GPU \
                      decode pool takes KV from a GPU prefill pool (both on UCX with CUDA)",
        });
    }
    let mut total = 0u64;
    for p in puts {
        remote.check_bounds(p.offset, p.local.len() as u64)?;
        total += p.local.len() as u64;
    }
    Ok(total)
}

/// Checks a GPU batch before anything is sent: the region must be GPU memory (a GPU source
/// never lands in host memory, nor the reverse), every put inside it.
fn check_device_batch(
    remote: &RemoteRegion,
    backend: Backend,
    peer: &PeerAddress,
    batch: &DeviceBatch,
) -> Result<u64> {
    check_peer(remote, backend, peer)?;
    if remote.memory == MemoryKind::Host {
        return Err(TransferError::GpuMemoryUnsupported {
            backend,
            missing: "these blocks are in GPU memory and the region is host memory; a GPU \
                      prefill pool writes into a GPU decode pool (pair workers whose KV pools \
                      are the same memory type)",
        });
    }
    for p in &batch.puts {
        if p.src.checked_add(p.len).is_none() {
            return Err(TransferError::BadDescriptor(format!(
                "device source {:#x} + {} wraps",
                p.src, p.len
            )));
        }
        remote.check_bounds(p.offset, p.len)?;
    }
    Ok(batch.bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_puts_merge_when_both_sides_continue() {
        let put = |src, len, offset| DevicePut { src, len, offset };
        let keep = Box::new(());
        // SAFETY: never issued; the test only looks at the merged puts.
        let b = unsafe {
            DeviceBatch::new(
                0,
                vec![
                    put(0x1000, 100, 0),
                    put(0x1064, 100, 100),  // continues both sides: merged
                    put(0x10c8, 100, 1000), // source continues, destination jumps
                    put(0x5000, 100, 1100), // destination continues, source jumps
                    put(0x5064, 0, 1200),   // empty: dropped
                    put(0x5064, 50, 1200),  // continues the previous one
                ],
                keep,
            )
        };
        assert_eq!(
            b.puts(),
            &[
                put(0x1000, 200, 0),
                put(0x10c8, 100, 1000),
                put(0x5000, 150, 1100)
            ]
        );
        assert_eq!(b.bytes(), 450);
    }

    #[test]
    fn device_batches_go_to_gpu_regions_only() {
        let mut r = RemoteRegion {
            backend: Backend::Ucx,
            peer: PeerAddress(b"x".to_vec()),
            region_id: 1,
            base: 0x1000,
            len: 1000,
            rkey: vec![1],
            secret: RegionSecret::default(),
            memory: MemoryKind::Host,
            check: 0,
        };
        r.seal();
        let batch = |offset| {
            // SAFETY: never issued.
            unsafe {
                DeviceBatch::new(
                    0,
                    vec![DevicePut {
                        src: 0x9000,
                        len: 100,
                        offset,
                    }],
                    Box::new(()),
                )
            }
        };
        let peer = r.peer.clone();
        let e = check_device_batch(&r, Backend::Ucx, &peer, &batch(0)).unwrap_err();
        assert!(
            matches!(e, TransferError::GpuMemoryUnsupported { .. }),
            "{e}"
        );
        r.memory = MemoryKind::Cuda { device: 0 };
        r.seal();
        assert_eq!(
            check_device_batch(&r, Backend::Ucx, &peer, &batch(900)).unwrap(),
            100
        );
        assert!(matches!(
            check_device_batch(&r, Backend::Ucx, &peer, &batch(901)),
            Err(TransferError::OutOfBounds { .. })
        ));
        // And the reverse: host bytes never go into a GPU region.
        let host = [Put {
            local: Bytes::from_static(b"abc"),
            offset: 0,
        }];
        assert!(matches!(
            check_batch(&r, Backend::Ucx, &peer, &host),
            Err(TransferError::GpuMemoryUnsupported { .. })
        ));
    }

    #[test]
    fn backend_names() {
        assert_eq!("UCX".parse::<Backend>().unwrap(), Backend::Ucx);
        assert_eq!("default".parse::<Backend>().unwrap(), Backend::Ucx);
        assert_eq!("TCP".parse::<Backend>().unwrap(), Backend::Tcp);
        assert!(matches!(
            "NIXL".parse::<Backend>(),
            Err(TransferError::UnknownBackend(_))
        ));
    }

    #[test]
    fn bounds() {
        let r = RemoteRegion {
            backend: Backend::Tcp,
            peer: PeerAddress(b"x".to_vec()),
            region_id: 1,
            base: 0x1000,
            len: 100,
            rkey: vec![],
            secret: RegionSecret::generate().unwrap(),
            memory: MemoryKind::Host,
            check: 0,
        };
        let mut r = r;
        assert!(r.validate().is_err(), "unsealed");
        r.seal();
        assert!(r.validate().is_ok());
        assert!(r.check_bounds(0, 100).is_ok());
        assert!(r.check_bounds(100, 0).is_ok());
        assert!(r.check_bounds(1, 100).is_err());
        assert!(r.check_bounds(u64::MAX, 2).is_err());
        let mut bad = RemoteRegion {
            base: u64::MAX - 10,
            ..r.clone()
        };
        assert!(bad.validate().is_err());
        bad.seal();
        assert!(bad.validate().is_err(), "wrapping range");
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<RemoteRegion>(&json).unwrap(), r);
        // The secret is not part of the checksum: changing it keeps the descriptor sealed.
        let other = RemoteRegion {
            secret: RegionSecret::generate().unwrap(),
            ..r.clone()
        };
        assert!(other.validate().is_ok());
        assert_ne!(other, r);
    }

    #[test]
    fn secrets_are_random_redacted_and_compared_whole() {
        let a = RegionSecret::generate().unwrap();
        let b = RegionSecret::generate().unwrap();
        assert_eq!(a.as_bytes().len(), RegionSecret::LEN);
        assert_ne!(a, b);
        assert!(a.matches(a.as_bytes()));
        assert!(!a.matches(b.as_bytes()));
        assert!(!a.matches(&a.as_bytes()[..RegionSecret::LEN - 1]));
        assert!(!a.matches(&[]));
        assert!(
            !RegionSecret::default().matches(&[]),
            "empty matches nothing"
        );
        let region = RemoteRegion {
            backend: Backend::Tcp,
            peer: PeerAddress(b"x".to_vec()),
            region_id: random_u64().unwrap(),
            base: 0,
            len: 1,
            rkey: vec![],
            secret: a.clone(),
            memory: MemoryKind::Host,
            check: 0,
        };
        let printed = format!("{region:?} {a:?}");
        assert!(printed.contains("redacted"), "{printed}");
        // The bytes, as Debug of a Vec or slice would print them, appear nowhere.
        let bytes = format!("{:?}", a.as_bytes());
        assert!(!printed.contains(&bytes[1..bytes.len() - 1]), "{printed}");
    }
}
