//! Builds [`EngineOptions`] in three layers, each deep-merged over the one before:
//! 1. the flags (`--max-batch-size`, `--free-gpu-memory-fraction`, ...);
//! 2. `--extra-engine-args FILE.yaml`;
//! 3. `--override-engine-args` (JSON or a Python dict literal) or the `--trtllm.*` flags.
//!
//! Unlike Dynamo, a YAML `kv_cache_config:` block merges key by key with the flags instead of
//! replacing them. A later layer that changes a value the user set by flag or env is logged.

use crate::cli::DynamicFlag;
use crate::engine_options::{classify_key, EngineOptions};
use crate::error::ConfigError;
use crate::merge::{deep_merge, strip_unknown};
use crate::resolve::Resolved;
use crate::values::Value as Value_;
use crate::worker::Get;
use serde_json::{json, Map, Value};
use std::path::Path;

/// Engine-option key path → the flag that sets it in layer 1.
const FLAG_KEYS: &[(&str, &str)] = &[
    ("max-batch-size", "max_batch_size"),
    ("max-num-tokens", "max_num_tokens"),
    ("max-seq-len", "max_seq_len"),
    ("max-beam-width", "max_beam_width"),
    ("tensor-parallel-size", "tensor_parallel_size"),
    ("pipeline-parallel-size", "pipeline_parallel_size"),
    ("expert-parallel-size", "moe_expert_parallel_size"),
    ("enable-attention-dp", "enable_attention_dp"),
    ("gpus-per-node", "gpus_per_node"),
    (
        "free-gpu-memory-fraction",
        "kv_cache_config.free_gpu_memory_fraction",
    ),
    ("guided-decoding-backend", "guided_decoding_backend"),
];

fn set_path(root: &mut Map<String, Value>, path: &str, value: Value) {
    let mut parts: Vec<&str> = path.split('.').collect();
    let Some(last) = parts.pop() else { return };
    let mut node = root;
    for part in parts {
        let entry = node.entry(part.to_string()).or_insert_with(|| json!({}));
        if !entry.is_object() {
            *entry = json!({});
        }
        let Value::Object(next) = entry else { return };
        node = next;
    }
    node.insert(last.to_string(), value);
}

fn flag_layer(resolved: &Resolved) -> Map<String, Value> {
    let mut layer = Map::new();
    for (flag, key) in FLAG_KEYS {
        if let Some(v) = resolved.get(flag) {
            set_path(
                &mut layer,
                key,
                serde_json::to_value(v).unwrap_or(Value::Null),
            );
        }
    }
    // `--kv-transport ucx|tcp` spells the backend in lower case; the option wants UCX/TCP.
    if let Some(Value_::Str(v)) = resolved.get("kv-transport") {
        set_path(
            &mut layer,
            "cache_transceiver_config.backend",
            Value::String(v.to_ascii_uppercase()),
        );
    }
    layer
}

/// Reads and parses the YAML file of `--extra-engine-args`.
pub fn read_yaml(path: &Path) -> Result<Map<String, Value>, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_yaml(&text, &format!("--extra-engine-args {}", path.display()))
}

/// Parses the text of an `--extra-engine-args` file: a mapping of options (an empty file is
/// an empty mapping). Errors name `origin` and the 1-based line and column.
pub fn parse_yaml(text: &str, origin: &str) -> Result<Map<String, Value>, ConfigError> {
    let value: Value = serde_saphyr::from_str(text).map_err(|e| {
        let (line, column) = e
            .location()
            .map(|l| (l.line() as usize, l.column() as usize))
            .unwrap_or((0, 0));
        ConfigError::Parse {
            origin: origin.to_string(),
            line,
            column,
            message: yaml_message(&e),
        }
    })?;
    match value {
        Value::Null => Ok(Map::new()),
        Value::Object(m) => Ok(m),
        _ => Err(ConfigError::Invalid(format!(
            "{origin}: the file must hold a mapping of options"
        ))),
    }
}

/// The YAML parser's message without the position (the error gives it once) and without its
/// advice on parser options.
fn yaml_message(e: &serde_saphyr::Error) -> String {
    let mut text = e.without_snippet().to_string();
    if let Some(at) = text.rfind(" at line ") {
        let tail = &text[at + " at line ".len()..];
        let positional = tail.split_once(", column ").is_some_and(|(l, c)| {
            [l, c]
                .iter()
                .all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        });
        if positional {
            text.truncate(at);
        }
    }
    text.replace(", set DuplicateKeyPolicy in Options if acceptable", "")
}

/// Parses `--override-engine-args`: JSON first, then a Python dict literal.
pub fn parse_override(text: &str, origin: &str) -> Result<Map<String, Value>, ConfigError> {
    let value = match serde_json::from_str::<Value>(text) {
        Ok(v) => v,
        Err(_) => crate::pyliteral::parse(text).map_err(|e| ConfigError::Parse {
            origin: origin.to_string(),
            line: e.line,
            column: e.column,
            message: format!(
                "{} (expected a JSON object or a Python dict literal)",
                e.message
            ),
        })?,
    };
    match value {
        Value::Object(m) => Ok(m),
        _ => Err(ConfigError::Invalid(format!(
            "{origin}: expected a dict of engine options"
        ))),
    }
}

/// Infers a `--trtllm.*` value: none/null, then int, float, bool, else string.
fn infer(raw: &str) -> Value {
    if raw.eq_ignore_ascii_case("none") || raw.eq_ignore_ascii_case("null") {
        return Value::Null;
    }
    if let Ok(i) = raw.parse::<i64>() {
        return json!(i);
    }
    if let Ok(f) = raw.parse::<f64>() {
        if let Some(n) = serde_json::Number::from_f64(f) {
            return Value::Number(n);
        }
    }
    match raw.to_ascii_lowercase().as_str() {
        "true" => Value::Bool(true),
        "false" => Value::Bool(false),
        _ => Value::String(raw.to_string()),
    }
}

/// Turns `--trtllm.a.b value` flags into one nested dict; a key used both as a value and as
/// a parent is an error.
pub fn dynamic_layer(flags: &[DynamicFlag]) -> Result<Map<String, Value>, ConfigError> {
    let mut root = Map::new();
    for flag in flags {
        let name = format!("--trtllm.{}", flag.path.join("."));
        let (last, parents) = flag
            .path
            .split_last()
            .ok_or_else(|| ConfigError::Invalid(format!("{name}: empty key")))?;
        let mut node = &mut root;
        for (i, part) in parents.iter().enumerate() {
            let entry = node.entry(part.clone()).or_insert_with(|| json!({}));
            let Value::Object(next) = entry else {
                return Err(ConfigError::Invalid(format!(
                    "{name}: conflicts with --trtllm.{}, which sets a value there",
                    flag.path[..=i].join(".")
                )));
            };
            node = next;
        }
        if node.get(last).is_some_and(Value::is_object) {
            return Err(ConfigError::Invalid(format!(
                "{name}: conflicts with nested --trtllm.{}.* flags",
                flag.path.join(".")
            )));
        }
        node.insert(last.clone(), infer(&flag.raw));
    }
    Ok(root)
}

/// Result of building the engine options.
pub struct BuiltOptions {
    pub options: EngineOptions,
    pub warnings: Vec<String>,
}

pub fn build(resolved: &Resolved) -> Result<BuiltOptions, ConfigError> {
    let g = Get(resolved);
    let strict = g.bool("strict-engine-args")?;
    let mut warnings = Vec::new();
    let mut merged = serde_json::to_value(EngineOptions::default())
        .map_err(|e| ConfigError::Invalid(format!("internal error: {e}")))?;
    deep_merge(
        &mut merged,
        &Value::Object(flag_layer(resolved)),
        &mut vec![],
        &mut |_, _, _| {},
    );

    let mut layers: Vec<(String, Map<String, Value>)> = Vec::new();
    if let Some(path) = g.opt_string("extra-engine-args")? {
        layers.push((
            format!("--extra-engine-args {path}"),
            read_yaml(Path::new(&path))?,
        ));
    }
    let override_text = g.opt_string("override-engine-args")?;
    match (override_text, resolved.dynamic.is_empty()) {
        (Some(_), false) => {
            return Err(ConfigError::Invalid(
                "--override-engine-args and --trtllm.* flags are mutually exclusive; use one"
                    .into(),
            ))
        }
        (Some(text), true) => {
            let origin = resolved.origin("override-engine-args");
            layers.push((origin.clone(), parse_override(&text, &origin)?));
        }
        (None, false) => {
            layers.push(("--trtllm.* flags".into(), dynamic_layer(&resolved.dynamic)?))
        }
        (None, true) => {}
    }

    for (origin, mut layer) in layers {
        let mut unknown = Vec::new();
        strip_unknown(&mut layer, "", &classify_key, &mut unknown).map_err(|path| {
            ConfigError::NotImplemented {
                flag: format!("{origin}: engine option `{path}`"),
                what: "Tandem's engine does not support this TensorRT-LLM option".into(),
            }
        })?;
        if !unknown.is_empty() {
            let msg = format!("{origin}: unknown engine option(s): {}", unknown.join(", "));
            if strict {
                return Err(ConfigError::Invalid(format!(
                    "{msg} (--strict-engine-args)"
                )));
            }
            warnings.push(format!(
                "{msg}; ignored (use --strict-engine-args to make this an error)"
            ));
        }
        deep_merge(
            &mut merged,
            &Value::Object(layer),
            &mut vec![],
            &mut |path, old, new| {
                if let Some((flag, _)) = FLAG_KEYS.iter().find(|(_, k)| *k == path) {
                    if resolved.is_explicit(flag) {
                        warnings.push(format!(
                            "{origin} sets {path} = {new}, overriding {} = {old}",
                            resolved.origin(flag)
                        ));
                    }
                }
            },
        );
    }
    let options: EngineOptions =
        serde_path_to_error::deserialize(merged).map_err(|e| ConfigError::EngineOption {
            path: e.path().to_string(),
            message: e.inner().to_string(),
        })?;
    Ok(BuiltOptions { options, warnings })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flag(path: &str, raw: &str) -> DynamicFlag {
        DynamicFlag {
            path: path.split('.').map(str::to_string).collect(),
            raw: raw.into(),
        }
    }

    #[test]
    fn dynamic_flags_infer_types_and_nest() {
        let layer = dynamic_layer(&[
            flag("kv_cache_config.enable_block_reuse", "False"),
            flag("kv_cache_config.max_tokens", "4096"),
            flag("kv_cache_config.free_gpu_memory_fraction", "0.5"),
            flag("max_seq_len", "None"),
            flag("guided_decoding_backend", "xgrammar"),
        ])
        .unwrap();
        assert_eq!(
            Value::Object(layer),
            json!({"kv_cache_config": {"enable_block_reuse": false, "max_tokens": 4096,
                   "free_gpu_memory_fraction": 0.5}, "max_seq_len": null,
                   "guided_decoding_backend": "xgrammar"})
        );
    }

    #[test]
    fn dynamic_flag_path_conflicts_are_errors() {
        let e = dynamic_layer(&[flag("a", "1"), flag("a.b", "2")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--trtllm.a.b") && e.contains("conflicts"), "{e}");
        let e = dynamic_layer(&[flag("a.b", "1"), flag("a", "2")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--trtllm.a") && e.contains("nested"), "{e}");
    }

    #[test]
    fn yaml_files_are_mappings_and_errors_carry_their_position() {
        let text = "# engine args\nmax_batch_size: 16\nkv_cache_config:\n  \
                    free_gpu_memory_fraction: 0.5\n  enable_block_reuse: false\n\
                    max_seq_len: ~\nbase: &b {x: 1.5e-3, y: [a, 'b']}\nother: *b\n";
        let m = parse_yaml(text, "o").unwrap();
        let other = json!({"x": 0.0015, "y": ["a", "b"]});
        assert_eq!(
            Value::Object(m),
            json!({"max_batch_size": 16, "kv_cache_config": {"free_gpu_memory_fraction": 0.5,
                   "enable_block_reuse": false}, "max_seq_len": null, "base": other,
                   "other": other})
        );
        assert!(parse_yaml("", "o").unwrap().is_empty());
        assert!(parse_yaml("# nothing but a comment\n", "o")
            .unwrap()
            .is_empty());
        let e = parse_yaml("a: 1\nb: [unclosed\n", "--extra-engine-args f.yaml").unwrap_err();
        let ConfigError::Parse { line, column, .. } = &e else {
            panic!("{e}");
        };
        assert!(*line >= 2 && *column >= 1, "{e}");
        assert!(e
            .to_string()
            .starts_with("--extra-engine-args f.yaml: parse error at line"));
        assert_eq!(e.to_string().matches("line").count(), 1, "{e}");
        let e = parse_yaml("a: 1\na: 2\n", "o").unwrap_err().to_string();
        assert!(e.contains("duplicate") && !e.contains("Options"), "{e}");
        assert!(parse_yaml("- a\n", "o")
            .unwrap_err()
            .to_string()
            .contains("mapping"));
    }

    #[test]
    fn override_accepts_json_and_python_and_rejects_non_dicts() {
        let py = parse_override("{'kv_cache_config': {'enable_block_reuse': False}}", "o").unwrap();
        let js =
            parse_override(r#"{"kv_cache_config": {"enable_block_reuse": false}}"#, "o").unwrap();
        assert_eq!(py, js);
        assert!(parse_override("[1, 2]", "o")
            .unwrap_err()
            .to_string()
            .contains("dict"));
        let e = parse_override("{'a': tru}", "--override-engine-args")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--override-engine-args") && e.contains("line 1, column 7"),
            "{e}"
        );
    }
}
