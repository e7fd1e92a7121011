//! The model card a worker publishes in discovery.

use tandem_config::{DisaggregationMode, WorkerConfig};
use tandem_engine::kv::layout::KvDtype as EngineKvDtype;
use tandem_protocol::{KvDtype, ModelCard, WorkerRole, WORKER_PROTOCOL_VERSION};

use crate::BuiltEngine;

/// Identity of a KV layout: workers whose ids differ cannot exchange blocks.
pub fn layout_id(layout: &tandem_engine::kv::layout::KvLayout) -> String {
    let text = serde_json::to_string(layout).unwrap_or_default();
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(text.as_bytes()))
}

/// The role a worker announces for its `--disaggregation-mode`.
pub fn role(mode: DisaggregationMode) -> WorkerRole {
    match mode {
        DisaggregationMode::Agg => WorkerRole::Agg,
        DisaggregationMode::Pd => WorkerRole::Pd,
        DisaggregationMode::Prefill => WorkerRole::Prefill,
        DisaggregationMode::Decode => WorkerRole::Decode,
        DisaggregationMode::Encode => WorkerRole::Encode,
    }
}

/// The card's name of a KV cache element type.
pub fn kv_dtype(dtype: EngineKvDtype) -> KvDtype {
    match dtype {
        EngineKvDtype::F32 => KvDtype::Float32,
        EngineKvDtype::Bf16 => KvDtype::Bfloat16,
        EngineKvDtype::F16 => KvDtype::Float16,
        EngineKvDtype::Fp8 => KvDtype::Fp8,
    }
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
        protocol_version: WORKER_PROTOCOL_VERSION,
        served_model_name: cfg.served_model_name(),
        tokenizer_hash: built.model.tokenizer_hash.clone(),
        context_length: engine_cfg.max_seq_len as u32,
        kv_cache_block_size: layout.block_size as u32,
        kv_dtype: kv_dtype(layout.dtype),
        kv_layout_id: layout_id(layout),
        total_kv_blocks: built.num_blocks as u32,
        max_num_seqs: engine_cfg.max_batch_size as u32,
        max_num_batched_tokens: engine_cfg.max_num_tokens as u32,
        role: role(cfg.disaggregation.disaggregation_mode),
        grpc_addr,
        http_addr,
        instance_id,
        eos_token_ids: engine_cfg.eos_token_ids.clone(),
        // Set by the caller, which holds the signing key.
        kv_event_key: String::new(),
        // Image inputs only where they are enabled (else the router refuses them).
        multimodal: if cfg.disaggregation.enable_multimodal {
            crate::media::multimodal_card(&built.model)
        } else {
            None
        },
        tool_call_parser: cfg.runtime.dyn_tool_call_parser.clone(),
        reasoning_parser: cfg.runtime.dyn_reasoning_parser.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_mode_announces_the_role_of_its_name() {
        for mode in [
            DisaggregationMode::Agg,
            DisaggregationMode::Pd,
            DisaggregationMode::Prefill,
            DisaggregationMode::Decode,
            DisaggregationMode::Encode,
        ] {
            assert_eq!(role(mode).as_str(), mode.name());
        }
    }
}
