//! Runs the tiny model (its exact weights, made in memory from the tiny model's seed: no files
//! or tokenizer needed) on the CPU backend and on the CUDA backend, over the same steps (two
//! prefills, a chunked prefill over a cached prefix, decodes, then 24 greedy steps), in f32
//! mode with f32 and bf16 KV pools and in bf16 mode, and prints a JSON report: max |Δ| of
//! logits over the CPU logits' std per step, greedy token agreement, the device argmax against
//! the host argmax of the same logits, and the exported KV blocks' max |Δ|. Exits 1 when
//! max |Δ| / std exceeds the tolerance (1e-4 in f32 mode with an f32 KV pool, the f32
//! criterion; 1e-3 with a bf16 pool, where a 1e-6 difference can flip one bf16 rounding of a
//! cached K/V value, 1 ulp = 2e-3 relative; 1e-1 in bf16 mode, whose greedy tokens may
//! differ and are only reported; 1e-3 in split-bf16 mode) or an f32-mode greedy token differs, 2 without a GPU.
//!
//! `cargo build --release -p tandem-engine --features cuda --example cuda_backend_check`

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("cuda_backend_check needs the `cuda` feature: --features cuda");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
fn main() {
    match check::run() {
        Ok(pass) => std::process::exit(if pass { 0 } else { 1 }),
        Err(e) => {
            println!("{}", serde_json::json!({ "error": e.to_string() }));
            std::process::exit(2);
        }
    }
}

#[cfg(feature = "cuda")]
mod check {
    use std::sync::Arc;

    use serde_json::{json, Value};
    use tandem_engine::backend::cpu::CpuBackend;
    use tandem_engine::backend::cpu_ops::Matrix;
    use tandem_engine::backend::cuda::{
        ComputeMode, CudaBackend, CudaDevice, CudaOptions, PoolSize,
    };
    use tandem_engine::backend::{Backend, LogitsMode, SeqInput};
    use tandem_engine::error::EngineError;
    use tandem_engine::kv::layout::KvDtype;
    use tandem_engine::model::config::ModelConfig;
    use tandem_engine::model::Qwen3Weights;
    use tandem_engine::sampler::SamplePlan;
    use tandem_engine::tiny::{qwen3_config_json, random_init, random_tensor, TINY, TINY_SEED};

    const BS: usize = 16;
    const BLOCKS: usize = 32;
    /// max |Δ| / std allowed with an f32 KV pool.
    const TOL: f64 = 1e-4;
    /// With a bf16 KV pool: the H200 run of 2026-11-30 measured 1.5e-4 (greedy tokens identical).
    const TOL_BF16_KV: f64 = 1e-3;
    /// In bf16 compute mode (GEMM inputs rounded to bf16; both backends get the same bf16
    /// weights): a loose bound on a lossy mode; the H200 run of 2026-11-30 measured 7.0e-2
    /// on this random 2-layer model (greedy tokens reported, not required).
    const TOL_BF16_MODE: f64 = 1e-1;
    /// In f16 mode (weights, GEMM inputs and KV pool in IEEE half, 3 mantissa bits more than
    /// bf16): expected near an eighth of the bf16 mode's error; a bf16 program in its place
    /// would fail it.
    const TOL_F16_MODE: f64 = 2e-2;
    /// In split-bf16 mode (bf16 weights, GEMM inputs as hi + lo bf16 terms), f32 KV pool.
    const TOL_SPLIT_MODE: f64 = 1e-3;
    /// Split-bf16 mode with an f16 KV pool: the split activations differ from the CPU's f32 at
    /// ~2^-16, so now and then a cached value rounds to the neighbouring f16 (one step, 2^-11
    /// relative; the exports differ by one such step): the H200 run of 2026-12-01 measured
    /// 1.07e-3. A bf16 pool in its place (8× coarser) would fail it.
    const TOL_SPLIT_F16_KV: f64 = 3e-3;

    fn argmax(v: &[f32]) -> u32 {
        let mut best = 0;
        for (i, x) in v.iter().enumerate() {
            if *x > v[best] {
                best = i;
            }
        }
        best as u32
    }

    /// max |Δ| / std(cpu) over all rows of all sequences.
    fn compare(cpu: &[Vec<Vec<f32>>], gpu: &[Vec<Vec<f32>>]) -> (f64, f64, bool) {
        let (mut max, mut n, mut s, mut s2) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
        let mut same_shape = cpu.len() == gpu.len();
        for (a, b) in cpu.iter().zip(gpu) {
            same_shape &= a.len() == b.len();
            for (ra, rb) in a.iter().zip(b) {
                same_shape &= ra.len() == rb.len();
                for (x, y) in ra.iter().zip(rb) {
                    max = max.max((*x as f64 - *y as f64).abs());
                    n += 1.0;
                    s += *x as f64;
                    s2 += (*x as f64) * (*x as f64);
                }
            }
        }
        let std = (s2 / n.max(1.0) - (s / n.max(1.0)).powi(2)).max(0.0).sqrt();
        (max, std, same_shape)
    }

    pub fn run() -> Result<bool, EngineError> {
        let json = serde_json::to_vec(&qwen3_config_json(&TINY, "float32")).unwrap_or_default();
        let cfg = ModelConfig::parse(&json, std::path::Path::new("tiny"))?;
        let w = Qwen3Weights::from_source(&cfg, |name, shape| {
            let (mean, std) = random_init(name, shape);
            let n = shape.iter().product();
            Ok(Matrix::F32(random_tensor(TINY_SEED, name, n, mean, std)))
        })?;
        let w = Arc::new(w);
        let mut all_pass = true;
        let mut runs: Vec<Value> = Vec::new();
        for (mode, kv) in [
            (ComputeMode::F32, KvDtype::F32),
            (ComputeMode::F32, KvDtype::Bf16),
            (ComputeMode::Bf16, KvDtype::Bf16),
            (ComputeMode::Bf16Split, KvDtype::F32),
            // bf16 weights beside an f16 cache (the kernels' h16_t pool).
            (ComputeMode::Bf16Split, KvDtype::F16),
            (ComputeMode::F16, KvDtype::F16),
        ] {
            // bf16 mode rounds the weights to bf16 on upload; the CPU reference gets the same
            // rounded weights, so the comparison measures the bf16 activations alone.
            let w_run = match mode {
                ComputeMode::F32 => w.clone(),
                ComputeMode::Bf16 | ComputeMode::Bf16Split | ComputeMode::F16 => {
                    Arc::new(Qwen3Weights::from_source(&cfg, |name, shape| {
                        let (mean, std) = random_init(name, shape);
                        let n = shape.iter().product();
                        let v = random_tensor(TINY_SEED, name, n, mean, std);
                        Ok(Matrix::Bf16(
                            v.iter()
                                .map(|x| half::bf16::from_f32(*x).to_bits())
                                .collect(),
                        ))
                    })?)
                }
            };
            let mut cpu =
                CpuBackend::from_parts(cfg.clone(), w_run.clone(), "tiny".into(), kv, BS, BLOCKS)?;
            let dev = CudaDevice::with_float16(0, mode.float16())?;
            let opts = CudaOptions {
                ordinal: 0,
                mode,
                kv_dtype: kv,
                block_size: BS,
                pool: PoolSize::Blocks(BLOCKS),
                max_step_tokens: 64,
                // The single-sequence greedy steps are captured and replayed from their
                // second occurrence on, so the check covers graph replays too.
                graph_max_batch: 8,
            };
            let mut gpu = CudaBackend::from_parts(dev, cfg.clone(), &w_run, "tiny".into(), &opts)?;
            let tol = match (mode, kv) {
                (ComputeMode::Bf16, _) => TOL_BF16_MODE,
                (ComputeMode::Bf16Split, KvDtype::F16) => TOL_SPLIT_F16_KV,
                (ComputeMode::Bf16Split, _) => TOL_SPLIT_MODE,
                (ComputeMode::F16, _) => TOL_F16_MODE,
                (_, KvDtype::F32) => TOL,
                (_, KvDtype::Bf16 | KvDtype::F16 | KvDtype::Fp8) => TOL_BF16_KV,
            };
            let mut steps: Vec<Value> = Vec::new();
            let mut worst = 0.0f64;
            let mut pass = true;
            // Sequences: A prefill 20 (blocks 0,1), B prefill 37 (blocks 5,3,9), C chunked 0..16
            // then 16..30 (blocks 12, 7).
            let ta: Vec<u32> = (0..20).map(|i| (i * 7919 + 11) % 151_936).collect();
            let tb: Vec<u32> = (0..37).map(|i| (i * 104_729 + 5) % 151_936).collect();
            let tc: Vec<u32> = (0..30).map(|i| (i * 31_337 + 3) % 151_936).collect();
            let (tab_a, tab_b, tab_c): (Vec<u32>, Vec<u32>, Vec<u32>) =
                (vec![0, 1, 20, 21], vec![5, 3, 9], vec![12, 7, 22, 23]);
            let s = |tokens: &'static [u32], start: usize, table: &'static [u32], l| SeqInput {
                tokens,
                start_pos: start,
                block_table: table,
                logits: l,
                media: Default::default(),
            };
            // Leak the small inputs so the SeqInputs can be 'static (a one-shot program).
            let ta: &'static [u32] = Box::leak(ta.into_boxed_slice());
            let tb: &'static [u32] = Box::leak(tb.into_boxed_slice());
            let tc: &'static [u32] = Box::leak(tc.into_boxed_slice());
            let tab_a: &'static [u32] = Box::leak(tab_a.into_boxed_slice());
            let tab_b: &'static [u32] = Box::leak(tab_b.into_boxed_slice());
            let tab_c: &'static [u32] = Box::leak(tab_c.into_boxed_slice());
            let mut scripted: Vec<(&str, Vec<SeqInput<'static>>)> = vec![
                (
                    "prefill A(20, all) + B(37, last) + C chunk 0..16 (none)",
                    vec![
                        s(ta, 0, tab_a, LogitsMode::All),
                        s(tb, 0, tab_b, LogitsMode::Last),
                        s(&tc[..16], 0, tab_c, LogitsMode::None),
                    ],
                ),
                (
                    "C chunk 16..30 over cached prefix (all) + decode A",
                    vec![
                        s(&tc[16..], 16, tab_c, LogitsMode::All),
                        s(&ta[3..4], 20, tab_a, LogitsMode::Last),
                    ],
                ),
            ];
            let mut last_a = 0u32;
            for (name, batch) in scripted.drain(..) {
                let a = cpu.forward(&batch)?;
                let b = gpu.forward(&batch)?;
                let (max, std, shape) = compare(&a.logits, &b.logits);
                let rel = max / std.max(1e-30);
                worst = worst.max(rel);
                pass &= shape && rel <= tol;
                steps.push(json!({"step": name, "max_abs_diff": max, "cpu_logit_std": std, "rel": rel, "same_shape": shape}));
                if let Some(row) = a.logits.last().and_then(|r| r.last()) {
                    last_a = argmax(row);
                }
            }
            // Greedy decode of A from position 21, each backend feeding its own argmax.
            let (mut tok_cpu, mut tok_gpu) = (last_a, last_a);
            let mut agree = 0;
            let mut first_diff: Option<usize> = None;
            let mut greedy_max_rel = 0.0f64;
            let mut device_argmax_mismatches = 0;
            let mut device_sample_mismatches = 0;
            for step in 0..24 {
                let pos = 21 + step;
                let in_c = [tok_cpu];
                let in_g = [tok_gpu];
                let a = cpu.forward(&[SeqInput {
                    tokens: &in_c,
                    start_pos: pos,
                    block_table: tab_a,
                    logits: LogitsMode::Last,
                    media: Default::default(),
                }])?;
                let step_g = [SeqInput {
                    tokens: &in_g,
                    start_pos: pos,
                    block_table: tab_a,
                    logits: LogitsMode::Last,
                    media: Default::default(),
                }];
                // Device argmax first (it rewrites this position's K/V with the same values).
                let dev_tok = gpu.forward_greedy(&step_g)?;
                let b = gpu.forward(&step_g)?;
                if dev_tok.first().and_then(|r| r.first()) != Some(&argmax(&b.logits[0][0])) {
                    device_argmax_mismatches += 1;
                }
                // Sampling on the device (penalties, temperature, top-k/top-p/min-p) against the
                // CPU rule on this step's logits, with the same uniform.
                let plan = SamplePlan {
                    greedy: false,
                    temperature: 0.8,
                    top_k: if step % 2 == 0 { 40 } else { 0 },
                    top_p: 0.9,
                    min_p: if step % 3 == 0 { 0.05 } else { 0.0 },
                    repetition_penalty: 1.2,
                    frequency_penalty: 0.4,
                    presence_penalty: 0.2,
                    seen: vec![1, 5, tok_gpu],
                    counts: vec![(tok_gpu, 2)],
                    logit_bias: vec![(tok_gpu, 0.5), (7, -2.0)],
                    masked: vec![0],
                    // Every other step, a grammar allowing every fourth token (and the
                    // chosen one), so the device's bitmask is checked on real logits.
                    allowed: (step % 2 == 1).then(|| {
                        let mut w = vec![0x1111_1111u32; b.logits[0][0].len().div_ceil(32)];
                        w[tok_gpu as usize / 32] |= 1 << (tok_gpu % 32);
                        w
                    }),
                    uniform: ((step as f64 + 0.5) * 0.618_033_988_75).fract(),
                    // Every third step, the token's logprob and five alternatives.
                    logprobs: (step % 3 == 0).then_some(5),
                };
                // Steps 1, 5, 9, ... hand the mask over while the forward pass runs
                // (`forward_sampled_with_masks`, the sampler launched after it); the other
                // masked steps carry it in the plan.
                let sampled = if step % 4 == 1 {
                    let without = SamplePlan {
                        allowed: None,
                        ..plan.clone()
                    };
                    let mask = plan.allowed.clone();
                    gpu.forward_sampled_with_masks(&step_g, &[Some(&without)], &mut || {
                        vec![mask.clone()]
                    })?
                } else {
                    gpu.forward_sampled(&step_g, &[Some(&plan)])?
                };
                let got = sampled.first().cloned().flatten();
                let (want_token, want_lp) = plan.sample_row_with_logprobs(&b.logits[0][0]);
                if got.as_ref().map(|s| s.token) != Some(want_token)
                    || !logprobs_close(got.and_then(|s| s.logprob).as_ref(), want_lp.as_ref())
                {
                    device_sample_mismatches += 1;
                }
                if tok_cpu == tok_gpu && first_diff.is_none() {
                    let (max, std, _) = compare(&a.logits, &b.logits);
                    greedy_max_rel = greedy_max_rel.max(max / std.max(1e-30));
                }
                tok_cpu = argmax(&a.logits[0][0]);
                tok_gpu = argmax(&b.logits[0][0]);
                if tok_cpu == tok_gpu {
                    agree += 1;
                } else if first_diff.is_none() {
                    first_diff = Some(step);
                }
            }
            worst = worst.max(greedy_max_rel);
            let greedy_required = !matches!(mode, ComputeMode::Bf16 | ComputeMode::F16);
            pass &= (first_diff.is_none() || !greedy_required)
                && greedy_max_rel <= tol
                && device_argmax_mismatches == 0
                && device_sample_mismatches == 0;
            let gs = gpu.graph_stats();
            // The KV blocks both backends wrote, in layout byte order.
            let blocks: Vec<u32> = [tab_a, tab_b, &tab_c[..2]].concat();
            let (ea, eb) = (cpu.export_blocks(&blocks)?, gpu.export_blocks(&blocks)?);
            let vals = |bytes: &[u8]| -> Vec<f32> {
                match kv {
                    KvDtype::F32 => bytes
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                    KvDtype::Bf16 => bytes
                        .chunks_exact(2)
                        .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
                        .collect(),
                    KvDtype::F16 => bytes
                        .chunks_exact(2)
                        .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                        .collect(),
                    // Codes and scales' bytes (the tiny model takes no fp8 cache: below).
                    KvDtype::Fp8 => bytes.iter().map(|b| *b as f32).collect(),
                }
            };
            let (va, vb) = (vals(&ea), vals(&eb));
            let kv_max = va
                .iter()
                .zip(&vb)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0f32, f32::max);
            // Import round trip: CPU blocks into the GPU pool, exported back unchanged.
            gpu.import_blocks(&blocks, &ea)?;
            let round_trip = gpu.export_blocks(&blocks)? == ea;
            pass &= round_trip && ea.len() == eb.len();
            all_pass &= pass;
            runs.push(json!({
                "mode": format!("{mode:?}"),
                "kv_dtype": kv.to_string(),
                "device_argmax_mismatches": device_argmax_mismatches,
                "device_sample_mismatches": device_sample_mismatches,
                "graphs": {"captured": gs.captured, "refused": gs.refused, "replays": gs.replays,
                           "last_refusal": gs.last_refusal,
                           "programmatic_edges": gs.programmatic_edges},
                "tol_max_abs_diff_over_std": tol,
                "steps": steps,
                "greedy": {"steps": 24, "agree": agree, "first_difference": first_diff, "max_rel": greedy_max_rel},
                "worst_max_abs_diff_over_std": worst,
                "kv_export_bytes": ea.len(), "kv_export_max_abs_diff": kv_max,
                "import_export_round_trip_identical": round_trip,
                "pass": pass,
            }));
        }
        // An fp8 cache is read by the tensor-core kernels alone (head_dim 64 or 128): the tiny
        // model's 16 is a configuration error naming it (cuda_kernels_check and the model
        // stage cover the fp8 cache itself).
        let fp8_refusal = {
            let dev = CudaDevice::with_float16(0, ComputeMode::Bf16Split.float16())?;
            let opts = CudaOptions {
                ordinal: 0,
                mode: ComputeMode::Bf16Split,
                kv_dtype: KvDtype::Fp8,
                block_size: BS,
                pool: PoolSize::Blocks(BLOCKS),
                max_step_tokens: 64,
                graph_max_batch: 8,
            };
            match CudaBackend::from_parts(dev, cfg.clone(), &w, "tiny".into(), &opts) {
                Err(EngineError::Config(m)) if m.contains("head_dim") => Ok(m),
                Err(e) => Err(e.to_string()),
                Ok(_) => Err("accepted".to_string()),
            }
        };
        all_pass &= fp8_refusal.is_ok();
        let report = json!({"model": "tiny (Qwen3, 2 layers, hidden 64, vocab 151936, f32 weights)", "runs": runs,
                            "fp8_cache_refused_for_head_dim_16": format!("{fp8_refusal:?}"), "all_pass": all_pass});
        println!(
            "{}",
            serde_json::to_string_pretty(&report).unwrap_or_default()
        );
        Ok(all_pass)
    }

    /// Device logprobs against the CPU rule's: the same presence, token and alternatives, each
    /// logprob within 1e-3 (sums in another order; ids may swap only between equal values).
    fn logprobs_close(
        got: Option<&tandem_engine::sampler::TokenLogprob>,
        want: Option<&tandem_engine::sampler::TokenLogprob>,
    ) -> bool {
        let close = |a: f32, b: f32| (a - b).abs() <= 1e-3 || (a == b);
        match (got, want) {
            (None, None) => true,
            (Some(g), Some(w)) => {
                g.token == w.token
                    && close(g.logprob, w.logprob)
                    && g.top.len() == w.top.len()
                    && g.top
                        .iter()
                        .zip(&w.top)
                        .all(|(a, b)| close(a.1, b.1) && (a.0 == b.0 || close(a.1, b.1)))
            }
            _ => false,
        }
    }
}
