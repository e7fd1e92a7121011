//! The planner's configuration (`tandem-planner`): which roles it scales and how, where it
//! reads the system's load, and what applies its decisions.

use serde::Serialize;
use std::path::PathBuf;

use crate::error::ConfigError;
use crate::resolve::{resolve, EnvLookup, Resolved};
use crate::runtime::RuntimeConfig;
use crate::spec::Scope;
use crate::worker::Get;

/// The roles a planner scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PlannerMode {
    Disagg,
    Agg,
    Prefill,
    Decode,
}

/// What applies the planner's decisions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ActuatorKind {
    Virtual,
    Local,
    Docker,
    Slurm,
    Kubernetes,
}

/// Which thresholds load scaling uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizationTarget {
    Throughput,
    Latency,
}

/// What load scaling measures engines by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LoadSignal {
    Thresholds,
    Sla,
}

/// Bounds of every scaled role and of the deployment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PlannerBounds {
    pub min_endpoint: u32,
    pub max_endpoint: u32,
    pub max_gpu_budget: u32,
    pub prefill_engine_num_gpu: u32,
    pub decode_engine_num_gpu: u32,
}

/// The planner's configuration.
#[derive(Clone, Debug, Serialize)]
pub struct PlannerConfig {
    pub mode: PlannerMode,
    pub actuator: ActuatorKind,
    pub local_workers_spec: Option<PathBuf>,
    pub docker_host: String,
    pub compose_project: Option<String>,
    /// As given; `tandem-planner` parses it (role=service pairs).
    pub compose_services: String,
    pub kubernetes_namespace: Option<String>,
    /// As given; `tandem-planner` parses it (role=Deployment pairs).
    pub kubernetes_deployments: String,
    pub optimization_target: OptimizationTarget,
    pub enable_load_scaling: bool,
    pub load_signal: LoadSignal,
    pub scale_down_intervals: u32,
    pub enable_throughput_scaling: bool,
    pub profile_data: Option<PathBuf>,
    pub ttft_ms: f64,
    pub itl_ms: f64,
    /// As given; `tandem-planner` parses it (constant, moving-average:N, kalman).
    pub load_predictor: String,
    pub throughput_interval_secs: u32,
    pub load_interval_secs: u32,
    pub bounds: PlannerBounds,
    pub router_metrics_url: String,
    pub decisions_out: Option<PathBuf>,
    pub dry_run: bool,
    pub metrics_host: String,
    pub metrics_port: u16,
    pub runtime: RuntimeConfig,
    pub print_config: bool,
    #[serde(skip)]
    pub warnings: Vec<String>,
}

/// The clap command of `tandem-planner` (for `--help` and the docs generator).
pub fn planner_command() -> clap::Command {
    crate::cli::command(
        "tandem-planner",
        "Tandem planner: scales the prefill, decode and aggregated workers to the load and the \
         latency targets.",
        Scope::Planner,
    )
}

/// Parses and validates the planner's configuration. `args` starts with the program name.
pub fn parse_planner(args: &[String], env: EnvLookup<'_>) -> Result<PlannerConfig, ConfigError> {
    let resolved = resolve(planner_command(), Scope::Planner, args, env)?;
    let g = Get(&resolved);
    let cfg = PlannerConfig {
        mode: match g.string("planner-mode")?.as_str() {
            "agg" => PlannerMode::Agg,
            "prefill" => PlannerMode::Prefill,
            "decode" => PlannerMode::Decode,
            _ => PlannerMode::Disagg,
        },
        actuator: actuator(&resolved)?,
        local_workers_spec: g.opt_string("local-workers-spec")?.map(PathBuf::from),
        docker_host: g.string("docker-host")?,
        compose_project: g.opt_string("compose-project")?,
        compose_services: g.string("compose-services")?,
        kubernetes_namespace: g.opt_string("kubernetes-namespace")?,
        kubernetes_deployments: g.string("kubernetes-deployments")?,
        optimization_target: match g.string("optimization-target")?.as_str() {
            "latency" => OptimizationTarget::Latency,
            _ => OptimizationTarget::Throughput,
        },
        enable_load_scaling: g.bool("enable-load-scaling")?,
        load_signal: match g.string("load-signal")?.as_str() {
            "sla" => LoadSignal::Sla,
            _ => LoadSignal::Thresholds,
        },
        scale_down_intervals: g.u32("scale-down-intervals")?,
        enable_throughput_scaling: g.bool("enable-throughput-scaling")?,
        profile_data: g.opt_string("planner-profile-data")?.map(PathBuf::from),
        ttft_ms: positive(&resolved, "ttft")?,
        itl_ms: positive(&resolved, "itl")?,
        load_predictor: g.string("load-predictor")?,
        throughput_interval_secs: g.u32("throughput-adjustment-interval")?,
        load_interval_secs: g.u32("load-adjustment-interval")?,
        bounds: PlannerBounds {
            min_endpoint: g.u32("min-endpoint")?,
            max_endpoint: g.u32("max-endpoint")?,
            max_gpu_budget: g.u32("max-gpu-budget")?,
            prefill_engine_num_gpu: g.u32("prefill-engine-num-gpu")?,
            decode_engine_num_gpu: g.u32("decode-engine-num-gpu")?,
        },
        router_metrics_url: g.string("router-metrics-url")?,
        decisions_out: g.opt_string("decisions-out")?.map(PathBuf::from),
        dry_run: g.bool("dry-run")?,
        metrics_host: g.string("planner-metrics-host")?,
        metrics_port: g.port("planner-metrics-port")?,
        runtime: RuntimeConfig::from_resolved(&resolved, false, env)?,
        print_config: g.bool("print-config")?,
        warnings: resolved.warnings.clone(),
    };
    check(&cfg, &resolved)?;
    Ok(cfg)
}

fn actuator(resolved: &Resolved) -> Result<ActuatorKind, ConfigError> {
    Ok(match Get(resolved).string("actuator")?.as_str() {
        "local" => ActuatorKind::Local,
        "docker" => ActuatorKind::Docker,
        "slurm" => ActuatorKind::Slurm,
        "kubernetes" => ActuatorKind::Kubernetes,
        _ => ActuatorKind::Virtual,
    })
}

fn positive(resolved: &Resolved, name: &str) -> Result<f64, ConfigError> {
    let v = Get(resolved).f64(name)?;
    if !(v.is_finite() && v > 0.0) {
        return Err(ConfigError::InvalidValue {
            origin: resolved.origin(name),
            value: v.to_string(),
            reason: "must be a positive number of milliseconds".into(),
        });
    }
    Ok(v)
}

/// Settings that contradict one another, each named.
fn check(cfg: &PlannerConfig, resolved: &Resolved) -> Result<(), ConfigError> {
    let b = &cfg.bounds;
    let invalid = |name: &str, value: String, reason: String| ConfigError::InvalidValue {
        origin: resolved.origin(name),
        value,
        reason,
    };
    if b.min_endpoint > b.max_endpoint {
        return Err(invalid(
            "min-endpoint",
            b.min_endpoint.to_string(),
            format!("above --max-endpoint {}", b.max_endpoint),
        ));
    }
    let roles: &[u32] = match cfg.mode {
        PlannerMode::Disagg => &[b.prefill_engine_num_gpu, b.decode_engine_num_gpu],
        PlannerMode::Agg | PlannerMode::Prefill => &[b.prefill_engine_num_gpu],
        PlannerMode::Decode => &[b.decode_engine_num_gpu],
    };
    let least: u64 = roles
        .iter()
        .map(|g| u64::from(*g) * u64::from(b.min_endpoint))
        .sum();
    if u64::from(b.max_gpu_budget) < least {
        return Err(invalid(
            "max-gpu-budget",
            b.max_gpu_budget.to_string(),
            format!("below the {least} GPUs that --min-endpoint of every scaled role needs"),
        ));
    }
    if b.min_endpoint == 0 && !cfg.enable_throughput_scaling {
        return Err(invalid(
            "min-endpoint",
            "0".into(),
            "a role at zero replicas reports no load, so load scaling alone could never bring \
             it back: use at least 1, or --enable-throughput-scaling"
                .into(),
        ));
    }
    if !cfg.enable_load_scaling && !cfg.enable_throughput_scaling {
        return Err(ConfigError::Invalid(
            "--no-enable-load-scaling and no --enable-throughput-scaling: the planner would \
             never scale anything"
                .into(),
        ));
    }
    if cfg.load_signal == LoadSignal::Sla && cfg.profile_data.is_none() {
        return Err(ConfigError::Invalid(
            "--load-signal sla needs --planner-profile-data (the time models of the estimates)"
                .into(),
        ));
    }
    if cfg.enable_throughput_scaling && cfg.profile_data.is_none() {
        return Err(ConfigError::Invalid(
            "--enable-throughput-scaling needs --planner-profile-data (the time models)".into(),
        ));
    }
    let needs_spec = matches!(cfg.actuator, ActuatorKind::Local | ActuatorKind::Slurm);
    if needs_spec && cfg.local_workers_spec.is_none() {
        return Err(ConfigError::Invalid(format!(
            "--actuator {} needs --local-workers-spec (the worker command of each role)",
            if cfg.actuator == ActuatorKind::Local {
                "local"
            } else {
                "slurm"
            }
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<PlannerConfig, ConfigError> {
        let mut all = vec!["tandem-planner".to_string()];
        all.extend(args.iter().map(|s| s.to_string()));
        parse_planner(&all, &|_| None)
    }

    #[test]
    fn defaults_parse_and_bad_combinations_are_named() {
        let cfg = parse(&[]).unwrap();
        assert_eq!(cfg.mode, PlannerMode::Disagg);
        assert_eq!(cfg.actuator, ActuatorKind::Virtual);
        assert!(cfg.enable_load_scaling && !cfg.enable_throughput_scaling);
        let err = |a: &[&str]| parse(a).unwrap_err().to_string();
        assert!(err(&["--min-endpoint", "3", "--max-endpoint", "2"]).contains("--min-endpoint"));
        assert!(err(&["--min-endpoint", "3", "--max-gpu-budget", "5"]).contains("6 GPUs"));
        assert!(err(&["--enable-throughput-scaling"]).contains("--planner-profile-data"));
        assert!(err(&["--load-signal", "sla"]).contains("--planner-profile-data"));
        assert!(err(&["--actuator", "local"]).contains("--local-workers-spec"));
        assert!(err(&["--actuator", "slurm"]).contains("--local-workers-spec"));
        assert!(err(&["--ttft", "0"]).contains("--ttft"));
        assert!(err(&["--no-enable-load-scaling"]).contains("never scale"));
        assert!(err(&["--min-endpoint", "0"]).contains("zero replicas"));
        // Agg needs only the prefill-engine GPUs: 3 × 1 fits in 3.
        assert!(parse(&[
            "--planner-mode",
            "agg",
            "--min-endpoint",
            "3",
            "--max-gpu-budget",
            "3"
        ])
        .is_ok());
    }
}
