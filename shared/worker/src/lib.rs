//! An engine worker as a service: builds the engine a worker's config asks for, serves it over
//! the gRPC `Worker` service of `proto/worker.proto`, registers its model card in discovery,
//! publishes KV events and gauges, and drains on SIGTERM.

#![deny(clippy::too_many_lines, clippy::too_many_arguments)]

pub mod card;
pub mod decode;
pub mod encode;
pub mod engine_setup;
pub mod failpoints;
pub mod grpc;
pub mod known_prefills;
pub mod lease_writes;
pub mod leases;
pub mod media;
pub mod nats;
pub mod prefill;
pub mod serve;
pub mod stats;
pub mod status;
pub mod transport;
pub mod wire;

pub use engine_setup::{
    build_engine, build_engine_on, build_engine_with, choose_device, BuiltEngine, Device,
};
pub use grpc::WorkerService;
pub use serve::{run, run_with, run_with_transfer, EngineBuilder, KvTransfer};
