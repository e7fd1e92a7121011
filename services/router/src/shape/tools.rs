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
    /// `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{..}<|tool_call_end|>..<|tool_calls_section_end|>` (Kimi K2).
    KimiK2,
    /// `<minimax:tool_call><invoke name="NAME"><parameter name="K">V</parameter></invoke></minimax:tool_call>` (MiniMax-M2).
    MinimaxM2,
    /// `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>` (GLM-4.5 to 4.7).
    Glm47,
    /// `<｜DSML｜function_calls><｜DSML｜invoke name="NAME"><｜DSML｜parameter name="K" string="true">V</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜function_calls>` (DeepSeek-V3.2).
    DeepSeekV32,
    /// `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{..}<|call|>`: a call
    /// in gpt-oss's Harmony format (the channel text before it stays content).
    Harmony,
}

const DS_CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const DS_CALLS_END: &str = "<｜tool▁calls▁end｜>";
const DS_CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const DS_CALL_END: &str = "<｜tool▁call▁end｜>";
const DS_SEP: &str = "<｜tool▁sep｜>";
const KIMI_SECTION_BEGIN: &str = "<|tool_calls_section_begin|>";
const KIMI_CALL_BEGIN: &str = "<|tool_call_begin|>";
const KIMI_ARGS_BEGIN: &str = "<|tool_call_argument_begin|>";
const KIMI_CALL_END: &str = "<|tool_call_end|>";
const HARMONY_CALL: &str = "<|channel|>commentary to=functions.";

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
            "kimi_k2" => ToolFormat::KimiK2,
            "minimax_m2" => ToolFormat::MinimaxM2,
            "glm47" => ToolFormat::Glm47,
            "deepseek_v3_2" => ToolFormat::DeepSeekV32,
            // Nemotron Nano writes Qwen3-Coder's XML.
            "nemotron_nano" => ToolFormat::Qwen3Coder,
            "harmony" => ToolFormat::Harmony,
            _ => return None,
        })
    }

    /// The tag a block of calls starts with (None: calls are the whole output).
    pub fn start(self) -> Option<&'static str> {
        Some(match self {
            ToolFormat::Hermes | ToolFormat::Qwen3Coder | ToolFormat::Glm47 => "<tool_call>",
            ToolFormat::Llama3Json => "<|python_tag|>",
            ToolFormat::Mistral => "[TOOL_CALLS]",
            ToolFormat::Jamba => "<tool_calls>",
            ToolFormat::NemotronDeci => "<TOOLCALL>",
            ToolFormat::Phi4 => "functools",
            ToolFormat::DeepSeekV3 | ToolFormat::DeepSeekV31 => DS_CALLS_BEGIN,
            ToolFormat::KimiK2 => KIMI_SECTION_BEGIN,
            ToolFormat::MinimaxM2 => "<minimax:tool_call>",
            ToolFormat::DeepSeekV32 => "<｜DSML｜function_calls>",
            ToolFormat::Harmony => HARMONY_CALL,
            ToolFormat::Pythonic => return None,
        })
    }

    /// Where a block ends (None: at the end of the output).
    pub fn end(self) -> Option<&'static str> {
        match self {
            ToolFormat::Hermes | ToolFormat::Qwen3Coder | ToolFormat::Glm47 => Some("</tool_call>"),
            ToolFormat::KimiK2 => Some("<|tool_calls_section_end|>"),
            ToolFormat::MinimaxM2 => Some("</minimax:tool_call>"),
            ToolFormat::DeepSeekV32 => Some("</｜DSML｜function_calls>"),
            ToolFormat::Harmony => Some("<|call|>"),
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
            ToolFormat::KimiK2 => kimi_calls(inner)?,
            ToolFormat::MinimaxM2 => super::xml_calls::invokes(inner, &super::xml_calls::MINIMAX)?,
            ToolFormat::DeepSeekV32 => super::xml_calls::invokes(inner, &super::xml_calls::DSML)?,
            ToolFormat::Glm47 => vec![super::xml_calls::glm47(inner)?],
            ToolFormat::Harmony => vec![harmony_call(inner)?],
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
        args.insert(key.to_string(), super::xml_calls::loose_value(value));
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

/// Kimi K2's calls: `functions.NAME:INDEX<|tool_call_argument_begin|>{..}` between
/// call begin and end markers.
fn kimi_calls(inner: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    for part in inner.split(KIMI_CALL_BEGIN).skip(1) {
        let (body, _) = part.split_once(KIMI_CALL_END)?;
        let (id, args) = body.split_once(KIMI_ARGS_BEGIN)?;
        let id = id.trim();
        let name = id.strip_prefix("functions.").unwrap_or(id);
        // The call's index follows the last ':'.
        let name = name.rsplit_once(':').map_or(name, |(n, _)| n);
        let v: Value = serde_json::from_str(args.trim()).ok()?;
        v.is_object().then_some(())?;
        calls.push(ToolCall {
            name: name.to_string(),
            arguments: v.to_string(),
        });
    }
    Some(calls)
}

/// A Harmony call after its `to=functions.` prefix: `NAME [<|constrain|>json]<|message|>{..}`.
fn harmony_call(inner: &str) -> Option<ToolCall> {
    let (head, args) = inner.split_once("<|message|>")?;
    let name = head.split("<|constrain|>").next()?.trim();
    let name = name.split_whitespace().next()?;
    let v: Value = serde_json::from_str(args.trim()).ok()?;
    v.is_object().then_some(())?;
    Some(ToolCall {
        name: name.to_string(),
        arguments: v.to_string(),
    })
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
        let cases: [(ToolFormat, &str); 16] = [
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
            (ToolFormat::KimiK2, "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|><|tool_calls_section_end|>"),
            (ToolFormat::MinimaxM2, "<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Paris</parameter>\n</invoke>\n</minimax:tool_call>"),
            (ToolFormat::Glm47, "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"),
            (ToolFormat::Glm47, "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"),
            (ToolFormat::DeepSeekV32, "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>"),
            (ToolFormat::Harmony, "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|>"),
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
        // Several calls, typed values.
        assert_eq!(
            ToolFormat::KimiK2.parse_block("<|tool_calls_section_begin|><|tool_call_begin|>functions.a:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_call_begin|>functions.b:1<|tool_call_argument_begin|>{\"x\": 1}<|tool_call_end|><|tool_calls_section_end|>"),
            Some(vec![call("a", "{}"), call("b", "{\"x\":1}")])
        );
        assert_eq!(
            ToolFormat::MinimaxM2.parse_block("<minimax:tool_call><invoke name=\"a\"><parameter name=\"n\">3</parameter><parameter name=\"s\">three</parameter></invoke><invoke name=\"b\"></invoke></minimax:tool_call>"),
            Some(vec![call("a", "{\"n\":3,\"s\":\"three\"}"), call("b", "{}")])
        );
        assert_eq!(
            ToolFormat::DeepSeekV32.parse_block("<｜DSML｜function_calls><｜DSML｜invoke name=\"a\"><｜DSML｜parameter name=\"n\" string=\"false\">[1, 2]</｜DSML｜parameter><｜DSML｜parameter name=\"s\" string=\"true\">12</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜function_calls>"),
            Some(vec![call("a", "{\"n\":[1,2],\"s\":\"12\"}")])
        );
        assert_eq!(
            ToolFormat::Glm47.parse_block("<tool_call>a<arg_key>n</arg_key><arg_value>2</arg_value><arg_key>s</arg_key><arg_value>x y</arg_value></tool_call>"),
            Some(vec![call("a", "{\"n\":2,\"s\":\"x y\"}")])
        );
        assert_eq!(
            ToolFormat::from_name("nemotron_nano"),
            Some(ToolFormat::Qwen3Coder)
        );
        for (f, bad) in [
            (ToolFormat::KimiK2, "<|tool_calls_section_begin|><|tool_call_begin|>functions.a:0<|tool_call_argument_begin|>{\"x\": <|tool_call_end|><|tool_calls_section_end|>"),
            (ToolFormat::MinimaxM2, "<minimax:tool_call><invoke name=\"a\"><parameter name=\"n\">3</invoke></minimax:tool_call>"),
            (ToolFormat::MinimaxM2, "<minimax:tool_call><invoke><parameter name=\"n\">3</parameter></invoke></minimax:tool_call>"),
            (ToolFormat::DeepSeekV32, "<｜DSML｜function_calls><｜DSML｜invoke name=\"a\"><｜DSML｜parameter name=\"n\" string=\"false\">not json</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜function_calls>"),
            (ToolFormat::Glm47, "<tool_call>a<arg_key>n</arg_key></tool_call>"),
            (ToolFormat::Glm47, "<tool_call><arg_key>n</arg_key><arg_value>1</arg_value></tool_call>"),
            (ToolFormat::Harmony, "<|channel|>commentary to=functions.a <|constrain|>json<|message|>{\"x\"<|call|>"),
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
