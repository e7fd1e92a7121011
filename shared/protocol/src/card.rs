//! The model card: what a worker tells discovery about the model it serves, so routers can
//! route to it and tokenize for it.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelCard {
    /// The name clients ask for (`model` in the OpenAI API).
    pub served_model_name: String,
    /// Hash over tokenizer.json and the chat template; workers of one model must agree.
    pub tokenizer_hash: String,
    /// Longest request (prompt + output) in tokens.
    pub context_length: u32,
    pub kv_cache_block_size: u32,
    /// `float32` or `bfloat16`.
    pub kv_dtype: String,
    /// Identity of the KV layout (model, dtype, block size, shapes, version) as a hash.
    pub kv_layout_id: String,
    pub total_kv_blocks: u32,
    pub max_num_seqs: u32,
    pub max_num_batched_tokens: u32,
    /// `agg`, `pd`, `prefill`, `decode` or `encode`.
    pub role: String,
    /// Where the worker's gRPC service is reached (advertised address).
    pub grpc_addr: String,
    /// Where its `/metrics` and `/health` are served.
    pub http_addr: String,
    pub instance_id: u64,
    /// End-of-sequence token ids.
    pub eos_token_ids: Vec<u32>,
}
