//! KV-aware routing for Tandem: everything the router needs to decide which worker gets a
//! request, and nothing about how requests or events travel.
//!
//! This crate owns:
//! - [`protocols`]: router-side types around the engine's block hashing and KV event shapes
//!   (re-exported from `tandem-engine`, Dynamo-compatible: XXH3-64 seed 1337, rolling
//!   sequence hashes, stored/removed/cleared events with a per-worker `event_id`);
//! - [`indexer`]: the radix index of which worker holds which blocks, with event-id gap
//!   detection, replay and dump ingestion;
//! - [`sequences`]: per-worker load the router itself has in flight (active prefill tokens and
//!   decode blocks);
//! - [`scheduling`]: the router modes (`kv`, `round-robin`, `random`, `least-loaded`,
//!   `power-of-two`, `direct`), the KV cost function, temperature sampling and busy thresholds;
//! - [`config`]: [`KvRouterConfig`], the values behind the router flags;
//! - [`metrics`]: metric names and recording helpers (facade only, no exporter);
//! - [`replica`]: the load events router replicas share (`--router-replica-sync`);
//! - [`router`]: [`KvRouter`], the thread-safe handle combining them for the serving layer.
//!
//! It does not own transport (gRPC/NATS subscriptions, asking a worker for a replay or dump),
//! discovery, tokenization, or the HTTP API: those call into this crate.

pub mod config;
pub mod indexer;
pub mod metrics;
pub mod protocols;
pub mod replica;
pub mod router;
pub mod scheduling;
pub mod sequences;

pub use config::{ConfigError, KvRouterConfig, RouterMode};
pub use indexer::{ApplyOutcome, GapReport, IndexerError, KvIndexer, ResyncOutcome};
pub use protocols::{OverlapScores, RouterEvent, WorkerId};
pub use replica::{LoadEvent, LoadSink};
pub use router::{KvRouter, RouteError};
pub use scheduling::{SelectError, SelectOptions, Selection, WorkerInfo, WorkerSelector};
pub use sequences::{ActiveSequences, LoadSource, NewRequest, WorkerLoad};
