//! The workspace's test harness. Only ever a dev-dependency: no crate that a release binary
//! links may depend on it.
//!
//! - [`proc`]: child processes (the workspace's own binaries) awaited by their READY lines,
//!   killed on drop;
//! - [`servers`]: real `etcd` and `nats-server` on free loopback ports;
//! - [`host`]: temp folders, free ports, installed binaries;
//! - [`fetch`]: real models fetched once into the cache for tests;
//! - [`tls`]: the internal mutual-TLS folder the test's processes share;
//! - [`faultproxy`]: a TCP proxy injecting latency, loss and partitions (`tandem-faultproxy`).
//!
//! Every wait is bounded and polls readiness; nothing sleeps a fixed time.

pub mod faultproxy;
pub mod fetch;
pub mod host;
pub mod proc;
pub mod servers;
pub mod tls;

pub use host::{find_binary, free_port, wait_until, TempDir};
pub use proc::{field, sibling_bin, spawn_ready, spawn_ready_n, Proc, READY_TIMEOUT};
pub use servers::{EtcdServer, HarnessError, NatsServer, STARTUP_TIMEOUT};
pub use tls::{internal_security, internal_tls_dir, tls_args};
