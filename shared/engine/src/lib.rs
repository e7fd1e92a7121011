//! The Tandem inference engine: model files, tokenizer and chat templates, the paged KV cache
//! with prefix reuse and block events, the scheduler, the sampler and the compute backends.

#![deny(clippy::too_many_lines, clippy::too_many_arguments)]

pub mod backend;
pub mod engine;
pub mod error;
pub mod failpoints;
pub mod kv;
pub mod model;
pub mod request;
pub mod sampler;
pub mod scheduler;
pub mod sequence;
pub mod tiny;
pub mod tokenizer;
