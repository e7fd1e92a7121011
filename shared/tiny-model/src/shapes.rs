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

impl ShapeConfig {
    /// As the families define them: Qwen3 has q/k norms, Qwen2 q/k/v biases always, Llama
    /// and Qwen3 q/k/v/o biases when `attention_bias`, Mistral none.
    fn extras(&self) -> Result<(bool, bool, bool), TinyModelError> {
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
        Ok((qk_norm, qkv_bias, o_bias))
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
    let (qk_norm, qkv_bias, o_bias) = c.extras()?;
    Ok(DecoderShape {
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        intermediate_size: c.intermediate_size,
        num_hidden_layers: c.num_hidden_layers,
        num_attention_heads: c.num_attention_heads,
        num_key_value_heads: c.num_key_value_heads.unwrap_or(c.num_attention_heads),
        head_dim: c.head_dim.unwrap_or(c.hidden_size / c.num_attention_heads),
        tie_word_embeddings: c.tie_word_embeddings,
        qk_norm,
        qkv_bias,
        o_bias,
    }
    .tensor_shapes())
}

/// What a decoder model's tensor list depends on: its sizes and which optional tensors its
/// layers carry. The engine fills it from its parsed `ModelConfig`, this crate from the
/// `config.json` it wrote, so both name the same tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecoderShape {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub tie_word_embeddings: bool,
    /// q/k RMS norms (Qwen3).
    pub qk_norm: bool,
    /// q/k/v projection biases.
    pub qkv_bias: bool,
    /// Output projection bias.
    pub o_bias: bool,
}

impl DecoderShape {
    /// Hugging Face tensor names and shapes, in the order they are written.
    pub fn tensor_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (h, hd, im) = (self.hidden_size, self.head_dim, self.intermediate_size);
        let (qd, kvd) = (self.num_attention_heads * hd, self.num_key_value_heads * hd);
        let mut v = vec![(
            "model.embed_tokens.weight".to_string(),
            vec![self.vocab_size, h],
        )];
        for l in 0..self.num_hidden_layers {
            let p = format!("model.layers.{l}.");
            let mut push = |name: &str, shape: Vec<usize>| v.push((format!("{p}{name}"), shape));
            push("input_layernorm.weight", vec![h]);
            for (proj, rows) in [("q", qd), ("k", kvd), ("v", kvd)] {
                push(&format!("self_attn.{proj}_proj.weight"), vec![rows, h]);
                if self.qkv_bias {
                    push(&format!("self_attn.{proj}_proj.bias"), vec![rows]);
                }
            }
            push("self_attn.o_proj.weight", vec![h, qd]);
            if self.o_bias {
                push("self_attn.o_proj.bias", vec![h]);
            }
            if self.qk_norm {
                push("self_attn.q_norm.weight", vec![hd]);
                push("self_attn.k_norm.weight", vec![hd]);
            }
            push("post_attention_layernorm.weight", vec![h]);
            push("mlp.gate_proj.weight", vec![im, h]);
            push("mlp.up_proj.weight", vec![im, h]);
            push("mlp.down_proj.weight", vec![h, im]);
        }
        v.push(("model.norm.weight".to_string(), vec![h]));
        if !self.tie_word_embeddings {
            v.push(("lm_head.weight".to_string(), vec![self.vocab_size, h]));
        }
        v
    }
}
