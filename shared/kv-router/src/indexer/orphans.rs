//! Blocks a worker still holds but that cannot be matched: their parent is not held (the
//! engine evicted or re-stored it, or a dump lists it first). Engines drop blocks one by one,
//! so a child can outlive its parent; it becomes matchable again the moment the parent is
//! stored again. Keeping them here, outside the tree, keeps the tree prefix-closed (fast
//! matching) while the router's view still equals the engine's own dump.

use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use crate::protocols::{ExternalSequenceBlockHash, LocalBlockHash};

#[derive(Default)]
pub(super) struct Orphans {
    /// block → (parent block, local hash)
    blocks: FxHashMap<ExternalSequenceBlockHash, (ExternalSequenceBlockHash, LocalBlockHash)>,
    /// parent block → orphans waiting for it
    below: FxHashMap<ExternalSequenceBlockHash, SmallVec<[ExternalSequenceBlockHash; 2]>>,
}

impl Orphans {
    pub(super) fn insert(
        &mut self,
        block: ExternalSequenceBlockHash,
        parent: ExternalSequenceBlockHash,
        local: LocalBlockHash,
    ) {
        self.remove(block);
        self.blocks.insert(block, (parent, local));
        self.below.entry(parent).or_default().push(block);
    }

    /// Forgets an orphan; returns its (parent, local hash). Its own orphans stay.
    pub(super) fn remove(
        &mut self,
        block: ExternalSequenceBlockHash,
    ) -> Option<(ExternalSequenceBlockHash, LocalBlockHash)> {
        let (parent, local) = self.blocks.remove(&block)?;
        if let Some(v) = self.below.get_mut(&parent) {
            v.retain(|b| *b != block);
            if v.is_empty() {
                self.below.remove(&parent);
            }
        }
        Some((parent, local))
    }

    /// Removes and returns the orphans waiting for `parent`, with their local hashes.
    pub(super) fn take_below(
        &mut self,
        parent: ExternalSequenceBlockHash,
    ) -> SmallVec<[(ExternalSequenceBlockHash, LocalBlockHash); 2]> {
        if self.below.is_empty() {
            return SmallVec::new();
        }
        let Some(kids) = self.below.remove(&parent) else {
            return SmallVec::new();
        };
        kids.into_iter()
            .filter_map(|k| self.blocks.remove(&k).map(|(_, l)| (k, l)))
            .collect()
    }

    pub(super) fn contains(&self, block: ExternalSequenceBlockHash) -> bool {
        self.blocks.contains_key(&block)
    }

    pub(super) fn len(&self) -> usize {
        self.blocks.len()
    }

    pub(super) fn clear(&mut self) -> usize {
        let n = self.blocks.len();
        self.blocks.clear();
        self.below.clear();
        n
    }

    /// (block, parent, local hash) of every orphan.
    pub(super) fn iter(
        &self,
    ) -> impl Iterator<
        Item = (
            ExternalSequenceBlockHash,
            ExternalSequenceBlockHash,
            LocalBlockHash,
        ),
    > + '_ {
        self.blocks.iter().map(|(&b, &(p, l))| (b, p, l))
    }

    /// Internal consistency, for `check_invariants`.
    pub(super) fn check(&self) -> Result<(), String> {
        let listed: usize = self.below.values().map(|v| v.len()).sum();
        if listed != self.blocks.len() {
            return Err(format!(
                "{listed} orphan links vs {} orphans",
                self.blocks.len()
            ));
        }
        for (p, kids) in &self.below {
            for k in kids {
                if self.blocks.get(k).map(|e| e.0) != Some(*p) {
                    return Err(format!("orphan {k:#x} listed under the wrong parent"));
                }
            }
        }
        Ok(())
    }
}
