//! One request's trip through the router: check it fits the context, route it (and decide
//! where its prompt is prefilled, see `disagg`), call the worker's `Generate` (or
//! `GenerateDisagg`), and turn the token stream into text deltas (incremental, valid UTF-8,
//! stop strings held back) with the engine's own detokenizer and stop matcher. Dropping the
//! receiver (client gone) cancels the call, which aborts the request on the worker.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tandem_engine::sampler::{SamplingParams, StopMatcher, TokenLogprob};
use tandem_engine::tokenizer::IncrementalDecoder;
use tandem_kv_router::{RouteError, SelectError, SelectOptions, WorkerInfo};
use tandem_protocol::worker::{GenerateDisaggRequest, GenerateRequest};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;

use crate::app::AppState;
use crate::error::{from_status, ApiError};
use crate::metrics as m;
use crate::models::ModelView;

#[derive(Debug, Clone)]
pub struct ChoiceDelta {
    pub index: usize,
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub finish_reason: Option<String>,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct UsageTotals {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
}

#[derive(Debug)]
pub enum GenEvent {
    Delta(ChoiceDelta),
    Done(UsageTotals),
    Error(ApiError),
}

/// Where the request went.
#[derive(Debug, Clone, Copy)]
pub struct Routed {
    /// The worker that serves the request (the decode worker when disaggregated).
    pub worker_id: u64,
    pub cached_tokens: usize,
    /// The first prefill worker handed to the decode worker, when disaggregated.
    pub prefill_worker_id: Option<u64>,
}

struct ChoiceText {
    decoder: IncrementalDecoder,
    stop: StopMatcher,
    stopped: bool,
}

pub async fn start(
    state: &AppState,
    view: &ModelView,
    request_id: &str,
    prompt: Vec<u32>,
    params: SamplingParams,
    received: Instant,
) -> Result<(mpsc::Receiver<GenEvent>, Routed), ApiError> {
    let first = view.workers.first().ok_or_else(|| {
        ApiError::unavailable(if view.prefill.is_empty() {
            format!(
                "no decode worker serves `{}`: no worker serves it",
                view.name
            )
        } else {
            format!(
                "no decode worker serves `{}`: only prefill workers do",
                view.name
            )
        })
    })?;
    let context = first.card.context_length as usize;
    let wanted = prompt.len() + params.max_tokens.unwrap_or(1);
    if prompt.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty", Some("prompt")));
    }
    if wanted > context {
        return Err(ApiError::bad_request(
            format!(
                "the prompt ({} tokens) plus max_tokens ({}) exceeds the model's context length of {context} tokens",
                prompt.len(),
                params.max_tokens.unwrap_or(1)
            ),
            Some("messages"),
        ));
    }
    let block_size = first.card.kv_cache_block_size;
    let t_hash = Instant::now();
    let hashes = tandem_kv_router::protocols::request_block_hashes(&prompt, block_size);
    metrics::histogram!(m::BLOCK_HASHING_MS).record(t_hash.elapsed().as_secs_f64() * 1e3);
    let candidates: Vec<WorkerInfo> = view
        .workers
        .iter()
        .map(|w| WorkerInfo {
            id: w.card.instance_id,
            total_blocks: w.card.total_kv_blocks.into(),
            max_num_batched_tokens: w.card.max_num_batched_tokens.into(),
            block_size: w.card.kv_cache_block_size,
        })
        .collect();
    let t_sched = Instant::now();
    let selection = state
        .kv
        .route(
            request_id,
            &hashes,
            prompt.len(),
            &candidates,
            &SelectOptions::default(),
        )
        .map_err(|e| match e {
            RouteError::Select(SelectError::NoWorkerAvailable { .. }) => {
                ApiError::unavailable(e.to_string())
            }
            other => ApiError::internal(other.to_string()),
        })?;
    metrics::histogram!(m::SCHEDULING_MS).record(t_sched.elapsed().as_secs_f64() * 1e3);
    let worker = view
        .workers
        .iter()
        .find(|w| w.card.instance_id == selection.worker_id)
        .ok_or_else(|| ApiError::unavailable("the chosen worker left"))?;
    let free_all = |rid: &str| {
        state.kv.free(rid);
        state.prefill_kv.free(rid);
    };
    let routed = crate::disagg::RoutedRequest {
        request_id,
        decode: worker,
        selection,
        hashes: &hashes,
        prompt_len: prompt.len(),
        params: &params,
    };
    let prefill =
        crate::disagg::plan(state, view, &routed).inspect_err(|_| free_all(request_id))?;
    let prefill_worker_id = prefill.first().map(|t| t.instance_id);
    let mut client = worker.client.clone();
    let params_json =
        serde_json::to_string(&params).map_err(|e| ApiError::internal(e.to_string()))?;
    let n = params.n;
    let skip_special = params.skip_special_tokens;
    let stops = params.stop.clone();
    let deadline = Instant::now() + Duration::from_secs(state.config.request_timeout_secs.into());
    let idle = Duration::from_secs(state.config.sse_idle_timeout_secs.into());
    metrics::histogram!(m::OVERHEAD_TOTAL_MS).record(received.elapsed().as_secs_f64() * 1e3);
    let request = GenerateRequest {
        request_id: request_id.to_string(),
        prompt: prompt.clone(),
        sampling_params_json: params_json,
    };
    // Both calls stream the same `GenerateOutput`s.
    let call = async {
        if prefill.is_empty() {
            client.generate(request).await
        } else {
            client
                .generate_disagg(GenerateDisaggRequest {
                    request: Some(request),
                    prefill_workers: prefill,
                })
                .await
        }
    };
    let mut stream = match tokio::time::timeout_at(deadline.into(), call).await {
        Ok(Ok(s)) => s.into_inner(),
        Ok(Err(status)) => {
            free_all(request_id);
            return Err(from_status(&status));
        }
        Err(_) => {
            free_all(request_id);
            return Err(ApiError::timeout(
                "the worker did not answer before the request deadline",
            ));
        }
    };

    let (tx, rx) = mpsc::channel(64);
    let kv = state.kv.clone();
    let prefill_kv = prefill_worker_id.map(|_| state.prefill_kv.clone());
    let assets = view.assets.clone();
    let rid = request_id.to_string();
    let worker_label = selection.worker_id.to_string();
    tokio::spawn(async move {
        let mut choices: HashMap<usize, ChoiceText> = HashMap::new();
        let mut usage = UsageTotals {
            prompt_tokens: prompt.len(),
            ..Default::default()
        };
        let mut finished = 0usize;
        let mut first_token = true;
        let mut last_token_at = Instant::now();
        let outcome: Result<(), ApiError> = loop {
            let item = tokio::select! {
                item = tokio::time::timeout_at(deadline.into(), stream.next()) => item,
                _ = tx.closed() => break Err(ApiError::bad_request("client disconnected", None)),
            };
            let out = match item {
                Err(_) => break Err(ApiError::timeout("request deadline passed")),
                Ok(None) => break Err(ApiError::internal("the worker ended the stream early")),
                Ok(Some(Err(status))) => break Err(from_status(&status)),
                Ok(Some(Ok(out))) => out,
            };
            if !out.error.is_empty() && out.finish_reason == "abort" {
                break Err(ApiError::internal(format!("worker error: {}", out.error)));
            }
            let now = Instant::now();
            if !out.token_ids.is_empty() {
                if first_token {
                    kv.mark_prefill_completed(&rid);
                    if let Some(p) = &prefill_kv {
                        p.mark_prefill_completed(&rid);
                    }
                    metrics::histogram!(m::TTFT).record(received.elapsed().as_secs_f64());
                    first_token = false;
                } else {
                    let per = now.duration_since(last_token_at).as_secs_f64()
                        / out.token_ids.len() as f64;
                    metrics::histogram!(m::ITL).record(per);
                }
                last_token_at = now;
                metrics::counter!(m::OUTPUT_TOKENS_TOTAL).increment(out.token_ids.len() as u64);
            }
            let index = out.index as usize;
            let choice = choices.entry(index).or_insert_with(|| ChoiceText {
                decoder: IncrementalDecoder::new(skip_special),
                stop: StopMatcher::new(&stops),
                stopped: false,
            });
            let mut text = String::new();
            if !choice.stopped {
                let mut raw = String::new();
                for id in &out.token_ids {
                    raw.push_str(
                        &choice
                            .decoder
                            .push(&assets.tokenizer, *id)
                            .unwrap_or_default(),
                    );
                }
                if !out.finish_reason.is_empty() {
                    raw.push_str(&choice.decoder.flush(&assets.tokenizer).unwrap_or_default());
                }
                let fed = choice.stop.feed(&raw);
                text = fed.emit;
                if fed.matched.is_some() {
                    choice.stopped = true;
                } else if !out.finish_reason.is_empty() {
                    text.push_str(&choice.stop.flush());
                }
            }
            let logprobs: Vec<TokenLogprob> = if out.logprobs_json.is_empty() {
                vec![]
            } else {
                serde_json::from_str(&out.logprobs_json).unwrap_or_default()
            };
            let finish = (!out.finish_reason.is_empty()).then(|| out.finish_reason.clone());
            if let Some(u) = &out.usage {
                usage.completion_tokens += u.completion_tokens as usize;
                usage.cached_tokens = usage.cached_tokens.max(u.cached_tokens as usize);
            }
            if finish.is_some() {
                finished += 1;
            }
            let delta = ChoiceDelta {
                index,
                text,
                logprobs,
                finish_reason: finish,
            };
            // A reader that stops reading fills this channel; after the idle timeout it counts
            // as gone, so it cannot hold KV blocks on the worker.
            match tokio::time::timeout(idle, tx.send(GenEvent::Delta(delta))).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => {
                    break Err(ApiError::bad_request("client disconnected", None))
                }
            }
            if finished == n {
                break Ok(());
            }
        };
        kv.free(&rid);
        if let Some(p) = &prefill_kv {
            p.free(&rid);
        }
        match outcome {
            Ok(()) => {
                metrics::histogram!(m::OUTPUT_SEQUENCE_TOKENS)
                    .record(usage.completion_tokens as f64);
                let _ = tx.send(GenEvent::Done(usage)).await;
            }
            Err(e) if e.message == "client disconnected" => {
                // Dropping `stream` here cancels the call; the worker aborts and frees blocks.
                tracing::info!(request_id = %rid, worker = %worker_label, "client disconnected; request cancelled");
                metrics::counter!(m::CANCELLATIONS).increment(1);
            }
            Err(e) => {
                tracing::warn!(request_id = %rid, worker = %worker_label, "request failed: {}", e.message);
                let _ = tx.send(GenEvent::Error(e)).await;
            }
        }
    });
    Ok((
        rx,
        Routed {
            worker_id: selection.worker_id,
            cached_tokens: selection.cached_tokens,
            prefill_worker_id,
        },
    ))
}
