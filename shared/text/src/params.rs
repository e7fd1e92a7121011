//! Per-request sampling parameters (OpenAI / vLLM names and meanings).

use serde::{Deserialize, Serialize};

use crate::limits;
use crate::{Constraint, ConstraintError};

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
/// - `logit_bias`: `(token id, bias)` pairs added to the raw logits before the penalties
///   (OpenAI's, bias in [-100, 100]).
/// - `constraint`: structured output; every step's logits are masked to the tokens that keep
///   the output inside the grammar, and the choice ends (`stop`) when the grammar is complete.
///   Not with beam search, `ignore_eos` or `min_tokens`.
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
    pub logit_bias: Vec<(u32, f32)>,
    pub constraint: Option<Constraint>,
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
            logit_bias: Vec::new(),
            constraint: None,
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

    /// Checks ranges and the caps of [`crate::limits`]; the error names the offending field.
    pub fn validate(&self) -> Result<(), ParamsError> {
        self.validate_floats()?;
        self.validate_counts()?;
        if let Some(b) = self.best_of {
            if b < self.n {
                return Err(ParamsError::BestOfBelowN {
                    best_of: b,
                    n: self.n,
                });
            }
            if b != self.n && !self.use_beam_search {
                return Err(ParamsError::BestOfWithoutBeamSearch);
            }
        }
        if self.use_beam_search {
            self.validate_beam_search()?;
        }
        self.validate_constraint()?;
        if let Some(m) = self.max_tokens {
            if m == 0 {
                return Err(range("max_tokens", "at least 1".into()));
            }
            if self.min_tokens > m {
                return Err(ParamsError::MinTokensOverMax);
            }
        }
        Ok(())
    }

    /// The float parameters: finite and in range.
    fn validate_floats(&self) -> Result<(), ParamsError> {
        for (field, v) in [
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("min_p", self.min_p),
            ("repetition_penalty", self.repetition_penalty),
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
            ("length_penalty", self.length_penalty),
        ] {
            if !v.is_finite() {
                return Err(ParamsError::NotFinite { field });
            }
        }
        if self.temperature < 0.0 {
            return Err(range("temperature", ">= 0".into()));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(range("top_p", "in (0, 1]".into()));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(range("min_p", "in [0, 1]".into()));
        }
        if self.repetition_penalty <= 0.0 {
            return Err(range("repetition_penalty", "> 0".into()));
        }
        for (field, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(range(field, "in [-2, 2]".into()));
            }
        }
        Ok(())
    }

    /// The sizes a client controls: `n`, `best_of`, `logprobs`, the stop strings and stop
    /// token ids, against [`crate::limits`].
    fn validate_counts(&self) -> Result<(), ParamsError> {
        let between = |field, v: usize, max: usize| {
            if (1..=max).contains(&v) {
                Ok(())
            } else {
                Err(range(field, format!("between 1 and {max}")))
            }
        };
        between("n", self.n, limits::MAX_N)?;
        if let Some(b) = self.best_of {
            between("best_of", b, limits::MAX_N)?;
        }
        if self.logprobs.is_some_and(|k| k > limits::MAX_LOGPROBS) {
            let max = limits::MAX_LOGPROBS;
            return Err(range("logprobs", format!("between 0 and {max}")));
        }
        too_many("stop", self.stop.len(), limits::MAX_STOP_STRINGS)?;
        too_many(
            "stop_token_ids",
            self.stop_token_ids.len(),
            limits::MAX_STOP_TOKEN_IDS,
        )?;
        let max = limits::MAX_STOP_STRING_BYTES;
        too_many("logit_bias", self.logit_bias.len(), limits::MAX_LOGIT_BIAS)?;
        let bound = limits::MAX_LOGIT_BIAS_VALUE;
        if let Some((token, _)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !b.is_finite() || b.abs() > bound)
        {
            return Err(ParamsError::LogitBiasOutOfRange { token: *token });
        }
        match self.stop.iter().position(|s| s.len() > max) {
            Some(index) => Err(ParamsError::StopStringTooLong {
                index,
                got: self.stop[index].len(),
                max,
            }),
            None => Ok(()),
        }
    }

    /// The constraint's size, and what it cannot be combined with.
    fn validate_constraint(&self) -> Result<(), ParamsError> {
        let Some(c) = &self.constraint else {
            return Ok(());
        };
        c.validate().map_err(ParamsError::Constraint)?;
        let refused = [
            ("use_beam_search", self.use_beam_search),
            ("ignore_eos", self.ignore_eos),
            ("min_tokens", self.min_tokens > 0),
        ];
        match refused.into_iter().find(|(_, set)| *set) {
            Some((field, _)) => Err(ParamsError::NotWithConstraint { field }),
            None => Ok(()),
        }
    }

    /// What beam search refuses.
    fn validate_beam_search(&self) -> Result<(), ParamsError> {
        let refused = [
            ("repetition_penalty", self.repetition_penalty != 1.0),
            ("presence_penalty", self.presence_penalty != 0.0),
            ("frequency_penalty", self.frequency_penalty != 0.0),
            ("min_tokens", self.min_tokens > 0),
            ("stop", !self.stop.is_empty()),
            ("logprobs", self.logprobs.is_some()),
        ];
        match refused.into_iter().find(|(_, set)| *set) {
            Some((field, _)) => Err(ParamsError::NotWithBeamSearch { field }),
            None => Ok(()),
        }
    }
}

/// Why [`SamplingParams::validate`] refused parameters. Every variant names its field
/// ([`ParamsError::field`]); the message is the one a client sees.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ParamsError {
    #[error("{field} must be finite")]
    NotFinite { field: &'static str },
    /// A value outside its range; `range` says which, e.g. `in (0, 1]`.
    #[error("{field} must be {range}")]
    OutOfRange { field: &'static str, range: String },
    /// A list longer than its cap in [`crate::limits`].
    #[error("{field} has {got} entries; at most {max} are allowed")]
    TooMany {
        field: &'static str,
        got: usize,
        max: usize,
    },
    #[error("stop[{index}] is {got} bytes long; at most {max} are allowed")]
    StopStringTooLong {
        index: usize,
        got: usize,
        max: usize,
    },
    #[error("{field} is not supported with use_beam_search")]
    NotWithBeamSearch { field: &'static str },
    #[error("best_of ({best_of}) must be >= n ({n})")]
    BestOfBelowN { best_of: usize, n: usize },
    #[error(
        "best_of > n is only supported with use_beam_search (sampling best_of is not implemented)"
    )]
    BestOfWithoutBeamSearch,
    #[error("min_tokens must not exceed max_tokens")]
    MinTokensOverMax,
    #[error("logit_bias of token {token} must be in [-100, 100]")]
    LogitBiasOutOfRange { token: u32 },
    #[error("{0}")]
    Constraint(ConstraintError),
    #[error("{field} is not supported with a structured-output constraint")]
    NotWithConstraint { field: &'static str },
}

impl ParamsError {
    /// The parameter at fault.
    pub fn field(&self) -> &'static str {
        match self {
            ParamsError::NotFinite { field }
            | ParamsError::OutOfRange { field, .. }
            | ParamsError::TooMany { field, .. }
            | ParamsError::NotWithBeamSearch { field }
            | ParamsError::NotWithConstraint { field } => field,
            ParamsError::LogitBiasOutOfRange { .. } => "logit_bias",
            ParamsError::Constraint(_) => "response_format",
            ParamsError::StopStringTooLong { .. } => "stop",
            ParamsError::BestOfBelowN { .. } | ParamsError::BestOfWithoutBeamSearch => "best_of",
            ParamsError::MinTokensOverMax => "min_tokens",
        }
    }
}

/// The message, for callers that report text.
impl From<ParamsError> for String {
    fn from(e: ParamsError) -> String {
        e.to_string()
    }
}

fn range(field: &'static str, range: String) -> ParamsError {
    ParamsError::OutOfRange { field, range }
}

fn too_many(field: &'static str, got: usize, max: usize) -> Result<(), ParamsError> {
    if got > max {
        Err(ParamsError::TooMany { field, got, max })
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::*;

    fn err(p: SamplingParams) -> ParamsError {
        p.validate().expect_err("refused")
    }

    #[test]
    fn defaults_and_the_caps_themselves_pass() {
        SamplingParams::default().validate().expect("defaults");
        let p = SamplingParams {
            n: MAX_N,
            logprobs: Some(MAX_LOGPROBS),
            stop: vec!["x".repeat(MAX_STOP_STRING_BYTES); MAX_STOP_STRINGS],
            stop_token_ids: vec![7; MAX_STOP_TOKEN_IDS],
            ..SamplingParams::default()
        };
        p.validate().expect("at the caps");
    }

    #[test]
    fn logit_bias_and_constraints_are_checked() {
        let bias = |b: f32| SamplingParams {
            logit_bias: vec![(3, 1.0), (7, b)],
            ..SamplingParams::default()
        };
        bias(-100.0).validate().expect("in range");
        for b in [100.5, f32::NAN, f32::NEG_INFINITY] {
            assert_eq!(err(bias(b)), ParamsError::LogitBiasOutOfRange { token: 7 });
        }
        let too_many = SamplingParams {
            logit_bias: vec![(1, 0.0); MAX_LOGIT_BIAS + 1],
            ..SamplingParams::default()
        };
        assert_eq!(err(too_many).field(), "logit_bias");
        let c = |p: SamplingParams| SamplingParams {
            constraint: Some(Constraint::JsonObject),
            ..p
        };
        c(SamplingParams::default()).validate().expect("plain");
        for (p, field) in [
            (
                SamplingParams {
                    ignore_eos: true,
                    ..SamplingParams::default()
                },
                "ignore_eos",
            ),
            (
                SamplingParams {
                    min_tokens: 2,
                    ..SamplingParams::default()
                },
                "min_tokens",
            ),
        ] {
            assert_eq!(err(c(p)), ParamsError::NotWithConstraint { field });
        }
        let empty = SamplingParams {
            constraint: Some(Constraint::Choice(vec![])),
            ..SamplingParams::default()
        };
        assert_eq!(err(empty).field(), "response_format");
    }

    #[test]
    fn n_and_best_of_are_bounded() {
        for n in [0, MAX_N + 1, usize::MAX] {
            let e = err(SamplingParams {
                n,
                ..SamplingParams::default()
            });
            assert_eq!(e.field(), "n", "{e}");
        }
        let e = err(SamplingParams {
            best_of: Some(usize::MAX),
            use_beam_search: true,
            ..SamplingParams::default()
        });
        assert_eq!(e.field(), "best_of", "{e}");
    }

    #[test]
    fn lists_over_their_caps_name_the_field() {
        let e = err(SamplingParams {
            stop: vec!["a".into(); MAX_STOP_STRINGS + 1],
            ..SamplingParams::default()
        });
        assert!(
            matches!(e, ParamsError::TooMany { field: "stop", .. }),
            "{e}"
        );
        let e = err(SamplingParams {
            stop: vec!["ok".into(), "y".repeat(MAX_STOP_STRING_BYTES + 1)],
            ..SamplingParams::default()
        });
        assert!(
            matches!(e, ParamsError::StopStringTooLong { index: 1, .. }),
            "{e}"
        );
        let e = err(SamplingParams {
            stop_token_ids: vec![1; MAX_STOP_TOKEN_IDS + 1],
            ..SamplingParams::default()
        });
        assert_eq!(e.field(), "stop_token_ids", "{e}");
        let e = err(SamplingParams {
            logprobs: Some(MAX_LOGPROBS + 1),
            ..SamplingParams::default()
        });
        assert_eq!(e.field(), "logprobs", "{e}");
    }

    #[test]
    fn ranges_and_beam_search_refusals_keep_their_messages() {
        let e = err(SamplingParams {
            top_p: 0.0,
            ..SamplingParams::default()
        });
        assert_eq!(e.to_string(), "top_p must be in (0, 1]");
        let e = err(SamplingParams {
            temperature: f32::NAN,
            ..SamplingParams::default()
        });
        assert_eq!(
            e,
            ParamsError::NotFinite {
                field: "temperature"
            }
        );
        let e = err(SamplingParams {
            use_beam_search: true,
            logprobs: Some(1),
            ..SamplingParams::default()
        });
        assert_eq!(
            e.to_string(),
            "logprobs is not supported with use_beam_search"
        );
        let e = err(SamplingParams {
            max_tokens: Some(2),
            min_tokens: 3,
            ..SamplingParams::default()
        });
        assert_eq!(e.field(), "min_tokens");
    }
}
