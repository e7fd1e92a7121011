//! A fast path for decoding ids to text with byte-level vocabularies (GPT-2 / Llama-3 /
//! Qwen2-3 style, whose decoder is `ByteLevel` alone), byte for byte what the `tokenizers`
//! crate's `decode` produces.
//!
//! `tokenizers` decodes by building each id's token string, then mapping every character of
//! every string back to its byte through a hash map, and finally checking the bytes as UTF-8:
//! a few microseconds per call. The engine's incremental detokenizer decodes a small window
//! of ids twice for every generated token, so at a batch of hundreds of sequences that is a
//! millisecond of the engine thread per step. This module does the same lookups once, at
//! load: every id's bytes in one table, so that a decode is copies and one UTF-8 check.
//!
//! What `tokenizers` does, and this table reproduces: an id is the added vocabulary's token
//! when it has one, else the model's; an id with neither is left out; with
//! `skip_special_tokens`, a token whose string is a special added token's is left out; a
//! token whose characters all map to bytes (GPT-2's byte ↔ character map) gives those bytes,
//! any other its string's own UTF-8; the bytes of all tokens are decoded as UTF-8 with
//! U+FFFD for each invalid sequence.

use std::collections::HashSet;

use tokenizers::DecoderWrapper;

/// One id's text: where its bytes lie in the table, and whether it is special.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    /// No token has this id: decoding leaves it out.
    Missing,
    Token {
        start: u32,
        end: u32,
        special: bool,
    },
}

/// Every id's decoded bytes, for a tokenizer whose decoder is `ByteLevel`.
pub struct ByteLevelDecoder {
    bytes: Vec<u8>,
    entries: Vec<Entry>,
}

impl std::fmt::Debug for ByteLevelDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ByteLevelDecoder")
            .field("ids", &self.entries.len())
            .field("bytes", &self.bytes.len())
            .finish()
    }
}

impl ByteLevelDecoder {
    /// The table for `tok` (whose highest id is `max_id`), or None when its decoder is not
    /// `ByteLevel` alone (those are decoded by `tokenizers`), or its ids do not fit the
    /// table's 32-bit offsets.
    pub fn new(tok: &tokenizers::Tokenizer, max_id: u32) -> Option<Self> {
        if !matches!(tok.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
            return None;
        }
        let special: HashSet<String> = tok
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| t.special)
            .map(|t| t.content)
            .collect();
        let byte_of = crate::fast_bpe::byte_of_char();
        let mut bytes = Vec::new();
        let mut entries = Vec::with_capacity(max_id as usize + 1);
        for id in 0..=max_id {
            let Some(token) = tok.id_to_token(id) else {
                entries.push(Entry::Missing);
                continue;
            };
            let start = u32::try_from(bytes.len()).ok()?;
            match token
                .chars()
                .map(|c| byte_of.get(&c).copied())
                .collect::<Option<Vec<u8>>>()
            {
                Some(b) => bytes.extend_from_slice(&b),
                None => bytes.extend_from_slice(token.as_bytes()),
            }
            entries.push(Entry::Token {
                start,
                end: u32::try_from(bytes.len()).ok()?,
                special: special.contains(&token),
            });
        }
        Some(ByteLevelDecoder { bytes, entries })
    }

    /// The text of `ids`, as `tokenizers::Tokenizer::decode` gives it.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String {
        let mut out = Vec::with_capacity(ids.len() * 8);
        for &id in ids {
            if let Some(&Entry::Token {
                start,
                end,
                special,
            }) = self.entries.get(id as usize)
            {
                if !(skip_special_tokens && special) {
                    out.extend_from_slice(&self.bytes[start as usize..end as usize]);
                }
            }
        }
        match String::from_utf8(out) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer(decoder: &str) -> tokenizers::Tokenizer {
        let mut json = crate::fast_bpe::tests::tiny_json();
        json["decoder"] = serde_json::from_str(decoder).expect("decoder json");
        json["added_tokens"]
            .as_array_mut()
            .expect("added tokens")
            .push(
                serde_json::json!({"id": 301, "content": "plain", "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": false}),
            );
        tokenizers::Tokenizer::from_bytes(json.to_string()).expect("tokenizer")
    }

    fn max_id(tok: &tokenizers::Tokenizer) -> u32 {
        tok.get_vocab(true)
            .into_values()
            .max()
            .expect("a vocabulary")
    }

    const BYTE_LEVEL: &str = r#"{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}"#;

    #[test]
    fn equals_tokenizers_on_every_kind_of_id() {
        let tok = tokenizer(BYTE_LEVEL);
        let fast = ByteLevelDecoder::new(&tok, max_id(&tok)).expect("a ByteLevel decoder");
        // Bytes that form "é" only together, an invalid byte alone, a stray continuation
        // byte, merged tokens, the special and the plain added tokens, ids past the
        // vocabulary and ids in its gaps (259..300).
        let cases: &[&[u32]] = &[
            &[],
            &[0xc3, 0xa9],
            &[0xc3],
            &[b'a' as u32, 0xa9, b'b' as u32],
            &[0xff, 0xfe],
            &[256, 257, 258, b' ' as u32],
            &[300, b'x' as u32, 300],
            &[301, 300, 301],
            &[299, 1_000_000, b'q' as u32, 302],
        ];
        for ids in cases {
            for skip in [false, true] {
                assert_eq!(
                    fast.decode(ids, skip),
                    tok.decode(ids, skip).expect("tokenizers decodes"),
                    "{ids:?}, skip {skip}"
                );
            }
        }
    }

    #[test]
    fn other_decoders_get_no_table() {
        let tok = tokenizer(&format!(
            r#"{{"type": "Sequence", "decoders": [{BYTE_LEVEL}]}}"#
        ));
        assert!(ByteLevelDecoder::new(&tok, max_id(&tok)).is_none());
        let tok = tokenizer(r#"{"type": "Fuse"}"#);
        assert!(ByteLevelDecoder::new(&tok, max_id(&tok)).is_none());
    }
}
