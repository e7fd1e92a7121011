//! One streaming `/v1/completions` request (or, with images, `/v1/chat/completions`) and the
//! timing of its SSE chunks.

use std::time::Instant;

use futures_util::StreamExt;
use serde_json::{json, Value};

use crate::stats::{Output, Record};
use crate::workload::Spec;

/// How prompts go on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PromptMode {
    /// Token-id arrays (exact ISL; our router accepts them).
    Tokens,
    /// Text, one word per token id, for servers that only take strings (ISL approximate).
    Text,
}

/// The images of `--images`, handed out in turn.
pub struct Images {
    urls: Vec<String>,
    next: std::sync::atomic::AtomicUsize,
}

impl Images {
    pub fn new(urls: Vec<String>) -> Self {
        Images {
            urls,
            next: Default::default(),
        }
    }

    /// The next image (round robin); `None` for an empty set.
    fn next(&self) -> Option<&str> {
        let i = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.urls
            .get(i % self.urls.len().max(1))
            .map(String::as_str)
    }
}

#[derive(Clone)]
pub struct Client {
    pub http: reqwest::Client,
    pub url: String,
    pub model: String,
    pub mode: PromptMode,
    /// Images as `data:` URLs (`--images`): each request is a chat completion of the next
    /// one (in turn) and the prompt as text; `url` is the chat endpoint.
    pub images: Option<std::sync::Arc<Images>>,
    pub sampling: Sampling,
    /// Run start: records are in seconds from it.
    pub t0: Instant,
}

/// What each request asks of the sampler.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sampling {
    /// Sent when set; else the server's default.
    pub temperature: Option<f64>,
    /// Top-2 logprobs, recorded in [`Record::output`].
    pub logprobs: bool,
}

/// Appends the tokens and top-2 margins of one SSE payload (either endpoint's format).
fn take_logprobs(v: &Value, out: &mut Output) {
    let Some(lp) = v.pointer("/choices/0/logprobs") else {
        return;
    };
    let margin = |mut top: Vec<f64>| {
        top.sort_by(|a, b| b.total_cmp(a));
        match top.as_slice() {
            [a, b, ..] => a - b,
            _ => 0.0,
        }
    };
    if let Some(content) = lp.get("content").and_then(Value::as_array) {
        for t in content {
            let top = t["top_logprobs"].as_array().map_or(Vec::new(), |a| {
                a.iter().filter_map(|x| x["logprob"].as_f64()).collect()
            });
            out.tokens
                .push(t["token"].as_str().unwrap_or_default().to_owned());
            out.margins.push(margin(top));
        }
        return;
    }
    let tokens = lp.get("tokens").and_then(Value::as_array);
    let tops = lp.get("top_logprobs").and_then(Value::as_array);
    for (i, t) in tokens.into_iter().flatten().enumerate() {
        let top = tops
            .and_then(|a| a.get(i))
            .and_then(Value::as_object)
            .map_or(Vec::new(), |m| {
                m.values().filter_map(Value::as_f64).collect()
            });
        out.tokens.push(t.as_str().unwrap_or_default().to_owned());
        out.margins.push(margin(top));
    }
}

/// The seed sent with a request, derived from its prompt: a seeded server (the mocker draws
/// tokens from it) answers the same workload with the same tokens on every run.
fn seed_of(spec: &Spec) -> u64 {
    spec.prompt.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, t| {
        (h ^ *t as u64).wrapping_mul(0x0100_0000_01b3)
    }) >> 1
}

/// Error classes in the report.
fn class_of(e: &reqwest::Error) -> &'static str {
    if e.is_timeout() {
        "timeout"
    } else if e.is_connect() {
        "connect"
    } else {
        "transport"
    }
}

/// Output tokens of one SSE event: the usage block's count when present, else whether a
/// choice carried text.
enum Event {
    Text,
    Usage(Usage),
    Done,
    Other,
}

/// The usage block of a stream's last chunk.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Usage {
    completion_tokens: usize,
    /// The server's count of prompt tokens and of those it had cached, when it gave them.
    prompt: Option<(usize, usize)>,
}

impl Usage {
    fn of(v: &Value) -> Option<Self> {
        let n = |p: &str| v.pointer(p).and_then(Value::as_u64).map(|n| n as usize);
        let completion_tokens = n("/usage/completion_tokens")?;
        let prompt = n("/usage/prompt_tokens").map(|p| {
            let cached = n("/usage/prompt_tokens_details/cached_tokens").unwrap_or(0);
            (p, cached)
        });
        Some(Self {
            completion_tokens,
            prompt,
        })
    }
}

/// Classifies one SSE payload; with `output`, also records its tokens and logprobs (one parse
/// serves both).
fn parse_event(data: &str, output: Option<&mut Output>) -> Result<Event, ()> {
    if data == "[DONE]" {
        return Ok(Event::Done);
    }
    let v: Value = serde_json::from_str(data).map_err(|_| ())?;
    if v.get("error").is_some() {
        return Err(());
    }
    if let Some(out) = output {
        take_logprobs(&v, out);
    }
    if let Some(usage) = Usage::of(&v) {
        // Usage may ride with the last text chunk too; text wins the timing.
        let has_text = v
            .pointer("/choices/0/text")
            .or_else(|| v.pointer("/choices/0/delta/content"))
            .and_then(Value::as_str)
            .is_some_and(|t| !t.is_empty());
        if !has_text {
            return Ok(Event::Usage(usage));
        }
    }
    // Only visible text counts as a token arrival (as in aiperf): a server sends empty text
    // for a token that ends inside a multi-byte character.
    let text = v
        .pointer("/choices/0/text")
        .or_else(|| v.pointer("/choices/0/delta/content"));
    match text.and_then(Value::as_str) {
        Some(t) if !t.is_empty() => Ok(Event::Text),
        _ => Ok(Event::Other),
    }
}

impl Client {
    fn body(&self, spec: &Spec) -> Value {
        let mut body = self.base_body(spec, seed_of(spec));
        if let Some(t) = self.sampling.temperature {
            body["temperature"] = json!(t);
        }
        if self.sampling.logprobs {
            if self.images.is_some() {
                body["logprobs"] = json!(true);
                body["top_logprobs"] = json!(2);
            } else {
                body["logprobs"] = json!(2);
            }
        }
        body
    }

    fn base_body(&self, spec: &Spec, seed: u64) -> Value {
        if let Some(image) = self.images.as_ref().and_then(|i| i.next()) {
            let words: Vec<String> = spec.prompt.iter().map(|t| format!("w{t}")).collect();
            return json!({
                "model": self.model,
                "seed": seed,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": image}},
                    {"type": "text", "text": words.join(" ")},
                ]}],
                "max_tokens": spec.max_tokens,
                "min_tokens": spec.max_tokens,
                "ignore_eos": true,
                "stream": true,
                "stream_options": {"include_usage": true},
            });
        }
        let prompt = match self.mode {
            PromptMode::Tokens => json!(spec.prompt),
            PromptMode::Text => {
                let words: Vec<String> = spec.prompt.iter().map(|t| format!("w{t}")).collect();
                json!(words.join(" "))
            }
        };
        json!({
            "model": self.model,
            "seed": seed,
            "prompt": prompt,
            "max_tokens": spec.max_tokens,
            "min_tokens": spec.max_tokens,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
    }

    fn now(&self) -> f64 {
        self.t0.elapsed().as_secs_f64()
    }

    pub async fn send(&self, spec: &Spec) -> Record {
        let mut rec = Record {
            start: self.now(),
            input_tokens: spec.prompt.len(),
            ..Record::default()
        };
        let fail = |mut r: Record, class: &str, now: f64| {
            r.error = Some(class.to_string());
            r.end = now;
            r
        };
        let resp = match self
            .http
            .post(&self.url)
            .json(&self.body(spec))
            .send()
            .await
        {
            Ok(r) => r,
            Err(e) => return fail(rec, class_of(&e), self.now()),
        };
        let status = resp.status();
        if !status.is_success() {
            let class = match status.as_u16() {
                429 => "http_429",
                400..=499 => "http_4xx",
                _ => "http_5xx",
            };
            let now = self.now();
            // Keep the start of the server's message: the class alone hides the cause.
            let body = resp.text().await.unwrap_or_default();
            rec.detail = Some(body.chars().take(300).collect());
            return fail(rec, class, now);
        }
        let mut stream = resp.bytes_stream();
        let mut buf: Vec<u8> = Vec::new();
        let mut text_chunks = 0usize;
        let mut usage = None;
        let mut output = self.sampling.logprobs.then(|| Output {
            seed: seed_of(spec),
            ..Output::default()
        });
        let mut done = false;
        while let Some(chunk) = stream.next().await {
            let bytes = match chunk {
                Ok(b) => b,
                Err(e) => return fail(rec, class_of(&e), self.now()),
            };
            let now = self.now();
            buf.extend_from_slice(&bytes);
            // SSE events end with a blank line; keep any partial event for the next chunk.
            while let Some(pos) = find_event_end(&buf) {
                let event: Vec<u8> = buf.drain(..pos.0 + pos.1).collect();
                let text = String::from_utf8_lossy(&event[..pos.0]);
                for line in text.lines() {
                    let Some(data) = line.strip_prefix("data:") else {
                        continue;
                    };
                    match parse_event(data.trim(), output.as_mut()) {
                        Ok(Event::Text) => {
                            text_chunks += 1;
                            rec.chunk_times.push(now);
                        }
                        Ok(Event::Usage(n)) => usage = Some(n),
                        Ok(Event::Done) => done = true,
                        Ok(Event::Other) => {}
                        Err(()) => {
                            rec.detail = Some(data.trim().chars().take(300).collect());
                            return fail(rec, "stream_error", now);
                        }
                    }
                }
            }
        }
        rec.end = self.now();
        if !done && usage.is_none() {
            let end = rec.end;
            return fail(rec, "stream_truncated", end);
        }
        rec.output_tokens = usage.map_or(text_chunks, |u: Usage| u.completion_tokens);
        rec.server_prompt = usage.and_then(|u| u.prompt);
        rec.output = output;
        if rec.chunk_times.is_empty() {
            let end = rec.end;
            return fail(rec, "no_output", end);
        }
        rec
    }
}

/// Position and length of the first event terminator (`\n\n` or `\r\n\r\n`).
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| (p, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_take_tokens_and_margins_from_either_endpoint() {
        let mut out = Output::default();
        let completion = json!({"choices": [{"text": "ab", "logprobs": {
            "tokens": ["a", "b"],
            "token_logprobs": [-0.1, -0.5],
            "top_logprobs": [{"a": -0.1, "x": -2.1}, {"b": -0.5}],
        }}]});
        take_logprobs(&completion, &mut out);
        let chat = json!({"choices": [{"delta": {"content": "c"}, "logprobs": {"content": [
            {"token": "c", "logprob": -0.3,
             "top_logprobs": [{"token": "d", "logprob": -0.9}, {"token": "c", "logprob": -0.3}]},
        ]}}]});
        take_logprobs(&chat, &mut out);
        take_logprobs(
            &json!({"choices": [{"text": "", "logprobs": null}]}),
            &mut out,
        );
        assert_eq!(out.tokens, ["a", "b", "c"]);
        let want = [2.0, 0.0, 0.6];
        for (got, want) in out.margins.iter().zip(want) {
            assert!((got - want).abs() < 1e-9, "{:?}", out.margins);
        }
    }

    #[test]
    fn events_are_classified() {
        assert!(matches!(parse_event("[DONE]", None), Ok(Event::Done)));
        assert!(matches!(
            parse_event(r#"{"choices":[{"text":"hi"}]}"#, None),
            Ok(Event::Text)
        ));
        assert!(matches!(
            parse_event(r#"{"choices":[],"usage":{"completion_tokens":7}}"#, None),
            Ok(Event::Usage(Usage {
                completion_tokens: 7,
                prompt: None
            }))
        ));
        let usage = r#"{"choices":[],"usage":{"completion_tokens":7,"prompt_tokens":40,
                        "prompt_tokens_details":{"cached_tokens":32}}}"#;
        assert!(matches!(
            parse_event(usage, None),
            Ok(Event::Usage(Usage {
                completion_tokens: 7,
                prompt: Some((40, 32))
            }))
        ));
        // Chat completions (`--images`): the text is the delta's content.
        assert!(matches!(
            parse_event(r#"{"choices":[{"delta":{"content":"hi"}}]}"#, None),
            Ok(Event::Text)
        ));
        assert!(matches!(
            parse_event(r#"{"choices":[{"delta":{"role":"assistant"}}]}"#, None),
            Ok(Event::Other)
        ));
        assert!(matches!(
            parse_event(r#"{"choices":[{"text":""}]}"#, None),
            Ok(Event::Other)
        ));
        assert!(parse_event("{not json", None).is_err());
        assert!(parse_event(r#"{"error":{"message":"x"}}"#, None).is_err());
    }

    #[test]
    fn event_boundaries() {
        assert_eq!(find_event_end(b"data: x\n\ndata: y"), Some((7, 2)));
        assert_eq!(find_event_end(b"data: x\r\n\r\n"), Some((7, 4)));
        assert_eq!(find_event_end(b"data: x\n"), None);
    }
}
