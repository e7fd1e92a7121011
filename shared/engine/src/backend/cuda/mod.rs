//! The CUDA backend, behind the `cuda` feature: on cudarc with dynamic loading, so
//! building needs no CUDA and a binary built here runs on a GPU machine.
//!
//! What this module owns:
//! - [`check_libraries`]: the guard before any CUDA call. cudarc *panics* when a library it
//!   loads lazily is missing; every entry point checks the driver, NVRTC and cuBLAS first and
//!   returns an [`EngineError`] naming what is missing instead.
//! - [`CudaDevice`]: one GPU's context, stream and cuBLAS handle, and the kernels of
//!   [`kernels`], compiled by NVRTC for the device's own architecture (its compute capability)
//!   and cached per process; typed launch wrappers that check their shapes on the host, so a
//!   bad call is an error and never an out-of-bounds access on the device.
//! - `kernels/*.cu`: the device code (embedding and row gathers, RMSNorm with fused residual
//!   add, Qwen3 q/k-norm + RoPE, SiLU·mul, bias add, KV write into paged blocks, paged
//!   attention for decode and prefill, weight-streaming GEMVs, argmax and sampling), all
//!   following the CPU path's math (`cpu_ops`, `model::decoder`, `sampler`) and the KV
//!   address function of [`crate::kv::layout`]; GEMMs through cuBLAS GemmEx (`gemm.rs`).
//! - [`TokenMaps`]: a step's ids, logits rows and token maps in one buffer (`token_maps.rs`).
//! - [`CudaBackend`]: the `Backend` trait on these in f32, bf16, split-bf16 and f16 modes,
//!   decode steps replayed as CUDA graphs (`graphs.rs`), weights uploaded by `weights.rs`.
//! - [`vision::CudaVision`]: a LLaVA model's CLIP tower and projector (the encode worker's and
//!   the worker's own image encoding), in f32 or TF32 GEMMs.
//!
//! What is not done yet: README.md beside this file.

mod attention;
mod attention_decode;
mod attention_scratch;
pub mod backend;
mod cluster_launch;
mod forward;
mod gemm;
mod gemm_lt;
mod graphs;
pub mod kernels;
pub mod ops;
mod precision;
mod prefill_schedule;
mod profile;
mod rope_kv;
pub mod sampling;
mod step;
pub mod switches;
mod token_maps;
pub mod vision;
mod weights;
mod workspace;

pub use attention::AttentionInputs;
pub use attention_scratch::{AttentionScratch, DecodeLaunch};
pub use backend::{ComputeMode, CudaBackend, CudaOptions, PoolSize};
pub use gemm::{GemmRoute, GemvInput, GemvWeights, ResidualRows};
pub use graphs::GraphStats;
pub use ops::Norm;
pub use prefill_schedule::{Balance, PieceSchedule};
pub use profile::LaunchTime;
pub use rope_kv::KvTarget;
pub use token_maps::{DevAddr, DeviceList, TileSlots, TokenMaps};

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits,
};

use crate::error::EngineError;

/// Ok when the CUDA driver, NVRTC and cuBLAS libraries can be loaded; otherwise an error that
/// names the missing ones. Call before anything else of this module (cudarc panics on a
/// missing library).
/// The driver's CUDA version as the driver API gives it (12030 for 12.3).
fn driver_version() -> Result<i32, EngineError> {
    let mut v = 0i32;
    // SAFETY: an out-parameter for a plain integer; the library is present (checked before).
    let status = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    if status != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        return Err(EngineError::Backend(format!(
            "CUDA: reading the driver version: {status:?}"
        )));
    }
    Ok(v)
}

pub fn check_libraries() -> Result<(), EngineError> {
    // SAFETY: these only try to dlopen the libraries and report whether that worked.
    let present = unsafe {
        [
            ("libcuda (driver)", cudarc::driver::sys::is_culib_present()),
            ("libnvrtc", cudarc::nvrtc::sys::is_culib_present()),
            ("libcublas", cudarc::cublas::sys::is_culib_present()),
            ("libcublasLt", cudarc::cublaslt::sys::is_culib_present()),
        ]
    };
    let missing: Vec<&str> = present
        .iter()
        .filter(|(_, ok)| !ok)
        .map(|(name, _)| *name)
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(EngineError::Backend(format!(
            "CUDA libraries not found: {}; use --device cpu",
            missing.join(", ")
        )))
    }
}

/// Whether a CUDA GPU can be used here: the libraries load and the driver sees a device.
pub fn available() -> bool {
    device_count() > 0
}

/// The GPUs the driver shows this process (0 when the libraries or the driver are missing).
pub fn device_count() -> usize {
    if check_libraries().is_err() {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| usize::try_from(n).unwrap_or(0))
}

fn cuda_err(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> EngineError + '_ {
    move |e| EngineError::Backend(format!("CUDA {what}: {e:?}"))
}

fn bad(msg: String) -> EngineError {
    EngineError::InvalidInput(msg)
}

fn check_len(what: &str, len: usize, want: usize) -> Result<(), EngineError> {
    if len < want {
        return Err(bad(format!("{what}: {len} elements, need {want}")));
    }
    Ok(())
}

fn to_i32(what: &str, v: usize) -> Result<i32, EngineError> {
    i32::try_from(v).map_err(|_| bad(format!("{what} = {v} does not fit in i32")))
}

/// An element type of the device buffers kernels read and write: f32, or a 16-bit float held
/// as its u16 bit pattern (as the host side stores bf16 too): bf16, or IEEE half on a device
/// whose program is the f16 one ([`CudaDevice::float16`]).
pub trait DeviceElem: DeviceRepr + ValidAsZeroBits + Copy + Unpin + Send + Sync + 'static {
    /// The suffix of the kernels' entry points for this type (`rms_norm_f32`, `rms_norm_bf16`).
    const SUFFIX: &'static str;
    /// cuBLAS's name for the type on a device whose 16-bit element is `e16`.
    fn cuda_type(e16: kernels::Float16) -> cudarc::cublas::sys::cudaDataType;
}

impl DeviceElem for f32 {
    const SUFFIX: &'static str = "f32";
    fn cuda_type(_: kernels::Float16) -> cudarc::cublas::sys::cudaDataType {
        cudarc::cublas::sys::cudaDataType::CUDA_R_32F
    }
}

impl DeviceElem for u16 {
    const SUFFIX: &'static str = "bf16";
    fn cuda_type(e16: kernels::Float16) -> cudarc::cublas::sys::cudaDataType {
        e16.cuda_type()
    }
}

/// Threads for a block over `n` elements: a multiple of 32 (the kernels' block reductions
/// need whole warps), at most 1024.
fn threads_for(n: usize) -> u32 {
    (n.div_ceil(32) * 32).clamp(32, 1024) as u32
}

/// A typed device buffer: f32, or bf16 as its u16 bit patterns. The weight matrices
/// ([`DeviceMatrix`]) are such buffers.
pub enum DeviceBuf {
    F32(CudaSlice<f32>),
    /// bf16 bit patterns.
    Bf16(CudaSlice<u16>),
}

impl DeviceBuf {
    pub fn len(&self) -> usize {
        match self {
            DeviceBuf::F32(s) => s.len(),
            DeviceBuf::Bf16(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element's name in errors: `f32` or `bf16`.
    pub fn elem_name(&self) -> &'static str {
        match self {
            DeviceBuf::F32(_) => "f32",
            DeviceBuf::Bf16(_) => "bf16",
        }
    }
}

/// The paged KV pool on the device, in the layout's element type.
pub enum KvPool {
    F32(CudaSlice<f32>),
    /// The program's 16-bit element (bf16, or IEEE half in the f16 program): `e16_t`.
    Bf16(CudaSlice<u16>),
    /// IEEE half in the bf16 program: the f16 cache beside bf16 weights of the bf16x2
    /// precision (the kernels' `h16_t`).
    Half(CudaSlice<u16>),
    /// FP8 e4m3 codes with an f32 scale per (token, KV head) after each part's slots
    /// (`kv::layout`), addressed in bytes: read by the FP8-KV program's tensor-core attention.
    Fp8(CudaSlice<u8>),
}

impl KvPool {
    pub fn len(&self) -> usize {
        match self {
            KvPool::F32(s) => s.len(),
            KvPool::Bf16(s) | KvPool::Half(s) => s.len(),
            KvPool::Fp8(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The suffix of the kernels written for this pool's element (`f32`, `bf16`, `h16`,
    /// `fp8`).
    pub fn kernel_suffix(&self) -> &'static str {
        match self {
            KvPool::F32(_) => "f32",
            KvPool::Bf16(_) => "bf16",
            KvPool::Half(_) => "h16",
            KvPool::Fp8(_) => "fp8",
        }
    }

    /// The pool's first byte on the device.
    pub fn device_addr(&self, stream: &Arc<CudaStream>) -> u64 {
        use cudarc::driver::DevicePtr;
        // Event tracking is off (CudaDevice::new): the guards do nothing.
        match self {
            KvPool::F32(p) => p.device_ptr(stream).0,
            KvPool::Bf16(p) | KvPool::Half(p) => p.device_ptr(stream).0,
            KvPool::Fp8(p) => p.device_ptr(stream).0,
        }
    }
}

/// A weight matrix `[rows, cols]` on the device, in its stored element type.
pub type DeviceMatrix = DeviceBuf;

/// The shape of a paged KV pool, in the terms of [`crate::kv::layout::KvLayout`].
#[derive(Clone, Copy, Debug)]
pub struct PoolShape {
    pub num_blocks: usize,
    pub num_layers: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// An FP8 pool: elements are bytes, and each (token, KV head) also holds a 4-byte scale.
    pub scales: bool,
}

impl PoolShape {
    /// Elements of the whole pool (bytes of an FP8 pool, its scales included).
    pub fn elems(&self) -> usize {
        let head = self.head_dim + if self.scales { 4 } else { 0 };
        self.num_blocks * self.num_layers * 2 * self.block_size * self.num_kv_heads * head
    }
}

/// A cuBLAS handle on `stream` with a fixed workspace of its own, so that GEMMs captured in a
/// graph allocate nothing.
fn blas_with_workspace(stream: &Arc<CudaStream>) -> Result<(CudaBlas, CudaSlice<u8>), EngineError> {
    let blas = CudaBlas::new(stream.clone())
        .map_err(|e| EngineError::Backend(format!("cuBLAS: {e:?}")))?;
    let blas_workspace = stream
        .alloc_zeros::<u8>(BLAS_WORKSPACE_BYTES)
        .map_err(cuda_err("allocating the cuBLAS workspace"))?;
    {
        use cudarc::driver::DevicePtr;
        let (ptr, _guard) = blas_workspace.device_ptr(stream);
        // SAFETY: a live device buffer of BLAS_WORKSPACE_BYTES on the handle's stream, kept
        // as long as the handle (both are fields of the device).
        let status = unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(
                *blas.handle(),
                ptr as *mut std::ffi::c_void,
                BLAS_WORKSPACE_BYTES,
            )
        };
        if status != cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(EngineError::Backend(format!(
                "cuBLAS: setting the workspace: {status:?}"
            )));
        }
    }
    Ok((blas, blas_workspace))
}

/// cuBLAS workspace size: what cuBLAS asks for on Hopper (32 MiB).
const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// One GPU: context, stream, cuBLAS handle and the compiled kernels.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// cuBLASLt and the GEMM algorithms measured per shape ([`switches::GEMM_TUNING_ENV`]);
    /// None keeps `cublasGemmEx`. Dropped before the workspace it uses (field order).
    lt: Option<gemm_lt::LtTuner>,
    /// cuBLAS's workspace (see BLAS_WORKSPACE_BYTES), also cuBLASLt's; dropped after `blas`
    /// and `lt` (field order).
    blas_workspace: CudaSlice<u8>,
    funcs: HashMap<String, CudaFunction>,
    /// Attention instances compiled on first use (see kernels::AttentionInstance).
    lazy_funcs: std::sync::Mutex<HashMap<String, CudaFunction>>,
    arch: String,
    name: String,
    sms: usize,
    /// Kernel launches and cuBLAS calls so far (benchmarks count them per step).
    launches: std::sync::atomic::AtomicU64,
    /// While profiling (benchmarks' per-kernel breakdown): an event recorded before each
    /// launch, with the launch's name.
    profile: std::sync::Mutex<Option<Vec<(String, cudarc::driver::CudaEvent)>>>,
    /// bf16 GEMMs of one or two rows by `gemv.cu` rather than cuBLAS
    /// ([`switches::SMALL_GEMM_ENV`]).
    small_m_gemv: bool,
    /// 16-bit GEMMs of up to 16 rows on `gemm_skinny.cu` ([`switches::SKINNY_GEMM_ENV`]).
    skinny_gemm: bool,
    /// What cuBLAS's GEMMs do past the product in the 16-bit precisions
    /// ([`switches::GEMM_EPILOGUE_ENV`]).
    gemm_epilogue: bool,
    /// Prefill steps of tiles alone hand the attention its q heads in 16 bits
    /// ([`switches::PREFILL_Q16_ENV`]).
    prefill_q16: bool,
    /// Programmatic dependent launch works here: compute capability 9.0 or later (the
    /// kernels' griddepcontrol instructions) and a driver of CUDA 12.3 or later (the graph
    /// edge API graphs.rs uses; cudarc would panic on a missing symbol).
    pdl_capable: bool,
    /// Thread-block clusters work here (compute capability 9.0 or later): the decode
    /// attention's cluster variant (`cluster_launch.rs`).
    cluster_capable: bool,
    /// Whether prefill tiles run the warpgroup (wgmma) kernel: the program was compiled for
    /// `sm_90a` and `TANDEM_CUDA_PREFILL_ATTENTION` is not `mma`.
    prefill_wgmma: bool,
    /// The program's 16-bit element: what `u16` buffers (weights, GEMM inputs, a 16-bit KV
    /// pool) hold on this device.
    e16: kernels::Float16,
}

impl CudaDevice {
    /// Opens GPU `ordinal`, compiles the bf16 kernels for its architecture (cached per
    /// process) and loads them. A machine without the CUDA libraries gets an error, not a
    /// panic.
    pub fn new(ordinal: usize) -> Result<Self, EngineError> {
        Self::with_float16(ordinal, kernels::Float16::Bf16)
    }

    /// Like [`Self::new`], with the program's 16-bit element `e16` (what every `u16` buffer
    /// of this device holds: bf16, or IEEE half for the f16 compute mode).
    pub fn with_float16(ordinal: usize, e16: kernels::Float16) -> Result<Self, EngineError> {
        check_libraries()?;
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("opening the device"))?;
        // SAFETY: the backend uses one stream only, so cudarc's per-buffer event tracking
        // (for cross-stream ordering) has nothing to order and would only add work per launch.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx
            .compute_capability()
            .map_err(cuda_err("reading the compute capability"))?;
        let arch = kernels::arch_for(major, minor);
        let pdl_capable = major >= 9 && driver_version()? >= 12_030;
        let cluster_capable = major >= 9;
        let name = ctx.name().map_err(cuda_err("reading the device name"))?;
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(cuda_err("reading the SM count"))?
            .max(1) as usize;
        let ptx = kernels::ptx_for(&arch, e16)?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(cuda_err("loading the kernels"))?;
        let mut funcs = HashMap::new();
        load_functions(
            &module,
            kernels::KERNEL_NAMES,
            "",
            cluster_capable,
            &mut funcs,
        )?;
        let wgmma = kernels::has_wgmma(&arch);
        if wgmma {
            load_functions(
                &module,
                kernels::WG_KERNEL_NAMES,
                "",
                cluster_capable,
                &mut funcs,
            )?;
        }
        let prefill_wgmma =
            wgmma && switches::prefill_attention()? == switches::PrefillAttention::Tiled;
        // A stream of our own: the legacy default stream cannot be captured into a CUDA graph.
        let stream = ctx.new_stream().map_err(cuda_err("creating a stream"))?;
        let (blas, blas_workspace) = blas_with_workspace(&stream)?;
        let lt = if switches::gemm_tuning()? {
            Some(gemm_lt::LtTuner::new()?)
        } else {
            None
        };
        Ok(CudaDevice {
            ctx,
            stream,
            blas,
            lt,
            blas_workspace,
            funcs,
            lazy_funcs: std::sync::Mutex::new(HashMap::new()),
            arch,
            name,
            sms,
            launches: std::sync::atomic::AtomicU64::new(0),
            profile: std::sync::Mutex::new(None),
            small_m_gemv: switches::small_m_gemv_from_env()?,
            skinny_gemm: switches::skinny_gemm()?,
            gemm_epilogue: switches::gemm_epilogue()?,
            prefill_q16: switches::prefill_q16()?,
            pdl_capable,
            cluster_capable,
            prefill_wgmma,
            e16,
        })
    }

    /// Compiles (cached per process) and loads a KV attention program
    /// ([`kernels::KvProgram`]): the tensor-core attention over an f16 pool beside bf16
    /// weights, or over an FP8 pool. Its kernels are then found under the program's prefix.
    /// Once per device.
    pub fn load_kv_program(&mut self, program: kernels::KvProgram) -> Result<(), EngineError> {
        let probe = format!("{}{}", program.prefix(), kernels::HALF_KV_KERNEL_NAMES[0]);
        if self.funcs.contains_key(&probe) {
            return Ok(());
        }
        let t0 = std::time::Instant::now();
        let ptx = kernels::kv_program_ptx(&self.arch, program)?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(cuda_err("loading a KV attention program"))?;
        load_functions(
            &module,
            kernels::HALF_KV_KERNEL_NAMES,
            program.prefix(),
            self.cluster_capable,
            &mut self.funcs,
        )?;
        if program == kernels::KvProgram::HalfKv && kernels::has_wgmma(&self.arch) {
            load_functions(
                &module,
                kernels::HALF_KV_WG_KERNEL_NAMES,
                program.prefix(),
                self.cluster_capable,
                &mut self.funcs,
            )?;
        }
        tracing::info!(
            ms = t0.elapsed().as_millis() as u64,
            program = program.name(),
            "CUDA KV attention kernels compiled"
        );
        Ok(())
    }

    /// [`Self::load_kv_program`] of the half-KV program.
    pub fn load_half_kv_attention(&mut self) -> Result<(), EngineError> {
        self.load_kv_program(kernels::KvProgram::HalfKv)
    }

    /// [`Self::load_kv_program`] of the FP8-KV program.
    pub fn load_fp8_kv_attention(&mut self) -> Result<(), EngineError> {
        self.load_kv_program(kernels::KvProgram::Fp8Kv)
    }

    /// What this device's 16-bit buffers hold (the program it compiled).
    pub fn float16(&self) -> kernels::Float16 {
        self.e16
    }

    /// The architecture the kernels were compiled for (`sm_90a` on an H100 or H200).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Streaming multiprocessors of the device.
    pub fn sm_count(&self) -> usize {
        self.sms
    }

    /// The device's name as the driver reports it.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize), EngineError> {
        self.ctx.mem_get_info().map_err(cuda_err("reading memory"))
    }

    /// Waits for all launched work.
    pub fn synchronize(&self) -> Result<(), EngineError> {
        self.stream.synchronize().map_err(cuda_err("synchronize"))
    }

    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>, EngineError> {
        self.stream
            .clone_htod(data)
            .map_err(cuda_err("host→device copy"))
    }

    pub fn download<T: DeviceRepr>(&self, data: &CudaSlice<T>) -> Result<Vec<T>, EngineError> {
        self.stream
            .clone_dtoh(data)
            .map_err(cuda_err("device→host copy"))
    }

    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, EngineError> {
        self.stream.alloc_zeros(n).map_err(cuda_err("allocation"))
    }

    /// `n` zeroed elements in one `cuMemAlloc` allocation rather than the stream-ordered
    /// pool cudarc allocates from: only such memory can be exported to other processes
    /// (`cuIpcGetMemHandle`, what UCX's `cuda_ipc` transport maps), so the KV pool lives in
    /// it. Free it with [`CudaDevice::free_exportable`], not by dropping it (cudarc's drop
    /// frees in stream order, which is for pool allocations).
    pub fn zeros_exportable<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, EngineError> {
        let bytes = n.max(1) * std::mem::size_of::<T>();
        self.stream
            .context()
            .bind_to_thread()
            .map_err(cuda_err("binding the context"))?;
        // SAFETY: a fresh allocation of `bytes`, zeroed before cudarc sees it; the slice
        // covers `n` elements of it.
        unsafe {
            let ptr = cudarc::driver::result::malloc_sync(bytes)
                .map_err(cuda_err("allocating exportable memory"))?;
            if let Err(e) = cudarc::driver::result::memset_d8_sync(ptr, 0, bytes) {
                let _ = cudarc::driver::result::free_sync(ptr);
                return Err(cuda_err("zeroing exportable memory")(e));
            }
            Ok(self.stream.upgrade_device_ptr(ptr, n))
        }
    }

    /// Frees a [`CudaDevice::zeros_exportable`] allocation (after the work queued on the
    /// device's stream, which may still read it).
    pub fn free_exportable<T>(&self, slice: CudaSlice<T>) {
        let _ = self.stream.synchronize();
        let ptr = slice.leak();
        // SAFETY: `ptr` came from malloc_sync (zeros_exportable) and is freed once, here.
        if let Err(e) = unsafe { cudarc::driver::result::free_sync(ptr) } {
            tracing::warn!("freeing the KV pool: {e:?}");
        }
    }

    /// A fence after the work queued on the device's stream so far (an event recorded on
    /// it): waiting for it waits for that work only, not for the device.
    pub fn kv_event(&self) -> Result<EventFence, EngineError> {
        self.stream
            .record_event(None)
            .map(EventFence)
            .map_err(cuda_err("recording a KV event"))
    }

    /// Kernel launches and cuBLAS calls issued so far.
    pub fn launch_count(&self) -> u64 {
        self.launches.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Counts a launch about to be issued; while profiling, also records an event before it
    /// (the GPU time between consecutive events is the launch's, gaps included).
    fn count_launch(&self, name: impl FnOnce() -> String) {
        self.launches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Ok(mut guard) = self.profile.lock() {
            if let Some(events) = guard.as_mut() {
                let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
                match self.stream.record_event(flags) {
                    Ok(ev) => events.push((name(), ev)),
                    Err(e) => tracing::warn!(error = ?e, "profiling event not recorded"),
                }
            }
        }
    }

    /// The kernel `name`, counted as one launch (every launch wrapper looks its kernel up
    /// right before launching it).
    fn func(&self, name: &str) -> Result<&CudaFunction, EngineError> {
        self.count_launch(|| name.to_string());
        self.loaded(name)
    }

    /// The raw handles of every kernel of the program loaded so far (attention instances
    /// included): the kernels that start with `griddepcontrol.wait` (graphs.rs).
    pub(super) fn own_functions(&self) -> std::collections::HashSet<usize> {
        let mut set: std::collections::HashSet<usize> = self
            .funcs
            .values()
            .map(|f| f.cu_function() as usize)
            .collect();
        if let Ok(lazy) = self.lazy_funcs.lock() {
            set.extend(lazy.values().map(|f| f.cu_function() as usize));
        }
        set
    }

    /// Which kernel serves prefill tiles of head_dim 128 over a bf16 or f16 pool on this
    /// device: `wgmma` (Hopper's warpgroup MMA, `attention_prefill_wg.cu`) or `mma.sync`
    /// (`attention_prefill.cu`, which also serves FP8 pools and head_dim 64 everywhere).
    pub fn prefill_tile_kernel(&self) -> &'static str {
        if self.prefill_wgmma {
            "wgmma"
        } else {
            "mma.sync"
        }
    }

    /// Whether thread-block clusters work here (compute capability 9.0 or later).
    pub fn cluster_capable(&self) -> bool {
        self.cluster_capable
    }

    /// Whether decode graphs may use programmatic dependent launch (see `pdl_capable`).
    pub(super) fn pdl_capable(&self) -> bool {
        self.pdl_capable
    }

    /// The kernel `name`, not counted (for queries such as occupancy).
    fn loaded(&self, name: &str) -> Result<&CudaFunction, EngineError> {
        self.funcs
            .get(name)
            .ok_or_else(|| EngineError::Backend(format!("CUDA kernel {name} is not loaded")))
    }

    /// An attention instance, compiled by NVRTC and loaded on first use (cached per process
    /// by kernels::instance_ptx), counted as one launch like [`CudaDevice::func`].
    fn instance_func(&self, inst: kernels::AttentionInstance) -> Result<CudaFunction, EngineError> {
        self.count_launch(|| "attention".to_string());
        self.load_instance(inst)
    }

    /// The loaded attention instance, compiling it first if this device has not yet.
    fn load_instance(&self, inst: kernels::AttentionInstance) -> Result<CudaFunction, EngineError> {
        let name = inst.name();
        let mut lazy = self
            .lazy_funcs
            .lock()
            .map_err(|_| EngineError::Backend("CUDA kernel table lock poisoned".into()))?;
        if let Some(f) = lazy.get(&name) {
            return Ok(f.clone());
        }
        let t0 = std::time::Instant::now();
        let ptx = kernels::instance_ptx(&self.arch, self.e16, inst)?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(cuda_err("loading an attention kernel"))?;
        let f = module
            .load_function(&name)
            .map_err(cuda_err(&format!("loading kernel {name}")))?;
        tracing::info!(kernel = %name, ms = t0.elapsed().as_millis() as u64, "CUDA kernel compiled");
        lazy.insert(name, f.clone());
        Ok(f)
    }
}

/// Loads `names` from `module` into `funcs` (under `prefix` + name), with the attributes the
/// tensor-core attention kernels need.
fn load_functions(
    module: &Arc<cudarc::driver::CudaModule>,
    names: &[&str],
    prefix: &str,
    cluster_capable: bool,
    funcs: &mut HashMap<String, CudaFunction>,
) -> Result<(), EngineError> {
    for name in names {
        let f = module
            .load_function(name)
            .map_err(cuda_err(&format!("loading kernel {name}")))?;
        // The tensor-core attention kernels take more than the default 48 KiB of dynamic
        // shared memory.
        let smem_bytes = |hd: usize| {
            if name.starts_with("attention_prefill_wg_") {
                attention::prefill_wg_smem_bytes(hd)
            } else if name.starts_with("attention_prefill_") {
                attention::prefill_smem_bytes(hd)
            } else {
                attention::kv_stages_smem_bytes(hd)
            }
        };
        if let Some(hd) = name
            .strip_prefix("attention_prefill_")
            .or_else(|| name.strip_prefix("attention_decode_"))
            .and_then(|r| r.rsplit_once("_hd"))
            .and_then(|(_, hd)| hd.parse::<usize>().ok())
        {
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem_bytes(hd) as i32,
            )
            .map_err(cuda_err(&format!("sizing the shared memory of {name}")))?;
        }
        // Clusters of up to 16 blocks (8 is the portable limit) for the decode attention whose
        // splits merge over distributed shared memory.
        if cluster_capable && name.starts_with("attention_decode_cluster_") {
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                1,
            )
            .map_err(cuda_err(&format!("allowing clusters of 16 for {name}")))?;
        }
        funcs.insert(format!("{prefix}{name}"), f);
    }
    Ok(())
}

/// A CUDA event as a [`crate::backend::DeviceFence`].
pub struct EventFence(cudarc::driver::CudaEvent);

impl crate::backend::DeviceFence for EventFence {
    fn wait(&self) -> Result<(), EngineError> {
        self.0
            .synchronize()
            .map_err(|e| EngineError::Backend(format!("CUDA: waiting for a KV event: {e:?}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_libraries_are_an_error_not_a_panic() {
        // On the build machine (no CUDA) this is the error path; on a GPU machine it is Ok.
        match check_libraries() {
            Ok(()) => {}
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.contains("CUDA libraries not found"), "{msg}");
                assert!(msg.contains("--device cpu"), "{msg}");
                assert!(CudaDevice::new(0).is_err());
            }
        }
    }

    #[test]
    fn threads_are_whole_warps() {
        assert_eq!(threads_for(1), 32);
        assert_eq!(threads_for(64), 64);
        assert_eq!(threads_for(65), 96);
        assert_eq!(threads_for(100_000), 1024);
    }
}
