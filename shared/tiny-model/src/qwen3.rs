//! The tiny Qwen3 model and the shape-check model: their dimensions, seeds and `config.json`.

/// Bump when the generator's output changes; the cache folder name carries it.
pub const TINY_MODEL_VERSION: u32 = 2;
/// Seed of the tiny model's weights.
pub const TINY_SEED: u64 = 0x7a4d_656d_2024_0001;

/// Dimensions of the tiny model (vocab as Qwen3's, so the real tokenizer fits).
pub struct TinyDims {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    /// lm_head tied to the embedding.
    pub tied: bool,
}

pub const TINY: TinyDims = TinyDims {
    hidden: 64,
    intermediate: 128,
    layers: 2,
    heads: 4,
    kv_heads: 2,
    head_dim: 16,
    vocab: 151_936,
    tied: true,
};

/// A one-layer model with Qwen3-0.6B's layer shapes (hidden 1024, 16/8 heads of 128,
/// intermediate 3072), an untied lm_head and bf16 weights; the vocab is cut to 4,096 so that
/// the checkpoint stays small. Checked against transformers like the tiny model, it covers
/// what the tiny one does not: real head and layer sizes, bf16 loading, a separate lm_head.
pub const SHAPE_CHECK: TinyDims = TinyDims {
    hidden: 1024,
    intermediate: 3072,
    layers: 1,
    heads: 16,
    kv_heads: 8,
    head_dim: 128,
    vocab: 4096,
    tied: false,
};
/// Seed of the shape-check model's weights.
pub const SHAPE_CHECK_SEED: u64 = 0x7a4d_656d_2024_0002;
/// Bump when the shape-check model's generator output changes.
pub const SHAPE_CHECK_VERSION: u32 = 1;

/// `config.json` of a Qwen3 model with these dimensions.
pub fn qwen3_config_json(d: &TinyDims, dtype: &str) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": false,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "hidden_size": d.hidden,
        "initializer_range": 0.02,
        "intermediate_size": d.intermediate,
        "max_position_embeddings": 40960,
        "max_window_layers": d.layers,
        "model_type": "qwen3",
        "num_attention_heads": d.heads,
        "num_hidden_layers": d.layers,
        "num_key_value_heads": d.kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_scaling": null,
        "rope_theta": 1000000.0,
        "sliding_window": null,
        "tie_word_embeddings": d.tied,
        "torch_dtype": dtype,
        "use_cache": true,
        "use_sliding_window": false,
        "vocab_size": d.vocab
    })
}
