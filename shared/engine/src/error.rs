//! The engine's error type. Every error that comes from a file names the file, and every
//! tensor problem names the tensor, so that a broken model folder can be fixed from the message.

use std::path::PathBuf;

/// Errors of the engine. Variants are grouped by the module that raises them.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A file or folder could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The model path does not exist or is not a folder.
    #[error("model path {0} does not exist or is not a folder")]
    ModelPathMissing(PathBuf),
    /// A vision tower was asked of a model folder without one.
    #[error("model {0} is not multimodal: its config.json names no vision tower (a LLaVA model has one)")]
    NotMultimodal(PathBuf),
    /// A file that a model folder needs is absent.
    #[error("model folder {folder} lacks {file}")]
    MissingFile { folder: PathBuf, file: String },
    /// A JSON file (config, generation config, tokenizer config, index) is malformed.
    #[error("{path}: {message}")]
    BadFile { path: PathBuf, message: String },
    /// `config.json` names an architecture this engine does not run.
    /// A tensor is missing, has the wrong shape or dtype, or its data is unreadable.
    #[error("{path}: tensor {tensor}: {message}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        message: String,
    },
    /// The tokenizer could not be loaded or failed on an input.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template could not be compiled or rendered.
    #[error("chat template: {0}")]
    Template(String),
    /// Fetching the tokenizer files into the cache failed.
    #[error("fetching the tokenizer files: {0}")]
    Fetch(String),
    /// Writing a built-in tiny model or fetching its tokenizer files failed.
    #[error(transparent)]
    TinyModel(#[from] tandem_tiny_model::TinyModelError),
    /// Two KV layouts differ; the first differing field is named.
    #[error("KV layout mismatch in {field}: ours {ours}, theirs {theirs}")]
    LayoutMismatch {
        field: &'static str,
        ours: String,
        theirs: String,
    },
    /// A backend call got an input it cannot run (bad block id, too few blocks, wrong sizes).
    #[error("invalid backend input: {0}")]
    InvalidInput(String),
    /// A request the engine refuses (bad parameters, too long for `max_seq_len`, ...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// Sampling parameters out of range or over a cap (from `tandem-text`).
    #[error("invalid request: {0}")]
    Params(#[from] tandem_text::ParamsError),

    #[error("invalid request: {0}")]
    Guide(#[from] crate::sampler::guide::GuideError),
    /// The engine already holds its limit of requests (`--engine-request-limit`).
    #[error(
        "the engine is at its limit of {limit} concurrent requests (--engine-request-limit); \
         retry later or on another worker"
    )]
    Overloaded { limit: usize },
    /// The queue of commands to the engine thread is full.
    #[error("the engine's command queue is full ({capacity} commands waiting); retry later")]
    QueueFull { capacity: usize },
    /// A request id that is already in use.
    #[error("request {0:?} is already running")]
    DuplicateRequest(String),
    /// A request id the engine does not know (finished, aborted or never submitted).
    #[error("unknown request {0:?}")]
    UnknownRequest(String),
    /// A reservation (lease) id the engine does not hold (never reserved, released or
    /// activated already).
    #[error("unknown KV reservation (lease {0})")]
    UnknownLease(u64),
    /// A reservation (lease) id that is already held.
    #[error("KV reservation (lease {0}) already exists")]
    DuplicateLease(u64),
    /// Not enough KV blocks for an import or a reservation.
    #[error("out of KV blocks: need {needed}, {available} available")]
    OutOfBlocks { needed: usize, available: usize },
    /// An exported request state that cannot be imported (inconsistent sizes, n > 1, ...).
    #[error("bad request snapshot: {0}")]
    BadSnapshot(String),
    /// An engine configuration that cannot work with its backend.
    #[error("engine config: {0}")]
    Config(String),
    /// The backend failed during a step.
    #[error("backend: {0}")]
    Backend(String),
    /// A tensor-parallel rank failed (or panicked) during a step; the other ranks abandoned
    /// it at their next collective.
    #[error("backend: tensor-parallel rank {rank} failed during the step")]
    RankFailed { rank: usize },
    /// Tokenizer, chat template or their files (from `tandem-text`).
    #[error(transparent)]
    Text(#[from] tandem_text::TextError),
    /// The engine thread has stopped.
    #[error("the engine has stopped")]
    Stopped,
}

/// Who is at fault when the engine refuses or fails something: what a service maps to its
/// status codes (gRPC, HTTP) without reading messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// The caller's input is wrong (parameters, lengths, ids, a malformed snapshot).
    Invalid,
    /// A request, lease or id that is not there (any more).
    NotFound,
    /// An id already in use.
    AlreadyExists,
    /// Out of capacity right now (KV blocks, the request limit): retry later or elsewhere.
    Exhausted,
    /// The engine cannot take work (stopped, shutting down, its queue full).
    Unavailable,
    /// Something failed inside (backend, files, configuration).
    Internal,
}

impl EngineError {
    /// The class of this error, by variant.
    pub fn class(&self) -> ErrorClass {
        use EngineError as E;
        match self {
            E::InvalidRequest(_) | E::Params(_) | E::BadSnapshot(_) | E::LayoutMismatch { .. } => {
                ErrorClass::Invalid
            }
            E::Guide(g) if g.is_invalid_request() => ErrorClass::Invalid,
            E::Guide(_) => ErrorClass::Internal,
            E::UnknownRequest(_) | E::UnknownLease(_) => ErrorClass::NotFound,
            E::DuplicateRequest(_) | E::DuplicateLease(_) => ErrorClass::AlreadyExists,
            E::OutOfBlocks { .. } | E::Overloaded { .. } => ErrorClass::Exhausted,
            E::Stopped | E::QueueFull { .. } => ErrorClass::Unavailable,
            E::Io { .. }
            | E::ModelPathMissing(_)
            | E::NotMultimodal(_)
            | E::MissingFile { .. }
            | E::BadFile { .. }
            | E::Tensor { .. }
            | E::Tokenizer(_)
            | E::Template(_)
            | E::Fetch(_)
            | E::TinyModel(_)
            | E::InvalidInput(_)
            | E::Config(_)
            | E::Backend(_)
            | E::RankFailed { .. }
            | E::Text(_) => ErrorClass::Internal,
        }
    }

    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        EngineError::Io {
            path: path.into(),
            source,
        }
    }
}
