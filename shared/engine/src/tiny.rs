//! The built-in tiny models ([`tandem_tiny_model`], re-exported here), and the tensor list the
//! engine's loader expects of a decoder model ([`tensor_shapes`]), which the tiny models'
//! writer must match.

use crate::model::config::ModelConfig;

pub use tandem_tiny_model::*;

/// The tensor names and shapes (Hugging Face names) of a decoder model with this config:
/// biases and q/k norms as its family has them.
pub fn tensor_shapes(c: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    tandem_tiny_model::shapes::DecoderShape {
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        intermediate_size: c.intermediate_size,
        num_hidden_layers: c.num_hidden_layers,
        num_attention_heads: c.num_attention_heads,
        num_key_value_heads: c.num_key_value_heads,
        head_dim: c.head_dim,
        tie_word_embeddings: c.tie_word_embeddings,
        qk_norm: c.qk_norm,
        qkv_bias: c.qkv_bias,
        o_bias: c.o_bias,
    }
    .tensor_shapes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::Family as EngineFamily;

    /// Every tiny model's config, as the writer produces it.
    fn tiny_configs() -> Vec<(String, serde_json::Value)> {
        let mut v = vec![
            ("tiny".to_string(), qwen3_config_json(&TINY, "float32")),
            (
                "shape-check".to_string(),
                qwen3_config_json(&SHAPE_CHECK, "bfloat16"),
            ),
        ];
        for name in FAMILY_MODELS {
            let (_, cfg, _) = family_model_spec(name).expect("a tiny model");
            v.push((name.to_string(), cfg));
        }
        v
    }

    #[test]
    fn the_writer_writes_the_tensors_the_loader_expects() {
        for (name, cfg) in tiny_configs() {
            let bytes = serde_json::to_vec(&cfg).unwrap();
            let parsed = ModelConfig::parse(&bytes, std::path::Path::new(&name)).unwrap();
            let written = tandem_tiny_model::shapes::tensor_shapes(&cfg).unwrap();
            assert_eq!(written, tensor_shapes(&parsed), "{name}");
        }
    }

    #[test]
    fn the_families_name_the_engine_s_families() {
        assert_eq!(Family::ALL.len(), EngineFamily::ALL.len());
        for (tiny, engine) in Family::ALL.into_iter().zip(EngineFamily::ALL) {
            assert_eq!(tiny.architecture(), engine.architecture());
            assert_eq!(tiny.model_type(), engine.model_type());
        }
    }
}
