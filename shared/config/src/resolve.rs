//! Resolution of every flag to one value: the command line wins over the environment, the
//! environment over the default.

use crate::cli::{self, DynamicFlag};
use crate::error::ConfigError;
use crate::spec::{FlagSpec, Scope};
use crate::values::{parse_value, Source, Value};
use clap::parser::ValueSource;
use std::collections::BTreeMap;

/// Reads an environment variable; tests pass a map instead of the process environment.
pub type EnvLookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The process environment.
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// Every flag of one scope with its value (or unset) and where it came from.
#[derive(Debug)]
pub struct Resolved {
    values: BTreeMap<&'static str, (Option<Value>, Source)>,
    pub dynamic: Vec<DynamicFlag>,
    /// Deprecation and override notices, for the binary to log.
    pub warnings: Vec<String>,
}

impl Resolved {
    pub fn get(&self, name: &str) -> Option<&Value> {
        self.values.get(name).and_then(|(v, _)| v.as_ref())
    }
    pub fn source(&self, name: &str) -> Option<&Source> {
        self.values.get(name).map(|(_, s)| s)
    }
    /// Whether the user set the flag (on the command line or in the environment).
    pub fn is_explicit(&self, name: &str) -> bool {
        matches!(self.source(name), Some(Source::Cli | Source::Env(_)))
    }
    /// Where a flag's value came from, for error messages: `--flag`, `DYN_X=…`, or the default.
    pub fn origin(&self, name: &str) -> String {
        match self.source(name) {
            Some(Source::Env(var)) => format!("environment variable {var}"),
            Some(Source::Default) => format!("--{name} (default)"),
            _ => format!("--{name}"),
        }
    }
    pub fn set(&mut self, name: &'static str, value: Option<Value>, source: Source) {
        self.values.insert(name, (value, source));
    }
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, Option<&Value>, &Source)> {
        self.values.iter().map(|(k, (v, s))| (*k, v.as_ref(), s))
    }
}

/// Parses `args` (program name first) for a binary of `scope` against `env`.
pub fn resolve(
    command: clap::Command,
    scope: Scope,
    args: &[String],
    env: EnvLookup<'_>,
) -> Result<Resolved, ConfigError> {
    let (rest, dynamic) = if scope == Scope::Worker {
        cli::split_dynamic_flags(args).map_err(ConfigError::Invalid)?
    } else {
        (args.to_vec(), Vec::new())
    };
    let matches = command.try_get_matches_from(&rest)?;
    let mut resolved = Resolved {
        values: BTreeMap::new(),
        dynamic,
        warnings: Vec::new(),
    };
    for spec in crate::flags::flags_for(scope) {
        let (value, source) = resolve_one(spec, &matches, env, &mut resolved.warnings)?;
        if let Some(form) = cli::uses_deprecated_alias(spec, &rest) {
            resolved.warnings.push(format!(
                "{form} is deprecated; use --{} / --{} instead",
                spec.name,
                spec.negated()
            ));
        }
        resolved.values.insert(spec.name, (value, source));
    }
    Ok(resolved)
}

fn on_command_line(matches: &clap::ArgMatches, id: &str) -> bool {
    matches.value_source(id) == Some(ValueSource::CommandLine)
}

fn resolve_one(
    spec: &'static FlagSpec,
    matches: &clap::ArgMatches,
    env: EnvLookup<'_>,
    warnings: &mut Vec<String>,
) -> Result<(Option<Value>, Source), ConfigError> {
    if spec.is_bool() {
        if on_command_line(matches, spec.name) {
            return Ok((Some(Value::Bool(true)), Source::Cli));
        }
        if on_command_line(matches, &spec.negated()) {
            return Ok((Some(Value::Bool(false)), Source::Cli));
        }
    } else if on_command_line(matches, spec.name) {
        // A repeatable (list) flag: every occurrence, joined as one list.
        let all: Vec<&str> = matches
            .get_many::<String>(spec.name)
            .map(|v| v.map(String::as_str).collect())
            .unwrap_or_default();
        let joined = all.join(",");
        let raw = if spec.repeatable {
            joined.as_str()
        } else {
            all.last().copied().unwrap_or_default()
        };
        let value = parse_value(spec, raw).map_err(|reason| ConfigError::InvalidValue {
            origin: format!("--{}", spec.name),
            value: raw.to_string(),
            reason,
        })?;
        return Ok((Some(value), Source::Cli));
    }
    let from_env = |var: &'static str| -> Result<Option<(Value, Source)>, ConfigError> {
        let Some(raw) = env(var) else { return Ok(None) };
        let value = parse_value(spec, &raw).map_err(|reason| ConfigError::InvalidValue {
            origin: format!("environment variable {var}"),
            value: raw.clone(),
            reason,
        })?;
        Ok(Some((value, Source::Env(var))))
    };
    if let Some(var) = spec.env {
        if let Some((v, s)) = from_env(var)? {
            return Ok((Some(v), s));
        }
    }
    if let Some(var) = spec.deprecated_env {
        if let Some((v, s)) = from_env(var)? {
            warnings.push(format!(
                "{var} is deprecated; set {} instead",
                spec.env.unwrap_or("the new flag")
            ));
            return Ok((Some(v), s));
        }
    }
    match spec.default {
        Some(raw) => {
            let value = parse_value(spec, raw).map_err(|reason| {
                ConfigError::Invalid(format!("built-in default of --{}: {reason}", spec.name))
            })?;
            Ok((Some(value), Source::Default))
        }
        None => Ok((None, Source::Default)),
    }
}
