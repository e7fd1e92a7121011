//! Follows discovery: adds workers (fetching their model's tokenizer when it is new) and
//! removes them, keeping the KV indexes in step (prefill workers follow into the prefill
//! index).

use std::sync::Arc;

use tandem_config::runtime::EventPlane;
use tandem_protocol::ModelCard;
use tandem_runtime::discovery::{Discovery, DiscoveryEvent};

use crate::app::AppState;
use crate::models::{connect_lazy, fetch_assets};

pub async fn add_worker(state: &AppState, card_json: serde_json::Value) {
    let card: ModelCard = match serde_json::from_value(card_json) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!("ignoring a worker with a malformed model card: {e}");
            return;
        }
    };
    // Encode workers are not used yet (multimodal is a later stage). Prefill workers are
    // kept apart from the workers that serve `Generate` (see `models`).
    if card.role == "encode" {
        return;
    }
    let mut client = match connect_lazy(&card.grpc_addr) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(addr = %card.grpc_addr, "ignoring a worker with a bad address: {e}");
            return;
        }
    };
    let assets = match state.registry.existing_assets(&card) {
        Ok(Some(a)) => a,
        Ok(None) => match fetch_assets(&mut client, &card).await {
            Ok(a) => Arc::new(a),
            Err(e) => {
                tracing::error!(
                    worker = card.instance_id,
                    "cannot load the tokenizer of `{}`: {e:#}",
                    card.served_model_name
                );
                return;
            }
        },
        Err(msg) => {
            tracing::error!("{msg}");
            metrics::counter!("tandem_router_refused_workers_total").increment(1);
            return;
        }
    };
    let id = card.instance_id;
    let router = if crate::models::is_prefill(&card) {
        state.prefill_kv.clone()
    } else {
        state.kv.clone()
    };
    tracing::info!(worker = id, addr = %card.grpc_addr, model = %card.served_model_name, role = %card.role, "worker added");
    state.registry.add(card, client.clone(), assets);
    if state.config.routing.use_kv_events && state.config.runtime.event_plane == EventPlane::Direct
    {
        crate::events::spawn_follower(router, state.registry.clone(), id, client);
    }
}

pub fn remove_worker(state: &AppState, id: u64) {
    if state.registry.remove(id) {
        // The id is in one of the two indexes; removing it from the other is a no-op.
        let mut freed = state.kv.remove_worker(id);
        freed.extend(state.prefill_kv.remove_worker(id));
        tracing::info!(worker = id, freed_requests = freed.len(), "worker removed");
    }
}

/// Runs until the watch ends.
pub async fn run(state: AppState, discovery: Arc<dyn Discovery>) -> anyhow::Result<()> {
    let mut watch = discovery.watch(&state.config.runtime.namespace).await?;
    while let Some(event) = watch.recv().await {
        match event {
            DiscoveryEvent::Added { instance, card } => {
                if !state.registry.contains(instance.instance_id) {
                    add_worker(&state, card).await;
                }
            }
            DiscoveryEvent::Removed { instance_id } => remove_worker(&state, instance_id),
        }
    }
    anyhow::bail!("the discovery watch ended")
}
