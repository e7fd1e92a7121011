//! The tokenizer, chat templates and incremental detokenizer come from `tandem-text` (the
//! router shares them); GGUF files carry their own tokenizer, turned into the same files here.

pub mod gguf;

pub use tandem_text::{
    chat, incremental, tokenizer_hash, ChatTemplate, IncrementalDecoder, Tokenizer,
};
