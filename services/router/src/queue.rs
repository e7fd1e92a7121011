//! The router's request queue (Dynamo's `--router-queue-threshold` semantics): while every
//! worker of a model is saturated (more active prefill tokens than the threshold times its
//! `max_num_batched_tokens`) or busy, a request waits here instead of failing, in order of
//! `priority` (lower first), then arrival (`fcfs`) or prompt length (`wspt`). The queue is
//! bounded: past `--router-queue-max-requests` waiting, a request gets 503 with `Retry-After`.
//!
//! Only the head of a model's queue tries to get in; it is woken when load drops (a request
//! finished its prefill or ended, a worker joined) and by a periodic tick, so a burst costs
//! one admission attempt per event, not one per waiting request. A request that stops
//! waiting (client gone, deadline) leaves the queue and wakes the next head.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::error::ApiError;
use crate::metrics as m;

/// How often the heads retry without an event (load reported by other means).
pub const TICK: Duration = Duration::from_millis(100);

/// A request's place in its model's queue: smaller keys go first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    priority: i32,
    /// The prompt length under `wspt`, 0 under `fcfs`.
    size: u64,
    seq: u64,
}

/// What a request waits for admission with.
#[derive(Debug, Clone)]
pub struct Ticket {
    pub model: String,
    /// Lower goes first (vLLM's convention); 0 by default.
    pub priority: i32,
    pub prompt_tokens: usize,
    /// When the request stops waiting (its deadline).
    pub deadline: Instant,
}

/// The outcome of one admission attempt.
pub enum Attempt<T> {
    /// Routed: the request goes on with `T`.
    Admitted(T),
    /// Every worker is saturated or busy: wait (or, with the queue off, the caller's 503).
    Saturated,
}

/// Waiting requests, per model.
#[derive(Default)]
struct Waiting {
    by_model: HashMap<String, BTreeMap<Key, Arc<Notify>>>,
    len: usize,
    next_seq: u64,
    /// Recent queue waits in seconds (moving average), the basis of `Retry-After`.
    recent_wait_secs: f64,
}

impl Waiting {
    fn is_head(&self, model: &str, key: Key) -> bool {
        self.by_model
            .get(model)
            .and_then(|q| q.keys().next())
            .is_none_or(|head| key <= *head)
    }

    fn remove(&mut self, model: &str, key: Key) {
        let Some(q) = self.by_model.get_mut(model) else {
            return;
        };
        if q.remove(&key).is_some() {
            self.len -= 1;
        }
        match q.values().next() {
            Some(next) => next.notify_one(),
            None => {
                self.by_model.remove(model);
            }
        }
        metrics::gauge!(m::QUEUE_PENDING).set(self.len as f64);
    }
}

pub struct AdmissionQueue {
    waiting: Mutex<Waiting>,
    /// False with `--router-queue-threshold none`: saturation is the caller's 503.
    enabled: bool,
    shortest_first: bool,
    max_waiting: usize,
}

/// Removes a waiting request from the queue when it stops waiting, however that happens.
struct Place<'a> {
    queue: &'a AdmissionQueue,
    model: String,
    key: Key,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        self.queue.lock().remove(&self.model, self.key);
    }
}

impl AdmissionQueue {
    pub fn new(enabled: bool, shortest_first: bool, max_waiting: usize) -> Self {
        AdmissionQueue {
            waiting: Mutex::new(Waiting::default()),
            enabled,
            shortest_first,
            max_waiting,
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Requests waiting now.
    pub fn len(&self) -> usize {
        self.lock().len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, Waiting> {
        // A panic while holding the lock leaves plain bookkeeping behind: keep going.
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes the head of every model's queue: load dropped, a worker joined, or the tick.
    pub fn wake(&self) {
        let w = self.lock();
        for q in w.by_model.values() {
            if let Some(head) = q.values().next() {
                head.notify_one();
            }
        }
    }

    /// Admits the request: `attempt` routes it (recording its load) or says every worker is
    /// saturated. Tried at once when the request would head its model's queue; otherwise, or
    /// when saturated, the request waits its turn. Returns `attempt`'s value and the time
    /// spent waiting.
    pub async fn admit<T>(
        &self,
        ticket: &Ticket,
        mut attempt: impl FnMut() -> Result<Attempt<T>, ApiError>,
    ) -> Result<(T, Duration), ApiError> {
        let arrived = Instant::now();
        let (place, notify) = {
            let mut w = self.lock();
            let key = self.key(&mut w, ticket);
            if w.is_head(&ticket.model, key) {
                if let Attempt::Admitted(t) = attempt()? {
                    return Ok((t, Duration::ZERO));
                }
                if !self.enabled {
                    return Err(ApiError::unavailable(
                        "every worker is busy (the router queue is off: --router-queue-threshold none)",
                    )
                    .with_retry_after(1));
                }
            }
            if w.len >= self.max_waiting {
                return Err(self.full(&w));
            }
            let notify = Arc::new(Notify::new());
            w.by_model
                .entry(ticket.model.clone())
                .or_default()
                .insert(key, notify.clone());
            w.len += 1;
            metrics::gauge!(m::QUEUE_PENDING).set(w.len as f64);
            let place = Place {
                queue: self,
                model: ticket.model.clone(),
                key,
            };
            (place, notify)
        };
        loop {
            if tokio::time::timeout_at(ticket.deadline.into(), notify.notified())
                .await
                .is_err()
            {
                return Err(ApiError::timeout(format!(
                    "the request waited {:.1} s in the router queue and reached its deadline \
                     (--request-timeout-secs)",
                    arrived.elapsed().as_secs_f64()
                )));
            }
            let mut w = self.lock();
            if !w.is_head(&place.model, place.key) {
                continue;
            }
            if let Attempt::Admitted(t) = attempt()? {
                let waited = arrived.elapsed();
                w.recent_wait_secs = 0.9 * w.recent_wait_secs + 0.1 * waited.as_secs_f64();
                metrics::histogram!(m::QUEUE_WAIT_SECONDS).record(waited.as_secs_f64());
                drop(w);
                // Dropping the place removes it and lets the next head try at once.
                drop(place);
                return Ok((t, waited));
            }
        }
    }

    fn key(&self, w: &mut Waiting, ticket: &Ticket) -> Key {
        w.next_seq += 1;
        Key {
            priority: ticket.priority,
            size: if self.shortest_first {
                ticket.prompt_tokens as u64
            } else {
                0
            },
            seq: w.next_seq,
        }
    }

    /// The 503 for a full queue, with a `Retry-After` from recent waits.
    fn full(&self, w: &Waiting) -> ApiError {
        let secs = w.recent_wait_secs.ceil().clamp(1.0, 60.0) as u64;
        ApiError::unavailable(format!(
            "the router queue is full ({} requests waiting, --router-queue-max-requests); \
             retry later",
            w.len
        ))
        .with_retry_after(secs)
    }

    /// Wakes the heads every [`TICK`] until the process ends.
    pub fn spawn_ticker(self: &Arc<Self>) {
        let queue = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(TICK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match queue.upgrade() {
                    Some(q) if !q.is_empty() => q.wake(),
                    Some(_) => {}
                    None => return,
                }
            }
        });
    }
}

#[cfg(test)]
mod tests;
