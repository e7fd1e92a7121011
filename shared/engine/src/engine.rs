//! The async engine API used by workers and the simulator.
//!
//! [`Engine::start`] moves a backend onto a dedicated OS thread (the compute loop of the
//! private `engine::core` module) and returns a cloneable [`EngineHandle`]. The handle talks to the thread over a
//! channel; each request's outputs come back on its own [`RequestStream`]. When idle, the
//! thread blocks on its command channel (no spinning); it ends when every handle and stream is
//! dropped, or on [`EngineHandle::shutdown`].
//!
//! Every handle method queues its command when it is called, not when its future is first
//! polled, so commands reach the engine in call order.
//!
//! KV events are published by the block manager through a [`KvEventPublisher`] that the
//! handle shares, so subscribing or dumping never waits for a step.
//!
//! Disaggregated serving (prefill on one engine, decode on another): the decode engine
//! [`EngineHandle::reserve`]s the prompt's blocks under a lease (its cached prefix plus fresh
//! blocks, which a transport writes straight into the pool memory, see
//! [`crate::backend::KvPoolMemory`]); the prefill engine runs [`EngineHandle::prefill`], which
//! streams the missing blocks as they complete and ends with the first token and the
//! [`SequenceState`]; the decode engine then [`EngineHandle::activate`]s the lease with that
//! state, or [`EngineHandle::release_reservation`]s it. Both halves together produce exactly
//! what one engine would.

mod beam;
#[cfg(test)]
mod beam_tests;
mod core;
#[cfg(test)]
mod disagg_tests;
mod emit;
#[cfg(test)]
mod hardening_tests;
mod lease;
#[cfg(test)]
mod media_tests;
mod migrate;
mod outbox;
mod prefill;
mod queue;
mod requests;
mod step;
#[cfg(test)]
mod test_backend;
#[cfg(test)]
mod tests;
mod validate;

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, mpsc as tmpsc, oneshot, watch};

use self::core::{Command, Core};
pub use self::lease::Reservation;
pub use self::prefill::{BlockExport, BlockPin, PrefillEvent, PrefillStream};
use self::queue::{command_queue, CommandQueue};
use crate::backend::{Backend, DevicePool};
use crate::error::EngineError;
use crate::kv::block_manager::BlockStats;
use crate::kv::block_manager::HashContext;
use crate::kv::events::{KvCacheEvent, KvEventPublisher, KvStoredDump, ReplayGap};
use crate::kv::layout::KvLayout;
pub use crate::request::{
    FinishReason, Request, RequestOutput, RequestSnapshot, SequenceState, StopReason, Usage,
};
use crate::sampler::SamplingParams;
pub use crate::scheduler::CapacitySchedulerPolicy;
use crate::tokenizer::Tokenizer;

/// Engine options. Field names mirror TensorRT-LLM's LLM API options of the same meaning
/// (`max_batch_size`, `max_num_tokens`, `max_seq_len`, `enable_chunked_prefill`,
/// `kv_cache_config.{tokens_per_block → kv_block_size, enable_block_reuse,
/// event_buffer_max_size}`, `scheduler_config.capacity_scheduler_policy`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineConfig {
    /// Most sequences running at once.
    pub max_batch_size: usize,
    /// Most new tokens computed in one step (prefill chunks + one per decoding sequence).
    pub max_num_tokens: usize,
    /// Longest sequence (prompt + generated); longer requests are refused at submission.
    pub max_seq_len: usize,
    pub enable_chunked_prefill: bool,
    /// Tokens per KV block; 0 takes the backend's. Must equal the backend layout's.
    pub kv_block_size: usize,
    /// KV blocks the engine may use; 0 takes all of the backend's. See
    /// [`EngineConfig::num_blocks_for_max_tokens`] for `kv_cache_config.max_tokens`.
    pub num_blocks: usize,
    pub enable_block_reuse: bool,
    /// KV events kept for replay by late subscribers.
    pub event_buffer_max_size: usize,
    pub capacity_scheduler_policy: CapacitySchedulerPolicy,
    /// End-of-sequence ids (from `generation_config.json`).
    pub eos_token_ids: Vec<u32>,
    /// Data-parallel rank stamped on KV events.
    pub dp_rank: u32,
    /// Widest beam search accepted (`use_beam_search` with `best_of`/`n`); 1 refuses beam
    /// search wider than one beam.
    pub max_beam_width: usize,
    /// Most requests held at once (running and waiting, decode reservations included); a new
    /// one past it is refused with [`EngineError::Overloaded`]. None: unlimited
    /// (`--engine-request-limit`).
    #[serde(default)]
    pub request_limit: Option<usize>,
    /// Most commands that start or ask for something (submit, prefill, stats, ...) waiting
    /// for the engine thread; more are refused with [`EngineError::QueueFull`].
    #[serde(default = "default_command_queue_capacity")]
    pub command_queue_capacity: usize,
}

fn default_command_queue_capacity() -> usize {
    4096
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_batch_size: 256,
            max_num_tokens: 8192,
            max_seq_len: 4096,
            enable_chunked_prefill: true,
            kv_block_size: 0,
            num_blocks: 0,
            enable_block_reuse: true,
            event_buffer_max_size: 1024,
            capacity_scheduler_policy: CapacitySchedulerPolicy::GuaranteedNoEvict,
            eos_token_ids: Vec::new(),
            dp_rank: 0,
            max_beam_width: 1,
            request_limit: None,
            command_queue_capacity: default_command_queue_capacity(),
        }
    }
}

impl EngineConfig {
    /// Blocks for `kv_cache_config.max_tokens` (rounded down: a partial block is useless).
    pub fn num_blocks_for_max_tokens(max_tokens: usize, block_size: usize) -> usize {
        max_tokens.checked_div(block_size).unwrap_or(0)
    }
}

/// A snapshot of the engine's load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub requests: usize,
    pub blocks: BlockStats,
    pub steps: u64,
    pub preemptions: u64,
    pub last_event_id: u64,
    /// Tokens at prompt positions (`< prompt_len`) that went through a forward pass, ever
    /// (recomputes included; a decode engine fed by remote prefills computes none).
    pub prompt_tokens_computed: u64,
    /// Live reservations (leases).
    pub reservations: usize,
    /// Blocks held by live reservations (counted in `blocks.referenced` too).
    pub reserved_blocks: usize,
    /// Tokens per KV block.
    #[serde(default)]
    pub block_size: usize,
    /// Prompt tokens not prefilled yet (waiting sequences and running ones mid-prefill).
    #[serde(default)]
    pub queued_prefill_tokens: usize,
    /// Tokens of waiting sequences, whose KV blocks are not held yet.
    #[serde(default)]
    pub queued_kv_tokens: usize,
    /// Wall time of the steps that ran a forward pass, ever, in microseconds: scheduling,
    /// the forward pass, sampling and emitting.
    #[serde(default)]
    pub step_micros: u64,
    /// The part of `step_micros` inside the backend's calls (on a GPU: the inputs copied to
    /// the device, the launches, the wait for the results and their read-back). The rest is
    /// the engine thread's own work — scheduling, the backend's inputs and sampling plans,
    /// emitting — during which the backend's device is idle.
    #[serde(default)]
    pub forward_micros: u64,
    /// The part of `step_micros` in marking the step's pieces computed, sampling on the host
    /// and emitting the tokens (the rest outside `forward_micros` is scheduling and preparing
    /// the backend's inputs and sampling plans).
    #[serde(default)]
    pub apply_micros: u64,
    /// The part of `step_micros` in the scheduler's `schedule` (the rest of the time before
    /// the forward pass prepares the backend's inputs and sampling plans).
    #[serde(default)]
    pub schedule_micros: u64,
    /// Time on the engine thread between steps while it had work (the commands it handled
    /// there, such as admitting requests): outside `step_micros`, and the device idles too.
    #[serde(default)]
    pub between_steps_micros: u64,
}

pub struct Engine;

impl Engine {
    /// Starts the compute thread over `backend`. Without a tokenizer, outputs carry token ids
    /// only and stop strings are refused.
    pub fn start(
        backend: Box<dyn Backend>,
        tokenizer: Option<Arc<Tokenizer>>,
        mut config: EngineConfig,
    ) -> Result<EngineHandle, EngineError> {
        let layout = backend.layout().clone();
        let device_pool = backend.device_pool();
        if config.kv_block_size == 0 {
            config.kv_block_size = layout.block_size;
        }
        if config.kv_block_size != layout.block_size {
            return Err(EngineError::Config(format!(
                "kv_block_size {} differs from the backend's block size {}",
                config.kv_block_size, layout.block_size
            )));
        }
        if config.num_blocks == 0 {
            config.num_blocks = backend.num_blocks();
        }
        if config.num_blocks > backend.num_blocks() {
            return Err(EngineError::Config(format!(
                "num_blocks {} exceeds the backend's pool of {}",
                config.num_blocks,
                backend.num_blocks()
            )));
        }
        for (name, v) in [
            ("max_batch_size", config.max_batch_size),
            ("max_num_tokens", config.max_num_tokens),
            ("max_seq_len", config.max_seq_len),
            ("num_blocks", config.num_blocks),
            ("max_beam_width", config.max_beam_width),
            ("command_queue_capacity", config.command_queue_capacity),
            ("request_limit", config.request_limit.unwrap_or(1)),
        ] {
            if v == 0 {
                return Err(EngineError::Config(format!("{name} must be > 0")));
            }
        }
        let events = KvEventPublisher::new(config.event_buffer_max_size, config.dp_rank);
        let (tx, rx) = command_queue(config.command_queue_capacity);
        let core = Core::new(backend, tokenizer, config.clone(), events.clone());
        // Dropped when the thread ends, however it ends (a panic unwinds through it).
        let (alive_tx, alive) = watch::channel(());
        std::thread::Builder::new()
            .name("tandem-engine".into())
            .spawn(move || {
                let _alive = alive_tx;
                core.run(rx)
            })
            .map_err(|e| EngineError::Config(format!("cannot start the engine thread: {e}")))?;
        Ok(EngineHandle {
            tx,
            alive,
            info: Arc::new(Info {
                config,
                layout,
                device_pool,
            }),
            events,
            next_key: Arc::new(AtomicU64::new(1)),
        })
    }
}

struct Info {
    config: EngineConfig,
    layout: KvLayout,
    device_pool: Option<DevicePool>,
}

/// A cloneable handle on a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    tx: CommandQueue,
    /// Closed once the engine thread has ended.
    alive: watch::Receiver<()>,
    info: Arc<Info>,
    events: KvEventPublisher,
    next_key: Arc<AtomicU64>,
}

impl EngineHandle {
    /// The configuration in force (defaults resolved).
    pub fn config(&self) -> &EngineConfig {
        &self.info.config
    }

    pub fn layout(&self) -> &KvLayout {
        &self.info.layout
    }

    /// The KV pool's GPU memory, when it lives on a GPU (see [`Backend::device_pool`]).
    pub fn device_pool(&self) -> Option<DevicePool> {
        self.info.device_pool
    }

    fn send(&self, cmd: Command) -> Result<(), EngineError> {
        self.tx.send(cmd)
    }

    /// Whether the engine thread still runs (false once it ended: shutdown, or a panic).
    pub fn is_running(&self) -> bool {
        self.alive.has_changed().is_ok()
    }

    /// Resolves once the engine thread has ended, however it ended.
    pub fn stopped(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut alive = self.alive.clone();
        async move { while alive.changed().await.is_ok() {} }
    }

    /// Sends a command now (so commands keep the order of the calls, even before the
    /// returned future is polled) and awaits its reply.
    fn call<T: Send + 'static>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> impl Future<Output = Result<T, EngineError>> + Send + 'static {
        let (tx, rx) = oneshot::channel();
        let sent = self.send(make(tx));
        async move {
            sent?;
            rx.await.map_err(|_| EngineError::Stopped)
        }
    }

    /// Queues a request; its outputs arrive on the returned stream. Refused with a clear
    /// error when it cannot run (bad parameters, prompt + max_tokens over `max_seq_len`,
    /// more blocks than the pool, duplicate id).
    pub fn submit(
        &self,
        request: Request,
    ) -> impl Future<Output = Result<RequestStream, EngineError>> + Send + 'static {
        let n = request.params.n;
        let request_id = request.request_id.clone();
        self.open_stream(request_id, n, move |key, out, ack| Command::Submit {
            request,
            key,
            out,
            ack,
        })
    }

    /// Sends a command that starts a request with its own output stream (submit, import,
    /// activate) and awaits its acknowledgement.
    fn open_stream(
        &self,
        request_id: String,
        n: usize,
        make: impl FnOnce(
            u64,
            tmpsc::UnboundedSender<RequestOutput>,
            oneshot::Sender<Result<(), EngineError>>,
        ) -> Command,
    ) -> impl Future<Output = Result<RequestStream, EngineError>> + Send + 'static {
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        let (out_tx, out_rx) = tmpsc::unbounded_channel();
        let ack = self.call(move |ack| make(key, out_tx, ack));
        let tx = self.tx.clone();
        async move {
            ack.await??;
            Ok(RequestStream::new(request_id, key, n, out_rx, tx))
        }
    }

    /// Aborts a request: each live choice ends with finish reason `abort` and its blocks are
    /// freed. Unknown ids are ignored.
    pub fn abort(&self, request_id: &str) {
        let _ = self.send(Command::Abort {
            request_id: request_id.to_owned(),
        });
    }

    pub fn stats(&self) -> impl Future<Output = Result<EngineStats, EngineError>> + Send + 'static {
        self.call(Command::Stats)
    }

    /// Live KV events from now on.
    pub fn subscribe_events(&self) -> broadcast::Receiver<KvCacheEvent> {
        self.events.subscribe()
    }

    /// Buffered events from `event_id` on, then the live stream.
    pub fn subscribe_events_from(
        &self,
        event_id: u64,
    ) -> Result<(Vec<KvCacheEvent>, broadcast::Receiver<KvCacheEvent>), ReplayGap> {
        self.events.subscribe_from(event_id)
    }

    /// Every stored block, then the live stream after the dump's `last_event_id`.
    pub fn dump_stored_blocks(&self) -> (KvStoredDump, broadcast::Receiver<KvCacheEvent>) {
        self.events.dump()
    }

    /// Takes a request (n = 1) out of this engine with its KV blocks and sampling state. Its
    /// stream here ends with finish reason `migrated`; [`EngineHandle::import`] on another
    /// engine continues it exactly.
    pub fn export(
        &self,
        request_id: &str,
    ) -> impl Future<Output = Result<RequestSnapshot, EngineError>> + Send + 'static {
        let request_id = request_id.to_owned();
        let reply = self.call(move |reply| Command::Export { request_id, reply });
        async move { reply.await? }
    }

    /// Continues an exported request here. Refused when the layouts differ.
    pub fn import(
        &self,
        snapshot: RequestSnapshot,
    ) -> impl Future<Output = Result<RequestStream, EngineError>> + Send + 'static {
        let request_id = snapshot.state.request_id.clone();
        self.open_stream(request_id, 1, move |key, out, ack| Command::Import {
            snapshot: Box::new(snapshot),
            key,
            out,
            ack,
        })
    }

    /// Holds blocks for `prompt` under `lease_id`: the locally cached prefix (attached, so it
    /// cannot be evicted) plus fresh blocks for the rest, which a remote prefill writes into
    /// the pool memory (at each block's offset). Validates the prompt as `submit` does (vocab,
    /// length < max_seq_len, the request fits the pool with max_tokens from `params`).
    /// The prefix is matched under `hashing` (the request's cache salt and media spans;
    /// activation checks that the prefilled state carries the same).
    /// Errors: `DuplicateLease`, `OutOfBlocks` when the pool cannot hold it right now.
    pub fn reserve(
        &self,
        lease_id: u64,
        prompt: Vec<u32>,
        params: SamplingParams,
        hashing: HashContext,
    ) -> impl Future<Output = Result<Reservation, EngineError>> + Send + 'static {
        let reply = self.call(move |reply| Command::Reserve {
            lease_id,
            prompt,
            params,
            hashing,
            reply,
        });
        async move { reply.await? }
    }

    /// Frees a reservation that will not be activated: prefix blocks are released, fresh
    /// blocks go back to the free list without being registered in the prefix cache (their
    /// content is unknown). Unknown lease id → `UnknownLease`.
    pub fn release_reservation(
        &self,
        lease_id: u64,
    ) -> impl Future<Output = Result<(), EngineError>> + Send + 'static {
        let reply = self.call(move |reply| Command::ReleaseReservation { lease_id, reply });
        async move { reply.await? }
    }

    /// Continues a request whose prompt KV was written into reservation `lease_id` by a
    /// remote prefill; `state` is what that prefill returned (`PrefillEvent::Done` without a
    /// finish reason: tokens = prompt + first token, num_computed == prompt_len). Checks the
    /// state's prompt against the reserved one, num_computed, and the rest as `import` does;
    /// the reservation's blocks become the sequence's table, the prompt's full blocks are
    /// committed to the prefix cache (KV `Stored` events), and the sequence is queued. Usage
    /// reports `cached_tokens = max(state.cached_prompt_tokens, reservation.cached_tokens)`.
    /// On refusal the reservation stays (the caller releases it).
    pub fn activate(
        &self,
        lease_id: u64,
        state: SequenceState,
    ) -> impl Future<Output = Result<RequestStream, EngineError>> + Send + 'static {
        let request_id = state.request_id.clone();
        self.open_stream(request_id, 1, move |key, out, ack| Command::Activate {
            lease_id,
            state: Box::new(state),
            key,
            out,
            ack,
        })
    }

    /// Runs the prompt of `request` (n must be 1) here — with this engine's prefix cache and
    /// chunking like any request — samples the first token exactly as an aggregated run would,
    /// then ends the sequence here (its blocks stay in the prefix cache). Emits
    /// `PrefillEvent::Blocks` for exactly the blocks `send_from_block..blocks_for(prompt_len)`,
    /// each once, in order, as soon as each is complete, then one `Done` (see
    /// [`PrefillEvent`]). `send_from_block` beyond the prompt's blocks is refused.
    pub fn prefill(
        &self,
        request: Request,
        send_from_block: usize,
    ) -> impl Future<Output = Result<PrefillStream, EngineError>> + Send + 'static {
        self.prefill_as(request, send_from_block, BlockExport::Host)
    }

    /// [`EngineHandle::prefill`] with the blocks leaving as `export` says: with
    /// [`BlockExport::Device`] they come as `PrefillEvent::DeviceBlocks` (the GPU pool's own
    /// memory, pinned until each event's pin is dropped); refused when the pool is not GPU
    /// memory.
    pub fn prefill_as(
        &self,
        request: Request,
        send_from_block: usize,
        export: BlockExport,
    ) -> impl Future<Output = Result<PrefillStream, EngineError>> + Send + 'static {
        let request_id = request.request_id.clone();
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        let (out_tx, out_rx) = tmpsc::unbounded_channel();
        let queue = self.tx.clone();
        let ack = self.call(move |ack| Command::Prefill {
            request,
            send_from_block,
            export,
            queue,
            key,
            out: out_tx,
            ack,
        });
        let tx = self.tx.clone();
        async move {
            ack.await??;
            Ok(PrefillStream::new(request_id, key, out_rx, tx))
        }
    }

    /// Drops every cached block and publishes `Cleared`; refused while requests run or
    /// reservations exist.
    pub fn clear_cache(&self) -> impl Future<Output = Result<(), EngineError>> + Send + 'static {
        let reply = self.call(Command::ClearCache);
        async move { reply.await? }
    }

    /// Stops the engine thread; live requests end with finish reason `abort` and
    /// reservations are dropped.
    pub fn shutdown(&self) {
        let _ = self.send(Command::Shutdown);
    }
}

/// The outputs of one request (all its choices, interleaved). Dropping it before the end
/// aborts the request.
pub struct RequestStream {
    request_id: String,
    key: u64,
    remaining: usize,
    rx: tmpsc::UnboundedReceiver<RequestOutput>,
    tx: CommandQueue,
    /// The outputs ended before every choice finished (the engine thread is gone).
    cut: bool,
}

impl RequestStream {
    fn new(
        request_id: String,
        key: u64,
        n: usize,
        rx: tmpsc::UnboundedReceiver<RequestOutput>,
        tx: CommandQueue,
    ) -> Self {
        Self {
            request_id,
            key,
            remaining: n,
            rx,
            tx,
            cut: false,
        }
    }

    /// Whether the stream ended before every choice finished: the engine thread stopped
    /// without ending the request (it died).
    pub fn was_cut(&self) -> bool {
        self.cut
    }

    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// The next output, or None once every choice has finished.
    pub async fn next(&mut self) -> Option<RequestOutput> {
        if self.remaining == 0 {
            return None;
        }
        match self.rx.recv().await {
            Some(o) => {
                if o.finish_reason.is_some() {
                    self.remaining -= 1;
                }
                Some(o)
            }
            None => {
                self.remaining = 0;
                self.cut = true;
                None
            }
        }
    }

    /// The next output if one is ready now (`None` also once every choice has finished; a
    /// stream whose engine is gone is noticed by [`Self::next`]).
    pub fn try_next(&mut self) -> Option<RequestOutput> {
        if self.remaining == 0 {
            return None;
        }
        let o = self.rx.try_recv().ok()?;
        if o.finish_reason.is_some() {
            self.remaining -= 1;
        }
        Some(o)
    }

    /// Every remaining output, in order.
    pub async fn collect(mut self) -> Vec<RequestOutput> {
        let mut v = Vec::new();
        while let Some(o) = self.next().await {
            v.push(o);
        }
        v
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if self.remaining > 0 {
            let _ = self.tx.send(Command::AbortKey(self.key));
        }
    }
}
