//! Radix index of which worker holds which KV blocks.
//!
//! Nodes are keyed by the *local* hash of a block (its own tokens), so a path from the root
//! spells a token prefix block by block and is shared by every worker that caches that prefix.
//! Each worker also has a lookup from its *external* block hash (the engine's id, carried in
//! events) to the node, because removals and `parent_hash` refer to blocks by that id.
//!
//! Nodes live in an arena (`Vec<Node>` with a free list, `u32` indices) instead of
//! `Rc<RefCell<_>>`: no reference counting, no interior mutability, the whole index is `Send`
//! and can sit behind a `Mutex`/`RwLock`, and a lookup is a couple of cache-friendly loads.
//!
//! Invariant: a worker's blocks *in the tree* are prefix-closed. A worker is only added to a
//! node whose parent it already holds, and removing a block moves the worker's blocks below it
//! out of the tree into its orphans (they could not be matched: a match must be contiguous
//! from the first block; they come back when the parent is stored again). Hence along any path
//! the worker sets shrink monotonically, every non-root node has at least one worker, and an
//! emptied node has an emptied subtree that can be freed at once.

use std::collections::BTreeSet;

use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use super::children::Children;
use super::orphans::Orphans;
use crate::protocols::{
    ExternalSequenceBlockHash, KvCacheEventData, KvCacheStoreData, KvCacheStoredBlockData,
    LocalBlockHash, OverlapScores, StoredBlock, WorkerId,
};

const ROOT: u32 = 0;
const NO_PARENT: u32 = u32::MAX;

/// An event the index could not apply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TreeError {
    #[error("radix index is full ({0} nodes)")]
    Capacity(usize),
}

struct Node {
    local: LocalBlockHash,
    parent: u32,
    depth: u32,
    children: Children,
    /// `(worker slot, that worker's external hash of this block)`, sorted by slot. Keeping the
    /// external hash here lets a cascading removal clean the worker's lookup without a search.
    /// Inline for one worker: unique suffixes, the bulk of a large index, allocate nothing.
    workers: SmallVec<[(u32, ExternalSequenceBlockHash); 1]>,
}

impl Node {
    fn slot_index(&self, slot: u32) -> Result<usize, usize> {
        self.workers.binary_search_by_key(&slot, |e| e.0)
    }
}

struct WorkerEntry {
    id: WorkerId,
    blocks: FxHashMap<ExternalSequenceBlockHash, u32>,
    orphans: Orphans,
}

/// The radix index. Single-threaded; wrap it in a lock to share it.
pub struct RadixTree {
    nodes: Vec<Node>,
    free_nodes: Vec<u32>,
    slots: Vec<Option<WorkerEntry>>,
    free_slots: Vec<u32>,
    slot_of: FxHashMap<WorkerId, u32>,
    // Scratch buffers reused by removals, so steady-state event application does not allocate.
    stack: Vec<(u32, ExternalSequenceBlockHash)>,
    emptied: Vec<u32>,
}

impl Default for RadixTree {
    fn default() -> Self {
        Self::new()
    }
}

impl RadixTree {
    pub fn new() -> Self {
        let root = Node {
            local: LocalBlockHash(0),
            parent: NO_PARENT,
            depth: 0,
            children: Children::Many(Box::default()),
            workers: SmallVec::new(),
        };
        Self {
            nodes: vec![root],
            free_nodes: Vec::new(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            slot_of: FxHashMap::default(),
            stack: Vec::new(),
            emptied: Vec::new(),
        }
    }

    /// Applies one event's payload for `worker`; returns how many blocks were added or removed.
    pub fn apply(&mut self, worker: WorkerId, data: &KvCacheEventData) -> Result<usize, TreeError> {
        match data {
            KvCacheEventData::Stored(s) => self.apply_stored(worker, s),
            KvCacheEventData::Removed(r) => Ok(self.apply_removed(worker, &r.block_hashes)),
            KvCacheEventData::Cleared => Ok(self.clear_worker(worker)),
        }
    }

    /// Adds a chain of blocks below `data.parent_hash` (the root when `None`). Returns how many
    /// became matchable; a chain under a parent the worker does not hold is kept as orphans.
    pub fn apply_stored(
        &mut self,
        worker: WorkerId,
        data: &KvCacheStoreData,
    ) -> Result<usize, TreeError> {
        let slot = self.ensure_slot(worker);
        let mut parent = match data.parent_hash {
            None => Some(ROOT),
            Some(p) => self.entry(slot).and_then(|e| e.blocks.get(&p)).copied(),
        };
        let mut parent_ext = data.parent_hash.unwrap_or_default();
        let mut added = 0;
        for b in &data.blocks {
            if let Some(pn) = parent {
                if let Ok((node, is_new)) = self.store_one(slot, pn, b) {
                    added += usize::from(is_new) + self.reattach(slot, node, b.block_hash);
                    parent = Some(node);
                    parent_ext = b.block_hash;
                    continue;
                }
            }
            // Not matchable (yet): an orphan until its parent is stored.
            if let Some(&old) = self.entry(slot).and_then(|e| e.blocks.get(&b.block_hash)) {
                self.remove_block(slot, old);
            }
            if let Some(e) = self.entry_mut(slot) {
                e.orphans.insert(b.block_hash, parent_ext, b.tokens_hash);
            }
            parent = None;
            parent_ext = b.block_hash;
        }
        if self.nodes.len() > u32::MAX as usize - 1 {
            return Err(TreeError::Capacity(self.nodes.len()));
        }
        Ok(added)
    }

    /// Moves the worker's orphans waiting for `ext` (now at `node`) back into the tree, and
    /// theirs after them. Returns how many became matchable.
    fn reattach(&mut self, slot: u32, node: u32, ext: ExternalSequenceBlockHash) -> usize {
        let mut added = 0;
        let mut todo: SmallVec<[(u32, ExternalSequenceBlockHash); 4]> = SmallVec::new();
        todo.push((node, ext));
        while let Some((n, x)) = todo.pop() {
            let kids = match self.entry_mut(slot) {
                Some(e) => e.orphans.take_below(x),
                None => return added,
            };
            for (k, local) in kids {
                let b = KvCacheStoredBlockData {
                    block_hash: k,
                    tokens_hash: local,
                };
                if let Ok((kn, is_new)) = self.store_one(slot, n, &b) {
                    added += usize::from(is_new);
                    todo.push((kn, k));
                }
            }
        }
        added
    }

    /// Stores one block for `slot` under `parent`; returns its node and whether it was new for
    /// the worker. `Err` when the parent stopped being held (engine id reuse inside the chain).
    fn store_one(
        &mut self,
        slot: u32,
        parent: u32,
        b: &KvCacheStoredBlockData,
    ) -> Result<(u32, bool), ()> {
        if let Some(e) = self.entry_mut(slot) {
            // Stored again under a held parent: no longer an orphan.
            e.orphans.remove(b.block_hash);
        }
        if let Some(&old) = self.entry(slot).and_then(|e| e.blocks.get(&b.block_hash)) {
            let n = &self.nodes[old as usize];
            if n.parent == parent && n.local == b.tokens_hash {
                return Ok((old, false));
            }
            // The engine reused this id for other content: the old block is gone.
            self.remove_block(slot, old);
            if parent != ROOT && self.nodes[parent as usize].slot_index(slot).is_err() {
                return Err(());
            }
        }
        let child = match self.nodes[parent as usize].children.get(b.tokens_hash) {
            Some(c) => c,
            None => self.alloc(parent, b.tokens_hash),
        };
        let is_new = match self.nodes[child as usize].slot_index(slot) {
            Ok(i) => {
                // Same content under another id: keep one id per (worker, block).
                let old_ext =
                    std::mem::replace(&mut self.nodes[child as usize].workers[i].1, b.block_hash);
                if let Some(e) = self.entry_mut(slot) {
                    e.blocks.remove(&old_ext);
                }
                false
            }
            Err(i) => {
                self.nodes[child as usize]
                    .workers
                    .insert(i, (slot, b.block_hash));
                true
            }
        };
        if let Some(e) = self.entry_mut(slot) {
            e.blocks.insert(b.block_hash, child);
        }
        Ok((child, is_new))
    }

    /// Removes blocks by external hash; the worker's blocks below them become orphans.
    /// Returns how many blocks the worker no longer holds; unknown hashes are ignored.
    pub fn apply_removed(
        &mut self,
        worker: WorkerId,
        hashes: &[ExternalSequenceBlockHash],
    ) -> usize {
        let Some(&slot) = self.slot_of.get(&worker) else {
            return 0;
        };
        let mut removed = 0;
        for h in hashes {
            if let Some(&node) = self.entry(slot).and_then(|e| e.blocks.get(h)) {
                self.remove_block(slot, node);
                removed += 1;
            } else if let Some(e) = self.entry_mut(slot) {
                removed += usize::from(e.orphans.remove(*h).is_some());
            }
        }
        removed
    }

    /// Drops every block of `worker` but keeps it known. Returns the number of blocks dropped.
    pub fn clear_worker(&mut self, worker: WorkerId) -> usize {
        let Some(&slot) = self.slot_of.get(&worker) else {
            return 0;
        };
        let (blocks, orphans) = match self.entry_mut(slot) {
            Some(e) => (std::mem::take(&mut e.blocks), e.orphans.clear()),
            None => return 0,
        };
        let n = blocks.len() + orphans;
        let mut emptied = std::mem::take(&mut self.emptied);
        for (_, node) in blocks {
            let nd = &mut self.nodes[node as usize];
            if let Ok(i) = nd.slot_index(slot) {
                nd.workers.remove(i);
                if nd.workers.is_empty() {
                    emptied.push(node);
                }
            }
        }
        self.free_emptied(&mut emptied);
        self.emptied = emptied;
        n
    }

    /// Forgets `worker` entirely (it left discovery). Returns the number of blocks dropped.
    pub fn remove_worker(&mut self, worker: WorkerId) -> usize {
        let n = self.clear_worker(worker);
        if let Some(slot) = self.slot_of.remove(&worker) {
            self.slots[slot as usize] = None;
            self.free_slots.push(slot);
        }
        n
    }

    /// For each worker, how many leading blocks of `locals` it holds.
    pub fn find_matches(&self, locals: &[LocalBlockHash]) -> OverlapScores {
        let mut scores = FxHashMap::default();
        let mut cur = match locals.first() {
            Some(&h) => self.nodes[ROOT as usize].children.get(h),
            None => None,
        };
        let mut depth = 1u32;
        while let Some(c) = cur {
            let cn = &self.nodes[c as usize];
            let next = locals.get(depth as usize).and_then(|&h| cn.children.get(h));
            match next {
                Some(n) => {
                    let nw = &self.nodes[n as usize].workers;
                    // Worker sets only shrink downwards, so equal sizes mean equal sets and
                    // nobody stops here; otherwise a merge walk finds who does.
                    if nw.len() != cn.workers.len() {
                        let mut j = 0;
                        for &(slot, _) in &cn.workers {
                            while j < nw.len() && nw[j].0 < slot {
                                j += 1;
                            }
                            if j >= nw.len() || nw[j].0 != slot {
                                scores.insert(self.worker_id(slot), depth);
                            }
                        }
                    }
                    depth += 1;
                }
                None => {
                    for &(slot, _) in &cn.workers {
                        scores.insert(self.worker_id(slot), depth);
                    }
                }
            }
            cur = next;
        }
        OverlapScores {
            scores,
            tree_sizes: self.tree_sizes(),
        }
    }

    /// Worker → number of blocks held, for every known worker.
    pub fn tree_sizes(&self) -> FxHashMap<WorkerId, usize> {
        self.slots
            .iter()
            .flatten()
            .map(|e| (e.id, e.blocks.len()))
            .collect()
    }

    /// Number of blocks `worker` holds.
    pub fn tree_size(&self, worker: WorkerId) -> usize {
        self.slot_of
            .get(&worker)
            .and_then(|&s| self.entry(s))
            .map_or(0, |e| e.blocks.len())
    }

    /// Known workers (including those currently holding nothing).
    pub fn workers(&self) -> Vec<WorkerId> {
        self.slots.iter().flatten().map(|e| e.id).collect()
    }

    /// Live nodes, root excluded.
    pub fn node_count(&self) -> usize {
        self.nodes.len() - 1 - self.free_nodes.len()
    }

    /// The worker's blocks as stored-block records: matchable ones parents before children
    /// (depth order), then orphans; replaying them into an empty index rebuilds the same state.
    pub fn dump_blocks(&self, worker: WorkerId) -> Vec<StoredBlock> {
        let Some(&slot) = self.slot_of.get(&worker) else {
            return Vec::new();
        };
        let Some(entry) = self.entry(slot) else {
            return Vec::new();
        };
        let mut rows: Vec<(u32, ExternalSequenceBlockHash, u32)> = entry
            .blocks
            .iter()
            .map(|(&ext, &n)| (self.nodes[n as usize].depth, ext, n))
            .collect();
        rows.sort_unstable();
        rows.into_iter()
            .filter_map(|(_, ext, n)| {
                let node = &self.nodes[n as usize];
                let parent_hash = if node.parent == ROOT {
                    None
                } else {
                    let p = &self.nodes[node.parent as usize];
                    // Always present by the prefix-closed invariant; skip rather than panic.
                    Some(p.workers[p.slot_index(slot).ok()?].1)
                };
                Some(StoredBlock {
                    parent_hash,
                    block_hash: ext,
                    tokens_hash: node.local,
                })
            })
            .chain(entry.orphans.iter().map(|(b, p, l)| StoredBlock {
                parent_hash: Some(p),
                block_hash: b,
                tokens_hash: l,
            }))
            .collect()
    }

    /// Blocks `worker` holds that cannot be matched (their parent is not held).
    pub fn orphan_count(&self, worker: WorkerId) -> usize {
        self.slot_of
            .get(&worker)
            .and_then(|&s| self.entry(s))
            .map_or(0, |e| e.orphans.len())
    }

    /// The worker's blocks as synthetic single-block `Stored` events, in replayable order.
    pub fn dump_events(&self, worker: WorkerId) -> Vec<KvCacheEventData> {
        self.dump_blocks(worker)
            .into_iter()
            .map(|b| {
                KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: b.parent_hash,
                    start_position: None,
                    blocks: vec![KvCacheStoredBlockData {
                        block_hash: b.block_hash,
                        tokens_hash: b.tokens_hash,
                    }],
                })
            })
            .collect()
    }

    /// Checks the structural invariants; for tests and debugging (O(size)).
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut lookup_total = 0;
        for (slot, e) in self.slots.iter().enumerate() {
            let Some(e) = e else { continue };
            lookup_total += e.blocks.len();
            e.orphans.check()?;
            if let Some(b) = e.blocks.keys().find(|b| e.orphans.contains(**b)) {
                return Err(format!(
                    "worker {}: {b:#x} both in the tree and orphaned",
                    e.id
                ));
            }
            for (&ext, &n) in &e.blocks {
                let node = &self.nodes[n as usize];
                match node.slot_index(slot as u32) {
                    Ok(i) if node.workers[i].1 == ext => {}
                    _ => return Err(format!("worker {}: lookup {ext:#x} → node {n} stale", e.id)),
                }
            }
        }
        let free: BTreeSet<u32> = self.free_nodes.iter().copied().collect();
        let mut entries = 0;
        for (i, node) in self.nodes.iter().enumerate().skip(1) {
            if free.contains(&(i as u32)) {
                continue;
            }
            entries += node.workers.len();
            if node.workers.is_empty() {
                return Err(format!("node {i} has no worker"));
            }
            if !node.workers.windows(2).all(|w| w[0].0 < w[1].0) {
                return Err(format!("node {i}: workers not sorted"));
            }
            let p = &self.nodes[node.parent as usize];
            if p.children.get(node.local) != Some(i as u32) {
                return Err(format!("node {i} not linked from its parent"));
            }
            if node.parent != ROOT && node.workers.iter().any(|&(s, _)| p.slot_index(s).is_err()) {
                return Err(format!("node {i}: a worker holds it but not its parent"));
            }
        }
        if entries != lookup_total {
            return Err(format!("{entries} node entries vs {lookup_total} lookups"));
        }
        Ok(())
    }

    fn worker_id(&self, slot: u32) -> WorkerId {
        self.entry(slot).map_or(0, |e| e.id)
    }

    fn entry(&self, slot: u32) -> Option<&WorkerEntry> {
        self.slots.get(slot as usize).and_then(Option::as_ref)
    }

    fn entry_mut(&mut self, slot: u32) -> Option<&mut WorkerEntry> {
        self.slots.get_mut(slot as usize).and_then(Option::as_mut)
    }

    fn ensure_slot(&mut self, worker: WorkerId) -> u32 {
        if let Some(&s) = self.slot_of.get(&worker) {
            return s;
        }
        let entry = WorkerEntry {
            id: worker,
            blocks: FxHashMap::default(),
            orphans: Orphans::default(),
        };
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.slots[s as usize] = Some(entry);
                s
            }
            None => {
                self.slots.push(Some(entry));
                (self.slots.len() - 1) as u32
            }
        };
        self.slot_of.insert(worker, slot);
        slot
    }

    fn alloc(&mut self, parent: u32, local: LocalBlockHash) -> u32 {
        let depth = self.nodes[parent as usize].depth + 1;
        let id = match self.free_nodes.pop() {
            Some(id) => {
                let n = &mut self.nodes[id as usize];
                n.local = local;
                n.parent = parent;
                n.depth = depth;
                id
            }
            None => {
                self.nodes.push(Node {
                    local,
                    parent,
                    depth,
                    children: Children::None,
                    workers: SmallVec::new(),
                });
                (self.nodes.len() - 1) as u32
            }
        };
        self.nodes[parent as usize].children.insert(local, id);
        id
    }

    /// Removes `slot` from `node`; the worker's blocks below it leave the tree for its orphans
    /// (the engine still holds them). Returns the number of blocks that left the tree.
    fn remove_block(&mut self, slot: u32, node: u32) -> usize {
        let mut stack = std::mem::take(&mut self.stack);
        let mut emptied = std::mem::take(&mut self.emptied);
        stack.push((node, ExternalSequenceBlockHash(0)));
        let mut moved = 0;
        while let Some((n, parent_ext)) = stack.pop() {
            let nd = &mut self.nodes[n as usize];
            let Ok(i) = nd.slot_index(slot) else { continue };
            let (_, ext) = nd.workers.remove(i);
            let local = nd.local;
            if nd.workers.is_empty() {
                emptied.push(n);
            }
            let first = stack.len();
            nd.children.push_ids_with(&mut stack, ext);
            debug_assert!(stack.len() >= first);
            if let Some(e) = self.slots[slot as usize].as_mut() {
                e.blocks.remove(&ext);
                if n != node {
                    e.orphans.insert(ext, parent_ext, local);
                }
            }
            moved += 1;
        }
        self.free_emptied(&mut emptied);
        self.stack = stack;
        self.emptied = emptied;
        moved
    }

    /// Frees nodes left without workers. By the invariant their subtrees are emptied too (and
    /// listed), so only the topmost ones need unlinking from a surviving parent.
    fn free_emptied(&mut self, emptied: &mut Vec<u32>) {
        for &n in emptied.iter() {
            let (parent, local) = {
                let nd = &self.nodes[n as usize];
                (nd.parent, nd.local)
            };
            if parent == ROOT || !self.nodes[parent as usize].workers.is_empty() {
                self.nodes[parent as usize].children.remove(local);
            }
        }
        for n in emptied.drain(..) {
            let nd = &mut self.nodes[n as usize];
            nd.children = Children::None;
            nd.parent = NO_PARENT;
            self.free_nodes.push(n);
        }
    }

    #[cfg(test)]
    fn child_count(&self, node: u32) -> usize {
        self.nodes[node as usize].children.len()
    }
}

#[cfg(test)]
#[path = "radix_tree_tests.rs"]
mod tests;
