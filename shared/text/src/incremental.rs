//! Turns a growing list of token ids into text deltas that are always valid UTF-8.
//!
//! Byte-level BPE tokens can split a character (an emoji, a CJK character) across tokens:
//! decoding token by token would emit U+FFFD. The decoder keeps a window of recent ids,
//! decodes `prefix` and `prefix + new` and emits the difference only once the new text no
//! longer ends in an incomplete character (decoded as U+FFFD). Decoding with the prefix also
//! gets word-boundary spaces right for tokenizers whose decoders strip a leading space.

use crate::error::TextError;
use crate::tokenizer::Tokenizer;

/// Incremental detokenizer for one sequence.
#[derive(Clone, Debug, Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    /// Start of the ids whose text was already emitted, kept as decoding context.
    prefix_start: usize,
    /// End of the ids whose text was emitted.
    read_start: usize,
    skip_special_tokens: bool,
}

impl IncrementalDecoder {
    pub fn new(skip_special_tokens: bool) -> Self {
        IncrementalDecoder {
            skip_special_tokens,
            ..Default::default()
        }
    }

    /// All ids pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Adds one token and returns the text that became complete with it (maybe empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TextError> {
        self.ids.push(id);
        let skip = self.skip_special_tokens;
        let prefix = tok.decode(&self.ids[self.prefix_start..self.read_start], skip)?;
        let full = tok.decode(&self.ids[self.prefix_start..], skip)?;
        if full.len() > prefix.len()
            && !full.ends_with('\u{FFFD}')
            && full.is_char_boundary(prefix.len())
        {
            let delta = full[prefix.len()..].to_string();
            self.prefix_start = self.read_start;
            self.read_start = self.ids.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// Text still held back (an incomplete character at the end), emitted as decoded (with
    /// U+FFFD) when the sequence ends.
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String, TextError> {
        let skip = self.skip_special_tokens;
        let prefix = tok.decode(&self.ids[self.prefix_start..self.read_start], skip)?;
        let full = tok.decode(&self.ids[self.prefix_start..], skip)?;
        self.prefix_start = self.ids.len();
        self.read_start = self.ids.len();
        Ok(full.get(prefix.len()..).unwrap_or_default().to_string())
    }
}
