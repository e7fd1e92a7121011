//! The encode worker's embedding cache: an image's embedding rows by the SHA-256 of its
//! decoded pixels, least recently used evicted first, bounded in bytes
//! (`--multimodal-embedding-cache-capacity-gb`; 0 turns it off).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

/// Gauge of the bytes the cache holds.
pub const CACHE_BYTES: &str = "tandem_encode_embedding_cache_bytes";

type Key = [u8; 32];

struct Entry {
    rows: Arc<Vec<f32>>,
    tick: u64,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<Key, Entry>,
    /// Recency order: tick → key (the smallest tick is the least recently used).
    order: BTreeMap<u64, Key>,
    bytes: usize,
    tick: u64,
}

pub struct EmbeddingCache {
    capacity: usize,
    inner: Mutex<Inner>,
}

impl EmbeddingCache {
    /// A cache of at most `capacity` bytes of rows (0: nothing is kept).
    pub fn new(capacity: usize) -> Self {
        EmbeddingCache {
            capacity,
            inner: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Every update leaves the maps consistent before it can panic.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn get(&self, key: &Key) -> Option<Arc<Vec<f32>>> {
        let mut g = self.lock();
        g.tick += 1;
        let tick = g.tick;
        let e = g.entries.get_mut(key)?;
        let old = std::mem::replace(&mut e.tick, tick);
        let rows = e.rows.clone();
        g.order.remove(&old);
        g.order.insert(tick, *key);
        Some(rows)
    }

    /// Keeps `rows` under `key`, evicting the least recently used entries to make room. Rows
    /// larger than the whole capacity are not kept.
    pub fn insert(&self, key: Key, rows: Arc<Vec<f32>>) {
        let size = rows.len() * std::mem::size_of::<f32>();
        if size > self.capacity {
            return;
        }
        let mut g = self.lock();
        if g.entries.contains_key(&key) {
            return;
        }
        while g.bytes + size > self.capacity {
            let Some((_, victim)) = g.order.pop_first() else {
                break;
            };
            if let Some(e) = g.entries.remove(&victim) {
                g.bytes -= e.rows.len() * std::mem::size_of::<f32>();
            }
        }
        g.tick += 1;
        let tick = g.tick;
        g.order.insert(tick, key);
        g.entries.insert(key, Entry { rows, tick });
        g.bytes += size;
        metrics::gauge!(CACHE_BYTES).set(g.bytes as f64);
    }

    /// Entries and bytes held.
    pub fn usage(&self) -> (usize, usize) {
        let g = self.lock();
        (g.entries.len(), g.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> Key {
        [b; 32]
    }

    #[test]
    fn least_recently_used_rows_go_first_and_bytes_stay_bounded() {
        // Room for two entries of 4 floats.
        let c = EmbeddingCache::new(32);
        c.insert(key(1), Arc::new(vec![1.0; 4]));
        c.insert(key(2), Arc::new(vec![2.0; 4]));
        assert_eq!(c.usage(), (2, 32));
        // Touch 1: 2 is now the oldest.
        assert_eq!(c.get(&key(1)).unwrap()[0], 1.0);
        c.insert(key(3), Arc::new(vec![3.0; 4]));
        assert!(c.get(&key(2)).is_none(), "2 was evicted");
        assert!(c.get(&key(1)).is_some() && c.get(&key(3)).is_some());
        assert_eq!(c.usage(), (2, 32));
        // Too large for the cache at all, and a disabled cache.
        c.insert(key(4), Arc::new(vec![0.0; 9]));
        assert!(c.get(&key(4)).is_none());
        let off = EmbeddingCache::new(0);
        off.insert(key(1), Arc::new(vec![1.0]));
        assert_eq!(off.usage(), (0, 0));
    }
}
