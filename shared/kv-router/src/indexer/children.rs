//! Child links of a radix node, sized for the common shapes: most nodes are links of one
//! cached chain (one child, kept inline), a few are branch points.

use rustc_hash::FxHashMap;

use crate::protocols::LocalBlockHash;

/// Up to this many children are kept in a small vector scanned linearly.
const FEW_CHILDREN: usize = 8;

/// Children of a node by local hash. Most nodes have at most one child (a cached sequence is a
/// chain), so the first child lives inline: no heap allocation for the common case.
pub(super) enum Children {
    None,
    One(LocalBlockHash, u32),
    Few(Vec<(LocalBlockHash, u32)>),
    Many(Box<FxHashMap<LocalBlockHash, u32>>),
}

impl Children {
    pub(super) fn get(&self, key: LocalBlockHash) -> Option<u32> {
        match self {
            Children::None => None,
            Children::One(k, n) => (*k == key).then_some(*n),
            Children::Few(v) => v.iter().find(|(k, _)| *k == key).map(|(_, n)| *n),
            Children::Many(m) => m.get(&key).copied(),
        }
    }

    pub(super) fn insert(&mut self, key: LocalBlockHash, node: u32) {
        match self {
            Children::None => *self = Children::One(key, node),
            Children::One(k, n) => *self = Children::Few(vec![(*k, *n), (key, node)]),
            Children::Few(v) if v.len() < FEW_CHILDREN => v.push((key, node)),
            Children::Few(v) => {
                let mut m: FxHashMap<LocalBlockHash, u32> = v.drain(..).collect();
                m.insert(key, node);
                *self = Children::Many(Box::new(m));
            }
            Children::Many(m) => {
                m.insert(key, node);
            }
        }
    }

    pub(super) fn remove(&mut self, key: LocalBlockHash) {
        match self {
            Children::None => {}
            Children::One(k, _) => {
                if *k == key {
                    *self = Children::None;
                }
            }
            Children::Few(v) => {
                if let Some(i) = v.iter().position(|(k, _)| *k == key) {
                    v.swap_remove(i);
                }
            }
            Children::Many(m) => {
                m.remove(&key);
            }
        }
    }

    /// Appends `(child, tag)` for every child.
    pub(super) fn push_ids_with<T: Copy>(&self, out: &mut Vec<(u32, T)>, tag: T) {
        match self {
            Children::None => {}
            Children::One(_, n) => out.push((*n, tag)),
            Children::Few(v) => out.extend(v.iter().map(|(_, n)| (*n, tag))),
            Children::Many(m) => out.extend(m.values().map(|n| (*n, tag))),
        }
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        match self {
            Children::None => 0,
            Children::One(..) => 1,
            Children::Few(v) => v.len(),
            Children::Many(m) => m.len(),
        }
    }
}
