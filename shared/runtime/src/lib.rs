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
//! - [`testing`]: a harness that starts real `etcd` and `nats-server` processes on loopback for
//!   integration tests (used by this crate's tests and by the services' tests).
//!
//! It does not own request routing, the request plane (gRPC, in the services), configuration
//! parsing (`tandem-config`) or the engine.

pub mod discovery;
pub mod events;
pub mod metrics;
pub mod net;
pub mod shutdown;
pub mod testing;

pub use discovery::{
    Discovery, DiscoveryBackend, DiscoveryError, DiscoveryEvent, DiscoveryWatch, Entry, Instance,
    Registration,
};
