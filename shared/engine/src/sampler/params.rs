//! Per-request sampling parameters (OpenAI / vLLM names and meanings).

use serde::{Deserialize, Serialize};

/// How a request's tokens are chosen and when it stops.
///
/// Semantics follow vLLM (which follows OpenAI where OpenAI defines them):
/// - `temperature == 0` is greedy (argmax, ties to the lowest token id).
/// - `top_k == 0` and `top_p == 1` and `min_p == 0` turn those filters off.
/// - `repetition_penalty` (vLLM/CTRL style, 1 = off) applies to every token seen in the prompt
///   or the output: a positive logit is divided by it, a negative one multiplied.
/// - `frequency_penalty` and `presence_penalty` (OpenAI style, 0 = off) apply to output tokens
///   only: `logit -= frequency_penalty * count + presence_penalty * (count > 0)`.
/// - `min_tokens`: EOS and `stop_token_ids` are masked, and stop strings ignored, until that
///   many tokens were generated.
/// - `max_tokens`: None means up to the engine's `max_seq_len` (or as many tokens as its whole
///   KV pool holds, if fewer).
/// - `n`: independent choices; choice `i` draws from its own stream seeded from `(seed, i)`.
/// - `logprobs`: `Some(k)` returns the chosen token's log-probability and the `k` most likely
///   alternatives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    pub n: usize,
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: Option<u64>,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub min_tokens: usize,
    pub max_tokens: Option<usize>,
    pub logprobs: Option<usize>,
    /// Leave special tokens out of the decoded text.
    pub skip_special_tokens: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            n: 1,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            min_tokens: 0,
            max_tokens: None,
            logprobs: None,
            skip_special_tokens: true,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Greedy when the temperature is (practically) zero: below 1e-5, dividing the logits by
    /// it could overflow to infinity, and the distribution is one-hot anyway.
    pub fn is_greedy(&self) -> bool {
        self.temperature < 1e-5 || self.top_k == 1
    }

    /// Checks ranges; returns a message naming the offending field.
    pub fn validate(&self) -> Result<(), String> {
        let finite = |name: &str, v: f32| {
            if v.is_finite() {
                Ok(())
            } else {
                Err(format!("{name} must be finite"))
            }
        };
        finite("temperature", self.temperature)?;
        finite("top_p", self.top_p)?;
        finite("min_p", self.min_p)?;
        finite("repetition_penalty", self.repetition_penalty)?;
        finite("presence_penalty", self.presence_penalty)?;
        finite("frequency_penalty", self.frequency_penalty)?;
        if self.n == 0 {
            return Err("n must be at least 1".into());
        }
        if self.temperature < 0.0 {
            return Err("temperature must be >= 0".into());
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err("top_p must be in (0, 1]".into());
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err("min_p must be in [0, 1]".into());
        }
        if self.repetition_penalty <= 0.0 {
            return Err("repetition_penalty must be > 0".into());
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return Err("presence_penalty must be in [-2, 2]".into());
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return Err("frequency_penalty must be in [-2, 2]".into());
        }
        if let Some(m) = self.max_tokens {
            if m == 0 {
                return Err("max_tokens must be at least 1".into());
            }
            if self.min_tokens > m {
                return Err("min_tokens must not exceed max_tokens".into());
            }
        }
        Ok(())
    }
}
