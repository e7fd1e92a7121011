//! One engine step: schedule, send the prefill blocks already complete (and, for prefills
//! sending by layer groups, the blocks this step completes), run the backend's forward pass
//! over the scheduled pieces, then mark them computed and sample (on the device or
//! here), emit, and step the beam groups whose beams all have their rows.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use super::core::Core;
use std::collections::HashMap;

use crate::backend::DeviceSample;
use crate::backend::{LogitsMode, SeqInput, StepOutput};
use crate::error::EngineError;
use crate::sampler::guide::{Guide, GuideError};
use crate::sampler::{SampleContext, SamplePlan};
use crate::scheduler::{ScheduledSeq, Scheduler};
use crate::sequence::{SeqId, Sequence};

/// Sampling that only the host sampler does: beam search, whose beams fork from whole
/// logits rows (a device sampler follows the plan: logit bias, penalties, masks, a grammar's
/// mask, the filters and logprobs).
fn needs_host_sampling(p: &crate::sampler::SamplingParams) -> bool {
    p.use_beam_search
}

/// What a step's backend call returned: logits rows to sample here, or tokens it sampled.
enum StepResult {
    Logits(StepOutput),
    Tokens(Vec<Option<DeviceSample>>),
}

impl Core {
    /// One step. Returns false when nothing could be scheduled.
    pub(super) fn step(&mut self) -> bool {
        let started = Instant::now();
        self.counters.step_starts(started);
        let sch = self.sched.schedule();
        self.counters.schedule_took(started.elapsed());
        self.counters.scheduled(&sch);
        if sch.seqs.is_empty() {
            // A step that only preempted made room: the next one makes progress.
            return !sch.preempted.is_empty();
        }
        let steps = self.counters.stepped();
        // A fault in the batched part is fatal to the thread (the worker sees it die).
        crate::failpoints::die_after_steps(steps);
        // Blocks complete before this step (a cached prefix, earlier chunks) go out now, so
        // sending overlaps this step's compute. (A failed send ends its request, which
        // `live_pieces` then leaves out.)
        self.flush_prefills(&sch.seqs);
        let pieces = self.live_pieces(&sch.seqs);
        let pieces = self.drop_pieces_without_media(pieces);
        // Blocks this step completes, for prefills that send by layer groups, go out now:
        // each group is written as soon as the step has computed it.
        self.send_prefills_by_layers(&pieces);
        let pieces = self.live_pieces(&pieces);
        let prompt_tokens = self.prompt_tokens_in(&pieces);
        match self.forward_preparing_masks(&pieces) {
            Ok(result) => {
                self.counters.prompt_tokens(prompt_tokens);
                let applying = Instant::now();
                self.apply(&pieces, &result);
                self.counters.apply_took(applying.elapsed());
            }
            Err(e) => self.fail_step(&pieces, &e),
        }
        let ended = Instant::now();
        self.counters
            .step_took(ended.saturating_duration_since(started));
        self.counters.step_ended(ended);
        true
    }

    /// The scheduled pieces whose sequence is live. Every scheduled id is (the scheduler only
    /// schedules its own sequences); this keeps the pieces and the backend rows aligned by
    /// construction anyway.
    fn live_pieces(&self, scheduled: &[ScheduledSeq]) -> Vec<ScheduledSeq> {
        scheduled
            .iter()
            .filter(|p| self.sched.get(p.id).is_some())
            .copied()
            .collect()
    }

    /// Pieces that would compute image positions without the image's embeddings (a
    /// sequence continued from another engine, which encoded its images, and whose blocks
    /// were evicted here) cannot run right: their requests fail, saying why.
    fn drop_pieces_without_media(&mut self, pieces: Vec<ScheduledSeq>) -> Vec<ScheduledSeq> {
        let (ok, missing): (Vec<_>, Vec<_>) = pieces.into_iter().partition(|p| {
            self.sched
                .get(p.id)
                .is_none_or(|s| media_present(s, p.start, p.len))
        });
        if missing.is_empty() {
            return ok;
        }
        for p in missing {
            if let Some(rid) = self.requests.request_of(p.id).map(str::to_owned) {
                self.fail(
                    &rid,
                    Some(
                        "the prompt's image positions must be recomputed, but this engine does \
                         not hold the images' embeddings (they were encoded where the prompt \
                         was prefilled)"
                            .into(),
                    ),
                );
            }
        }
        self.live_pieces(&ok)
    }

    /// Tokens at prompt positions among the pieces.
    fn prompt_tokens_in(&self, pieces: &[ScheduledSeq]) -> usize {
        pieces
            .iter()
            .filter_map(|p| {
                let s = self.sched.get(p.id)?;
                Some((p.start + p.len).min(s.prompt_len).saturating_sub(p.start))
            })
            .sum()
    }

    /// The forward pass, with the grammar masks of the sequences it samples computed on
    /// another thread meanwhile: sampling then finds them ready, and a grammar never stalls
    /// the batch by more than what its mask costs beyond the forward pass.
    fn forward_preparing_masks(
        &mut self,
        pieces: &[ScheduledSeq],
    ) -> Result<StepResult, EngineError> {
        let guides: Vec<(SeqId, Box<Guide>)> = pieces
            .iter()
            .filter(|p| p.sample)
            .filter_map(|p| Some((p.id, self.sched.get_mut(p.id)?.guide.take()?)))
            .collect();
        if guides.is_empty() {
            return self.forward(pieces);
        }
        if self.samples_on_device(pieces) {
            return self.forward_with_device_masks(pieces, guides);
        }
        let (result, guides) = std::thread::scope(|s| {
            let prep = s.spawn(move || {
                use rayon::prelude::*;
                let mut guides = guides;
                guides.par_iter_mut().for_each(|(_, g)| g.prepare());
                guides
            });
            let result = self.forward(pieces);
            (result, prep.join())
        });
        match guides {
            Ok(guides) => self.put_back(guides),
            // `prepare` catches llguidance's panics; this is a panic of the thread itself.
            Err(_) => {
                return Err(EngineError::InvalidInput(
                    "a grammar mask thread panicked".into(),
                ))
            }
        }
        result
    }

    /// A device-sampled step with grammars: the plans go to the backend without their masks,
    /// which are computed (in parallel) while its forward pass runs and reach its sampler
    /// after it. A mask that fails allows nothing; emitting then fails that request with the
    /// reason (`emit_device_sample`).
    fn forward_with_device_masks(
        &mut self,
        pieces: &[ScheduledSeq],
        mut guides: Vec<(SeqId, Box<Guide>)>,
    ) -> Result<StepResult, EngineError> {
        let Some(plans) = self.device_sample_plans(pieces) else {
            self.put_back(guides);
            return self.forward(pieces);
        };
        let words = self.backend.vocab_size().div_ceil(32);
        let inputs = backend_inputs(&self.sched, pieces);
        let refs: Vec<Option<&SamplePlan>> = plans.iter().map(Option::as_ref).collect();
        let mut masks = || {
            use rayon::prelude::*;
            guides.par_iter_mut().for_each(|(_, g)| g.prepare());
            pieces
                .iter()
                .map(|p| {
                    let (_, g) = guides.iter_mut().find(|(id, _)| *id == p.id)?;
                    Some(g.mask_words(words).unwrap_or_else(|_| vec![0; words]))
                })
                .collect()
        };
        let started = Instant::now();
        let result = self
            .backend
            .forward_sampled_with_masks(&inputs, &refs, &mut masks);
        self.counters.forward_took(started.elapsed());
        self.put_back(guides);
        result.map(StepResult::Tokens)
    }

    /// The backend's forward pass over the pieces. Sampling happens on the backend's device
    /// when it can, and no sequence needs its logits row here (logprobs, beam search): the
    /// plans take each draw's uniform from the sequence's RNG now, exactly as the CPU sampler
    /// would.
    fn forward(&mut self, pieces: &[ScheduledSeq]) -> Result<StepResult, EngineError> {
        let device_plans = self.device_sample_plans(pieces);
        let inputs = backend_inputs(&self.sched, pieces);
        let refs: Option<Vec<Option<&SamplePlan>>> = device_plans
            .as_ref()
            .map(|plans| plans.iter().map(Option::as_ref).collect());
        let started = Instant::now();
        let result = match &refs {
            Some(refs) => self
                .backend
                .forward_sampled(&inputs, refs)
                .map(StepResult::Tokens),
            None => self.backend.forward(&inputs).map(StepResult::Logits),
        };
        self.counters.forward_took(started.elapsed());
        result
    }

    /// Gives the guides taken for a step back to their sequences.
    fn put_back(&mut self, guides: Vec<(SeqId, Box<Guide>)>) {
        for (id, g) in guides {
            if let Some(seq) = self.sched.get_mut(id) {
                seq.guide = Some(g);
            }
        }
    }

    /// Whether the step's sampling happens on the backend's device: it can, and no sequence
    /// the step samples needs its logits row here (logprobs, beam search, logit bias, or a
    /// grammar whose mask failed: the host path then fails that request with the reason).
    fn samples_on_device(&self, pieces: &[ScheduledSeq]) -> bool {
        self.backend.samples_on_device()
            && self.beams.is_empty()
            && !pieces.iter().any(|p| {
                p.sample
                    && self.sched.get(p.id).is_none_or(|s| {
                        needs_host_sampling(&s.params)
                            || s.guide.as_ref().is_some_and(|g| g.has_failed())
                    })
            })
    }

    /// The sampling plans of a step whose sampling the backend does on its device (None:
    /// sample here, from logits rows), each with its grammar's mask. Taking a plan advances
    /// the sequence's RNG.
    fn device_sample_plans(&mut self, pieces: &[ScheduledSeq]) -> Option<Vec<Option<SamplePlan>>> {
        if !self.samples_on_device(pieces) {
            return None;
        }
        let eos = &self.cfg.eos_token_ids;
        let words = self.backend.vocab_size().div_ceil(32);
        let mut plans = Vec::with_capacity(pieces.len());
        for p in pieces {
            let plan = if p.sample {
                let seq = self.sched.get_mut(p.id)?;
                let ctx = SampleContext {
                    all_tokens: &seq.tokens,
                    eos_token_ids: eos,
                };
                let mut plan = SamplePlan::new(&seq.params, &mut seq.sampler, &ctx);
                if let Some(guide) = seq.guide.as_mut() {
                    // Computed before the step (`forward_preparing_masks`); an error was
                    // caught by `samples_on_device`.
                    plan.allowed = Some(guide.mask_words(words).ok()?);
                }
                Some(plan)
            } else {
                None
            };
            plans.push(plan);
        }
        Some(plans)
    }

    /// A failed forward pass leaves the batch's KV in an unknown state: fails its requests,
    /// and the engine keeps serving the others.
    fn fail_step(&mut self, pieces: &[ScheduledSeq], e: &EngineError) {
        tracing::error!("engine step failed: {e}");
        let msg = e.to_string();
        let rids: Vec<String> = pieces
            .iter()
            .filter_map(|p| self.requests.request_of(p.id).map(str::to_owned))
            .collect();
        for rid in rids {
            self.fail(&rid, Some(msg.clone()));
        }
    }

    /// Marks the pieces computed, sends the prefill blocks they completed, and samples and
    /// emits where a piece asks for a token; then steps the beam groups that got rows.
    fn apply(&mut self, pieces: &[ScheduledSeq], result: &StepResult) {
        let mut beam_reqs: Vec<String> = Vec::new();
        let mut guide_failures = match result {
            StepResult::Tokens(tokens) => self.advance_guides(pieces, tokens),
            StepResult::Logits(_) => HashMap::new(),
        };
        for (i, p) in pieces.iter().enumerate() {
            self.sched.mark_computed(p);
            if self.prefills.contains(p.id) {
                self.flush_prefill(p.id);
            }
            if !p.sample {
                continue;
            }
            // Sampling, stop checks and emission are one request's own work: a panic in
            // them fails that request only.
            let beam = self.isolated(p.id, |core| match result {
                // Sampled on the device with this step's plan.
                StepResult::Tokens(tokens) => {
                    let failure = guide_failures.remove(&p.id);
                    core.emit_device_token(p.id, tokens.get(i).cloned().flatten(), failure);
                    None
                }
                StepResult::Logits(out) => core.sample_row(p.id, logits_row(out, i)),
            });
            if let Some(rid) = beam.flatten() {
                if !beam_reqs.contains(&rid) {
                    beam_reqs.push(rid);
                }
            }
        }
        for rid in beam_reqs {
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| self.beam_step(&rid))) {
                self.fail_panicked(&rid, payload.as_ref());
            }
        }
    }

    /// The guides of the device-sampled sequences follow their tokens, in parallel (each
    /// guide its own token; at a large batch this host work would otherwise add up one
    /// sequence after another). Returns why a guide failed (its mask, or the token), by
    /// sequence: emitting then fails that request.
    fn advance_guides(
        &mut self,
        pieces: &[ScheduledSeq],
        tokens: &[Option<DeviceSample>],
    ) -> HashMap<SeqId, GuideError> {
        let mut work: Vec<(SeqId, u32, Box<Guide>)> = Vec::new();
        for (p, t) in pieces.iter().zip(tokens) {
            let (true, Some(t)) = (p.sample, t) else {
                continue;
            };
            if let Some(g) = self.sched.get_mut(p.id).and_then(|s| s.guide.take()) {
                work.push((p.id, t.token, g));
            }
        }
        let failures = {
            use rayon::prelude::*;
            work.par_iter_mut()
                .filter_map(|(id, token, g)| {
                    let r = g.failure().map_or_else(|| g.advance(*token), Err);
                    r.err().map(|e| (*id, e))
                })
                .collect()
        };
        for (id, _, g) in work {
            if let Some(seq) = self.sched.get_mut(id) {
                seq.guide = Some(g);
            }
        }
        failures
    }

    /// Runs sequence `id`'s part of a step. A panic in it fails the sequence's request (each
    /// choice ends with `abort` and an error, its blocks are freed) and returns None; the
    /// engine thread and the batch's other requests go on.
    fn isolated<R>(&mut self, id: SeqId, work: impl FnOnce(&mut Core) -> R) -> Option<R> {
        match catch_unwind(AssertUnwindSafe(|| work(self))) {
            Ok(r) => Some(r),
            Err(payload) => {
                match self.requests.request_of(id).map(str::to_owned) {
                    Some(rid) => self.fail_panicked(&rid, payload.as_ref()),
                    None => tracing::error!(
                        seq = id,
                        "a sequence's step panicked after it ended: {}",
                        panic_message(payload.as_ref())
                    ),
                }
                None
            }
        }
    }

    /// Fails request `rid` after a panic in its own work.
    fn fail_panicked(&mut self, rid: &str, payload: &(dyn std::any::Any + Send)) {
        let what = panic_message(payload);
        tracing::error!(
            request_id = rid,
            "the request's step panicked: {what}; failing it"
        );
        self.fail(rid, Some(format!("internal engine error: {what}")));
    }

    /// Emits the token the device sampled for `id`, or fails its request when there is none.
    fn emit_device_token(
        &mut self,
        id: SeqId,
        token: Option<DeviceSample>,
        guide_failure: Option<GuideError>,
    ) {
        if let Some(e) = guide_failure {
            if let Some(rid) = self.requests.request_of(id).map(str::to_owned) {
                self.fail(&rid, Some(e.to_string()));
            }
            return;
        }
        match token {
            Some(t) => self.emit_device_sample(id, t),
            None => {
                let msg = "the backend returned no sampled token".to_string();
                if let Some(rid) = self.requests.request_of(id).map(str::to_owned) {
                    self.fail(&rid, Some(msg));
                }
            }
        }
    }

    /// Samples and emits the token of `id` from its row; a beam's row is recorded for its
    /// group instead, and the group's request id returned.
    fn sample_row(&mut self, id: SeqId, row: Option<&[f32]>) -> Option<String> {
        if !self.beams.is_empty() {
            if let Some(rid) = self.beam_row(id, row) {
                return Some(rid);
            }
        }
        self.sample_and_emit(id, row);
        None
    }
}

/// The message of a panic payload (`panic!` with a literal or a format string).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Whether every image span that positions `start..start + len` of `s` touch has its
/// embeddings.
fn media_present(s: &Sequence, start: usize, len: usize) -> bool {
    s.table
        .hashing()
        .media()
        .iter()
        .filter(|m| m.start < start + len && start < m.start + m.len)
        .all(|m| s.media.iter().any(|e| e.span == *m))
}

/// The backend rows of the pieces, in order.
fn backend_inputs<'s>(sched: &'s Scheduler, pieces: &[ScheduledSeq]) -> Vec<SeqInput<'s>> {
    pieces
        .iter()
        .filter_map(|p| {
            let s = sched.get(p.id)?;
            Some(SeqInput {
                tokens: &s.tokens[p.start..p.start + p.len],
                start_pos: p.start,
                block_table: s.table.ids(),
                logits: if p.sample {
                    LogitsMode::Last
                } else {
                    LogitsMode::None
                },
                media: &s.media,
            })
        })
        .collect()
}

/// Piece `i`'s logits row. A backend without logits (the simulator) returns no row: the
/// token is then drawn from the sequence's RNG, still reproducible from the seed.
fn logits_row(out: &StepOutput, i: usize) -> Option<&[f32]> {
    out.logits
        .get(i)
        .and_then(|rows| rows.last())
        .filter(|r| !r.is_empty())
        .map(|r| r.as_slice())
}
