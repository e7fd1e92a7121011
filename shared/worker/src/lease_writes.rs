//! The writer's half of a lease: the writes a worker is making into other workers' registered
//! memory (a prefill worker's KV blocks, an encode worker's image embeddings), and fencing.
//!
//! Each write runs in a task of its own, so a cancelled call never drops a put halfway: the
//! task stops at its next boundary. A fence answers only once the lease's task has ended (or
//! marks a lease not seen yet as fenced, so that a write arriving after its fence is
//! refused), which is what lets the lease's owner reuse its memory safely.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, watch, Notify};
use tonic::Status;

/// How long a fenced lease is remembered (so a write arriving after its fence is refused):
/// far longer than any lease lives or a call to write for it can be delayed. Entries are
/// forgotten by age only, never to make room: a count bound would forget the fences of
/// leases still live under a storm of revocations.
const FENCED_RETENTION: Duration = Duration::from_secs(600);

/// (owner instance id, lease id).
pub type LeaseKey = (u64, u64);

struct ActiveWrite {
    epoch: u64,
    cancel: Arc<Cancel>,
    /// Becomes true when the write task has ended.
    done: watch::Receiver<bool>,
}

#[derive(Default)]
struct Fenced {
    /// When each was fenced, oldest first.
    order: VecDeque<(Instant, LeaseKey)>,
    set: HashSet<LeaseKey>,
}

impl Fenced {
    /// Remembers `k` as fenced at `now`, forgetting fences older than the retention.
    fn insert(&mut self, k: LeaseKey, now: Instant) {
        while let Some(&(at, old)) = self.order.front() {
            if now.saturating_duration_since(at) < FENCED_RETENTION {
                break;
            }
            self.order.pop_front();
            self.set.remove(&old);
        }
        if self.set.insert(k) {
            self.order.push_back((now, k));
        }
    }
}

/// Every lease this worker is writing, and those fenced.
#[derive(Default)]
pub struct LeaseWrites {
    inner: Mutex<(HashMap<LeaseKey, ActiveWrite>, Fenced)>,
}

impl LeaseWrites {
    fn lock(&self) -> std::sync::MutexGuard<'_, (HashMap<LeaseKey, ActiveWrite>, Fenced)> {
        // Single inserts and removes: a poisoned lock is still consistent.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Leases being written now.
    pub fn active(&self) -> usize {
        self.lock().0.len()
    }

    /// Runs `work` as the write of lease `key` (epoch `epoch`) in a task of its own and
    /// returns its result. Refused if the lease was fenced or is being written already. A
    /// dropped caller cancels the work (it sees the flag at its next boundary); a fence
    /// cancels it and waits for the task to end.
    pub async fn run<T, F>(
        self: &Arc<Self>,
        key: LeaseKey,
        epoch: u64,
        what: &'static str,
        work: impl FnOnce(Arc<Cancel>) -> F,
    ) -> Result<T, Status>
    where
        T: Send + 'static,
        F: Future<Output = Result<T, Status>> + Send + 'static,
    {
        let cancel = Arc::new(Cancel::default());
        let done_tx = self.begin(key, epoch, &cancel, what)?;
        let (result_tx, result_rx) = oneshot::channel();
        let fut = work(cancel.clone());
        let me = self.clone();
        tokio::spawn(async move {
            let r = fut.await;
            me.lock().0.remove(&key);
            let _ = done_tx.send(true);
            let _ = result_tx.send(r);
        });
        let mut guard = CancelOnDrop(Some(cancel));
        let r = result_rx.await.unwrap_or_else(|_| {
            Err(Status::aborted(format!(
                "the {what} task ended without a result"
            )))
        });
        guard.0 = None;
        r
    }

    /// Records the lease as being written; the returned sender marks the write ended.
    fn begin(
        &self,
        key: LeaseKey,
        epoch: u64,
        cancel: &Arc<Cancel>,
        what: &str,
    ) -> Result<watch::Sender<bool>, Status> {
        let (done_tx, done_rx) = watch::channel(false);
        let mut w = self.lock();
        if w.1.set.contains(&key) {
            return Err(Status::aborted(format!(
                "lease {} was revoked before its {what} started",
                key.1
            )));
        }
        if w.0.contains_key(&key) {
            return Err(Status::already_exists(format!(
                "lease {} is already being written",
                key.1
            )));
        }
        w.0.insert(
            key,
            ActiveWrite {
                epoch,
                cancel: cancel.clone(),
                done: done_rx,
            },
        );
        Ok(done_tx)
    }

    /// Stops writing for a lease and returns once no write for it can happen any more;
    /// whether one was in progress.
    pub async fn fence(&self, key: LeaseKey, epoch: u64) -> bool {
        let active = {
            let mut w = self.lock();
            w.1.insert(key, Instant::now());
            match w.0.get(&key) {
                Some(a) if a.epoch == epoch => {
                    a.cancel.set();
                    Some(a.done.clone())
                }
                _ => None,
            }
        };
        let was_active = active.is_some();
        if let Some(mut done) = active {
            // Ends when the write task sends `true` or is dropped (both: it has stopped).
            let _ = done.wait_for(|d| *d).await;
        }
        was_active
    }
}

/// Sets the flag when dropped unless disarmed: a cancelled gRPC call stops its write task.
struct CancelOnDrop(Option<Arc<Cancel>>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            c.set();
        }
    }
}

/// A revocation flag that can also be awaited.
#[derive(Default)]
pub struct Cancel {
    flag: AtomicBool,
    notify: Notify,
}

impl Cancel {
    pub fn set(&self) {
        self.flag.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    pub fn is_set(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }

    pub async fn wait(&self) {
        // Registered before the check, so a `set` in between still wakes it.
        let notified = self.notify.notified();
        if self.is_set() {
            return;
        }
        notified.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fences_are_forgotten_by_age_never_to_make_room() {
        let mut f = Fenced::default();
        let t0 = Instant::now();
        // A storm: 100,000 fences within a minute are all remembered.
        for i in 0..100_000u64 {
            f.insert((1, i), t0 + Duration::from_micros(i * 600));
        }
        assert_eq!(f.set.len(), 100_000);
        assert!(f.set.contains(&(1, 0)), "the first of the storm");
        // Past the retention, the old ones go with the next fence.
        f.insert((2, 0), t0 + FENCED_RETENTION + Duration::from_secs(61));
        assert_eq!(f.set.len(), 1);
        assert!(f.set.contains(&(2, 0)));
    }

    #[tokio::test]
    async fn a_fence_waits_for_the_write_and_refuses_later_ones() {
        let w = Arc::new(LeaseWrites::default());
        let (started_tx, started_rx) = oneshot::channel();
        let writer = {
            let w = w.clone();
            tokio::spawn(async move {
                w.run((1, 7), 3, "test", |cancel| async move {
                    let _ = started_tx.send(());
                    cancel.wait().await;
                    Err::<(), _>(Status::aborted("revoked"))
                })
                .await
            })
        };
        started_rx.await.unwrap();
        assert_eq!(w.active(), 1);
        assert!(w.fence((1, 7), 3).await, "the write was in progress");
        assert_eq!(w.active(), 0, "the fence returned after the task ended");
        assert!(writer.await.unwrap().is_err());
        let again = w.run((1, 7), 3, "test", |_| async { Ok(()) }).await;
        assert_eq!(again.unwrap_err().code(), tonic::Code::Aborted);
        // A lease never seen: fenced ahead, its write refused.
        assert!(!w.fence((1, 8), 1).await);
        assert!(w
            .run((1, 8), 1, "test", |_| async { Ok(()) })
            .await
            .is_err());
        assert_eq!(
            w.run((2, 8), 1, "test", |_| async { Ok(5) }).await.unwrap(),
            5
        );
    }
}
