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
/// - `use_beam_search` (vLLM's extra parameter): beam search of width `best_of` (or `n` when
///   `best_of` is unset), returning the `n` best hypotheses, best first. It follows Hugging Face
///   transformers' `generate(num_beams=width, do_sample=False)`: each step keeps the `width`
///   best continuations by cumulative log-probability; a hypothesis ends at EOS (or a stop
///   token id) or at `max_tokens`, scored `sum_logprobs / generated_len ** length_penalty`
///   (the EOS token counted in both). `early_stopping = false` (the default, as in
///   transformers) stops once `width` hypotheses are finished and the best running beam can no
///   longer beat the worst of them at its current length; `true` stops as soon as `width` are
///   finished. Beam search is deterministic: `temperature`, `top_k`, `top_p`, `min_p` and
///   `seed` are ignored; penalties, `min_tokens`, stop strings and `logprobs` are refused.
/// - `best_of` without beam search must equal `n` (sampling `best_of > n` is not
///   implemented and is refused).
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
    pub use_beam_search: bool,
    /// Beam width with `use_beam_search` (None: `n`).
    pub best_of: Option<usize>,
    /// Exponent of the generated length in a finished hypothesis' score (transformers').
    pub length_penalty: f32,
    pub early_stopping: bool,
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
            use_beam_search: false,
            best_of: None,
            length_penalty: 1.0,
            early_stopping: false,
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

    /// The beam width: `best_of` (or `n`) with beam search, else 1.
    pub fn beam_width(&self) -> usize {
        if self.use_beam_search {
            self.best_of.unwrap_or(self.n)
        } else {
            1
        }
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
        finite("length_penalty", self.length_penalty)?;
        if let Some(b) = self.best_of {
            if b < self.n {
                return Err(format!("best_of ({b}) must be >= n ({})", self.n));
            }
            if b != self.n && !self.use_beam_search {
                return Err(
                    "best_of > n is only supported with use_beam_search (sampling best_of is \
                     not implemented)"
                        .into(),
                );
            }
        }
        if self.use_beam_search {
            let refuse = |what: &str| Err(format!("{what} is not supported with use_beam_search"));
            if self.repetition_penalty != 1.0
                || self.presence_penalty != 0.0
                || self.frequency_penalty != 0.0
            {
                return refuse("a repetition, presence or frequency penalty");
            }
            if self.min_tokens > 0 {
                return refuse("min_tokens");
            }
            if !self.stop.is_empty() {
                return refuse("stop");
            }
            if self.logprobs.is_some() {
                return refuse("logprobs");
            }
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
