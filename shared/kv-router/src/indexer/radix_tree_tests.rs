use super::*;
use crate::protocols::{eh, lh, ExternalSequenceBlockHash, LocalBlockHash};
use crate::protocols::{KvCacheRemoveData, KvCacheStoreData};

/// A chain of blocks whose external hash is `1000 * tag + local` (so two workers may use
/// different ids for the same content) and local hashes `locals`.
fn store(parent: Option<u64>, tag: u64, locals: &[u64]) -> KvCacheEventData {
    KvCacheEventData::Stored(KvCacheStoreData {
        parent_hash: parent.map(ExternalSequenceBlockHash),
        start_position: None,
        blocks: locals
            .iter()
            .map(|&l| KvCacheStoredBlockData {
                block_hash: ExternalSequenceBlockHash(1000 * tag + l),
                tokens_hash: LocalBlockHash(l),
            })
            .collect(),
    })
}

fn removed(hs: &[u64]) -> KvCacheEventData {
    KvCacheEventData::Removed(KvCacheRemoveData {
        block_hashes: eh(hs),
    })
}

fn scores(t: &RadixTree, locals: &[u64]) -> Vec<(WorkerId, u32)> {
    let mut v: Vec<_> = t.find_matches(&lh(locals)).scores.into_iter().collect();
    v.sort_unstable();
    v
}

#[test]
fn store_and_match_depth_per_worker() {
    let mut t = RadixTree::new();
    assert_eq!(t.apply(1, &store(None, 1, &[1, 2, 3, 4])), Ok(4));
    assert_eq!(t.apply(2, &store(None, 2, &[1, 2])), Ok(2));
    t.apply(2, &store(Some(2002), 2, &[7])).unwrap();
    t.apply(3, &store(None, 3, &[9])).unwrap();
    t.check_invariants().unwrap();
    // Shared prefix [1, 2] is one path: 4 + 1 (the [7] branch) + 1 ([9]) nodes.
    assert_eq!(t.node_count(), 6);
    assert_eq!(scores(&t, &[1, 2, 3, 4, 5]), vec![(1, 4), (2, 2)]);
    assert_eq!(scores(&t, &[1, 2, 7]), vec![(1, 2), (2, 3)]);
    assert_eq!(scores(&t, &[1]), vec![(1, 1), (2, 1)]);
    assert_eq!(scores(&t, &[9, 1]), vec![(3, 1)]);
    assert_eq!(
        scores(&t, &[2, 3]),
        vec![],
        "matches must start at the first block"
    );
    assert_eq!(scores(&t, &[]), vec![]);
    let o = t.find_matches(&lh(&[1]));
    assert_eq!((o.tree_size(1), o.tree_size(2), o.tree_size(3)), (4, 3, 1));
}

#[test]
fn removal_orphans_the_workers_descendants_only() {
    let mut t = RadixTree::new();
    t.apply(1, &store(None, 1, &[1, 2, 3])).unwrap();
    t.apply(2, &store(None, 2, &[1, 2, 3])).unwrap();
    // Worker 1 drops block 2: its block 3 can no longer be matched, but it still holds it.
    assert_eq!(t.apply(1, &removed(&[1002])), Ok(1));
    t.check_invariants().unwrap();
    assert_eq!(scores(&t, &[1, 2, 3]), vec![(1, 1), (2, 3)]);
    assert_eq!((t.tree_size(1), t.orphan_count(1)), (1, 1));
    assert_eq!(t.node_count(), 3, "nodes still held by worker 2 stay");
    // The engine's own removal of block 3 finds the orphan; 555 is unknown.
    assert_eq!(t.apply(1, &removed(&[1003, 555])), Ok(1));
    assert_eq!(t.orphan_count(1), 0);
    // Worker 2 drops its first block: nodes only it held are freed.
    assert_eq!(t.apply(2, &removed(&[2001])), Ok(1));
    assert_eq!(t.orphan_count(2), 2);
    t.check_invariants().unwrap();
    assert_eq!(t.node_count(), 1);
    assert_eq!(t.child_count(ROOT), 1);
    assert_eq!(t.apply(1, &removed(&[1001])), Ok(1));
    assert_eq!(t.node_count(), 0);
    assert_eq!(t.child_count(ROOT), 0);
    // Storing worker 2's first block again makes its orphans matchable again.
    assert_eq!(t.apply(2, &store(None, 2, &[1])), Ok(3));
    assert_eq!(scores(&t, &[1, 2, 3]), vec![(2, 3)]);
    assert_eq!(t.orphan_count(2), 0);
    t.check_invariants().unwrap();
}

#[test]
fn cleared_and_remove_worker() {
    let mut t = RadixTree::new();
    t.apply(1, &store(None, 1, &[1, 2, 3])).unwrap();
    t.apply(2, &store(None, 2, &[1, 5])).unwrap();
    assert_eq!(t.apply(1, &KvCacheEventData::Cleared), Ok(3));
    t.check_invariants().unwrap();
    assert_eq!(scores(&t, &[1, 2, 3]), vec![(2, 1)]);
    assert!(t.workers().contains(&1), "cleared workers stay known");
    assert_eq!(t.remove_worker(2), 2);
    assert_eq!(t.node_count(), 0);
    assert_eq!(t.workers(), vec![1]);
    // A freed slot and freed nodes are reused cleanly.
    t.apply(3, &store(None, 3, &[1, 2])).unwrap();
    t.check_invariants().unwrap();
    assert_eq!(scores(&t, &[1, 2]), vec![(3, 2)]);
}

#[test]
fn unknown_parent_keeps_orphans_until_the_parent_arrives() {
    let mut t = RadixTree::new();
    // Blocks 1, 2 (ids 1001, 1002) arrive before their parent, id 42.
    assert_eq!(t.apply(1, &store(Some(42), 1, &[1, 2])), Ok(0));
    assert_eq!(t.node_count(), 0);
    assert_eq!(t.orphan_count(1), 2);
    assert_eq!(t.dump_blocks(1).len(), 2);
    t.check_invariants().unwrap();
    let parent = KvCacheEventData::Stored(KvCacheStoreData {
        parent_hash: None,
        start_position: None,
        blocks: vec![KvCacheStoredBlockData {
            block_hash: ExternalSequenceBlockHash(42),
            tokens_hash: LocalBlockHash(9),
        }],
    });
    assert_eq!(t.apply(1, &parent), Ok(3));
    assert_eq!(scores(&t, &[9, 1, 2]), vec![(1, 3)]);
    assert_eq!(t.orphan_count(1), 0);
    t.check_invariants().unwrap();
    assert_eq!(t.apply(1, &KvCacheEventData::Cleared), Ok(3));
    // Removing or clearing an unknown worker is a no-op.
    assert_eq!(t.apply(9, &removed(&[1])), Ok(0));
    assert_eq!(t.clear_worker(9), 0);
}

#[test]
fn restoring_is_idempotent_and_id_reuse_moves_the_block() {
    let mut t = RadixTree::new();
    t.apply(1, &store(None, 1, &[1, 2])).unwrap();
    assert_eq!(t.apply(1, &store(None, 1, &[1, 2])), Ok(0));
    assert_eq!(t.tree_size(1), 2);
    // The engine reuses id 1002 for a block with other content under the same parent.
    let reuse = KvCacheEventData::Stored(KvCacheStoreData {
        parent_hash: Some(ExternalSequenceBlockHash(1001)),
        start_position: None,
        blocks: vec![KvCacheStoredBlockData {
            block_hash: ExternalSequenceBlockHash(1002),
            tokens_hash: LocalBlockHash(77),
        }],
    });
    assert_eq!(t.apply(1, &reuse), Ok(1));
    t.check_invariants().unwrap();
    assert_eq!(scores(&t, &[1, 2]), vec![(1, 1)]);
    assert_eq!(scores(&t, &[1, 77]), vec![(1, 2)]);
    // Same content under a new id keeps one entry per block.
    let rename = KvCacheEventData::Stored(KvCacheStoreData {
        parent_hash: None,
        start_position: None,
        blocks: vec![KvCacheStoredBlockData {
            block_hash: ExternalSequenceBlockHash(5),
            tokens_hash: LocalBlockHash(1),
        }],
    });
    assert_eq!(t.apply(1, &rename), Ok(0));
    t.check_invariants().unwrap();
    assert_eq!(t.tree_size(1), 2);
    assert_eq!(t.apply(1, &removed(&[5])), Ok(1));
    assert_eq!(t.orphan_count(1), 1);
    t.check_invariants().unwrap();
}

#[test]
fn dump_round_trip_rebuilds_the_same_index() {
    let mut t = RadixTree::new();
    t.apply(1, &store(None, 1, &[1, 2, 3])).unwrap();
    t.apply(1, &store(Some(1001), 1, &[8, 9])).unwrap();
    t.apply(2, &store(None, 2, &[1, 2])).unwrap();
    t.apply(1, &removed(&[1003])).unwrap();
    // An orphan chain is part of the worker's state too.
    t.apply(2, &store(Some(77), 2, &[5, 6])).unwrap();
    let mut rebuilt = RadixTree::new();
    for w in t.workers() {
        let events = t.dump_events(w);
        for ev in &events {
            rebuilt.apply(w, ev).unwrap();
        }
    }
    rebuilt.check_invariants().unwrap();
    assert_eq!(
        t.snapshot(),
        rebuilt.snapshot(),
        "{:?}",
        t.snapshot().diff(&rebuilt.snapshot())
    );
    assert_eq!(t.snapshot().total_blocks(), 8);
    let d = t.dump_blocks(1);
    assert_eq!(d[0].parent_hash, None);
    assert!(d.iter().skip(1).all(|b| b.parent_hash.is_some()));
    assert!(t.dump_blocks(77).is_empty());
    // A differing index is reported.
    rebuilt.apply(2, &KvCacheEventData::Cleared).unwrap();
    assert_eq!(t.snapshot().diff(&rebuilt.snapshot()).len(), 1);
}

#[test]
fn wide_fanout_switches_child_storage() {
    let mut t = RadixTree::new();
    t.apply(1, &store(None, 1, &[1])).unwrap();
    for l in 100..140 {
        t.apply(1, &store(Some(1001), 1, &[l])).unwrap();
    }
    t.check_invariants().unwrap();
    for l in 100..140 {
        assert_eq!(scores(&t, &[1, l]), vec![(1, 2)]);
    }
    for l in 100..140 {
        t.apply(1, &removed(&[1000 + l])).unwrap();
    }
    t.check_invariants().unwrap();
    assert_eq!(t.node_count(), 1);
}

/// Random operations against a model of per-worker block maps; the index must keep its
/// invariants and answer matches like a brute-force scan.
#[test]
fn random_operations_match_a_brute_force_model() {
    let mut rng = crate::scheduling::rng::SplitMix64::new(7);
    let mut t = RadixTree::new();
    for step in 0..3000 {
        let w = rng.below(4);
        match rng.below(10) {
            0 => {
                t.apply(w, &KvCacheEventData::Cleared).unwrap();
            }
            1..=3 => {
                let blocks = t.dump_blocks(w);
                if !blocks.is_empty() {
                    let b = blocks[rng.below(blocks.len() as u64) as usize];
                    t.apply(w, &removed(&[b.block_hash.0])).unwrap();
                }
            }
            _ => {
                // Sequences over a tiny alphabet, so prefixes are shared a lot.
                let len = 1 + rng.below(5) as usize;
                let locals: Vec<LocalBlockHash> =
                    (0..len).map(|_| LocalBlockHash(1 + rng.below(3))).collect();
                let seqs = crate::protocols::sequence_hashes(&locals);
                let ev = KvCacheEventData::Stored(KvCacheStoreData {
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
                });
                t.apply(w, &ev).unwrap();
            }
        }
        if step % 100 == 0 {
            t.check_invariants().unwrap();
        }
        let q: Vec<LocalBlockHash> = (0..4).map(|_| LocalBlockHash(1 + rng.below(3))).collect();
        let qs = crate::protocols::sequence_hashes(&q);
        let got = t.find_matches(&q);
        for w in 0..4 {
            let held: BTreeSet<ExternalSequenceBlockHash> =
                t.dump_blocks(w).iter().map(|b| b.block_hash).collect();
            let want = qs.iter().take_while(|h| held.contains(h)).count() as u32;
            assert_eq!(got.score(w), want, "step {step} worker {w}");
        }
    }
}
