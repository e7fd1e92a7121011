//! Checks run before any work starts: value ranges and combinations, then features that have
//! a flag but are not implemented yet (a non-default value exits with a message naming the
//! flag rather than being ignored).

use crate::engine_options::{CapacitySchedulerPolicy, EngineOptions, TransceiverBackend};
use crate::error::ConfigError;
use crate::resolve::Resolved;
use crate::spec::Group;
use crate::values::parse_value;
use crate::worker::WorkerConfig;

fn invalid(msg: impl Into<String>) -> ConfigError {
    ConfigError::Invalid(msg.into())
}

/// Range and combination checks on the flags and the merged engine options.
pub fn validate(cfg: &WorkerConfig, resolved: &Resolved) -> Result<(), ConfigError> {
    let fraction = cfg.kv_cache.free_gpu_memory_fraction;
    if !(fraction > 0.0 && fraction <= 1.0) {
        return Err(ConfigError::InvalidValue {
            origin: resolved.origin("free-gpu-memory-fraction"),
            value: fraction.to_string(),
            reason: "must be in the range (0, 1]".into(),
        });
    }
    let diffusion = matches!(
        cfg.disaggregation.modality.as_str(),
        "video_diffusion" | "image_diffusion"
    );
    if cfg.disaggregation.enable_multimodal && diffusion {
        return Err(invalid(format!(
            "--enable-multimodal cannot be combined with --modality {} (diffusion modalities use \
             --modality alone)",
            cfg.disaggregation.modality
        )));
    }
    validate_engine(&cfg.engine)?;
    Ok(())
}

fn positive(path: &str, v: Option<u64>) -> Result<(), ConfigError> {
    match v {
        Some(0) => Err(ConfigError::EngineOption {
            path: path.into(),
            message: "must be a positive integer".into(),
        }),
        _ => Ok(()),
    }
}

fn validate_engine(e: &EngineOptions) -> Result<(), ConfigError> {
    let f = e.kv_cache_config.free_gpu_memory_fraction;
    if !(f > 0.0 && f <= 1.0) {
        return Err(ConfigError::EngineOption {
            path: "kv_cache_config.free_gpu_memory_fraction".into(),
            message: format!("{f} is outside the range (0, 1]"),
        });
    }
    positive("max_batch_size", Some(e.max_batch_size.into()))?;
    positive("max_num_tokens", Some(e.max_num_tokens.into()))?;
    positive("max_seq_len", e.max_seq_len.map(u64::from))?;
    positive("max_beam_width", Some(e.max_beam_width.into()))?;
    positive("tensor_parallel_size", Some(e.tensor_parallel_size.into()))?;
    positive(
        "pipeline_parallel_size",
        Some(e.pipeline_parallel_size.into()),
    )?;
    positive(
        "moe_expert_parallel_size",
        e.moe_expert_parallel_size.map(u64::from),
    )?;
    positive("gpus_per_node", e.gpus_per_node.map(u64::from))?;
    positive("kv_cache_config.max_tokens", e.kv_cache_config.max_tokens)?;
    positive(
        "cache_transceiver_config.max_tokens_in_buffer",
        e.cache_transceiver_config.max_tokens_in_buffer,
    )?;
    if let Some(graphs) = &e.cuda_graph_config {
        positive(
            "cuda_graph_config.max_batch_size",
            Some(graphs.max_batch_size.into()),
        )?;
        for size in graphs.batch_sizes.iter().flatten() {
            positive("cuda_graph_config.batch_sizes", Some((*size).into()))?;
        }
    }
    if let Some(gpus) = e.gpus_per_node {
        let world = e.tensor_parallel_size * e.pipeline_parallel_size;
        if world > gpus && !world.is_multiple_of(gpus) {
            return Err(invalid(format!(
                "tensor_parallel_size {} x pipeline_parallel_size {} = {world} GPUs cannot be laid \
                 out on nodes of {gpus} GPUs (--gpus-per-node): use at most {gpus} or a multiple of it",
                e.tensor_parallel_size, e.pipeline_parallel_size
            )));
        }
    }
    if let Some(ep) = e.moe_expert_parallel_size {
        if !e.tensor_parallel_size.is_multiple_of(ep) {
            return Err(invalid(format!(
                "expert parallel size {ep} must divide tensor_parallel_size {}",
                e.tensor_parallel_size
            )));
        }
    }
    Ok(())
}

/// Flags whose non-default value asks for something not implemented yet, with what it is.
/// The list shrinks as features land.
pub const NOT_IMPLEMENTED_FLAGS: &[(&str, &str)] = &[
    (
        "load-format",
        "weight formats other than auto-detected safetensors",
    ),
    ("model-loader-extra-config", "model loader options"),
    ("pipeline-parallel-size", "pipeline parallelism"),
    ("enable-attention-dp", "attention data parallelism"),
    (
        "conversation-affinity",
        "attention-DP conversation affinity",
    ),
    (
        "conversation-affinity-dp-rank-source",
        "attention-DP conversation affinity",
    ),
    ("allowed-local-media-path", "media inputs (multimodal)"),
    ("max-file-size-mb", "media inputs (multimodal)"),
    (
        "frontend-decoding",
        "router-side media decoding (multimodal)",
    ),
    ("guided-decoding-backend", "guided decoding"),
    (
        "exclude-tools-when-tool-choice-none",
        "tool_choice handling",
    ),
    (
        "endpoint-types",
        "registering a subset of API endpoint types",
    ),
    ("output-modalities", "output modalities other than text"),
    ("media-output-fs-url", "media outputs"),
    ("media-output-http-url", "media outputs"),
];

/// Fails on the first flag or engine option that asks for a feature not implemented yet.
pub fn reject_unimplemented(cfg: &WorkerConfig, resolved: &Resolved) -> Result<(), ConfigError> {
    for (name, what) in NOT_IMPLEMENTED_FLAGS {
        check_default(resolved, name, what)?;
    }
    for spec in crate::flags::FLAGS
        .iter()
        .filter(|s| matches!(s.group, Group::Diffusion | Group::DiffusionRequestDefaults))
    {
        check_default(resolved, spec.name, "diffusion models")?;
    }
    if matches!(
        cfg.disaggregation.modality.as_str(),
        "video_diffusion" | "image_diffusion"
    ) {
        return Err(not_impl("--modality", "diffusion modalities"));
    }
    let parsers = [
        (
            "--dyn-tool-call-parser",
            &cfg.runtime.dyn_tool_call_parser,
            crate::flags::TOOL_CALL_PARSERS_BUILT,
            "tool-call",
        ),
        (
            "--dyn-reasoning-parser",
            &cfg.runtime.dyn_reasoning_parser,
            crate::flags::REASONING_PARSERS_BUILT,
            "reasoning",
        ),
    ];
    for (flag, value, built, what) in parsers {
        if let Some(p) = value.as_deref().filter(|p| !built.contains(p)) {
            let what = format!("the {p} {what} format (built: {})", built.join(", "));
            return Err(not_impl(flag, &what));
        }
    }
    let connector_ok = cfg.runtime.connector.iter().all(|c| c == "none");
    if !connector_ok {
        return Err(not_impl("--connector", "KV connectors (kvbm)"));
    }
    let e = &cfg.engine;
    let checks: [(bool, &str, &str); 7] = [
        (
            e.tensor_parallel_size > 1
                && matches!(cfg.model.device, crate::worker::DeviceChoice::Cuda { .. }),
            "tensor_parallel_size",
            TP_ON_CUDA,
        ),
        (
            e.pipeline_parallel_size > 1,
            "pipeline_parallel_size",
            "pipeline parallelism",
        ),
        (
            e.moe_expert_parallel_size.is_some_and(|v| v > 1),
            "moe_expert_parallel_size",
            "expert parallelism",
        ),
        (
            e.enable_attention_dp,
            "enable_attention_dp",
            "attention data parallelism",
        ),
        (
            e.guided_decoding_backend.is_some(),
            "guided_decoding_backend",
            "guided decoding",
        ),
        (
            e.scheduler_config.capacity_scheduler_policy == CapacitySchedulerPolicy::StaticBatch,
            "scheduler_config.capacity_scheduler_policy",
            "the STATIC_BATCH policy",
        ),
        (
            matches!(
                e.cache_transceiver_config.backend,
                TransceiverBackend::Nixl | TransceiverBackend::Mpi
            ),
            "cache_transceiver_config.backend",
            "KV transfer backends other than UCX and TCP",
        ),
    ];
    for (asked, key, what) in checks {
        if asked {
            return Err(not_impl(&format!("engine option `{key}`"), what));
        }
    }
    if e.backend != "pytorch" {
        return Err(not_impl(
            "engine option `backend`",
            "backends other than pytorch (Tandem's own engine)",
        ));
    }
    Ok(())
}

/// What `tensor_parallel_size` above 1 on a GPU asks for that is not built yet.
pub const TP_ON_CUDA: &str = "tensor parallelism on CUDA devices (NCCL); the CPU backend \
     (--device cpu) runs it with one thread per rank";

fn not_impl(flag: &str, what: &str) -> ConfigError {
    ConfigError::NotImplemented {
        flag: flag.into(),
        what: what.into(),
    }
}

pub(crate) fn check_default(
    resolved: &Resolved,
    name: &str,
    what: &str,
) -> Result<(), ConfigError> {
    let Some(spec) = crate::flags::spec(name) else {
        return Ok(());
    };
    let default = spec.default.and_then(|d| parse_value(spec, d).ok());
    let value = resolved.get(name);
    let is_default = match (value, &default) {
        (None, None) => true,
        (Some(v), Some(d)) => v == d,
        // An empty string or list equals "unset".
        (Some(crate::values::Value::Str(s)), None) => s.is_empty(),
        _ => false,
    };
    if is_default {
        Ok(())
    } else {
        Err(not_impl(&resolved.origin(name), what))
    }
}

/// Router flags whose non-default value asks for something not implemented yet.
pub const ROUTER_NOT_IMPLEMENTED_FLAGS: &[(&str, &str)] = &[
    ("router-track-output-blocks", "output-block tracking"),
    ("router-durable-kv-events", "JetStream KV events"),
    ("router-snapshot-threshold", "JetStream KV events"),
    ("router-reset-states", "JetStream KV events"),
    ("router-prefill-load-model", "the aic prefill load model"),
    ("router-event-threads", "multi-threaded event application"),
    ("use-remote-indexer", "remote KV indexers"),
    ("serve-indexer", "remote KV indexers"),
];

pub fn reject_unimplemented_router(resolved: &Resolved) -> Result<(), ConfigError> {
    for (name, what) in ROUTER_NOT_IMPLEMENTED_FLAGS {
        check_default(resolved, name, what)?;
    }
    Ok(())
}
