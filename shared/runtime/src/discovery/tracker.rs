//! Turns key/value changes in the two buckets into [`DiscoveryEvent`]s.
//!
//! The `file` and `etcd` backends both store an instance as two keys. A watcher may see them in
//! either order (two etcd watch streams; a folder scan racing a writer), so an entry counts as
//! present only while both its instance record and its card are known, and an event is sent
//! only when that combined view changes.

use super::{DiscoveryEvent, Entry, Instance, INSTANCES_BUCKET, MDC_BUCKET};
use std::collections::{BTreeMap, BTreeSet};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Bucket {
    Instances,
    Mdc,
}

/// Splits `v1/instances/ns/comp/ep/id` into its bucket and `ns/comp/ep/id` tail.
pub(crate) fn split_key(key: &str) -> Option<(Bucket, &str)> {
    let (bucket, rest) = if let Some(rest) = key.strip_prefix(INSTANCES_BUCKET) {
        (Bucket::Instances, rest)
    } else if let Some(rest) = key.strip_prefix(MDC_BUCKET) {
        (Bucket::Mdc, rest)
    } else {
        return None;
    };
    let suffix = rest.strip_prefix('/')?;
    // Exactly four segments; anything else (e.g. Dynamo's LoRA `/{model_suffix}`) is not ours.
    (suffix.split('/').count() == 4).then_some((bucket, suffix))
}

#[derive(Default)]
pub(crate) struct Tracker {
    instances: BTreeMap<String, Instance>,
    cards: BTreeMap<String, serde_json::Value>,
    emitted: BTreeMap<String, (Instance, serde_json::Value)>,
    dirty: BTreeSet<String>,
}

impl Tracker {
    /// Records a put. Values come from other processes: a record that does not parse, or whose
    /// content disagrees with its key, is ignored rather than trusted.
    pub(crate) fn put(&mut self, key: &str, value: &[u8]) {
        let Some((bucket, suffix)) = split_key(key) else {
            return;
        };
        match bucket {
            Bucket::Instances => match serde_json::from_slice::<Instance>(value) {
                Ok(instance) if instance.key_suffix() == suffix => {
                    self.instances.insert(suffix.to_string(), instance);
                }
                Ok(_) => {
                    tracing::warn!(key, "discovery record does not match its key; ignored");
                    self.instances.remove(suffix);
                }
                Err(err) => {
                    tracing::warn!(key, %err, "unreadable discovery record; ignored");
                    self.instances.remove(suffix);
                }
            },
            Bucket::Mdc => match serde_json::from_slice::<serde_json::Value>(value) {
                Ok(card) => {
                    self.cards.insert(suffix.to_string(), card);
                }
                Err(err) => {
                    tracing::warn!(key, %err, "unreadable model card; ignored");
                    self.cards.remove(suffix);
                }
            },
        }
        self.dirty.insert(suffix.to_string());
    }

    pub(crate) fn delete(&mut self, key: &str) {
        let Some((bucket, suffix)) = split_key(key) else {
            return;
        };
        match bucket {
            Bucket::Instances => {
                self.instances.remove(suffix);
            }
            Bucket::Mdc => {
                self.cards.remove(suffix);
            }
        }
        self.dirty.insert(suffix.to_string());
    }

    /// Replaces the whole state with a fresh snapshot (a folder scan, or an etcd re-list after
    /// a broken watch); the next [`Tracker::flush`] reports the difference.
    pub(crate) fn replace_all<'a>(&mut self, kvs: impl IntoIterator<Item = (&'a str, &'a [u8])>) {
        let old: Vec<String> = self
            .instances
            .keys()
            .chain(self.cards.keys())
            .cloned()
            .collect();
        self.dirty.extend(old);
        self.instances.clear();
        self.cards.clear();
        for (key, value) in kvs {
            self.put(key, value);
        }
    }

    /// Takes over the key/value state of a fresh snapshot while remembering what was already
    /// reported, so the next flush sends only the difference.
    pub(crate) fn adopt(&mut self, fresh: Tracker) {
        let touched: Vec<String> = self
            .instances
            .keys()
            .chain(self.cards.keys())
            .chain(fresh.instances.keys())
            .chain(fresh.cards.keys())
            .cloned()
            .collect();
        self.dirty.extend(touched);
        self.instances = fresh.instances;
        self.cards = fresh.cards;
    }

    /// Events for everything that changed since the last flush.
    pub(crate) fn flush(&mut self) -> Vec<DiscoveryEvent> {
        let mut events = Vec::new();
        for suffix in std::mem::take(&mut self.dirty) {
            let now = match (self.instances.get(&suffix), self.cards.get(&suffix)) {
                (Some(i), Some(c)) => Some((i.clone(), c.clone())),
                _ => None,
            };
            match (now, self.emitted.get(&suffix)) {
                (Some(now), prev) if prev != Some(&now) => {
                    events.push(DiscoveryEvent::Added {
                        instance: now.0.clone(),
                        card: now.1.clone(),
                    });
                    self.emitted.insert(suffix, now);
                }
                (None, Some(prev)) => {
                    events.push(DiscoveryEvent::Removed {
                        instance_id: prev.0.instance_id,
                    });
                    self.emitted.remove(&suffix);
                }
                _ => {}
            }
        }
        events
    }

    /// Complete entries, in key order.
    pub(crate) fn entries(&self, component: Option<&str>) -> Vec<Entry> {
        self.instances
            .iter()
            .filter(|(_, i)| component.is_none_or(|c| i.component == c))
            .filter_map(|(suffix, instance)| {
                self.cards.get(suffix).map(|card| Entry {
                    instance: instance.clone(),
                    card: card.clone(),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inst(id: u64) -> Instance {
        Instance {
            namespace: "ns".into(),
            component: "c".into(),
            endpoint: "e".into(),
            instance_id: id,
            grpc_addr: "h:1".into(),
            http_addr: None,
            role: "agg".into(),
        }
    }

    #[test]
    fn needs_both_keys_in_any_order() {
        let mut t = Tracker::default();
        let i = inst(10);
        t.put(&i.mdc_key(), b"{\"m\":1}");
        assert!(t.flush().is_empty());
        t.put(&i.instance_key(), &serde_json::to_vec(&i).unwrap());
        let ev = t.flush();
        assert!(matches!(&ev[..], [DiscoveryEvent::Added { instance, .. }] if instance == &i));
        // Same value again: no event.
        t.put(&i.mdc_key(), b"{\"m\":1}");
        assert!(t.flush().is_empty());
        // Card change: upsert.
        t.put(&i.mdc_key(), b"{\"m\":2}");
        assert_eq!(t.flush().len(), 1);
        t.delete(&i.instance_key());
        t.delete(&i.mdc_key());
        assert_eq!(t.flush(), vec![DiscoveryEvent::Removed { instance_id: 10 }]);
    }

    #[test]
    fn rejects_mismatched_and_malformed_records() {
        let mut t = Tracker::default();
        let i = inst(10);
        let other = inst(11);
        t.put(&i.mdc_key(), b"{}");
        t.put(&i.instance_key(), &serde_json::to_vec(&other).unwrap());
        assert!(t.flush().is_empty());
        t.put(&i.instance_key(), b"not json");
        assert!(t.flush().is_empty());
        t.put("v1/instances/ns/c/e/10/extra", b"{}");
        t.put("v1/other/ns/c/e/10", b"{}");
        assert!(t.flush().is_empty());
    }

    #[test]
    fn snapshot_diff() {
        let mut t = Tracker::default();
        let (a, b) = (inst(1), inst(2));
        let (ja, jb) = (
            serde_json::to_vec(&a).unwrap(),
            serde_json::to_vec(&b).unwrap(),
        );
        let (ka, kb) = (a.instance_key(), b.instance_key());
        let (ma, mb) = (a.mdc_key(), b.mdc_key());
        t.replace_all([
            (ka.as_str(), &ja[..]),
            (ma.as_str(), &b"{}"[..]),
            (kb.as_str(), &jb[..]),
            (mb.as_str(), &b"{}"[..]),
        ]);
        assert_eq!(t.flush().len(), 2);
        t.replace_all([(kb.as_str(), &jb[..]), (mb.as_str(), &b"{}"[..])]);
        assert_eq!(t.flush(), vec![DiscoveryEvent::Removed { instance_id: 1 }]);
        assert_eq!(t.entries(None).len(), 1);
    }
}
