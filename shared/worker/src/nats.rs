//! Publishing the engine's KV events on NATS (`--event-plane nats`).

use tandem_config::endpoint::EndpointAddr;
use tandem_config::WorkerConfig;
use tandem_engine::engine::EngineHandle;
use tandem_engine::kv::events::KvCacheEvent;
use tandem_runtime::events::{EventSigner, NatsEventPlane};

pub async fn spawn_publisher(
    cfg: &WorkerConfig,
    endpoint: &EndpointAddr,
    worker_id: u64,
    engine: EngineHandle,
    security: &tandem_pki::ChannelSecurity,
    signer: std::sync::Arc<EventSigner>,
) -> anyhow::Result<()> {
    let plane = NatsEventPlane::connect(
        &cfg.runtime.nats_server,
        std::time::Duration::from_secs(5),
        security.identity(),
    )
    .await?;
    let publisher = plane.kv_events_publisher::<KvCacheEvent>(
        &endpoint.namespace,
        &endpoint.component,
        worker_id,
        signer,
    )?;
    let mut events = engine.subscribe_events();
    tokio::spawn(async move {
        loop {
            match events.recv().await {
                Ok(event) if crate::failpoints::skipped_kv_event(event.event_id) => {}
                Ok(event) => {
                    if let Err(e) = publisher.publish(&event).await {
                        tracing::warn!("publishing a KV event on NATS failed: {e}");
                    }
                }
                // Routers detect the gap from event ids and ask this worker for a dump.
                Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                    tracing::warn!("KV event publisher lagged by {n} events")
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            }
        }
    });
    Ok(())
}
