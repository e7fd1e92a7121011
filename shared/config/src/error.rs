//! Errors of config resolution. Each one names the flag, env var, file or key at fault.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Command-line syntax errors, `--help` and `--version` (clap renders them).
    #[error("{0}")]
    Cli(#[from] clap::Error),
    #[error("invalid value {value:?} for {origin}: {reason}")]
    InvalidValue {
        origin: String,
        value: String,
        reason: String,
    },
    #[error("{0}")]
    Invalid(String),
    #[error("{flag}: not implemented yet: {what}")]
    NotImplemented { flag: String, what: String },
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{origin}: parse error at line {line}, column {column}: {message}")]
    Parse {
        origin: String,
        line: usize,
        column: usize,
        message: String,
    },
    #[error("engine option `{path}`: {message}")]
    EngineOption { path: String, message: String },
}

impl ConfigError {
    /// Exit code a binary should use: 0 for `--help`/`--version`, 2 for usage errors.
    pub fn exit_code(&self) -> i32 {
        match self {
            ConfigError::Cli(e) if !e.use_stderr() => 0,
            _ => 2,
        }
    }
}
