//! Follows discovery: adds workers (fetching their model's tokenizer when it is new) and
//! removes them, keeping the KV indexes in step (prefill workers follow into the prefill
//! index).

use std::sync::Arc;

use serde_json::Value;
use tandem_config::runtime::EventPlane;
use tandem_protocol::{ModelCard, WorkerRole, WORKER_PROTOCOL_VERSION};
use tandem_runtime::discovery::{Discovery, DiscoveryEvent};

use crate::app::AppState;
use crate::models::{connect_lazy, fetch_assets};
use crate::replicas::COMPONENT;

/// Why a worker found in discovery is not routed to.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error(
        "ignoring worker {worker}: it speaks worker protocol version {theirs}, this router \
         speaks version {ours}"
    )]
    Version {
        worker: String,
        /// The version the card announces, or `none`.
        theirs: String,
        ours: u32,
    },
    #[error("ignoring worker {worker}: malformed model card: {source}")]
    Malformed {
        worker: String,
        source: serde_json::Error,
    },
}

/// The model card of a worker this router may route to: one announcing this router's
/// [`WORKER_PROTOCOL_VERSION`] (checked first, so a worker of another version is named as
/// such even when the rest of its card has changed), and well-formed.
pub fn admit(card: serde_json::Value) -> Result<ModelCard, Refusal> {
    let worker = worker_name(&card);
    let announced = card.get("protocol_version").and_then(Value::as_u64);
    if announced != Some(u64::from(WORKER_PROTOCOL_VERSION)) {
        return Err(Refusal::Version {
            worker,
            theirs: announced.map_or_else(|| "none".to_owned(), |v| v.to_string()),
            ours: WORKER_PROTOCOL_VERSION,
        });
    }
    serde_json::from_value(card).map_err(|source| Refusal::Malformed { worker, source })
}

/// A worker as its card names it: instance id and gRPC address, as far as the card has them.
fn worker_name(card: &Value) -> String {
    let id = card.get("instance_id").and_then(Value::as_u64);
    let addr = card.get("grpc_addr").and_then(Value::as_str);
    match (id, addr) {
        (Some(id), Some(addr)) => format!("{id} ({addr})"),
        (Some(id), None) => id.to_string(),
        (None, Some(addr)) => format!("at {addr}"),
        (None, None) => "(no instance id)".to_owned(),
    }
}

pub async fn add_worker(state: &AppState, card_json: Value) {
    let card = match admit(card_json) {
        Ok(card) => card,
        Err(refusal) => {
            tracing::warn!("{refusal}");
            metrics::counter!("tandem_router_refused_workers_total").increment(1);
            return;
        }
    };
    // Encode workers serve prefill and aggregated workers, never the router (E/P/D). Prefill
    // workers are kept apart from the workers that serve `Generate` (see `models`).
    if card.role == WorkerRole::Encode {
        return;
    }
    let mut client = match connect_lazy(&state.channels, &card.grpc_addr) {
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
    let health = state.registry.add(card, client.clone(), assets);
    crate::health::spawn_probe(
        state.registry.clone(),
        state.queue.clone(),
        id,
        client.clone(),
        health,
    );
    // Requests waiting in the queue may fit on the new worker.
    state.queue.wake();
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

/// Runs until the watch ends (the caller starts it again). Each start first drops the
/// registered workers that are no longer in discovery (they left while no watch ran); the
/// watch then adds the ones that are new.
pub async fn run(state: AppState, discovery: Arc<dyn Discovery>) -> anyhow::Result<()> {
    let namespace = &state.config.runtime.namespace;
    let live: std::collections::HashSet<u64> = discovery
        .list(namespace, None)
        .await?
        .iter()
        .map(|e| e.instance.instance_id)
        .collect();
    for id in state.registry.ids() {
        if !live.contains(&id) {
            remove_worker(&state, id);
        }
    }
    if let Some(r) = &state.replicas {
        r.retain(&state, &live);
    }
    let mut watch = discovery.watch(namespace).await?;
    while let Some(event) = watch.recv().await {
        match event {
            // Router replicas register too (`--router-replica-sync`): they are peers, not
            // workers.
            DiscoveryEvent::Added { instance, card } if instance.component == COMPONENT => {
                if let Some(r) = &state.replicas {
                    r.peer_added(&instance, &card);
                }
            }
            DiscoveryEvent::Added { instance, card } => {
                if !state.registry.contains(instance.instance_id) {
                    add_worker(&state, card).await;
                }
            }
            DiscoveryEvent::Removed { instance_id } => {
                let peer = state
                    .replicas
                    .as_ref()
                    .is_some_and(|r| r.peer_removed(&state, instance_id));
                if !peer {
                    remove_worker(&state, instance_id);
                }
            }
        }
    }
    anyhow::bail!("the discovery watch ended")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn card(version: Option<u64>) -> Value {
        let mut card = serde_json::json!({
            "served_model_name": "m",
            "tokenizer_hash": "h",
            "context_length": 4096,
            "kv_cache_block_size": 32,
            "kv_dtype": "bfloat16",
            "kv_layout_id": "L",
            "total_kv_blocks": 100,
            "max_num_seqs": 8,
            "max_num_batched_tokens": 2048,
            "role": "pd",
            "grpc_addr": "10.0.0.7:9000",
            "http_addr": "10.0.0.7:9001",
            "instance_id": 42,
            "eos_token_ids": [2],
        });
        if let Some(v) = version {
            card["protocol_version"] = v.into();
        }
        card
    }

    #[test]
    fn a_worker_of_this_protocol_version_is_admitted() {
        let admitted = admit(card(Some(WORKER_PROTOCOL_VERSION.into()))).expect("admitted");
        assert_eq!(admitted.protocol_version, WORKER_PROTOCOL_VERSION);
        assert_eq!(admitted.role, WorkerRole::Pd);
        assert_eq!(admitted.kv_dtype, tandem_protocol::KvDtype::Bfloat16);
    }

    #[test]
    fn a_worker_of_another_version_or_none_is_refused_by_name() {
        let older = admit(card(Some(1))).expect_err("version 1");
        assert!(matches!(older, Refusal::Version { .. }), "{older:?}");
        assert_eq!(
            older.to_string(),
            format!(
                "ignoring worker 42 (10.0.0.7:9000): it speaks worker protocol version 1, this \
                 router speaks version {WORKER_PROTOCOL_VERSION}"
            )
        );
        let unversioned = admit(card(None)).expect_err("no version");
        assert!(
            unversioned.to_string().contains("protocol version none"),
            "{unversioned}"
        );
        // The version is checked before the rest: a newer worker's unknown role is reported
        // as a version mismatch, not as a malformed card.
        let mut newer = card(Some(u64::from(WORKER_PROTOCOL_VERSION) + 1));
        newer["role"] = "router".into();
        assert!(matches!(admit(newer), Err(Refusal::Version { .. })));
    }

    #[test]
    fn a_malformed_card_of_this_version_is_refused() {
        let mut bad = card(Some(WORKER_PROTOCOL_VERSION.into()));
        bad["role"] = "router".into();
        let e = admit(bad).expect_err("unknown role");
        assert!(matches!(e, Refusal::Malformed { .. }), "{e:?}");
        assert!(e.to_string().starts_with("ignoring worker 42"), "{e}");
    }
}
