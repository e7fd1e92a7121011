//! What structured outputs cost per token: the built-in tiny model on the CPU engine (the
//! real Qwen3 tokenizer, 151,936-token vocabulary), or with `--cuda --model DIR` a model on
//! the CUDA backend (whose device sampler applies the grammar's mask), generating at batch 1
//! and 64, with a JSON-schema constraint and without one, in the same run; and the grammar's
//! own work per token (mask, apply, advance) measured alone.
//!
//!     cargo run -p tandem-engine --example grammar_cost [-- --tokens 64]
//!     grammar_cost --cuda --model DIR (built with --features cuda)
//!
//! The schema never completes within the budget (an array of at least 1,000 objects), so every
//! step of every sequence computes a mask; the unconstrained run uses `ignore_eos` to generate
//! the same number of tokens.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_engine::backend::cpu::CpuBackend;
use tandem_engine::backend::Backend;
use tandem_engine::engine::{Engine, EngineConfig, EngineHandle, Request};
use tandem_engine::kv::layout::KvDtype;
use tandem_engine::model::{LoadOptions, LoadedModel};
use tandem_engine::sampler::guide::Guides;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::tokenizer::Tokenizer;
use tandem_text::Constraint;

const SCHEMA: &str = r#"{"type": "array", "minItems": 1000, "items": {"type": "object",
  "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                 "name": {"type": "string", "maxLength": 8},
                 "ok": {"type": "boolean"}},
  "required": ["id", "name", "ok"], "additionalProperties": false}}"#;

/// The value after `flag` on the command line.
fn arg(flag: &str) -> Option<String> {
    std::env::args().skip_while(|a| a != flag).nth(1)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let tokens: usize = arg("--tokens")
        .map(|v| v.parse())
        .transpose()?
        .unwrap_or(64);
    let cuda = std::env::args().any(|a| a == "--cuda");
    let dir = match arg("--model") {
        Some(d) => std::path::PathBuf::from(d),
        None => tandem_engine::tiny::ensure_tiny_model()?,
    };
    let model = LoadedModel::load(&dir, &LoadOptions::default())?;
    println!(
        "backend: {}, model {}",
        if cuda { "CUDA" } else { "CPU" },
        dir.display()
    );
    let tokenizer = Arc::new(Tokenizer::load(&dir)?);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    println!("rayon threads: {}", rayon::current_num_threads());
    grammar_alone(&model, &tokenizer, tokens)?;
    println!("| batch | unconstrained tok/s | json_schema tok/s | ratio | added per token |");
    println!("| --- | --- | --- | --- | --- |");
    for batch in [1usize, 64] {
        let shape = Shape {
            batch,
            tokens,
            cuda,
        };
        let plain = rt.block_on(run(&model, &tokenizer, shape, None))?;
        let constraint = Some(Constraint::JsonSchema(SCHEMA.into()));
        let guided = rt.block_on(run(&model, &tokenizer, shape, constraint))?;
        let n = (batch * tokens) as f64;
        let (p, g) = (n / plain.as_secs_f64(), n / guided.as_secs_f64());
        let added_us = (guided.as_secs_f64() - plain.as_secs_f64()) / n * 1e6;
        println!(
            "| {batch} | {p:.0} | {g:.0} | {:.2} | {added_us:.0} µs |",
            g / p
        );
    }
    Ok(())
}

/// The grammar's work per token with no model: mask, apply it to a logits row, advance.
fn grammar_alone(
    model: &LoadedModel,
    tokenizer: &Arc<Tokenizer>,
    tokens: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    let vocab = model.config.vocab_size;
    let guides = Guides::new(Some(tokenizer.clone()), vocab, model.eos_token_ids());
    let t = Instant::now();
    let mut guide = guides.compile(&Constraint::JsonSchema(SCHEMA.into()))?;
    println!(
        "token table + first compile: {:.0} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    let t = Instant::now();
    guides.compile(&Constraint::JsonSchema(SCHEMA.into()))?;
    println!(
        "compile (table built): {:.2} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    let mut row = vec![0f32; vocab];
    let (mut mask_t, mut apply_t) = (Duration::ZERO, Duration::ZERO);
    let mut state = 12345u64;
    for _ in 0..tokens {
        let t = Instant::now();
        guide.prepare();
        mask_t += t.elapsed();
        row.iter_mut().for_each(|x| *x = 0.0);
        let t = Instant::now();
        guide.mask_logits(&mut row)?;
        apply_t += t.elapsed();
        // A uniform pick among the allowed tokens (a random model's behaviour).
        let allowed: Vec<u32> = (0..vocab as u32)
            .filter(|&i| row[i as usize].is_finite())
            .collect();
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        guide.advance(allowed[(state >> 33) as usize % allowed.len()])?;
    }
    let per = |d: Duration| d.as_secs_f64() / tokens as f64 * 1e6;
    println!(
        "grammar alone, per token: mask {:.0} µs, apply {:.0} µs ({tokens} tokens)",
        per(mask_t),
        per(apply_t)
    );
    Ok(())
}

/// One timed run: `batch` requests of `tokens` tokens each, on which backend.
#[derive(Clone, Copy)]
struct Shape {
    batch: usize,
    tokens: usize,
    cuda: bool,
}

/// The backend of a run: the CPU engine's, or (`--cuda`) the CUDA backend's.
fn backend(
    model: &LoadedModel,
    blocks: usize,
    cuda: bool,
) -> Result<Box<dyn Backend>, Box<dyn std::error::Error>> {
    if !cuda {
        return Ok(Box::new(CpuBackend::new(model, KvDtype::F32, 16, blocks)?));
    }
    #[cfg(feature = "cuda")]
    {
        use tandem_engine::backend::cuda::{ComputeMode, CudaBackend, CudaOptions, PoolSize};
        let mode = ComputeMode::Bf16Split;
        let opts = CudaOptions {
            ordinal: 0,
            mode,
            kv_dtype: mode.kv_dtype16(),
            block_size: 16,
            pool: PoolSize::Blocks(blocks),
            max_step_tokens: 8192,
            graph_max_batch: 256,
        };
        Ok(Box::new(CudaBackend::new(model, &opts)?))
    }
    #[cfg(not(feature = "cuda"))]
    Err("--cuda needs this example built with --features cuda".into())
}

/// `batch` requests of `tokens` tokens each through a fresh engine; the wall time.
async fn run(
    model: &LoadedModel,
    tokenizer: &Arc<Tokenizer>,
    Shape {
        batch,
        tokens,
        cuda,
    }: Shape,
    constraint: Option<Constraint>,
) -> Result<Duration, Box<dyn std::error::Error>> {
    let blocks = batch * (tokens + 16).div_ceil(16) + 16;
    let backend = backend(model, blocks, cuda)?;
    let cfg = EngineConfig {
        max_batch_size: batch,
        max_num_tokens: 8192,
        max_seq_len: tokens + 64,
        num_blocks: blocks,
        eos_token_ids: model.eos_token_ids(),
        ..EngineConfig::default()
    };
    let engine: EngineHandle = Engine::start(backend, Some(tokenizer.clone()), cfg)?;
    let prompt = tokenizer.encode("Write the records:", false)?;
    // The token table is built on an engine's first constrained request: not timed.
    let warm = SamplingParams {
        max_tokens: Some(1),
        ignore_eos: constraint.is_none(),
        constraint: constraint.clone(),
        ..SamplingParams::default()
    };
    let r = Request {
        request_id: "warm-up".into(),
        prompt: prompt.clone(),
        params: warm,
        cache_salt: None,
        media: Vec::new(),
        replayed: 0,
    };
    engine.submit(r).await?.collect().await;
    let started = Instant::now();
    let mut streams = Vec::with_capacity(batch);
    for i in 0..batch {
        let params = SamplingParams {
            max_tokens: Some(tokens),
            seed: Some(i as u64),
            ignore_eos: constraint.is_none(),
            constraint: constraint.clone(),
            ..SamplingParams::default()
        };
        let r = Request {
            request_id: format!("r{i}"),
            prompt: prompt.clone(),
            params,
            cache_salt: None,
            media: Vec::new(),
            replayed: 0,
        };
        streams.push(engine.submit(r).await?);
    }
    let mut generated = 0;
    for s in streams {
        generated += s
            .collect()
            .await
            .iter()
            .map(|o| o.token_ids.len())
            .sum::<usize>();
    }
    let elapsed = started.elapsed();
    if generated != batch * tokens {
        return Err(format!("generated {generated} tokens, not {}", batch * tokens).into());
    }
    Ok(elapsed)
}
