//! Continuous batching with chunked prefill, prefix reuse and preemption by recompute.
//!
//! Every step the scheduler builds one batch under two limits: at most `max_batch_size`
//! running sequences, and at most `max_num_tokens` new tokens in total (prefill chunks plus one
//! token per decoding sequence).
//!
//! 1. **Running sequences first, oldest first.** Each gets its next piece: one token when
//!    decoding, otherwise the rest of its prompt, cut to the remaining token budget when
//!    `enable_chunked_prefill` is on (or when recomputing after preemption, which may be longer
//!    than `max_num_tokens`). If the pool cannot hold that piece, the *newest* running sequence
//!    is preempted — its blocks released (full computed blocks stay in the prefix cache, so the
//!    recompute is mostly cache hits) and it goes back to the waiting queue in arrival order. A
//!    sequence preempts itself only when it is the newest.
//! 2. **Then waiting sequences, strictly FCFS**, unless something was preempted this step:
//!    the head is admitted if the batch has room, the token budget is not spent and the capacity
//!    policy allows it; otherwise admission stops, so a large old request is never overtaken by
//!    small new ones.
//!
//! 3. **If nothing was scheduled while sequences wait**, the newest running sequence is
//!    preempted. Only a running sequence with nothing to compute can cause that: a beam of a
//!    beam search whose step waits for sibling beams that are still waiting for blocks.
//!
//! **No deadlock, no starvation.** Admission (in the engine) refuses any request that could not
//! complete alone in the whole pool (`prompt + max_tokens` blocks ≤ `num_blocks`) or within
//! `max_seq_len`. Only referenced blocks are unavailable, and those belong to running sequences;
//! the oldest running sequence is only preempted when it is the only one, in which case the whole
//! pool is available to it. So the oldest sequence always progresses, and FCFS admission means
//! every sequence eventually becomes the oldest.
//!
//! **Capacity policies** (`scheduler_config.capacity_scheduler_policy` in TensorRT-LLM):
//! - `GUARANTEED_NO_EVICT` (the default, as in TensorRT-LLM): a sequence is admitted only when
//!   the pool can hold it *to completion* (`prompt + max_tokens` tokens) on top of what every
//!   running sequence may still grow to. Running sequences are then never preempted.
//! - `MAX_UTILIZATION`: a sequence is admitted as soon as its next prefill chunk fits;
//!   running sequences that later run out of blocks are preempted as above. More concurrency,
//!   at the price of recompute.

use std::collections::{HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::kv::block_manager::{BlockManager, BlockStats};
use crate::sequence::{FinishReason, SeqId, SeqStatus, Sequence};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum CapacitySchedulerPolicy {
    #[default]
    GuaranteedNoEvict,
    MaxUtilization,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    pub max_batch_size: usize,
    pub max_num_tokens: usize,
    pub enable_chunked_prefill: bool,
    pub policy: CapacitySchedulerPolicy,
}

/// See [`Scheduler::queued_load`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueuedLoad {
    pub prefill_tokens: usize,
    pub kv_tokens: usize,
}

/// One sequence's share of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub id: SeqId,
    /// First position to compute (== the sequence's `num_computed`).
    pub start: usize,
    pub len: usize,
    /// True when this piece reaches the end of the sequence's tokens: a token is sampled.
    pub sample: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Schedule {
    pub seqs: Vec<ScheduledSeq>,
    pub preempted: Vec<SeqId>,
}

impl Schedule {
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.len).sum()
    }
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    blocks: BlockManager,
    seqs: HashMap<SeqId, Sequence>,
    /// Sorted by arrival.
    waiting: VecDeque<SeqId>,
    /// Sorted by arrival.
    running: Vec<SeqId>,
    /// Without chunked prefill, a prompt may not fit the budget left after the decodes; the
    /// head of the queue then goes first in the next step, so decodes cannot starve it.
    prefill_first: Option<SeqId>,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, blocks: BlockManager) -> Self {
        Self {
            cfg,
            blocks,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            prefill_first: None,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }
    pub fn blocks(&self) -> &BlockManager {
        &self.blocks
    }
    pub fn blocks_mut(&mut self) -> &mut BlockManager {
        &mut self.blocks
    }
    pub fn block_stats(&self) -> BlockStats {
        self.blocks.stats()
    }
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }
    /// Work ahead of the engine, for load reports: prompt tokens whose KV is not computed
    /// yet (waiting sequences and running ones still in prefill), and the tokens of waiting
    /// sequences, whose KV blocks are not held yet.
    pub fn queued_load(&self) -> QueuedLoad {
        let mut load = QueuedLoad::default();
        for s in self.waiting.iter().filter_map(|id| self.seqs.get(id)) {
            load.prefill_tokens += s.uncomputed();
            load.kv_tokens += s.tokens.len();
        }
        for s in self.running.iter().filter_map(|id| self.seqs.get(id)) {
            load.prefill_tokens += s.prompt_len.saturating_sub(s.num_computed);
        }
        load
    }
    pub fn get(&self, id: SeqId) -> Option<&Sequence> {
        self.seqs.get(&id)
    }
    pub fn get_mut(&mut self, id: SeqId) -> Option<&mut Sequence> {
        self.seqs.get_mut(&id)
    }
    /// Ids of all live sequences.
    pub fn ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    /// Queues a sequence. It may already hold blocks (an imported sequence whose KV is in
    /// place); admission then skips the prefix lookup.
    pub fn add(&mut self, mut seq: Sequence) {
        seq.status = SeqStatus::Waiting;
        let id = seq.id;
        let arrival = seq.arrival;
        self.seqs.insert(id, seq);
        let pos = self
            .waiting
            .iter()
            .position(|w| self.seqs[w].arrival > arrival)
            .unwrap_or(self.waiting.len());
        self.waiting.insert(pos, id);
    }

    fn insert_running(&mut self, id: SeqId) {
        let arrival = self.seqs[&id].arrival;
        let pos = self
            .running
            .iter()
            .position(|r| self.seqs[r].arrival > arrival)
            .unwrap_or(self.running.len());
        self.running.insert(pos, id);
    }

    /// Removes a sequence (finished, aborted or exported), releasing its blocks.
    pub fn remove(&mut self, id: SeqId, reason: FinishReason) -> Option<Sequence> {
        let mut seq = self.seqs.remove(&id)?;
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&w| w != id);
        self.blocks.release(&mut seq.table);
        seq.status = SeqStatus::Finished(reason);
        Some(seq)
    }

    /// Removes a sequence without releasing its blocks: the caller takes over the table (to
    /// export them first) and must release it through [`Scheduler::blocks_mut`].
    pub fn take(&mut self, id: SeqId) -> Option<Sequence> {
        let seq = self.seqs.remove(&id)?;
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&w| w != id);
        Some(seq)
    }

    fn preempt(&mut self, id: SeqId) {
        self.running.retain(|&r| r != id);
        if let Some(seq) = self.seqs.get_mut(&id) {
            self.blocks.release(&mut seq.table);
            seq.num_computed = 0;
            seq.num_preemptions += 1;
        }
        // Back into the waiting queue in arrival order (usually at the front).
        if let Some(seq) = self.seqs.remove(&id) {
            self.add(seq);
        }
    }

    /// Blocks the running sequences may still need to reach their maximum length.
    fn reserved_growth(&self) -> usize {
        self.running
            .iter()
            .map(|id| {
                let s = &self.seqs[id];
                self.blocks
                    .blocks_for(s.max_total_len())
                    .saturating_sub(s.table.len())
            })
            .sum()
    }

    /// Size of the next piece of `seq` under `budget`, or None when it must wait this step.
    fn piece(&self, seq: &Sequence, budget: usize) -> Option<usize> {
        let n = seq.uncomputed();
        if n == 0 || budget == 0 {
            return None;
        }
        if n <= budget {
            return Some(n);
        }
        let recompute = seq.num_preemptions > 0 || seq.num_generated() > 0;
        if self.cfg.enable_chunked_prefill || recompute {
            Some(budget)
        } else {
            None
        }
    }

    /// Builds the next batch and allocates the blocks it writes.
    pub fn schedule(&mut self) -> Schedule {
        let mut out = Schedule::default();
        let mut budget = self.cfg.max_num_tokens;
        let head = self.waiting.front().copied();
        if head.is_some() && self.prefill_first == head {
            self.prefill_first = None;
            self.admit(&mut out, &mut budget);
        }

        let mut i = 0;
        while i < self.running.len() {
            let id = self.running[i];
            if out.seqs.iter().any(|s| s.id == id) {
                // Admitted first in this very step.
                i += 1;
                continue;
            }
            let Some(n) = self.piece(&self.seqs[&id], budget) else {
                i += 1;
                continue;
            };
            let mut self_preempted = false;
            loop {
                let seq = self.seqs.get_mut(&id).expect("running seq exists");
                let need = seq.num_computed + n;
                if self.blocks.ensure_capacity(&mut seq.table, need).is_ok() {
                    break;
                }
                let victim = *self.running.last().expect("running is not empty");
                self.preempt(victim);
                out.preempted.push(victim);
                // A victim admitted earlier in this step gives its piece back.
                if let Some(pos) = out.seqs.iter().position(|s| s.id == victim) {
                    budget += out.seqs.remove(pos).len;
                }
                if victim == id {
                    self_preempted = true;
                    break;
                }
            }
            if self_preempted {
                // `id` was the newest: nothing after it remains.
                break;
            }
            let seq = &self.seqs[&id];
            out.seqs.push(ScheduledSeq {
                id,
                start: seq.num_computed,
                len: n,
                sample: seq.num_computed + n == seq.tokens.len(),
            });
            budget -= n;
            i += 1;
        }

        if out.preempted.is_empty() {
            self.admit(&mut out, &mut budget);
        }
        if out.seqs.is_empty() && out.preempted.is_empty() && !self.waiting.is_empty() {
            // Nothing could run, yet sequences wait: the blocks are held by waiting sequences
            // (forked beams) or by running ones with nothing to compute (beams waiting for
            // their siblings, see `engine/beam.rs`). Free the newest waiting holder, else
            // preempt the newest running sequence, so the oldest can go on.
            let head = self.waiting.front().copied();
            let holder = self
                .waiting
                .iter()
                .rev()
                .copied()
                .find(|w| Some(*w) != head && !self.seqs[w].table.is_empty());
            if let Some(h) = holder {
                if let Some(seq) = self.seqs.get_mut(&h) {
                    self.blocks.release(&mut seq.table);
                    seq.num_computed = 0;
                    seq.num_preemptions += 1;
                }
                out.preempted.push(h);
            } else if let Some(&victim) = self.running.last() {
                self.preempt(victim);
                out.preempted.push(victim);
            }
        }
        out
    }

    fn admit(&mut self, out: &mut Schedule, budget: &mut usize) {
        while let Some(&id) = self.waiting.front() {
            if self.running.len() >= self.cfg.max_batch_size || *budget == 0 {
                break;
            }
            let seq = &self.seqs[&id];
            let has_blocks = !seq.table.is_empty();
            if self.cfg.policy == CapacitySchedulerPolicy::GuaranteedNoEvict {
                let need = if has_blocks {
                    self.blocks
                        .blocks_for(seq.max_total_len())
                        .saturating_sub(seq.table.len())
                } else {
                    self.blocks.blocks_needed_for(
                        &seq.tokens,
                        seq.table.hashing(),
                        seq.max_total_len(),
                    )
                };
                if need + self.reserved_growth() > self.blocks.available() {
                    if self.running.is_empty() && self.release_waiting_holder(id) {
                        continue;
                    }
                    break;
                }
            }
            let seq = self.seqs.get_mut(&id).expect("waiting seq exists");
            let mut attached = false;
            if !has_blocks {
                let cached = self.blocks.attach_prefix(&mut seq.table, &seq.tokens);
                // At least the last token is computed: its logits give the next token.
                seq.num_computed = cached.min(seq.tokens.len() - 1);
                if seq.cached_prompt_tokens.is_none() {
                    seq.cached_prompt_tokens = Some(seq.num_computed.min(seq.prompt_len));
                }
                attached = true;
            }
            let Some(n) = self.piece(&self.seqs[&id], *budget) else {
                self.undo_attach(id, attached);
                let s = &self.seqs[&id];
                if *budget < self.cfg.max_num_tokens && s.uncomputed() <= self.cfg.max_num_tokens {
                    self.prefill_first = Some(id);
                }
                break;
            };
            let seq = self.seqs.get_mut(&id).expect("waiting seq exists");
            if self
                .blocks
                .ensure_capacity(&mut seq.table, seq.num_computed + n)
                .is_err()
            {
                self.undo_attach(id, attached);
                if self.running.is_empty() && self.release_waiting_holder(id) {
                    continue;
                }
                break;
            }
            self.waiting.pop_front();
            seq.status = SeqStatus::Running;
            out.seqs.push(ScheduledSeq {
                id,
                start: seq.num_computed,
                len: n,
                sample: seq.num_computed + n == seq.tokens.len(),
            });
            self.insert_running(id);
            *budget -= n;
        }
    }

    /// Releases the blocks of the newest waiting sequence other than `except` that holds some
    /// (an imported sequence, whose KV arrived with it); it will recompute. Only used when
    /// nothing runs: then no block would ever be freed otherwise, and the head would wait
    /// forever behind sequences queued after it.
    fn release_waiting_holder(&mut self, except: SeqId) -> bool {
        let holder = self
            .waiting
            .iter()
            .rev()
            .copied()
            .find(|w| *w != except && !self.seqs[w].table.is_empty());
        let Some(h) = holder else {
            return false;
        };
        if let Some(seq) = self.seqs.get_mut(&h) {
            self.blocks.release(&mut seq.table);
            seq.num_computed = 0;
        }
        true
    }

    fn undo_attach(&mut self, id: SeqId, attached: bool) {
        if attached {
            if let Some(seq) = self.seqs.get_mut(&id) {
                self.blocks.release(&mut seq.table);
                seq.num_computed = 0;
            }
        }
    }

    /// Records that a scheduled piece was computed: advances `num_computed` and registers the
    /// blocks that became full for reuse.
    pub fn mark_computed(&mut self, s: &ScheduledSeq) {
        if let Some(seq) = self.seqs.get_mut(&s.id) {
            seq.num_computed = s.start + s.len;
            self.blocks
                .commit_computed(&mut seq.table, &seq.tokens, seq.num_computed);
        }
    }
}

#[cfg(test)]
mod tests;
