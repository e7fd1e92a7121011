//! The planner's decision maths, without I/O: load predictors ([`predict`]), time models
//! interpolated from profiling data ([`perf`]), the sizing of each role from a predicted
//! demand ([`sizing`]), as Dynamo's SLA planner does it (`dynamo-notes.md` §6.2), and the
//! reactive one-step-per-interval scaling on the engines' load ([`load`], §6.3). What reads
//! the metrics, runs the interval loop and scales the deployments (the actuators) builds on
//! these; it is not written yet.

pub mod load;
pub mod perf;
pub mod predict;
pub mod sizing;

/// Bad planner input: each variant names what was wrong.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error("{what}: a time model needs at least one point")]
    EmptyCurve { what: &'static str },
    #[error("{what}: points must have strictly increasing x and finite, non-negative values (point {index})")]
    BadPoint { what: &'static str, index: usize },
    #[error("decode model: {rows} context rows of step times for {contexts} contexts, or a row not {batches} long")]
    DecodeGrid {
        rows: usize,
        contexts: usize,
        batches: usize,
    },
    #[error("{what} = {value} is out of range ({range})")]
    OutOfRange {
        what: &'static str,
        value: f64,
        range: &'static str,
    },
    #[error("predictor {0:?}: expected constant, moving-average:N (N ≥ 1) or kalman")]
    UnknownPredictor(String),
}
