//! `tandem-loadtest`: drives an OpenAI-compatible endpoint with streaming requests and
//! reports TTFT / ITL / E2E, throughput and goodput, as JSON, CSV and SVG plots.

pub mod client;
pub mod plot;
pub mod report;
pub mod rng;
pub mod runner;
pub mod stats;
pub mod workload;
