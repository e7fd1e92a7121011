//! Text in and out of a model, shared by the router (which tokenizes, renders chat templates,
//! detokenizes and matches stop strings) and the engine (which samples and stops): the
//! tokenizer (`tokenizer.json` through the `tokenizers` crate), chat templates (minijinja),
//! the incremental detokenizer, the stop matcher, sampling parameters with their validation,
//! and the log-probability type. It links no model code.

#![deny(clippy::too_many_lines, clippy::too_many_arguments)]

pub mod chat;
pub mod constraint;
pub mod error;
pub mod fast_bpe;
pub mod fast_decode;
pub mod incremental;
pub mod limits;
pub mod logprob;
pub mod params;
pub mod stop;
pub mod tokenizer;

pub use chat::{ChatRequest, ChatTemplate};
pub use constraint::{Constraint, ConstraintError};
pub use error::TextError;
pub use incremental::IncrementalDecoder;
pub use logprob::TokenLogprob;
pub use params::{ParamsError, SamplingParams};
pub use stop::{StopFeed, StopMatcher, StopReason};
pub use tokenizer::{tokenizer_hash, Tokenizer};

/// Lowercase hex of bytes.
pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}
