//! The edge shared by every binary's `main`: parse the process's own arguments and
//! environment, print errors and `--help` the way a user expects, log warnings, and honour
//! `--print-config` / `--dump-config-to`.

use crate::error::ConfigError;
use crate::worker::{Role, WorkerConfig};
use crate::RouterConfig;
use std::io::Write;

/// Prints to stdout, ignoring a closed pipe (`... --print-config | head`).
fn print_stdout(text: &str) {
    let _ = writeln!(std::io::stdout().lock(), "{text}");
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`); stdout stays free for READY lines
/// and `--print-config`.
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// For roles that cannot serve yet: validates the config (so `--print-config` and config
/// errors work), then exits 1 saying what is missing.
pub fn refuse_role(role: Role, missing: &str) -> ! {
    init_logging();
    let Some(cfg) = worker_config_or_exit(role) else {
        std::process::exit(0);
    };
    eprintln!(
        "{}: configuration is valid ({} mode, endpoint {}), but {missing}",
        role.binary(),
        cfg.disaggregation.disaggregation_mode.name(),
        cfg.endpoint()
    );
    std::process::exit(1);
}

fn exit_with(err: ConfigError, bin: &str) -> ! {
    if let ConfigError::Cli(e) = err {
        e.exit();
    }
    let code = err.exit_code();
    eprintln!("{bin}: error: {err}");
    std::process::exit(code);
}

/// Parses a worker's config from the process, or exits. Returns `None` after
/// `--print-config` printed the config (the caller should exit 0).
pub fn worker_config_or_exit(role: Role) -> Option<WorkerConfig> {
    let args: Vec<String> = std::env::args().collect();
    let cfg = crate::parse_worker(role, &args, &crate::process_env)
        .unwrap_or_else(|e| exit_with(e, role.binary()));
    for w in &cfg.warnings {
        tracing::warn!("{w}");
    }
    if cfg.print_config {
        print_stdout(&cfg.to_json());
        return None;
    }
    if let Err(e) = cfg.dump_if_requested() {
        exit_with(e, role.binary());
    }
    Some(cfg)
}

/// Parses the router's config from the process, or exits; `None` after `--print-config`.
pub fn router_config_or_exit() -> Option<RouterConfig> {
    let args: Vec<String> = std::env::args().collect();
    let cfg = crate::parse_router(&args, &crate::process_env)
        .unwrap_or_else(|e| exit_with(e, "tandem-router"));
    for w in &cfg.warnings {
        tracing::warn!("{w}");
    }
    if cfg.print_config {
        print_stdout(
            &serde_json::to_string_pretty(&cfg)
                .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}")),
        );
        return None;
    }
    if let Some(path) = &cfg.runtime.dump_config_to {
        let json = serde_json::to_string_pretty(&cfg).unwrap_or_default();
        if let Err(source) = std::fs::write(path, json) {
            exit_with(
                ConfigError::Io {
                    path: path.clone(),
                    source,
                },
                "tandem-router",
            );
        }
    }
    Some(cfg)
}

/// Parses the planner's config from the process, or exits; `None` after `--print-config`.
pub fn planner_config_or_exit() -> Option<crate::PlannerConfig> {
    let args: Vec<String> = std::env::args().collect();
    let cfg = crate::parse_planner(&args, &crate::process_env)
        .unwrap_or_else(|e| exit_with(e, "tandem-planner"));
    for w in &cfg.warnings {
        tracing::warn!("{w}");
    }
    let json = serde_json::to_string_pretty(&cfg).unwrap_or_default();
    if cfg.print_config {
        print_stdout(&json);
        return None;
    }
    if let Some(path) = &cfg.runtime.dump_config_to {
        if let Err(source) = std::fs::write(path, &json) {
            exit_with(
                ConfigError::Io {
                    path: path.clone(),
                    source,
                },
                "tandem-planner",
            );
        }
    }
    Some(cfg)
}
