//! The config crate's parsers: the `--extra-engine-args` YAML, the Python dict literals of
//! `--override-engine-args`, and whole command lines with environments (flags, env vars,
//! `--trtllm.*`, engine options).

use std::collections::HashMap;

use serde_json::Value;
use tandem_config::options_build::{parse_override, parse_yaml};
use tandem_config::{parse_router, parse_worker, pyliteral, ConfigError, Role};

/// An error names where it came from and says something.
fn named(e: &ConfigError) {
    let text = e.to_string();
    assert!(!text.is_empty());
    if let ConfigError::Parse { origin, .. } = e {
        assert!(text.contains(origin.as_str()), "{text}");
    }
}

/// Parses a worker with `--override-engine-args` = `layer` (JSON): the same merge of an
/// engine-option layer over the flags, unknown-key stripping and typed options as a YAML file
/// goes through.
fn merge_layer(layer: &serde_json::Map<String, Value>) {
    let json = Value::Object(layer.clone()).to_string();
    let argv = ["tandem-decode", "--override-engine-args", &json].map(String::from);
    if let Err(e) = parse_worker(Role::Decode, &argv, &|_| None) {
        named(&e);
    }
}

/// The YAML of `--extra-engine-args`, then its merge into the engine options.
pub fn config_yaml(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match parse_yaml(text, "--extra-engine-args fuzz.yaml") {
        Ok(map) => merge_layer(&map),
        Err(e) => named(&e),
    }
}

/// Python dict literals: the parser alone (with a round trip: what it returns, printed as
/// JSON, parses back to the same value), then `--override-engine-args` as a whole.
pub fn config_pyliteral(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(value) = pyliteral::parse(text) {
        let json = value.to_string();
        let again = pyliteral::parse(&json)
            .unwrap_or_else(|e| panic!("{json:?} (printed from {text:?}) does not parse: {e:?}"));
        assert_eq!(again, value, "{text:?} -> {json}");
    }
    match parse_override(text, "--override-engine-args") {
        Ok(map) => merge_layer(&map),
        Err(e) => named(&e),
    }
}

/// A command line and an environment, as text: the first line is the role (`prefill`,
/// `decode`, `encode` or `router`), then one argument per line; a line `$NAME=value` sets an
/// environment variable instead. Flags that name a file to read are dropped (the fuzzer must
/// not read `/dev/zero`).
pub fn config_cli_env(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut lines = text.split('\n');
    let role = lines.next().unwrap_or_default().trim();
    let mut env = HashMap::new();
    let mut args = Vec::new();
    for line in lines {
        if let Some(var) = line.strip_prefix('$') {
            let (k, v) = var.split_once('=').unwrap_or((var, ""));
            env.insert(k.to_string(), v.to_string());
        } else {
            args.push(line.to_string());
        }
    }
    let reads_a_file = |s: &str| {
        let s = s.to_ascii_lowercase().replace('_', "-");
        s.contains("extra-engine-args")
    };
    env.retain(|k, _| !reads_a_file(k));
    let mut kept = Vec::with_capacity(args.len() + 1);
    let mut skip_value = false;
    for a in args {
        if std::mem::take(&mut skip_value) {
            continue;
        }
        if reads_a_file(&a) {
            skip_value = !a.contains('=');
            continue;
        }
        kept.push(a);
    }
    let lookup = |k: &str| env.get(k).cloned();
    let result = match role {
        "router" => {
            kept.insert(0, "tandem-router".into());
            parse_router(&kept, &lookup).map(drop)
        }
        role => {
            let role = match role {
                "prefill" => Role::Prefill,
                "encode" => Role::Encode,
                _ => Role::Decode,
            };
            kept.insert(0, role.binary().into());
            parse_worker(role, &kept, &lookup).map(|c| drop(c.to_json()))
        }
    };
    if let Err(e) = result {
        named(&e);
    }
}
