//! The router's side of `proto/worker.proto`: the sampling parameters it sends and the
//! logprobs, KV events and dumps it reads back. The conversions live in
//! `tandem_protocol::wire` (both sides of each pair in one place, tested as round trips);
//! this module is the one place the router reaches them.

use tandem_kv_protocol::{KvCacheEvent, KvStoredDump};
use tandem_protocol::wire::{FromWire, IntoWire, TryFromWire};
use tandem_protocol::worker as pb;
use tandem_protocol::WireError;
use tandem_text::{SamplingParams, TokenLogprob};

/// The message carrying a request's sampling parameters.
pub fn sampling_params(params: &SamplingParams) -> pb::SamplingParams {
    params.clone().into_wire()
}

/// The engine's logprobs of one output's tokens.
pub fn logprobs(wire: &[pb::TokenLogprob]) -> Vec<TokenLogprob> {
    wire.iter().cloned().map(TokenLogprob::from_wire).collect()
}

/// A worker's KV event, or the field that makes it malformed.
pub fn kv_event(wire: pb::KvEvent) -> Result<KvCacheEvent, WireError> {
    KvCacheEvent::try_from_wire(wire)
}

/// The OpenAI `finish_reason` of an output: `None` while its choice goes on. A value this
/// version does not know (a newer worker) ends the choice as `abort`.
pub fn finish_reason(out: &pb::GenerateOutput) -> Option<&'static str> {
    use pb::FinishReason as F;
    match F::try_from(out.finish_reason) {
        Ok(F::Unspecified) => None,
        Ok(F::Stop) => Some("stop"),
        Ok(F::Length) => Some("length"),
        Ok(F::Abort) => Some("abort"),
        Ok(F::Migrated) => Some("migrated"),
        Err(_) => {
            tracing::warn!(
                value = out.finish_reason,
                "a worker sent an unknown finish reason; the choice ends as abort"
            );
            Some("abort")
        }
    }
}

/// A worker's dump of its stored blocks.
pub fn kv_dump(wire: pb::KvDump) -> KvStoredDump {
    KvStoredDump::from_wire(wire)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_kv_protocol::{
        ExternalSequenceBlockHash, KvCacheEventData, KvCacheRemoveData, LocalBlockHash, StoredBlock,
    };

    #[test]
    fn what_the_router_reads_is_what_a_worker_sent() {
        let event = KvCacheEvent {
            event_id: 4,
            data: KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: vec![ExternalSequenceBlockHash(8), ExternalSequenceBlockHash(9)],
            }),
            dp_rank: 0,
        };
        assert_eq!(kv_event(event.clone().into_wire()), Ok(event));
        let dump = KvStoredDump {
            last_event_id: 4,
            blocks: vec![StoredBlock {
                parent_hash: None,
                block_hash: ExternalSequenceBlockHash(1),
                tokens_hash: LocalBlockHash(2),
            }],
        };
        assert_eq!(kv_dump(dump.clone().into_wire()), dump);
        let lps = vec![TokenLogprob {
            token: 3,
            logprob: -1.0,
            top: vec![(3, -1.0)],
        }];
        let wire: Vec<_> = lps.iter().cloned().map(IntoWire::into_wire).collect();
        assert_eq!(logprobs(&wire), lps);
        let params = SamplingParams {
            max_tokens: Some(7),
            stop: vec!["x".into()],
            ..SamplingParams::greedy()
        };
        let back = SamplingParams::try_from_wire(sampling_params(&params));
        assert_eq!(back, Ok(params));
    }

    #[test]
    fn a_malformed_event_is_an_error_naming_the_field() {
        let wire = pb::KvEvent {
            event_id: 1,
            dp_rank: 0,
            data: None,
        };
        assert_eq!(kv_event(wire), Err(WireError::missing("data")));
    }
}
