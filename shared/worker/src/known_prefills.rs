//! The prefill workers a decode worker may dial: the registered prefill workers of its own
//! namespace in discovery. A `GenerateDisagg` names prefill workers chosen by the router; a
//! decode worker dials one and hands it its KV region descriptor (with the region's secret),
//! so it refuses any address that discovery does not list as a prefill worker.
//!
//! The set is a snapshot of `Discovery::list`, refreshed when it is older than [`MAX_AGE`] or
//! when a named worker is not in it (a worker registered since): a deregistered worker stays
//! allowed for at most [`MAX_AGE`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_runtime::discovery::{Discovery, Entry};

/// The role string prefill workers register with.
const PREFILL_ROLE: &str = "prefill";

/// Bound on one discovery look-up.
const LIST_TIMEOUT: Duration = Duration::from_secs(2);

/// Oldest snapshot a check trusts.
pub const MAX_AGE: Duration = Duration::from_secs(2);

/// Prefill workers of one namespace, by instance id (→ gRPC address).
pub struct KnownPrefills {
    snapshot: tokio::sync::Mutex<(Option<Instant>, HashMap<u64, String>)>,
    store: Arc<dyn Discovery>,
    namespace: String,
}

impl KnownPrefills {
    pub fn new(store: Arc<dyn Discovery>, namespace: String) -> Arc<Self> {
        Arc::new(KnownPrefills {
            snapshot: tokio::sync::Mutex::new((None, HashMap::new())),
            store,
            namespace,
        })
    }

    async fn refresh(&self, snap: &mut (Option<Instant>, HashMap<u64, String>)) {
        match tokio::time::timeout(LIST_TIMEOUT, self.store.list(&self.namespace, None)).await {
            Ok(Ok(entries)) => {
                snap.1 = entries
                    .into_iter()
                    .filter(|Entry { instance, .. }| {
                        instance.role == PREFILL_ROLE && instance.namespace == self.namespace
                    })
                    .map(|e| (e.instance.instance_id, e.instance.grpc_addr))
                    .collect();
                snap.0 = Some(Instant::now());
            }
            Ok(Err(e)) => tracing::warn!("cannot list discovery to check a prefill worker: {e}"),
            Err(_) => tracing::warn!("discovery did not answer within {LIST_TIMEOUT:?}"),
        }
    }

    /// Whether `grpc_addr` is the address of the registered prefill worker `instance_id`.
    pub async fn allows(&self, instance_id: u64, grpc_addr: &str) -> bool {
        let mut snap = self.snapshot.lock().await;
        let fresh = snap.0.is_some_and(|t| t.elapsed() <= MAX_AGE);
        let known = |s: &(Option<Instant>, HashMap<u64, String>)| {
            s.1.get(&instance_id).is_some_and(|a| a == grpc_addr)
        };
        if fresh && known(&snap) {
            return true;
        }
        self.refresh(&mut snap).await;
        known(&snap)
    }
}
