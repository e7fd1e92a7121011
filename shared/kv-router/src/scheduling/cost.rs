//! The KV router's cost function (Dynamo's) and the two ways of turning costs into a choice.
//!
//! `logit(w) = overlap_weight × potential_prefill_blocks(w) + potential_decode_blocks(w)`, where
//! prefill blocks are the tokens the worker would still have to prefill (already queued plus
//! this prompt minus its cached prefix) divided by the block size, and decode blocks are the
//! blocks its active requests hold plus this request's blocks it does not already hold. Lower is
//! better: the weight trades time-to-first-token (cache hits) against decode load (ITL).

use super::rng::SplitMix64;

/// Inputs of one worker's cost.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CostInputs {
    pub overlap_blocks: u32,
    pub isl_tokens: usize,
    pub block_size: u32,
    /// Prefill tokens already routed there and not yet computed (0 when not tracked).
    pub active_prefill_tokens: u64,
    /// Blocks held by active requests there (0 when not tracked).
    pub active_decode_blocks: usize,
    /// Blocks of this request not already active there.
    pub new_blocks: usize,
}

impl CostInputs {
    /// Prompt tokens the worker already holds.
    pub fn cached_tokens(&self) -> usize {
        (self.overlap_blocks as usize)
            .saturating_mul(self.block_size as usize)
            .min(self.isl_tokens)
    }

    /// Prompt tokens the worker would have to compute.
    pub fn new_prefill_tokens(&self) -> usize {
        self.isl_tokens - self.cached_tokens()
    }
}

/// The cost of sending the request to a worker (lower is better).
pub fn logit(overlap_weight: f64, c: &CostInputs) -> f64 {
    let prefill_tokens = c.active_prefill_tokens as f64 + c.new_prefill_tokens() as f64;
    let prefill_blocks = prefill_tokens / f64::from(c.block_size.max(1));
    let decode_blocks = (c.active_decode_blocks + c.new_blocks) as f64;
    overlap_weight * prefill_blocks + decode_blocks
}

fn same(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

/// Index of the lowest logit. Ties go to the smaller `tree_sizes` entry (less cached state, so
/// cache spreads out), then to a uniformly random one of the remaining.
pub fn argmin(logits: &[f64], tree_sizes: &[usize], rng: &mut SplitMix64) -> Option<usize> {
    let best = logits.iter().copied().fold(f64::INFINITY, f64::min);
    let ties: Vec<usize> = (0..logits.len())
        .filter(|&i| same(logits[i], best))
        .collect();
    let smallest = ties
        .iter()
        .map(|&i| tree_sizes.get(i).copied().unwrap_or(0))
        .min()?;
    let ties: Vec<usize> = ties
        .into_iter()
        .filter(|&i| tree_sizes.get(i).copied().unwrap_or(0) == smallest)
        .collect();
    match ties.len() {
        0 => None,
        1 => Some(ties[0]),
        n => Some(ties[rng.below(n as u64) as usize]),
    }
}

/// Softmax sampling over negated logits: they are first scaled by their range (so the
/// temperature means the same whatever the magnitude of the costs), then
/// `p(i) ∝ exp(-(logit_i - min) / range / temperature)`. Equal logits sample uniformly.
/// Subtracting the minimum changes nothing in the distribution and keeps `exp` from
/// underflowing.
pub fn softmax_sample(logits: &[f64], temperature: f64, rng: &mut SplitMix64) -> Option<usize> {
    if logits.is_empty() {
        return None;
    }
    let weights = softmax_weights(logits, temperature);
    let total: f64 = weights.iter().sum();
    let mut x = rng.next_f64() * total;
    for (i, w) in weights.iter().enumerate() {
        if x < *w {
            return Some(i);
        }
        x -= w;
    }
    Some(logits.len() - 1)
}

/// Unnormalised sampling weights of [`softmax_sample`].
pub fn softmax_weights(logits: &[f64], temperature: f64) -> Vec<f64> {
    let min = logits.iter().copied().fold(f64::INFINITY, f64::min);
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let range = max - min;
    // Written positively so that NaN falls through to uniform as well.
    if range.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
        || temperature.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
    {
        return vec![1.0; logits.len()];
    }
    logits
        .iter()
        .map(|&v| (-((v - min) / range) / temperature).exp())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cost_on_a_hand_computed_example() {
        // 100-token prompt, block size 16 (6 full blocks + a partial), 4 blocks cached (64
        // tokens) → 36 new tokens; 32 tokens already queued → 68 / 16 = 4.25 prefill blocks.
        // 10 active blocks + 3 new → 13 decode blocks. Weight 1: 17.25; weight 2: 21.5.
        let c = CostInputs {
            overlap_blocks: 4,
            isl_tokens: 100,
            block_size: 16,
            active_prefill_tokens: 32,
            active_decode_blocks: 10,
            new_blocks: 3,
        };
        assert_eq!(c.cached_tokens(), 64);
        assert_eq!(c.new_prefill_tokens(), 36);
        assert_eq!(logit(1.0, &c), 17.25);
        assert_eq!(logit(2.0, &c), 21.5);
        assert_eq!(logit(0.0, &c), 13.0);
        // Overlap can't exceed the prompt (a cached partial tail is not double counted).
        let full = CostInputs {
            overlap_blocks: 10,
            isl_tokens: 100,
            ..c
        };
        assert_eq!(full.new_prefill_tokens(), 0);
    }

    #[test]
    fn argmin_breaks_ties_on_tree_size_then_randomly() {
        let mut rng = SplitMix64::new(1);
        assert_eq!(argmin(&[3.0, 1.0, 2.0], &[0, 0, 0], &mut rng), Some(1));
        assert_eq!(argmin(&[1.0, 1.0, 2.0], &[50, 10, 0], &mut rng), Some(1));
        let mut seen = [0u32; 3];
        for _ in 0..300 {
            seen[argmin(&[1.0, 1.0, 1.0], &[5, 5, 9], &mut rng).unwrap()] += 1;
        }
        assert_eq!(seen[2], 0);
        assert!(seen[0] > 100 && seen[1] > 100, "{seen:?}");
        assert_eq!(argmin(&[], &[], &mut rng), None);
    }

    #[test]
    fn softmax_sampling_statistics_with_a_fixed_seed() {
        // Logits [0, 10], T = 1: normalised [0, 1], p0 = 1 / (1 + e^-1) ≈ 0.7311.
        let mut rng = SplitMix64::new(2024);
        let n = 40_000;
        let hits = (0..n)
            .filter(|_| softmax_sample(&[0.0, 10.0], 1.0, &mut rng) == Some(0))
            .count();
        let p = hits as f64 / n as f64;
        assert!((p - 0.7311).abs() < 0.01, "p0 = {p}");
        // Three workers, T = 0.5: weights 1, e^-1, e^-2 for normalised 0, 0.5, 1.
        let w = softmax_weights(&[2.0, 4.0, 6.0], 0.5);
        assert!((w[1] - (-1f64).exp()).abs() < 1e-12 && (w[2] - (-2f64).exp()).abs() < 1e-12);
        let mut counts = [0usize; 3];
        for _ in 0..n {
            counts[softmax_sample(&[2.0, 4.0, 6.0], 0.5, &mut rng).unwrap()] += 1;
        }
        let z: f64 = w.iter().sum();
        for i in 0..3 {
            let p = counts[i] as f64 / n as f64;
            assert!(
                (p - w[i] / z).abs() < 0.01,
                "worker {i}: {p} vs {}",
                w[i] / z
            );
        }
        // Equal logits sample uniformly; very high temperature approaches uniform too.
        assert_eq!(softmax_weights(&[3.0, 3.0], 1.0), vec![1.0, 1.0]);
        let hot = softmax_weights(&[0.0, 1.0], 1e6);
        assert!((hot[1] - 1.0).abs() < 1e-5);
    }
}
