//! What goes into the engine (a request), what comes out (a stream of outputs), and the state
//! of a request exported to another engine instance.

use serde::{Deserialize, Serialize};

use std::sync::Arc;

use crate::kv::hash::CacheSalt;
use crate::kv::layout::KvLayout;
use crate::sampler::{SamplerState, SamplingParams, StopMatcher, TokenLogprob};
pub use crate::sequence::FinishReason;
pub use tandem_kv_protocol::MediaSpan;

/// A tokenized request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    /// Unique among the engine's live requests.
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// Its blocks are hashed under this salt: they are shared only with requests of the same
    /// salt (see [`CacheSalt`]).
    #[serde(default)]
    pub cache_salt: Option<CacheSalt>,
    /// Media (image) embeddings spliced into the prompt: each replaces the token embeddings
    /// of its span's placeholder tokens; the spans' content hashes are part of the block
    /// hashes.
    #[serde(default)]
    pub media: Vec<MediaEmbedding>,
    /// Request migration: the last this many prompt tokens are output an earlier engine
    /// generated (see [`crate::sampler::SamplerState::replayed`]); `params.max_tokens` counts
    /// only what is still to come.
    #[serde(default)]
    pub replayed: usize,
}

/// An image's embeddings (a vision encoder's projected features): `span.len` rows of the
/// model's `hidden_size` values that replace the embeddings of the prompt's placeholder
/// tokens `span.start..span.start + span.len`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MediaEmbedding {
    pub span: MediaSpan,
    /// Row-major `[span.len, hidden_size]`.
    pub data: Arc<Vec<f32>>,
}

impl MediaEmbedding {
    /// The row of prompt position `pos`, when the span covers it.
    pub fn row(&self, pos: usize, hidden: usize) -> Option<&[f32]> {
        let i = pos.checked_sub(self.span.start)?;
        if i >= self.span.len {
            return None;
        }
        self.data.get(i * hidden..(i + 1) * hidden)
    }
}

/// Token counts of one choice, sent with its last output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache (or from an import) rather than
    /// being computed here.
    pub cached_tokens: usize,
}

/// One increment of one choice of a request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestOutput {
    pub request_id: String,
    /// Choice index (`0..n`).
    pub index: usize,
    /// New tokens (usually one).
    pub token_ids: Vec<u32>,
    /// New text: always valid UTF-8 and never part of a stop string; may be empty while text
    /// is held back.
    pub text: String,
    /// One entry per new token when logprobs were asked for.
    pub logprobs: Vec<TokenLogprob>,
    /// Set on the choice's last output.
    pub finish_reason: Option<FinishReason>,
    /// The stop string or stop token id that ended the choice, when one did.
    pub stop_reason: Option<StopReason>,
    /// Set on the choice's last output.
    pub usage: Option<Usage>,
    /// Set when the engine failed the request (the finish reason is then `abort`).
    pub error: Option<String>,
    /// Beam search: the hypothesis' score (`sum_logprobs / len ** length_penalty`), on its
    /// only output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub score: Option<f32>,
}

impl RequestOutput {
    /// Appends `next`, the following output of the same choice, to this one, so that tokens
    /// that were ready together travel as one output; gives `next` back when it cannot be
    /// merged (another choice, or this output already ends its choice or carries a score).
    pub fn absorb(&mut self, next: RequestOutput) -> Result<(), Box<RequestOutput>> {
        let ended = self.finish_reason.is_some() || self.error.is_some() || self.score.is_some();
        if ended || next.index != self.index || next.score.is_some() {
            return Err(Box::new(next));
        }
        self.token_ids.extend_from_slice(&next.token_ids);
        self.text.push_str(&next.text);
        self.logprobs.extend(next.logprobs);
        self.finish_reason = next.finish_reason;
        self.stop_reason = next.stop_reason;
        self.usage = next.usage;
        self.error = next.error;
        Ok(())
    }
}

pub use tandem_text::StopReason;

/// Everything about one in-flight sequence that another engine needs to continue it exactly:
/// tokens so far, how many have KV (shipped beside it), the sampler's RNG and penalty counts,
/// and the held-back text of a partial stop-string match. The incremental detokenizer is
/// rebuilt from the generated tokens, which determine it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SequenceState {
    pub request_id: String,
    pub index: usize,
    pub params: SamplingParams,
    /// Prompt then generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub max_tokens: usize,
    /// Leading tokens whose KV is in the exported blocks.
    pub num_computed: usize,
    pub cached_prompt_tokens: usize,
    pub sampler: SamplerState,
    pub stop: StopMatcher,
    /// The request's cache salt: the continuing engine hashes the blocks under it.
    #[serde(default)]
    pub cache_salt: Option<CacheSalt>,
    /// The prompt's media spans (their hashes are part of the block hashes). The embeddings
    /// themselves stay with the engine that computed the prompt.
    #[serde(default)]
    pub media: Vec<MediaSpan>,
}

/// An exported request: its state, the layout its KV was written in, and the KV bytes of
/// `ceil(num_computed / block_size)` blocks in layout order.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSnapshot {
    pub layout: KvLayout,
    pub state: SequenceState,
    pub kv: Vec<u8>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(index: usize, token: u32, text: &str, finish: Option<FinishReason>) -> RequestOutput {
        RequestOutput {
            request_id: "r".into(),
            index,
            token_ids: vec![token],
            text: text.into(),
            logprobs: Vec::new(),
            finish_reason: finish,
            stop_reason: None,
            usage: finish.map(|_| Usage::default()),
            error: None,
            score: None,
        }
    }

    #[test]
    fn outputs_of_one_choice_merge_until_it_ends() {
        let mut a = out(0, 1, "he", None);
        assert!(a.absorb(out(0, 2, "llo", None)).is_ok());
        assert!(a.absorb(out(0, 3, "!", Some(FinishReason::Stop))).is_ok());
        assert_eq!(
            (a.token_ids.as_slice(), a.text.as_str()),
            (&[1, 2, 3][..], "hello!")
        );
        assert_eq!(a.finish_reason, Some(FinishReason::Stop));
        assert!(a.usage.is_some());
        // Nothing follows a choice's last output, nor joins another choice's.
        assert_eq!(
            a.absorb(out(0, 4, "x", None)),
            Err(Box::new(out(0, 4, "x", None)))
        );
        let mut b = out(0, 1, "a", None);
        assert!(b.absorb(out(1, 2, "b", None)).is_err());
    }
}
