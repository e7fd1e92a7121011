//! Worker selection: every router mode behind one [`WorkerSelector::select`].
//!
//! All modes except `direct` first drop *busy* workers (above a load threshold, see
//! [`WorkerSelector::is_busy`]); when nobody is left the answer is
//! [`SelectError::NoWorkerAvailable`], which the HTTP layer turns into a 503. `direct` sends to
//! the worker the request names, busy or not, because the caller chose it deliberately.

pub mod cost;
pub mod rng;

use crate::config::{KvRouterConfig, RouterMode};
use crate::protocols::{sequence_hashes, LocalBlockHash, OverlapScores, WorkerId};
use crate::sequences::{LoadSource, WorkerLoad};
use cost::CostInputs;
use rng::SplitMix64;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// A worker the request may go to, with what the selector needs to know about its capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerInfo {
    pub id: WorkerId,
    /// KV cache capacity in blocks (0 = unknown: the decode-blocks threshold is skipped).
    pub total_blocks: u64,
    /// Per-step token budget (0 = unknown: the fractional prefill threshold is skipped).
    pub max_num_batched_tokens: u64,
    pub block_size: u32,
}

/// Per-request overrides (Dynamo's `RouterConfigOverride`) and the `direct` target.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SelectOptions {
    pub overlap_score_weight: Option<f64>,
    pub router_temperature: Option<f64>,
    /// The worker a `direct`-mode request must go to.
    pub worker_id: Option<WorkerId>,
}

/// The choice, with what the caller records for it (load tracking, metrics, usage).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Selection {
    pub worker_id: WorkerId,
    pub mode: RouterMode,
    /// Leading prompt blocks the chosen worker already holds.
    pub overlap_blocks: u32,
    /// Prompt tokens the chosen worker already holds (`usage.prompt_tokens_details.cached_tokens`).
    pub cached_tokens: usize,
    /// Prompt tokens it still has to compute.
    pub new_prefill_tokens: usize,
    /// The chosen worker's cost (kv mode only).
    pub logit: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SelectError {
    /// No candidate, or every candidate is busy: answer 503.
    #[error("no worker available: {busy} of {candidates} worker(s) busy")]
    NoWorkerAvailable { candidates: usize, busy: usize },
    #[error("router mode direct needs a target worker id")]
    DirectTargetMissing,
    #[error("worker {0} is not among the available workers")]
    UnknownWorker(WorkerId),
    #[error("router mode {0} is not implemented")]
    Unsupported(RouterMode),
}

/// Chooses workers. Holds the config, the seed of its random choices and the round-robin
/// cursor, both atomics; loads and overlaps are passed in per call, so concurrent selections
/// need no lock.
pub struct WorkerSelector {
    config: KvRouterConfig,
    /// Each selection draws from a generator of its own, seeded from this counter.
    draws: AtomicU64,
    next_rr: AtomicUsize,
}

impl WorkerSelector {
    /// `seed: None` seeds from the clock; tests pass a seed to make every choice reproducible.
    pub fn new(config: KvRouterConfig, seed: Option<u64>) -> Self {
        let seed = seed.unwrap_or_else(|| SplitMix64::from_entropy().next_u64());
        Self {
            config,
            draws: AtomicU64::new(seed),
            next_rr: AtomicUsize::new(0),
        }
    }

    /// The generator of one selection (sequential selections draw reproducibly from a seed).
    fn rng(&self) -> SplitMix64 {
        // Consecutive counters would give overlapping streams: seed from a mix of the counter.
        let mut state = self
            .draws
            .fetch_add(tandem_rng::GOLDEN_GAMMA, Ordering::Relaxed);
        SplitMix64::new(tandem_rng::splitmix64(&mut state))
    }

    pub fn config(&self) -> &KvRouterConfig {
        &self.config
    }

    /// Busy by any enabled threshold of the config, on the worker's current tracked load.
    pub fn is_busy(&self, w: &WorkerInfo, load: &WorkerLoad) -> bool {
        let c = &self.config;
        let decode = c.active_decode_blocks_threshold.is_some_and(|f| {
            w.total_blocks > 0 && load.active_decode_blocks as f64 > f * w.total_blocks as f64
        });
        let prefill_abs = c
            .active_prefill_tokens_threshold
            .is_some_and(|t| load.active_prefill_tokens > t);
        let prefill_frac = c.active_prefill_tokens_threshold_frac.is_some_and(|f| {
            w.max_num_batched_tokens > 0
                && load.active_prefill_tokens as f64 > f * w.max_num_batched_tokens as f64
        });
        decode || prefill_abs || prefill_frac
    }

    /// Above `router_queue_threshold × max_num_batched_tokens` active prefill tokens: the
    /// worker cannot start a new prompt soon. When every candidate is saturated the serving
    /// layer holds the request in its queue instead of piling it onto a worker.
    /// Never true when the threshold is disabled or the budget unknown.
    pub fn is_saturated(&self, w: &WorkerInfo, load: &WorkerLoad) -> bool {
        self.config.router_queue_threshold.is_some_and(|f| {
            w.max_num_batched_tokens > 0
                && load.active_prefill_tokens as f64 > f * w.max_num_batched_tokens as f64
        })
    }

    /// Picks a worker for a request of `isl_tokens` prompt tokens whose full blocks hash to
    /// `request_local_hashes`, among `candidates`, with the index's `overlaps` and the tracked
    /// `loads`.
    pub fn select(
        &self,
        request_local_hashes: &[LocalBlockHash],
        isl_tokens: usize,
        candidates: &[WorkerInfo],
        overlaps: &OverlapScores,
        loads: &dyn LoadSource,
        opts: &SelectOptions,
    ) -> Result<Selection, SelectError> {
        let mode = self.config.router_mode;
        let finish = |w: &WorkerInfo, logit: Option<f64>| {
            let c = CostInputs {
                overlap_blocks: overlaps.score(w.id),
                isl_tokens,
                block_size: w.block_size,
                ..Default::default()
            };
            Selection {
                worker_id: w.id,
                mode,
                overlap_blocks: c.overlap_blocks,
                cached_tokens: c.cached_tokens(),
                new_prefill_tokens: c.new_prefill_tokens(),
                logit,
            }
        };
        if mode == RouterMode::Direct {
            let target = opts.worker_id.ok_or(SelectError::DirectTargetMissing)?;
            let w = candidates
                .iter()
                .find(|w| w.id == target)
                .ok_or(SelectError::UnknownWorker(target))?;
            return Ok(finish(w, None));
        }
        if mode == RouterMode::DeviceAwareWeighted {
            return Err(SelectError::Unsupported(mode));
        }
        let with_load: Vec<(&WorkerInfo, WorkerLoad)> = candidates
            .iter()
            .map(|w| (w, loads.load(w.id)))
            .filter(|(w, l)| !self.is_busy(w, l))
            .collect();
        if with_load.is_empty() {
            return Err(SelectError::NoWorkerAvailable {
                candidates: candidates.len(),
                busy: candidates.len(),
            });
        }
        let n = with_load.len();
        let load_key = |l: &WorkerLoad| {
            (
                l.active_requests,
                l.active_decode_blocks,
                l.active_prefill_tokens,
            )
        };
        let pick = match mode {
            RouterMode::RoundRobin => self.next_rr.fetch_add(1, Ordering::Relaxed) % n,
            RouterMode::Random => self.rng().below(n as u64) as usize,
            RouterMode::LeastLoaded => {
                let best = with_load.iter().map(|(_, l)| load_key(l)).min();
                let ties: Vec<usize> = (0..n)
                    .filter(|&i| Some(load_key(&with_load[i].1)) == best)
                    .collect();
                ties[self.rng().below(ties.len() as u64) as usize]
            }
            RouterMode::PowerOfTwo => {
                if n == 1 {
                    0
                } else {
                    let mut rng = self.rng();
                    let a = rng.below(n as u64) as usize;
                    let b = (a + 1 + rng.below(n as u64 - 1) as usize) % n;
                    if load_key(&with_load[b].1) < load_key(&with_load[a].1) {
                        b
                    } else {
                        a
                    }
                }
            }
            RouterMode::Kv => {
                let (i, logit) = self.kv_pick(
                    request_local_hashes,
                    isl_tokens,
                    &with_load,
                    overlaps,
                    loads,
                    opts,
                );
                return Ok(finish(with_load[i].0, Some(logit)));
            }
            RouterMode::Direct | RouterMode::DeviceAwareWeighted => {
                return Err(SelectError::Unsupported(mode))
            }
        };
        Ok(finish(with_load[pick].0, None))
    }

    fn kv_pick(
        &self,
        locals: &[LocalBlockHash],
        isl_tokens: usize,
        workers: &[(&WorkerInfo, WorkerLoad)],
        overlaps: &OverlapScores,
        loads: &dyn LoadSource,
        opts: &SelectOptions,
    ) -> (usize, f64) {
        let c = &self.config;
        let weight = opts.overlap_score_weight.unwrap_or(c.overlap_score_weight);
        let temperature = opts.router_temperature.unwrap_or(c.router_temperature);
        // Sequence hashes identify blocks by position, which is what "already active" means.
        let seqs = if c.router_track_active_blocks && c.router_assume_kv_reuse {
            sequence_hashes(locals)
        } else {
            Vec::new()
        };
        let logits: Vec<f64> = workers
            .iter()
            .map(|(w, l)| {
                let partial = usize::from(
                    w.block_size > 0 && !isl_tokens.is_multiple_of(w.block_size as usize),
                );
                let (active_decode_blocks, new_blocks) = if !c.router_track_active_blocks {
                    (0, 0)
                } else if c.router_assume_kv_reuse {
                    (
                        l.active_decode_blocks,
                        loads.new_blocks(w.id, &seqs) + partial,
                    )
                } else {
                    (l.active_decode_blocks, locals.len() + partial)
                };
                let inputs = CostInputs {
                    overlap_blocks: overlaps.score(w.id),
                    isl_tokens,
                    block_size: w.block_size,
                    active_prefill_tokens: if c.router_track_prefill_tokens {
                        l.active_prefill_tokens
                    } else {
                        0
                    },
                    active_decode_blocks,
                    new_blocks,
                };
                cost::logit(weight, &inputs)
            })
            .collect();
        let pick = if temperature > 0.0 {
            cost::softmax_sample(&logits, temperature, &mut self.rng())
        } else {
            let sizes: Vec<usize> = workers
                .iter()
                .map(|(w, _)| overlaps.tree_size(w.id))
                .collect();
            cost::argmin(&logits, &sizes, &mut self.rng())
        };
        // `workers` is non-empty here, so both pickers return Some.
        let i = pick.unwrap_or(0);
        if tracing::enabled!(tracing::Level::DEBUG) {
            trace_kv_pick(locals.first(), workers, overlaps, &logits, i);
        }
        (i, logits[i])
    }
}

/// One kv decision at debug level: the prompt's first block (which names a shared prefix),
/// and each candidate's overlap, load and cost, so that a log shows why a request went to a
/// worker that held less of its prompt than another.
fn trace_kv_pick(
    first_block: Option<&LocalBlockHash>,
    workers: &[(&WorkerInfo, WorkerLoad)],
    overlaps: &OverlapScores,
    logits: &[f64],
    chosen: usize,
) {
    let candidates: Vec<String> = workers
        .iter()
        .zip(logits)
        .map(|((w, l), logit)| {
            format!(
                "{}:overlap={},requests={},blocks={},prefill={},logit={logit:.1}",
                w.id,
                overlaps.score(w.id),
                l.active_requests,
                l.active_decode_blocks,
                l.active_prefill_tokens
            )
        })
        .collect();
    tracing::debug!(
        first_block = first_block.map(|h| h.0),
        chosen = workers[chosen].0.id,
        candidates = candidates.join(" "),
        "kv routing decision"
    );
}

#[cfg(test)]
#[path = "selector_tests.rs"]
mod tests;
