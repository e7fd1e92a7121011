//! Approximate mode (`--no-router-kv-events`): for engines that publish no KV events, the
//! router predicts each worker's cache from its own routing decisions. A routed prompt's blocks
//! count as cached on the chosen worker for `router_ttl_secs` (refreshed when routed again),
//! and when the prediction grows past `router_max_tree_size` blocks the oldest predictions are
//! dropped down to `router_prune_target_ratio` of it.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

use super::radix_tree::RadixTree;
use crate::config::KvRouterConfig;
use crate::protocols::{
    sequence_hashes, ExternalSequenceBlockHash, KvCacheStoreData, KvCacheStoredBlockData,
    LocalBlockHash, OverlapScores, WorkerId,
};

pub struct ApproxIndexer {
    tree: RadixTree,
    ttl: Duration,
    max_blocks: usize,
    prune_target: usize,
    /// Newest deadline of each predicted (worker, sequence hash).
    deadlines: FxHashMap<(WorkerId, ExternalSequenceBlockHash), Instant>,
    /// Deadlines in the order they were set (non-decreasing, the TTL being constant); entries
    /// superseded by a refresh are skipped when they come up.
    queue: VecDeque<(Instant, WorkerId, ExternalSequenceBlockHash)>,
}

impl ApproxIndexer {
    pub fn new(config: &KvRouterConfig) -> Self {
        let max_blocks = config.router_max_tree_size.max(1);
        Self {
            tree: RadixTree::new(),
            ttl: Duration::from_secs_f64(config.router_ttl_secs.max(0.0)),
            max_blocks,
            prune_target: (max_blocks as f64 * config.router_prune_target_ratio) as usize,
            deadlines: FxHashMap::default(),
            queue: VecDeque::new(),
        }
    }

    /// The request with these full-block hashes was sent to `worker`: predict it cached there.
    pub fn record_routing(&mut self, worker: WorkerId, locals: &[LocalBlockHash], now: Instant) {
        self.expire(now);
        let seqs = sequence_hashes(locals);
        let data = KvCacheStoreData {
            parent_hash: None,
            start_position: None,
            blocks: locals
                .iter()
                .zip(&seqs)
                .map(|(&l, &s)| KvCacheStoredBlockData {
                    block_hash: s,
                    tokens_hash: l,
                })
                .collect(),
        };
        if let Err(e) = self.tree.apply_stored(worker, &data) {
            tracing::warn!(error = %e, "approximate index not updated");
        }
        let deadline = now + self.ttl;
        for s in seqs {
            self.deadlines.insert((worker, s), deadline);
            self.queue.push_back((deadline, worker, s));
        }
        if self.predicted_blocks() > self.max_blocks {
            while self.predicted_blocks() > self.prune_target {
                if !self.pop_oldest() {
                    break;
                }
            }
        }
    }

    /// Drops predictions past their deadline; returns how many blocks went.
    pub fn expire(&mut self, now: Instant) -> usize {
        let before = self.predicted_blocks();
        while self.queue.front().is_some_and(|(d, _, _)| *d <= now) {
            self.pop_oldest();
        }
        before - self.predicted_blocks()
    }

    /// Pops the oldest queue entry, removing its block if the entry is still current.
    fn pop_oldest(&mut self) -> bool {
        let Some((d, w, h)) = self.queue.pop_front() else {
            return false;
        };
        if self.deadlines.get(&(w, h)) == Some(&d) {
            self.deadlines.remove(&(w, h));
            // Blocks below it stay (as unmatchable orphans) until their own deadlines.
            self.tree.apply_removed(w, &[h]);
        }
        true
    }

    pub fn find_matches(&self, locals: &[LocalBlockHash]) -> OverlapScores {
        self.tree.find_matches(locals)
    }

    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.tree.remove_worker(worker);
        self.deadlines.retain(|(w, _), _| *w != worker);
    }

    /// Predicted blocks across all workers (matchable or not). O(workers).
    pub fn predicted_blocks(&self) -> usize {
        self.tree
            .workers()
            .into_iter()
            .map(|w| self.tree.tree_size(w) + self.tree.orphan_count(w))
            .sum()
    }

    pub fn tree(&self) -> &RadixTree {
        &self.tree
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocols::lh;

    fn cfg(ttl: f64, max: usize) -> KvRouterConfig {
        KvRouterConfig {
            use_kv_events: false,
            router_ttl_secs: ttl,
            router_max_tree_size: max,
            router_prune_target_ratio: 0.5,
            ..Default::default()
        }
    }

    #[test]
    fn predictions_expire_after_the_ttl_unless_refreshed() {
        let mut a = ApproxIndexer::new(&cfg(10.0, 1000));
        let t0 = Instant::now();
        a.record_routing(1, &lh(&[1, 2, 3]), t0);
        a.record_routing(2, &lh(&[1, 2]), t0 + Duration::from_secs(5));
        assert_eq!(a.find_matches(&lh(&[1, 2, 3])).score(1), 3);
        // Worker 1 routed [1] again at t=8: that block lives on, its children expire at t=10.
        a.record_routing(1, &lh(&[1]), t0 + Duration::from_secs(8));
        assert_eq!(a.expire(t0 + Duration::from_secs(11)), 2);
        assert_eq!(a.find_matches(&lh(&[1, 2, 3])).score(1), 1);
        assert_eq!(a.find_matches(&lh(&[1, 2])).score(2), 2);
        a.expire(t0 + Duration::from_secs(20));
        assert_eq!(a.predicted_blocks(), 0);
        assert_eq!(a.tree().node_count(), 0);
        a.tree().check_invariants().unwrap();
    }

    #[test]
    fn oversized_prediction_is_pruned_oldest_first() {
        let mut a = ApproxIndexer::new(&cfg(1000.0, 8));
        let t0 = Instant::now();
        a.record_routing(1, &lh(&[1, 2, 3, 4]), t0);
        a.record_routing(2, &lh(&[5, 6, 7, 8]), t0);
        assert_eq!(a.predicted_blocks(), 8);
        a.record_routing(3, &lh(&[9]), t0);
        // Over 8: pruned down to 4 (ratio 0.5), oldest first: worker 1's chain goes.
        assert!(a.predicted_blocks() <= 4, "{}", a.predicted_blocks());
        assert_eq!(a.find_matches(&lh(&[1])).score(1), 0);
        assert_eq!(a.find_matches(&lh(&[9])).score(3), 1);
        a.remove_worker(3);
        a.tree().check_invariants().unwrap();
    }
}
