//! Deep merge of engine-option layers and the walk that finds keys the engine does not know.

use serde_json::{Map, Value};

/// Merges `over` into `base`: objects merge key by key, recursively; anything else (scalars,
/// lists, null) replaces. Calls `on_change(path, old, new)` for every leaf whose value changes.
pub fn deep_merge(
    base: &mut Value,
    over: &Value,
    path: &mut Vec<String>,
    on_change: &mut dyn FnMut(&str, &Value, &Value),
) {
    match (base, over) {
        (Value::Object(b), Value::Object(o)) => {
            for (key, value) in o {
                path.push(key.clone());
                match b.get_mut(key) {
                    Some(existing) if existing.is_object() && value.is_object() => {
                        deep_merge(existing, value, path, on_change)
                    }
                    Some(existing) => {
                        if existing != value {
                            on_change(&path.join("."), existing, value);
                        }
                        *existing = value.clone();
                    }
                    None => {
                        b.insert(key.clone(), value.clone());
                    }
                }
                path.pop();
            }
        }
        (b, o) => {
            if b != o {
                on_change(&path.join("."), b, o);
            }
            *b = o.clone();
        }
    }
}

/// How the engine treats a key path.
pub enum KeyKind {
    /// The engine honours it; objects are walked further.
    Known { object: bool },
    /// A TensorRT-LLM option the engine does not implement yet.
    NotImplemented,
    /// Not an option at all.
    Unknown,
}

/// Removes unknown keys from `layer` and returns their dotted paths; returns the first
/// not-implemented key path found as an error.
pub fn strip_unknown(
    layer: &mut Map<String, Value>,
    prefix: &str,
    classify: &dyn Fn(&str) -> KeyKind,
    unknown: &mut Vec<String>,
) -> Result<(), String> {
    let keys: Vec<String> = layer.keys().cloned().collect();
    for key in keys {
        let path = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        match classify(&path) {
            KeyKind::Known { object: true } => {
                if let Some(Value::Object(inner)) = layer.get_mut(&key) {
                    strip_unknown(inner, &path, classify, unknown)?;
                }
            }
            KeyKind::Known { object: false } => {}
            KeyKind::NotImplemented => {
                // `null` or an empty object asks for nothing; anything else is a request.
                let asks = match layer.get(&key) {
                    Some(Value::Null) => false,
                    Some(Value::Object(m)) => !m.is_empty(),
                    Some(Value::Bool(b)) => *b,
                    _ => true,
                };
                if asks {
                    return Err(path);
                }
                layer.remove(&key);
            }
            KeyKind::Unknown => {
                layer.remove(&key);
                unknown.push(path);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn nested_objects_merge_and_scalars_replace() {
        let mut base = json!({"a": 1, "kv": {"f": 0.9, "reuse": true}, "l": [1, 2]});
        let over = json!({"kv": {"reuse": false}, "l": [3], "new": {"x": 1}});
        let mut changes = vec![];
        deep_merge(&mut base, &over, &mut vec![], &mut |p, _, n| {
            changes.push((p.to_string(), n.clone()))
        });
        assert_eq!(
            base,
            json!({"a": 1, "kv": {"f": 0.9, "reuse": false}, "l": [3], "new": {"x": 1}})
        );
        assert_eq!(
            changes,
            vec![
                ("kv.reuse".to_string(), json!(false)),
                ("l".to_string(), json!([3]))
            ]
        );
    }

    #[test]
    fn unknown_keys_are_removed_and_reported() {
        let classify = |p: &str| match p {
            "kv" => KeyKind::Known { object: true },
            "kv.f" | "a" => KeyKind::Known { object: false },
            "spec" => KeyKind::NotImplemented,
            _ => KeyKind::Unknown,
        };
        let mut layer = json!({"a": 1, "kv": {"f": 1, "typo": 2}, "bogus": 3, "spec": null});
        let mut unknown = vec![];
        strip_unknown(layer.as_object_mut().unwrap(), "", &classify, &mut unknown).unwrap();
        unknown.sort();
        assert_eq!(unknown, vec!["bogus".to_string(), "kv.typo".to_string()]);
        assert_eq!(layer, json!({"a": 1, "kv": {"f": 1}}));
        let mut asks = json!({"spec": {"decoding_type": "Eagle"}});
        let err =
            strip_unknown(asks.as_object_mut().unwrap(), "", &classify, &mut vec![]).unwrap_err();
        assert_eq!(err, "spec");
    }
}
