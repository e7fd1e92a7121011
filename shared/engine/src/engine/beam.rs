//! Beam search, as Hugging Face transformers' `generate(num_beams=W, do_sample=False)` does it.
//!
//! A beam request runs as a *beam group*: up to `width` live sequences (beams) in the
//! scheduler, all of the same length. Each beam's logits row, when it comes, is reduced to its
//! `K = max(2, 1 + #eos) * width` best continuations (log-softmax of the raw row). Once every
//! live beam has its candidates (beams are normally scheduled in the same step; a preempted
//! beam recomputes first), the group steps:
//! 1. every candidate is scored `cumulative logprob of its beam + its logprob`; the best `K`
//!    over all beams are kept, best first;
//! 2. among the first `width`, those ending in EOS (or a stop token id) — all of them when the
//!    new length reaches `max_tokens` — become finished hypotheses scored
//!    `sum_logprobs / generated_len ** length_penalty`, the EOS token counted in both; the
//!    finished set keeps the `width` best;
//! 3. the first `width` candidates that are not EOS become the next beams;
//! 4. the search stops at `max_tokens`, or when `width` hypotheses are finished and either
//!    `early_stopping` is set or the best running beam's score at its current length,
//!    `cum / len ** length_penalty`, is no better than the worst finished one (transformers'
//!    heuristic for `early_stopping=False`).
//!
//! **Blocks are shared copy-on-write.** A new beam forks from its parent: the parent's full
//! blocks are shared by reference count, and the parent's last, partial block is copied into
//! a fresh block ([`crate::backend::Backend::copy_blocks`]), since the two beams write
//! different tokens after it. A parent chosen once continues in place; a parent chosen by no
//! candidate is dropped and its blocks released. When the search ends (or the request is
//! aborted or fails) every beam's blocks are released.
//!
//! **Outputs**: the `n` best hypotheses, best first, each as one output (index `0..n`) with
//! all its tokens, its text, its finish reason (`stop` at EOS, `length` at `max_tokens`), its
//! usage and its [`crate::request::RequestOutput::score`]. A stream gets them only at the end:
//! until the search finishes, no hypothesis is final.

use std::collections::HashMap;
use std::sync::Arc;

use super::core::{output, Core};
use super::requests::Sink;
use crate::request::{FinishReason, RequestOutput, StopReason, Usage};
use crate::sampler::{sample_without_logits, top_k_logprobs};
use crate::sequence::{NewSequence, SeqId, Sequence};
use crate::tokenizer::Tokenizer;

/// One finished hypothesis.
#[derive(Debug, Clone)]
struct Hyp {
    /// Generated tokens (the EOS included).
    tokens: Vec<u32>,
    score: f64,
    eos: Option<u32>,
}

/// A continuation of a live beam.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    /// The beam's cumulative logprob plus the token's.
    score: f64,
    /// The beam's index in `live`.
    beam: usize,
    token: u32,
}

pub(super) struct BeamGroup {
    width: usize,
    n: usize,
    length_penalty: f64,
    early_stopping: bool,
    max_tokens: usize,
    /// EOS ids (unless `ignore_eos`) and stop token ids.
    eos: Vec<u32>,
    stop_token_ids: Vec<u32>,
    /// Live beams, best first, with their cumulative logprob.
    live: Vec<(SeqId, f64)>,
    /// Each live beam's candidates for the next step, once its row came.
    pending: HashMap<SeqId, Vec<(u32, f32)>>,
    /// Best first, at most `width`.
    finished: Vec<Hyp>,
    prompt_len: usize,
    cached_tokens: usize,
    skip_special_tokens: bool,
}

impl BeamGroup {
    /// The group of a request with `use_beam_search` (validated): its one sequence `seq` for
    /// the prompt; beams fork from it after the first step. `eos_token_ids` are the engine's.
    fn new(seq: &Sequence, eos_token_ids: &[u32]) -> Self {
        let p = &seq.params;
        let mut eos: Vec<u32> = if p.ignore_eos {
            Vec::new()
        } else {
            eos_token_ids.to_vec()
        };
        // Sorted and without repeats: looked up by binary search on every candidate.
        eos.extend_from_slice(&p.stop_token_ids);
        eos.sort_unstable();
        eos.dedup();
        BeamGroup {
            width: p.beam_width(),
            n: p.n,
            length_penalty: p.length_penalty as f64,
            early_stopping: p.early_stopping,
            max_tokens: seq.max_tokens,
            eos,
            stop_token_ids: p.stop_token_ids.clone(),
            live: vec![(seq.id, 0.0)],
            pending: HashMap::new(),
            finished: Vec::new(),
            prompt_len: seq.prompt_len,
            cached_tokens: 0,
            skip_special_tokens: p.skip_special_tokens,
        }
    }

    fn is_eos(&self, token: u32) -> bool {
        self.eos.binary_search(&token).is_ok()
    }

    fn k(&self) -> usize {
        2.max(1 + self.eos.len()) * self.width
    }

    fn norm(&self, cum: f64, len: usize) -> f64 {
        cum / (len as f64).powf(self.length_penalty)
    }

    fn add_finished(&mut self, h: Hyp) {
        // After the equal ones already there (an earlier hypothesis wins a tie).
        let pos = self
            .finished
            .iter()
            .position(|f| f.score < h.score)
            .unwrap_or(self.finished.len());
        self.finished.insert(pos, h);
        self.finished.truncate(self.width);
    }

    /// Records beam `seq`'s `K` best continuations, from its logits row (None: a backend
    /// without logits; they are then drawn from the beam's RNG).
    fn record_row(&mut self, seq: &mut Sequence, row: Option<&[f32]>, vocab: usize) {
        let k = self.k();
        if self.cached_tokens == 0 {
            self.cached_tokens = seq.cached_prompt_tokens.unwrap_or(0);
        }
        let cands = match row {
            Some(r) => top_k_logprobs(r, k),
            None => (0..k)
                .map(|i| {
                    let t = sample_without_logits(vocab, &mut seq.sampler).token;
                    (t, -1.0 - i as f32)
                })
                .collect(),
        };
        self.pending.insert(seq.id, cands);
    }

    /// Whether every live beam has its candidates.
    fn has_every_row(&self) -> bool {
        self.live
            .iter()
            .all(|(id, _)| self.pending.contains_key(id))
    }

    /// The first live beam (all live beams have the same length).
    fn leader(&self) -> SeqId {
        self.live[0].0
    }

    /// Step 1: the best `K` continuations over all beams, best first; the recorded
    /// candidates are consumed.
    fn best_candidates(&mut self) -> Vec<Candidate> {
        let mut cands: Vec<Candidate> = Vec::new();
        for (beam, (id, cum)) in self.live.iter().enumerate() {
            for &(token, lp) in &self.pending[id] {
                cands.push(Candidate {
                    score: cum + lp as f64,
                    beam,
                    token,
                });
            }
        }
        self.pending.clear();
        cands.sort_by(|a, b| {
            b.score
                .total_cmp(&a.score)
                .then(a.beam.cmp(&b.beam))
                .then(a.token.cmp(&b.token))
        });
        cands.truncate(self.k());
        cands
    }

    /// Step 2: among the first `width` candidates, those ending in EOS (all of them
    /// `at_max`) become finished hypotheses of length `new_len`. `generated` gives a live
    /// beam's generated tokens.
    fn collect_finished<'s>(
        &mut self,
        cands: &[Candidate],
        new_len: usize,
        at_max: bool,
        generated: impl Fn(SeqId) -> Option<&'s [u32]>,
    ) {
        if self.early_stopping && self.finished.len() >= self.width {
            return;
        }
        for c in cands.iter().take(self.width) {
            let is_eos = self.is_eos(c.token);
            if !(is_eos || at_max) {
                continue;
            }
            let Some(parent) = generated(self.live[c.beam].0) else {
                continue;
            };
            let mut tokens = parent.to_vec();
            tokens.push(c.token);
            let h = Hyp {
                tokens,
                score: self.norm(c.score, new_len),
                eos: is_eos.then_some(c.token),
            };
            self.add_finished(h);
        }
    }

    /// Step 3: the first `width` candidates that are not EOS.
    fn next_beams(&self, cands: &[Candidate]) -> Vec<Candidate> {
        cands
            .iter()
            .copied()
            .filter(|c| !self.is_eos(c.token))
            .take(self.width)
            .collect()
    }

    /// Step 4: whether the search stops before continuing with `next` at length `new_len`.
    fn is_done(&self, next: &[Candidate], new_len: usize, at_max: bool) -> bool {
        let full = self.finished.len() >= self.width;
        at_max
            || next.is_empty()
            || (full
                && (self.early_stopping
                    || self
                        .finished
                        .last()
                        .map(|f| f.score)
                        .unwrap_or(f64::NEG_INFINITY)
                        >= self.norm(next[0].score, new_len)))
    }

    fn usage(&self, completion_tokens: usize) -> Usage {
        Usage {
            prompt_tokens: self.prompt_len,
            completion_tokens,
            cached_tokens: self.cached_tokens,
        }
    }

    /// `n` aborted outputs of request `rid`.
    fn aborted_outputs(&self, rid: &str, error: Option<String>) -> Vec<RequestOutput> {
        (0..self.n)
            .map(|index| {
                let mut o = output(rid, index);
                o.finish_reason = Some(FinishReason::Abort);
                o.usage = Some(self.usage(0));
                o.error = error.clone();
                o
            })
            .collect()
    }

    /// The `n` best hypotheses of request `rid` as its outputs, best first.
    fn final_outputs(
        &self,
        rid: &str,
        tokenizer: Option<&Tokenizer>,
        eos_token_ids: &[u32],
    ) -> Vec<RequestOutput> {
        (0..self.n)
            .map(|index| {
                let mut o = output(rid, index);
                match self.finished.get(index) {
                    Some(h) => self.fill_hypothesis(&mut o, h, tokenizer, eos_token_ids),
                    None => {
                        // Fewer hypotheses than n (a vocabulary smaller than the width).
                        o.finish_reason = Some(FinishReason::Length);
                        o.usage = Some(self.usage(0));
                    }
                }
                o
            })
            .collect()
    }

    /// Fills output `o` with hypothesis `h`: its tokens, text, finish and stop reason, usage
    /// and score.
    fn fill_hypothesis(
        &self,
        o: &mut RequestOutput,
        h: &Hyp,
        tokenizer: Option<&Tokenizer>,
        eos_token_ids: &[u32],
    ) {
        o.token_ids = h.tokens.clone();
        if let Some(tk) = tokenizer {
            o.text = tk
                .decode(&h.tokens, self.skip_special_tokens)
                .unwrap_or_default();
        }
        o.finish_reason = Some(match h.eos {
            Some(_) => FinishReason::Stop,
            None => FinishReason::Length,
        });
        o.stop_reason = h.eos.map(|t| {
            if self.stop_token_ids.binary_search(&t).is_ok() && !eos_token_ids.contains(&t) {
                StopReason::TokenId(t)
            } else {
                StopReason::Eos(t)
            }
        });
        o.usage = Some(self.usage(h.tokens.len()));
        o.score = Some(h.score as f32);
    }
}

/// The beam groups, by request id.
pub(super) struct BeamGroups {
    groups: HashMap<String, BeamGroup>,
}

impl BeamGroups {
    pub(super) fn new() -> Self {
        Self {
            groups: HashMap::new(),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    pub(super) fn contains(&self, request_id: &str) -> bool {
        self.groups.contains_key(request_id)
    }
}

impl Core {
    /// Starts a beam group for a request with `use_beam_search` (validated): one sequence for
    /// the prompt; beams fork from it after the first step.
    pub(super) fn submit_beams(&mut self, seq: &Sequence) {
        let g = BeamGroup::new(seq, &self.cfg.eos_token_ids);
        self.beams.groups.insert(seq.request_id.to_string(), g);
    }

    /// Records a beam's logits row (None: a backend without logits; candidates are then
    /// drawn from the beam's RNG). Returns the request id when the beam belongs to a group.
    pub(super) fn beam_row(&mut self, id: SeqId, row: Option<&[f32]>) -> Option<String> {
        let rid = self.requests.request_of(id)?.to_owned();
        let vocab = self.backend.vocab_size();
        let g = self.beams.groups.get_mut(&rid)?;
        let seq = self.sched.get_mut(id)?;
        g.record_row(seq, row, vocab);
        Some(rid)
    }

    /// Runs the group's step once every live beam has its candidates.
    pub(super) fn beam_step(&mut self, rid: &str) {
        let Some(g) = self.beams.groups.get_mut(rid) else {
            return;
        };
        if !g.has_every_row() {
            return;
        }
        let cands = g.best_candidates();
        let cur_len = self
            .sched
            .get(g.leader())
            .map(|s| s.num_generated())
            .unwrap_or(0);
        let new_len = cur_len + 1;
        let at_max = new_len >= g.max_tokens;
        let sched = &self.sched;
        g.collect_finished(&cands, new_len, at_max, |id| {
            sched.get(id).map(|s| s.generated())
        });
        let next = g.next_beams(&cands);
        if g.is_done(&next, new_len, at_max) {
            self.finish_beams(rid, None);
            return;
        }
        self.advance_beams(rid, &next);
    }

    /// Makes `next` the live beams: drops unchosen parents, forks parents chosen more than
    /// once, extends the rest in place.
    fn advance_beams(&mut self, rid: &str, next: &[Candidate]) {
        let Some(g) = self.beams.groups.get(rid) else {
            return;
        };
        let parents: Vec<SeqId> = g.live.iter().map(|(id, _)| *id).collect();
        let mut uses = vec![0usize; parents.len()];
        for c in next {
            uses[c.beam] += 1;
        }
        // Dropped parents first: their blocks may be needed by the forks.
        for (bi, &id) in parents.iter().enumerate() {
            if uses[bi] == 0 {
                self.drop_beam(rid, id);
            }
        }
        let mut live = Vec::with_capacity(next.len());
        let mut in_place: Vec<(SeqId, u32)> = Vec::new();
        for c in next {
            let pid = parents[c.beam];
            uses[c.beam] -= 1;
            if uses[c.beam] == 0 {
                // The last use continues the parent itself (after its forks copied it).
                in_place.push((pid, c.token));
                live.push((pid, c.score));
            } else if let Some(fid) = self.fork_beam(rid, pid, c.token) {
                live.push((fid, c.score));
            }
        }
        for (pid, tok) in in_place {
            if let Some(s) = self.sched.get_mut(pid) {
                s.tokens.push(tok);
            }
        }
        if let Some(g) = self.beams.groups.get_mut(rid) {
            g.live = live;
        }
    }

    /// A new beam: the parent's tokens plus `tok`, its full blocks shared, its partial last
    /// block copied.
    fn fork_beam(&mut self, rid: &str, pid: SeqId, tok: u32) -> Option<SeqId> {
        let parent = self.sched.get(pid)?;
        let mut seq = Sequence::new(NewSequence {
            id: self.requests.new_seq_id(),
            request_id: Arc::clone(&parent.request_id),
            index: 0,
            tokens: parent.tokens.clone(),
            max_tokens: parent.max_tokens,
            arrival: parent.arrival,
            params: Arc::clone(&parent.params),
            sampler: parent.sampler.clone(),
            hashing: parent.table.hashing().clone(),
            media: Arc::clone(&parent.media),
        });
        seq.prompt_len = parent.prompt_len;
        seq.cached_prompt_tokens = parent.cached_prompt_tokens;
        let (parent_table, computed) = (parent.table.clone(), parent.num_computed);
        let (mut table, copy, mut computed) = self.sched.blocks_mut().fork(&parent_table, computed);
        if let Some((src, dst)) = copy {
            if let Err(e) = self.backend.copy_blocks(&[(src, dst)]) {
                // Recompute the partial block instead.
                tracing::warn!("copying KV block {src} to {dst}: {e}");
                self.sched.blocks_mut().release(&mut table);
                computed = 0;
            }
        }
        seq.table = table;
        seq.num_computed = computed;
        seq.tokens.push(tok);
        let id = seq.id;
        self.sched.add(seq);
        self.requests.add_seq(rid, id);
        Some(id)
    }

    /// Removes one beam silently, releasing its blocks.
    fn drop_beam(&mut self, rid: &str, id: SeqId) {
        self.requests.detach_seq(rid, id);
        self.sched.remove(id, FinishReason::Abort);
    }

    /// Ends a beam request: releases every beam and sends the `n` best hypotheses (or, with
    /// `error` / on abort, `n` aborted outputs).
    pub(super) fn finish_beams(&mut self, rid: &str, abort: Option<Option<String>>) {
        let Some(g) = self.beams.groups.remove(rid) else {
            return;
        };
        for (id, _) in &g.live {
            self.drop_beam(rid, *id);
        }
        let Some(e) = self.requests.remove(rid) else {
            return;
        };
        for &id in e.seqs() {
            // Forks not yet live (cannot happen) are released too.
            self.sched.remove(id, FinishReason::Abort);
        }
        let Sink::Stream(tx) = e.sink() else {
            return;
        };
        let outputs = match abort {
            Some(error) => g.aborted_outputs(rid, error),
            None => g.final_outputs(rid, self.tokenizer.as_deref(), &self.cfg.eos_token_ids),
        };
        for o in outputs {
            self.outbox.push(tx, o);
        }
    }
}
