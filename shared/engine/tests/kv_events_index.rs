//! The engine's KV event publisher feeding the router's index: live events, replays and dumps
//! rebuild the same index the workers' own dumps describe (the two crates agree through
//! `tandem-kv-protocol` alone).

use tandem_engine::kv::events::KvEventPublisher;
use tandem_kv_protocol::{
    block_hashes, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData,
    LocalBlockHash,
};
use tandem_kv_router::scheduling::rng::SplitMix64;
use tandem_kv_router::{ApplyOutcome, KvIndexer, RouterEvent};

#[test]
fn engine_publisher_dump_round_trips_through_the_indexer() {
    let p = KvEventPublisher::new(16, 0);
    let mut rx = p.subscribe();
    let seq = block_hashes(&(0..64).collect::<Vec<u32>>(), 16);
    let blocks: Vec<_> = seq
        .iter()
        .map(|&(l, s)| KvCacheStoredBlockData {
            block_hash: s,
            tokens_hash: l,
        })
        .collect();
    p.emit(KvCacheEventData::Stored(KvCacheStoreData {
        parent_hash: None,
        start_position: None,
        blocks,
    }));
    p.emit(KvCacheEventData::Removed(KvCacheRemoveData {
        block_hashes: vec![seq[3].1],
    }));
    let mut ix = KvIndexer::new();
    while let Ok(e) = rx.try_recv() {
        ix.apply_event(RouterEvent::new(9, e)).unwrap();
    }
    let (dump, _) = p.dump();
    let rebuilt = KvIndexer::from_dumps([(9, &dump)]);
    assert_eq!(ix.snapshot(), rebuilt.snapshot());
    let locals: Vec<LocalBlockHash> = seq.iter().map(|x| x.0).collect();
    assert_eq!(ix.find_matches(&locals).score(9), 3);
}

/// Engine publishers under random traffic, with live events randomly lost on the way (single
/// events, and bursts longer than the publisher's replay buffer): gaps are healed by replay
/// from the buffer, or by a dump when it no longer holds them. At the end the index must equal
/// the union of the workers' own dumps.
#[test]
fn lossy_delivery_heals_to_the_union_of_worker_dumps() {
    fn heal(ix: &mut KvIndexer, w: u64, p: &KvEventPublisher, expected: u64) -> bool {
        match p.subscribe_from(expected) {
            Ok((events, _)) => {
                let out = ix.apply_replay(w, events).unwrap();
                assert_eq!(out.gap, None);
                true
            }
            Err(_) => {
                let out = ix.apply_dump(w, &p.dump().0);
                assert_eq!(out.gap, None);
                false
            }
        }
    }

    let mut rng = SplitMix64::new(77);
    let pubs: Vec<KvEventPublisher> = (0..3).map(|_| KvEventPublisher::new(8, 0)).collect();
    let mut rxs: Vec<_> = pubs.iter().map(|p| p.subscribe()).collect();
    let mut burst = [0u32; 3];
    let mut ix = KvIndexer::new();
    let (mut replays, mut dumps) = (0, 0);
    for _ in 0..3000 {
        let w = rng.below(3) as usize;
        let p = &pubs[w];
        let (held, _) = p.dump();
        if rng.below(3) == 0 && !held.blocks.is_empty() {
            let b = held.blocks[rng.below(held.blocks.len() as u64) as usize];
            p.emit(KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: vec![b.block_hash],
            }));
        } else {
            // Prompts over a 2-token alphabet share prefixes a lot.
            let n = 4 * (1 + rng.below(4) as usize);
            let toks: Vec<u32> = (0..n).map(|_| rng.below(2) as u32).collect();
            let blocks: Vec<_> = block_hashes(&toks, 4)
                .into_iter()
                .map(|(l, s)| KvCacheStoredBlockData {
                    block_hash: s,
                    tokens_hash: l,
                })
                .collect();
            p.emit(KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: None,
                start_position: None,
                blocks,
            }));
        }
        if rng.below(150) == 0 {
            burst[w] = 12; // longer than the replay buffer
        }
        while let Ok(e) = rxs[w].try_recv() {
            if burst[w] > 0 {
                burst[w] -= 1;
                continue;
            }
            if rng.below(20) == 0 {
                continue; // lost in transit
            }
            if let Ok(ApplyOutcome::Gap(gap)) = ix.apply_event(RouterEvent::new(w as u64, e)) {
                if heal(&mut ix, w as u64, p, gap.expected) {
                    replays += 1;
                } else {
                    dumps += 1;
                }
            }
        }
    }
    // A lost tail shows up only with the next event; the serving layer's resubscribe catches
    // it, here an explicit check does.
    for (w, p) in pubs.iter().enumerate() {
        let last = ix.last_event_id(w as u64).unwrap_or(0);
        if last < p.last_event_id() {
            heal(&mut ix, w as u64, p, last + 1);
        }
    }
    assert!(
        replays > 10 && dumps > 2,
        "replays {replays}, dumps {dumps}"
    );
    let worker_dumps: Vec<_> = pubs.iter().map(|p| p.dump().0).collect();
    let expected =
        KvIndexer::from_dumps(worker_dumps.iter().enumerate().map(|(w, d)| (w as u64, d)));
    ix.tree().check_invariants().unwrap();
    let (got, want) = (ix.snapshot(), expected.snapshot());
    assert_eq!(got, want, "{:?}", got.diff(&want));
    assert!(want.total_blocks() > 0);
}
