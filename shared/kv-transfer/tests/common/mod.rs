//! Helpers shared by the transfer tests and the cross-process child.
#![allow(dead_code)]

use std::time::Duration;

use tandem_kv_transfer::{open, AnyTransport, Backend, TransportConfig};

/// Deterministic xorshift64* so failures reproduce from the seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&self.next().to_le_bytes());
        }
        v.truncate(n);
        v
    }
}

/// FNV-1a, to compare buffers across processes.
pub fn fnv(data: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in data {
        h ^= b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

pub fn config(backend: Backend, timeout: Duration) -> TransportConfig {
    let mut c = TransportConfig::new(backend);
    c.op_timeout = timeout;
    c
}

pub async fn transport(backend: Backend, timeout: Duration) -> AnyTransport {
    open(config(backend, timeout))
        .await
        .unwrap_or_else(|e| panic!("open {backend}: {e}"))
}

/// A heap buffer whose memory is exposed to remote writers. Rust never holds a reference
/// into it while a transfer may run: tests read it through `snapshot` after a notification.
pub struct Pool {
    ptr: *mut u8,
    len: usize,
}

unsafe impl Send for Pool {}
unsafe impl Sync for Pool {}

impl Pool {
    pub fn new(len: usize) -> Self {
        let b = vec![0u8; len].into_boxed_slice();
        Pool {
            ptr: Box::into_raw(b) as *mut u8,
            len,
        }
    }

    pub fn memory(&self) -> tandem_kv_transfer::LocalMemory {
        // SAFETY: the pool outlives its registrations in every test (dropped last).
        unsafe { tandem_kv_transfer::LocalMemory::host(self.ptr, self.len) }
    }

    /// The same memory described as GPU memory of device 0 (for refusal tests: no transport
    /// here may touch it as such).
    pub fn as_gpu_memory(&self) -> tandem_kv_transfer::LocalMemory {
        // SAFETY: as `memory`; the transports refuse it before using the pointer.
        unsafe { tandem_kv_transfer::LocalMemory::cuda(self.ptr, self.len, 0) }
    }

    pub fn snapshot(&self) -> Vec<u8> {
        // SAFETY: called only when no transfer is in flight.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }.to_vec()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: reconstructs the Box made in `new`.
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.ptr, self.len,
            )))
        };
    }
}
