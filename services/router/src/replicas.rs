//! Router replicas sharing their load (`--router-replica-sync`, Dynamo's replica sync): each
//! router announces the requests it routes, their first tokens and their ends on NATS, and
//! counts its peers' requests in the load it routes by, so that two routers behind one load
//! balancer do not both pile onto the worker each thinks is idle.
//!
//! Beyond Dynamo's semantics:
//! - each router registers in discovery (component `router`) with the key it signs its
//!   events with; a peer's events are applied only when signed by the key of its
//!   registration, and a peer that leaves discovery (its lease ends: `kill -9`) takes its load
//!   with it at once instead of at the request expiry;
//! - every [`ANNOUNCE_EVERY`] a router lists what it still has in flight, so a `Free` lost in
//!   transit (a NATS restart) heals, and a peer not heard from for [`SILENT_AFTER`] has its
//!   load dropped (it comes back with the peer's next requests).
//!
//! A router that joins learns its peers' requests from the ones they route after it joined:
//! their older requests are not counted until they end (a short window; the peers' load is
//! never over-counted, which would queue requests for nothing).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tandem_kv_router::{KvRouter, LoadEvent};
use tandem_runtime::discovery::{Discovery, Instance, Registration};
use tandem_runtime::events::{EventPublisher, EventSigner, NatsEventPlane};

use crate::app::AppState;

/// The discovery component routers register under.
pub const COMPONENT: &str = "router";
const ENDPOINT: &str = "replica-sync";
const TOPIC: &str = "active-sequences";
/// How often a router lists what it has in flight.
pub const ANNOUNCE_EVERY: Duration = Duration::from_secs(2);
/// A peer not heard from this long has its load dropped.
pub const SILENT_AFTER: Duration = Duration::from_secs(10);
/// Load events waiting for NATS beyond this many are dropped (and counted): the next list of
/// what is in flight heals lost ends, and a lost start under-counts for one request's life.
const QUEUE: usize = 65_536;
const NATS_TIMEOUT: Duration = Duration::from_secs(5);

const EVENTS: &str = "tandem_router_replica_events_total";
const PEERS: &str = "tandem_router_replica_peers";

/// Which of the router's two load trackers an event is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pool {
    /// The workers that serve `Generate` (`AppState::kv`).
    Decode,
    /// The prefill workers (`AppState::prefill_kv`).
    Prefill,
}

/// One message on the replicas' subject.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub pool: Pool,
    pub event: LoadEvent,
}

struct Peer {
    /// The hex public key of the peer's registration.
    key: String,
    last_heard: Instant,
    /// Whether its load is counted (false once it fell silent, until it speaks again).
    counted: bool,
}

/// This router's identity among the replicas, and the peers it knows.
pub struct Replicas {
    id: u64,
    signer: Arc<EventSigner>,
    peers: Mutex<HashMap<u64, Peer>>,
}

impl Replicas {
    pub fn new() -> anyhow::Result<Self> {
        Ok(Replicas {
            id: tandem_runtime::discovery::new_instance_id(),
            signer: Arc::new(EventSigner::generate()?),
            peers: Mutex::new(HashMap::new()),
        })
    }

    /// This router's instance id among the replicas.
    pub fn id(&self) -> u64 {
        self.id
    }

    fn peers(&self) -> MutexGuard<'_, HashMap<u64, Peer>> {
        self.peers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A router found in discovery: its events are accepted from now on.
    pub fn peer_added(&self, instance: &Instance, card: &serde_json::Value) {
        if instance.instance_id == self.id {
            return;
        }
        let Some(key) = card.get("event_key").and_then(|k| k.as_str()) else {
            tracing::warn!(
                peer = instance.instance_id,
                "a router's card has no event_key"
            );
            return;
        };
        let mut peers = self.peers();
        peers.insert(
            instance.instance_id,
            Peer {
                key: key.to_owned(),
                last_heard: Instant::now(),
                counted: true,
            },
        );
        tracing::info!(peer = instance.instance_id, "router replica joined");
        metrics::gauge!(PEERS).set(peers.len() as f64);
    }

    /// Drops a peer that left discovery, with its load. False when `id` is no peer.
    pub fn peer_removed(&self, state: &AppState, id: u64) -> bool {
        let mut peers = self.peers();
        if peers.remove(&id).is_none() {
            return false;
        }
        metrics::gauge!(PEERS).set(peers.len() as f64);
        drop(peers);
        let freed = state.kv.remove_peer(id) + state.prefill_kv.remove_peer(id);
        tracing::info!(peer = id, freed_requests = freed, "router replica left");
        state.queue.wake();
        true
    }

    /// Drops the peers that are not in `live` (discovery's ids now).
    pub fn retain(&self, state: &AppState, live: &HashSet<u64>) {
        let gone: Vec<u64> = self
            .peers()
            .keys()
            .filter(|id| !live.contains(id))
            .copied()
            .collect();
        for id in gone {
            self.peer_removed(state, id);
        }
    }

    /// The key to check `peer`'s events with, noting that it was heard from; `None` for a
    /// router not (yet) in discovery.
    fn heard_from(&self, peer: u64) -> Option<String> {
        let mut peers = self.peers();
        let p = peers.get_mut(&peer)?;
        p.last_heard = Instant::now();
        p.counted = true;
        Some(p.key.clone())
    }

    /// Drops the load of peers not heard from for [`SILENT_AFTER`].
    fn drop_silent(&self, state: &AppState, now: Instant) {
        let silent: Vec<u64> = self
            .peers()
            .iter_mut()
            .filter(|(_, p)| p.counted && now.duration_since(p.last_heard) > SILENT_AFTER)
            .map(|(&id, p)| {
                p.counted = false;
                id
            })
            .collect();
        for id in silent {
            let freed = state.kv.remove_peer(id) + state.prefill_kv.remove_peer(id);
            tracing::warn!(
                peer = id,
                freed_requests = freed,
                "router replica silent for {SILENT_AFTER:?}: its load is no longer counted"
            );
            state.queue.wake();
        }
    }
}

/// Starts replica sync: registers this router in discovery, sends its load changes to NATS,
/// applies its peers'. The returned registration lives as long as the router serves.
pub async fn start(
    state: &AppState,
    replicas: Arc<Replicas>,
    discovery: &Arc<dyn Discovery>,
) -> anyhow::Result<Registration> {
    let rt = &state.config.runtime;
    let instance = Instance {
        namespace: rt.namespace.clone(),
        component: COMPONENT.into(),
        endpoint: ENDPOINT.into(),
        instance_id: replicas.id,
        grpc_addr: String::new(),
        http_addr: None,
        role: COMPONENT.into(),
    };
    let card = serde_json::json!({
        "role": COMPONENT,
        "instance_id": replicas.id,
        "event_key": replicas.signer.public_key_hex(),
    });
    let registration = discovery.register(instance, card).await?;
    let (tx, rx) = tokio::sync::mpsc::channel(QUEUE);
    for (router, pool) in [
        (&state.kv, Pool::Decode),
        (&state.prefill_kv, Pool::Prefill),
    ] {
        let tx = tx.clone();
        router.set_load_sink(Box::new(move |event| {
            if tx.try_send(Message { pool, event }).is_err() {
                metrics::counter!(EVENTS, "outcome" => "dropped").increment(1);
            }
        }));
    }
    tokio::spawn(publish(state.clone(), replicas.clone(), rx));
    tokio::spawn(announce(state.clone(), replicas.clone()));
    let (st, r) = (state.clone(), replicas.clone());
    tokio::spawn(tandem_runtime::task::restart_forever(
        "the router replica follower",
        move || follow(st.clone(), r.clone()),
    ));
    tracing::info!(id = replicas.id, "sharing load with router replicas");
    Ok(registration)
}

async fn connect(state: &AppState) -> anyhow::Result<NatsEventPlane> {
    Ok(NatsEventPlane::connect(
        &state.config.runtime.nats_server,
        NATS_TIMEOUT,
        state.channels.identity(),
    )
    .await?)
}

/// Sends this router's load changes, in order; connects (and reconnects) with backoff.
async fn publish(
    state: AppState,
    replicas: Arc<Replicas>,
    mut rx: tokio::sync::mpsc::Receiver<Message>,
) {
    let mut backoff = tandem_runtime::task::FIRST_BACKOFF;
    let publisher: EventPublisher<Message> = loop {
        let made = connect(&state).await.and_then(|plane| {
            Ok(plane.publisher(
                &state.config.runtime.namespace,
                COMPONENT,
                TOPIC,
                replicas.id,
                replicas.signer.clone(),
            )?)
        });
        match made {
            Ok(p) => break p,
            Err(e) => {
                tracing::warn!("router replica sync cannot reach NATS yet: {e:#}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(tandem_runtime::task::MAX_BACKOFF);
            }
        }
    };
    while let Some(msg) = rx.recv().await {
        if let Err(e) = publisher.publish(&msg).await {
            tracing::warn!("router replica event not sent: {e}");
            metrics::counter!(EVENTS, "outcome" => "unsent").increment(1);
        }
    }
}

/// Lists what this router has in flight every [`ANNOUNCE_EVERY`], and drops silent peers.
async fn announce(state: AppState, replicas: Arc<Replicas>) {
    let mut tick = tokio::time::interval(ANNOUNCE_EVERY);
    loop {
        tick.tick().await;
        state.kv.announce_live();
        state.prefill_kv.announce_live();
        replicas.drop_silent(&state, Instant::now());
    }
}

/// Applies the peers' load changes until the subscription ends.
async fn follow(state: AppState, replicas: Arc<Replicas>) -> anyhow::Result<()> {
    let plane = connect(&state).await?;
    let mut sub = plane
        .subscribe::<Message>(&state.config.runtime.namespace, COMPONENT, TOPIC)
        .await?;
    while let Some(item) = sub.next().await {
        let received = match item {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("undecodable router replica event: {e}");
                metrics::counter!(EVENTS, "outcome" => "undecodable").increment(1);
                continue;
            }
        };
        let peer = received.worker_id;
        if peer == replicas.id {
            continue;
        }
        let Some(key) = replicas.heard_from(peer) else {
            metrics::counter!(EVENTS, "outcome" => "unknown_router").increment(1);
            continue;
        };
        if let Err(e) = received.verify(&key) {
            tracing::warn!(peer, "router replica event dropped: {e}");
            metrics::counter!(EVENTS, "outcome" => "bad_signature").increment(1);
            continue;
        }
        let Message { pool, event } = received.event;
        let frees = matches!(
            event,
            LoadEvent::Free { .. }
                | LoadEvent::MarkPrefillCompleted { .. }
                | LoadEvent::Live { .. }
        );
        router_of(&state, pool).apply_peer(peer, event);
        metrics::counter!(EVENTS, "outcome" => "applied").increment(1);
        if frees {
            // Requests queued for room may fit now.
            state.queue.wake();
        }
    }
    anyhow::bail!("the NATS subscription ended")
}

fn router_of(state: &AppState, pool: Pool) -> &Arc<KvRouter> {
    match pool {
        Pool::Decode => &state.kv,
        Pool::Prefill => &state.prefill_kv,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_their_pool() {
        let m = Message {
            pool: Pool::Prefill,
            event: LoadEvent::Free {
                request_id: "r".into(),
            },
        };
        let j = serde_json::to_value(&m).unwrap();
        assert_eq!(j["pool"], "prefill");
        assert_eq!(j["event"]["type"], "free");
        assert_eq!(serde_json::from_value::<Message>(j).unwrap(), m);
    }
}
