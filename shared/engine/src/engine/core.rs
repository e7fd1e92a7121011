//! The engine thread: owns the backend and the scheduler, turns commands into state changes
//! and runs steps (schedule → forward → sample → emit) while there is work.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;

use tokio::sync::{mpsc as tmpsc, oneshot};

use super::lease::{Lease, Reservation};
use super::prefill::PrefillEvent;
use super::{EngineConfig, EngineStats};
use crate::backend::{Backend, LogitsMode, SeqInput};
use crate::error::EngineError;
use crate::kv::block_manager::BlockManager;
use crate::kv::events::KvEventPublisher;
use crate::request::{FinishReason, Request, RequestOutput, RequestSnapshot, SequenceState, Usage};
use crate::sampler::{Rng, SampleContext, SamplePlan, SamplerState, SamplingParams};
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::sequence::{SeqId, Sequence};
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
        key: u64,
        out: tmpsc::UnboundedSender<PrefillEvent>,
        ack: Reply<()>,
    },
    Shutdown,
}

/// Where a request's outputs go.
pub(super) enum Sink {
    /// A [`super::RequestStream`]: every output.
    Stream(tmpsc::UnboundedSender<RequestOutput>),
    /// A [`super::PrefillStream`]: KV blocks, then one `Done` with the first output and the
    /// state that continues the request elsewhere.
    Prefill(tmpsc::UnboundedSender<PrefillEvent>),
}

/// What a step's backend call returned: logits rows to sample here, or tokens it sampled.
enum StepResult {
    Logits(crate::backend::StepOutput),
    Tokens(Vec<Option<u32>>),
}

pub(super) struct Entry {
    pub(super) key: u64,
    pub(super) seqs: Vec<SeqId>,
    pub(super) out: Sink,
}

pub(crate) struct Core {
    pub(super) backend: Box<dyn Backend>,
    pub(super) tokenizer: Option<Arc<Tokenizer>>,
    pub(super) cfg: EngineConfig,
    pub(super) sched: Scheduler,
    pub(super) events: KvEventPublisher,
    pub(super) reqs: HashMap<String, Entry>,
    pub(super) seq_req: HashMap<SeqId, String>,
    pub(super) next_seq: SeqId,
    pub(super) next_arrival: u64,
    pub(super) steps: u64,
    pub(super) preemptions: u64,
    /// Reserved blocks by lease id (see `lease.rs`).
    pub(super) leases: HashMap<u64, Lease>,
    /// Prefill-only sequences: the next prompt block index to send (see `prefill.rs`).
    pub(super) prefill_next: HashMap<SeqId, usize>,
    /// Tokens at prompt positions that went through a forward pass, ever.
    pub(super) prompt_tokens_computed: u64,
    /// Beam groups by request id (see `beam.rs`).
    pub(super) beams: HashMap<String, super::beam::BeamGroup>,
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
    }
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
        Self {
            backend,
            tokenizer,
            cfg,
            sched,
            events,
            reqs: HashMap::new(),
            seq_req: HashMap::new(),
            next_seq: 1,
            next_arrival: 0,
            steps: 0,
            preemptions: 0,
            leases: HashMap::new(),
            prefill_next: HashMap::new(),
            prompt_tokens_computed: 0,
            beams: HashMap::new(),
        }
    }

    pub(crate) fn run(mut self, rx: Receiver<Command>) {
        loop {
            // Block while idle; otherwise take what has arrived and go on stepping.
            if self.sched.is_idle() {
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
            if !self.sched.is_idle() && !self.step() {
                // Work exists but nothing can be scheduled (cannot happen with admission
                // checks, but never spin): wait for a command to change the situation.
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
                let id = self
                    .reqs
                    .iter()
                    .find(|(_, e)| e.key == key)
                    .map(|(id, _)| id.clone());
                if let Some(id) = id {
                    self.abort(&id);
                }
            }
            Command::Stats(reply) => {
                let _ = reply.send(self.stats());
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
                let r = if self.leases.is_empty() {
                    self.sched.blocks_mut().clear_cache().map_err(|n| {
                        EngineError::InvalidRequest(format!(
                            "cannot clear the KV cache while {n} blocks are in use"
                        ))
                    })
                } else {
                    Err(EngineError::InvalidRequest(format!(
                        "cannot clear the KV cache while {} reservations hold blocks",
                        self.leases.len()
                    )))
                };
                let _ = reply.send(r);
            }
            Command::Reserve {
                lease_id,
                prompt,
                params,
                reply,
            } => {
                let _ = reply.send(self.reserve(lease_id, prompt, &params));
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
                key,
                out,
                ack,
            } => {
                let _ = ack.send(self.prefill(request, send_from_block, key, out));
            }
            Command::Shutdown => return false,
        }
        true
    }

    fn stats(&self) -> EngineStats {
        EngineStats {
            running: self.sched.num_running(),
            waiting: self.sched.num_waiting(),
            requests: self.reqs.len(),
            blocks: self.sched.block_stats(),
            steps: self.steps,
            preemptions: self.preemptions,
            last_event_id: self.events.last_event_id(),
            prompt_tokens_computed: self.prompt_tokens_computed,
            reservations: self.leases.len(),
            reserved_blocks: self.leases.values().map(|l| l.table.len()).sum(),
        }
    }

    pub(super) fn new_decoder(&self, params: &SamplingParams) -> Option<IncrementalDecoder> {
        self.tokenizer
            .as_ref()
            .map(|_| IncrementalDecoder::new(params.skip_special_tokens))
    }

    pub(super) fn submit(&mut self, req: Request, key: u64, out: Sink) -> Result<(), EngineError> {
        let max_tokens = self.validate(&req.request_id, &req.prompt, &req.params)?;
        let seed = req.params.seed.unwrap_or_else(Rng::random_seed);
        let params = Arc::new(req.params);
        let rid: Arc<str> = Arc::from(req.request_id.as_str());
        // A beam request starts as one sequence; its beams fork from it (see `beam.rs`).
        let choices = if params.use_beam_search { 1 } else { params.n };
        let mut seqs = Vec::with_capacity(choices);
        for index in 0..choices {
            let id = self.next_seq;
            self.next_seq += 1;
            self.next_arrival += 1;
            let mut seq = Sequence::new(
                id,
                rid.clone(),
                index,
                req.prompt.clone(),
                max_tokens,
                self.next_arrival,
                params.clone(),
                SamplerState::new(seed, index as u64),
            );
            seq.decoder = self.new_decoder(&params);
            if params.use_beam_search {
                seq.decoder = None;
                self.submit_beams(id, &seq);
            }
            self.sched.add(seq);
            self.seq_req.insert(id, req.request_id.clone());
            seqs.push(id);
        }
        self.reqs.insert(req.request_id, Entry { key, seqs, out });
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
        let Some(rid) = self.seq_req.remove(&id) else {
            return;
        };
        self.prefill_next.remove(&id);
        let seq = self.sched.remove(id, reason);
        if let (Some(seq), false) = (&seq, handoff) {
            last.finish_reason = Some(reason);
            last.usage = Some(usage(seq));
        }
        let mut gone = false;
        if let Some(e) = self.reqs.get_mut(&rid) {
            e.seqs.retain(|&s| s != id);
            match (&e.out, &seq) {
                (Sink::Stream(tx), _) => {
                    let _ = tx.send(last);
                }
                (Sink::Prefill(tx), Some(seq)) => {
                    let _ = tx.send(PrefillEvent::Done {
                        output: last,
                        state: state_of(seq),
                    });
                }
                // Unreachable (a live id always has its sequence); the stream then ends.
                (Sink::Prefill(_), None) => {}
            }
            gone = e.seqs.is_empty();
        }
        if gone {
            self.reqs.remove(&rid);
        }
    }

    pub(super) fn abort(&mut self, request_id: &str) {
        self.fail(request_id, None);
    }

    /// Ends every choice of a request with `abort` (and an error message, if any).
    pub(super) fn fail(&mut self, request_id: &str, error: Option<String>) {
        if self.beams.contains_key(request_id) {
            self.finish_beams(request_id, Some(error));
            return;
        }
        let Some(e) = self.reqs.get(request_id) else {
            return;
        };
        for id in e.seqs.clone() {
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
        let ids: Vec<String> = self.reqs.keys().cloned().collect();
        for id in ids {
            self.fail(&id, Some("the engine is shutting down".into()));
        }
        self.drop_leases();
    }

    /// The sampling plans of a step whose sampling the backend does on its device (None:
    /// sample here, from logits rows). Taking a plan advances the sequence's RNG.
    fn device_sample_plans(
        &mut self,
        pieces: &[crate::scheduler::ScheduledSeq],
    ) -> Option<Vec<Option<SamplePlan>>> {
        if !self.backend.samples_on_device() || !self.beams.is_empty() {
            return None;
        }
        let needs_row = pieces.iter().any(|p| {
            p.sample
                && self
                    .sched
                    .get(p.id)
                    .is_none_or(|s| s.params.logprobs.is_some() || s.params.use_beam_search)
        });
        if needs_row {
            return None;
        }
        let eos = &self.cfg.eos_token_ids;
        let mut plans = Vec::with_capacity(pieces.len());
        for p in pieces {
            let plan = if p.sample {
                let seq = self.sched.get_mut(p.id)?;
                let ctx = SampleContext {
                    all_tokens: &seq.tokens,
                    eos_token_ids: eos,
                };
                Some(SamplePlan::new(&seq.params, &mut seq.sampler, &ctx))
            } else {
                None
            };
            plans.push(plan);
        }
        Some(plans)
    }

    /// One step. Returns false when nothing could be scheduled.
    fn step(&mut self) -> bool {
        let sch = self.sched.schedule();
        self.preemptions += sch.preempted.len() as u64;
        if sch.seqs.is_empty() {
            // A step that only preempted made room: the next one makes progress.
            return !sch.preempted.is_empty();
        }
        self.steps += 1;
        if !self.prefill_next.is_empty() {
            // Blocks complete before this step (a cached prefix, earlier chunks) go out now,
            // so sending overlaps this step's compute. (A failed send ends its request, which
            // the filter below then leaves out.)
            for p in &sch.seqs {
                if self.prefill_next.contains_key(&p.id) {
                    self.flush_prefill(p.id);
                }
            }
        }
        // Every scheduled id is live (the scheduler only schedules its own sequences); keep
        // the pieces and the backend rows aligned by construction anyway.
        let pieces: Vec<_> = sch
            .seqs
            .iter()
            .filter(|p| self.sched.get(p.id).is_some())
            .copied()
            .collect();
        let prompt_tokens: usize = pieces
            .iter()
            .filter_map(|p| {
                let s = self.sched.get(p.id)?;
                Some((p.start + p.len).min(s.prompt_len).saturating_sub(p.start))
            })
            .sum();
        // Sampling on the backend's device when it can, and no sequence needs its logits row
        // here (logprobs, beam search): the plans take each draw's uniform from the
        // sequence's RNG now, exactly as the CPU sampler would.
        let device_plans = self.device_sample_plans(&pieces);
        let result = {
            let inputs: Vec<SeqInput<'_>> = pieces
                .iter()
                .filter_map(|p| {
                    let s = self.sched.get(p.id)?;
                    Some(SeqInput {
                        tokens: &s.tokens[p.start..p.start + p.len],
                        start_pos: p.start,
                        block_table: s.table.ids(),
                        logits: if p.sample {
                            LogitsMode::Last
                        } else {
                            LogitsMode::None
                        },
                    })
                })
                .collect();
            match &device_plans {
                Some(plans) => {
                    let refs: Vec<Option<&SamplePlan>> = plans.iter().map(Option::as_ref).collect();
                    self.backend
                        .forward_sampled(&inputs, &refs)
                        .map(StepResult::Tokens)
                }
                None => self.backend.forward(&inputs).map(StepResult::Logits),
            }
        };
        let out = match result {
            Ok(o) => o,
            Err(e) => {
                // The batch's KV is in an unknown state: fail its requests, keep serving others.
                tracing::error!("engine step failed: {e}");
                let msg = e.to_string();
                let rids: Vec<String> = pieces
                    .iter()
                    .filter_map(|p| self.seq_req.get(&p.id).cloned())
                    .collect();
                for rid in rids {
                    self.fail(&rid, Some(msg.clone()));
                }
                return true;
            }
        };
        self.prompt_tokens_computed += prompt_tokens as u64;
        let mut beam_reqs: Vec<String> = Vec::new();
        for (i, p) in pieces.iter().enumerate() {
            self.sched.mark_computed(p);
            if self.prefill_next.contains_key(&p.id) {
                self.flush_prefill(p.id);
            }
            if p.sample {
                let out = match &out {
                    StepResult::Logits(o) => o,
                    StepResult::Tokens(tokens) => {
                        // Sampled on the device with this step's plan.
                        match tokens.get(i).copied().flatten() {
                            Some(t) => self.emit_device_sample(p.id, t),
                            None => {
                                let msg = "the backend returned no sampled token".to_string();
                                if let Some(rid) = self.seq_req.get(&p.id).cloned() {
                                    self.fail(&rid, Some(msg));
                                }
                            }
                        }
                        continue;
                    }
                };
                // A backend without logits (the simulator) returns no row: the token is then
                // drawn from the sequence's RNG, still reproducible from the seed.
                let row = out
                    .logits
                    .get(i)
                    .and_then(|rows| rows.last())
                    .filter(|r| !r.is_empty())
                    .map(|r| r.as_slice());
                if self.beams.is_empty() {
                    self.sample_and_emit(p.id, row);
                } else if let Some(rid) = self.beam_row(p.id, row) {
                    if !beam_reqs.contains(&rid) {
                        beam_reqs.push(rid);
                    }
                } else {
                    self.sample_and_emit(p.id, row);
                }
            }
        }
        for rid in beam_reqs {
            self.beam_step(&rid);
        }
        true
    }
}
