//! Environment switches of the CUDA backend, for comparisons on a GPU (each refuses unknown
//! values): which attention kernels serve prefill chunks and decode rows, how the decode
//! attention is split and staged, which GEMM serves steps of one or two rows, what cuBLAS's
//! GEMMs do past the product and whether their algorithms are tuned per shape, and whether
//! decode graphs use programmatic dependent launch. Variants that measured slower and had no
//! other use are gone (git history keeps their code and A/Bs: the decode-step fusions of
//! `TANDEM_CUDA_DECODE_FUSION`, the two-row early GEMV weights, `TANDEM_CUDA_L2_PREFETCH`);
//! each kept non-default value says why it stays.

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
/// where the shape allows, by the warpgroup kernel `attention_prefill_wg.cu` on compute
/// capability 9.0 and `attention_prefill.cu`'s mma.sync elsewhere), `mma` (the mma.sync
/// tiles on every device, for comparisons on Hopper) or `fast` (every token by
/// `attention_fast`, for comparisons). `fast` stays: `attention_fast` runs anyway wherever the
/// tiles cannot (the f32 mode, the bf16x2 mode over an f32 or bf16 cache), so forcing it
/// costs no code of its own; `mma` stays because the mma.sync kernel serves FP8 pools and
/// pre-Hopper devices anyway.
pub const PREFILL_ATTENTION_ENV: &str = "TANDEM_CUDA_PREFILL_ATTENTION";

/// The kernels [`PREFILL_ATTENTION_ENV`] asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillAttention {
    /// Tensor-core tiles, warpgroup MMA where the device has it.
    Tiled,
    /// Tensor-core tiles by mma.sync everywhere.
    Mma,
    /// No tiles: `attention_fast` for every token.
    Fast,
}

pub(super) fn prefill_attention() -> Result<PrefillAttention, EngineError> {
    choice(
        PREFILL_ATTENTION_ENV,
        &[
            ("tiled", PrefillAttention::Tiled),
            ("mma", PrefillAttention::Mma),
            ("fast", PrefillAttention::Fast),
        ],
    )
}

pub(super) fn tiled_prefill_attention() -> Result<bool, EngineError> {
    Ok(prefill_attention()? != PrefillAttention::Fast)
}

/// `TANDEM_CUDA_PREFILL_TILE_ORDER`: `paired` (the default: see
/// [`super::TokenMaps::tile_slots`]; a 2,048-token prefill's attention 2.60 → 2.37 ms on an
/// H100) or `longest-first` (the tiles by their key runs, longest first, alone: for
/// comparisons).
pub const PREFILL_TILE_ORDER_ENV: &str = "TANDEM_CUDA_PREFILL_TILE_ORDER";

pub(super) fn paired_tile_order() -> Result<bool, EngineError> {
    choice(
        PREFILL_TILE_ORDER_ENV,
        &[("paired", true), ("longest-first", false)],
    )
}

/// `TANDEM_CUDA_PREFILL_SCHEDULE`: how the warpgroup prefill attention's blocks take the
/// tiles: `balanced` (the default: where the tiles fit one wave, as many blocks as the GPU
/// holds at once, each about the same cost — a piece its key runs and 3 more — long tiles cut
/// into pieces of at least 2 runs; see `prefill_schedule.rs`; a 2,048-token prefill's
/// attention 2.21 → 1.96 ms on an H100) or `per-tile` (one block per tile and KV head in the
/// order of [`PREFILL_TILE_ORDER_ENV`], the launch before the schedule: for comparisons).
pub const PREFILL_SCHEDULE_ENV: &str = "TANDEM_CUDA_PREFILL_SCHEDULE";

/// The fewest key runs of a cut piece and a piece's own cost in runs
/// ([`PREFILL_SCHEDULE_ENV`]; `None`: one block per tile).
pub(super) fn prefill_piece_costs() -> Result<Option<(usize, usize)>, EngineError> {
    choice(
        PREFILL_SCHEDULE_ENV,
        &[("balanced", Some((2, 3))), ("per-tile", None)],
    )
}

/// `TANDEM_CUDA_DECODE_ATTENTION`: `tiled` (the default: the decode rows of a 16-bit step
/// through the tensor-core decode kernel, measured faster on an H200 from one row on: batch 1
/// 893 against 822 tok/s) or `split` (the CUDA-core split kernel, for comparisons).
/// `split` stays: that kernel serves the decode rows wherever the tensor cores cannot (the f32
/// mode, the bf16x2 mode over an f32 or bf16 cache) anyway.
pub const DECODE_ATTENTION_ENV: &str = "TANDEM_CUDA_DECODE_ATTENTION";

/// The fewest decode rows a step sends to the tensor-core decode kernel (see
/// [`super::TokenMaps::decode_tc_min`]).
pub(super) fn decode_tc_min() -> Result<usize, EngineError> {
    choice(DECODE_ATTENTION_ENV, &[("tiled", 0), ("split", usize::MAX)])
}

/// `TANDEM_CUDA_DECODE_STAGES`: shared-memory stages of the tensor-core decode kernel,
/// `auto` (the default: chosen per launch, see [`super::AttentionScratch::decode_launch`]),
/// `2` (each run of keys loads while the one before computes) or `1` (half the shared memory
/// per block, so more blocks per SM hide each other's loads). `1` and `2` stay: `auto` picks
/// between the same two per launch; fixing one is how that choice is measured.
pub const DECODE_STAGES_ENV: &str = "TANDEM_CUDA_DECODE_STAGES";

pub(super) fn decode_stages() -> Result<Option<usize>, EngineError> {
    choice(
        DECODE_STAGES_ENV,
        &[("auto", None), ("2", Some(2)), ("1", Some(1))],
    )
}

/// `TANDEM_CUDA_DECODE_SPLITS`: blocks per (row, KV head) of the tensor-core decode kernel,
/// `auto` (the default: the count that fills the GPU's resident slots in the most even waves,
/// see [`super::AttentionScratch::decode_launch`]) or a count from 1 to 32 (at most what the
/// split scratch holds for the step's pairs). A fixed count stays: it reruns the split
/// comparisons behind `auto` and takes no code path of its own.
pub const DECODE_SPLITS_ENV: &str = "TANDEM_CUDA_DECODE_SPLITS";

pub(super) fn decode_splits() -> Result<Option<usize>, EngineError> {
    match std::env::var(DECODE_SPLITS_ENV) {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Ok(v) => parse_splits(&v),
        Err(e) => Err(EngineError::InvalidInput(format!(
            "{DECODE_SPLITS_ENV}: {e}"
        ))),
    }
}

fn parse_splits(v: &str) -> Result<Option<usize>, EngineError> {
    let max = super::attention_scratch::MAX_SPLITS;
    match v.trim() {
        "auto" => Ok(None),
        n => match n.parse::<usize>() {
            Ok(n) if (1..=max).contains(&n) => Ok(Some(n)),
            _ => Err(EngineError::InvalidInput(format!(
                "{DECODE_SPLITS_ENV} must be `auto` or a count from 1 to {max}, not `{v}`"
            ))),
        },
    }
}

/// `TANDEM_CUDA_DECODE_CLUSTER`: whether the tensor-core decode attention's splits of one
/// (row, KV head) run as one thread-block cluster (sm_90 and later; at most the largest
/// cluster the GPU schedules, 16 on an H200) and merge over distributed shared memory instead
/// of through global memory, a fence and a counter: `auto` (the default: when the clustered
/// launch has at most one block per SM, where the merge is on every block's critical path —
/// measured on the H200: batch 1 +1.1%, +2.0% with the second run staged early, while
/// clustering batch 2 lost 0.5% and batch 8 7%), `off` or `on` (whenever a launch splits).
/// `off` and `on` stay: `auto` runs both kernels (clusters at batch 1, none above), so forcing
/// one measures that choice with no code of its own.
pub const DECODE_CLUSTER_ENV: &str = "TANDEM_CUDA_DECODE_CLUSTER";

/// See [`DECODE_CLUSTER_ENV`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeCluster {
    Auto,
    On,
    Off,
}

pub(super) fn decode_cluster_from_env() -> Result<DecodeCluster, EngineError> {
    choice(
        DECODE_CLUSTER_ENV,
        &[
            ("auto", DecodeCluster::Auto),
            ("off", DecodeCluster::Off),
            ("on", DecodeCluster::On),
        ],
    )
}

/// `TANDEM_CUDA_SMALL_GEMM`: `gemv` (the default: bf16 GEMMs of one or two rows, the decode
/// steps of few sequences, by the weight-streaming kernels of `gemv.cu`, with their fused
/// norms) or `cublas` (for comparisons). `cublas` stays: cuBLAS serves every GEMM of three
/// rows or more anyway, so it is the reference the GEMVs are measured against.
pub const SMALL_GEMM_ENV: &str = "TANDEM_CUDA_SMALL_GEMM";

pub(super) fn small_m_gemv_from_env() -> Result<bool, EngineError> {
    choice(SMALL_GEMM_ENV, &[("gemv", true), ("cublas", false)])
}

/// `TANDEM_CUDA_SKINNY_GEMM`: `on` (the default: 16-bit GEMMs of 1–16 rows run
/// `gemm_skinny.cu` on the tensor cores, but for bf16x2's single f32 row, which keeps its GEMV,
/// and shapes the kernel does not take) or `off` (`gemv.cu` for one or two rows, cuBLAS above).
pub const SKINNY_GEMM_ENV: &str = "TANDEM_CUDA_SKINNY_GEMM";

pub(super) fn skinny_gemm() -> Result<bool, EngineError> {
    choice(SKINNY_GEMM_ENV, &[("on", true), ("off", false)])
}

/// `TANDEM_CUDA_GEMM_TUNING`: `off` (the default: every GEMM cuBLAS serves runs
/// `cublasGemmEx`, cuBLAS's first heuristic choice) or `on` (each such GEMM shape class is
/// timed once on `cublasGemmEx` and on cuBLASLt's heuristic candidates, and runs on the
/// fastest; see `gemm_lt.rs`). Measured on an H100 (docs/benchmarks.md): decode steps
/// unchanged at batch 1–256 (cuBLAS's first choice is already the fastest for them), prefill
/// 3–4% faster. `on` stays a switch, not the default: that gain does not pay for an
/// algorithm choice that depends on start-up timings (two workers could round differently).
/// `cuda_kernels_check` runs the GEMM checks on a tuning device too.
pub const GEMM_TUNING_ENV: &str = "TANDEM_CUDA_GEMM_TUNING";

pub(super) fn gemm_tuning() -> Result<bool, EngineError> {
    choice(GEMM_TUNING_ENV, &[("off", false), ("on", true)])
}

/// `TANDEM_CUDA_GEMM_EPILOGUE`: what cuBLAS's GEMMs do past the product in the bf16 and f16
/// precisions, where cuBLAS runs them (17 rows and more). `on` (the default): the qkv and
/// gate_up GEMMs write their outputs rounded to the 16-bit element, as transformers' 16-bit
/// linear layers do, for the q/k norm + RoPE and SiLU·mul kernels to read half the bytes, and
/// the o and down projections add themselves into the residual stream (beta = 1) instead of
/// leaving the add to the next RMSNorm (H100, bf16 2k prefill 7.58 → 6.95 ms: rounding alone
/// 7.12, adding alone 7.48). `off`: f32 outputs. `off` stays as the reference of accuracy
/// comparisons (bf16's logits 4.0e-2 of f32 with it, 4.5e-2 without).
pub const GEMM_EPILOGUE_ENV: &str = "TANDEM_CUDA_GEMM_EPILOGUE";

/// See [`GEMM_EPILOGUE_ENV`]: whether the qkv and gate_up outputs are rounded to 16 bits and
/// the o and down outputs added into the residual stream.
pub(super) fn gemm_epilogue() -> Result<bool, EngineError> {
    choice(GEMM_EPILOGUE_ENV, &[("on", true), ("off", false)])
}

/// `TANDEM_CUDA_PREFILL_Q16`: in the bf16 and f16 precisions, where a step holds prefill tiles
/// and no decode rows and its qkv GEMM writes 16-bit rows ([`GEMM_EPILOGUE_ENV`]), `on` (the
/// default): the q/k norm + RoPE writes the rotated q heads back into those rows, rounded as
/// the attention rounds them anyway, and the warpgroup prefill attention copies its Q tiles
/// from there (no f32 q rows written and read back); `off`: q heads in f32 rows (for
/// comparisons; what steps with decode rows do).
pub const PREFILL_Q16_ENV: &str = "TANDEM_CUDA_PREFILL_Q16";

pub(super) fn prefill_q16() -> Result<bool, EngineError> {
    choice(PREFILL_Q16_ENV, &[("on", true), ("off", false)])
}

/// `TANDEM_CUDA_PDL`: `on` (the default: in decode-step graphs, the edges between the
/// program's kernels are programmatic, so each kernel launches while the one before it runs)
/// or `off` (plain edges, for comparisons). `off` stays: plain edges are what a GPU below
/// compute capability 9.0 or a driver older than CUDA 12.3 gets anyway.
pub const PDL_ENV: &str = "TANDEM_CUDA_PDL";

pub(super) fn pdl_from_env() -> Result<bool, EngineError> {
    choice(PDL_ENV, &[("on", true), ("off", false)])
}

#[cfg(test)]
mod tests {
    use super::{choice, parse_splits};

    #[test]
    fn decode_splits_are_auto_or_a_count() {
        assert_eq!(parse_splits("auto").unwrap(), None);
        assert_eq!(parse_splits(" 16 ").unwrap(), Some(16));
        for bad in ["0", "33", "-1", "many", ""] {
            let e = parse_splits(bad).unwrap_err().to_string();
            assert!(e.contains("TANDEM_CUDA_DECODE_SPLITS"), "{e}");
        }
    }

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
