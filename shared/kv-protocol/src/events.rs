//! KV cache events, shaped like Dynamo's `KvCacheEvent` (its JSON is what goes over NATS).
//!
//! `block_hash` is the chained sequence hash of a block (Dynamo's `ExternalSequenceBlockHash`,
//! here computed the same way the router does, so both sides agree) and `tokens_hash` its local
//! hash (`LocalBlockHash`). `event_id` is monotonic per engine, starting at 1, with no gaps.
//!
//! A subscriber that (re)connects replays from an `event_id` still in the publisher's bounded
//! buffer, or takes a [`KvStoredDump`] of every stored block and then follows the live stream
//! from the dump's `last_event_id`.

use serde::{Deserialize, Serialize};

use crate::hash::{ExternalSequenceBlockHash, LocalBlockHash};

/// One event, as published to the router.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheEvent {
    pub event_id: u64,
    pub data: KvCacheEventData,
    #[serde(default)]
    pub dp_rank: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvCacheEventData {
    Stored(KvCacheStoreData),
    Removed(KvCacheRemoveData),
    Cleared,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheStoreData {
    /// Sequence hash of the block before the first stored block; None at the sequence start.
    pub parent_hash: Option<ExternalSequenceBlockHash>,
    #[serde(default)]
    pub start_position: Option<u32>,
    pub blocks: Vec<KvCacheStoredBlockData>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheStoredBlockData {
    pub block_hash: ExternalSequenceBlockHash,
    pub tokens_hash: LocalBlockHash,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheRemoveData {
    pub block_hashes: Vec<ExternalSequenceBlockHash>,
}

/// Every block currently stored, in store order (a parent always precedes its children), and
/// the id of the last event reflected in it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvStoredDump {
    pub last_event_id: u64,
    pub blocks: Vec<StoredBlock>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredBlock {
    pub parent_hash: Option<ExternalSequenceBlockHash>,
    pub block_hash: ExternalSequenceBlockHash,
    pub tokens_hash: LocalBlockHash,
}

/// Replay could not start at the requested id because the buffer no longer holds it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("kv event {requested} is no longer buffered (oldest buffered: {oldest}); take a dump")]
pub struct ReplayGap {
    pub requested: u64,
    pub oldest: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(parent: Option<u64>, hs: &[u64]) -> KvCacheEventData {
        KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: parent.map(ExternalSequenceBlockHash),
            start_position: None,
            blocks: hs
                .iter()
                .map(|&h| KvCacheStoredBlockData {
                    block_hash: ExternalSequenceBlockHash(h),
                    tokens_hash: LocalBlockHash(h + 100),
                })
                .collect(),
        })
    }

    #[test]
    fn serde_shape_is_snake_case_like_dynamo() {
        let ev = KvCacheEvent {
            event_id: 7,
            data: stored(None, &[1]),
            dp_rank: 0,
        };
        let j = serde_json::to_value(&ev).unwrap();
        assert_eq!(
            j,
            serde_json::json!({"event_id":7,"dp_rank":0,"data":{"stored":{"parent_hash":null,
              "start_position":null,"blocks":[{"block_hash":1,"tokens_hash":101}]}}})
        );
        let c = serde_json::to_value(KvCacheEventData::Cleared).unwrap();
        assert_eq!(c, serde_json::json!("cleared"));
        let r = KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: vec![ExternalSequenceBlockHash(3)],
        });
        assert_eq!(
            serde_json::to_value(&r).unwrap(),
            serde_json::json!({"removed":{"block_hashes":[3]}})
        );
        let back: KvCacheEvent = serde_json::from_value(j).unwrap();
        assert_eq!(back, ev);
    }
}
