//! Service discovery: who is serving what, where, and with which model card.
//!
//! A worker [`Discovery::register`]s an [`Instance`] together with its model card (opaque JSON
//! owned by the services) and keeps the returned [`Registration`] alive for as long as it
//! serves. A router [`Discovery::watch`]es a namespace and gets the current set followed by
//! changes. Three backends share this contract and one key layout (Dynamo's):
//!
//! - `v1/instances/{namespace}/{component}/{endpoint}/{instance_id:x}` → the [`Instance`] (JSON)
//! - `v1/mdc/{namespace}/{component}/{endpoint}/{instance_id:x}` → the model card (JSON)
//!
//! Backends: [`mem::MemDiscovery`] (one process), [`file::FileDiscovery`] (one machine, a folder
//! with heartbeats), [`etcd::EtcdDiscovery`] (leases). Both `file` and `etcd` notice a crashed
//! owner within their TTL.

pub mod etcd;
pub mod file;
pub mod mem;
mod tracker;

use serde::{Deserialize, Serialize};
use std::fmt;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::mpsc;

/// Boxed future used by the object-safe [`Discovery`] trait (services pick the backend at run
/// time from `--discovery-backend`, so the trait must work behind `Arc<dyn Discovery>`).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

pub type Result<T, E = DiscoveryError> = std::result::Result<T, E>;

/// Default time after which a silent instance counts as gone (Dynamo's etcd lease TTL).
pub const DEFAULT_TTL: Duration = Duration::from_secs(10);

/// Key prefix of instance records.
pub const INSTANCES_BUCKET: &str = "v1/instances";
/// Key prefix of model deployment cards.
pub const MDC_BUCKET: &str = "v1/mdc";

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("invalid {what} {value:?}: {reason}")]
    InvalidName {
        what: &'static str,
        value: String,
        reason: &'static str,
    },
    #[error("unknown discovery backend {0:?} (expected mem, file or etcd)")]
    UnknownBackend(String),
    #[error("discovery file store at {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    #[error("etcd at {endpoints:?} did not answer within {timeout:?}")]
    EtcdTimeout {
        endpoints: Vec<String>,
        timeout: Duration,
    },
    #[error("etcd request did not complete within {0:?}")]
    EtcdRequestTimeout(Duration),
    #[error("encoding discovery record: {0}")]
    Encode(#[from] serde_json::Error),
    #[error("discovery backend task stopped")]
    Closed,
    #[error(
        "etcd endpoint {0:?} is plaintext but internal channels use mutual TLS: give https:// \
         endpoints of an etcd started with --client-cert-auth and the deployment's CA, or run \
         with --insecure-internal"
    )]
    PlaintextEtcd(String),
    #[error(
        "etcd endpoint {0:?} is https:// but this process has no --internal-tls-dir to present \
         a client certificate with"
    )]
    EtcdTlsWithoutIdentity(String),
    #[error("the etcd client's TLS settings: {0}")]
    EtcdTls(String),
}

/// One serving instance: a process (or a data-parallel rank) behind one endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    pub namespace: String,
    pub component: String,
    pub endpoint: String,
    /// Unique per registration; [`new_instance_id`] makes one.
    pub instance_id: u64,
    /// Advertised request-plane (gRPC) address, `host:port`.
    pub grpc_addr: String,
    /// Advertised status server (`/metrics`, `/health`), if the process runs one.
    #[serde(default)]
    pub http_addr: Option<String>,
    /// Worker role (`agg`, `prefill`, `decode`, `encode`, ...): interpreted by the services.
    pub role: String,
}

impl Instance {
    /// The `{ns}/{comp}/{ep}/{id:x}` tail shared by both buckets.
    pub fn key_suffix(&self) -> String {
        format!(
            "{}/{}/{}/{:x}",
            self.namespace, self.component, self.endpoint, self.instance_id
        )
    }

    pub fn instance_key(&self) -> String {
        format!("{INSTANCES_BUCKET}/{}", self.key_suffix())
    }

    pub fn mdc_key(&self) -> String {
        format!("{MDC_BUCKET}/{}", self.key_suffix())
    }

    /// Rejects names that would break the key layout (or escape the file store's folder).
    pub fn validate(&self) -> Result<()> {
        validate_name("namespace", &self.namespace)?;
        validate_name("component", &self.component)?;
        validate_name("endpoint", &self.endpoint)?;
        Ok(())
    }
}

/// Names become key (and path) segments: keep them to a safe alphabet.
pub fn validate_name(what: &'static str, value: &str) -> Result<()> {
    let bad = |reason| {
        Err(DiscoveryError::InvalidName {
            what,
            value: value.to_string(),
            reason,
        })
    };
    if value.is_empty() {
        return bad("empty");
    }
    if value == "." || value == ".." || value.starts_with('.') {
        return bad("must not start with '.'");
    }
    if !value
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
    {
        return bad("only ASCII letters, digits, '_', '-' and '.' are allowed");
    }
    Ok(())
}

/// A fresh random instance id. Random rather than sequential so that ids from independent
/// processes (file/mem backends have no server to hand them out) do not collide; kept below
/// 2^53 so that JSON consumers that read numbers as doubles see the exact value.
pub fn new_instance_id() -> u64 {
    use std::collections::hash_map::RandomState;
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    if let Ok(d) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(d.as_nanos());
    }
    // Never 0: some callers use 0 as "unset".
    (h.finish() & ((1u64 << 53) - 1)).max(1)
}

/// An instance with its model card, as returned by [`Discovery::list`].
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub instance: Instance,
    pub card: serde_json::Value,
}

/// A change seen by a watcher. `Added` is also sent again, for the same `instance_id`, when an
/// instance's record or card changes (treat it as an upsert).
// Discovery events are rare and short-lived; boxing `Added` would only add noise.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum DiscoveryEvent {
    Added {
        instance: Instance,
        card: serde_json::Value,
    },
    Removed {
        instance_id: u64,
    },
}

/// The discovery plane. Object safe: use it as `Arc<dyn Discovery>`.
pub trait Discovery: Send + Sync {
    /// Publishes `instance` with `card` until the returned [`Registration`] is dropped or
    /// [`Registration::deregister`]ed. To change the card later use
    /// [`Registration::update_card`]; registering the same instance key twice while the first
    /// registration lives is a caller error (both would keep refreshing their own record).
    fn register(
        &self,
        instance: Instance,
        card: serde_json::Value,
    ) -> BoxFuture<'_, Result<Registration>>;

    /// The live entries of `namespace` (optionally only one component), sorted by key.
    fn list<'a>(
        &'a self,
        namespace: &'a str,
        component: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Vec<Entry>>>;

    /// Changes in `namespace`, starting with an `Added` for every entry present now. The
    /// background work stops when the returned [`DiscoveryWatch`] is dropped.
    fn watch<'a>(&'a self, namespace: &'a str) -> BoxFuture<'a, Result<DiscoveryWatch>>;
}

/// Backend-specific removal of one registration.
pub(crate) trait RegistrationInner: Send + Sync {
    /// Replaces the card; watchers see an `Added` for the same instance.
    fn update_card(&self, card: serde_json::Value) -> BoxFuture<'static, Result<()>>;
    /// Orderly removal: the entry is gone from the store when this returns.
    fn deregister(self: Box<Self>) -> BoxFuture<'static, Result<()>>;
    /// Best-effort synchronous removal, used from `Drop`.
    fn remove_now(self: Box<Self>);
    /// Stop keeping the entry alive without removing it, as a crash would.
    fn abandon(self: Box<Self>);
}

/// A live registration. Dropping it removes the entry (best effort: for etcd the lease revoke
/// is sent from a spawned task when a Tokio runtime is available, otherwise the lease expires);
/// [`Registration::deregister`] removes it and waits for that to finish.
pub struct Registration {
    instance: Instance,
    inner: Option<Box<dyn RegistrationInner>>,
}

impl Registration {
    pub(crate) fn new(instance: Instance, inner: Box<dyn RegistrationInner>) -> Self {
        Self {
            instance,
            inner: Some(inner),
        }
    }

    pub fn instance(&self) -> &Instance {
        &self.instance
    }

    /// Publishes a new model card for this instance (e.g. after a runtime configuration
    /// change). Watchers receive an `Added` with the same instance and the new card.
    pub async fn update_card(&self, card: serde_json::Value) -> Result<()> {
        match &self.inner {
            Some(inner) => inner.update_card(card).await,
            None => Err(DiscoveryError::Closed),
        }
    }

    /// Removes the entry and waits until the store confirms it.
    pub async fn deregister(mut self) -> Result<()> {
        match self.inner.take() {
            Some(inner) => inner.deregister().await,
            None => Ok(()),
        }
    }

    /// Stops the heartbeat / lease keep-alive but leaves the entry in the store, exactly what a
    /// `kill -9` does: watchers see it disappear only when its TTL runs out. For tests and
    /// failure drills.
    pub fn abandon(mut self) {
        if let Some(inner) = self.inner.take() {
            inner.abandon();
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            inner.remove_now();
        }
    }
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registration")
            .field("instance", &self.instance)
            .field("live", &self.inner.is_some())
            .finish()
    }
}

/// A stream of [`DiscoveryEvent`]s; also usable as a `futures_core::Stream`.
pub struct DiscoveryWatch {
    rx: mpsc::UnboundedReceiver<DiscoveryEvent>,
}

impl DiscoveryWatch {
    pub(crate) fn new(rx: mpsc::UnboundedReceiver<DiscoveryEvent>) -> Self {
        Self { rx }
    }

    /// The next change; `None` once the backend has stopped (e.g. the store was dropped).
    pub async fn recv(&mut self) -> Option<DiscoveryEvent> {
        self.rx.recv().await
    }
}

impl futures_core::Stream for DiscoveryWatch {
    type Item = DiscoveryEvent;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx)
    }
}

/// `--discovery-backend` values (Dynamo's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiscoveryBackend {
    Mem,
    File,
    Etcd,
}

impl FromStr for DiscoveryBackend {
    type Err = DiscoveryError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "mem" => Ok(Self::Mem),
            "file" => Ok(Self::File),
            "etcd" => Ok(Self::Etcd),
            other => Err(DiscoveryError::UnknownBackend(other.to_string())),
        }
    }
}

/// What [`connect`] needs; the services fill it from `tandem-config`'s runtime settings.
#[derive(Clone, Debug)]
pub struct DiscoveryOptions {
    pub backend: DiscoveryBackend,
    /// Root folder of the `file` backend (`DYN_FILE_KV`, default `$TMPDIR/tandem_store_kv`).
    pub file_root: PathBuf,
    /// `ETCD_ENDPOINTS`.
    pub etcd_endpoints: Vec<String>,
    /// Lease / heartbeat TTL.
    pub ttl: Duration,
    /// The deployment's identity: etcd is then reached over TLS with its client certificate.
    pub tls: Option<tandem_pki::InternalIdentity>,
}

impl Default for DiscoveryOptions {
    fn default() -> Self {
        Self {
            backend: DiscoveryBackend::File,
            file_root: file::default_root(),
            etcd_endpoints: vec!["http://localhost:2379".to_string()],
            ttl: DEFAULT_TTL,
            tls: None,
        }
    }
}

impl DiscoveryOptions {
    /// The options a service's runtime settings (`--discovery-backend`, `DYN_FILE_KV`,
    /// `--etcd-endpoints`) ask for, with the default TTL.
    pub fn from_config(rt: &tandem_config::RuntimeConfig) -> Self {
        use tandem_config::runtime::DiscoveryBackend as Cfg;
        Self {
            backend: match rt.discovery_backend {
                Cfg::Mem => DiscoveryBackend::Mem,
                Cfg::File => DiscoveryBackend::File,
                Cfg::Etcd => DiscoveryBackend::Etcd,
            },
            file_root: rt.file_kv_root.clone(),
            etcd_endpoints: rt.etcd_endpoints.clone(),
            ..Self::default()
        }
    }

    /// With the deployment's identity (from `--internal-tls-dir`), for etcd's TLS.
    pub fn with_security(mut self, security: &tandem_pki::ChannelSecurity) -> Self {
        self.tls = match security {
            tandem_pki::ChannelSecurity::MutualTls(id) => Some(id.clone()),
            tandem_pki::ChannelSecurity::Plaintext => None,
        };
        self
    }
}

/// Opens the configured backend. `mem` returns the process-wide in-memory store, so that
/// everything in one process sees the same registrations.
pub async fn connect(options: &DiscoveryOptions) -> Result<Arc<dyn Discovery>> {
    Ok(match options.backend {
        DiscoveryBackend::Mem => Arc::new(mem::MemDiscovery::global()),
        DiscoveryBackend::File => Arc::new(file::FileDiscovery::new(
            file::FileOptions::new(options.file_root.clone()).with_ttl(options.ttl),
        )?),
        DiscoveryBackend::Etcd => Arc::new(
            etcd::EtcdDiscovery::connect(
                &options.etcd_endpoints,
                etcd::EtcdOptions::default()
                    .with_ttl(options.ttl)
                    .with_tls(options.tls.clone()),
            )
            .await?,
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated() {
        assert!(validate_name("namespace", "dynamo").is_ok());
        assert!(validate_name("namespace", "a-b_c.1").is_ok());
        for bad in ["", ".", "..", ".hidden", "a/b", "a b", "ü"] {
            assert!(validate_name("namespace", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn key_layout_matches_dynamo() {
        let i = Instance {
            namespace: "dynamo".into(),
            component: "backend".into(),
            endpoint: "generate".into(),
            instance_id: 0x1f,
            grpc_addr: "127.0.0.1:1".into(),
            http_addr: None,
            role: "agg".into(),
        };
        assert_eq!(i.instance_key(), "v1/instances/dynamo/backend/generate/1f");
        assert_eq!(i.mdc_key(), "v1/mdc/dynamo/backend/generate/1f");
    }

    #[test]
    fn instance_ids_are_distinct_and_nonzero() {
        let ids: std::collections::HashSet<u64> = (0..1000).map(|_| new_instance_id()).collect();
        assert_eq!(ids.len(), 1000);
        assert!(!ids.contains(&0));
    }

    #[test]
    fn backend_names() {
        assert_eq!(
            "etcd".parse::<DiscoveryBackend>().unwrap(),
            DiscoveryBackend::Etcd
        );
        assert!("zk".parse::<DiscoveryBackend>().is_err());
    }
}
