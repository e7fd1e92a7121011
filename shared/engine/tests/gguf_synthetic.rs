//! GGUF → decoder weights on small synthetic models written here as llama.cpp's converter
//! writes them (GGUF names, `[in, out]` dims, q/k rows permuted for llama, `rope_freqs`):
//! loading them gives the same config and exactly the same weights as the Hugging Face
//! tensors they were made from. Covers what SmolLM2 does not: grouped-query attention with
//! an untied `output`, Llama 3 RoPE factors, and qwen2 (attention biases, no permutation).

use std::path::Path;

use tandem_engine::backend::cpu_ops::Matrix;
use tandem_engine::model::config::RopeScaling;
use tandem_engine::model::{DecoderWeights, LoadOptions, LoadedModel, ModelConfig};
use tandem_engine::tiny::{random_tensor, tensor_shapes};

enum Kv {
    Str(String),
    U32(u32),
    F32(f32),
    Bool(bool),
    Strs(Vec<String>),
    I32s(Vec<i32>),
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

/// A GGUF v3 file with F32 tensors (`dims` in GGUF order).
fn write_gguf(path: &Path, kvs: &[(&str, Kv)], tensors: &[(String, Vec<u64>, Vec<f32>)]) {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((kvs.len() as u64).to_le_bytes());
    for (k, v) in kvs {
        put_str(&mut b, k);
        match v {
            Kv::Str(s) => {
                b.extend(8u32.to_le_bytes());
                put_str(&mut b, s);
            }
            Kv::U32(x) => {
                b.extend(4u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            Kv::F32(x) => {
                b.extend(6u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            Kv::Bool(x) => {
                b.extend(7u32.to_le_bytes());
                b.push(*x as u8);
            }
            Kv::Strs(v) => {
                b.extend(9u32.to_le_bytes());
                b.extend(8u32.to_le_bytes());
                b.extend((v.len() as u64).to_le_bytes());
                for s in v {
                    put_str(&mut b, s);
                }
            }
            Kv::I32s(v) => {
                b.extend(9u32.to_le_bytes());
                b.extend(5u32.to_le_bytes());
                b.extend((v.len() as u64).to_le_bytes());
                for x in v {
                    b.extend(x.to_le_bytes());
                }
            }
        }
    }
    let mut offset = 0u64;
    for (name, dims, data) in tensors {
        put_str(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(0u32.to_le_bytes()); // F32
        b.extend(offset.to_le_bytes());
        offset += (data.len() as u64 * 4).div_ceil(32) * 32;
    }
    while !b.len().is_multiple_of(32) {
        b.push(0);
    }
    for (_, _, data) in tensors {
        let start = b.len();
        b.extend(data.iter().flat_map(|v| v.to_le_bytes()));
        while !(b.len() - start).is_multiple_of(32) {
            b.push(0);
        }
    }
    std::fs::write(path, b).unwrap();
}

/// llama.cpp's `permute` (convert_hf_to_gguf.py, LlamaModel): within each head, row
/// `half*(hd/2) + i` moves to `2*i + half`.
fn permute(data: &[f32], heads: usize, rows: usize, cols: usize) -> Vec<f32> {
    let hd = rows / heads;
    let mut out = vec![0.0; data.len()];
    for h in 0..heads {
        for half in 0..2 {
            for i in 0..hd / 2 {
                let src = (h * hd + half * hd / 2 + i) * cols;
                let dst = (h * hd + 2 * i + half) * cols;
                out[dst..dst + cols].copy_from_slice(&data[src..src + cols]);
            }
        }
    }
    out
}

fn gguf_name(hf: &str) -> String {
    let table = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = table.iter().find(|(h, _)| *h == hf) {
        return g.to_string();
    }
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (l, name) = rest.split_once('.').unwrap();
    let name = name
        .replace("input_layernorm", "attn_norm")
        .replace("post_attention_layernorm", "ffn_norm")
        .replace("self_attn.q_proj", "attn_q")
        .replace("self_attn.k_proj", "attn_k")
        .replace("self_attn.v_proj", "attn_v")
        .replace("self_attn.o_proj", "attn_output")
        .replace("mlp.gate_proj", "ffn_gate")
        .replace("mlp.up_proj", "ffn_up")
        .replace("mlp.down_proj", "ffn_down");
    format!("blk.{l}.{name}")
}

const SEED: u64 = 0x6767_7566_0001;

fn check(arch: &str, hf_config: serde_json::Value, rope_freqs: Option<Vec<f32>>) {
    let raw = serde_json::to_vec(&hf_config).unwrap();
    let cfg = ModelConfig::parse(&raw, Path::new("config.json")).unwrap();
    let random = |name: &str, n: usize| random_tensor(SEED, name, n, 0.0, 1.0);
    let mut tensors = vec![];
    for (name, shape) in tensor_shapes(&cfg) {
        let n = shape.iter().product();
        let mut data = random(&name, n);
        if arch == "llama" {
            let cols = if shape.len() == 2 { shape[1] } else { 1 };
            if name.contains("q_proj") {
                data = permute(&data, cfg.num_attention_heads, shape[0], cols);
            } else if name.contains("k_proj") {
                data = permute(&data, cfg.num_key_value_heads, shape[0], cols);
            }
        }
        let dims = shape.iter().rev().map(|&d| d as u64).collect();
        tensors.push((gguf_name(&name), dims, data));
    }
    if let Some(f) = &rope_freqs {
        tensors.push(("rope_freqs.weight".into(), vec![f.len() as u64], f.clone()));
    }
    let v = cfg.vocab_size;
    let tokens: Vec<String> = (0..v)
        .map(|i| match i {
            0 => "<|endoftext|>".to_string(),
            _ => format!("t{i}"),
        })
        .collect();
    let types: Vec<i32> = (0..v).map(|i| if i == 0 { 3 } else { 1 }).collect();
    let a = |k: &str| format!("{arch}.{k}");
    let (ka, kb, kc, kd, ke, kf, kg, kh, ki) = (
        a("block_count"),
        a("context_length"),
        a("embedding_length"),
        a("feed_forward_length"),
        a("attention.head_count"),
        a("attention.head_count_kv"),
        a("rope.freq_base"),
        a("attention.layer_norm_rms_epsilon"),
        a("attention.key_length"),
    );
    let kvs = vec![
        ("general.architecture", Kv::Str(arch.into())),
        (ka.as_str(), Kv::U32(cfg.num_hidden_layers as u32)),
        (kb.as_str(), Kv::U32(cfg.max_position_embeddings as u32)),
        (kc.as_str(), Kv::U32(cfg.hidden_size as u32)),
        (kd.as_str(), Kv::U32(cfg.intermediate_size as u32)),
        (ke.as_str(), Kv::U32(cfg.num_attention_heads as u32)),
        (kf.as_str(), Kv::U32(cfg.num_key_value_heads as u32)),
        (kg.as_str(), Kv::F32(cfg.rope_theta)),
        (kh.as_str(), Kv::F32(cfg.rms_norm_eps)),
        (ki.as_str(), Kv::U32(cfg.head_dim as u32)),
        ("tokenizer.ggml.model", Kv::Str("gpt2".into())),
        ("tokenizer.ggml.pre", Kv::Str("qwen2".into())),
        ("tokenizer.ggml.tokens", Kv::Strs(tokens)),
        ("tokenizer.ggml.token_type", Kv::I32s(types)),
        ("tokenizer.ggml.merges", Kv::Strs(vec![])),
        ("tokenizer.ggml.eos_token_id", Kv::U32(0)),
        ("tokenizer.ggml.add_bos_token", Kv::Bool(false)),
        (
            "tokenizer.chat_template",
            Kv::Str("{% for m in messages %}{{ m.content }}{% endfor %}".into()),
        ),
    ];
    let dir = std::env::temp_dir().join(format!("tandem-gguf-syn-{arch}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.gguf");
    write_gguf(&path, &kvs, &tensors);

    let m = LoadedModel::load(&path, &LoadOptions::default()).unwrap();
    let c = &m.config;
    assert_eq!(c.family, cfg.family);
    assert_eq!(
        (c.num_hidden_layers, c.hidden_size, c.intermediate_size),
        (
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.intermediate_size
        )
    );
    assert_eq!(
        (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
        (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim
        )
    );
    assert_eq!(
        (c.qkv_bias, c.o_bias, c.qk_norm),
        (cfg.qkv_bias, cfg.o_bias, false)
    );
    assert_eq!(c.tie_word_embeddings, cfg.tie_word_embeddings);
    assert_eq!(
        (c.rope_theta, c.rms_norm_eps),
        (cfg.rope_theta, cfg.rms_norm_eps)
    );
    assert_eq!(c.vocab_size, v);
    assert_eq!(m.eos_token_ids(), vec![0]);
    match (&rope_freqs, &c.rope_scaling) {
        (Some(f), Some(RopeScaling::Factors(got))) => {
            assert_eq!(got, &f.iter().map(|x| *x as f64).collect::<Vec<_>>())
        }
        (None, None) => {}
        (want, got) => panic!("rope scaling {got:?}, expected factors {want:?}"),
    }

    let want = DecoderWeights::from_source(&cfg, |name, shape| {
        Ok(Matrix::F32(random(name, shape.iter().product())))
    })
    .unwrap();
    let got = &m.weights;
    assert!(got.embed == want.embed, "{arch}: embed");
    assert_eq!(got.norm, want.norm);
    assert!(got.lm_head == want.lm_head, "{arch}: lm_head");
    assert_eq!(got.layers.len(), want.layers.len());
    for (l, (g, w)) in got.layers.iter().zip(&want.layers).enumerate() {
        assert!(g.qkv == w.qkv, "{arch} layer {l}: qkv");
        assert_eq!(g.qkv_bias, w.qkv_bias, "{arch} layer {l}: qkv bias");
        assert!(g.o_proj == w.o_proj, "{arch} layer {l}: o_proj");
        assert!(g.gate_up == w.gate_up, "{arch} layer {l}: gate_up");
        assert!(g.down == w.down, "{arch} layer {l}: down");
        assert_eq!(g.input_norm, w.input_norm);
        assert_eq!(g.post_norm, w.post_norm);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

fn hf_config(model_type: &str, arch: &str, tied: bool) -> serde_json::Value {
    serde_json::json!({
        "architectures": [arch], "model_type": model_type,
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 4096,
        "vocab_size": 40, "tie_word_embeddings": tied, "hidden_act": "silu",
    })
}

#[test]
fn llama_gguf_with_gqa_untied_output_and_rope_factors() {
    let factors: Vec<f32> = (0..4).map(|i| 1.0 + i as f32).collect();
    check(
        "llama",
        hf_config("llama", "LlamaForCausalLM", false),
        Some(factors),
    );
}

#[test]
fn qwen2_gguf_with_biases_and_tied_embeddings() {
    check("qwen2", hf_config("qwen2", "Qwen2ForCausalLM", true), None);
}
