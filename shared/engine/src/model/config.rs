//! The model's `config.json` (Hugging Face format), reduced to what the decoder forward needs:
//! the Llama-like families Qwen3, Qwen2/2.5, Llama (3.x `rope_scaling` included) and Mistral.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::model::vision::{is_llava, VisionConfig};

use crate::error::EngineError;

/// A decoder family: one forward ([`crate::model::decoder`]) runs them all; they differ in
/// per-head q/k norms, attention biases, defaults and which sliding windows they can have.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// `Qwen3ForCausalLM`: q/k RMSNorm per head, biases when `attention_bias`.
    Qwen3,
    /// `Qwen2ForCausalLM` (Qwen2 and Qwen2.5): q/k/v always have a bias, o_proj none.
    Qwen2,
    /// `LlamaForCausalLM` (Llama 2/3.x): biases on q/k/v/o when `attention_bias`.
    Llama,
    /// `MistralForCausalLM`: no biases; a sliding window over all layers.
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

    fn from_architecture(a: &str) -> Option<Family> {
        Family::ALL.into_iter().find(|f| f.architecture() == a)
    }

    fn from_model_type(t: &str) -> Option<Family> {
        Family::ALL.into_iter().find(|f| f.model_type() == t)
    }

    /// transformers' defaults for keys a config may leave out: (rope_theta,
    /// max_position_embeddings). Qwen3 keeps the engine's earlier default theta of 1e6.
    fn defaults(self) -> (f64, usize) {
        match self {
            Family::Qwen3 => (1_000_000.0, 40960),
            Family::Qwen2 => (10_000.0, 32768),
            Family::Llama => (10_000.0, 2048),
            Family::Mistral => (10_000.0, 4096 * 32),
        }
    }
}

/// Architectures this engine runs.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &[
    "Qwen3ForCausalLM",
    "Qwen2ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
];

/// RoPE frequency scaling (`rope_scaling` / `rope_parameters`). Only `llama3` changes the
/// frequencies; `default` (or none) is plain RoPE.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Llama 3.1+: low frequencies divided by `factor`, high ones kept, the band between
    /// interpolated (transformers' `_compute_llama3_parameters`).
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// Per-frequency divisors (GGUF's `rope_freqs.weight`, how llama.cpp stores Llama 3.1+
    /// scaling): `inv_freq[i] / factors[i]`, `head_dim / 2` of them.
    Factors(Vec<f64>),
}

impl RopeScaling {
    /// The inverse frequencies of a head of `head_dim` with base `theta`, scaled.
    pub fn inv_freq(scaling: Option<&RopeScaling>, head_dim: usize, theta: f32) -> Vec<f64> {
        let base = crate::backend::cpu_ops::rope_inv_freq(head_dim, theta);
        match scaling {
            None => base,
            Some(RopeScaling::Factors(factors)) => base
                .into_iter()
                .zip(factors.iter().chain(std::iter::repeat(&1.0)))
                .map(|(f, d)| f / d)
                .collect(),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            }) => {
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                base.into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }
}

/// The fields of a decoder `config.json` that the engine uses.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub architecture: String,
    pub family: Family,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Biases on the q, k and v projections.
    pub qkv_bias: bool,
    /// A bias on o_proj.
    pub o_bias: bool,
    /// Attention sees only the last `w` positions (the token's own included), in every layer.
    /// `None` when the config has none or its window covers `max_position_embeddings`.
    pub sliding_window: Option<usize>,
    pub vocab_size: usize,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    /// The dtype the checkpoint was saved in (informational; tensors carry their own dtype).
    pub torch_dtype: Option<String>,
    /// The vision tower and projector of a multimodal (LLaVA) model; `None` for text-only
    /// models. The fields above are then its language model's (`text_config`).
    pub vision: Option<VisionConfig>,
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
    rope_theta: Option<f64>,
    vocab_size: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    max_position_embeddings: Option<usize>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
    rope_scaling: Option<serde_json::Value>,
    /// transformers 5's form: `{rope_type, rope_theta, ...}`.
    rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    hidden_act: Option<String>,
    /// Absent is not the same as null for Mistral (transformers' default is 4096).
    #[serde(default, deserialize_with = "present")]
    sliding_window: Option<serde_json::Value>,
    #[serde(default)]
    use_sliding_window: bool,
    max_window_layers: Option<usize>,
}

/// Deserializes a present key (null included) as `Some`, so that absence stays `None`.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<serde_json::Value>, D::Error> {
    serde_json::Value::deserialize(d).map(Some)
}

fn default_eps() -> f64 {
    1e-6
}

/// Parses a `rope_scaling` / `rope_parameters` object; `key` names it in errors.
fn parse_rope(v: &serde_json::Value, key: &str) -> Result<Option<RopeScaling>, String> {
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(|t| t.as_str())
        .ok_or_else(|| format!("{key} has no rope_type (or type): {v}"))?;
    match kind {
        "default" => Ok(None),
        "llama3" => {
            let num = |k: &str| {
                v.get(k)
                    .and_then(|x| x.as_f64())
                    .ok_or_else(|| format!("{key} of rope_type llama3 lacks the number {key}.{k}"))
            };
            let (factor, lo, hi, old) = (
                num("factor")?,
                num("low_freq_factor")?,
                num("high_freq_factor")?,
                num("original_max_position_embeddings")?,
            );
            let s = RopeScaling::Llama3 {
                factor,
                low_freq_factor: lo,
                high_freq_factor: hi,
                original_max_position_embeddings: old,
            };
            if factor <= 0.0 || lo <= 0.0 || hi <= lo || old <= 0.0 {
                return Err(format!(
                    "{key}: llama3 needs factor > 0, 0 < low_freq_factor < high_freq_factor and \
                     original_max_position_embeddings > 0: {v}"
                ));
            }
            Ok(Some(s))
        }
        other => Err(format!(
            "{key}.rope_type {other:?} is not supported (supported: default, llama3)"
        )),
    }
}

/// The family named by `architectures` and `model_type` (either may be absent, not both; when
/// both are given they must agree).
fn family_of(value: &serde_json::Value) -> Result<Family, String> {
    let supported = SUPPORTED_ARCHITECTURES.join(", ");
    let arch = value
        .get("architectures")
        .and_then(|a| a.as_array())
        .and_then(|a| a.first())
        .and_then(|s| s.as_str());
    let model_type = value.get("model_type").and_then(|m| m.as_str());
    let by_arch = match arch {
        Some(a) => Some(Family::from_architecture(a).ok_or_else(|| {
            format!("architectures: unsupported architecture {a:?} (supported: {supported})")
        })?),
        None => None,
    };
    let by_type = match model_type {
        Some(t) => Some(Family::from_model_type(t).ok_or_else(|| {
            format!(
                "model_type: unsupported model_type {t:?} (supported: qwen3, qwen2, llama, \
                 mistral)"
            )
        })?),
        None => None,
    };
    match (by_arch, by_type) {
        (Some(a), Some(t)) if a != t => Err(format!(
            "architectures {:?} and model_type {:?} name different families",
            a.architecture(),
            t.model_type()
        )),
        (Some(f), _) | (None, Some(f)) => Ok(f),
        (None, None) => Err(format!(
            "neither architectures nor model_type is given (supported: {supported})"
        )),
    }
}

impl RawConfig {
    /// The RoPE scaling (`rope_scaling`, else transformers 5's `rope_parameters`) and theta
    /// (`rope_theta`, else `rope_parameters.rope_theta`, else the family's default).
    fn rope(&self, default_theta: f64) -> Result<(Option<RopeScaling>, f64), String> {
        let non_null = |v: &Option<serde_json::Value>| v.clone().filter(|v| !v.is_null());
        let rope_params = non_null(&self.rope_parameters);
        let rope_scaling = match (non_null(&self.rope_scaling), &rope_params) {
            (Some(s), _) => parse_rope(&s, "rope_scaling")?,
            (None, Some(p)) => parse_rope(p, "rope_parameters")?,
            (None, None) => None,
        };
        let rope_theta = self
            .rope_theta
            .or_else(|| rope_params.as_ref()?.get("rope_theta")?.as_f64())
            .unwrap_or(default_theta);
        Ok((rope_scaling, rope_theta))
    }

    /// Refuses the MLP variants the decoder does not run (an activation other than SiLU,
    /// biases).
    fn check_mlp(&self) -> Result<(), String> {
        if let Some(act) = self.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(format!("hidden_act {act:?} is not supported (only silu)"));
        }
        if self.mlp_bias {
            return Err("mlp_bias true is not supported (MLP without biases only)".into());
        }
        Ok(())
    }

    /// `(qk_norm, qkv_bias, o_bias)` of the family.
    fn attention_extras(&self, family: Family) -> (bool, bool, bool) {
        match family {
            Family::Qwen3 | Family::Llama => (
                family == Family::Qwen3,
                self.attention_bias,
                self.attention_bias,
            ),
            Family::Qwen2 => (false, true, false),
            Family::Mistral => (false, false, false),
        }
    }

    /// The sliding window over every layer, if any (one that covers
    /// `max_position_embeddings` is none); refuses Qwen's per-layer windows.
    fn sliding_window_for(
        &self,
        family: Family,
        max_position_embeddings: usize,
    ) -> Result<Option<usize>, String> {
        let window = match &self.sliding_window {
            None if family == Family::Mistral => Some(4096),
            None => None,
            Some(v) if v.is_null() => None,
            Some(v) => Some(
                v.as_u64()
                    .filter(|w| *w > 0)
                    .ok_or_else(|| format!("sliding_window {v} is not a positive integer"))?
                    as usize,
            ),
        }
        .filter(|w| *w < max_position_embeddings);
        match family {
            Family::Mistral => Ok(window),
            Family::Llama => Ok(None),
            Family::Qwen2 | Family::Qwen3 => {
                // transformers: layers from max_window_layers on use the window, when
                // use_sliding_window. Per-layer windows are not implemented: refuse them.
                let from = self.max_window_layers.unwrap_or(28);
                if let (true, Some(w)) = (self.use_sliding_window, window) {
                    if from < self.num_hidden_layers {
                        return Err(format!(
                            "use_sliding_window with sliding_window {w} < \
                             max_position_embeddings {max_position_embeddings} on layers \
                             {from}.. (max_window_layers) is not supported: per-layer sliding \
                             windows are not implemented"
                        ));
                    }
                }
                Ok(None)
            }
        }
    }

    /// `(num_key_value_heads, head_dim)`, checked against the other sizes.
    fn head_shape(&self) -> Result<(usize, usize), String> {
        let num_key_value_heads = self.num_key_value_heads.unwrap_or(self.num_attention_heads);
        if self.num_attention_heads == 0 || self.hidden_size == 0 || self.num_hidden_layers == 0 {
            return Err(
                "hidden_size, num_attention_heads and num_hidden_layers must be > 0".into(),
            );
        }
        let head_dim = self
            .head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads);
        if num_key_value_heads == 0 || !self.num_attention_heads.is_multiple_of(num_key_value_heads)
        {
            return Err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads, num_key_value_heads
            ));
        }
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(format!("head_dim {head_dim} must be even and > 0"));
        }
        Ok((num_key_value_heads, head_dim))
    }
}

/// A LLaVA config's `text_config`, with transformers' `LlamaConfig` defaults for the fields
/// the Hub's configs leave out (llava-1.5's lists only a few) and `model_type` llama when
/// absent. The top level's `vocab_size` fills the text's when only it is given.
fn llava_text_config(value: &serde_json::Value) -> Result<serde_json::Value, String> {
    let mut text = value
        .get("text_config")
        .filter(|t| t.is_object())
        .cloned()
        .ok_or("a LLaVA config needs a text_config object")?;
    let obj = text.as_object_mut().ok_or("text_config is not an object")?;
    obj.remove("architectures");
    let model_type = obj
        .entry("model_type")
        .or_insert_with(|| "llama".into())
        .clone();
    if model_type == "llama" {
        for (k, v) in [
            ("hidden_size", serde_json::json!(4096)),
            ("intermediate_size", serde_json::json!(11008)),
            ("num_hidden_layers", serde_json::json!(32)),
            ("num_attention_heads", serde_json::json!(32)),
            ("rms_norm_eps", serde_json::json!(1e-6)),
            (
                "vocab_size",
                value.get("vocab_size").cloned().unwrap_or(32000.into()),
            ),
        ] {
            obj.entry(k).or_insert(v);
        }
    }
    Ok(text)
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
        Self::from_json(bytes).map_err(|message| EngineError::BadFile {
            path: PathBuf::from(path),
            message,
        })
    }

    /// [`ModelConfig::parse`], its errors without the file name.
    fn from_json(bytes: &[u8]) -> Result<Self, String> {
        // Check the family first so that an unknown model says so instead of failing on a
        // missing field that its family does not have.
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| format!("not valid JSON: {e}"))?;
        if is_llava(&value) {
            let text = llava_text_config(&value)?;
            let mut cfg = Self::from_value(text, bytes).map_err(|e| format!("text_config: {e}"))?;
            cfg.vision = Some(VisionConfig::from_llava(&value, cfg.hidden_size)?);
            cfg.architecture = "LlavaForConditionalGeneration".into();
            return Ok(cfg);
        }
        Self::from_value(value, bytes)
    }

    /// Parses a decoder config (a text model's, or a LLaVA's `text_config`).
    fn from_value(value: serde_json::Value, bytes: &[u8]) -> Result<Self, String> {
        let family = family_of(&value)?;
        let raw: RawConfig =
            serde_json::from_value(value).map_err(|e| format!("invalid config: {e}"))?;
        let (default_theta, default_max_pos) = family.defaults();
        let max_position_embeddings = raw.max_position_embeddings.unwrap_or(default_max_pos);
        let (rope_scaling, rope_theta) = raw.rope(default_theta)?;
        raw.check_mlp()?;
        let (qk_norm, qkv_bias, o_bias) = raw.attention_extras(family);
        let sliding_window = raw.sliding_window_for(family, max_position_embeddings)?;
        let (num_key_value_heads, head_dim) = raw.head_shape()?;
        Ok(ModelConfig {
            architecture: family.architecture().to_string(),
            family,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: raw.rms_norm_eps as f32,
            rope_theta: rope_theta as f32,
            rope_scaling,
            qk_norm,
            qkv_bias,
            o_bias,
            sliding_window,
            vocab_size: raw.vocab_size,
            tie_word_embeddings: raw.tie_word_embeddings,
            max_position_embeddings,
            torch_dtype: raw.torch_dtype.or(raw.dtype),
            vision: None,
            raw: bytes.to_vec(),
        })
    }

    /// Query heads per KV head (grouped-query attention).
    pub fn group_size(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// RoPE inverse frequencies, with this config's scaling.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        RopeScaling::inv_freq(self.rope_scaling.as_ref(), self.head_dim, self.rope_theta)
    }
}

#[cfg(test)]
mod tests;
