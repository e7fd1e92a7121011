//! The XML-like tool-call bodies: MiniMax-M2's `<invoke name="..">`, DeepSeek-V3.2's DSML
//! (the same shape with `｜DSML｜` in its tag names and a `string` attribute per parameter)
//! and GLM-4.7's `<arg_key>` / `<arg_value>` pairs. Parameter values that parse as JSON keep
//! their type, others are strings (DSML says which with `string="true"`).

use serde_json::{Map, Value};

use super::tools::ToolCall;

/// The tag names of one `<invoke>` dialect.
pub struct InvokeTags {
    pub invoke: &'static str,
    pub parameter: &'static str,
    /// Parameters carry `string="true|false"` (DSML): false values must be JSON.
    pub typed: bool,
}

pub const MINIMAX: InvokeTags = InvokeTags {
    invoke: "invoke",
    parameter: "parameter",
    typed: false,
};

pub const DSML: InvokeTags = InvokeTags {
    invoke: "｜DSML｜invoke",
    parameter: "｜DSML｜parameter",
    typed: true,
};

/// Every `<invoke name="NAME"><parameter name="K">V</parameter>..</invoke>` of `body`, with
/// nothing but whitespace between them; None when one is malformed.
pub fn invokes(body: &str, tags: &InvokeTags) -> Option<Vec<ToolCall>> {
    let open = format!("<{}", tags.invoke);
    let close = format!("</{}>", tags.invoke);
    let mut calls = Vec::new();
    let mut rest = body.trim();
    while !rest.is_empty() {
        let after = rest.strip_prefix(open.as_str())?;
        let (attrs, after) = after.split_once('>')?;
        let name = attribute(attrs, "name")?;
        let (inner, after) = after.split_once(close.as_str())?;
        calls.push(ToolCall {
            name: name.to_string(),
            arguments: Value::Object(parameters(inner, tags)?).to_string(),
        });
        rest = after.trim_start();
    }
    Some(calls)
}

/// The `<parameter name="K">V</parameter>` elements of one invoke.
fn parameters(mut rest: &str, tags: &InvokeTags) -> Option<Map<String, Value>> {
    let open = format!("<{}", tags.parameter);
    let close = format!("</{}>", tags.parameter);
    let mut args = Map::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            return Some(args);
        }
        let after = rest.strip_prefix(open.as_str())?;
        let (attrs, after) = after.split_once('>')?;
        let key = attribute(attrs, "name")?;
        let (raw, after) = after.split_once(close.as_str())?;
        let value = match (tags.typed, attribute(attrs, "string")) {
            (true, Some("true")) => Value::String(raw.to_string()),
            (true, Some("false")) => serde_json::from_str(raw.trim()).ok()?,
            (true, _) => return None,
            (false, _) => loose_value(raw),
        };
        args.insert(key.to_string(), value);
        rest = after;
    }
}

/// GLM-4.7: `NAME<arg_key>K</arg_key><arg_value>V</arg_value>..` (line breaks allowed
/// between the parts).
pub fn glm47(body: &str) -> Option<ToolCall> {
    let body = body.trim();
    let (name, mut rest) = match body.find("<arg_key>") {
        Some(i) => body.split_at(i),
        None => (body, ""),
    };
    let name = name.trim();
    if name.is_empty() || name.contains('<') {
        return None;
    }
    let mut args = Map::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        let (key, after) = rest.strip_prefix("<arg_key>")?.split_once("</arg_key>")?;
        let after = after.trim_start().strip_prefix("<arg_value>")?;
        let (raw, after) = after.split_once("</arg_value>")?;
        args.insert(key.trim().to_string(), loose_value(raw));
        rest = after;
    }
    Some(ToolCall {
        name: name.to_string(),
        arguments: Value::Object(args).to_string(),
    })
}

/// A value written as text: JSON when it parses as JSON, else the text itself (line
/// breaks around it dropped).
pub fn loose_value(raw: &str) -> Value {
    let value = raw.trim_matches('\n');
    serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_string()))
}

/// The value of `key="..."` in a tag's attribute text (`key` as a whole word: `name` is
/// not the end of `filename`).
fn attribute<'a>(attrs: &'a str, key: &str) -> Option<&'a str> {
    let pattern = format!("{key}=\"");
    attrs.match_indices(&pattern).find_map(|(i, _)| {
        let whole = attrs[..i]
            .chars()
            .next_back()
            .is_none_or(char::is_whitespace);
        let value = &attrs[i + pattern.len()..];
        whole.then(|| value.find('"').map(|len| &value[..len]))?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_found_by_whole_name() {
        assert_eq!(attribute(r#" name="f""#, "name"), Some("f"));
        assert_eq!(
            attribute(r#" name="k" string="true""#, "string"),
            Some("true")
        );
        assert_eq!(attribute(r#" filename="f""#, "name"), None);
        assert_eq!(attribute(r#" filename="x" name="f""#, "name"), Some("f"));
        assert_eq!(attribute(r#" name="unterminated"#, "name"), None);
    }
}
