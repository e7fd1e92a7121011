//! Unit tests of the disaggregation decision and prefill planning.

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

fn input(role: WorkerRole, prompt_len: usize, cached: usize, n: usize, prefill: usize) -> Decision {
    input_with(&POLICY, role, prompt_len, cached, n, prefill)
}

fn input_with(
    policy: &DisaggPolicy,
    role: WorkerRole,
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
            beam_search: false,
            compatible_prefill: prefill,
        },
    )
}

fn beam(policy: &DisaggPolicy, role: WorkerRole, prefill: usize) -> Decision {
    decide(
        policy,
        &DecisionInput {
            decode_role: role,
            prompt_len: 4096,
            cached_tokens: 0,
            n: 2,
            beam_search: true,
            compatible_prefill: prefill,
        },
    )
}

#[test]
fn beam_search_runs_aggregated_or_is_refused_when_disagg_is_forced() {
    assert_eq!(
        beam(&POLICY, WorkerRole::Agg, 2),
        Local(LocalReason::AggWorker)
    );
    assert_eq!(
        beam(&POLICY, WorkerRole::Pd, 2),
        Local(LocalReason::BeamSearch)
    );
    assert_eq!(LocalReason::BeamSearch.label(), "beam_search");
    for (policy, role, cause) in [
        (&ENFORCED, WorkerRole::Pd, RemoteReason::Enforced),
        (&POLICY, WorkerRole::Decode, RemoteReason::DecodeOnly),
        (&ENFORCED, WorkerRole::Decode, RemoteReason::DecodeOnly),
    ] {
        assert_eq!(
            beam(policy, role, 2),
            Refuse {
                what: Refusal::BeamSearch,
                cause
            }
        );
    }
}

use Decision::*;

fn sp(n: usize) -> SamplingParams {
    SamplingParams {
        n,
        ..SamplingParams::default()
    }
}

#[test]
fn agg_workers_always_prefill_locally() {
    assert_eq!(
        input(WorkerRole::Agg, 4096, 0, 1, 3),
        Local(LocalReason::AggWorker)
    );
    assert_eq!(
        input_with(&ENFORCED, WorkerRole::Agg, 4096, 0, 4, 0),
        Local(LocalReason::AggWorker)
    );
    assert_eq!(
        input(WorkerRole::Prefill, 4096, 0, 1, 3),
        Local(LocalReason::AggWorker)
    );
}

#[test]
fn pd_long_uncached_prompt_goes_remote() {
    assert_eq!(
        input(WorkerRole::Pd, 1024, 0, 1, 1),
        Remote(RemoteReason::UncachedPrompt)
    );
    // Exactly the threshold of uncached tokens is enough.
    assert_eq!(
        input(WorkerRole::Pd, 256, 0, 1, 1),
        Remote(RemoteReason::UncachedPrompt)
    );
}

#[test]
fn pd_local_shortcuts() {
    assert_eq!(
        input(WorkerRole::Pd, 1024, 0, 1, 0),
        Local(LocalReason::NoPrefillWorker)
    );
    assert_eq!(
        input(WorkerRole::Pd, 255, 0, 1, 2),
        Local(LocalReason::ShortPrompt)
    );
    // 1024 prompt, 800 cached: 224 uncached < 256.
    assert_eq!(
        input(WorkerRole::Pd, 1024, 800, 1, 2),
        Local(LocalReason::ShortPrompt)
    );
    // 4096 prompt, 3300 cached: 796 uncached, but 80.6% cached.
    assert_eq!(
        input(WorkerRole::Pd, 4096, 3300, 1, 2),
        Local(LocalReason::DecodeCacheHit)
    );
    // 4096 prompt, 3200 cached: 78.1% < 80%.
    assert_eq!(
        input(WorkerRole::Pd, 4096, 3200, 1, 2),
        Remote(RemoteReason::UncachedPrompt)
    );
    assert_eq!(
        input(WorkerRole::Pd, 4096, 0, 2, 2),
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
        input_with(&never_local, WorkerRole::Pd, 1, 0, 1, 1),
        Remote(RemoteReason::UncachedPrompt)
    );
    // Fully cached with ratio 1.0: the whole prompt is on D, prefill there.
    let full = DisaggPolicy {
        prefill_threshold_tokens: 0,
        ..never_local
    };
    assert_eq!(
        input_with(&full, WorkerRole::Pd, 64, 64, 1, 1),
        Local(LocalReason::DecodeCacheHit)
    );
    let always_local = DisaggPolicy {
        decode_hit_ratio: 0.0,
        ..never_local
    };
    assert_eq!(
        input_with(&always_local, WorkerRole::Pd, 4096, 0, 1, 1),
        Local(LocalReason::DecodeCacheHit)
    );
    // Cached tokens over the prompt length (cannot happen, but must not underflow).
    assert_eq!(
        input(WorkerRole::Pd, 100, 200, 1, 1),
        Local(LocalReason::ShortPrompt)
    );
}

#[test]
fn enforced_pd_has_no_shortcuts() {
    assert_eq!(
        input_with(&ENFORCED, WorkerRole::Pd, 8, 8, 1, 1),
        Remote(RemoteReason::Enforced)
    );
    assert_eq!(
        input_with(&ENFORCED, WorkerRole::Pd, 8, 0, 1, 0),
        Refuse {
            what: Refusal::NoPrefillWorker,
            cause: RemoteReason::Enforced
        }
    );
    assert_eq!(
        input_with(&ENFORCED, WorkerRole::Pd, 8, 0, 2, 1),
        Refuse {
            what: Refusal::MultipleChoices,
            cause: RemoteReason::Enforced
        }
    );
}

#[test]
fn decode_workers_are_always_disaggregated() {
    assert_eq!(
        input(WorkerRole::Decode, 8, 8, 1, 1),
        Remote(RemoteReason::DecodeOnly)
    );
    assert_eq!(
        input(WorkerRole::Decode, 4096, 0, 1, 0),
        Refuse {
            what: Refusal::NoPrefillWorker,
            cause: RemoteReason::DecodeOnly
        }
    );
    assert_eq!(
        input(WorkerRole::Decode, 4096, 0, 3, 2),
        Refuse {
            what: Refusal::MultipleChoices,
            cause: RemoteReason::DecodeOnly
        }
    );
}

fn entry(role: WorkerRole, layout: &str, id: u64) -> WorkerEntry {
    WorkerEntry {
        card: tandem_protocol::ModelCard {
            protocol_version: tandem_protocol::WORKER_PROTOCOL_VERSION,
            served_model_name: "m".into(),
            tokenizer_hash: "h".into(),
            context_length: 4096,
            kv_cache_block_size: 32,
            kv_dtype: tandem_protocol::KvDtype::Float32,
            kv_layout_id: layout.into(),
            total_kv_blocks: 100,
            max_num_seqs: 8,
            max_num_batched_tokens: 2048,
            role,
            grpc_addr: format!("127.0.0.1:{}", 9000 + id),
            http_addr: String::new(),
            instance_id: id,
            eos_token_ids: vec![],
            kv_event_key: String::new(),
            multimodal: Default::default(),
            tool_call_parser: None,
            reasoning_parser: None,
        },
        client: crate::models::connect_lazy(&tandem_pki::ChannelSecurity::Plaintext, "127.0.0.1:1")
            .expect("client"),
        health: Default::default(),
    }
}

#[tokio::test]
async fn refusal_errors_name_the_cause() {
    let d = entry(WorkerRole::Pd, "L1", 7);
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
    for cause in [RemoteReason::Enforced, RemoteReason::DecodeOnly] {
        let e = refusal_error(Refusal::BeamSearch, cause, &d);
        assert_eq!(e.status.as_u16(), 400);
        assert_eq!(e.param.as_deref(), Some("use_beam_search"));
        assert!(e.message.contains("beam search"), "{}", e.message);
    }
}

#[tokio::test]
async fn only_prefill_workers_of_the_same_layout_pair() {
    let prefill = vec![
        entry(WorkerRole::Prefill, "L1", 2),
        entry(WorkerRole::Prefill, "L2", 3),
        entry(WorkerRole::Prefill, "", 4),
        entry(WorkerRole::Prefill, "L1", 5),
    ];
    let mut ids: Vec<u64> = compatible_prefill(&prefill, &entry(WorkerRole::Pd, "L1", 1))
        .iter()
        .map(|w| w.card.instance_id)
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, vec![2, 5]);
    // A decode worker with no layout id pairs with nothing.
    assert!(compatible_prefill(&prefill, &entry(WorkerRole::Pd, "", 9)).is_empty());
}

fn state(flags: &[&str]) -> AppState {
    let args: Vec<String> = std::iter::once("tandem-router")
        .chain(flags.iter().copied())
        .map(String::from)
        .collect();
    let cfg = tandem_config::parse_router(&args, &|_| None).expect("config");
    AppState::new(cfg, tandem_pki::ChannelSecurity::Plaintext, Some(7)).expect("state")
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

/// `request_id` routed to `decode` (which holds `cached_tokens` of the prompt).
fn routed<'a>(
    decode: &'a WorkerEntry,
    request_id: &'a str,
    hashes: &'a [LocalBlockHash],
    cached_tokens: usize,
    prompt_len: usize,
    params: &'a SamplingParams,
) -> RoutedRequest<'a> {
    RoutedRequest {
        request_id,
        decode,
        selection: selection(decode.card.instance_id, cached_tokens, prompt_len),
        hashes,
        prompt_len,
        params,
    }
}

fn view(decode: WorkerEntry, prefill: Vec<WorkerEntry>) -> ModelView {
    let dir = std::env::temp_dir().join(format!("tandem-router-disagg-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(
        dir.join("tokenizer.json"),
        r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
           "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,
           "decoder":null,"model":{"type":"WordLevel","vocab":{"a":0,"<unk>":1},
           "unk_token":"<unk>"}}"#,
    )
    .expect("write");
    let tokenizer = tandem_text::Tokenizer::load(&dir).expect("tokenizer");
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
        .map(|id| entry(WorkerRole::Prefill, "L1", id))
        .chain([entry(WorkerRole::Prefill, "L2", 6)])
        .collect();
    let v = view(entry(WorkerRole::Pd, "L1", 1), prefill);
    let prompt: Vec<u32> = (0..1024).collect();
    let hashes = tandem_kv_router::protocols::request_block_hashes(&prompt, 32, None);
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
    let targets = plan(&st, &v, &routed(d, "r1", &hashes, 0, 1024, &sp(1))).expect("plan");
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
    let h = tandem_kv_router::protocols::request_block_hashes(&short, 32, None);
    let t = plan(&st, &v, &routed(d, "r2", &h, 0, 40, &sp(1))).expect("plan");
    assert!(t.is_empty());
    assert!(!st.prefill_kv.free("r2"));
    // An agg worker never disaggregates.
    let agg = entry(WorkerRole::Agg, "L1", 9);
    let t = plan(&st, &v, &routed(&agg, "r3", &hashes, 0, 1024, &sp(1))).expect("plan");
    assert!(t.is_empty());
}

#[tokio::test]
async fn enforced_plan_refuses_what_cannot_run_disaggregated() {
    let st = state(&["--enforce-disagg"]);
    let v = view(
        entry(WorkerRole::Pd, "L1", 1),
        vec![entry(WorkerRole::Prefill, "L2", 2)],
    );
    let short: Vec<u32> = (0..8).collect();
    let h = tandem_kv_router::protocols::request_block_hashes(&short, 32, None);
    let d = &v.workers[0];
    let e = plan(&st, &v, &routed(d, "r1", &h, 8, 8, &sp(1))).expect_err("no layout");
    assert_eq!(e.status.as_u16(), 503);
    assert!(e.message.contains("--enforce-disagg"), "{}", e.message);
    let v = view(
        entry(WorkerRole::Pd, "L1", 1),
        vec![entry(WorkerRole::Prefill, "L1", 2)],
    );
    let t = plan(&st, &v, &routed(&v.workers[0], "r2", &h, 8, 8, &sp(1))).expect("plan");
    assert_eq!(t.len(), 1);
    assert_eq!(t[0].instance_id, 2);
    let e = plan(&st, &v, &routed(&v.workers[0], "r3", &h, 0, 8, &sp(2))).expect_err("n");
    assert_eq!(e.status.as_u16(), 400);
    assert_eq!(e.param.as_deref(), Some("n"));
    let beams = SamplingParams {
        use_beam_search: true,
        best_of: Some(4),
        ..sp(2)
    };
    let e = plan(&st, &v, &routed(&v.workers[0], "r4", &h, 0, 8, &beams)).expect_err("beam search");
    assert_eq!(e.status.as_u16(), 400);
    assert_eq!(e.param.as_deref(), Some("use_beam_search"));
}
