//! Tool calls in a model's output, in the formats of `--dyn-tool-call-parser`. A call that
//! does not parse stays in the content: the client sees what the model wrote, never an error.

use serde_json::{Map, Value};

/// One parsed call: the function's name and its arguments as JSON text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// The tool-call formats built in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>{"name": .., "arguments": {..}}</tool_call>` (Qwen, Hermes).
    Hermes,
    /// `<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`.
    Qwen3Coder,
    /// The whole output: `{"name": .., "parameters": {..}}`, several joined by `;`, optionally
    /// after `<|python_tag|>` (Llama 3).
    Llama3Json,
    /// `[TOOL_CALLS] [{"name": .., "arguments": {..}}, ..]`.
    Mistral,
    /// `<tool_calls>{"name": .., "arguments": {..}}</tool_calls>` (AI21 Jamba; an array too).
    Jamba,
    /// `<TOOLCALL>[{"name": .., "arguments": {..}}]</TOOLCALL>` (NVIDIA Nemotron).
    NemotronDeci,
    /// `functools{"name": .., "arguments": {..}}` (Phi-4; an array too), to the end.
    Phi4,
    /// `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + a fenced JSON block.
    DeepSeekV3,
    /// `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{..}<｜tool▁call▁end｜>`.
    DeepSeekV31,
    /// The whole output: `[get_weather(city="Paris"), get_time()]` (Llama 3.2 / 4).
    Pythonic,
}

const DS_CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const DS_CALLS_END: &str = "<｜tool▁calls▁end｜>";
const DS_CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const DS_CALL_END: &str = "<｜tool▁call▁end｜>";
const DS_SEP: &str = "<｜tool▁sep｜>";

impl ToolFormat {
    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "hermes" => ToolFormat::Hermes,
            "qwen3_coder" => ToolFormat::Qwen3Coder,
            "llama3_json" => ToolFormat::Llama3Json,
            "mistral" => ToolFormat::Mistral,
            "jamba" => ToolFormat::Jamba,
            "nemotron_deci" => ToolFormat::NemotronDeci,
            "phi4" => ToolFormat::Phi4,
            "deepseek_v3" => ToolFormat::DeepSeekV3,
            "deepseek_v3_1" => ToolFormat::DeepSeekV31,
            "pythonic" => ToolFormat::Pythonic,
            _ => return None,
        })
    }

    /// The tag a block of calls starts with (None: calls are the whole output).
    pub fn start(self) -> Option<&'static str> {
        Some(match self {
            ToolFormat::Hermes | ToolFormat::Qwen3Coder => "<tool_call>",
            ToolFormat::Llama3Json => "<|python_tag|>",
            ToolFormat::Mistral => "[TOOL_CALLS]",
            ToolFormat::Jamba => "<tool_calls>",
            ToolFormat::NemotronDeci => "<TOOLCALL>",
            ToolFormat::Phi4 => "functools",
            ToolFormat::DeepSeekV3 | ToolFormat::DeepSeekV31 => DS_CALLS_BEGIN,
            ToolFormat::Pythonic => return None,
        })
    }

    /// Where a block ends (None: at the end of the output).
    pub fn end(self) -> Option<&'static str> {
        match self {
            ToolFormat::Hermes | ToolFormat::Qwen3Coder => Some("</tool_call>"),
            ToolFormat::DeepSeekV3 | ToolFormat::DeepSeekV31 => Some(DS_CALLS_END),
            ToolFormat::Jamba => Some("</tool_calls>"),
            ToolFormat::NemotronDeci => Some("</TOOLCALL>"),
            ToolFormat::Llama3Json
            | ToolFormat::Mistral
            | ToolFormat::Phi4
            | ToolFormat::Pythonic => None,
        }
    }

    /// The character calls may begin with, untagged, at the start of the output.
    pub fn bare_start(self) -> Option<char> {
        match self {
            ToolFormat::Llama3Json => Some('{'),
            ToolFormat::Pythonic => Some('['),
            _ => None,
        }
    }

    /// The calls of one block (start tag included, end tag included when there is one);
    /// None when it does not parse.
    pub fn parse_block(self, block: &str) -> Option<Vec<ToolCall>> {
        let trimmed = block.trim();
        let inner = self
            .start()
            .and_then(|s| trimmed.strip_prefix(s))
            .unwrap_or(trimmed);
        let inner = match self.end() {
            Some(end) => inner.trim_end().strip_suffix(end)?,
            None => inner,
        };
        let calls = match self {
            ToolFormat::Hermes => vec![json_call(inner.trim(), &["arguments", "parameters"])?],
            ToolFormat::Qwen3Coder => vec![qwen3_coder_call(inner)?],
            ToolFormat::Llama3Json => inner
                .split(';')
                .filter(|s| !s.trim().is_empty())
                .map(|s| json_call(s.trim(), &["parameters", "arguments"]))
                .collect::<Option<Vec<_>>>()?,
            ToolFormat::Mistral
            | ToolFormat::Jamba
            | ToolFormat::NemotronDeci
            | ToolFormat::Phi4 => json_calls(inner)?,
            ToolFormat::DeepSeekV3 | ToolFormat::DeepSeekV31 => deepseek_calls(self, inner)?,
            ToolFormat::Pythonic => super::pythonic::parse(inner)?,
        };
        (!calls.is_empty()).then_some(calls)
    }
}

/// One call object or an array of them.
fn json_calls(inner: &str) -> Option<Vec<ToolCall>> {
    let keys = ["arguments", "parameters"];
    match serde_json::from_str::<Value>(inner.trim()).ok()? {
        Value::Array(a) => a.iter().map(|v| call_of(v, &keys)).collect(),
        v => Some(vec![call_of(&v, &keys)?]),
    }
}

/// A `{"name": .., <args key>: ..}` object.
fn json_call(text: &str, args_keys: &[&str]) -> Option<ToolCall> {
    call_of(&serde_json::from_str(text).ok()?, args_keys)
}

fn call_of(v: &Value, args_keys: &[&str]) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = args_keys.iter().find_map(|k| v.get(*k));
    let arguments = match args {
        None => "{}".to_string(),
        // Some models write the arguments as a JSON string.
        Some(Value::String(s)) => {
            serde_json::from_str::<Value>(s).ok()?;
            s.clone()
        }
        Some(a) if a.is_object() => a.to_string(),
        Some(_) => return None,
    };
    Some(ToolCall { name, arguments })
}

/// `<function=NAME><parameter=P>value</parameter>...</function>`: values that parse as JSON
/// keep their type, others are strings.
fn qwen3_coder_call(inner: &str) -> Option<ToolCall> {
    let rest = inner.trim().strip_prefix("<function=")?;
    let (name, mut rest) = rest.split_once('>')?;
    rest = rest.trim_end().strip_suffix("</function>")?;
    let mut args = Map::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        let after = rest.strip_prefix("<parameter=")?;
        let (key, after) = after.split_once('>')?;
        let (value, after) = after.split_once("</parameter>")?;
        let value = value.trim_matches('\n');
        let v = serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_string()));
        args.insert(key.to_string(), v);
        rest = after;
    }
    Some(ToolCall {
        name: name.trim().to_string(),
        arguments: Value::Object(args).to_string(),
    })
}

/// DeepSeek's calls between its begin/end markers.
fn deepseek_calls(format: ToolFormat, inner: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    for part in inner.split(DS_CALL_BEGIN).skip(1) {
        let body = part.split(DS_CALL_END).next()?;
        let (head, args) = body.split_once(DS_SEP)?;
        let (name, args) = match format {
            ToolFormat::DeepSeekV3 => {
                // head: "function"; args: "NAME\n```json\n{..}\n```"
                if head.trim() != "function" {
                    return None;
                }
                let (name, block) = args.split_once('\n')?;
                let json = block.trim().strip_prefix("```json")?.strip_suffix("```")?;
                (name.trim(), json.trim())
            }
            _ => (head.trim(), args.trim()),
        };
        let v: Value = serde_json::from_str(args).ok()?;
        v.is_object().then_some(())?;
        calls.push(ToolCall {
            name: name.to_string(),
            arguments: v.to_string(),
        });
    }
    Some(calls)
}

/// The calls of a `tool_choice: "required"` output: `[{"name": .., "parameters": {..}}, ..]`.
pub fn parse_required(text: &str) -> Option<Vec<ToolCall>> {
    match serde_json::from_str::<Value>(text.trim()).ok()? {
        Value::Array(a) if !a.is_empty() => a
            .iter()
            .map(|v| call_of(v, &["parameters", "arguments"]))
            .collect(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, args: &str) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: args.into(),
        }
    }

    /// Outputs as each model family writes them (recorded from the formats' chat templates
    /// and model cards), and malformed ones.
    #[test]
    fn each_format_parses_its_calls_and_refuses_malformed_ones() {
        let weather = call("get_weather", r#"{"city":"Paris"}"#);
        let cases: [(ToolFormat, &str); 10] = [
            (ToolFormat::Jamba, "<tool_calls>{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}</tool_calls>"),
            (ToolFormat::NemotronDeci, "<TOOLCALL>[{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}]</TOOLCALL>"),
            (ToolFormat::Phi4, "functools{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}"),
            (ToolFormat::Hermes, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"),
            (ToolFormat::Hermes, "<tool_call>{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\"}</tool_call>"),
            (ToolFormat::Qwen3Coder, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"),
            (ToolFormat::Llama3Json, "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}"),
            (ToolFormat::Mistral, "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]"),
            (ToolFormat::DeepSeekV3, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
            (ToolFormat::DeepSeekV31, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
        ];
        for (f, text) in cases {
            let got = f.parse_block(text);
            let want = match text.contains("\\\"city") {
                // Arguments written as a string stay that string.
                true => vec![call("get_weather", "{\"city\": \"Paris\"}")],
                false => vec![weather.clone()],
            };
            assert_eq!(got, Some(want), "{f:?}: {text}");
        }
        let two =
            "{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": 1}}";
        assert_eq!(
            ToolFormat::Llama3Json.parse_block(two),
            Some(vec![call("a", "{}"), call("b", "{\"x\":1}")])
        );
        for (f, bad) in [
            (ToolFormat::Hermes, "<tool_call>{\"name\": \"x\", \"arguments\": {\"a\": </tool_call>"),
            (ToolFormat::Hermes, "<tool_call>{\"arguments\": {}}</tool_call>"),
            (ToolFormat::Qwen3Coder, "<tool_call><function=f><parameter=a>1</tool_call>"),
            (ToolFormat::Mistral, "[TOOL_CALLS] not json"),
            (ToolFormat::NemotronDeci, "<TOOLCALL>[{\"name\":\"f\",\"arguments\":[1]}]</TOOLCALL>"),
            (ToolFormat::Phi4, "functools{\"name\":"),
            (ToolFormat::DeepSeekV3, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
        ] {
            assert_eq!(f.parse_block(bad), None, "{f:?}: {bad}");
        }
        assert_eq!(
            parse_required("[{\"name\":\"f\",\"parameters\":{\"a\":1}}]"),
            Some(vec![call("f", "{\"a\":1}")])
        );
        assert_eq!(parse_required("[]"), None);
    }
}
