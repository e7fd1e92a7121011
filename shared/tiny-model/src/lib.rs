//! The built-in tiny model: a small Qwen3-architecture checkpoint whose weights come from the
//! workspace's PRNG (splitmix64 + Box-Muller, [`weights`]), so that they never change with a
//! crate upgrade, plus the real Qwen3 tokenizer files fetched once into a cache
//! ([`tokenizer`]). Beside it, one tiny model per other family ([`families`]) and a one-layer
//! model of Qwen3-0.6B's shapes ([`SHAPE_CHECK`]), and a tiny random LLaVA ([`llava`]: a CLIP
//! vision tower, a projector and a tiny Llama, `tandem model tiny-vl`).
//!
//! It links no engine, so that the launcher (`tandem model tiny`, `tandem up`) can write the
//! models; the engine re-exports it as `tandem_engine::tiny` and checks that the tensors
//! written here are the ones its loader expects.

pub mod cache;
pub mod families;
pub mod llava;
pub mod qwen3;
pub mod shapes;
pub mod tokenizer;
pub mod weights;
mod write;

pub use cache::{build_once, ensure_shape_check_model, ensure_tiny_model};
pub use families::*;
pub use llava::*;
pub use qwen3::*;
pub use tokenizer::{ensure_tokenizer_files, TOKENIZER_FILES, TOKENIZER_SHA256};
pub use weights::{random_init, random_tensor};
pub use write::{
    write_random_model, write_random_qwen3, write_shape_check_model, write_tiny_model, WeightDtype,
};

use std::path::{Path, PathBuf};

/// Errors of writing a tiny model or fetching its tokenizer files.
#[derive(Debug, thiserror::Error)]
pub enum TinyModelError {
    /// A file or folder could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A tensor could not be serialised into the checkpoint.
    #[error("{path}: tensor {tensor}: {message}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        message: String,
    },
    /// A model's `config.json` lacks what its tensors' shapes need.
    #[error("tiny model config: {0}")]
    Config(String),
    /// No tiny model of that name.
    #[error("no tiny model named {0:?}")]
    UnknownModel(String),
    /// Fetching the tokenizer files into the cache failed.
    #[error("fetching the tokenizer files: {0}")]
    Fetch(String),
}

impl TinyModelError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}
