//! Parsing of flag values from CLI and environment strings, with errors that name where the
//! value came from (`--flag` or `ENV_VAR`).

use crate::spec::{FlagSpec, Kind};
use serde::Serialize;

/// A parsed flag value.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Value {
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    List(Vec<String>),
}

/// Where a resolved value came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    Cli,
    Env(&'static str),
    Default,
}

/// Parses a boolean as env vars are written: true/1/yes/on, false/0/no/off, any case.
pub fn parse_bool(raw: &str) -> Option<bool> {
    match raw.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Some(true),
        "false" | "0" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// Parses `raw` as the flag's kind. The error says what was expected; the caller adds where
/// the value came from.
pub fn parse_value(spec: &FlagSpec, raw: &str) -> Result<Value, String> {
    match spec.kind {
        Kind::Bool => parse_bool(raw)
            .map(Value::Bool)
            .ok_or_else(|| "expected one of true/1/yes/on or false/0/no/off".to_string()),
        Kind::Int { min } => {
            let v: i64 = raw
                .trim()
                .parse()
                .map_err(|_| "expected an integer".to_string())?;
            if v < min {
                return Err(if min == 1 {
                    "must be a positive integer (at least 1)".to_string()
                } else {
                    format!("must be at least {min}")
                });
            }
            Ok(Value::Int(v))
        }
        Kind::Float => {
            let v: f64 = raw
                .trim()
                .parse()
                .map_err(|_| "expected a number".to_string())?;
            if !v.is_finite() {
                return Err("must be a finite number".to_string());
            }
            Ok(Value::Float(v))
        }
        Kind::Str | Kind::Path => Ok(Value::Str(raw.to_string())),
        Kind::Choice(choices) => {
            if choices.contains(&raw) {
                Ok(Value::Str(raw.to_string()))
            } else {
                Err(format!("expected one of: {}", choices.join(", ")))
            }
        }
        Kind::List => Ok(Value::List(
            raw.split(|c: char| c == ',' || c.is_whitespace())
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect(),
        )),
    }
}

impl Value {
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }
    pub fn as_float(&self) -> Option<f64> {
        match self {
            Value::Float(f) => Some(*f),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_list(&self) -> Option<&[String]> {
        match self {
            Value::List(l) => Some(l),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn booleans_accept_every_documented_spelling_in_any_case() {
        for t in ["true", "TRUE", "1", "yes", "Yes", "on", "ON"] {
            assert_eq!(parse_bool(t), Some(true), "{t}");
        }
        for f in ["false", "False", "0", "no", "NO", "off", "Off"] {
            assert_eq!(parse_bool(f), Some(false), "{f}");
        }
        for bad in ["", "2", "maybe", "truee", "y"] {
            assert_eq!(parse_bool(bad), None, "{bad}");
        }
    }

    #[test]
    fn lists_split_on_commas_and_whitespace() {
        let spec = FlagSpec::new("x", Kind::List, crate::spec::Group::Runtime, "");
        assert_eq!(
            parse_value(&spec, "chat, completions  none").unwrap(),
            Value::List(vec!["chat".into(), "completions".into(), "none".into()])
        );
        assert_eq!(parse_value(&spec, "").unwrap(), Value::List(vec![]));
    }

    #[test]
    fn numbers_are_range_checked() {
        let spec = FlagSpec::new("x", Kind::Int { min: 1 }, crate::spec::Group::Runtime, "");
        assert!(parse_value(&spec, "0").unwrap_err().contains("positive"));
        assert!(parse_value(&spec, "-3").unwrap_err().contains("positive"));
        assert!(parse_value(&spec, "abc").unwrap_err().contains("integer"));
        let f = FlagSpec::new("y", Kind::Float, crate::spec::Group::Runtime, "");
        assert!(parse_value(&f, "nan").unwrap_err().contains("finite"));
        assert_eq!(parse_value(&f, "0.5").unwrap(), Value::Float(0.5));
    }
}
