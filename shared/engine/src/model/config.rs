//! The model's `config.json` (Hugging Face format), reduced to what the Qwen3 forward needs.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::EngineError;

/// Architectures this engine runs.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["Qwen3ForCausalLM"];

/// The fields of a Qwen3 `config.json` that the engine uses.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub architecture: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub vocab_size: usize,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    /// The dtype the checkpoint was saved in (informational; tensors carry their own dtype).
    pub torch_dtype: Option<String>,
    /// The raw file, kept for the model identity hash.
    pub raw: Vec<u8>,
}

#[derive(Deserialize)]
struct RawConfig {
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    #[serde(default = "default_theta")]
    rope_theta: f64,
    vocab_size: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default = "default_max_pos")]
    max_position_embeddings: usize,
    torch_dtype: Option<String>,
    dtype: Option<String>,
    rope_scaling: Option<serde_json::Value>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    1_000_000.0
}
fn default_max_pos() -> usize {
    40960
}

impl ModelConfig {
    /// Reads `config.json` from a model folder.
    pub fn load(folder: &Path) -> Result<Self, EngineError> {
        let path = folder.join("config.json");
        if !path.is_file() {
            return Err(EngineError::MissingFile {
                folder: folder.to_path_buf(),
                file: "config.json".into(),
            });
        }
        let bytes = std::fs::read(&path).map_err(|e| EngineError::io(&path, e))?;
        Self::parse(&bytes, &path)
    }

    /// Parses `config.json` bytes; `path` only names the file in errors.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Self, EngineError> {
        let bad = |message: String| EngineError::BadFile {
            path: PathBuf::from(path),
            message,
        };
        // Check the architecture first so that an unknown model says so instead of failing
        // on a missing field that its family does not have.
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let archs: Vec<String> = value
            .get("architectures")
            .and_then(|a| a.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        let architecture = match archs.first() {
            Some(a) if SUPPORTED_ARCHITECTURES.contains(&a.as_str()) => a.clone(),
            Some(a) => {
                return Err(EngineError::UnknownArchitecture {
                    path: path.to_path_buf(),
                    architecture: a.clone(),
                })
            }
            None => {
                let mt = value.get("model_type").and_then(|m| m.as_str());
                if mt == Some("qwen3") {
                    "Qwen3ForCausalLM".to_string()
                } else {
                    return Err(EngineError::UnknownArchitecture {
                        path: path.to_path_buf(),
                        architecture: mt.unwrap_or("<none given>").to_string(),
                    });
                }
            }
        };
        let raw: RawConfig =
            serde_json::from_value(value).map_err(|e| bad(format!("invalid config: {e}")))?;
        if let Some(scaling) = raw.rope_scaling.as_ref().filter(|v| !v.is_null()) {
            return Err(bad(format!(
                "rope_scaling {scaling} is not supported yet (only plain RoPE)"
            )));
        }
        let num_key_value_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        if raw.num_attention_heads == 0 || raw.hidden_size == 0 || raw.num_hidden_layers == 0 {
            return Err(bad(
                "hidden_size, num_attention_heads and num_hidden_layers must be > 0".into(),
            ));
        }
        let head_dim = raw
            .head_dim
            .unwrap_or(raw.hidden_size / raw.num_attention_heads);
        if num_key_value_heads == 0 || !raw.num_attention_heads.is_multiple_of(num_key_value_heads)
        {
            return Err(bad(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                raw.num_attention_heads, num_key_value_heads
            )));
        }
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(bad(format!("head_dim {head_dim} must be even and > 0")));
        }
        Ok(ModelConfig {
            architecture,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: raw.rms_norm_eps as f32,
            rope_theta: raw.rope_theta as f32,
            vocab_size: raw.vocab_size,
            tie_word_embeddings: raw.tie_word_embeddings,
            max_position_embeddings: raw.max_position_embeddings,
            torch_dtype: raw.torch_dtype.or(raw.dtype),
            raw: bytes.to_vec(),
        })
    }

    /// Query heads per KV head (grouped-query attention).
    pub fn group_size(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }
}

#[cfg(test)]
mod tests {
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

    #[test]
    fn missing_config_file_is_named() {
        let dir = std::env::temp_dir().join(format!("tandem-cfg-missing-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let err = ModelConfig::load(&dir).unwrap_err().to_string();
        assert!(err.contains("config.json"), "{err}");
        let _ = std::fs::remove_dir(&dir);
    }
}
