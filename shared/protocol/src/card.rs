//! The model card: what a worker tells discovery about the model it serves, so routers can
//! route to it and tokenize for it. It travels as JSON (discovery entries stay readable).

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelCard {
    /// The worker's [`crate::WORKER_PROTOCOL_VERSION`].
    pub protocol_version: u32,
    /// The name clients ask for (`model` in the OpenAI API).
    pub served_model_name: String,
    /// Hash over tokenizer.json and the chat template; workers of one model must agree.
    pub tokenizer_hash: String,
    /// Longest request (prompt + output) in tokens.
    pub context_length: u32,
    pub kv_cache_block_size: u32,
    pub kv_dtype: KvDtype,
    /// Identity of the KV layout (model, dtype, block size, shapes, version) as a hash.
    pub kv_layout_id: String,
    pub total_kv_blocks: u32,
    pub max_num_seqs: u32,
    pub max_num_batched_tokens: u32,
    pub role: WorkerRole,
    /// Where the worker's gRPC service is reached (advertised address).
    pub grpc_addr: String,
    /// Where its `/metrics` and `/health` are served.
    pub http_addr: String,
    pub instance_id: u64,
    /// End-of-sequence token ids.
    pub eos_token_ids: Vec<u32>,
    /// Hex Ed25519 public key the worker signs its NATS KV events with; a router drops any
    /// event claiming this worker that the key does not verify.
    #[serde(default)]
    pub kv_event_key: String,
    /// Set when the model takes images: how the router builds their prompts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multimodal: Option<MultimodalCard>,
    /// `--dyn-tool-call-parser`: the format the router parses tool calls from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_parser: Option<String>,
    /// `--dyn-reasoning-parser`: the format the router splits reasoning from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_parser: Option<String>,
}

/// What a router needs to build an image prompt for a multimodal (LLaVA) model: each image
/// the chat template places as one `image_token_id` becomes `tokens_per_image` of them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MultimodalCard {
    pub image_token_id: u32,
    pub tokens_per_image: u32,
    pub max_images_per_request: u32,
}

/// What a worker does in (dis)aggregated serving: its `--disaggregation-mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerRole {
    /// Prefill and decode on the same engine.
    Agg,
    /// Decode worker that prefills long uncached prompts on a prefill worker.
    Pd,
    /// Prefill worker: only called by decode workers.
    Prefill,
    /// Decode worker that always prefills remotely.
    Decode,
    /// Encode worker (multimodal; not routed to yet).
    Encode,
}

impl WorkerRole {
    /// The name used in discovery and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerRole::Agg => "agg",
            WorkerRole::Pd => "pd",
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
            WorkerRole::Encode => "encode",
        }
    }
}

impl std::fmt::Display for WorkerRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The element type of a worker's KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    Float32,
    Bfloat16,
    Float16,
    /// FP8 e4m3 with a scale per (token, KV head).
    Fp8,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_and_dtypes_keep_their_lowercase_names_in_json() {
        for role in [
            WorkerRole::Agg,
            WorkerRole::Pd,
            WorkerRole::Prefill,
            WorkerRole::Decode,
            WorkerRole::Encode,
        ] {
            let json = serde_json::to_value(role).expect("role");
            assert_eq!(json, serde_json::json!(role.as_str()));
            assert_eq!(serde_json::from_value::<WorkerRole>(json).ok(), Some(role));
        }
        for (dtype, name) in [
            (KvDtype::Float32, "float32"),
            (KvDtype::Bfloat16, "bfloat16"),
            (KvDtype::Float16, "float16"),
            (KvDtype::Fp8, "fp8"),
        ] {
            assert_eq!(
                serde_json::to_value(dtype).ok(),
                Some(serde_json::json!(name))
            );
        }
        assert!(serde_json::from_value::<WorkerRole>(serde_json::json!("router")).is_err());
    }
}
