//! The built-in tiny models ([`tandem_tiny_model`], re-exported here), and the tensor list the
//! engine's loader expects of a decoder model ([`tensor_shapes`]), which the tiny models'
//! writer must match.

use crate::model::config::ModelConfig;

pub use tandem_tiny_model::*;

/// The tensor names and shapes (Hugging Face names) of a decoder model with this config:
/// biases and q/k norms as its family has them.
pub fn tensor_shapes(c: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (h, hd, im) = (c.hidden_size, c.head_dim, c.intermediate_size);
    let (qd, kvd) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
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
            if c.qkv_bias {
                push(&format!("self_attn.{proj}_proj.bias"), vec![rows]);
            }
        }
        push("self_attn.o_proj.weight", vec![h, qd]);
        if c.o_bias {
            push("self_attn.o_proj.bias", vec![h]);
        }
        if c.qk_norm {
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
    v
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
