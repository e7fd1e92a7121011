//! Where a request's prompt is prefilled (DESIGN.md, request flow steps 3 and 5).
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
pub struct DecisionInput<'a> {
    /// The decode worker's role (its model card's `role`).
    pub decode_role: &'a str,
    pub prompt_len: usize,
    /// Prompt tokens the decode worker already holds.
    pub cached_tokens: usize,
    /// Choices asked for (`n`).
    pub n: usize,
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
pub fn decide(policy: &DisaggPolicy, input: &DecisionInput<'_>) -> Decision {
    let forced = match input.decode_role {
        "decode" => RemoteReason::DecodeOnly,
        "pd" if policy.enforce => RemoteReason::Enforced,
        "pd" => RemoteReason::UncachedPrompt,
        _ => return Decision::Local(LocalReason::AggWorker),
    };
    if forced != RemoteReason::UncachedPrompt {
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
        .filter(|p| &p.card.kv_layout_id == layout)
        .collect()
}

fn worker_info(w: &WorkerEntry) -> WorkerInfo {
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

/// Decides where the prompt of a request routed to `decode` (with `selection` from the decode
/// index) is prefilled. An empty list means on `decode` itself (`Generate`); otherwise the
/// prefill workers to hand to `decode.GenerateDisagg`, best first, the request being recorded
/// on the first one in `state.prefill_kv` (the caller marks and frees it there as on the
/// decode side).
#[allow(clippy::too_many_arguments)]
pub fn plan(
    state: &AppState,
    view: &ModelView,
    decode: &WorkerEntry,
    selection: &Selection,
    request_id: &str,
    hashes: &[LocalBlockHash],
    prompt_len: usize,
    n: usize,
) -> Result<Vec<PrefillTarget>, ApiError> {
    let policy = DisaggPolicy::from_config(&state.config.routing);
    let compatible = compatible_prefill(&view.prefill, decode);
    let input = DecisionInput {
        decode_role: &decode.card.role,
        prompt_len,
        cached_tokens: selection.cached_tokens,
        n,
        compatible_prefill: compatible.len(),
    };
    let local = |reason: LocalReason| {
        tracing::debug!(
            request_id,
            decode = decode.card.instance_id,
            prompt_len,
            cached_tokens = selection.cached_tokens,
            reason = reason.label(),
            "prefill on the decode worker"
        );
        count("local", reason.label());
    };
    let reason = match decide(&policy, &input) {
        Decision::Local(reason) => {
            local(reason);
            return Ok(Vec::new());
        }
        Decision::Refuse { what, cause } => {
            tracing::debug!(
                request_id,
                decode = decode.card.instance_id,
                compatible_prefill = compatible.len(),
                n,
                "refused: must run disaggregated ({}) but cannot ({what:?})",
                cause.label()
            );
            return Err(refusal_error(what, cause, decode));
        }
        Decision::Remote(reason) => reason,
    };
    let targets = match pick_prefill(state, request_id, hashes, prompt_len, &compatible) {
        Ok(t) => t,
        Err(RouteError::Select(e @ SelectError::NoWorkerAvailable { .. })) => {
            if reason == RemoteReason::UncachedPrompt {
                local(LocalReason::PrefillBusy);
                return Ok(Vec::new());
            }
            return Err(ApiError::unavailable(format!(
                "no prefill worker available for decode worker {}: {e}",
                decode.card.instance_id
            )));
        }
        Err(e) => return Err(ApiError::internal(e.to_string())),
    };
    tracing::debug!(
        request_id,
        decode = decode.card.instance_id,
        prefill = ?targets.iter().map(|t| t.instance_id).collect::<Vec<_>>(),
        prompt_len,
        cached_tokens = selection.cached_tokens,
        reason = reason.label(),
        "prefill on a prefill worker"
    );
    count("remote", reason.label());
    Ok(targets)
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: DisaggPolicy = DisaggPolicy {
        enforce: false,
        prefill_threshold_tokens: 256,
        decode_hit_ratio: 0.8,
    };
    const ENFORCED: DisaggPolicy = DisaggPolicy {
        enforce: true,
        ..POLICY
    };

    fn input(role: &str, prompt_len: usize, cached: usize, n: usize, prefill: usize) -> Decision {
        input_with(&POLICY, role, prompt_len, cached, n, prefill)
    }

    fn input_with(
        policy: &DisaggPolicy,
        role: &str,
        prompt_len: usize,
        cached: usize,
        n: usize,
        prefill: usize,
    ) -> Decision {
        decide(
            policy,
            &DecisionInput {
                decode_role: role,
                prompt_len,
                cached_tokens: cached,
                n,
                compatible_prefill: prefill,
            },
        )
    }

    use Decision::*;

    #[test]
    fn agg_workers_always_prefill_locally() {
        assert_eq!(input("agg", 4096, 0, 1, 3), Local(LocalReason::AggWorker));
        assert_eq!(
            input_with(&ENFORCED, "agg", 4096, 0, 4, 0),
            Local(LocalReason::AggWorker)
        );
        assert_eq!(input("", 4096, 0, 1, 3), Local(LocalReason::AggWorker));
    }

    #[test]
    fn pd_long_uncached_prompt_goes_remote() {
        assert_eq!(
            input("pd", 1024, 0, 1, 1),
            Remote(RemoteReason::UncachedPrompt)
        );
        // Exactly the threshold of uncached tokens is enough.
        assert_eq!(
            input("pd", 256, 0, 1, 1),
            Remote(RemoteReason::UncachedPrompt)
        );
    }

    #[test]
    fn pd_local_shortcuts() {
        assert_eq!(
            input("pd", 1024, 0, 1, 0),
            Local(LocalReason::NoPrefillWorker)
        );
        assert_eq!(input("pd", 255, 0, 1, 2), Local(LocalReason::ShortPrompt));
        // 1024 prompt, 800 cached: 224 uncached < 256.
        assert_eq!(
            input("pd", 1024, 800, 1, 2),
            Local(LocalReason::ShortPrompt)
        );
        // 4096 prompt, 3300 cached: 796 uncached, but 80.6% cached.
        assert_eq!(
            input("pd", 4096, 3300, 1, 2),
            Local(LocalReason::DecodeCacheHit)
        );
        // 4096 prompt, 3200 cached: 78.1% < 80%.
        assert_eq!(
            input("pd", 4096, 3200, 1, 2),
            Remote(RemoteReason::UncachedPrompt)
        );
        assert_eq!(
            input("pd", 4096, 0, 2, 2),
            Local(LocalReason::MultipleChoices)
        );
    }

    #[test]
    fn thresholds_at_their_limits() {
        let never_local = DisaggPolicy {
            enforce: false,
            prefill_threshold_tokens: 0,
            decode_hit_ratio: 1.0,
        };
        assert_eq!(
            input_with(&never_local, "pd", 1, 0, 1, 1),
            Remote(RemoteReason::UncachedPrompt)
        );
        // Fully cached with ratio 1.0: the whole prompt is on D, prefill there.
        let full = DisaggPolicy {
            prefill_threshold_tokens: 0,
            ..never_local
        };
        assert_eq!(
            input_with(&full, "pd", 64, 64, 1, 1),
            Local(LocalReason::DecodeCacheHit)
        );
        let always_local = DisaggPolicy {
            decode_hit_ratio: 0.0,
            ..never_local
        };
        assert_eq!(
            input_with(&always_local, "pd", 4096, 0, 1, 1),
            Local(LocalReason::DecodeCacheHit)
        );
        // Cached tokens over the prompt length (cannot happen, but must not underflow).
        assert_eq!(input("pd", 100, 200, 1, 1), Local(LocalReason::ShortPrompt));
    }

    #[test]
    fn enforced_pd_has_no_shortcuts() {
        assert_eq!(
            input_with(&ENFORCED, "pd", 8, 8, 1, 1),
            Remote(RemoteReason::Enforced)
        );
        assert_eq!(
            input_with(&ENFORCED, "pd", 8, 0, 1, 0),
            Refuse {
                what: Refusal::NoPrefillWorker,
                cause: RemoteReason::Enforced
            }
        );
        assert_eq!(
            input_with(&ENFORCED, "pd", 8, 0, 2, 1),
            Refuse {
                what: Refusal::MultipleChoices,
                cause: RemoteReason::Enforced
            }
        );
    }

    #[test]
    fn decode_workers_are_always_disaggregated() {
        assert_eq!(
            input("decode", 8, 8, 1, 1),
            Remote(RemoteReason::DecodeOnly)
        );
        assert_eq!(
            input("decode", 4096, 0, 1, 0),
            Refuse {
                what: Refusal::NoPrefillWorker,
                cause: RemoteReason::DecodeOnly
            }
        );
        assert_eq!(
            input("decode", 4096, 0, 3, 2),
            Refuse {
                what: Refusal::MultipleChoices,
                cause: RemoteReason::DecodeOnly
            }
        );
    }

    fn entry(role: &str, layout: &str, id: u64) -> WorkerEntry {
        WorkerEntry {
            card: tandem_protocol::ModelCard {
                served_model_name: "m".into(),
                tokenizer_hash: "h".into(),
                context_length: 4096,
                kv_cache_block_size: 32,
                kv_dtype: "float32".into(),
                kv_layout_id: layout.into(),
                total_kv_blocks: 100,
                max_num_seqs: 8,
                max_num_batched_tokens: 2048,
                role: role.into(),
                grpc_addr: format!("127.0.0.1:{}", 9000 + id),
                http_addr: String::new(),
                instance_id: id,
                eos_token_ids: vec![],
            },
            client: crate::models::connect_lazy("127.0.0.1:1").expect("client"),
        }
    }

    #[tokio::test]
    async fn refusal_errors_name_the_cause() {
        let d = entry("pd", "L1", 7);
        let e = refusal_error(Refusal::MultipleChoices, RemoteReason::Enforced, &d);
        assert_eq!(e.status.as_u16(), 400);
        assert_eq!(e.param.as_deref(), Some("n"));
        assert_eq!(
            e.message,
            "n > 1 is not supported with disaggregated prefill/decode (--enforce-disagg)"
        );
        let e = refusal_error(Refusal::NoPrefillWorker, RemoteReason::Enforced, &d);
        assert_eq!(e.status.as_u16(), 503);
        assert!(e.message.contains("--enforce-disagg"), "{}", e.message);
        assert!(e.message.contains("L1"), "{}", e.message);
        let e = refusal_error(Refusal::NoPrefillWorker, RemoteReason::DecodeOnly, &d);
        assert_eq!(e.status.as_u16(), 503);
        assert!(e.message.contains("`decode` mode"), "{}", e.message);
    }

    #[tokio::test]
    async fn only_prefill_workers_of_the_same_layout_pair() {
        let prefill = vec![
            entry("prefill", "L1", 2),
            entry("prefill", "L2", 3),
            entry("prefill", "", 4),
            entry("prefill", "L1", 5),
        ];
        let mut ids: Vec<u64> = compatible_prefill(&prefill, &entry("pd", "L1", 1))
            .iter()
            .map(|w| w.card.instance_id)
            .collect();
        ids.sort_unstable();
        assert_eq!(ids, vec![2, 5]);
        // A decode worker with no layout id pairs with nothing.
        assert!(compatible_prefill(&prefill, &entry("pd", "", 9)).is_empty());
    }

    fn state(flags: &[&str]) -> AppState {
        let args: Vec<String> = std::iter::once("tandem-router")
            .chain(flags.iter().copied())
            .map(String::from)
            .collect();
        let cfg = tandem_config::parse_router(&args, &|_| None).expect("config");
        let kv = || {
            std::sync::Arc::new(tandem_kv_router::KvRouter::new(
                crate::app::kv_router_config(&cfg).expect("kv config"),
                Some(7),
            ))
        };
        AppState {
            registry: Default::default(),
            kv: kv(),
            prefill_kv: kv(),
            dumps: Default::default(),
            config: std::sync::Arc::new(cfg),
        }
    }

    fn selection(worker_id: u64, cached_tokens: usize, prompt_len: usize) -> Selection {
        Selection {
            worker_id,
            mode: tandem_kv_router::RouterMode::Kv,
            overlap_blocks: (cached_tokens / 32) as u32,
            cached_tokens,
            new_prefill_tokens: prompt_len - cached_tokens,
            logit: None,
        }
    }

    fn view(decode: WorkerEntry, prefill: Vec<WorkerEntry>) -> ModelView {
        let dir =
            std::env::temp_dir().join(format!("tandem-router-disagg-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(
            dir.join("tokenizer.json"),
            r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
               "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,
               "decoder":null,"model":{"type":"WordLevel","vocab":{"a":0,"<unk>":1},
               "unk_token":"<unk>"}}"#,
        )
        .expect("write");
        let tokenizer = tandem_engine::tokenizer::Tokenizer::load(&dir).expect("tokenizer");
        let _ = std::fs::remove_dir_all(&dir);
        ModelView {
            name: "m".into(),
            assets: std::sync::Arc::new(crate::models::ModelAssets {
                tokenizer,
                template: None,
                hash: "h".into(),
            }),
            workers: vec![decode],
            prefill,
        }
    }

    #[tokio::test]
    async fn plan_orders_prefill_workers_and_records_the_best() {
        let st = state(&[]);
        let prefill: Vec<WorkerEntry> = [2, 3, 4, 5]
            .into_iter()
            .map(|id| entry("prefill", "L1", id))
            .chain([entry("prefill", "L2", 6)])
            .collect();
        let v = view(entry("pd", "L1", 1), prefill);
        let prompt: Vec<u32> = (0..1024).collect();
        let hashes = tandem_kv_router::protocols::request_block_hashes(&prompt, 32);
        // Workers 2 and 3 are already busy prefilling other prompts: they come last.
        let infos: Vec<WorkerInfo> = v.prefill.iter().map(worker_info).collect();
        for (rid, id) in [("other-2", 2), ("other-3", 3)] {
            st.prefill_kv
                .route(
                    rid,
                    &hashes[..8],
                    256,
                    &infos,
                    &SelectOptions {
                        worker_id: Some(id),
                        ..Default::default()
                    },
                )
                .ok();
        }
        let loaded: Vec<u64> = [2, 3, 4, 5]
            .into_iter()
            .filter(|id| st.prefill_kv.worker_load(*id).active_requests > 0)
            .collect();
        let d = &v.workers[0];
        let targets =
            plan(&st, &v, d, &selection(1, 0, 1024), "r1", &hashes, 1024, 1).expect("plan");
        let ids: Vec<u64> = targets.iter().map(|t| t.instance_id).collect();
        assert_eq!(ids.len(), MAX_PREFILL_CANDIDATES, "{ids:?}");
        assert!(!ids.contains(&6), "another KV layout was paired: {ids:?}");
        let mut unique = ids.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ids.len(), "{ids:?}");
        assert!(
            !loaded.contains(&ids[0]),
            "a loaded worker came first: {ids:?} {loaded:?}"
        );
        assert_eq!(targets[0].grpc_addr, format!("127.0.0.1:{}", 9000 + ids[0]));
        // The request is recorded on the best prefill worker only.
        let before = if loaded.contains(&ids[0]) { 1 } else { 0 };
        assert_eq!(
            st.prefill_kv.worker_load(ids[0]).active_requests,
            before + 1
        );
        assert!(st.prefill_kv.free("r1"));

        // A short prompt stays on the decode worker and records nothing.
        let short: Vec<u32> = (0..40).collect();
        let h = tandem_kv_router::protocols::request_block_hashes(&short, 32);
        let t = plan(&st, &v, d, &selection(1, 0, 40), "r2", &h, 40, 1).expect("plan");
        assert!(t.is_empty());
        assert!(!st.prefill_kv.free("r2"));
        // An agg worker never disaggregates.
        let agg = entry("agg", "L1", 9);
        let t = plan(
            &st,
            &v,
            &agg,
            &selection(9, 0, 1024),
            "r3",
            &hashes,
            1024,
            1,
        )
        .expect("plan");
        assert!(t.is_empty());
    }

    #[tokio::test]
    async fn enforced_plan_refuses_what_cannot_run_disaggregated() {
        let st = state(&["--enforce-disagg"]);
        let v = view(entry("pd", "L1", 1), vec![entry("prefill", "L2", 2)]);
        let short: Vec<u32> = (0..8).collect();
        let h = tandem_kv_router::protocols::request_block_hashes(&short, 32);
        let d = &v.workers[0];
        let e = plan(&st, &v, d, &selection(1, 8, 8), "r1", &h, 8, 1).expect_err("no layout");
        assert_eq!(e.status.as_u16(), 503);
        assert!(e.message.contains("--enforce-disagg"), "{}", e.message);
        let v = view(entry("pd", "L1", 1), vec![entry("prefill", "L1", 2)]);
        let t = plan(&st, &v, &v.workers[0], &selection(1, 8, 8), "r2", &h, 8, 1).expect("plan");
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].instance_id, 2);
        let e = plan(&st, &v, &v.workers[0], &selection(1, 0, 8), "r3", &h, 8, 2).expect_err("n");
        assert_eq!(e.status.as_u16(), 400);
        assert_eq!(e.param.as_deref(), Some("n"));
    }
}
