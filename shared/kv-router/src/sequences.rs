//! Per-worker load the router itself has put on each worker: requests in flight, the prompt
//! tokens still to prefill, and the KV blocks those requests occupy.
//!
//! Lifecycle per request: [`ActiveSequences::add_request`] when routed,
//! [`ActiveSequences::mark_prefill_completed`] at the first token, [`ActiveSequences::free`] when
//! it ends (any way). A request whose end was never reported (a lost stream, a router bug) would
//! inflate a worker's load forever, so [`ActiveSequences::expire_stale`] frees requests older
//! than the configured expiry; the serving layer calls it periodically.
//!
//! With `router_assume_kv_reuse`, requests sharing a prefix on one worker share its blocks
//! (counted once, by sequence hash); without it every request's blocks are its own.
//!
//! Router replicas (`--router-replica-sync`) also count each other's requests: a peer's
//! requests are kept apart by the peer's id ([`ActiveSequences::add_peer_request`] and its
//! siblings), so a peer that leaves takes exactly its own load with it
//! ([`ActiveSequences::remove_peer`]), and a peer's list of what it still has in flight drops
//! requests whose end was lost ([`ActiveSequences::retain_peer`]).
//!
//! Concurrency: no lock over the whole. The per-worker loads, the requests and the peers'
//! requests are sharded maps ([`DashMap`]); one request's change takes its request entry, then
//! its worker's entry (always in that order, never the reverse, so two changes cannot wait on
//! each other). Two requests routed at the same instant may both read a worker's load before
//! either is added to it, as two router replicas may: the next request sees both.

use std::time::{Duration, Instant};

use dashmap::mapref::entry::Entry as MapEntry;
use dashmap::DashMap;
use rustc_hash::{FxBuildHasher, FxHashMap, FxHashSet};

use crate::config::KvRouterConfig;
use crate::protocols::{ExternalSequenceBlockHash, WorkerId};

type Map<K, V> = DashMap<K, V, FxBuildHasher>;

/// What the router has in flight on one worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerLoad {
    pub active_requests: usize,
    /// KV blocks held by the worker's active requests (prefix-shared blocks counted once).
    pub active_decode_blocks: usize,
    /// Prompt tokens routed to the worker whose prefill has not completed.
    pub active_prefill_tokens: u64,
}

/// Where the selector reads worker load from ([`ActiveSequences`], or a test double).
pub trait LoadSource {
    fn load(&self, worker: WorkerId) -> WorkerLoad;
    /// How many of these full blocks (by sequence hash) are not already active on `worker`.
    fn new_blocks(&self, worker: WorkerId, seq_hashes: &[ExternalSequenceBlockHash]) -> usize;
}

/// A request being routed to a worker.
#[derive(Debug, Clone, Copy)]
pub struct NewRequest<'a> {
    pub request_id: &'a str,
    pub worker_id: WorkerId,
    /// Sequence hashes of the prompt's full blocks.
    pub seq_hashes: &'a [ExternalSequenceBlockHash],
    pub isl_tokens: usize,
    /// Prompt blocks the worker already has cached (they need no prefill).
    pub overlap_blocks: u32,
    pub block_size: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SequenceError {
    #[error("request {0:?} is already active")]
    DuplicateRequest(String),
}

#[derive(Default)]
struct WorkerSeqs {
    shared: FxHashMap<ExternalSequenceBlockHash, u32>,
    private_blocks: usize,
    prefill_tokens: u64,
    requests: usize,
}

impl WorkerSeqs {
    fn load(&self) -> WorkerLoad {
        WorkerLoad {
            active_requests: self.requests,
            active_decode_blocks: self.shared.len() + self.private_blocks,
            active_prefill_tokens: self.prefill_tokens,
        }
    }
}

struct Entry {
    worker: WorkerId,
    shared: Vec<ExternalSequenceBlockHash>,
    private_blocks: usize,
    /// Outstanding prefill tokens (0 once prefill completed).
    prefill_tokens: u64,
    started: Instant,
    /// A peer's request: how many of the peer's in-flight lists had been applied when it was
    /// added (see [`ActiveSequences::retain_peer`]).
    lists_before: u64,
}

/// A peer router replica's requests.
#[derive(Default)]
struct PeerRequests {
    requests: FxHashMap<String, Entry>,
    /// In-flight lists of the peer applied so far.
    lists: u64,
}

/// Active requests of every worker.
pub struct ActiveSequences {
    workers: Map<WorkerId, WorkerSeqs>,
    /// This router's own requests.
    requests: Map<String, Entry>,
    /// Peer router replicas' requests, by the peer's id.
    peers: Map<u64, PeerRequests>,
    track_blocks: bool,
    track_prefill: bool,
    assume_reuse: bool,
    expiry: Duration,
}

impl ActiveSequences {
    pub fn new(config: &KvRouterConfig) -> Self {
        Self {
            workers: Map::default(),
            requests: Map::default(),
            peers: Map::default(),
            track_blocks: config.router_track_active_blocks,
            track_prefill: config.router_track_prefill_tokens,
            assume_reuse: config.router_assume_kv_reuse,
            expiry: Duration::from_secs(config.active_request_expiry_secs),
        }
    }

    /// Records a routed request (AddRequest).
    pub fn add_request(&self, req: NewRequest<'_>) -> Result<(), SequenceError> {
        self.add_request_at(req, Instant::now())
    }

    pub fn add_request_at(&self, req: NewRequest<'_>, now: Instant) -> Result<(), SequenceError> {
        match self.requests.entry(req.request_id.to_string()) {
            MapEntry::Occupied(_) => {
                Err(SequenceError::DuplicateRequest(req.request_id.to_string()))
            }
            MapEntry::Vacant(slot) => {
                slot.insert(self.enter(&req, now, 0));
                Ok(())
            }
        }
    }

    /// Counts the load of a request a peer router replica routed. Returns false (and changes
    /// nothing) when the peer already has a request of that id.
    pub fn add_peer_request(&self, peer: u64, req: NewRequest<'_>, now: Instant) -> bool {
        let mut p = self.peers.entry(peer).or_default();
        if p.requests.contains_key(req.request_id) {
            return false;
        }
        let entry = self.enter(&req, now, p.lists);
        p.requests.insert(req.request_id.to_string(), entry);
        true
    }

    /// Adds a request's load to its worker and returns the entry that undoes it.
    fn enter(&self, req: &NewRequest<'_>, now: Instant, lists_before: u64) -> Entry {
        let cached = (req.overlap_blocks as usize)
            .saturating_mul(req.block_size as usize)
            .min(req.isl_tokens);
        let prefill_tokens = if self.track_prefill {
            (req.isl_tokens - cached) as u64
        } else {
            0
        };
        let partial = usize::from(
            req.block_size > 0 && !req.isl_tokens.is_multiple_of(req.block_size as usize),
        );
        let mut w = self.workers.entry(req.worker_id).or_default();
        let (shared, private_blocks) = match (self.track_blocks, self.assume_reuse) {
            (false, _) => (Vec::new(), 0),
            (true, true) => {
                for &h in req.seq_hashes {
                    *w.shared.entry(h).or_insert(0) += 1;
                }
                (req.seq_hashes.to_vec(), partial)
            }
            (true, false) => (Vec::new(), req.seq_hashes.len() + partial),
        };
        w.private_blocks += private_blocks;
        w.prefill_tokens += prefill_tokens;
        w.requests += 1;
        Entry {
            worker: req.worker_id,
            shared,
            private_blocks,
            prefill_tokens,
            started: now,
            lists_before,
        }
    }

    /// The request's prompt is computed (first token seen): its prefill load ends. Returns
    /// its worker; `None` for an unknown request.
    pub fn mark_prefill_completed(&self, request_id: &str) -> Option<WorkerId> {
        let (worker, tokens) = {
            let mut e = self.requests.get_mut(request_id)?;
            (e.worker, std::mem::take(&mut e.prefill_tokens))
        };
        self.complete_prefill(worker, tokens);
        Some(worker)
    }

    /// The request ended: all its load goes. Returns its worker; `None` for an unknown
    /// request (freeing twice is harmless).
    pub fn free(&self, request_id: &str) -> Option<WorkerId> {
        let (_, e) = self.requests.remove(request_id)?;
        let worker = e.worker;
        self.release(e);
        Some(worker)
    }

    /// A peer's request reached its first token. Its worker; `None` when unknown.
    pub fn mark_peer_prefill_completed(&self, peer: u64, request_id: &str) -> Option<WorkerId> {
        let (worker, tokens) = {
            let mut p = self.peers.get_mut(&peer)?;
            let e = p.requests.get_mut(request_id)?;
            (e.worker, std::mem::take(&mut e.prefill_tokens))
        };
        self.complete_prefill(worker, tokens);
        Some(worker)
    }

    /// A peer's request ended. Its worker; `None` when unknown.
    pub fn free_peer(&self, peer: u64, request_id: &str) -> Option<WorkerId> {
        let e = self.peers.get_mut(&peer)?.requests.remove(request_id)?;
        self.peers.remove_if(&peer, |_, p| p.requests.is_empty());
        let worker = e.worker;
        self.release(e);
        Some(worker)
    }

    /// Applies the peer's list of what it has in flight (`live`): drops its requests that
    /// are missing from it and were added before the previous list (a request added since
    /// may have been listed by the peer after this list was made: it is only dropped if the
    /// next list lacks it too). Returns how many were dropped (their end never reached this
    /// router).
    pub fn retain_peer(&self, peer: u64, live: &FxHashSet<&str>) -> usize {
        let gone: Vec<Entry> = {
            let Some(mut p) = self.peers.get_mut(&peer) else {
                return 0;
            };
            let before = p.lists;
            p.lists += 1;
            let ids: Vec<String> = p
                .requests
                .iter()
                .filter(|(id, e)| !live.contains(id.as_str()) && e.lists_before < before)
                .map(|(id, _)| id.clone())
                .collect();
            ids.iter().filter_map(|id| p.requests.remove(id)).collect()
        };
        let n = gone.len();
        for e in gone {
            self.release(e);
        }
        n
    }

    /// A peer left (or fell silent): all its requests' load goes. Returns how many.
    pub fn remove_peer(&self, peer: u64) -> usize {
        let Some((_, p)) = self.peers.remove(&peer) else {
            return 0;
        };
        let n = p.requests.len();
        for e in p.requests.into_values() {
            self.release(e);
        }
        n
    }

    /// The peers with requests counted here (a peer with none is not listed).
    pub fn peer_ids(&self) -> Vec<u64> {
        self.peers
            .iter()
            .filter(|p| !p.requests.is_empty())
            .map(|p| *p.key())
            .collect()
    }

    /// This router's own requests in flight.
    pub fn local_request_ids(&self) -> Vec<String> {
        self.requests.iter().map(|e| e.key().clone()).collect()
    }

    /// Frees requests added more than the expiry ago; returns this router's own (peers'
    /// stale requests go too, uncounted: their router reports its own).
    pub fn expire_stale(&self, now: Instant) -> Vec<String> {
        let stale = |e: &Entry| now.saturating_duration_since(e.started) > self.expiry;
        let own: Vec<String> = self
            .requests
            .iter()
            .filter(|e| stale(e.value()))
            .map(|e| e.key().clone())
            .collect();
        let own: Vec<String> = own
            .into_iter()
            .filter(|id| self.free(id).is_some())
            .collect();
        let peers: Vec<(u64, Vec<String>)> = self
            .peers
            .iter()
            .map(|p| {
                let ids = p.requests.iter().filter(|(_, e)| stale(e));
                (*p.key(), ids.map(|(id, _)| id.clone()).collect())
            })
            .collect();
        for (peer, ids) in peers {
            for id in ids {
                self.free_peer(peer, &id);
            }
        }
        if !own.is_empty() {
            tracing::warn!(count = own.len(), "expired stale active requests");
        }
        own
    }

    /// Drops a worker that left, with its requests (peers' too); returns this router's own.
    pub fn remove_worker(&self, worker: WorkerId) -> Vec<String> {
        let mut ids = Vec::new();
        self.requests.retain(|id, e| {
            let keep = e.worker != worker;
            if !keep {
                ids.push(id.clone());
            }
            keep
        });
        for mut p in self.peers.iter_mut() {
            p.requests.retain(|_, e| e.worker != worker);
        }
        self.peers.retain(|_, p| !p.requests.is_empty());
        self.workers.remove(&worker);
        ids
    }

    /// Worker of a peer's active request.
    pub fn worker_of_peer(&self, peer: u64, request_id: &str) -> Option<WorkerId> {
        self.peers
            .get(&peer)?
            .requests
            .get(request_id)
            .map(|e| e.worker)
    }

    /// Worker of an active request.
    pub fn worker_of(&self, request_id: &str) -> Option<WorkerId> {
        self.requests.get(request_id).map(|e| e.worker)
    }

    pub fn active_request_count(&self) -> usize {
        self.requests.len()
    }

    /// Loads of every worker with something in flight.
    pub fn loads(&self) -> Vec<(WorkerId, WorkerLoad)> {
        let mut v: Vec<_> = self.workers.iter().map(|w| (*w.key(), w.load())).collect();
        v.sort_unstable_by_key(|(w, _)| *w);
        v
    }

    fn release(&self, e: Entry) {
        let Some(mut w) = self.workers.get_mut(&e.worker) else {
            return;
        };
        for h in e.shared {
            if let Some(c) = w.shared.get_mut(&h) {
                *c -= 1;
                if *c == 0 {
                    w.shared.remove(&h);
                }
            }
        }
        w.private_blocks = w.private_blocks.saturating_sub(e.private_blocks);
        w.prefill_tokens = w.prefill_tokens.saturating_sub(e.prefill_tokens);
        w.requests = w.requests.saturating_sub(1);
    }

    /// Ends `tokens` of prefill load on `worker`.
    fn complete_prefill(&self, worker: WorkerId, tokens: u64) {
        if let Some(mut w) = self.workers.get_mut(&worker) {
            w.prefill_tokens = w.prefill_tokens.saturating_sub(tokens);
        }
    }
}

impl LoadSource for ActiveSequences {
    fn load(&self, worker: WorkerId) -> WorkerLoad {
        self.workers
            .get(&worker)
            .map(|w| w.load())
            .unwrap_or_default()
    }

    fn new_blocks(&self, worker: WorkerId, seq_hashes: &[ExternalSequenceBlockHash]) -> usize {
        match self.workers.get(&worker) {
            Some(w) if self.assume_reuse => {
                // A sequence hash covers its whole prefix, and every active request registers
                // all its full blocks, so the active blocks of a prompt form a prefix: the
                // first miss ends the scan (O(overlap) instead of O(prompt) per worker).
                let active = seq_hashes
                    .iter()
                    .take_while(|h| w.shared.contains_key(h))
                    .count();
                seq_hashes.len() - active
            }
            _ => seq_hashes.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocols::eh;

    fn req<'a>(
        id: &'a str,
        worker: WorkerId,
        hashes: &'a [ExternalSequenceBlockHash],
        isl: usize,
        overlap: u32,
    ) -> NewRequest<'a> {
        NewRequest {
            request_id: id,
            worker_id: worker,
            seq_hashes: hashes,
            isl_tokens: isl,
            overlap_blocks: overlap,
            block_size: 4,
        }
    }

    #[test]
    fn lifecycle_add_prefill_free() {
        let s = ActiveSequences::new(&KvRouterConfig::default());
        // 10 tokens = 2 full blocks + a partial; 1 block cached → 6 tokens to prefill.
        s.add_request(req("a", 1, &eh(&[11, 12]), 10, 1)).unwrap();
        let l = s.load(1);
        assert_eq!(
            (
                l.active_requests,
                l.active_decode_blocks,
                l.active_prefill_tokens
            ),
            (1, 3, 6)
        );
        // A second request sharing the first block on the same worker shares it.
        s.add_request(req("b", 1, &eh(&[11, 13]), 8, 0)).unwrap();
        assert_eq!(s.load(1).active_decode_blocks, 4);
        assert_eq!(s.load(1).active_prefill_tokens, 14);
        assert_eq!(s.new_blocks(1, &eh(&[11, 12, 99])), 1);
        assert_eq!(s.new_blocks(2, &eh(&[11, 12, 99])), 3);
        assert!(s.mark_prefill_completed("a").is_some());
        assert_eq!(s.load(1).active_prefill_tokens, 8);
        assert!(s.free("a").is_some());
        assert!(s.free("a").is_none(), "double free is a no-op");
        assert!(s.mark_prefill_completed("a").is_none());
        assert_eq!(s.load(1).active_decode_blocks, 2);
        assert!(s.free("b").is_some());
        assert_eq!(s.load(1), WorkerLoad::default());
        assert_eq!(
            s.add_request(req("c", 1, &[], 1, 0))
                .and_then(|_| s.add_request(req("c", 2, &[], 1, 0))),
            Err(SequenceError::DuplicateRequest("c".into()))
        );
    }

    #[test]
    fn without_kv_reuse_blocks_are_not_shared() {
        let cfg = KvRouterConfig {
            router_assume_kv_reuse: false,
            ..Default::default()
        };
        let s = ActiveSequences::new(&cfg);
        s.add_request(req("a", 1, &eh(&[11, 12]), 8, 0)).unwrap();
        s.add_request(req("b", 1, &eh(&[11, 12]), 8, 0)).unwrap();
        assert_eq!(s.load(1).active_decode_blocks, 4);
        assert_eq!(s.new_blocks(1, &eh(&[11, 12])), 2);
        s.free("a");
        s.free("b");
        assert_eq!(s.load(1), WorkerLoad::default());
    }

    #[test]
    fn tracking_switches() {
        let cfg = KvRouterConfig {
            router_track_active_blocks: false,
            router_track_prefill_tokens: false,
            ..Default::default()
        };
        let s = ActiveSequences::new(&cfg);
        s.add_request(req("a", 1, &eh(&[11, 12]), 8, 0)).unwrap();
        let l = s.load(1);
        assert_eq!(
            (
                l.active_requests,
                l.active_decode_blocks,
                l.active_prefill_tokens
            ),
            (1, 0, 0)
        );
    }

    #[test]
    fn stale_requests_expire_and_workers_can_leave() {
        let cfg = KvRouterConfig {
            active_request_expiry_secs: 60,
            ..Default::default()
        };
        let s = ActiveSequences::new(&cfg);
        let t0 = Instant::now();
        s.add_request_at(req("old", 1, &eh(&[1]), 4, 0), t0)
            .unwrap();
        s.add_request_at(req("new", 1, &eh(&[2]), 4, 0), t0 + Duration::from_secs(50))
            .unwrap();
        s.add_request_at(req("other", 2, &eh(&[3]), 4, 0), t0)
            .unwrap();
        let mut gone = s.expire_stale(t0 + Duration::from_secs(61));
        gone.sort();
        assert_eq!(gone, vec!["old".to_string(), "other".to_string()]);
        assert_eq!(s.load(1).active_requests, 1);
        assert_eq!(s.remove_worker(1), vec!["new".to_string()]);
        assert_eq!(s.active_request_count(), 0);
        assert_eq!(s.worker_of("new"), None);
        assert_eq!(s.load(1), WorkerLoad::default());
    }

    #[test]
    fn peers_requests_count_and_leave_with_their_peer() {
        let s = ActiveSequences::new(&KvRouterConfig::default());
        let now = Instant::now();
        s.add_request(req("mine", 1, &eh(&[11]), 4, 0)).unwrap();
        // The same request id from two peers is two requests; a repeat from one is ignored.
        assert!(s.add_peer_request(7, req("x", 1, &eh(&[12]), 4, 0), now));
        assert!(s.add_peer_request(8, req("x", 2, &eh(&[13]), 8, 0), now));
        assert!(!s.add_peer_request(7, req("x", 1, &eh(&[12]), 4, 0), now));
        assert!(s.add_peer_request(7, req("y", 1, &eh(&[14]), 4, 0), now));
        assert_eq!(s.load(1).active_requests, 3);
        assert_eq!(s.load(1).active_prefill_tokens, 12);
        assert_eq!(s.load(2).active_requests, 1);
        // A peer's request never touches this router's own, nor another peer's.
        assert!(s.free("x").is_none());
        assert!(s.mark_peer_prefill_completed(7, "x").is_some());
        assert_eq!(s.load(1).active_prefill_tokens, 8);
        assert!(s.mark_peer_prefill_completed(9, "x").is_none());
        // The peer's lists of what it has in flight drop the ones whose end was lost: a
        // request added since the previous list may be newer than this list, so only the
        // second list without it drops it.
        let live: rustc_hash::FxHashSet<&str> = ["y"].into_iter().collect();
        assert_eq!(s.retain_peer(7, &live), 0);
        assert_eq!(s.load(1).active_requests, 3);
        assert_eq!(s.retain_peer(7, &live), 1);
        assert_eq!(s.load(1).active_requests, 2);
        assert!(s.free_peer(8, "x").is_some());
        assert!(s.free_peer(8, "x").is_none());
        assert_eq!(s.load(2), WorkerLoad::default());
        // A peer that leaves takes its load; this router's stays.
        assert_eq!(s.remove_peer(7), 1);
        assert_eq!(s.remove_peer(7), 0);
        assert_eq!(s.local_request_ids(), vec!["mine".to_string()]);
        assert!(s.free("mine").is_some());
        assert_eq!(s.load(1), WorkerLoad::default());
        assert!(s.peer_ids().is_empty());
    }

    #[test]
    fn concurrent_requests_leave_no_load_behind() {
        let s = ActiveSequences::new(&KvRouterConfig::default());
        std::thread::scope(|scope| {
            for t in 0..4u64 {
                let s = &s;
                scope.spawn(move || {
                    for i in 0..500u64 {
                        let id = format!("{t}-{i}");
                        // Every thread shares its first block with the others on worker i % 3.
                        let hashes = eh(&[1, 100 + t * 1000 + i]);
                        s.add_request(req(&id, i % 3, &hashes, 8, 0)).unwrap();
                        if i % 2 == 0 {
                            s.mark_prefill_completed(&id);
                        }
                        if i % 5 != 4 {
                            s.free(&id);
                        }
                    }
                });
            }
        });
        // 100 of each thread's 500 requests are still in flight.
        assert_eq!(s.active_request_count(), 400);
        let total: usize = s.loads().iter().map(|(_, l)| l.active_requests).sum();
        assert_eq!(total, 400);
        for id in s.local_request_ids() {
            s.free(&id);
        }
        assert!(s.loads().iter().all(|(_, l)| *l == WorkerLoad::default()));
    }

    #[test]
    fn peers_requests_expire_and_leave_with_their_worker() {
        let cfg = KvRouterConfig {
            active_request_expiry_secs: 60,
            ..Default::default()
        };
        let s = ActiveSequences::new(&cfg);
        let t0 = Instant::now();
        assert!(s.add_peer_request(7, req("old", 1, &eh(&[1]), 4, 0), t0));
        assert!(s.add_peer_request(
            7,
            req("w2", 2, &eh(&[2]), 4, 0),
            t0 + Duration::from_secs(30)
        ));
        // Expiry frees a peer's stale request but reports only this router's own.
        assert!(s.expire_stale(t0 + Duration::from_secs(61)).is_empty());
        assert_eq!(s.load(1), WorkerLoad::default());
        assert!(s.remove_worker(2).is_empty());
        assert_eq!(s.load(2), WorkerLoad::default());
        assert!(s.free_peer(7, "w2").is_none());
    }
}
