//! OpenAI response bodies and SSE chunks for chat and text completions.

use serde_json::{json, Value};
use tandem_text::TokenLogprob;

use crate::generate::{ChoiceDelta, UsageTotals};
use crate::models::ModelAssets;

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

pub fn usage_json(u: &UsageTotals) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
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

/// One streaming chunk for one choice delta.
pub fn chunk(meta: &Meta, assets: &ModelAssets, d: &ChoiceDelta, first: bool) -> Value {
    let lp = logprobs_json(meta.kind, assets, &d.logprobs);
    let choice = match meta.kind {
        Kind::Chat => {
            let mut delta = json!({"content": d.text});
            if first {
                delta["role"] = json!("assistant");
            }
            json!({"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason})
        }
        Kind::Completion => {
            json!({"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason})
        }
    };
    json!({
        "id": meta.id,
        "object": match meta.kind { Kind::Chat => "chat.completion.chunk", Kind::Completion => "text_completion" },
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
    })
}

/// The final usage-only chunk (`stream_options.include_usage`).
pub fn usage_chunk(meta: &Meta, u: &UsageTotals) -> Value {
    json!({
        "id": meta.id,
        "object": match meta.kind { Kind::Chat => "chat.completion.chunk", Kind::Completion => "text_completion" },
        "created": meta.created,
        "model": meta.model,
        "choices": [],
        "usage": usage_json(u),
    })
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
        want_logprobs: bool,
    ) -> Value {
        let choices: Vec<Value> = self
            .choices
            .into_iter()
            .map(|(index, (text, lps, finish))| {
                let lp = if want_logprobs { logprobs_json(meta.kind, assets, &lps) } else { Value::Null };
                match meta.kind {
                    Kind::Chat => json!({
                        "index": index,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": lp,
                        "finish_reason": finish,
                    }),
                    Kind::Completion => json!({"index": index, "text": text, "logprobs": lp, "finish_reason": finish}),
                }
            })
            .collect();
        json!({
            "id": meta.id,
            "object": match meta.kind { Kind::Chat => "chat.completion", Kind::Completion => "text_completion" },
            "created": meta.created,
            "model": meta.model,
            "choices": choices,
            "usage": usage_json(usage),
        })
    }
}
