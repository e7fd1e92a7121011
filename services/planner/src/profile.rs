//! The profile file: the time models of throughput scaling, in the format `tandem-mocker
//! --planner-profile-data` reads too, so a simulation runs on the same numbers the planner
//! plans with.
//!
//! ```json
//! {"prefill": [[tokens, ms], ...],
//!  "decode": [[kv_usage, ms], ...],
//!  "decode_grid": {"contexts": [...], "batches": [...], "ms": [[...], ...]},
//!  "kv_capacity_tokens": 262144, "max_num_batched_tokens": 8192, "max_num_seqs": 256}
//! ```
//!
//! `prefill` and `decode` are the mocker's curves (a step's prefill time by its new tokens,
//! its decode time by the share of the KV pool the batch holds). `decode_grid`, when present,
//! gives measured step times by batch size and context; without it the planner derives them
//! from `decode`: a batch of B sequences at context C holds B·C of `kv_capacity_tokens`.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::perf::{Curve, DecodeModel, PrefillModel};
use crate::PlanError;

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("cannot read the profile {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the profile {path} is not valid: {source}")]
    Json {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("the profile {path}: {source}")]
    Model {
        path: String,
        #[source]
        source: PlanError,
    },
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct DecodeGrid {
    pub contexts: Vec<f64>,
    pub batches: Vec<f64>,
    pub ms: Vec<Vec<f64>>,
}

/// The file's contents.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct ProfileData {
    pub prefill: Vec<(f64, f64)>,
    pub decode: Vec<(f64, f64)>,
    #[serde(default)]
    pub decode_grid: Option<DecodeGrid>,
    pub kv_capacity_tokens: f64,
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
}

/// The models a profile yields.
#[derive(Clone, Debug)]
pub struct TimeModels {
    pub prefill: PrefillModel,
    pub decode: DecodeModel,
    /// Largest batch a decode engine runs.
    pub max_batch: usize,
}

/// Batch sizes and contexts of a derived decode grid.
const DERIVED_BATCHES: [f64; 10] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];
const DERIVED_CONTEXTS: [f64; 8] = [
    128.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0,
];

impl ProfileData {
    pub fn load(path: &Path) -> Result<ProfileData, ProfileError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ProfileError::Io {
            path: p.clone(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|source| ProfileError::Json { path: p, source })
    }

    /// The time models, checked.
    pub fn models(&self) -> Result<TimeModels, PlanError> {
        if !(self.kv_capacity_tokens.is_finite() && self.kv_capacity_tokens > 0.0) {
            return Err(PlanError::OutOfRange {
                what: "kv_capacity_tokens",
                value: self.kv_capacity_tokens,
                range: "finite, > 0",
            });
        }
        if self.max_num_seqs == 0 {
            return Err(PlanError::OutOfRange {
                what: "max_num_seqs",
                value: 0.0,
                range: "at least 1",
            });
        }
        let prefill = PrefillModel::new(sorted(&self.prefill), self.max_num_batched_tokens)?;
        let decode = match &self.decode_grid {
            Some(g) => DecodeModel::new(&g.contexts, &g.batches, &g.ms)?,
            None => self.derived_decode()?,
        };
        Ok(TimeModels {
            prefill,
            decode,
            max_batch: self.max_num_seqs,
        })
    }

    /// Step times by batch and context from the KV-usage curve.
    fn derived_decode(&self) -> Result<DecodeModel, PlanError> {
        let by_usage = Curve::new("decode model", sorted(&self.decode))?;
        let ms: Vec<Vec<f64>> = DERIVED_CONTEXTS
            .iter()
            .map(|c| {
                DERIVED_BATCHES
                    .iter()
                    .map(|b| by_usage.at((b * c / self.kv_capacity_tokens).min(1.0)))
                    .collect()
            })
            .collect();
        DecodeModel::new(&DERIVED_CONTEXTS, &DERIVED_BATCHES, &ms)
    }
}

/// Points sorted by x, equal x averaged (files may list them in any order, as the mocker
/// accepts).
fn sorted(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    crate::sweep::merge_equal_x(points.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data() -> ProfileData {
        serde_json::from_str(
            r#"{"prefill": [[4096, 400], [1, 10]],
                "decode": [[0.0, 10], [1.0, 30]],
                "kv_capacity_tokens": 65536, "max_num_batched_tokens": 2048,
                "max_num_seqs": 64}"#,
        )
        .unwrap()
    }

    #[test]
    fn decode_steps_follow_the_kv_usage_curve() {
        let m = data().models().unwrap();
        // 16 sequences × 2048 tokens hold half the 65,536-token pool: 10 + 20 × 0.5 ms.
        assert!((m.decode.step_ms(16.0, 2048.0) - 20.0).abs() < 1e-9);
        // 2,048-token chunks: 4,096 tokens are two chunks of 2,048.
        let chunk = 10.0 + (400.0 - 10.0) * (2047.0 / 4095.0);
        assert!((m.prefill.time_ms(4096.0) - 2.0 * chunk).abs() < 1e-6);
        assert_eq!(m.max_batch, 64);
    }

    #[test]
    fn bad_profiles_are_named() {
        let mut d = data();
        d.kv_capacity_tokens = 0.0;
        assert!(d.models().is_err());
        let mut d = data();
        d.prefill.clear();
        assert!(d.models().is_err());
        let mut d = data();
        d.decode_grid = Some(DecodeGrid {
            contexts: vec![1.0],
            batches: vec![1.0, 2.0],
            ms: vec![vec![1.0]],
        });
        assert!(matches!(d.models(), Err(PlanError::DecodeGrid { .. })));
    }
}
