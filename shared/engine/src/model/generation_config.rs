//! `generation_config.json`: the EOS ids and the model's default sampling parameters.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::EngineError;

/// What the engine takes from `generation_config.json`. Every field is optional in the file;
/// a missing file gives the defaults (no EOS ids from here, greedy-free defaults unset).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerationConfig {
    /// Token ids that end a generation.
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
    pub do_sample: Option<bool>,
    pub temperature: Option<f32>,
    pub top_k: Option<u32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub max_new_tokens: Option<u32>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

#[derive(Deserialize)]
struct Raw {
    eos_token_id: Option<OneOrMany>,
    bos_token_id: Option<u32>,
    pad_token_id: Option<u32>,
    do_sample: Option<bool>,
    temperature: Option<f32>,
    top_k: Option<u32>,
    top_p: Option<f32>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    max_new_tokens: Option<u32>,
}

impl GenerationConfig {
    /// Reads `generation_config.json` from `folder`; a missing file gives the defaults.
    pub fn load(folder: &Path) -> Result<Self, EngineError> {
        let path = folder.join("generation_config.json");
        if !path.is_file() {
            return Ok(Self::default());
        }
        let bytes = std::fs::read(&path).map_err(|e| EngineError::io(&path, e))?;
        Self::parse(&bytes, &path)
    }

    pub fn parse(bytes: &[u8], path: &Path) -> Result<Self, EngineError> {
        let raw: Raw = serde_json::from_slice(bytes).map_err(|e| EngineError::BadFile {
            path: path.to_path_buf(),
            message: format!("invalid generation config: {e}"),
        })?;
        let eos_token_ids = match raw.eos_token_id {
            None => vec![],
            Some(OneOrMany::One(id)) => vec![id],
            Some(OneOrMany::Many(ids)) => ids,
        };
        Ok(GenerationConfig {
            eos_token_ids,
            bos_token_id: raw.bos_token_id,
            pad_token_id: raw.pad_token_id,
            do_sample: raw.do_sample,
            temperature: raw.temperature,
            top_k: raw.top_k,
            top_p: raw.top_p,
            min_p: raw.min_p,
            repetition_penalty: raw.repetition_penalty,
            max_new_tokens: raw.max_new_tokens,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_qwen3_generation_config() {
        let text = r#"{"bos_token_id": 151643, "do_sample": true,
            "eos_token_id": [151645, 151643], "pad_token_id": 151643,
            "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}"#;
        let g = GenerationConfig::parse(text.as_bytes(), Path::new("g.json")).unwrap();
        assert_eq!(g.eos_token_ids, vec![151645, 151643]);
        assert_eq!(g.top_k, Some(20));
        assert_eq!(g.temperature, Some(0.6));
    }

    #[test]
    fn single_eos_id_and_errors() {
        let g = GenerationConfig::parse(br#"{"eos_token_id": 7}"#, Path::new("g")).unwrap();
        assert_eq!(g.eos_token_ids, vec![7]);
        let e = GenerationConfig::parse(br#"{"eos_token_id": "x"}"#, Path::new("/m/g.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/m/g.json"), "{e}");
    }
}
