//! The model card a worker publishes in discovery.

use tandem_config::WorkerConfig;
use tandem_engine::kv::layout::KvDtype;
use tandem_protocol::ModelCard;

use crate::BuiltEngine;

/// Identity of a KV layout: workers whose ids differ cannot exchange blocks.
pub fn layout_id(layout: &tandem_engine::kv::layout::KvLayout) -> String {
    let text = serde_json::to_string(layout).unwrap_or_default();
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(text.as_bytes()))
}

pub fn model_card(
    cfg: &WorkerConfig,
    built: &BuiltEngine,
    instance_id: u64,
    grpc_addr: String,
    http_addr: String,
) -> ModelCard {
    let engine_cfg = built.engine.config();
    let layout = built.engine.layout();
    ModelCard {
        served_model_name: cfg.served_model_name(),
        tokenizer_hash: built.model.tokenizer_hash.clone(),
        context_length: engine_cfg.max_seq_len as u32,
        kv_cache_block_size: layout.block_size as u32,
        kv_dtype: match layout.dtype {
            KvDtype::F32 => "float32".into(),
            KvDtype::Bf16 => "bfloat16".into(),
            KvDtype::F16 => "float16".into(),
        },
        kv_layout_id: layout_id(layout),
        total_kv_blocks: built.num_blocks as u32,
        max_num_seqs: engine_cfg.max_batch_size as u32,
        max_num_batched_tokens: engine_cfg.max_num_tokens as u32,
        role: cfg.disaggregation.disaggregation_mode.name().into(),
        grpc_addr,
        http_addr,
        instance_id,
        eos_token_ids: engine_cfg.eos_token_ids.clone(),
    }
}
