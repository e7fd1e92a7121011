//! The paged KV block pool: allocation, reference counts, prefix reuse by chained block hash,
//! LRU eviction of unreferenced cached blocks, and the KV events that describe it.
//!
//! A block is in exactly one of three states:
//! - *referenced*: held by at least one live sequence (`ref_count > 0`);
//! - *cached*: unreferenced but holding the KV of a full, hashed block that a later request
//!   with the same prefix can reuse; it sits in the LRU and is evicted (a `Removed` event) when a
//!   fresh block is needed and no free block is left;
//! - *free*: unreferenced and holding nothing reusable.
//!
//! A block is hashed (a `Stored` event) only once it is full **and** its KV has been computed,
//! so a reused block always holds valid KV. With `enable_block_reuse = false` nothing is hashed,
//! looked up or announced.

use std::collections::{BTreeMap, HashMap};

use super::events::{
    KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData, KvEventPublisher,
};
use tandem_kv_protocol::hash::{chain_hash, CacheSalt, ExternalSequenceBlockHash};
pub use tandem_kv_protocol::HashContext;

/// Not enough free or evictable blocks for an allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("out of KV blocks: need {needed}, {available} available")]
pub struct OutOfBlocks {
    pub needed: usize,
    pub available: usize,
}

/// Block counts by state; `referenced + cached + free == total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct BlockStats {
    pub total: usize,
    pub referenced: usize,
    pub cached: usize,
    pub free: usize,
}

/// The blocks of one sequence, in token order, and the salt its blocks are hashed under.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    pub blocks: Vec<u32>,
    /// How many leading blocks are hashed (full and computed), and the last one's sequence hash.
    num_hashed: usize,
    last_hash: Option<ExternalSequenceBlockHash>,
    /// What the blocks' hashes cover besides tokens (the request's cache salt and its media
    /// spans): its blocks are matched and registered under these hashes.
    hashing: HashContext,
}

impl BlockTable {
    /// An empty table whose blocks are hashed under `salt`.
    pub fn salted(salt: Option<CacheSalt>) -> Self {
        Self::hashed(HashContext::salted(salt))
    }
    /// An empty table whose blocks are hashed under `hashing` (salt and media spans).
    pub fn hashed(hashing: HashContext) -> Self {
        BlockTable {
            hashing,
            ..BlockTable::default()
        }
    }
    pub fn salt(&self) -> Option<CacheSalt> {
        self.hashing.salt
    }
    pub fn hashing(&self) -> &HashContext {
        &self.hashing
    }
    pub fn ids(&self) -> &[u32] {
        &self.blocks
    }
    pub fn len(&self) -> usize {
        self.blocks.len()
    }
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
    /// Sequence hashes are known for this many leading blocks.
    pub fn num_hashed(&self) -> usize {
        self.num_hashed
    }
}

#[derive(Debug, Clone, Default)]
struct Block {
    ref_count: u32,
    /// Sequence hash, when this block is registered for reuse.
    hash: Option<ExternalSequenceBlockHash>,
    /// LRU stamp while cached.
    lru_stamp: Option<u64>,
}

pub struct BlockManager {
    block_size: usize,
    enable_reuse: bool,
    blocks: Vec<Block>,
    /// Unreferenced, unhashed blocks; used before evicting anything.
    free: Vec<u32>,
    /// Unreferenced hashed blocks by LRU stamp (oldest first).
    lru: BTreeMap<u64, u32>,
    clock: u64,
    by_hash: HashMap<ExternalSequenceBlockHash, u32>,
    referenced: usize,
    events: KvEventPublisher,
}

impl BlockManager {
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        enable_reuse: bool,
        events: KvEventPublisher,
    ) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        Self {
            block_size,
            enable_reuse,
            blocks: vec![Block::default(); num_blocks],
            // Reverse so that block 0 is handed out first: easier to read in tests and logs.
            free: (0..num_blocks as u32).rev().collect(),
            lru: BTreeMap::new(),
            clock: 0,
            by_hash: HashMap::new(),
            referenced: 0,
            events,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }
    pub fn reuse_enabled(&self) -> bool {
        self.enable_reuse
    }
    pub fn events(&self) -> &KvEventPublisher {
        &self.events
    }

    /// Blocks that can be handed out now (free plus evictable).
    pub fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    pub fn stats(&self) -> BlockStats {
        BlockStats {
            total: self.blocks.len(),
            referenced: self.referenced,
            cached: self.lru.len(),
            free: self.free.len(),
        }
    }

    /// Blocks needed to hold `num_tokens` tokens.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// Leading full blocks of `tokens` (hashed under `hashing`) whose KV is cached, as
    /// `(block id, sequence hash)`.
    pub fn match_prefix(
        &self,
        tokens: &[u32],
        hashing: &HashContext,
    ) -> Vec<(u32, ExternalSequenceBlockHash)> {
        let mut out = Vec::new();
        if !self.enable_reuse {
            return out;
        }
        let mut parent = None;
        for (i, chunk) in tokens.chunks_exact(self.block_size).enumerate() {
            let h = chain_hash(parent, hashing.block_hash(i, self.block_size, chunk));
            match self.by_hash.get(&h) {
                Some(&id) => out.push((id, h)),
                None => break,
            }
            parent = Some(h);
        }
        out
    }

    /// Fresh blocks that admitting `tokens` (computing them all) would take, given the
    /// prefix cache: the blocks not covered by cached prefix blocks, plus any cached-but-free
    /// prefix blocks, which stop being evictable once referenced.
    pub fn blocks_needed_for(
        &self,
        tokens: &[u32],
        hashing: &HashContext,
        total_tokens: usize,
    ) -> usize {
        let hits = self.match_prefix(tokens, hashing);
        let revived = hits
            .iter()
            .filter(|(id, _)| self.blocks[*id as usize].ref_count == 0)
            .count();
        self.blocks_for(total_tokens).saturating_sub(hits.len()) + revived
    }

    /// Starts a sequence's table from the prefix cache; returns the number of cached tokens.
    /// The table must be empty; its salt is the one the prefix is matched under. Takes no
    /// fresh block.
    pub fn attach_prefix(&mut self, table: &mut BlockTable, tokens: &[u32]) -> usize {
        debug_assert!(table.is_empty());
        let hits = self.match_prefix(tokens, &table.hashing);
        for &(id, h) in &hits {
            self.incref(id);
            table.blocks.push(id);
            table.last_hash = Some(h);
        }
        table.num_hashed = hits.len();
        hits.len() * self.block_size
    }

    fn incref(&mut self, id: u32) {
        let b = &mut self.blocks[id as usize];
        if b.ref_count == 0 {
            if let Some(stamp) = b.lru_stamp.take() {
                self.lru.remove(&stamp);
            }
            self.referenced += 1;
        }
        b.ref_count += 1;
    }

    /// Takes one unreferenced block: a free one, else the least recently used cached one.
    fn take_block(&mut self) -> Option<u32> {
        if let Some(id) = self.free.pop() {
            return Some(id);
        }
        let (_, id) = self.lru.pop_first()?;
        let b = &mut self.blocks[id as usize];
        b.lru_stamp = None;
        if let Some(h) = b.hash.take() {
            self.by_hash.remove(&h);
            self.events
                .emit(KvCacheEventData::Removed(KvCacheRemoveData {
                    block_hashes: vec![h],
                }));
        }
        Some(id)
    }

    /// Grows `table` so it can hold `num_tokens` tokens. All or nothing.
    pub fn ensure_capacity(
        &mut self,
        table: &mut BlockTable,
        num_tokens: usize,
    ) -> Result<(), OutOfBlocks> {
        let want = self.blocks_for(num_tokens).saturating_sub(table.len());
        if want > self.available() {
            return Err(OutOfBlocks {
                needed: want,
                available: self.available(),
            });
        }
        for _ in 0..want {
            // Cannot fail: checked above.
            if let Some(id) = self.take_block() {
                self.incref(id);
                table.blocks.push(id);
            }
        }
        Ok(())
    }

    /// Registers every block of `table` that is full and computed (`tokens[..computed]`) for
    /// reuse, emitting one `Stored` event for the newly hashed run.
    pub fn commit_computed(&mut self, table: &mut BlockTable, tokens: &[u32], computed: usize) {
        let full = (computed.min(tokens.len()) / self.block_size).min(table.len());
        if !self.enable_reuse || full <= table.num_hashed {
            table.num_hashed = table.num_hashed.max(full);
            return;
        }
        let parent_hash = table.last_hash;
        let start = table.num_hashed;
        let mut stored = Vec::new();
        for i in start..full {
            let chunk = &tokens[i * self.block_size..(i + 1) * self.block_size];
            let local = table.hashing.block_hash(i, self.block_size, chunk);
            let h = chain_hash(table.last_hash, local);
            let id = table.blocks[i];
            table.last_hash = Some(h);
            table.num_hashed = i + 1;
            let blk = &mut self.blocks[id as usize];
            if blk.hash.is_some() {
                // Already registered (a reused prefix block).
                continue;
            }
            if self.by_hash.contains_key(&h) {
                // Another sequence computed the same prefix concurrently; its block stays the
                // canonical copy and this one is simply freed when released.
                continue;
            }
            blk.hash = Some(h);
            self.by_hash.insert(h, id);
            stored.push(KvCacheStoredBlockData {
                block_hash: h,
                tokens_hash: local,
            });
        }
        if !stored.is_empty() {
            // The parent of a run is the hash just before its first block. When a duplicate
            // was skipped at the start, that parent is still the right chain predecessor.
            let first_parent = if stored.len() == full - start {
                parent_hash
            } else {
                self.parent_of_first(tokens, &table.hashing, &stored)
            };
            self.events.emit(KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: first_parent,
                start_position: None,
                blocks: stored,
            }));
        }
    }

    /// Parent hash of the first block in `stored`, recomputed from the tokens (rare path: only
    /// when some blocks of a run were duplicates and skipped).
    fn parent_of_first(
        &self,
        tokens: &[u32],
        hashing: &HashContext,
        stored: &[KvCacheStoredBlockData],
    ) -> Option<ExternalSequenceBlockHash> {
        let first = stored.first()?.block_hash;
        let mut parent = None;
        for (i, chunk) in tokens.chunks_exact(self.block_size).enumerate() {
            let h = chain_hash(parent, hashing.block_hash(i, self.block_size, chunk));
            if h == first {
                return parent;
            }
            parent = Some(h);
        }
        None
    }

    /// A table for a sequence forked from one whose table is `parent` with `computed` tokens
    /// of KV (beam search): the parent's full blocks are shared (reference counts go up), and
    /// when `computed` ends inside a block, that partial block goes to a fresh block, to be
    /// copied by the caller (copy-on-write: the two sequences write different tokens after
    /// it). Returns the table, the `(src, dst)` copy to make, and how many leading tokens the
    /// new table has KV for: `computed`, or only the full blocks' tokens when no fresh block
    /// is available (the fork then recomputes the rest).
    pub fn fork(
        &mut self,
        parent: &BlockTable,
        computed: usize,
    ) -> (BlockTable, Option<(u32, u32)>, usize) {
        let full = (computed / self.block_size).min(parent.len());
        let mut t = BlockTable::hashed(parent.hashing.clone());
        for &id in &parent.blocks[..full] {
            self.incref(id);
            t.blocks.push(id);
        }
        if parent.num_hashed <= full {
            t.num_hashed = parent.num_hashed;
            t.last_hash = parent.last_hash;
        }
        // Otherwise (not expected) the hashes are recomputed from the start on commit, where
        // already registered blocks are skipped.
        let partial = !computed.is_multiple_of(self.block_size) && parent.len() > full;
        if !partial {
            return (t, None, full * self.block_size);
        }
        match self.take_block() {
            Some(dst) => {
                self.incref(dst);
                t.blocks.push(dst);
                (t, Some((parent.blocks[full], dst)), computed)
            }
            None => (t, None, full * self.block_size),
        }
    }

    /// A table holding one more reference on each of `ids` (blocks a sequence references
    /// now), for [`BlockManager::release`] later: the blocks are neither evicted nor reused
    /// until then, whatever their sequence does meanwhile (a GPU-to-GPU write reading them).
    pub fn pin(&mut self, ids: &[u32]) -> BlockTable {
        let mut t = BlockTable::salted(None);
        for &id in ids {
            debug_assert!(
                self.blocks[id as usize].ref_count > 0,
                "pinning unreferenced block {id}"
            );
            self.incref(id);
            t.blocks.push(id);
        }
        t
    }

    /// Releases every block of `table` and empties it (its salt stays). Blocks are released tail first so that,
    /// with equal recency, a prefix's later blocks are evicted before its earlier ones (an
    /// earlier block is worth more: every longer prefix needs it).
    pub fn release(&mut self, table: &mut BlockTable) {
        for &id in table.blocks.iter().rev() {
            let b = &mut self.blocks[id as usize];
            debug_assert!(b.ref_count > 0, "double release of block {id}");
            if b.ref_count == 0 {
                continue;
            }
            b.ref_count -= 1;
            if b.ref_count == 0 {
                self.referenced -= 1;
                if b.hash.is_some() {
                    self.clock += 1;
                    b.lru_stamp = Some(self.clock);
                    self.lru.insert(self.clock, id);
                } else {
                    self.free.push(id);
                }
            }
        }
        *table = BlockTable::hashed(std::mem::take(&mut table.hashing));
    }

    /// Drops every cached (unreferenced) block and announces `Cleared`. Refused while any
    /// block is referenced, since `Cleared` tells subscribers that nothing is stored.
    pub fn clear_cache(&mut self) -> Result<(), usize> {
        if self.referenced > 0 {
            return Err(self.referenced);
        }
        for (_, id) in std::mem::take(&mut self.lru) {
            let b = &mut self.blocks[id as usize];
            b.lru_stamp = None;
            b.hash = None;
            self.free.push(id);
        }
        self.by_hash.clear();
        self.events.emit(KvCacheEventData::Cleared);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::events::KvCacheEvent;
    use crate::kv::hash::block_hashes;
    use tokio::sync::broadcast::Receiver;

    fn mgr(n: usize, bs: usize, reuse: bool) -> (BlockManager, Receiver<KvCacheEvent>) {
        let p = KvEventPublisher::new(64, 0);
        let rx = p.subscribe();
        (BlockManager::new(n, bs, reuse, p), rx)
    }

    fn drain(rx: &mut Receiver<KvCacheEvent>) -> Vec<KvCacheEvent> {
        let mut v = Vec::new();
        while let Ok(e) = rx.try_recv() {
            v.push(e);
        }
        v
    }

    fn check_invariants(m: &BlockManager) {
        let s = m.stats();
        assert_eq!(s.referenced + s.cached + s.free, s.total);
    }

    /// Allocates and computes `tokens` as one sequence would.
    fn run_seq(m: &mut BlockManager, tokens: &[u32]) -> (BlockTable, usize) {
        let mut t = BlockTable::default();
        let cached = m.attach_prefix(&mut t, tokens);
        m.ensure_capacity(&mut t, tokens.len()).unwrap();
        m.commit_computed(&mut t, tokens, tokens.len());
        check_invariants(m);
        (t, cached)
    }

    /// Allocates and computes `tokens` as one sequence of salt `salt` would.
    fn run_salted(m: &mut BlockManager, salt: Option<CacheSalt>, tokens: &[u32]) -> usize {
        let mut t = BlockTable::salted(salt);
        let cached = m.attach_prefix(&mut t, tokens);
        m.ensure_capacity(&mut t, tokens.len()).unwrap();
        m.commit_computed(&mut t, tokens, tokens.len());
        m.release(&mut t);
        assert_eq!(t.salt(), salt, "a released table keeps its salt");
        check_invariants(m);
        cached
    }

    #[test]
    fn salted_sequences_share_blocks_only_with_their_own_salt() {
        let (mut m, mut rx) = mgr(16, 4, true);
        let p: Vec<u32> = (0..9).collect();
        let (a, b) = (Some(CacheSalt(1)), Some(CacheSalt(2)));
        assert_eq!(run_salted(&mut m, a, &p), 0);
        assert_eq!(
            run_salted(&mut m, a, &p),
            8,
            "same salt: the prefix is reused"
        );
        assert_eq!(run_salted(&mut m, b, &p), 0, "another salt misses");
        assert_eq!(run_salted(&mut m, None, &p), 0, "no salt misses");
        assert_eq!(m.match_prefix(&p, &HashContext::salted(b)).len(), 2);
        // What the engine announces is what a router computes for the same salt.
        let want = crate::kv::hash::salted_block_hashes(a, &p, 4);
        let stored: Vec<_> = drain(&mut rx)
            .into_iter()
            .filter_map(|e| match e.data {
                KvCacheEventData::Stored(s) => Some(s.blocks),
                _ => None,
            })
            .collect();
        let first: Vec<_> = stored[0].iter().map(|b| b.tokens_hash).collect();
        assert_eq!(first, want);
        assert_eq!(stored.len(), 3, "one Stored run per salt");
    }

    #[test]
    fn prefix_reuse_and_refcounts() {
        let (mut m, mut rx) = mgr(8, 4, true);
        let a: Vec<u32> = (0..10).collect();
        let (mut ta, cached) = run_seq(&mut m, &a);
        assert_eq!(cached, 0);
        assert_eq!(ta.len(), 3);
        let ev = drain(&mut rx);
        assert_eq!(ev.len(), 1);
        let hs = block_hashes(&a, 4);
        match &ev[0].data {
            KvCacheEventData::Stored(s) => {
                assert_eq!(s.parent_hash, None);
                let got: Vec<_> = s
                    .blocks
                    .iter()
                    .map(|b| (b.tokens_hash, b.block_hash))
                    .collect();
                assert_eq!(got, hs);
            }
            other => panic!("unexpected {other:?}"),
        }
        // Same first 8 tokens, different tail: shares two blocks while both are live.
        let mut b: Vec<u32> = (0..8).collect();
        b.extend([99, 98, 97, 96, 95]);
        let (mut tb, cached) = run_seq(&mut m, &b);
        assert_eq!(cached, 8);
        assert_eq!(&tb.ids()[..2], &ta.ids()[..2]);
        assert_eq!(m.stats().referenced, 5);
        let ev = drain(&mut rx);
        match &ev[0].data {
            KvCacheEventData::Stored(s) => {
                assert_eq!(s.parent_hash, Some(hs[1].1));
                assert_eq!(s.blocks.len(), 1);
            }
            other => panic!("unexpected {other:?}"),
        }
        m.release(&mut ta);
        assert_eq!(m.stats().referenced, 4, "shared blocks stay referenced");
        m.release(&mut tb);
        let s = m.stats();
        assert_eq!((s.referenced, s.cached, s.free), (0, 3, 5));
        check_invariants(&m);
    }

    #[test]
    fn lru_eviction_emits_removed_and_never_leaks() {
        let (mut m, mut rx) = mgr(4, 2, true);
        let a = [1, 2, 3, 4];
        let (mut ta, _) = run_seq(&mut m, &a);
        m.release(&mut ta);
        let b = [5, 6, 7, 8];
        let (mut tb, _) = run_seq(&mut m, &b);
        m.release(&mut tb);
        assert_eq!(m.stats().cached, 4);
        drain(&mut rx);
        // A new sequence of 2 blocks evicts the oldest cached: a's tail first, then a's head.
        let (mut tc, _) = run_seq(&mut m, &[9, 9, 9, 9]);
        let ev = drain(&mut rx);
        let ha = block_hashes(&a, 2);
        let removed: Vec<ExternalSequenceBlockHash> = ev
            .iter()
            .filter_map(|e| match &e.data {
                KvCacheEventData::Removed(r) => Some(r.block_hashes.clone()),
                _ => None,
            })
            .flatten()
            .collect();
        assert_eq!(removed, vec![ha[1].1, ha[0].1]);
        assert!(m.match_prefix(&a, &HashContext::default()).is_empty());
        assert_eq!(m.match_prefix(&b, &HashContext::default()).len(), 2);
        m.release(&mut tc);
        check_invariants(&m);
        assert_eq!(m.stats().referenced, 0);
        // Event ids are gapless and increasing.
        let p = m.events().clone();
        assert_eq!(p.last_event_id(), 2 + 2 + 1);
    }

    #[test]
    fn reuse_revives_lru_block() {
        let (mut m, _rx) = mgr(3, 2, true);
        let (mut t, _) = run_seq(&mut m, &[1, 2, 3, 4]);
        m.release(&mut t);
        assert_eq!(m.stats().cached, 2);
        assert_eq!(
            m.blocks_needed_for(&[1, 2, 3, 4, 5], &HashContext::default(), 5),
            3
        );
        let (mut t2, cached) = run_seq(&mut m, &[1, 2, 3, 4, 5]);
        assert_eq!(cached, 4);
        assert_eq!(m.stats().referenced, 3);
        assert_eq!(m.stats().cached, 0);
        m.release(&mut t2);
        check_invariants(&m);
    }

    #[test]
    fn out_of_blocks_is_all_or_nothing() {
        let (mut m, _rx) = mgr(2, 2, true);
        let mut t = BlockTable::default();
        let err = m.ensure_capacity(&mut t, 5).unwrap_err();
        assert_eq!(
            err,
            OutOfBlocks {
                needed: 3,
                available: 2
            }
        );
        assert!(t.is_empty());
        assert_eq!(m.stats().free, 2);
    }

    #[test]
    fn reuse_disabled_hashes_nothing() {
        let (mut m, mut rx) = mgr(4, 2, false);
        let (mut t, _) = run_seq(&mut m, &[1, 2, 3, 4]);
        m.release(&mut t);
        let (mut t2, cached) = run_seq(&mut m, &[1, 2, 3, 4]);
        assert_eq!(cached, 0);
        assert!(drain(&mut rx).is_empty());
        m.release(&mut t2);
        assert_eq!(m.stats().free, 4);
    }

    #[test]
    fn partial_blocks_are_hashed_when_they_fill() {
        let (mut m, mut rx) = mgr(4, 4, true);
        let mut toks = vec![1, 2, 3];
        let mut t = BlockTable::default();
        m.ensure_capacity(&mut t, 3).unwrap();
        m.commit_computed(&mut t, &toks, 3);
        assert!(drain(&mut rx).is_empty());
        toks.push(4);
        m.ensure_capacity(&mut t, 4).unwrap();
        // Full but not computed yet: not stored.
        m.commit_computed(&mut t, &toks, 3);
        assert!(drain(&mut rx).is_empty());
        m.commit_computed(&mut t, &toks, 4);
        assert_eq!(drain(&mut rx).len(), 1);
        m.release(&mut t);
    }

    #[test]
    fn concurrent_duplicate_prefix_is_not_double_stored() {
        let (mut m, mut rx) = mgr(4, 2, true);
        let mut t1 = BlockTable::default();
        let mut t2 = BlockTable::default();
        m.ensure_capacity(&mut t1, 2).unwrap();
        m.ensure_capacity(&mut t2, 2).unwrap();
        m.commit_computed(&mut t1, &[7, 7], 2);
        m.commit_computed(&mut t2, &[7, 7], 2);
        assert_eq!(drain(&mut rx).len(), 1);
        m.release(&mut t1);
        m.release(&mut t2);
        let s = m.stats();
        assert_eq!((s.cached, s.free), (1, 3));
    }

    #[test]
    fn clear_cache() {
        let (mut m, mut rx) = mgr(4, 2, true);
        let (mut t, _) = run_seq(&mut m, &[1, 2]);
        assert_eq!(m.clear_cache(), Err(1));
        m.release(&mut t);
        drain(&mut rx);
        m.clear_cache().unwrap();
        assert_eq!(drain(&mut rx)[0].data, KvCacheEventData::Cleared);
        assert_eq!(m.stats().free, 4);
        assert!(m.match_prefix(&[1, 2], &HashContext::default()).is_empty());
    }
}
