//! The router's KV index: the radix tree plus per-worker event ordering.
//!
//! Events arrive over the network, per worker, numbered by a monotonic `event_id` that
//! starts at 1. [`KvIndexer`] applies them in order and notices when some are missing
//! (`id > last + 1`): it then stops applying that worker's live events (they are buffered,
//! bounded) and reports a [`GapReport`]; the serving layer asks the worker for a replay from
//! `expected` ([`KvIndexer::apply_replay`]) or, when the worker's buffer no longer holds it, a
//! full dump ([`KvIndexer::apply_dump`], which replaces the worker's state). Buffered live
//! events that follow on contiguously are applied right after, so the index is never left
//! with a hole.
//!
//! Ids are peer-controlled: arithmetic on them saturates, so a hostile or buggy id (say
//! `u64::MAX`) cannot panic the router; at worst that worker's events stop applying until a
//! dump resets it.

pub mod approx;
mod children;
mod orphans;
pub mod radix_tree;
pub mod snapshot;

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

pub use radix_tree::{RadixTree, TreeError};
pub use snapshot::IndexSnapshot;

use crate::metrics;
use crate::protocols::{
    KvCacheEvent, KvCacheEventData, KvCacheStoreData, KvCacheStoredBlockData, KvStoredDump,
    LocalBlockHash, OverlapScores, RouterEvent, WorkerId,
};

/// Live events kept per worker while it awaits a replay or dump.
pub const DEFAULT_MAX_PENDING_EVENTS: usize = 16_384;

/// Events from `expected` up to `received - 1` were never seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GapReport {
    pub worker_id: WorkerId,
    /// First missing id: ask the worker to replay from here.
    pub expected: u64,
    /// The id that revealed the gap.
    pub received: u64,
}

/// What happened to one live event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApplyOutcome {
    /// Applied; this many blocks were added or removed.
    Applied { blocks: usize },
    /// Already reflected (id ≤ last applied, e.g. overlap between a replay and the live
    /// stream); ignored.
    Duplicate,
    /// Events are missing: this one is buffered, and the worker must replay or dump.
    Gap(GapReport),
    /// The worker awaits a replay or dump; the event is buffered until then.
    Buffered,
    /// Too many events buffered while awaiting resync: only a dump can restore this worker.
    DumpRequired { worker_id: WorkerId },
}

/// Result of a replay or a dump.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResyncOutcome {
    /// Events applied (replayed plus buffered ones drained after it).
    pub applied_events: usize,
    /// Blocks of a dump the worker holds below a parent it does not hold: kept, but not
    /// matchable until the parent is stored again.
    pub orphaned_blocks: usize,
    /// Still not contiguous: ask again from `expected`.
    pub gap: Option<GapReport>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexerError {
    /// The event was consumed (its id counts as applied) but part of it could not be indexed.
    #[error("kv event {event_id}: {source}")]
    Tree {
        event_id: u64,
        #[source]
        source: TreeError,
    },
    /// A replay did not start right after the last applied event or skipped ids.
    #[error(
        "replay for worker {worker_id} is not contiguous: expected event {expected}, got {got}"
    )]
    ReplayNotContiguous {
        worker_id: WorkerId,
        expected: u64,
        got: u64,
    },
}

#[derive(Default)]
struct WorkerState {
    last_event_id: u64,
    resync: Option<Resync>,
}

struct Resync {
    pending: BTreeMap<u64, KvCacheEventData>,
    overflowed: bool,
}

/// Radix index plus event ordering, for all workers. Single-threaded (`Send + Sync`): share it
/// behind a `Mutex` or `RwLock` (`find_matches` takes `&self`).
pub struct KvIndexer {
    tree: RadixTree,
    workers: FxHashMap<WorkerId, WorkerState>,
    max_pending: usize,
}

impl Default for KvIndexer {
    fn default() -> Self {
        Self::new()
    }
}

impl KvIndexer {
    pub fn new() -> Self {
        Self::with_max_pending(DEFAULT_MAX_PENDING_EVENTS)
    }

    pub fn with_max_pending(max_pending: usize) -> Self {
        Self {
            tree: RadixTree::new(),
            workers: FxHashMap::default(),
            max_pending,
        }
    }

    /// An index built from full dumps, e.g. to compare with the live one in tests.
    pub fn from_dumps<'a>(dumps: impl IntoIterator<Item = (WorkerId, &'a KvStoredDump)>) -> Self {
        let mut ix = Self::new();
        for (w, d) in dumps {
            ix.apply_dump(w, d);
        }
        ix
    }

    /// Applies one live event in id order (see [`ApplyOutcome`]).
    pub fn apply_event(&mut self, ev: RouterEvent) -> Result<ApplyOutcome, IndexerError> {
        let worker = ev.worker_id;
        let id = ev.event.event_id;
        let max_pending = self.max_pending;
        let st = self.workers.entry(worker).or_default();
        if id <= st.last_event_id {
            metrics::event_applied(&ev.event.data, metrics::STATUS_DUPLICATE);
            return Ok(ApplyOutcome::Duplicate);
        }
        if let Some(r) = st.resync.as_mut() {
            if r.overflowed {
                return Ok(ApplyOutcome::DumpRequired { worker_id: worker });
            }
            if r.pending.len() >= max_pending {
                // Replaying behind this many live events would never catch up: drop them.
                r.pending.clear();
                r.overflowed = true;
                return Ok(ApplyOutcome::DumpRequired { worker_id: worker });
            }
            r.pending.insert(id, ev.event.data);
            return Ok(ApplyOutcome::Buffered);
        }
        if id > st.last_event_id.saturating_add(1) {
            let report = GapReport {
                worker_id: worker,
                expected: st.last_event_id.saturating_add(1),
                received: id,
            };
            metrics::dropped_events(worker, id - report.expected);
            tracing::warn!(
                worker_id = worker,
                expected = report.expected,
                received = id,
                "kv event gap; awaiting replay or dump"
            );
            let mut pending = BTreeMap::new();
            pending.insert(id, ev.event.data);
            st.resync = Some(Resync {
                pending,
                overflowed: false,
            });
            return Ok(ApplyOutcome::Gap(report));
        }
        st.last_event_id = id;
        self.apply_data(worker, id, &ev.event.data)
            .map(|blocks| ApplyOutcome::Applied { blocks })
    }

    /// Applies events a worker replayed from its buffer (starting at or before the first
    /// missing id), then any buffered live events that now follow on.
    pub fn apply_replay(
        &mut self,
        worker: WorkerId,
        events: Vec<KvCacheEvent>,
    ) -> Result<ResyncOutcome, IndexerError> {
        let mut out = ResyncOutcome::default();
        for ev in events {
            let last = self.workers.entry(worker).or_default().last_event_id;
            if ev.event_id <= last {
                continue;
            }
            if ev.event_id != last.saturating_add(1) {
                return Err(IndexerError::ReplayNotContiguous {
                    worker_id: worker,
                    expected: last.saturating_add(1),
                    got: ev.event_id,
                });
            }
            self.apply_counted(worker, ev.event_id, &ev.data, &mut out);
        }
        self.drain_pending(worker, &mut out);
        Ok(out)
    }

    /// Replaces the worker's state with a full dump, then applies buffered live events newer
    /// than the dump. Also how a newly discovered worker is first ingested.
    pub fn apply_dump(&mut self, worker: WorkerId, dump: &KvStoredDump) -> ResyncOutcome {
        let mut out = ResyncOutcome::default();
        self.tree.clear_worker(worker);
        // Any order works: a block listed before its parent waits as an orphan and is
        // attached when the parent comes.
        for b in &dump.blocks {
            let data = KvCacheStoreData {
                parent_hash: b.parent_hash,
                start_position: None,
                blocks: vec![KvCacheStoredBlockData {
                    block_hash: b.block_hash,
                    tokens_hash: b.tokens_hash,
                }],
            };
            if let Err(e) = self.tree.apply_stored(worker, &data) {
                tracing::warn!(worker_id = worker, error = %e, "dump block not indexed");
            }
        }
        out.orphaned_blocks = self.tree.orphan_count(worker);
        let st = self.workers.entry(worker).or_default();
        st.last_event_id = dump.last_event_id;
        if let Some(r) = st.resync.as_mut() {
            // A dump supersedes whatever overflowed; newer buffered events still apply.
            r.overflowed = false;
        }
        self.drain_pending(worker, &mut out);
        out
    }

    /// Forgets a worker that left discovery. Returns the number of blocks dropped.
    pub fn remove_worker(&mut self, worker: WorkerId) -> usize {
        self.workers.remove(&worker);
        self.tree.remove_worker(worker)
    }

    /// For each worker, how many leading blocks of the request it holds.
    pub fn find_matches(&self, locals: &[LocalBlockHash]) -> OverlapScores {
        self.tree.find_matches(locals)
    }

    /// The worker's state as a dump (same shape a worker serves), with the last applied id.
    pub fn dump(&self, worker: WorkerId) -> KvStoredDump {
        KvStoredDump {
            last_event_id: self.last_event_id(worker).unwrap_or(0),
            blocks: self.tree.dump_blocks(worker),
        }
    }

    /// Every worker's blocks in comparable form.
    pub fn snapshot(&self) -> IndexSnapshot {
        self.tree.snapshot()
    }

    /// Last applied event id (None for a worker never heard of).
    pub fn last_event_id(&self, worker: WorkerId) -> Option<u64> {
        self.workers.get(&worker).map(|s| s.last_event_id)
    }

    /// `Some(first missing id)` while the worker awaits a replay or dump.
    pub fn awaiting_resync(&self, worker: WorkerId) -> Option<u64> {
        let st = self.workers.get(&worker)?;
        st.resync
            .as_ref()
            .map(|_| st.last_event_id.saturating_add(1))
    }

    /// Workers seen through events or dumps.
    pub fn workers(&self) -> Vec<WorkerId> {
        let mut v: Vec<_> = self.workers.keys().copied().collect();
        v.sort_unstable();
        v
    }

    pub fn tree(&self) -> &RadixTree {
        &self.tree
    }

    fn apply_data(
        &mut self,
        worker: WorkerId,
        event_id: u64,
        data: &KvCacheEventData,
    ) -> Result<usize, IndexerError> {
        match self.tree.apply(worker, data) {
            Ok(n) => {
                metrics::event_applied(data, metrics::STATUS_OK);
                Ok(n)
            }
            Err(source) => {
                metrics::event_applied(data, metrics::STATUS_ERROR);
                Err(IndexerError::Tree { event_id, source })
            }
        }
    }

    fn apply_counted(
        &mut self,
        worker: WorkerId,
        id: u64,
        data: &KvCacheEventData,
        out: &mut ResyncOutcome,
    ) {
        if let Some(st) = self.workers.get_mut(&worker) {
            st.last_event_id = id;
        }
        out.applied_events += 1;
        if let Err(e) = self.apply_data(worker, id, data) {
            tracing::warn!(worker_id = worker, error = %e, "replayed kv event not indexed");
        }
    }

    /// Applies buffered events that follow the last applied id; ends the resync when the
    /// buffer empties, or reports the next gap.
    fn drain_pending(&mut self, worker: WorkerId, out: &mut ResyncOutcome) {
        loop {
            let Some(st) = self.workers.get_mut(&worker) else {
                return;
            };
            let last = st.last_event_id;
            let Some(r) = st.resync.as_mut() else { return };
            if r.overflowed {
                out.gap = Some(GapReport {
                    worker_id: worker,
                    expected: last.saturating_add(1),
                    received: last.saturating_add(1),
                });
                return;
            }
            // Drop what the replay or dump already covered.
            while r.pending.first_key_value().is_some_and(|(&k, _)| k <= last) {
                r.pending.pop_first();
            }
            match r.pending.first_key_value().map(|(&k, _)| k) {
                None => {
                    st.resync = None;
                    return;
                }
                Some(k) if k == last.saturating_add(1) => {
                    let Some((id, data)) = r.pending.pop_first() else {
                        return;
                    };
                    self.apply_counted(worker, id, &data, out);
                }
                Some(k) => {
                    out.gap = Some(GapReport {
                        worker_id: worker,
                        expected: last.saturating_add(1),
                        received: k,
                    });
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
#[path = "indexer_tests.rs"]
mod tests;
