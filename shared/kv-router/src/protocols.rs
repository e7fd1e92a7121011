//! Wire and index types shared by the router and the workers.
//!
//! Block hashing and the KV event shapes live in the leaf crate `tandem-kv-protocol`, which the
//! engine publishes with; they are re-exported here so the router never grows a second,
//! subtly different copy. This module only adds what exists on the router side: the worker
//! identity attached to an event and the result of a prefix lookup.
//!
//! One [`WorkerId`] is one engine with one KV cache: the events' `dp_rank` is not part of the
//! key. A worker running several data-parallel ranks registers one id per rank.

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

pub use tandem_kv_protocol::events::{
    KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData,
    KvStoredDump, StoredBlock,
};
pub use tandem_kv_protocol::hash::{
    block_hashes, chain_hash, local_block_hash, local_block_hashes, salted_block_hash,
    salted_block_hashes, sequence_hashes, CacheSalt, ExternalSequenceBlockHash, LocalBlockHash,
    XXH3_SEED,
};

/// Identity of a worker instance (Dynamo's `worker_id`, the discovery instance id).
pub type WorkerId = u64;

/// One KV event tagged with the worker that published it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouterEvent {
    pub worker_id: WorkerId,
    pub event: KvCacheEvent,
}

impl RouterEvent {
    pub fn new(worker_id: WorkerId, event: KvCacheEvent) -> Self {
        Self { worker_id, event }
    }
}

/// Result of matching a request's block chain against the index.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OverlapScores {
    /// Worker → number of leading request blocks that worker already holds. Workers with no
    /// matching block are absent.
    pub scores: FxHashMap<WorkerId, u32>,
    /// Worker → number of blocks the worker holds in total, for every worker the index knows.
    /// Used to break ties towards the worker with less cached state.
    pub tree_sizes: FxHashMap<WorkerId, usize>,
}

impl OverlapScores {
    /// Matched blocks of `worker` (0 when it holds none of the prefix).
    pub fn score(&self, worker: WorkerId) -> u32 {
        self.scores.get(&worker).copied().unwrap_or(0)
    }

    /// Blocks `worker` holds in total (0 when unknown).
    pub fn tree_size(&self, worker: WorkerId) -> usize {
        self.tree_sizes.get(&worker).copied().unwrap_or(0)
    }
}

/// Local block hashes of a request's tokens, as the router feeds them to
/// [`crate::KvIndexer::find_matches`]. Only full blocks are hashed. With a salt, they match
/// only blocks an engine stored for requests of the same salt.
pub fn request_block_hashes(
    tokens: &[u32],
    block_size: u32,
    salt: Option<CacheSalt>,
) -> Vec<LocalBlockHash> {
    salted_block_hashes(salt, tokens, block_size as usize)
}

/// Test shorthand: local hashes from plain numbers.
#[cfg(test)]
pub(crate) fn lh(xs: &[u64]) -> Vec<LocalBlockHash> {
    xs.iter().copied().map(LocalBlockHash).collect()
}

/// Test shorthand: sequence hashes from plain numbers.
#[cfg(test)]
pub(crate) fn eh(xs: &[u64]) -> Vec<ExternalSequenceBlockHash> {
    xs.iter().copied().map(ExternalSequenceBlockHash).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_event_serde_round_trip() {
        let ev = RouterEvent::new(
            7,
            KvCacheEvent {
                event_id: 3,
                data: KvCacheEventData::Removed(KvCacheRemoveData {
                    block_hashes: vec![ExternalSequenceBlockHash(1), ExternalSequenceBlockHash(2)],
                }),
                dp_rank: 0,
            },
        );
        let j = serde_json::to_string(&ev).unwrap();
        assert_eq!(serde_json::from_str::<RouterEvent>(&j).unwrap(), ev);
    }

    #[test]
    fn request_hashes_match_engine_hashing() {
        let toks: Vec<u32> = (0..10).collect();
        let hs = request_block_hashes(&toks, 4, None);
        assert_eq!(hs.len(), 2, "the trailing partial block is not hashed");
        assert_eq!(hs[0], local_block_hash(&[0, 1, 2, 3]));
    }
}
