//! The CUDA backend (issue 7), behind the `cuda` feature: on cudarc with dynamic loading, so
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
//! - `kernels/*.cu`: the device code (embedding gather, RMSNorm with fused residual add,
//!   Qwen3 q/k-norm + RoPE, SiLU·mul, KV write into paged blocks and a paged attention for
//!   decode and prefill), all following the CPU path's math (`cpu_ops`, `model::decoder`) and
//!   the KV address function of [`crate::kv::layout`].
//! - [`CudaBackend`]: the `Backend` trait on these, f32 mode (checked against the CPU backend).
//!
//! Not here yet (see README.md beside this file): worker wiring, bf16 GEMMs,
//! fast attention, GPU sampling and CUDA graphs.

pub mod backend;
pub mod kernels;

pub use backend::CudaBackend;

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
    ValidAsZeroBits,
};

use crate::error::EngineError;

/// Ok when the CUDA driver, NVRTC and cuBLAS libraries can be loaded; otherwise an error that
/// names the missing ones. Call before anything else of this module (cudarc panics on a
/// missing library).
pub fn check_libraries() -> Result<(), EngineError> {
    // SAFETY: these only try to dlopen the libraries and report whether that worked.
    let present = unsafe {
        [
            ("libcuda (driver)", cudarc::driver::sys::is_culib_present()),
            ("libnvrtc", cudarc::nvrtc::sys::is_culib_present()),
            ("libcublas", cudarc::cublas::sys::is_culib_present()),
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

/// Threads for a block over `n` elements: a multiple of 32 (the kernels' block reductions
/// need whole warps), at most 1024.
fn threads_for(n: usize) -> u32 {
    (n.div_ceil(32) * 32).clamp(32, 1024) as u32
}

/// A device buffer of the paged KV pool, in the layout's element type.
pub enum KvPool {
    F32(CudaSlice<f32>),
    /// bf16 bit patterns.
    Bf16(CudaSlice<u16>),
}

impl KvPool {
    pub fn len(&self) -> usize {
        match self {
            KvPool::F32(s) => s.len(),
            KvPool::Bf16(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A device copy of a weight matrix `[rows, cols]`, in its stored element type.
pub enum DeviceMatrix {
    F32(CudaSlice<f32>),
    /// bf16 bit patterns.
    Bf16(CudaSlice<u16>),
}

impl DeviceMatrix {
    pub fn len(&self) -> usize {
        match self {
            DeviceMatrix::F32(s) => s.len(),
            DeviceMatrix::Bf16(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The shape of a paged KV pool, in the terms of [`crate::kv::layout::KvLayout`].
#[derive(Clone, Copy, Debug)]
pub struct PoolShape {
    pub num_blocks: usize,
    pub num_layers: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl PoolShape {
    /// Elements of the whole pool.
    pub fn elems(&self) -> usize {
        self.num_blocks * self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
    }
}

/// The per-token inputs of [`CudaDevice::attention`] and [`CudaDevice::kv_write`], already on
/// the device: the flattened block tables of the batch and, per token of the step, where its
/// table starts, its position, its first visible position (sliding window) and its block.
pub struct TokenMaps {
    pub tables: CudaSlice<i32>,
    pub table_start: CudaSlice<i32>,
    pub positions: CudaSlice<i32>,
    pub lo_pos: CudaSlice<i32>,
    pub token_block: CudaSlice<i32>,
    pub tokens: usize,
}

/// One GPU: context, stream, cuBLAS handle and the compiled kernels.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    funcs: HashMap<&'static str, CudaFunction>,
    arch: String,
    name: String,
}

impl CudaDevice {
    /// Opens GPU `ordinal`, compiles the kernels for its architecture (cached per process) and
    /// loads them. A machine without the CUDA libraries gets an error, not a panic.
    pub fn new(ordinal: usize) -> Result<Self, EngineError> {
        check_libraries()?;
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("opening the device"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(cuda_err("reading the compute capability"))?;
        let arch = kernels::arch_for(major, minor);
        let name = ctx.name().map_err(cuda_err("reading the device name"))?;
        let ptx = kernels::ptx_for(&arch)?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(cuda_err("loading the kernels"))?;
        let mut funcs = HashMap::new();
        for name in kernels::KERNEL_NAMES {
            let f = module
                .load_function(name)
                .map_err(cuda_err(&format!("loading kernel {name}")))?;
            funcs.insert(*name, f);
        }
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| EngineError::Backend(format!("cuBLAS: {e:?}")))?;
        Ok(CudaDevice {
            ctx,
            stream,
            blas,
            funcs,
            arch,
            name,
        })
    }

    /// The architecture the kernels were compiled for (`sm_90` on an H200).
    pub fn arch(&self) -> &str {
        &self.arch
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

    fn func(&self, name: &str) -> Result<&CudaFunction, EngineError> {
        self.funcs
            .get(name)
            .ok_or_else(|| EngineError::Backend(format!("CUDA kernel {name} is not loaded")))
    }

    /// Builds the [`TokenMaps`] of a step on the device. `seqs` gives, per sequence, its block
    /// table and the positions of its tokens this step; `window` is the sliding window
    /// (`usize::MAX` for none).
    pub fn token_maps(
        &self,
        seqs: &[(&[u32], std::ops::Range<usize>)],
        block_size: usize,
        window: usize,
    ) -> Result<TokenMaps, EngineError> {
        let mut tables = Vec::new();
        let (mut table_start, mut positions, mut lo_pos, mut token_block) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (table, range) in seqs {
            let start = to_i32("block table offset", tables.len())?;
            for &b in *table {
                tables.push(to_i32("block id", b as usize)?);
            }
            for pos in range.clone() {
                let block = *table.get(pos / block_size).ok_or_else(|| {
                    bad(format!(
                        "block table of {} blocks does not cover position {pos}",
                        table.len()
                    ))
                })?;
                table_start.push(start);
                positions.push(to_i32("position", pos)?);
                lo_pos.push(to_i32("position", (pos + 1).saturating_sub(window))?);
                token_block.push(to_i32("block id", block as usize)?);
            }
        }
        let tokens = positions.len();
        if tables.is_empty() {
            tables.push(0); // no zero-length device buffers
        }
        Ok(TokenMaps {
            tables: self.upload(&tables)?,
            table_start: self.upload(&table_start)?,
            positions: self.upload(&positions)?,
            lo_pos: self.upload(&lo_pos)?,
            token_block: self.upload(&token_block)?,
            tokens,
        })
    }

    /// `out[t, :] = table[ids[t], :]` as f32 (`hidden` columns). Ids must be below the
    /// table's row count; `vocab` is checked here on the host copy of the ids.
    pub fn embedding(
        &self,
        out: &mut CudaSlice<f32>,
        table: &DeviceMatrix,
        ids_host: &[u32],
        hidden: usize,
    ) -> Result<(), EngineError> {
        let vocab = table.len() / hidden.max(1);
        if let Some(id) = ids_host.iter().find(|&&id| id as usize >= vocab) {
            return Err(bad(format!(
                "token id {id} is outside the vocabulary ({vocab})"
            )));
        }
        let t = ids_host.len();
        if t == 0 {
            return Ok(());
        }
        check_len("embedding out", out.len(), t * hidden)?;
        let ids = self.upload(ids_host)?;
        let h = to_i32("hidden", hidden)?;
        let cfg = LaunchConfig {
            grid_dim: (t as u32, 1, 1),
            block_dim: (threads_for(hidden).min(256), 1, 1),
            shared_mem_bytes: 0,
        };
        let name = match table {
            DeviceMatrix::F32(_) => "embedding_f32",
            DeviceMatrix::Bf16(_) => "embedding_bf16",
        };
        let f = self.func(name)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out);
        match table {
            DeviceMatrix::F32(s) => b.arg(s),
            DeviceMatrix::Bf16(s) => b.arg(s),
        };
        b.arg(&ids).arg(&h);
        // SAFETY: the argument list matches the kernel's signature; every index is in bounds
        // (ids < vocab checked above, out holds t*hidden).
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching embedding"))?;
        Ok(())
    }

    /// RMSNorm of `rows` rows of `dim`: with `residual`, first `x += residual` (written back),
    /// then `out = w * x / sqrt(mean(x²) + eps)`.
    pub fn rms_norm(
        &self,
        out: &mut CudaSlice<f32>,
        x: &mut CudaSlice<f32>,
        residual: Option<&CudaSlice<f32>>,
        w: &CudaSlice<f32>,
        rows: usize,
        eps: f32,
    ) -> Result<(), EngineError> {
        let dim = w.len();
        if rows == 0 {
            return Ok(());
        }
        check_len("rms_norm out", out.len(), rows * dim)?;
        check_len("rms_norm x", x.len(), rows * dim)?;
        if let Some(r) = residual {
            check_len("rms_norm residual", r.len(), rows * dim)?;
        }
        let d = to_i32("dim", dim)?;
        let null = 0u64;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (threads_for(dim).min(256), 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.func("rms_norm_f32")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out).arg(x);
        match residual {
            Some(r) => b.arg(r),
            None => b.arg(&null),
        };
        b.arg(w).arg(&d).arg(&eps);
        // SAFETY: signature matches; every buffer holds rows*dim (checked), w holds dim.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching rms_norm"))?;
        Ok(())
    }

    /// Per-head RMSNorm (when `q_norm`/`k_norm` are given, each `head_dim` long) and RoPE in
    /// place on the first `nq + nkv` heads of each of the `maps.tokens` rows of `qkv` (rows
    /// `row_stride` apart). `inv_freq` holds `head_dim / 2` frequencies (as f32).
    #[allow(clippy::too_many_arguments)]
    pub fn qk_norm_rope(
        &self,
        qkv: &mut CudaSlice<f32>,
        row_stride: usize,
        nq: usize,
        nkv: usize,
        head_dim: usize,
        maps: &TokenMaps,
        inv_freq: &CudaSlice<f32>,
        q_norm: Option<&CudaSlice<f32>>,
        k_norm: Option<&CudaSlice<f32>>,
        eps: f32,
    ) -> Result<(), EngineError> {
        let t = maps.tokens;
        if t == 0 {
            return Ok(());
        }
        if !head_dim.is_multiple_of(2) || (nq + nkv) * head_dim > row_stride {
            return Err(bad(format!(
                "qk_norm_rope: head_dim {head_dim}, {nq}+{nkv} heads, row stride {row_stride}"
            )));
        }
        check_len("qk_norm_rope qkv", qkv.len(), t * row_stride)?;
        check_len("qk_norm_rope inv_freq", inv_freq.len(), head_dim / 2)?;
        for n in [q_norm, k_norm].into_iter().flatten() {
            check_len("qk_norm_rope norm weight", n.len(), head_dim)?;
        }
        let (rs, q, hd) = (
            to_i32("row stride", row_stride)?,
            to_i32("nq", nq)?,
            to_i32("head_dim", head_dim)?,
        );
        let null = 0u64;
        let cfg = LaunchConfig {
            grid_dim: (t as u32, (nq + nkv) as u32, 1),
            block_dim: (threads_for(head_dim / 2), 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.func("qk_norm_rope_f32")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(qkv)
            .arg(&rs)
            .arg(&q)
            .arg(&hd)
            .arg(&maps.positions)
            .arg(inv_freq);
        for n in [q_norm, k_norm] {
            match n {
                Some(n) => b.arg(n),
                None => b.arg(&null),
            };
        }
        b.arg(&eps);
        // SAFETY: signature matches; shapes checked above.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching qk_norm_rope"))?;
        Ok(())
    }

    /// `out[r, c] = silu(gu[r, c]) * gu[r, im + c]` for `rows` rows.
    pub fn silu_mul(
        &self,
        out: &mut CudaSlice<f32>,
        gu: &CudaSlice<f32>,
        rows: usize,
        im: usize,
    ) -> Result<(), EngineError> {
        if rows * im == 0 {
            return Ok(());
        }
        check_len("silu_mul out", out.len(), rows * im)?;
        check_len("silu_mul gu", gu.len(), rows * 2 * im)?;
        let (r, i) = (to_i32("rows", rows)?, to_i32("im", im)?);
        let blocks = (rows * im).div_ceil(256).min(65_535 * 8) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.func("silu_mul_f32")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out).arg(gu).arg(&r).arg(&i);
        // SAFETY: signature matches; shapes checked above.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching silu_mul"))?;
        Ok(())
    }

    /// Stores the K and V of every token of `maps` (in `qkv` at column `k_off`, K then V,
    /// `num_kv_heads * head_dim` each) into `layer` of the pool, at the layout's address.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_write(
        &self,
        pool: &mut KvPool,
        shape: PoolShape,
        layer: usize,
        qkv: &CudaSlice<f32>,
        row_stride: usize,
        k_off: usize,
        maps: &TokenMaps,
    ) -> Result<(), EngineError> {
        let t = maps.tokens;
        if t == 0 {
            return Ok(());
        }
        let kvd = shape.num_kv_heads * shape.head_dim;
        if k_off + 2 * kvd > row_stride || layer >= shape.num_layers {
            return Err(bad(format!(
                "kv_write: k offset {k_off} + 2×{kvd} over row stride {row_stride}, or layer {layer} ≥ {}",
                shape.num_layers
            )));
        }
        check_len("kv_write pool", pool.len(), shape.elems())?;
        check_len("kv_write qkv", qkv.len(), t * row_stride)?;
        let cfg = LaunchConfig {
            grid_dim: (t as u32, 1, 1),
            block_dim: (threads_for(kvd).min(256), 1, 1),
            shared_mem_bytes: 0,
        };
        let args = [
            to_i32("row stride", row_stride)?,
            to_i32("k offset", k_off)?,
            to_i32("kv width", kvd)?,
        ];
        let tail = [
            to_i32("block size", shape.block_size)?,
            to_i32("layer", layer)?,
            to_i32("layers", shape.num_layers)?,
        ];
        let name = match pool {
            KvPool::F32(_) => "kv_write_f32",
            KvPool::Bf16(_) => "kv_write_bf16",
        };
        let f = self.func(name)?;
        let mut b = self.stream.launch_builder(f);
        match pool {
            KvPool::F32(p) => b.arg(p),
            KvPool::Bf16(p) => b.arg(p),
        };
        b.arg(qkv)
            .arg(&args[0])
            .arg(&args[1])
            .arg(&args[2])
            .arg(&maps.token_block)
            .arg(&maps.positions)
            .arg(&tail[0])
            .arg(&tail[1])
            .arg(&tail[2]);
        // SAFETY: signature matches; the pool holds the whole shape (checked) and the block
        // ids come from tables the caller validated against `shape.num_blocks`.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching kv_write"))?;
        Ok(())
    }

    /// Paged attention of every token of `maps` over positions `lo_pos ..= pos` of its
    /// sequence in `layer` of the pool; q is `qkv[t, 0 .. nq*head_dim]`; `out` is
    /// `[tokens, nq * head_dim]`. This step's K/V must be written first.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        out: &mut CudaSlice<f32>,
        qkv: &CudaSlice<f32>,
        row_stride: usize,
        pool: &KvPool,
        shape: PoolShape,
        layer: usize,
        nq: usize,
        maps: &TokenMaps,
        scale: f32,
    ) -> Result<(), EngineError> {
        let t = maps.tokens;
        if t == 0 {
            return Ok(());
        }
        let (nkv, hd) = (shape.num_kv_heads, shape.head_dim);
        if nkv == 0 || !nq.is_multiple_of(nkv) || nq * hd > row_stride || layer >= shape.num_layers
        {
            return Err(bad(format!(
                "attention: {nq} q heads over {nkv} KV heads, head_dim {hd}, row stride {row_stride}, layer {layer}"
            )));
        }
        check_len("attention pool", pool.len(), shape.elems())?;
        check_len("attention qkv", qkv.len(), t * row_stride)?;
        check_len("attention out", out.len(), t * nq * hd)?;
        let ints = [
            to_i32("row stride", row_stride)?,
            to_i32("nq", nq)?,
            to_i32("nkv", nkv)?,
            to_i32("head_dim", hd)?,
            to_i32("block size", shape.block_size)?,
            to_i32("layer", layer)?,
            to_i32("layers", shape.num_layers)?,
        ];
        let cfg = LaunchConfig {
            grid_dim: (t as u32, nq as u32, 1),
            block_dim: (threads_for(hd), 1, 1),
            shared_mem_bytes: 0,
        };
        let name = match pool {
            KvPool::F32(_) => "attention_f32",
            KvPool::Bf16(_) => "attention_bf16",
        };
        let f = self.func(name)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out).arg(qkv).arg(&ints[0]);
        match pool {
            KvPool::F32(p) => b.arg(p),
            KvPool::Bf16(p) => b.arg(p),
        };
        b.arg(&maps.tables)
            .arg(&maps.table_start)
            .arg(&maps.positions)
            .arg(&maps.lo_pos)
            .arg(&ints[1])
            .arg(&ints[2])
            .arg(&ints[3])
            .arg(&ints[4])
            .arg(&ints[5])
            .arg(&ints[6])
            .arg(&scale);
        // SAFETY: signature matches; shapes checked above, block ids validated by the caller.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching attention"))?;
        Ok(())
    }

    /// `out[m, n] = x[m, k] · w[n, k]ᵀ` (row-major, as `cpu_ops::matmul_t`) through cuBLAS
    /// sgemm: the f32 mode. bf16 weights are not supported yet (an error says so).
    pub fn matmul_t(
        &self,
        x: &CudaSlice<f32>,
        m: usize,
        k: usize,
        w: &DeviceMatrix,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), EngineError> {
        let w = match w {
            DeviceMatrix::F32(w) => w,
            DeviceMatrix::Bf16(_) => return Err(EngineError::Backend(
                "CUDA matmul with bf16 weights is not implemented yet (issue 7); use f32 weights"
                    .into(),
            )),
        };
        if m == 0 || n == 0 {
            return Ok(());
        }
        check_len("matmul x", x.len(), m * k)?;
        check_len("matmul w", w.len(), n * k)?;
        check_len("matmul out", out.len(), m * n)?;
        // Column-major view: outᵀ (n×m) = w (k×n col-major, transposed) · xᵀ (k×m col-major).
        let cfg = GemmConfig {
            transa: cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T,
            transb: cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N,
            m: to_i32("n", n)?,
            n: to_i32("m", m)?,
            k: to_i32("k", k)?,
            alpha: 1.0f32,
            lda: to_i32("k", k)?,
            ldb: to_i32("k", k)?,
            beta: 0.0f32,
            ldc: to_i32("n", n)?,
        };
        // SAFETY: the buffers hold the sizes the configuration reads and writes (checked).
        unsafe { self.blas.gemm(cfg, w, x, out) }
            .map_err(|e| EngineError::Backend(format!("cuBLAS sgemm: {e:?}")))?;
        Ok(())
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
