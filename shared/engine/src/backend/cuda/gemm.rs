//! GEMMs through cuBLAS's `cublasGemmEx`: f32 × f32 (the exact mode) or bf16 × bf16 (weights
//! and activations in bf16), both accumulating and writing f32.

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

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
        let (w_type, w_len) = match w {
            DeviceMatrix::F32(s) => (f32::CUDA_TYPE, s.len()),
            DeviceMatrix::Bf16(s) => (u16::CUDA_TYPE, s.len()),
        };
        if w_type != X::CUDA_TYPE {
            return Err(EngineError::Backend(format!(
                "GEMM of {} activations with {} weights is not supported",
                X::SUFFIX,
                match w {
                    DeviceMatrix::F32(_) => "f32",
                    DeviceMatrix::Bf16(_) => "bf16",
                }
            )));
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        check_len("matmul x", x.len(), m * k)?;
        check_len("matmul w", w_len, n * k)?;
        check_len("matmul out", out.len(), m * n)?;
        let (mi, ni, ki) = (to_i32("m", m)?, to_i32("n", n)?, to_i32("k", k)?);
        if let (DeviceMatrix::Bf16(ws), Some(rows)) = (w, gemv_rows(m, k)) {
            if self.small_m_gemv {
                return self.gemv_bf16(x, ws, out, rows, mi, ni, ki);
            }
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        self.count_launch(|| format!("gemm n={n} k={k}"));
        let stream = &self.stream;
        let (x_ptr, _gx) = x.device_ptr(stream);
        let (w_ptr, _gw) = match w {
            DeviceMatrix::F32(s) => s.device_ptr(stream),
            DeviceMatrix::Bf16(s) => s.device_ptr(stream),
        };
        let (o_ptr, _go) = out.device_ptr_mut(stream);
        // Column-major view: outᵀ (n×m) = w (k×n col-major, transposed) · xᵀ (k×m col-major).
        // SAFETY: the pointers are live device buffers of the sizes checked above, on the
        // handle's stream; alpha/beta are f32 as CUBLAS_COMPUTE_32F requires.
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
                w_type,
                ki,
                x_ptr as *const _,
                X::CUDA_TYPE,
                ki,
                (&beta) as *const f32 as *const _,
                o_ptr as *mut _,
                f32::CUDA_TYPE,
                ni,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| EngineError::Backend(format!("cuBLAS GemmEx: {e:?}")))?;
        Ok(())
    }
}

/// Rows up to which bf16 GEMMs go to `gemv.cu`: measured on an H200 (0.6B shape, decode at
/// 1k context), batch 1 ran at 709 tok/s against cuBLAS's 556, but batch 8 at 2,744 against
/// 3,919 (each weight element then meets eight x rows from L1).
const GEMV_MAX_ROWS: usize = 2;

/// The `gemv_bf16_m*` instance for `m` rows (k a multiple of 8), if `gemv.cu` takes them.
fn gemv_rows(m: usize, k: usize) -> Option<usize> {
    if !k.is_multiple_of(8) || m > GEMV_MAX_ROWS {
        return None;
    }
    [1, 2].into_iter().find(|&r| m <= r)
}

/// Warps per block of `gemv.cu` (its GEMV_WARPS): one output column each.
const GEMV_WARPS: usize = 8;

impl CudaDevice {
    /// `out[m, n] = x[m, k] · w[n, k]ᵀ` for m ≤ `rows` by `gemv.cu` (bf16 × bf16, f32 out);
    /// shapes and element types checked by the caller (`X` is bf16 here).
    #[allow(clippy::too_many_arguments)]
    fn gemv_bf16<X: DeviceElem>(
        &self,
        x: &CudaSlice<X>,
        w: &CudaSlice<u16>,
        out: &mut CudaSlice<f32>,
        rows: usize,
        m: i32,
        n: i32,
        k: i32,
    ) -> Result<(), EngineError> {
        let name = format!("gemv_bf16_m{rows}");
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
