//! One request's trip through the router, as [`start`]'s stages:
//! 1. validate: a decode worker serves the model and the request fits its context;
//! 2. hash: the prompt's KV block hashes, which routing matches against the workers' caches;
//! 3. route: the decode worker, chosen on the decode index (which records the request);
//! 4. dispatch: where the prompt is prefilled (see `disagg`), then the worker's `Generate`
//!    (or `GenerateDisagg`) call;
//! 5. stream: a task that turns the token stream into text deltas (incremental, valid UTF-8,
//!    stop strings held back) with the engine's own detokenizer and stop matcher.
//!
//! Dropping the receiver (client gone) cancels the call, which aborts the request on the
//! worker.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_kv_router::protocols::{CacheSalt, LocalBlockHash};
use tandem_kv_router::{RouteError, SelectError, SelectOptions, Selection, WorkerInfo};
use tandem_protocol::wire::IntoWire;
use tandem_protocol::worker::{GenerateDisaggRequest, GenerateRequest};
use tandem_protocol::worker::{GenerateOutput, PrefillTarget};
use tandem_text::{IncrementalDecoder, SamplingParams, StopMatcher, TokenLogprob};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tonic::Streaming;

use crate::app::AppState;
use crate::disagg::{self, RoutedRequest};
use crate::error::{from_status, ApiError};
use crate::limits::RateLimits;
use crate::media::PlacedImage;
use crate::metrics as m;
use crate::models::{ModelAssets, ModelView, WorkerEntry};
use crate::queue::{Attempt, Ticket};

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
    /// Time spent in the router's queue.
    pub queued: Duration,
}

/// Runs one request through the stages (see the module doc) and returns the stream stage's
/// events with where the request went. An error of stages 1 to 4 is the client's answer;
/// from the dispatch on, a failure also frees the request in the KV indexes (which the stream
/// stage does when it ends).
pub async fn start(
    state: &AppState,
    view: &Arc<ModelView>,
    request: Incoming,
) -> Result<(mpsc::Receiver<GenEvent>, Routed), ApiError> {
    let mut req = Request {
        state: state.clone(),
        view: view.clone(),
        id: request.id,
        prompt: request.prompt,
        params: request.params,
        priority: request.priority,
        received: request.received,
        limits: request.limits,
        cache_salt: request.cache_salt,
        images: request.images,
        target: request.target,
        replayed: 0,
    };
    let block_size = req.validate()?;
    let hashes = req.hash_blocks(block_size);
    let (route, call) = req.route_and_dispatch(&hashes, Vec::new()).await?;
    let routed = Routed {
        worker_id: route.selection.worker_id,
        cached_tokens: route.selection.cached_tokens,
        prefill_worker_id: call.prefill_worker_id,
        queued: route.queued,
    };
    Ok((req.stream(&route, call), routed))
}

/// A request as the handlers hand it over: tokenized and validated.
pub struct Incoming {
    /// The internal request id, the one the workers and the KV indexes see.
    pub id: String,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// The queue's order: lower first.
    pub priority: i32,
    /// When the HTTP request arrived.
    pub received: Instant,
    /// The caller's rate limits, charged with the output tokens.
    pub limits: Arc<RateLimits>,
    /// The salt the prompt's blocks are hashed under, here and on the workers.
    pub cache_salt: Option<CacheSalt>,
    /// The prompt's images, placed at their image tokens.
    pub images: Vec<PlacedImage>,
    /// `--router-mode direct`: the worker the client named.
    pub target: Option<u64>,
}

/// One request as the stages see it (and, for migration, the stream stage too).
struct Request {
    state: AppState,
    /// The model's workers: the handler's snapshot, renewed when the request leaves the queue.
    view: Arc<ModelView>,
    id: String,
    /// The prompt, followed after a migration by the output so far (`replayed` tokens).
    prompt: Vec<u32>,
    params: SamplingParams,
    priority: i32,
    /// When the HTTP request arrived (TTFT and the router's overhead are measured from here).
    received: Instant,
    limits: Arc<RateLimits>,
    cache_salt: Option<CacheSalt>,
    images: Vec<PlacedImage>,
    /// Output tokens at the end of `prompt` that an earlier worker generated (migration).
    replayed: usize,
    /// `--router-mode direct`: the worker the client named.
    target: Option<u64>,
}

/// Workers one request is offered to before a refusal is the client's answer.
const MAX_DISPATCH_ATTEMPTS: usize = 3;

/// Why the dispatch stage failed.
enum CallError {
    /// The worker refused before doing any work: another may take the request.
    Refused(ApiError),
    Failed(ApiError),
}

/// The route stage's answer: the decode worker and the decode index's selection.
struct Route {
    worker: WorkerEntry,
    selection: Selection,
    /// Time spent in the router's queue.
    queued: Duration,
}

/// The dispatch stage's answer: the worker's output stream, under way.
struct Call {
    stream: Streaming<GenerateOutput>,
    /// The first prefill worker, when disaggregated.
    prefill_worker_id: Option<u64>,
    /// The request's deadline (`--request-timeout-secs` from the dispatch).
    deadline: Instant,
}

impl Request {
    /// Stage 1: a decode worker serves the model and the prompt plus `max_tokens` fits its
    /// context. Returns the KV block size the prompt is hashed with.
    fn validate(&self) -> Result<u32, ApiError> {
        let first = self
            .view
            .workers
            .first()
            .ok_or_else(|| no_decode_worker(&self.view.name, !self.view.prefill.is_empty()))?;
        check_fits(
            self.prompt.len(),
            self.params.max_tokens,
            first.card.context_length as usize,
        )?;
        Ok(first.card.kv_cache_block_size)
    }

    /// Stage 2: the prompt's KV block hashes.
    fn hash_blocks(&self, block_size: u32) -> Vec<LocalBlockHash> {
        let t_hash = Instant::now();
        let hashes = crate::media::hash_context(self.cache_salt, &self.images)
            .block_hashes(&self.prompt, block_size as usize);
        metrics::histogram!(m::BLOCK_HASHING_MS).record(t_hash.elapsed().as_secs_f64() * 1e3);
        hashes
    }

    /// Stages 3 and 4 together: a worker that refuses the call before doing any work (it is
    /// draining, its engine stopped, or it cannot be reached: it may have just left) gets the
    /// request no more; it is routed again among the others, up to
    /// [`MAX_DISPATCH_ATTEMPTS`] workers in all (`refused` are excluded from the start).
    async fn route_and_dispatch(
        &mut self,
        hashes: &[LocalBlockHash],
        mut refused: Vec<u64>,
    ) -> Result<(Route, Call), ApiError> {
        let first_refused = refused.len();
        loop {
            let route = self.route(hashes, &refused).await?;
            match self.dispatch(&route, hashes).await {
                Ok(call) => return Ok((route, call)),
                Err(CallError::Refused(e))
                    if refused.len() - first_refused + 1 < MAX_DISPATCH_ATTEMPTS =>
                {
                    let worker = route.selection.worker_id;
                    tracing::warn!(
                        worker,
                        request = %self.id,
                        "{}; routing to another worker",
                        e.message
                    );
                    metrics::counter!(m::REDISPATCHED_TOTAL).increment(1);
                    refused.push(worker);
                }
                Err(CallError::Refused(e) | CallError::Failed(e)) => return Err(e),
            }
        }
    }

    /// Stage 3: the decode worker, chosen on the decode index (never one of `refused`),
    /// which records the request under its id. While every worker is saturated or busy the
    /// request waits in the router's queue; each attempt after the first sees the model's
    /// workers afresh.
    async fn route(
        &mut self,
        hashes: &[LocalBlockHash],
        refused: &[u64],
    ) -> Result<Route, ApiError> {
        let ticket = Ticket {
            model: self.view.name.clone(),
            priority: self.priority,
            prompt_tokens: self.prompt.len(),
            deadline: self.received
                + Duration::from_secs(self.state.config.request_timeout_secs.into()),
        };
        // After a refusal the snapshot may be stale (the refusing worker left, another
        // joined): start from the registry's current workers.
        let mut view = refused.is_empty().then(|| self.view.clone());
        let attempt = || {
            let view = match view.take() {
                Some(v) => v,
                None => self.state.registry.view(&self.view.name).ok_or_else(|| {
                    no_decode_worker(&self.view.name, !self.view.prefill.is_empty())
                })?,
            };
            Ok(match self.try_route(&view, hashes, refused)? {
                Some((worker, selection)) => Attempt::Admitted((view, worker, selection)),
                None => Attempt::Saturated,
            })
        };
        let ((view, worker, selection), queued) = self.state.queue.admit(&ticket, attempt).await?;
        self.view = view;
        Ok(Route {
            worker,
            selection,
            queued,
        })
    }

    /// One routing attempt on `view`'s workers: the chosen worker, or `None` when every one
    /// is saturated (above the queue threshold) or busy.
    fn try_route(
        &self,
        view: &ModelView,
        hashes: &[LocalBlockHash],
        refused: &[u64],
    ) -> Result<Option<(WorkerEntry, Selection)>, ApiError> {
        let candidates: Vec<WorkerInfo> = view
            .workers
            .iter()
            .filter(|w| !refused.contains(&w.card.instance_id) && w.healthy())
            .map(disagg::worker_info)
            .collect();
        if candidates.is_empty() && view.workers.iter().any(|w| !w.healthy()) {
            return Err(ApiError::unavailable(format!(
                "every worker of {} is failing its health probe or refused the request",
                view.name
            ))
            .with_retry_after(1));
        }
        if candidates.is_empty() && !refused.is_empty() {
            return Err(ApiError::unavailable(format!(
                "every worker of {} refused the request (draining or unreachable)",
                view.name
            ))
            .with_retry_after(1));
        }
        if candidates.is_empty() {
            return Err(no_decode_worker(&view.name, !view.prefill.is_empty()));
        }
        if self.state.kv.should_queue(&candidates) {
            return Ok(None);
        }
        let t_sched = Instant::now();
        let routed = self.state.kv.route(
            &self.id,
            hashes,
            self.prompt.len(),
            &candidates,
            &SelectOptions {
                worker_id: self.target,
                ..SelectOptions::default()
            },
        );
        let selection = match routed {
            Ok(s) => s,
            Err(RouteError::Select(SelectError::NoWorkerAvailable { .. })) => return Ok(None),
            Err(RouteError::Select(SelectError::UnknownWorker(id))) => {
                return Err(ApiError::bad_request(
                    format!(
                        "worker {id} (the request's target) is not a healthy worker of model {}",
                        view.name
                    ),
                    Some(crate::prepare::TARGET_HEADER),
                ))
            }
            Err(e) => return Err(ApiError::internal(e.to_string())),
        };
        metrics::histogram!(m::SCHEDULING_MS).record(t_sched.elapsed().as_secs_f64() * 1e3);
        let worker = view
            .workers
            .iter()
            .find(|w| w.card.instance_id == selection.worker_id)
            .cloned();
        match worker {
            Some(w) => Ok(Some((w, selection))),
            None => {
                self.state.kv.free(&self.id);
                Err(ApiError::unavailable("the chosen worker left"))
            }
        }
    }

    /// Stage 4: plans where the prompt is prefilled, then calls the worker. A failure frees
    /// the request in the KV indexes.
    async fn dispatch(&self, route: &Route, hashes: &[LocalBlockHash]) -> Result<Call, CallError> {
        let prefill = self
            .plan_prefill(route, hashes)
            .inspect_err(|_| self.free())
            .map_err(CallError::Failed)?;
        self.call(&route.worker, prefill).await
    }

    /// Where the prompt is prefilled (`disagg::plan`): an empty list means on the decode
    /// worker itself.
    fn plan_prefill(
        &self,
        route: &Route,
        hashes: &[LocalBlockHash],
    ) -> Result<Vec<PrefillTarget>, ApiError> {
        disagg::plan(
            &self.state,
            &self.view,
            &RoutedRequest {
                request_id: &self.id,
                decode: &route.worker,
                selection: route.selection,
                hashes,
                prompt_len: self.prompt.len(),
                params: &self.params,
            },
        )
    }

    /// Calls `worker`'s `Generate`, or `GenerateDisagg` with `prefill` when there are prefill
    /// workers, before the request's deadline.
    async fn call(
        &self,
        worker: &WorkerEntry,
        prefill: Vec<PrefillTarget>,
    ) -> Result<Call, CallError> {
        let prefill_worker_id = prefill.first().map(|t| t.instance_id);
        let mut client = worker.client.clone();
        let deadline =
            Instant::now() + Duration::from_secs(self.state.config.request_timeout_secs.into());
        metrics::histogram!(m::OVERHEAD_TOTAL_MS)
            .record(self.received.elapsed().as_secs_f64() * 1e3);
        let request = GenerateRequest {
            request_id: self.id.clone(),
            prompt: self.prompt.clone(),
            sampling_params: Some(crate::wire::sampling_params(&self.params)),
            cache_salt: self.cache_salt.map(|s| s.0),
            media: self.images.iter().map(media_input).collect(),
            replayed_tokens: u32::try_from(self.replayed).unwrap_or(u32::MAX),
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
        let stream = match tokio::time::timeout_at(deadline.into(), call).await {
            Ok(Ok(s)) => s.into_inner(),
            Ok(Err(status)) => {
                self.free();
                let error = from_status(&status);
                // Unavailable before the stream began: the worker did no work (draining,
                // stopped, or unreachable); Cancelled: its server shut down under the call
                // (a drained worker exiting), and nothing reached the client. Another worker
                // may take the request. With migration on, so may one whose connection broke
                // as the call began (its process died): Dynamo's new-request migration.
                return Err(match status.code() {
                    tonic::Code::Unavailable | tonic::Code::Cancelled => CallError::Refused(error),
                    code if broken_stream(code) && self.state.config.migration.limit > 0 => {
                        let model = self.view.name.clone();
                        metrics::counter!(m::MIGRATIONS, "model" => model, "migration_type" => "new_request")
                            .increment(1);
                        CallError::Refused(error)
                    }
                    _ => CallError::Failed(error),
                });
            }
            Err(_) => {
                self.free();
                return Err(CallError::Failed(ApiError::timeout(
                    "the worker did not answer before the request deadline",
                )));
            }
        };
        Ok(Call {
            stream,
            prefill_worker_id,
            deadline,
        })
    }

    /// Forgets the request in both KV indexes.
    fn free(&self) {
        self.state.kv.free(&self.id);
        self.state.prefill_kv.free(&self.id);
        self.state.queue.wake();
    }

    /// Stage 5: spawns the task that turns `call`'s outputs into [`GenEvent`]s on the returned
    /// channel; the task owns the request from here, to migrate it if its worker fails.
    fn stream(self, route: &Route, call: Call) -> mpsc::Receiver<GenEvent> {
        let (tx, rx) = mpsc::channel(64);
        let cfg = &self.state.config;
        let migrates = cfg.migration.limit > 0;
        let progress = Progress::new(&self.params, self.prompt.len(), migrates);
        let migration = Migration {
            left: cfg.migration.limit,
            max_seq_len: cfg.migration.max_seq_len.map(|n| n as usize),
            prompt_len: self.prompt.len(),
            max_tokens: self.params.max_tokens,
            min_tokens: self.params.min_tokens,
        };
        let task = StreamTask {
            tx,
            worker_id: route.selection.worker_id,
            deadline: call.deadline,
            idle: Duration::from_secs(cfg.sse_idle_timeout_secs.into()),
            migration,
            req: self,
        };
        tokio::spawn(task.run(call.stream, progress));
        rx
    }

    /// The request again after its output so far, `output`, to continue elsewhere: the
    /// client's prompt followed by `output`, and `max_tokens` and `min_tokens` less what was
    /// generated (both count the tokens still to come).
    fn replay(&mut self, m: &Migration, output: &[u32]) {
        self.prompt.truncate(m.prompt_len);
        self.prompt.extend_from_slice(output);
        self.params.max_tokens = m.max_tokens.map(|n| n - output.len());
        self.params.min_tokens = m.min_tokens.saturating_sub(output.len());
        self.replayed = output.len();
    }
}

/// The error for a model whose workers are all prefill workers, or that has none left.
fn no_decode_worker(model: &str, has_prefill: bool) -> ApiError {
    ApiError::unavailable(if has_prefill {
        format!("no decode worker serves `{model}`: only prefill workers do")
    } else {
        format!("no decode worker serves `{model}`: no worker serves it")
    })
}

/// Refuses an empty prompt, and a prompt whose `max_tokens` (1 when unset) would not fit in
/// the model's `context` tokens.
fn check_fits(
    prompt_len: usize,
    max_tokens: Option<usize>,
    context: usize,
) -> Result<(), ApiError> {
    let wanted = prompt_len.saturating_add(max_tokens.unwrap_or(1));
    if prompt_len == 0 {
        return Err(ApiError::bad_request("the prompt is empty", Some("prompt")));
    }
    if wanted > context {
        return Err(ApiError::bad_request(
            format!(
                "the prompt ({prompt_len} tokens) plus max_tokens ({}) exceeds the model's context length of {context} tokens",
                max_tokens.unwrap_or(1)
            ),
            Some("messages"),
        ));
    }
    Ok(())
}

/// How the stream stage ended.
enum Ended {
    /// Every choice finished.
    Finished,
    /// The client went away (or stopped reading past the idle timeout).
    ClientGone,
    Failed(ApiError),
    /// The worker's stream broke (its process died, its connection dropped, its server shut
    /// down under the call): the request may migrate to another worker.
    Broken(ApiError),
}

/// Request migration's budget and what replaying needs (`--migration-limit`).
struct Migration {
    /// Migrations left; 0: off.
    left: u32,
    /// Longest prompt plus output that migrates.
    max_seq_len: Option<usize>,
    /// The client's prompt length, `max_tokens` and `min_tokens`.
    prompt_len: usize,
    max_tokens: Option<usize>,
    min_tokens: usize,
}

/// What the stream stage's task owns, besides the stream and its [`Progress`].
struct StreamTask {
    tx: mpsc::Sender<GenEvent>,
    /// The request, routed again if it migrates.
    req: Request,
    /// The worker streaming now (the decode worker when disaggregated).
    worker_id: u64,
    deadline: Instant,
    /// `--sse-idle-timeout-secs`: how long a full channel may wait for its reader.
    idle: Duration,
    migration: Migration,
}

impl StreamTask {
    /// Forwards the outputs until every choice has finished, migrating the request when its
    /// worker's stream breaks (within the budget), then frees the request in the KV indexes
    /// and tells the client how it ended. Dropping a stream that has not ended cancels its
    /// call: the worker aborts the request and frees its blocks.
    async fn run(mut self, mut stream: Streaming<GenerateOutput>, mut progress: Progress) {
        let ended = loop {
            match self.forward(&mut stream, &mut progress).await {
                Ended::Broken(cause) => match self.migrate(&mut progress, cause).await {
                    Ok(next) => stream = next,
                    Err(e) => break Ended::Failed(e),
                },
                ended => break ended,
            }
        };
        drop(stream);
        self.req.free();
        self.report(ended, progress.usage).await;
    }

    async fn forward(
        &self,
        stream: &mut Streaming<GenerateOutput>,
        progress: &mut Progress,
    ) -> Ended {
        // One timer for the whole stream, not one per message.
        let deadline = tokio::time::sleep_until(self.deadline.into());
        tokio::pin!(deadline);
        loop {
            let out = match self.next_output(stream, deadline.as_mut()).await {
                Ok(out) => out,
                Err(ended) => return ended,
            };
            if !out.error.is_empty() && crate::wire::finish_reason(&out) == Some("abort") {
                return Ended::Failed(ApiError::internal(format!("worker error: {}", out.error)));
            }
            self.record_tokens(&mut progress.timing, out.token_ids.len());
            let delta = progress.delta(&out, &self.req.view.assets);
            if let Err(ended) = self.send(delta).await {
                return ended;
            }
            if progress.finished == progress.n {
                return Ended::Finished;
            }
        }
    }

    /// Sends the request, its output so far replayed, to another worker than the one whose
    /// stream broke, and returns the new stream; `cause` when it may not migrate (budget
    /// spent, off, too long, several choices) or no other worker takes it.
    async fn migrate(
        &mut self,
        progress: &mut Progress,
        cause: ApiError,
    ) -> Result<Streaming<GenerateOutput>, ApiError> {
        let Some(output) = progress.output.as_ref() else {
            return Err(cause);
        };
        let budget = &self.migration;
        let total = budget.prompt_len + output.len();
        let done = budget.max_tokens.is_some_and(|n| output.len() >= n);
        if budget.left == 0 || done {
            return Err(cause);
        }
        let model = self.req.view.name.clone();
        if budget.max_seq_len.is_some_and(|max| total > max) {
            metrics::counter!(m::MIGRATION_MAX_SEQ_LEN_EXCEEDED, "model" => model).increment(1);
            return Err(cause);
        }
        self.migration.left -= 1;
        let broken = self.worker_id;
        tracing::warn!(
            request_id = %self.req.id,
            worker = broken,
            generated = output.len(),
            "{}; migrating the request to another worker",
            cause.message
        );
        metrics::counter!(m::MIGRATIONS, "model" => model, "migration_type" => "ongoing_request")
            .increment(1);
        self.req.free();
        self.req.replay(&self.migration, output);
        let block_size = self.req.validate()?;
        let hashes = self.req.hash_blocks(block_size);
        let (route, call) = self.req.route_and_dispatch(&hashes, vec![broken]).await?;
        self.worker_id = route.selection.worker_id;
        progress.begin_attempt();
        Ok(call.stream)
    }

    /// The worker's next output, or how the stream ended without one.
    async fn next_output(
        &self,
        stream: &mut Streaming<GenerateOutput>,
        deadline: std::pin::Pin<&mut tokio::time::Sleep>,
    ) -> Result<GenerateOutput, Ended> {
        let item = tokio::select! {
            item = stream.next() => item,
            _ = deadline => {
                return Err(Ended::Failed(ApiError::timeout("request deadline passed")))
            }
            _ = self.tx.closed() => return Err(Ended::ClientGone),
        };
        match item {
            None => Err(Ended::Broken(ApiError::internal(
                "the worker ended the stream early",
            ))),
            Some(Err(status)) if broken_stream(status.code()) => {
                Err(Ended::Broken(from_status(&status)))
            }
            Some(Err(status)) => Err(Ended::Failed(from_status(&status))),
            Some(Ok(out)) => Ok(out),
        }
    }

    /// On the first tokens of each attempt, marks the prefill done in the KV indexes (and,
    /// on the request's first, records the TTFT); after, the inter-token latency.
    fn record_tokens(&self, timing: &mut TokenTiming, tokens: usize) {
        let now = Instant::now();
        if tokens == 0 {
            return;
        }
        self.req.limits.charge_tokens(tokens);
        let state = &self.req.state;
        if timing.prefill_pending {
            state.kv.mark_prefill_completed(&self.req.id);
            state.prefill_kv.mark_prefill_completed(&self.req.id);
            state.queue.wake();
            timing.prefill_pending = false;
        }
        if timing.first_token {
            metrics::histogram!(m::TTFT).record(self.req.received.elapsed().as_secs_f64());
            timing.first_token = false;
        } else {
            let per = now.duration_since(timing.last_token_at).as_secs_f64() / tokens as f64;
            metrics::histogram!(m::ITL).record(per);
        }
        timing.last_token_at = now;
        metrics::counter!(m::OUTPUT_TOKENS_TOTAL).increment(tokens as u64);
    }

    /// Hands `delta` to the client. A reader that stops reading fills this channel; after the
    /// idle timeout it counts as gone, so it cannot hold KV blocks on the worker.
    async fn send(&self, delta: ChoiceDelta) -> Result<(), Ended> {
        // A reader keeping up leaves room: no timer for that case.
        let event = match self.tx.try_send(GenEvent::Delta(delta)) {
            Ok(()) => return Ok(()),
            Err(mpsc::error::TrySendError::Closed(_)) => return Err(Ended::ClientGone),
            Err(mpsc::error::TrySendError::Full(event)) => event,
        };
        match tokio::time::timeout(self.idle, self.tx.send(event)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) | Err(_) => Err(Ended::ClientGone),
        }
    }

    async fn report(&self, ended: Ended, usage: UsageTotals) {
        let (rid, worker) = (&self.req.id, self.worker_id);
        match ended {
            Ended::Finished => {
                metrics::histogram!(m::OUTPUT_SEQUENCE_TOKENS)
                    .record(usage.completion_tokens as f64);
                let _ = self.tx.send(GenEvent::Done(usage)).await;
            }
            Ended::ClientGone => {
                tracing::info!(request_id = %rid, worker, "client disconnected; request cancelled");
                metrics::counter!(m::CANCELLATIONS).increment(1);
            }
            Ended::Failed(e) | Ended::Broken(e) => {
                tracing::warn!(request_id = %rid, worker, "request failed: {}", e.message);
                let _ = self.tx.send(GenEvent::Error(e)).await;
            }
        }
    }
}

/// Whether a stream that ended with `code` broke under the request (the worker's process
/// died or its connection dropped: Unknown and Unavailable are what a reset connection
/// reads as; Cancelled and Aborted, a server shut down under the call) rather than refusing
/// it: a broken request may migrate.
fn broken_stream(code: tonic::Code) -> bool {
    use tonic::Code::*;
    matches!(code, Unknown | Unavailable | Cancelled | Aborted)
}

/// When tokens came, for the TTFT and the inter-token latency.
struct TokenTiming {
    /// No token yet (the TTFT is still to be recorded).
    first_token: bool,
    /// No token yet from the worker streaming now (its prefill is still tracked as load).
    prefill_pending: bool,
    last_token_at: Instant,
}

/// What the stream stage accumulates over the outputs.
struct Progress {
    choices: Choices,
    usage: UsageTotals,
    /// Choices asked for (`n`) and finished so far.
    n: usize,
    finished: usize,
    timing: TokenTiming,
    /// The output token ids so far, kept for a migration when the request has one choice
    /// (`None`: migration off, or several choices or beam search, which do not migrate).
    output: Option<Vec<u32>>,
}

impl Progress {
    /// With `migrates`, the output is kept for a replay (one choice only).
    fn new(params: &SamplingParams, prompt_tokens: usize, migrates: bool) -> Self {
        let single = params.n == 1 && !params.use_beam_search;
        Progress {
            choices: Choices {
                skip_special: params.skip_special_tokens,
                stops: params.stop.clone(),
                by_index: HashMap::new(),
            },
            usage: UsageTotals {
                prompt_tokens,
                ..Default::default()
            },
            n: params.n,
            finished: 0,
            timing: TokenTiming {
                first_token: true,
                prefill_pending: true,
                last_token_at: Instant::now(),
            },
            output: (migrates && single).then(Vec::new),
        }
    }

    /// A migrated request starts on its next worker: what was generated so far counts as
    /// output (the worker's usage counts only its own tokens), and its prefill is new load.
    fn begin_attempt(&mut self) {
        let generated = self.output.as_ref().map_or(0, Vec::len);
        self.usage.completion_tokens = generated;
        self.timing.prefill_pending = true;
    }

    /// Applies one output: its choice's new text, its logprobs, finish and usage.
    fn delta(&mut self, out: &GenerateOutput, assets: &ModelAssets) -> ChoiceDelta {
        let index = out.index as usize;
        let finish = crate::wire::finish_reason(out);
        let finishing = finish.is_some();
        if let Some(output) = self.output.as_mut() {
            output.extend_from_slice(&out.token_ids);
        }
        let text = self
            .choices
            .get(index)
            .push(assets, &out.token_ids, finishing);
        let logprobs = crate::wire::logprobs(&out.logprobs);
        if let Some(u) = &out.usage {
            self.usage.completion_tokens += u.completion_tokens as usize;
            self.usage.cached_tokens = self.usage.cached_tokens.max(u.cached_tokens as usize);
        }
        if finish.is_some() {
            self.finished += 1;
        }
        ChoiceDelta {
            index,
            text,
            logprobs,
            finish_reason: finish.map(str::to_owned),
        }
    }
}

/// Each choice's text state, made on its first output.
struct Choices {
    skip_special: bool,
    stops: Vec<String>,
    by_index: HashMap<usize, ChoiceText>,
}

impl Choices {
    fn get(&mut self, index: usize) -> &mut ChoiceText {
        self.by_index.entry(index).or_insert_with(|| ChoiceText {
            decoder: IncrementalDecoder::new(self.skip_special),
            stop: StopMatcher::new(&self.stops),
            stopped: false,
        })
    }
}

/// One choice's detokenizer and stop matcher.
struct ChoiceText {
    decoder: IncrementalDecoder,
    stop: StopMatcher,
    stopped: bool,
}

impl ChoiceText {
    /// The text `token_ids` add, stop strings held back; `last` flushes what was held. After
    /// a stop string matched, nothing more.
    fn push(&mut self, assets: &ModelAssets, token_ids: &[u32], last: bool) -> String {
        if self.stopped {
            return String::new();
        }
        let mut raw = String::new();
        for id in token_ids {
            raw.push_str(
                &self
                    .decoder
                    .push(&assets.tokenizer, *id)
                    .unwrap_or_default(),
            );
        }
        if last {
            raw.push_str(&self.decoder.flush(&assets.tokenizer).unwrap_or_default());
        }
        let fed = self.stop.feed(&raw);
        let mut text = fed.emit;
        if fed.matched.is_some() {
            self.stopped = true;
        } else if last {
            text.push_str(&self.stop.flush());
        }
        text
    }
}

#[cfg(test)]
pub(crate) mod tests;

/// An image as the worker gets it: its bytes, content hash and span.
fn media_input(image: &PlacedImage) -> tandem_protocol::worker::MediaInput {
    tandem_protocol::worker::MediaInput {
        data: image.input.data.as_ref().clone(),
        content_hash: image.input.hash.0.to_vec(),
        span: Some(image.span.into_wire()),
    }
}
