//! Disaggregated prefill → decode: `prefill` on engine A streams blocks that the test writes
//! into engine B's pool memory at the reserved blocks' offsets (what a transport does), then
//! `activate` on B continues the request. The result must equal an aggregated run on one
//! engine, token for token.

use std::sync::Arc;

use super::test_backend::{TestBackend, EOS, T};
use super::*;
use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::backend::KvPoolMemory;
use crate::error::EngineError;
use crate::kv::block_manager::HashContext;
use crate::kv::events::KvCacheEventData;
use crate::kv::hash::CacheSalt;
use crate::kv::layout::{KvDtype, KvLayout};
use crate::model::{LoadOptions, LoadedModel};
use crate::sampler::SamplingParams;

const BLOCK: usize = 8;
const BLOCKS: usize = 64;

struct Tiny {
    model: LoadedModel,
    tokenizer: Arc<Tokenizer>,
}

fn tiny() -> Tiny {
    let dir = crate::tiny::ensure_tiny_model().expect("build the tiny model");
    let model = LoadedModel::load(&dir, &LoadOptions::default()).expect("load the tiny model");
    let tokenizer = Arc::new(Tokenizer::load(&dir).expect("load the tokenizer"));
    Tiny { model, tokenizer }
}

fn tiny_config(t: &Tiny, max_num_tokens: usize) -> EngineConfig {
    EngineConfig {
        max_batch_size: 8,
        max_num_tokens,
        max_seq_len: 256,
        num_blocks: BLOCKS,
        eos_token_ids: t.model.eos_token_ids(),
        ..EngineConfig::default()
    }
}

/// An engine over an owned pool (the prefill side and the aggregated reference).
fn owned_engine(t: &Tiny, max_num_tokens: usize) -> EngineHandle {
    let be = CpuBackend::new(&t.model, KvDtype::F32, BLOCK, BLOCKS).unwrap();
    Engine::start(
        Box::new(be),
        Some(t.tokenizer.clone()),
        tiny_config(t, max_num_tokens),
    )
    .unwrap()
}

/// The decode side: an engine whose pool lives in memory the test owns, and that memory's
/// address, where the test writes blocks as a transport would.
struct Decode {
    h: EngineHandle,
    base: usize,
    len: usize,
}

fn decode_engine(t: &Tiny, max_num_tokens: usize) -> Decode {
    let block_bytes = {
        let probe = CpuBackend::new(&t.model, KvDtype::F32, BLOCK, 1).unwrap();
        probe.layout().block_bytes()
    };
    let len = BLOCKS * block_bytes;
    let mut buf = vec![0u64; len.div_ceil(8)];
    let base = buf.as_mut_ptr() as usize;
    // SAFETY: the Vec's heap buffer does not move when boxed and lives as long as the pool.
    let mem = unsafe { KvPoolMemory::external(base as *mut u8, len, Box::new(buf)) }.unwrap();
    let be = CpuBackend::new_in(&t.model, KvDtype::F32, BLOCK, BLOCKS, mem).unwrap();
    let h = Engine::start(
        Box::new(be),
        Some(t.tokenizer.clone()),
        tiny_config(t, max_num_tokens),
    )
    .unwrap();
    Decode { h, base, len }
}

impl Decode {
    /// Writes whole blocks into reserved block ids, as a remote put would.
    fn write_blocks(&self, ids: &[u32], data: &[u8]) {
        let bb = self.h.layout().block_bytes();
        assert_eq!(data.len(), ids.len() * bb);
        for (&id, src) in ids.iter().zip(data.chunks_exact(bb)) {
            let off = self.h.layout().block_offset(id) as usize;
            assert!(off + bb <= self.len);
            // SAFETY: in bounds; the block is reserved, so the engine does not touch it.
            unsafe {
                std::ptr::copy_nonoverlapping(src.as_ptr(), (self.base + off) as *mut u8, bb)
            };
        }
    }
}

/// A backend whose transfer memory is not its pool, as the CUDA backend's host staging:
/// remote writes land in `staging`, and `load_received_blocks` imports them into the pool.
struct StagedBackend {
    inner: CpuBackend,
    staging: Vec<u64>,
}

impl Backend for StagedBackend {
    fn layout(&self) -> &KvLayout {
        self.inner.layout()
    }
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn forward(
        &mut self,
        batch: &[crate::backend::SeqInput<'_>],
    ) -> Result<crate::backend::StepOutput, EngineError> {
        self.inner.forward(batch)
    }
    fn export_blocks(&self, blocks: &[u32]) -> Result<Vec<u8>, EngineError> {
        self.inner.export_blocks(blocks)
    }
    fn import_blocks(&mut self, blocks: &[u32], data: &[u8]) -> Result<(), EngineError> {
        self.inner.import_blocks(blocks, data)
    }
    fn load_received_blocks(&mut self, blocks: &[u32]) -> Result<(), EngineError> {
        let bb = self.layout().block_bytes();
        // SAFETY: plain bytes of the u64 buffer, which holds the whole pool's bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts(self.staging.as_ptr() as *const u8, self.staging.len() * 8)
        };
        for &b in blocks {
            let off = self.layout().block_offset(b) as usize;
            let data = bytes[off..off + bb].to_vec();
            self.inner.import_blocks(&[b], &data)?;
        }
        Ok(())
    }
}

/// A decode engine over a [`StagedBackend`]: the test writes blocks into the staging memory.
fn staged_decode_engine(t: &Tiny, max_num_tokens: usize) -> Decode {
    let inner = CpuBackend::new(&t.model, KvDtype::F32, BLOCK, BLOCKS).unwrap();
    let len = BLOCKS * inner.layout().block_bytes();
    let mut staging = vec![0u64; len.div_ceil(8)];
    // The Vec's heap buffer does not move when the Vec moves into the backend.
    let base = staging.as_mut_ptr() as usize;
    let h = Engine::start(
        Box::new(StagedBackend { inner, staging }),
        Some(t.tokenizer.clone()),
        tiny_config(t, max_num_tokens),
    )
    .unwrap();
    Decode { h, base, len }
}

fn req(id: &str, prompt: Vec<u32>, params: SamplingParams) -> Request {
    Request {
        replayed: 0,
        request_id: id.into(),
        cache_salt: None,
        prompt,
        params,
        media: Default::default(),
    }
}

async fn run(h: &EngineHandle, r: Request) -> Vec<RequestOutput> {
    let s = h.submit(r).await.unwrap();
    tokio::time::timeout(T, s.collect()).await.unwrap()
}

async fn stats(h: &EngineHandle) -> EngineStats {
    tokio::time::timeout(T, h.stats()).await.unwrap().unwrap()
}

fn tokens(outs: &[RequestOutput]) -> Vec<u32> {
    outs.iter().flat_map(|o| o.token_ids.clone()).collect()
}

fn text(outs: &[RequestOutput]) -> String {
    outs.iter().map(|o| o.text.as_str()).collect()
}

fn logprobs(outs: &[RequestOutput]) -> Vec<f32> {
    outs.iter()
        .flat_map(|x| x.logprobs.iter().map(|l| l.logprob))
        .collect()
}

/// What a disaggregated run saw.
struct Disagg {
    outs: Vec<RequestOutput>,
    reservation: Reservation,
    /// (first_block, number of blocks) of each Blocks event.
    events: Vec<(usize, usize)>,
}

/// Reserve on B, prefill on A from B's first missing block, copy the blocks into B's
/// reservation, activate on B (unless the first token ended the request).
async fn disagg(a: &EngineHandle, b: &Decode, lease: u64, r: Request) -> Disagg {
    let reservation =
        b.h.reserve(
            lease,
            r.prompt.clone(),
            r.params.clone(),
            HashContext::salted(r.cache_salt),
        )
        .await
        .unwrap();
    let from = reservation.cached_tokens / BLOCK;
    let nblocks = r.prompt.len().div_ceil(BLOCK);
    assert_eq!(reservation.block_ids.len(), nblocks);
    let mut ps = a.prefill(r, from).await.unwrap();
    let bb = a.layout().block_bytes();
    let mut events = Vec::new();
    let mut outs = Vec::new();
    let mut next = from;
    loop {
        match tokio::time::timeout(T, ps.next()).await.unwrap() {
            Some(PrefillEvent::Blocks { first_block, data }) => {
                assert_eq!(first_block, next, "blocks come in order, each once");
                let k = data.len() / bb;
                assert!(k > 0 && data.len() == k * bb);
                b.write_blocks(&reservation.block_ids[first_block..first_block + k], &data);
                events.push((first_block, k));
                next += k;
            }
            Some(PrefillEvent::Done { output, state }) => {
                assert_eq!(next, nblocks, "every missing block was sent before Done");
                let finished = output.finish_reason.is_some();
                outs.push(output);
                if finished {
                    b.h.release_reservation(lease).await.unwrap();
                } else {
                    assert_eq!(state.num_computed, state.prompt_len);
                    assert_eq!(state.tokens.len(), state.prompt_len + 1);
                    let s = b.h.activate(lease, state).await.unwrap();
                    outs.extend(tokio::time::timeout(T, s.collect()).await.unwrap());
                }
                break;
            }
            Some(PrefillEvent::DeviceBlocks { .. }) => panic!("GPU blocks from a host export"),
            None => panic!("prefill stream ended without Done"),
        }
    }
    assert!(ps.next().await.is_none());
    Disagg {
        outs,
        reservation,
        events,
    }
}

fn assert_same(got: &[RequestOutput], want: &[RequestOutput]) {
    assert_eq!(tokens(got), tokens(want));
    assert_eq!(text(got), text(want));
    assert_eq!(logprobs(got), logprobs(want));
    let (g, w) = (got.last().unwrap(), want.last().unwrap());
    assert_eq!(g.finish_reason, w.finish_reason);
    assert_eq!(g.stop_reason, w.stop_reason);
    let (gu, wu) = (g.usage.unwrap(), w.usage.unwrap());
    assert_eq!(
        (gu.prompt_tokens, gu.completion_tokens),
        (wu.prompt_tokens, wu.completion_tokens)
    );
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..SamplingParams::greedy()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disagg_equals_aggregated_greedy_and_seeded_with_stop() {
    let t = tiny();
    let prompt = t
        .tokenizer
        .encode("The quick brown fox jumps over the lazy dog", false)
        .unwrap();
    let reference = owned_engine(&t, 64);
    let a = owned_engine(&t, 64);
    let b = decode_engine(&t, 64);

    // Greedy.
    let want = run(&reference, req("g", prompt.clone(), greedy(16))).await;
    let d = disagg(&a, &b, 1, req("g", prompt.clone(), greedy(16))).await;
    assert_same(&d.outs, &want);
    assert_eq!(d.reservation.cached_tokens, 0);
    assert_eq!(
        d.events.iter().map(|e| e.1).sum::<usize>(),
        d.reservation.block_ids.len()
    );

    // Seeded sampling with penalties, logprobs and a stop string hit mid-run.
    let sampled = SamplingParams {
        max_tokens: Some(40),
        seed: Some(7),
        temperature: 0.9,
        top_k: 50,
        top_p: 0.95,
        min_p: 0.01,
        repetition_penalty: 1.1,
        presence_penalty: 0.3,
        frequency_penalty: 0.2,
        ignore_eos: true,
        logprobs: Some(2),
        min_tokens: 2,
        ..SamplingParams::default()
    };
    let free = run(&reference, req("f", prompt.clone(), sampled.clone())).await;
    let full = text(&free);
    let chars: Vec<char> = full.chars().collect();
    assert!(
        chars.len() > 20,
        "need text to pick a stop string: {full:?}"
    );
    let stop: String = chars[chars.len() * 2 / 3..chars.len() * 2 / 3 + 3]
        .iter()
        .collect();
    let with_stop = SamplingParams {
        stop: vec![stop.clone()],
        ..sampled
    };
    let want = run(&reference, req("s", prompt.clone(), with_stop.clone())).await;
    assert_eq!(
        want.last().unwrap().stop_reason,
        Some(StopReason::String(stop))
    );
    let d = disagg(&a, &b, 2, req("s", prompt.clone(), with_stop)).await;
    assert_same(&d.outs, &want);
    // The second run found the first's prompt blocks cached on B: only the rest was sent.
    assert!(d.reservation.cached_tokens > 0);

    let sb = stats(&b.h).await;
    assert_eq!(sb.prompt_tokens_computed, 0, "B computed no prompt token");
    assert_eq!((sb.reservations, sb.reserved_blocks), (0, 0));
    assert_eq!(sb.blocks.referenced, 0);
    let sa = stats(&a).await;
    assert_eq!(sa.blocks.referenced, 0);
    assert!(sa.prompt_tokens_computed > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_prompt_streams_blocks_per_chunk() {
    let t = tiny();
    let mut prompt = Vec::new();
    while prompt.len() < 45 {
        prompt.extend(
            t.tokenizer
                .encode(" Once upon a time, in a land far away,", false)
                .unwrap(),
        );
    }
    prompt.truncate(45);
    // 16 tokens per step: the prompt takes 3 chunks (2 + 2 + 2 blocks, the last partial).
    let reference = owned_engine(&t, 16);
    let a = owned_engine(&t, 16);
    let b = decode_engine(&t, 16);
    let params = greedy(10);
    let want = run(&reference, req("l", prompt.clone(), params.clone())).await;
    let d = disagg(&a, &b, 9, req("l", prompt.clone(), params)).await;
    assert_same(&d.outs, &want);
    assert_eq!(d.events, vec![(0, 2), (2, 2), (4, 2)]);
    assert_eq!(stats(&b.h).await.prompt_tokens_computed, 0);
}

/// A prompt sharing its first blocks with an earlier request `w`.
fn prefixed(t: &Tiny) -> (Vec<u32>, Vec<u32>) {
    let mut w = Vec::new();
    while w.len() < 3 * BLOCK {
        w.extend(
            t.tokenizer
                .encode(" It was a bright cold day in April", false)
                .unwrap(),
        );
    }
    w.truncate(3 * BLOCK + 3);
    let mut x = w[..3 * BLOCK].to_vec();
    x.extend(
        t.tokenizer
            .encode(" and the clocks were striking thirteen", false)
            .unwrap(),
    );
    (w, x)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_side_cached_prefix_is_not_sent() {
    let t = tiny();
    let (w, x) = prefixed(&t);
    let reference = owned_engine(&t, 64);
    let a = owned_engine(&t, 64);
    let b = decode_engine(&t, 64);
    // Everyone saw `w` (so the prefix KV is the same bits everywhere).
    for h in [&reference, &a, &b.h] {
        run(h, req("w", w.clone(), greedy(2))).await;
    }
    let before = stats(&b.h).await.prompt_tokens_computed;
    let params = SamplingParams {
        seed: Some(3),
        temperature: 0.7,
        logprobs: Some(1),
        ..greedy(12)
    };
    let want = run(&reference, req("x", x.clone(), params.clone())).await;
    let d = disagg(&a, &b, 5, req("x", x.clone(), params)).await;
    assert_same(&d.outs, &want);
    assert_eq!(d.reservation.cached_tokens, 3 * BLOCK);
    let nblocks = x.len().div_ceil(BLOCK);
    assert_eq!(d.events.first().unwrap().0, 3);
    assert_eq!(d.events.iter().map(|e| e.1).sum::<usize>(), nblocks - 3);
    assert_eq!(stats(&b.h).await.prompt_tokens_computed, before);
    // Usage reports the reserved prefix as cached.
    assert_eq!(
        d.outs.last().unwrap().usage.unwrap().cached_tokens,
        3 * BLOCK
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_salted_disaggregated_request_reuses_only_its_salts_prefix() {
    let t = tiny();
    let (w, x) = prefixed(&t);
    let a = owned_engine(&t, 64);
    let b = decode_engine(&t, 64);
    let salted = |id: &str, p: &[u32], salt: u64| Request {
        cache_salt: Some(CacheSalt(salt)),
        ..req(id, p.to_vec(), greedy(2))
    };
    // Tenant 1's `w`, served disaggregated: the decode side registers it under salt 1.
    let d = disagg(&a, &b, 1, salted("w", &w, 1)).await;
    assert_eq!(d.reservation.cached_tokens, 0);
    // Tenant 2 shares nothing with it, on either side: the prefill computes the whole prompt.
    let computed = || async { stats(&a).await.prompt_tokens_computed };
    let before = computed().await;
    let d = disagg(&a, &b, 2, salted("x2", &x, 2)).await;
    assert_eq!(d.reservation.cached_tokens, 0);
    assert_eq!(computed().await - before, x.len() as u64);
    assert_eq!(d.outs.last().unwrap().usage.unwrap().cached_tokens, 0);
    // Tenant 1 reuses its own prefix on both sides.
    let before = computed().await;
    let d = disagg(&a, &b, 3, salted("x1", &x, 1)).await;
    assert_eq!(d.reservation.cached_tokens, 3 * BLOCK);
    assert_eq!(d.events.first().unwrap().0, 3);
    assert_eq!(computed().await - before, (x.len() - 3 * BLOCK) as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_side_cached_prefix_is_sent_at_the_first_step() {
    let t = tiny();
    let (w, x) = prefixed(&t);
    let reference = owned_engine(&t, 64);
    let a = owned_engine(&t, 64);
    let b = decode_engine(&t, 64);
    for h in [&reference, &a] {
        run(h, req("w", w.clone(), greedy(2))).await;
    }
    let mut events = b.h.subscribe_events();
    let want = run(&reference, req("x", x.clone(), greedy(12))).await;
    let d = disagg(&a, &b, 6, req("x", x.clone(), greedy(12))).await;
    assert_same(&d.outs, &want);
    assert_eq!(d.reservation.cached_tokens, 0);
    // The cached blocks go out before the step that computes the rest.
    assert_eq!(d.events[0], (0, 3));
    assert_eq!(
        d.events.iter().map(|e| e.1).sum::<usize>(),
        x.len().div_ceil(BLOCK)
    );
    assert_eq!(
        d.outs.last().unwrap().usage.unwrap().cached_tokens,
        3 * BLOCK
    );
    assert_eq!(stats(&b.h).await.prompt_tokens_computed, 0);
    // Activation registered the prompt's full blocks on B.
    let stored: usize = std::iter::from_fn(|| events.try_recv().ok())
        .filter_map(|e| match e.data {
            KvCacheEventData::Stored(s) => Some(s.blocks.len()),
            _ => None,
        })
        .sum();
    assert!(stored >= x.len() / BLOCK, "stored {stored}");
}

// ---- Fast tests over the test backend. ----

fn test_config(num_blocks: usize) -> EngineConfig {
    EngineConfig {
        max_batch_size: 8,
        max_num_tokens: 32,
        max_seq_len: 256,
        num_blocks,
        eos_token_ids: vec![EOS],
        ..EngineConfig::default()
    }
}

fn test_engine(num_blocks: usize) -> EngineHandle {
    Engine::start(
        Box::new(TestBackend::new(4, num_blocks)),
        None,
        test_config(num_blocks),
    )
    .unwrap()
}

fn prompt(len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 5) % 60 + 1).collect()
}

#[tokio::test]
async fn reservations_count_and_release_every_block() {
    let h = test_engine(16);
    let base = stats(&h).await;
    // A cached prefix first: 2 full blocks of prompt(10).
    run(&h, req("w", prompt(10), greedy(1))).await;
    let cached = stats(&h).await.blocks;
    let r = h
        .reserve(1, prompt(14), greedy(4), HashContext::default())
        .await
        .unwrap();
    assert_eq!(r.cached_tokens, 8);
    assert_eq!(r.block_ids.len(), 4);
    let s = stats(&h).await;
    assert_eq!((s.reservations, s.reserved_blocks), (1, 4));
    assert_eq!(s.blocks.referenced, 4);
    assert!(matches!(
        h.reserve(1, prompt(3), greedy(1), HashContext::default())
            .await,
        Err(EngineError::DuplicateLease(1))
    ));
    let e = h.clear_cache().await.unwrap_err();
    assert!(e.to_string().contains("reservation"), "{e}");
    h.release_reservation(1).await.unwrap();
    let s = stats(&h).await;
    assert_eq!((s.reservations, s.reserved_blocks), (0, 0));
    // Back to the state before the reservation: the fresh blocks are free, not cached.
    assert_eq!(s.blocks, cached);
    assert!(matches!(
        h.release_reservation(1).await,
        Err(EngineError::UnknownLease(1))
    ));
    let e = h.activate(7, dummy_state(&prompt(3))).await.err().unwrap();
    assert!(matches!(e, EngineError::UnknownLease(7)), "{e}");
    h.clear_cache().await.unwrap();
    assert_eq!(stats(&h).await.blocks, base.blocks);
    // Refusals: the pool cannot hold it now; a bad prompt.
    let _r1 = h
        .reserve(2, prompt(40), greedy(4), HashContext::default())
        .await
        .unwrap();
    assert!(matches!(
        h.reserve(3, prompt(40), greedy(4), HashContext::default())
            .await,
        Err(EngineError::OutOfBlocks { .. })
    ));
    assert!(h
        .reserve(3, vec![99], greedy(1), HashContext::default())
        .await
        .is_err());
    assert!(h
        .reserve(3, prompt(10), greedy(100), HashContext::default())
        .await
        .is_err());
    assert_eq!(stats(&h).await.reservations, 1);
    // Shutdown drops reservations (and the engine answers no more).
    h.shutdown();
    assert!(matches!(
        h.reserve(4, prompt(3), greedy(1), HashContext::default())
            .await,
        Err(EngineError::Stopped)
    ));
}

fn dummy_state(p: &[u32]) -> SequenceState {
    SequenceState {
        request_id: "d".into(),
        index: 0,
        params: greedy(4),
        tokens: [p, &[1]].concat(),
        prompt_len: p.len(),
        max_tokens: 4,
        num_computed: p.len(),
        cached_prompt_tokens: 0,
        sampler: crate::sampler::SamplerState::new(1, 0),
        stop: crate::sampler::StopMatcher::new(&[] as &[String]),
        cache_salt: None,
        media: Default::default(),
    }
}

/// Prefill on one test-backend engine; returns the Done state after checking the events.
async fn prefill_state(a: &EngineHandle, r: Request) -> (RequestOutput, SequenceState) {
    let mut ps = a.prefill(r, 0).await.unwrap();
    loop {
        match tokio::time::timeout(T, ps.next()).await.unwrap().unwrap() {
            PrefillEvent::Blocks { .. } | PrefillEvent::DeviceBlocks { .. } => {}
            PrefillEvent::Done { output, state } => return (output, state),
        }
    }
}

#[tokio::test]
async fn activate_refuses_a_mismatch_and_keeps_the_reservation() {
    let a = test_engine(16);
    let b = test_engine(16);
    let (out, state) = prefill_state(&a, req("r", prompt(9), greedy(4))).await;
    assert!(out.finish_reason.is_none() && out.usage.is_none());
    assert_eq!(out.token_ids.len(), 1);
    b.reserve(1, prompt(10), greedy(4), HashContext::default())
        .await
        .unwrap();
    let e = b.activate(1, state.clone()).await.err().unwrap();
    assert!(e.to_string().contains("prompt"), "{e}");
    b.reserve(2, prompt(9), greedy(4), HashContext::default())
        .await
        .unwrap();
    let mut bad = state.clone();
    bad.num_computed -= 1;
    assert!(b.activate(2, bad).await.is_err());
    let mut bad = state.clone();
    bad.tokens.truncate(9);
    assert!(b.activate(2, bad).await.is_err());
    // A state of another cache salt than the reservation's.
    let mut bad = state.clone();
    bad.cache_salt = Some(crate::kv::hash::CacheSalt(5));
    let e = b.activate(2, bad).await.err().unwrap();
    assert!(matches!(e, EngineError::BadSnapshot(_)), "{e}");
    assert_eq!(stats(&b).await.reservations, 2);
    b.release_reservation(1).await.unwrap();
    b.release_reservation(2).await.unwrap();
    let s = stats(&b).await;
    assert_eq!((s.blocks.referenced, s.blocks.cached), (0, 0));
    assert_eq!(s.blocks.free, 16);
}

#[tokio::test]
async fn prefill_refusals_and_first_token_finishing() {
    let a = test_engine(16);
    let two = SamplingParams { n: 2, ..greedy(3) };
    assert!(matches!(
        a.prefill(req("n", prompt(5), two), 0).await,
        Err(EngineError::InvalidRequest(_))
    ));
    assert!(a.prefill(req("f", prompt(5), greedy(3)), 3).await.is_err());
    // max_tokens 1: the first token ends the request, Done carries the finish.
    let (out, state) = prefill_state(&a, req("one", prompt(6), greedy(1))).await;
    assert_eq!(out.finish_reason, Some(FinishReason::Length));
    let u = out.usage.unwrap();
    assert_eq!((u.prompt_tokens, u.completion_tokens), (6, 1));
    assert_eq!(state.tokens.len(), 7);
    let s = stats(&a).await;
    assert_eq!((s.requests, s.blocks.referenced), (0, 0));
    assert_eq!(s.prompt_tokens_computed, 6);
}

#[tokio::test]
async fn dropping_a_prefill_stream_aborts_it() {
    let (gb, permits) = TestBackend::gated(4, 16);
    let a = Engine::start(Box::new(gb), None, test_config(16)).unwrap();
    // 40 tokens take two steps of 32: the drop lands before the prompt is done.
    let ps = a.prefill(req("p", prompt(40), greedy(3)), 0).await.unwrap();
    drop(ps);
    let f = a.stats();
    permits.send(()).unwrap();
    let s = tokio::time::timeout(T, f).await.unwrap().unwrap();
    assert_eq!((s.requests, s.blocks.referenced), (0, 0));
    assert!(s.prompt_tokens_computed < 40);
}

#[tokio::test]
async fn preempted_prefill_restarts_without_resending() {
    // An older decoding request grows while a prefill runs in a pool too small for both
    // (MAX_UTILIZATION): the prefill is preempted mid-prompt and recomputes, and still reports
    // every block exactly once, in order, with the token of a solo run.
    let cfg = EngineConfig {
        max_num_tokens: 8,
        capacity_scheduler_policy: CapacitySchedulerPolicy::MaxUtilization,
        ..test_config(10)
    };
    let (gb, permits) = TestBackend::gated(4, 10);
    let a = Engine::start(Box::new(gb), None, cfg).unwrap();
    let solo = test_engine(32);
    let rp = prompt(28);
    let pp: Vec<u32> = prompt(24).iter().map(|t| t % 50 + 3).collect();
    let want_r = run(&solo, req("r", rp.clone(), greedy(8))).await;
    let want_p = run(&solo, req("p", pp.clone(), greedy(1))).await;
    let fr = a.submit(req("r", rp, greedy(8)));
    let fp = a.prefill(req("p", pp, greedy(1)), 0);
    for _ in 0..1000 {
        permits.send(()).unwrap();
    }
    let sr = fr.await.unwrap();
    let mut ps = fp.await.unwrap();
    let mut next = 0;
    loop {
        match tokio::time::timeout(T, ps.next()).await.unwrap().unwrap() {
            PrefillEvent::Blocks { first_block, data } => {
                assert_eq!(first_block, next);
                next += data.len() / a.layout().block_bytes();
            }
            PrefillEvent::DeviceBlocks { .. } => panic!("GPU blocks from a host export"),
            PrefillEvent::Done { output, .. } => {
                assert_eq!(next, 6);
                assert_eq!(output.token_ids, tokens(&want_p));
                break;
            }
        }
    }
    let got_r = tokio::time::timeout(T, sr.collect()).await.unwrap();
    assert_eq!(tokens(&got_r), tokens(&want_r));
    let s = stats(&a).await;
    assert!(s.preemptions > 0, "no preemption happened: {s:?}");
    assert_eq!(s.blocks.referenced, 0);
}

/// The engine hands exactly the blocks a remote prefill wrote (not the reserved prefix it
/// had cached) to `load_received_blocks` on activation: with a backend whose transfer memory
/// is separate from its pool (the CUDA backend's host staging), the result still equals an
/// aggregated run, and the cached prefix is not overwritten by the (empty) staging copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_transfer_memory_is_loaded_on_activation() {
    let t = tiny();
    let (w, x) = prefixed(&t);
    let reference = owned_engine(&t, 64);
    let a = owned_engine(&t, 64);
    let b = staged_decode_engine(&t, 64);
    for h in [&reference, &a, &b.h] {
        run(h, req("w", w.clone(), greedy(2))).await;
    }
    let want = run(&reference, req("x", x.clone(), greedy(12))).await;
    let d = disagg(&a, &b, 9, req("x", x.clone(), greedy(12))).await;
    assert_eq!(d.reservation.cached_tokens, 3 * BLOCK);
    assert_same(&d.outs, &want);
    // And a prompt with nothing cached on the decode side.
    let fresh: Vec<u32> = x.iter().rev().copied().collect();
    let want = run(&reference, req("y", fresh.clone(), greedy(8))).await;
    let d = disagg(&a, &b, 10, req("y", fresh, greedy(8))).await;
    assert_same(&d.outs, &want);
}

/// A CPU backend standing in for a GPU one: its pool (memory the test owns) is reported as
/// device memory, so prefills can hand blocks out in place (`BlockExport::Device`).
struct InPlaceBackend {
    inner: CpuBackend,
    base: u64,
    /// Layer fences handed out for the next step, resolved once its forward returns.
    armed: Option<crate::backend::fence::ArmedLayers>,
}

/// A fence that has always passed (the CPU backend's work is done when `forward` returns).
struct Passed;

impl crate::backend::DeviceFence for Passed {
    fn wait(&self) -> Result<(), EngineError> {
        Ok(())
    }
}

impl Backend for InPlaceBackend {
    fn layout(&self) -> &KvLayout {
        self.inner.layout()
    }
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn forward(
        &mut self,
        batch: &[crate::backend::SeqInput<'_>],
    ) -> Result<crate::backend::StepOutput, EngineError> {
        let marks = self.armed.take().map(|a| a.into_setters());
        let out = self.inner.forward(batch)?;
        if let Some(mut marks) = marks {
            marks.finish(|| Ok(Box::new(Passed)))?;
        }
        Ok(out)
    }
    fn export_blocks(&self, blocks: &[u32]) -> Result<Vec<u8>, EngineError> {
        self.inner.export_blocks(blocks)
    }
    fn import_blocks(&mut self, blocks: &[u32], data: &[u8]) -> Result<(), EngineError> {
        self.inner.import_blocks(blocks, data)
    }
    fn device_pool(&self) -> Option<crate::backend::DevicePool> {
        Some(crate::backend::DevicePool {
            ptr: self.base,
            len: self.num_blocks() * self.layout().block_bytes(),
            device: 0,
        })
    }
    fn device_blocks(
        &mut self,
        blocks: &[u32],
    ) -> Result<Option<crate::backend::DeviceBlocks>, EngineError> {
        let bb = self.layout().block_bytes();
        Ok(Some(crate::backend::DeviceBlocks {
            device: 0,
            block_bytes: bb,
            ptrs: blocks
                .iter()
                .map(|&b| self.base + self.layout().block_offset(b))
                .collect(),
            ready: crate::backend::BlocksReady::Whole(Box::new(Passed)),
        }))
    }
    fn device_blocks_by_layers(
        &mut self,
        blocks: &[u32],
        groups: usize,
    ) -> Result<Option<crate::backend::DeviceBlocks>, EngineError> {
        let layers = self.layout().num_layers;
        let fences = self
            .armed
            .get_or_insert_with(|| crate::backend::fence::ArmedLayers::new(layers, groups))
            .fences();
        let Some(mut blocks) = self.device_blocks(blocks)? else {
            return Ok(None);
        };
        blocks.ready = crate::backend::BlocksReady::Layers {
            layer_bytes: self.layout().layer_bytes(),
            groups: fences,
        };
        Ok(Some(blocks))
    }
}

fn in_place_engine(t: &Tiny, max_num_tokens: usize) -> EngineHandle {
    let probe = CpuBackend::new(&t.model, KvDtype::F32, BLOCK, 1).unwrap();
    let len = BLOCKS * probe.layout().block_bytes();
    let mut buf = vec![0u64; len.div_ceil(8)];
    let base = buf.as_mut_ptr() as u64;
    // SAFETY: the Vec's heap buffer does not move when boxed and lives as long as the pool.
    let mem = unsafe { KvPoolMemory::external(base as *mut u8, len, Box::new(buf)) }.unwrap();
    let inner = CpuBackend::new_in(&t.model, KvDtype::F32, BLOCK, BLOCKS, mem).unwrap();
    Engine::start(
        Box::new(InPlaceBackend {
            inner,
            base,
            armed: None,
        }),
        Some(t.tokenizer.clone()),
        tiny_config(t, max_num_tokens),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_handed_out_in_place_stay_pinned_until_written() {
    in_place_prefill(0).await;
}

/// Blocks a step completes leave before it runs, in layer groups each behind its own fence:
/// read group by group, they make the same blocks and the same continuation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_handed_out_by_layer_groups_assemble_the_same_kv() {
    in_place_prefill(2).await;
    in_place_prefill(64).await;
}

/// Reads a handed-out block set: whole blocks after their fence, or group by group, each
/// group's layers of every block after that group's fence; returns each block's bytes.
fn read_device_blocks(blocks: &crate::backend::DeviceBlocks) -> Vec<Vec<u8>> {
    let bb = blocks.block_bytes;
    let mut out = vec![vec![0u8; bb]; blocks.ptrs.len()];
    let groups: Vec<std::ops::Range<usize>> = match &blocks.ready {
        crate::backend::BlocksReady::Whole(f) => {
            f.wait().unwrap();
            std::iter::once(0..bb).collect()
        }
        crate::backend::BlocksReady::Layers {
            layer_bytes,
            groups,
        } => {
            let mut ranges = Vec::new();
            let mut covered = 0;
            for g in groups {
                g.fence.wait().unwrap();
                assert_eq!(g.layers.start * layer_bytes, covered, "groups in order");
                covered = g.layers.end * layer_bytes;
                ranges.push(g.layers.start * layer_bytes..covered);
            }
            assert_eq!(covered, bb, "the groups cover every layer");
            ranges
        }
    };
    for bytes in groups {
        for (j, &ptr) in blocks.ptrs.iter().enumerate() {
            // SAFETY: the pin keeps the block referenced (not reused nor written), and the
            // range is inside the block.
            let data = unsafe { std::slice::from_raw_parts(ptr as *const u8, bb) };
            out[j][bytes.clone()].copy_from_slice(&data[bytes.clone()]);
        }
    }
    out
}

async fn in_place_prefill(layer_groups: usize) {
    let t = tiny();
    let prompt = t
        .tokenizer
        .encode(
            &"The quick brown fox jumps over the lazy dog. ".repeat(6),
            false,
        )
        .unwrap();
    assert!(prompt.len() > 2 * 16, "{} tokens", prompt.len());
    let reference = owned_engine(&t, 64);
    let want = run(&reference, req("p", prompt.clone(), greedy(12))).await;
    // Chunks of 16 tokens: blocks leave in several events, while the prompt still computes.
    let a = in_place_engine(&t, 16);
    let b = decode_engine(&t, 64);
    let reservation =
        b.h.reserve(9, prompt.clone(), greedy(12), HashContext::salted(None))
            .await
            .unwrap();
    let mut ps = a
        .prefill_as(
            req("p", prompt.clone(), greedy(12)),
            0,
            BlockExport::Device { layer_groups },
        )
        .await
        .unwrap();
    let (mut pins, mut next, mut events) = (Vec::new(), 0, 0);
    let state = loop {
        match tokio::time::timeout(T, ps.next()).await.unwrap() {
            Some(PrefillEvent::DeviceBlocks {
                first_block,
                blocks,
                pin,
            }) => {
                assert_eq!(first_block, next, "blocks come in order, each once");
                let by_layers = matches!(blocks.ready, crate::backend::BlocksReady::Layers { .. });
                assert_eq!(by_layers, layer_groups > 0, "{:?}", blocks.ready);
                for (j, data) in read_device_blocks(&blocks).iter().enumerate() {
                    b.write_blocks(&reservation.block_ids[first_block + j..][..1], data);
                }
                next += blocks.ptrs.len();
                events += 1;
                // Held until after Done: the sequence has ended by then.
                pins.push(pin);
            }
            Some(PrefillEvent::Done { state, .. }) => break state,
            Some(PrefillEvent::Blocks { .. }) => panic!("copied blocks from a device export"),
            None => panic!("prefill stream ended without Done"),
        }
    };
    assert!(events > 1, "a chunked prompt leaves in several events");
    assert_eq!(next, reservation.block_ids.len());
    // The sequence has ended; its blocks are still referenced, by the pins alone.
    let held = stats(&a).await.blocks.referenced;
    assert_eq!(held, next, "every handed-out block stays pinned");
    drop(pins);
    assert_eq!(stats(&a).await.blocks.referenced, 0, "dropped pins release");
    let s = b.h.activate(9, state).await.unwrap();
    let mut outs = vec![];
    outs.extend(tokio::time::timeout(T, s.collect()).await.unwrap());
    assert_eq!(tokens(&outs), tokens(&want)[1..].to_vec());

    // An engine whose pool is not device memory refuses a device export.
    let e = reference
        .prefill_as(
            req("x", prompt, greedy(2)),
            0,
            BlockExport::Device { layer_groups },
        )
        .await
        .err()
        .expect("refused");
    assert!(matches!(e, EngineError::InvalidRequest(_)), "{e}");
}
