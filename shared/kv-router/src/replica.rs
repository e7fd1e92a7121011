//! What router replicas tell each other about the load they put on workers
//! (`--router-replica-sync`, Dynamo's active-sequence events): each replica announces the
//! requests it routes, their first tokens and their ends, and every few seconds the whole list
//! of what it still has in flight, so that an end lost in transit heals. The transport (NATS,
//! signatures, peer liveness) is the serving layer's; this module is only the shapes.

use serde::{Deserialize, Serialize};

use crate::protocols::{ExternalSequenceBlockHash, WorkerId};

/// One change in a router's load, as its peers apply it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum LoadEvent {
    /// A request was routed to `worker_id`.
    AddRequest {
        request_id: String,
        worker_id: WorkerId,
        /// Sequence hashes of the prompt's full blocks.
        seq_hashes: Vec<ExternalSequenceBlockHash>,
        isl_tokens: usize,
        overlap_blocks: u32,
        block_size: u32,
    },
    /// The request's first token arrived: its prefill load ends.
    MarkPrefillCompleted { request_id: String },
    /// The request ended, any way.
    Free { request_id: String },
    /// Every request the sender has in flight now; peers drop the sender's others.
    Live { request_ids: Vec<String> },
}

/// Receives a router's own [`LoadEvent`]s, in the order they happen (it is called under the
/// load tracker's lock: it must only queue the event).
pub type LoadSink = Box<dyn Fn(LoadEvent) + Send + Sync>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_travel_as_tagged_json() {
        let ev = LoadEvent::AddRequest {
            request_id: "r".into(),
            worker_id: 3,
            seq_hashes: vec![ExternalSequenceBlockHash(9)],
            isl_tokens: 40,
            overlap_blocks: 1,
            block_size: 16,
        };
        let j = serde_json::to_value(&ev).unwrap();
        assert_eq!(j["type"], "add_request");
        assert_eq!(serde_json::from_value::<LoadEvent>(j).unwrap(), ev);
        let live = LoadEvent::Live {
            request_ids: vec!["a".into()],
        };
        assert_eq!(
            serde_json::to_string(&live).unwrap(),
            r#"{"type":"live","request_ids":["a"]}"#
        );
    }
}
