//! The publisher that numbers, buffers and broadcasts the engine's KV cache events (their
//! types live in the leaf crate `tandem-kv-protocol`, shared with the router). `event_id` is
//! monotonic per engine, starting at 1, with no gaps.
//!
//! A subscriber that (re)connects can [`KvEventPublisher::subscribe_from`] an `event_id` still in
//! the bounded replay buffer, or take a [`KvEventPublisher::dump`] of every stored block and then
//! follow the live stream from the dump's `last_event_id`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::broadcast;

pub use tandem_kv_protocol::events::{
    KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData,
    KvStoredDump, ReplayGap, StoredBlock,
};
use tandem_kv_protocol::ExternalSequenceBlockHash;

struct Inner {
    next_id: u64,
    buffer: VecDeque<KvCacheEvent>,
    max_buffer: usize,
    // Mirror of the stored set, so a dump never has to stop the engine thread.
    stored: HashMap<ExternalSequenceBlockHash, (u64, StoredBlock)>,
    order: BTreeMap<u64, ExternalSequenceBlockHash>,
    next_order: u64,
}

/// Numbers, buffers and broadcasts KV events. Cheap to clone; the engine thread emits, the
/// worker subscribes.
#[derive(Clone)]
pub struct KvEventPublisher {
    inner: Arc<Mutex<Inner>>,
    tx: broadcast::Sender<KvCacheEvent>,
    dp_rank: u32,
}

impl KvEventPublisher {
    /// `max_buffer` is `kv_cache_config.event_buffer_max_size` (0 keeps no replay history);
    /// the live broadcast channel holds at least that many events for slow subscribers.
    pub fn new(max_buffer: usize, dp_rank: u32) -> Self {
        let (tx, _) = broadcast::channel(max_buffer.max(1024));
        Self {
            inner: Arc::new(Mutex::new(Inner {
                next_id: 1,
                buffer: VecDeque::new(),
                max_buffer,
                stored: HashMap::new(),
                order: BTreeMap::new(),
                next_order: 0,
            })),
            tx,
            dp_rank,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves consistent-enough data (each mutation is
        // completed before anything can panic), so recover rather than propagate the poison.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Numbers and publishes one event; returns its id.
    pub fn emit(&self, data: KvCacheEventData) -> u64 {
        let mut g = self.lock();
        let id = g.next_id;
        g.next_id += 1;
        match &data {
            KvCacheEventData::Stored(s) => {
                let mut parent = s.parent_hash;
                for b in &s.blocks {
                    let ord = g.next_order;
                    g.next_order += 1;
                    let blk = StoredBlock {
                        parent_hash: parent,
                        block_hash: b.block_hash,
                        tokens_hash: b.tokens_hash,
                    };
                    if let Some((old, _)) = g.stored.insert(b.block_hash, (ord, blk)) {
                        g.order.remove(&old);
                    }
                    g.order.insert(ord, b.block_hash);
                    parent = Some(b.block_hash);
                }
            }
            KvCacheEventData::Removed(r) => {
                for h in &r.block_hashes {
                    if let Some((ord, _)) = g.stored.remove(h) {
                        g.order.remove(&ord);
                    }
                }
            }
            KvCacheEventData::Cleared => {
                g.stored.clear();
                g.order.clear();
            }
        }
        let ev = KvCacheEvent {
            event_id: id,
            data,
            dp_rank: self.dp_rank,
        };
        if g.max_buffer > 0 {
            if g.buffer.len() == g.max_buffer {
                g.buffer.pop_front();
            }
            g.buffer.push_back(ev.clone());
        }
        // Sending under the lock keeps the buffer and the live stream in one order.
        let _ = self.tx.send(ev);
        id
    }

    /// Live events from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<KvCacheEvent> {
        self.tx.subscribe()
    }

    /// Buffered events with `event_id >= from`, plus the live stream continuing right after
    /// them (no gap, no duplicate).
    pub fn subscribe_from(
        &self,
        from: u64,
    ) -> Result<(Vec<KvCacheEvent>, broadcast::Receiver<KvCacheEvent>), ReplayGap> {
        let g = self.lock();
        if from < g.next_id {
            let oldest = g.buffer.front().map(|e| e.event_id).unwrap_or(g.next_id);
            if from < oldest {
                return Err(ReplayGap {
                    requested: from,
                    oldest,
                });
            }
        }
        let replay = g
            .buffer
            .iter()
            .filter(|e| e.event_id >= from)
            .cloned()
            .collect();
        Ok((replay, self.tx.subscribe()))
    }

    /// Every stored block, with the id of the last event it reflects, plus the live stream
    /// continuing right after that id.
    pub fn dump(&self) -> (KvStoredDump, broadcast::Receiver<KvCacheEvent>) {
        let g = self.lock();
        let blocks = g
            .order
            .values()
            .filter_map(|h| g.stored.get(h).map(|(_, b)| *b))
            .collect();
        let dump = KvStoredDump {
            last_event_id: g.next_id - 1,
            blocks,
        };
        (dump, self.tx.subscribe())
    }

    /// Id of the last event emitted (0 before any).
    pub fn last_event_id(&self) -> u64 {
        self.lock().next_id - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use tandem_kv_protocol::LocalBlockHash;

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
    fn ids_are_monotonic_and_replay_is_bounded() {
        let p = KvEventPublisher::new(2, 0);
        let mut rx = p.subscribe();
        assert_eq!(p.emit(stored(None, &[1])), 1);
        assert_eq!(p.emit(stored(Some(1), &[2])), 2);
        assert_eq!(p.emit(KvCacheEventData::Cleared), 3);
        for want in 1..=3 {
            assert_eq!(rx.try_recv().unwrap().event_id, want);
        }
        let (replay, mut live) = p.subscribe_from(2).unwrap();
        assert_eq!(
            replay.iter().map(|e| e.event_id).collect::<Vec<_>>(),
            vec![2, 3]
        );
        assert_eq!(
            p.subscribe_from(1).unwrap_err(),
            ReplayGap {
                requested: 1,
                oldest: 2
            }
        );
        p.emit(stored(None, &[9]));
        assert_eq!(live.try_recv().unwrap().event_id, 4);
        // Asking for the future is not a gap: nothing to replay yet.
        assert!(p.subscribe_from(5).unwrap().0.is_empty());
    }

    #[test]
    fn dump_mirrors_stored_blocks_in_order() {
        let p = KvEventPublisher::new(0, 0);
        p.emit(stored(None, &[1, 2, 3]));
        p.emit(KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: vec![ExternalSequenceBlockHash(3)],
        }));
        p.emit(stored(Some(2), &[4]));
        let (d, _) = p.dump();
        assert_eq!(d.last_event_id, 3);
        let hs: Vec<_> = d
            .blocks
            .iter()
            .map(|b| (b.parent_hash.map(|h| h.0), b.block_hash.0))
            .collect();
        assert_eq!(hs, vec![(None, 1), (Some(1), 2), (Some(2), 4)]);
        p.emit(KvCacheEventData::Cleared);
        assert!(p.dump().0.blocks.is_empty());
    }
}
