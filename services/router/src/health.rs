//! Health probes of the workers the router calls: every [`PROBE_INTERVAL`] each worker's
//! `Health` is called with a deadline; a worker that fails one (no answer in time, an error,
//! or `healthy: false`: its engine stopped) leaves the candidate sets at once, and comes back
//! with its first good answer. Together with the channels' HTTP/2 keep-alive this bounds how
//! long a dead, frozen or partitioned worker stays routable to seconds, not discovery's TTL.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tandem_protocol::worker::HealthRequest;

use crate::models::{Client, Registry};
use crate::queue::AdmissionQueue;

pub const PROBE_INTERVAL: Duration = Duration::from_secs(2);
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// 1 while a worker answers its probes, 0 while it does not (label `worker_id`).
const WORKER_HEALTHY: &str = "tandem_router_worker_healthy";

/// Whether a worker passes its health probes (shared by its registry entry and its probe).
#[derive(Debug)]
pub struct WorkerHealth(AtomicBool);

impl Default for WorkerHealth {
    /// A new worker is routable until a probe says otherwise.
    fn default() -> Self {
        WorkerHealth(AtomicBool::new(true))
    }
}

impl WorkerHealth {
    pub fn healthy(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// Records a probe's outcome; true when it changed.
    pub fn set(&self, healthy: bool) -> bool {
        self.0.swap(healthy, Ordering::Relaxed) != healthy
    }
}

/// Probes worker `worker_id` until it leaves the registry.
pub fn spawn_probe(
    registry: Arc<Registry>,
    queue: Arc<AdmissionQueue>,
    worker_id: u64,
    mut client: Client,
    health: Arc<WorkerHealth>,
) {
    tokio::spawn(async move {
        let label = [("worker_id", worker_id.to_string())];
        metrics::gauge!(WORKER_HEALTHY, &label).set(1.0);
        loop {
            tokio::time::sleep(PROBE_INTERVAL).await;
            if !registry.contains(worker_id) {
                break;
            }
            let verdict = probe(&mut client).await;
            let healthy = verdict.is_ok();
            if health.set(healthy) {
                match verdict {
                    Ok(()) => {
                        tracing::info!(worker = worker_id, "worker healthy again; routable");
                        // Requests waiting in the queue may fit on it.
                        queue.wake();
                    }
                    Err(why) => tracing::warn!(
                        worker = worker_id,
                        "worker failed its health probe ({why}); not routed to until it passes"
                    ),
                }
            }
            metrics::gauge!(WORKER_HEALTHY, &label).set(if healthy { 1.0 } else { 0.0 });
        }
    });
}

/// One `Health` call within [`PROBE_TIMEOUT`]: why it failed, if it did.
async fn probe(client: &mut Client) -> Result<(), String> {
    let mut request = tonic::Request::new(HealthRequest {});
    request.set_timeout(PROBE_TIMEOUT);
    match tokio::time::timeout(PROBE_TIMEOUT, client.health(request)).await {
        Err(_) => Err(format!("no answer within {PROBE_TIMEOUT:?}")),
        Ok(Err(status)) => Err(format!("{:?}: {}", status.code(), status.message())),
        Ok(Ok(reply)) => {
            let reply = reply.into_inner();
            if reply.healthy {
                Ok(())
            } else {
                Err(format!("it reports {:?}", reply.status))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_starts_good_and_reports_changes() {
        let h = WorkerHealth::default();
        assert!(h.healthy());
        assert!(!h.set(true), "no change");
        assert!(h.set(false));
        assert!(!h.healthy());
        assert!(h.set(true));
    }
}
