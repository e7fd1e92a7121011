//! The model's tokenizer (`tokenizer.json` through the `tokenizers` crate) and the tokenizer
//! hash workers and routers compare.

use std::path::Path;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::chat::ChatTemplate;
use crate::error::TextError;
use crate::fast_bpe::{FastBpe, Piece};
use crate::fast_decode::ByteLevelDecoder;
use crate::hex;

/// A model's tokenizer.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// sha256 of `tokenizer.json` (combined with the template in [`tokenizer_hash`]).
    file_sha256: String,
    /// The longest token string of the vocabulary, in bytes (see [`Tokenizer::min_tokens`]).
    max_token_bytes: usize,
    /// Ids-only encoding for byte-level BPE vocabularies, equal to `inner`'s (see
    /// [`crate::fast_bpe`]); `None` for other tokenizers.
    fast: Option<Arc<FastBpe>>,
    /// Every id's bytes, for vocabularies whose decoder is `ByteLevel`: decoding equal to
    /// `inner`'s (see [`crate::fast_decode`]); `None` for other tokenizers.
    fast_decode: Option<Arc<ByteLevelDecoder>>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("sha256", &self.file_sha256)
            .finish()
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` from a model folder.
    pub fn load(folder: &Path) -> Result<Self, TextError> {
        let path = folder.join("tokenizer.json");
        if !path.is_file() {
            return Err(TextError::MissingFile {
                folder: folder.to_path_buf(),
                file: "tokenizer.json".into(),
            });
        }
        let bytes = std::fs::read(&path).map_err(|e| TextError::io(&path, e))?;
        Self::from_bytes(&bytes, &path.display().to_string())
    }

    /// A tokenizer from the bytes of a `tokenizer.json`; `origin` names them in errors.
    pub fn from_bytes(bytes: &[u8], origin: &str) -> Result<Self, TextError> {
        let inner = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| TextError::Tokenizer(format!("{origin}: cannot load: {e}")))?;
        let (max_token_bytes, max_id) = vocab_extent(&inner);
        let fast = match serde_json::from_slice(bytes)
            .map_err(|_| None)
            .and_then(|json| FastBpe::from_json(&json, |t| inner.token_to_id(t)).map_err(Some))
        {
            Ok(fast) => Some(Arc::new(fast)),
            Err(why) => {
                if let Some(why) = why {
                    tracing::debug!("{origin}: encoded by `tokenizers` alone: {why}");
                }
                None
            }
        };
        let fast_decode = max_id
            .and_then(|max_id| ByteLevelDecoder::new(&inner, max_id))
            .map(Arc::new);
        Ok(Tokenizer {
            inner,
            file_sha256: hex(&Sha256::digest(bytes)),
            max_token_bytes,
            fast,
            fast_decode,
        })
    }

    /// A lower bound on the tokens `text_bytes` bytes of text encode to, known before
    /// encoding: a token's string spells its bytes at least once (byte-level and
    /// SentencePiece vocabularies write each input byte as one or more bytes; byte-fallback
    /// tokens as six), and normalisation (NFC, NFKC) shrinks text at most threefold. An
    /// oversized prompt is refused on this bound without being tokenized.
    pub fn min_tokens(&self, text_bytes: usize) -> usize {
        text_bytes / (3 * self.max_token_bytes)
    }

    /// Token ids of `text`. Chat prompts are rendered by the template with their special
    /// tokens spelled out, so `add_special_tokens` is normally false (Qwen3 adds none anyway).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TextError> {
        let Some(pieces) = self
            .fast
            .as_ref()
            .and_then(|f| f.encode(text, add_special_tokens))
        else {
            return self.encode_slow(text, add_special_tokens);
        };
        let mut ids = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Ids(part) if ids.is_empty() => ids = part,
                Piece::Ids(part) => ids.extend_from_slice(&part),
                Piece::Slow(range) => ids.extend(self.encode_slow(&text[range], false)?),
            }
        }
        Ok(ids)
    }

    /// `text` through `tokenizers`: ids only, no character offsets tracked (`encode_fast`).
    fn encode_slow(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TextError> {
        let enc = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TextError::Tokenizer(format!("encode: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Whether [`Tokenizer::encode`] has its fast path for this vocabulary.
    pub fn has_fast_path(&self) -> bool {
        self.fast.is_some()
    }

    /// Whether [`Tokenizer::decode`] has its fast path for this vocabulary.
    pub fn has_fast_decode(&self) -> bool {
        self.fast_decode.is_some()
    }

    /// Text of `ids`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TextError> {
        if let Some(fast) = &self.fast_decode {
            return Ok(fast.decode(ids, skip_special_tokens));
        }
        self.decode_slow(ids, skip_special_tokens)
    }

    /// Text of `ids` through `tokenizers`.
    pub fn decode_slow(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TextError> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TextError::Tokenizer(format!("decode: {e}")))
    }

    /// Id of a token string (e.g. `<|im_end|>`), if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// sha256 of `tokenizer.json`.
    pub fn file_sha256(&self) -> &str {
        &self.file_sha256
    }

    /// The wrapped `tokenizers` object, for callers that need more (e.g. grammar engines).
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// The longest token's length in bytes (at least 1) and the highest id, from one walk of
/// the vocabulary (a map of every token's string: building it is the costly part).
fn vocab_extent(tok: &tokenizers::Tokenizer) -> (usize, Option<u32>) {
    let vocab = tok.get_vocab(true);
    let longest = vocab.keys().map(String::len).max().unwrap_or(1).max(1);
    (longest, vocab.into_values().max())
}

/// The tokenizer hash of the model card: sha256 over the sha256 of `tokenizer.json` and the
/// chat template source, so a change of either changes it.
pub fn tokenizer_hash(tokenizer: &Tokenizer, template: Option<&ChatTemplate>) -> String {
    let mut h = Sha256::new();
    h.update(tokenizer.file_sha256().as_bytes());
    h.update([0u8]);
    if let Some(t) = template {
        h.update(t.source().as_bytes());
    }
    hex(&h.finalize())
}
