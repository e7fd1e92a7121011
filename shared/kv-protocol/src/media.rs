//! Hashing of blocks that hold media (image) tokens.
//!
//! A multimodal prompt stands for each image with a run of identical placeholder tokens (the
//! model's image token, repeated as many times as the image has embeddings). Hashing those
//! tokens alone would make the same text with another image hit the cache, so a block that
//! holds any placeholder of an image covers, besides its tokens, that image's content hash and
//! where in the image the block starts ([`MediaSpan`]). Blocks without media hash exactly as
//! before (salted or not), so text-only prefixes are shared across requests with and without
//! images.
//!
//! [`HashContext`] gathers everything besides the tokens that a sequence's block hashes
//! cover (the tenant's [`CacheSalt`] and the media spans); engines and routers both hash
//! through it, so what a router indexes is what an engine announces.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::hash::{salted_block_hash, sequence_hashes, CacheSalt, LocalBlockHash, XXH3_SEED};

/// `len` placeholder tokens of a prompt, from position `start`, stand for one media item whose
/// content hash is `hash` (the first 8 bytes of the image's SHA-256, say).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MediaSpan {
    pub start: usize,
    pub len: usize,
    pub hash: u64,
}

impl MediaSpan {
    /// Whether the span has a token in `[from, to)`.
    fn overlaps(&self, from: usize, to: usize) -> bool {
        self.start < to && from < self.start.saturating_add(self.len)
    }
}

/// What a sequence's block hashes cover besides the tokens: the cache salt and the media
/// spans (sorted by `start`, not overlapping: see [`HashContext::new`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HashContext {
    pub salt: Option<CacheSalt>,
    media: Vec<MediaSpan>,
}

/// Media spans that overlap one another, or are empty.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("media span {index} (start {start}, len {len}) is empty or overlaps the one before")]
pub struct BadMediaSpans {
    pub index: usize,
    pub start: usize,
    pub len: usize,
}

impl HashContext {
    /// A context of `salt` and `media` (sorted here by start); spans must be non-empty and
    /// disjoint.
    pub fn new(salt: Option<CacheSalt>, mut media: Vec<MediaSpan>) -> Result<Self, BadMediaSpans> {
        media.sort_by_key(|m| m.start);
        let mut end = 0usize;
        for (index, m) in media.iter().enumerate() {
            if m.len == 0 || (index > 0 && m.start < end) {
                return Err(BadMediaSpans {
                    index,
                    start: m.start,
                    len: m.len,
                });
            }
            end = m.start.saturating_add(m.len);
        }
        Ok(HashContext { salt, media })
    }

    /// A context of only a salt (no media).
    pub fn salted(salt: Option<CacheSalt>) -> Self {
        HashContext {
            salt,
            media: Vec::new(),
        }
    }

    pub fn media(&self) -> &[MediaSpan] {
        &self.media
    }

    /// The local hash of block `index` (tokens `index*block_size ..`), whose tokens are
    /// `chunk`: the salted token hash when no media span touches the block; else the hash also
    /// covers, per span touching it, the span's content hash and the block's offset into it.
    pub fn block_hash(&self, index: usize, block_size: usize, chunk: &[u32]) -> LocalBlockHash {
        let from = index * block_size;
        let to = from + chunk.len();
        let mut touching = self
            .media
            .iter()
            .filter(|m| m.overlaps(from, to))
            .peekable();
        if touching.peek().is_none() {
            return salted_block_hash(self.salt, chunk);
        }
        let mut bytes = Vec::with_capacity(16 + 24 * 2 + chunk.len() * 4);
        bytes.extend_from_slice(b"tandem-mm");
        if let Some(CacheSalt(s)) = self.salt {
            bytes.extend_from_slice(&s.to_le_bytes());
        }
        for m in touching {
            bytes.extend_from_slice(&m.hash.to_le_bytes());
            let offset = from as i64 - m.start as i64;
            bytes.extend_from_slice(&offset.to_le_bytes());
        }
        for t in chunk {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        LocalBlockHash(xxh3_64_with_seed(&bytes, XXH3_SEED))
    }

    /// Local hashes of every full block of `tokens`; the trailing partial block is dropped.
    pub fn block_hashes(&self, tokens: &[u32], block_size: usize) -> Vec<LocalBlockHash> {
        if block_size == 0 {
            return Vec::new();
        }
        tokens
            .chunks_exact(block_size)
            .enumerate()
            .map(|(i, chunk)| self.block_hash(i, block_size, chunk))
            .collect()
    }

    /// `(local, sequence)` hashes of every full block of `tokens`.
    pub fn block_and_sequence_hashes(
        &self,
        tokens: &[u32],
        block_size: usize,
    ) -> Vec<(LocalBlockHash, crate::hash::ExternalSequenceBlockHash)> {
        let locals = self.block_hashes(tokens, block_size);
        let seqs = sequence_hashes(&locals);
        locals.into_iter().zip(seqs).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::{local_block_hashes, salted_block_hashes};

    fn span(start: usize, len: usize, hash: u64) -> MediaSpan {
        MediaSpan { start, len, hash }
    }

    #[test]
    fn without_media_the_context_hashes_like_the_salted_hash() {
        let toks: Vec<u32> = (0..16).collect();
        assert_eq!(
            HashContext::default().block_hashes(&toks, 4),
            local_block_hashes(&toks, 4)
        );
        let salt = Some(CacheSalt(9));
        assert_eq!(
            HashContext::salted(salt).block_hashes(&toks, 4),
            salted_block_hashes(salt, &toks, 4)
        );
    }

    #[test]
    fn only_blocks_touching_an_image_depend_on_its_hash() {
        // Blocks of 4: [0..4) text, [4..8) and [8..12) image, [12..16) text.
        let mut toks: Vec<u32> = (0..16).collect();
        toks[5..11].fill(99);
        let a = HashContext::new(None, vec![span(5, 6, 1)]).unwrap();
        let b = HashContext::new(None, vec![span(5, 6, 2)]).unwrap();
        let (ha, hb) = (a.block_hashes(&toks, 4), b.block_hashes(&toks, 4));
        let plain = local_block_hashes(&toks, 4);
        assert_eq!(ha[0], plain[0], "text before the image is shared");
        assert_eq!(
            ha[3], plain[3],
            "a block after the image has the plain local hash"
        );
        assert_ne!(ha[1], hb[1]);
        assert_ne!(ha[2], hb[2]);
        assert_ne!(ha[1], plain[1]);
        // The chained (sequence) hashes differ from the image on: nothing after it is shared.
        let (sa, sb) = (sequence_hashes(&ha), sequence_hashes(&hb));
        assert_eq!(sa[0], sb[0]);
        assert_ne!(sa[3], sb[3]);
        assert_eq!(ha, a.clone().block_hashes(&toks, 4), "deterministic");
    }

    #[test]
    fn the_offset_into_the_image_counts() {
        // The same image placed one block later hashes its blocks differently from the
        // same tokens at another offset into the image.
        let toks = vec![7u32; 8];
        let early = HashContext::new(None, vec![span(0, 8, 5)]).unwrap();
        let late = HashContext::new(None, vec![span(4, 4, 5)]).unwrap();
        assert_ne!(
            early.block_hashes(&toks, 4)[1],
            late.block_hashes(&toks, 4)[1]
        );
    }

    #[test]
    fn salt_and_media_combine() {
        let toks = vec![3u32; 8];
        let m = vec![span(0, 8, 5)];
        let s1 = HashContext::new(Some(CacheSalt(1)), m.clone()).unwrap();
        let s2 = HashContext::new(Some(CacheSalt(2)), m.clone()).unwrap();
        let none = HashContext::new(None, m).unwrap();
        assert_ne!(s1.block_hashes(&toks, 4), s2.block_hashes(&toks, 4));
        assert_ne!(s1.block_hashes(&toks, 4), none.block_hashes(&toks, 4));
    }

    #[test]
    fn overlapping_or_empty_spans_are_refused() {
        assert!(HashContext::new(None, vec![span(0, 4, 1), span(3, 2, 2)]).is_err());
        assert!(HashContext::new(None, vec![span(0, 0, 1)]).is_err());
        let ok = HashContext::new(None, vec![span(8, 2, 1), span(0, 4, 2)]).unwrap();
        assert_eq!(ok.media()[0].start, 0, "sorted by start");
    }
}
