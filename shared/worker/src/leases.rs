//! The decode worker's leases: reservations of KV blocks that a remote prefill writes into.
//!
//! A lease is *live* while its prefill may legitimately write. When it is revoked (the client
//! went away, the deadline passed, the prefill worker failed) it becomes *quarantined*: a
//! one-sided put already in flight cannot be recalled, so its blocks are not reused until the
//! writer has provably stopped — it answered `FenceLease`, nothing listens on its address any
//! more (its process is gone), or the lease ended more than the reclaim margin ago (writers
//! stop at the lease's end by their own clock). Only then are the blocks released.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tandem_runtime::metrics::names;

/// Gauge of leases by state (`live`, `quarantined`).
pub const LEASES_GAUGE: &str = "tandem_kv_leases";
/// Counter of revoked leases by how their writer was proven stopped.
pub const FENCES_TOTAL: &str = "tandem_kv_lease_fences_total";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseState {
    Live,
    Quarantined,
}

#[derive(Debug, Clone)]
pub struct LeaseInfo {
    pub epoch: u64,
    /// The prefill worker allowed to write (its gRPC address).
    pub writer: String,
    pub state: LeaseState,
    pub since: Instant,
    /// When the lease was granted: its TTL counts from here.
    pub granted: Instant,
}

/// The OS random number generator failed (lease ids cannot be drawn).
#[derive(Debug, thiserror::Error)]
#[error("cannot draw a lease id from the OS random number generator: {0}")]
pub struct LeaseRngError(String);

/// Every lease this worker has granted and not yet finished.
#[derive(Default)]
pub struct LeaseTable {
    leases: Mutex<HashMap<u64, LeaseInfo>>,
}

/// A random non-zero `u64` from the OS RNG (lease ids and epochs).
pub(crate) fn random_u64() -> Result<u64, LeaseRngError> {
    loop {
        let mut b = [0u8; 8];
        getrandom::fill(&mut b).map_err(|e| LeaseRngError(e.to_string()))?;
        let v = u64::from_le_bytes(b);
        if v != 0 {
            return Ok(v);
        }
    }
}

impl LeaseTable {
    pub fn new() -> Self {
        LeaseTable::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, LeaseInfo>> {
        // A panic while holding this lock cannot leave the map half-updated (single inserts
        // and removes), so a poisoned lock is still usable.
        self.leases.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A fresh (lease id, epoch), both drawn from the OS RNG: a client that sees its own
    /// leases (ids, the owner's instance id) cannot predict another's to fence it, and a
    /// restarted worker does not reuse a pair a prefill worker may remember as fenced. The id
    /// is not in use in this table.
    pub fn next(&self) -> Result<(u64, u64), LeaseRngError> {
        let id = loop {
            let id = random_u64()?;
            if !self.lock().contains_key(&id) {
                break id;
            }
        };
        Ok((id, random_u64()?))
    }

    pub fn grant(&self, lease_id: u64, epoch: u64, writer: &str) {
        self.lock().insert(
            lease_id,
            LeaseInfo {
                epoch,
                writer: writer.to_owned(),
                state: LeaseState::Live,
                since: Instant::now(),
                granted: Instant::now(),
            },
        );
        self.publish();
    }

    /// Moves a live lease to quarantine; returns its info (None if unknown).
    pub fn quarantine(&self, lease_id: u64) -> Option<LeaseInfo> {
        let info = {
            let mut m = self.lock();
            let l = m.get_mut(&lease_id)?;
            l.state = LeaseState::Quarantined;
            l.since = Instant::now();
            l.clone()
        };
        self.publish();
        Some(info)
    }

    /// Forgets a lease (activated, released after its writer stopped, or fenced).
    pub fn remove(&self, lease_id: u64) {
        self.lock().remove(&lease_id);
        self.publish();
    }

    pub fn counts(&self) -> (usize, usize) {
        let m = self.lock();
        let q = m
            .values()
            .filter(|l| l.state == LeaseState::Quarantined)
            .count();
        (m.len() - q, q)
    }

    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    fn publish(&self) {
        let (live, quarantined) = self.counts();
        metrics::gauge!(LEASES_GAUGE, "state" => "live").set(live as f64);
        metrics::gauge!(LEASES_GAUGE, "state" => "quarantined").set(quarantined as f64);
    }
}

/// How a revoked lease's writer was proven stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceProof {
    /// The prefill worker answered `FenceLease`: no write for the lease can happen any more.
    Acknowledged,
    /// Nothing listens on the prefill worker's address: its process (and its puts) are gone.
    WriterGone,
    /// The lease ended more than the reclaim margin ago: the writer, which stops at the
    /// lease's end by its own clock, has stopped (a frozen or partitioned writer).
    DeadlinePassed,
}

impl FenceProof {
    pub fn label(self) -> &'static str {
        match self {
            FenceProof::Acknowledged => "acknowledged",
            FenceProof::WriterGone => "writer_gone",
            FenceProof::DeadlinePassed => "deadline_passed",
        }
    }
}

/// Whether nothing accepts connections at `addr` (a refused connect proves the listener, and
/// so the process that owned it, is gone; a timeout proves nothing).
pub async fn listener_gone(addr: &str) -> bool {
    match tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr)).await {
        Ok(Err(e)) => e.kind() == std::io::ErrorKind::ConnectionRefused,
        _ => false,
    }
}

/// Records a fence in metrics.
pub fn count_fence(proof: FenceProof) {
    metrics::counter!(FENCES_TOTAL, names::labels::STATUS => proof.label()).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_move_from_live_to_quarantine_to_gone() {
        let t = LeaseTable::new();
        let (a, ea) = t.next().unwrap();
        let (b, eb) = t.next().unwrap();
        assert_ne!(a, b);
        assert_ne!(ea, eb);
        // Not a counter: consecutive ids and epochs are unrelated.
        assert_ne!(a.wrapping_add(1), b);
        assert_ne!(ea.wrapping_add(1), eb);
        t.grant(a, ea, "127.0.0.1:1");
        t.grant(b, eb, "127.0.0.1:1");
        assert_eq!(t.counts(), (2, 0));
        assert_eq!(t.quarantine(a).map(|l| l.epoch), Some(ea));
        assert_eq!(t.counts(), (1, 1));
        assert!(t.quarantine(999).is_none());
        t.remove(a);
        t.remove(b);
        assert!(t.is_empty());
    }

    #[tokio::test]
    async fn a_closed_port_is_proof_a_live_one_is_not() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        assert!(!listener_gone(&addr).await);
        drop(l);
        assert!(listener_gone(&addr).await);
    }
}
