//! Every flag and environment variable of every Tandem role, in one table
//! ([`flags::FLAGS`]), resolved as CLI over env over default, validated before any work starts,
//! and turned into typed configs ([`WorkerConfig`], [`RouterConfig`]) plus the merged
//! [`EngineOptions`] the engine honours. `docs/config.md` is generated from the same table.

pub mod cli;
pub mod docs;
pub mod endpoint;
pub mod engine_options;
pub mod entry;
pub mod error;
pub mod flags;
pub mod merge;
pub mod options_build;
pub mod parse;
pub mod paths;
pub mod planner;
pub mod pyliteral;
pub mod resolve;
pub mod runtime;
pub mod spec;
pub mod validate;
pub mod values;
pub mod worker;

pub use engine_options::EngineOptions;
pub use error::ConfigError;
pub use parse::{
    parse_router, parse_worker, router_command, worker_command, AdminListener, AdmissionConfig,
    ApiKeys, HttpServerConfig, MediaLimits, MigrationConfig, RouterConfig, RoutingConfig,
    SecurityConfig, TlsFiles,
};
pub use planner::{parse_planner, planner_command, PlannerConfig};
pub use resolve::process_env;
pub use runtime::RuntimeConfig;
pub use worker::{DisaggregationMode, Role, WorkerConfig};
