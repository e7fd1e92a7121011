//! The tiny models' weight values: per tensor, a splitmix64 stream seeded from the model's
//! seed and the tensor's name, turned into normals by Box-Muller. Fixed forever: every
//! tiny-model golden depends on these exact values.

use tandem_rng::SplitMix64;

/// Standard normals from a splitmix64 stream.
struct Normals(SplitMix64);

impl Normals {
    /// Uniform in (0, 1]: 53 random bits, never 0 (Box-Muller takes its log).
    fn next_unit(&mut self) -> f64 {
        ((self.0.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Standard normal by Box-Muller (one of the pair; simple beats fast here).
    fn next_normal(&mut self) -> f64 {
        let u1 = self.next_unit();
        let u2 = self.next_unit();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// FNV-1a 64 of a tensor name: each tensor gets its own stream, independent of order.
fn fnv1a(s: &str) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in s.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Deterministic values for a named tensor: `mean + std * N(0, 1)`.
pub fn random_tensor(seed: u64, name: &str, n: usize, mean: f32, std: f32) -> Vec<f32> {
    let mut rng = Normals(SplitMix64::new(seed ^ fnv1a(name)));
    (0..n)
        .map(|_| mean + std * rng.next_normal() as f32)
        .collect()
}

/// Mean and std of a Qwen3 tensor in a random model: norms near 1 (so that wrong norm
/// handling shows), projections 1/sqrt(fan_in) (activations stay O(1) through the layers),
/// embeddings N(0, 0.1²). Small embeddings keep the token's own embedding from dominating the
/// residual stream: with N(0, 1) the tied lm_head made greedy decoding repeat the last token
/// forever, which checks little. At 0.1 the greedy continuations vary and the top-2 logit
/// margins stay > 1% of the logits' std, far above f32 noise.
pub fn random_init(name: &str, shape: &[usize]) -> (f32, f32) {
    if name.ends_with("norm.weight") {
        (1.0, 0.1)
    } else if name.ends_with(".bias") {
        // Large enough to matter against the O(1) projections (Qwen2's k biases are large).
        (0.0, 0.3)
    } else if name.contains("embed_tokens") || name.starts_with("lm_head") {
        (0.0, 0.1)
    } else {
        let fan_in = shape.last().copied().unwrap_or(1).max(1);
        (0.0, 1.0 / (fan_in as f32).sqrt())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TINY_SEED;

    #[test]
    fn values_are_pinned() {
        // Fixed outputs: if these change, every tiny-model golden changes with them.
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(r.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        let v = random_tensor(TINY_SEED, "x", 20000, 0.0, 1.0);
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / v.len() as f32;
        assert!(
            mean.abs() < 0.03 && (var - 1.0).abs() < 0.05,
            "{mean} {var}"
        );
        assert_eq!(v, random_tensor(TINY_SEED, "x", 20000, 0.0, 1.0));
        assert_ne!(v[..8], random_tensor(TINY_SEED, "y", 8, 0.0, 1.0)[..]);
    }
}
