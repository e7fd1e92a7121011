//! GEMMs through cuBLAS's `cublasGemmEx`: f32 × f32 (the exact mode) or bf16 × bf16 (weights
//! and activations in bf16), both accumulating and writing f32.

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use super::{check_len, to_i32, CudaDevice, DeviceElem, DeviceMatrix};
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
        let (alpha, beta) = (1.0f32, 0.0f32);
        self.count_launch();
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
