//! Environment switches of the CUDA backend, for comparisons on a GPU (each refuses unknown
//! values): which attention kernels serve prefill chunks and decode rows, which GEMM serves
//! steps of one or two rows, whether decode steps fuse their norms into the kernels after
//! them, and whether decode graphs use programmatic dependent launch.

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

/// `TANDEM_CUDA_DECODE_SPLITS`: blocks per (row, KV head) of the tensor-core decode kernel,
/// `auto` (the default: the count that fills the GPU's resident slots in the most even waves,
/// see [`super::AttentionScratch::decode_launch`]) or a count from 1 to 32 (at most what the
/// split scratch holds for the step's pairs).
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
/// norms) or `cublas` (for comparisons).
pub const SMALL_GEMM_ENV: &str = "TANDEM_CUDA_SMALL_GEMM";

pub(super) fn small_m_gemv_from_env() -> Result<bool, EngineError> {
    choice(SMALL_GEMM_ENV, &[("gemv", true), ("cublas", false)])
}

/// `TANDEM_CUDA_L2_PREFETCH`: `off` (the default: measured 2% slower at batch 1 on the H200,
/// docs/benchmarks.md) or `on`: the GEMVs of one or two rows ask the weights of the GEMM
/// after them into L2 while they run.
pub const L2_PREFETCH_ENV: &str = "TANDEM_CUDA_L2_PREFETCH";

pub(super) fn l2_prefetch_from_env() -> Result<bool, EngineError> {
    choice(L2_PREFETCH_ENV, &[("off", false), ("on", true)])
}

/// `TANDEM_CUDA_DECODE_FUSION`: which decode-step fusions are on. Unset, only one: the GEMVs
/// of one row (decode steps of one sequence) load their first weights before waiting on the
/// kernel before them (batch 1 +2.7% on the H200; at two rows it lost 6%); every other one
/// measured slower (docs/benchmarks.md). `off` turns that one off too, `on` turns on all, and
/// a comma-separated list adds to the default
/// - `rope`: in steps whose every row is a decode row, the q/k norms, RoPE and KV write ride
///   in the tensor-core decode attention (one launch per layer fewer);
/// - `final-norm`: in steps of one or two rows that want every row's logits, the final
///   RMSNorm rides in the lm_head GEMV (no row gathers, no separate norm: three launches
///   fewer);
/// - `early-weights`: the GEMVs of two rows too load their first weights before waiting on
///   the kernel before them (programmatic launch), overlapping its tail;
/// - `qkv-rope`: in steps of one or two rows, the q/k norms, RoPE and KV write ride in the
///   tail of the qkv GEMV (the last block of each head does them: one launch per layer
///   fewer).
pub const DECODE_FUSION_ENV: &str = "TANDEM_CUDA_DECODE_FUSION";

/// The fusions of [`DECODE_FUSION_ENV`]; `Default` is what an unset variable gives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeFusion {
    pub rope: bool,
    pub final_norm: bool,
    pub early_weights: EarlyWeights,
    pub qkv_rope: bool,
}

/// Which GEMVs (`gemv.cu`'s one- and two-row kernels) load their first weights before the
/// programmatic-launch wait: their `_early_` entry points.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EarlyWeights {
    Off,
    #[default]
    OneRow,
    OneAndTwoRows,
}

impl EarlyWeights {
    /// Whether a GEMV of `rows` rows takes its early variant.
    pub fn applies(self, rows: usize) -> bool {
        match self {
            EarlyWeights::Off => false,
            EarlyWeights::OneRow => rows == 1,
            EarlyWeights::OneAndTwoRows => true,
        }
    }
}

impl DecodeFusion {
    /// `off`, `on`, or a comma-separated list of `rope`, `final-norm`, `early-weights`,
    /// `qkv-rope`.
    pub fn parse(v: &str) -> Result<Self, EngineError> {
        match v {
            "off" => {
                return Ok(DecodeFusion {
                    early_weights: EarlyWeights::Off,
                    ..DecodeFusion::default()
                })
            }
            "on" => {
                return Ok(DecodeFusion {
                    rope: true,
                    final_norm: true,
                    early_weights: EarlyWeights::OneAndTwoRows,
                    qkv_rope: true,
                })
            }
            _ => {}
        }
        let mut f = DecodeFusion::default();
        for part in v.split(',').map(str::trim) {
            match part {
                "rope" => f.rope = true,
                "final-norm" => f.final_norm = true,
                "early-weights" => f.early_weights = EarlyWeights::OneAndTwoRows,
                "qkv-rope" => f.qkv_rope = true,
                other => {
                    return Err(EngineError::InvalidInput(format!(
                        "{DECODE_FUSION_ENV} must be `off`, `on` or a comma-separated list of \
                         `rope`, `final-norm`, `early-weights`, `qkv-rope`, not `{other}` (in \
                         `{v}`)"
                    )))
                }
            }
        }
        Ok(f)
    }
}

pub(super) fn decode_fusion_from_env() -> Result<DecodeFusion, EngineError> {
    match std::env::var(DECODE_FUSION_ENV) {
        Err(std::env::VarError::NotPresent) => Ok(DecodeFusion::default()),
        Ok(v) => DecodeFusion::parse(&v),
        Err(e) => Err(EngineError::InvalidInput(format!(
            "{DECODE_FUSION_ENV}: {e}"
        ))),
    }
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
    use super::{choice, parse_splits, DecodeFusion, EarlyWeights};

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
    fn decode_fusion_takes_off_on_or_a_list_and_names_a_bad_part() {
        let off = DecodeFusion::parse("off").unwrap();
        assert!(!off.rope && !off.final_norm && !off.qkv_rope);
        assert_eq!(off.early_weights, EarlyWeights::Off);
        // Unset: the one-row early weights only.
        let default = DecodeFusion::default();
        assert!(!default.rope && !default.final_norm && !default.qkv_rope);
        assert_eq!(default.early_weights, EarlyWeights::OneRow);
        let all = DecodeFusion::parse("on").unwrap();
        assert!(all.rope && all.final_norm && all.qkv_rope);
        assert_eq!(all.early_weights, EarlyWeights::OneAndTwoRows);
        let q = DecodeFusion::parse("qkv-rope").unwrap();
        assert!(q.qkv_rope && !q.rope && !q.final_norm);
        assert_eq!(q.early_weights, EarlyWeights::OneRow);
        let two = DecodeFusion::parse("rope, early-weights").unwrap();
        assert!(two.rope && !two.final_norm);
        assert_eq!(two.early_weights, EarlyWeights::OneAndTwoRows);
        let e = DecodeFusion::parse("rope,fast").unwrap_err().to_string();
        assert!(e.contains("not `fast`") && e.contains("final-norm"), "{e}");
        assert!(DecodeFusion::parse("").is_err());
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
