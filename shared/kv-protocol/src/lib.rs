//! What an engine and a router must agree on about KV blocks, and nothing more: how a block is
//! hashed (Dynamo's XXH3 scheme and seed, optionally salted per tenant) and the KV cache events workers publish (Dynamo's
//! `KvCacheEvent` shape). A leaf crate: the engine publishes these, the KV router indexes them,
//! and neither links the other.

pub mod events;
pub mod hash;
pub mod media;

pub use events::{
    KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData,
    KvStoredDump, ReplayGap, StoredBlock,
};
pub use hash::{
    block_hashes, chain_hash, local_block_hash, local_block_hashes, salted_block_hash,
    salted_block_hashes, sequence_hashes, CacheSalt, ExternalSequenceBlockHash, LocalBlockHash,
    XXH3_SEED,
};
pub use media::{BadMediaSpans, HashContext, MediaSpan};
