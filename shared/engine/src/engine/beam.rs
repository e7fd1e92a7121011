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

use super::core::{output, Core, Sink};
use crate::request::{FinishReason, StopReason, Usage};
use crate::sampler::{sample_without_logits, top_k_logprobs};
use crate::sequence::{SeqId, Sequence};

/// One finished hypothesis.
#[derive(Debug, Clone)]
pub(super) struct Hyp {
    /// Generated tokens (the EOS included).
    tokens: Vec<u32>,
    score: f64,
    eos: Option<u32>,
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
}

impl Core {
    /// Starts a beam group for a request with `use_beam_search` (validated): one sequence for
    /// the prompt; beams fork from it after the first step.
    pub(super) fn submit_beams(&mut self, id: SeqId, seq: &Sequence) {
        let p = &seq.params;
        let mut eos: Vec<u32> = if p.ignore_eos {
            Vec::new()
        } else {
            self.cfg.eos_token_ids.clone()
        };
        for &t in &p.stop_token_ids {
            if !eos.contains(&t) {
                eos.push(t);
            }
        }
        let g = BeamGroup {
            width: p.beam_width(),
            n: p.n,
            length_penalty: p.length_penalty as f64,
            early_stopping: p.early_stopping,
            max_tokens: seq.max_tokens,
            eos,
            stop_token_ids: p.stop_token_ids.clone(),
            live: vec![(id, 0.0)],
            pending: HashMap::new(),
            finished: Vec::new(),
            prompt_len: seq.prompt_len,
            cached_tokens: 0,
            skip_special_tokens: p.skip_special_tokens,
        };
        self.beams.insert(seq.request_id.to_string(), g);
    }

    /// Records a beam's logits row (None: a backend without logits; candidates are then
    /// drawn from the beam's RNG). Returns the request id when the beam belongs to a group.
    pub(super) fn beam_row(&mut self, id: SeqId, row: Option<&[f32]>) -> Option<String> {
        let rid = self.seq_req.get(&id)?.clone();
        let vocab = self.backend.vocab_size();
        let g = self.beams.get_mut(&rid)?;
        let k = g.k();
        let seq = self.sched.get_mut(id)?;
        if g.cached_tokens == 0 {
            g.cached_tokens = seq.cached_prompt_tokens.unwrap_or(0);
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
        g.pending.insert(id, cands);
        Some(rid)
    }

    /// Runs the group's step once every live beam has its candidates.
    pub(super) fn beam_step(&mut self, rid: &str) {
        let Some(g) = self.beams.get_mut(rid) else {
            return;
        };
        if g.live.iter().any(|(id, _)| !g.pending.contains_key(id)) {
            return;
        }
        let k = g.k();
        let width = g.width;
        // 1. The best K continuations over all beams.
        let mut cands: Vec<(f64, usize, u32)> = Vec::new();
        for (bi, (id, cum)) in g.live.iter().enumerate() {
            for &(tok, lp) in &g.pending[id] {
                cands.push((cum + lp as f64, bi, tok));
            }
        }
        g.pending.clear();
        cands.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        cands.truncate(k);
        let cur_len = self
            .sched
            .get(g.live[0].0)
            .map(|s| s.num_generated())
            .unwrap_or(0);
        let new_len = cur_len + 1;
        let at_max = new_len >= g.max_tokens;
        // 2. Finished hypotheses among the first `width`.
        if !(g.early_stopping && g.finished.len() >= width) {
            for &(score, bi, tok) in cands.iter().take(width) {
                let is_eos = g.eos.contains(&tok);
                if !(is_eos || at_max) {
                    continue;
                }
                let Some(parent) = self.sched.get(g.live[bi].0) else {
                    continue;
                };
                let mut tokens = parent.generated().to_vec();
                tokens.push(tok);
                let h = Hyp {
                    tokens,
                    score: g.norm(score, new_len),
                    eos: is_eos.then_some(tok),
                };
                g.add_finished(h);
            }
        }
        // 3. The next beams.
        let next: Vec<(f64, usize, u32)> = cands
            .iter()
            .copied()
            .filter(|c| !g.eos.contains(&c.2))
            .take(width)
            .collect();
        // 4. Stop?
        let full = g.finished.len() >= width;
        let done = at_max
            || next.is_empty()
            || (full
                && (g.early_stopping
                    || g.finished
                        .last()
                        .map(|f| f.score)
                        .unwrap_or(f64::NEG_INFINITY)
                        >= g.norm(next[0].0, new_len)));
        if done {
            self.finish_beams(rid, None);
            return;
        }
        self.advance_beams(rid, &next);
    }

    /// Makes `next` (score, parent index, token) the live beams: drops unchosen parents,
    /// forks parents chosen more than once, extends the rest in place.
    fn advance_beams(&mut self, rid: &str, next: &[(f64, usize, u32)]) {
        let Some(g) = self.beams.get_mut(rid) else {
            return;
        };
        let parents: Vec<SeqId> = g.live.iter().map(|(id, _)| *id).collect();
        let mut uses = vec![0usize; parents.len()];
        for &(_, bi, _) in next {
            uses[bi] += 1;
        }
        // Dropped parents first: their blocks may be needed by the forks.
        for (bi, &id) in parents.iter().enumerate() {
            if uses[bi] == 0 {
                self.drop_beam(rid, id);
            }
        }
        let mut live = Vec::with_capacity(next.len());
        let mut in_place: Vec<(SeqId, u32)> = Vec::new();
        for &(score, bi, tok) in next {
            let pid = parents[bi];
            uses[bi] -= 1;
            if uses[bi] == 0 {
                // The last use continues the parent itself (after its forks copied it).
                in_place.push((pid, tok));
                live.push((pid, score));
            } else if let Some(fid) = self.fork_beam(rid, pid, tok) {
                live.push((fid, score));
            }
        }
        for (pid, tok) in in_place {
            if let Some(s) = self.sched.get_mut(pid) {
                s.tokens.push(tok);
            }
        }
        if let Some(g) = self.beams.get_mut(rid) {
            g.live = live;
        }
    }

    /// A new beam: the parent's tokens plus `tok`, its full blocks shared, its partial last
    /// block copied.
    fn fork_beam(&mut self, rid: &str, pid: SeqId, tok: u32) -> Option<SeqId> {
        let parent = self.sched.get(pid)?;
        let id = self.next_seq;
        self.next_seq += 1;
        let mut seq = Sequence::new(
            id,
            Arc::clone(&parent.request_id),
            0,
            parent.tokens.clone(),
            parent.max_tokens,
            parent.arrival,
            Arc::clone(&parent.params),
            parent.sampler.clone(),
        );
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
        self.sched.add(seq);
        self.seq_req.insert(id, rid.to_owned());
        if let Some(e) = self.reqs.get_mut(rid) {
            e.seqs.push(id);
        }
        Some(id)
    }

    /// Removes one beam silently, releasing its blocks.
    fn drop_beam(&mut self, rid: &str, id: SeqId) {
        self.seq_req.remove(&id);
        self.sched.remove(id, FinishReason::Abort);
        if let Some(e) = self.reqs.get_mut(rid) {
            e.seqs.retain(|&s| s != id);
        }
    }

    /// Ends a beam request: releases every beam and sends the `n` best hypotheses (or, with
    /// `error` / on abort, `n` aborted outputs).
    pub(super) fn finish_beams(&mut self, rid: &str, abort: Option<Option<String>>) {
        let Some(g) = self.beams.remove(rid) else {
            return;
        };
        for (id, _) in &g.live {
            self.drop_beam(rid, *id);
        }
        let Some(e) = self.reqs.remove(rid) else {
            return;
        };
        for id in e.seqs {
            // Forks not yet live (cannot happen) are released too.
            self.seq_req.remove(&id);
            self.sched.remove(id, FinishReason::Abort);
        }
        let Sink::Stream(tx) = &e.out else {
            return;
        };
        let usage = |completion_tokens| Usage {
            prompt_tokens: g.prompt_len,
            completion_tokens,
            cached_tokens: g.cached_tokens,
        };
        if let Some(error) = abort {
            for index in 0..g.n {
                let mut o = output(rid, index);
                o.finish_reason = Some(FinishReason::Abort);
                o.usage = Some(usage(0));
                o.error = error.clone();
                let _ = tx.send(o);
            }
            return;
        }
        for index in 0..g.n {
            let mut o = output(rid, index);
            match g.finished.get(index) {
                Some(h) => {
                    o.token_ids = h.tokens.clone();
                    if let Some(tk) = self.tokenizer.as_deref() {
                        o.text = tk
                            .decode(&h.tokens, g.skip_special_tokens)
                            .unwrap_or_default();
                    }
                    o.finish_reason = Some(match h.eos {
                        Some(_) => FinishReason::Stop,
                        None => FinishReason::Length,
                    });
                    o.stop_reason = h.eos.map(|t| {
                        if g.stop_token_ids.contains(&t) && !self.cfg.eos_token_ids.contains(&t) {
                            StopReason::TokenId(t)
                        } else {
                            StopReason::Eos(t)
                        }
                    });
                    o.usage = Some(usage(h.tokens.len()));
                    o.score = Some(h.score as f32);
                }
                None => {
                    // Fewer hypotheses than n (a vocabulary smaller than the width).
                    o.finish_reason = Some(FinishReason::Length);
                    o.usage = Some(usage(0));
                }
            }
            let _ = tx.send(o);
        }
    }
}
