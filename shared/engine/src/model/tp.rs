//! Tensor parallelism (Megatron-style) for the decoder: which part of each weight a rank
//! holds, and the collectives that join the ranks' partial results.
//!
//! With `world` ranks, rank `r` holds
//! - q/k/v and gate/up **column-parallel**: the rows (output features) of its query heads
//!   `r·nq/world..`, its KV heads `r·nkv/world..` (query heads stay with their KV head, so
//!   grouped-query attention needs nothing from other ranks) and its slice of the MLP's
//!   intermediate features;
//! - o_proj and down **row-parallel**: the matching columns (input features), so each rank's
//!   product is a partial sum of the full output, joined by one all-reduce per projection;
//! - the embedding and lm_head **vocabulary-parallel**: rows `r·⌈V/world⌉..` of the
//!   vocabulary; a token outside a rank's rows embeds as zeros there (joined by an
//!   all-reduce), and each rank's logits are its vocabulary slice (joined by an all-gather of
//!   equal, zero-padded slices, as NCCL's all-gather requires);
//! - the KV cache of its KV heads only.
//!
//! Norms, q/k norms and the residual stream are replicated: after each all-reduce every rank
//! holds the same sum (taken in rank order), so every rank computes the same residual stream.
//! With one rank there are no collectives and the forward pass is exactly the unsharded one.

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};

use crate::backend::cpu_ops::Matrix;
use crate::error::EngineError;
use crate::model::config::ModelConfig;
use crate::model::decoder::{DecoderWeights, LayerWeights};

/// One rank's place among `world` tensor-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
}

impl Shard {
    /// The whole model on one rank.
    pub const WHOLE: Shard = Shard { rank: 0, world: 1 };

    /// Checks that `cfg` can be split over `world` ranks: KV heads, query heads and the MLP's
    /// intermediate features must divide evenly (the vocabulary need not).
    pub fn check(cfg: &ModelConfig, world: usize) -> Result<(), EngineError> {
        if world == 0 {
            return Err(EngineError::Config(
                "tensor_parallel_size must be at least 1".into(),
            ));
        }
        let parts = [
            ("num_key_value_heads", cfg.num_key_value_heads),
            ("num_attention_heads", cfg.num_attention_heads),
            ("intermediate_size", cfg.intermediate_size),
        ];
        for (name, n) in parts {
            if !n.is_multiple_of(world) {
                return Err(EngineError::Config(format!(
                    "tensor_parallel_size {world} does not divide the model's {name} ({n}); \
                     the KV cache and attention are split by KV head and the MLP by \
                     intermediate feature, so choose a size that divides both"
                )));
            }
        }
        Ok(())
    }

    /// This rank's part of `n` items split evenly (heads, features).
    pub fn part(&self, n: usize) -> Range<usize> {
        let per = n / self.world;
        self.rank * per..(self.rank + 1) * per
    }

    /// Rows of a vocabulary of `vocab` every rank's slice is padded to: `⌈vocab / world⌉`.
    pub fn vocab_per_rank(&self, vocab: usize) -> usize {
        vocab.div_ceil(self.world)
    }

    /// This rank's vocabulary rows (the last rank's may be fewer than
    /// [`Shard::vocab_per_rank`], or none).
    pub fn vocab(&self, vocab: usize) -> Range<usize> {
        let per = self.vocab_per_rank(vocab);
        (self.rank * per).min(vocab)..((self.rank + 1) * per).min(vocab)
    }

    /// This rank's part of `cfg`'s decoder weights (copies; `w` is left as it is).
    pub fn weights(&self, cfg: &ModelConfig, w: &DecoderWeights) -> DecoderWeights {
        let h = cfg.hidden_size;
        let vocab = self.vocab(cfg.vocab_size);
        let embed = w.embed.row_range(vocab.clone(), h);
        let lm_head = w.lm_head.as_ref().map(|m| m.row_range(vocab, h));
        DecoderWeights {
            embed,
            layers: w.layers.iter().map(|l| self.layer(cfg, l)).collect(),
            norm: w.norm.clone(),
            lm_head,
        }
    }

    /// One layer's part: column-parallel q/k/v and gate/up, row-parallel o_proj and down.
    fn layer(&self, cfg: &ModelConfig, l: &LayerWeights) -> LayerWeights {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let (qd, kvd) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
        let im = cfg.intermediate_size;
        let q = self.part(qd);
        let kv = self.part(kvd);
        let qkv_rows = [q.clone(), shift(&kv, qd), shift(&kv, qd + kvd)];
        let mlp = self.part(im);
        let gate_up_rows = [mlp.clone(), shift(&mlp, im)];
        LayerWeights {
            input_norm: l.input_norm.clone(),
            qkv: rows_of(&l.qkv, &qkv_rows, h),
            qkv_bias: l.qkv_bias.as_ref().map(|b| {
                qkv_rows
                    .iter()
                    .flat_map(|r| b[r.clone()].iter().copied())
                    .collect()
            }),
            q_norm: l.q_norm.clone(),
            k_norm: l.k_norm.clone(),
            o_proj: l.o_proj.col_range(q, qd),
            o_bias: l.o_bias.clone(),
            post_norm: l.post_norm.clone(),
            gate_up: rows_of(&l.gate_up, &gate_up_rows, h),
            down: l.down.col_range(mlp, im),
        }
    }
}

fn shift(r: &Range<usize>, by: usize) -> Range<usize> {
    r.start + by..r.end + by
}

/// The rows `ranges` of `m` (`cols` columns), one range after another.
fn rows_of(m: &Matrix, ranges: &[Range<usize>], cols: usize) -> Matrix {
    Matrix::concat(
        ranges
            .iter()
            .map(|r| m.row_range(r.clone(), cols))
            .collect(),
    )
}

/// The collectives the ranks of one step call, in the same order on every rank. An error
/// means another rank failed: the step is abandoned.
pub trait Collective: Sync {
    /// Replaces `buf` on every rank with the element-wise sum of every rank's `buf`.
    fn all_reduce_sum(&self, rank: usize, buf: &mut [f32]) -> Result<(), EngineError>;
    /// Every rank's `part` (all the same length), concatenated in rank order.
    fn all_gather(&self, rank: usize, part: &[f32]) -> Result<Vec<f32>, EngineError>;
}

/// A rank's view of its shard and the collective joining it to the others.
#[derive(Clone, Copy)]
pub struct RankCtx<'c> {
    pub shard: Shard,
    pub collective: Option<&'c dyn Collective>,
}

impl RankCtx<'_> {
    /// The whole model on one rank (no collectives).
    pub const WHOLE: RankCtx<'static> = RankCtx {
        shard: Shard::WHOLE,
        collective: None,
    };

    /// [`Collective::all_reduce_sum`]; nothing with one rank.
    pub fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), EngineError> {
        match self.collective {
            Some(c) if self.shard.world > 1 => c.all_reduce_sum(self.shard.rank, buf),
            _ => Ok(()),
        }
    }

    /// [`Collective::all_gather`]; `part` itself with one rank.
    pub fn all_gather(&self, part: Vec<f32>) -> Result<Vec<f32>, EngineError> {
        match self.collective {
            Some(c) if self.shard.world > 1 => c.all_gather(self.shard.rank, &part),
            _ => Ok(part),
        }
    }
}

/// Ranks as threads of one process: each collective is a rendezvous where every rank leaves
/// its buffer and takes all of them. A rank that fails or panics [`poisons`](Self::poison)
/// it, and the ranks waiting (or arriving later) get an error instead of waiting for ever.
pub struct ThreadCollective {
    world: usize,
    state: Mutex<Round>,
    arrived: Condvar,
}

#[derive(Default)]
struct Round {
    /// Completed rendezvous so far.
    generation: u64,
    /// Buffers left in the current one, by rank.
    slots: Vec<Option<Vec<f32>>>,
    /// The buffers of the last completed rendezvous, by rank.
    last: Arc<Vec<Vec<f32>>>,
    poisoned: Option<usize>,
}

impl ThreadCollective {
    pub fn new(world: usize) -> Self {
        Self {
            world,
            state: Mutex::new(Round {
                slots: vec![None; world],
                ..Round::default()
            }),
            arrived: Condvar::new(),
        }
    }

    /// Marks the collective failed by `rank`: waiting and later calls return an error.
    pub fn poison(&self, rank: usize) {
        let mut s = self.lock();
        s.poisoned.get_or_insert(rank);
        self.arrived.notify_all();
    }

    /// Clears a failure and any half-finished rendezvous (between steps, when no rank runs).
    pub fn reset(&self) {
        let mut s = self.lock();
        s.poisoned = None;
        s.slots.iter_mut().for_each(|slot| *slot = None);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Round> {
        // A rank that panicked while holding the lock left the round half-written: the
        // poison flag (set by its guard) tells the others, so the data is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Leaves `data` as `rank`'s buffer and returns every rank's once all have arrived.
    fn exchange(&self, rank: usize, data: &[f32]) -> Result<Arc<Vec<Vec<f32>>>, EngineError> {
        let mut s = self.lock();
        let failed = |by: usize| EngineError::RankFailed { rank: by };
        if let Some(by) = s.poisoned {
            return Err(failed(by));
        }
        s.slots[rank] = Some(data.to_vec());
        let generation = s.generation;
        if s.slots.iter().all(Option::is_some) {
            let all = s.slots.iter_mut().filter_map(Option::take).collect();
            s.last = Arc::new(all);
            s.generation += 1;
            self.arrived.notify_all();
            return Ok(s.last.clone());
        }
        while s.generation == generation {
            if let Some(by) = s.poisoned {
                return Err(failed(by));
            }
            s = self.arrived.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        // The next rendezvous cannot complete before this rank arrives at it, so `last` is
        // still this one's.
        Ok(s.last.clone())
    }
}

impl Collective for ThreadCollective {
    fn all_reduce_sum(&self, rank: usize, buf: &mut [f32]) -> Result<(), EngineError> {
        let all = self.exchange(rank, buf)?;
        buf.fill(0.0);
        for part in all.iter() {
            for (b, p) in buf.iter_mut().zip(part) {
                *b += p;
            }
        }
        Ok(())
    }

    fn all_gather(&self, rank: usize, part: &[f32]) -> Result<Vec<f32>, EngineError> {
        let all = self.exchange(rank, part)?;
        debug_assert_eq!(all.len(), self.world);
        Ok(all.concat())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_each_dimension_once() {
        let shards: Vec<Shard> = (0..3).map(|rank| Shard { rank, world: 3 }).collect();
        assert_eq!(shards[1].part(12), 4..8);
        // 10 vocabulary rows over 3 ranks: 4, 4 and 2, each slice padded to 4.
        let v: Vec<_> = shards.iter().map(|s| s.vocab(10)).collect();
        assert_eq!(v, vec![0..4, 4..8, 8..10]);
        assert_eq!(shards[2].vocab_per_rank(10), 4);
        // More ranks than rows: the last ranks hold none.
        assert_eq!(Shard { rank: 3, world: 4 }.vocab(3), 3..3);
    }

    #[test]
    fn thread_collective_sums_and_gathers_in_rank_order() {
        let world = 3;
        let c = ThreadCollective::new(world);
        let out: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|rank| {
                    let c = &c;
                    s.spawn(move || {
                        let mut sums = Vec::new();
                        // Many rounds back to back: a fast rank must never read a later
                        // round's buffers.
                        for round in 0..200 {
                            let mut buf = vec![rank as f32 + round as f32; 2];
                            c.all_reduce_sum(rank, &mut buf).unwrap();
                            sums.push(buf[0]);
                        }
                        let g = c.all_gather(rank, &[rank as f32, 10.0]).unwrap();
                        (sums, g)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (sums, gathered) in &out {
            let want: Vec<f32> = (0..200).map(|r| 3.0 + 3.0 * r as f32).collect();
            assert_eq!(sums, &want);
            assert_eq!(gathered, &vec![0.0, 10.0, 1.0, 10.0, 2.0, 10.0]);
        }
    }

    #[test]
    fn a_failed_rank_releases_the_others() {
        let c = ThreadCollective::new(2);
        let err = std::thread::scope(|s| {
            let waiting = s.spawn(|| c.all_reduce_sum(0, &mut [1.0]));
            c.poison(1);
            waiting.join().unwrap()
        })
        .unwrap_err();
        assert!(matches!(err, EngineError::RankFailed { rank: 1 }), "{err}");
        // A later call fails at once until the collective is reset.
        assert!(c.all_gather(0, &[1.0]).is_err());
        c.reset();
        let ok = std::thread::scope(|s| {
            let other = s.spawn(|| c.all_gather(1, &[2.0]));
            let mine = c.all_gather(0, &[1.0]).unwrap();
            (mine, other.join().unwrap().unwrap())
        });
        assert_eq!(ok.0, vec![1.0, 2.0]);
        assert_eq!(ok.1, vec![1.0, 2.0]);
    }
}
