//! The decode side of disaggregated serving (`--disaggregation-mode pd|decode`): for each
//! request, reserve destination blocks under a lease, have a prefill worker compute the prompt
//! and write the missing blocks straight into this worker's registered KV pool, stream the
//! first token it returns at once, then decode the rest here.
//!
//! This worker owns the lease from grant to release, so every way a request can end — the
//! prefill answered, failed or vanished, the client left, the deadline passed — goes through
//! one place that either releases the blocks (the writer has stopped) or quarantines them and
//! fences the writer (see [`crate::leases`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tandem_pki::ChannelSecurity;

use tandem_engine::engine::{EngineHandle, RequestStream, SequenceState};
use tandem_engine::kv::block_manager::HashContext;
use tandem_engine::kv::hash::CacheSalt;
use tandem_engine::request::MediaSpan;
use tandem_engine::sampler::SamplingParams;
use tandem_kv_transfer::RemoteRegion;
use tandem_protocol::wire::{required, TryFromWire};
use tandem_protocol::worker::prefill_progress::Step;
use tandem_protocol::worker::worker_client::WorkerClient;
use tandem_protocol::worker::{
    FenceLeaseRequest, GenerateDisaggRequest, GenerateOutput, GenerateRequest, KvLease,
    PrefillProgress, PrefillReply, PrefillRequest, PrefillTarget,
};
use tandem_protocol::WireError;
use tokio::sync::mpsc;
use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::grpc::forward;
use crate::leases::{count_fence, listener_gone, FenceProof, LeaseTable};
use crate::wire::{engine_sub, sub, EngineIntoWire};

/// Prefill workers tried per request before giving up.
pub const MAX_PREFILL_ATTEMPTS: usize = 3;

type Out = mpsc::Sender<Result<GenerateOutput, Status>>;

/// How long a lease lasts, and how long past its end a revoked lease's blocks stay
/// quarantined when its writer can be neither fenced nor seen gone.
#[derive(Debug, Clone, Copy)]
pub struct LeaseTimes {
    pub ttl: Duration,
    pub reclaim_margin: Duration,
}

pub struct DecodeSide {
    engine: EngineHandle,
    instance_id: u64,
    layout_id: String,
    region: RemoteRegion,
    block_bytes: u64,
    block_size: usize,
    ttl: Duration,
    reclaim_margin: Duration,
    /// How channels to prefill workers are secured.
    security: ChannelSecurity,
    pub leases: Arc<LeaseTable>,
    clients: Mutex<HashMap<String, WorkerClient<Channel>>>,
    pub bytes_received: AtomicU64,
    /// The prefill workers this worker may dial (set once discovery is connected).
    known_prefills: std::sync::OnceLock<Arc<crate::known_prefills::KnownPrefills>>,
}

/// How one attempt with one prefill worker ended.
enum Attempt {
    /// Decoding here; forward the stream.
    Decoding(RequestStream),
    /// The first token ended the request, or the client left: nothing more to do.
    Over,
    /// The request itself is refused (bad input, does not fit): tell the client, no retry.
    Refused(Status),
    /// This prefill worker failed; another may succeed.
    PrefillFailed(String),
}

impl DecodeSide {
    pub fn new(
        engine: EngineHandle,
        instance_id: u64,
        layout_id: String,
        region: RemoteRegion,
        times: LeaseTimes,
        security: ChannelSecurity,
    ) -> Self {
        let layout = engine.layout().clone();
        DecodeSide {
            engine,
            instance_id,
            layout_id,
            region,
            block_bytes: layout.block_bytes() as u64,
            block_size: layout.block_size,
            ttl: times.ttl,
            reclaim_margin: times.reclaim_margin,
            security,
            leases: Arc::new(LeaseTable::new()),
            clients: Mutex::new(HashMap::new()),
            bytes_received: AtomicU64::new(0),
            known_prefills: std::sync::OnceLock::new(),
        }
    }

    /// Where `GenerateDisagg`'s prefill workers are checked; until set, every one is refused.
    pub fn set_known_prefills(&self, known: Arc<crate::known_prefills::KnownPrefills>) {
        let _ = self.known_prefills.set(known);
    }

    fn client(&self, addr: &str) -> Result<WorkerClient<Channel>, String> {
        let mut m = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = m.get(addr) {
            return Ok(c.clone());
        }
        let channel = self
            .security
            .endpoint(addr)
            .map_err(|e| format!("bad prefill worker address: {e}"))?
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(3))
            .connect_lazy();
        let c = WorkerClient::new(channel)
            .max_decoding_message_size(tandem_protocol::MAX_GRPC_MESSAGE_BYTES)
            .max_encoding_message_size(tandem_protocol::MAX_GRPC_MESSAGE_BYTES);
        m.insert(addr.to_owned(), c.clone());
        Ok(c)
    }

    /// Checks a `GenerateDisagg` call and starts it; outputs go to `tx`.
    pub async fn start(
        self: &Arc<Self>,
        req: GenerateDisaggRequest,
        tx: Out,
    ) -> Result<(), Status> {
        let request = required(req.request, "request")?;
        if request.request_id.is_empty() {
            return Err(Status::invalid_argument("request_id is empty"));
        }
        let params: SamplingParams = sub(request.sampling_params.clone(), "sampling_params")
            .map_err(|e: WireError| e.within("request"))?;
        params.validate().map_err(Status::invalid_argument)?;
        if params.n != 1 {
            return Err(Status::invalid_argument(format!(
                "n = {} is not supported with disaggregated prefill/decode (only n = 1); \
                 send it to an aggregated or pd worker's Generate",
                params.n
            )));
        }
        if req.prefill_workers.is_empty() {
            return Err(Status::invalid_argument("prefill_workers is empty"));
        }
        hashing_of(&request)?;
        // Only registered prefill workers of this namespace get dialled (and handed the KV
        // region's descriptor and secret).
        let Some(known) = self.known_prefills.get() else {
            return Err(Status::unavailable(
                "this decode worker does not know its prefill workers yet (discovery)",
            ));
        };
        // Unknown targets are dropped (a worker that left discovery is not dialled; the
        // router's list is a failover order); none left is a refusal naming them.
        let mut targets = Vec::with_capacity(req.prefill_workers.len());
        let mut refused = Vec::new();
        for t in req.prefill_workers {
            if known.allows(t.instance_id, &t.grpc_addr).await {
                targets.push(t);
            } else {
                tracing::warn!(
                    addr = %t.grpc_addr,
                    instance_id = t.instance_id,
                    "GenerateDisagg names a prefill worker not registered in discovery; not dialling it"
                );
                refused.push(format!("{:?} (instance {})", t.grpc_addr, t.instance_id));
            }
        }
        if targets.is_empty() {
            return Err(Status::permission_denied(format!(
                "prefill worker {} is not a registered prefill worker of this namespace in \
                 discovery; refusing to dial it",
                refused.join(", ")
            )));
        }
        let me = self.clone();
        tokio::spawn(async move {
            me.run(request, params, targets, tx).await;
        });
        Ok(())
    }

    async fn run(
        self: Arc<Self>,
        request: GenerateRequest,
        params: SamplingParams,
        targets: Vec<PrefillTarget>,
        tx: Out,
    ) {
        let rid = request.request_id.clone();
        let mut failures = Vec::new();
        for target in targets.iter().take(MAX_PREFILL_ATTEMPTS) {
            match self.attempt(&request, &params, target, &tx).await {
                Attempt::Decoding(stream) => {
                    forward(stream, &tx, &self.engine).await;
                    return;
                }
                Attempt::Over => return,
                Attempt::Refused(status) => {
                    let _ = tx.send(Err(status)).await;
                    return;
                }
                Attempt::PrefillFailed(why) => {
                    tracing::warn!(request_id = %rid, prefill = %target.grpc_addr, "remote prefill failed: {why}");
                    failures.push(format!("{}: {why}", target.grpc_addr));
                }
            }
        }
        let _ = tx
            .send(Err(Status::unavailable(format!(
                "remote prefill failed on every prefill worker tried ({})",
                failures.join("; ")
            ))))
            .await;
    }

    async fn attempt(
        &self,
        request: &GenerateRequest,
        params: &SamplingParams,
        target: &PrefillTarget,
        tx: &Out,
    ) -> Attempt {
        let began = Instant::now();
        let lease = match self.lease(request, params, target).await {
            Ok(lease) => lease,
            Err(refused) => return refused,
        };
        let called = Instant::now();
        crate::stats::disagg_phase("reserve", called - began);
        let mut call = match self.call_prefill(request, lease, target, tx).await {
            Ok(call) => call,
            Err(ended) => return ended,
        };
        crate::stats::disagg_phase("first_token", called.elapsed());
        let done = self.after_first(&mut call, tx).await;
        crate::stats::disagg_phase("prefill_call", called.elapsed());
        let (reply, finished) = match done {
            Ok(done) => done,
            Err(ended) => return ended,
        };
        // Every write of this lease has completed.
        self.bytes_received
            .fetch_add(reply.bytes_transferred, Ordering::Relaxed);
        if finished {
            // The first token ended the request: nothing to continue.
            self.release(call.lease_id).await;
            return Attempt::Over;
        }
        self.continue_here(call.lease_id, reply, tx).await
    }

    /// Reserves the prompt's blocks and grants `target` a lease to write the missing ones.
    async fn lease(
        &self,
        request: &GenerateRequest,
        params: &SamplingParams,
        target: &PrefillTarget,
    ) -> Result<KvLease, Attempt> {
        let (lease_id, epoch) = self
            .leases
            .next()
            .map_err(|e| Attempt::Refused(Status::internal(e.to_string())))?;
        let hashing = hashing_of(request).map_err(Attempt::Refused)?;
        let reservation = match self
            .engine
            .reserve(lease_id, request.prompt.clone(), params.clone(), hashing)
            .await
        {
            Ok(r) => r,
            Err(e) => return Err(Attempt::Refused(crate::status::engine_status(e))),
        };
        self.leases.grant(lease_id, epoch, &target.grpc_addr);
        let first_block = reservation.cached_tokens / self.block_size;
        Ok(KvLease {
            lease_id,
            epoch,
            owner_instance_id: self.instance_id,
            kv_layout_id: self.layout_id.clone(),
            region: Some(self.region.clone().into_wire()),
            first_block: first_block as u32,
            block_offsets: reservation.block_ids[first_block..]
                .iter()
                .map(|&b| b as u64 * self.block_bytes)
                .collect(),
            ttl_ms: self.ttl.as_millis() as u64,
        })
    }

    /// Calls `target`'s `Prefill` under the lease until its first token. Every way it can fail
    /// before then releases the lease (the writer has stopped) or revokes it (it may still be
    /// writing), and leaves the request to another prefill worker.
    async fn call_prefill(
        &self,
        request: &GenerateRequest,
        lease: KvLease,
        target: &PrefillTarget,
        tx: &Out,
    ) -> Result<PrefillCall, Attempt> {
        let mut call = PrefillCall {
            lease_id: lease.lease_id,
            epoch: lease.epoch,
            writer: target.grpc_addr.clone(),
            deadline: tokio::time::Instant::now() + self.ttl,
            first: None,
            messages: None,
        };
        let mut client = match self.client(&target.grpc_addr) {
            Ok(c) => c,
            Err(e) => {
                self.release(call.lease_id).await;
                return Err(Attempt::PrefillFailed(e));
            }
        };
        let opened = async {
            let mut messages = client
                .prefill(PrefillRequest {
                    request: Some(request.clone()),
                    lease: Some(lease),
                })
                .await?
                .into_inner();
            let first = messages.message().await?;
            Ok::<_, Status>((messages, first))
        };
        // Dropping the call (client gone, deadline) cancels the RPC; the writer may still be
        // mid-put, so those paths quarantine rather than release.
        let answer = tokio::select! {
            r = tokio::time::timeout_at(call.deadline, opened) => r,
            _ = tx.closed() => {
                call.revoke(self);
                return Err(Attempt::Over);
            }
        };
        let (messages, first) = match answer {
            Err(_) => {
                call.revoke(self);
                return Err(Attempt::PrefillFailed(format!(
                    "no first token within the lease TTL of {:?}",
                    self.ttl
                )));
            }
            Ok(Err(status)) => return Err(self.failed(&call, status).await),
            Ok(Ok(m)) => m,
        };
        call.messages = Some(messages);
        match first.and_then(|m| m.step) {
            Some(Step::First(first)) => {
                call.first = Some(first);
                Ok(call)
            }
            other => {
                call.revoke(self);
                Err(Attempt::PrefillFailed(format!(
                    "the prefill worker's first message is not the first token: {}",
                    step_name(other.as_ref())
                )))
            }
        }
    }

    /// A `Prefill` call that failed with `status` before its first token: the lease released
    /// if the prefill worker answered (its writer has stopped), revoked otherwise.
    async fn failed(&self, call: &PrefillCall, status: Status) -> Attempt {
        if !writer_stopped(&status) {
            call.revoke(self);
            return Attempt::PrefillFailed(describe(&status));
        }
        self.release(call.lease_id).await;
        if status.code() == Code::InvalidArgument {
            return Attempt::Refused(status);
        }
        Attempt::PrefillFailed(describe(&status))
    }

    /// Streams the first token to the client at once (it is the TTFT), then waits for the
    /// prefill worker's `done`: every write of the lease completed. The first token is out,
    /// so a failure now cannot move to another prefill worker: the client gets the error
    /// (the router's `--migration-limit` may then continue the request elsewhere). Also
    /// returns whether the first token ended the request.
    async fn after_first(
        &self,
        call: &mut PrefillCall,
        tx: &Out,
    ) -> Result<(PrefillReply, bool), Attempt> {
        let first = call.first.take().unwrap_or_default();
        let finished =
            first.finish_reason != i32::from(tandem_protocol::worker::FinishReason::Unspecified);
        if tx.send(Ok(first)).await.is_err() {
            call.revoke(self);
            return Err(Attempt::Over);
        }
        let Some(messages) = call.messages.as_mut() else {
            call.revoke(self);
            return Err(Attempt::Over);
        };
        let answer = tokio::select! {
            r = tokio::time::timeout_at(call.deadline, messages.message()) => r,
            // A client gone while the writes finish: its tokens stop, the lease ends below.
            _ = tx.closed(), if !finished => {
                call.revoke(self);
                return Err(Attempt::Over);
            }
        };
        let failure = match answer {
            Ok(Ok(Some(PrefillProgress {
                step: Some(Step::Done(reply)),
            }))) => return Ok((reply, finished)),
            Ok(Ok(other)) => {
                call.revoke(self);
                format!(
                    "the prefill worker's message after the first token is not done: {}",
                    step_name(other.and_then(|m| m.step).as_ref())
                )
            }
            Ok(Err(status)) => {
                if writer_stopped(&status) {
                    self.release(call.lease_id).await;
                } else {
                    call.revoke(self);
                }
                describe(&status)
            }
            Err(_) => {
                call.revoke(self);
                format!(
                    "its writes did not finish within the lease TTL of {:?}",
                    self.ttl
                )
            }
        };
        if !finished {
            let _ = tx
                .send(Err(Status::unavailable(format!(
                    "the prefill worker {} failed after the first token: {failure}",
                    call.writer
                ))))
                .await;
        }
        Err(Attempt::Over)
    }

    /// Continues the request on this engine from the state the prefill worker handed over
    /// (its first token is out already).
    async fn continue_here(&self, lease_id: u64, reply: PrefillReply, tx: &Out) -> Attempt {
        let state: SequenceState = match engine_sub(reply.state, "state") {
            Ok(s) => s,
            Err(e) => {
                self.release(lease_id).await;
                let _ = tx
                    .send(Err(Status::internal(format!(
                        "malformed prefill reply after the first token: {e}"
                    ))))
                    .await;
                return Attempt::Over;
            }
        };
        match self.engine.activate(lease_id, state).await {
            Ok(stream) => {
                self.leases.remove(lease_id);
                Attempt::Decoding(stream)
            }
            Err(e) => {
                self.release(lease_id).await;
                Attempt::Refused(Status::new(
                    crate::status::engine_code(&e),
                    format!("cannot continue the request after its remote prefill: {e}"),
                ))
            }
        }
    }

    /// Frees a lease whose writer is known to have stopped.
    async fn release(&self, lease_id: u64) {
        if let Err(e) = self.engine.release_reservation(lease_id).await {
            tracing::warn!(lease_id, "releasing a reservation: {e}");
        }
        self.leases.remove(lease_id);
    }

    /// Revokes a lease whose writer may still be writing: quarantine its blocks, then fence
    /// the writer in the background and release only once it has provably stopped — it
    /// answered `FenceLease`, its listener is gone, or the lease ended more than the reclaim
    /// margin ago (the writer stops at the lease's end by its own clock).
    fn revoke(&self, lease_id: u64, epoch: u64, writer: &str) {
        let Some(info) = self.leases.quarantine(lease_id) else {
            return;
        };
        tracing::info!(
            lease_id,
            epoch,
            writer,
            "lease revoked; blocks quarantined until the writer is fenced"
        );
        let fence = Fence {
            client: self.client(writer).ok(),
            owner: self.instance_id,
            lease_id,
            epoch,
            writer: writer.to_owned(),
            rpc_timeout: self.ttl.max(Duration::from_secs(5)),
            reclaim_at: info.granted + self.ttl + self.reclaim_margin,
        };
        let engine = self.engine.clone();
        let leases = self.leases.clone();
        tokio::spawn(async move {
            let proof = fence.run().await;
            count_fence(proof);
            if let Err(e) = engine.release_reservation(lease_id).await {
                tracing::warn!(lease_id, "releasing a fenced reservation: {e}");
            }
            leases.remove(lease_id);
            tracing::info!(
                lease_id,
                proof = proof.label(),
                "quarantined lease released"
            );
        });
    }
}

/// Proving that a revoked lease's writer has stopped.
struct Fence {
    client: Option<WorkerClient<Channel>>,
    owner: u64,
    lease_id: u64,
    epoch: u64,
    writer: String,
    rpc_timeout: Duration,
    /// The lease's end plus the reclaim margin.
    reclaim_at: Instant,
}

impl Fence {
    async fn run(&self) -> FenceProof {
        tokio::select! {
            proof = self.ask() => proof,
            _ = tokio::time::sleep_until(self.reclaim_at.into()) => {
                tracing::warn!(
                    lease_id = self.lease_id,
                    writer = %self.writer,
                    "the writer was neither fenced nor gone; reclaiming its lease past its end"
                );
                FenceProof::DeadlinePassed
            }
        }
    }

    /// Fences the writer, or sees it gone, retrying with backoff.
    async fn ask(&self) -> FenceProof {
        let mut backoff = Duration::from_millis(50);
        loop {
            if let Some(mut c) = self.client.clone() {
                let fence = c.fence_lease(FenceLeaseRequest {
                    owner_instance_id: self.owner,
                    lease_id: self.lease_id,
                    epoch: self.epoch,
                });
                match tokio::time::timeout(self.rpc_timeout, fence).await {
                    Ok(Ok(_)) => return FenceProof::Acknowledged,
                    Ok(Err(s)) => tracing::debug!(lease_id = self.lease_id, "FenceLease: {s}"),
                    Err(_) => tracing::debug!(lease_id = self.lease_id, "FenceLease timed out"),
                }
            }
            if listener_gone(&self.writer).await {
                return FenceProof::WriterGone;
            }
            tracing::warn!(lease_id = self.lease_id, writer = %self.writer, "cannot fence the writer yet; lease stays quarantined");
            // Retry pacing for a production fault path (not a test synchronisation).
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }
}

/// What the request's blocks are hashed under: its cache salt and its images' spans (the
/// prefill worker encodes the images; the blocks it writes carry their hashes).
fn hashing_of(request: &GenerateRequest) -> Result<HashContext, Status> {
    let spans = request
        .media
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let span = required(m.span, "span").map_err(|e| e.within(&format!("media[{i}]")))?;
            MediaSpan::try_from_wire(span).map_err(|e| e.within(&format!("media[{i}]")))
        })
        .collect::<Result<Vec<_>, WireError>>()
        .map_err(|e| Status::from(e.within("request")))?;
    HashContext::new(request.cache_salt.map(CacheSalt), spans)
        .map_err(|e| Status::invalid_argument(format!("request.media: {e}")))
}

/// A `Prefill` call in flight, from its first token on.
struct PrefillCall {
    lease_id: u64,
    epoch: u64,
    /// The prefill worker's gRPC address.
    writer: String,
    /// The lease's end: the whole call, first token and writes, must finish by then.
    deadline: tokio::time::Instant,
    first: Option<GenerateOutput>,
    messages: Option<tonic::Streaming<PrefillProgress>>,
}

impl PrefillCall {
    /// Revokes the lease (its writer may still be writing): see [`DecodeSide::revoke`].
    fn revoke(&self, side: &DecodeSide) {
        side.revoke(self.lease_id, self.epoch, &self.writer);
    }
}

/// A `Prefill` message's kind, for errors.
fn step_name(step: Option<&Step>) -> &'static str {
    match step {
        Some(Step::First(_)) => "a first token",
        Some(Step::Done(_)) => "done",
        None => "an empty message or the end of the stream",
    }
}

fn describe(status: &Status) -> String {
    format!("{:?}: {}", status.code(), status.message())
}

/// Whether a Prefill error came from the prefill worker's handler after its writes stopped
/// (the codes it answers with), as opposed to a transport failure that proves nothing.
fn writer_stopped(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::InvalidArgument
            | Code::FailedPrecondition
            | Code::ResourceExhausted
            | Code::Aborted
            | Code::AlreadyExists
            | Code::Unimplemented
    )
}
