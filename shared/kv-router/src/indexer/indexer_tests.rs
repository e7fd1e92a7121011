use super::*;
use crate::protocols::{
    eh, lh, ExternalSequenceBlockHash, KvCacheRemoveData, LocalBlockHash, StoredBlock,
};

fn ev(worker: WorkerId, id: u64, data: KvCacheEventData) -> RouterEvent {
    RouterEvent::new(
        worker,
        KvCacheEvent {
            event_id: id,
            data,
            dp_rank: 0,
        },
    )
}

fn store(parent: Option<u64>, locals: &[u64]) -> KvCacheEventData {
    KvCacheEventData::Stored(KvCacheStoreData {
        parent_hash: parent.map(ExternalSequenceBlockHash),
        start_position: None,
        blocks: locals
            .iter()
            .map(|&l| KvCacheStoredBlockData {
                block_hash: ExternalSequenceBlockHash(100 + l),
                tokens_hash: LocalBlockHash(l),
            })
            .collect(),
    })
}

fn remove(hs: &[u64]) -> KvCacheEventData {
    KvCacheEventData::Removed(KvCacheRemoveData {
        block_hashes: eh(hs),
    })
}

#[test]
fn in_order_events_apply_and_duplicates_are_ignored() {
    let mut ix = KvIndexer::new();
    assert_eq!(
        ix.apply_event(ev(1, 1, store(None, &[1, 2]))),
        Ok(ApplyOutcome::Applied { blocks: 2 })
    );
    assert_eq!(
        ix.apply_event(ev(1, 2, store(Some(102), &[3]))),
        Ok(ApplyOutcome::Applied { blocks: 1 })
    );
    assert_eq!(
        ix.apply_event(ev(1, 2, store(None, &[9]))),
        Ok(ApplyOutcome::Duplicate)
    );
    assert_eq!(ix.last_event_id(1), Some(2));
    assert_eq!(ix.find_matches(&lh(&[1, 2, 3])).score(1), 3);
    assert_eq!(ix.find_matches(&lh(&[9])).score(1), 0);
}

#[test]
fn gap_is_reported_buffered_and_healed_by_replay() {
    let mut ix = KvIndexer::new();
    ix.apply_event(ev(1, 1, store(None, &[1]))).unwrap();
    // Events 2 and 3 are lost.
    let out = ix.apply_event(ev(1, 4, store(Some(103), &[4]))).unwrap();
    assert_eq!(
        out,
        ApplyOutcome::Gap(GapReport {
            worker_id: 1,
            expected: 2,
            received: 4
        })
    );
    assert_eq!(ix.awaiting_resync(1), Some(2));
    assert_eq!(
        ix.apply_event(ev(1, 5, remove(&[101]))).unwrap(),
        ApplyOutcome::Buffered
    );
    // Nothing past the gap was applied yet.
    assert_eq!(ix.find_matches(&lh(&[1])).score(1), 1);
    let replay = vec![
        KvCacheEvent {
            event_id: 1,
            data: store(None, &[1]),
            dp_rank: 0,
        },
        KvCacheEvent {
            event_id: 2,
            data: store(Some(101), &[2]),
            dp_rank: 0,
        },
        KvCacheEvent {
            event_id: 3,
            data: store(Some(102), &[3]),
            dp_rank: 0,
        },
    ];
    let out = ix.apply_replay(1, replay).unwrap();
    assert_eq!(out.applied_events, 4, "2 and 3 replayed, 4 and 5 drained");
    assert_eq!(out.gap, None);
    assert_eq!(ix.awaiting_resync(1), None);
    assert_eq!(ix.last_event_id(1), Some(5));
    // Event 5 removed block 1: the rest of the chain is held but no longer matchable.
    assert_eq!(ix.tree().tree_size(1), 0);
    assert_eq!(ix.tree().orphan_count(1), 3);
}

#[test]
fn replay_must_be_contiguous() {
    let mut ix = KvIndexer::new();
    ix.apply_event(ev(1, 3, store(None, &[1]))).unwrap();
    let bad = vec![KvCacheEvent {
        event_id: 2,
        data: store(None, &[1]),
        dp_rank: 0,
    }];
    assert_eq!(
        ix.apply_replay(1, bad),
        Err(IndexerError::ReplayNotContiguous {
            worker_id: 1,
            expected: 1,
            got: 2
        })
    );
    // A partial replay that stops short reports the remaining gap.
    let part = vec![KvCacheEvent {
        event_id: 1,
        data: store(None, &[5]),
        dp_rank: 0,
    }];
    let out = ix.apply_replay(1, part).unwrap();
    assert_eq!(
        out.gap,
        Some(GapReport {
            worker_id: 1,
            expected: 2,
            received: 3
        })
    );
}

#[test]
fn dump_replaces_state_and_drains_newer_events() {
    let mut ix = KvIndexer::new();
    ix.apply_event(ev(1, 1, store(None, &[7, 8]))).unwrap();
    assert!(matches!(
        ix.apply_event(ev(1, 10, store(Some(101), &[2]))),
        Ok(ApplyOutcome::Gap(_))
    ));
    ix.apply_event(ev(1, 8, store(None, &[50]))).unwrap(); // older than the dump: dropped
    let dump = KvStoredDump {
        last_event_id: 9,
        blocks: vec![
            StoredBlock {
                parent_hash: None,
                block_hash: ExternalSequenceBlockHash(101),
                tokens_hash: LocalBlockHash(1),
            },
            StoredBlock {
                parent_hash: Some(ExternalSequenceBlockHash(999)),
                block_hash: ExternalSequenceBlockHash(130),
                tokens_hash: LocalBlockHash(30),
            },
        ],
    };
    let out = ix.apply_dump(1, &dump);
    assert_eq!(out.orphaned_blocks, 1, "orphan block in the dump");
    assert_eq!(out.applied_events, 1, "event 10 drained");
    assert_eq!(out.gap, None);
    assert_eq!(ix.last_event_id(1), Some(10));
    assert_eq!(ix.find_matches(&lh(&[1, 2])).score(1), 2);
    assert_eq!(
        ix.find_matches(&lh(&[7])).score(1),
        0,
        "dump replaced the old state"
    );
    assert_eq!(ix.find_matches(&lh(&[50])).score(1), 0);
}

#[test]
fn dump_order_does_not_matter() {
    // Children listed before their parents (an engine re-storing a parent moves it last).
    let blocks = vec![
        StoredBlock {
            parent_hash: Some(ExternalSequenceBlockHash(102)),
            block_hash: ExternalSequenceBlockHash(103),
            tokens_hash: LocalBlockHash(3),
        },
        StoredBlock {
            parent_hash: Some(ExternalSequenceBlockHash(101)),
            block_hash: ExternalSequenceBlockHash(102),
            tokens_hash: LocalBlockHash(2),
        },
        StoredBlock {
            parent_hash: None,
            block_hash: ExternalSequenceBlockHash(101),
            tokens_hash: LocalBlockHash(1),
        },
        // A cycle and an orphan are ignored, without looping.
        StoredBlock {
            parent_hash: Some(ExternalSequenceBlockHash(201)),
            block_hash: ExternalSequenceBlockHash(200),
            tokens_hash: LocalBlockHash(9),
        },
        StoredBlock {
            parent_hash: Some(ExternalSequenceBlockHash(200)),
            block_hash: ExternalSequenceBlockHash(201),
            tokens_hash: LocalBlockHash(8),
        },
    ];
    let mut ix = KvIndexer::new();
    let out = ix.apply_dump(
        1,
        &KvStoredDump {
            last_event_id: 5,
            blocks,
        },
    );
    assert_eq!(out.orphaned_blocks, 2);
    assert_eq!(ix.find_matches(&lh(&[1, 2, 3])).score(1), 3);
}

#[test]
fn pending_overflow_requires_a_dump() {
    let mut ix = KvIndexer::with_max_pending(2);
    ix.apply_event(ev(1, 1, store(None, &[1]))).unwrap();
    assert!(matches!(
        ix.apply_event(ev(1, 5, store(None, &[2]))),
        Ok(ApplyOutcome::Gap(_))
    ));
    assert_eq!(
        ix.apply_event(ev(1, 6, store(None, &[3]))),
        Ok(ApplyOutcome::Buffered)
    );
    assert_eq!(
        ix.apply_event(ev(1, 7, store(None, &[4]))),
        Ok(ApplyOutcome::DumpRequired { worker_id: 1 })
    );
    // A replay cannot fix it (live events were dropped) ...
    let out = ix.apply_replay(1, vec![]).unwrap();
    assert!(out.gap.is_some());
    // ... a dump can.
    let out = ix.apply_dump(
        1,
        &KvStoredDump {
            last_event_id: 7,
            blocks: vec![],
        },
    );
    assert_eq!(out.gap, None);
    assert_eq!(ix.awaiting_resync(1), None);
    assert_eq!(
        ix.apply_event(ev(1, 8, store(None, &[4]))),
        Ok(ApplyOutcome::Applied { blocks: 1 })
    );
}

#[test]
fn first_event_from_a_new_worker_past_one_is_a_gap() {
    let mut ix = KvIndexer::new();
    let out = ix.apply_event(ev(3, 42, store(None, &[1]))).unwrap();
    assert_eq!(
        out,
        ApplyOutcome::Gap(GapReport {
            worker_id: 3,
            expected: 1,
            received: 42
        })
    );
}

#[test]
fn unknown_parent_is_kept_unmatchable_and_consumes_the_id() {
    let mut ix = KvIndexer::new();
    assert_eq!(
        ix.apply_event(ev(1, 1, store(Some(5), &[1]))),
        Ok(ApplyOutcome::Applied { blocks: 0 })
    );
    assert_eq!(ix.last_event_id(1), Some(1));
    assert_eq!(ix.find_matches(&lh(&[1])).score(1), 0);
    assert_eq!(ix.dump(1).blocks.len(), 1);
}

#[test]
fn index_equals_union_of_worker_dumps_and_remove_worker() {
    let mut ix = KvIndexer::new();
    ix.apply_event(ev(1, 1, store(None, &[1, 2, 3]))).unwrap();
    ix.apply_event(ev(2, 1, store(None, &[1, 4]))).unwrap();
    ix.apply_event(ev(2, 2, remove(&[104]))).unwrap();
    let d1 = ix.dump(1);
    let d2 = ix.dump(2);
    assert_eq!(d1.last_event_id, 1);
    let rebuilt = KvIndexer::from_dumps([(1, &d1), (2, &d2)]);
    assert_eq!(ix.snapshot(), rebuilt.snapshot());
    assert_eq!(rebuilt.last_event_id(2), Some(2));
    assert_eq!(ix.remove_worker(1), 3);
    assert_eq!(ix.workers(), vec![2]);
    assert_eq!(ix.find_matches(&lh(&[1, 2])).scores.len(), 1);
}

#[test]
fn extreme_event_ids_do_not_panic() {
    let mut ix = KvIndexer::new();
    assert!(matches!(
        ix.apply_event(ev(1, u64::MAX, store(None, &[1]))),
        Ok(ApplyOutcome::Gap(_))
    ));
    let out = ix.apply_dump(
        1,
        &KvStoredDump {
            last_event_id: u64::MAX,
            blocks: vec![],
        },
    );
    assert_eq!(out.gap, None);
    assert_eq!(
        ix.apply_event(ev(1, u64::MAX, store(None, &[1]))),
        Ok(ApplyOutcome::Duplicate)
    );
    assert_eq!(ix.awaiting_resync(1), None);
    assert!(ix.apply_replay(1, vec![]).is_ok());
}
