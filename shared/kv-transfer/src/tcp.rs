//! [`TcpTransport`]: the KV transfer protocol over plain TCP, for machines without UCX.
//!
//! Wire format (little-endian), sender → receiver on one connection:
//! - `HELLO`  `[4][region_id u64][secret 32 bytes]` — presents a region's
//!   [`RegionSecret`]; the connection may then write into that region
//! - `PUT`    `[1][region_id u64][offset u64][len u64][len bytes]`
//! - `FLUSH`  `[2][seq u64]` — the receiver answers `[seq u64][status u8][msg_len u32][msg]`
//!   once every preceding put has been copied (status 0) or with the first refused put's error
//! - `NOTIFY` `[3][len u32][payload]` — handed to the receiver's event stream
//!
//! Authentication: a region is a capability. Its id and its 256-bit secret are drawn from the
//! OS RNG at registration and travel in the descriptor over the (TLS) gRPC control channel. A
//! sender presents the secret once per connection and region (`HELLO`, compared in constant
//! time), not in every `PUT`: a prefill worker keeps one connection per decode worker and
//! writes into one region (the whole pool) through it, so a hello costs 41 bytes once instead
//! of 32 bytes and a comparison per put. A hello with a wrong secret or an unknown region, a
//! put into a region the connection has not presented the secret of, a put that does not fit
//! the region (checked on the header, before the payload is read or any buffer allocated),
//! a notification before any valid hello, an oversized notification or one that finds the
//! receiver's event queue ([`crate::EVENT_QUEUE`]) full: each is refused, counted
//! ([`crate::REFUSED_TOTAL`], [`TcpTransport::refused`]) and the connection closed, with the
//! pool untouched. A put is copied in slices of at most [`COPY_CHUNK`] bytes, so a connection
//! holds at most that much payload in memory.
//!
//! The receiver copies each put into its registered region only after checking, against its
//! own registration table, that the region exists and `offset + len` fits; it never trusts the
//! sender's descriptor. Frames on one connection are handled in order, so a notification is
//! seen after every put sent before it. Registration drop removes the region under the same
//! lock the copy holds, so once `drop` returns no frame can touch that memory.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::metrics::{record_refused, Refusal};
use crate::{
    check_batch, random_u64, Backend, Bytes, DeviceBatch, Event, KvConnection, KvTransport,
    LocalMemory, MemoryKind, Notifications, PeerAddress, Put, RegionSecret, RemoteRegion, Result,
    TransferError, TransportConfig, EVENT_QUEUE, MAX_NOTIFICATION_BYTES,
};

const PUT: u8 = 1;
const FLUSH: u8 = 2;
const NOTIFY: u8 = 3;
const HELLO: u8 = 4;

/// Largest slice of a put's payload the receiver reads before copying it into the region.
pub const COPY_CHUNK: usize = 1 << 20;

struct RegionEntry {
    ptr: *mut u8,
    len: usize,
    secret: RegionSecret,
}

// SAFETY: the entry is an address range whose validity the `LocalMemory::host` contract
// guarantees until the registration is dropped; all access goes through `Shared::regions`.
unsafe impl Send for RegionEntry {}

/// Refusals by reason, for tests and `/metrics` (the counter [`crate::REFUSED_TOTAL`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RefusedCounts {
    pub bad_secret: u64,
    pub unauthenticated: u64,
    pub out_of_bounds: u64,
    pub oversized_notification: u64,
    pub event_queue_full: u64,
}

impl RefusedCounts {
    pub fn total(&self) -> u64 {
        self.bad_secret
            + self.unauthenticated
            + self.out_of_bounds
            + self.oversized_notification
            + self.event_queue_full
    }
}

#[derive(Default)]
struct Refusals([AtomicU64; 5]);

impl Refusals {
    fn slot(reason: Refusal) -> usize {
        match reason {
            Refusal::BadSecret => 0,
            Refusal::Unauthenticated => 1,
            Refusal::OutOfBounds => 2,
            Refusal::OversizedNotification => 3,
            Refusal::EventQueueFull => 4,
        }
    }

    fn counts(&self) -> RefusedCounts {
        let c = |r| self.0[Self::slot(r)].load(Ordering::Relaxed);
        RefusedCounts {
            bad_secret: c(Refusal::BadSecret),
            unauthenticated: c(Refusal::Unauthenticated),
            out_of_bounds: c(Refusal::OutOfBounds),
            oversized_notification: c(Refusal::OversizedNotification),
            event_queue_full: c(Refusal::EventQueueFull),
        }
    }
}

struct Shared {
    regions: Mutex<HashMap<u64, RegionEntry>>,
    events: mpsc::Sender<Event>,
    refusals: Refusals,
    labels: Vec<(String, String)>,
}

impl Shared {
    fn new(events: mpsc::Sender<Event>, labels: Vec<(String, String)>) -> Self {
        Shared {
            regions: Mutex::new(HashMap::new()),
            events,
            refusals: Refusals::default(),
            labels,
        }
    }

    fn regions(&self) -> std::sync::MutexGuard<'_, HashMap<u64, RegionEntry>> {
        self.regions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts a refusal and returns the error that closes the connection.
    fn refuse(&self, reason: Refusal, msg: String) -> TransferError {
        self.refusals.0[Refusals::slot(reason)].fetch_add(1, Ordering::Relaxed);
        record_refused(&self.labels, reason);
        tracing::warn!(
            reason = reason.as_str(),
            "kv-transfer tcp: refused a frame: {msg}"
        );
        match reason {
            Refusal::BadSecret | Refusal::Unauthenticated => TransferError::NotAuthenticated(msg),
            _ => TransferError::Protocol(msg),
        }
    }

    /// Whether `secret` is region `id`'s (constant-time comparison).
    fn authenticate(&self, id: u64, secret: &[u8]) -> bool {
        self.regions()
            .get(&id)
            .is_some_and(|r| r.secret.matches(secret))
    }

    /// `[offset, offset + len)` lies inside region `id` (which exists).
    fn fits(&self, id: u64, offset: u64, len: u64) -> std::result::Result<(), String> {
        let regions = self.regions();
        let Some(r) = regions.get(&id) else {
            return Err(format!("unknown or unregistered region {id}"));
        };
        match offset.checked_add(len) {
            Some(end) if end <= r.len as u64 => Ok(()),
            _ => Err(format!(
                "put out of bounds: offset {offset} + len {len} exceeds the region's {} bytes",
                r.len
            )),
        }
    }

    /// Copies `data` into region `id` at `offset` if, and only if, it fits.
    fn copy_in(&self, id: u64, offset: u64, data: &[u8]) -> std::result::Result<(), String> {
        let regions = self.regions();
        let Some(r) = regions.get(&id) else {
            return Err(format!("unknown or unregistered region {id}"));
        };
        let end = offset.checked_add(data.len() as u64);
        if end.is_none_or(|end| end > r.len as u64) {
            return Err(format!(
                "put out of bounds: offset {offset} + len {} exceeds the region's {} bytes",
                data.len(),
                r.len
            ));
        }
        // SAFETY: `offset + data.len() <= r.len` was just checked and the region is valid
        // while it is in the table (we hold the lock that `drop` of the registration takes).
        // `data` is our own buffer, so the ranges cannot overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), r.ptr.add(offset as usize), data.len())
        };
        Ok(())
    }
}

/// The address a descriptor names: `advertise` (a host) with the listener's port, or the bound
/// address, loopback for a wildcard bind.
fn advertised(bound: SocketAddr, advertise: Option<&str>) -> String {
    match advertise.map(str::trim).filter(|h| !h.is_empty()) {
        Some(h) if h.contains(':') && !h.starts_with('[') => format!("[{h}]:{}", bound.port()),
        Some(h) => format!("{h}:{}", bound.port()),
        None => {
            let ip = match bound.ip() {
                std::net::IpAddr::V4(ip) if ip.is_unspecified() => {
                    std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)
                }
                std::net::IpAddr::V6(ip) if ip.is_unspecified() => {
                    std::net::IpAddr::V6(std::net::Ipv6Addr::LOCALHOST)
                }
                ip => ip,
            };
            SocketAddr::new(ip, bound.port()).to_string()
        }
    }
}

/// KV transfer over TCP. Listens for senders at `address()`; `connect` dials other receivers.
pub struct TcpTransport {
    shared: Arc<Shared>,
    local: SocketAddr,
    address: PeerAddress,
    accept: JoinHandle<()>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
    notifications: Mutex<Option<Notifications>>,
    config: TransportConfig,
}

impl TcpTransport {
    /// Binds the listener (`config.tcp_listen`) and starts accepting senders.
    pub async fn bind(config: TransportConfig) -> Result<Self> {
        let listener = TcpListener::bind(config.tcp_listen).await?;
        let local = listener.local_addr()?;
        let address =
            PeerAddress(advertised(local, config.tcp_advertise_host.as_deref()).into_bytes());
        let (tx, notifications) = Notifications::channel();
        let shared = Arc::new(Shared::new(tx, config.metric_labels.clone()));
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accept = tokio::spawn(accept_loop(listener, shared.clone(), conns.clone()));
        Ok(TcpTransport {
            shared,
            local,
            address,
            accept,
            conns,
            notifications: Mutex::new(Some(notifications)),
            config,
        })
    }

    /// The address the listener is bound to (`address()` is what descriptors advertise).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Frames and events this receiver refused so far, by reason.
    pub fn refused(&self) -> RefusedCounts {
        self.shared.refusals.counts()
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        // Stop accepting and serving: after this no frame touches registered memory, and the
        // registration table (with every region in it) is released.
        self.accept.abort();
        for h in self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            h.abort();
        }
        self.shared.regions().clear();
    }
}

async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!("kv-transfer tcp accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let shared2 = shared.clone();
        let h = tokio::spawn(async move {
            let error = serve_conn(stream, &shared2)
                .await
                .err()
                .map(|e| e.to_string());
            // A full queue drops the event: nobody is draining the stream.
            let _ = shared2.events.try_send(Event::PeerClosed {
                peer: peer.to_string(),
                error,
            });
        });
        let mut conns = conns.lock().unwrap_or_else(|e| e.into_inner());
        conns.retain(|h| !h.is_finished());
        conns.push(h);
    }
}

/// Serves one sender until it closes (Ok) or breaks the protocol / the socket fails (Err).
async fn serve_conn(stream: TcpStream, shared: &Shared) -> Result<()> {
    let (rd, wr) = stream.into_split();
    serve_frames(
        BufReader::with_capacity(256 * 1024, rd),
        wr,
        shared,
        HashSet::new(),
    )
    .await
}

/// The receiver's side of the wire format (module docs): reads frames from `rd` until a clean
/// end between frames (Ok) or a protocol, authentication or I/O error (Err), writing flush
/// acks to `wr`. `authorized`: the regions whose secret this connection has presented.
async fn serve_frames<R, W>(
    mut rd: R,
    mut wr: W,
    shared: &Shared,
    mut authorized: HashSet<u64>,
) -> Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    // Payload slices; allocated on the first accepted put, at most COPY_CHUNK bytes.
    let mut buf: Vec<u8> = Vec::new();
    // The first put that failed since the last flush (its region was unregistered while it
    // was arriving); reported on the next flush ack.
    let mut first_error: Option<String> = None;
    loop {
        let kind = match rd.read_u8().await {
            Ok(k) => k,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        match kind {
            HELLO => {
                let id = rd.read_u64_le().await?;
                let mut secret = [0u8; RegionSecret::LEN];
                rd.read_exact(&mut secret).await?;
                if !shared.authenticate(id, &secret) {
                    return Err(shared.refuse(
                        Refusal::BadSecret,
                        format!("hello for region {id}: unknown region or wrong secret"),
                    ));
                }
                authorized.insert(id);
            }
            PUT => {
                let id = rd.read_u64_le().await?;
                let offset = rd.read_u64_le().await?;
                let len = rd.read_u64_le().await?;
                if !authorized.contains(&id) {
                    return Err(shared.refuse(
                        Refusal::Unauthenticated,
                        format!("put into region {id} before presenting its secret"),
                    ));
                }
                // Checked on the header alone: nothing of the payload is read, and nothing
                // allocated, for a put that does not fit.
                if let Err(msg) = shared.fits(id, offset, len) {
                    return Err(shared.refuse(Refusal::OutOfBounds, msg));
                }
                let mut done = 0u64;
                while done < len {
                    // `len` fits the region, so it fits the address space.
                    let n = (len - done).min(COPY_CHUNK as u64) as usize;
                    if buf.len() < n {
                        buf.resize(n, 0);
                    }
                    rd.read_exact(&mut buf[..n]).await?;
                    if let Err(e) = shared.copy_in(id, offset + done, &buf[..n]) {
                        first_error.get_or_insert(e);
                    }
                    done += n as u64;
                }
            }
            FLUSH => {
                let seq = rd.read_u64_le().await?;
                let msg = first_error.take();
                let mut ack = Vec::with_capacity(13);
                ack.extend_from_slice(&seq.to_le_bytes());
                ack.push(msg.is_some() as u8);
                let m = msg.unwrap_or_default();
                ack.extend_from_slice(&(m.len() as u32).to_le_bytes());
                ack.extend_from_slice(m.as_bytes());
                wr.write_all(&ack).await?;
            }
            NOTIFY => {
                let len = rd.read_u32_le().await? as usize;
                if authorized.is_empty() {
                    return Err(shared.refuse(
                        Refusal::Unauthenticated,
                        "notification before presenting any region's secret".into(),
                    ));
                }
                if len > MAX_NOTIFICATION_BYTES {
                    return Err(shared.refuse(
                        Refusal::OversizedNotification,
                        format!("notification of {len} bytes"),
                    ));
                }
                let mut payload = vec![0u8; len];
                rd.read_exact(&mut payload).await?;
                match shared.events.try_send(Event::Notification(payload)) {
                    Ok(()) | Err(mpsc::error::TrySendError::Closed(_)) => {}
                    Err(mpsc::error::TrySendError::Full(_)) => {
                        return Err(shared.refuse(
                            Refusal::EventQueueFull,
                            format!("notification with {EVENT_QUEUE} events already queued"),
                        ))
                    }
                }
            }
            other => {
                return Err(TransferError::Protocol(format!(
                    "unknown frame kind {other}"
                )))
            }
        }
    }
}

/// What [`replay_frames`] saw the receiver do.
#[derive(Debug)]
pub struct FrameReplay {
    /// How the frame loop ended: Ok on a clean end between frames.
    pub result: Result<()>,
    /// The bytes written back to the sender (flush acks).
    pub acks: Vec<u8>,
    /// The notifications handed to the receiver's event stream.
    pub events: Vec<Event>,
}

/// Runs the receiver's frame loop over `input`, as if one sender had sent exactly these bytes
/// on a connection that has already presented the secret of `region`, registered as region 1
/// (and no other) with a fresh random secret (so a `HELLO` in `input` is refused). For the
/// fuzz targets and tests: a receiver in service reads frames from its TCP connections.
pub async fn replay_frames(input: &[u8], region: &mut [u8]) -> FrameReplay {
    let (events_tx, mut events_rx) = mpsc::channel(EVENT_QUEUE);
    let shared = Shared::new(events_tx, Vec::new());
    // An RNG failure leaves an empty secret, which matches nothing: the same for the replay.
    shared.regions().insert(
        1,
        RegionEntry {
            ptr: region.as_mut_ptr(),
            len: region.len(),
            secret: RegionSecret::generate().unwrap_or_default(),
        },
    );
    let mut acks = Vec::new();
    let result = serve_frames(input, &mut acks, &shared, HashSet::from([1])).await;
    drop(shared);
    let mut events = Vec::new();
    while let Ok(ev) = events_rx.try_recv() {
        events.push(ev);
    }
    FrameReplay {
        result,
        acks,
        events,
    }
}

/// A registered region of a [`TcpTransport`]; dropping it unregisters.
pub struct TcpRegistration {
    shared: Arc<Shared>,
    desc: RemoteRegion,
    /// Memory from `allocate`, freed after the region left the table.
    owned: Option<OwnedBuf>,
}

struct OwnedBuf(*mut [u8]);
// SAFETY: a heap allocation owned by the registration; only freed in its Drop.
unsafe impl Send for OwnedBuf {}
unsafe impl Sync for OwnedBuf {}

impl crate::Registration for TcpRegistration {
    fn descriptor(&self) -> &RemoteRegion {
        &self.desc
    }
}

impl Drop for TcpRegistration {
    fn drop(&mut self) {
        self.shared.regions().remove(&self.desc.region_id);
    }
}

/// The byte stream of a [`TcpConnection`] and the regions it has presented the secret of.
struct ConnStream {
    stream: TcpStream,
    presented: HashSet<u64>,
}

/// A sender's connection to one TCP receiver.
pub struct TcpConnection {
    stream: tokio::sync::Mutex<ConnStream>,
    peer: PeerAddress,
    seq: AtomicU64,
    /// Set when an operation was interrupted mid-frame (error, timeout, cancelled future):
    /// the byte stream is no longer in a known state, so every later call fails.
    broken: AtomicBool,
    op_timeout: Duration,
    labels: Vec<(String, String)>,
}

/// Marks the connection broken unless disarmed, so a cancelled future poisons it.
struct BreakGuard<'a>(&'a AtomicBool, bool);
impl Drop for BreakGuard<'_> {
    fn drop(&mut self) {
        if !self.1 {
            self.0.store(true, Ordering::Release);
        }
    }
}

impl TcpConnection {
    fn check_usable(&self) -> Result<()> {
        if self.broken.load(Ordering::Acquire) {
            return Err(TransferError::PeerFailed(
                "connection broken by an earlier failure".into(),
            ));
        }
        Ok(())
    }

    async fn write_inner(
        &self,
        conn: &mut ConnStream,
        remote: &RemoteRegion,
        puts: &[Put],
    ) -> Result<()> {
        let stream = &mut conn.stream;
        if !conn.presented.contains(&remote.region_id) {
            let mut hello = [0u8; 9 + RegionSecret::LEN];
            hello[0] = HELLO;
            hello[1..9].copy_from_slice(&remote.region_id.to_le_bytes());
            hello[9..].copy_from_slice(remote.secret.as_bytes());
            stream.write_all(&hello).await?;
            conn.presented.insert(remote.region_id);
        }
        for p in puts {
            let mut hdr = [0u8; 25];
            hdr[0] = PUT;
            hdr[1..9].copy_from_slice(&remote.region_id.to_le_bytes());
            hdr[9..17].copy_from_slice(&p.offset.to_le_bytes());
            hdr[17..25].copy_from_slice(&(p.local.len() as u64).to_le_bytes());
            stream.write_all(&hdr).await?;
            stream.write_all(&p.local).await?;
        }
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let mut fl = [0u8; 9];
        fl[0] = FLUSH;
        fl[1..9].copy_from_slice(&seq.to_le_bytes());
        stream.write_all(&fl).await?;
        let got = stream.read_u64_le().await?;
        let status = stream.read_u8().await?;
        let mlen = stream.read_u32_le().await? as usize;
        if mlen > MAX_NOTIFICATION_BYTES {
            return Err(TransferError::Protocol(format!(
                "flush ack message of {mlen} bytes"
            )));
        }
        let mut msg = vec![0u8; mlen];
        stream.read_exact(&mut msg).await?;
        if got != seq {
            return Err(TransferError::Protocol(format!(
                "flush ack {got}, expected {seq}"
            )));
        }
        if status != 0 {
            return Err(TransferError::PeerFailed(format!(
                "receiver refused a put: {}",
                String::from_utf8_lossy(&msg)
            )));
        }
        Ok(())
    }
}

impl KvConnection for TcpConnection {
    /// Refused: TCP frames carry host bytes, and GPU memory is never staged through them.
    async fn write_device(&self, _remote: &RemoteRegion, _batch: DeviceBatch) -> Result<()> {
        Err(TransferError::GpuMemoryUnsupported {
            backend: Backend::Tcp,
            missing: "the TCP transport moves host memory only; GPU-to-GPU KV needs UCX with \
                      CUDA support (cache_transceiver_config.backend: UCX, PyPI libucx-cu13)",
        })
    }

    async fn write(&self, remote: &RemoteRegion, puts: Vec<Put>) -> Result<()> {
        let bytes = check_batch(remote, Backend::Tcp, &self.peer, &puts)?;
        if remote.secret.as_bytes().len() != RegionSecret::LEN {
            return Err(TransferError::BadDescriptor(format!(
                "a TCP region's secret is {} bytes, this descriptor carries {}",
                RegionSecret::LEN,
                remote.secret.as_bytes().len()
            )));
        }
        self.check_usable()?;
        let start = Instant::now();
        let mut stream = self.stream.lock().await;
        let mut guard = BreakGuard(&self.broken, false);
        let r = tokio::time::timeout(
            self.op_timeout,
            self.write_inner(&mut stream, remote, &puts),
        )
        .await;
        match r {
            Ok(Ok(())) => {
                guard.1 = true;
                crate::metrics::record_transfer(
                    &self.labels,
                    remote.memory,
                    bytes,
                    start.elapsed(),
                );
                Ok(())
            }
            Ok(Err(e @ TransferError::PeerFailed(_))) => {
                // A refused put is reported by a well-formed ack: the stream is still in sync.
                guard.1 = true;
                Err(e)
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(TransferError::Timeout {
                after: self.op_timeout,
                what: "a TCP write batch",
            }),
        }
    }

    async fn notify(&self, payload: Bytes) -> Result<()> {
        if payload.len() > MAX_NOTIFICATION_BYTES {
            return Err(TransferError::NotificationTooLarge(payload.len()));
        }
        self.check_usable()?;
        let mut conn = self.stream.lock().await;
        if conn.presented.is_empty() {
            return Err(TransferError::NotAuthenticated(
                "a TCP connection notifies only after writing into a region (its hello \
                 presents the region's secret)"
                    .into(),
            ));
        }
        let stream = &mut conn.stream;
        let mut guard = BreakGuard(&self.broken, false);
        let send = async {
            let mut hdr = [0u8; 5];
            hdr[0] = NOTIFY;
            hdr[1..5].copy_from_slice(&(payload.len() as u32).to_le_bytes());
            stream.write_all(&hdr).await?;
            stream.write_all(&payload).await?;
            stream.flush().await?;
            Ok::<(), TransferError>(())
        };
        match tokio::time::timeout(self.op_timeout, send).await {
            Ok(Ok(())) => {
                guard.1 = true;
                Ok(())
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(TransferError::Timeout {
                after: self.op_timeout,
                what: "a TCP notification",
            }),
        }
    }
}

impl KvTransport for TcpTransport {
    type Registration = TcpRegistration;
    type Connection = TcpConnection;

    fn backend(&self) -> Backend {
        Backend::Tcp
    }

    fn address(&self) -> PeerAddress {
        self.address.clone()
    }

    async fn register(&self, mem: LocalMemory) -> Result<TcpRegistration> {
        mem.check()?;
        if mem.kind() != MemoryKind::Host {
            return Err(TransferError::GpuMemoryUnsupported {
                backend: Backend::Tcp,
                missing: "the TCP transport moves host memory only; GPU KV needs \
                          cache_transceiver_config.backend UCX with a CUDA-enabled UCX \
                          (PyPI libucx-cu13)",
            });
        }
        // Random id and secret: neither guessable from other registrations nor reused.
        let secret = RegionSecret::generate()?;
        let id = {
            let mut regions = self.shared.regions();
            let id = loop {
                let id = random_u64()?;
                if !regions.contains_key(&id) {
                    break id;
                }
            };
            regions.insert(
                id,
                RegionEntry {
                    ptr: mem.ptr,
                    len: mem.len,
                    secret: secret.clone(),
                },
            );
            id
        };
        Ok(TcpRegistration {
            shared: self.shared.clone(),
            desc: RemoteRegion {
                backend: Backend::Tcp,
                peer: self.address(),
                region_id: id,
                base: mem.ptr as u64,
                len: mem.len as u64,
                rkey: Vec::new(),
                secret,
                memory: MemoryKind::Host,
                check: 0,
            }
            .sealed(),
            owned: None,
        })
    }

    async fn allocate(&self, len: usize) -> Result<(TcpRegistration, *mut u8)> {
        let owned = OwnedBuf(Box::into_raw(vec![0u8; len].into_boxed_slice()));
        // SAFETY: a fresh allocation, owned by the registration we return and freed in its Drop.
        let mem = unsafe { LocalMemory::host(owned.0 as *mut u8, len) };
        match self.register(mem).await {
            Ok(mut reg) => {
                let ptr = owned.0 as *mut u8;
                reg.owned = Some(owned);
                Ok((reg, ptr))
            }
            Err(e) => {
                // SAFETY: registration failed, so nothing else refers to the allocation.
                drop(unsafe { Box::from_raw(owned.0) });
                Err(e)
            }
        }
    }

    async fn connect(&self, peer: &PeerAddress) -> Result<TcpConnection> {
        let addr = std::str::from_utf8(&peer.0)
            .map_err(|_| TransferError::BadDescriptor("TCP peer address is not UTF-8".into()))?
            .to_string();
        let stream =
            match tokio::time::timeout(self.config.op_timeout, TcpStream::connect(&addr)).await {
                Ok(s) => s?,
                Err(_) => {
                    return Err(TransferError::Timeout {
                        after: self.config.op_timeout,
                        what: "a TCP connect",
                    })
                }
            };
        stream.set_nodelay(true)?;
        Ok(TcpConnection {
            stream: tokio::sync::Mutex::new(ConnStream {
                stream,
                presented: HashSet::new(),
            }),
            peer: peer.clone(),
            seq: AtomicU64::new(0),
            broken: AtomicBool::new(false),
            op_timeout: self.config.op_timeout,
            labels: self.config.metric_labels.clone(),
        })
    }

    fn take_notifications(&self) -> Option<Notifications> {
        self.notifications
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }
}
