//! Comparable per-worker views of the index, so a test can check "router index == union of
//! the workers' dumps" and print what differs.

use std::collections::{BTreeMap, BTreeSet};

use super::radix_tree::RadixTree;
use crate::protocols::{ExternalSequenceBlockHash, LocalBlockHash, WorkerId};

/// Per-worker block sets in comparable form: worker → `(block_hash, parent_hash, tokens_hash)`.
/// Workers holding nothing are omitted, so "never seen" and "empty" compare equal.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IndexSnapshot(pub BTreeMap<WorkerId, BTreeSet<SnapshotBlock>>);

/// One block of a snapshot: `(block_hash, parent_hash, tokens_hash)`.
pub type SnapshotBlock = (
    ExternalSequenceBlockHash,
    Option<ExternalSequenceBlockHash>,
    LocalBlockHash,
);

impl IndexSnapshot {
    /// Human-readable differences (empty when equal), for test failure messages.
    pub fn diff(&self, other: &IndexSnapshot) -> Vec<String> {
        let mut out = Vec::new();
        let workers: BTreeSet<_> = self.0.keys().chain(other.0.keys()).collect();
        let empty = BTreeSet::new();
        for w in workers {
            let a = self.0.get(w).unwrap_or(&empty);
            let b = other.0.get(w).unwrap_or(&empty);
            let only_a = a.difference(b).count();
            let only_b = b.difference(a).count();
            if only_a + only_b > 0 {
                out.push(format!(
                    "worker {w}: {only_a} block(s) only on the left, {only_b} only on the right"
                ));
            }
        }
        out
    }

    pub fn total_blocks(&self) -> usize {
        self.0.values().map(BTreeSet::len).sum()
    }
}

impl RadixTree {
    /// Every worker's blocks in comparable form.
    pub fn snapshot(&self) -> IndexSnapshot {
        let mut out = BTreeMap::new();
        for w in self.workers() {
            if self.tree_size(w) + self.orphan_count(w) == 0 {
                continue;
            }
            let set = self
                .dump_blocks(w)
                .into_iter()
                .map(|b| (b.block_hash, b.parent_hash, b.tokens_hash))
                .collect();
            out.insert(w, set);
        }
        IndexSnapshot(out)
    }
}
