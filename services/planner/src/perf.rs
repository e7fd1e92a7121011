//! Time models interpolated from profiling points: a prefill's time by its tokens
//! ([`PrefillModel`], chunked by the engine's `max_num_batched_tokens`), and a decode step's
//! time by batch size and context ([`DecodeModel`]). Between points they interpolate linearly;
//! past the last point they extend the last segment (a model measured up to 8k tokens still
//! answers for 9k, growing as it did last).

use crate::PlanError;

/// A piecewise-linear function through points of strictly increasing x.
#[derive(Clone, Debug, PartialEq)]
pub struct Curve {
    points: Vec<(f64, f64)>,
}

impl Curve {
    /// `what` names the model in errors.
    pub fn new(what: &'static str, points: Vec<(f64, f64)>) -> Result<Self, PlanError> {
        if points.is_empty() {
            return Err(PlanError::EmptyCurve { what });
        }
        for (i, &(x, y)) in points.iter().enumerate() {
            let increasing = i == 0 || x > points[i - 1].0;
            if !(x.is_finite() && y.is_finite() && x >= 0.0 && y >= 0.0 && increasing) {
                return Err(PlanError::BadPoint { what, index: i });
            }
        }
        Ok(Curve { points })
    }

    /// The value at `x` (never negative).
    pub fn at(&self, x: f64) -> f64 {
        let p = &self.points;
        if p.len() == 1 {
            return p[0].1;
        }
        // The segment holding x, or the first / last one outside the points.
        let i = p
            .windows(2)
            .position(|w| x <= w[1].0)
            .unwrap_or(p.len() - 2);
        let ((x0, y0), (x1, y1)) = (p[i], p[i + 1]);
        (y0 + (y1 - y0) * (x - x0) / (x1 - x0)).max(0.0)
    }
}

/// A prefill's wall time by its tokens, run as chunks of at most `chunk` tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefillModel {
    ms_by_tokens: Curve,
    chunk: f64,
}

impl PrefillModel {
    /// `points`: (prefill tokens, ms) from profiling; `chunk`: `max_num_batched_tokens`.
    pub fn new(points: Vec<(f64, f64)>, chunk: usize) -> Result<Self, PlanError> {
        if chunk == 0 {
            return Err(PlanError::OutOfRange {
                what: "max_num_batched_tokens",
                value: 0.0,
                range: "at least 1",
            });
        }
        Ok(PrefillModel {
            ms_by_tokens: Curve::new("prefill model", points)?,
            chunk: chunk as f64,
        })
    }

    /// Milliseconds to prefill `tokens` new tokens: whole chunks, then the rest.
    pub fn time_ms(&self, tokens: f64) -> f64 {
        if tokens <= 0.0 {
            return 0.0;
        }
        let full = (tokens / self.chunk).floor();
        let rest = tokens - full * self.chunk;
        let rest_ms = if rest > 0.0 {
            self.ms_by_tokens.at(rest)
        } else {
            0.0
        };
        full * self.ms_by_tokens.at(self.chunk) + rest_ms
    }
}

/// A decode step's wall time by batch size, one curve per profiled context length.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeModel {
    contexts: Curve,
    rows: Vec<Curve>,
}

impl DecodeModel {
    /// `ms[c][b]`: the step time at `contexts[c]` tokens of context and `batches[b]` sequences.
    pub fn new(contexts: &[f64], batches: &[f64], ms: &[Vec<f64>]) -> Result<Self, PlanError> {
        if ms.len() != contexts.len() || ms.iter().any(|r| r.len() != batches.len()) {
            return Err(PlanError::DecodeGrid {
                rows: ms.len(),
                contexts: contexts.len(),
                batches: batches.len(),
            });
        }
        // The contexts' curve maps a context to its row index (checked increasing).
        let index: Vec<(f64, f64)> = contexts
            .iter()
            .enumerate()
            .map(|(i, c)| (*c, i as f64))
            .collect();
        let rows = ms
            .iter()
            .map(|r| {
                let points = batches.iter().copied().zip(r.iter().copied()).collect();
                Curve::new("decode model", points)
            })
            .collect::<Result<_, _>>()?;
        Ok(DecodeModel {
            contexts: Curve::new("decode model contexts", index)?,
            rows,
        })
    }

    /// Milliseconds of one step of `batch` sequences at `context` tokens each: linear in the
    /// batch along the two profiled contexts around `context`, then linear between them.
    pub fn step_ms(&self, batch: f64, context: f64) -> f64 {
        if self.rows.len() == 1 {
            return self.rows[0].at(batch);
        }
        let pos = self.contexts.at(context);
        let i = (pos.floor() as usize).min(self.rows.len() - 2);
        let f = pos - i as f64;
        let (a, b) = (self.rows[i].at(batch), self.rows[i + 1].at(batch));
        (a + (b - a) * f).max(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn curves_interpolate_and_extend_their_ends() {
        let c = Curve::new("t", vec![(0.0, 10.0), (100.0, 20.0), (200.0, 40.0)]).unwrap();
        assert_eq!(c.at(50.0), 15.0);
        assert_eq!(c.at(150.0), 30.0);
        assert_eq!(c.at(300.0), 60.0, "the last segment extended");
        assert_eq!(Curve::new("t", vec![(5.0, 7.0)]).unwrap().at(99.0), 7.0);
        assert_eq!(
            Curve::new("t", vec![]),
            Err(PlanError::EmptyCurve { what: "t" })
        );
        assert_eq!(
            Curve::new("t", vec![(1.0, 1.0), (1.0, 2.0)]),
            Err(PlanError::BadPoint {
                what: "t",
                index: 1
            })
        );
        assert!(Curve::new("t", vec![(0.0, f64::NAN)]).is_err());
    }

    #[test]
    fn prefill_runs_in_chunks() {
        // 2 ms + 0.01 ms a token: a 2,048-token chunk is 22.48 ms.
        let m = PrefillModel::new(vec![(0.0, 2.0), (4096.0, 42.96)], 2048).unwrap();
        assert!((m.time_ms(1000.0) - 12.0).abs() < 1e-9);
        // 5,000 tokens: two full chunks and 904 tokens.
        let want = 2.0 * 22.48 + (2.0 + 9.04);
        assert!((m.time_ms(5000.0) - want).abs() < 1e-9);
        assert_eq!(m.time_ms(0.0), 0.0);
        assert!(PrefillModel::new(vec![(0.0, 1.0)], 0).is_err());
    }

    #[test]
    fn decode_steps_interpolate_in_batch_and_context() {
        let m = DecodeModel::new(
            &[1000.0, 3000.0],
            &[1.0, 64.0],
            &[vec![10.0, 20.0], vec![12.0, 40.0]],
        )
        .unwrap();
        assert_eq!(m.step_ms(1.0, 1000.0), 10.0);
        assert_eq!(m.step_ms(64.0, 3000.0), 40.0);
        // Batch 32.5 is halfway: 15 at 1k, 26 at 3k; context 2k is halfway between: 20.5.
        assert!((m.step_ms(32.5, 2000.0) - 20.5).abs() < 1e-9);
        assert!(matches!(
            DecodeModel::new(&[1.0], &[1.0, 2.0], &[vec![1.0]]),
            Err(PlanError::DecodeGrid { .. })
        ));
    }
}
