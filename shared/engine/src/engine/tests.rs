//! Engine tests over [`TestBackend`](super::test_backend::TestBackend).

use std::sync::atomic::Ordering;

use super::test_backend::{TestBackend, EOS, T};
use super::*;
use crate::kv::events::KvCacheEventData;
use crate::kv::hash::CacheSalt;
use crate::sampler::SamplingParams;

pub(super) fn config(num_blocks: usize) -> EngineConfig {
    EngineConfig {
        max_batch_size: 8,
        max_num_tokens: 32,
        max_seq_len: 256,
        num_blocks,
        eos_token_ids: vec![EOS],
        capacity_scheduler_policy: CapacitySchedulerPolicy::MaxUtilization,
        ..EngineConfig::default()
    }
}

fn start(block_size: usize, num_blocks: usize, cfg: EngineConfig) -> EngineHandle {
    Engine::start(
        Box::new(TestBackend::new(block_size, num_blocks)),
        None,
        cfg,
    )
    .unwrap()
}

fn req(id: &str, prompt: Vec<u32>, params: SamplingParams) -> Request {
    Request {
        request_id: id.into(),
        cache_salt: None,
        prompt,
        params,
        media: Default::default(),
        replayed: 0,
    }
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (seed * 7 + i * 3) % 60 + 1)
        .collect()
}

pub(super) fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..SamplingParams::greedy()
    }
}

fn sampled(max_tokens: usize, seed: u64) -> SamplingParams {
    SamplingParams {
        max_tokens: Some(max_tokens),
        seed: Some(seed),
        temperature: 0.8,
        top_p: 0.9,
        top_k: 20,
        repetition_penalty: 1.2,
        frequency_penalty: 0.3,
        presence_penalty: 0.2,
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

fn tokens(outs: &[RequestOutput]) -> Vec<u32> {
    outs.iter()
        .flat_map(|o| o.token_ids.iter().copied())
        .collect()
}

pub(super) async fn run(h: &EngineHandle, r: Request) -> Vec<RequestOutput> {
    let s = h.submit(r).await.unwrap();
    tokio::time::timeout(T, s.collect()).await.unwrap()
}

pub(super) async fn wait_idle(h: &EngineHandle) -> EngineStats {
    // Finishing is processed before the last output is sent, so one round trip suffices.
    tokio::time::timeout(T, h.stats()).await.unwrap().unwrap()
}

#[tokio::test]
async fn stats_split_step_time_into_forward_and_the_engine_own() {
    let mut backend = TestBackend::new(4, 64);
    backend.forward_time = std::time::Duration::from_millis(2);
    let h = Engine::start(Box::new(backend), None, config(64)).unwrap();
    let before = wait_idle(&h).await;
    assert_eq!(
        (before.steps, before.step_micros, before.forward_micros),
        (0, 0, 0)
    );
    run(&h, req("a", prompt(1, 10), greedy(5))).await;
    let s = wait_idle(&h).await;
    // One prefill step and four decode steps, each at least the backend's 2 ms.
    assert_eq!(s.steps, 5);
    assert!(s.forward_micros >= 5 * 2_000, "{s:?}");
    assert!(s.step_micros >= s.forward_micros, "{s:?}");
    // `apply` is part of the step outside the forward pass; a step's stop and the next
    // one's start are not (one request alone: back to back, no waiting in between).
    assert!(s.apply_micros > 0, "{s:?}");
    assert!(
        s.step_micros >= s.forward_micros + s.apply_micros + s.schedule_micros,
        "{s:?}"
    );
    assert!(s.between_steps_micros < s.forward_micros, "{s:?}");
}

#[tokio::test]
async fn concurrent_requests_under_preemption_match_solo_runs() {
    let solo = start(4, 64, config(64));
    let mut want = Vec::new();
    for i in 0..6 {
        let p = if i % 2 == 0 {
            greedy(20)
        } else {
            sampled(20, i)
        };
        want.push(tokens(
            &run(&solo, req("x", prompt(i as u32, 10 + i as usize), p)).await,
        ));
    }
    // 12 blocks of 4 tokens: each request grows to ~8 blocks, so they preempt each other.
    // The engine holds its first step until every request is queued, so they overlap.
    let (gb, permits) = TestBackend::gated(4, 12);
    let h = Engine::start(Box::new(gb), None, config(12)).unwrap();
    let mut pending = Vec::new();
    for i in 0..6 {
        let p = if i % 2 == 0 {
            greedy(20)
        } else {
            sampled(20, i)
        };
        pending.push(h.submit(req(&format!("r{i}"), prompt(i as u32, 10 + i as usize), p)));
    }
    for _ in 0..10_000 {
        permits.send(()).unwrap();
    }
    let mut streams = Vec::new();
    for f in pending {
        streams.push(tokio::time::timeout(T, f).await.unwrap().unwrap());
    }
    for (i, s) in streams.into_iter().enumerate() {
        let outs = tokio::time::timeout(T, s.collect()).await.unwrap();
        assert_eq!(tokens(&outs), want[i], "request {i}");
        let last = outs.last().unwrap();
        assert_eq!(last.finish_reason, Some(FinishReason::Length));
        assert_eq!(last.usage.unwrap().completion_tokens, 20);
    }
    let st = wait_idle(&h).await;
    assert!(st.preemptions > 0, "the pool was meant to force preemption");
    assert_eq!((st.running, st.waiting, st.requests), (0, 0, 0));
    assert_eq!(st.blocks.referenced, 0);
    assert_eq!(st.blocks.cached + st.blocks.free, 12);
}

#[tokio::test]
async fn guaranteed_no_evict_also_completes() {
    let cfg = EngineConfig {
        capacity_scheduler_policy: CapacitySchedulerPolicy::GuaranteedNoEvict,
        ..config(12)
    };
    let h = start(4, 12, cfg);
    let mut streams = Vec::new();
    for i in 0..4 {
        streams.push(
            h.submit(req(&format!("r{i}"), prompt(i, 12), greedy(16)))
                .await
                .unwrap(),
        );
    }
    for s in streams {
        let outs = tokio::time::timeout(T, s.collect()).await.unwrap();
        assert_eq!(tokens(&outs).len(), 16);
    }
    let st = wait_idle(&h).await;
    assert_eq!(st.preemptions, 0);
    assert_eq!(st.blocks.referenced, 0);
}

#[tokio::test]
async fn limits_are_clear_errors() {
    let h = start(
        4,
        16,
        EngineConfig {
            max_seq_len: 32,
            ..config(16)
        },
    );
    let e = h
        .submit(req("a", prompt(0, 20), greedy(20)))
        .await
        .err()
        .unwrap();
    assert!(e.to_string().contains("exceeds max_seq_len"), "{e}");
    let e = h.submit(req("b", vec![], greedy(2))).await.err().unwrap();
    assert!(matches!(e, EngineError::InvalidRequest(_)));
    let e = h
        .submit(req("c", vec![999], greedy(2)))
        .await
        .err()
        .unwrap();
    assert!(e.to_string().contains("vocabulary"));
    let stop = SamplingParams {
        stop: vec!["x".into()],
        ..greedy(2)
    };
    assert!(h.submit(req("d", prompt(0, 3), stop)).await.is_err());
    // Within max_seq_len but larger than the whole pool: refused, never admitted to hang.
    let small = start(
        4,
        2,
        EngineConfig {
            max_seq_len: 64,
            ..config(2)
        },
    );
    let e = small
        .submit(req("e", prompt(0, 4), greedy(10)))
        .await
        .err()
        .unwrap();
    assert!(e.to_string().contains("KV blocks"), "{e}");
    // Without max_tokens the pool bounds the length instead: 2 blocks = 8 tokens.
    let no_max = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    let outs = run(&small, req("f", prompt(0, 3), no_max)).await;
    assert_eq!(tokens(&outs).len(), 5);
    assert_eq!(
        outs.last().unwrap().finish_reason,
        Some(FinishReason::Length)
    );
    let (gb, permits) = TestBackend::gated(4, 16);
    let g = Engine::start(Box::new(gb), None, config(16)).unwrap();
    let _keep = g
        .submit(req("dup", prompt(0, 3), greedy(28)))
        .await
        .unwrap();
    let second = g.submit(req("dup", prompt(0, 3), greedy(2)));
    permits.send(()).unwrap();
    let e = tokio::time::timeout(T, second)
        .await
        .unwrap()
        .err()
        .unwrap();
    assert!(matches!(e, EngineError::DuplicateRequest(_)));
}

#[tokio::test]
async fn abort_and_dropped_streams_free_blocks() {
    let (gb, permits) = TestBackend::gated(4, 64);
    let h = Engine::start(Box::new(gb), None, config(64)).unwrap();
    let mut s = h.submit(req("a", prompt(1, 9), greedy(200))).await.unwrap();
    permits.send(()).unwrap();
    let first = tokio::time::timeout(T, s.next()).await.unwrap().unwrap();
    assert_eq!(first.token_ids.len(), 1);
    // The abort lands before or after the engine's second step, depending on timing.
    h.abort("a");
    permits.send(()).unwrap();
    let rest = tokio::time::timeout(T, s.collect()).await.unwrap();
    assert!(rest.len() <= 2);
    let last = rest.last().unwrap();
    assert_eq!(last.finish_reason, Some(FinishReason::Abort));
    assert_eq!(last.usage.unwrap().completion_tokens, rest.len());
    let mut s2 = h.submit(req("b", prompt(2, 9), greedy(200))).await.unwrap();
    permits.send(()).unwrap();
    tokio::time::timeout(T, s2.next()).await.unwrap().unwrap();
    drop(s2);
    let stats = h.stats();
    permits.send(()).unwrap();
    let st = tokio::time::timeout(T, stats).await.unwrap().unwrap();
    assert_eq!((st.requests, st.running, st.blocks.referenced), (0, 0, 0));
}

#[tokio::test]
async fn eos_stop_ids_and_n_choices() {
    let h = start(4, 64, config(64));
    // Find the greedy continuation, then stop on its third token.
    let outs = run(&h, req("g", prompt(3, 5), greedy(8))).await;
    let toks = tokens(&outs);
    let p = SamplingParams {
        stop_token_ids: vec![toks[2]],
        ..greedy(8)
    };
    let outs = run(&h, req("s", prompt(3, 5), p)).await;
    let last = outs.last().unwrap();
    assert_eq!(tokens(&outs), toks[..3].to_vec());
    assert_eq!(last.finish_reason, Some(FinishReason::Stop));
    assert_eq!(last.stop_reason, Some(StopReason::TokenId(toks[2])));
    // min_tokens masks the stop id for the first 3 tokens.
    let p = SamplingParams {
        stop_token_ids: vec![toks[2]],
        min_tokens: 3,
        ..greedy(8)
    };
    let outs = run(&h, req("m", prompt(3, 5), p)).await;
    assert!(tokens(&outs).len() > 3);
    // n = 3 seeded: reproducible, choices independent.
    let p = SamplingParams {
        n: 3,
        ..sampled(12, 42)
    };
    let a = run(&h, req("n1", prompt(4, 6), p.clone())).await;
    let b = run(&h, req("n2", prompt(4, 6), p)).await;
    let per = |outs: &[RequestOutput], i| {
        tokens(
            &outs
                .iter()
                .filter(|o| o.index == i)
                .cloned()
                .collect::<Vec<_>>(),
        )
    };
    for i in 0..3 {
        assert_eq!(per(&a, i), per(&b, i));
        assert_eq!(per(&a, i).len(), 12);
    }
    assert!(per(&a, 0) != per(&a, 1) || per(&a, 1) != per(&a, 2));
    assert_eq!(a.iter().filter(|o| o.finish_reason.is_some()).count(), 3);
}

#[tokio::test]
async fn prefix_reuse_reports_cached_tokens_and_events() {
    let h = start(4, 64, config(64));
    let mut ev = h.subscribe_events();
    let p = prompt(5, 10);
    let a = run(&h, req("a", p.clone(), greedy(3))).await;
    let b = run(&h, req("b", p.clone(), greedy(3))).await;
    assert_eq!(tokens(&a), tokens(&b));
    assert_eq!(a.last().unwrap().usage.unwrap().cached_tokens, 0);
    assert_eq!(b.last().unwrap().usage.unwrap().cached_tokens, 8);
    let first = ev.try_recv().unwrap();
    assert_eq!(first.event_id, 1);
    match first.data {
        KvCacheEventData::Stored(s) => {
            let want = crate::kv::hash::block_hashes(&p, 4);
            assert_eq!(s.parent_hash, None);
            assert_eq!(s.blocks[0].block_hash, want[0].1);
            assert_eq!(s.blocks[1].tokens_hash, want[1].0);
        }
        other => panic!("{other:?}"),
    }
    let (dump, _) = h.dump_stored_blocks();
    assert!(dump.blocks.len() >= 2);
    h.clear_cache().await.unwrap();
    let (dump, _) = h.dump_stored_blocks();
    assert!(dump.blocks.is_empty());
}

#[tokio::test]
async fn requests_share_cached_blocks_only_under_the_same_salt() {
    let h = start(4, 64, config(64));
    let mut ev = h.subscribe_events();
    let p = prompt(6, 10);
    let salted = |id: &str, salt: Option<u64>| Request {
        cache_salt: salt.map(CacheSalt),
        ..req(id, p.clone(), greedy(3))
    };
    let cached = |outs: Vec<RequestOutput>| outs.last().unwrap().usage.unwrap().cached_tokens;
    assert_eq!(cached(run(&h, salted("a", Some(1))).await), 0);
    assert_eq!(
        cached(run(&h, salted("b", Some(2))).await),
        0,
        "another salt"
    );
    assert_eq!(cached(run(&h, salted("c", None)).await), 0, "no salt");
    assert_eq!(
        cached(run(&h, salted("d", Some(1))).await),
        8,
        "the same salt"
    );
    // The first request's blocks were announced under salt 1's hashes.
    let want = crate::kv::hash::salted_block_hashes(Some(CacheSalt(1)), &p, 4);
    match ev.try_recv().unwrap().data {
        KvCacheEventData::Stored(s) => {
            let got: Vec<_> = s.blocks.iter().map(|b| b.tokens_hash).collect();
            assert_eq!(got, want);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(wait_idle(&h).await.blocks.referenced, 0);
}

async fn continue_elsewhere(params: SamplingParams, after: usize) {
    let p = prompt(9, 11);
    let reference = start(4, 64, config(64));
    let want = tokens(&run(&reference, req("r", p.clone(), params.clone())).await);

    // One step per permit: `after` steps give `after` tokens; the export lands before or
    // after the next step, so the snapshot holds `after` or `after + 1` tokens.
    let (ab, permits) = TestBackend::gated(4, 64);
    let a = Engine::start(Box::new(ab), None, config(64)).unwrap();
    let mut s = a.submit(req("r", p, params)).await.unwrap();
    for _ in 0..after {
        permits.send(()).unwrap();
    }
    let mut got = Vec::new();
    while got.len() < after {
        let o = tokio::time::timeout(T, s.next()).await.unwrap().unwrap();
        got.extend(o.token_ids);
    }
    let export = a.export("r");
    permits.send(()).unwrap();
    let snap = tokio::time::timeout(T, export).await.unwrap().unwrap();
    let generated = snap.state.tokens.len() - snap.state.prompt_len;
    assert!(generated == after || generated == after + 1);
    let rest = tokio::time::timeout(T, s.collect()).await.unwrap();
    got.extend(tokens(&rest));
    assert_eq!(
        rest.last().unwrap().finish_reason,
        Some(FinishReason::Migrated)
    );
    assert_eq!(snap.state.tokens[snap.state.prompt_len..], got[..]);
    assert_eq!(wait_idle(&a).await.blocks.referenced, 0);

    let b_backend = TestBackend::new(4, 64);
    let computed = b_backend.computed.clone();
    let b = Engine::start(Box::new(b_backend), None, config(64)).unwrap();
    let already = got.len();
    let s = b.import(snap).await.unwrap();
    let outs = tokio::time::timeout(T, s.collect()).await.unwrap();
    got.extend(tokens(&outs));
    assert_eq!(got, want);
    // The importer computed only the generated tail, none of the prompt.
    assert_eq!(computed.load(Ordering::Relaxed), want.len() - already);
    assert!(outs.last().unwrap().usage.unwrap().cached_tokens == 11);
}

#[tokio::test]
async fn export_import_continues_greedy_exactly() {
    continue_elsewhere(greedy(24), 5).await;
}

#[tokio::test]
async fn export_import_continues_seeded_sampling_with_penalties() {
    continue_elsewhere(sampled(24, 1234), 7).await;
}

/// A request replayed from its output so far (request migration: the prompt followed by the
/// first `cut` tokens, `replayed` = `cut`, `max_tokens` and `min_tokens` less `cut`) on a
/// fresh engine goes on exactly as the uninterrupted run: the RNG position, the penalty
/// counts and min_tokens carry over.
async fn replay_elsewhere(params: SamplingParams, cut: usize) {
    let p = prompt(3, 9);
    let full = tokens(
        &run(
            &start(4, 64, config(64)),
            req("r", p.clone(), params.clone()),
        )
        .await,
    );
    let mut replayed = req("r", [&p[..], &full[..cut]].concat(), params.clone());
    replayed.replayed = cut;
    replayed.params.max_tokens = params.max_tokens.map(|n| n - cut);
    replayed.params.min_tokens = params.min_tokens.saturating_sub(cut);
    let rest = tokens(&run(&start(4, 64, config(64)), replayed).await);
    assert_eq!(rest, full[cut..], "full run {full:?}");
}

#[tokio::test]
async fn a_replayed_request_continues_greedy_and_seeded_sampling_exactly() {
    replay_elsewhere(greedy(20), 6).await;
    replay_elsewhere(sampled(20, 99), 7).await;
    // min_tokens counts the replayed output: EOS stays masked up to 12 tokens in all.
    let eos_allowed = SamplingParams {
        ignore_eos: false,
        min_tokens: 12,
        ..sampled(20, 7)
    };
    replay_elsewhere(eos_allowed, 5).await;
}

#[tokio::test]
async fn a_replay_must_leave_a_prompt_and_continue_one_choice() {
    let e = start(4, 64, config(64));
    let mut all = req("all", prompt(1, 4), greedy(4));
    all.replayed = 4;
    let err = e
        .submit(all)
        .await
        .err()
        .expect("the whole prompt replayed");
    assert!(matches!(err, EngineError::InvalidRequest(_)), "{err}");
    let mut two = req("two", prompt(1, 4), SamplingParams { n: 2, ..greedy(4) });
    two.replayed = 1;
    let err = e.submit(two).await.err().expect("n = 2 replayed");
    assert!(err.to_string().contains("n = 1"), "{err}");
    assert_eq!(wait_idle(&e).await.blocks.referenced, 0);
}

#[tokio::test]
async fn import_refuses_a_different_layout() {
    let (ab, permits) = TestBackend::gated(4, 64);
    let a = Engine::start(Box::new(ab), None, config(64)).unwrap();
    let _s = a.submit(req("r", prompt(1, 6), greedy(50))).await.unwrap();
    let export = a.export("r");
    permits.send(()).unwrap();
    let snap = tokio::time::timeout(T, export).await.unwrap().unwrap();
    assert_eq!(snap.kv.len() % snap.layout.block_bytes(), 0);
    let b = start(8, 64, config(64));
    let e = b.import(snap.clone()).await.err().unwrap();
    assert!(
        matches!(
            e,
            EngineError::LayoutMismatch {
                field: "block_size",
                ..
            }
        ),
        "{e}"
    );
    let mut bad = snap;
    bad.kv.push(0);
    let c = start(4, 64, config(64));
    assert!(matches!(
        c.import(bad).await,
        Err(EngineError::BadSnapshot(_))
    ));
    assert_eq!(wait_idle(&c).await.blocks.referenced, 0);
}

#[tokio::test]
async fn backend_without_logits_draws_from_the_seed() {
    let mk = || {
        let mut b = TestBackend::new(4, 16);
        b.no_logits = true;
        Engine::start(Box::new(b), None, config(16)).unwrap()
    };
    let p = SamplingParams {
        seed: Some(5),
        ..greedy(10)
    };
    let a = tokens(&run(&mk(), req("a", prompt(1, 4), p.clone())).await);
    let b = tokens(&run(&mk(), req("a", prompt(1, 4), p)).await);
    assert_eq!(a.len(), 10);
    assert_eq!(a, b);
}

#[tokio::test]
async fn chunked_prefill_off_and_stats() {
    let cfg = EngineConfig {
        enable_chunked_prefill: false,
        max_num_tokens: 16,
        ..config(64)
    };
    let h = start(4, 64, cfg);
    let e = h
        .submit(req("long", prompt(0, 20), greedy(2)))
        .await
        .err()
        .unwrap();
    assert!(e.to_string().contains("chunked prefill is off"));
    let outs = run(&h, req("ok", prompt(0, 16), greedy(4))).await;
    assert_eq!(tokens(&outs).len(), 4);
    let st = h.stats().await.unwrap();
    assert!(st.steps >= 4);
    assert_eq!(st.blocks.total, 64);
}

#[tokio::test]
async fn reuse_off_computes_everything_and_publishes_nothing() {
    let h = start(
        4,
        32,
        EngineConfig {
            enable_block_reuse: false,
            ..config(32)
        },
    );
    let mut ev = h.subscribe_events();
    let p = prompt(6, 10);
    run(&h, req("a", p.clone(), greedy(3))).await;
    let b = run(&h, req("b", p, greedy(3))).await;
    assert_eq!(b.last().unwrap().usage.unwrap().cached_tokens, 0);
    assert!(ev.try_recv().is_err(), "no events without reuse");
    let st = wait_idle(&h).await;
    assert_eq!((st.blocks.cached, st.blocks.free), (0, 32));
}

#[tokio::test]
async fn late_subscribers_replay_or_dump() {
    let h = start(
        4,
        8,
        EngineConfig {
            event_buffer_max_size: 4,
            ..config(8)
        },
    );
    // Enough distinct prompts to store and then evict blocks: more than 4 events.
    for i in 0..4 {
        run(&h, req(&format!("r{i}"), prompt(10 + i, 8), greedy(2))).await;
    }
    let last = wait_idle(&h).await.last_event_id;
    assert!(last > 4);
    let (replay, _live) = h.subscribe_events_from(last - 3).unwrap();
    let ids: Vec<u64> = replay.iter().map(|e| e.event_id).collect();
    assert_eq!(ids, (last - 3..=last).collect::<Vec<_>>());
    assert!(
        h.subscribe_events_from(1).is_err(),
        "event 1 left the buffer"
    );
    // The dump holds exactly the blocks still cached, and follows on from `last`.
    let (dump, _live) = h.dump_stored_blocks();
    assert_eq!(dump.last_event_id, last);
    let st = wait_idle(&h).await;
    assert_eq!(dump.blocks.len(), st.blocks.cached);
}

#[tokio::test]
async fn export_mid_prefill_continues_exactly() {
    let cfg = EngineConfig {
        max_num_tokens: 4,
        ..config(64)
    };
    let p = prompt(11, 11);
    let params = sampled(10, 77);
    let reference = start(4, 64, cfg.clone());
    let want = tokens(&run(&reference, req("r", p.clone(), params.clone())).await);

    let (ab, permits, done) = TestBackend::gated_reporting(4, 64);
    let a = Engine::start(Box::new(ab), None, cfg.clone()).unwrap();
    let s = a.submit(req("r", p, params)).await.unwrap();
    permits.send(()).unwrap();
    // The first chunk is computed; the engine is now between steps or waiting in the second.
    done.recv_timeout(T).unwrap();
    let export = a.export("r");
    // The export lands before the second chunk or right after it, never later.
    permits.send(()).unwrap();
    let snap = match tokio::time::timeout(T, export).await.unwrap() {
        Ok(snap) => snap,
        Err(e) => panic!("{e}: {:?}", s.collect().await),
    };
    assert_eq!(snap.state.tokens.len(), 11, "still in prefill");
    assert!(snap.state.num_computed == 4 || snap.state.num_computed == 8);
    let rest = tokio::time::timeout(T, s.collect()).await.unwrap();
    assert_eq!(rest.len(), 1);

    let b = start(4, 64, cfg);
    let outs = tokio::time::timeout(T, b.import(snap).await.unwrap().collect())
        .await
        .unwrap();
    assert_eq!(tokens(&outs), want);
}

/// With a backend that samples on its device, the engine hands it plans (taking each draw's
/// uniform from the sequence's RNG) and emits its tokens: the same outputs as sampling here,
/// for greedy, seeded filtered sampling with penalties, min_tokens and stop ids; requests
/// asking for logprobs get them from the device too, and a logit bias is applied there.
#[tokio::test]
async fn device_sampling_matches_host_sampling() {
    let params: Vec<SamplingParams> = vec![
        greedy(12),
        sampled(12, 3),
        SamplingParams {
            min_tokens: 4,
            stop_token_ids: vec![9],
            ..sampled(12, 5)
        },
        SamplingParams {
            logprobs: Some(2),
            ..sampled(6, 8)
        },
        SamplingParams {
            logit_bias: vec![(3, 4.0), (10, -50.0)],
            ..sampled(8, 9)
        },
    ];
    let host = start(4, 64, config(64));
    let mut want = Vec::new();
    for (i, p) in params.iter().enumerate() {
        want.push(run(&host, req("h", prompt(i as u32, 9), p.clone())).await);
    }
    let mut b = TestBackend::new(4, 64);
    b.device_sampling = true;
    let sampled_steps = b.sampled_steps.clone();
    let dev = Engine::start(Box::new(b), None, config(64)).unwrap();
    for (i, p) in params.iter().enumerate() {
        let before = sampled_steps.load(Ordering::Relaxed);
        let got = run(&dev, req("d", prompt(i as u32, 9), p.clone())).await;
        assert_eq!(tokens(&got), tokens(&want[i]), "request {i}");
        let logprobs: Vec<_> = got.iter().flat_map(|o| o.logprobs.clone()).collect();
        let want_lp: Vec<_> = want[i].iter().flat_map(|o| o.logprobs.clone()).collect();
        assert_eq!(logprobs, want_lp, "request {i}");
        assert!(p.logprobs.is_none() || !logprobs.is_empty(), "request {i}");
        let on_device = sampled_steps.load(Ordering::Relaxed) - before;
        assert!(on_device > 0, "request {i} never sampled on the device");
    }
}
