//! The tiny random LLaVA (`tandem model tiny-vl`) on the CUDA backend in the default
//! precision (bf16x2 with an f16 KV cache), or in f32, against transformers' f32 goldens
//! (`shared/tiny-model/goldens/llava/`): the image features come from the CPU vision tower
//! (checked against the goldens to 2.2e-6 of their std by `tests/llava_goldens.rs`) and are
//! spliced into the prompt on the GPU. Per case: the logits of the last positions within 2e-2
//! (f32: 1e-4) of their std with cosine ≥ 0.999, every prompt position's argmax equal to the
//! reference's where its top-2 margin is at least 1% of the row's std, the 8 greedy tokens equal
//! to transformers' `generate` (reported per step), and the same prompt with another image's
//! features giving other logits (the splice is not a no-op). Prints a JSON report; exits 1 on a
//! failed check, 2 without a GPU.
//!
//! `cargo build --release -p tandem-engine --features cuda --example cuda_llava_check`, then
//! `cuda_llava_check [GOLDENS_DIR [bf16x2|f32]]` (default: `shared/tiny-model/goldens/llava` of
//! the checkout it was built from, bf16x2; f32 is f32 weights and KV, tolerance 1e-4). The tiny
//! LLaVA is written into Tandem's cache (`TANDEM_CACHE_DIR`), which must hold
//! `qwen3-tokenizer/` where there is no network.

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("cuda_llava_check needs the `cuda` feature: --features cuda");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
fn main() {
    match check::run() {
        Ok(pass) => std::process::exit(if pass { 0 } else { 1 }),
        Err(e) => {
            println!("{}", serde_json::json!({ "error": e }));
            std::process::exit(2);
        }
    }
}

#[cfg(feature = "cuda")]
#[path = "common/stats.rs"]
mod stats;

#[cfg(feature = "cuda")]
mod check {
    use std::path::{Path, PathBuf};
    use std::sync::Arc;

    use serde_json::{json, Value};

    use crate::stats::{cosine, std_of};
    use tandem_engine::backend::cuda::{ComputeMode, CudaBackend, CudaOptions, PoolSize};
    use tandem_engine::backend::{Backend, LogitsMode, SeqInput};
    use tandem_engine::engine::{Engine, EngineConfig, Request};
    use tandem_engine::kv::layout::KvDtype;
    use tandem_engine::model::{LoadOptions, LoadedModel};
    use tandem_engine::request::{MediaEmbedding, MediaSpan};
    use tandem_engine::sampler::SamplingParams;

    const MIN_COSINE: f64 = 0.999;
    const BLOCK: usize = 16;

    /// The precision asked for (second argument): `bf16x2` (the default, f16 KV) or `f32`
    /// (f32 weights and KV: isolates the splice from the weights' rounding), with its
    /// tolerance on max |Δ| / std.
    fn precision() -> Result<(ComputeMode, KvDtype, &'static str, f64), String> {
        match std::env::args().nth(2).as_deref() {
            None | Some("bf16x2") => Ok((ComputeMode::Bf16Split, KvDtype::F16, "bf16x2", 2e-2)),
            Some("f32") => Ok((ComputeMode::F32, KvDtype::F32, "f32", 1e-4)),
            Some(other) => Err(format!("precision {other:?}: expected bf16x2 or f32")),
        }
    }

    /// The goldens folder: the first argument, else the checkout this was built from.
    fn goldens() -> PathBuf {
        std::env::args_os()
            .nth(1)
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                Path::new(env!("CARGO_MANIFEST_DIR")).join("../tiny-model/goldens/llava")
            })
    }

    fn read_f32(v: &Value) -> Result<Vec<f32>, String> {
        let file = v["file"].as_str().ok_or("tensor without a file")?;
        let bytes = std::fs::read(goldens().join(file)).map_err(|e| format!("{file}: {e}"))?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    fn u32s(v: &Value) -> Vec<u32> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_u64().map(|x| x as u32))
                    .collect()
            })
            .unwrap_or_default()
    }

    fn argmax(row: &[f32]) -> u32 {
        let mut best = 0;
        for (i, v) in row.iter().enumerate() {
            if *v > row[best] {
                best = i;
            }
        }
        best as u32
    }

    /// The prompt's image spans with `features` as their rows.
    fn media(
        ids: &[u32],
        image_token: u32,
        features: &[f32],
        hidden: usize,
    ) -> Vec<MediaEmbedding> {
        let mut out = Vec::new();
        let (mut i, mut offset) = (0, 0);
        while i < ids.len() {
            if ids[i] != image_token {
                i += 1;
                continue;
            }
            let start = i;
            while i < ids.len() && ids[i] == image_token {
                i += 1;
            }
            let len = i - start;
            let data = features[offset..offset + len * hidden].to_vec();
            offset += len * hidden;
            out.push(MediaEmbedding {
                span: MediaSpan {
                    start,
                    len,
                    hash: 1 + out.len() as u64 + offset as u64,
                },
                data: Arc::new(data),
            });
        }
        out
    }

    fn backend(model: &LoadedModel, blocks: usize) -> Result<CudaBackend, String> {
        let (mode, kv_dtype, _, _) = precision()?;
        let opts = CudaOptions {
            ordinal: 0,
            mode,
            kv_dtype,
            block_size: BLOCK,
            pool: PoolSize::Blocks(blocks),
            max_step_tokens: 256,
            graph_max_batch: 8,
        };
        CudaBackend::new(model, &opts).map_err(|e| e.to_string())
    }

    /// Every prompt position's logits on the GPU.
    fn prompt_logits(
        be: &mut CudaBackend,
        ids: &[u32],
        media: &[MediaEmbedding],
    ) -> Result<Vec<Vec<f32>>, String> {
        let table: Vec<u32> = (0..ids.len().div_ceil(BLOCK) as u32).collect();
        let out = be
            .forward(&[SeqInput {
                tokens: ids,
                start_pos: 0,
                block_table: &table,
                logits: LogitsMode::All,
                media,
            }])
            .map_err(|e| e.to_string())?;
        Ok(out.logits.into_iter().next().unwrap_or_default())
    }

    pub fn run() -> Result<bool, String> {
        let (_, _, precision_name, tol) = precision()?;
        let text = std::fs::read_to_string(goldens().join("manifest.json"))
            .map_err(|e| format!("manifest: {e}"))?;
        let m: Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
        let dir = tandem_engine::tiny::ensure_tiny_vl_model().map_err(|e| e.to_string())?;
        let model = LoadedModel::load(&dir, &LoadOptions::default()).map_err(|e| e.to_string())?;
        let vision = model
            .vision
            .clone()
            .ok_or("the tiny LLaVA has no vision tower")?;
        let image_token = m["image_token_index"].as_u64().ok_or("image_token_index")? as u32;
        let (hidden, vocab) = (model.config.hidden_size, model.config.vocab_size);
        let cases = m["cases"].as_array().ok_or("cases")?;
        let mut be = backend(&model, 64)?;
        let mut report = Vec::new();
        let mut pass = true;
        let mut other_features: Option<Vec<f32>> = None;
        for case in cases {
            let name = case["case"].as_str().unwrap_or("?").to_owned();
            let ids = u32s(&case["input_ids"]);
            let features = vision
                .encode(&read_f32(&case["pixel_values"])?)
                .map_err(|e| e.to_string())?;
            let rows = prompt_logits(&mut be, &ids, &media(&ids, image_token, &features, hidden))?;
            let theirs = read_f32(&case["logits_last"])?;
            let positions = u32s(&case["logits_last_positions"]);
            let (mut worst, mut min_cos) = (0.0f64, 1.0f64);
            for (k, &p) in positions.iter().enumerate() {
                let want = &theirs[k * vocab..(k + 1) * vocab];
                let got = &rows[p as usize];
                let s = std_of(want);
                let d = got
                    .iter()
                    .zip(want)
                    .fold(0.0f64, |w, (a, b)| w.max((*a as f64 - *b as f64).abs() / s));
                worst = worst.max(d);
                min_cos = min_cos.min(cosine(got, want));
            }
            // Argmax per prompt position where the reference is decided.
            let argmaxes = u32s(&case["argmax"]);
            let margins: Vec<f64> = case["top2_margin"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_f64).collect())
                .unwrap_or_default();
            let mut argmax_misses = Vec::new();
            for (p, (&want, &margin)) in argmaxes.iter().zip(&margins).enumerate() {
                if margin >= 0.01 * std_of(&rows[p]) && argmax(&rows[p]) != want {
                    argmax_misses.push(p);
                }
            }
            let greedy = greedy_tokens(&model, &ids, media(&ids, image_token, &features, hidden))?;
            let want_greedy = u32s(&case["greedy_tokens"]);
            // The splice matters: another image's features change the logits.
            let spliced_differs = match &other_features {
                Some(f) if f.len() == features.len() => {
                    let other = prompt_logits(&mut be, &ids, &media(&ids, image_token, f, hidden))?;
                    let last = ids.len() - 1;
                    other[last] != rows[last]
                }
                _ => true,
            };
            other_features = Some(features);
            let ok = worst <= tol
                && min_cos >= MIN_COSINE
                && argmax_misses.is_empty()
                && greedy == want_greedy
                && spliced_differs;
            pass &= ok;
            report.push(json!({
                "case": name, "ok": ok, "max_delta_over_std": worst, "min_cosine": min_cos,
                "argmax_misses": argmax_misses, "greedy": greedy, "greedy_reference": want_greedy,
                "other_image_changes_logits": spliced_differs,
            }));
        }
        println!(
            "{}",
            json!({ "precision": precision_name, "tolerance": tol, "min_cosine": MIN_COSINE,
                    "pass": pass, "cases": report })
        );
        Ok(pass)
    }

    /// The engine's greedy tokens for the prompt on a fresh CUDA backend.
    fn greedy_tokens(
        model: &LoadedModel,
        ids: &[u32],
        media: Vec<MediaEmbedding>,
    ) -> Result<Vec<u32>, String> {
        let be = backend(model, 64)?;
        let cfg = EngineConfig {
            max_batch_size: 4,
            max_num_tokens: 256,
            max_seq_len: 256,
            num_blocks: 64,
            eos_token_ids: vec![],
            ..EngineConfig::default()
        };
        let h = Engine::start(Box::new(be), None, cfg).map_err(|e| e.to_string())?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        let req = Request {
            replayed: 0,
            request_id: "llava".into(),
            prompt: ids.to_vec(),
            params: SamplingParams {
                max_tokens: Some(8),
                ignore_eos: true,
                ..SamplingParams::greedy()
            },
            cache_salt: None,
            media,
        };
        let outs = rt.block_on(async {
            let stream = h.submit(req).await.map_err(|e| e.to_string())?;
            Ok::<_, String>(stream.collect().await)
        })?;
        h.shutdown();
        Ok(outs.iter().flat_map(|o| o.token_ids.clone()).collect())
    }
}
