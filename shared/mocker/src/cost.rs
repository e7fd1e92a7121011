//! How long a simulated step takes, as a function of the batch's composition.
//!
//! A step's batch splits into prefill pieces (a chunk of more than one new token, or the
//! first token of a sequence) and decode pieces (one new token after cached context). Its
//! time is the sum of the two phases, each present only when the batch has pieces of it:
//!
//! `step_ms = [T > 0] * prefill_ms(T) / speedup + [D > 0] * decode_ms(u) / (speedup * decode_speedup)`
//!
//! with T = new tokens summed over the prefill pieces and u = KV tokens the batch occupies
//! (context + new tokens of every piece) over the pool's token capacity. Summing rather than
//! taking the maximum models one fused forward whose prefill part is compute-bound and whose
//! decode part is bandwidth-bound, as in Dynamo's mocker.

use std::path::Path;

use serde::Deserialize;

/// What the cost model sees of one step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepShape {
    /// New tokens summed over the prefill pieces.
    pub prefill_tokens: usize,
    /// Number of decode pieces.
    pub decode_seqs: usize,
    /// KV tokens held by the batch's sequences after this step.
    pub active_kv_tokens: usize,
    /// Token capacity of the pool (blocks × block size).
    pub total_kv_tokens: usize,
}

impl StepShape {
    /// KV occupancy in [0, 1].
    pub fn kv_usage(&self) -> f64 {
        if self.total_kv_tokens == 0 {
            return 0.0;
        }
        (self.active_kv_tokens as f64 / self.total_kv_tokens as f64).min(1.0)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CostError {
    #[error("cannot read the profile {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("profile {path} is not valid JSON of the expected shape: {source}")]
    Json {
        path: String,
        source: serde_json::Error,
    },
    #[error("profile {path}: {msg}")]
    Invalid { path: String, msg: String },
    #[error("{0} must be a positive finite number")]
    Ratio(&'static str),
}

/// A measured profile: prefill time by batched new tokens, decode time by KV occupancy.
/// File format (JSON): `{"prefill": [[tokens, ms], ...], "decode": [[kv_usage, ms], ...]}`,
/// points in any order; lookups interpolate linearly and clamp at the ends.
#[derive(Clone, Debug, Deserialize)]
pub struct Profile {
    pub prefill: Vec<(f64, f64)>,
    pub decode: Vec<(f64, f64)>,
}

impl Profile {
    pub fn load(path: &Path) -> Result<Self, CostError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| CostError::Io {
            path: p.clone(),
            source,
        })?;
        let mut prof: Profile = serde_json::from_str(&text).map_err(|source| CostError::Json {
            path: p.clone(),
            source,
        })?;
        for (name, pts) in [("prefill", &mut prof.prefill), ("decode", &mut prof.decode)] {
            if pts.is_empty() {
                return Err(CostError::Invalid {
                    path: p.clone(),
                    msg: format!("`{name}` has no points"),
                });
            }
            if pts
                .iter()
                .any(|(x, y)| !x.is_finite() || !y.is_finite() || *y < 0.0)
            {
                return Err(CostError::Invalid {
                    path: p.clone(),
                    msg: format!("`{name}` has a non-finite or negative value"),
                });
            }
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        Ok(prof)
    }
}

/// Piecewise-linear lookup over points sorted by x, clamped at both ends.
fn interpolate(points: &[(f64, f64)], x: f64) -> f64 {
    let Some(first) = points.first() else {
        return 0.0;
    };
    if x <= first.0 {
        return first.1;
    }
    for w in points.windows(2) {
        let ((x0, y0), (x1, y1)) = (w[0], w[1]);
        if x <= x1 {
            if x1 == x0 {
                return y1;
            }
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0);
        }
    }
    points.last().map(|p| p.1).unwrap_or(0.0)
}

#[derive(Clone, Debug)]
pub enum Timing {
    /// Dynamo's default fit.
    Polynomial,
    Profile(Profile),
}

#[derive(Clone, Debug)]
pub struct CostModel {
    pub timing: Timing,
    pub speedup_ratio: f64,
    pub decode_speedup_ratio: f64,
    /// Decode role of a disaggregated replay: prompt KV arrives by (separately timed)
    /// transfer, so prefill pieces cost nothing here.
    pub prefill_free: bool,
}

impl CostModel {
    pub fn new(timing: Timing, speedup: f64, decode_speedup: f64) -> Result<Self, CostError> {
        if !(speedup.is_finite() && speedup > 0.0) {
            return Err(CostError::Ratio("--speedup-ratio"));
        }
        if !(decode_speedup.is_finite() && decode_speedup > 0.0) {
            return Err(CostError::Ratio("--decode-speedup-ratio"));
        }
        Ok(CostModel {
            timing,
            speedup_ratio: speedup,
            decode_speedup_ratio: decode_speedup,
            prefill_free: false,
        })
    }

    /// Prefill time of `tokens` batched new tokens, before speed-up.
    pub fn prefill_ms(&self, tokens: usize) -> f64 {
        let t = tokens as f64;
        match &self.timing {
            Timing::Polynomial => 4.209989e-07 * t * t + 1.518344e-02 * t + 16.50142,
            Timing::Profile(p) => interpolate(&p.prefill, t),
        }
    }

    /// Decode time at KV occupancy `u`, before speed-up; at least 1 ms as in Dynamo.
    pub fn decode_ms(&self, u: f64) -> f64 {
        match &self.timing {
            Timing::Polynomial => (-25.74 * u * u + 54.01 * u + 5.74).max(1.0),
            Timing::Profile(p) => interpolate(&p.decode, u),
        }
    }

    /// Simulated time of one step, in milliseconds (see the module docs).
    pub fn step_ms(&self, s: &StepShape) -> f64 {
        let mut ms = 0.0;
        if s.prefill_tokens > 0 && !self.prefill_free {
            ms += self.prefill_ms(s.prefill_tokens) / self.speedup_ratio;
        }
        if s.decode_seqs > 0 {
            ms += self.decode_ms(s.kv_usage()) / (self.speedup_ratio * self.decode_speedup_ratio);
        }
        ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn poly(speed: f64) -> CostModel {
        CostModel::new(Timing::Polynomial, speed, 1.0).unwrap()
    }

    #[test]
    fn polynomial_matches_dynamo_fit() {
        let m = poly(1.0);
        assert!((m.prefill_ms(1000) - (0.4209989 + 15.18344 + 16.50142)).abs() < 1e-9);
        assert!((m.decode_ms(0.0) - 5.74).abs() < 1e-12);
        // The fit dips below 1 ms past u≈2.2; never below the floor.
        assert_eq!(m.decode_ms(3.0), 1.0);
    }

    #[test]
    fn mixed_step_is_sum_of_phases_over_speedup() {
        let m = poly(2.0);
        let s = StepShape {
            prefill_tokens: 512,
            decode_seqs: 3,
            active_kv_tokens: 500,
            total_kv_tokens: 1000,
        };
        let want = (m.prefill_ms(512) + m.decode_ms(0.5)) / 2.0;
        assert!((m.step_ms(&s) - want).abs() < 1e-12);
        let only_decode = StepShape {
            prefill_tokens: 0,
            ..s
        };
        assert!((m.step_ms(&only_decode) - m.decode_ms(0.5) / 2.0).abs() < 1e-12);
        assert_eq!(m.step_ms(&StepShape::default()), 0.0);
    }

    #[test]
    fn profile_interpolates_and_clamps() {
        let pts = vec![(0.0, 10.0), (100.0, 20.0), (200.0, 40.0)];
        assert_eq!(interpolate(&pts, -5.0), 10.0);
        assert_eq!(interpolate(&pts, 50.0), 15.0);
        assert_eq!(interpolate(&pts, 150.0), 30.0);
        assert_eq!(interpolate(&pts, 1e9), 40.0);
    }

    #[test]
    fn bad_profile_and_ratios_are_refused() {
        let dir = std::env::temp_dir().join(format!("mocker-prof-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("p.json");
        std::fs::write(&f, r#"{"prefill": [], "decode": [[0.5, 3]]}"#).unwrap();
        assert!(matches!(Profile::load(&f), Err(CostError::Invalid { .. })));
        std::fs::write(
            &f,
            r#"{"prefill": [[200, 9], [100, 5]], "decode": [[0.5, 3]]}"#,
        )
        .unwrap();
        let p = Profile::load(&f).unwrap();
        assert_eq!(p.prefill[0].0, 100.0);
        assert!(CostModel::new(Timing::Polynomial, 0.0, 1.0).is_err());
        assert!(CostModel::new(Timing::Polynomial, 1.0, f64::NAN).is_err());
        let _ = std::fs::remove_dir_all(dir);
    }
}
