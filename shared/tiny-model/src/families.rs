//! The tiny random model of each family beside Qwen3 (Qwen2, Llama 3, Mistral), written with
//! the same PRNG and initialisation as the tiny Qwen3.

use std::path::{Path, PathBuf};

use tandem_config::paths::cache_dir;

use crate::tokenizer::{copy_tokenizer_files, ensure_tokenizer_files};
use crate::{
    build_once, ensure_tiny_model, qwen3_config_json, write_random_model, write_tiny_model,
    TinyDims, TinyModelError, WeightDtype, TINY,
};

/// The decoder families with a tiny model. The engine's `Family` names the same four; this
/// crate keeps its own so that it does not link the engine (the engine's tests check that
/// the architecture and model type strings agree).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    Qwen3,
    Qwen2,
    Llama,
    Mistral,
}

impl Family {
    /// Every family, in a fixed order.
    pub const ALL: [Family; 4] = [Family::Qwen3, Family::Qwen2, Family::Llama, Family::Mistral];

    /// The architecture name in `config.json`'s `architectures`.
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
        }
    }

    /// The `model_type` in `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Qwen3 => "qwen3",
            Family::Qwen2 => "qwen2",
            Family::Llama => "llama",
            Family::Mistral => "mistral",
        }
    }
}

/// Bump when a family model's generator output changes (the cache folder names carry it).
pub const FAMILY_MODEL_VERSION: u32 = 2;

/// The tiny random model of each family, checked against transformers like the tiny Qwen3
/// (`tests/family_goldens.rs`). Vocab 1,024 (prompts are id lists; the folder carries the
/// Qwen3 tokenizer only because the loader wants one); each family's model exercises what it
/// adds to the decoder:
/// - qwen2: q/k/v biases, no q/k norm, no `head_dim` key (hidden / heads), untied lm_head (as
///   Qwen2.5-7B; tied, greedy decoding repeated one token), an inactive sliding window
///   (`use_sliding_window: false`);
/// - llama3: `rope_scaling` of type llama3 with `original_max_position_embeddings` 64, so that
///   all three frequency bands (kept, interpolated, divided by 8) occur within short prompts;
///   4 query heads per KV head; untied lm_head;
/// - mistral: a sliding window of 8 positions (far shorter than the prompts), `head_dim` 32 ≠
///   hidden / heads (as Mistral Nemo); untied lm_head.
///
/// One more model, [`LLAMA_BIAS`], covers `attention_bias` (q/k/v and o_proj biases), plain
/// RoPE and a tied lm_head in the Llama family.
pub fn family_dims(family: Family) -> TinyDims {
    let base = TinyDims {
        hidden: 64,
        intermediate: 128,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        vocab: 1024,
        tied: false,
    };
    match family {
        Family::Qwen3 => TINY,
        Family::Qwen2 => base,
        Family::Llama => TinyDims {
            intermediate: 160,
            kv_heads: 1,
            ..base
        },
        Family::Mistral => TinyDims {
            head_dim: 32,
            ..base
        },
    }
}

/// Seed of a family model's weights.
pub fn family_seed(family: Family) -> u64 {
    0x7a4d_656d_2024_0100
        + match family {
            Family::Qwen3 => 0,
            Family::Qwen2 => 1,
            Family::Llama => 2,
            Family::Mistral => 3,
        }
}

/// The short name of a family (`tandem model tiny --family NAME`, cache folders, goldens).
pub fn family_name(family: Family) -> &'static str {
    match family {
        Family::Qwen3 => "qwen3",
        Family::Qwen2 => "qwen2",
        Family::Llama => "llama3",
        Family::Mistral => "mistral",
    }
}

/// The family of a short name ([`family_name`]).
pub fn family_by_name(name: &str) -> Option<Family> {
    Family::ALL.into_iter().find(|f| family_name(*f) == name)
}

/// `config.json` of a family's model with these dimensions, shaped like the family's real
/// configs on the Hub.
pub fn family_config_json(family: Family, d: &TinyDims, dtype: &str) -> serde_json::Value {
    if family == Family::Qwen3 {
        return qwen3_config_json(d, dtype);
    }
    let mut c = serde_json::json!({
        "architectures": [family.architecture()],
        "model_type": family.model_type(),
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "hidden_act": "silu",
        "hidden_size": d.hidden,
        "initializer_range": 0.02,
        "intermediate_size": d.intermediate,
        "num_attention_heads": d.heads,
        "num_hidden_layers": d.layers,
        "num_key_value_heads": d.kv_heads,
        "tie_word_embeddings": d.tied,
        "torch_dtype": dtype,
        "use_cache": true,
        "vocab_size": d.vocab
    });
    let extra = match family {
        Family::Qwen2 => serde_json::json!({
            "max_position_embeddings": 32768,
            "max_window_layers": d.layers,
            "rms_norm_eps": 1e-6,
            "rope_scaling": null,
            "rope_theta": 1000000.0,
            "sliding_window": 4096,
            "use_sliding_window": false
        }),
        Family::Llama => serde_json::json!({
            "attention_bias": false,
            "head_dim": d.head_dim,
            "max_position_embeddings": 131072,
            "mlp_bias": false,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-5,
            "rope_scaling": {
                "factor": 8.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 64,
                "rope_type": "llama3"
            },
            "rope_theta": 500000.0
        }),
        _ => serde_json::json!({
            "head_dim": d.head_dim,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000.0,
            "sliding_window": 8
        }),
    };
    if let (Some(c), Some(e)) = (c.as_object_mut(), extra.as_object()) {
        c.extend(e.clone());
    }
    c
}

/// The name of the Llama model with `attention_bias: true`, plain RoPE and a tied lm_head.
pub const LLAMA_BIAS: &str = "llama-bias";

/// The tiny models checked against transformers beside the tiny Qwen3, by name (the
/// folders of `examples/write_family_models.rs`, the entries of `family_logits.json`).
pub const FAMILY_MODELS: [&str; 4] = ["qwen2", "llama3", "mistral", LLAMA_BIAS];

/// The family, `config.json` and seed of a named tiny model ([`FAMILY_MODELS`]).
pub fn family_model_spec(name: &str) -> Option<(Family, serde_json::Value, u64)> {
    if name == LLAMA_BIAS {
        let dims = TinyDims {
            tied: true,
            ..family_dims(Family::Llama)
        };
        let mut cfg = family_config_json(Family::Llama, &dims, "float32");
        if let Some(c) = cfg.as_object_mut() {
            c.insert("attention_bias".into(), true.into());
            c.insert("rope_scaling".into(), serde_json::Value::Null);
            c.remove("head_dim");
        }
        return Some((Family::Llama, cfg, family_seed(Family::Llama) + 0x10));
    }
    let family = family_by_name(name).filter(|f| *f != Family::Qwen3)?;
    let cfg = family_config_json(family, &family_dims(family), "float32");
    Some((family, cfg, family_seed(family)))
}

/// Writes a named tiny model ([`FAMILY_MODELS`], f32) into `out_dir`, with the tokenizer files
/// when `with_tokenizer` (the engine's loader wants them; transformers needs only the weights).
pub fn write_named_model(
    name: &str,
    out_dir: &Path,
    with_tokenizer: bool,
) -> Result<(), TinyModelError> {
    let (_, cfg, seed) =
        family_model_spec(name).ok_or_else(|| TinyModelError::UnknownModel(name.to_string()))?;
    write_random_model(out_dir, &cfg, seed, WeightDtype::F32)?;
    if with_tokenizer {
        copy_tokenizer_files(&ensure_tokenizer_files()?, out_dir)?;
    }
    Ok(())
}

/// Writes a family's tiny model ([`family_dims`]) into `out_dir` (see [`write_named_model`]).
/// Qwen3's is the tiny model itself.
pub fn write_family_model(
    family: Family,
    out_dir: &Path,
    with_tokenizer: bool,
) -> Result<(), TinyModelError> {
    if family == Family::Qwen3 {
        return write_tiny_model(out_dir);
    }
    write_named_model(family_name(family), out_dir, with_tokenizer)
}

/// A named tiny model's folder in the cache (with tokenizer files), built if absent.
pub fn ensure_named_model(name: &str) -> Result<PathBuf, TinyModelError> {
    let dir = cache_dir().join(format!("tiny-{name}-v{FAMILY_MODEL_VERSION}"));
    build_once(&dir, |tmp| write_named_model(name, tmp, true))?;
    Ok(dir)
}

/// A family's tiny model folder in the cache (with tokenizer files), built if absent.
pub fn ensure_family_model(family: Family) -> Result<PathBuf, TinyModelError> {
    if family == Family::Qwen3 {
        return ensure_tiny_model();
    }
    ensure_named_model(family_name(family))
}
