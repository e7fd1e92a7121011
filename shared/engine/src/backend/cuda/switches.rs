//! Environment switches of the CUDA backend, for comparisons on a GPU (each refuses unknown
//! values): which attention kernels serve prefill chunks and decode rows, which GEMM serves
//! steps of one or two rows, and whether decode graphs use programmatic dependent launch.

use crate::error::EngineError;

/// The value of `name` among `choices` (unset: the first choice); anything else is an error
/// naming the accepted values.
fn choice<T: Copy>(name: &str, choices: &[(&str, T)]) -> Result<T, EngineError> {
    let accepted = || {
        choices
            .iter()
            .map(|(v, _)| format!("`{v}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    match std::env::var(name) {
        Err(std::env::VarError::NotPresent) => Ok(choices[0].1),
        Ok(v) => choices
            .iter()
            .find(|(c, _)| *c == v)
            .map(|(_, t)| *t)
            .ok_or_else(|| {
                EngineError::InvalidInput(format!(
                    "{name} must be one of {}, not `{v}`",
                    accepted()
                ))
            }),
        Err(e) => Err(EngineError::InvalidInput(format!("{name}: {e}"))),
    }
}

/// `TANDEM_CUDA_PREFILL_ATTENTION`: `tiled` (the default: prefill chunks on tensor cores
/// where the shape allows) or `fast` (every token by `attention_fast`, for comparisons).
pub const PREFILL_ATTENTION_ENV: &str = "TANDEM_CUDA_PREFILL_ATTENTION";

pub(super) fn tiled_prefill_attention() -> Result<bool, EngineError> {
    choice(PREFILL_ATTENTION_ENV, &[("tiled", true), ("fast", false)])
}

/// `TANDEM_CUDA_DECODE_ATTENTION`: `tiled` (the default: the decode rows of a 16-bit step
/// through the tensor-core decode kernel, measured faster on an H200 from one row on: batch 1
/// 893 against 822 tok/s) or `split` (the CUDA-core split kernel, for comparisons).
pub const DECODE_ATTENTION_ENV: &str = "TANDEM_CUDA_DECODE_ATTENTION";

/// The fewest decode rows a step sends to the tensor-core decode kernel (see
/// [`super::TokenMaps::decode_tc_min`]).
pub(super) fn decode_tc_min() -> Result<usize, EngineError> {
    choice(DECODE_ATTENTION_ENV, &[("tiled", 0), ("split", usize::MAX)])
}

/// `TANDEM_CUDA_DECODE_STAGES`: shared-memory stages of the tensor-core decode kernel,
/// `auto` (the default: chosen per launch, see [`super::AttentionScratch::decode_launch`]),
/// `2` (each run of keys loads while the one before computes) or `1` (half the shared memory
/// per block, so more blocks per SM hide each other's loads).
pub const DECODE_STAGES_ENV: &str = "TANDEM_CUDA_DECODE_STAGES";

pub(super) fn decode_stages() -> Result<Option<usize>, EngineError> {
    choice(
        DECODE_STAGES_ENV,
        &[("auto", None), ("2", Some(2)), ("1", Some(1))],
    )
}

/// `TANDEM_CUDA_SMALL_GEMM`: `gemv` (the default: bf16 GEMMs of one or two rows, the decode
/// steps of few sequences, by the weight-streaming kernels of `gemv.cu`, with their fused
/// norms) or `cublas` (for comparisons).
pub const SMALL_GEMM_ENV: &str = "TANDEM_CUDA_SMALL_GEMM";

pub(super) fn small_m_gemv_from_env() -> Result<bool, EngineError> {
    choice(SMALL_GEMM_ENV, &[("gemv", true), ("cublas", false)])
}

/// `TANDEM_CUDA_PDL`: `on` (the default: in decode-step graphs, the edges between the
/// program's kernels are programmatic, so each kernel launches while the one before it runs)
/// or `off` (plain edges, for comparisons).
pub const PDL_ENV: &str = "TANDEM_CUDA_PDL";

pub(super) fn pdl_from_env() -> Result<bool, EngineError> {
    choice(PDL_ENV, &[("on", true), ("off", false)])
}

#[cfg(test)]
mod tests {
    use super::choice;

    #[test]
    fn a_switch_takes_its_default_or_a_listed_value_and_names_the_rest() {
        // A name no test or user sets.
        let name = "TANDEM_CUDA_SWITCH_TEST_UNSET";
        assert_eq!(choice(name, &[("a", 1), ("b", 2)]).unwrap(), 1);
        std::env::set_var("TANDEM_CUDA_SWITCH_TEST_SET", "b");
        assert_eq!(
            choice("TANDEM_CUDA_SWITCH_TEST_SET", &[("a", 1), ("b", 2)]).unwrap(),
            2
        );
        std::env::set_var("TANDEM_CUDA_SWITCH_TEST_BAD", "c");
        let e = choice("TANDEM_CUDA_SWITCH_TEST_BAD", &[("a", 1), ("b", 2)]).unwrap_err();
        assert!(e.to_string().contains("`a`, `b`"), "{e}");
        assert!(e.to_string().contains("not `c`"), "{e}");
        assert!(choice(name, &[("x", 0)]).is_ok());
    }
}
