//! The typed engine options: the TensorRT-LLM LLM-API keys that Tandem's engine honours,
//! built from the flags and then deep-merged with `--extra-engine-args` (YAML) and
//! `--override-engine-args` / `--trtllm.*` (see docs/config.md, "Merge rules").

use crate::merge::KeyKind;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EngineOptions {
    /// Always `pytorch`: Tandem's engine stands where TensorRT-LLM's PyTorch backend does.
    pub backend: String,
    pub max_batch_size: u32,
    pub max_num_tokens: u32,
    pub max_seq_len: Option<u32>,
    pub max_beam_width: u32,
    pub tensor_parallel_size: u32,
    pub pipeline_parallel_size: u32,
    pub moe_expert_parallel_size: Option<u32>,
    pub enable_attention_dp: bool,
    pub gpus_per_node: Option<u32>,
    pub kv_cache_config: KvCacheConfig,
    /// Split long prompts over several steps within `max_num_tokens`. On by default (TensorRT-LLM
    /// defaults it off), so a prompt longer than one step's budget is served, not refused.
    pub enable_chunked_prefill: bool,
    /// `null` disables CUDA graphs.
    pub cuda_graph_config: Option<CudaGraphConfig>,
    pub scheduler_config: SchedulerConfig,
    pub cache_transceiver_config: CacheTransceiverConfig,
    pub disable_overlap_scheduler: bool,
    pub guided_decoding_backend: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct KvCacheConfig {
    pub free_gpu_memory_fraction: f64,
    pub enable_block_reuse: bool,
    /// Pool size in tokens; overrides the memory-fraction rule when set.
    pub max_tokens: Option<u64>,
    /// Events kept for replay by late or lagging subscribers.
    pub event_buffer_max_size: u64,
    pub dtype: KvCacheDtype,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvCacheDtype {
    /// On CUDA f16 (`--cuda-precision bf16x2`, the default, and `f16`) or bf16 (`bf16`); f32
    /// on CPU.
    Auto,
    Float32,
    Bfloat16,
    #[serde(alias = "fp16", alias = "half")]
    Float16,
    /// FP8 e4m3 with an f32 scale per (token, KV head): half a 16-bit cache's bytes (CUDA
    /// with `--cuda-precision bf16x2` or `bf16`, and the CPU backend).
    #[serde(alias = "fp8_e4m3", alias = "e4m3")]
    Fp8,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CudaGraphConfig {
    pub max_batch_size: u32,
    pub enable_padding: bool,
    /// Explicit capture sizes; derived from `max_batch_size` when unset.
    pub batch_sizes: Option<Vec<u32>>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SchedulerConfig {
    pub capacity_scheduler_policy: CapacitySchedulerPolicy,
}

/// How the scheduler admits requests (see the engine's scheduler docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum CapacitySchedulerPolicy {
    /// Admit only what fits to completion (prompt + max_tokens); never preempts.
    GuaranteedNoEvict,
    /// Admit greedily; preempt (recompute) the newest sequences when blocks run out.
    MaxUtilization,
    /// Run a batch to completion before admitting more (not implemented yet).
    StaticBatch,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CacheTransceiverConfig {
    pub backend: TransceiverBackend,
    pub max_tokens_in_buffer: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum TransceiverBackend {
    /// UCX.
    Default,
    Ucx,
    Tcp,
    Nixl,
    Mpi,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            backend: "pytorch".into(),
            max_batch_size: 2048,
            max_num_tokens: 8192,
            max_seq_len: None,
            max_beam_width: 1,
            tensor_parallel_size: 1,
            pipeline_parallel_size: 1,
            moe_expert_parallel_size: None,
            enable_attention_dp: false,
            gpus_per_node: None,
            kv_cache_config: KvCacheConfig::default(),
            enable_chunked_prefill: true,
            cuda_graph_config: Some(CudaGraphConfig::default()),
            scheduler_config: SchedulerConfig::default(),
            cache_transceiver_config: CacheTransceiverConfig::default(),
            disable_overlap_scheduler: false,
            guided_decoding_backend: None,
        }
    }
}

impl Default for KvCacheConfig {
    fn default() -> Self {
        KvCacheConfig {
            free_gpu_memory_fraction: 0.9,
            enable_block_reuse: true,
            max_tokens: None,
            event_buffer_max_size: 100_000,
            dtype: KvCacheDtype::Auto,
        }
    }
}

impl Default for CudaGraphConfig {
    fn default() -> Self {
        CudaGraphConfig {
            max_batch_size: 128,
            enable_padding: true,
            batch_sizes: None,
        }
    }
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            capacity_scheduler_policy: CapacitySchedulerPolicy::GuaranteedNoEvict,
        }
    }
}

impl Default for CacheTransceiverConfig {
    fn default() -> Self {
        CacheTransceiverConfig {
            backend: TransceiverBackend::Default,
            max_tokens_in_buffer: None,
        }
    }
}

impl CudaGraphConfig {
    /// The batch sizes to capture: explicit ones, or 1, 2, 4, 8 and multiples of 8 up to the max.
    pub fn capture_sizes(&self) -> Vec<u32> {
        if let Some(sizes) = &self.batch_sizes {
            let mut s = sizes.clone();
            s.sort_unstable();
            s.dedup();
            return s;
        }
        let mut sizes: Vec<u32> = [1, 2, 4]
            .into_iter()
            .filter(|s| *s <= self.max_batch_size)
            .collect();
        sizes.extend(
            (1..)
                .map(|i| i * 8)
                .take_while(|s| *s <= self.max_batch_size),
        );
        sizes
    }
}

const OBJECT_KEYS: &[&str] = &[
    "kv_cache_config",
    "cuda_graph_config",
    "scheduler_config",
    "cache_transceiver_config",
];

const LEAF_KEYS: &[&str] = &[
    "backend",
    "max_batch_size",
    "max_num_tokens",
    "max_seq_len",
    "max_beam_width",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "moe_expert_parallel_size",
    "enable_attention_dp",
    "gpus_per_node",
    "enable_chunked_prefill",
    "disable_overlap_scheduler",
    "guided_decoding_backend",
    "kv_cache_config.free_gpu_memory_fraction",
    "kv_cache_config.enable_block_reuse",
    "kv_cache_config.max_tokens",
    "kv_cache_config.event_buffer_max_size",
    "kv_cache_config.dtype",
    "cuda_graph_config.max_batch_size",
    "cuda_graph_config.enable_padding",
    "cuda_graph_config.batch_sizes",
    "scheduler_config.capacity_scheduler_policy",
    "cache_transceiver_config.backend",
    "cache_transceiver_config.max_tokens_in_buffer",
];

/// TensorRT-LLM options that exist there but not in Tandem yet: asking for one is an error.
const NOT_IMPLEMENTED_KEYS: &[&str] = &[
    "speculative_config",
    "lora_config",
    "enable_lora",
    "peft_cache_config",
    "kv_connector_config",
    "sleep_config",
    "moe_config",
    "attn_backend",
    "decoding_config",
    "batched_logits_processor",
    "kv_cache_config.enable_partial_reuse",
    "kv_cache_config.host_cache_size",
    "kv_cache_config.max_attention_window",
    "kv_cache_config.sink_token_length",
    "kv_cache_config.secondary_offload_min_priority",
    "kv_cache_config.copy_on_partial_reuse",
    "scheduler_config.context_chunking_policy",
    "scheduler_config.dynamic_batch_config",
];

/// Classifies a dotted key path of an engine-option layer.
pub fn classify_key(path: &str) -> KeyKind {
    if OBJECT_KEYS.contains(&path) {
        KeyKind::Known { object: true }
    } else if LEAF_KEYS.contains(&path) {
        KeyKind::Known { object: false }
    } else if NOT_IMPLEMENTED_KEYS.contains(&path) {
        KeyKind::NotImplemented
    } else {
        KeyKind::Unknown
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_of_the_typed_options_is_classified_known() {
        let value = serde_json::to_value(EngineOptions::default()).unwrap();
        fn walk(v: &serde_json::Value, prefix: &str) {
            if let serde_json::Value::Object(m) = v {
                for (k, inner) in m {
                    let path = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    match classify_key(&path) {
                        KeyKind::Known { object: true } => walk(inner, &path),
                        KeyKind::Known { object: false } => {}
                        _ => panic!("{path} is a field of EngineOptions but not classified known"),
                    }
                }
            }
        }
        walk(&value, "");
    }

    #[test]
    fn cuda_graph_sizes_default_to_powers_then_multiples_of_eight() {
        let c = CudaGraphConfig {
            max_batch_size: 20,
            enable_padding: true,
            batch_sizes: None,
        };
        assert_eq!(c.capture_sizes(), vec![1, 2, 4, 8, 16]);
        let c = CudaGraphConfig {
            batch_sizes: Some(vec![8, 1, 8]),
            ..c
        };
        assert_eq!(c.capture_sizes(), vec![1, 8]);
    }
}
