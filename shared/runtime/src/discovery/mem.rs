//! In-process discovery: a shared map. For tests and for several roles in one process; it
//! cannot see other processes.

use super::{
    BoxFuture, Discovery, DiscoveryEvent, DiscoveryWatch, Entry, Instance, Registration,
    RegistrationInner, Result,
};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use tokio::sync::mpsc;

#[derive(Default)]
struct State {
    /// Keyed by [`Instance::key_suffix`], so listing is in key order like the other backends.
    entries: BTreeMap<String, Entry>,
    watchers: Vec<(String, mpsc::UnboundedSender<DiscoveryEvent>)>,
}

impl State {
    fn notify(&mut self, namespace: &str, event: &DiscoveryEvent) {
        // Closed watchers are pruned here, so a dropped watch costs nothing afterwards.
        self.watchers
            .retain(|(ns, tx)| ns != namespace || tx.send(event.clone()).is_ok());
    }
}

/// Cloning shares the store.
#[derive(Clone, Default)]
pub struct MemDiscovery {
    state: Arc<Mutex<State>>,
}

impl MemDiscovery {
    /// A new, empty, private store.
    pub fn new() -> Self {
        Self::default()
    }

    /// The process-wide store used by `--discovery-backend mem`.
    pub fn global() -> Self {
        static GLOBAL: OnceLock<MemDiscovery> = OnceLock::new();
        GLOBAL.get_or_init(MemDiscovery::new).clone()
    }

    fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the map half-updated (every update is a
        // single insert/remove), so a poisoned lock is still safe to use.
        state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

struct MemRegistration {
    state: Arc<Mutex<State>>,
    instance: Instance,
}

impl MemRegistration {
    fn remove(&self) {
        let mut state = MemDiscovery::lock(&self.state);
        let suffix = self.instance.key_suffix();
        // Only remove our own record: a later registration of the same key replaced it.
        if state
            .entries
            .get(&suffix)
            .is_some_and(|e| e.instance == self.instance)
        {
            state.entries.remove(&suffix);
            state.notify(
                &self.instance.namespace,
                &DiscoveryEvent::Removed {
                    instance_id: self.instance.instance_id,
                },
            );
        }
    }
}

impl RegistrationInner for MemRegistration {
    fn update_card(&self, card: serde_json::Value) -> BoxFuture<'static, Result<()>> {
        let mut state = MemDiscovery::lock(&self.state);
        let suffix = self.instance.key_suffix();
        let result = match state.entries.get_mut(&suffix) {
            Some(e) if e.instance == self.instance => {
                e.card = card.clone();
                state.notify(
                    &self.instance.namespace,
                    &DiscoveryEvent::Added {
                        instance: self.instance.clone(),
                        card,
                    },
                );
                Ok(())
            }
            _ => Err(super::DiscoveryError::Closed),
        };
        Box::pin(async move { result })
    }
    fn deregister(self: Box<Self>) -> BoxFuture<'static, Result<()>> {
        self.remove();
        Box::pin(async { Ok(()) })
    }
    fn remove_now(self: Box<Self>) {
        self.remove();
    }
    fn abandon(self: Box<Self>) {
        // Nothing keeps a memory entry alive, so a "crash" is indistinguishable from removal.
        self.remove();
    }
}

impl Discovery for MemDiscovery {
    fn register(
        &self,
        instance: Instance,
        card: serde_json::Value,
    ) -> BoxFuture<'_, Result<Registration>> {
        Box::pin(async move {
            instance.validate()?;
            let mut state = Self::lock(&self.state);
            state.entries.insert(
                instance.key_suffix(),
                Entry {
                    instance: instance.clone(),
                    card: card.clone(),
                },
            );
            state.notify(
                &instance.namespace,
                &DiscoveryEvent::Added {
                    instance: instance.clone(),
                    card,
                },
            );
            drop(state);
            let inner = MemRegistration {
                state: self.state.clone(),
                instance: instance.clone(),
            };
            Ok(Registration::new(instance, Box::new(inner)))
        })
    }

    fn list<'a>(
        &'a self,
        namespace: &'a str,
        component: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Vec<Entry>>> {
        Box::pin(async move {
            let state = Self::lock(&self.state);
            Ok(state
                .entries
                .values()
                .filter(|e| e.instance.namespace == namespace)
                .filter(|e| component.is_none_or(|c| e.instance.component == c))
                .cloned()
                .collect())
        })
    }

    fn watch<'a>(&'a self, namespace: &'a str) -> BoxFuture<'a, Result<DiscoveryWatch>> {
        Box::pin(async move {
            let (tx, rx) = mpsc::unbounded_channel();
            // Snapshot and subscription under one lock: no change can fall between them.
            let mut state = Self::lock(&self.state);
            for e in state.entries.values() {
                if e.instance.namespace == namespace {
                    let _ = tx.send(DiscoveryEvent::Added {
                        instance: e.instance.clone(),
                        card: e.card.clone(),
                    });
                }
            }
            state.watchers.push((namespace.to_string(), tx));
            Ok(DiscoveryWatch::new(rx))
        })
    }
}
