//! Admission caps, the request limit, the bounded command queue, a panicking request and a
//! dead engine thread, over [`TestBackend`](super::test_backend::TestBackend).

use super::test_backend::{TestBackend, T, VOCAB};
use super::tests::{config, greedy, run, wait_idle};
use super::*;
use crate::error::EngineError;
use crate::failpoints::unit::PANIC_MARK;
use crate::sampler::SamplingParams;

fn req(id: &str, params: SamplingParams) -> Request {
    Request {
        replayed: 0,
        request_id: id.into(),
        cache_salt: None,
        prompt: vec![1, 2, 3, 4, 5],
        params,
        media: Default::default(),
    }
}

fn start(cfg: EngineConfig) -> EngineHandle {
    Engine::start(Box::new(TestBackend::new(4, 64)), None, cfg).unwrap()
}

async fn submit_err(h: &EngineHandle, r: Request) -> EngineError {
    match tokio::time::timeout(T, h.submit(r)).await.unwrap() {
        Ok(_) => panic!("admitted"),
        Err(e) => e,
    }
}

#[tokio::test]
async fn huge_max_tokens_and_n_are_refused_without_overflow() {
    let h = start(config(64));
    for m in [usize::MAX, usize::MAX - 3, usize::MAX / 2 + 1] {
        let e = submit_err(&h, req("big", greedy(m))).await;
        assert!(matches!(e, EngineError::InvalidRequest(_)), "{e}");
        assert!(e.to_string().contains("max_seq_len"), "{e}");
    }
    let p = SamplingParams {
        n: usize::MAX,
        ..greedy(4)
    };
    let e = submit_err(&h, req("many", p)).await;
    assert!(
        matches!(&e, EngineError::Params(p) if p.field() == "n"),
        "{e}"
    );
    // The engine still serves.
    let outs = run(&h, req("ok", greedy(3))).await;
    assert_eq!(
        outs.last().unwrap().finish_reason,
        Some(FinishReason::Length)
    );
}

#[tokio::test]
async fn stop_token_ids_must_be_in_the_vocabulary_and_stop_once_sorted() {
    let h = start(config(64));
    let p = SamplingParams {
        stop_token_ids: vec![3, VOCAB as u32],
        ..greedy(4)
    };
    let e = submit_err(&h, req("oov", p)).await;
    assert!(e.to_string().contains("stop_token_ids"), "{e}");
    let p = SamplingParams {
        stop_token_ids: vec![u32::MAX],
        min_tokens: 1,
        ..greedy(4)
    };
    assert!(matches!(
        submit_err(&h, req("huge", p)).await,
        EngineError::InvalidRequest(_)
    ));
    // Unsorted, repeated ids still stop at the first one generated.
    let free = run(&h, req("free", greedy(6))).await;
    let first: u32 = free[0].token_ids[0];
    let p = SamplingParams {
        stop_token_ids: vec![60, first, 2, first, 0],
        ..greedy(6)
    };
    let outs = h.submit(req("stops", p)).await.unwrap().collect().await;
    let last = outs.last().unwrap();
    assert_eq!(last.stop_reason, Some(StopReason::TokenId(first)));
    assert_eq!(last.usage.unwrap().completion_tokens, 1);
}

#[tokio::test]
async fn the_request_limit_refuses_past_it_and_frees_with_the_request() {
    let (gb, permits) = TestBackend::gated(4, 64);
    let cfg = EngineConfig {
        request_limit: Some(1),
        ..config(64)
    };
    let h = Engine::start(Box::new(gb), None, cfg).unwrap();
    let first = h.submit(req("a", greedy(20))).await.unwrap();
    // Handled after the first step, while "a" still runs.
    let second = h.submit(req("b", greedy(2)));
    permits.send(()).unwrap();
    let e = match tokio::time::timeout(T, second).await.unwrap() {
        Ok(_) => panic!("admitted past the limit"),
        Err(e) => e,
    };
    assert!(matches!(e, EngineError::Overloaded { limit: 1 }), "{e}");
    // The refusal counted "a". No stats while "a" runs: the engine thread sits in a gated
    // step and would answer only after the next permit, racing the gate's own timeout.
    for _ in 0..100 {
        permits.send(()).unwrap();
    }
    let outs = tokio::time::timeout(T, first.collect()).await.unwrap();
    assert_eq!(
        outs.last().unwrap().finish_reason,
        Some(FinishReason::Length)
    );
    assert_eq!(
        wait_idle(&h).await.requests,
        0,
        "the request freed its place"
    );
    let again = h.submit(req("b", greedy(1))).await.expect("room again");
    tokio::time::timeout(T, again.collect()).await.unwrap();
}

#[tokio::test]
async fn a_full_command_queue_refuses_at_once_instead_of_growing() {
    let (gb, permits) = TestBackend::gated(4, 64);
    let cfg = EngineConfig {
        command_queue_capacity: 3,
        ..config(64)
    };
    let h = Engine::start(Box::new(gb), None, cfg).unwrap();
    // The engine thread blocks in its first step (no permit), so commands pile up.
    let _running = h.submit(req("a", greedy(2))).await.unwrap();
    let mut waiting = Vec::new();
    let refused = loop {
        assert!(waiting.len() < 1000, "the queue never filled");
        // The command is sent when `stats` is called; one poll tells a refusal apart.
        let mut f = Box::pin(h.stats());
        match tokio::time::timeout(std::time::Duration::ZERO, &mut f).await {
            Ok(Err(e)) => break e,
            Ok(Ok(_)) => {} // answered: the thread had not entered its step yet
            Err(_) => waiting.push(f),
        }
    };
    assert!(
        matches!(refused, EngineError::QueueFull { capacity: 3 }),
        "{refused}"
    );
    // Aborting still goes through a full queue.
    h.abort("a");
    drop(permits);
    for f in waiting {
        // Answered or refused, never left hanging.
        let _ = tokio::time::timeout(T, f)
            .await
            .expect("a queued command hung");
    }
    assert_eq!(wait_idle(&h).await.requests, 0);
}

#[tokio::test]
async fn a_panic_in_one_requests_step_fails_it_alone() {
    let (gb, permits) = TestBackend::gated(4, 64);
    let h = Engine::start(Box::new(gb), None, config(64)).unwrap();
    let bad = h.submit(req(&format!("x-{PANIC_MARK}"), greedy(8)));
    let good = h.submit(req("good", greedy(8)));
    let (bad, good) = (bad.await.unwrap(), good.await.unwrap());
    for _ in 0..100 {
        permits.send(()).unwrap();
    }
    let bad = tokio::time::timeout(T, bad.collect()).await.unwrap();
    let last = bad.last().unwrap();
    assert_eq!(last.finish_reason, Some(FinishReason::Abort));
    let error = last.error.clone().unwrap_or_default();
    assert!(error.contains("internal engine error"), "{error}");
    let good = tokio::time::timeout(T, good.collect()).await.unwrap();
    assert_eq!(good.iter().map(|o| o.token_ids.len()).sum::<usize>(), 8);
    assert_eq!(
        good.last().unwrap().finish_reason,
        Some(FinishReason::Length)
    );
    assert!(h.is_running());
    let st = wait_idle(&h).await;
    assert_eq!((st.requests, st.running, st.waiting), (0, 0, 0));
    assert_eq!(
        st.blocks.referenced, 0,
        "the failed request's blocks were freed"
    );
}

#[tokio::test]
async fn a_dead_engine_thread_is_visible_and_cuts_its_streams() {
    let mut backend = TestBackend::new(4, 64);
    backend.panic_in_forward = true;
    let h = Engine::start(Box::new(backend), None, config(64)).unwrap();
    assert!(h.is_running());
    let mut s = h.submit(req("a", greedy(4))).await.unwrap();
    while tokio::time::timeout(T, s.next()).await.unwrap().is_some() {}
    assert!(s.was_cut(), "the stream must say it ended early");
    tokio::time::timeout(T, h.stopped())
        .await
        .expect("stopped() resolves");
    assert!(!h.is_running());
    assert!(matches!(
        submit_err(&h, req("b", greedy(1))).await,
        EngineError::Stopped
    ));
}
