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

use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

use crate::config::KvRouterConfig;
use crate::protocols::{ExternalSequenceBlockHash, WorkerId};

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
}

/// Active requests of every worker.
pub struct ActiveSequences {
    workers: FxHashMap<WorkerId, WorkerSeqs>,
    /// This router's own requests.
    requests: FxHashMap<String, Entry>,
    /// Peer router replicas' requests, by the peer's id.
    peers: FxHashMap<u64, FxHashMap<String, Entry>>,
    track_blocks: bool,
    track_prefill: bool,
    assume_reuse: bool,
    expiry: Duration,
}

impl ActiveSequences {
    pub fn new(config: &KvRouterConfig) -> Self {
        Self {
            workers: FxHashMap::default(),
            requests: FxHashMap::default(),
            peers: FxHashMap::default(),
            track_blocks: config.router_track_active_blocks,
            track_prefill: config.router_track_prefill_tokens,
            assume_reuse: config.router_assume_kv_reuse,
            expiry: Duration::from_secs(config.active_request_expiry_secs),
        }
    }

    /// Records a routed request (AddRequest).
    pub fn add_request(&mut self, req: NewRequest<'_>) -> Result<(), SequenceError> {
        self.add_request_at(req, Instant::now())
    }

    pub fn add_request_at(
        &mut self,
        req: NewRequest<'_>,
        now: Instant,
    ) -> Result<(), SequenceError> {
        if self.requests.contains_key(req.request_id) {
            return Err(SequenceError::DuplicateRequest(req.request_id.to_string()));
        }
        let entry = self.enter(&req, now);
        self.requests.insert(req.request_id.to_string(), entry);
        Ok(())
    }

    /// Counts the load of a request a peer router replica routed. Returns false (and changes
    /// nothing) when the peer already has a request of that id.
    pub fn add_peer_request(&mut self, peer: u64, req: NewRequest<'_>, now: Instant) -> bool {
        if self
            .peers
            .get(&peer)
            .is_some_and(|m| m.contains_key(req.request_id))
        {
            return false;
        }
        let entry = self.enter(&req, now);
        self.peers
            .entry(peer)
            .or_default()
            .insert(req.request_id.to_string(), entry);
        true
    }

    /// Adds a request's load to its worker and returns the entry that undoes it.
    fn enter(&mut self, req: &NewRequest<'_>, now: Instant) -> Entry {
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
        let w = self.workers.entry(req.worker_id).or_default();
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
        }
    }

    /// The request's prompt is computed (first token seen): its prefill load ends. Returns
    /// false for an unknown request.
    pub fn mark_prefill_completed(&mut self, request_id: &str) -> bool {
        let Some(e) = self.requests.get_mut(request_id) else {
            return false;
        };
        complete_prefill(&mut self.workers, e);
        true
    }

    /// The request ended: all its load goes. Returns false for an unknown request (freeing
    /// twice is harmless).
    pub fn free(&mut self, request_id: &str) -> bool {
        let Some(e) = self.requests.remove(request_id) else {
            return false;
        };
        self.release(e);
        true
    }

    /// A peer's request reached its first token. False when unknown.
    pub fn mark_peer_prefill_completed(&mut self, peer: u64, request_id: &str) -> bool {
        let Some(e) = self
            .peers
            .get_mut(&peer)
            .and_then(|m| m.get_mut(request_id))
        else {
            return false;
        };
        complete_prefill(&mut self.workers, e);
        true
    }

    /// A peer's request ended. False when unknown.
    pub fn free_peer(&mut self, peer: u64, request_id: &str) -> bool {
        let Some(m) = self.peers.get_mut(&peer) else {
            return false;
        };
        let Some(e) = m.remove(request_id) else {
            return false;
        };
        if m.is_empty() {
            self.peers.remove(&peer);
        }
        self.release(e);
        true
    }

    /// Keeps only the peer's requests in `live` (the peer's own list of what it has in
    /// flight); returns how many were dropped (their end never reached this router).
    pub fn retain_peer(&mut self, peer: u64, live: &rustc_hash::FxHashSet<&str>) -> usize {
        let Some(m) = self.peers.get_mut(&peer) else {
            return 0;
        };
        let gone: Vec<String> = m
            .keys()
            .filter(|id| !live.contains(id.as_str()))
            .cloned()
            .collect();
        for id in &gone {
            self.free_peer(peer, id);
        }
        gone.len()
    }

    /// A peer left (or fell silent): all its requests' load goes. Returns how many.
    pub fn remove_peer(&mut self, peer: u64) -> usize {
        let Some(m) = self.peers.remove(&peer) else {
            return 0;
        };
        let n = m.len();
        for e in m.into_values() {
            self.release(e);
        }
        n
    }

    /// The peers with requests counted here (a peer with none is not listed).
    pub fn peer_ids(&self) -> Vec<u64> {
        self.peers.keys().copied().collect()
    }

    /// This router's own requests in flight.
    pub fn local_request_ids(&self) -> Vec<String> {
        self.requests.keys().cloned().collect()
    }

    /// Frees requests added more than the expiry ago; returns this router's own (peers'
    /// stale requests go too, uncounted: their router reports its own).
    pub fn expire_stale(&mut self, now: Instant) -> Vec<String> {
        let expiry = self.expiry;
        let stale = |m: &FxHashMap<String, Entry>| -> Vec<String> {
            m.iter()
                .filter(|(_, e)| now.saturating_duration_since(e.started) > expiry)
                .map(|(id, _)| id.clone())
                .collect()
        };
        let own = stale(&self.requests);
        for id in &own {
            self.free(id);
        }
        let peers: Vec<(u64, Vec<String>)> =
            self.peers.iter().map(|(&p, m)| (p, stale(m))).collect();
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
    pub fn remove_worker(&mut self, worker: WorkerId) -> Vec<String> {
        let on_worker = |m: &FxHashMap<String, Entry>| -> Vec<String> {
            m.iter()
                .filter(|(_, e)| e.worker == worker)
                .map(|(id, _)| id.clone())
                .collect()
        };
        let ids = on_worker(&self.requests);
        for id in &ids {
            self.requests.remove(id);
        }
        for m in self.peers.values_mut() {
            for id in on_worker(m) {
                m.remove(&id);
            }
        }
        self.peers.retain(|_, m| !m.is_empty());
        self.workers.remove(&worker);
        ids
    }

    /// Worker of a peer's active request.
    pub fn worker_of_peer(&self, peer: u64, request_id: &str) -> Option<WorkerId> {
        self.peers.get(&peer)?.get(request_id).map(|e| e.worker)
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
        let mut v: Vec<_> = self.workers.iter().map(|(&w, s)| (w, s.load())).collect();
        v.sort_unstable_by_key(|(w, _)| *w);
        v
    }

    fn release(&mut self, e: Entry) {
        let Some(w) = self.workers.get_mut(&e.worker) else {
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
}

/// Ends a request's prefill load on its worker.
fn complete_prefill(workers: &mut FxHashMap<WorkerId, WorkerSeqs>, e: &mut Entry) {
    if let Some(w) = workers.get_mut(&e.worker) {
        w.prefill_tokens = w.prefill_tokens.saturating_sub(e.prefill_tokens);
    }
    e.prefill_tokens = 0;
}

impl LoadSource for ActiveSequences {
    fn load(&self, worker: WorkerId) -> WorkerLoad {
        self.workers
            .get(&worker)
            .map(WorkerSeqs::load)
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
        let mut s = ActiveSequences::new(&KvRouterConfig::default());
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
        assert!(s.mark_prefill_completed("a"));
        assert_eq!(s.load(1).active_prefill_tokens, 8);
        assert!(s.free("a"));
        assert!(!s.free("a"), "double free is a no-op");
        assert!(!s.mark_prefill_completed("a"));
        assert_eq!(s.load(1).active_decode_blocks, 2);
        assert!(s.free("b"));
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
        let mut s = ActiveSequences::new(&cfg);
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
        let mut s = ActiveSequences::new(&cfg);
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
        let mut s = ActiveSequences::new(&cfg);
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
        let mut s = ActiveSequences::new(&KvRouterConfig::default());
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
        assert!(!s.free("x"));
        assert!(s.mark_peer_prefill_completed(7, "x"));
        assert_eq!(s.load(1).active_prefill_tokens, 8);
        assert!(!s.mark_peer_prefill_completed(9, "x"));
        // The peer's list of what it has in flight drops the ones whose end was lost.
        let live: rustc_hash::FxHashSet<&str> = ["y"].into_iter().collect();
        assert_eq!(s.retain_peer(7, &live), 1);
        assert_eq!(s.load(1).active_requests, 2);
        assert!(s.free_peer(8, "x"));
        assert!(!s.free_peer(8, "x"));
        assert_eq!(s.load(2), WorkerLoad::default());
        // A peer that leaves takes its load; this router's stays.
        assert_eq!(s.remove_peer(7), 1);
        assert_eq!(s.remove_peer(7), 0);
        assert_eq!(s.local_request_ids(), vec!["mine".to_string()]);
        assert!(s.free("mine"));
        assert_eq!(s.load(1), WorkerLoad::default());
        assert!(s.peer_ids().is_empty());
    }

    #[test]
    fn peers_requests_expire_and_leave_with_their_worker() {
        let cfg = KvRouterConfig {
            active_request_expiry_secs: 60,
            ..Default::default()
        };
        let mut s = ActiveSequences::new(&cfg);
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
        assert!(!s.free_peer(7, "w2"));
    }
}
