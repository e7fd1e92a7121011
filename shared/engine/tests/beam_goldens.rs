//! Beam search on the built-in tiny model (CPU backend, f32 KV) against Hugging Face
//! transformers' `generate(num_beams=W, num_return_sequences=k, do_sample=False,
//! length_penalty=..., early_stopping=False, max_new_tokens=...)` — goldens made by
//! `scripts/goldens/make_beam_goldens.py`: the same hypotheses (token ids, EOS included) in
//! the same order, and the same `sequences_scores` within 1e-4. Block size 4 so that beams
//! fork inside blocks (copy-on-write of the partial block). A second test runs the cases with
//! the model's EOS ids at once through a small pool (`MAX_UTILIZATION`); both end with every
//! block back in the pool. (Preemption and abort of beams are tested in the engine's unit
//! tests, `engine::beam_tests`.)

use serde::Deserialize;
use tandem_engine::backend::cpu::CpuBackend;
use tandem_engine::engine::{
    CapacitySchedulerPolicy, Engine, EngineConfig, EngineHandle, FinishReason, Request,
    RequestOutput,
};
use tandem_engine::kv::layout::KvDtype;
use tandem_engine::model::weights::file_sha256;
use tandem_engine::model::{LoadOptions, LoadedModel};
use tandem_engine::sampler::SamplingParams;

const BLOCK: usize = 4;

#[derive(Deserialize)]
struct Goldens {
    weights_sha256: String,
    cases: Vec<Case>,
}

#[derive(Deserialize, Clone)]
struct Case {
    name: String,
    prompt_ids: Vec<u32>,
    width: usize,
    num_return_sequences: usize,
    length_penalty: f32,
    max_new_tokens: usize,
    eos_token_ids: Vec<u32>,
    hypotheses: Vec<Hyp>,
}

#[derive(Deserialize, Clone)]
struct Hyp {
    tokens: Vec<u32>,
    score: f64,
}

fn load() -> (LoadedModel, Goldens) {
    let dir = tandem_engine::tiny::ensure_tiny_model().expect("build the tiny model");
    let g: Goldens = serde_json::from_str(include_str!("goldens/beam_search.json")).unwrap();
    let sha = file_sha256(&dir.join("model.safetensors")).expect("hash weights");
    assert_eq!(
        sha, g.weights_sha256,
        "the tiny model changed: rerun scripts/goldens/make_beam_goldens.py"
    );
    let model = LoadedModel::load(&dir, &LoadOptions::default()).expect("load the tiny model");
    (model, g)
}

fn engine(
    model: &LoadedModel,
    num_blocks: usize,
    eos: Vec<u32>,
    policy: CapacitySchedulerPolicy,
) -> EngineHandle {
    let backend = CpuBackend::new(model, KvDtype::F32, BLOCK, num_blocks).expect("backend");
    let cfg = EngineConfig {
        max_batch_size: 16,
        max_num_tokens: 64,
        max_seq_len: 256,
        num_blocks,
        eos_token_ids: eos,
        capacity_scheduler_policy: policy,
        max_beam_width: 4,
        ..EngineConfig::default()
    };
    Engine::start(Box::new(backend), None, cfg).expect("start")
}

fn request(id: &str, c: &Case) -> Request {
    Request {
        replayed: 0,
        request_id: id.into(),
        cache_salt: None,
        prompt: c.prompt_ids.clone(),
        params: SamplingParams {
            n: c.num_return_sequences,
            best_of: Some(c.width),
            use_beam_search: true,
            length_penalty: c.length_penalty,
            max_tokens: Some(c.max_new_tokens),
            temperature: 0.0,
            ..SamplingParams::default()
        },
        media: Default::default(),
    }
}

fn check(c: &Case, outs: &[RequestOutput]) {
    assert_eq!(outs.len(), c.num_return_sequences, "{}", c.name);
    for (i, (o, h)) in outs.iter().zip(&c.hypotheses).enumerate() {
        assert_eq!(o.index, i, "{}", c.name);
        assert_eq!(o.token_ids, h.tokens, "{}: hypothesis {i}", c.name);
        let score = o.score.expect("a beam output has a score") as f64;
        assert!(
            (score - h.score).abs() < 1e-4,
            "{}: hypothesis {i} score {score} vs {}",
            c.name,
            h.score
        );
        let eos = h.tokens.last().is_some_and(|t| c.eos_token_ids.contains(t));
        let want = if eos {
            FinishReason::Stop
        } else {
            FinishReason::Length
        };
        assert_eq!(o.finish_reason, Some(want), "{}", c.name);
        assert_eq!(o.usage.unwrap().completion_tokens, h.tokens.len());
    }
}

async fn run(h: &EngineHandle, id: &str, c: &Case) -> Vec<RequestOutput> {
    let s = h.submit(request(id, c)).await.expect("submit");
    let mut outs = tokio::time::timeout(std::time::Duration::from_secs(120), s.collect())
        .await
        .unwrap_or_else(|_| panic!("{}: beam search did not end", c.name));
    outs.sort_by_key(|o| o.index);
    outs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beam_search_matches_transformers() {
    let (model, g) = load();
    let mut eos_cases = 0;
    for c in &g.cases {
        let h = engine(&model, 256, c.eos_token_ids.clone(), Default::default());
        let outs = run(&h, "r", c).await;
        check(c, &outs);
        eos_cases += c
            .hypotheses
            .iter()
            .any(|h| h.tokens.len() < c.max_new_tokens) as usize;
        let s = h.stats().await.unwrap();
        assert_eq!(s.blocks.referenced, 0, "{}: blocks left referenced", c.name);
        assert_eq!(s.requests, 0);
        h.shutdown();
    }
    assert!(
        eos_cases >= 3,
        "the goldens exercise finished-by-EOS hypotheses"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beam_search_concurrent_in_a_small_pool() {
    let (model, g) = load();
    // Cases sharing the default EOS, all at once through a pool that holds about two of them:
    // beams get preempted and recomputed, results do not change.
    let cases: Vec<Case> = g
        .cases
        .iter()
        .filter(|c| c.eos_token_ids.len() == 2)
        .cloned()
        .collect();
    let eos = cases[0].eos_token_ids.clone();
    let h = engine(&model, 56, eos, CapacitySchedulerPolicy::MaxUtilization);
    // Submit queues each command at the call: all reach the engine together.
    let futs: Vec<_> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| h.submit(request(&format!("r{i}"), c)))
        .collect();
    for (c, f) in cases.iter().zip(futs) {
        let s = f.await.expect("submit");
        let mut outs = tokio::time::timeout(std::time::Duration::from_secs(120), s.collect())
            .await
            .unwrap_or_else(|_| panic!("{}: beam search did not end", c.name));
        outs.sort_by_key(|o| o.index);
        check(c, &outs);
    }
    let s = h.stats().await.unwrap();
    assert_eq!(s.blocks.referenced, 0);

    assert_eq!((s.running, s.waiting, s.requests), (0, 0, 0));
}
