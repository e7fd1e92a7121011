//! The engine thread: owns the backend, the scheduler and the state of each responsibility
//! (live requests, leases, prefill cursors, beam groups), turns commands into state changes and
//! runs steps (see `step.rs`) while there is work.

use std::sync::mpsc::TryRecvError;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc as tmpsc, oneshot};

use super::beam::BeamGroups;
use super::lease::{Leases, Reservation};
use super::outbox::Outbox;
use super::prefill::{BlockExport, PrefillCursors, PrefillEvent};
use super::queue::{CommandQueue, CommandReceiver};
use super::requests::{Entry, Requests, Sink};
use super::{EngineConfig, EngineStats};
use crate::backend::Backend;
use crate::error::EngineError;
use crate::kv::block_manager::BlockManager;
use crate::kv::block_manager::HashContext;
use crate::kv::events::KvEventPublisher;
use crate::request::{FinishReason, Request, RequestOutput, RequestSnapshot, SequenceState, Usage};
use crate::sampler::guide::{Guide, Guides};
use crate::sampler::{Rng, SamplerState, SamplingParams};
use crate::scheduler::{Schedule, Scheduler, SchedulerConfig};
use crate::sequence::{NewSequence, SeqId, Sequence};
use crate::tokenizer::{IncrementalDecoder, Tokenizer};

type Reply<T> = oneshot::Sender<Result<T, EngineError>>;

pub(crate) enum Command {
    Submit {
        request: Request,
        key: u64,
        out: tmpsc::UnboundedSender<RequestOutput>,
        ack: Reply<()>,
    },
    Abort {
        request_id: String,
    },
    /// Abort by stream key (a dropped stream), so a reused request id is never hit.
    AbortKey(u64),
    Stats(oneshot::Sender<EngineStats>),
    Export {
        request_id: String,
        reply: Reply<RequestSnapshot>,
    },
    Import {
        snapshot: Box<RequestSnapshot>,
        key: u64,
        out: tmpsc::UnboundedSender<RequestOutput>,
        ack: Reply<()>,
    },
    ClearCache(Reply<()>),
    Reserve {
        lease_id: u64,
        prompt: Vec<u32>,
        params: SamplingParams,
        hashing: HashContext,
        reply: Reply<Reservation>,
    },
    ReleaseReservation {
        lease_id: u64,
        reply: Reply<()>,
    },
    Activate {
        lease_id: u64,
        state: Box<SequenceState>,
        key: u64,
        out: tmpsc::UnboundedSender<RequestOutput>,
        ack: Reply<()>,
    },
    Prefill {
        request: Request,
        send_from_block: usize,
        export: BlockExport,
        /// The queue the export's pins are released through.
        queue: CommandQueue,
        key: u64,
        out: tmpsc::UnboundedSender<PrefillEvent>,
        ack: Reply<()>,
    },
    /// A [`super::prefill::BlockPin`] was dropped: release its blocks.
    Unpin(u64),
    Shutdown,
}

impl Command {
    /// Whether the command ends something already admitted (so it must never be refused by
    /// the bounded queue, see `queue.rs`).
    pub(crate) fn is_cleanup(&self) -> bool {
        matches!(
            self,
            Command::Abort { .. }
                | Command::AbortKey(_)
                | Command::ReleaseReservation { .. }
                | Command::Unpin(_)
                | Command::Shutdown
        )
    }
}

/// Counts reported in [`EngineStats`].
#[derive(Default)]
pub(super) struct Counters {
    steps: u64,
    preemptions: u64,
    /// Tokens at prompt positions that went through a forward pass, ever.
    prompt_tokens_computed: u64,
    /// Time in steps that ran a forward pass, in the backend's calls of those steps, and in
    /// their `apply` (marking pieces computed, sampling on the host, emitting).
    step_time: Duration,
    forward_time: Duration,
    apply_time: Duration,
    /// The part of `step_time` in the scheduler's `schedule`.
    schedule_time: Duration,
    /// Time on the engine thread between one step's end and the next one's start while it
    /// had work (commands handled between steps), and when the last step ended (None once
    /// the thread has waited idle).
    between_time: Duration,
    last_step_end: Option<Instant>,
}

impl Counters {
    /// A schedule was made: counts its preemptions.
    pub(super) fn scheduled(&mut self, sch: &Schedule) {
        self.preemptions += sch.preempted.len() as u64;
    }

    /// A step ran its forward pass; returns how many have run.
    pub(super) fn stepped(&mut self) -> u64 {
        self.steps += 1;
        self.steps
    }

    /// A forward pass computed `n` tokens at prompt positions.
    pub(super) fn prompt_tokens(&mut self, n: usize) {
        self.prompt_tokens_computed += n as u64;
    }

    /// A step that ran a forward pass took `d` in all.
    pub(super) fn step_took(&mut self, d: Duration) {
        self.step_time += d;
    }

    /// The backend's forward call (with its sampling, when on the device) took `d`.
    pub(super) fn forward_took(&mut self, d: Duration) {
        self.forward_time += d;
    }

    /// A step's schedule took `d`.
    pub(super) fn schedule_took(&mut self, d: Duration) {
        self.schedule_time += d;
    }

    /// A step's `apply` took `d`.
    pub(super) fn apply_took(&mut self, d: Duration) {
        self.apply_time += d;
    }

    /// A step starts at `now`: the time since the previous one ended counts as between
    /// steps, unless the thread waited idle since.
    pub(super) fn step_starts(&mut self, now: Instant) {
        if let Some(end) = self.last_step_end.take() {
            self.between_time += now.saturating_duration_since(end);
        }
    }

    /// A step ended at `now`.
    pub(super) fn step_ended(&mut self, now: Instant) {
        self.last_step_end = Some(now);
    }

    /// The thread is about to wait for a command with nothing to do.
    pub(super) fn idle(&mut self) {
        self.last_step_end = None;
    }
}

pub(crate) struct Core {
    pub(super) backend: Box<dyn Backend>,
    pub(super) tokenizer: Option<Arc<Tokenizer>>,
    /// Compiles structured-output constraints (its token table is built on first use).
    pub(super) guides: Guides,
    pub(super) cfg: EngineConfig,
    pub(super) sched: Scheduler,
    events: KvEventPublisher,
    /// Live requests and their sequences (see `requests.rs`).
    pub(super) requests: Requests,
    /// Reserved blocks by lease id (see `lease.rs`).
    pub(super) leases: Leases,
    /// Prefill-only sequences: the next prompt block to send (see `prefill.rs`).
    pub(super) prefills: PrefillCursors,
    /// Beam groups by request id (see `beam.rs`).
    pub(super) beams: BeamGroups,
    pub(super) counters: Counters,
    /// Outputs on their way to the requests' streams (see `outbox.rs`).
    pub(super) outbox: Outbox,
}

pub(super) fn output(request_id: &str, index: usize) -> RequestOutput {
    RequestOutput {
        request_id: request_id.to_owned(),
        index,
        token_ids: Vec::new(),
        text: String::new(),
        logprobs: Vec::new(),
        finish_reason: None,
        stop_reason: None,
        usage: None,
        error: None,
        score: None,
    }
}

/// What another engine needs to continue `seq` (see [`SequenceState`]).
pub(super) fn state_of(seq: &Sequence) -> SequenceState {
    SequenceState {
        request_id: seq.request_id.to_string(),
        index: seq.index,
        params: (*seq.params).clone(),
        tokens: seq.tokens.clone(),
        prompt_len: seq.prompt_len,
        max_tokens: seq.max_tokens,
        num_computed: seq.num_computed,
        cached_prompt_tokens: seq.cached_prompt_tokens.unwrap_or(0),
        sampler: seq.sampler.clone(),
        stop: seq.stop.clone(),
        cache_salt: seq.table.salt(),
        media: seq.table.hashing().media().to_vec(),
    }
}

/// Where the output tokens a migrated request replays start in its prompt (its length when
/// none), checked: a replay continues one choice, and leaves at least one prompt token that
/// is not output.
fn check_replay(req: &Request) -> Result<usize, EngineError> {
    let r = req.replayed;
    if r == 0 {
        return Ok(req.prompt.len());
    }
    let bad = |m: String| Err(EngineError::InvalidRequest(m));
    if r >= req.prompt.len() {
        return bad(format!(
            "replayed_tokens {r} must be fewer than the prompt's {} tokens",
            req.prompt.len()
        ));
    }
    if req.params.n != 1 || req.params.use_beam_search {
        return bad("replayed_tokens continues one choice: n = 1 and no beam search".into());
    }
    Ok(req.prompt.len() - r)
}

/// Parameters as a sequence keeps them: `stop_token_ids` sorted and without repeats, so
/// each generated token is looked up by binary search (their count is capped, see
/// `tandem_text::limits`).
pub(super) fn normalized(mut params: SamplingParams) -> SamplingParams {
    params.stop_token_ids.sort_unstable();
    params.stop_token_ids.dedup();
    params
}

pub(super) fn usage(seq: &Sequence) -> Usage {
    Usage {
        prompt_tokens: seq.prompt_len,
        completion_tokens: seq.num_generated(),
        cached_tokens: seq.cached_prompt_tokens.unwrap_or(0),
    }
}

impl Core {
    pub(crate) fn new(
        backend: Box<dyn Backend>,
        tokenizer: Option<Arc<Tokenizer>>,
        cfg: EngineConfig,
        events: KvEventPublisher,
    ) -> Self {
        let blocks = BlockManager::new(
            cfg.num_blocks,
            cfg.kv_block_size,
            cfg.enable_block_reuse,
            events.clone(),
        );
        let sched = Scheduler::new(
            SchedulerConfig {
                max_batch_size: cfg.max_batch_size,
                max_num_tokens: cfg.max_num_tokens,
                enable_chunked_prefill: cfg.enable_chunked_prefill,
                policy: cfg.capacity_scheduler_policy,
            },
            blocks,
        );
        let guides = Guides::new(
            tokenizer.clone(),
            backend.vocab_size(),
            cfg.eos_token_ids.clone(),
        );
        Self {
            backend,
            tokenizer,
            guides,
            cfg,
            sched,
            events,
            requests: Requests::new(),
            leases: Leases::new(),
            prefills: PrefillCursors::new(),
            beams: BeamGroups::new(),
            counters: Counters::default(),
            outbox: Outbox::new(),
        }
    }

    pub(crate) fn run(mut self, rx: CommandReceiver) {
        loop {
            // What the last commands and step made goes to the streams now.
            self.outbox.flush();
            // Block while idle; otherwise take what has arrived and go on stepping.
            if self.sched.is_idle() {
                self.counters.idle();
                match rx.recv() {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            break;
                        }
                    }
                    Err(_) => break,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            self.abort_all();
                            return;
                        }
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        if self.sched.is_idle() {
                            return;
                        }
                        break;
                    }
                }
            }
            // (An abort's last output, before the step.)
            self.outbox.flush();
            if !self.sched.is_idle() && !self.step() {
                // Work exists but nothing can be scheduled (cannot happen with admission
                // checks, but never spin): wait for a command to change the situation.
                self.outbox.flush();
                self.counters.idle();
                match rx.recv() {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            break;
                        }
                    }
                    Err(_) => break,
                }
            }
        }
        self.abort_all();
    }

    /// Returns false on shutdown.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit {
                request,
                key,
                out,
                ack,
            } => {
                let _ = ack.send(self.submit(request, key, Sink::Stream(out)));
            }
            Command::Abort { request_id } => self.abort(&request_id),
            Command::AbortKey(key) => {
                if let Some(id) = self.requests.with_key(key) {
                    self.abort(&id);
                }
            }
            // Answered once this engine's outputs so far have reached their streams: a
            // caller that asks for stats after a step finds the step's outputs there (the
            // mocker's virtual-clock replay relies on it).
            Command::Stats(reply) => {
                let stats = self.stats();
                self.outbox.then(move || {
                    let _ = reply.send(stats);
                });
            }
            Command::Export { request_id, reply } => {
                let _ = reply.send(self.export(&request_id));
            }
            Command::Import {
                snapshot,
                key,
                out,
                ack,
            } => {
                let _ = ack.send(self.import(*snapshot, key, out));
            }
            Command::ClearCache(reply) => {
                let _ = reply.send(self.clear_cache());
            }
            Command::Reserve {
                lease_id,
                prompt,
                params,
                hashing,
                reply,
            } => {
                let _ = reply.send(self.reserve(lease_id, prompt, &params, hashing));
            }
            Command::ReleaseReservation { lease_id, reply } => {
                let _ = reply.send(self.release_reservation(lease_id));
            }
            Command::Activate {
                lease_id,
                state,
                key,
                out,
                ack,
            } => {
                let _ = ack.send(self.activate(lease_id, *state, key, out));
            }
            Command::Prefill {
                request,
                send_from_block,
                export,
                queue,
                key,
                out,
                ack,
            } => {
                let r = self.prefill(request, send_from_block, (export, queue), key, out);
                let _ = ack.send(r);
            }
            Command::Unpin(id) => self.prefills.unpin(self.sched.blocks_mut(), id),
            Command::Shutdown => return false,
        }
        true
    }

    fn stats(&self) -> EngineStats {
        let queued = self.sched.queued_load();
        EngineStats {
            running: self.sched.num_running(),
            waiting: self.sched.num_waiting(),
            requests: self.requests.len(),
            blocks: self.sched.block_stats(),
            steps: self.counters.steps,
            preemptions: self.counters.preemptions,
            last_event_id: self.events.last_event_id(),
            prompt_tokens_computed: self.counters.prompt_tokens_computed,
            reservations: self.leases.len(),
            reserved_blocks: self.leases.reserved_blocks(),
            block_size: self.sched.blocks().block_size(),
            queued_prefill_tokens: queued.prefill_tokens,
            queued_kv_tokens: queued.kv_tokens,
            step_micros: micros(self.counters.step_time),
            forward_micros: micros(self.counters.forward_time),
            apply_micros: micros(self.counters.apply_time),
            schedule_micros: micros(self.counters.schedule_time),
            between_steps_micros: micros(self.counters.between_time),
        }
    }

    /// Drops every cached block; refused while reservations or requests hold blocks.
    fn clear_cache(&mut self) -> Result<(), EngineError> {
        if !self.leases.is_empty() {
            return Err(EngineError::InvalidRequest(format!(
                "cannot clear the KV cache while {} reservations hold blocks",
                self.leases.len()
            )));
        }
        self.sched.blocks_mut().clear_cache().map_err(|n| {
            EngineError::InvalidRequest(format!(
                "cannot clear the KV cache while {n} blocks are in use"
            ))
        })
    }

    pub(super) fn new_decoder(&self, params: &SamplingParams) -> Option<IncrementalDecoder> {
        self.tokenizer
            .as_ref()
            .map(|_| IncrementalDecoder::new(params.skip_special_tokens))
    }

    /// The guide of a constrained sequence whose output so far is `output` (None without a
    /// constraint).
    pub(super) fn guide_for(
        &self,
        params: &SamplingParams,
        output: &[u32],
    ) -> Result<Option<Box<Guide>>, EngineError> {
        let Some(c) = &params.constraint else {
            return Ok(None);
        };
        let mut guide = self.guides.compile(c)?;
        guide.replay(output)?;
        Ok(Some(Box::new(guide)))
    }

    pub(super) fn submit(&mut self, req: Request, key: u64, out: Sink) -> Result<(), EngineError> {
        self.check_request_limit()?;
        let max_tokens = self.validate(&req.request_id, &req.prompt, &req.params)?;
        let output_from = check_replay(&req)?;
        let guide = self.guide_for(&req.params, &req.prompt[output_from..])?;
        let hashing = self.media_context(&req.prompt, req.cache_salt, &req.media)?;
        let media: Arc<[_]> = Arc::from(req.media);
        let seed = req.params.seed.unwrap_or_else(Rng::random_seed);
        let params = Arc::new(normalized(req.params));
        let rid: Arc<str> = Arc::from(req.request_id.as_str());
        // A beam request starts as one sequence; its beams fork from it (see `beam.rs`).
        let choices = if params.use_beam_search { 1 } else { params.n };
        let mut seqs = Vec::with_capacity(choices);
        for index in 0..choices {
            let mut seq = Sequence::new(NewSequence {
                id: self.requests.new_seq_id(),
                request_id: rid.clone(),
                index,
                tokens: req.prompt.clone(),
                max_tokens,
                arrival: self.requests.new_arrival(),
                params: params.clone(),
                sampler: SamplerState::replayed(
                    seed,
                    index as u64,
                    &params,
                    &req.prompt[output_from..],
                ),
                hashing: hashing.clone(),
                media: media.clone(),
            });
            seq.decoder = self.new_decoder(&params);
            seq.guide = guide.as_ref().map(|g| Box::new(g.fork()));
            if params.use_beam_search {
                seq.decoder = None;
                self.submit_beams(&seq);
            }
            seqs.push(seq.id);
            self.sched.add(seq);
        }
        self.requests
            .insert(req.request_id, Entry::new(key, seqs, out));
        Ok(())
    }

    /// Ends one sequence: removes it, releases its blocks and sends its last output. A
    /// prefill-only sequence ends with `Done`; with `handoff`, it continues elsewhere: its
    /// output then carries no finish reason or usage.
    pub(super) fn finish_seq(
        &mut self,
        id: SeqId,
        reason: FinishReason,
        mut last: RequestOutput,
        handoff: bool,
    ) {
        let Some(rid) = self.requests.request_of(id).map(str::to_owned) else {
            return;
        };
        self.requests.detach_seq(&rid, id);
        self.prefills.remove(id);
        let seq = self.sched.remove(id, reason);
        if let (Some(seq), false) = (&seq, handoff) {
            last.finish_reason = Some(reason);
            last.usage = Some(usage(seq));
        }
        match (self.requests.get(&rid).map(Entry::sink), &seq) {
            (Some(Sink::Stream(tx)), _) => {
                self.outbox.push(tx, last);
            }
            (Some(Sink::Prefill(tx)), Some(seq)) => {
                let _ = tx.send(PrefillEvent::Done {
                    output: last,
                    state: state_of(seq),
                });
            }
            // Unreachable (a live id always has its sequence); the stream then ends.
            (Some(Sink::Prefill(_)), None) | (None, _) => {}
        }
        self.requests.remove_if_done(&rid);
    }

    pub(super) fn abort(&mut self, request_id: &str) {
        self.fail(request_id, None);
    }

    /// Ends every choice of a request with `abort` (and an error message, if any).
    pub(super) fn fail(&mut self, request_id: &str, error: Option<String>) {
        if self.beams.contains(request_id) {
            self.finish_beams(request_id, Some(error));
            return;
        }
        let Some(e) = self.requests.get(request_id) else {
            return;
        };
        for id in e.seqs().to_vec() {
            let index = self.sched.get(id).map(|s| s.index).unwrap_or(0);
            let mut o = output(request_id, index);
            o.error = error.clone();
            self.finish(id, FinishReason::Abort, o);
        }
    }

    pub(super) fn finish(&mut self, id: SeqId, reason: FinishReason, last: RequestOutput) {
        self.finish_seq(id, reason, last, false);
    }

    fn abort_all(&mut self) {
        for id in self.requests.ids() {
            self.fail(&id, Some("the engine is shutting down".into()));
        }
        self.drop_leases();
    }
}

/// Whole microseconds of `d`, saturating.
fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}
