//! OpenAI response bodies and SSE chunks for chat and text completions.

use serde::Serialize;
use serde_json::{json, Value};
use tandem_text::TokenLogprob;

use crate::generate::{ChoiceDelta, UsageTotals};
use crate::models::ModelAssets;
use crate::shape::{self, OutputShape, Shaped, ToolCallDelta};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
}

/// What every chunk and body of one request shares.
#[derive(Clone)]
pub struct Meta {
    pub kind: Kind,
    pub id: String,
    pub model: String,
    pub created: u64,
}

fn token_text(assets: &ModelAssets, id: u32) -> String {
    assets.tokenizer.decode(&[id], false).unwrap_or_default()
}

/// Usage; `reasoning_tokens` (the tokens of the choices' reasoning) when a reasoning parser
/// split some out.
pub fn usage_json(u: &UsageTotals, reasoning_tokens: Option<usize>) -> Value {
    let mut v = json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    });
    if let Some(r) = reasoning_tokens {
        v["completion_tokens_details"] = json!({"reasoning_tokens": r});
    }
    v
}

/// Tokens of reasoning text (re-encoded: the output's own token boundaries are not kept).
pub fn reasoning_tokens(assets: &ModelAssets, texts: &[&str]) -> Option<usize> {
    let all: usize = texts
        .iter()
        .filter(|t| !t.is_empty())
        .map(|t| assets.tokenizer.encode(t, false).map_or(0, |ids| ids.len()))
        .sum();
    texts.iter().any(|t| !t.is_empty()).then_some(all)
}

fn tool_calls_json(calls: &[ToolCallDelta]) -> Value {
    calls
        .iter()
        .map(|c| {
            let mut f = json!({"arguments": c.arguments});
            if let Some(n) = &c.name {
                f["name"] = json!(n);
            }
            let mut v = json!({"index": c.index, "function": f});
            if let Some(id) = &c.id {
                v["id"] = json!(id);
                v["type"] = json!("function");
            }
            v
        })
        .collect()
}

/// `stop` becomes `tool_calls` when the choice called tools.
pub fn finish_reason(reason: Option<String>, called_tools: bool) -> Option<String> {
    match reason.as_deref() {
        Some("stop") if called_tools => Some("tool_calls".into()),
        _ => reason,
    }
}

/// Logprobs in the endpoint's format; `None` when none were asked for.
pub fn logprobs_json(kind: Kind, assets: &ModelAssets, lps: &[TokenLogprob]) -> Value {
    if lps.is_empty() {
        return Value::Null;
    }
    match kind {
        Kind::Chat => {
            let content: Vec<Value> = lps
                .iter()
                .map(|lp| {
                    let text = token_text(assets, lp.token);
                    json!({
                        "token": text,
                        "logprob": lp.logprob,
                        "bytes": text.as_bytes(),
                        "top_logprobs": lp.top.iter().map(|(t, l)| {
                            let tt = token_text(assets, *t);
                            json!({"token": tt, "logprob": l, "bytes": tt.as_bytes()})
                        }).collect::<Vec<_>>(),
                    })
                })
                .collect();
            json!({ "content": content })
        }
        Kind::Completion => {
            let tokens: Vec<String> = lps.iter().map(|lp| token_text(assets, lp.token)).collect();
            let token_logprobs: Vec<f32> = lps.iter().map(|lp| lp.logprob).collect();
            let top: Vec<Value> = lps
                .iter()
                .map(|lp| {
                    let m: serde_json::Map<String, Value> = lp
                        .top
                        .iter()
                        .map(|(t, l)| (token_text(assets, *t), json!(l)))
                        .collect();
                    Value::Object(m)
                })
                .collect();
            json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top})
        }
    }
}

/// A streaming chunk as it is serialised: borrowed fields, written straight to text (a
/// chunk goes out per token, so no intermediate JSON tree is built for it).
#[derive(Serialize)]
struct Chunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [ChunkChoice<'a>; 1],
}

#[derive(Serialize)]
struct ChunkChoice<'a> {
    index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    delta: Option<ChatDelta<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a str>,
    logprobs: Value,
    finish_reason: Option<&'a str>,
}

#[derive(Serialize)]
struct ChatDelta<'a> {
    content: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "str::is_empty")]
    reasoning_content: &'a str,
    #[serde(skip_serializing_if = "Value::is_null")]
    tool_calls: Value,
}

/// One streaming chunk for one choice delta, as JSON text (`shaped`: a chat delta's content,
/// reasoning and tool calls; `d.finish_reason` already final).
pub fn chunk(
    meta: &Meta,
    assets: &ModelAssets,
    d: &ChoiceDelta,
    shaped: &Shaped,
    first: bool,
) -> String {
    let (delta, text) = match meta.kind {
        Kind::Chat => {
            let tool_calls = match shaped.tool_calls.is_empty() {
                true => Value::Null,
                false => tool_calls_json(&shaped.tool_calls),
            };
            let delta = ChatDelta {
                content: &shaped.content,
                role: first.then_some("assistant"),
                reasoning_content: &shaped.reasoning,
                tool_calls,
            };
            (Some(delta), None)
        }
        Kind::Completion => (None, Some(d.text.as_str())),
    };
    let chunk = Chunk {
        id: &meta.id,
        object: match meta.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        },
        created: meta.created,
        model: &meta.model,
        choices: [ChunkChoice {
            index: d.index,
            delta,
            text,
            logprobs: logprobs_json(meta.kind, assets, &d.logprobs),
            finish_reason: d.finish_reason.as_deref(),
        }],
    };
    // Serialising borrowed strings and numbers cannot fail.
    serde_json::to_string(&chunk).unwrap_or_default()
}

/// The final usage-only chunk (`stream_options.include_usage`).
pub fn usage_chunk(meta: &Meta, u: &UsageTotals, reasoning_tokens: Option<usize>) -> Value {
    json!({
        "id": meta.id,
        "object": match meta.kind { Kind::Chat => "chat.completion.chunk", Kind::Completion => "text_completion" },
        "created": meta.created,
        "model": meta.model,
        "choices": [],
        "usage": usage_json(u, reasoning_tokens),
    })
}

/// What a non-streaming body includes beyond the text.
#[derive(Clone, Copy)]
pub struct Want<'a> {
    pub logprobs: bool,
    pub shape: &'a OutputShape,
}

/// A whole chat message: content (null when the choice only called tools), reasoning and
/// tool calls.
fn chat_message(s: &Shaped) -> Value {
    let content = match s.content.is_empty() && !s.tool_calls.is_empty() {
        true => Value::Null,
        false => json!(s.content),
    };
    let mut m = json!({"role": "assistant", "content": content});
    if !s.reasoning.is_empty() {
        m["reasoning_content"] = json!(s.reasoning);
    }
    if !s.tool_calls.is_empty() {
        let calls: Vec<Value> = shape::merged_calls(&s.tool_calls)
            .iter()
            .map(|c| {
                json!({"id": c.id, "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}})
            })
            .collect();
        m["tool_calls"] = json!(calls);
    }
    m
}

/// Accumulates deltas into a non-streaming body.
#[derive(Default)]
pub struct Collected {
    choices: std::collections::BTreeMap<usize, (String, Vec<TokenLogprob>, Option<String>)>,
}

impl Collected {
    pub fn push(&mut self, d: ChoiceDelta) {
        let entry = self.choices.entry(d.index).or_default();
        entry.0.push_str(&d.text);
        entry.1.extend(d.logprobs);
        if d.finish_reason.is_some() {
            entry.2 = d.finish_reason;
        }
    }

    pub fn body(
        self,
        meta: &Meta,
        assets: &ModelAssets,
        usage: &UsageTotals,
        want: Want<'_>,
    ) -> Value {
        let mut reasoning: Vec<String> = Vec::new();
        let choices: Vec<Value> = self
            .choices
            .into_iter()
            .map(|(index, (text, lps, finish))| {
                let lp = if want.logprobs { logprobs_json(meta.kind, assets, &lps) } else { Value::Null };
                match meta.kind {
                    Kind::Chat => {
                        let (shaped, shaper) = shape::shape_whole(want.shape, index, &text);
                        reasoning.push(shaped.reasoning.clone());
                        json!({
                            "index": index,
                            "message": chat_message(&shaped),
                            "logprobs": lp,
                            "finish_reason": finish_reason(finish, shaper.called_tools()),
                        })
                    }
                    Kind::Completion => {
                        let text = format!("{}{text}", want.shape.echo_of(index));
                        json!({"index": index, "text": text, "logprobs": lp, "finish_reason": finish})
                    }
                }
            })
            .collect();
        let texts: Vec<&str> = reasoning.iter().map(String::as_str).collect();
        let reasoning_tokens = reasoning_tokens(assets, &texts);
        json!({
            "id": meta.id,
            "object": match meta.kind { Kind::Chat => "chat.completion", Kind::Completion => "text_completion" },
            "created": meta.created,
            "model": meta.model,
            "choices": choices,
            "usage": usage_json(usage, reasoning_tokens),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(kind: Kind) -> Meta {
        Meta {
            kind,
            id: "chatcmpl-1".into(),
            model: "m".into(),
            created: 7,
        }
    }

    fn delta(text: &str, finish: Option<&str>) -> ChoiceDelta {
        ChoiceDelta {
            index: 1,
            text: text.into(),
            logprobs: Vec::new(),
            finish_reason: finish.map(str::to_owned),
        }
    }

    fn parsed(chunk: String) -> Value {
        serde_json::from_str(&chunk).expect("a chunk is JSON")
    }

    #[test]
    fn chat_chunks_carry_the_role_first_and_reasoning_and_calls_when_there_are_some() {
        let assets = crate::generate::tests::assets();
        let shaped = Shaped {
            content: "a".into(),
            ..Shaped::default()
        };
        let d = delta("a", None);
        assert_eq!(
            parsed(chunk(&meta(Kind::Chat), &assets, &d, &shaped, true)),
            json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7,
                   "model": "m", "choices": [{"index": 1,
                   "delta": {"content": "a", "role": "assistant"},
                   "logprobs": null, "finish_reason": null}]})
        );
        let shaped = Shaped {
            content: String::new(),
            reasoning: "hm".into(),
            tool_calls: vec![ToolCallDelta {
                index: 0,
                id: Some("call_1".into()),
                name: Some("f".into()),
                arguments: "{}".into(),
            }],
        };
        let d = delta("", Some("tool_calls"));
        let c = parsed(chunk(&meta(Kind::Chat), &assets, &d, &shaped, false));
        assert_eq!(
            c["choices"][0],
            json!({"index": 1, "delta": {"content": "", "reasoning_content": "hm",
                   "tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                   "function": {"name": "f", "arguments": "{}"}}]},
                   "logprobs": null, "finish_reason": "tool_calls"})
        );
    }

    #[test]
    fn completion_chunks_carry_the_text() {
        let assets = crate::generate::tests::assets();
        let d = delta("a b", Some("stop"));
        let c = parsed(chunk(
            &meta(Kind::Completion),
            &assets,
            &d,
            &Shaped::default(),
            true,
        ));
        assert_eq!(c["object"], "text_completion");
        assert_eq!(
            c["choices"],
            json!([{"index": 1, "text": "a b", "logprobs": null, "finish_reason": "stop"}])
        );
    }
}
