//! Block hashing compatible with Dynamo's KV router (`lib/kv-router/src/protocols.rs`).
//!
//! Two hashes exist per full block:
//! - the *local* hash (`tokens_hash` in events, `LocalBlockHash` in Dynamo): XXH3-64 with seed
//!   1337 over the block's tokens as little-endian `u32` bytes. It depends only on the block's
//!   own tokens.
//! - the *sequence* hash (`block_hash` in events): chains the local hashes so that it identifies
//!   the whole prefix up to and including the block: `seq[0] = local[0]`,
//!   `seq[i] = xxh3_64_with_seed(le(seq[i-1]) ++ le(local[i]), 1337)`.
//!
//! Only full blocks are hashed: a trailing partial block has no hash, because its contents
//! are still changing and could never be matched by another request's full block.
//!
//! A request may carry a [`CacheSalt`] (one per tenant, or vLLM's `cache_salt`): its blocks'
//! local hashes then cover the salt's eight bytes before the tokens, so every hash of a salted
//! sequence differs from the unsalted one and from any other salt's. Engines register and
//! match blocks under these hashes and routers index them, so requests of different salts
//! never share a cache entry, and a prefix-cache hit (or a router's score) reveals nothing
//! about another tenant's prompts.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The seed Dynamo uses for every KV hash.
pub const XXH3_SEED: u64 = 1337;

/// Content hash of one block's tokens alone (Dynamo's `LocalBlockHash`): what a router computes
/// from a request and navigates its radix index by.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct LocalBlockHash(pub u64);

/// A block's chained hash, identifying the whole prefix up to and including it (Dynamo's
/// `ExternalSequenceBlockHash`): the engine's id for a block in its events. A router treats it
/// as opaque and only uses it to find the block again on removal or when a child is stored.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct ExternalSequenceBlockHash(pub u64);

impl std::fmt::LowerHex for LocalBlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::LowerHex::fmt(&self.0, f)
    }
}

impl std::fmt::LowerHex for ExternalSequenceBlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::LowerHex::fmt(&self.0, f)
    }
}

/// The salt of a request's block hashes: requests with different salts (or one salted, one
/// not) never share KV blocks. Opaque to engines; the router derives it from the tenant (and
/// a request's `cache_salt`), and it travels with the request to every worker that hashes
/// its blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CacheSalt(pub u64);

/// Hash of one block's tokens alone.
pub fn local_block_hash(tokens: &[u32]) -> LocalBlockHash {
    salted_block_hash(None, tokens)
}

/// Hash of one block's tokens under `salt`: with a salt, its little-endian bytes come before
/// the tokens' (so a salted block never hashes like an unsalted one: the inputs' lengths
/// differ).
pub fn salted_block_hash(salt: Option<CacheSalt>, tokens: &[u32]) -> LocalBlockHash {
    let mut bytes = Vec::with_capacity(8 + tokens.len() * 4);
    if let Some(CacheSalt(s)) = salt {
        bytes.extend_from_slice(&s.to_le_bytes());
    }
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    LocalBlockHash(xxh3_64_with_seed(&bytes, XXH3_SEED))
}

/// Local hashes of every full block of `tokens`; the trailing partial block is dropped.
pub fn local_block_hashes(tokens: &[u32], block_size: usize) -> Vec<LocalBlockHash> {
    salted_block_hashes(None, tokens, block_size)
}

/// Local hashes of every full block of `tokens` under `salt`.
pub fn salted_block_hashes(
    salt: Option<CacheSalt>,
    tokens: &[u32],
    block_size: usize,
) -> Vec<LocalBlockHash> {
    if block_size == 0 {
        return Vec::new();
    }
    tokens
        .chunks_exact(block_size)
        .map(|chunk| salted_block_hash(salt, chunk))
        .collect()
}

/// Sequence hash of a block given its parent's sequence hash (None for the first block).
pub fn chain_hash(
    parent: Option<ExternalSequenceBlockHash>,
    local: LocalBlockHash,
) -> ExternalSequenceBlockHash {
    match parent {
        None => ExternalSequenceBlockHash(local.0),
        Some(p) => {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&p.0.to_le_bytes());
            bytes[8..].copy_from_slice(&local.0.to_le_bytes());
            ExternalSequenceBlockHash(xxh3_64_with_seed(&bytes, XXH3_SEED))
        }
    }
}

/// Sequence hashes from a list of local hashes.
pub fn sequence_hashes(locals: &[LocalBlockHash]) -> Vec<ExternalSequenceBlockHash> {
    let mut out = Vec::with_capacity(locals.len());
    let mut parent = None;
    for &l in locals {
        let h = chain_hash(parent, l);
        out.push(h);
        parent = Some(h);
    }
    out
}

/// Both hashes of every full block of `tokens`: `(local, sequence)` pairs.
pub fn block_hashes(
    tokens: &[u32],
    block_size: usize,
) -> Vec<(LocalBlockHash, ExternalSequenceBlockHash)> {
    let locals = local_block_hashes(tokens, block_size);
    let seqs = sequence_hashes(&locals);
    locals.into_iter().zip(seqs).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    // Known values computed independently with Python's `xxhash` package:
    //   xxhash.xxh3_64_intdigest(struct.pack('<4I', 1,2,3,4), seed=1337)
    //   xxhash.xxh3_64_intdigest(struct.pack('<QQ', a, b), seed=1337)
    const H1234: u64 = 14643705804678351452;
    const H5678: u64 = 16777012769546811212;
    const CHAIN: u64 = 4945711292740353085;
    const H0_31: u64 = 5756925433886871916;

    #[test]
    fn local_hash_matches_python_xxhash() {
        assert_eq!(local_block_hash(&[1, 2, 3, 4]), LocalBlockHash(H1234));
        assert_eq!(local_block_hash(&[5, 6, 7, 8]), LocalBlockHash(H5678));
        let toks: Vec<u32> = (0..32).collect();
        assert_eq!(local_block_hash(&toks), LocalBlockHash(H0_31));
    }

    #[test]
    fn chained_hash_matches_python_xxhash() {
        let hs = block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 4);
        let pairs: Vec<(u64, u64)> = hs.iter().map(|(l, s)| (l.0, s.0)).collect();
        assert_eq!(pairs, vec![(H1234, H1234), (H5678, CHAIN)]);
    }

    #[test]
    fn partial_blocks_are_not_hashed() {
        assert!(block_hashes(&[1, 2, 3], 4).is_empty());
        assert_eq!(local_block_hashes(&[1, 2, 3, 4, 5], 4).len(), 1);
        assert!(local_block_hashes(&[1, 2], 0).is_empty());
    }

    #[test]
    fn a_salt_changes_every_hash_and_no_salt_is_the_dynamo_hash() {
        let toks: Vec<u32> = (0..16).collect();
        assert_eq!(
            salted_block_hashes(None, &toks, 4),
            local_block_hashes(&toks, 4)
        );
        let a = salted_block_hashes(Some(CacheSalt(1)), &toks, 4);
        let b = salted_block_hashes(Some(CacheSalt(2)), &toks, 4);
        let plain = local_block_hashes(&toks, 4);
        for i in 0..4 {
            assert_ne!(a[i], plain[i], "block {i}");
            assert_ne!(a[i], b[i], "block {i}");
        }
        assert_eq!(a, salted_block_hashes(Some(CacheSalt(1)), &toks, 4));
        // Python: xxhash.xxh3_64_intdigest(struct.pack('<Q4I', 7, 1, 2, 3, 4), seed=1337)
        let mut bytes = 7u64.to_le_bytes().to_vec();
        for t in [1u32, 2, 3, 4] {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        assert_eq!(
            salted_block_hash(Some(CacheSalt(7)), &[1, 2, 3, 4]),
            LocalBlockHash(xxh3_64_with_seed(&bytes, XXH3_SEED))
        );
    }

    #[test]
    fn sequence_hash_depends_on_prefix() {
        let a = block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4);
        let b = block_hashes(&[9, 9, 9, 9, 5, 6, 7, 8], 4);
        assert_eq!(a[1].0, b[1].0, "same tokens, same local hash");
        assert_eq!(
            a[0].1 .0, a[0].0 .0,
            "the first block's sequence hash is its local hash"
        );
        assert_ne!(a[1].1, b[1].1, "different prefix, different sequence hash");
    }
}
