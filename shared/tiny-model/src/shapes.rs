//! The tensors (Hugging Face names and shapes) of a tiny model, read from the `config.json`
//! this crate wrote. The engine's loader derives the same list from its parsed `ModelConfig`
//! (`tandem_engine::tiny::tensor_shapes`); its tests check the two agree for every tiny
//! model.

use serde::Deserialize;

use crate::TinyModelError;

/// What the tensor shapes depend on in a `config.json`.
#[derive(Deserialize)]
struct ShapeConfig {
    model_type: String,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: bool,
}

/// Which optional tensors a family's layers carry.
struct LayerExtras {
    qk_norm: bool,
    qkv_bias: bool,
    o_bias: bool,
}

impl ShapeConfig {
    /// As the families define them: Qwen3 has q/k norms, Qwen2 q/k/v biases always, Llama
    /// and Qwen3 q/k/v/o biases when `attention_bias`, Mistral none.
    fn extras(&self) -> Result<LayerExtras, TinyModelError> {
        let bias = self.attention_bias;
        let (qk_norm, qkv_bias, o_bias) = match self.model_type.as_str() {
            "qwen3" => (true, bias, bias),
            "llama" => (false, bias, bias),
            "qwen2" => (false, true, false),
            "mistral" => (false, false, false),
            other => {
                return Err(TinyModelError::Config(format!(
                    "model_type {other:?} is not a tiny model family"
                )))
            }
        };
        Ok(LayerExtras {
            qk_norm,
            qkv_bias,
            o_bias,
        })
    }
}

/// The tensor names and shapes of the decoder model of this `config.json`.
pub fn tensor_shapes(
    config: &serde_json::Value,
) -> Result<Vec<(String, Vec<usize>)>, TinyModelError> {
    let c = ShapeConfig::deserialize(config).map_err(|e| TinyModelError::Config(e.to_string()))?;
    if c.num_attention_heads == 0 {
        return Err(TinyModelError::Config("num_attention_heads is 0".into()));
    }
    let extras = c.extras()?;
    let h = c.hidden_size;
    let hd = c.head_dim.unwrap_or(h / c.num_attention_heads);
    let kv_heads = c.num_key_value_heads.unwrap_or(c.num_attention_heads);
    let (qd, kvd, im) = (
        c.num_attention_heads * hd,
        kv_heads * hd,
        c.intermediate_size,
    );
    let mut v = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![c.vocab_size, h],
    )];
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}.");
        let mut push = |name: &str, shape: Vec<usize>| v.push((format!("{p}{name}"), shape));
        push("input_layernorm.weight", vec![h]);
        for (proj, rows) in [("q", qd), ("k", kvd), ("v", kvd)] {
            push(&format!("self_attn.{proj}_proj.weight"), vec![rows, h]);
            if extras.qkv_bias {
                push(&format!("self_attn.{proj}_proj.bias"), vec![rows]);
            }
        }
        push("self_attn.o_proj.weight", vec![h, qd]);
        if extras.o_bias {
            push("self_attn.o_proj.bias", vec![h]);
        }
        if extras.qk_norm {
            push("self_attn.q_norm.weight", vec![hd]);
            push("self_attn.k_norm.weight", vec![hd]);
        }
        push("post_attention_layernorm.weight", vec![h]);
        push("mlp.gate_proj.weight", vec![im, h]);
        push("mlp.up_proj.weight", vec![im, h]);
        push("mlp.down_proj.weight", vec![h, im]);
    }
    v.push(("model.norm.weight".to_string(), vec![h]));
    if !c.tie_word_embeddings {
        v.push(("lm_head.weight".to_string(), vec![c.vocab_size, h]));
    }
    Ok(v)
}
