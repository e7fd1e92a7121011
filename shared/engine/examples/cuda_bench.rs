//! The CUDA backend's speed on a model folder (the figures of docs/benchmarks.md), each figure beside its
//! limit measured in the same run:
//! - HBM bandwidth: a device-to-device copy (bytes read + written over the time);
//! - 16-bit GEMM rate: cuBLAS GemmEx 8192³ (the mode's 16-bit inputs — bf16, or f16 in the f16
//!   mode — f32 accumulation and output; reported as `bf16_gemm_flops`, the name the reports
//!   have always used);
//! - decode: tokens/s at each batch size with `--context` tokens of context per sequence
//!   (greedy on the device, so a step's logits never leave the GPU), and the fraction of the
//!   bandwidth limit: (weights + KV bytes read per step) / bandwidth over the step time;
//!   kernel launches (ours + cuBLAS calls) per step;
//! - prefill: the time of one sequence of n tokens, and its fraction of the GEMM limit
//!   (the step's FLOPs, attention included, over the measured GEMM rate);
//! - mixed steps (`--mixed 64,512`): each decode batch's step with one new sequence's prefill
//!   chunk of that many tokens beside its rows (what a serving step that admits a prompt
//!   runs), against the decode step alone at the same context: what a chunk adds to the
//!   inter-token gap of every decoding sequence.
//!
//! `cuda_bench --model DIR [--batches 1,8,64,256] [--context 1024] [--prefill 512,2048,8192]
//!  [--steps 32] [--mode bf16|f16|bf16x2] [--kv-dtype bf16|f16|f32] [--graphs 256]
//!  [--profile 1] [--mixed 64,512]` prints one JSON object (the KV cache in the mode's own 16-bit type unless
//!  `--kv-dtype` says otherwise;
//!  `--graphs 0`: no CUDA graphs; `--profile 1`: one more step of each case run eagerly with
//!  an event per launch, its GPU time per kernel reported as `breakdown`).

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("cuda_bench needs the `cuda` feature: --features cuda");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
fn main() {
    if let Err(e) = bench::run() {
        eprintln!("cuda_bench: {e}");
        std::process::exit(1);
    }
}

#[cfg(feature = "cuda")]
mod bench {
    use std::path::PathBuf;
    use std::time::Instant;

    use serde_json::{json, Value};
    use tandem_engine::backend::cuda::{
        ComputeMode, CudaBackend, CudaDevice, CudaOptions, DeviceMatrix, PoolSize,
    };
    use tandem_engine::backend::{Backend, LogitsMode, SeqInput};
    use tandem_engine::model::config::ModelConfig;
    use tandem_engine::model::{LoadOptions, LoadedModel};

    type Res<T> = Result<T, String>;
    const BLOCK: usize = 32;
    const MAX_STEP_TOKENS: usize = 8192;

    fn list(v: &str) -> Res<Vec<usize>> {
        v.split(',')
            .map(|x| x.trim().parse().map_err(|_| format!("not a number: {x}")))
            .collect()
    }

    fn e(x: impl std::fmt::Display) -> String {
        x.to_string()
    }

    /// Device-to-device copy bandwidth (read + write bytes / s), best of 5 copies of 2 GiB.
    fn bandwidth(dev: &CudaDevice) -> Res<f64> {
        let n = 1usize << 29; // 2 GiB of f32
        let src = dev.zeros::<f32>(n).map_err(e)?;
        let mut dst = dev.zeros::<f32>(n).map_err(e)?;
        let mut best = f64::MAX;
        for _ in 0..5 {
            dev.synchronize().map_err(e)?;
            let t = Instant::now();
            dev.stream()
                .memcpy_dtod(&src, &mut dst)
                .map_err(|x| format!("{x:?}"))?;
            dev.synchronize().map_err(e)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(2.0 * (n * 4) as f64 / best)
    }

    /// 16-bit GEMM FLOP/s (GemmEx 8192³, the device's 16-bit type), best of 5.
    fn gemm_rate(dev: &CudaDevice) -> Res<f64> {
        let n = 8192;
        let x = dev.zeros::<u16>(n * n).map_err(e)?;
        let w = DeviceMatrix::Bf16(dev.zeros::<u16>(n * n).map_err(e)?);
        let mut out = dev.zeros::<f32>(n * n).map_err(e)?;
        dev.matmul_t(&x, n, n, &w, n, &mut out).map_err(e)?;
        let mut best = f64::MAX;
        for _ in 0..5 {
            dev.synchronize().map_err(e)?;
            let t = Instant::now();
            dev.matmul_t(&x, n, n, &w, n, &mut out).map_err(e)?;
            dev.synchronize().map_err(e)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(2.0 * (n as f64).powi(3) / best)
    }

    /// Bytes of bf16 weights a decode step reads (every matrix once; the tied embedding as
    /// the lm_head).
    fn weight_bytes(c: &ModelConfig) -> f64 {
        let (h, hd, im) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (qd, kvd) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        let layer = (qd + 2 * kvd) * h + h * qd + 2 * im * h + h * im;
        2.0 * (c.num_hidden_layers * layer + c.vocab_size * h) as f64
    }

    /// KV bytes per token of context (all layers, K and V, in `dtype`: 16-bit, or FP8
    /// codes and a 4-byte scale per head).
    fn kv_bytes_per_token(c: &ModelConfig, dtype: tandem_engine::kv::layout::KvDtype) -> f64 {
        let head = c.head_dim * dtype.bytes() + dtype.scale_bytes();
        (c.num_hidden_layers * 2 * c.num_key_value_heads * head) as f64
    }

    /// FLOPs of a prefill of n tokens: the GEMMs, causal attention, one lm_head row.
    fn prefill_flops(c: &ModelConfig, n: usize) -> f64 {
        let (h, hd, im) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (qd, kvd) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        let per_token = 2.0 * ((qd + 2 * kvd) * h + h * qd + 2 * im * h + h * im) as f64;
        let n = n as f64;
        let attn = 2.0 * 2.0 * (n * (n + 1.0) / 2.0) * qd as f64; // QKᵀ and PV, causal
        c.num_hidden_layers as f64 * (per_token * n + attn) + 2.0 * (h * c.vocab_size) as f64
    }

    /// GPU time per kernel of what `f` launches, as JSON rows (longest first).
    fn profiled(gpu: &mut CudaBackend, f: impl FnOnce(&mut CudaBackend) -> Res<()>) -> Res<Value> {
        gpu.device().start_profile();
        let ran = f(gpu);
        let times = gpu.device().finish_profile().map_err(e)?;
        ran?;
        Ok(times
            .iter()
            .map(|t| json!({"kernel": t.name, "launches": t.launches, "ms": t.ms}))
            .collect())
    }

    /// Median of 3 timed calls of `f` after one warm-up.
    fn median_time(mut f: impl FnMut() -> Res<()>) -> Res<f64> {
        f()?;
        let mut times = Vec::new();
        for _ in 0..3 {
            let t = Instant::now();
            f()?;
            times.push(t.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        Ok(times[1])
    }

    /// The decode step `decode` with a new sequence's prefill chunk of each of `chunks` tokens
    /// beside it (its KV in blocks from `first_block` on, rewritten by every repeat), against
    /// the decode step alone: the time each chunk adds to every decoding sequence's gap.
    /// With `profile`, each row carries its step's GPU time per kernel.
    fn mixed_steps(
        gpu: &mut CudaBackend,
        decode: &[SeqInput<'_>],
        chunks: &[usize],
        first_block: usize,
        token: &dyn Fn(usize) -> u32,
        profile: bool,
    ) -> Res<Vec<Value>> {
        let alone = median_time(|| gpu.forward_greedy(decode).map(|_| ()).map_err(e))?;
        let mut rows = Vec::new();
        for &n in chunks {
            let tokens: Vec<u32> = (0..n).map(|p| token(p * 13 + 3)).collect();
            let table: Vec<u32> =
                (first_block as u32..(first_block + n.div_ceil(BLOCK)) as u32).collect();
            let mut batch = decode.to_vec();
            batch.push(SeqInput {
                tokens: &tokens,
                start_pos: 0,
                block_table: &table,
                logits: LogitsMode::Last,
                media: Default::default(),
            });
            let with = median_time(|| gpu.forward_greedy(&batch).map(|_| ()).map_err(e))?;
            let breakdown = if profile {
                profiled(gpu, |g| g.forward_greedy(&batch).map(|_| ()).map_err(e))?
            } else {
                Value::Null
            };
            rows.push(json!({
                "breakdown": breakdown,
                "chunk_tokens": n, "step_ms": with * 1e3, "decode_alone_ms": alone * 1e3,
                "added_ms": (with - alone) * 1e3,
                "added_us_per_chunk_token": (with - alone) * 1e6 / n.max(1) as f64,
            }));
        }
        Ok(rows)
    }

    pub fn run() -> Res<()> {
        let mut model_dir = None;
        let mut mode = ComputeMode::Bf16;
        let mut kv_dtype: Option<tandem_engine::kv::layout::KvDtype> = None;
        // Decode steps of up to this many sequences run as CUDA graphs (0: eager).
        let mut graphs = 256usize;
        let mut profile = false;
        let (mut batches, mut context, mut prefills, mut steps) = (
            vec![1, 8, 64, 256],
            1024usize,
            vec![512, 2048, 8192],
            32usize,
        );
        let mut mixed: Vec<usize> = Vec::new();
        let mut a = std::env::args().skip(1);
        while let Some(k) = a.next() {
            let v = a.next().ok_or(format!("{k} needs a value"))?;
            match k.as_str() {
                "--model" => model_dir = Some(PathBuf::from(v)),
                "--batches" => batches = list(&v)?,
                "--context" => context = v.parse().map_err(|_| "--context: a number")?,
                "--prefill" => prefills = list(&v)?,
                "--mixed" => mixed = list(&v)?,
                "--steps" => steps = v.parse().map_err(|_| "--steps: a number")?,
                "--graphs" => graphs = v.parse().map_err(|_| "--graphs: a number")?,
                "--profile" => profile = v != "0",
                "--kv-dtype" => kv_dtype = Some(v.parse().map_err(|e| format!("--kv-dtype: {e}"))?),
                "--mode" => {
                    mode = match v.as_str() {
                        "bf16" => ComputeMode::Bf16,
                        "bf16x2" => ComputeMode::Bf16Split,
                        "f16" => ComputeMode::F16,
                        other => {
                            return Err(format!("--mode must be bf16, bf16x2 or f16, not {other}"))
                        }
                    }
                }
                other => return Err(format!("unknown argument {other}")),
            }
        }
        let model_dir = model_dir.ok_or("--model is required")?;
        let model = LoadedModel::load(&model_dir, &LoadOptions::default()).map_err(e)?;
        let cfg = model.config.clone();
        let max_b = batches.iter().copied().max().unwrap_or(1);
        let per_seq = (context + steps + 8).div_ceil(BLOCK);
        let longest_prefill = prefills.iter().copied().max().unwrap_or(0);
        let longest_mixed = mixed.iter().copied().max().unwrap_or(0);
        if longest_mixed + max_b > MAX_STEP_TOKENS {
            return Err(format!(
                "--mixed: a chunk of {longest_mixed} beside {max_b} decode rows exceeds a step's {MAX_STEP_TOKENS} tokens"
            ));
        }
        // The mixed steps' chunk writes its KV after the decode sequences' blocks.
        let blocks =
            (max_b * per_seq + longest_mixed.div_ceil(BLOCK)).max(longest_prefill.div_ceil(BLOCK));
        let opts = CudaOptions {
            ordinal: 0,
            mode,
            kv_dtype: kv_dtype.unwrap_or(mode.kv_dtype16()),
            block_size: BLOCK,
            pool: PoolSize::Blocks(blocks),
            max_step_tokens: MAX_STEP_TOKENS,
            graph_max_batch: graphs,
        };
        let mut gpu = CudaBackend::new(&model, &opts).map_err(e)?;
        let bw = bandwidth(gpu.device())?;
        let flops = gemm_rate(gpu.device())?;
        eprintln!(
            "bandwidth {:.0} GB/s, {} GEMM {:.0} TFLOP/s",
            bw / 1e9,
            gpu.device().float16().name(),
            flops / 1e12
        );
        let wbytes = weight_bytes(&cfg);
        let kvtok = kv_bytes_per_token(&cfg, opts.kv_dtype);
        let vocab = cfg.vocab_size as u64;
        let token = |i: usize| ((i as u64 * 2_654_435_761 + 17) % vocab.min(150_000)) as u32;

        let mut decode: Vec<Value> = Vec::new();
        for &b in &batches {
            let tables: Vec<Vec<u32>> = (0..b)
                .map(|i| ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect())
                .collect();
            let prompts: Vec<Vec<u32>> = (0..b)
                .map(|s| (0..context).map(|p| token(s * 7919 + p)).collect())
                .collect();
            // Prefill the context (untimed), as many sequences per step as fit.
            let per_step = (MAX_STEP_TOKENS / context).max(1);
            for chunk in (0..b).collect::<Vec<_>>().chunks(per_step) {
                let batch: Vec<SeqInput<'_>> = chunk
                    .iter()
                    .map(|&i| SeqInput {
                        tokens: &prompts[i],
                        start_pos: 0,
                        block_table: &tables[i],
                        logits: LogitsMode::None,
                        media: Default::default(),
                    })
                    .collect();
                gpu.forward(&batch).map_err(e)?;
            }
            let mut last: Vec<[u32; 1]> = (0..b).map(|i| [token(i)]).collect();
            let warmup = 3;
            let mut timed = 0.0;
            let launches0 = gpu.device().launch_count();
            let mut launches = 0;
            for s in 0..warmup + steps {
                let batch: Vec<SeqInput<'_>> = (0..b)
                    .map(|i| SeqInput {
                        tokens: &last[i],
                        start_pos: context + s,
                        block_table: &tables[i],
                        logits: LogitsMode::Last,
                        media: Default::default(),
                    })
                    .collect();
                let t = Instant::now();
                let next = gpu.forward_greedy(&batch).map_err(e)?;
                if s >= warmup {
                    timed += t.elapsed().as_secs_f64();
                }
                if s == 0 {
                    launches = gpu.device().launch_count() - launches0;
                }
                for (l, n) in last.iter_mut().zip(next) {
                    l[0] = n.first().copied().unwrap_or(0);
                }
            }
            let step_s = timed / steps as f64;
            let ctx_avg = context as f64 + warmup as f64 + steps as f64 / 2.0;
            let bytes = wbytes + b as f64 * ctx_avg * kvtok;
            let limit_s = bytes / bw;
            let batch: Vec<SeqInput<'_>> = (0..b)
                .map(|i| SeqInput {
                    tokens: &last[i],
                    start_pos: context + warmup + steps,
                    block_table: &tables[i],
                    logits: LogitsMode::Last,
                    media: Default::default(),
                })
                .collect();
            // The GPU's share of a step: the same step's graph replayed back to back (the
            // step_ms above adds the host's preparation, copies and read-back).
            gpu.forward_greedy(&batch).map_err(e)?;
            let gpu_step_s = gpu.graph_replay_seconds(&batch, steps).map_err(e)?;
            let breakdown = if profile {
                profiled(&mut gpu, |g| {
                    g.forward_greedy(&batch).map(|_| ()).map_err(e)
                })?
            } else {
                Value::Null
            };
            let mixed_rows =
                mixed_steps(&mut gpu, &batch, &mixed, max_b * per_seq, &token, profile)?;
            let gs = gpu.graph_stats();
            let row = json!({
                "graphs": {"captured": gs.captured, "refused": gs.refused, "replays": gs.replays,
                           "last_refusal": gs.last_refusal,
                           "programmatic_edges": gs.programmatic_edges},
                "batch": b, "context": context, "steps": steps,
                "tok_s": b as f64 / step_s, "step_ms": step_s * 1e3,
                "graph_replay_step_ms": gpu_step_s.map(|s| s * 1e3),
                "bytes_per_step": bytes, "limit_step_ms": limit_s * 1e3,
                "fraction_of_bandwidth_limit": limit_s / step_s,
                "launches_per_step": launches,
                "breakdown": breakdown,
                "mixed": mixed_rows,
            });
            eprintln!("decode {row}");
            decode.push(row);
        }

        let mut prefill: Vec<Value> = Vec::new();
        for &n in &prefills {
            let tokens: Vec<u32> = (0..n).map(|p| token(p * 31 + 5)).collect();
            let table: Vec<u32> = (0..n.div_ceil(BLOCK) as u32).collect();
            // Chunks of at most MAX_STEP_TOKENS, as the engine schedules them.
            let run_prefill = |gpu: &mut CudaBackend| -> Res<()> {
                let mut start = 0;
                while start < n {
                    let end = (start + MAX_STEP_TOKENS).min(n);
                    let batch = [SeqInput {
                        tokens: &tokens[start..end],
                        start_pos: start,
                        block_table: &table,
                        logits: if end == n {
                            LogitsMode::Last
                        } else {
                            LogitsMode::None
                        },
                        media: Default::default(),
                    }];
                    gpu.forward_greedy(&batch).map_err(e)?;
                    start = end;
                }
                Ok(())
            };
            let mut times = Vec::new();
            for _ in 0..4 {
                let t = Instant::now();
                run_prefill(&mut gpu)?;
                times.push(t.elapsed().as_secs_f64());
            }
            let breakdown = if profile {
                profiled(&mut gpu, run_prefill)?
            } else {
                Value::Null
            };
            times.remove(0); // warm-up
            times.sort_by(f64::total_cmp);
            let s = times[times.len() / 2];
            let f = prefill_flops(&cfg, n);
            let row = json!({
                "tokens": n, "ms": s * 1e3, "flops": f, "limit_ms": f / flops * 1e3,
                "fraction_of_gemm_limit": f / flops / s, "tok_s": n as f64 / s,
                "breakdown": breakdown,
            });
            eprintln!("prefill {row}");
            prefill.push(row);
        }
        let group = cfg.num_attention_heads / cfg.num_key_value_heads.max(1);
        let decode_blocks_per_sm: Vec<Option<u32>> = [1, 2]
            .iter()
            .map(|&stages| {
                gpu.device()
                    .decode_attention_blocks_per_sm(group, cfg.head_dim, stages)
                    .ok()
            })
            .collect();
        eprintln!("attention_decode blocks per SM (1, 2 stages): {decode_blocks_per_sm:?}");
        let report = json!({
            "device": gpu.device().name(),
            "attention_decode_blocks_per_sm_1_2_stages": decode_blocks_per_sm,
            "mode": format!("{mode:?}"),
            "graph_max_batch": graphs,
            "profiled": profile,
            "model": model_dir.display().to_string(),
            "weights_bytes_bf16": wbytes,
            "kv_bytes_per_token": kvtok,
            "hbm_bandwidth_bytes_s": bw,
            "bf16_gemm_flops": flops,
            "decode": decode,
            "prefill": prefill,
        });
        println!("{}", serde_json::to_string_pretty(&report).map_err(e)?);
        Ok(())
    }
}
