//! Where a request's prompt is prefilled: on the decode worker the router chose, or on prefill
//! workers that send the prompt's KV to it.
//!
//! The decode worker D is chosen first, on the decode index (`AppState::kv`), as for an
//! aggregated request. Then:
//! - D in `agg` mode prefills itself (plain `Generate`).
//! - D in `pd` mode disaggregates conditionally: it prefills itself when no prefill worker
//!   shares its KV layout, when few prompt tokens are uncached on it
//!   (`--disagg-prefill-threshold-tokens`), when it already holds most of the prompt
//!   (`--disagg-decode-hit-ratio`), or when the request cannot run disaggregated (`n > 1`).
//!   With `--enforce-disagg` none of these shortcuts apply: such requests are refused.
//! - D in `decode` mode cannot prefill: always disaggregated, as if enforced.
//!
//! Disaggregated, the router picks up to [`MAX_PREFILL_CANDIDATES`] prefill workers with D's
//! KV layout (never another), best first by the prefill index (`AppState::prefill_kv`: KV
//! overlap and load, the same cost as the decode side), records the request on the best one,
//! and calls `D.GenerateDisagg` with them; D tries them in order.
//!
//! `n > 1` cannot run disaggregated: a prefill worker computes the prompt once and hands D the
//! sampling state of one sequence with the first token it sampled, so there is no way to start
//! `n` independent sequences from one remote prefill.
//!
//! [`decide`] is the pure decision; [`plan`] applies it to a routed request.

use tandem_config::RoutingConfig;
use tandem_kv_router::protocols::LocalBlockHash;
use tandem_kv_router::{RouteError, SelectError, SelectOptions, Selection, WorkerInfo};
use tandem_protocol::worker::PrefillTarget;
use tandem_protocol::WorkerRole;
use tandem_text::SamplingParams;

use crate::app::AppState;
use crate::error::ApiError;
use crate::metrics as m;
use crate::models::{ModelView, WorkerEntry};

/// The best prefill worker plus up to two fallbacks.
pub const MAX_PREFILL_CANDIDATES: usize = 3;

/// The router's disaggregation settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DisaggPolicy {
    /// `--enforce-disagg`: a `pd` decode worker never prefills itself.
    pub enforce: bool,
    /// `--disagg-prefill-threshold-tokens`: fewer uncached prompt tokens prefill locally.
    pub prefill_threshold_tokens: u32,
    /// `--disagg-decode-hit-ratio`: a decode worker holding at least this fraction of the
    /// prompt prefills locally.
    pub decode_hit_ratio: f64,
}

impl DisaggPolicy {
    pub fn from_config(r: &RoutingConfig) -> Self {
        DisaggPolicy {
            enforce: r.enforce_disagg,
            prefill_threshold_tokens: r.disagg_prefill_threshold_tokens,
            decode_hit_ratio: r.disagg_decode_hit_ratio,
        }
    }
}

/// What the decision looks at.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecisionInput {
    /// The decode worker's role (its model card's `role`).
    pub decode_role: WorkerRole,
    pub prompt_len: usize,
    /// Prompt tokens the decode worker already holds.
    pub cached_tokens: usize,
    /// Choices asked for (`n`).
    pub n: usize,
    /// `use_beam_search`: beams fork from the prompt on one engine, which a remote prefill
    /// cannot hand over yet.
    pub beam_search: bool,
    /// Prefill workers with the decode worker's KV layout.
    pub compatible_prefill: usize,
}

/// Why the prompt is prefilled on the decode worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalReason {
    /// The decode worker is aggregated (or of an unknown role).
    AggWorker,
    /// No prefill worker shares its KV layout.
    NoPrefillWorker,
    /// `n > 1` cannot run disaggregated.
    MultipleChoices,
    /// Beam search cannot run disaggregated.
    BeamSearch,
    /// Fewer uncached prompt tokens than `--disagg-prefill-threshold-tokens`.
    ShortPrompt,
    /// The decode worker holds at least `--disagg-decode-hit-ratio` of the prompt.
    DecodeCacheHit,
    /// Every compatible prefill worker is busy.
    PrefillBusy,
}

impl LocalReason {
    pub fn label(self) -> &'static str {
        match self {
            LocalReason::AggWorker => "agg_worker",
            LocalReason::NoPrefillWorker => "no_prefill_worker",
            LocalReason::MultipleChoices => "n_gt_1",
            LocalReason::BeamSearch => "beam_search",
            LocalReason::ShortPrompt => "short_prompt",
            LocalReason::DecodeCacheHit => "decode_cache_hit",
            LocalReason::PrefillBusy => "prefill_busy",
        }
    }
}

/// Why the prompt is prefilled on a prefill worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteReason {
    /// `--enforce-disagg` with a `pd` decode worker.
    Enforced,
    /// The decode worker is in `decode` mode and cannot prefill.
    DecodeOnly,
    /// A `pd` decode worker with enough uncached prompt tokens.
    UncachedPrompt,
}

impl RemoteReason {
    pub fn label(self) -> &'static str {
        match self {
            RemoteReason::Enforced => "enforced",
            RemoteReason::DecodeOnly => "decode_only",
            RemoteReason::UncachedPrompt => "uncached_prompt",
        }
    }
}

/// Why a request that must run disaggregated cannot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No prefill worker shares the decode worker's KV layout (503).
    NoPrefillWorker,
    /// `n > 1` (400).
    MultipleChoices,
    /// `use_beam_search` (400).
    BeamSearch,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Local(LocalReason),
    Remote(RemoteReason),
    /// The request must run disaggregated (`cause`) but cannot.
    Refuse {
        what: Refusal,
        cause: RemoteReason,
    },
}

/// The pure decision for a request routed to a decode worker.
pub fn decide(policy: &DisaggPolicy, input: &DecisionInput) -> Decision {
    let forced = match input.decode_role {
        WorkerRole::Decode => RemoteReason::DecodeOnly,
        WorkerRole::Pd if policy.enforce => RemoteReason::Enforced,
        WorkerRole::Pd => RemoteReason::UncachedPrompt,
        WorkerRole::Agg | WorkerRole::Prefill | WorkerRole::Encode => {
            return Decision::Local(LocalReason::AggWorker)
        }
    };
    if forced != RemoteReason::UncachedPrompt {
        if input.beam_search {
            return Decision::Refuse {
                what: Refusal::BeamSearch,
                cause: forced,
            };
        }
        if input.n > 1 {
            return Decision::Refuse {
                what: Refusal::MultipleChoices,
                cause: forced,
            };
        }
        if input.compatible_prefill == 0 {
            return Decision::Refuse {
                what: Refusal::NoPrefillWorker,
                cause: forced,
            };
        }
        return Decision::Remote(forced);
    }
    if input.compatible_prefill == 0 {
        return Decision::Local(LocalReason::NoPrefillWorker);
    }
    if input.beam_search {
        return Decision::Local(LocalReason::BeamSearch);
    }
    if input.n > 1 {
        return Decision::Local(LocalReason::MultipleChoices);
    }
    let cached = input.cached_tokens.min(input.prompt_len);
    let uncached = input.prompt_len - cached;
    if uncached < policy.prefill_threshold_tokens as usize {
        return Decision::Local(LocalReason::ShortPrompt);
    }
    if input.prompt_len > 0 && cached as f64 / input.prompt_len as f64 >= policy.decode_hit_ratio {
        return Decision::Local(LocalReason::DecodeCacheHit);
    }
    Decision::Remote(RemoteReason::UncachedPrompt)
}

fn cause_text(cause: RemoteReason) -> &'static str {
    match cause {
        RemoteReason::DecodeOnly => "its decode workers run in `decode` mode and cannot prefill",
        _ => "--enforce-disagg",
    }
}

/// The client's error for a refusal, `decode` being the chosen decode worker.
pub fn refusal_error(what: Refusal, cause: RemoteReason, decode: &WorkerEntry) -> ApiError {
    match what {
        Refusal::BeamSearch => ApiError::bad_request(
            format!(
                "beam search (`use_beam_search`, `best_of`) is not supported with disaggregated \
                 prefill/decode ({}); it runs on aggregated or `pd` workers without \
                 --enforce-disagg",
                cause_text(cause)
            ),
            Some("use_beam_search"),
        ),
        Refusal::MultipleChoices => ApiError::bad_request(
            format!(
                "n > 1 is not supported with disaggregated prefill/decode ({})",
                cause_text(cause)
            ),
            Some("n"),
        ),
        Refusal::NoPrefillWorker => ApiError::unavailable(match cause {
            RemoteReason::DecodeOnly => format!(
                "no prefill worker with KV layout `{}` is available for decode worker {} \
                 (a worker in `decode` mode cannot prefill)",
                decode.card.kv_layout_id, decode.card.instance_id
            ),
            _ => format!(
                "no prefill worker with KV layout `{}` is available for decode worker {}, and \
                 --enforce-disagg forbids prefilling on the decode worker",
                decode.card.kv_layout_id, decode.card.instance_id
            ),
        }),
    }
}

/// The prefill workers that may write into `decode`'s KV memory: the same KV layout (an
/// unknown layout pairs with nothing).
pub fn compatible_prefill<'a>(
    prefill: &'a [WorkerEntry],
    decode: &WorkerEntry,
) -> Vec<&'a WorkerEntry> {
    let layout = &decode.card.kv_layout_id;
    if layout.is_empty() {
        return Vec::new();
    }
    prefill
        .iter()
        .filter(|p| &p.card.kv_layout_id == layout && p.healthy())
        .collect()
}

/// What the KV router needs to know of a worker.
pub(crate) fn worker_info(w: &WorkerEntry) -> WorkerInfo {
    WorkerInfo {
        id: w.card.instance_id,
        total_blocks: w.card.total_kv_blocks.into(),
        max_num_batched_tokens: w.card.max_num_batched_tokens.into(),
        block_size: w.card.kv_cache_block_size,
    }
}

/// Orders up to [`MAX_PREFILL_CANDIDATES`] of `prefill` for the request, best first by the
/// prefill index, and records the request on the best one (`state.prefill_kv`, under
/// `request_id`). Busy workers are left out; none left is `NoWorkerAvailable`.
pub fn pick_prefill(
    state: &AppState,
    request_id: &str,
    hashes: &[LocalBlockHash],
    prompt_len: usize,
    prefill: &[&WorkerEntry],
) -> Result<Vec<PrefillTarget>, RouteError> {
    let mut rest: Vec<WorkerInfo> = prefill.iter().map(|w| worker_info(w)).collect();
    let opts = SelectOptions::default();
    let best = state
        .prefill_kv
        .route(request_id, hashes, prompt_len, &rest, &opts)?;
    let mut chosen: Vec<Selection> = vec![best];
    rest.retain(|w| w.id != best.worker_id);
    while chosen.len() < MAX_PREFILL_CANDIDATES && !rest.is_empty() {
        let Ok(next) = state.prefill_kv.select(hashes, prompt_len, &rest, &opts) else {
            break;
        };
        rest.retain(|w| w.id != next.worker_id);
        chosen.push(next);
    }
    Ok(chosen
        .iter()
        .filter_map(|s| prefill.iter().find(|w| w.card.instance_id == s.worker_id))
        .map(|w| PrefillTarget {
            instance_id: w.card.instance_id,
            grpc_addr: w.card.grpc_addr.clone(),
        })
        .collect())
}

fn count(decision: &'static str, reason: &'static str) {
    metrics::counter!(m::DISAGG_DECISIONS, "decision" => decision, "reason" => reason).increment(1);
}

/// A request routed to a decode worker, as [`plan`] sees it.
#[derive(Clone, Copy)]
pub struct RoutedRequest<'a> {
    pub request_id: &'a str,
    /// The decode worker the decode index chose.
    pub decode: &'a WorkerEntry,
    /// The decode index's choice (the prompt tokens `decode` already holds).
    pub selection: Selection,
    pub hashes: &'a [LocalBlockHash],
    pub prompt_len: usize,
    pub params: &'a SamplingParams,
}

/// Decides where the prompt of a request routed to `req.decode` is prefilled. An empty list
/// means on the decode worker itself (`Generate`); otherwise the prefill workers to hand to
/// `decode.GenerateDisagg`, best first, the request being recorded on the first one in
/// `state.prefill_kv` (the caller marks and frees it there as on the decode side).
pub fn plan(
    state: &AppState,
    view: &ModelView,
    req: &RoutedRequest<'_>,
) -> Result<Vec<PrefillTarget>, ApiError> {
    let policy = DisaggPolicy::from_config(&state.config.routing);
    let compatible = compatible_prefill(&view.prefill, req.decode);
    match decide(&policy, &req.decision_input(compatible.len())) {
        Decision::Local(reason) => {
            req.prefill_locally(reason);
            Ok(Vec::new())
        }
        Decision::Refuse { what, cause } => Err(req.refuse(what, cause, compatible.len())),
        Decision::Remote(reason) => req.prefill_remotely(state, reason, &compatible),
    }
}

impl RoutedRequest<'_> {
    fn decision_input(&self, compatible_prefill: usize) -> DecisionInput {
        DecisionInput {
            decode_role: self.decode.card.role,
            prompt_len: self.prompt_len,
            cached_tokens: self.selection.cached_tokens,
            n: self.params.n,
            beam_search: self.params.use_beam_search,
            compatible_prefill,
        }
    }

    /// Logs and counts a prompt left to the decode worker.
    fn prefill_locally(&self, reason: LocalReason) {
        tracing::debug!(
            request_id = self.request_id,
            decode = self.decode.card.instance_id,
            prompt_len = self.prompt_len,
            cached_tokens = self.selection.cached_tokens,
            reason = reason.label(),
            "prefill on the decode worker"
        );
        count("local", reason.label());
    }

    /// The client's error for a request that must run disaggregated but cannot.
    fn refuse(&self, what: Refusal, cause: RemoteReason, compatible_prefill: usize) -> ApiError {
        tracing::debug!(
            request_id = self.request_id,
            decode = self.decode.card.instance_id,
            compatible_prefill,
            n = self.params.n,
            "refused: must run disaggregated ({}) but cannot ({what:?})",
            cause.label()
        );
        refusal_error(what, cause, self.decode)
    }

    /// The prefill workers for the request, out of `compatible`. When all are busy, a request
    /// that may prefill locally (`UncachedPrompt`) does; any other is refused (503).
    fn prefill_remotely(
        &self,
        state: &AppState,
        reason: RemoteReason,
        compatible: &[&WorkerEntry],
    ) -> Result<Vec<PrefillTarget>, ApiError> {
        let picked = pick_prefill(
            state,
            self.request_id,
            self.hashes,
            self.prompt_len,
            compatible,
        );
        let targets = match picked {
            Ok(t) => t,
            Err(RouteError::Select(e @ SelectError::NoWorkerAvailable { .. })) => {
                if reason == RemoteReason::UncachedPrompt {
                    self.prefill_locally(LocalReason::PrefillBusy);
                    return Ok(Vec::new());
                }
                return Err(ApiError::unavailable(format!(
                    "no prefill worker available for decode worker {}: {e}",
                    self.decode.card.instance_id
                )));
            }
            Err(e) => return Err(ApiError::internal(e.to_string())),
        };
        tracing::debug!(
            request_id = self.request_id,
            decode = self.decode.card.instance_id,
            prefill = ?targets.iter().map(|t| t.instance_id).collect::<Vec<_>>(),
            prompt_len = self.prompt_len,
            cached_tokens = self.selection.cached_tokens,
            reason = reason.label(),
            "prefill on a prefill worker"
        );
        count("remote", reason.label());
        Ok(targets)
    }
}

#[cfg(test)]
mod tests;
