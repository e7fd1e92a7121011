//! [`KvRouter`]: the index, the load tracker and the selector behind one thread-safe handle,
//! which is what the serving layer holds.
//!
//! Locks: the index is behind an `RwLock` (events write, lookups read) and is never held
//! together with anything else. The load of the requests in flight ([`ActiveSequences`]) is in
//! sharded maps and the selector's random and round-robin state in atomics, so concurrent
//! requests route without a lock over the whole: each reads the loads, chooses, and adds its
//! own (two requests at the same instant may both choose by the loads before either's, as two
//! router replicas may).

use std::sync::{Mutex, MutexGuard, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Instant;

use crate::config::KvRouterConfig;
use crate::indexer::approx::ApproxIndexer;
use crate::indexer::{ApplyOutcome, IndexerError, KvIndexer, ResyncOutcome};
use crate::metrics;
use crate::protocols::{
    sequence_hashes, KvCacheEvent, KvStoredDump, LocalBlockHash, OverlapScores, RouterEvent,
    WorkerId,
};
use crate::replica::{LoadEvent, LoadSink};
use crate::scheduling::{SelectError, SelectOptions, Selection, WorkerInfo, WorkerSelector};
use crate::sequences::{ActiveSequences, LoadSource, NewRequest, SequenceError, WorkerLoad};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RouteError {
    #[error(transparent)]
    Select(#[from] SelectError),
    #[error(transparent)]
    Sequence(#[from] SequenceError),
}

/// The KV-aware router state of one router process.
pub struct KvRouter {
    config: KvRouterConfig,
    indexer: RwLock<KvIndexer>,
    /// Present when `use_kv_events` is off: overlaps then come from the router's own decisions.
    approx: Option<Mutex<ApproxIndexer>>,
    sequences: ActiveSequences,
    selector: WorkerSelector,
    /// Where this router's load changes go for its peer replicas (`--router-replica-sync`).
    sink: OnceLock<LoadSink>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves the data consistent before anything can panic, so a
    // poisoned lock is still usable; failing all routing after one panic would be worse.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl KvRouter {
    /// `seed` makes random choices reproducible (tests); `None` in production.
    pub fn new(config: KvRouterConfig, seed: Option<u64>) -> Self {
        Self {
            indexer: RwLock::new(KvIndexer::new()),
            approx: (!config.use_kv_events).then(|| Mutex::new(ApproxIndexer::new(&config))),
            sequences: ActiveSequences::new(&config),
            selector: WorkerSelector::new(config.clone(), seed),
            sink: OnceLock::new(),
            config,
        }
    }

    /// Sends this router's load changes to `sink` from now on (once; false if already set).
    pub fn set_load_sink(&self, sink: LoadSink) -> bool {
        self.sink.set(sink).is_ok()
    }

    fn emit(&self, event: impl FnOnce() -> LoadEvent) {
        if let Some(sink) = self.sink.get() {
            sink(event());
        }
    }

    pub fn config(&self) -> &KvRouterConfig {
        &self.config
    }

    fn index_read(&self) -> RwLockReadGuard<'_, KvIndexer> {
        self.indexer.read().unwrap_or_else(|e| e.into_inner())
    }

    fn index_write(&self) -> RwLockWriteGuard<'_, KvIndexer> {
        self.indexer.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Prefix overlap of a request with every worker.
    pub fn find_matches(&self, local_hashes: &[LocalBlockHash]) -> OverlapScores {
        if let Some(a) = &self.approx {
            return lock(a).find_matches(local_hashes);
        }
        self.index_read().find_matches(local_hashes)
    }

    /// Chooses a worker without recording the request (e.g. to preview, or when the caller
    /// tracks load elsewhere).
    pub fn select(
        &self,
        local_hashes: &[LocalBlockHash],
        isl_tokens: usize,
        candidates: &[WorkerInfo],
        opts: &SelectOptions,
    ) -> Result<Selection, SelectError> {
        let overlaps = self.find_matches(local_hashes);
        self.selector.select(
            local_hashes,
            isl_tokens,
            candidates,
            &overlaps,
            &self.sequences,
            opts,
        )
    }

    /// Chooses a worker and records the request on it (AddRequest), atomically with respect
    /// to other routing decisions. Records the KV hit rate and the worker's load gauges.
    pub fn route(
        &self,
        request_id: &str,
        local_hashes: &[LocalBlockHash],
        isl_tokens: usize,
        candidates: &[WorkerInfo],
        opts: &SelectOptions,
    ) -> Result<Selection, RouteError> {
        let overlaps = self.find_matches(local_hashes);
        let seq_hashes = sequence_hashes(local_hashes);
        let seqs = &self.sequences;
        let sel =
            self.selector
                .select(local_hashes, isl_tokens, candidates, &overlaps, seqs, opts)?;
        let block_size = candidates
            .iter()
            .find(|w| w.id == sel.worker_id)
            .map_or(0, |w| w.block_size);
        seqs.add_request(NewRequest {
            request_id,
            worker_id: sel.worker_id,
            seq_hashes: &seq_hashes,
            isl_tokens,
            overlap_blocks: sel.overlap_blocks,
            block_size,
        })?;
        self.emit(|| LoadEvent::AddRequest {
            request_id: request_id.to_string(),
            worker_id: sel.worker_id,
            seq_hashes,
            isl_tokens,
            overlap_blocks: sel.overlap_blocks,
            block_size,
        });
        metrics::record_worker_load(sel.worker_id, &seqs.load(sel.worker_id));
        if let Some(a) = &self.approx {
            lock(a).record_routing(sel.worker_id, local_hashes, Instant::now());
        }
        metrics::record_kv_hit(sel.overlap_blocks, local_hashes.len(), block_size);
        Ok(sel)
    }

    /// True when every candidate is saturated (see [`WorkerSelector::is_saturated`]): the
    /// caller should queue the request and retry when load drops (after a `free` or
    /// `mark_prefill_completed`) rather than route it now.
    pub fn should_queue(&self, candidates: &[WorkerInfo]) -> bool {
        !candidates.is_empty()
            && candidates
                .iter()
                .all(|w| self.selector.is_saturated(w, &self.sequences.load(w.id)))
    }

    /// First token seen: the request's prefill load ends.
    pub fn mark_prefill_completed(&self, request_id: &str) -> bool {
        let Some(worker) = self.sequences.mark_prefill_completed(request_id) else {
            return false;
        };
        self.emit(|| LoadEvent::MarkPrefillCompleted {
            request_id: request_id.to_string(),
        });
        metrics::record_worker_load(worker, &self.sequences.load(worker));
        true
    }

    /// The request ended (finished, failed, cancelled): its load goes.
    pub fn free(&self, request_id: &str) -> bool {
        let Some(worker) = self.sequences.free(request_id) else {
            return false;
        };
        self.emit(|| LoadEvent::Free {
            request_id: request_id.to_string(),
        });
        metrics::record_worker_load(worker, &self.sequences.load(worker));
        true
    }

    /// Frees requests older than `active_request_expiry_secs`; call periodically.
    pub fn expire_stale(&self) -> Vec<String> {
        let gone = self.sequences.expire_stale(Instant::now());
        for id in &gone {
            self.emit(|| LoadEvent::Free {
                request_id: id.clone(),
            });
        }
        gone
    }

    /// Announces every request this router has in flight (a [`LoadEvent::Live`]); call every
    /// few seconds when replicas sync. A request routed while the list is made may be missing
    /// from it: a peer drops a request only when two lists in a row lack it.
    pub fn announce_live(&self) {
        self.emit(|| LoadEvent::Live {
            request_ids: self.sequences.local_request_ids(),
        });
    }

    /// Applies a load change of the peer replica `peer`.
    pub fn apply_peer(&self, peer: u64, event: LoadEvent) {
        let seqs = &self.sequences;
        let worker = match &event {
            LoadEvent::AddRequest {
                request_id,
                worker_id,
                seq_hashes,
                isl_tokens,
                overlap_blocks,
                block_size,
            } => {
                let req = NewRequest {
                    request_id,
                    worker_id: *worker_id,
                    seq_hashes,
                    isl_tokens: *isl_tokens,
                    overlap_blocks: *overlap_blocks,
                    block_size: *block_size,
                };
                seqs.add_peer_request(peer, req, Instant::now())
                    .then_some(*worker_id)
            }
            LoadEvent::MarkPrefillCompleted { request_id } => {
                seqs.mark_peer_prefill_completed(peer, request_id)
            }
            LoadEvent::Free { request_id } => seqs.free_peer(peer, request_id),
            LoadEvent::Live { request_ids } => {
                let live = request_ids.iter().map(String::as_str).collect();
                let dropped = seqs.retain_peer(peer, &live);
                if dropped > 0 {
                    tracing::info!(peer, dropped, "a peer router's lost request ends healed");
                }
                None
            }
        };
        if let Some(w) = worker {
            metrics::record_worker_load(w, &seqs.load(w));
        }
    }

    /// A peer replica left or fell silent: its requests' load goes. Returns how many.
    pub fn remove_peer(&self, peer: u64) -> usize {
        let n = self.sequences.remove_peer(peer);
        for (w, load) in self.sequences.loads() {
            metrics::record_worker_load(w, &load);
        }
        n
    }

    pub fn worker_load(&self, worker: WorkerId) -> WorkerLoad {
        self.sequences.load(worker)
    }

    /// A worker left discovery: drop its blocks and its requests. Returns the freed request ids.
    pub fn remove_worker(&self, worker: WorkerId) -> Vec<String> {
        self.index_write().remove_worker(worker);
        if let Some(a) = &self.approx {
            lock(a).remove_worker(worker);
        }
        self.sequences.remove_worker(worker)
    }

    pub fn apply_event(&self, ev: RouterEvent) -> Result<ApplyOutcome, IndexerError> {
        self.index_write().apply_event(ev)
    }

    pub fn apply_replay(
        &self,
        worker: WorkerId,
        events: Vec<KvCacheEvent>,
    ) -> Result<ResyncOutcome, IndexerError> {
        self.index_write().apply_replay(worker, events)
    }

    pub fn apply_dump(&self, worker: WorkerId, dump: &KvStoredDump) -> ResyncOutcome {
        self.index_write().apply_dump(worker, dump)
    }

    /// Read access to the index (dumps, snapshots, last event ids).
    pub fn with_indexer<R>(&self, f: impl FnOnce(&KvIndexer) -> R) -> R {
        f(&self.index_read())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RouterMode;
    use crate::protocols::{
        block_hashes, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData,
    };

    fn workers() -> Vec<WorkerInfo> {
        [1, 2]
            .map(|id| WorkerInfo {
                id,
                total_blocks: 1000,
                max_num_batched_tokens: 2048,
                block_size: 4,
            })
            .to_vec()
    }

    fn stored(tokens: &[u32]) -> KvCacheEventData {
        KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: None,
            start_position: None,
            blocks: block_hashes(tokens, 4)
                .into_iter()
                .map(|(l, s)| KvCacheStoredBlockData {
                    block_hash: s,
                    tokens_hash: l,
                })
                .collect(),
        })
    }

    fn event(worker: WorkerId, id: u64, data: KvCacheEventData) -> RouterEvent {
        RouterEvent::new(
            worker,
            KvCacheEvent {
                event_id: id,
                data,
                dp_rank: 0,
            },
        )
    }

    #[test]
    fn routes_to_the_cache_holder_then_follows_eviction() {
        let cfg = KvRouterConfig {
            router_mode: RouterMode::Kv,
            ..Default::default()
        };
        let r = KvRouter::new(cfg, Some(1));
        let prompt: Vec<u32> = (0..64).collect();
        r.apply_event(event(2, 1, stored(&prompt))).unwrap();
        let locals = crate::protocols::request_block_hashes(&prompt, 4, None);
        let sel = r
            .route("a", &locals, 64, &workers(), &SelectOptions::default())
            .unwrap();
        assert_eq!((sel.worker_id, sel.cached_tokens), (2, 64));
        assert_eq!(r.worker_load(2).active_requests, 1);
        assert_eq!(
            r.route("a", &locals, 64, &workers(), &SelectOptions::default()),
            Err(RouteError::Sequence(SequenceError::DuplicateRequest(
                "a".into()
            )))
        );
        assert!(r.mark_prefill_completed("a"));
        assert!(r.free("a"));
        assert_eq!(r.worker_load(2), WorkerLoad::default());
        // The worker evicts the prefix: the next request goes to the emptier worker 1.
        let first = block_hashes(&prompt, 4)[0].1;
        r.apply_event(event(
            2,
            2,
            KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: vec![first],
            }),
        ))
        .unwrap();
        let sel = r
            .select(&locals, 64, &workers(), &SelectOptions::default())
            .unwrap();
        assert_eq!(sel.overlap_blocks, 0);
        assert_eq!(r.with_indexer(|ix| ix.last_event_id(2)), Some(2));
        assert!(r.remove_worker(2).is_empty());
        assert!(r.expire_stale().is_empty());
    }

    #[test]
    fn queue_when_every_worker_is_saturated() {
        let cfg = KvRouterConfig {
            router_mode: RouterMode::RoundRobin,
            router_queue_threshold: Some(0.01),
            ..Default::default()
        };
        let r = KvRouter::new(cfg, Some(1));
        let ws = workers();
        assert!(!r.should_queue(&ws));
        // 64 prompt tokens each > 0.01 × 2048 = 20.48.
        let locals: Vec<LocalBlockHash> = (1..=16).map(LocalBlockHash).collect();
        r.route("a", &locals, 64, &ws, &SelectOptions::default())
            .unwrap();
        assert!(!r.should_queue(&ws), "one worker is still free");
        r.route("b", &locals, 64, &ws, &SelectOptions::default())
            .unwrap();
        assert!(r.should_queue(&ws));
        r.mark_prefill_completed("a");
        assert!(!r.should_queue(&ws));
        assert!(!r.should_queue(&[]));
    }

    #[test]
    fn a_replica_sees_its_peers_load_and_queues_on_it() {
        let cfg = KvRouterConfig {
            router_mode: RouterMode::RoundRobin,
            router_queue_threshold: Some(0.01),
            ..Default::default()
        };
        let a = KvRouter::new(cfg.clone(), Some(1));
        let b = KvRouter::new(cfg, Some(1));
        let sent = std::sync::Arc::new(Mutex::new(Vec::new()));
        let to = sent.clone();
        assert!(a.set_load_sink(Box::new(move |ev| lock(&to).push(ev))));
        assert!(!a.set_load_sink(Box::new(|_| {})), "the sink is set once");
        let ws = workers();
        let locals: Vec<LocalBlockHash> = (1..=16).map(LocalBlockHash).collect();
        a.route("a", &locals, 64, &ws, &SelectOptions::default())
            .unwrap();
        a.route("b", &locals, 64, &ws, &SelectOptions::default())
            .unwrap();
        let deliver = |b: &KvRouter| {
            for ev in lock(&sent).drain(..) {
                b.apply_peer(7, ev);
            }
        };
        deliver(&b);
        // Both workers are saturated by the peer's two requests: b queues too.
        assert!(b.should_queue(&ws));
        assert_eq!(b.worker_load(1).active_requests, 1);
        a.mark_prefill_completed("a");
        deliver(&b);
        assert!(!b.should_queue(&ws));
        // A lost Free heals with the lists of what the peer has in flight: "a" was added
        // before any list, so the second list without it drops it.
        a.free("a");
        lock(&sent).clear();
        a.announce_live();
        assert_eq!(
            lock(&sent).last(),
            Some(&LoadEvent::Live {
                request_ids: vec!["b".into()]
            })
        );
        deliver(&b);
        assert_eq!(
            b.worker_load(1).active_requests + b.worker_load(2).active_requests,
            2,
            "one list may be older than a request"
        );
        a.announce_live();
        deliver(&b);
        assert_eq!(
            b.worker_load(1).active_requests + b.worker_load(2).active_requests,
            1
        );
        // The peer leaves: its load goes with it; b's own requests never travel back.
        assert_eq!(b.remove_peer(7), 1);
        assert_eq!(b.worker_load(1), WorkerLoad::default());
        assert_eq!(b.worker_load(2), WorkerLoad::default());
    }

    #[test]
    fn router_is_shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<KvRouter>();
    }

    #[test]
    fn approximate_mode_follows_its_own_decisions() {
        let cfg = KvRouterConfig {
            router_mode: RouterMode::Kv,
            use_kv_events: false,
            ..Default::default()
        };
        let r = KvRouter::new(cfg, Some(3));
        let locals: Vec<LocalBlockHash> = (1..=16).map(LocalBlockHash).collect();
        let first = r
            .route("a", &locals, 64, &workers(), &SelectOptions::default())
            .unwrap();
        assert_eq!(first.overlap_blocks, 0);
        r.free("a");
        // Events are not used for matching in this mode ...
        r.apply_event(event(3, 1, stored(&(0..64).collect::<Vec<u32>>())))
            .unwrap();
        // ... the prediction is: the same prompt follows the first decision.
        let again = r
            .route("b", &locals, 64, &workers(), &SelectOptions::default())
            .unwrap();
        assert_eq!(
            (again.worker_id, again.overlap_blocks),
            (first.worker_id, 16)
        );
    }
}
