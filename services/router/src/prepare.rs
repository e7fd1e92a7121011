//! From a request body to a [`Prepared`] request: parse, find the model, check the sizes a
//! client controls, bound the prompt's length before tokenizing it, render and tokenize off
//! the async threads, turn the fields into sampling parameters, and take the request from
//! the rate limits. Every refusal is a 4xx naming what was wrong.

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use tandem_text::{Constraint, SamplingParams};
use tokio::sync::Semaphore;

use crate::app::AppState;
use crate::completion;
use crate::error::ApiError;
use crate::limits::{RateLimits, LARGE_PROMPT_BYTES, MAX_MESSAGES, MAX_TOOLS};
use crate::media::{self, PlacedImage};
use crate::models::{ModelAssets, ModelView};
use crate::openai::{parse_body, ChatCompletionRequest, CompletionRequest, PromptField};
use crate::params;
use crate::respond::{Kind, Meta};
use crate::shape::OutputShape;
use crate::structured;
use crate::tenancy::Tenant;
use tandem_kv_router::protocols::CacheSalt;

/// Large prompts tokenized at once; the others wait for a turn, small prompts never do.
static LARGE_PROMPTS: Semaphore = Semaphore::const_new(2);

/// A request ready for [`crate::generate::start`].
pub struct Prepared {
    pub meta: Meta,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub priority: i32,
    pub stream: bool,
    pub include_usage: bool,
    pub want_logprobs: bool,
    pub view: Arc<ModelView>,
    /// The caller's rate limits (its API key's, or the shared ones), charged as tokens stream.
    pub limits: Arc<RateLimits>,
    /// The salt of the prompt's KV block hashes (the tenant's and the request's `cache_salt`).
    pub cache_salt: Option<CacheSalt>,
    /// The images of a chat prompt, placed at their image tokens.
    pub images: Vec<PlacedImage>,
    /// How the output is shaped into content, reasoning and tool calls.
    pub shape: OutputShape,
    /// `--router-mode direct`: the worker the client named (header or `nvext`).
    pub target: Option<u64>,
    /// A batched completion's other prompts (`prompt` is the first); choice `j` of prompt `i`
    /// is answered as choice `i * n + j`.
    pub more_prompts: Vec<Vec<u32>>,
}

/// A refused request, with what its metrics are labelled with.
pub struct Refusal {
    pub error: ApiError,
    /// The served model's name; empty when the request named no served model, so client
    /// input never becomes a metric label.
    pub model: String,
    pub stream: bool,
}

impl Refusal {
    fn unlabelled(error: ApiError) -> Self {
        Refusal {
            error,
            model: String::new(),
            stream: false,
        }
    }
}

/// The response's identity: `chatcmpl-` or `cmpl-` and the request id, the served model, now.
fn meta(kind: Kind, rid: &str, model: &str) -> Meta {
    let prefix = match kind {
        Kind::Chat => "chatcmpl",
        Kind::Completion => "cmpl",
    };
    Meta {
        kind,
        id: format!("{prefix}-{rid}"),
        model: model.to_string(),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    }
}

/// Refusals of a request for the served model `model`, labelled with it.
fn labelled(model: &str, stream: bool) -> impl Fn(ApiError) -> Refusal + Copy + '_ {
    move |error| Refusal {
        error,
        model: model.to_string(),
        stream,
    }
}

/// The served model `name`, or 404.
fn served(state: &AppState, name: &str) -> Result<Arc<ModelView>, Refusal> {
    state
        .registry
        .view(name)
        .ok_or_else(|| Refusal::unlabelled(ApiError::not_found_model(name)))
}

pub async fn chat(
    state: &AppState,
    body: &[u8],
    rid: &str,
    tenant: &Tenant,
    headers: &axum::http::HeaderMap,
) -> Result<Prepared, Refusal> {
    let req: ChatCompletionRequest = parse_body(body).map_err(Refusal::unlabelled)?;
    let view = served(state, &req.model)?;
    let stream = req.stream;
    let fail = labelled(&view.name, stream);
    check_chat_sizes(&req).map_err(fail)?;
    let cache_salt = tenant.cache_salt(req.cache_salt.as_deref()).map_err(fail)?;
    let target = direct_target(state, headers, req.nvext.as_ref()).map_err(fail)?;
    stream_options_need_stream(req.stream_options.is_some(), req.stream).map_err(fail)?;
    let lp = params::chat_logprobs(req.logprobs, req.top_logprobs).map_err(fail)?;
    let (tool_choice, forced) =
        structured::tool_choice(req.tools.as_ref(), req.tool_choice.as_ref()).map_err(fail)?;
    let params = sampling_params(&view, req.common(), lp, forced).map_err(fail)?;
    let text_bytes = content_bytes(&req.messages);
    check_prompt_bound(&view, text_bytes, params.max_tokens, "messages").map_err(fail)?;
    let priority = params::priority(req.priority).map_err(fail)?;
    let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let images = chat_images(state, &view, &req.messages)
        .await
        .map_err(fail)?;
    let t = Instant::now();
    let assets = view.assets.clone();
    let (prompt, req) = off_thread(text_bytes, move || {
        (crate::chat::chat_prompt(&assets, &req), req)
    })
    .await
    .map_err(fail)?;
    let (prompt, images) = match (prompt.map_err(fail)?, view.multimodal()) {
        (prompt, Some(mm)) if !images.is_empty() => {
            media::place(prompt, images, mm).map_err(fail)?
        }
        (prompt, _) => (prompt, Vec::new()),
    };
    metrics::histogram!("dynamo_frontend_tokenize_seconds").record(t.elapsed().as_secs_f64());
    tenant.limits.admit(prompt.len()).map_err(fail)?;
    if let Some(user) = &req.user {
        tracing::info!(request_id = rid, user = %user, "chat request");
    }
    let shape = OutputShape {
        tool_choice,
        tool_format: view.tool_format(),
        reasoning: view.reasoning_format(),
        call_id_prefix: rid.to_string(),
        ..OutputShape::plain()
    };
    Ok(Prepared {
        meta: meta(Kind::Chat, rid, &view.name),
        prompt,
        params,
        priority,
        stream,
        include_usage,
        want_logprobs: lp.is_some(),
        view,
        limits: tenant.limits.clone(),
        cache_salt,
        images,
        shape,
        target,
        more_prompts: Vec::new(),
    })
}

/// The images of a chat request's `image_url` parts, read, decoded and hashed; refused for a
/// model that does not take images, or past its per-request limit.
async fn chat_images(
    state: &AppState,
    view: &ModelView,
    messages: &Value,
) -> Result<Vec<media::ImageInput>, ApiError> {
    let urls = media::image_urls(messages);
    if urls.is_empty() {
        return Ok(Vec::new());
    }
    let Some(mm) = view.multimodal() else {
        return Err(ApiError::bad_request(
            format!(
                "`{}` is an image, but model `{}` does not take images",
                urls[0].0, view.name
            ),
            Some(&urls[0].0),
        ));
    };
    let router_limit = state.config.media.max_images_per_request;
    let limit = mm.max_images_per_request.min(router_limit) as usize;
    if urls.len() > limit {
        let whose = match mm.max_images_per_request <= router_limit {
            true => format!("model `{}`'s limit", view.name),
            false => "the limit of --max-images-per-request".to_string(),
        };
        return Err(ApiError::bad_request(
            format!(
                "{} images exceed {whose} of {limit} per request",
                urls.len()
            ),
            Some("messages"),
        ));
    }
    media::load(urls, media::policy(&state.config.media), &state.fetcher).await
}

pub async fn completion(
    state: &AppState,
    body: &[u8],
    rid: &str,
    tenant: &Tenant,
    headers: &axum::http::HeaderMap,
) -> Result<Prepared, Refusal> {
    let req: CompletionRequest = parse_body(body).map_err(Refusal::unlabelled)?;
    let view = served(state, &req.model)?;
    let stream = req.stream;
    let fail = labelled(&view.name, stream);
    let cache_salt = tenant.cache_salt(req.cache_salt.as_deref()).map_err(fail)?;
    let target = direct_target(state, headers, req.nvext.as_ref()).map_err(fail)?;
    stream_options_need_stream(req.stream_options.is_some(), req.stream).map_err(fail)?;
    let lp = params::completion_logprobs(req.logprobs).map_err(fail)?;
    let echo = req.echo.unwrap_or(false);
    if echo && req.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(fail(ApiError::bad_request(
            "`echo` with `suffix` is not supported: the prompt echoed would be the \
             fill-in-the-middle prompt",
            Some("echo"),
        )));
    }
    if echo && lp.is_some() {
        return Err(fail(ApiError::bad_request(
            "`echo` with `logprobs` (the prompt's logprobs) is not supported yet",
            Some("echo"),
        )));
    }
    let params = sampling_params(&view, req.common(), lp, None).map_err(fail)?;
    let priority = params::priority(req.priority).map_err(fail)?;
    let t = Instant::now();
    let prompts = completion::prompts(&view, req.prompt, req.suffix.as_deref()).map_err(fail)?;
    let mut tokenized = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let ids = completion_prompt(&view, prompt.clone(), params.max_tokens)
            .await
            .map_err(fail)?;
        tenant.limits.admit(ids.len()).map_err(fail)?;
        tokenized.push((prompt, ids));
    }
    metrics::histogram!("dynamo_frontend_tokenize_seconds").record(t.elapsed().as_secs_f64());
    let mut shape = OutputShape::plain();
    if echo {
        shape.echo = tokenized
            .iter()
            .map(|(p, ids)| completion::echo_text(&view, p, ids))
            .collect();
        shape.choices_per_prompt = params.n;
    }
    let mut ids = tokenized.into_iter().map(|(_, ids)| ids);
    let prompt = ids.next().unwrap_or_default();
    Ok(Prepared {
        meta: meta(Kind::Completion, rid, &view.name),
        prompt,
        params,
        priority,
        stream,
        include_usage: req.stream_options.as_ref().is_some_and(|o| o.include_usage),
        want_logprobs: lp.is_some(),
        view,
        limits: tenant.limits.clone(),
        cache_salt,
        images: Vec::new(),
        shape,
        target,
        more_prompts: ids.collect(),
    })
}

/// The request header naming the worker of a `--router-mode direct` request (the same name
/// as the response header that tells which worker served a request).
pub const TARGET_HEADER: &str = crate::handlers::WORKER_HEADER;

/// The worker a request names, from the header or Dynamo's `nvext.backend_instance_id`:
/// required in `--router-mode direct`, refused in the other modes (which choose themselves).
fn direct_target(
    state: &AppState,
    headers: &axum::http::HeaderMap,
    nvext: Option<&crate::openai::NvExt>,
) -> Result<Option<u64>, ApiError> {
    let bad = |m: String| ApiError::bad_request(m, Some(TARGET_HEADER));
    let header = match headers.get(TARGET_HEADER) {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .ok_or_else(|| {
                    bad(format!(
                        "header {TARGET_HEADER} must be a worker instance id"
                    ))
                })?,
        ),
    };
    let field = nvext.and_then(|n| n.backend_instance_id);
    let target = match (header, field) {
        (Some(h), Some(f)) if h != f => {
            return Err(bad(format!(
                "header {TARGET_HEADER} ({h}) and nvext.backend_instance_id ({f}) name different workers"
            )))
        }
        (h, f) => h.or(f),
    };
    let direct = state.kv.config().router_mode == tandem_kv_router::RouterMode::Direct;
    match (direct, target) {
        (true, None) => Err(bad(format!(
            "--router-mode direct needs the target worker: set header {TARGET_HEADER} or \
             nvext.backend_instance_id"
        ))),
        (false, Some(_)) => Err(bad(format!(
            "a target worker ({TARGET_HEADER} or nvext.backend_instance_id) is only taken with \
             --router-mode direct; this router chooses workers itself"
        ))),
        (_, t) => Ok(t),
    }
}

fn stream_options_need_stream(has_options: bool, stream: bool) -> Result<(), ApiError> {
    if has_options && !stream {
        return Err(ApiError::bad_request(
            "`stream_options` requires `stream: true`",
            Some("stream_options"),
        ));
    }
    Ok(())
}

/// The sampling parameters, with the stop token ids and logit bias checked against the
/// model's vocabulary, and the structured-output constraint (from the request's fields, or
/// `forced` by its tool choice).
fn sampling_params(
    view: &ModelView,
    common: crate::openai::CommonFields,
    logprobs: Option<usize>,
    forced: Option<Constraint>,
) -> Result<SamplingParams, ApiError> {
    let vocab = view.assets.tokenizer.vocab_size();
    let constraint = structured::constraint(&common.guided)?;
    let bias = structured::logit_bias(common.logit_bias.as_ref(), vocab)?;
    let mut p = params::sampling_params(common, logprobs)?;
    p.logit_bias = bias;
    p.constraint =
        match (constraint, forced) {
            (Some(_), Some(_)) => return Err(ApiError::bad_request(
                "`tool_choice` \"required\" or a named function already constrains the output; \
                 it cannot be combined with a structured-output field",
                Some("tool_choice"),
            )),
            (c, f) => c.or(f),
        };
    p.validate()
        .map_err(|e| ApiError::bad_request(e.to_string(), Some(e.field())))?;
    if let Some(bad) = p.stop_token_ids.iter().find(|id| **id as usize >= vocab) {
        return Err(ApiError::bad_request(
            format!("`stop_token_ids` holds {bad}, outside the vocabulary (size {vocab})"),
            Some("stop_token_ids"),
        ));
    }
    Ok(p)
}

/// At most [`MAX_MESSAGES`] messages and [`MAX_TOOLS`] tools.
fn check_chat_sizes(req: &ChatCompletionRequest) -> Result<(), ApiError> {
    if let Some(list) = req.messages.as_array() {
        if list.len() > MAX_MESSAGES {
            return Err(ApiError::bad_request(
                format!(
                    "`messages` holds {} messages; at most {MAX_MESSAGES} are accepted",
                    list.len()
                ),
                Some("messages"),
            ));
        }
    }
    if let Some(tools) = req.tools.as_ref().and_then(Value::as_array) {
        if tools.len() > MAX_TOOLS {
            return Err(ApiError::bad_request(
                format!(
                    "`tools` holds {} tools; at most {MAX_TOOLS} are accepted",
                    tools.len()
                ),
                Some("tools"),
            ));
        }
    }
    Ok(())
}

/// Bytes of the text in the messages' `content` (strings, and text parts), which the chat
/// template copies into the prompt.
fn content_bytes(messages: &Value) -> usize {
    fn strings(v: &Value) -> usize {
        match v {
            Value::String(s) => s.len(),
            Value::Array(a) => a.iter().map(strings).sum(),
            Value::Object(o) => o.get("text").map_or(0, strings),
            _ => 0,
        }
    }
    messages.as_array().map_or(0, |list| {
        list.iter()
            .filter_map(|m| m.get("content"))
            .map(strings)
            .sum()
    })
}

/// Refuses, before tokenizing, a prompt of `text_bytes` bytes that cannot fit the model's
/// context: it encodes to at least `Tokenizer::min_tokens` tokens.
fn check_prompt_bound(
    view: &ModelView,
    text_bytes: usize,
    max_tokens: Option<usize>,
    param: &str,
) -> Result<(), ApiError> {
    let Some(worker) = view.workers.first() else {
        return Ok(());
    };
    let context = worker.card.context_length as usize;
    let at_least = view.assets.tokenizer.min_tokens(text_bytes);
    let wanted = at_least.saturating_add(max_tokens.unwrap_or(1));
    if wanted > context {
        return Err(ApiError::bad_request(
            format!(
                "the prompt ({text_bytes} bytes, so at least {at_least} tokens) plus max_tokens \
                 ({}) exceeds the model's context length of {context} tokens",
                max_tokens.unwrap_or(1)
            ),
            Some(param),
        ));
    }
    Ok(())
}

/// The token ids of a completion prompt: text tokenized off the async threads, ids checked
/// against the vocabulary.
async fn completion_prompt(
    view: &ModelView,
    prompt: PromptField,
    max_tokens: Option<usize>,
) -> Result<Vec<u32>, ApiError> {
    match prompt {
        PromptField::Text(text) => {
            check_prompt_bound(view, text.len(), max_tokens, "prompt")?;
            let assets: Arc<ModelAssets> = view.assets.clone();
            off_thread(text.len(), move || assets.tokenizer.encode(&text, false))
                .await?
                .map_err(|e| {
                    ApiError::bad_request(
                        format!("cannot tokenize the prompt: {e}"),
                        Some("prompt"),
                    )
                })
        }
        PromptField::Tokens(ids) => {
            let vocab = view.assets.tokenizer.vocab_size() as u32;
            if let Some(bad) = ids.iter().find(|id| **id >= vocab) {
                return Err(ApiError::bad_request(
                    format!("token id {bad} is outside the vocabulary (size {vocab})"),
                    Some("prompt"),
                ));
            }
            Ok(ids)
        }
        PromptField::Batch(_) => Err(ApiError::bad_request(
            "a prompt must be a string or a list of token ids",
            Some("prompt"),
        )),
    }
}

/// Prompts up to this many bytes are rendered and tokenized on the request's own thread: a
/// few hundred microseconds, less than handing them to another thread costs (the hop, and
/// the tokenizer's per-thread caches and allocator pages warmed again on the other side).
const INLINE_PROMPT_BYTES: usize = 16 * 1024;

/// Runs `work` (rendering, tokenizing): a small prompt's in place, a larger one's on the
/// blocking pool so the async threads keep serving; prompts over [`LARGE_PROMPT_BYTES`] take
/// turns.
async fn off_thread<T: Send + 'static>(
    text_bytes: usize,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    if text_bytes <= INLINE_PROMPT_BYTES {
        return Ok(work());
    }
    let _turn = if text_bytes > LARGE_PROMPT_BYTES {
        Some(
            LARGE_PROMPTS
                .acquire()
                .await
                .map_err(|_| ApiError::internal("the tokenizer pool is closed"))?,
        )
    } else {
        None
    };
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn content_bytes_counts_strings_and_text_parts() {
        let m = json!([
            {"role": "system", "content": "abc"},
            {"role": "user", "content": [{"type": "text", "text": "de"}, {"type": "text", "text": "f"}]},
            {"role": "assistant", "content": null},
        ]);
        assert_eq!(content_bytes(&m), 6);
        assert_eq!(content_bytes(&json!("not a list")), 0);
    }
}
