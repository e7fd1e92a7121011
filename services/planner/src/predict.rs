//! Next-interval predictors of a load series (request rate, ISL, OSL, KV hit rate): the last
//! value ([`Constant`]), the mean of a window ([`MovingAverage`]), and a local linear trend
//! Kalman filter ([`Kalman`]) that follows ramps. Each takes one observation per adjustment
//! interval and forecasts the next.

use std::collections::VecDeque;
use std::str::FromStr;

use crate::PlanError;

/// A forecaster of the next value of a series.
pub trait Predictor: Send {
    /// Takes the value observed over the interval that just ended.
    fn observe(&mut self, value: f64);
    /// The forecast for the next interval; `None` before any observation.
    fn predict(&self) -> Option<f64>;
}

/// The last value seen.
#[derive(Debug, Default)]
pub struct Constant {
    last: Option<f64>,
}

impl Predictor for Constant {
    fn observe(&mut self, value: f64) {
        self.last = Some(value);
    }
    fn predict(&self) -> Option<f64> {
        self.last
    }
}

/// The mean of the last `window` values.
#[derive(Debug)]
pub struct MovingAverage {
    window: usize,
    values: VecDeque<f64>,
}

impl MovingAverage {
    pub fn new(window: usize) -> Self {
        MovingAverage {
            window: window.max(1),
            values: VecDeque::new(),
        }
    }
}

impl Predictor for MovingAverage {
    fn observe(&mut self, value: f64) {
        if self.values.len() == self.window {
            self.values.pop_front();
        }
        self.values.push_back(value);
    }
    fn predict(&self) -> Option<f64> {
        (!self.values.is_empty())
            .then(|| self.values.iter().sum::<f64>() / self.values.len() as f64)
    }
}

/// The Kalman filter's noise settings (Dynamo's defaults: 1.0, 0.1, 10.0, 5 points).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KalmanParams {
    /// Process noise of the level.
    pub q_level: f64,
    /// Process noise of the trend.
    pub q_trend: f64,
    /// Measurement noise.
    pub r: f64,
    /// Observations before the filter's forecast is used (the last value until then).
    pub min_points: usize,
}

impl Default for KalmanParams {
    fn default() -> Self {
        KalmanParams {
            q_level: 1.0,
            q_trend: 0.1,
            r: 10.0,
            min_points: 5,
        }
    }
}

/// A local linear trend model: state `[level, trend]`, each step `level += trend`, observed
/// with noise; the forecast is `level + trend`.
#[derive(Debug)]
pub struct Kalman {
    params: KalmanParams,
    /// `[level, trend]` after the last update.
    x: [f64; 2],
    /// The state's covariance.
    p: [[f64; 2]; 2],
    seen: usize,
    last: Option<f64>,
}

impl Kalman {
    pub fn new(params: KalmanParams) -> Self {
        Kalman {
            params,
            x: [0.0; 2],
            p: [[0.0; 2]; 2],
            seen: 0,
            last: None,
        }
    }
}

impl Predictor for Kalman {
    fn observe(&mut self, z: f64) {
        let KalmanParams {
            q_level,
            q_trend,
            r,
            ..
        } = self.params;
        self.seen += 1;
        self.last = Some(z);
        if self.seen == 1 {
            // Start at the observation, no trend, as uncertain as a measurement.
            self.x = [z, 0.0];
            self.p = [[r, 0.0], [0.0, r]];
            return;
        }
        // Predict: x = F x, P = F P Fᵀ + Q with F = [[1, 1], [0, 1]].
        let [l, t] = self.x;
        let x = [l + t, t];
        let p = self.p;
        let p00 = p[0][0] + p[0][1] + p[1][0] + p[1][1] + q_level;
        let p01 = p[0][1] + p[1][1];
        let p10 = p[1][0] + p[1][1];
        let p11 = p[1][1] + q_trend;
        // Update with H = [1, 0].
        let s = p00 + r;
        let (k0, k1) = (p00 / s, p10 / s);
        let y = z - x[0];
        self.x = [x[0] + k0 * y, x[1] + k1 * y];
        self.p = [
            [(1.0 - k0) * p00, (1.0 - k0) * p01],
            [p10 - k1 * p00, p11 - k1 * p01],
        ];
    }

    fn predict(&self) -> Option<f64> {
        if self.seen < self.params.min_points.max(2) {
            return self.last;
        }
        Some(self.x[0] + self.x[1])
    }
}

/// A predictor whose forecasts stay within the range of the values it has seen: for series
/// with natural bounds (ISL, OSL, the KV hit rate) a trend extrapolated past anything observed
/// is noise, not a forecast (a Kalman filter that saw the ISL fall from 1,024 to 128 in a few
/// intervals predicts 0 next).
pub struct WithinObserved {
    inner: Box<dyn Predictor>,
    /// `(smallest, largest)` value seen.
    range: Option<(f64, f64)>,
}

impl WithinObserved {
    pub fn new(inner: Box<dyn Predictor>) -> Self {
        WithinObserved { inner, range: None }
    }
}

impl Predictor for WithinObserved {
    fn observe(&mut self, value: f64) {
        let (lo, hi) = self.range.unwrap_or((value, value));
        self.range = Some((lo.min(value), hi.max(value)));
        self.inner.observe(value);
    }
    fn predict(&self) -> Option<f64> {
        let (lo, hi) = self.range?;
        self.inner.predict().map(|v| v.clamp(lo, hi))
    }
}

/// Which predictor a series uses (a flag's value: `constant`, `moving-average:N`, `kalman`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PredictorKind {
    Constant,
    MovingAverage(usize),
    Kalman(KalmanParams),
}

impl PredictorKind {
    /// A fresh predictor of this kind.
    pub fn build(self) -> Box<dyn Predictor> {
        match self {
            PredictorKind::Constant => Box::new(Constant::default()),
            PredictorKind::MovingAverage(w) => Box::new(MovingAverage::new(w)),
            PredictorKind::Kalman(p) => Box::new(Kalman::new(p)),
        }
    }
}

impl FromStr for PredictorKind {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<Self, PlanError> {
        let bad = || PlanError::UnknownPredictor(s.to_string());
        match s {
            "constant" => Ok(PredictorKind::Constant),
            "kalman" => Ok(PredictorKind::Kalman(KalmanParams::default())),
            _ => {
                let window = s.strip_prefix("moving-average:").ok_or_else(bad)?;
                match window.parse::<usize>() {
                    Ok(w) if w >= 1 => Ok(PredictorKind::MovingAverage(w)),
                    _ => Err(bad()),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(p: &mut dyn Predictor, values: &[f64]) {
        values.iter().for_each(|v| p.observe(*v));
    }

    #[test]
    fn constant_and_moving_average_by_hand() {
        let mut c = Constant::default();
        assert_eq!(c.predict(), None);
        feed(&mut c, &[3.0, 7.0]);
        assert_eq!(c.predict(), Some(7.0));
        let mut m = MovingAverage::new(3);
        assert_eq!(m.predict(), None);
        feed(&mut m, &[1.0, 2.0]);
        assert_eq!(m.predict(), Some(1.5));
        // The window drops the oldest: (2 + 3 + 10) / 3.
        feed(&mut m, &[3.0, 10.0]);
        assert_eq!(m.predict(), Some(5.0));
    }

    #[test]
    fn kalman_first_step_by_hand() {
        // r = 10, q = (1, 0.1). After 4, P = diag(10, 10). Observing 6: predicted level 4,
        // P00 = 10 + 10 + 1 = 21, P10 = 10, S = 31, K = (21/31, 10/31), innovation 2:
        // level = 4 + 42/31, trend = 20/31; forecast = level + trend = 4 + 62/31 = 6.
        let mut k = Kalman::new(KalmanParams {
            min_points: 2,
            ..KalmanParams::default()
        });
        feed(&mut k, &[4.0]);
        assert_eq!(k.predict(), Some(4.0), "the last value before min_points");
        feed(&mut k, &[6.0]);
        assert!(
            (k.predict().unwrap() - 6.0).abs() < 1e-12,
            "{:?}",
            k.predict()
        );
    }

    #[test]
    fn kalman_follows_a_ramp_and_holds_a_level() {
        let mut k = Kalman::new(KalmanParams::default());
        let ramp: Vec<f64> = (1..=30).map(|i| 10.0 * i as f64).collect();
        feed(&mut k, &ramp);
        let next = k.predict().unwrap();
        assert!((next - 310.0).abs() < 2.0, "ramp forecast {next}");
        // A moving average lags a ramp by half its window.
        let mut m = MovingAverage::new(10);
        feed(&mut m, &ramp);
        assert_eq!(m.predict(), Some(255.0));
        let mut flat = Kalman::new(KalmanParams::default());
        feed(&mut flat, &[50.0; 20]);
        assert!((flat.predict().unwrap() - 50.0).abs() < 1e-9);
    }

    #[test]
    fn a_bounded_series_stays_within_what_was_seen() {
        // The ISL of the planner benchmark: 1,024 for a while, then 128.
        let series = [1024.0, 1024.0, 1024.0, 1024.0, 1024.0, 128.0, 128.0, 128.0];
        let mut raw = Kalman::new(KalmanParams::default());
        feed(&mut raw, &series);
        let extrapolated = raw.predict().unwrap();
        assert!(
            extrapolated < 128.0,
            "the raw filter overshoots: {extrapolated}"
        );
        let mut k = WithinObserved::new(PredictorKind::Kalman(KalmanParams::default()).build());
        assert_eq!(k.predict(), None);
        feed(&mut k, &series);
        assert_eq!(k.predict(), Some(128.0));
        // A rise is capped at the largest value seen.
        let mut up = WithinObserved::new(Box::new(Kalman::new(KalmanParams::default())));
        feed(
            &mut up,
            &[10.0, 10.0, 10.0, 10.0, 10.0, 200.0, 200.0, 200.0],
        );
        assert_eq!(up.predict(), Some(200.0));
    }

    #[test]
    fn kinds_parse_from_flag_values() {
        assert_eq!("constant".parse(), Ok(PredictorKind::Constant));
        assert_eq!(
            "moving-average:8".parse(),
            Ok(PredictorKind::MovingAverage(8))
        );
        assert!(matches!("kalman".parse(), Ok(PredictorKind::Kalman(_))));
        for bad in ["arima", "moving-average:0", "moving-average:x", ""] {
            assert_eq!(
                bad.parse::<PredictorKind>(),
                Err(PlanError::UnknownPredictor(bad.into()))
            );
        }
        let mut p = PredictorKind::MovingAverage(2).build();
        feed(p.as_mut(), &[1.0, 3.0]);
        assert_eq!(p.predict(), Some(2.0));
    }
}
