//! The paged KV cache.
pub mod block_manager;
pub mod events;
pub mod hash;
pub mod layout;
