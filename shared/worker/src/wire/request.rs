//! Requests, their outputs, and the state of a prefilled request handed to a decode worker.

use tandem_engine::kv::hash::CacheSalt;
use tandem_engine::request::{
    FinishReason, MediaSpan, Request, RequestOutput, SequenceState, Usage,
};
use tandem_engine::sampler::{Rng, SamplerState, StopMatcher};
use tandem_protocol::wire::{required, to_usize, TryFromWire};
use tandem_protocol::worker as pb;
use tandem_protocol::WireError;

use super::{engine_sub, sub, EngineIntoWire, EngineTryFromWire, FromWire, IntoWire};

impl EngineTryFromWire<pb::GenerateRequest> for Request {
    fn try_from_wire(r: pb::GenerateRequest) -> Result<Self, WireError> {
        Ok(Request {
            request_id: r.request_id,
            prompt: r.prompt,
            params: sub(r.sampling_params, "sampling_params")?,
            cache_salt: r.cache_salt.map(CacheSalt),
            replayed: to_usize(r.replayed_tokens.into(), "replayed_tokens")?,
            // Images become embeddings only where a vision tower runs (see `media.rs`),
            // which takes them out of the message before this conversion.
            media: match r.media.is_empty() {
                true => Vec::new(),
                false => {
                    return Err(WireError::Unsupported {
                        field: "media".into(),
                        reason: "images are served only by Generate on a worker whose model \
                                 takes images (not by disaggregated prefill yet)",
                    })
                }
            },
        })
    }
}

/// The finish reason on the wire.
pub fn finish_reason(reason: FinishReason) -> pb::FinishReason {
    match reason {
        FinishReason::Stop => pb::FinishReason::Stop,
        FinishReason::Length => pb::FinishReason::Length,
        FinishReason::Abort => pb::FinishReason::Abort,
        FinishReason::Migrated => pb::FinishReason::Migrated,
    }
}

impl EngineIntoWire for Usage {
    type Wire = pb::Usage;
    fn into_wire(self) -> pb::Usage {
        pb::Usage {
            prompt_tokens: self.prompt_tokens as u32,
            completion_tokens: self.completion_tokens as u32,
            cached_tokens: self.cached_tokens as u32,
        }
    }
}

/// An engine output as streamed to the caller (its request id is the call's; a beam's score
/// is not sent).
impl EngineIntoWire for RequestOutput {
    type Wire = pb::GenerateOutput;
    fn into_wire(self) -> pb::GenerateOutput {
        pb::GenerateOutput {
            index: self.index as u32,
            token_ids: self.token_ids,
            text: self.text,
            logprobs: self.logprobs.into_iter().map(IntoWire::into_wire).collect(),
            finish_reason: self
                .finish_reason
                .map_or(pb::FinishReason::Unspecified, finish_reason)
                .into(),
            stop_reason: self.stop_reason.map(IntoWire::into_wire),
            usage: self.usage.map(EngineIntoWire::into_wire),
            error: self.error.unwrap_or_default(),
        }
    }
}

impl EngineIntoWire for SamplerState {
    type Wire = pb::SamplerState;
    fn into_wire(self) -> pb::SamplerState {
        let [s0, s1, s2, s3] = self.rng.state();
        pb::SamplerState {
            rng: Some(pb::RngState { s0, s1, s2, s3 }),
            output_counts: self.output_counts.into_iter().collect(),
            replayed: self.replayed as u64,
        }
    }
}

impl EngineTryFromWire<pb::SamplerState> for SamplerState {
    fn try_from_wire(s: pb::SamplerState) -> Result<Self, WireError> {
        let rng = required(s.rng, "rng")?;
        Ok(SamplerState::from_parts(
            Rng::from_state([rng.s0, rng.s1, rng.s2, rng.s3]),
            s.output_counts.into_iter().collect(),
            to_usize(s.replayed, "sampler.replayed")?,
        ))
    }
}

impl EngineIntoWire for SequenceState {
    type Wire = pb::SequenceState;
    fn into_wire(self) -> pb::SequenceState {
        let count = |v: usize| v as u64;
        pb::SequenceState {
            request_id: self.request_id,
            index: count(self.index),
            params: Some(self.params.into_wire()),
            tokens: self.tokens,
            prompt_len: count(self.prompt_len),
            max_tokens: count(self.max_tokens),
            num_computed: count(self.num_computed),
            cached_prompt_tokens: count(self.cached_prompt_tokens),
            sampler: Some(self.sampler.into_wire()),
            stop: Some(self.stop.into_wire()),
            cache_salt: self.cache_salt.map(|s| s.0),
            media: self.media.into_iter().map(IntoWire::into_wire).collect(),
        }
    }
}

impl EngineTryFromWire<pb::SequenceState> for SequenceState {
    fn try_from_wire(s: pb::SequenceState) -> Result<Self, WireError> {
        Ok(SequenceState {
            request_id: s.request_id,
            index: to_usize(s.index, "index")?,
            params: sub(s.params, "params")?,
            tokens: s.tokens,
            prompt_len: to_usize(s.prompt_len, "prompt_len")?,
            max_tokens: to_usize(s.max_tokens, "max_tokens")?,
            num_computed: to_usize(s.num_computed, "num_computed")?,
            cached_prompt_tokens: to_usize(s.cached_prompt_tokens, "cached_prompt_tokens")?,
            sampler: engine_sub(s.sampler, "sampler")?,
            stop: StopMatcher::from_wire(required(s.stop, "stop")?),
            cache_salt: s.cache_salt.map(CacheSalt),
            media: s
                .media
                .into_iter()
                .enumerate()
                .map(|(i, m)| {
                    MediaSpan::try_from_wire(m).map_err(|e| e.within(&format!("media[{i}]")))
                })
                .collect::<Result<_, _>>()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_engine::request::StopReason;
    use tandem_engine::sampler::{SamplingParams, TokenLogprob};
    use tandem_protocol::wire::TryFromWire;

    fn state() -> SequenceState {
        let mut sampler = SamplerState::new(1234, 1);
        sampler.rng.next_u64();
        sampler.record(5);
        sampler.record(5);
        sampler.record(9);
        let mut stop = StopMatcher::new(&["</s>".to_string()]);
        stop.feed("hello </");
        SequenceState {
            request_id: "r-1".into(),
            index: 1,
            params: SamplingParams {
                seed: Some(1234),
                stop: vec!["</s>".into()],
                max_tokens: Some(20),
                ..SamplingParams::default()
            },
            tokens: vec![1, 2, 3, 5, 5, 9],
            prompt_len: 3,
            max_tokens: 20,
            num_computed: 5,
            cached_prompt_tokens: 2,
            sampler,
            stop,
            cache_salt: Some(CacheSalt(42)),
            media: Default::default(),
        }
    }

    #[test]
    fn sequence_state_round_trips_with_its_sampler_and_stop_state() {
        let s = state();
        assert_eq!(s.stop.pending(), "</");
        assert_eq!(SequenceState::try_from_wire(s.clone().into_wire()), Ok(s));
    }

    #[test]
    fn missing_sub_messages_are_named_by_their_path() {
        let mut wire = state().into_wire();
        if let Some(sampler) = wire.sampler.as_mut() {
            sampler.rng = None;
        }
        assert_eq!(
            SequenceState::try_from_wire(wire),
            Err(WireError::missing("sampler.rng"))
        );
        let mut wire = state().into_wire();
        wire.params = None;
        assert_eq!(
            SequenceState::try_from_wire(wire),
            Err(WireError::missing("params"))
        );
        let mut wire = state().into_wire();
        wire.stop = None;
        assert_eq!(
            SequenceState::try_from_wire(wire),
            Err(WireError::missing("stop"))
        );
    }

    #[test]
    fn a_generate_request_needs_its_sampling_params() {
        let request = Request {
            replayed: 0,
            request_id: "r".into(),
            prompt: vec![1, 2],
            params: SamplingParams::greedy(),
            cache_salt: Some(CacheSalt(0xfeed)),
            media: Default::default(),
        };
        let wire = pb::GenerateRequest {
            replayed_tokens: 0,
            request_id: request.request_id.clone(),
            prompt: request.prompt.clone(),
            sampling_params: Some(request.params.clone().into_wire()),
            cache_salt: Some(0xfeed),
            media: Default::default(),
        };
        assert_eq!(Request::try_from_wire(wire.clone()), Ok(request));
        let bare = pb::GenerateRequest {
            sampling_params: None,
            ..wire
        };
        let e = Request::try_from_wire(bare).expect_err("no params");
        assert_eq!(e, WireError::missing("sampling_params"));
        assert_eq!(tonic::Status::from(e).code(), tonic::Code::InvalidArgument);
    }

    #[test]
    fn outputs_carry_logprobs_stop_reason_and_usage() {
        let lp = TokenLogprob {
            token: 9,
            logprob: -0.5,
            top: vec![(9, -0.5), (3, -1.5)],
        };
        let out = RequestOutput {
            request_id: "r".into(),
            index: 2,
            token_ids: vec![9],
            text: "x".into(),
            logprobs: vec![lp.clone()],
            finish_reason: Some(FinishReason::Stop),
            stop_reason: Some(StopReason::TokenId(9)),
            usage: Some(Usage {
                prompt_tokens: 4,
                completion_tokens: 1,
                cached_tokens: 2,
            }),
            error: None,
            score: None,
        };
        let wire = out.into_wire();
        assert_eq!(wire.index, 2);
        assert_eq!(wire.finish_reason(), pb::FinishReason::Stop);
        assert_eq!(
            wire.logprobs
                .into_iter()
                .map(TokenLogprob::from_wire)
                .collect::<Vec<_>>(),
            vec![lp]
        );
        let stop = wire.stop_reason.expect("stop reason");
        assert_eq!(StopReason::try_from_wire(stop), Ok(StopReason::TokenId(9)));
        assert_eq!(
            wire.usage,
            Some(pb::Usage {
                prompt_tokens: 4,
                completion_tokens: 1,
                cached_tokens: 2
            })
        );
    }
}
