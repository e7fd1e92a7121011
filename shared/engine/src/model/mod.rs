//! Model folders (and GGUF files: [`gguf`]): config, weights, tokenizer, chat template and
//! generation defaults, loaded together into a [`LoadedModel`]. The families run (Qwen3,
//! Qwen2/2.5, Llama 3.x, Mistral: [`Family`]) share one decoder ([`decoder`]), parameterised
//! by the parsed [`ModelConfig`]: q/k norms, attention biases, RoPE scaling, sliding window,
//! tied embeddings.

pub mod config;
pub mod decoder;
pub mod generation_config;
pub mod gguf;
pub mod tp;
pub mod vision;
pub mod weights;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::error::EngineError;
use crate::tokenizer::{tokenizer_hash, ChatTemplate, Tokenizer};
pub use config::{Family, ModelConfig};
pub use decoder::DecoderWeights;
pub use generation_config::GenerationConfig;
/// The former name of [`DecoderWeights`] (Qwen3 was the first family).
pub type Qwen3Weights = DecoderWeights;
pub use vision::{VisionConfig, VisionEncoder, VisionWeights};
pub use weights::Weights;

/// What [`LoadedModel::load`] loads.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Convert the weights for compute. Off for processes that only tokenize (a router):
    /// the checkpoint is then only mapped to compute the model identity.
    pub weights: bool,
    /// Load a multimodal model's vision tower and projector too (with `weights`). Off where
    /// images are encoded elsewhere (an encode worker) or not taken at all.
    pub vision: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            weights: true,
            vision: true,
        }
    }
}

impl LoadOptions {
    /// Tokenizing only (a router): the checkpoint is mapped, not converted.
    pub fn no_weights() -> Self {
        LoadOptions {
            weights: false,
            vision: false,
        }
    }
}

/// Everything of a model folder the engine uses.
pub struct LoadedModel {
    pub path: PathBuf,
    pub config: ModelConfig,
    /// f32 compute weights, shared by every backend made from this model.
    /// Empty (no layers) when loaded with [`LoadOptions::no_weights`].
    pub weights: Arc<DecoderWeights>,
    /// The vision tower and projector of a multimodal model, when loaded with weights.
    pub vision: Option<Arc<VisionEncoder>>,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    pub generation_config: GenerationConfig,
    /// Identity of the model: sha256 of config.json and the weights' identity; part of the
    /// KV layout descriptor.
    pub model_id: String,
    /// Identity of tokenizer.json and the chat template, for the model card.
    pub tokenizer_hash: String,
    pub weights_loaded: bool,
}

impl std::fmt::Debug for LoadedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedModel")
            .field("path", &self.path)
            .field("config", &self.config)
            .field("model_id", &self.model_id)
            .finish_non_exhaustive()
    }
}

/// The folder's checkpoint, mapped. Without weights (a tokenizer's or a simulator's load) a
/// folder may hold none: `config.json` and the tokenizer files are then all it needs.
fn map_weights(path: &Path, opts: &LoadOptions) -> Result<Option<Weights>, EngineError> {
    match Weights::load(path) {
        Ok(w) => Ok(Some(w)),
        Err(EngineError::MissingFile { .. }) if !opts.weights => Ok(None),
        Err(e) => Err(e),
    }
}

/// Identity of a folder without weights: sha256 of config.json, marked as such.
fn config_identity(config: &ModelConfig) -> String {
    let mut h = Sha256::new();
    h.update(&config.raw);
    h.update(b"no weights");
    weights::hex(&h.finalize())
}

/// Identity of a model: sha256 of config.json and the weights' identity.
fn model_identity(config: &ModelConfig, mapped: &Weights) -> String {
    let mut h = Sha256::new();
    h.update(&config.raw);
    h.update(mapped.identity().as_bytes());
    weights::hex(&h.finalize())
}

/// The vision tower and projector of a multimodal model folder, loaded alone (what an encode
/// worker runs), with the model's identity ([`LoadedModel::model_id`]).
pub fn load_vision(path: &Path) -> Result<(VisionEncoder, String), EngineError> {
    if !path.is_dir() {
        return Err(EngineError::ModelPathMissing(path.to_path_buf()));
    }
    let config = ModelConfig::load(path)?;
    let Some(vc) = config.vision.clone() else {
        return Err(EngineError::NotMultimodal(path.to_path_buf()));
    };
    let mapped = Weights::load(path)?;
    let encoder = VisionEncoder::new(vc.clone(), VisionWeights::load(&vc, &mapped)?);
    Ok((encoder, model_identity(&config, &mapped)))
}

impl LoadedModel {
    /// Loads a Hugging Face model folder, or a GGUF file (`*.gguf`, see [`gguf`]). Errors name
    /// the file (and the tensor) at fault.
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Self, EngineError> {
        if gguf::is_gguf(path) {
            return gguf::load(path, opts);
        }
        if !path.is_dir() {
            return Err(EngineError::ModelPathMissing(path.to_path_buf()));
        }
        tracing::info!(path = %path.display(), "loading model");
        let config = ModelConfig::load(path)?;
        let mapped = map_weights(path, opts)?;
        let tokenizer = Tokenizer::load(path)?;
        let chat_template = ChatTemplate::load(path)?;
        let generation_config = GenerationConfig::load(path)?;
        let weights = if let (true, Some(mapped)) = (opts.weights, &mapped) {
            DecoderWeights::load(&config, mapped)?
        } else {
            DecoderWeights {
                embed: crate::backend::cpu_ops::Matrix::F32(vec![]),
                layers: vec![],
                norm: vec![],
                lm_head: None,
            }
        };
        let vision = match (&config.vision, &mapped, opts.weights && opts.vision) {
            (Some(vc), Some(mapped), true) => Some(Arc::new(VisionEncoder::new(
                vc.clone(),
                VisionWeights::load(vc, mapped)?,
            ))),
            _ => None,
        };
        let model_id = match &mapped {
            Some(mapped) => model_identity(&config, mapped),
            None => config_identity(&config),
        };
        let tokenizer_hash = tokenizer_hash(&tokenizer, chat_template.as_ref());
        tracing::info!(model_id = %model_id, "model loaded");
        Ok(LoadedModel {
            path: path.to_path_buf(),
            config,
            weights: Arc::new(weights),
            vision,
            tokenizer,
            chat_template,
            generation_config,
            model_id,
            tokenizer_hash,
            weights_loaded: opts.weights,
        })
    }

    /// Serves `source` (`--custom-jinja-template`) as the chat template instead of the
    /// model's own; the tokenizer hash covers it, so routers render with the same one.
    pub fn use_chat_template(&mut self, source: String) -> Result<(), EngineError> {
        let template = match &self.chat_template {
            Some(own) => own.replaced(source),
            None => ChatTemplate::new(source, None, None),
        }
        .map_err(|e| EngineError::Template(e.to_string()))?;
        self.tokenizer_hash = tokenizer_hash(&self.tokenizer, Some(&template));
        self.chat_template = Some(template);
        Ok(())
    }

    /// EOS ids: generation_config.json's, else the template's `eos_token`.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        if !self.generation_config.eos_token_ids.is_empty() {
            return self.generation_config.eos_token_ids.clone();
        }
        self.chat_template
            .as_ref()
            .and_then(|t| t.eos_token.as_deref())
            .and_then(|t| self.tokenizer.token_to_id(t))
            .into_iter()
            .collect()
    }
}
