//! [`AttentionScratch`]: the partial states and counters of attention split over several
//! blocks per (token, KV head), and how many splits a launch gets.

use cudarc::driver::CudaSlice;

use super::attention_decode::{decode_cluster_kernel, decode_kernel, decode_smem_bytes};
use super::switches::DecodeCluster;
use super::{cuda_err, CudaDevice};
use crate::error::EngineError;

/// At most this many blocks share one (token, KV head)'s positions.
pub(super) const MAX_SPLITS: usize = 32;

/// At most this many blocks in one cluster of the decode attention's cluster variant (its
/// merge is unrolled to them: FD_MAX_CLUSTER in attention_cluster.cu).
pub(super) const MAX_CLUSTER: usize = 16;

/// How one `attention_decode.cu` launch runs: blocks per (row, KV head), shared-memory
/// stages (1 or 2), and whether those blocks form one thread-block cluster that merges its
/// splits over distributed shared memory (16-bit output, sm_90 and later, splits at most the
/// GPU's largest cluster).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeLaunch {
    pub splits: usize,
    pub stages: usize,
    pub cluster: bool,
}

impl DecodeLaunch {
    /// `splits` blocks per (row, KV head) merging through global memory, with `stages`.
    pub fn plain(splits: usize, stages: usize) -> Self {
        DecodeLaunch {
            splits,
            stages,
            cluster: false,
        }
    }
}

/// Device scratch of the split attention: the partial states and the per-(token, head)
/// counters (zeroed once; the merging block resets its counter).
pub struct AttentionScratch {
    pub(super) part_acc: CudaSlice<f32>,
    pub(super) part_ml: CudaSlice<f32>,
    pub(super) counters: CudaSlice<u32>,
    /// The warpgroup prefill's partial states of cut tiles
    /// ([`super::prefill_schedule::STATE_FLOATS`] a slot) and their counters (zeroed once; the
    /// merging block resets its counter). Prefill steps run eagerly, so growing them leaves
    /// captured graphs valid.
    pub(super) prefill_states: CudaSlice<f32>,
    pub(super) prefill_counts: CudaSlice<i32>,
    sms: usize,
    /// Blocks of `attention_decode.cu` resident at once on the whole GPU (occupancy × SMs)
    /// with one and two shared-memory stages, found on first use.
    decode_slots: [Option<usize>; 2],
    /// Shared-memory stages of `attention_decode.cu` fixed by
    /// [`super::switches::DECODE_STAGES_ENV`] (`None`: chosen per launch).
    decode_stages: Option<usize>,
    /// Splits per (row, KV head) of `attention_decode.cu` fixed by
    /// [`super::switches::DECODE_SPLITS_ENV`] (`None`: chosen per launch).
    decode_splits: Option<usize>,
    /// When the splits of a (row, KV head) run as one cluster
    /// ([`super::switches::DECODE_CLUSTER_ENV`]).
    decode_cluster: DecodeCluster,
    /// The largest cluster of the cluster variant at one and two stages (0: none), found on
    /// first use.
    cluster_max: [Option<usize>; 2],
    /// Bumped when a buffer is reallocated (graphs captured before hold stale addresses).
    pub generation: u64,
    /// The decode launches read an FP8 pool (their shared memory: `decode_smem_bytes`).
    pub fp8_pool: bool,
}

impl AttentionScratch {
    pub fn new(dev: &CudaDevice) -> Result<Self, EngineError> {
        Ok(AttentionScratch {
            part_acc: dev.zeros(1)?,
            part_ml: dev.zeros(1)?,
            counters: dev.zeros(1)?,
            prefill_states: dev.zeros(1)?,
            prefill_counts: dev.zeros(1)?,
            sms: dev.sm_count(),
            decode_slots: [None; 2],
            decode_stages: super::switches::decode_stages()?,
            decode_splits: super::switches::decode_splits()?,
            decode_cluster: super::switches::decode_cluster_from_env()?,
            cluster_max: [None; 2],
            generation: 0,
            fp8_pool: false,
        })
    }

    /// Scratch already sized for every split launch of a model with `group` q heads per KV
    /// head of `head_dim` (splits > 1 only when pairs < 8 × SMs, so pairs × splits < 16 ×
    /// SMs): it never grows, and captured graphs keep valid addresses.
    pub fn for_model(dev: &CudaDevice, group: usize, head_dim: usize) -> Result<Self, EngineError> {
        let mut s = Self::new(dev)?;
        let sms = s.sms;
        s.ensure(dev, 16 * sms * group.max(1), head_dim.max(1), 8 * sms)?;
        s.generation = 0;
        Ok(s)
    }

    /// Blocks per (token, head) for `pairs` (token, KV head) pairs: enough to give every SM
    /// about eight blocks (32 warps), so that decoding a few long sequences keeps enough
    /// loads in flight to use the memory bandwidth. Depends on the pair count only (a captured
    /// graph replays it at any context length).
    pub fn splits_for(&self, pairs: usize) -> usize {
        (8 * self.sms).div_ceil(pairs.max(1)).clamp(1, MAX_SPLITS)
    }

    /// How `attention_decode.cu` serves `pairs` (row, KV head) pairs: its shared-memory stages
    /// (unless [`super::switches::DECODE_STAGES_ENV`] fixes them, one from two pairs per SM
    /// on: enough blocks then share each SM that their loads and math overlap, and one stage
    /// lets twice as many fit; below that, double buffering overlaps them within a block —
    /// measured on an H200, batch 64: 19.4k against 17.5k tok/s, batch 8: 4.9k against 5.0k),
    /// and the splits per pair: the count (≤ 32) whose blocks fill the GPU's resident slots at
    /// those stages in the most even waves, within the scratch [`Self::for_model`] sized; and
    /// whether the splits run as one cluster ([`super::switches::DECODE_CLUSTER_ENV`]).
    /// Depends on the pair count only (graphs stay valid at any context length; a split past
    /// the keys merges as empty).
    pub fn decode_launch(
        &mut self,
        dev: &CudaDevice,
        pairs: usize,
        out: &str,
        group: usize,
        head_dim: usize,
    ) -> Result<DecodeLaunch, EngineError> {
        let plain = self.plain_decode_launch(dev, pairs, out, group, head_dim)?;
        let DecodeLaunch { splits, stages, .. } = plain;
        if self.decode_cluster != DecodeCluster::Off && splits > 1 && out == "bf16" {
            let max = self.cluster_max(dev, stages, group, head_dim)?;
            if let Some(splits) = cluster_splits(self.decode_cluster, splits, max, pairs, self.sms)
            {
                return Ok(DecodeLaunch {
                    splits,
                    stages,
                    cluster: true,
                });
            }
        }
        Ok(plain)
    }

    /// [`Self::decode_launch`] without clusters: the stages and splits alone.
    fn plain_decode_launch(
        &mut self,
        dev: &CudaDevice,
        pairs: usize,
        out: &str,
        group: usize,
        head_dim: usize,
    ) -> Result<DecodeLaunch, EngineError> {
        let stages = self
            .decode_stages
            .unwrap_or(if pairs >= 2 * self.sms { 1 } else { 2 });
        let slot = &mut self.decode_slots[stages - 1];
        let slots = match *slot {
            Some(n) => n,
            None => {
                let f = dev.loaded(&decode_kernel(out, group, head_dim))?;
                let per_sm = f
                    .occupancy_max_active_blocks_per_multiprocessor(
                        128,
                        decode_smem_bytes(head_dim, stages, self.fp8_pool) as usize,
                        None,
                    )
                    .map_err(cuda_err("attention_decode occupancy"))?;
                let n = (per_sm as usize).max(1) * self.sms;
                *slot = Some(n);
                n
            }
        };
        let splits = match self.decode_splits {
            Some(s) => s.min(split_bound(pairs, self.sms)),
            None => decode_splits_for(pairs, slots, self.sms),
        };
        Ok(DecodeLaunch::plain(splits, stages))
    }

    /// The largest cluster of the cluster variant at `stages` (0 where the GPU has none).
    fn cluster_max(
        &mut self,
        dev: &CudaDevice,
        stages: usize,
        group: usize,
        head_dim: usize,
    ) -> Result<usize, EngineError> {
        if let Some(n) = self.cluster_max[stages - 1] {
            return Ok(n);
        }
        let f = dev.loaded(&decode_cluster_kernel("bf16", group, head_dim))?;
        let n = dev.max_cluster_size(
            f,
            128,
            decode_smem_bytes(head_dim, stages, self.fp8_pool),
            MAX_CLUSTER,
        )?;
        self.cluster_max[stages - 1] = Some(n);
        Ok(n)
    }

    /// Room for `states` partial states of `head_dim` and `pairs` counters.
    pub(super) fn ensure(
        &mut self,
        dev: &CudaDevice,
        states: usize,
        head_dim: usize,
        pairs: usize,
    ) -> Result<(), EngineError> {
        if self.part_acc.len() < states * head_dim || self.part_ml.len() < 2 * states {
            self.part_acc = dev.zeros(states * head_dim)?;
            self.part_ml = dev.zeros(2 * states)?;
            self.generation += 1;
        }
        if self.counters.len() < pairs {
            self.counters = dev.zeros(pairs)?;
            self.generation += 1;
        }
        Ok(())
    }
}

impl AttentionScratch {
    /// Room for `slots` partial states of the warpgroup prefill and their counters (grown by
    /// doubling).
    pub(super) fn ensure_prefill(
        &mut self,
        dev: &CudaDevice,
        slots: usize,
    ) -> Result<(), EngineError> {
        let floats = slots * super::prefill_schedule::STATE_FLOATS;
        if self.prefill_states.len() < floats {
            self.prefill_states = dev.zeros(floats.next_power_of_two())?;
        }
        if self.prefill_counts.len() < slots {
            self.prefill_counts = dev.zeros(slots.next_power_of_two())?;
        }
        Ok(())
    }
}

/// See [`AttentionScratch::decode_splits`]: splits of `pairs` over `slots` resident blocks,
/// with at most 16 × `sms` partial states and 8 × `sms` counters (the scratch's size).
/// The most splits `pairs` pairs may take: the scratch of [`AttentionScratch::for_model`]
/// holds 16 × SMs partial states (none from 8 × SMs pairs on, where the GPU is full anyway).
fn split_bound(pairs: usize, sms: usize) -> usize {
    let pairs = pairs.max(1);
    if pairs > 8 * sms {
        1
    } else {
        (16 * sms / pairs).clamp(1, MAX_SPLITS)
    }
}

/// The splits of a clustered launch of `pairs` pairs that would take `splits` unclustered,
/// clusters of at most `max` blocks, on `sms` SMs, or `None` to stay unclustered: `On`
/// clusters any split launch; `Auto` only one with at most a block per SM (there every
/// block's merge is on the critical path; with more, other blocks hide it and the clusters'
/// co-scheduling costs).
fn cluster_splits(
    mode: DecodeCluster,
    splits: usize,
    max: usize,
    pairs: usize,
    sms: usize,
) -> Option<usize> {
    let clustered = splits.min(max);
    let wanted = match mode {
        DecodeCluster::Off => false,
        DecodeCluster::On => true,
        DecodeCluster::Auto => pairs * clustered <= sms,
    };
    (wanted && clustered >= 2).then_some(clustered)
}

fn decode_splits_for(pairs: usize, slots: usize, sms: usize) -> usize {
    let pairs = pairs.max(1);
    let bound = split_bound(pairs, sms);
    let mut best = (1, 0.0f64);
    for s in 1..=bound {
        let waves = (pairs * s) as f64 / slots.max(1) as f64;
        // Below one wave, the share of the GPU filled (a few long sequences want many
        // splits); from one wave on, how even the waves are.
        let score = if waves < 1.0 {
            waves
        } else {
            waves / waves.ceil()
        };
        // A split costs a merge: take more only for clearly (3%) better waves.
        if score > best.1 * 1.03 {
            best = (s, score);
        }
    }
    best.0
}

#[cfg(test)]
mod tests {
    use super::{cluster_splits, decode_splits_for, split_bound, DecodeCluster};

    #[test]
    fn clusters_serve_launches_of_a_block_per_sm_unless_forced() {
        use DecodeCluster::{Auto, Off, On};
        // H200: 132 SMs, clusters of 16. Batch 1 of 8 KV heads: 32 splits become 16.
        assert_eq!(cluster_splits(Auto, 32, 16, 8, 132), Some(16));
        // Batch 2: 256 blocks on 132 SMs stay unclustered unless forced.
        assert_eq!(cluster_splits(Auto, 32, 16, 16, 132), None);
        assert_eq!(cluster_splits(On, 32, 16, 16, 132), Some(16));
        assert_eq!(cluster_splits(On, 3, 16, 512, 132), Some(3));
        assert_eq!(cluster_splits(Off, 32, 16, 8, 132), None);
        // No clusters on the GPU (max 0), or one split: unclustered.
        assert_eq!(cluster_splits(On, 32, 0, 8, 132), None);
        assert_eq!(cluster_splits(On, 1, 16, 8, 132), None);
    }

    #[test]
    fn fixed_splits_stay_within_the_scratch() {
        assert_eq!(split_bound(8, 132), 32);
        assert_eq!(split_bound(8 * 8, 132), 32);
        assert_eq!(split_bound(100, 132), 21);
        assert_eq!(split_bound(8 * 132, 132), 2);
        assert_eq!(split_bound(8 * 132 + 1, 132), 1);
        assert_eq!(split_bound(0, 1), 16);
    }

    #[test]
    fn decode_splits_fill_even_waves_within_the_scratch() {
        // H200: 132 SMs, 3 blocks each.
        let (sms, slots) = (132, 396);
        assert_eq!(decode_splits_for(64 * 8, slots, sms), 3);
        assert_eq!(decode_splits_for(8 * 8, slots, sms), 6);
        assert_eq!(decode_splits_for(8, slots, sms), 32);
        assert_eq!(decode_splits_for(256 * 8, slots, sms), 1);
        // 1,056 pairs: 2.7 waves alone, 5.3 at two splits (no more even); three would pass
        // the scratch's 2,112 states.
        assert_eq!(decode_splits_for(132 * 8, slots, sms), 1);
        assert_eq!(decode_splits_for(1, slots, sms), 32);
        assert_eq!(decode_splits_for(0, 0, 1), 1);
    }
}
