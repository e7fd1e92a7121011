//! The memory a CPU KV pool lives in: heap memory the pool owns, or memory provided by the
//! caller (a mapping registered with the KV transport, so that remote writers can put blocks
//! straight into it).
//!
//! Remote writers (RDMA/UCX puts) may write into blocks the engine has reserved for them while
//! the engine computes on other blocks. The backend therefore never holds a Rust reference over
//! the whole pool: it takes a slice per access (one token's heads, one block), and only of
//! blocks it owns. The pool's bytes are in the layout's byte order (little endian), so the
//! backend reads f32/bf16 elements in place; the crate only builds for little-endian targets.

use std::alloc::Layout;
use std::any::Any;
use std::ptr::NonNull;

use crate::error::EngineError;

const _: () = assert!(
    cfg!(target_endian = "little"),
    "the KV pool is read in place in little-endian layout order"
);

/// Alignment of owned pools (a cache line; enough for every KV dtype and SIMD loads).
pub const POOL_ALIGN: usize = 64;

/// Smallest alignment accepted for external memory (an f32 element).
pub const MIN_EXTERNAL_ALIGN: usize = 4;

enum Keep {
    /// Allocated here with this layout; freed on drop.
    Owned(Layout),
    /// Owned by the caller; dropped (after the pool stops using the memory) with the pool.
    External(#[allow(dead_code)] Box<dyn Any + Send + Sync>),
}

/// Memory a CPU KV pool lives in: `len` bytes at `as_ptr()`.
pub struct KvPoolMemory {
    ptr: NonNull<u8>,
    len: usize,
    keep: Keep,
}

// SAFETY: the memory is either owned by this value (a plain heap allocation) or kept alive by
// `keep`, which is Send + Sync. The pool is only accessed through `CpuKv`, which follows Rust's
// aliasing rules for the ranges it touches (writes through `&mut`, reads through `&`).
unsafe impl Send for KvPoolMemory {}
// SAFETY: see above; shared access only reads.
unsafe impl Sync for KvPoolMemory {}

impl KvPoolMemory {
    /// Heap memory owned by the pool, zeroed and [`POOL_ALIGN`]-byte aligned. What
    /// `CpuBackend::new` uses.
    pub fn owned(len: usize) -> Result<Self, EngineError> {
        let layout = Layout::from_size_align(len.max(1), POOL_ALIGN)
            .map_err(|e| EngineError::InvalidInput(format!("KV pool of {len} bytes: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            EngineError::InvalidInput(format!("cannot allocate a KV pool of {len} bytes"))
        })?;
        Ok(Self {
            ptr,
            len,
            keep: Keep::Owned(layout),
        })
    }

    /// Memory provided by the caller (e.g. a mapping registered with the KV transport). Its
    /// content is used as is (not zeroed). Refused when `ptr` is null or not aligned to
    /// [`MIN_EXTERNAL_ALIGN`] bytes.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be valid for reads and writes and must not move or be unmapped
    /// while `keep` lives; `keep` is dropped with the pool (e.g. the transport registration that
    /// owns the mapping). Other writers may only write into blocks the engine has reserved for
    /// them (a reservation), never into blocks the engine computes on.
    pub unsafe fn external(
        ptr: *mut u8,
        len: usize,
        keep: Box<dyn Any + Send + Sync>,
    ) -> Result<Self, EngineError> {
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            EngineError::InvalidInput("external KV pool memory: null pointer".into())
        })?;
        if !(ptr.as_ptr() as usize).is_multiple_of(MIN_EXTERNAL_ALIGN) {
            return Err(EngineError::InvalidInput(format!(
                "external KV pool memory at {:p} is not {MIN_EXTERNAL_ALIGN}-byte aligned",
                ptr.as_ptr()
            )));
        }
        Ok(Self {
            ptr,
            len,
            keep: Keep::External(keep),
        })
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True when the memory was provided by the caller.
    pub fn is_external(&self) -> bool {
        matches!(self.keep, Keep::External(_))
    }

    /// Checks that `off..off + bytes` lies inside the memory and that `off` is aligned for
    /// elements of `align` bytes; returns the start pointer.
    #[inline]
    pub(crate) fn range_ptr(&self, off: usize, bytes: usize, align: usize) -> *mut u8 {
        assert!(
            off.checked_add(bytes).is_some_and(|end| end <= self.len),
            "KV pool access {off}+{bytes} beyond {} bytes",
            self.len
        );
        debug_assert!((self.ptr.as_ptr() as usize + off).is_multiple_of(align));
        // SAFETY: off <= len, so the result is inside (or one past) the allocation.
        unsafe { self.ptr.as_ptr().add(off) }
    }

    /// `n` elements of `T` at byte offset `off`, for reading.
    ///
    /// # Safety
    /// No one may write `off..off + n * size_of::<T>()` while the slice lives (the caller
    /// reads only blocks the engine owns, and the engine never writes while it reads).
    #[inline]
    pub(crate) unsafe fn slice<T: Copy>(&self, off: usize, n: usize) -> &[T] {
        let size = std::mem::size_of::<T>();
        let p = self.range_ptr(off, n * size, std::mem::align_of::<T>());
        // SAFETY: in bounds and aligned (checked above); every bit pattern is a valid f32 / u16
        // / u8; no concurrent writer by the caller's contract.
        unsafe { std::slice::from_raw_parts(p as *const T, n) }
    }

    /// `n` elements of `T` at byte offset `off`, for writing.
    ///
    /// # Safety
    /// No one else may read or write `off..off + n * size_of::<T>()` while the slice lives.
    #[inline]
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut<T: Copy>(&self, off: usize, n: usize) -> &mut [T] {
        let size = std::mem::size_of::<T>();
        let p = self.range_ptr(off, n * size, std::mem::align_of::<T>());
        // SAFETY: in bounds and aligned (checked above); exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(p as *mut T, n) }
    }
}

impl Drop for KvPoolMemory {
    fn drop(&mut self) {
        if let Keep::Owned(layout) = self.keep {
            // SAFETY: allocated in `owned` with this very layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
        // External: `keep` is dropped after this, ending the caller's registration.
    }
}

impl std::fmt::Debug for KvPoolMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPoolMemory")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("external", &self.is_external())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_is_aligned_and_zeroed() {
        let m = KvPoolMemory::owned(1000).unwrap();
        assert_eq!(m.as_ptr() as usize % POOL_ALIGN, 0);
        assert_eq!(m.len(), 1000);
        // SAFETY: nobody else touches this memory.
        assert!(unsafe { m.slice::<u8>(0, 1000) }.iter().all(|&b| b == 0));
        assert!(KvPoolMemory::owned(0).unwrap().is_empty());
    }

    #[test]
    fn external_refuses_null_and_misaligned() {
        let mut buf = vec![0u32; 16];
        let p = buf.as_mut_ptr() as *mut u8;
        // SAFETY: the pointers are refused before any use.
        unsafe {
            assert!(KvPoolMemory::external(std::ptr::null_mut(), 8, Box::new(())).is_err());
            let e = KvPoolMemory::external(p.add(2), 8, Box::new(())).unwrap_err();
            assert!(e.to_string().contains("aligned"), "{e}");
        }
    }

    #[test]
    #[should_panic(expected = "beyond")]
    fn out_of_range_access_panics() {
        let m = KvPoolMemory::owned(16).unwrap();
        // SAFETY: refused before any slice is built.
        let _ = unsafe { m.slice::<f32>(8, 4) };
    }
}
