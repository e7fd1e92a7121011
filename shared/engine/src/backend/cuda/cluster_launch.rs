//! Launches with thread-block clusters (sm_90 and later) through `cuLaunchKernelEx`, which
//! cudarc's launch builder does not reach: the kernel parameters marshalled by hand, each in
//! an 8-byte slot of its own.

use cudarc::driver::{sys, CudaFunction, CudaSlice, DevicePtr};

use super::{cuda_err, CudaDevice, DevAddr};
use crate::error::EngineError;

/// The parameters of one launch, in the kernel's order. A slot holds a pointer, a 64-bit
/// integer, or a 32-bit value in its low four bytes (the driver reads each parameter's own
/// size from its slot's address; x86-64 and aarch64 are little-endian).
pub(super) struct RawParams {
    slots: Vec<u64>,
}

impl RawParams {
    pub(super) fn new() -> Self {
        RawParams {
            slots: Vec::with_capacity(24),
        }
    }

    /// A device buffer, by its address (the backend's stream has cudarc's event tracking
    /// off, so taking the address records nothing).
    pub(super) fn slice<T>(&mut self, dev: &CudaDevice, s: &CudaSlice<T>) -> &mut Self {
        let (ptr, _sync) = s.device_ptr(&dev.stream);
        self.slots.push(ptr);
        self
    }

    pub(super) fn addr(&mut self, a: DevAddr) -> &mut Self {
        self.slots.push(a.raw());
        self
    }

    pub(super) fn int(&mut self, v: i32) -> &mut Self {
        self.slots.push(u64::from(v as u32));
        self
    }

    pub(super) fn float(&mut self, v: f32) -> &mut Self {
        self.slots.push(u64::from(v.to_bits()));
        self
    }

    pub(super) fn long(&mut self, v: i64) -> &mut Self {
        self.slots.push(v as u64);
        self
    }
}

/// Shape of a clustered launch.
pub(super) struct ClusterConfig {
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub shared_mem_bytes: u32,
    pub cluster: (u32, u32, u32),
}

impl CudaDevice {
    /// Launches `f` on the device's stream with clusters of `cfg.cluster` blocks.
    ///
    /// # Safety
    /// `params` must match the kernel's signature in count, order and types, and every
    /// buffer it names must hold what the kernel reads and writes at this shape.
    pub(super) unsafe fn launch_clustered(
        &self,
        f: &CudaFunction,
        cfg: &ClusterConfig,
        params: &mut RawParams,
    ) -> Result<(), EngineError> {
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("binding the context"))?;
        let mut ptrs: Vec<*mut std::ffi::c_void> = params
            .slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut std::ffi::c_void)
            .collect();
        // SAFETY: a zeroed attribute is a valid bit pattern (plain C data); id and the
        // union's cluster member are set before use.
        let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        attr.value.clusterDim.x = cfg.cluster.0;
        attr.value.clusterDim.y = cfg.cluster.1;
        attr.value.clusterDim.z = cfg.cluster.2;
        let launch = sys::CUlaunchConfig {
            gridDimX: cfg.grid.0,
            gridDimY: cfg.grid.1,
            gridDimZ: cfg.grid.2,
            blockDimX: cfg.block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        sys::cuLaunchKernelEx(
            &launch,
            f.cu_function(),
            ptrs.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()
        .map_err(cuda_err("launching with clusters"))
    }

    /// The most blocks (at most `cap`) a cluster of `f` may have at `block` threads and
    /// `shared_mem_bytes` of dynamic shared memory (0 where the GPU has no clusters).
    pub(super) fn max_cluster_size(
        &self,
        f: &CudaFunction,
        block: u32,
        shared_mem_bytes: u32,
        cap: usize,
    ) -> Result<usize, EngineError> {
        if !self.cluster_capable {
            return Ok(0);
        }
        let launch = sys::CUlaunchConfig {
            gridDimX: 1,
            gridDimY: 1,
            gridDimZ: cap as u32,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: std::ptr::null_mut(),
            numAttrs: 0,
        };
        let mut n: std::ffi::c_int = 0;
        // SAFETY: a live function handle and a launch configuration without attributes.
        unsafe { sys::cuOccupancyMaxPotentialClusterSize(&mut n, f.cu_function(), &launch) }
            .result()
            .map_err(cuda_err("querying the largest cluster"))?;
        Ok((n.max(0) as usize).min(cap))
    }
}
