//! The planner: the decision maths without I/O — load predictors ([`predict`]), time models
//! interpolated from profiling data ([`perf`], read from a [`profile`] file), the sizing of
//! each role from a predicted demand ([`sizing`]), as Dynamo's SLA planner does it
//! (`dynamo-notes.md` §6.2), the reactive one-step-per-interval scaling on the engines' load
//! ([`load`], §6.3), and the two combined interval by interval ([`plan`]) — and its edges:
//! reading the router's and workers' metrics ([`observe`], [`prom`]) and applying decisions
//! ([`actuate`]); and the profiler that measures a worker for the time models ([`sweep`]).
//! The `tandem-planner` binary runs the loop, and `tandem-planner profile` the profiler.

pub mod actuate;
pub mod load;
pub mod observe;
pub mod perf;
pub mod plan;
pub mod predict;
pub mod profile;
pub mod prom;
pub mod sizing;
pub mod sweep;

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
