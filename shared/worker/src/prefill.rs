//! The prefill worker (`--disaggregation-mode prefill`): computes a prompt and writes the KV
//! blocks a decode worker's lease asks for straight into that worker's registered memory,
//! batch by batch as the engine completes them (so transfer overlaps the next chunk's
//! compute), then returns the first token and the request's sampling state.
//!
//! Each write runs in its own task, so a cancelled call never drops a put halfway: the task
//! stops at the next batch boundary. `FenceLease` answers only once the lease's task has
//! ended (or marks a lease it has not seen as fenced), which is what lets the decode worker
//! reuse the blocks of a revoked lease safely.
//!
//! Where the blocks go is the [`KvWriter`]: the KV transport, or (simulated engines of
//! `tandem-mocker`) a [`SimulatedLink`] that moves no bytes but takes their time; everything
//! else here is the same code for both.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_engine::engine::{EngineHandle, PrefillEvent};
use tandem_engine::request::{FinishReason, Request};
use tandem_engine::sampler::SamplingParams;
use tandem_kv_transfer::{AnyConnection, AnyTransport, Bytes, KvConnection, KvTransport, Put};
use tandem_kv_transfer::{PeerAddress, RemoteRegion};
use tandem_protocol::worker::*;
use tokio::sync::{oneshot, watch, Notify};
use tonic::Status;

use crate::grpc::to_proto;
use crate::transport::{KvWriter, SimulatedLink};

/// Fenced leases remembered (so a Prefill arriving after its fence is refused).
const FENCED_MEMORY: usize = 65_536;

type LeaseKey = (u64, u64);

struct ActiveWrite {
    epoch: u64,
    cancel: Arc<Cancel>,
    /// Becomes true when the write task has ended.
    done: watch::Receiver<bool>,
}

#[derive(Default)]
struct Fenced {
    order: VecDeque<LeaseKey>,
    set: HashSet<LeaseKey>,
}

impl Fenced {
    fn insert(&mut self, k: LeaseKey) {
        if self.set.insert(k) {
            self.order.push_back(k);
            if self.order.len() > FENCED_MEMORY {
                if let Some(old) = self.order.pop_front() {
                    self.set.remove(&old);
                }
            }
        }
    }
}

pub struct PrefillSide {
    engine: EngineHandle,
    writer: KvWriter,
    layout_id: String,
    block_bytes: usize,
    connections: tokio::sync::Mutex<HashMap<PeerAddress, Arc<AnyConnection>>>,
    writes: Mutex<(HashMap<LeaseKey, ActiveWrite>, Fenced)>,
    pub bytes_sent: AtomicU64,
}

/// Sets the flag when dropped unless disarmed: a cancelled gRPC call stops its write task.
struct CancelOnDrop(Option<Arc<Cancel>>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            c.set();
        }
    }
}

/// Where one lease's blocks go: a transport connection, or the simulated link.
enum Link {
    Real(Arc<AnyConnection>),
    Simulated(Arc<SimulatedLink>),
}

impl PrefillSide {
    pub fn new(engine: EngineHandle, transport: Arc<AnyTransport>, layout_id: String) -> Self {
        Self::with_writer(engine, KvWriter::Transport(transport), layout_id)
    }

    /// A prefill side whose writes go through `writer` (the transport, or a simulated link).
    pub fn with_writer(engine: EngineHandle, writer: KvWriter, layout_id: String) -> Self {
        let block_bytes = engine.layout().block_bytes();
        PrefillSide {
            engine,
            writer,
            layout_id,
            block_bytes,
            connections: tokio::sync::Mutex::new(HashMap::new()),
            writes: Mutex::new((HashMap::new(), Fenced::default())),
            bytes_sent: AtomicU64::new(0),
        }
    }

    fn writes(&self) -> std::sync::MutexGuard<'_, (HashMap<LeaseKey, ActiveWrite>, Fenced)> {
        self.writes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Leases being written now.
    pub fn active(&self) -> usize {
        self.writes().0.len()
    }

    pub async fn prefill(self: &Arc<Self>, req: PrefillRequest) -> Result<PrefillReply, Status> {
        let lease = req
            .lease
            .ok_or_else(|| Status::invalid_argument("lease is missing"))?;
        let request = req
            .request
            .ok_or_else(|| Status::invalid_argument("request is missing"))?;
        if lease.kv_layout_id != self.layout_id {
            return Err(Status::failed_precondition(format!(
                "KV layouts differ: the decode worker's is {:?}, this prefill worker's is {:?}",
                lease.kv_layout_id, self.layout_id
            )));
        }
        let region: RemoteRegion = serde_json::from_str(&lease.region_json)
            .map_err(|e| Status::invalid_argument(format!("lease.region_json: {e}")))?;
        region
            .validate()
            .map_err(|e| Status::invalid_argument(format!("lease.region_json: {e}")))?;
        let params: SamplingParams = if request.sampling_params_json.is_empty() {
            SamplingParams::default()
        } else {
            serde_json::from_str(&request.sampling_params_json)
                .map_err(|e| Status::invalid_argument(format!("sampling_params_json: {e}")))?
        };
        params.validate().map_err(Status::invalid_argument)?;
        let key = (lease.owner_instance_id, lease.lease_id);
        let cancel = Arc::new(Cancel::default());
        let (done_tx, done_rx) = watch::channel(false);
        {
            let mut w = self.writes();
            if w.1.set.contains(&key) {
                return Err(Status::aborted(format!(
                    "lease {} was revoked before its prefill started",
                    lease.lease_id
                )));
            }
            if w.0.contains_key(&key) {
                return Err(Status::already_exists(format!(
                    "lease {} is already being written",
                    lease.lease_id
                )));
            }
            w.0.insert(
                key,
                ActiveWrite {
                    epoch: lease.epoch,
                    cancel: cancel.clone(),
                    done: done_rx,
                },
            );
        }
        let (result_tx, result_rx) = oneshot::channel();
        let me = self.clone();
        let task_cancel = cancel.clone();
        tokio::spawn(async move {
            let engine_request = Request {
                request_id: request.request_id,
                prompt: request.prompt,
                params,
            };
            let r = me.write(engine_request, lease, region, &task_cancel).await;
            me.writes().0.remove(&key);
            let _ = done_tx.send(true);
            let _ = result_tx.send(r);
        });
        let mut guard = CancelOnDrop(Some(cancel));
        let r = result_rx
            .await
            .unwrap_or_else(|_| Err(Status::aborted("the prefill task ended without a result")));
        guard.0 = None;
        r
    }

    async fn connection(&self, peer: &PeerAddress) -> Result<Arc<AnyConnection>, Status> {
        let transport = match &self.writer {
            KvWriter::Transport(t) => t,
            KvWriter::Simulated(_) => {
                return Err(Status::internal("a simulated writer has no connections"))
            }
        };
        let mut m = self.connections.lock().await;
        if let Some(c) = m.get(peer) {
            return Ok(c.clone());
        }
        let c = Arc::new(transport.connect(peer).await.map_err(|e| {
            Status::aborted(format!(
                "cannot connect to the decode worker's KV transport: {e}"
            ))
        })?);
        m.insert(peer.clone(), c.clone());
        Ok(c)
    }

    async fn forget_connection(&self, peer: &PeerAddress) {
        self.connections.lock().await.remove(peer);
    }

    /// Runs the prompt and writes its blocks. Every error is returned after the last put of
    /// this lease has completed or failed: the caller may then treat the writer as stopped.
    async fn write(
        &self,
        request: Request,
        lease: KvLease,
        region: RemoteRegion,
        cancel: &Cancel,
    ) -> Result<PrefillReply, Status> {
        let deadline = Instant::now() + Duration::from_millis(lease.ttl_ms.max(1));
        let first_block = lease.first_block as usize;
        let want = lease.block_offsets.len();
        let prompt_len = request.prompt.len();
        let request_id = request.request_id.clone();
        let mut stream = self
            .engine
            .prefill(request, first_block)
            .await
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let link = match &self.writer {
            KvWriter::Transport(_) => Link::Real(self.connection(&region.peer).await?),
            KvWriter::Simulated(s) => Link::Simulated(s.clone()),
        };
        let bb = self.block_bytes;
        let mut sent_blocks = 0usize;
        let mut sent_bytes = 0u64;
        let t0 = Instant::now();
        loop {
            if cancel.is_set() {
                return Err(Status::aborted("the lease was revoked"));
            }
            let event = tokio::select! {
                ev = stream.next() => ev,
                _ = tokio::time::sleep_until(deadline.into()) => {
                    return Err(Status::aborted(format!(
                        "lease {} expired (ttl {} ms) before the prefill finished",
                        lease.lease_id, lease.ttl_ms
                    )));
                }
                _ = cancel.wait() => return Err(Status::aborted("the lease was revoked")),
            };
            match event {
                Some(PrefillEvent::Blocks {
                    first_block: at,
                    data,
                }) => {
                    let n = data.len() / bb;
                    if data.len() % bb != 0
                        || at < first_block
                        || at + n > first_block + want
                        || at != first_block + sent_blocks
                    {
                        return Err(Status::internal(format!(
                            "engine produced blocks {at}..{} ({} bytes) outside the lease's {first_block}..{}",
                            at + n,
                            data.len(),
                            first_block + want
                        )));
                    }
                    let offsets = &lease.block_offsets[at - first_block..at + n - first_block];
                    let written = match &link {
                        Link::Real(conn) => {
                            let data = Bytes::from(data);
                            let puts: Vec<Put> = (0..n)
                                .map(|j| Put {
                                    local: data.slice(j * bb..(j + 1) * bb),
                                    offset: offsets[j],
                                })
                                .collect();
                            crate::failpoints::prefill_hold(&request_id, at + n - 1).await;
                            if let Err(e) = conn.write(&region, puts).await {
                                self.forget_connection(&region.peer).await;
                                return Err(Status::aborted(format!(
                                    "writing KV blocks to the decode worker failed: {e}"
                                )));
                            }
                            data.len() as u64
                        }
                        Link::Simulated(sim) => {
                            // No bytes move: the export is dropped unread.
                            drop(data);
                            crate::failpoints::prefill_hold(&request_id, at + n - 1).await;
                            sim.write(&region, offsets, bb as u64).await.map_err(|e| {
                                Status::aborted(format!(
                                    "writing KV blocks to the decode worker failed: {e}"
                                ))
                            })?
                        }
                    };
                    sent_blocks += n;
                    sent_bytes += written;
                    self.bytes_sent.fetch_add(written, Ordering::Relaxed);
                }
                Some(PrefillEvent::Done { output, state }) => {
                    if output.finish_reason == Some(FinishReason::Abort) {
                        return Err(Status::aborted(format!(
                            "the prefill was aborted: {}",
                            output.error.as_deref().unwrap_or("engine abort")
                        )));
                    }
                    if sent_blocks != want {
                        return Err(Status::internal(format!(
                            "the prefill sent {sent_blocks} of the lease's {want} blocks"
                        )));
                    }
                    let state_json = serde_json::to_string(&state)
                        .map_err(|e| Status::internal(format!("state: {e}")))?;
                    tracing::debug!(
                        lease_id = lease.lease_id,
                        prompt_len,
                        blocks = sent_blocks,
                        bytes = sent_bytes,
                        ms = t0.elapsed().as_secs_f64() * 1e3,
                        "remote prefill done"
                    );
                    let prefill_cached_tokens = state.cached_prompt_tokens as u32;
                    return Ok(PrefillReply {
                        first: Some(to_proto(output)),
                        state_json,
                        bytes_transferred: sent_bytes,
                        blocks_transferred: sent_blocks as u32,
                        prefill_cached_tokens,
                    });
                }
                None => {
                    return Err(Status::aborted(
                        "the prefill ended without a result (request aborted or engine stopped)",
                    ))
                }
            }
        }
    }

    /// Stops writing for a lease and returns once no write for it can happen any more.
    pub async fn fence(&self, req: FenceLeaseRequest) -> FenceLeaseReply {
        let key = (req.owner_instance_id, req.lease_id);
        let active = {
            let mut w = self.writes();
            w.1.insert(key);
            match w.0.get(&key) {
                Some(a) if a.epoch == req.epoch => {
                    a.cancel.set();
                    Some(a.done.clone())
                }
                _ => None,
            }
        };
        let was_active = active.is_some();
        if let Some(mut done) = active {
            // Ends when the write task sends `true` or is dropped (both: it has stopped).
            let _ = done.wait_for(|d| *d).await;
        }
        FenceLeaseReply { was_active }
    }
}

/// A revocation flag that can also be awaited.
#[derive(Default)]
struct Cancel {
    flag: AtomicBool,
    notify: Notify,
}

impl Cancel {
    fn set(&self) {
        self.flag.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    fn is_set(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }

    async fn wait(&self) {
        // Registered before the check, so a `set` in between still wakes it.
        let notified = self.notify.notified();
        if self.is_set() {
            return;
        }
        notified.await;
    }
}
