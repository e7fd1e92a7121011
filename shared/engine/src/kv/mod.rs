//! The paged KV cache. Block hashing and the event types come from `tandem-kv-protocol`, the
//! leaf crate the router shares.
pub mod block_manager;
pub mod events;
pub mod fp8;
pub mod layout;

pub use tandem_kv_protocol::hash;
