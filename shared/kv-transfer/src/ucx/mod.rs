//! [`UcxTransport`]: KV transfer over UCX (UCP RMA put + flush, active message notifications).
//!
//! Threading design: UCX workers are not thread-safe unless created in multi-thread mode, and
//! that mode costs a lock per call. Instead one dedicated thread owns the context, the worker,
//! every endpoint, memory handle and remote key; the rest of the process talks to it through a
//! command channel, and each command answers on a tokio oneshot. The thread sleeps in `poll(2)`
//! on the worker's event fd (`ucp_worker_get_efd` + `ucp_worker_arm`), so an idle transport
//! uses no CPU; a command wakes it with `ucp_worker_signal`, the one UCP call documented as
//! safe from any thread. While operations are in flight it spins on `ucp_worker_progress` for
//! a short while before sleeping again, with a short poll timeout to check deadlines.
//!
//! Lanes (`TransportConfig::ucx_lanes`): a connection has one endpoint per lane, each lane a
//! context + worker + progress thread as above. Lane 0 (the *primary*) is the one whose
//! address is published: it owns the registrations and receives notifications; lanes 1.. are
//! send-only, started on the first `connect`, and connect to the same receiver worker. A write
//! batch is cut into one contiguous share per lane (large puts are split into zero-copy
//! slices; small batches use fewer lanes) and every lane issues its share at once. On one host
//! a put through shared memory or cma is a copy made by the sending thread, so one lane moves
//! data at one core's memory bandwidth; lanes make the copies of a batch run on several cores.
//! The receiver needs no thread of its own for that (one-sided puts).
//!
//! On each lane, a share issues one `ucp_put_nbx` per put and one `ucp_ep_flush_nbx`; it
//! completes when the flush and every put request have completed, i.e. the data is in the
//! receiver's memory, and the batch completes when every lane's share has (a failed lane fails
//! the batch, once the others are done). The source bytes ([`Put::local`]) stay owned by the
//! lane's thread until then, even if the caller's future was dropped. Every share has a
//! deadline (`op_timeout`): past it the lane's endpoint is closed by force and the batch fails
//! with a timeout, so a dead receiver never hangs a sender. With
//! `TransportConfig::ucx_peer_error_handling` the endpoints use `UCP_ERR_HANDLING_MODE_PEER`
//! and a dead receiver fails outstanding requests at once — but UCX then only uses transports
//! that can detect peer failure (tcp, RDMA), not shared memory / cma / cuda_ipc. The default
//! is UCX's own (`NONE`), which lets it pick the fastest transport (what `ucx_perftest` does).
//! Requests of a force-closed endpoint that UCX never completes are abandoned: their source
//! buffers are kept until the worker is destroyed, then released.
//!
//! Notifications are UCP active messages (id [`AM_ID`], eager only, at most
//! [`MAX_NOTIFICATION_BYTES`]); the handler copies the payload to the event channel. The
//! notification is sent (on lane 0) after the preceding batch's flushes completed on every
//! lane, which is what orders it after those puts.
//!
//! Limitation: the receiver does not learn that a sender died (it holds no endpoint to it);
//! it bounds its wait with [`crate::Notifications::recv_timeout`] / the lease deadline. A
//! watch endpoint back to the sender in PEER mode was tried and is not possible: UCX requires
//! both directions between two workers to use the same error mode.

use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tandem_ucx_sys as sys;
use tokio::sync::{mpsc, oneshot};

use crate::{
    check_batch, check_device_batch, Backend, Bytes, DeviceBatch, Event, KvConnection, KvTransport,
    LocalMemory, MemoryKind, Notifications, PeerAddress, Put, RemoteRegion, Result, TransferError,
    TransportConfig, MAX_NOTIFICATION_BYTES,
};

/// Active-message id of notifications.
pub const AM_ID: u32 = 0x7a4b;

fn ucx_err(op: &'static str, status: sys::ucs_status_t) -> TransferError {
    TransferError::Ucx {
        op,
        msg: sys::status_string(status),
    }
}

/// Raw UCP handles are plain pointers; they are only dereferenced by UCX on the owning thread.
#[derive(Clone, Copy)]
struct WorkerPtr(sys::ucp_worker_h);
// SAFETY: only used for ucp_worker_signal, which UCX documents as callable from any thread, and
// only while the worker is alive (guarded by `Shared::worker`'s mutex, cleared before destroy).
unsafe impl Send for WorkerPtr {}

enum Cmd {
    Register {
        ptr: usize,
        len: usize,
        memory: MemoryKind,
        reply: oneshot::Sender<Result<(u64, usize, Vec<u8>)>>,
    },
    Unregister {
        id: u64,
        done: std_mpsc::Sender<()>,
    },
    Connect {
        addr: Vec<u8>,
        reply: oneshot::Sender<Result<u64>>,
    },
    Write {
        ep: u64,
        rkey: Vec<u8>,
        share: Share,
        reply: oneshot::Sender<Result<()>>,
        /// When the command was sent (the queue phase of the lane's timing).
        sent: Instant,
    },
    Notify {
        ep: u64,
        payload: Bytes,
        reply: oneshot::Sender<Result<()>>,
    },
    Close {
        ep: u64,
    },
}

/// One put as the progress thread issues it: source address, length, remote address.
type RawPut = (usize, usize, u64);

/// A lane's share of a write batch: its puts, the memory they read, and what keeps that
/// memory alive until UCX has read it (held by the lane even if the caller goes away).
struct Share {
    puts: Vec<RawPut>,
    source: MemoryKind,
    keep: Vec<progress::Held>,
}

impl Share {
    /// Puts from host bytes, each kept by its own `Bytes` handle.
    fn host(puts: Vec<(Bytes, u64)>) -> Self {
        let raw = puts
            .iter()
            .map(|(b, addr)| (b.as_ptr() as usize, b.len(), *addr))
            .collect();
        Share {
            puts: raw,
            source: MemoryKind::Host,
            keep: puts
                .into_iter()
                .map(|(b, _)| Box::new(b) as progress::Held)
                .collect(),
        }
    }
}

struct Shared {
    tx: Mutex<Option<std_mpsc::Sender<Cmd>>>,
    worker: Mutex<Option<WorkerPtr>>,
}

impl Shared {
    fn send(&self, cmd: Cmd) -> Result<()> {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let tx = tx.as_ref().ok_or(TransferError::Closed)?;
        tx.send(cmd).map_err(|_| TransferError::Closed)?;
        if let Some(w) = *self.worker.lock().unwrap_or_else(|e| e.into_inner()) {
            // SAFETY: the worker is alive while it is in `self.worker` (see WorkerPtr).
            unsafe { sys::ucp_worker_signal(w.0) };
        }
        Ok(())
    }
}

/// Settings every lane's progress thread starts with.
#[derive(Clone)]
struct LaneSettings {
    op_timeout: Duration,
    peer_error_handling: bool,
    ucx_config: Vec<(String, String)>,
}

impl LaneSettings {
    fn of(config: &TransportConfig) -> Self {
        LaneSettings {
            op_timeout: config.op_timeout,
            peer_error_handling: config.ucx_peer_error_handling,
            ucx_config: config.ucx_config.clone(),
        }
    }
}

/// One UCX context + worker and the progress thread that owns them. Dropping it stops the
/// thread, which fails outstanding work and releases every UCX handle of the lane.
struct Lane {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

type InitReply = std::result::Result<(Vec<u8>, WorkerPtr), String>;

/// How a new progress thread reports the outcome of its initialisation.
type InitSink = Box<dyn FnOnce(InitReply) + Send>;

impl Lane {
    /// Starts the progress thread of a lane; `init` hears whether UCX came up. `events` is
    /// where received notifications go (only the primary lane, whose address is published,
    /// registers the active-message handler).
    fn spawn(
        name: String,
        settings: LaneSettings,
        events: Option<mpsc::Sender<Event>>,
        init: InitSink,
    ) -> Result<(std_mpsc::Sender<Cmd>, JoinHandle<()>)> {
        let (tx, rx) = std_mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || progress_thread(rx, events, init, settings))
            .map_err(TransferError::Io)?;
        Ok((tx, thread))
    }

    fn new(tx: std_mpsc::Sender<Cmd>, thread: JoinHandle<()>, worker: WorkerPtr) -> Self {
        Lane {
            shared: Arc::new(Shared {
                tx: Mutex::new(Some(tx)),
                worker: Mutex::new(Some(worker)),
            }),
            thread: Some(thread),
        }
    }

    /// Starts a send-only lane and waits (asynchronously) until its UCX is up.
    async fn start_send_lane(index: usize, settings: LaneSettings) -> Result<Lane> {
        let (init_tx, init_rx) = oneshot::channel();
        let (tx, thread) = Lane::spawn(
            format!("ucx-lane-{index}"),
            settings,
            None,
            Box::new(move |r| {
                let _ = init_tx.send(r);
            }),
        )?;
        match init_rx.await {
            Ok(Ok((_, worker))) => Ok(Lane::new(tx, thread, worker)),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(TransferError::UcxUnavailable(e))
            }
            Err(_) => Err(TransferError::UcxUnavailable(format!(
                "the progress thread of UCX lane {index} died"
            ))),
        }
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        // Closing the channel tells the thread to fail outstanding work, close endpoints, unmap
        // every registration and destroy the worker and context; signal it so it notices now.
        self.shared
            .tx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(w) = self
            .shared
            .worker
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            // SAFETY: the worker is still alive: only the thread destroys it, after this.
            unsafe { sys::ucp_worker_signal(w.0) };
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// KV transfer over UCX. See the module documentation for the threading design.
pub struct UcxTransport {
    /// Send-only lanes 1..`ucx_lanes`, started by the first `connect` (declared before
    /// `primary` so they stop first).
    extra: tokio::sync::OnceCell<Vec<Lane>>,
    /// Lane 0: the published worker address, registrations, notifications, and the first
    /// share of every write batch.
    primary: Lane,
    address: PeerAddress,
    notifications: Mutex<Option<Notifications>>,
    config: TransportConfig,
}

impl UcxTransport {
    /// Initialises UCX (context with RMA + AM + wakeup, one worker) on a new progress thread.
    /// The extra send lanes of [`TransportConfig::ucx_lanes`] start on the first `connect`.
    /// Fails with [`TransferError::UcxUnavailable`] if UCX cannot be initialised.
    pub fn new(config: TransportConfig) -> Result<Self> {
        let (ev_tx, notifications) = Notifications::channel();
        let (init_tx, init_rx) = std_mpsc::channel();
        let (tx, thread) = Lane::spawn(
            "ucx-progress".into(),
            LaneSettings::of(&config),
            Some(ev_tx),
            Box::new(move |r| {
                let _ = init_tx.send(r);
            }),
        )?;
        let (address, worker) = match init_rx.recv() {
            Ok(Ok(x)) => x,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(TransferError::UcxUnavailable(e));
            }
            Err(_) => {
                return Err(TransferError::UcxUnavailable(
                    "the UCX progress thread died".into(),
                ))
            }
        };
        Ok(UcxTransport {
            extra: tokio::sync::OnceCell::new(),
            primary: Lane::new(tx, thread, worker),
            address: PeerAddress(address),
            notifications: Mutex::new(Some(notifications)),
            config,
        })
    }

    /// Version of the libucp loaded at run time.
    pub fn library_version() -> (u32, u32, u32) {
        sys::library_version()
    }

    /// The lanes a connection uses: the primary, then the extra ones (started here, once).
    /// An extra lane that fails to start is logged and left out: fewer lanes, not an error.
    async fn lanes(&self) -> Vec<Arc<Shared>> {
        let wanted = self.config.ucx_lanes.max(1);
        let extra = self
            .extra
            .get_or_init(|| async {
                let settings = LaneSettings::of(&self.config);
                let mut lanes = Vec::with_capacity(wanted - 1);
                for i in 1..wanted {
                    match Lane::start_send_lane(i, settings.clone()).await {
                        Ok(l) => lanes.push(l),
                        Err(e) => {
                            tracing::warn!("kv-transfer: UCX lane {i} not started: {e}");
                            break;
                        }
                    }
                }
                lanes
            })
            .await;
        std::iter::once(&self.primary)
            .chain(extra.iter())
            .map(|l| l.shared.clone())
            .collect()
    }

    /// `ucp_mem_map` of `[ptr, ptr + len)` in `memory`, or a UCX allocation of `len` bytes of
    /// host memory if `ptr == 0`.
    async fn map(&self, ptr: usize, len: usize, memory: MemoryKind) -> Result<UcxRegistration> {
        let (reply, rx) = oneshot::channel();
        self.primary.shared.send(Cmd::Register {
            ptr,
            len,
            memory,
            reply,
        })?;
        let (id, base, rkey) = answer(rx, self.config.op_timeout, "ucp_mem_map").await?;
        Ok(UcxRegistration {
            shared: self.primary.shared.clone(),
            desc: RemoteRegion {
                backend: Backend::Ucx,
                peer: self.address.clone(),
                region_id: id,
                base: base as u64,
                len: len as u64,
                rkey,
                secret: crate::RegionSecret::default(),
                memory,
                check: 0,
            }
            .sealed(),
        })
    }
}

async fn answer<T>(
    rx: oneshot::Receiver<Result<T>>,
    after: Duration,
    what: &'static str,
) -> Result<T> {
    match tokio::time::timeout(after, rx).await {
        Ok(Ok(r)) => r,
        Ok(Err(_)) => Err(TransferError::Closed),
        Err(_) => Err(TransferError::Timeout { after, what }),
    }
}

/// A registered region of a [`UcxTransport`]; dropping it unmaps the memory (synchronously,
/// bounded to a few seconds) so UCX no longer references it afterwards.
pub struct UcxRegistration {
    shared: Arc<Shared>,
    desc: RemoteRegion,
}

impl crate::Registration for UcxRegistration {
    fn descriptor(&self) -> &RemoteRegion {
        &self.desc
    }
}

impl Drop for UcxRegistration {
    fn drop(&mut self) {
        let (done, wait) = std_mpsc::channel();
        if self
            .shared
            .send(Cmd::Unregister {
                id: self.desc.region_id,
                done,
            })
            .is_ok()
        {
            let _ = wait.recv_timeout(Duration::from_secs(5));
        }
    }
}

/// A sender's endpoints to one UCX receiver, one per lane (lane 0 also carries the
/// notifications); dropping it closes them.
pub struct UcxConnection {
    lanes: Vec<(Arc<Shared>, u64)>,
    peer: PeerAddress,
    op_timeout: Duration,
    labels: Vec<(String, String)>,
}

impl UcxConnection {
    /// How many lanes this connection stripes write batches over.
    pub fn lanes(&self) -> usize {
        self.lanes.len()
    }
}

impl Drop for UcxConnection {
    fn drop(&mut self) {
        for (shared, ep) in &self.lanes {
            let _ = shared.send(Cmd::Close { ep: *ep });
        }
    }
}

impl UcxConnection {
    /// Sends each share to its lane (share i to lane i) and waits for all of them: the batch
    /// is complete when every lane's share is (each lane flushed its endpoint); a failed lane
    /// fails the batch, after the other lanes have finished with it.
    async fn issue(&self, remote: &RemoteRegion, shares: Vec<Share>) -> Result<()> {
        let mut replies = Vec::with_capacity(shares.len());
        let mut result = Ok(());
        for ((shared, ep), share) in self.lanes.iter().zip(shares) {
            let (reply, rx) = oneshot::channel();
            let sent = shared.send(Cmd::Write {
                ep: *ep,
                rkey: remote.rkey.clone(),
                share,
                reply,
                sent: Instant::now(),
            });
            if let Err(e) = sent {
                result = Err(e);
                break;
            }
            replies.push(rx);
        }
        for rx in replies {
            // The thread enforces op_timeout itself; the extra second covers a wedged thread.
            let r = answer(
                rx,
                self.op_timeout + Duration::from_secs(1),
                "a UCX write batch",
            )
            .await;
            if result.is_ok() {
                result = r;
            }
        }
        result
    }
}

impl KvConnection for UcxConnection {
    async fn write(&self, remote: &RemoteRegion, puts: Vec<Put>) -> Result<()> {
        let bytes = check_batch(remote, Backend::Ucx, &self.peer, &puts)?;
        if remote.rkey.is_empty() {
            return Err(TransferError::BadDescriptor("empty rkey".into()));
        }
        let start = Instant::now();
        // Absolute addresses cannot overflow: check_batch validated base + len and every
        // offset + len <= len.
        let puts = puts
            .into_iter()
            .filter(|p| !p.local.is_empty())
            .map(|p| (p.local, remote.base + p.offset))
            .collect();
        let shares = stripe(puts, bytes, self.lanes.len())
            .into_iter()
            .map(Share::host)
            .collect();
        self.issue(remote, shares).await?;
        crate::metrics::record_transfer(&self.labels, remote.memory, bytes, start.elapsed());
        Ok(())
    }

    /// GPU to GPU: one share on lane 0 (the copies run on UCX's CUDA streams, not on the
    /// lane's thread, so striping over lanes buys nothing), adjacent puts merged first.
    async fn write_device(&self, remote: &RemoteRegion, batch: DeviceBatch) -> Result<()> {
        let bytes = check_device_batch(remote, Backend::Ucx, &self.peer, &batch)?;
        if remote.rkey.is_empty() {
            return Err(TransferError::BadDescriptor("empty rkey".into()));
        }
        let start = Instant::now();
        let (device, puts, keep) = batch.into_parts();
        let share = Share {
            puts: puts
                .iter()
                .map(|p| (p.src as usize, p.len as usize, remote.base + p.offset))
                .collect(),
            source: MemoryKind::Cuda { device },
            keep: vec![keep],
        };
        self.issue(remote, vec![share]).await?;
        crate::metrics::record_transfer(&self.labels, remote.memory, bytes, start.elapsed());
        Ok(())
    }

    async fn notify(&self, payload: Bytes) -> Result<()> {
        if payload.len() > MAX_NOTIFICATION_BYTES {
            return Err(TransferError::NotificationTooLarge(payload.len()));
        }
        // Lane 0's endpoint. Ordering: every write that returned before this call had all of
        // its lanes flushed, i.e. its data is in the receiver's memory already.
        let (shared, ep) = &self.lanes[0];
        let (reply, rx) = oneshot::channel();
        shared.send(Cmd::Notify {
            ep: *ep,
            payload,
            reply,
        })?;
        answer(
            rx,
            self.op_timeout + Duration::from_secs(1),
            "a UCX notification",
        )
        .await
    }
}

impl KvTransport for UcxTransport {
    type Registration = UcxRegistration;
    type Connection = UcxConnection;

    fn backend(&self) -> Backend {
        Backend::Ucx
    }

    fn address(&self) -> PeerAddress {
        self.address.clone()
    }

    async fn register(&self, mem: LocalMemory) -> Result<UcxRegistration> {
        mem.check()?;
        self.map(mem.ptr as usize, mem.len, mem.kind()).await
    }

    async fn allocate(&self, len: usize) -> Result<(UcxRegistration, *mut u8)> {
        if len == 0 {
            return Err(TransferError::BadDescriptor("empty region".into()));
        }
        let reg = self.map(0, len, MemoryKind::Host).await?;
        let ptr = reg.desc.base as *mut u8;
        Ok((reg, ptr))
    }

    async fn connect(&self, peer: &PeerAddress) -> Result<UcxConnection> {
        if peer.0.is_empty() {
            return Err(TransferError::BadDescriptor(
                "empty UCX worker address".into(),
            ));
        }
        let lanes = self.lanes().await;
        let mut waits = Vec::with_capacity(lanes.len());
        for shared in &lanes {
            let (reply, rx) = oneshot::channel();
            shared.send(Cmd::Connect {
                addr: peer.0.clone(),
                reply,
            })?;
            waits.push(rx);
        }
        let mut eps = Vec::with_capacity(lanes.len());
        let mut result = Ok(());
        for (shared, rx) in lanes.into_iter().zip(waits) {
            match answer(rx, self.config.op_timeout, "ucp_ep_create").await {
                Ok(ep) => eps.push((shared, ep)),
                Err(e) => {
                    if result.is_ok() {
                        result = Err(e);
                    }
                }
            }
        }
        // Dropping the connection closes the endpoints that were created.
        let conn = UcxConnection {
            lanes: eps,
            peer: peer.clone(),
            op_timeout: self.config.op_timeout,
            labels: self.config.metric_labels.clone(),
        };
        result.map(|()| conn)
    }

    fn take_notifications(&self) -> Option<Notifications> {
        self.notifications
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }
}

mod progress;
mod stripe;
use progress::progress_thread;
use stripe::stripe;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Registration;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_lane_fails_the_batch() {
        let mut cfg = TransportConfig::new(Backend::Ucx);
        cfg.op_timeout = Duration::from_secs(10);
        cfg.ucx_lanes = 4;
        let rx = UcxTransport::new(cfg.clone()).unwrap();
        let tx = UcxTransport::new(cfg).unwrap();
        let mut events = rx.take_notifications().unwrap();
        let len = 16 << 20;
        let (reg, ptr) = rx.allocate(len).await.unwrap();
        let desc = reg.descriptor().clone();
        let conn = tx.connect(&rx.address()).await.unwrap();
        assert_eq!(conn.lanes(), 4);
        let put = |v: u8| Put {
            local: vec![v; 8 << 20].into(),
            offset: 0,
        };
        conn.write(&desc, vec![put(1)]).await.unwrap();
        // SAFETY: the registration is alive and no write is in flight.
        let got = unsafe { std::slice::from_raw_parts(ptr, 8 << 20) };
        assert!(got.iter().all(|&b| b == 1));

        // Lane 2's endpoint goes away: a batch striped over all lanes fails as a whole.
        let (shared, ep) = &conn.lanes[2];
        shared.send(Cmd::Close { ep: *ep }).unwrap();
        let err = conn.write(&desc, vec![put(2)]).await.unwrap_err();
        assert!(matches!(err, TransferError::PeerFailed(_)), "{err}");
        // Small batches (one lane) and notifications still use lane 0, which is healthy.
        conn.write(
            &desc,
            vec![Put {
                local: vec![3u8; 4096].into(),
                offset: 0,
            }],
        )
        .await
        .unwrap();
        conn.notify(Bytes::from_static(b"after")).await.unwrap();
        assert_eq!(
            events
                .next_notification(Duration::from_secs(10))
                .await
                .unwrap(),
            b"after"
        );
        drop(conn);
        drop(reg);
    }
}
