//! The NATS event plane: subscriptions to the KV-event subjects of the workers' components
//! (`backend` for the workers that serve `Generate`, `prefill` for the prefill workers); each
//! event goes to the index of its worker's kind. Gaps (and new workers) are healed with a dump
//! fetched from the worker over gRPC.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use tandem_kv_protocol::KvCacheEvent;
use tandem_kv_router::{ApplyOutcome, RouterEvent};
use tandem_protocol::worker::DumpKvBlocksRequest;
use tandem_runtime::events::NatsEventPlane;

use crate::app::AppState;

/// Workers whose dump is being fetched (one fetch at a time each).
#[derive(Clone, Default)]
pub struct DumpsInFlight(Arc<Mutex<HashSet<u64>>>);

/// Fetches a worker's dump and applies it (the index then drains events buffered meanwhile).
pub fn spawn_dump(state: AppState, worker_id: u64, inflight: DumpsInFlight) {
    if !inflight
        .0
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(worker_id)
    {
        return;
    }
    tokio::spawn(async move {
        let mut backoff = Duration::from_millis(50);
        for _ in 0..10 {
            let Some(mut client) = state.registry.client(worker_id) else {
                break;
            };
            match client.dump_kv_blocks(DumpKvBlocksRequest {}).await {
                Ok(reply) => {
                    let dump = crate::wire::kv_dump(reply.into_inner());
                    state.kv_of(worker_id).apply_dump(worker_id, &dump);
                    metrics::counter!("tandem_router_kv_dumps_total").increment(1);
                    break;
                }
                Err(s) => {
                    tracing::debug!(worker_id, "KV dump failed: {}", s.message());
                    tokio::time::sleep(backoff).await;
                    backoff *= 2;
                }
            }
        }
        inflight
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&worker_id);
    });
}

/// The components whose KV events the router follows: the workers that serve `Generate`
/// publish under `backend`, prefill workers under `prefill` (see the workers' endpoints).
pub const COMPONENTS: [&str; 2] = ["backend", "prefill"];

/// Follows the KV-event subjects of [`COMPONENTS`].
pub async fn run(state: AppState, inflight: DumpsInFlight) -> anyhow::Result<()> {
    let rt = &state.config.runtime;
    let plane = NatsEventPlane::connect(
        &rt.nats_server,
        Duration::from_secs(5),
        state.channels.identity(),
    )
    .await?;
    let backend = plane
        .kv_events_subscriber::<KvCacheEvent>(&rt.namespace, COMPONENTS[0])
        .await?;
    let prefill = plane
        .kv_events_subscriber::<KvCacheEvent>(&rt.namespace, COMPONENTS[1])
        .await?;
    let mut sub = futures_util::stream::select(backend, prefill);
    tracing::info!(server = %rt.nats_server, "following KV events on NATS");
    while let Some(item) = sub.next().await {
        let env = match item {
            Ok(env) => env,
            Err(e) => {
                tracing::warn!("undecodable KV event on NATS: {e}");
                continue;
            }
        };
        let worker_id = env.worker_id;
        // Only a registered worker's events, signed with the key of its card: another member
        // of the deployment cannot speak for it.
        let Some(key) = state.registry.event_key(worker_id) else {
            continue;
        };
        if let Err(e) = env.verify(&key) {
            tracing::warn!(worker_id, "KV event dropped: {e}");
            metrics::counter!("tandem_router_kv_events_rejected_total", "reason" => "signature")
                .increment(1);
            continue;
        }
        match state
            .kv_of(worker_id)
            .apply_event(RouterEvent::new(worker_id, env.event))
        {
            Ok(ApplyOutcome::Gap(gap)) => {
                tracing::info!(
                    worker_id,
                    expected = gap.expected,
                    received = gap.received,
                    "KV event gap; fetching a dump"
                );
                metrics::counter!("tandem_router_kv_event_gaps_total").increment(1);
                spawn_dump(state.clone(), worker_id, inflight.clone());
            }
            Ok(ApplyOutcome::DumpRequired { .. }) => {
                spawn_dump(state.clone(), worker_id, inflight.clone())
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(worker_id, "KV event not fully indexed: {e}"),
        }
    }
    anyhow::bail!("the NATS subscription ended")
}
