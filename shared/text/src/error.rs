//! Errors of the text crate. Every error that comes from a file names the file.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A file that a model folder needs is absent.
    #[error("model folder {folder} lacks {file}")]
    MissingFile { folder: PathBuf, file: String },
    /// A JSON file (tokenizer config) is malformed.
    #[error("{path}: {message}")]
    BadFile { path: PathBuf, message: String },
    /// The tokenizer could not be loaded or failed on an input.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template could not be compiled or rendered.
    #[error("chat template: {0}")]
    Template(String),
}

impl TextError {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        TextError::Io {
            path: path.into(),
            source,
        }
    }
}
