//! CPU engine throughput: prefill (512 tokens) and decode (batch 1 and 8) tokens/s for the
//! tiny model and a Qwen3-0.6B-shaped random model, next to a pure GEMM rate measured in the
//! same run (so the forward can be read as a fraction of what the GEMM crate delivers here).
//!
//!     cargo run -p tandem-engine --example bench_cpu [-- --quick] [--tensor-parallel N]
//!
//! `--tensor-parallel N` splits each model over N ranks (threads joined by the in-process
//! all-reduce; the tiny model runs whole when N does not divide its heads).
//!
//! The dev profile already optimises tandem-engine and its dependencies (opt-level 3), so no
//! release build is needed. `--quick` runs the 0.6B shape with 4 layers only. The 0.6B shape
//! runs twice: f32 weights, and bf16 weights as a real checkpoint holds them.

use std::sync::Arc;
use std::time::Instant;

use tandem_engine::backend::cpu::CpuBackend;
use tandem_engine::backend::cpu_ops::{matmul_t, MatRef, Matrix};
use tandem_engine::backend::{Backend, LogitsMode, SeqInput};
use tandem_engine::kv::layout::KvDtype;
use tandem_engine::model::{ModelConfig, Qwen3Weights};
use tandem_engine::tiny::{qwen3_config_json, random_init, random_tensor, TinyDims, TINY};

const BLOCK: usize = 32;
const PREFILL: usize = 512;
const CONTEXT: usize = 128;
const DECODE_STEPS: usize = 16;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let tp = match args.iter().position(|a| a == "--tensor-parallel") {
        Some(i) => args
            .get(i + 1)
            .and_then(|n| n.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .ok_or("--tensor-parallel takes a rank count (1 or more)")?,
        None => 1,
    };
    println!(
        "rayon threads: {}, tensor parallel {tp}",
        rayon::current_num_threads()
    );
    let gemm = gemm_rate(PREFILL, 1024, 3072);
    let gemv = gemm_rate(1, 1024, 3072);
    let gemv8 = gemm_rate(8, 1024, 3072);
    println!("baseline sgemm [512x1024]·[1024x3072]: {gemm:.1} GFLOP/s");
    println!("baseline gemv  [1x1024]·[1024x3072]:   {gemv:.1} GFLOP/s");
    println!("baseline gemv  [8x1024]·[1024x3072]:   {gemv8:.1} GFLOP/s");
    bench(
        "tiny (2 layers, hidden 64, f32 weights)",
        &TINY,
        gemm,
        (false, tp),
    )?;
    let q06 = TinyDims {
        hidden: 1024,
        intermediate: 3072,
        layers: if quick { 4 } else { 28 },
        heads: 16,
        kv_heads: 8,
        head_dim: 128,
        vocab: 151_936,
        tied: true,
    };
    for bf16 in [false, true] {
        let dtype = if bf16 { "bf16" } else { "f32" };
        bench(
            &format!("Qwen3-0.6B shape ({} layers, {dtype} weights)", q06.layers),
            &q06,
            gemm,
            (bf16, tp),
        )?;
    }
    Ok(())
}

/// GFLOP/s of the engine's own matmul at the given size (best of 3).
fn gemm_rate(m: usize, k: usize, n: usize) -> f64 {
    let x = random_tensor(1, "x", m * k, 0.0, 1.0);
    let w = random_tensor(2, "w", n * k, 0.0, 1.0);
    let mut out = vec![0.0; m * n];
    let reps = if m <= 16 { 100 } else { 3 };
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        for _ in 0..reps {
            matmul_t(&x, m, k, MatRef::F32(&w), n, &mut out);
        }
        best = best.min(t.elapsed().as_secs_f64() / reps as f64);
    }
    2.0 * (m * k * n) as f64 / best / 1e9
}

fn bench(
    name: &str,
    d: &TinyDims,
    gemm: f64,
    (bf16, tp): (bool, usize),
) -> Result<(), Box<dyn std::error::Error>> {
    let t = Instant::now();
    let cfg_json = serde_json::to_vec(&qwen3_config_json(d, "float32"))?;
    let cfg = ModelConfig::parse(&cfg_json, std::path::Path::new("<bench>"))?;
    let w = Qwen3Weights::from_source(&cfg, |name, shape| {
        let (mean, std) = random_init(name, shape);
        let v = random_tensor(7, name, shape.iter().product(), mean, std);
        Ok(if bf16 {
            Matrix::Bf16(v.iter().map(|x| half_bits(*x)).collect())
        } else {
            Matrix::F32(v)
        })
    })?;
    // Weight FLOPs per token: every matmul weight except the embedding lookup; lm_head counted
    // separately since prefill computes it for one row only.
    let layer_params: usize = w
        .layers
        .iter()
        .map(|l| l.qkv.len() + l.o_proj.len() + l.gate_up.len() + l.down.len())
        .sum();
    let head_params = w.lm_head().len();
    println!(
        "\n== {name}: {:.0} M matmul params + {:.0} M lm_head, built in {:.1} s",
        layer_params as f64 / 1e6,
        head_params as f64 / 1e6,
        t.elapsed().as_secs_f64()
    );
    let blocks = 8 * (CONTEXT + DECODE_STEPS).div_ceil(BLOCK) + PREFILL.div_ceil(BLOCK);
    let mut be = CpuBackend::from_parts(
        cfg.clone(),
        Arc::new(w),
        "bench".into(),
        KvDtype::F32,
        BLOCK,
        blocks,
    )?;
    if tandem_engine::model::tp::Shard::check(&cfg, tp).is_ok() {
        be = be.with_tensor_parallel(tp)?;
    }
    println!("  tensor parallel ranks: {}", be.tensor_parallel_size());

    // Prefill 512 tokens, one chunk.
    let prompt: Vec<u32> = (0..PREFILL as u32).map(|i| (i * 7919) % 150_000).collect();
    let table: Vec<u32> = (0..PREFILL.div_ceil(BLOCK) as u32).collect();
    let t = Instant::now();
    be.forward(&[SeqInput {
        tokens: &prompt,
        start_pos: 0,
        block_table: &table,
        logits: LogitsMode::Last,
        media: Default::default(),
    }])?;
    let s = t.elapsed().as_secs_f64();
    let flops = 2.0 * (layer_params * PREFILL + head_params) as f64;
    println!(
        "prefill {PREFILL}: {:.1} tok/s ({:.2} s, {:.1} GFLOP/s = {:.0}% of the sgemm baseline)",
        PREFILL as f64 / s,
        s,
        flops / s / 1e9,
        100.0 * flops / s / 1e9 / gemm
    );

    for batch in [1usize, 8] {
        let per_seq = (CONTEXT + DECODE_STEPS).div_ceil(BLOCK);
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|b| {
                let first = (PREFILL.div_ceil(BLOCK) + b * per_seq) as u32;
                (first..first + per_seq as u32).collect()
            })
            .collect();
        let ctx: Vec<u32> = (0..CONTEXT as u32)
            .map(|i| (i * 31 + 5) % 150_000)
            .collect();
        let inputs: Vec<SeqInput<'_>> = tables
            .iter()
            .map(|t| SeqInput {
                tokens: &ctx,
                start_pos: 0,
                block_table: t,
                logits: LogitsMode::None,
                media: Default::default(),
            })
            .collect();
        be.forward(&inputs)?;
        let t = Instant::now();
        for step in 0..DECODE_STEPS {
            let tok = [((step * 101) % 150_000) as u32];
            let inputs: Vec<SeqInput<'_>> = tables
                .iter()
                .map(|t| SeqInput {
                    tokens: &tok,
                    start_pos: CONTEXT + step,
                    block_table: t,
                    logits: LogitsMode::Last,
                    media: Default::default(),
                })
                .collect();
            be.forward(&inputs)?;
        }
        let s = t.elapsed().as_secs_f64();
        println!(
            "decode batch {batch} (context {CONTEXT}): {:.1} tok/s ({:.1} ms/step)",
            (batch * DECODE_STEPS) as f64 / s,
            1e3 * s / DECODE_STEPS as f64
        );
    }
    Ok(())
}

/// f32 → bf16 bits, round to nearest even (what checkpoints hold).
fn half_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}
