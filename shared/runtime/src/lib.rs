//! Tandem's distributed runtime: the pieces every Tandem process shares to find its peers and
//! talk about itself, independent of what it serves.
//!
//! This crate owns:
//! - [`discovery`]: registering instances (with their model card) and watching them, over three
//!   interchangeable backends (`mem`, `file`, `etcd`) with one key layout
//!   (`v1/instances/...`, `v1/mdc/...`) and crash detection by lease / heartbeat TTL.
//! - [`events`]: the NATS event plane (KV events on `namespace.{ns}.component.{comp}.kv-events`).
//!   The `direct` (gRPC stream) event plane lives in the services, not here.
//! - [`metrics`]: the Prometheus recorder, the shared metric names, and the small HTTP status
//!   server (`/metrics`, `/health`, `/live`).
//! - [`shutdown`]: SIGTERM/SIGINT to a cancellation token, so services deregister, drain, exit.
//! - [`net`]: bind versus advertised addresses for listeners.
//!
//! A worker, in short:
//!
//! ```no_run
//! # async fn worker() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use tandem_runtime::{discovery, metrics, net::BoundListener, shutdown};
//!
//! let token = shutdown::on_signals();
//! let handle = metrics::install_recorder()?;
//! let rpc = BoundListener::bind("0.0.0.0:0", std::env::var("DYN_TCP_RPC_HOST").ok().as_deref()).await?;
//! let status = metrics::serve_status_until("0.0.0.0:0", handle, Arc::new(|| true), token.clone()).await?;
//! let store = discovery::connect(&discovery::DiscoveryOptions::default()).await?;
//! let instance = discovery::Instance {
//!     namespace: "dynamo".into(),
//!     component: "backend".into(),
//!     endpoint: "generate".into(),
//!     instance_id: discovery::new_instance_id(),
//!     grpc_addr: rpc.advertised().to_string(),
//!     http_addr: Some(tandem_runtime::net::advertised_addr(status, None)?),
//!     role: "agg".into(),
//! };
//! let registration = store.register(instance, serde_json::json!({"served_model_name": "tiny"})).await?;
//! // ... serve on rpc.into_listener() ...
//! token.cancelled().await;
//! registration.deregister().await?; // routers stop sending first
//! // ... drain in-flight requests, then return ...
//! # Ok(()) }
//! ```
//!
//! It does not own request routing, the request plane (gRPC, in the services), configuration
//! parsing (`tandem-config`) or the engine.

pub mod discovery;
pub mod events;
pub mod metrics;
pub mod net;
pub mod shutdown;
pub mod task;

pub use discovery::{
    Discovery, DiscoveryBackend, DiscoveryError, DiscoveryEvent, DiscoveryWatch, Entry, Instance,
    Registration,
};
