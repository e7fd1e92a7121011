//! The prefill worker (`--disaggregation-mode prefill`): computes a prompt and writes the KV
//! blocks a decode worker's lease asks for straight into that worker's registered memory,
//! batch by batch as the engine completes them (so transfer overlaps the next chunk's
//! compute), then returns the first token and the request's sampling state.
//!
//! Each write runs in its own task ([`LeaseWrites`]), so a cancelled call never drops a put
//! halfway: the task stops at the next batch boundary. `FenceLease` answers only once the
//! lease's task has ended (or marks a lease it has not seen as fenced), which is what lets
//! the decode worker reuse the blocks of a revoked lease safely.
//!
//! Where the blocks go is the [`KvWriter`]: the KV transport, or (simulated engines of
//! `tandem-mocker`) a [`SimulatedLink`] that moves no bytes but takes their time; everything
//! else here is the same code for both.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_engine::engine::{EngineHandle, PrefillEvent, PrefillStream};
use tandem_engine::request::{FinishReason, Request, RequestOutput, SequenceState};
use tandem_kv_transfer::{AnyConnection, AnyTransport, Bytes, KvConnection, Put};
use tandem_kv_transfer::{MemoryKind, PeerAddress, RemoteRegion};
use tandem_protocol::wire::required;
use tandem_protocol::worker::{
    FenceLeaseReply, FenceLeaseRequest, KvLease, PrefillReply, PrefillRequest,
};
use tandem_protocol::WireError;
use tonic::Status;

use crate::lease_writes::{Cancel, LeaseWrites};
use crate::media::MediaEncoder;
use crate::transport::{Connections, KvWriter, SimulatedLink};
use crate::wire::{engine_sub, EngineIntoWire};

pub struct PrefillSide {
    engine: EngineHandle,
    writer: KvWriter,
    layout_id: String,
    block_bytes: usize,
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
            connections: Connections::default(),
            writes: Arc::default(),
            bytes_sent: AtomicU64::new(0),
            media: std::sync::OnceLock::new(),
        }
    }

    /// Lets this prefill worker take images (its model's vision tower).
    pub fn set_media(&self, media: Arc<MediaEncoder>) {
        let _ = self.media.set(media);
    }

    /// Leases being written now.
    pub fn active(&self) -> usize {
        self.writes.active()
    }

    pub async fn prefill(
        self: &Arc<Self>,
        mut req: PrefillRequest,
    ) -> Result<PrefillReply, Status> {
        let images = req
            .request
            .as_mut()
            .map(|r| std::mem::take(&mut r.media))
            .unwrap_or_default();
        let (mut request, lease, region) = self.check(req)?;
        if !images.is_empty() {
            let media = self.media.get().ok_or_else(|| {
                Status::invalid_argument("request.media: this worker's model does not take images")
            })?;
            request.media = media.embed(&request.prompt, images).await?;
        }
        let key = (lease.owner_instance_id, lease.lease_id);
        let epoch = lease.epoch;
        let me = self.clone();
        self.writes
            .run(key, epoch, "prefill", move |cancel| async move {
                me.write(request, lease, region, &cancel).await
            })
            .await
    }

    /// The request, lease and destination region of a `Prefill` call, checked: a malformed
    /// message, another KV layout or bad sampling parameters are refused before any write.
    fn check(&self, req: PrefillRequest) -> Result<(Request, KvLease, RemoteRegion), Status> {
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
        same_memory(&region)?;
        request
            .params
            .validate()
            .map_err(Status::invalid_argument)?;
        Ok((request, lease, region))
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
        let request_id = request.request_id.clone();
        let prompt_len = request.prompt.len();
        let mut stream = self
            .engine
            .prefill(request, lease.first_block as usize)
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
            started: Instant::now(),
            deadline,
        };
        loop {
            match next_event(&mut stream, &w.lease, deadline, cancel).await? {
                Some(PrefillEvent::Blocks {
                    first_block: at,
                    data,
                }) => self.send_blocks(&mut w, at, data).await?,
                Some(PrefillEvent::Done { output, state }) => return w.finish(output, state),
                None => {
                    return Err(Status::aborted(
                        "the prefill ended without a result (request aborted or engine stopped)",
                    ))
                }
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
        // The writer stops by its own clock: past the lease's end its owner may already
        // have given the blocks to another request.
        if Instant::now() >= w.deadline {
            return Err(Status::aborted(format!(
                "lease {} expired (ttl {} ms) before blocks {at}.. were written; not writing",
                w.lease.lease_id, w.lease.ttl_ms
            )));
        }
        let offsets = &w.lease.block_offsets[at - w.first_block()..at + n - w.first_block()];
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
                if let Err(e) = conn.write(&w.region, puts).await {
                    self.connections.forget(&w.region.peer).await;
                    return Err(write_failed(e));
                }
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

    /// Stops writing for a lease and returns once no write for it can happen any more.
    pub async fn fence(&self, req: FenceLeaseRequest) -> FenceLeaseReply {
        let key = (req.owner_instance_id, req.lease_id);
        FenceLeaseReply {
            was_active: self.writes.fence(key, req.epoch).await,
        }
    }
}

/// This worker's blocks leave from host memory: a region of another memory type is refused
/// before any compute, never staged.
fn same_memory(region: &RemoteRegion) -> Result<(), Status> {
    if region.memory == MemoryKind::Host {
        return Ok(());
    }
    Err(Status::failed_precondition(format!(
        "the decode worker's KV pool is {} memory; this prefill worker writes from host \
         memory (pair workers whose pools are the same memory type)",
        region.memory.label()
    )))
}

/// The engine's next prefill event, unless the lease expires or is revoked first.
async fn next_event(
    stream: &mut PrefillStream,
    lease: &KvLease,
    deadline: Instant,
    cancel: &Cancel,
) -> Result<Option<PrefillEvent>, Status> {
    if cancel.is_set() {
        return Err(Status::aborted("the lease was revoked"));
    }
    tokio::select! {
        ev = stream.next() => Ok(ev),
        _ = tokio::time::sleep_until(deadline.into()) => Err(Status::aborted(format!(
            "lease {} expired (ttl {} ms) before the prefill finished",
            lease.lease_id, lease.ttl_ms
        ))),
        _ = cancel.wait() => Err(Status::aborted("the lease was revoked")),
    }
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
}

impl LeaseWrite {
    fn first_block(&self) -> usize {
        self.lease.first_block as usize
    }

    /// Blocks the lease asks for.
    fn want(&self) -> usize {
        self.lease.block_offsets.len()
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
        tracing::debug!(
            lease_id = self.lease.lease_id,
            prompt_len = self.prompt_len,
            blocks = self.sent_blocks,
            bytes = self.sent_bytes,
            ms = self.started.elapsed().as_secs_f64() * 1e3,
            "remote prefill done"
        );
        Ok(PrefillReply {
            first: Some(output.into_wire()),
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
    fn a_gpu_region_is_refused_by_a_host_memory_writer() {
        let mut region = crate::transport::simulated_region(1, 4096);
        assert!(same_memory(&region).is_ok());
        region.memory = MemoryKind::Cuda { device: 1 };
        let e = same_memory(&region).unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(e.message().contains("cuda memory"), "{}", e.message());
    }
}
