//! Structured outputs and logit bias from the request body: OpenAI's `response_format`,
//! vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, Dynamo's
//! `nvext.guided_*`, and the grammar a forced tool choice implies. The worker's engine compiles
//! and enforces the [`Constraint`]; here the fields are read and checked by name.

use serde_json::{json, Value};
use tandem_text::limits::{MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_VALUE};
use tandem_text::Constraint;

use crate::error::ApiError;
use crate::openai::{Guided, LogitBias};

fn bad(field: &str, msg: impl std::fmt::Display) -> ApiError {
    ApiError::bad_request(format!("`{field}` {msg}"), Some(field))
}

/// The request's constraint: at most one of the structured-output fields may be set.
pub fn constraint(g: &Guided) -> Result<Option<Constraint>, ApiError> {
    let nv = g.nvext.clone().unwrap_or_default();
    if let Some(b) = nv.guided_decoding_backend.as_deref() {
        if !matches!(b, "llguidance" | "auto" | "") {
            return Err(bad(
                "nvext.guided_decoding_backend",
                format!("{b:?} is not available: Tandem enforces grammars with llguidance"),
            ));
        }
    }
    let mut found: Vec<(&str, Constraint)> = Vec::new();
    if let Some(rf) = &g.response_format {
        if let Some(c) = response_format(rf)? {
            found.push(("response_format", c));
        }
    }
    for (field, json) in [
        ("guided_json", &g.guided_json),
        ("nvext.guided_json", &nv.guided_json),
    ] {
        if let Some(v) = json {
            found.push((field, json_schema(field, v)?));
        }
    }
    for (field, rx) in [
        ("guided_regex", &g.guided_regex),
        ("nvext.guided_regex", &nv.guided_regex),
    ] {
        if let Some(rx) = rx {
            found.push((field, Constraint::Regex(rx.clone())));
        }
    }
    for (field, c) in [
        ("guided_choice", &g.guided_choice),
        ("nvext.guided_choice", &nv.guided_choice),
    ] {
        if let Some(c) = c {
            found.push((field, Constraint::Choice(c.clone())));
        }
    }
    for (field, gr) in [
        ("guided_grammar", &g.guided_grammar),
        ("nvext.guided_grammar", &nv.guided_grammar),
    ] {
        if let Some(gr) = gr {
            found.push((field, Constraint::Lark(gr.clone())));
        }
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(f, _)| *f).collect();
        return Err(bad(
            names[1],
            format!(
                "cannot be combined with `{}`: set one structured-output field",
                names[0]
            ),
        ));
    }
    let Some((field, c)) = found.pop() else {
        return Ok(None);
    };
    c.validate().map_err(|e| bad(field, e))?;
    Ok(Some(c))
}

/// OpenAI's `response_format`: `text` (none), `json_object`, or `json_schema` with its schema.
fn response_format(rf: &Value) -> Result<Option<Constraint>, ApiError> {
    const F: &str = "response_format";
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::JsonObject)),
        Some("json_schema") => {
            let js = rf
                .get("json_schema")
                .ok_or_else(|| bad(F, "of type json_schema needs a `json_schema` object"))?;
            let schema = js
                .get("schema")
                .ok_or_else(|| bad("response_format.json_schema.schema", "is missing"))?;
            json_schema("response_format.json_schema.schema", schema).map(Some)
        }
        Some(other) => Err(bad(
            F,
            format!("type {other:?} is not one of text, json_object, json_schema"),
        )),
        None => Err(bad(F, "needs a string `type`")),
    }
}

/// A JSON schema given as an object (or, as vLLM also takes, as a string holding one).
fn json_schema(field: &str, v: &Value) -> Result<Constraint, ApiError> {
    let schema: Value = match v {
        Value::String(s) => {
            serde_json::from_str(s).map_err(|e| bad(field, format!("is not a JSON schema: {e}")))?
        }
        other => other.clone(),
    };
    if !schema.is_object() && !schema.is_boolean() {
        return Err(bad(field, "must be a JSON schema object"));
    }
    Ok(Constraint::JsonSchema(schema.to_string()))
}

/// `logit_bias` as (token id, bias) pairs, each id inside the vocabulary and each bias in
/// [-100, 100].
pub fn logit_bias(map: Option<&LogitBias>, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    const F: &str = "logit_bias";
    let Some(map) = map else {
        return Ok(Vec::new());
    };
    if map.len() > MAX_LOGIT_BIAS {
        return Err(bad(
            F,
            format!(
                "holds {} entries; at most {MAX_LOGIT_BIAS} are accepted",
                map.len()
            ),
        ));
    }
    map.iter()
        .map(|(k, &b)| {
            let id: u32 = k
                .parse()
                .map_err(|_| bad(F, format!("key {k:?} is not a token id")))?;
            if id as usize >= vocab {
                return Err(bad(
                    F,
                    format!("token {id} is outside the vocabulary (size {vocab})"),
                ));
            }
            if !b.is_finite() || b.abs() > MAX_LOGIT_BIAS_VALUE {
                return Err(bad(F, format!("bias of token {id} must be in [-100, 100]")));
            }
            Ok((id, b))
        })
        .collect()
}

/// What a chat request's `tool_choice` asks of the output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// `auto` (or unset with tools): the model may call tools; a parser finds the calls.
    Auto,
    /// `none`, or no tools: plain content.
    None,
    /// `required`: one or more calls, the output constrained to a JSON array of them.
    Required,
    /// A named function: the output is that function's arguments, constrained by its schema.
    Named(String),
}

/// The tool choice of a chat request and, for `required` and a named function, the grammar
/// that enforces it.
pub fn tool_choice(
    tools: Option<&Value>,
    choice: Option<&Value>,
) -> Result<(ToolChoice, Option<Constraint>), ApiError> {
    const F: &str = "tool_choice";
    let functions = functions(tools)?;
    let choice = match choice {
        None if functions.is_empty() => ToolChoice::None,
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" if functions.is_empty() => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => return Err(bad(F, format!("{other:?} is not auto, none or required"))),
        },
        Some(v) => {
            let name = v
                .pointer("/function/name")
                .and_then(Value::as_str)
                .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| bad(F, "must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}"))?;
            ToolChoice::Named(name.to_string())
        }
    };
    let constraint = match &choice {
        ToolChoice::Required if functions.is_empty() => {
            return Err(bad(F, "is \"required\" but the request has no `tools`"))
        }
        ToolChoice::Required => Some(required_calls_schema(&functions)),
        ToolChoice::Named(name) => {
            let (_, params) = functions.iter().find(|(n, _)| n == name).ok_or_else(|| {
                bad(
                    F,
                    format!("names function {name:?}, which is not in `tools`"),
                )
            })?;
            Some(Constraint::JsonSchema(params.to_string()))
        }
        _ => None,
    };
    Ok((choice, constraint))
}

/// The tools' functions: (name, parameters schema).
fn functions(tools: Option<&Value>) -> Result<Vec<(String, Value)>, ApiError> {
    let Some(tools) = tools else {
        return Ok(Vec::new());
    };
    let list = tools
        .as_array()
        .ok_or_else(|| bad("tools", "must be an array"))?;
    list.iter()
        .enumerate()
        .map(|(i, t)| {
            let name = t
                .pointer("/function/name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad(&format!("tools[{i}]"), "needs `function.name`"))?;
            let params = t
                .pointer("/function/parameters")
                .cloned()
                .unwrap_or_else(|| json!({"type": "object"}));
            Ok((name.to_string(), params))
        })
        .collect()
}

/// `required`: a non-empty JSON array of `{"name": <a tool>, "parameters": <its schema>}`.
fn required_calls_schema(functions: &[(String, Value)]) -> Constraint {
    let calls: Vec<Value> = functions
        .iter()
        .map(|(name, params)| {
            json!({
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": false,
            })
        })
        .collect();
    let schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": calls}});
    Constraint::JsonSchema(schema.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::NvExt;

    #[test]
    fn response_format_and_guided_fields_make_one_constraint() {
        let g = |rf: Value| Guided {
            response_format: Some(rf),
            ..Guided::default()
        };
        assert_eq!(constraint(&g(json!({"type": "text"}))).unwrap(), None);
        assert_eq!(
            constraint(&g(json!({"type": "json_object"}))).unwrap(),
            Some(Constraint::JsonObject)
        );
        let schema = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}});
        assert_eq!(
            constraint(&g(schema)).unwrap(),
            Some(Constraint::JsonSchema("{\"type\":\"integer\"}".into()))
        );
        let e = constraint(&g(json!({"type": "yaml"}))).unwrap_err();
        assert!(e.message.contains("yaml"), "{}", e.message);
        let both = Guided {
            guided_regex: Some("a+".into()),
            nvext: Some(NvExt {
                guided_choice: Some(vec!["x".into()]),
                ..NvExt::default()
            }),
            ..Guided::default()
        };
        let e = constraint(&both).unwrap_err();
        assert!(e.message.contains("cannot be combined"), "{}", e.message);
        let empty = Guided {
            guided_choice: Some(vec![]),
            ..Guided::default()
        };
        assert!(constraint(&empty).unwrap_err().message.contains("empty"));
    }

    #[test]
    fn logit_bias_keys_and_values_are_checked() {
        let m = |k: &str, v: f32| LogitBias::from([(k.to_string(), v)]);
        assert_eq!(
            logit_bias(Some(&m("5", -3.0)), 10).unwrap(),
            vec![(5, -3.0)]
        );
        for (k, v, what) in [
            ("x", 1.0, "not a token id"),
            ("10", 1.0, "outside"),
            ("1", 101.0, "[-100, 100]"),
        ] {
            let e = logit_bias(Some(&m(k, v)), 10).unwrap_err();
            assert!(e.message.contains(what), "{}", e.message);
        }
    }

    #[test]
    fn forced_tool_choices_become_grammars() {
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
        let (c, g) = tool_choice(Some(&tools), None).unwrap();
        assert_eq!((c, g), (ToolChoice::Auto, None));
        let (c, g) = tool_choice(None, Some(&json!("auto"))).unwrap();
        assert_eq!((c, g), (ToolChoice::None, None));
        let (c, g) = tool_choice(Some(&tools), Some(&json!("required"))).unwrap();
        assert_eq!(c, ToolChoice::Required);
        assert!(matches!(g, Some(Constraint::JsonSchema(s)) if s.contains("get_weather")));
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let (c, g) = tool_choice(Some(&tools), Some(&named)).unwrap();
        assert_eq!(c, ToolChoice::Named("get_weather".into()));
        assert!(matches!(g, Some(Constraint::JsonSchema(s)) if s.contains("city")));
        let other = json!({"type": "function", "function": {"name": "nope"}});
        assert!(tool_choice(Some(&tools), Some(&other)).is_err());
        assert!(tool_choice(None, Some(&json!("required"))).is_err());
    }
}
