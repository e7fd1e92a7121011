//! A chat choice's generated text turned into what the API returns: reasoning split from
//! content (`--dyn-reasoning-parser`), and tool calls found in the content (with
//! `--dyn-tool-call-parser`), or read from the JSON that a forced tool choice's grammar made
//! the model write. The same [`ChoiceShaper`] serves streaming (delta by delta) and whole
//! responses (one push, then finish).

pub mod pythonic;
pub mod reasoning;
pub mod tools;
pub mod xml_calls;

use reasoning::{partial_tag, ReasoningFormat, ThinkSplitter};
use tools::{ToolCall, ToolFormat};

use crate::structured::ToolChoice;

/// How a request's chat output is shaped.
#[derive(Debug, Clone)]
pub struct OutputShape {
    pub tool_choice: ToolChoice,
    /// The served model's tool-call format (its workers' `--dyn-tool-call-parser`).
    pub tool_format: Option<ToolFormat>,
    pub reasoning: Option<ReasoningFormat>,
    /// Tool call ids are this prefix, the choice index and the call's number.
    pub call_id_prefix: String,
    /// Completions' `echo`: each prompt's text, put before its choices' text.
    pub echo: Vec<String>,
    /// Choices per prompt (`n`): choice `i` answers prompt `i / choices_per_prompt`.
    pub choices_per_prompt: usize,
}

impl OutputShape {
    /// Plain text: completions, and chat without tools or parsers.
    pub fn plain() -> Self {
        Self {
            tool_choice: ToolChoice::None,
            tool_format: None,
            reasoning: None,
            call_id_prefix: String::new(),
            echo: Vec::new(),
            choices_per_prompt: 1,
        }
    }

    /// The echoed prompt text of choice `index` (empty without `echo`).
    pub fn echo_of(&self, index: usize) -> &str {
        self.echo
            .get(index / self.choices_per_prompt.max(1))
            .map_or("", String::as_str)
    }
}

/// What one delta (or a whole output) becomes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Shaped {
    pub content: String,
    pub reasoning: String,
    pub tool_calls: Vec<ToolCallDelta>,
}

impl Shaped {
    /// Appends `other` (a later piece of the same choice).
    pub fn extend(&mut self, other: Shaped) {
        self.content.push_str(&other.content);
        self.reasoning.push_str(&other.reasoning);
        self.tool_calls.extend(other.tool_calls);
    }
}

/// A tool call, or the next piece of one (OpenAI's `delta.tool_calls[]`): the id and name come
/// with a call's first piece only.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCallDelta {
    pub index: usize,
    pub id: Option<String>,
    pub name: Option<String>,
    pub arguments: String,
}

/// What happens to the content (after reasoning is split off).
#[derive(Debug)]
enum Tools {
    /// Content as written.
    Plain,
    /// Everything is the arguments of one call to this function (a named tool choice).
    Named { name: String, started: bool },
    /// `required`: a JSON array of calls, read at the end.
    Required { buf: String },
    /// `auto` with a parser: content until a call starts, calls parsed block by block.
    Parse {
        format: ToolFormat,
        buf: String,
        in_call: bool,
        wrote_content: bool,
    },
}

/// One choice's shaping state.
#[derive(Debug)]
pub struct ChoiceShaper {
    reasoning: Option<ThinkSplitter>,
    reasoning_text: String,
    tools: Tools,
    calls: usize,
    id_prefix: String,
}

impl ChoiceShaper {
    pub fn new(shape: &OutputShape, index: usize) -> Self {
        let tools = match (&shape.tool_choice, shape.tool_format) {
            (ToolChoice::Named(name), _) => Tools::Named {
                name: name.clone(),
                started: false,
            },
            (ToolChoice::Required, _) => Tools::Required { buf: String::new() },
            (ToolChoice::Auto, Some(format)) => Tools::Parse {
                format,
                buf: String::new(),
                in_call: false,
                wrote_content: false,
            },
            _ => Tools::Plain,
        };
        Self {
            reasoning: shape.reasoning.map(ThinkSplitter::new),
            reasoning_text: String::new(),
            tools,
            calls: 0,
            id_prefix: format!("{}_{index}", shape.call_id_prefix),
        }
    }

    /// Shapes the next piece of text.
    pub fn push(&mut self, text: &str) -> Shaped {
        let (content, reasoning) = match self.reasoning.as_mut() {
            Some(r) => r.push(text),
            None => (text.to_string(), String::new()),
        };
        self.reasoning_text.push_str(&reasoning);
        let mut out = self.content(&content, false);
        out.reasoning = reasoning;
        out
    }

    /// Shapes what is held back at the end of the output.
    pub fn finish(&mut self) -> Shaped {
        let (content, reasoning) = match self.reasoning.as_mut() {
            Some(r) => r.finish(),
            None => (String::new(), String::new()),
        };
        self.reasoning_text.push_str(&reasoning);
        let mut out = self.content(&content, true);
        out.reasoning = reasoning;
        out
    }

    /// Whether the choice called tools (its finish reason is then `tool_calls`, except for
    /// a named tool choice, which OpenAI ends with `stop`).
    pub fn called_tools(&self) -> bool {
        self.calls > 0 && !matches!(self.tools, Tools::Named { .. })
    }

    /// The reasoning text so far (for counting its tokens).
    pub fn reasoning_text(&self) -> &str {
        &self.reasoning_text
    }

    fn content(&mut self, text: &str, last: bool) -> Shaped {
        match &mut self.tools {
            Tools::Plain => Shaped {
                content: text.to_string(),
                ..Shaped::default()
            },
            Tools::Named { name, started } => {
                if text.is_empty() && (*started || !last) {
                    return Shaped::default();
                }
                let first = !*started;
                *started = true;
                let name = first.then(|| name.clone());
                let id = first.then(|| format!("call_{}_0", self.id_prefix));
                self.calls = 1;
                Shaped {
                    tool_calls: vec![ToolCallDelta {
                        index: 0,
                        id,
                        name,
                        arguments: text.to_string(),
                    }],
                    ..Shaped::default()
                }
            }
            Tools::Required { buf } => {
                buf.push_str(text);
                if !last {
                    return Shaped::default();
                }
                let buf = std::mem::take(buf);
                match tools::parse_required(&buf) {
                    Some(calls) => self.emit(calls),
                    None => Shaped {
                        content: buf,
                        ..Shaped::default()
                    },
                }
            }
            Tools::Parse { .. } => self.parse(text, last),
        }
    }

    /// `auto` with a parser: content passes until a call's start tag (held back while it may
    /// be one), then each complete block becomes calls, or content when it does not parse.
    fn parse(&mut self, text: &str, last: bool) -> Shaped {
        let Tools::Parse {
            format,
            buf,
            in_call,
            wrote_content,
        } = &mut self.tools
        else {
            return Shaped::default();
        };
        let format = *format;
        buf.push_str(text);
        let mut content = String::new();
        let mut calls: Vec<ToolCall> = Vec::new();
        loop {
            if !*in_call {
                let bare = format.bare_start().is_some_and(|c| {
                    !*wrote_content && content.is_empty() && buf.trim_start().starts_with(c)
                });
                match format.start().and_then(|tag| buf.find(tag)) {
                    _ if bare => *in_call = true,
                    Some(i) => {
                        content.push_str(&buf[..i]);
                        buf.drain(..i);
                        *in_call = true;
                    }
                    None => {
                        let keep = match (last, format.start()) {
                            (false, Some(tag)) => partial_tag(buf, tag),
                            _ => 0,
                        };
                        content.push_str(&buf[..buf.len() - keep]);
                        buf.drain(..buf.len() - keep);
                        break;
                    }
                }
            }
            let end = match format.end() {
                Some(end) => buf.find(end).map(|i| i + end.len()),
                None => last.then_some(buf.len()),
            };
            let Some(end) = end.or(last.then_some(buf.len())) else {
                break;
            };
            let block: String = buf.drain(..end).collect();
            *in_call = false;
            match format.parse_block(&block) {
                Some(c) => calls.extend(c),
                // Malformed: the client gets what the model wrote.
                None => content.push_str(&block),
            }
            if buf.is_empty() {
                break;
            }
        }
        if !content.trim().is_empty() {
            *wrote_content = true;
        }
        let mut out = self.emit(calls);
        out.content = content;
        out
    }

    /// Whole calls as deltas, numbered after those already sent.
    fn emit(&mut self, calls: Vec<ToolCall>) -> Shaped {
        let mut out = Shaped::default();
        for c in calls {
            let index = self.calls;
            self.calls += 1;
            out.tool_calls.push(ToolCallDelta {
                index,
                id: Some(format!("call_{}_{index}", self.id_prefix)),
                name: Some(c.name),
                arguments: c.arguments,
            });
        }
        out
    }
}

/// A whole output shaped at once (non-streaming responses).
pub fn shape_whole(shape: &OutputShape, index: usize, text: &str) -> (Shaped, ChoiceShaper) {
    let mut s = ChoiceShaper::new(shape, index);
    let mut out = s.push(text);
    out.extend(s.finish());
    (out, s)
}

/// The tool calls of a whole output, merged by index (streamed pieces joined).
pub fn merged_calls(deltas: &[ToolCallDelta]) -> Vec<ToolCallDelta> {
    let mut out: Vec<ToolCallDelta> = Vec::new();
    for d in deltas {
        match out.iter_mut().find(|c| c.index == d.index) {
            Some(c) => c.arguments.push_str(&d.arguments),
            None => out.push(d.clone()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(choice: ToolChoice, format: Option<ToolFormat>, reasoning: bool) -> OutputShape {
        OutputShape {
            tool_choice: choice,
            tool_format: format,
            reasoning: reasoning.then_some(ReasoningFormat::Think),
            call_id_prefix: "r1".into(),
            ..OutputShape::plain()
        }
    }

    /// Streams `text` in `step`-byte pieces; returns the joined content, reasoning and calls.
    fn stream(s: &OutputShape, text: &str, step: usize) -> (String, String, Vec<ToolCallDelta>) {
        let mut sh = ChoiceShaper::new(s, 0);
        let mut all = Shaped::default();
        let mut i = 0;
        while i < text.len() {
            let mut j = (i + step).min(text.len());
            while !text.is_char_boundary(j) {
                j += 1;
            }
            all.extend(sh.push(&text[i..j]));
            i = j;
        }
        all.extend(sh.finish());
        (all.content, all.reasoning, merged_calls(&all.tool_calls))
    }

    #[test]
    fn reasoning_content_and_parallel_calls_stream_at_any_boundary() {
        let s = shape(ToolChoice::Auto, Some(ToolFormat::Hermes), true);
        let text = "<think>need weather</think>\n\nChecking.<tool_call>\n{\"name\": \"w\", \"arguments\": {\"c\": \"P\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"t\", \"arguments\": {}}\n</tool_call>";
        for step in 1..text.len() {
            let (content, reasoning, calls) = stream(&s, text, step);
            assert_eq!(reasoning, "need weather", "step {step}");
            assert_eq!(content.trim(), "Checking.", "step {step}");
            let names: Vec<_> = calls.iter().map(|c| c.name.clone().unwrap()).collect();
            assert_eq!(names, ["w", "t"], "step {step}");
            assert_eq!(calls[0].arguments, "{\"c\":\"P\"}");
            assert_eq!(calls[1].id.as_deref(), Some("call_r1_0_1"));
        }
    }

    #[test]
    fn malformed_calls_and_other_tags_stay_content() {
        let s = shape(ToolChoice::Auto, Some(ToolFormat::Hermes), false);
        let bad = "x <tool_call>{\"name\": oops}</tool_call> y <tool_";
        for step in [1, 3, 100] {
            let (content, _, calls) = stream(&s, bad, step);
            assert_eq!(content, bad);
            assert!(calls.is_empty());
        }
        let unclosed = "<tool_call>{\"name\": \"w\"";
        assert_eq!(stream(&s, unclosed, 4).0, unclosed);
        let py = shape(ToolChoice::Auto, Some(ToolFormat::Pythonic), false);
        let (c, _, calls) = stream(&py, "[f(a=1), g(b='x')]", 3);
        assert_eq!((c.as_str(), calls.len()), ("", 2));
        assert_eq!(stream(&py, "[1] is a list", 3).0, "[1] is a list");
        assert_eq!(stream(&py, "no [f()] here", 3).0, "no [f()] here");
        let llama = shape(ToolChoice::Auto, Some(ToolFormat::Llama3Json), false);
        let (c, _, calls) = stream(&llama, " {\"name\": \"f\", \"parameters\": {\"a\": 1}}", 5);
        assert_eq!((c.as_str(), calls.len()), ("", 1));
        assert_eq!(stream(&llama, "I think {braces}", 5).0, "I think {braces}");
    }

    #[test]
    fn forced_choices_read_the_grammar_output() {
        let named = shape(ToolChoice::Named("w".into()), None, false);
        let (c, _, calls) = stream(&named, "{\"c\":\"P\"}", 2);
        assert_eq!(c, "");
        assert_eq!(calls.len(), 1);
        assert_eq!(
            (calls[0].name.as_deref(), calls[0].arguments.as_str()),
            (Some("w"), "{\"c\":\"P\"}")
        );
        let required = shape(ToolChoice::Required, None, false);
        let out = "[{\"name\":\"a\",\"parameters\":{}},{\"name\":\"b\",\"parameters\":{\"x\":2}}]";
        let (c, _, calls) = stream(&required, out, 7);
        assert_eq!((c.as_str(), calls.len()), ("", 2));
        assert_eq!(calls[1].arguments, "{\"x\":2}");
    }
}
