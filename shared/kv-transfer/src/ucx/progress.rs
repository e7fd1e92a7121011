//! The progress thread of a UCX lane: everything here runs on it and owns the raw UCX handles
//! (context, worker, endpoints, memory handles, remote keys); the rest of the transport talks
//! to it through [`super::Cmd`]s.

use std::any::Any;
use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use tandem_ucx_sys as sys;
use tokio::sync::{mpsc, oneshot};

use super::{ucx_err, Cmd, InitSink, LaneSettings, Share, WorkerPtr, AM_ID};
use crate::{Bytes, Event, MemoryKind, Result, TransferError, MAX_NOTIFICATION_BYTES};

/// What keeps an operation's source memory alive (its `Bytes`, or the owner of a GPU batch's
/// blocks) until UCX has finished reading it.
pub(super) type Held = Box<dyn Any + Send>;

/// What a UCX without CUDA support lacks, for [`TransferError::GpuMemoryUnsupported`].
pub(super) const NO_CUDA_UCX: &str = "this UCX has no CUDA memory support (no cuda_copy / \
    cuda_ipc transports): load the CUDA-enabled UCX of PyPI libucx-cu13 through LD_LIBRARY_PATH \
    (and UCX_MODULE_DIR)";

/// A registration of this context: its handle and the addresses it covers.
struct Region {
    memh: sys::ucp_mem_h,
    start: usize,
    end: usize,
}

/// Per-endpoint state. `failed` is written by the error callback, whose `arg` points at it:
/// boxed so the address is stable, freed only after the worker is destroyed.
/// The longest sleep with write batches in flight (see [`Thread::sleep_length`]).
const PENDING_SLEEP: Duration = Duration::from_micros(50);

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
    /// A write batch's phases (notifications have none).
    timing: Option<BatchTiming>,
    _keep: Vec<Held>,
}

/// Where a write batch's time goes on its lane: waiting for the thread, issuing its puts,
/// and until UCX reported them complete (and whether the thread slept meanwhile).
struct BatchTiming {
    source: MemoryKind,
    sent: Instant,
    handled: Instant,
    issued: Instant,
    slept: bool,
}

impl BatchTiming {
    fn record(&self, done: Instant) {
        crate::metrics::record_ucx_phases(
            self.source,
            [
                self.handled - self.sent,
                self.issued - self.handled,
                done.saturating_duration_since(self.issued),
            ],
            self.slept,
        );
    }
}

struct Thread {
    ctx: sys::ucp_context_h,
    worker: sys::ucp_worker_h,
    /// This context's registrations: the memory handle and the bytes it covers.
    regions: HashMap<u64, Region>,
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
    abandoned: Vec<Held>,
    op_timeout: Duration,
    peer_error_handling: bool,
    /// The memory types this UCX context registers (`ucp_context_query`: bit
    /// `UCS_MEMORY_TYPE_*`); a UCX without CUDA support has only the host bit.
    memory_types: u64,
}

unsafe extern "C" fn ep_error_cb(arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    // SAFETY: `arg` is the Endpoint's boxed Cell, alive until after the worker is destroyed;
    // callbacks run on the progress thread (inside ucp_worker_progress), the Cell's only user.
    let cell = unsafe { &*(arg as *const std::cell::Cell<sys::ucs_status_t>) };
    cell.set(status);
}

struct AmCtx {
    events: mpsc::Sender<Event>,
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
    if let Err(mpsc::error::TrySendError::Full(_)) =
        ctx.events.try_send(Event::Notification(payload))
    {
        // Nobody drains the receiver's events: dropped (and counted) rather than queued
        // without bound.
        crate::metrics::record_refused(&[], crate::metrics::Refusal::EventQueueFull);
        tracing::warn!("kv-transfer: dropping a notification, the event queue is full");
    }
    sys::UCS_OK
}

pub(super) fn progress_thread(
    rx: std_mpsc::Receiver<Cmd>,
    events: Option<mpsc::Sender<Event>>,
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

/// The memory types a context registers (host only when the query fails).
///
/// # Safety
/// `ctx` is a live context.
unsafe fn memory_types(ctx: sys::ucp_context_h) -> u64 {
    // SAFETY: a zeroed attr with only MEMORY_TYPES requested; ctx is live.
    unsafe {
        let mut attr: sys::ucp_context_attr_t = std::mem::zeroed();
        attr.field_mask = sys::UCP_ATTR_FIELD_MEMORY_TYPES as u64;
        match sys::ucp_context_query(ctx, &mut attr) {
            sys::UCS_OK => attr.memory_types,
            _ => 1 << sys::UCS_MEMORY_TYPE_HOST,
        }
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
            memory_types: memory_types(ctx),
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
            let wait = self.sleep_length();
            let timeout = libc::timespec {
                tv_sec: wait.as_secs() as libc::time_t,
                tv_nsec: wait.subsec_nanos() as libc::c_long,
            };
            let mut pfd = libc::pollfd {
                fd: efd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd (the fd belongs to the live worker) and a valid timeout.
            unsafe { libc::ppoll(&mut pfd, 1, &timeout, ptr::null()) };
        }
    }

    /// How long the thread may sleep: long when idle (a command or an event wakes it); with
    /// batches in flight, briefly — not every transport's completions wake the worker's
    /// event fd (CUDA copies are polled), so a long sleep would add its length to a batch.
    fn sleep_length(&mut self) -> Duration {
        if !self.pending.is_empty() {
            for p in &mut self.pending {
                if let Some(t) = &mut p.timing {
                    t.slept = true;
                }
            }
            return PENDING_SLEEP;
        }
        if self.closing.is_empty() {
            Duration::from_secs(1)
        } else {
            Duration::from_millis(1)
        }
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Register {
                ptr,
                len,
                memory,
                reply,
            } => {
                let _ = reply.send(self.register(ptr, len, memory));
            }
            Cmd::Unregister { id, done } => {
                if let Some(r) = self.regions.remove(&id) {
                    // SAFETY: memh came from ucp_mem_map on this context and is unmapped once.
                    unsafe { sys::ucp_mem_unmap(self.ctx, r.memh) };
                }
                let _ = done.send(());
            }
            Cmd::Connect { addr, reply } => {
                let _ = reply.send(self.connect(&addr));
            }
            Cmd::Write {
                ep,
                rkey,
                share,
                reply,
                sent,
            } => self.write(ep, rkey, share, reply, sent),
            Cmd::Notify { ep, payload, reply } => self.notify(ep, payload, reply),
            Cmd::Close { ep } => self.close_ep(ep, false),
        }
    }

    fn register(
        &mut self,
        ptr: usize,
        len: usize,
        memory: MemoryKind,
    ) -> Result<(u64, usize, Vec<u8>)> {
        let cuda = matches!(memory, MemoryKind::Cuda { .. });
        if cuda && self.memory_types & (1 << sys::UCS_MEMORY_TYPE_CUDA) == 0 {
            return Err(TransferError::GpuMemoryUnsupported {
                backend: crate::Backend::Ucx,
                missing: NO_CUDA_UCX,
            });
        }
        // SAFETY: LocalMemory's constructors make [ptr, ptr+len) valid while registered;
        // param structs are zero-initialised and announced through field_mask.
        unsafe {
            let mut mp: sys::ucp_mem_map_params_t = std::mem::zeroed();
            mp.field_mask =
                (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH) as u64;
            mp.address = ptr as *mut c_void;
            mp.length = len;
            if cuda {
                mp.field_mask |= sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE as u64;
                mp.memory_type = sys::UCS_MEMORY_TYPE_CUDA;
            }
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
            self.regions.insert(
                id,
                Region {
                    memh,
                    start: addr,
                    end: addr + attr.length,
                },
            );
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

    /// The memory handle of the registration holding `len` bytes from `src`, if any.
    fn memh_of(&self, src: usize, len: usize) -> Option<sys::ucp_mem_h> {
        let end = src.checked_add(len)?;
        self.regions
            .values()
            .find(|r| r.start <= src && end <= r.end)
            .map(|r| r.memh)
    }

    /// Issues a share of a write batch: `puts` read `source` memory, kept alive by `keep`.
    fn write(
        &mut self,
        id: u64,
        rkey_bytes: Vec<u8>,
        share: Share,
        reply: oneshot::Sender<Result<()>>,
        sent: Instant,
    ) {
        let handled = Instant::now();
        let Share { puts, source, keep } = share;
        let cuda = matches!(source, MemoryKind::Cuda { .. });
        if cuda && self.memory_types & (1 << sys::UCS_MEMORY_TYPE_CUDA) == 0 {
            let _ = reply.send(Err(TransferError::GpuMemoryUnsupported {
                backend: crate::Backend::Ucx,
                missing: NO_CUDA_UCX,
            }));
            return;
        }
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
        let mut pending = Pending::new(id, reply, self.op_timeout, "a UCX write batch", keep);
        // SAFETY: zeroed request params = no callback, contiguous datatype, defaults; a GPU
        // source announces its memory type, so UCX skips detecting it per put.
        let mut plain: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
        if cuda {
            plain.op_attr_mask = sys::UCP_OP_ATTR_FIELD_MEMORY_TYPE;
            plain.memory_type = sys::UCS_MEMORY_TYPE_CUDA;
        }
        for (src, len, addr) in puts {
            if len == 0 {
                continue;
            }
            // A source inside one of this context's registrations (a worker's own KV pool)
            // names its handle: UCX then registers nothing per put (for GPU memory each
            // registration is an IPC handle lookup, ~40 µs).
            let mut param = plain;
            if let Some(memh) = self.memh_of(src, len) {
                param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_MEMH;
                param.memh = memh;
            }
            // SAFETY: the source stays alive in `pending._keep` until every request of the
            // batch has completed; `addr` is inside the remote region (checked by the caller).
            let r = unsafe { sys::ucp_put_nbx(ep, src as *const c_void, len, addr, rkey, &param) };
            pending.track(r);
            if pending.first_error.is_some() {
                break;
            }
        }
        // SAFETY: flush of a live endpoint with default params.
        let param: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
        let r = unsafe { sys::ucp_ep_flush_nbx(ep, &param) };
        pending.track(r);
        pending.timing = Some(BatchTiming {
            source,
            sent,
            handled,
            issued: Instant::now(),
            slept: false,
        });
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
        let mut pending = Pending::new(
            id,
            reply,
            self.op_timeout,
            "a UCX notification",
            vec![Box::new(payload)],
        );
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
                if let (Ok(()), Some(t)) = (&r, &p.timing) {
                    t.record(now);
                }
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
            for (_, r) in self.regions.drain() {
                sys::ucp_mem_unmap(self.ctx, r.memh);
            }
            // Requests still pending here are abandoned with the worker: keep their source
            // bytes until after ucp_worker_destroy, when UCX can no longer read them.
            let mut keep: Vec<Held> = std::mem::take(&mut self.abandoned);
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
    /// An operation on endpoint `ep` that fails with a timeout unless done within `timeout`;
    /// `keep` holds its source bytes until then.
    fn new(
        ep: u64,
        reply: oneshot::Sender<Result<()>>,
        timeout: Duration,
        what: &'static str,
        keep: Vec<Held>,
    ) -> Self {
        Pending {
            ep,
            requests: Vec::new(),
            first_error: None,
            reply: Some(reply),
            deadline: Instant::now() + timeout,
            what,
            timing: None,
            _keep: keep,
        }
    }

    /// Records the result of a `*_nbx` call: immediate success, error, or a request to watch.
    fn track(&mut self, r: sys::ucs_status_ptr_t) {
        if sys::ucs_ptr_is_ptr(r) {
            self.requests.push(r);
        } else if sys::ucs_ptr_is_err(r) && self.first_error.is_none() {
            self.first_error = Some(sys::ucs_ptr_status(r));
        }
    }
}
