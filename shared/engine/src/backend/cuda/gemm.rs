//! GEMMs through cuBLAS's `cublasGemmEx`: f32 × f32 (the exact mode) or 16-bit × 16-bit
//! (weights and activations in the device's bf16 or f16), both accumulating and writing f32.

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::gemm_lt::{LtChoice, LtOperands, LtShape};
use super::ops::Norm;
use super::{check_len, cuda_err, to_i32, CudaDevice, DeviceElem, DeviceMatrix};
use crate::error::EngineError;

impl CudaDevice {
    /// `out[m, n] = x[m, k] · w[n, k]ᵀ` (row-major, as `cpu_ops::matmul_t`), accumulated in
    /// f32. `x` and `w` must have the same element type (f32 with f32, bf16 with bf16).
    pub fn matmul_t<X: DeviceElem>(
        &self,
        x: &CudaSlice<X>,
        m: usize,
        k: usize,
        w: &DeviceMatrix,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), EngineError> {
        let input = gemv_input::<X>();
        let route = self.gemm_route(m, n, k, w, input);
        // f32 rows over bf16 weights: the bf16x2 precision's single-row GEMVs.
        if !matches!(route, GemmRoute::Gemv { .. }) {
            check_same_types::<X>(w)?;
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        check_gemm_lengths(x.len(), w, out.len(), (m, n, k))?;
        let (mi, ni, ki) = (to_i32("m", m)?, to_i32("n", n)?, to_i32("k", k)?);
        match (w, route) {
            (DeviceMatrix::Bf16(ws), GemmRoute::Gemv { rows, input }) => {
                self.gemv_bf16(x, ws, out, rows, input, (mi, ni, ki))
            }
            (DeviceMatrix::Bf16(ws), GemmRoute::Skinny { cols }) => {
                self.gemm_skinny(x, ws, out, cols, (mi, ni, ki))
            }
            _ => self.cublas_gemm(x, w, out, (mi, ni, ki), Accumulate::No),
        }
    }

    /// [`Self::matmul_t`] writing its output rounded to the program's 16-bit element (still
    /// accumulated in f32): for GEMMs cuBLAS runs ([`Self::gemm_writes_16`]), whose consumers
    /// then read half the bytes; any other route is an error.
    pub fn matmul_t_16<X: DeviceElem>(
        &self,
        x: &CudaSlice<X>,
        m: usize,
        k: usize,
        w: &DeviceMatrix,
        n: usize,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), EngineError> {
        let dims =
            self.cublas_16_dims::<X>("a 16-bit GEMM output", x.len(), w, out.len(), (m, n, k))?;
        self.cublas_gemm(x, w, out, dims, Accumulate::No)
    }

    /// `out[m, n] += x[m, k] · w[n, k]ᵀ` (f32, the sum in cuBLAS's epilogue): a projection
    /// joining the residual stream without a separate add. Only where cuBLAS runs the GEMM
    /// with 16-bit operands ([`Self::gemm_writes_16`]); anything else is an error.
    pub fn matmul_t_add<X: DeviceElem>(
        &self,
        x: &CudaSlice<X>,
        m: usize,
        k: usize,
        w: &DeviceMatrix,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), EngineError> {
        let what = "a GEMM adding into its output";
        let dims = self.cublas_16_dims::<X>(what, x.len(), w, out.len(), (m, n, k))?;
        self.cublas_gemm(x, w, out, dims, Accumulate::Yes)
    }

    /// The checked dimensions of a GEMM that only cuBLAS with 16-bit operands may run
    /// (`what` names it in the error otherwise).
    fn cublas_16_dims<X: DeviceElem>(
        &self,
        what: &str,
        x_len: usize,
        w: &DeviceMatrix,
        out_len: usize,
        (m, n, k): (usize, usize, usize),
    ) -> Result<(i32, i32, i32), EngineError> {
        if !self.gemm_writes_16::<X>(m, n, k, w) {
            return Err(EngineError::Backend(format!(
                "{what} needs cuBLAS and 16-bit operands; this GEMM of {m} {} rows over {} \
                 weights runs {:?}",
                X::SUFFIX,
                w.elem_name(),
                self.gemm_route(m, n, k, w, gemv_input::<X>())
            )));
        }
        check_gemm_lengths(x_len, w, out_len, (m, n, k))?;
        Ok((to_i32("m", m)?, to_i32("n", n)?, to_i32("k", k)?))
    }

    /// Whether [`Self::matmul_t_16`] takes `m` rows of `X` and `k` over `w` into `n` columns:
    /// 16-bit operands on cuBLAS's route.
    pub fn gemm_writes_16<X: DeviceElem>(
        &self,
        m: usize,
        n: usize,
        k: usize,
        w: &DeviceMatrix,
    ) -> bool {
        X::SUFFIX != "f32"
            && matches!(w, DeviceMatrix::Bf16(_))
            && self.gemm_route(m, n, k, w, gemv_input::<X>()) == GemmRoute::Cublas
    }

    /// Whether steps round their qkv and gate_up GEMM outputs to 16 bits and add their o and
    /// down projections into the residual stream where [`Self::gemm_writes_16`] allows
    /// ([`super::switches::GEMM_EPILOGUE_ENV`]).
    pub fn gemm_epilogue(&self) -> bool {
        self.gemm_epilogue
    }

    /// Whether a step of prefill tiles alone whose qkv GEMM writes 16-bit rows has the q/k
    /// norm write its q heads back into them for the attention
    /// ([`super::switches::PREFILL_Q16_ENV`]).
    pub fn prefill_q16(&self) -> bool {
        self.prefill_q16
    }

    /// A GEMM of checked operands into `out` (f32, or the 16-bit element), f32
    /// accumulation; added to what `out` holds with [`Accumulate::Yes`]. Runs on cuBLASLt
    /// where its shape measured faster there (`gemm_lt.rs`), else on `cublasGemmEx`.
    fn cublas_gemm<X: DeviceElem, O: DeviceElem>(
        &self,
        x: &CudaSlice<X>,
        w: &DeviceMatrix,
        out: &mut CudaSlice<O>,
        (mi, ni, ki): (i32, i32, i32),
        acc: Accumulate,
    ) -> Result<(), EngineError> {
        let alpha = 1.0f32;
        let beta = match acc {
            Accumulate::No => 0.0f32,
            Accumulate::Yes => 1.0f32,
        };
        self.count_launch(|| format!("gemm n={ni} k={ki}"));
        let stream = &self.stream;
        let (x_ptr, _gx) = x.device_ptr(stream);
        let (w_ptr, _gw) = match w {
            DeviceMatrix::F32(s) => s.device_ptr(stream),
            DeviceMatrix::Bf16(s) => s.device_ptr(stream),
        };
        let (o_ptr, _go) = out.device_ptr_mut(stream);
        let x_type = X::cuda_type(self.e16);
        let o_type = O::cuda_type(self.e16);
        // Column-major view: outᵀ (n×m) = w (k×n col-major, transposed) · xᵀ (k×m col-major).
        let mut gemm_ex = || -> Result<(), EngineError> {
            // SAFETY: the pointers are live device buffers of the sizes the callers checked,
            // on the handle's stream; w has x's element type (checked); alpha/beta are f32 as
            // CUBLAS_COMPUTE_32F requires.
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    *self.blas.handle(),
                    cublasOperation_t::CUBLAS_OP_T,
                    cublasOperation_t::CUBLAS_OP_N,
                    ni,
                    mi,
                    ki,
                    (&alpha) as *const f32 as *const _,
                    w_ptr as *const _,
                    x_type,
                    ki,
                    x_ptr as *const _,
                    x_type,
                    ki,
                    (&beta) as *const f32 as *const _,
                    o_ptr as *mut _,
                    o_type,
                    ni,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| EngineError::Backend(format!("cuBLAS GemmEx: {e:?}")))
        };
        let accumulate = matches!(acc, Accumulate::Yes);
        if let (Some(x_lt), Some(o_lt)) = (lt_type(x_type), lt_type(o_type)) {
            let shape = LtShape {
                m: mi,
                n: ni,
                k: ki,
                x_type: x_lt,
                out_type: o_lt,
                accumulate,
            };
            if self.gemm_tuned(&shape, (w_ptr, x_ptr, o_ptr), &mut gemm_ex)? {
                return Ok(());
            }
        }
        gemm_ex()
    }

    /// Runs a GEMM of `shape` over the (weights, rows, output) addresses on cuBLASLt where
    /// its tuned plan says so (true); false where `cublasGemmEx` is the plan or tuning is off.
    fn gemm_tuned(
        &self,
        shape: &LtShape,
        (w, x, out): (u64, u64, u64),
        gemm_ex: &mut dyn FnMut() -> Result<(), EngineError>,
    ) -> Result<bool, EngineError> {
        let Some(tuner) = &self.lt else {
            return Ok(false);
        };
        let (workspace, _guard) = self.blas_workspace.device_ptr(&self.stream);
        let operands = LtOperands {
            w,
            x,
            out,
            workspace,
            workspace_bytes: super::BLAS_WORKSPACE_BYTES,
        };
        Ok(tuner.gemm(shape, &operands, &self.stream, gemm_ex)? == LtChoice::Lt)
    }
}

/// cuBLASLt's name for a cuBLAS data type the backend's GEMMs use (None: another).
fn lt_type(t: cudarc::cublas::sys::cudaDataType) -> Option<cudarc::cublaslt::sys::cudaDataType> {
    use cudarc::cublas::sys::cudaDataType as B;
    use cudarc::cublaslt::sys::cudaDataType as L;
    match t {
        B::CUDA_R_32F => Some(L::CUDA_R_32F),
        B::CUDA_R_16BF => Some(L::CUDA_R_16BF),
        B::CUDA_R_16F => Some(L::CUDA_R_16F),
        _ => None,
    }
}

/// Whether a cuBLAS GEMM overwrites its output (beta 0) or adds to it (beta 1).
#[derive(Clone, Copy)]
enum Accumulate {
    No,
    Yes,
}

/// How the GEMVs see rows of `X`.
fn gemv_input<X: DeviceElem>() -> GemvInput {
    if X::SUFFIX == "f32" {
        GemvInput::F32
    } else {
        GemvInput::Bf16
    }
}

/// cuBLAS and the skinny GEMM take activations of the weights' element type only.
fn check_same_types<X: DeviceElem>(w: &DeviceMatrix) -> Result<(), EngineError> {
    let same = match w {
        DeviceMatrix::F32(_) => X::SUFFIX == "f32",
        DeviceMatrix::Bf16(_) => X::SUFFIX != "f32",
    };
    if same {
        Ok(())
    } else {
        Err(EngineError::Backend(format!(
            "GEMM of {} activations with {} weights is not supported",
            X::SUFFIX,
            w.elem_name()
        )))
    }
}

/// x holds m rows of k, w n rows of k, out m rows of n.
fn check_gemm_lengths(
    x: usize,
    w: &DeviceMatrix,
    out: usize,
    (m, n, k): (usize, usize, usize),
) -> Result<(), EngineError> {
    let w_len = match w {
        DeviceMatrix::F32(s) => s.len(),
        DeviceMatrix::Bf16(s) => s.len(),
    };
    check_len("matmul x", x, m * k)?;
    check_len("matmul w", w_len, n * k)?;
    check_len("matmul out", out, m * n)
}

/// What a `gemv.cu` GEMV reads its activation rows as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvInput {
    /// bf16 (the bf16 precision's GEMM input).
    Bf16,
    /// f32, never rounded (the bf16x2 precision at one or two rows: its GEMVs read the
    /// weights once, as bf16's do, with no split rows to fold).
    F32,
}

impl GemvInput {
    /// The part of the entry point's name that picks it.
    fn kernel_part(self) -> &'static str {
        match self {
            GemvInput::Bf16 => "bf16",
            GemvInput::F32 => "xf32",
        }
    }

    /// Bytes per element (of the fused norm GEMV's rows in shared memory).
    fn bytes(self) -> usize {
        match self {
            GemvInput::Bf16 => 2,
            GemvInput::F32 => 4,
        }
    }
}

/// Which kernel [`CudaDevice::matmul_t`] runs a GEMM on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmRoute {
    /// `gemv.cu`'s weight-streaming GEMV instance for up to `rows` rows of `input`.
    Gemv { rows: usize, input: GemvInput },
    /// `gemm_skinny.cu`'s tensor-core GEMM with `cols` output columns per block.
    Skinny { cols: usize },
    /// cuBLAS.
    Cublas,
}

/// Rows up to which GEMMs over bf16 weights may go to `gemv.cu`: measured on an H200 (0.6B
/// shape, decode at 1k context), batch 1 ran at 709 tok/s against cuBLAS's 556, but batch 8
/// at 2,744 against 3,919 (each weight element then meets eight x rows from L1).
pub(super) const GEMV_MAX_ROWS: usize = 2;

/// The `gemv_bf16_m*` instance for `m` rows (k a multiple of 8), if `gemv.cu` has one.
fn gemv_instance(m: usize, k: usize) -> Option<usize> {
    if !k.is_multiple_of(8) || m > GEMV_MAX_ROWS {
        return None;
    }
    [1, 2].into_iter().find(|&r| m <= r)
}

/// The `gemv.cu` instance that takes `m` rows of `input` and `k`, if the GEMVs (switch
/// `gemvs`) take them: only where the skinny GEMM (switch `skinny`) does not, but for one f32
/// row. Measured on an H100 (0.6B shape, 1k context, tok/s GEMV → skinny): bf16 batch 1 1,027
/// → 1,065 and batch 2 1,469 → 1,899; bf16x2 batch 2 (then four split bf16 rows) 1,298 →
/// 1,632; bf16x2 batch 1 1,048 → 925, so its f32 row keeps the GEMV.
fn gemv_rows(m: usize, k: usize, input: GemvInput, gemvs: bool, skinny: bool) -> Option<usize> {
    let rows = gemv_instance(m, k).filter(|_| gemvs)?;
    let skinny_takes = skinny && skinny_fits(m, k);
    let gemv_first = input == GemvInput::F32 && m == 1;
    (gemv_first || !skinny_takes).then_some(rows)
}

impl CudaDevice {
    /// The kernel a GEMM of `m` rows of `input` and `k` over `w` into `n` columns runs on.
    pub fn gemm_route(
        &self,
        m: usize,
        n: usize,
        k: usize,
        w: &DeviceMatrix,
        input: GemvInput,
    ) -> GemmRoute {
        if !matches!(w, DeviceMatrix::Bf16(_)) {
            return GemmRoute::Cublas;
        }
        if let Some(rows) = self.gemv_rows(m, k, input) {
            return GemmRoute::Gemv { rows, input };
        }
        match (input, self.skinny_cols(m, n, k)) {
            (GemvInput::Bf16, Some(cols)) => GemmRoute::Skinny { cols },
            _ => GemmRoute::Cublas,
        }
    }

    fn gemv_rows(&self, m: usize, k: usize, input: GemvInput) -> Option<usize> {
        gemv_rows(m, k, input, self.small_m_gemv, self.skinny_gemm)
    }

    /// Whether [`Self::matmul_t`] takes `m` f32 rows of `k` over `w` (bf16 weights): by a
    /// `gemv.cu` GEMV reading f32 rows (else the bf16x2 precision splits them in hi and lo).
    pub fn f32_rows_gemv_fits(&self, m: usize, k: usize, w: &DeviceMatrix) -> bool {
        matches!(w, DeviceMatrix::Bf16(_)) && self.gemv_rows(m, k, GemvInput::F32).is_some()
    }
}

/// The part of a `gemv.cu` entry point's name for a GEMV of `rows` rows: the one-row GEMVs load
/// their first weights before the PDL wait (`_early_`: batch 1 +2.7% on the H200), the
/// two-row ones after it (early weights lost 6% there).
fn gemv_variant(rows: usize) -> &'static str {
    if rows == 1 {
        "_early"
    } else {
        ""
    }
}

/// Warps per block of `gemv.cu` (its GEMV_WARPS): one output column each.
const GEMV_WARPS: usize = 8;

impl CudaDevice {
    /// `out[m, n] = x[m, k] · w[n, k]ᵀ` for m ≤ `rows` by `gemv.cu` (bf16 weights, `input`
    /// rows, f32 out); shapes and element types checked by the caller (`X` is `input`).
    fn gemv_bf16<X: DeviceElem>(
        &self,
        x: &CudaSlice<X>,
        w: &CudaSlice<u16>,
        out: &mut CudaSlice<f32>,
        rows: usize,
        input: GemvInput,
        (m, n, k): (i32, i32, i32),
    ) -> Result<(), EngineError> {
        let early = gemv_variant(rows);
        let name = format!("gemv{early}_{}_m{rows}", input.kernel_part());
        let f = self.func(&name)?;
        let cfg = LaunchConfig {
            grid_dim: ((n as usize).div_ceil(GEMV_WARPS) as u32, 1, 1),
            block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(f);
        b.arg(out).arg(x).arg(w).arg(&m).arg(&n).arg(&k);
        // SAFETY: signature matches; x holds m·k, w n·k and out m·n elements (checked by
        // matmul_t), k is a multiple of 8 and the buffers' starts are 256-byte aligned, so
        // the kernel's 16-byte loads stay in bounds and aligned.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching gemv_bf16"))?;
        Ok(())
    }
}

/// Warps per block of `gemm_skinny.cu` (its SG_WARPS), each a slice of k of 32-element chunks.
const SKINNY_WARPS: usize = 8;

/// Rows of x up to which `gemm_skinny.cu` runs: one 16-row tile of mma.sync (two tiles, 32
/// rows, measured 19–23% slower than cuBLAS on an H100).
const SKINNY_MAX_ROWS: usize = 16;

/// Output columns per block of `gemm_skinny.cu` for `m` rows of `k` into `n` columns, if it
/// takes the shape: 16 where that still makes two blocks per SM, else 8.
fn skinny_cols(m: usize, n: usize, k: usize, sms: usize) -> Option<usize> {
    skinny_fits(m, k).then_some(if n.div_ceil(16) >= 2 * sms { 16 } else { 8 })
}

/// Whether `gemm_skinny.cu` takes `m` rows of `k`: one to 16 rows, k whole slices of its warps.
fn skinny_fits(m: usize, k: usize) -> bool {
    (1..=SKINNY_MAX_ROWS).contains(&m) && k.is_multiple_of(32 * SKINNY_WARPS)
}

impl CudaDevice {
    fn skinny_cols(&self, m: usize, n: usize, k: usize) -> Option<usize> {
        self.skinny_gemm
            .then(|| skinny_cols(m, n, k, self.sms))
            .flatten()
    }

    /// `out[m, n] = x[m, k] · w[n, k]ᵀ` by `gemm_skinny.cu` (16-bit x and w, f32 out) with
    /// `cols` output columns per block; shapes checked by the caller.
    fn gemm_skinny<X: DeviceElem>(
        &self,
        x: &CudaSlice<X>,
        w: &CudaSlice<u16>,
        out: &mut CudaSlice<f32>,
        cols: usize,
        (m, n, k): (i32, i32, i32),
    ) -> Result<(), EngineError> {
        let f = self.func(&format!("gemm_skinny_n{cols}"))?;
        let cfg = LaunchConfig {
            grid_dim: ((n as usize).div_ceil(cols) as u32, 1, 1),
            block_dim: ((SKINNY_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(f);
        b.arg(out).arg(x).arg(w).arg(&m).arg(&n).arg(&k);
        // SAFETY: signature matches; x holds m·k 16-bit elements, w n·k and out m·n (checked
        // by matmul_t), k is a multiple of 256 and the buffers' starts 256-byte aligned, so
        // every 16-byte load stays in bounds and aligned; columns past n read row n − 1 and
        // are not stored.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching gemm_skinny"))?;
        Ok(())
    }
}

/// Dynamic shared memory `gemv.cu`'s fused norm GEMV may take for its normalised rows
/// (m · k bf16): the default 48 KiB limit of a launch less a margin for the kernel's static
/// shared memory (block_sum's 132 bytes), which counts against the same limit.
const NORM_GEMV_SMEM_MAX: usize = (48 << 10) - 1024;

impl CudaDevice {
    /// Whether [`Self::norm_gemv`] takes `m` rows of `k` over weights `w` with rows of
    /// `input`: bf16 weights, at most two rows, k a multiple of 8 whose rows fit in shared
    /// memory, the GEMV switch on.
    pub fn norm_gemv_fits(&self, m: usize, k: usize, w: &DeviceMatrix, input: GemvInput) -> bool {
        matches!(w, DeviceMatrix::Bf16(_))
            && self
                .gemv_rows(m, k, input)
                .is_some_and(|rows| rows * k * input.bytes() <= NORM_GEMV_SMEM_MAX)
    }

    /// A decode step's RMSNorm and GEMV in one launch (`gemv.cu`'s `gemv_norm_*`): the rows
    /// `x + residual` (stored to `x_out`, the residual stream's other buffer) normalised by
    /// `norm`, rounded to bf16 (`input` bf16) or kept in f32, times the weights' transpose into
    /// `out[m, n]` (f32). With `weights.silu`, `out` gets silu(gate) · up in the `input` type.
    /// Shapes must pass [`Self::norm_gemv_fits`].
    pub fn norm_gemv<O: DeviceElem>(
        &self,
        out: &mut CudaSlice<O>,
        rows: ResidualRows<'_>,
        norm: Norm<'_>,
        weights: GemvWeights<'_>,
        input: GemvInput,
    ) -> Result<(), EngineError> {
        let (m, k, n) = (rows.m, rows.k, weights.n);
        let (DeviceMatrix::Bf16(ws), Some(instance), true) = (
            weights.w,
            self.gemv_rows(m, k, input),
            self.norm_gemv_fits(m, k, weights.w, input),
        ) else {
            return Err(EngineError::Backend(format!(
                "norm_gemv: {m} rows of {k} over {} weights is not a fused-GEMV shape",
                weights.w.elem_name()
            )));
        };
        check_norm_gemv_output::<O>(weights.silu, input)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        rows.check_lengths(norm)?;
        weights.check_len(ws.len(), k)?;
        check_len("norm_gemv out", out.len(), m * n)?;
        let ints = [to_i32("m", m)?, to_i32("n", n)?, to_i32("k", k)?];
        let silu_part = if weights.silu { "_silu" } else { "" };
        let early = gemv_variant(instance);
        let rows_type = input.kernel_part();
        let f = self.func(&format!(
            "gemv_norm{silu_part}{early}_{rows_type}_m{instance}"
        ))?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(GEMV_WARPS) as u32, 1, 1),
            block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: (instance * k * input.bytes()) as u32,
        };
        let null = 0u64;
        let mut b = self.stream.launch_builder(f);
        b.arg(out).arg(rows.x);
        match rows.residual {
            Some(r) => b.arg(r),
            None => b.arg(&null),
        };
        b.arg(rows.x_out).arg(norm.w).arg(&norm.eps).arg(ws);
        for v in &ints {
            b.arg(v);
        }
        // SAFETY: signature matches; every buffer's length was checked above (x, residual and
        // x_out m·k, w (silu ? 2n : n)·k, out m·n), k is a multiple of 8 and the buffers'
        // starts are 256-byte aligned for the 16-byte weight loads; the shared memory holds
        // the instance's rows of k `input` elements.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching gemv_norm"))?;
        Ok(())
    }
}

/// The rows a fused norm GEMV reads and where it leaves their sum: `m` rows of `k`, `x` plus
/// `residual` (the last output into the residual stream, if any), stored to `x_out`.
pub struct ResidualRows<'a> {
    pub x: &'a CudaSlice<f32>,
    pub residual: Option<&'a CudaSlice<f32>>,
    pub x_out: &'a mut CudaSlice<f32>,
    pub m: usize,
    pub k: usize,
}

impl ResidualRows<'_> {
    /// Every buffer holds the m·k rows, the norm one weight per element of a row.
    fn check_lengths(&self, norm: Norm<'_>) -> Result<(), EngineError> {
        let mk = self.m * self.k;
        check_len("norm_gemv x", self.x.len(), mk)?;
        if let Some(r) = self.residual {
            check_len("norm_gemv residual", r.len(), mk)?;
        }
        check_len("norm_gemv x_out", self.x_out.len(), mk)?;
        check_len("norm_gemv norm weight", norm.w.len(), self.k)
    }
}

/// A fused norm GEMV's weights: `n` output columns; with `silu`, `w` holds the gate and up
/// rows interleaved (2n rows, as the backend loads gate_up) and the epilogue is SiLU·mul.
#[derive(Clone, Copy)]
pub struct GemvWeights<'a> {
    pub w: &'a DeviceMatrix,
    pub n: usize,
    pub silu: bool,
}

impl GemvWeights<'_> {
    /// The weights hold their rows (`n`, or `2n` with SiLU) of `k`.
    fn check_len(&self, len: usize, k: usize) -> Result<(), EngineError> {
        let w_rows = if self.silu { 2 * self.n } else { self.n };
        if len != w_rows * k {
            return Err(EngineError::Backend(format!(
                "norm_gemv: weights of {len} elements, expected {w_rows} × {k}"
            )));
        }
        Ok(())
    }
}

/// The output a fused norm GEMV writes: bf16 for SiLU·mul over bf16 rows (the down
/// projection's input), else f32; `O` must be it.
fn check_norm_gemv_output<O: DeviceElem>(silu: bool, input: GemvInput) -> Result<(), EngineError> {
    let want_out = match (silu, input) {
        (true, GemvInput::Bf16) => "bf16",
        _ => "f32",
    };
    if O::SUFFIX != want_out {
        return Err(EngineError::Backend(format!(
            "norm_gemv: {} output, expected {want_out}",
            O::SUFFIX
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{gemv_rows, skinny_cols, GemvInput};

    #[test]
    fn skinny_gemm_takes_up_to_16_rows_of_whole_k_slices() {
        // 132 SMs: 16 columns per block only where that still makes 264 blocks.
        assert_eq!(skinny_cols(4, 6144, 1024, 132), Some(16));
        assert_eq!(skinny_cols(16, 4096, 1024, 132), Some(8));
        assert_eq!(skinny_cols(3, 1024, 3072, 132), Some(8));
        // Past 16 rows, or k not in slices of 8 warps × 32, cuBLAS keeps it.
        assert_eq!(skinny_cols(17, 4096, 1024, 132), None);
        assert_eq!(skinny_cols(8, 4096, 1000, 132), None);
        assert_eq!(skinny_cols(0, 4096, 1024, 132), None);
    }

    #[test]
    fn gemvs_keep_one_f32_row_and_what_the_skinny_gemm_cannot_take() {
        let (f32_rows, bf16_rows) = (GemvInput::F32, GemvInput::Bf16);
        // Skinny GEMM on: bf16 rows go to it, one f32 row stays a GEMV, two do not.
        assert_eq!(gemv_rows(1, 1024, bf16_rows, true, true), None);
        assert_eq!(gemv_rows(2, 3072, bf16_rows, true, true), None);
        assert_eq!(gemv_rows(1, 1024, f32_rows, true, true), Some(1));
        assert_eq!(gemv_rows(2, 1024, f32_rows, true, true), None);
        // k the skinny GEMM does not take (not a multiple of 256): the GEMVs.
        assert_eq!(gemv_rows(1, 1000, bf16_rows, true, true), Some(1));
        assert_eq!(gemv_rows(2, 8, f32_rows, true, true), Some(2));
        // Skinny GEMM off: the GEMVs take one and two rows of either.
        assert_eq!(gemv_rows(1, 1024, bf16_rows, true, false), Some(1));
        assert_eq!(gemv_rows(2, 1024, f32_rows, true, false), Some(2));
        assert_eq!(gemv_rows(3, 1024, bf16_rows, true, false), None);
        // GEMVs off, or k not a multiple of 8: none.
        assert_eq!(gemv_rows(1, 1024, f32_rows, false, false), None);
        assert_eq!(gemv_rows(1, 1001, bf16_rows, true, false), None);
    }
}
