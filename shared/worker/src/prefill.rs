//! The prefill worker (`--disaggregation-mode prefill`): computes a prompt and writes the KV
//! blocks a decode worker's lease asks for straight into that worker's registered memory,
//! batch by batch as the engine completes them (so transfer overlaps the next chunk's
//! compute). It sends the first token as soon as the engine has sampled it — while the last
//! blocks are still being written (`--first-token-before-kv-writes`) — then, once every
//! write is done, the request's sampling state. GPU to GPU, a
//! batch may also come before the step that computes it, in groups of layers each behind
//! its own fence (`--kv-transfer-layer-groups`): each group is put as soon as the step has
//! computed it, so the transfer overlaps that same step.
//!
//! Each write runs in its own task ([`LeaseWrites`]), so a cancelled call never drops a put
//! halfway: the task stops at the next batch boundary. `FenceLease` answers only once the
//! lease's task has ended (or marks a lease it has not seen as fenced), which is what lets
//! the decode worker reuse the blocks of a revoked lease safely.
//!
//! Where the blocks go is the [`KvWriter`]: the KV transport, or (simulated engines of
//! `tandem-mocker`) a [`SimulatedLink`] that moves no bytes but takes their time; everything
//! else here is the same code for both.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_engine::backend::{BlocksReady, DeviceBlocks, DeviceFence};
use tandem_engine::engine::{BlockExport, BlockPin, EngineHandle, PrefillEvent, PrefillStream};
use tandem_engine::request::{FinishReason, Request, RequestOutput, SequenceState};
use tandem_kv_transfer::{
    AnyConnection, AnyTransport, Bytes, DeviceBatch, DevicePut, KvConnection, Put,
};
use tandem_kv_transfer::{Backend, KvTransport, MemoryKind, PeerAddress, RemoteRegion};
use tandem_protocol::wire::required;
use tandem_protocol::worker::prefill_progress::Step;
use tandem_protocol::worker::{
    FenceLeaseReply, FenceLeaseRequest, KvLease, PrefillProgress, PrefillReply, PrefillRequest,
};
use tandem_protocol::WireError;
use tokio::sync::mpsc;
use tonic::Status;

use crate::lease_writes::{Cancel, LeaseWrites};
use crate::media::MediaEncoder;
use crate::transport::{Connections, KvWriter, SimulatedLink};
use crate::wire::{engine_sub, EngineIntoWire};

/// A `Prefill` call's messages, as its task sends them.
pub type ProgressTx = mpsc::Sender<Result<PrefillProgress, Status>>;
/// A `Prefill` call's messages, as its caller receives them.
pub type ProgressRx = mpsc::Receiver<Result<PrefillProgress, Status>>;

pub struct PrefillSide {
    engine: EngineHandle,
    writer: KvWriter,
    layout_id: String,
    block_bytes: usize,
    /// Layer groups of a GPU-to-GPU write while its step runs (0: whole blocks after it).
    layer_groups: usize,
    /// Whether the first token goes out while the last writes are in flight
    /// (`--first-token-before-kv-writes`), or only once every write is done.
    first_early: bool,
    connections: Connections,
    writes: Arc<LeaseWrites>,
    pub bytes_sent: AtomicU64,
    /// The model's vision tower, when it takes images: this worker encodes a prompt's
    /// images itself before prefilling it (EP/D).
    media: std::sync::OnceLock<Arc<MediaEncoder>>,
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
            layer_groups: 0,
            first_early: true,
            connections: Connections::default(),
            writes: Arc::default(),
            bytes_sent: AtomicU64::new(0),
            media: std::sync::OnceLock::new(),
        }
    }

    /// GPU-to-GPU writes leave in `groups` groups of layers while their step runs (0: whole
    /// blocks after each step; see `BlockExport::Device`).
    pub fn with_layer_groups(mut self, groups: usize) -> Self {
        self.layer_groups = groups;
        self
    }

    /// Whether the first token goes out before the last KV writes are done (see
    /// `--first-token-before-kv-writes`).
    pub fn with_first_token_early(mut self, early: bool) -> Self {
        self.first_early = early;
        self
    }

    /// Lets this prefill worker take images (its model's vision tower).
    pub fn set_media(&self, media: Arc<MediaEncoder>) {
        let _ = self.media.set(media);
    }

    /// Leases being written now.
    pub fn active(&self) -> usize {
        self.writes.active()
    }

    /// Starts a `Prefill` call: checks it (and embeds its images), then runs it in a task of
    /// its own whose messages — the first token as soon as it is sampled, then `done` once
    /// every write has completed, or an error — come out of the returned channel. Dropping
    /// the receiver cancels the call: the writes stop at their next boundary.
    pub async fn start(self: &Arc<Self>, mut req: PrefillRequest) -> Result<ProgressRx, Status> {
        let images = req
            .request
            .as_mut()
            .map(|r| std::mem::take(&mut r.media))
            .unwrap_or_default();
        let (mut request, lease, region, export) = self.check(req)?;
        if !images.is_empty() {
            let media = self.media.get().ok_or_else(|| {
                Status::invalid_argument("request.media: this worker's model does not take images")
            })?;
            request.media = media.embed(&request.prompt, images).await?;
        }
        let (tx, rx) = mpsc::channel(2);
        let me = self.clone();
        tokio::spawn(async move {
            let key = (lease.owner_instance_id, lease.lease_id);
            let epoch = lease.epoch;
            let first = tx.clone();
            let writer = me.clone();
            let run = me
                .writes
                .run(key, epoch, "prefill", move |cancel| async move {
                    writer
                        .write(request, (lease, region, export), &first, &cancel)
                        .await
                });
            // A caller that went away drops `run`, which cancels the writes.
            let msg = tokio::select! {
                r = run => r.map(|done| PrefillProgress {
                    step: Some(Step::Done(done)),
                }),
                _ = tx.closed() => return,
            };
            let _ = tx.send(msg).await;
        });
        Ok(rx)
    }

    /// The request, lease and destination region of a `Prefill` call, checked, and how the
    /// blocks leave the engine for that region: a malformed message, another KV layout, a
    /// region this worker's pool cannot write into or bad sampling parameters are refused
    /// before any write.
    fn check(
        &self,
        req: PrefillRequest,
    ) -> Result<(Request, KvLease, RemoteRegion, BlockExport), Status> {
        let mut lease = required(req.lease, "lease")?;
        let request: Request = engine_sub(req.request, "request")?;
        if lease.kv_layout_id != self.layout_id {
            return Err(Status::failed_precondition(format!(
                "KV layouts differ: the decode worker's is {:?}, this prefill worker's is {:?}",
                lease.kv_layout_id, self.layout_id
            )));
        }
        let region: RemoteRegion =
            engine_sub(lease.region.take(), "region").map_err(|e: WireError| e.within("lease"))?;
        region
            .validate()
            .map_err(|e| Status::invalid_argument(format!("lease.region: {e}")))?;
        let export = export_for(&region, self.gpu_writer(), self.layer_groups)?;
        request
            .params
            .validate()
            .map_err(Status::invalid_argument)?;
        Ok((request, lease, region, export))
    }

    /// Whether this worker writes from GPU memory: its pool is on a GPU and its transport is
    /// UCX (which moves GPU memory when it is CUDA-enabled, and says so when it is not).
    fn gpu_writer(&self) -> bool {
        self.engine.device_pool().is_some()
            && matches!(&self.writer, KvWriter::Transport(t) if t.backend() == Backend::Ucx)
    }

    async fn connection(&self, peer: &PeerAddress) -> Result<Arc<AnyConnection>, Status> {
        let transport = match &self.writer {
            KvWriter::Transport(t) => t,
            KvWriter::Simulated(_) => {
                return Err(Status::internal("a simulated writer has no connections"))
            }
        };
        self.connections.get(transport, peer).await.map_err(|e| {
            Status::aborted(format!(
                "cannot connect to the decode worker's KV transport: {e}"
            ))
        })
    }

    /// Where a lease's blocks go: a connection to the region's peer, or the simulated link.
    async fn link(&self, region: &RemoteRegion) -> Result<Link, Status> {
        Ok(match &self.writer {
            KvWriter::Transport(_) => Link::Real(self.connection(&region.peer).await?),
            KvWriter::Simulated(s) => Link::Simulated(s.clone()),
        })
    }

    /// Runs the prompt and writes its blocks; sends the first token to `first` as soon as the
    /// engine has sampled it, even while the last blocks are still being written. Every error
    /// is returned after the last put of this lease has completed or failed: the caller may
    /// then treat the writer as stopped.
    async fn write(
        &self,
        request: Request,
        (lease, region, export): (KvLease, RemoteRegion, BlockExport),
        first: &ProgressTx,
        cancel: &Cancel,
    ) -> Result<PrefillReply, Status> {
        let began = Instant::now();
        let ends = LeaseEnd {
            lease_id: lease.lease_id,
            ttl_ms: lease.ttl_ms,
            at: began + Duration::from_millis(lease.ttl_ms.max(1)),
        };
        let request_id = request.request_id.clone();
        let prompt_len = request.prompt.len();
        let mut stream = self
            .engine
            .prefill_as(request, lease.first_block as usize, export)
            .await
            .map_err(crate::status::engine_status)?;
        let mut w = LeaseWrite {
            link: self.link(&region).await?,
            lease,
            region,
            request_id,
            prompt_len,
            sent_blocks: 0,
            sent_bytes: 0,
            started: began,
            deadline: ends.at,
            timing: WriteTiming::default(),
        };
        let mut first_sent = false;
        let mut event = next_event(&mut stream, &ends, cancel).await?;
        loop {
            match event {
                Some(PrefillEvent::Done { output, state }) => {
                    if !first_sent {
                        send_first(first, &output, began).await;
                    }
                    return w.finish(output, state);
                }
                None => {
                    return Err(Status::aborted(
                        "the prefill ended without a result (request aborted or engine stopped)",
                    ))
                }
                Some(blocks) => {
                    // The next event (more blocks, or the first token, which then goes out at
                    // once unless it waits for the writes) is taken while these blocks are
                    // written.
                    let next = async {
                        let ev = next_event(&mut stream, &ends, cancel).await;
                        if let (true, Ok(Some(PrefillEvent::Done { output, .. }))) =
                            (self.first_early, &ev)
                        {
                            send_first(first, output, began).await;
                            first_sent = true;
                        }
                        ev
                    };
                    let (wrote, next) = tokio::join!(self.send(&mut w, blocks), next);
                    wrote?;
                    event = next?;
                }
            }
        }
    }

    /// Writes one blocks event of the engine's.
    async fn send(&self, w: &mut LeaseWrite, event: PrefillEvent) -> Result<(), Status> {
        match event {
            PrefillEvent::Blocks {
                first_block: at,
                data,
            } => {
                w.timing.computed();
                self.send_blocks(w, at, data).await
            }
            PrefillEvent::DeviceBlocks {
                first_block: at,
                blocks,
                pin,
            } => self.send_device_blocks(w, at, blocks, pin).await,
            PrefillEvent::Done { .. } => {
                Err(Status::internal("a prefill's result among its blocks"))
            }
        }
    }

    /// Writes the engine's blocks `at..` (their bytes in `data`) to the lease's offsets.
    async fn send_blocks(
        &self,
        w: &mut LeaseWrite,
        at: usize,
        data: Vec<u8>,
    ) -> Result<(), Status> {
        let bb = self.block_bytes;
        let n = data.len() / bb;
        w.check_blocks(at, n, data.len(), bb)?;
        crate::failpoints::prefill_silent().await;
        w.check_deadline(at)?;
        let offsets = w.offsets(at, n);
        let last_block = at + n - 1;
        let written = match &w.link {
            Link::Real(conn) => {
                let data = Bytes::from(data);
                let puts: Vec<Put> = (0..n)
                    .map(|j| Put {
                        local: data.slice(j * bb..(j + 1) * bb),
                        offset: offsets[j],
                    })
                    .collect();
                crate::failpoints::prefill_hold(&w.request_id, last_block).await;
                let started = Instant::now();
                if let Err(e) = conn.write(&w.region, puts).await {
                    self.connections.forget(&w.region.peer).await;
                    return Err(write_failed(e));
                }
                w.timing.wrote(started);
                data.len() as u64
            }
            Link::Simulated(sim) => {
                // No bytes move: the export is dropped unread.
                drop(data);
                crate::failpoints::prefill_hold(&w.request_id, last_block).await;
                sim.write(&w.region, offsets, bb as u64)
                    .await
                    .map_err(write_failed)?
            }
        };
        w.sent_blocks += n;
        w.sent_bytes += written;
        self.bytes_sent.fetch_add(written, Ordering::Relaxed);
        Ok(())
    }

    /// Writes the engine's blocks `at..` (in its GPU pool, pinned by `pin`) GPU to GPU into
    /// the lease's offsets: whole, once the step that computed them is complete, or group of
    /// layers by group, each once the step has passed it.
    async fn send_device_blocks(
        &self,
        w: &mut LeaseWrite,
        at: usize,
        blocks: DeviceBlocks,
        pin: BlockPin,
    ) -> Result<(), Status> {
        let bb = blocks.block_bytes;
        let n = blocks.ptrs.len();
        if bb != self.block_bytes {
            return Err(Status::internal(format!(
                "the engine's GPU blocks are {bb} bytes, its layout's {}",
                self.block_bytes
            )));
        }
        w.check_blocks(at, n, n * bb, bb)?;
        crate::failpoints::prefill_silent().await;
        let Link::Real(conn) = &w.link else {
            return Err(Status::internal("GPU blocks for a simulated link"));
        };
        let conn = conn.clone();
        let pin = Arc::new(pin);
        for (bytes, fence) in byte_parts(blocks.ready, bb) {
            wait_fence(fence).await?;
            w.timing.fence_passed();
            w.timing.computed();
            w.check_deadline(at)?;
            let puts = w
                .offsets(at, n)
                .iter()
                .zip(&blocks.ptrs)
                .map(|(&offset, &src)| DevicePut {
                    src: src + bytes.start as u64,
                    len: bytes.len() as u64,
                    offset: offset + bytes.start as u64,
                })
                .collect();
            // SAFETY: the engine handed these blocks out as its pool's memory on
            // `blocks.device`, and these bytes of them are final (the fence above); `pin`
            // keeps them referenced — neither evicted, reused nor written — until the
            // transport drops its last clone, after its last read.
            let batch = unsafe { DeviceBatch::new(blocks.device, puts, Box::new(pin.clone())) };
            crate::failpoints::prefill_hold(&w.request_id, at + n - 1).await;
            let started = Instant::now();
            if let Err(e) = conn.write_device(&w.region, batch).await {
                self.connections.forget(&w.region.peer).await;
                return Err(write_failed(e));
            }
            w.timing.wrote(started);
        }
        let written = (n * bb) as u64;
        w.sent_blocks += n;
        w.sent_bytes += written;
        self.bytes_sent.fetch_add(written, Ordering::Relaxed);
        Ok(())
    }

    /// Stops writing for a lease and returns once no write for it can happen any more.
    pub async fn fence(&self, req: FenceLeaseRequest) -> FenceLeaseReply {
        let key = (req.owner_instance_id, req.lease_id);
        FenceLeaseReply {
            was_active: self.writes.fence(key, req.epoch).await,
        }
    }
}

/// How blocks leave the engine for `region`: a host region takes exported (copied) blocks;
/// a GPU region takes the GPU pool's blocks in place, from a GPU writer only. Any other
/// pair is refused before any compute, never staged.
fn export_for(
    region: &RemoteRegion,
    gpu_writer: bool,
    layer_groups: usize,
) -> Result<BlockExport, Status> {
    match (region.memory, gpu_writer) {
        (MemoryKind::Host, _) => Ok(BlockExport::Host),
        (MemoryKind::Cuda { .. }, true) => Ok(BlockExport::Device { layer_groups }),
        (memory, false) => Err(Status::failed_precondition(format!(
            "the decode worker's KV pool is {} memory; this prefill worker writes from host \
             memory (pair workers whose pools are the same memory type: GPU to GPU needs \
             --device cuda and the UCX transport on both)",
            memory.label()
        ))),
    }
}

/// The lease a prefill writes for, as its event loop checks it: its id and TTL (for errors)
/// and its end by this worker's clock.
struct LeaseEnd {
    lease_id: u64,
    ttl_ms: u64,
    at: Instant,
}

/// The engine's next prefill event, unless the lease expires or is revoked first.
async fn next_event(
    stream: &mut PrefillStream,
    lease: &LeaseEnd,
    cancel: &Cancel,
) -> Result<Option<PrefillEvent>, Status> {
    if cancel.is_set() {
        return Err(Status::aborted("the lease was revoked"));
    }
    tokio::select! {
        ev = stream.next() => Ok(ev),
        _ = tokio::time::sleep_until(lease.at.into()) => Err(Status::aborted(format!(
            "lease {} expired (ttl {} ms) before the prefill finished",
            lease.lease_id, lease.ttl_ms
        ))),
        _ = cancel.wait() => Err(Status::aborted("the lease was revoked")),
    }
}

/// Sends the prefill's first token to the caller (not an aborted one: that is the call's
/// error). A caller gone is noticed by the task running the call.
async fn send_first(first: &ProgressTx, output: &RequestOutput, began: Instant) {
    if output.finish_reason == Some(FinishReason::Abort) {
        return;
    }
    let msg = PrefillProgress {
        step: Some(Step::First(output.clone().into_wire())),
    };
    let _ = first.send(Ok(msg)).await;
    crate::stats::disagg_phase("prefill_first", began.elapsed());
}

/// The byte ranges of each handed-out block to write in turn, each after its fence: the
/// whole block, or each group of layers.
fn byte_parts(ready: BlocksReady, block_bytes: usize) -> Vec<(Range<usize>, Arc<dyn DeviceFence>)> {
    match ready {
        BlocksReady::Whole(fence) => vec![(0..block_bytes, Arc::from(fence))],
        BlocksReady::Layers {
            layer_bytes,
            groups,
        } => groups
            .into_iter()
            .map(|g| {
                (
                    g.layers.start * layer_bytes..g.layers.end * layer_bytes,
                    g.fence,
                )
            })
            .collect(),
    }
}

/// Waits for `fence` off the async threads (it is almost always passed already when whole
/// blocks come after their step; a layer group's passes while its step runs).
async fn wait_fence(fence: Arc<dyn DeviceFence>) -> Result<(), Status> {
    tokio::task::spawn_blocking(move || fence.wait())
        .await
        .map_err(|e| Status::internal(format!("waiting for the KV blocks: {e}")))?
        .map_err(|e| Status::internal(format!("waiting for the KV blocks: {e}")))
}

fn write_failed(e: impl std::fmt::Display) -> Status {
    Status::aborted(format!(
        "writing KV blocks to the decode worker failed: {e}"
    ))
}

/// One lease being written: where its blocks go and how far the write has got.
struct LeaseWrite {
    lease: KvLease,
    region: RemoteRegion,
    link: Link,
    request_id: String,
    prompt_len: usize,
    sent_blocks: usize,
    sent_bytes: u64,
    started: Instant,
    /// The lease's end by this worker's clock: no put starts after it.
    deadline: Instant,
    timing: WriteTiming,
}

/// Where a lease's write time went: in puts, and after the last computed layer.
#[derive(Default)]
struct WriteTiming {
    /// Time inside the transport's writes.
    writing: Duration,
    /// When the last fence passed (the last bytes to write were computed) and when the last
    /// write ended: the difference is the part of the transfer not hidden behind compute.
    last_fence: Option<Instant>,
    last_write_end: Option<Instant>,
    /// When the last blocks to write were known computed.
    last_computed: Option<Instant>,
}

impl WriteTiming {
    fn fence_passed(&mut self) {
        self.last_fence = Some(Instant::now());
    }

    fn computed(&mut self) {
        self.last_computed = Some(Instant::now());
    }

    fn wrote(&mut self, started: Instant) {
        let now = Instant::now();
        self.writing += now - started;
        self.last_write_end = Some(now);
    }

    /// Records the lease's write time and its exposed part (GPU-to-GPU writes, which wait
    /// for fences): `tandem_kv_transfer_write_seconds` and
    /// `tandem_kv_transfer_exposed_seconds`; and the prefill's phases from `began` (the call
    /// received), `tandem_disagg_phase_seconds`.
    fn record(&self, began: Instant) {
        if let Some(computed) = self.last_computed {
            crate::stats::disagg_phase("prefill_compute", computed - began);
        }
        crate::stats::disagg_phase("prefill_total", began.elapsed());
        metrics::histogram!("tandem_kv_transfer_write_seconds").record(self.writing.as_secs_f64());
        if let (Some(fence), Some(end)) = (self.last_fence, self.last_write_end) {
            let exposed = end.saturating_duration_since(fence);
            metrics::histogram!("tandem_kv_transfer_exposed_seconds").record(exposed.as_secs_f64());
        }
    }
}

impl LeaseWrite {
    fn first_block(&self) -> usize {
        self.lease.first_block as usize
    }

    /// Blocks the lease asks for.
    fn want(&self) -> usize {
        self.lease.block_offsets.len()
    }

    /// The writer stops by its own clock: past the lease's end its owner may already have
    /// given the blocks to another request.
    fn check_deadline(&self, at: usize) -> Result<(), Status> {
        if Instant::now() >= self.deadline {
            return Err(Status::aborted(format!(
                "lease {} expired (ttl {} ms) before blocks {at}.. were written; not writing",
                self.lease.lease_id, self.lease.ttl_ms
            )));
        }
        Ok(())
    }

    /// The lease's destination offsets of the engine's blocks `at..at + n`.
    fn offsets(&self, at: usize, n: usize) -> &[u64] {
        let first = self.first_block();
        &self.lease.block_offsets[at - first..at + n - first]
    }

    /// The engine's blocks `at..at + n` (`len` bytes) must be whole blocks, next in order,
    /// and inside the lease.
    fn check_blocks(
        &self,
        at: usize,
        n: usize,
        len: usize,
        block_bytes: usize,
    ) -> Result<(), Status> {
        let (first, want) = (self.first_block(), self.want());
        if !len.is_multiple_of(block_bytes)
            || at < first
            || at + n > first + want
            || at != first + self.sent_blocks
        {
            return Err(Status::internal(format!(
                "engine produced blocks {at}..{} ({len} bytes) outside the lease's {first}..{}",
                at + n,
                first + want
            )));
        }
        Ok(())
    }

    /// The reply once the engine has computed the prompt: the first token and the state
    /// that continues the request on the decode worker.
    fn finish(self, output: RequestOutput, state: SequenceState) -> Result<PrefillReply, Status> {
        if output.finish_reason == Some(FinishReason::Abort) {
            return Err(Status::aborted(format!(
                "the prefill was aborted: {}",
                output.error.as_deref().unwrap_or("engine abort")
            )));
        }
        if self.sent_blocks != self.want() {
            return Err(Status::internal(format!(
                "the prefill sent {} of the lease's {} blocks",
                self.sent_blocks,
                self.want()
            )));
        }
        self.timing.record(self.started);
        tracing::debug!(
            lease_id = self.lease.lease_id,
            prompt_len = self.prompt_len,
            blocks = self.sent_blocks,
            bytes = self.sent_bytes,
            ms = self.started.elapsed().as_secs_f64() * 1e3,
            "remote prefill done"
        );
        Ok(PrefillReply {
            prefill_cached_tokens: state.cached_prompt_tokens as u32,
            state: Some(state.into_wire()),
            bytes_transferred: self.sent_bytes,
            blocks_transferred: self.sent_blocks as u32,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_region_is_written_by_a_gpu_writer_only() {
        let mut region = crate::transport::simulated_region(1, 4096);
        assert_eq!(export_for(&region, false, 4).unwrap(), BlockExport::Host);
        assert_eq!(export_for(&region, true, 4).unwrap(), BlockExport::Host);
        region.memory = MemoryKind::Cuda { device: 1 };
        assert_eq!(
            export_for(&region, true, 4).unwrap(),
            BlockExport::Device { layer_groups: 4 }
        );
        let e = export_for(&region, false, 4).unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(e.message().contains("cuda memory"), "{}", e.message());
    }
}
