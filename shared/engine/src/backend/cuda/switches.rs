//! Environment switches of the CUDA backend, for comparisons on a GPU (each refuses unknown
//! values): which attention kernels serve prefill chunks and decode rows, and which GEMM serves
//! steps of one or two rows.

use crate::error::EngineError;

/// `TANDEM_CUDA_PREFILL_ATTENTION`: `tiled` (the default: prefill chunks on tensor cores
/// where the shape allows) or `fast` (every token by `attention_fast`, for comparisons).
pub const PREFILL_ATTENTION_ENV: &str = "TANDEM_CUDA_PREFILL_ATTENTION";

pub(super) fn tiled_prefill_attention() -> Result<bool, EngineError> {
    match std::env::var(PREFILL_ATTENTION_ENV) {
        Err(std::env::VarError::NotPresent) => Ok(true),
        Ok(v) if v == "tiled" => Ok(true),
        Ok(v) if v == "fast" => Ok(false),
        Ok(v) => Err(EngineError::InvalidInput(format!(
            "{PREFILL_ATTENTION_ENV} must be `tiled` or `fast`, not `{v}`"
        ))),
        Err(e) => Err(EngineError::InvalidInput(format!(
            "{PREFILL_ATTENTION_ENV}: {e}"
        ))),
    }
}

/// `TANDEM_CUDA_DECODE_ATTENTION`: `auto` (the default: the decode rows of a step through the
/// tensor-core decode kernel from two rows on, a single row through the CUDA-core split kernel,
/// as measured faster on an H200), `tiled` (always the tensor-core kernel) or `split` (always
/// the CUDA-core one).
pub const DECODE_ATTENTION_ENV: &str = "TANDEM_CUDA_DECODE_ATTENTION";

/// The fewest decode rows a step sends to the tensor-core decode kernel (see
/// [`super::TokenMaps::decode_tc_min`]).
pub(super) fn decode_tc_min() -> Result<usize, EngineError> {
    match std::env::var(DECODE_ATTENTION_ENV) {
        Err(std::env::VarError::NotPresent) => Ok(2),
        Ok(v) if v == "auto" => Ok(2),
        Ok(v) if v == "tiled" => Ok(0),
        Ok(v) if v == "split" => Ok(usize::MAX),
        Ok(v) => Err(EngineError::InvalidInput(format!(
            "{DECODE_ATTENTION_ENV} must be `auto`, `tiled` or `split`, not `{v}`"
        ))),
        Err(e) => Err(EngineError::InvalidInput(format!(
            "{DECODE_ATTENTION_ENV}: {e}"
        ))),
    }
}

/// `TANDEM_CUDA_SMALL_GEMM`: `gemv` (the default: bf16 GEMMs of ≤ 8 rows, the decode steps of
/// few sequences, by the weight-streaming kernel of `gemv.cu`) or `cublas` (for comparisons).
pub const SMALL_GEMM_ENV: &str = "TANDEM_CUDA_SMALL_GEMM";

pub(super) fn small_m_gemv_from_env() -> Result<bool, EngineError> {
    match std::env::var(SMALL_GEMM_ENV) {
        Err(std::env::VarError::NotPresent) => Ok(true),
        Ok(v) if v == "gemv" => Ok(true),
        Ok(v) if v == "cublas" => Ok(false),
        Ok(v) => Err(EngineError::InvalidInput(format!(
            "{SMALL_GEMM_ENV} must be `gemv` or `cublas`, not `{v}`"
        ))),
        Err(e) => Err(EngineError::InvalidInput(format!("{SMALL_GEMM_ENV}: {e}"))),
    }
}

/// `TANDEM_CUDA_PDL`: `on` (the default: in decode-step graphs, the edges between the
/// program's kernels are programmatic, so each kernel launches while the one before it runs)
/// or `off` (plain edges, for comparisons).
pub const PDL_ENV: &str = "TANDEM_CUDA_PDL";

pub(super) fn pdl_from_env() -> Result<bool, EngineError> {
    match std::env::var(PDL_ENV) {
        Err(std::env::VarError::NotPresent) => Ok(true),
        Ok(v) if v == "on" => Ok(true),
        Ok(v) if v == "off" => Ok(false),
        Ok(v) => Err(EngineError::InvalidInput(format!(
            "{PDL_ENV} must be `on` or `off`, not `{v}`"
        ))),
        Err(e) => Err(EngineError::InvalidInput(format!("{PDL_ENV}: {e}"))),
    }
}
