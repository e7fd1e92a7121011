//! GGUF model files (llama.cpp's format) of the `llama` and `qwen2` architectures, loaded into
//! the same decoder as Hugging Face folders:
//! - the metadata (`{arch}.block_count`, `.embedding_length`, `.attention.head_count(_kv)`,
//!   `.rope.freq_base`, `.context_length`, rms eps, ...) becomes a Hugging Face `config.json`
//!   (kept as the config's raw bytes, so the model identity covers it) parsed by
//!   [`ModelConfig::parse`]; Llama 3.1+ RoPE scaling comes from the `rope_freqs.weight`
//!   factors ([`RopeScaling::Factors`]); other `rope.scaling.type`s than none are refused;
//! - tensors (`token_embd`, `blk.N.attn_q`, ..., `output_norm`, `output`) are dequantized at
//!   load to **f32** (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; see [`dequant`]): the
//!   dequantized values are exact in f32, and the CPU kernels read f32 directly; other types
//!   are refused with an error naming the tensor and its type;
//! - llama.cpp's converter permutes the rows of `attn_q`/`attn_k` (llama only) for its
//!   interleaved RoPE; they are permuted back so that the decoder's Hugging Face RoPE is right;
//! - the tokenizer and chat template come from the `tokenizer.*` metadata
//!   ([`crate::tokenizer::gguf`]).

pub mod dequant;
pub mod file;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::json;
use sha2::{Digest, Sha256};

use crate::backend::cpu_ops::Matrix;
use crate::error::EngineError;
use crate::model::config::{ModelConfig, RopeScaling};
use crate::model::decoder::DecoderWeights;
use crate::model::generation_config::GenerationConfig;
use crate::model::{weights, LoadOptions, LoadedModel};
use crate::tokenizer::gguf::{tokenizer_files, GgufTokenizerFiles};
use crate::tokenizer::{tokenizer_hash, ChatTemplate, Tokenizer};
pub use file::{GgufFile, Value};

/// Whether `path` names a GGUF file (a file whose name ends in `.gguf`).
pub fn is_gguf(path: &Path) -> bool {
    path.is_file()
        && path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

fn bad(f: &GgufFile, message: String) -> EngineError {
    EngineError::BadFile {
        path: f.path.clone(),
        message,
    }
}

/// The architecture (`general.architecture`), checked to be one this loader maps.
fn architecture(f: &GgufFile) -> Result<&str, EngineError> {
    let arch = f
        .get("general.architecture")
        .and_then(Value::as_str)
        .ok_or_else(|| bad(f, "metadata general.architecture is missing".into()))?;
    match arch {
        "llama" | "qwen2" => Ok(arch),
        other => Err(bad(
            f,
            format!(
                "general.architecture {other:?} is not supported for GGUF (supported: llama, \
                 qwen2)"
            ),
        )),
    }
}

/// The Hugging Face `config.json` equivalent of a GGUF's metadata.
pub fn config_json(f: &GgufFile) -> Result<serde_json::Value, EngineError> {
    let arch = architecture(f)?;
    let key = |k: &str| format!("{arch}.{k}");
    let uint = |k: &str| -> Result<u64, EngineError> {
        f.get(&key(k)).and_then(Value::as_u64).ok_or_else(|| {
            bad(
                f,
                format!("metadata {} is missing or not an integer", key(k)),
            )
        })
    };
    let float = |k: &str| f.get(&key(k)).and_then(Value::as_f64);
    let hidden = uint("embedding_length")?;
    let heads = uint("attention.head_count")?;
    let kv_heads = uint("attention.head_count_kv").unwrap_or(heads);
    let head_dim = uint("attention.key_length").unwrap_or(hidden / heads.max(1));
    let embd = f
        .tensor("token_embd.weight")
        .ok_or_else(|| bad(f, "tensor token_embd.weight is missing".into()))?;
    let vocab = embd.dims.get(1).copied().unwrap_or(0);
    if let Some(t) = f
        .get(&key("rope.scaling.type"))
        .and_then(Value::as_str)
        .filter(|t| *t != "none")
    {
        return Err(bad(
            f,
            format!(
                "{} {t:?} is not supported (only none)",
                key("rope.scaling.type")
            ),
        ));
    }
    let (architecture, model_type) = match arch {
        "qwen2" => ("Qwen2ForCausalLM", "qwen2"),
        _ => ("LlamaForCausalLM", "llama"),
    };
    let bias = f.tensor("blk.0.attn_q.bias").is_some();
    Ok(json!({
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": uint("feed_forward_length")?,
        "num_hidden_layers": uint("block_count")?,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float("attention.layer_norm_rms_epsilon").unwrap_or(1e-6),
        "rope_theta": float("rope.freq_base").unwrap_or(10_000.0),
        "max_position_embeddings": uint("context_length").unwrap_or(2048),
        "vocab_size": vocab,
        "tie_word_embeddings": f.tensor("output.weight").is_none(),
        "attention_bias": bias && arch == "llama",
        "hidden_act": "silu",
        "sliding_window": null,
        "use_sliding_window": false,
        "torch_dtype": "float32",
        "gguf_file_type": f.get("general.file_type").and_then(Value::as_u64),
    }))
}

/// Llama 3.1+ RoPE scaling as llama.cpp stores it: `rope_freqs.weight`, one divisor per
/// frequency (`head_dim / 2` of them).
fn rope_factors(f: &GgufFile, cfg: &ModelConfig) -> Result<Option<RopeScaling>, EngineError> {
    if f.tensor("rope_freqs.weight").is_none() {
        return Ok(None);
    }
    let v = f.tensor_f32("rope_freqs.weight", &[cfg.head_dim / 2])?;
    if v.iter().any(|x| !(x.is_finite() && *x > 0.0)) {
        return Err(EngineError::Tensor {
            path: f.path.clone(),
            tensor: "rope_freqs.weight".into(),
            message: "factors must be finite and > 0".into(),
        });
    }
    Ok(Some(RopeScaling::Factors(
        v.into_iter().map(f64::from).collect(),
    )))
}

/// The GGUF name of a Hugging Face tensor name.
fn gguf_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(n) = fixed {
        return Some(n.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, name) = rest.split_once('.')?;
    let (module, suffix) = name.rsplit_once('.')?;
    let g = match module {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}.{suffix}"))
}

/// Undoes llama.cpp's `permute` of q/k rows: within each head, GGUF row `2*i + half` is
/// Hugging Face row `half*(head_dim/2) + i`. `data` has `rows` rows of `cols` values.
fn unpermute(data: Vec<f32>, n_heads: usize, rows: usize, cols: usize) -> Vec<f32> {
    let hd = rows / n_heads;
    let half = hd / 2;
    let mut out = vec![0.0f32; data.len()];
    for h in 0..n_heads {
        for i in 0..half {
            for s in 0..2 {
                let src = (h * hd + 2 * i + s) * cols;
                let dst = (h * hd + s * half + i) * cols;
                out[dst..dst + cols].copy_from_slice(&data[src..src + cols]);
            }
        }
    }
    out
}

/// The decoder weights of a GGUF file, dequantized to f32.
pub fn decoder_weights(f: &GgufFile, cfg: &ModelConfig) -> Result<DecoderWeights, EngineError> {
    let permuted = architecture(f)? == "llama";
    DecoderWeights::from_source(cfg, |hf, shape| {
        let name = gguf_name(hf).ok_or_else(|| EngineError::Tensor {
            path: f.path.clone(),
            tensor: hf.to_string(),
            message: "has no GGUF counterpart".into(),
        })?;
        let mut v = f.tensor_f32(&name, shape)?;
        if permuted {
            let heads = if hf.contains("q_proj") {
                Some(cfg.num_attention_heads)
            } else if hf.contains("k_proj") {
                Some(cfg.num_key_value_heads)
            } else {
                None
            };
            if let Some(heads) = heads {
                let cols = if shape.len() == 2 { shape[1] } else { 1 };
                v = unpermute(v, heads, shape[0], cols);
            }
        }
        Ok(Matrix::F32(v))
    })
}

/// A cheap identity of the file: sha256 over its size, header and 16 samples of its data.
fn identity(f: &GgufFile) -> String {
    let bytes = f.bytes();
    let mut h = Sha256::new();
    h.update((bytes.len() as u64).to_le_bytes());
    h.update(&bytes[..f.data_start().min(bytes.len())]);
    let data = &bytes[f.data_start().min(bytes.len())..];
    const SAMPLES: usize = 16;
    const SAMPLE: usize = 4096;
    for k in 0..SAMPLES {
        let at = data.len().saturating_sub(SAMPLE) * k / (SAMPLES - 1);
        h.update(&data[at..(at + SAMPLE).min(data.len())]);
    }
    weights::hex(&h.finalize())
}

/// Loads a GGUF file as a [`LoadedModel`] (`path` is the file).
pub fn load(path: &Path, opts: &LoadOptions) -> Result<LoadedModel, EngineError> {
    tracing::info!(path = %path.display(), "loading GGUF model");
    let f = GgufFile::open(path)?;
    let cfg_json = config_json(&f)?;
    let raw = serde_json::to_vec_pretty(&cfg_json).unwrap_or_default();
    let mut config = ModelConfig::parse(&raw, &path.join("<metadata as config.json>"))?;
    config.rope_scaling = rope_factors(&f, &config)?.or(config.rope_scaling);
    let files = tokenizer_files(&f)?;
    let tokenizer = Tokenizer::from_bytes(&files.tokenizer_json, &path.display().to_string())?;
    let chat_template = chat_template(&files)?;
    let generation_config =
        GenerationConfig::parse(&files.generation_config_json, &path.join("<metadata>"))?;
    let weights = if opts.weights {
        decoder_weights(&f, &config)?
    } else {
        DecoderWeights {
            embed: Matrix::F32(vec![]),
            layers: vec![],
            norm: vec![],
            lm_head: None,
        }
    };
    let mut h = Sha256::new();
    h.update(&config.raw);
    h.update(identity(&f).as_bytes());
    let model_id = weights::hex(&h.finalize());
    let tokenizer_hash = tokenizer_hash(&tokenizer, chat_template.as_ref());
    tracing::info!(model_id = %model_id, "GGUF model loaded");
    Ok(LoadedModel {
        path: path.to_path_buf(),
        config,
        weights: Arc::new(weights),
        vision: None,
        tokenizer,
        chat_template,
        generation_config,
        model_id,
        tokenizer_hash,
        weights_loaded: opts.weights,
    })
}

fn chat_template(files: &GgufTokenizerFiles) -> Result<Option<ChatTemplate>, EngineError> {
    let cfg: serde_json::Value =
        serde_json::from_slice(&files.tokenizer_config_json).unwrap_or_default();
    let Some(src) = cfg.get("chat_template").and_then(|t| t.as_str()) else {
        return Ok(None);
    };
    let tok = |k: &str| cfg.get(k).and_then(|t| t.as_str()).map(String::from);
    Ok(Some(ChatTemplate::new(
        src.to_string(),
        tok("bos_token"),
        tok("eos_token"),
    )?))
}

/// Writes the files a router fetches (`tokenizer.json`, `tokenizer_config.json` with the
/// chat template, `generation_config.json`) derived from a GGUF file into a folder of the
/// cache named after the file's identity, and returns that folder. Loading that folder's
/// tokenizer gives the same tokenizer hash as [`load`].
pub fn write_model_files(path: &Path) -> Result<PathBuf, EngineError> {
    let f = GgufFile::open(path)?;
    let files = tokenizer_files(&f)?;
    let id = identity(&f);
    let dir = tandem_config::paths::cache_dir().join(format!("gguf-files-{}", &id[..16]));
    std::fs::create_dir_all(&dir).map_err(|e| EngineError::io(&dir, e))?;
    for (name, bytes) in [
        ("tokenizer.json", &files.tokenizer_json),
        ("tokenizer_config.json", &files.tokenizer_config_json),
        ("generation_config.json", &files.generation_config_json),
    ] {
        // Written to a temp name and renamed: several workers may share the cache.
        let p = dir.join(name);
        let tmp = dir.join(format!(".{name}.{}", std::process::id()));
        std::fs::write(&tmp, bytes).map_err(|e| EngineError::io(&tmp, e))?;
        std::fs::rename(&tmp, &p).map_err(|e| EngineError::io(&p, e))?;
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_names() {
        assert_eq!(
            gguf_name("model.layers.12.self_attn.q_proj.weight").as_deref(),
            Some("blk.12.attn_q.weight")
        );
        assert_eq!(
            gguf_name("model.layers.0.self_attn.k_proj.bias").as_deref(),
            Some("blk.0.attn_k.bias")
        );
        assert_eq!(
            gguf_name("model.layers.3.post_attention_layernorm.weight").as_deref(),
            Some("blk.3.ffn_norm.weight")
        );
        assert_eq!(
            gguf_name("lm_head.weight").as_deref(),
            Some("output.weight")
        );
        assert_eq!(gguf_name("model.layers.0.self_attn.q_norm.weight"), None);
    }

    #[test]
    fn rope_factors_reproduce_llama3_scaling() {
        // llama.cpp's converter (LlamaModel.generate_extra_tensors) turns Llama 3.1's
        // rope_scaling into per-frequency divisors; they must give transformers' frequencies.
        let (factor, lo, hi, old) = (8.0, 1.0, 4.0, 8192.0);
        let llama3 = RopeScaling::Llama3 {
            factor,
            low_freq_factor: lo,
            high_freq_factor: hi,
            original_max_position_embeddings: old,
        };
        let base = RopeScaling::inv_freq(None, 128, 500_000.0);
        let factors: Vec<f64> = base
            .iter()
            .map(|f| {
                let wavelen = 2.0 * std::f64::consts::PI / f;
                if wavelen < old / hi {
                    1.0
                } else if wavelen > old / lo {
                    factor
                } else {
                    let smooth = (old / wavelen - lo) / (hi - lo);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                }
            })
            .map(|x| x as f32 as f64) // stored as f32 in the GGUF
            .collect();
        let want = RopeScaling::inv_freq(Some(&llama3), 128, 500_000.0);
        let got = RopeScaling::inv_freq(Some(&RopeScaling::Factors(factors)), 128, 500_000.0);
        for (a, b) in got.iter().zip(&want) {
            assert!((a / b - 1.0).abs() < 1e-6, "{a} {b}");
        }
        assert!(want.iter().zip(&base).any(|(a, b)| a != b));
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // llama.cpp: w.reshape(n_head, 2, hd/2, cols).swapaxes(1, 2).reshape(...)
        let (heads, hd, cols) = (2, 4, 3);
        let hf: Vec<f32> = (0..heads * hd * cols).map(|x| x as f32).collect();
        let mut permuted = vec![0.0; hf.len()];
        for h in 0..heads {
            for half in 0..2 {
                for i in 0..hd / 2 {
                    let src = (h * hd + half * hd / 2 + i) * cols;
                    let dst = (h * hd + 2 * i + half) * cols;
                    permuted[dst..dst + cols].copy_from_slice(&hf[src..src + cols]);
                }
            }
        }
        assert_ne!(permuted, hf);
        assert_eq!(unpermute(permuted, heads, heads * hd, cols), hf);
    }
}
