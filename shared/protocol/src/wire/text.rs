//! Sampling parameters, token logprobs, stop reasons and the stop-string matcher's state.

use crate::wire::{required, to_usize};
use crate::worker as pb;
use crate::WireError;
use tandem_text::{Constraint, SamplingParams, StopMatcher, StopReason, TokenLogprob};

use super::{FromWire, IntoWire, TryFromWire};

impl IntoWire for SamplingParams {
    type Wire = pb::SamplingParams;
    fn into_wire(self) -> pb::SamplingParams {
        let count = |v: usize| v as u64;
        pb::SamplingParams {
            n: count(self.n),
            temperature: self.temperature,
            top_k: count(self.top_k),
            top_p: self.top_p,
            min_p: self.min_p,
            seed: self.seed,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            stop: self.stop,
            stop_token_ids: self.stop_token_ids,
            ignore_eos: self.ignore_eos,
            min_tokens: count(self.min_tokens),
            max_tokens: self.max_tokens.map(count),
            logprobs: self.logprobs.map(count),
            skip_special_tokens: self.skip_special_tokens,
            use_beam_search: self.use_beam_search,
            best_of: self.best_of.map(count),
            length_penalty: self.length_penalty,
            early_stopping: self.early_stopping,
            logit_bias: self
                .logit_bias
                .into_iter()
                .map(|(token, bias)| pb::LogitBias { token, bias })
                .collect(),
            constraint: self.constraint.map(IntoWire::into_wire),
        }
    }
}

impl IntoWire for Constraint {
    type Wire = pb::Constraint;
    fn into_wire(self) -> pb::Constraint {
        use pb::constraint::{Choices, JsonObject, Kind};
        pb::Constraint {
            kind: Some(match self {
                Constraint::JsonObject => Kind::JsonObject(JsonObject {}),
                Constraint::JsonSchema(s) => Kind::JsonSchema(s),
                Constraint::Regex(s) => Kind::Regex(s),
                Constraint::Choice(choices) => Kind::Choice(Choices { choices }),
                Constraint::Lark(s) => Kind::Lark(s),
            }),
        }
    }
}

impl TryFromWire<pb::Constraint> for Constraint {
    fn try_from_wire(c: pb::Constraint) -> Result<Self, WireError> {
        use pb::constraint::Kind;
        Ok(match required(c.kind, "kind")? {
            Kind::JsonObject(_) => Constraint::JsonObject,
            Kind::JsonSchema(s) => Constraint::JsonSchema(s),
            Kind::Regex(s) => Constraint::Regex(s),
            Kind::Choice(c) => Constraint::Choice(c.choices),
            Kind::Lark(s) => Constraint::Lark(s),
        })
    }
}

fn optional_usize(value: Option<u64>, field: &str) -> Result<Option<usize>, WireError> {
    value.map(|v| to_usize(v, field)).transpose()
}

impl TryFromWire<pb::SamplingParams> for SamplingParams {
    fn try_from_wire(p: pb::SamplingParams) -> Result<Self, WireError> {
        Ok(SamplingParams {
            n: to_usize(p.n, "n")?,
            temperature: p.temperature,
            top_k: to_usize(p.top_k, "top_k")?,
            top_p: p.top_p,
            min_p: p.min_p,
            seed: p.seed,
            repetition_penalty: p.repetition_penalty,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            stop: p.stop,
            stop_token_ids: p.stop_token_ids,
            ignore_eos: p.ignore_eos,
            min_tokens: to_usize(p.min_tokens, "min_tokens")?,
            max_tokens: optional_usize(p.max_tokens, "max_tokens")?,
            logprobs: optional_usize(p.logprobs, "logprobs")?,
            skip_special_tokens: p.skip_special_tokens,
            use_beam_search: p.use_beam_search,
            best_of: optional_usize(p.best_of, "best_of")?,
            length_penalty: p.length_penalty,
            early_stopping: p.early_stopping,
            logit_bias: p
                .logit_bias
                .into_iter()
                .map(|b| (b.token, b.bias))
                .collect(),
            constraint: p
                .constraint
                .map(Constraint::try_from_wire)
                .transpose()
                .map_err(|e| e.within("constraint"))?,
        })
    }
}

impl IntoWire for TokenLogprob {
    type Wire = pb::TokenLogprob;
    fn into_wire(self) -> pb::TokenLogprob {
        pb::TokenLogprob {
            token: self.token,
            logprob: self.logprob,
            top: self
                .top
                .into_iter()
                .map(|(token, logprob)| pb::TopLogprob { token, logprob })
                .collect(),
        }
    }
}

impl FromWire<pb::TokenLogprob> for TokenLogprob {
    fn from_wire(lp: pb::TokenLogprob) -> Self {
        TokenLogprob {
            token: lp.token,
            logprob: lp.logprob,
            top: lp.top.into_iter().map(|t| (t.token, t.logprob)).collect(),
        }
    }
}

impl IntoWire for StopReason {
    type Wire = pb::StopReason;
    fn into_wire(self) -> pb::StopReason {
        use pb::stop_reason::Reason;
        pb::StopReason {
            reason: Some(match self {
                StopReason::Eos(token) => Reason::EosToken(token),
                StopReason::TokenId(token) => Reason::StopTokenId(token),
                StopReason::String(stop) => Reason::StopString(stop),
            }),
        }
    }
}

impl TryFromWire<pb::StopReason> for StopReason {
    fn try_from_wire(r: pb::StopReason) -> Result<Self, WireError> {
        use pb::stop_reason::Reason;
        Ok(match required(r.reason, "reason")? {
            Reason::EosToken(token) => StopReason::Eos(token),
            Reason::StopTokenId(token) => StopReason::TokenId(token),
            Reason::StopString(stop) => StopReason::String(stop),
        })
    }
}

impl IntoWire for StopMatcher {
    type Wire = pb::StopMatcherState;
    fn into_wire(self) -> pb::StopMatcherState {
        pb::StopMatcherState {
            stops: self.stops().to_vec(),
            pending: self.pending().to_owned(),
        }
    }
}

impl FromWire<pb::StopMatcherState> for StopMatcher {
    fn from_wire(s: pb::StopMatcherState) -> Self {
        StopMatcher::resume(s.stops, s.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_field_set() -> SamplingParams {
        SamplingParams {
            n: 3,
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.05,
            seed: Some(u64::MAX - 1),
            repetition_penalty: 1.1,
            presence_penalty: -0.5,
            frequency_penalty: 0.25,
            stop: vec!["\n\n".into(), "END".into()],
            stop_token_ids: vec![7, 8],
            ignore_eos: true,
            min_tokens: 2,
            max_tokens: Some(100),
            logprobs: Some(5),
            skip_special_tokens: false,
            use_beam_search: true,
            best_of: Some(4),
            length_penalty: 0.8,
            early_stopping: true,
            logit_bias: vec![(5, -2.5)],
            constraint: Some(Constraint::Choice(vec!["yes".into(), "no".into()])),
        }
    }

    #[test]
    fn sampling_params_round_trip() {
        for params in [
            every_field_set(),
            SamplingParams::default(),
            SamplingParams::greedy(),
            SamplingParams {
                constraint: Some(Constraint::JsonSchema("{}".into())),
                ..SamplingParams::default()
            },
            SamplingParams {
                constraint: Some(Constraint::JsonObject),
                ..SamplingParams::default()
            },
        ] {
            let back = SamplingParams::try_from_wire(params.clone().into_wire());
            assert_eq!(back, Ok(params));
        }
    }

    #[test]
    fn token_logprobs_round_trip() {
        let lp = TokenLogprob {
            token: 42,
            logprob: -0.125,
            top: vec![(42, -0.125), (7, -2.5), (0, -9.0)],
        };
        assert_eq!(TokenLogprob::from_wire(lp.clone().into_wire()), lp);
    }

    #[test]
    fn stop_reasons_round_trip_and_need_their_oneof() {
        for reason in [
            StopReason::Eos(2),
            StopReason::TokenId(13),
            StopReason::String("###".into()),
        ] {
            let back = StopReason::try_from_wire(reason.clone().into_wire());
            assert_eq!(back, Ok(reason));
        }
        assert_eq!(
            StopReason::try_from_wire(pb::StopReason { reason: None }),
            Err(WireError::missing("reason"))
        );
    }

    #[test]
    fn a_stop_matcher_resumes_holding_the_same_text() {
        let mut m = StopMatcher::new(&["STOP".to_string(), String::new()]);
        assert_eq!(m.feed("abc ST").emit, "abc ");
        let mut back = StopMatcher::from_wire(m.clone().into_wire());
        assert_eq!(back, m);
        assert_eq!(back.pending(), "ST");
        assert_eq!(back.feed("OP").matched.as_deref(), Some("STOP"));
    }
}
