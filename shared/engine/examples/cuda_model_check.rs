//! The correctness run against transformers on a real checkpoint: loads a model folder on the CUDA
//! backend (bf16 mode by default) and, for the cases `scripts/gpu/hf_reference.py` wrote
//! (`cases.json`: prompts and transformers' greedy continuations),
//! - teacher-forced: runs prompt + continuation and writes the logits rows that predict each
//!   continuation token to `OUT/tandem_logits.f32` (raw little-endian f32,
//!   `[prompts, steps, vocab]`, the layout of `hf_logits.f32`);
//! - free-running: greedy decoding on the device from each prompt, all prompts batched,
//!   written to `OUT/tandem_greedy.json` (`{"greedy": [[ids]...]}`).
//!
//! `scripts/gpu/compare_logits.py` then computes the figures. Usage:
//! `cuda_model_check --model DIR --cases cases.json --out-dir OUT [--mode bf16|bf16x2|f32]
//!  [--kv-dtype bf16|f16|f32]`

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("cuda_model_check needs the `cuda` feature: --features cuda");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
fn main() {
    if let Err(e) = run::run() {
        eprintln!("cuda_model_check: {e}");
        std::process::exit(1);
    }
}

#[cfg(feature = "cuda")]
mod run {
    use std::io::Write;
    use std::path::PathBuf;
    use std::time::Instant;

    use tandem_engine::backend::cuda::{ComputeMode, CudaBackend, CudaOptions, PoolSize};
    use tandem_engine::backend::{Backend, LogitsMode, SeqInput};
    use tandem_engine::kv::layout::KvDtype;
    use tandem_engine::model::{LoadOptions, LoadedModel};

    type Res<T> = Result<T, String>;

    const BLOCK: usize = 32;
    /// Prompts per teacher-forced step (bounds the logits rows brought back at once).
    const TF_GROUP: usize = 8;

    struct Args {
        model: PathBuf,
        cases: PathBuf,
        out: PathBuf,
        mode: ComputeMode,
        kv: KvDtype,
    }

    fn args() -> Res<Args> {
        let mut a = std::env::args().skip(1);
        let (mut model, mut cases, mut out, mut mode) = (None, None, None, ComputeMode::Bf16);
        let mut kv = None;
        while let Some(k) = a.next() {
            let mut v = || a.next().ok_or(format!("{k} needs a value"));
            match k.as_str() {
                "--model" => model = Some(PathBuf::from(v()?)),
                "--cases" => cases = Some(PathBuf::from(v()?)),
                "--out-dir" => out = Some(PathBuf::from(v()?)),
                "--mode" => {
                    mode = match v()?.as_str() {
                        "bf16" => ComputeMode::Bf16,
                        "f32" => ComputeMode::F32,
                        "bf16x2" => ComputeMode::Bf16Split,
                        "f16" => ComputeMode::F16,
                        other => {
                            return Err(format!(
                                "--mode must be bf16, bf16x2, f16 or f32, not {other}"
                            ))
                        }
                    }
                }
                "--kv-dtype" => {
                    kv = Some(
                        v()?.parse::<KvDtype>()
                            .map_err(|e| format!("--kv-dtype: {e}"))?,
                    )
                }
                other => return Err(format!("unknown argument {other}")),
            }
        }
        Ok(Args {
            model: model.ok_or("--model is required")?,
            cases: cases.ok_or("--cases is required")?,
            out: out.ok_or("--out-dir is required")?,
            mode,
            // The mode's own 16-bit pool unless asked otherwise.
            kv: kv.unwrap_or(mode.kv_dtype16()),
        })
    }

    fn ids(v: &serde_json::Value, key: &str) -> Res<Vec<Vec<u32>>> {
        let rows = v[key]
            .as_array()
            .ok_or(format!("cases.json: {key} is not a list"))?;
        rows.iter()
            .map(|r| {
                r.as_array()
                    .ok_or(format!("cases.json: {key} holds a non-list"))?
                    .iter()
                    .map(|x| {
                        x.as_u64()
                            .and_then(|x| u32::try_from(x).ok())
                            .ok_or(format!("cases.json: {key} holds a non-id {x}"))
                    })
                    .collect()
            })
            .collect()
    }

    pub fn run() -> Res<()> {
        let a = args()?;
        let text = std::fs::read(&a.cases).map_err(|e| format!("{}: {e}", a.cases.display()))?;
        let cases: serde_json::Value =
            serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", a.cases.display()))?;
        let prompts = ids(&cases, "prompts")?;
        let conts = ids(&cases, "continuations")?;
        let steps = cases["steps"].as_u64().ok_or("cases.json: steps missing")? as usize;
        if prompts.len() != conts.len() || conts.iter().any(|c| c.len() < steps) {
            return Err("cases.json: one continuation of `steps` tokens per prompt needed".into());
        }
        let t0 = Instant::now();
        let model =
            LoadedModel::load(&a.model, &LoadOptions::default()).map_err(|e| e.to_string())?;
        let load_s = t0.elapsed().as_secs_f64();
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0) + steps;
        let per_seq = longest.div_ceil(BLOCK);
        let opts = CudaOptions {
            ordinal: 0,
            mode: a.mode,
            kv_dtype: a.kv,
            block_size: BLOCK,
            pool: PoolSize::Blocks(per_seq * prompts.len()),
            max_step_tokens: TF_GROUP * longest,
            // The greedy decode of all prompts replays a captured graph.
            graph_max_batch: 128,
        };
        let mut gpu = CudaBackend::new(&model, &opts).map_err(|e| e.to_string())?;
        let vocab = gpu.vocab_size();
        let tables: Vec<Vec<u32>> = (0..prompts.len())
            .map(|i| ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect())
            .collect();
        std::fs::create_dir_all(&a.out).map_err(|e| format!("{}: {e}", a.out.display()))?;

        // Teacher-forced rows.
        let t1 = Instant::now();
        let path = a.out.join("tandem_logits.f32");
        let file = std::fs::File::create(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut w = std::io::BufWriter::with_capacity(1 << 24, file);
        let inputs: Vec<Vec<u32>> = prompts
            .iter()
            .zip(&conts)
            .map(|(p, c)| [p.as_slice(), &c[..steps]].concat())
            .collect();
        for group in (0..prompts.len()).collect::<Vec<_>>().chunks(TF_GROUP) {
            let batch: Vec<SeqInput<'_>> = group
                .iter()
                .map(|&i| SeqInput {
                    tokens: &inputs[i],
                    start_pos: 0,
                    block_table: &tables[i],
                    logits: LogitsMode::All,
                    media: Default::default(),
                })
                .collect();
            let out = gpu.forward(&batch).map_err(|e| e.to_string())?;
            for (&i, rows) in group.iter().zip(&out.logits) {
                let pl = prompts[i].len();
                for row in &rows[pl - 1..pl - 1 + steps] {
                    if row.len() != vocab {
                        return Err(format!(
                            "a logits row of {} values, vocab {vocab}",
                            row.len()
                        ));
                    }
                    for x in row {
                        w.write_all(&x.to_le_bytes()).map_err(|e| e.to_string())?;
                    }
                }
            }
            eprintln!(
                "teacher-forced: {}/{} prompts",
                group[group.len() - 1] + 1,
                prompts.len()
            );
        }
        w.flush().map_err(|e| e.to_string())?;
        let tf_s = t1.elapsed().as_secs_f64();

        // Free-running greedy, every prompt in one batch.
        let t2 = Instant::now();
        let batch: Vec<SeqInput<'_>> = prompts
            .iter()
            .zip(&tables)
            .map(|(p, t)| SeqInput {
                tokens: p,
                start_pos: 0,
                block_table: t,
                logits: LogitsMode::Last,
                media: Default::default(),
            })
            .collect();
        let first = gpu.forward_greedy(&batch).map_err(|e| e.to_string())?;
        let mut greedy: Vec<Vec<u32>> = first;
        for step in 1..steps {
            let last: Vec<[u32; 1]> = greedy.iter().map(|g| [g[g.len() - 1]]).collect();
            let batch: Vec<SeqInput<'_>> = (0..prompts.len())
                .map(|i| SeqInput {
                    tokens: &last[i],
                    start_pos: prompts[i].len() + step - 1,
                    block_table: &tables[i],
                    logits: LogitsMode::Last,
                    media: Default::default(),
                })
                .collect();
            let next = gpu.forward_greedy(&batch).map_err(|e| e.to_string())?;
            for (g, n) in greedy.iter_mut().zip(next) {
                g.extend(n);
            }
        }
        let greedy_s = t2.elapsed().as_secs_f64();
        let path = a.out.join("tandem_greedy.json");
        let body = serde_json::json!({ "greedy": greedy });
        std::fs::write(&path, body.to_string()).map_err(|e| format!("{}: {e}", path.display()))?;
        let report = serde_json::json!({
            "device": gpu.device().name(),
            "mode": format!("{:?}", a.mode),
            "kv_dtype": a.kv.to_string(),
            "prompts": prompts.len(),
            "steps": steps,
            "load_s": load_s,
            "teacher_forced_s": tf_s,
            "greedy_s": greedy_s,
        });
        println!("{report}");
        Ok(())
    }
}
