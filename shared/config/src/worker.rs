//! The typed configuration of a worker process (prefill, decode, encode), grouped as the
//! seed page groups the flags.

use crate::endpoint::EndpointAddr;
use crate::engine_options::EngineOptions;
use crate::error::ConfigError;
use crate::resolve::Resolved;
use crate::runtime::RuntimeConfig;
use serde::Serialize;
use std::path::PathBuf;

/// A worker binary; it decides which disaggregation modes are allowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
    Encode,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DisaggregationMode {
    /// Prefill and decode in one worker.
    Agg,
    /// A decode worker that prefills itself when the router decides it is cheaper.
    Pd,
    Prefill,
    Decode,
    Encode,
}

impl Role {
    pub fn binary(self) -> &'static str {
        match self {
            Role::Prefill => "tandem-prefill",
            Role::Decode => "tandem-decode",
            Role::Encode => "tandem-encode",
        }
    }
    pub fn default_mode(self) -> DisaggregationMode {
        match self {
            Role::Prefill => DisaggregationMode::Prefill,
            Role::Decode => DisaggregationMode::Decode,
            Role::Encode => DisaggregationMode::Encode,
        }
    }
    pub fn allowed_modes(self) -> &'static [DisaggregationMode] {
        use DisaggregationMode::*;
        match self {
            Role::Prefill => &[Prefill],
            Role::Decode => &[Decode, Agg, Pd],
            Role::Encode => &[Encode],
        }
    }
}

impl DisaggregationMode {
    pub fn name(self) -> &'static str {
        match self {
            DisaggregationMode::Agg => "agg",
            DisaggregationMode::Pd => "pd",
            DisaggregationMode::Prefill => "prefill",
            DisaggregationMode::Decode => "decode",
            DisaggregationMode::Encode => "encode",
        }
    }
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "agg" => DisaggregationMode::Agg,
            "pd" => DisaggregationMode::Pd,
            "prefill" => DisaggregationMode::Prefill,
            "decode" => DisaggregationMode::Decode,
            "encode" => DisaggregationMode::Encode,
            _ => return None,
        })
    }
}

/// Where a worker's engine runs (`--device auto|cpu|cuda|cuda:N`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum DeviceChoice {
    /// CUDA when this binary has it and a GPU is visible, else the CPU.
    Auto,
    Cpu,
    /// GPU `ordinal` among those `CUDA_VISIBLE_DEVICES` leaves visible (`cuda` is `cuda:0`).
    Cuda {
        ordinal: u32,
    },
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" | "" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" => Ok(DeviceChoice::Cuda { ordinal: 0 }),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(|ordinal| DeviceChoice::Cuda { ordinal })
                .ok_or_else(|| {
                    "expected auto, cpu, cuda or cuda:N (N a GPU's index, 0 first)".to_string()
                }),
        }
    }
}

impl std::fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceChoice::Auto => f.write_str("auto"),
            DeviceChoice::Cpu => f.write_str("cpu"),
            DeviceChoice::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct ModelLoading {
    /// `None` means the built-in tiny model.
    pub model_path: Option<String>,
    pub served_model_name: Option<String>,
    pub load_format: String,
    pub model_loader_extra_config: Option<serde_json::Value>,
    /// `--device`.
    pub device: DeviceChoice,
    /// `bf16`, `bf16x2` or `f16` (`--cuda-precision`).
    pub cuda_precision: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Parallelism {
    pub tensor_parallel_size: u32,
    pub pipeline_parallel_size: u32,
    pub expert_parallel_size: Option<u32>,
    pub enable_attention_dp: bool,
    pub conversation_affinity: bool,
    pub conversation_affinity_dp_rank_source: String,
    pub gpus_per_node: Option<u32>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Limits {
    pub max_batch_size: u32,
    pub max_num_tokens: u32,
    pub max_seq_len: Option<u32>,
    pub max_beam_width: u32,
}

#[derive(Clone, Debug, Serialize)]
pub struct KvCache {
    pub kv_block_size: u32,
    pub free_gpu_memory_fraction: f64,
    pub publish_kv_events: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct EngineArgs {
    pub extra_engine_args: Option<PathBuf>,
    pub override_engine_args: Option<String>,
    pub strict_engine_args: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct Disaggregation {
    pub disaggregation_mode: DisaggregationMode,
    pub enable_multimodal: bool,
    pub modality: String,
    pub encode_endpoint: Option<EndpointAddr>,
    pub allowed_local_media_path: Option<PathBuf>,
    pub max_file_size_mb: u32,
    pub frontend_decoding: bool,
    /// Seconds a decode worker's reservation for a remote prefill may stay unfinished.
    pub kv_lease_ttl_secs: u32,
    /// Seconds past a revoked lease's TTL after which its blocks are reclaimed without a fence.
    pub kv_lease_reclaim_margin_secs: u32,
    /// `--kv-transfer-layer-groups`: groups of layers a GPU-to-GPU prefill write leaves in
    /// while its step runs (0: whole blocks after the step).
    pub kv_transfer_layer_groups: u32,
    /// `--first-token-before-kv-writes`: a prefill worker sends its first token while the
    /// prompt's last KV writes are in flight.
    pub first_token_before_kv_writes: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct Diffusion {
    pub quant_algo: Option<String>,
    pub quant_dynamic: bool,
    pub enable_teacache: bool,
    pub teacache_use_ret_steps: bool,
    pub teacache_thresh: f64,
    pub torch_dtype: String,
    pub revision: Option<String>,
    pub disable_torch_compile: bool,
    pub enable_fullgraph: bool,
    pub enable_cuda_graph: bool,
    pub attn_backend: String,
    pub dit_ulysses_size: u32,
    pub dit_ring_size: u32,
    pub dit_cfg_size: u32,
    pub enable_layerwise_nvtx_marker: bool,
    pub skip_warmup: bool,
    pub default_height: u32,
    pub default_width: u32,
    pub default_num_inference_steps: u32,
    pub default_guidance_scale: f64,
    pub default_num_frames: u32,
    pub default_num_images_per_prompt: u32,
}

/// The host part of an `--rpc-advertise-host` value (`host`, `host:port`, `ip`, `[ipv6]:port`),
/// unbracketed; `None` for an empty value.
pub fn advertise_host_part(value: &str) -> Option<&str> {
    let v = value.trim();
    if v.is_empty() {
        return None;
    }
    if v.parse::<std::net::IpAddr>().is_ok() {
        return Some(v);
    }
    if let Some(rest) = v.strip_prefix('[') {
        return rest.split_once(']').map(|(h, _)| h);
    }
    match v.rsplit_once(':') {
        Some((h, port)) if !h.contains(':') && port.parse::<u16>().is_ok() => Some(h),
        _ => Some(v),
    }
}

/// Where internal listeners (`--rpc-host`, `--system-host`) bind unless told: the advertised
/// interface (the host of `--rpc-advertise-host`, an IPv6 address bracketed so that
/// `host:port` parses), else loopback. Never the wildcard.
pub fn default_bind_host(advertise: Option<&str>) -> String {
    match advertise.and_then(advertise_host_part) {
        Some(h) if h.parse::<std::net::Ipv6Addr>().is_ok() => format!("[{h}]"),
        Some(h) => h.to_string(),
        None => "127.0.0.1".to_string(),
    }
}

/// Where the worker listens, and the addresses it advertises to other processes.
#[derive(Clone, Debug, Serialize)]
pub struct Network {
    pub rpc_host: String,
    pub rpc_port: u16,
    /// `--kv-transfer-port`: the TCP KV transfer listener's port (0: any free one).
    pub kv_transfer_port: u16,
    pub rpc_advertise_host: Option<String>,
    pub system_host: String,
    pub system_port: u16,
}

/// Everything a worker needs, resolved and validated.
#[derive(Clone, Debug, Serialize)]
pub struct WorkerConfig {
    pub role: Role,
    pub model: ModelLoading,
    pub parallelism: Parallelism,
    pub limits: Limits,
    pub kv_cache: KvCache,
    pub engine_args: EngineArgs,
    pub disaggregation: Disaggregation,
    pub guided_decoding_backend: Option<String>,
    pub diffusion: Diffusion,
    pub runtime: RuntimeConfig,
    pub network: Network,
    /// The merged engine options: authoritative for every key they hold.
    pub engine: EngineOptions,
    #[serde(skip)]
    pub print_config: bool,
    #[serde(skip)]
    pub warnings: Vec<String>,
}

/// Typed access to resolved values. Types are guaranteed by the flag table, so a mismatch is a
/// table bug, reported as an error rather than a panic.
pub(crate) struct Get<'a>(pub &'a Resolved);

impl Get<'_> {
    fn missing(name: &str) -> ConfigError {
        ConfigError::Invalid(format!(
            "--{name}: internal error: no value of the expected type"
        ))
    }
    pub fn bool(&self, name: &str) -> Result<bool, ConfigError> {
        self.0
            .get(name)
            .and_then(|v| v.as_bool())
            .ok_or_else(|| Self::missing(name))
    }
    pub fn u32(&self, name: &str) -> Result<u32, ConfigError> {
        self.opt_u32(name)?.ok_or_else(|| Self::missing(name))
    }
    pub fn opt_u32(&self, name: &str) -> Result<Option<u32>, ConfigError> {
        match self.0.get(name) {
            None => Ok(None),
            Some(v) => {
                let i = v.as_int().ok_or_else(|| Self::missing(name))?;
                u32::try_from(i)
                    .map(Some)
                    .map_err(|_| ConfigError::InvalidValue {
                        origin: self.0.origin(name),
                        value: i.to_string(),
                        reason: format!("must be at most {}", u32::MAX),
                    })
            }
        }
    }
    pub fn f64(&self, name: &str) -> Result<f64, ConfigError> {
        self.0
            .get(name)
            .and_then(|v| v.as_float())
            .ok_or_else(|| Self::missing(name))
    }
    pub fn string(&self, name: &str) -> Result<String, ConfigError> {
        self.opt_string(name)?.ok_or_else(|| Self::missing(name))
    }
    /// Unset and empty both read as `None`.
    pub fn opt_string(&self, name: &str) -> Result<Option<String>, ConfigError> {
        match self.0.get(name) {
            None => Ok(None),
            Some(v) => {
                let s = v.as_str().ok_or_else(|| Self::missing(name))?;
                Ok((!s.is_empty()).then(|| s.to_string()))
            }
        }
    }
    pub fn port(&self, name: &str) -> Result<u16, ConfigError> {
        let v = self.u32(name)?;
        u16::try_from(v).map_err(|_| ConfigError::InvalidValue {
            origin: self.0.origin(name),
            value: v.to_string(),
            reason: "must be a TCP port (0-65535)".into(),
        })
    }
    pub fn list(&self, name: &str) -> Result<Vec<String>, ConfigError> {
        Ok(self
            .0
            .get(name)
            .and_then(|v| v.as_list())
            .map(<[String]>::to_vec)
            .unwrap_or_default())
    }
}

pub(crate) fn disaggregation_mode(
    role: Role,
    resolved: &Resolved,
    warnings: &mut Vec<String>,
) -> Result<DisaggregationMode, ConfigError> {
    let Some(raw) = Get(resolved).opt_string("disaggregation-mode")? else {
        return Ok(role.default_mode());
    };
    let mode = if raw == "prefill_and_decode" {
        warnings.push(
            "--disaggregation-mode prefill_and_decode is deprecated: it means agg; use agg \
             (aggregated) or pd (decode worker that may prefill itself)"
                .into(),
        );
        DisaggregationMode::Agg
    } else {
        DisaggregationMode::parse(&raw).ok_or_else(|| ConfigError::InvalidValue {
            origin: resolved.origin("disaggregation-mode"),
            value: raw.clone(),
            reason: "unknown mode".into(),
        })?
    };
    if !role.allowed_modes().contains(&mode) {
        let allowed: Vec<&str> = role.allowed_modes().iter().map(|m| m.name()).collect();
        return Err(ConfigError::InvalidValue {
            origin: resolved.origin("disaggregation-mode"),
            value: raw,
            reason: format!("{} accepts only: {}", role.binary(), allowed.join(", ")),
        });
    }
    Ok(mode)
}

impl WorkerConfig {
    /// The name the model is served under: the flag, else the model folder's name.
    pub fn served_model_name(&self) -> String {
        if let Some(name) = &self.model.served_model_name {
            return name.clone();
        }
        match &self.model.model_path {
            None => "tandem-tiny".into(),
            Some(p) => std::path::Path::new(p.trim_end_matches('/'))
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| p.clone()),
        }
    }
}
