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
    requests: FxHashMap<String, Entry>,
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
        self.requests.insert(
            req.request_id.to_string(),
            Entry {
                worker: req.worker_id,
                shared,
                private_blocks,
                prefill_tokens,
                started: now,
            },
        );
        Ok(())
    }

    /// The request's prompt is computed (first token seen): its prefill load ends. Returns
    /// false for an unknown request.
    pub fn mark_prefill_completed(&mut self, request_id: &str) -> bool {
        let Some(e) = self.requests.get_mut(request_id) else {
            return false;
        };
        if let Some(w) = self.workers.get_mut(&e.worker) {
            w.prefill_tokens = w.prefill_tokens.saturating_sub(e.prefill_tokens);
        }
        e.prefill_tokens = 0;
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

    /// Frees requests added more than the expiry ago; returns their ids.
    pub fn expire_stale(&mut self, now: Instant) -> Vec<String> {
        let expiry = self.expiry;
        let stale: Vec<String> = self
            .requests
            .iter()
            .filter(|(_, e)| now.saturating_duration_since(e.started) > expiry)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &stale {
            self.free(id);
        }
        if !stale.is_empty() {
            tracing::warn!(count = stale.len(), "expired stale active requests");
        }
        stale
    }

    /// Drops a worker that left, with its requests; returns their ids.
    pub fn remove_worker(&mut self, worker: WorkerId) -> Vec<String> {
        let ids: Vec<String> = self
            .requests
            .iter()
            .filter(|(_, e)| e.worker == worker)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &ids {
            self.requests.remove(id);
        }
        self.workers.remove(&worker);
        ids
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
}
