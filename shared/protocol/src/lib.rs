//! The wire contracts between Tandem processes: the generated gRPC code of `proto/` and the
//! model card workers publish in discovery.

pub mod card;
pub mod wire;

/// Generated code of `proto/worker.proto`.
pub mod worker {
    #![allow(clippy::all)]
    tonic::include_proto!("tandem.worker.v3");
}

pub use card::{KvDtype, ModelCard, MultimodalCard, WorkerRole};
pub use wire::WireError;

/// The version of `proto/worker.proto` (its package is `tandem.worker.v<this>`). Workers
/// announce it in their model card; a router routes only to workers of its own version.
pub const WORKER_PROTOCOL_VERSION: u32 = 3;

/// gRPC messages may carry the tokenizer (about 11 MB for Qwen3).
pub const MAX_GRPC_MESSAGE_BYTES: usize = 64 * 1024 * 1024;
