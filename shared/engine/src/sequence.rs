//! One sequence (one choice of one request) as the scheduler and the engine loop see it.
//!
//! `tokens` holds the prompt followed by the generated tokens; `num_computed` of them have their
//! KV in the cache. A sequence is in prefill while more than one token is uncomputed, and in
//! decode when only its last sampled token is. Preemption by recompute simply sets
//! `num_computed` back to zero and releases the blocks: the tokens, the sampler state and the
//! stop matcher are kept, so the recomputed sequence continues exactly where it was.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::kv::block_manager::{BlockTable, HashContext};
use crate::request::MediaEmbedding;
use crate::sampler::guide::Guide;
use crate::sampler::{SamplerState, SamplingParams, StopMatcher};
use crate::tokenizer::incremental::IncrementalDecoder;

pub type SeqId = u64;

/// Why a sequence ended (OpenAI `finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS, a stop token id or a stop string.
    Stop,
    /// `max_tokens` or `max_seq_len` reached.
    Length,
    /// Aborted by the caller.
    Abort,
    /// Exported to another engine, which continues it.
    Migrated,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqStatus {
    Waiting,
    Running,
    Finished(FinishReason),
}

pub struct Sequence {
    pub id: SeqId,
    pub request_id: Arc<str>,
    /// Choice index within the request (for `n > 1`).
    pub index: usize,
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Generation stops after this many tokens (resolved from `max_tokens` / `max_seq_len`).
    pub max_tokens: usize,
    pub num_computed: usize,
    /// Prompt tokens served from the prefix cache at first admission (for usage).
    pub cached_prompt_tokens: Option<usize>,
    pub table: BlockTable,
    /// The prompt's media embeddings, spliced in when their positions are computed.
    pub media: Arc<[MediaEmbedding]>,
    pub status: SeqStatus,
    /// FCFS order: smaller is older.
    pub arrival: u64,
    pub params: Arc<SamplingParams>,
    pub sampler: SamplerState,
    pub stop: StopMatcher,
    /// Incremental detokenizer over the generated tokens (None when the engine has no tokenizer).
    pub decoder: Option<IncrementalDecoder>,
    /// Where the output is in its structured-output grammar (requests with a constraint).
    pub guide: Option<Box<Guide>>,
    pub num_preemptions: u32,
}

/// What a new sequence starts from: its identity, its tokens so far (the prompt, or the
/// tokens of the sequence it continues), its limits and its sampling state.
pub struct NewSequence {
    pub id: SeqId,
    pub request_id: Arc<str>,
    /// Choice index within the request (for `n > 1`).
    pub index: usize,
    /// Taken as the prompt: `prompt_len` is its length.
    pub tokens: Vec<u32>,
    pub max_tokens: usize,
    /// FCFS order: smaller is older.
    pub arrival: u64,
    pub params: Arc<SamplingParams>,
    pub sampler: SamplerState,
    /// What its block hashes cover besides tokens: the request's cache salt and media spans.
    pub hashing: HashContext,
    /// The prompt's media embeddings (empty for text, and on an engine continuing a sequence
    /// another one prefilled).
    pub media: Arc<[MediaEmbedding]>,
}

impl Sequence {
    pub fn new(init: NewSequence) -> Self {
        let NewSequence {
            id,
            request_id,
            index,
            tokens,
            max_tokens,
            arrival,
            params,
            sampler,
            hashing,
            media,
        } = init;
        let stop = StopMatcher::new(&params.stop);
        Self {
            id,
            request_id,
            index,
            prompt_len: tokens.len(),
            tokens,
            max_tokens,
            num_computed: 0,
            cached_prompt_tokens: None,
            table: BlockTable::hashed(hashing),
            media,
            status: SeqStatus::Waiting,
            arrival,
            params,
            sampler,
            stop,
            decoder: None,
            guide: None,
            num_preemptions: 0,
        }
    }

    pub fn num_generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// Tokens whose KV still has to be computed before the next token can be sampled.
    pub fn uncomputed(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    /// Largest total length this sequence can reach.
    pub fn max_total_len(&self) -> usize {
        self.prompt_len + self.max_tokens
    }

    pub fn is_finished(&self) -> bool {
        matches!(self.status, SeqStatus::Finished(_))
    }
}
