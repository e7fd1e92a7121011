//! Tests of config parsing: real configs of each family and the refusals.

use super::*;

const QWEN3_06B: &str = r#"{
  "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "hidden_act": "silu",
  "hidden_size": 1024, "head_dim": 128, "intermediate_size": 3072,
  "max_position_embeddings": 40960, "model_type": "qwen3", "num_attention_heads": 16,
  "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
  "rope_scaling": null, "rope_theta": 1000000, "tie_word_embeddings": true,
  "torch_dtype": "bfloat16", "vocab_size": 151936
}"#;

#[test]
fn parses_the_qwen3_0_6b_config() {
    let c = ModelConfig::parse(QWEN3_06B.as_bytes(), Path::new("config.json")).unwrap();
    assert_eq!(c.hidden_size, 1024);
    assert_eq!(c.head_dim, 128);
    assert_eq!(c.num_key_value_heads, 8);
    assert_eq!(c.group_size(), 2);
    assert_eq!(c.rope_theta, 1e6);
    assert!(c.tie_word_embeddings);
    assert_eq!(c.torch_dtype.as_deref(), Some("bfloat16"));
}

#[test]
fn unknown_architecture_is_named() {
    let text = QWEN3_06B.replace("Qwen3ForCausalLM", "MambaForCausalLM");
    let err = ModelConfig::parse(text.as_bytes(), Path::new("/m/config.json"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("MambaForCausalLM"), "{err}");
    assert!(err.contains("/m/config.json"), "{err}");
}

#[test]
fn missing_field_names_the_file_and_field() {
    let text = QWEN3_06B.replace("\"hidden_size\": 1024,", "");
    let err = ModelConfig::parse(text.as_bytes(), Path::new("/m/config.json"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("hidden_size") && err.contains("/m/config.json"),
        "{err}"
    );
}

/// meta-llama/Llama-3.2-1B-Instruct's config.json.
const LLAMA32_1B: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64,
  "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
  "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": false,
  "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
  "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256
}"#;

/// Qwen/Qwen2.5-0.5B-Instruct's config.json.
const QWEN25_05B: &str = r#"{
  "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
  "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
  "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
  "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "sliding_window": 32768, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "transformers_version": "4.43.1", "use_cache": true, "use_sliding_window": false,
  "vocab_size": 151936
}"#;

/// mistralai/Mistral-7B-v0.1's config.json (a 4096 window under a 32k context).
const MISTRAL_7B_V01: &str = r#"{
  "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
  "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
  "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "vocab_size": 32000
}"#;

fn parse(text: &str) -> Result<ModelConfig, String> {
    ModelConfig::parse(text.as_bytes(), Path::new("/m/config.json")).map_err(|e| e.to_string())
}

#[test]
fn parses_real_family_configs() {
    let l = parse(LLAMA32_1B).unwrap();
    assert_eq!(l.family, Family::Llama);
    assert_eq!((l.head_dim, l.group_size()), (64, 4));
    assert!(!l.qk_norm && !l.qkv_bias && !l.o_bias && l.sliding_window.is_none());
    assert_eq!(
        l.rope_scaling,
        Some(RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0
        })
    );
    let q = parse(QWEN25_05B).unwrap();
    assert_eq!(q.family, Family::Qwen2);
    assert_eq!(q.head_dim, 64, "hidden_size / num_attention_heads");
    assert!(q.qkv_bias && !q.o_bias && !q.qk_norm);
    assert_eq!(q.sliding_window, None, "use_sliding_window is false");
    let m = parse(MISTRAL_7B_V01).unwrap();
    assert_eq!(m.family, Family::Mistral);
    assert_eq!(m.sliding_window, Some(4096));
    assert!(!m.qkv_bias && !m.qk_norm);
    let q3 = parse(QWEN3_06B).unwrap();
    assert!(q3.qk_norm && !q3.qkv_bias && q3.rope_scaling.is_none());
}

#[test]
fn mistral_window_is_ignored_only_when_it_covers_the_context() {
    let null = MISTRAL_7B_V01.replace("\"sliding_window\": 4096", "\"sliding_window\": null");
    assert_eq!(parse(&null).unwrap().sliding_window, None);
    let wide = MISTRAL_7B_V01.replace("\"sliding_window\": 4096", "\"sliding_window\": 32768");
    assert_eq!(parse(&wide).unwrap().sliding_window, None);
    // Absent: transformers' MistralConfig default of 4096.
    let absent = MISTRAL_7B_V01.replace("\"sliding_window\": 4096,", "");
    assert_eq!(parse(&absent).unwrap().sliding_window, Some(4096));
}

#[test]
fn qwen2_per_layer_sliding_window_is_refused() {
    let on = QWEN25_05B
        .replace(
            "\"use_sliding_window\": false",
            "\"use_sliding_window\": true",
        )
        .replace("\"sliding_window\": 32768", "\"sliding_window\": 4096");
    let err = parse(&on).unwrap_err();
    assert!(
        err.contains("use_sliding_window") && err.contains("max_window_layers"),
        "{err}"
    );
    // A window covering the context changes nothing: accepted.
    let wide = QWEN25_05B.replace(
        "\"use_sliding_window\": false",
        "\"use_sliding_window\": true",
    );
    assert_eq!(parse(&wide).unwrap().sliding_window, None);
}

#[test]
fn unsupported_keys_are_refused_by_name() {
    let yarn = LLAMA32_1B.replace("\"rope_type\": \"llama3\"", "\"rope_type\": \"yarn\"");
    let err = parse(&yarn).unwrap_err();
    assert!(
        err.contains("rope_scaling.rope_type") && err.contains("yarn"),
        "{err}"
    );
    let no_factor = LLAMA32_1B.replace("\"factor\": 32.0,", "");
    let err = parse(&no_factor).unwrap_err();
    assert!(err.contains("rope_scaling.factor"), "{err}");
    let mt = QWEN25_05B.replace("\"model_type\": \"qwen2\"", "\"model_type\": \"gemma\"");
    let err = parse(&mt).unwrap_err();
    assert!(err.contains("model_type") && err.contains("gemma"), "{err}");
    let no_arch = mt.replace("\"architectures\": [\"Qwen2ForCausalLM\"],", "");
    assert!(parse(&no_arch).unwrap_err().contains("gemma"));
    let mixed = QWEN25_05B.replace("\"model_type\": \"qwen2\"", "\"model_type\": \"llama\"");
    let err = parse(&mixed).unwrap_err();
    assert!(
        err.contains("Qwen2ForCausalLM") && err.contains("llama"),
        "{err}"
    );
    let act = LLAMA32_1B.replace("\"silu\"", "\"gelu\"");
    assert!(parse(&act).unwrap_err().contains("hidden_act"));
    let mlp = LLAMA32_1B.replace("\"mlp_bias\": false", "\"mlp_bias\": true");
    assert!(parse(&mlp).unwrap_err().contains("mlp_bias"));
    let none = r#"{"hidden_size": 8}"#;
    assert!(parse(none).unwrap_err().contains("architectures"));
}

#[test]
fn transformers5_rope_parameters_are_read() {
    let v5 = LLAMA32_1B
        .replace("\"rope_scaling\"", "\"rope_parameters\"")
        .replace(
            "\"rope_type\": \"llama3\"}",
            "\"rope_type\": \"llama3\", \"rope_theta\": 250000.0}",
        )
        .replace("\"rope_theta\": 500000.0,", "");
    let c = parse(&v5).unwrap();
    assert_eq!(c.rope_theta, 250000.0);
    assert!(matches!(c.rope_scaling, Some(RopeScaling::Llama3 { factor, .. }) if factor == 32.0));
    let plain = QWEN25_05B.replace(
        "\"rope_theta\": 1000000.0,",
        "\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 1000000.0},",
    );
    let c = parse(&plain).unwrap();
    assert_eq!((c.rope_theta, c.rope_scaling), (1e6, None));
}

#[test]
fn llama3_inv_freq_has_three_bands() {
    // transformers' _compute_llama3_parameters for Llama 3.2 (factor 32, 1/4, 8192):
    // high frequencies kept, low ones divided by 32, the band between interpolated.
    let c = parse(LLAMA32_1B).unwrap();
    let plain = RopeScaling::inv_freq(None, 64, 500000.0);
    let scaled = c.rope_inv_freq();
    let wavelen = |f: f64| 2.0 * std::f64::consts::PI / f;
    let (mut kept, mut divided, mut between) = (0, 0, 0);
    for (p, s) in plain.iter().zip(&scaled) {
        if wavelen(*p) < 2048.0 {
            assert_eq!(p, s);
            kept += 1;
        } else if wavelen(*p) > 8192.0 {
            assert!((p / 32.0 - s).abs() <= 1e-12 * p);
            divided += 1;
        } else {
            assert!(s < p && *s > p / 32.0);
            between += 1;
        }
    }
    assert!(
        kept > 0 && divided > 0 && between > 0,
        "{kept} {divided} {between}"
    );
}

#[test]
fn missing_config_file_is_named() {
    let dir = std::env::temp_dir().join(format!("tandem-cfg-missing-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let err = ModelConfig::load(&dir).unwrap_err().to_string();
    assert!(err.contains("config.json"), "{err}");
    let _ = std::fs::remove_dir(&dir);
}
