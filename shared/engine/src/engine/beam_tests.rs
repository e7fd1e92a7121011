//! Beam search through the engine on the test backend, whose logits depend on every KV slot
//! read back from the pool: the hypotheses equal those of a reference beam search that
//! computes each row from the tokens alone, so shared and copied (copy-on-write) blocks hold
//! exactly the right KV. Every block returns to the pool; abort and preemption free all beams.

use super::test_backend::{mix, TestBackend, EOS, T, VOCAB};
use super::*;
use crate::request::RequestOutput;
use crate::sampler::top_k_logprobs;

/// The test backend's logits row after `tokens`.
fn row(tokens: &[u32]) -> Vec<f32> {
    let mut h = 0u64;
    for (pos, &t) in tokens.iter().enumerate() {
        h = mix(h ^ (t as u64) ^ ((pos as u64) << 32));
    }
    (0..VOCAB as u64)
        .map(|j| (mix(h ^ (j * 0x9E37_79B9)) % 1000) as f32 / 200.0)
        .collect()
}

/// Hugging Face's beam search (early_stopping=False) over [`row`], best first:
/// (generated tokens, score).
fn reference(
    prompt: &[u32],
    width: usize,
    lp: f64,
    max_tokens: usize,
    eos: &[u32],
) -> Vec<(Vec<u32>, f64)> {
    let k = 2 * width;
    let norm = |cum: f64, len: usize| cum / (len as f64).powf(lp);
    let mut live: Vec<(Vec<u32>, f64)> = vec![(Vec::new(), 0.0)];
    let mut fin: Vec<(Vec<u32>, f64)> = Vec::new();
    for step in 1..=max_tokens {
        let mut c: Vec<(f64, usize, u32)> = Vec::new();
        for (bi, (g, cum)) in live.iter().enumerate() {
            let mut all = prompt.to_vec();
            all.extend(g);
            for (t, l) in top_k_logprobs(&row(&all), k) {
                c.push((cum + l as f64, bi, t));
            }
        }
        c.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        c.truncate(k);
        let at_max = step == max_tokens;
        for &(s, bi, t) in c.iter().take(width) {
            if eos.contains(&t) || at_max {
                let mut g = live[bi].0.clone();
                g.push(t);
                let sc = norm(s, step);
                let pos = fin.iter().position(|f| f.1 < sc).unwrap_or(fin.len());
                fin.insert(pos, (g, sc));
                fin.truncate(width);
            }
        }
        let next: Vec<_> = c
            .iter()
            .filter(|x| !eos.contains(&x.2))
            .take(width)
            .collect();
        if at_max || (fin.len() >= width && fin.last().unwrap().1 >= norm(next[0].0, step)) {
            break;
        }
        live = next
            .iter()
            .map(|&&(s, bi, t)| {
                let mut g = live[bi].0.clone();
                g.push(t);
                (g, s)
            })
            .collect();
    }
    fin
}

fn config(num_blocks: usize, policy: CapacitySchedulerPolicy) -> EngineConfig {
    EngineConfig {
        max_batch_size: 16,
        max_num_tokens: 64,
        max_seq_len: 256,
        num_blocks,
        eos_token_ids: vec![EOS],
        capacity_scheduler_policy: policy,
        max_beam_width: 4,
        ..EngineConfig::default()
    }
}

fn beam_params(n: usize, width: usize, lp: f32, max_tokens: usize) -> SamplingParams {
    SamplingParams {
        n,
        best_of: Some(width),
        use_beam_search: true,
        length_penalty: lp,
        max_tokens: Some(max_tokens),
        ..SamplingParams::greedy()
    }
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (seed * 7 + i * 3) % 60 + 1)
        .collect()
}

async fn run(
    h: &EngineHandle,
    id: &str,
    prompt: Vec<u32>,
    p: SamplingParams,
) -> Vec<RequestOutput> {
    let s = h
        .submit(Request {
            replayed: 0,
            request_id: id.into(),
            cache_salt: None,
            prompt,
            params: p,
            media: Default::default(),
        })
        .await
        .expect("submit");
    let mut outs = tokio::time::timeout(T, s.collect())
        .await
        .expect("beam search ends");
    outs.sort_by_key(|o| o.index);
    outs
}

fn check(outs: &[RequestOutput], want: &[(Vec<u32>, f64)], n: usize) {
    assert_eq!(outs.len(), n);
    for (o, (tokens, score)) in outs.iter().zip(want) {
        assert_eq!(&o.token_ids, tokens);
        assert!((o.score.unwrap() as f64 - score).abs() < 1e-4);
        assert!(o.finish_reason.is_some());
    }
}

#[tokio::test]
async fn beams_match_a_reference_and_free_every_block() {
    for (block_size, seed, len, width, n, lp, max) in [
        (4, 1, 7, 2, 2, 1.0, 12),
        (4, 2, 8, 4, 3, 1.0, 16),
        (2, 3, 5, 4, 4, 0.5, 20),
        (8, 4, 13, 3, 1, 2.0, 24),
    ] {
        let h = Engine::start(
            Box::new(TestBackend::new(block_size, 128)),
            None,
            config(128, CapacitySchedulerPolicy::GuaranteedNoEvict),
        )
        .unwrap();
        let p = prompt(seed, len);
        let want = reference(&p, width, lp as f64, max, &[EOS]);
        let outs = run(&h, "b", p, beam_params(n, width, lp, max)).await;
        check(&outs, &want, n);
        let s = h.stats().await.unwrap();
        assert_eq!(
            (s.blocks.referenced, s.requests, s.running, s.waiting),
            (0, 0, 0, 0)
        );
        h.shutdown();
    }
}

#[tokio::test]
async fn beams_survive_preemption() {
    // Several beam requests at once through a pool too small for all: beams are preempted
    // and recomputed, the results do not change.
    // Gated: every request is queued before the first step.
    let (b, permits) = TestBackend::gated(4, 40);
    let h = Engine::start(
        Box::new(b),
        None,
        config(40, CapacitySchedulerPolicy::MaxUtilization),
    )
    .unwrap();
    // The commands are queued when submit is called: all four reach the engine before its
    // first step (which waits for a permit).
    let mut pending = Vec::new();
    for i in 0..4u32 {
        let p = prompt(10 + i, 9);
        let params = SamplingParams {
            ignore_eos: true,
            ..beam_params(4, 4, 1.0, 24)
        };
        let fut = h.submit(Request {
            replayed: 0,
            request_id: format!("r{i}"),
            cache_salt: None,
            prompt: p.clone(),
            params,
            media: Default::default(),
        });
        pending.push((p, fut));
    }
    for _ in 0..100_000 {
        if permits.send(()).is_err() {
            break;
        }
    }
    let mut streams = Vec::new();
    for (p, fut) in pending {
        streams.push((p, fut.await.unwrap()));
    }
    for (p, s) in streams {
        let want = reference(&p, 4, 1.0, 24, &[]);
        let mut outs = tokio::time::timeout(T, s.collect())
            .await
            .expect("beam search ends");
        outs.sort_by_key(|o| o.index);
        check(&outs, &want, 4);
    }
    let s = h.stats().await.unwrap();
    assert!(
        s.preemptions > 0,
        "the pool was meant to force preemption: {s:?}"
    );
    assert_eq!((s.blocks.referenced, s.requests), (0, 0));
    drop(permits);
    h.shutdown();
}

#[tokio::test]
async fn aborting_a_beam_search_frees_every_beam() {
    // Abort mid-search: n aborted choices, every beam's blocks back.
    let (b, permits, done) = TestBackend::gated_reporting(4, 64);
    let h = Engine::start(
        Box::new(b),
        None,
        config(64, CapacitySchedulerPolicy::GuaranteedNoEvict),
    )
    .unwrap();
    let fut = h.submit(Request {
        replayed: 0,
        request_id: "a".into(),
        cache_salt: None,
        prompt: prompt(5, 6),
        params: SamplingParams {
            ignore_eos: true,
            ..beam_params(2, 4, 1.0, 30)
        },
        media: Default::default(),
    });
    for _ in 0..4 {
        permits.send(()).unwrap();
    }
    let mut s = fut.await.unwrap();
    for _ in 0..4 {
        done.recv_timeout(T).unwrap();
    }
    // Queued behind the step now waiting for its permit.
    h.abort("a");
    for _ in 0..100 {
        let _ = permits.send(());
    }
    let mut ends = 0;
    while let Some(o) = tokio::time::timeout(T, s.next()).await.unwrap() {
        assert_eq!(o.finish_reason, Some(FinishReason::Abort));
        ends += 1;
    }
    assert_eq!(ends, 2);
    let st = h.stats().await.unwrap();
    assert!(st.steps >= 4 && st.steps < 30, "aborted mid-search: {st:?}");
    assert_eq!(
        (st.blocks.referenced, st.requests, st.running, st.waiting),
        (0, 0, 0, 0)
    );
    drop(permits);
    h.shutdown();
}

#[tokio::test]
async fn beam_requests_are_validated() {
    let h = Engine::start(
        Box::new(TestBackend::new(4, 64)),
        None,
        EngineConfig {
            max_beam_width: 2,
            ..config(64, CapacitySchedulerPolicy::GuaranteedNoEvict)
        },
    )
    .unwrap();
    let submit = |p: SamplingParams| {
        h.submit(Request {
            replayed: 0,
            request_id: "v".into(),
            cache_salt: None,
            prompt: prompt(1, 4),
            params: p,
            media: Default::default(),
        })
    };
    let err = |r: Result<RequestStream, EngineError>| match r {
        Err(e) => e.to_string(),
        Ok(_) => panic!("accepted"),
    };
    assert!(err(submit(beam_params(2, 4, 1.0, 8)).await).contains("max_beam_width"));
    assert!(err(submit(beam_params(3, 2, 1.0, 8)).await).contains("best_of"));
    let mut p = beam_params(2, 2, 1.0, 8);
    p.logprobs = Some(1);
    assert!(err(submit(p).await).contains("logprobs"));
    let p = SamplingParams {
        best_of: Some(3),
        ..SamplingParams::default()
    };
    assert!(err(submit(p).await).contains("use_beam_search"));
    // Beam requests cannot be exported or prefilled remotely.
    let p = beam_params(2, 2, 1.0, 8);
    let r = h
        .prefill(
            Request {
                replayed: 0,
                request_id: "p".into(),
                cache_salt: None,
                prompt: prompt(1, 4),
                params: p,
                media: Default::default(),
            },
            0,
        )
        .await;
    assert!(r.is_err());
    h.shutdown();
}
