//! Media (image) embeddings in the engine: spliced at their span's positions on the CPU
//! backend, hashed into the prefix cache by content, refused where they cannot apply.

use std::sync::Arc;

use super::test_backend::TestBackend;
use super::tests::run;
use super::*;
use crate::backend::cpu::CpuBackend;
use crate::kv::layout::KvDtype;
use crate::model::{LoadOptions, LoadedModel};
use crate::request::{MediaEmbedding, MediaSpan};
use crate::sampler::SamplingParams;

const BLOCK: usize = 4;

fn engine() -> (EngineHandle, usize) {
    let dir = crate::tiny::ensure_tiny_model().expect("build the tiny model");
    let model = LoadedModel::load(&dir, &LoadOptions::default()).expect("load the tiny model");
    let hidden = model.config.hidden_size;
    let be = CpuBackend::new(&model, KvDtype::F32, BLOCK, 64).unwrap();
    let cfg = EngineConfig {
        max_batch_size: 4,
        max_num_tokens: 64,
        max_seq_len: 128,
        num_blocks: 64,
        eos_token_ids: model.eos_token_ids(),
        ..EngineConfig::default()
    };
    (Engine::start(Box::new(be), None, cfg).unwrap(), hidden)
}

/// `len` rows of `hidden` values from a seed (not token embeddings).
fn embedding(start: usize, len: usize, hidden: usize, seed: u64) -> MediaEmbedding {
    let mut rng = tandem_rng::SplitMix64::new(seed);
    let data = (0..len * hidden)
        .map(|_| (rng.next_f64() as f32 - 0.5) * 0.2)
        .collect();
    MediaEmbedding {
        span: MediaSpan {
            start,
            len,
            hash: seed,
        },
        data: Arc::new(data),
    }
}

fn request(id: &str, media: Vec<MediaEmbedding>) -> Request {
    // Text, 12 placeholder tokens (positions 6..18), text.
    let mut prompt: Vec<u32> = (0..24).map(|i| 100 + i * 13).collect();
    prompt[6..18].fill(7);
    Request {
        replayed: 0,
        request_id: id.into(),
        prompt,
        params: SamplingParams {
            max_tokens: Some(1),
            logprobs: Some(0),
            ignore_eos: true,
            ..SamplingParams::greedy()
        },
        cache_salt: None,
        media,
    }
}

fn first_logprob(outs: &[RequestOutput]) -> (u32, f32) {
    let lp = &outs[0].logprobs[0];
    (lp.token, lp.logprob)
}

fn cached(outs: &[RequestOutput]) -> usize {
    outs.iter()
        .find_map(|o| o.usage)
        .map(|u| u.cached_tokens)
        .unwrap_or(usize::MAX)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_replace_the_placeholders_and_key_the_prefix_cache() {
    let (h, hidden) = engine();
    let a = || vec![embedding(6, 12, hidden, 1)];
    let b = vec![embedding(6, 12, hidden, 2)];
    let text = run(&h, request("text", vec![])).await;
    let first = run(&h, request("a1", a())).await;
    assert_ne!(
        first_logprob(&text),
        first_logprob(&first),
        "the image rows change the output"
    );
    assert_eq!(
        cached(&first),
        4,
        "only the block before the image is shared with the text-only prompt"
    );
    let again = run(&h, request("a2", a())).await;
    assert_eq!(first_logprob(&first), first_logprob(&again));
    assert_eq!(
        cached(&again),
        23,
        "the same image hits the whole prompt (its last token is recomputed)"
    );
    let other = run(&h, request("b", b)).await;
    assert_eq!(
        cached(&other),
        4,
        "another image misses from its first block on"
    );
    assert_ne!(first_logprob(&first), first_logprob(&other));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_embeddings_are_refused() {
    let (h, hidden) = engine();
    let mut short = embedding(6, 12, hidden, 1);
    Arc::make_mut(&mut short.data).pop();
    let past_end = embedding(20, 12, hidden, 1);
    let overlapping = vec![embedding(6, 6, hidden, 1), embedding(10, 4, hidden, 2)];
    for (name, media) in [
        ("short", vec![short]),
        ("past the prompt", vec![past_end]),
        ("overlapping", overlapping),
    ] {
        let err = h.submit(request(name, media)).await.err();
        assert!(
            matches!(err, Some(EngineError::InvalidRequest(_))),
            "{name}: {err:?}"
        );
    }
}

#[tokio::test]
async fn a_backend_without_media_support_refuses_embeddings() {
    let h = Engine::start(
        Box::new(TestBackend::new(4, 16)),
        None,
        super::tests::config(16),
    )
    .unwrap();
    let err = h
        .submit(request("r", vec![embedding(6, 12, 8, 1)]))
        .await
        .err();
    assert!(
        matches!(err, Some(EngineError::InvalidRequest(_))),
        "{err:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continued_sequence_never_recomputes_images_it_has_no_embeddings_for() {
    let (h, _) = engine();
    let mut r = request("moved", vec![]);
    r.params.max_tokens = Some(4);
    let layout = h.layout().clone();
    // A sequence prefilled elsewhere: only its first block's KV came along, its image spans
    // did, its embeddings did not.
    let state = SequenceState {
        request_id: "moved".into(),
        index: 0,
        params: r.params.clone(),
        tokens: [r.prompt.clone(), vec![5]].concat(),
        prompt_len: r.prompt.len(),
        max_tokens: 4,
        num_computed: BLOCK,
        cached_prompt_tokens: 0,
        sampler: crate::sampler::SamplerState::new(1, 0),
        stop: crate::sampler::StopMatcher::new(&[] as &[String]),
        cache_salt: None,
        media: vec![MediaSpan {
            start: 6,
            len: 12,
            hash: 1,
        }],
    };
    let snapshot = RequestSnapshot {
        kv: vec![0u8; layout.block_bytes()],
        layout,
        state,
    };
    let outs = tokio::time::timeout(
        super::test_backend::T,
        h.import(snapshot).await.unwrap().collect(),
    )
    .await
    .unwrap();
    let last = outs.last().expect("an output");
    assert_eq!(last.finish_reason, Some(FinishReason::Abort));
    assert!(
        last.error
            .as_deref()
            .is_some_and(|e| e.contains("embeddings")),
        "{last:?}"
    );
}
