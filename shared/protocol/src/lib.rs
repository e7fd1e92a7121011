//! The wire contracts between Tandem processes: the generated gRPC code of `proto/` and the
//! model card workers publish in discovery.

pub mod card;

/// Generated code of `proto/worker.proto`.
pub mod worker {
    #![allow(clippy::all)]
    tonic::include_proto!("tandem.worker.v1");
}

pub use card::ModelCard;

/// gRPC messages may carry the tokenizer (about 11 MB for Qwen3).
pub const MAX_GRPC_MESSAGE_BYTES: usize = 64 * 1024 * 1024;
