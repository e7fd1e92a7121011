//! Chat templates from `tokenizer_config.json`, rendered with minijinja the way
//! `transformers`' `apply_chat_template` renders them with Jinja2: `trim_blocks` and
//! `lstrip_blocks` on, Python string methods (pycompat), `raise_exception`, and a `tojson`
//! that writes what Python's `json.dumps` writes (", " and ": " separators, non-ASCII kept,
//! key order kept) — the Qwen3 template prints tool schemas with it.

use std::path::Path;

use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;

use crate::error::TextError;

const TEMPLATE_NAME: &str = "chat";

/// A compiled chat template with the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bytes", &self.source.len())
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

/// Inputs of one rendering, as `apply_chat_template` takes them.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ChatRequest<'a> {
    /// The conversation: objects with `role`, `content`, and optionally `reasoning_content`,
    /// `tool_calls`, `name`, ...
    pub messages: &'a serde_json::Value,
    /// Tool schemas, or none.
    pub tools: Option<&'a serde_json::Value>,
    pub add_generation_prompt: bool,
    /// Extra template variables (`enable_thinking`, ...), an object.
    pub extra: Option<&'a serde_json::Value>,
}

impl ChatTemplate {
    /// Reads the template from `tokenizer_config.json` of a model folder; `Ok(None)` when the
    /// file or its `chat_template` is absent.
    pub fn load(folder: &Path) -> Result<Option<Self>, TextError> {
        let path = folder.join("tokenizer_config.json");
        if !path.is_file() {
            return Ok(None);
        }
        let bytes = std::fs::read(&path).map_err(|e| TextError::io(&path, e))?;
        let cfg: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| TextError::BadFile {
                path: path.clone(),
                message: format!("not valid JSON: {e}"),
            })?;
        // The template is a string, or a list of {name, template} where "default" is the one.
        let source = match cfg.get("chat_template") {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(String::from)
                .ok_or_else(|| TextError::BadFile {
                    path: path.clone(),
                    message: "chat_template list has no \"default\" entry".into(),
                })?,
            _ => return Ok(None),
        };
        let token = |k: &str| match cfg.get(k) {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(v) => v.get("content").and_then(|c| c.as_str()).map(String::from),
            None => None,
        };
        let t = Self::new(source, token("bos_token"), token("eos_token"))
            .map_err(|e| TextError::Template(format!("{}: {e}", path.display())))?;
        Ok(Some(t))
    }

    /// Compiles a template source.
    pub fn new(
        source: String,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TextError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| TextError::Template(describe(&e)))?;
        Ok(ChatTemplate {
            env,
            source,
            bos_token,
            eos_token,
        })
    }

    /// The template's source text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Another template source with this one's `bos_token` and `eos_token`.
    pub fn replaced(&self, source: String) -> Result<Self, TextError> {
        Self::new(source, self.bos_token.clone(), self.eos_token.clone())
    }

    /// Renders a conversation into the prompt text.
    pub fn render(&self, req: &ChatRequest<'_>) -> Result<String, TextError> {
        let mut ctx = serde_json::Map::new();
        if let Some(serde_json::Value::Object(extra)) = req.extra {
            for (k, v) in extra {
                ctx.insert(k.clone(), v.clone());
            }
        }
        ctx.insert("messages".into(), req.messages.clone());
        if let Some(tools) = req.tools {
            ctx.insert("tools".into(), tools.clone());
        }
        ctx.insert(
            "add_generation_prompt".into(),
            req.add_generation_prompt.into(),
        );
        for (k, v) in [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
        ] {
            if let Some(v) = v {
                ctx.entry(k.to_string()).or_insert(v.clone().into());
            }
        }
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TextError::Template(describe(&e)))?;
        tmpl.render(Value::from_serialize(&ctx))
            .map_err(|e| TextError::Template(describe(&e)))
    }
}

fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    if let Some(d) = e.display_debug_info().to_string().lines().next() {
        if !d.is_empty() {
            s.push_str(&format!(" ({d})"));
        }
    }
    s
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent)`.
fn tojson(value: Value, indent: Option<usize>) -> Result<Value, Error> {
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = Vec::new();
    let res = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let mut ser = serde_json::Serializer::with_formatter(
                &mut out,
                serde_json::ser::PrettyFormatter::with_indent(&pad),
            );
            json.serialize(&mut ser)
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonFormatter);
            json.serialize(&mut ser)
        }
    };
    res.map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let s = String::from_utf8(out)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    // Marked safe: the template output is not HTML, nothing may be escaped.
    Ok(Value::from_safe_string(s))
}

/// Python's default `json.dumps` separators: `", "` between items, `": "` after keys.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tojson_writes_python_json() {
        let t = ChatTemplate::new("{{ x | tojson }}".into(), None, None).unwrap();
        let x = serde_json::json!({"x": {"b": [1, 2.5, "é<&>"], "a": null, "c": true}});
        let out = t
            .env
            .get_template(TEMPLATE_NAME)
            .unwrap()
            .render(Value::from_serialize(&x))
            .unwrap();
        assert_eq!(out, r#"{"b": [1, 2.5, "é<&>"], "a": null, "c": true}"#);
    }

    #[test]
    fn trims_blocks_and_has_python_methods_and_raise() {
        let t = ChatTemplate::new(
            "{% for m in messages %}\n  {% if m %}{{ m.content.strip().upper() }}{% endif %}|{% endfor %}".into(),
            None,
            None,
        )
        .unwrap();
        let msgs = serde_json::json!([{"content": " a "}, {"content": "b\n"}]);
        let req = ChatRequest {
            messages: &msgs,
            ..Default::default()
        };
        assert_eq!(t.render(&req).unwrap(), "A|B|");
        let t = ChatTemplate::new("{{ raise_exception('nope') }}".into(), None, None).unwrap();
        let e = t.render(&req).unwrap_err().to_string();
        assert!(e.contains("nope"), "{e}");
    }
}
