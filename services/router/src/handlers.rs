//! The HTTP handlers: `/v1/chat/completions`, `/v1/completions` and `/v1/models`.

use std::convert::Infallible;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde_json::json;
use tokio_stream::wrappers::ReceiverStream;

use crate::app::AppState;
use crate::auth::Caller;
use crate::error::ApiError;
use crate::generate::{self, GenEvent, Routed, UsageTotals};
use crate::metrics as m;
use crate::prepare::{self, Prepared};
use crate::respond::{self, Collected};
use crate::shape::{ChoiceShaper, OutputShape, Shaped};

pub const REQUEST_ID_HEADER: &str = "x-request-id";
/// The worker that served a request; sent only with `--expose-worker-id` (instance ids help
/// whoever would fence other users' leases).
pub const WORKER_HEADER: &str = "x-tandem-worker-id";
/// The (first) prefill worker of a disaggregated request; with `--expose-worker-id` too.
pub const PREFILL_WORKER_HEADER: &str = "x-tandem-prefill-worker-id";

pub fn request_id(headers: &HeaderMap) -> String {
    headers
        .get(REQUEST_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty() && s.len() <= 128 && s.chars().all(|c| c.is_ascii_graphic()))
        .map(str::to_string)
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string())
}

/// The id the workers and the load tracker see: the client's id (so logs correlate) plus a
/// random suffix, because two clients may send the same `x-request-id`.
fn internal_id(rid: &str) -> String {
    format!("{rid}-{:08x}", uuid::Uuid::new_v4().as_u128() as u32)
}

/// Counts a request in flight until dropped (the end of a stream included).
struct Inflight {
    model: String,
    endpoint: &'static str,
    started: Instant,
}

impl Inflight {
    fn new(model: &str, endpoint: &'static str) -> Self {
        metrics::gauge!(m::INFLIGHT_REQUESTS, "model" => model.to_string()).increment(1.0);
        Inflight {
            model: model.to_string(),
            endpoint,
            started: Instant::now(),
        }
    }
}

impl Drop for Inflight {
    fn drop(&mut self) {
        metrics::gauge!(m::INFLIGHT_REQUESTS, "model" => self.model.clone()).decrement(1.0);
        metrics::histogram!(m::REQUEST_DURATION_SECONDS, "model" => self.model.clone(), "endpoint" => self.endpoint)
            .record(self.started.elapsed().as_secs_f64());
    }
}

fn count(model: &str, endpoint: &'static str, stream: bool, status: &'static str) {
    metrics::counter!(m::REQUESTS_TOTAL, "model" => model.to_string(), "endpoint" => endpoint,
        "request_type" => if stream { "stream" } else { "unary" }, "status" => status)
    .increment(1);
}

fn with_headers(mut resp: Response, request_id: &str, routed: Option<&Routed>) -> Response {
    if let Ok(v) = HeaderValue::from_str(request_id) {
        resp.headers_mut().insert(REQUEST_ID_HEADER, v);
    }
    if let Some(r) = routed {
        resp.headers_mut()
            .insert(WORKER_HEADER, HeaderValue::from(r.worker_id));
        if let Some(p) = r.prefill_worker_id {
            resp.headers_mut()
                .insert(PREFILL_WORKER_HEADER, HeaderValue::from(p));
        }
    }
    resp
}

fn error_response(
    e: ApiError,
    request_id: &str,
    model: &str,
    endpoint: &'static str,
    stream: bool,
) -> Response {
    tracing::info!(
        request_id,
        status = e.status.as_u16(),
        "request refused: {}",
        e.message
    );
    count(model, endpoint, stream, "error");
    metrics::counter!("dynamo_frontend_model_rejection_total", "error_type" => e.metric_label())
        .increment(1);
    with_headers(e.into_response(), request_id, None)
}

async fn serve(
    state: AppState,
    p: Prepared,
    rid: String,
    endpoint: &'static str,
    received: Instant,
) -> Response {
    let model = p.meta.model.clone();
    let expose = state.config.security.expose_worker_id;
    metrics::histogram!(m::INPUT_SEQUENCE_TOKENS).record(p.prompt.len() as f64);
    let inflight = Inflight::new(&model, endpoint);
    let mut p = p;
    let choices = p.params.n;
    let incoming = incoming(&mut p, &rid, received);
    let (rx, routed) = match start_all(&state, &p.view, incoming, choices).await {
        Ok(x) => x,
        Err(e) => return error_response(e, &rid, &model, endpoint, p.stream),
    };
    tracing::info!(request_id = %rid, worker = routed.worker_id, prefill_worker = ?routed.prefill_worker_id, cached_tokens = routed.cached_tokens, queued_ms = routed.queued.as_millis() as u64, "routed");
    let assets = p.view.assets.clone();
    let meta = p.meta;
    let shown = expose.then_some(&routed);
    if p.stream {
        count(&model, endpoint, true, "success");
        let include_usage = p.include_usage;
        let mut shapers = Shapers::new(p.shape, meta.kind);
        let events = ReceiverStream::new(rx).flat_map(move |ev| {
            let _keep = &inflight;
            let items: Vec<Result<Event, Infallible>> =
                match ev {
                    GenEvent::Delta(mut d) => {
                        let (shaped, first) = shapers.shape(&mut d);
                        vec![Ok(Event::default()
                            .data(respond::chunk(&meta, &assets, &d, &shaped, first)))]
                    }
                    GenEvent::Done(u) => {
                        let mut v = Vec::new();
                        if include_usage {
                            let r = shapers.reasoning_tokens(&assets);
                            v.push(Ok(Event::default()
                                .data(respond::usage_chunk(&meta, &u, r).to_string())));
                        }
                        v.push(Ok(Event::default().data("[DONE]")));
                        v
                    }
                    GenEvent::Error(e) => vec![
                        Ok(Event::default().data(e.body().to_string())),
                        Ok(Event::default().data("[DONE]")),
                    ],
                };
            stream::iter(items)
        });
        let resp = Sse::new(events)
            .keep_alive(KeepAlive::default())
            .into_response();
        return with_headers(resp, &rid, shown);
    }
    // Non-streaming: if the client goes away, this future is dropped with `rx`, which cancels.
    let mut rx = rx;
    let mut collected = Collected::default();
    let mut usage = UsageTotals::default();
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Delta(d) => collected.push(d),
            GenEvent::Done(u) => usage = u,
            GenEvent::Error(e) => return error_response(e, &rid, &model, endpoint, false),
        }
    }
    drop(inflight);
    count(&model, endpoint, false, "success");
    let want = respond::Want {
        logprobs: p.want_logprobs,
        shape: &p.shape,
    };
    let body = collected.body(&meta, &assets, &usage, want);
    with_headers(Json(body).into_response(), &rid, shown)
}

pub async fn chat_completions(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let received = Instant::now();
    let rid = request_id(&headers);
    let tenant = state.tenant(caller);
    match prepare::chat(&state, &body, &rid, &tenant, &headers).await {
        Ok(p) => serve(state, p, rid, "chat_completions", received).await,
        Err(r) => error_response(r.error, &rid, &r.model, "chat_completions", r.stream),
    }
}

pub async fn completions(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let received = Instant::now();
    let rid = request_id(&headers);
    let tenant = state.tenant(caller);
    match prepare::completion(&state, &body, &rid, &tenant, &headers).await {
        Ok(p) => serve(state, p, rid, "completions", received).await,
        Err(r) => error_response(r.error, &rid, &r.model, "completions", r.stream),
    }
}

/// The answer to a request refused before its body was read (content type, size, timeout).
pub fn refused_early(e: ApiError, headers: &HeaderMap, endpoint: &'static str) -> Response {
    error_response(e, &request_id(headers), "", endpoint, false)
}

pub async fn list_models(State(state): State<AppState>) -> Json<serde_json::Value> {
    let data: Vec<_> = state
        .registry
        .model_names()
        .into_iter()
        .map(|name| json!({"id": name, "object": "model", "created": 0, "owned_by": "tandem"}))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

/// `GET /debug/kv_index`: what the router believes each worker holds (block hashes and the
/// last event applied), for operators and for the tests that compare it with worker dumps:
/// `workers` are the decode side's, `prefill_workers` the prefill index's.
pub async fn debug_kv_index(State(state): State<AppState>) -> Json<serde_json::Value> {
    Json(json!({
        "workers": index_json(&state.kv),
        "prefill_workers": index_json(&state.prefill_kv),
    }))
}

fn index_json(kv: &tandem_kv_router::KvRouter) -> serde_json::Map<String, serde_json::Value> {
    kv.with_indexer(|ix| {
        ix.workers()
            .into_iter()
            .map(|w| {
                let dump = ix.dump(w);
                let mut hashes: Vec<u64> = dump.blocks.iter().map(|b| b.block_hash.0).collect();
                hashes.sort_unstable();
                (
                    w.to_string(),
                    json!({"last_event_id": dump.last_event_id, "block_hashes": hashes}),
                )
            })
            .collect::<serde_json::Map<String, serde_json::Value>>()
    })
}

/// The shapers of a streamed response's choices (chat only: completions stream text as is,
/// their choices only tracked to put the echo in front of each one's first delta).
struct Shapers {
    shape: OutputShape,
    kind: respond::Kind,
    choices: std::collections::BTreeMap<usize, ChoiceShaper>,
    /// Completion choices that have streamed their first delta.
    seen: std::collections::BTreeSet<usize>,
}

impl Shapers {
    fn new(shape: OutputShape, kind: respond::Kind) -> Self {
        Self {
            shape,
            kind,
            choices: Default::default(),
            seen: Default::default(),
        }
    }

    /// The delta shaped (its finish reason made final), and whether it is the choice's first.
    fn shape(&mut self, d: &mut generate::ChoiceDelta) -> (Shaped, bool) {
        if self.kind == respond::Kind::Completion {
            if self.seen.insert(d.index) {
                d.text.insert_str(0, self.shape.echo_of(d.index));
            }
            return (Shaped::default(), false);
        }
        let first = !self.choices.contains_key(&d.index);
        let shaper = self
            .choices
            .entry(d.index)
            .or_insert_with(|| ChoiceShaper::new(&self.shape, d.index));
        let mut shaped = shaper.push(&d.text);
        if d.finish_reason.is_some() {
            shaped.extend(shaper.finish());
            d.finish_reason = respond::finish_reason(d.finish_reason.take(), shaper.called_tools());
        }
        (shaped, first)
    }

    fn reasoning_tokens(&self, assets: &crate::models::ModelAssets) -> Option<usize> {
        let texts: Vec<&str> = self
            .choices
            .values()
            .map(ChoiceShaper::reasoning_text)
            .collect();
        respond::reasoning_tokens(assets, &texts)
    }
}

/// What goes to [`generate::start`]: the request, and each further prompt of a batch as its
/// own request (internal ids `-1`, `-2`, ...).
fn incoming(p: &mut Prepared, rid: &str, received: Instant) -> Vec<generate::Incoming> {
    let id = internal_id(rid);
    let mut prompts = vec![std::mem::take(&mut p.prompt)];
    prompts.append(&mut p.more_prompts);
    let mut images = Some(std::mem::take(&mut p.images));
    prompts
        .into_iter()
        .enumerate()
        .map(|(i, prompt)| generate::Incoming {
            id: match i {
                0 => id.clone(),
                i => format!("{id}-{i}"),
            },
            prompt,
            params: p.params.clone(),
            priority: p.priority,
            received,
            limits: p.limits.clone(),
            cache_salt: p.cache_salt,
            images: images.take().unwrap_or_default(),
            target: p.target,
        })
        .collect()
}

/// Starts a request, or each prompt of a batched completion with their events merged into
/// one stream: prompt `i`'s choice `j` becomes choice `i * choices + j`, and the usage is
/// summed. Where the first prompt went is what the headers show. A failed start drops the
/// prompts already started (their streams' ends cancel them).
async fn start_all(
    state: &AppState,
    view: &std::sync::Arc<crate::models::ModelView>,
    incoming: Vec<generate::Incoming>,
    choices: usize,
) -> Result<(tokio::sync::mpsc::Receiver<GenEvent>, Routed), crate::error::ApiError> {
    let mut streams = tokio_stream::StreamMap::new();
    let mut first = None;
    for (i, inc) in incoming.into_iter().enumerate() {
        let (rx, routed) = generate::start(state, view, inc).await?;
        first.get_or_insert(routed);
        streams.insert(i * choices, ReceiverStream::new(rx));
    }
    let routed = first.ok_or_else(|| crate::error::ApiError::internal("no prompt to start"))?;
    if streams.len() == 1 {
        if let Some(only) = streams.remove(&0) {
            return Ok((only.into_inner(), routed));
        }
    }
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(merge_prompts(streams, tx));
    Ok((rx, routed))
}

/// Forwards a batch's events: deltas renumbered, one `Done` with the summed usage after every
/// prompt's, the first error alone.
async fn merge_prompts(
    mut streams: tokio_stream::StreamMap<usize, ReceiverStream<GenEvent>>,
    tx: tokio::sync::mpsc::Sender<GenEvent>,
) {
    let prompts = streams.len();
    let (mut done, mut usage) = (0, UsageTotals::default());
    while let Some((offset, ev)) = streams.next().await {
        let ev = match ev {
            GenEvent::Delta(mut d) => {
                d.index += offset;
                GenEvent::Delta(d)
            }
            GenEvent::Done(u) => {
                usage.prompt_tokens += u.prompt_tokens;
                usage.completion_tokens += u.completion_tokens;
                usage.cached_tokens += u.cached_tokens;
                done += 1;
                continue;
            }
            GenEvent::Error(e) => {
                let _ = tx.send(GenEvent::Error(e)).await;
                return;
            }
        };
        if tx.send(ev).await.is_err() {
            return;
        }
    }
    if done == prompts {
        let _ = tx.send(GenEvent::Done(usage)).await;
    }
}
