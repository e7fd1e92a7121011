//! [`TcpTransport`]: the KV transfer protocol over plain TCP, for machines without UCX.
//!
//! Wire format (little-endian), sender → receiver on one connection:
//! - `PUT`    `[1][region_id u64][offset u64][len u64][len bytes]`
//! - `FLUSH`  `[2][seq u64]` — the receiver answers `[seq u64][status u8][msg_len u32][msg]`
//!   once every preceding put has been copied (status 0) or with the first refused put's error
//! - `NOTIFY` `[3][len u32][payload]` — handed to the receiver's event stream
//!
//! The receiver copies each put into its registered region only after checking, against its
//! own registration table, that the region exists and `offset + len` fits; it never trusts the
//! sender's descriptor. Frames on one connection are handled in order, so a notification is
//! seen after every put sent before it. Registration drop removes the region under the same
//! lock the copy holds, so once `drop` returns no frame can touch that memory.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::{
    check_batch, Backend, Bytes, Event, KvConnection, KvTransport, LocalMemory, MemoryKind,
    Notifications, PeerAddress, Put, RemoteRegion, Result, TransferError, TransportConfig,
    MAX_NOTIFICATION_BYTES,
};

const PUT: u8 = 1;
const FLUSH: u8 = 2;
const NOTIFY: u8 = 3;

/// Puts larger than this are a protocol violation (the connection is dropped) rather than a
/// refused put whose payload is skipped.
const MAX_PUT_BYTES: u64 = 1 << 32;

struct RegionEntry {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the entry is an address range whose validity the `LocalMemory::host` contract
// guarantees until the registration is dropped; all access goes through `Shared::regions`.
unsafe impl Send for RegionEntry {}

struct Shared {
    regions: Mutex<HashMap<u64, RegionEntry>>,
    next_region: AtomicU64,
    events: mpsc::UnboundedSender<Event>,
}

impl Shared {
    /// Copies `data` into region `id` at `offset` if, and only if, it fits.
    fn copy_in(&self, id: u64, offset: u64, data: &[u8]) -> std::result::Result<(), String> {
        let regions = self.regions.lock().unwrap_or_else(|e| e.into_inner());
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

/// KV transfer over TCP. Listens for senders at `address()`; `connect` dials other receivers.
pub struct TcpTransport {
    shared: Arc<Shared>,
    local: SocketAddr,
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
        let (tx, notifications) = Notifications::channel();
        let shared = Arc::new(Shared {
            regions: Mutex::new(HashMap::new()),
            next_region: AtomicU64::new(1),
            events: tx,
        });
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accept = tokio::spawn(accept_loop(listener, shared.clone(), conns.clone()));
        Ok(TcpTransport {
            shared,
            local,
            accept,
            conns,
            notifications: Mutex::new(Some(notifications)),
            config,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local
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
        self.shared
            .regions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
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
            let _ = shared2.events.send(Event::PeerClosed {
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
    serve_frames(BufReader::with_capacity(256 * 1024, rd), wr, shared).await
}

/// The receiver's side of the wire format (module docs): reads frames from `rd` until a clean
/// end between frames (Ok) or a protocol or I/O error (Err), writing flush acks to `wr`.
async fn serve_frames<R, W>(mut rd: R, mut wr: W, shared: &Shared) -> Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf: Vec<u8> = Vec::new();
    // The first refused put since the last flush; reported on the next flush ack.
    let mut first_error: Option<String> = None;
    loop {
        let kind = match rd.read_u8().await {
            Ok(k) => k,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        match kind {
            PUT => {
                let id = rd.read_u64_le().await?;
                let offset = rd.read_u64_le().await?;
                let len = rd.read_u64_le().await?;
                if len > MAX_PUT_BYTES {
                    return Err(TransferError::Protocol(format!("put of {len} bytes")));
                }
                // Read what arrives rather than allocating `len` up front: a header alone must
                // not make the receiver allocate 4 GiB.
                buf.clear();
                let got = (&mut rd).take(len).read_to_end(&mut buf).await?;
                if (got as u64) < len {
                    return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
                }
                if let Err(e) = shared.copy_in(id, offset, &buf) {
                    first_error.get_or_insert(e);
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
                if len > MAX_NOTIFICATION_BYTES {
                    return Err(TransferError::NotificationTooLarge(len));
                }
                let mut payload = vec![0u8; len];
                rd.read_exact(&mut payload).await?;
                let _ = shared.events.send(Event::Notification(payload));
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
/// on a connection, with `region` registered as region 1 (and no other). For the fuzz targets
/// and tests: a receiver in service reads frames from its TCP connections.
pub async fn replay_frames(input: &[u8], region: &mut [u8]) -> FrameReplay {
    let (events_tx, mut events_rx) = mpsc::unbounded_channel();
    let shared = Shared {
        regions: Mutex::new(HashMap::from([(
            1,
            RegionEntry {
                ptr: region.as_mut_ptr(),
                len: region.len(),
            },
        )])),
        next_region: AtomicU64::new(2),
        events: events_tx,
    };
    let mut acks = Vec::new();
    let result = serve_frames(input, &mut acks, &shared).await;
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
        self.shared
            .regions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.desc.region_id);
    }
}

/// A sender's connection to one TCP receiver.
pub struct TcpConnection {
    stream: tokio::sync::Mutex<TcpStream>,
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
        stream: &mut TcpStream,
        remote: &RemoteRegion,
        puts: &[Put],
    ) -> Result<()> {
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
    async fn write(&self, remote: &RemoteRegion, puts: Vec<Put>) -> Result<()> {
        let bytes = check_batch(remote, Backend::Tcp, &self.peer, &puts)?;
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
                crate::metrics::record_transfer(&self.labels, bytes, start.elapsed());
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
        let mut stream = self.stream.lock().await;
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
        PeerAddress(self.local.to_string().into_bytes())
    }

    async fn register(&self, mem: LocalMemory) -> Result<TcpRegistration> {
        mem.check()?;
        let id = self.shared.next_region.fetch_add(1, Ordering::Relaxed);
        self.shared
            .regions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(
                id,
                RegionEntry {
                    ptr: mem.ptr,
                    len: mem.len,
                },
            );
        Ok(TcpRegistration {
            shared: self.shared.clone(),
            desc: RemoteRegion {
                backend: Backend::Tcp,
                peer: self.address(),
                region_id: id,
                base: mem.ptr as u64,
                len: mem.len as u64,
                rkey: Vec::new(),
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
            stream: tokio::sync::Mutex::new(stream),
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
