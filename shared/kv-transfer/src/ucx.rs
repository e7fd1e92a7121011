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

use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tandem_ucx_sys as sys;
use tokio::sync::{mpsc, oneshot};

use crate::{
    check_batch, Backend, Bytes, Event, KvConnection, KvTransport, LocalMemory, MemoryKind,
    Notifications, PeerAddress, Put, RemoteRegion, Result, TransferError, TransportConfig,
    MAX_NOTIFICATION_BYTES,
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
        puts: Vec<(Bytes, u64)>,
        reply: oneshot::Sender<Result<()>>,
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
        events: Option<mpsc::UnboundedSender<Event>>,
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

    /// `ucp_mem_map` of `[ptr, ptr + len)`, or a UCX allocation of `len` bytes if `ptr == 0`.
    async fn map(&self, ptr: usize, len: usize) -> Result<UcxRegistration> {
        let (reply, rx) = oneshot::channel();
        self.primary
            .shared
            .send(Cmd::Register { ptr, len, reply })?;
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
                memory: MemoryKind::Host,
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

/// A lane gets at least this much of a batch: below it, waking another thread costs more
/// than the copy it would take over.
const MIN_LANE_SHARE: u64 = 1 << 20;

/// Pieces of a put shorter than this are not split off: the lane takes the whole rest.
const MIN_PIECE: u64 = 64 << 10;

/// Cuts a batch (source bytes, remote address) into one contiguous share per lane, in batch
/// order, each about `total / n` bytes (n = the lanes the batch is worth, at most `lanes`);
/// large puts are split into zero-copy `Bytes` slices at 4 KiB-aligned cuts.
fn stripe(puts: Vec<(Bytes, u64)>, total: u64, lanes: usize) -> Vec<Vec<(Bytes, u64)>> {
    let n = (total / MIN_LANE_SHARE).clamp(1, lanes.max(1) as u64) as usize;
    if n == 1 {
        return vec![puts];
    }
    let share = total.div_ceil(n as u64).next_multiple_of(4096);
    let mut out: Vec<Vec<(Bytes, u64)>> = (0..n).map(|_| Vec::new()).collect();
    let (mut lane, mut fill) = (0usize, 0u64);
    for (buf, addr) in puts {
        let len = buf.len() as u64;
        let mut off = 0u64;
        while off < len {
            if fill >= share && lane + 1 < n {
                lane += 1;
                fill = 0;
            }
            let rest = len - off;
            let mut take = if lane + 1 == n {
                rest
            } else {
                rest.min(share - fill)
            };
            if rest - take < MIN_PIECE {
                take = rest;
            }
            let piece = if off == 0 && take == len {
                buf.clone()
            } else {
                buf.slice(off as usize..(off + take) as usize)
            };
            out[lane].push((piece, addr + off));
            off += take;
            fill += take;
        }
    }
    out.retain(|l| !l.is_empty());
    out
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
        let shares = stripe(puts, bytes, self.lanes.len());
        let mut replies = Vec::with_capacity(shares.len());
        let mut result = Ok(());
        for ((shared, ep), puts) in self.lanes.iter().zip(shares) {
            let (reply, rx) = oneshot::channel();
            let sent = shared.send(Cmd::Write {
                ep: *ep,
                rkey: remote.rkey.clone(),
                puts,
                reply,
            });
            if let Err(e) = sent {
                result = Err(e);
                break;
            }
            replies.push(rx);
        }
        // The batch is complete when every lane's share is (each lane flushed its endpoint);
        // a failed lane fails the batch, after the other lanes have finished with it.
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
        result?;
        crate::metrics::record_transfer(&self.labels, bytes, start.elapsed());
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
        self.map(mem.ptr as usize, mem.len).await
    }

    async fn allocate(&self, len: usize) -> Result<(UcxRegistration, *mut u8)> {
        if len == 0 {
            return Err(TransferError::BadDescriptor("empty region".into()));
        }
        let reg = self.map(0, len).await?;
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

// ---------------------------------------------------------------------------------------
// The progress thread. Everything below runs on it and owns the raw UCX handles.
// ---------------------------------------------------------------------------------------

/// Per-endpoint state. `failed` is written by the error callback, whose `arg` points at it:
/// boxed so the address is stable, freed only after the worker is destroyed.
struct Endpoint {
    ep: sys::ucp_ep_h,
    failed: Box<std::cell::Cell<sys::ucs_status_t>>,
    /// Unpacked remote keys by packed bytes: unpacking once per region, not per batch.
    rkeys: HashMap<Vec<u8>, sys::ucp_rkey_h>,
}

/// A request in flight; `keep` owns the source bytes until UCX is done with them.
struct Pending {
    ep: u64,
    requests: Vec<*mut c_void>,
    first_error: Option<sys::ucs_status_t>,
    reply: Option<oneshot::Sender<Result<()>>>,
    deadline: Instant,
    what: &'static str,
    _keep: Vec<Bytes>,
}

struct Thread {
    ctx: sys::ucp_context_h,
    worker: sys::ucp_worker_h,
    regions: HashMap<u64, sys::ucp_mem_h>,
    eps: HashMap<u64, Endpoint>,
    next_id: AtomicU64,
    pending: Vec<Pending>,
    /// Close requests of endpoints, progressed until they finish.
    closing: Vec<*mut c_void>,
    /// Error slots of closed endpoints; UCX may still call the handler until the worker dies.
    /// Boxed (not moved into the Vec) because UCX holds their addresses.
    #[allow(clippy::vec_box)]
    dead_slots: Vec<Box<std::cell::Cell<sys::ucs_status_t>>>,
    /// Source buffers of batches whose endpoint was force-closed before UCX finished with
    /// them: freed only after the worker is destroyed.
    abandoned: Vec<Bytes>,
    op_timeout: Duration,
    peer_error_handling: bool,
}

unsafe extern "C" fn ep_error_cb(arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    // SAFETY: `arg` is the Endpoint's boxed Cell, alive until after the worker is destroyed;
    // callbacks run on the progress thread (inside ucp_worker_progress), the Cell's only user.
    let cell = unsafe { &*(arg as *const std::cell::Cell<sys::ucs_status_t>) };
    cell.set(status);
}

struct AmCtx {
    events: mpsc::UnboundedSender<Event>,
}

unsafe extern "C" fn am_recv_cb(
    arg: *mut c_void,
    _header: *const c_void,
    _header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: `arg` is the thread's boxed AmCtx, which outlives the worker.
    let ctx = unsafe { &*(arg as *const AmCtx) };
    // SAFETY: UCX passes a valid param struct for the duration of the callback.
    let attr = if param.is_null() {
        0
    } else {
        unsafe { (*param).recv_attr }
    };
    if attr & sys::UCP_AM_RECV_ATTR_FLAG_RNDV as u64 != 0 || length > MAX_NOTIFICATION_BYTES {
        // Senders force eager, so this is a foreign or oversized message: drop it.
        tracing::warn!("kv-transfer: dropping a {length}-byte rendezvous/oversized notification");
        return sys::UCS_OK;
    }
    let payload = if length == 0 || data.is_null() {
        Vec::new()
    } else {
        // SAFETY: for eager messages `data` holds `length` readable bytes during the callback;
        // we copy them and return UCS_OK, so UCX may release them afterwards.
        unsafe { std::slice::from_raw_parts(data as *const u8, length) }.to_vec()
    };
    let _ = ctx.events.send(Event::Notification(payload));
    sys::UCS_OK
}

fn progress_thread(
    rx: std_mpsc::Receiver<Cmd>,
    events: Option<mpsc::UnboundedSender<Event>>,
    init: InitSink,
    settings: LaneSettings,
) {
    let am_ctx = events.map(|events| Box::new(AmCtx { events }));
    // SAFETY: init_ucx only performs the documented UCP initialisation sequence.
    let (mut t, efd, address) = match unsafe { init_ucx(am_ctx.as_deref(), &settings) } {
        Ok(x) => x,
        Err(e) => {
            init(Err(e));
            return;
        }
    };
    init(Ok((address, WorkerPtr(t.worker))));
    t.run(&rx, efd);
    // SAFETY: teardown of handles this thread created; nothing else references them now.
    unsafe { t.teardown() };
    drop(am_ctx);
}

/// `ucp_config_read` (environment) plus the overrides of `TransportConfig::ucx_config`.
/// The caller releases the returned config with `ucp_config_release`.
unsafe fn read_config(
    overrides: &[(String, String)],
) -> std::result::Result<*mut sys::ucp_config_t, String> {
    // SAFETY: documented call sequence; strings are NUL-terminated CStrings that outlive the
    // calls; the config is released on every error path.
    unsafe {
        let mut cfg: *mut sys::ucp_config_t = ptr::null_mut();
        let st = sys::ucp_config_read(ptr::null(), ptr::null(), &mut cfg);
        if st != sys::UCS_OK {
            return Err(format!("ucp_config_read: {}", sys::status_string(st)));
        }
        for (name, value) in overrides {
            let (Ok(n), Ok(v)) = (
                std::ffi::CString::new(name.as_str()),
                std::ffi::CString::new(value.as_str()),
            ) else {
                sys::ucp_config_release(cfg);
                return Err(format!(
                    "UCX setting {name:?} = {value:?} contains a NUL byte"
                ));
            };
            let st = sys::ucp_config_modify(cfg, n.as_ptr(), v.as_ptr());
            if st != sys::UCS_OK {
                sys::ucp_config_release(cfg);
                return Err(format!(
                    "ucp_config_modify({name}={value}): {}",
                    sys::status_string(st)
                ));
            }
        }
        Ok(cfg)
    }
}

/// Context + worker + (primary lane only) AM handler + event fd.
unsafe fn init_ucx(
    am_ctx: Option<&AmCtx>,
    settings: &LaneSettings,
) -> std::result::Result<(Thread, i32, Vec<u8>), String> {
    // SAFETY (whole function): zeroed param structs are valid "no field set" values; each
    // field we fill is announced in field_mask; failures release what was created.
    unsafe {
        let mut params: sys::ucp_params_t = std::mem::zeroed();
        params.field_mask = sys::UCP_PARAM_FIELD_FEATURES as u64;
        params.features =
            (sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_AM | sys::UCP_FEATURE_WAKEUP) as u64;
        let cfg = read_config(&settings.ucx_config)?;
        let mut ctx: sys::ucp_context_h = ptr::null_mut();
        let st = sys::ucp_init(&params, cfg, &mut ctx);
        sys::ucp_config_release(cfg);
        if st != sys::UCS_OK {
            return Err(format!("ucp_init: {}", sys::status_string(st)));
        }
        let mut wp: sys::ucp_worker_params_t = std::mem::zeroed();
        wp.field_mask = sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64;
        // Single: only this thread ever calls into the worker (ucp_worker_signal excepted).
        wp.thread_mode = sys::UCS_THREAD_MODE_SINGLE;
        let mut worker: sys::ucp_worker_h = ptr::null_mut();
        let st = sys::ucp_worker_create(ctx, &wp, &mut worker);
        if st != sys::UCS_OK {
            sys::ucp_cleanup(ctx);
            return Err(format!("ucp_worker_create: {}", sys::status_string(st)));
        }
        let fail = |what: &str, st| {
            sys::ucp_worker_destroy(worker);
            sys::ucp_cleanup(ctx);
            Err(format!("{what}: {}", sys::status_string(st)))
        };
        if let Some(am_ctx) = am_ctx {
            let mut hp: sys::ucp_am_handler_param_t = std::mem::zeroed();
            hp.field_mask = (sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG) as u64;
            hp.id = AM_ID;
            hp.cb = Some(am_recv_cb);
            hp.arg = am_ctx as *const AmCtx as *mut c_void;
            let st = sys::ucp_worker_set_am_recv_handler(worker, &hp);
            if st != sys::UCS_OK {
                return fail("ucp_worker_set_am_recv_handler", st);
            }
        }
        let mut efd = -1;
        let st = sys::ucp_worker_get_efd(worker, &mut efd);
        if st != sys::UCS_OK {
            return fail("ucp_worker_get_efd", st);
        }
        let mut addr: *mut sys::ucp_address_t = ptr::null_mut();
        let mut len = 0usize;
        let st = sys::ucp_worker_get_address(worker, &mut addr, &mut len);
        if st != sys::UCS_OK {
            return fail("ucp_worker_get_address", st);
        }
        let address = std::slice::from_raw_parts(addr as *const u8, len).to_vec();
        sys::ucp_worker_release_address(worker, addr);
        let t = Thread {
            ctx,
            worker,
            regions: HashMap::new(),
            eps: HashMap::new(),
            next_id: AtomicU64::new(1),
            pending: Vec::new(),
            closing: Vec::new(),
            dead_slots: Vec::new(),
            abandoned: Vec::new(),
            op_timeout: settings.op_timeout,
            peer_error_handling: settings.peer_error_handling,
        };
        Ok((t, efd, address))
    }
}

impl Thread {
    fn id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn progress(&mut self) -> bool {
        let mut any = false;
        // SAFETY: the worker is owned by this thread.
        while unsafe { sys::ucp_worker_progress(self.worker) } != 0 {
            any = true;
        }
        any
    }

    fn run(&mut self, rx: &std_mpsc::Receiver<Cmd>, efd: i32) {
        let mut idle_spins = 0u32;
        loop {
            let mut worked = self.progress();
            loop {
                match rx.try_recv() {
                    Ok(cmd) => {
                        self.handle(cmd);
                        worked = true;
                    }
                    Err(std_mpsc::TryRecvError::Empty) => break,
                    Err(std_mpsc::TryRecvError::Disconnected) => return,
                }
            }
            worked |= self.progress();
            self.check_pending();
            if worked {
                idle_spins = 0;
                continue;
            }
            // In-flight work: spin a little (completions are usually microseconds away)
            // before paying for a sleep/wakeup.
            if !self.pending.is_empty() && idle_spins < 2000 {
                idle_spins += 1;
                std::hint::spin_loop();
                continue;
            }
            idle_spins = 0;
            // SAFETY: the worker is owned by this thread; arm after progress returned 0.
            let st = unsafe { sys::ucp_worker_arm(self.worker) };
            if st == sys::UCS_ERR_BUSY {
                continue;
            }
            let timeout_ms = if self.pending.is_empty() && self.closing.is_empty() {
                1000
            } else {
                1
            };
            let mut pfd = libc::pollfd {
                fd: efd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd; the fd belongs to the live worker.
            unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        }
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Register { ptr, len, reply } => {
                let _ = reply.send(self.register(ptr, len));
            }
            Cmd::Unregister { id, done } => {
                if let Some(memh) = self.regions.remove(&id) {
                    // SAFETY: memh came from ucp_mem_map on this context and is unmapped once.
                    unsafe { sys::ucp_mem_unmap(self.ctx, memh) };
                }
                let _ = done.send(());
            }
            Cmd::Connect { addr, reply } => {
                let _ = reply.send(self.connect(&addr));
            }
            Cmd::Write {
                ep,
                rkey,
                puts,
                reply,
            } => self.write(ep, rkey, puts, reply),
            Cmd::Notify { ep, payload, reply } => self.notify(ep, payload, reply),
            Cmd::Close { ep } => self.close_ep(ep, false),
        }
    }

    fn register(&mut self, ptr: usize, len: usize) -> Result<(u64, usize, Vec<u8>)> {
        // SAFETY: LocalMemory::host's contract makes [ptr, ptr+len) valid while registered;
        // param structs are zero-initialised and announced through field_mask.
        unsafe {
            let mut mp: sys::ucp_mem_map_params_t = std::mem::zeroed();
            mp.field_mask =
                (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH) as u64;
            mp.address = ptr as *mut c_void;
            mp.length = len;
            if ptr == 0 {
                mp.field_mask = (sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                    | sys::UCP_MEM_MAP_PARAM_FIELD_FLAGS) as u64;
                mp.flags = sys::UCP_MEM_MAP_ALLOCATE;
            }
            let mut memh: sys::ucp_mem_h = ptr::null_mut();
            let st = sys::ucp_mem_map(self.ctx, &mp, &mut memh);
            if st != sys::UCS_OK {
                return Err(ucx_err("ucp_mem_map", st));
            }
            let mut attr: sys::ucp_mem_attr_t = std::mem::zeroed();
            attr.field_mask =
                (sys::UCP_MEM_ATTR_FIELD_ADDRESS | sys::UCP_MEM_ATTR_FIELD_LENGTH) as u64;
            let st = sys::ucp_mem_query(memh, &mut attr);
            if st != sys::UCS_OK || attr.address.is_null() || attr.length < len {
                sys::ucp_mem_unmap(self.ctx, memh);
                return Err(ucx_err("ucp_mem_query", st));
            }
            let addr = attr.address as usize;
            let mut buf: *mut c_void = ptr::null_mut();
            let mut size = 0usize;
            let st = sys::ucp_rkey_pack(self.ctx, memh, &mut buf, &mut size);
            if st != sys::UCS_OK {
                sys::ucp_mem_unmap(self.ctx, memh);
                return Err(ucx_err("ucp_rkey_pack", st));
            }
            let rkey = std::slice::from_raw_parts(buf as *const u8, size).to_vec();
            sys::ucp_rkey_buffer_release(buf);
            let id = self.id();
            self.regions.insert(id, memh);
            Ok((id, addr, rkey))
        }
    }

    fn connect(&mut self, addr: &[u8]) -> Result<u64> {
        let failed = Box::new(std::cell::Cell::new(sys::UCS_OK));
        // SAFETY: `addr` is a worker address blob the peer produced; UCX parses it and
        // returns an error for garbage. The error-handler arg is the boxed Cell (stable).
        unsafe {
            let mut p: sys::ucp_ep_params_t = std::mem::zeroed();
            p.field_mask = (sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER) as u64;
            p.address = addr.as_ptr() as *const sys::ucp_address_t;
            // PEER mode makes UCX report a dead peer at once, but UCX 1.13 then excludes the
            // transports that cannot detect failures (shm, cma, cuda_ipc): see TransportConfig.
            p.err_mode = if self.peer_error_handling {
                sys::UCP_ERR_HANDLING_MODE_PEER
            } else {
                sys::UCP_ERR_HANDLING_MODE_NONE
            };
            p.err_handler.cb = Some(ep_error_cb);
            p.err_handler.arg =
                &*failed as *const std::cell::Cell<sys::ucs_status_t> as *mut c_void;
            let mut ep: sys::ucp_ep_h = ptr::null_mut();
            let st = sys::ucp_ep_create(self.worker, &p, &mut ep);
            if st != sys::UCS_OK {
                return Err(ucx_err("ucp_ep_create", st));
            }
            let id = self.id();
            self.eps.insert(
                id,
                Endpoint {
                    ep,
                    failed,
                    rkeys: HashMap::new(),
                },
            );
            Ok(id)
        }
    }

    /// The endpoint, unless it failed (then it is closed and the error returned).
    fn usable_ep(&mut self, id: u64) -> Result<sys::ucp_ep_h> {
        let Some(e) = self.eps.get(&id) else {
            return Err(TransferError::PeerFailed("endpoint closed".into()));
        };
        let st = e.failed.get();
        if st != sys::UCS_OK {
            return Err(TransferError::PeerFailed(sys::status_string(st)));
        }
        Ok(e.ep)
    }

    fn write(
        &mut self,
        id: u64,
        rkey_bytes: Vec<u8>,
        puts: Vec<(Bytes, u64)>,
        reply: oneshot::Sender<Result<()>>,
    ) {
        let ep = match self.usable_ep(id) {
            Ok(ep) => ep,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        let rkey = {
            let entry = self.eps.get_mut(&id).expect("checked by usable_ep");
            match entry.rkeys.get(&rkey_bytes) {
                Some(r) => *r,
                None => {
                    let mut r: sys::ucp_rkey_h = ptr::null_mut();
                    // SAFETY: UCX does NOT validate packed keys (garbage can crash it); the
                    // caller verified the descriptor's checksum, so these are the bytes the
                    // receiver's ucp_rkey_pack produced. UCX still reports keys it cannot use.
                    let st = unsafe {
                        sys::ucp_ep_rkey_unpack(ep, rkey_bytes.as_ptr() as *const c_void, &mut r)
                    };
                    if st != sys::UCS_OK {
                        let _ = reply.send(Err(TransferError::BadDescriptor(format!(
                            "rkey does not unpack: {}",
                            sys::status_string(st)
                        ))));
                        return;
                    }
                    entry.rkeys.insert(rkey_bytes, r);
                    r
                }
            }
        };
        let mut pending = Pending {
            ep: id,
            requests: Vec::new(),
            first_error: None,
            reply: Some(reply),
            deadline: Instant::now() + self.op_timeout,
            what: "a UCX write batch",
            _keep: Vec::with_capacity(puts.len()),
        };
        // SAFETY: zeroed request params = no callback, contiguous datatype, defaults.
        let param: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
        for (buf, addr) in puts {
            if buf.is_empty() {
                continue;
            }
            // SAFETY: `buf` stays alive in `pending._keep` until every request of the batch
            // has completed; `addr` is inside the remote region (checked by the caller).
            let r = unsafe {
                sys::ucp_put_nbx(
                    ep,
                    buf.as_ptr() as *const c_void,
                    buf.len(),
                    addr,
                    rkey,
                    &param,
                )
            };
            pending.track(r);
            pending._keep.push(buf);
            if pending.first_error.is_some() {
                break;
            }
        }
        // SAFETY: flush of a live endpoint with default params.
        let r = unsafe { sys::ucp_ep_flush_nbx(ep, &param) };
        pending.track(r);
        self.pending.push(pending);
    }

    fn notify(&mut self, id: u64, payload: Bytes, reply: oneshot::Sender<Result<()>>) {
        let ep = match self.usable_ep(id) {
            Ok(ep) => ep,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        // SAFETY: zeroed params plus an announced flags field (eager: the receiver's handler
        // only accepts data it can copy inside the callback).
        let mut param: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
        param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = sys::UCP_AM_SEND_FLAG_EAGER;
        // SAFETY: payload kept alive in `_keep` until the request completes.
        let r = unsafe {
            sys::ucp_am_send_nbx(
                ep,
                AM_ID,
                ptr::null(),
                0,
                payload.as_ptr() as *const c_void,
                payload.len(),
                &param,
            )
        };
        let mut pending = Pending {
            ep: id,
            requests: Vec::new(),
            first_error: None,
            reply: Some(reply),
            deadline: Instant::now() + self.op_timeout,
            what: "a UCX notification",
            _keep: vec![payload],
        };
        pending.track(r);
        self.pending.push(pending);
    }

    /// Completes finished operations and fails those past their deadline.
    fn check_pending(&mut self) {
        let now = Instant::now();
        let mut expired_eps = Vec::new();
        for p in &mut self.pending {
            p.requests.retain(|&r| {
                // SAFETY: `r` is a live request handle from this worker, freed exactly once here.
                let st = unsafe { sys::ucp_request_check_status(r) };
                if st == sys::UCS_INPROGRESS {
                    return true;
                }
                if st != sys::UCS_OK && p.first_error.is_none() {
                    p.first_error = Some(st);
                }
                unsafe { sys::ucp_request_free(r) };
                false
            });
            if !p.requests.is_empty() && now >= p.deadline && !expired_eps.contains(&p.ep) {
                expired_eps.push(p.ep);
            }
        }
        // A batch past its deadline: force-close its endpoint, which completes every request
        // on it with an error (so the source buffers can be released), and fail the batch.
        for ep in expired_eps {
            for p in &mut self.pending {
                if p.ep == ep {
                    if let Some(reply) = p.reply.take() {
                        let _ = reply.send(Err(TransferError::Timeout {
                            after: self.op_timeout,
                            what: p.what,
                        }));
                    }
                }
            }
            self.close_ep(ep, true);
            // Give UCX a moment to complete the force-closed requests; whatever is still
            // outstanding is abandoned (freed after the worker is gone) so the loop can idle.
            self.progress();
            let abandoned = &mut self.abandoned;
            self.pending.retain_mut(|p| {
                if p.ep != ep {
                    return true;
                }
                p.requests.retain(|&r| {
                    // SAFETY: live request of this worker; ucp_request_free on an unfinished
                    // request lets UCX release it when it completes.
                    let st = unsafe { sys::ucp_request_check_status(r) };
                    unsafe { sys::ucp_request_free(r) };
                    st == sys::UCS_INPROGRESS
                });
                if !p.requests.is_empty() {
                    abandoned.append(&mut p._keep);
                }
                false
            });
        }
        self.pending.retain_mut(|p| {
            if !p.requests.is_empty() {
                return true;
            }
            if let Some(reply) = p.reply.take() {
                let r = match p.first_error {
                    None => Ok(()),
                    Some(st) => Err(TransferError::PeerFailed(sys::status_string(st))),
                };
                let _ = reply.send(r);
            }
            false
        });
        self.closing.retain(|&r| {
            // SAFETY: close request handles of this worker, freed once on completion.
            let st = unsafe { sys::ucp_request_check_status(r) };
            if st == sys::UCS_INPROGRESS {
                return true;
            }
            unsafe { sys::ucp_request_free(r) };
            false
        });
    }

    fn close_ep(&mut self, id: u64, force: bool) {
        let Some(e) = self.eps.remove(&id) else {
            return;
        };
        // SAFETY: rkeys belong to this endpoint and are destroyed before it closes; a failed
        // endpoint must be closed with FORCE (UCX requirement), as must a timed-out one.
        unsafe {
            for (_, r) in e.rkeys {
                sys::ucp_rkey_destroy(r);
            }
            let mut param: sys::ucp_request_param_t = std::mem::zeroed();
            if force || e.failed.get() != sys::UCS_OK {
                param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
                param.flags = sys::UCP_EP_CLOSE_FLAG_FORCE;
            }
            let r = sys::ucp_ep_close_nbx(e.ep, &param);
            if sys::ucs_ptr_is_ptr(r) {
                self.closing.push(r);
            }
        }
        self.dead_slots.push(e.failed);
    }

    unsafe fn teardown(&mut self) {
        // Fail whatever is still outstanding, close every endpoint by force, wait (bounded)
        // for UCX to finish the requests, then release memory handles, worker and context.
        for p in &mut self.pending {
            if let Some(reply) = p.reply.take() {
                let _ = reply.send(Err(TransferError::Closed));
            }
        }
        let ids: Vec<u64> = self.eps.keys().copied().collect();
        for id in ids {
            self.close_ep(id, true);
        }
        let until = Instant::now() + Duration::from_secs(2);
        while (!self.pending.is_empty() || !self.closing.is_empty()) && Instant::now() < until {
            self.progress();
            self.check_pending();
        }
        // SAFETY: every handle below was created by this thread and is released once; requests
        // that did not finish in time are abandoned (their buffers leak, which is safe).
        unsafe {
            for (_, memh) in self.regions.drain() {
                sys::ucp_mem_unmap(self.ctx, memh);
            }
            // Requests still pending here are abandoned with the worker: keep their source
            // bytes until after ucp_worker_destroy, when UCX can no longer read them.
            let mut keep: Vec<Bytes> = std::mem::take(&mut self.abandoned);
            for mut p in self.pending.drain(..) {
                keep.append(&mut p._keep);
            }
            sys::ucp_worker_destroy(self.worker);
            sys::ucp_cleanup(self.ctx);
            drop(keep);
        }
    }
}

impl Pending {
    /// Records the result of a `*_nbx` call: immediate success, error, or a request to watch.
    fn track(&mut self, r: sys::ucs_status_ptr_t) {
        if sys::ucs_ptr_is_ptr(r) {
            self.requests.push(r);
        } else if sys::ucs_ptr_is_err(r) && self.first_error.is_none() {
            self.first_error = Some(sys::ucs_ptr_status(r));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Registration;

    fn batch(sizes: &[usize]) -> (Vec<(Bytes, u64)>, u64) {
        let mut addr = 0x10_0000u64;
        let mut total = 0;
        let puts = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let p = (Bytes::from(vec![i as u8; n]), addr);
                // Scattered destinations: a gap after every put.
                addr += n as u64 + 8192;
                total += n as u64;
                p
            })
            .collect();
        (puts, total)
    }

    #[test]
    fn stripe_covers_every_byte_once_in_order_and_balances_lanes() {
        let block = 3_670_016;
        for (sizes, lanes, want) in [
            (vec![block; 64], 4, 4),
            (vec![block; 3], 4, 4),
            (vec![block], 4, 3),
            (vec![131_072; 64], 4, 4),
            (vec![131_072; 4], 4, 1),
            (vec![(1 << 20) + 4100; 5], 4, 4),
            (vec![7, 0, 1 << 22, 5000, 3 << 20], 3, 3),
            (vec![block; 8], 1, 1),
        ] {
            let (puts, total) = batch(&sizes);
            let shares = stripe(puts.clone(), total, lanes);
            assert_eq!(shares.len(), want, "{sizes:?} over {lanes}");
            // Concatenating the shares gives back the batch, byte for byte and in order.
            let flat: Vec<(Bytes, u64)> = shares.iter().flatten().cloned().collect();
            let (mut i, mut off) = (0usize, 0u64);
            for (piece, addr) in &flat {
                while puts[i].0.len() as u64 == off {
                    i += 1;
                    off = 0;
                }
                assert_eq!(*addr, puts[i].1 + off);
                let src = &puts[i].0[off as usize..off as usize + piece.len()];
                assert_eq!(&piece[..], src);
                off += piece.len() as u64;
            }
            let moved: u64 = flat.iter().map(|(b, _)| b.len() as u64).sum();
            assert_eq!(moved, total);
            if want > 1 {
                let share = total.div_ceil(want as u64).next_multiple_of(4096);
                for s in &shares {
                    let n: u64 = s.iter().map(|(b, _)| b.len() as u64).sum();
                    assert!(n > 0 && n < share + MIN_PIECE, "{n} vs {share}");
                }
            }
        }
    }

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
