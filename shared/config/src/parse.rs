//! Entry points: turn a command line and an environment into a validated config.

use crate::error::ConfigError;
use crate::options_build;
use crate::resolve::{resolve, EnvLookup, Resolved};
use crate::runtime::RuntimeConfig;
use crate::spec::Scope;
use crate::worker::*;
use serde::Serialize;

fn about(role: Role) -> &'static str {
    match role {
        Role::Prefill => "Tandem prefill worker: computes prompts and pushes their KV blocks to decode workers.",
        Role::Decode => "Tandem decode worker: generates tokens (aggregated with --disaggregation-mode agg, or pd).",
        Role::Encode => "Tandem encode worker: turns multimodal inputs into embeddings.",
    }
}

/// The clap command of a worker binary (for `--help` and the docs generator).
pub fn worker_command(role: Role) -> clap::Command {
    crate::cli::command(role.binary(), about(role), Scope::Worker)
}

/// The clap command of the router.
pub fn router_command() -> clap::Command {
    crate::cli::command(
        "tandem-router",
        "Tandem router: OpenAI-compatible HTTP API with KV-aware routing.",
        Scope::Router,
    )
}

/// Parses and validates a worker's configuration. `args` starts with the program name.
pub fn parse_worker(
    role: Role,
    args: &[String],
    env: EnvLookup<'_>,
) -> Result<WorkerConfig, ConfigError> {
    let resolved = resolve(worker_command(role), Scope::Worker, args, env)?;
    let cfg = worker_from_resolved(role, &resolved, env)?;
    crate::validate::validate(&cfg, &resolved)?;
    crate::validate::reject_unimplemented(&cfg, &resolved)?;
    Ok(cfg)
}

fn worker_from_resolved(
    role: Role,
    resolved: &Resolved,
    env: EnvLookup<'_>,
) -> Result<WorkerConfig, ConfigError> {
    let g = Get(resolved);
    let mut warnings = resolved.warnings.clone();
    let disaggregation_mode = disaggregation_mode(role, resolved, &mut warnings)?;
    let model_loader_extra_config = match g.opt_string("model-loader-extra-config")? {
        None => None,
        Some(text) => match serde_json::from_str::<serde_json::Value>(&text) {
            Ok(v @ serde_json::Value::Object(_)) => Some(v),
            _ => {
                return Err(ConfigError::InvalidValue {
                    origin: resolved.origin("model-loader-extra-config"),
                    value: text,
                    reason: "must be a JSON object".into(),
                })
            }
        },
    };
    let encode_endpoint = match g.opt_string("encode-endpoint")? {
        None => None,
        Some(text) => Some(
            crate::endpoint::EndpointAddr::parse(&text).map_err(|reason| {
                ConfigError::InvalidValue {
                    origin: resolved.origin("encode-endpoint"),
                    value: text,
                    reason,
                }
            })?,
        ),
    };
    // --enable-multimodal and --modality multimodal imply each other (Dynamo's rule).
    let mut modality = g.string("modality")?;
    let mut enable_multimodal = g.bool("enable-multimodal")?;
    if enable_multimodal && modality == "text" {
        modality = "multimodal".into();
    }
    if modality == "multimodal" {
        enable_multimodal = true;
    }
    let built = options_build::build(resolved)?;
    warnings.extend(built.warnings);
    let runtime = RuntimeConfig::from_resolved(resolved, true, env)?;
    let connectors = &runtime.connector;
    if connectors.len() > 1 {
        return Err(ConfigError::InvalidValue {
            origin: resolved.origin("connector"),
            value: connectors.join(","),
            reason: "at most one connector may be given".into(),
        });
    }
    if let Some(bad) = connectors
        .iter()
        .find(|c| !matches!(c.as_str(), "none" | "kvbm"))
    {
        return Err(ConfigError::InvalidValue {
            origin: resolved.origin("connector"),
            value: bad.clone(),
            reason: "expected none or kvbm".into(),
        });
    }
    for t in &runtime.endpoint_types {
        if !matches!(t.as_str(), "chat" | "completions" | "none") {
            return Err(ConfigError::InvalidValue {
                origin: resolved.origin("endpoint-types"),
                value: t.clone(),
                reason: "expected chat, completions or none".into(),
            });
        }
    }
    let advertise = g.opt_string("rpc-advertise-host")?;
    let device_text = g.string("device")?;
    let device =
        device_text
            .parse::<DeviceChoice>()
            .map_err(|reason| ConfigError::InvalidValue {
                origin: resolved.origin("device"),
                value: device_text.clone(),
                reason,
            })?;
    Ok(WorkerConfig {
        role,
        model: ModelLoading {
            model_path: g.opt_string("model-path")?,
            served_model_name: g.opt_string("served-model-name")?,
            load_format: g.string("load-format")?,
            model_loader_extra_config,
            device,
            cuda_precision: g.string("cuda-precision")?,
        },
        parallelism: Parallelism {
            tensor_parallel_size: g.u32("tensor-parallel-size")?,
            pipeline_parallel_size: g.u32("pipeline-parallel-size")?,
            expert_parallel_size: g.opt_u32("expert-parallel-size")?,
            enable_attention_dp: g.bool("enable-attention-dp")?,
            conversation_affinity: g.bool("conversation-affinity")?,
            conversation_affinity_dp_rank_source: g
                .string("conversation-affinity-dp-rank-source")?,
            gpus_per_node: g.opt_u32("gpus-per-node")?,
        },
        limits: Limits {
            max_batch_size: g.u32("max-batch-size")?,
            max_num_tokens: g.u32("max-num-tokens")?,
            max_seq_len: g.opt_u32("max-seq-len")?,
            max_beam_width: g.u32("max-beam-width")?,
        },
        kv_cache: KvCache {
            kv_block_size: g.u32("kv-block-size")?,
            free_gpu_memory_fraction: g.f64("free-gpu-memory-fraction")?,
            publish_kv_events: g.bool("publish-kv-events")?,
        },
        engine_args: EngineArgs {
            extra_engine_args: g.opt_string("extra-engine-args")?.map(Into::into),
            override_engine_args: g.opt_string("override-engine-args")?,
            strict_engine_args: g.bool("strict-engine-args")?,
        },
        disaggregation: Disaggregation {
            disaggregation_mode,
            enable_multimodal,
            modality,
            encode_endpoint,
            allowed_local_media_path: g.opt_string("allowed-local-media-path")?.map(Into::into),
            max_file_size_mb: g.u32("max-file-size-mb")?,
            frontend_decoding: g.bool("frontend-decoding")?,
            kv_lease_ttl_secs: g.u32("kv-lease-ttl-secs")?,
            kv_lease_reclaim_margin_secs: g.u32("kv-lease-reclaim-margin-secs")?,
            kv_transfer_layer_groups: g.u32("kv-transfer-layer-groups")?,
            first_token_before_kv_writes: g.bool("first-token-before-kv-writes")?,
        },
        guided_decoding_backend: g.opt_string("guided-decoding-backend")?,
        diffusion: Diffusion {
            quant_algo: g.opt_string("quant-algo")?,
            quant_dynamic: g.bool("quant-dynamic")?,
            enable_teacache: g.bool("enable-teacache")?,
            teacache_use_ret_steps: g.bool("teacache-use-ret-steps")?,
            teacache_thresh: g.f64("teacache-thresh")?,
            torch_dtype: g.string("torch-dtype")?,
            revision: g.opt_string("revision")?,
            disable_torch_compile: g.bool("disable-torch-compile")?,
            enable_fullgraph: g.bool("enable-fullgraph")?,
            enable_cuda_graph: g.bool("enable-cuda-graph")?,
            attn_backend: g.string("attn-backend")?,
            dit_ulysses_size: g.u32("dit-ulysses-size")?,
            dit_ring_size: g.u32("dit-ring-size")?,
            dit_cfg_size: g.u32("dit-cfg-size")?,
            enable_layerwise_nvtx_marker: g.bool("enable-layerwise-nvtx-marker")?,
            skip_warmup: g.bool("skip-warmup")?,
            default_height: g.u32("default-height")?,
            default_width: g.u32("default-width")?,
            default_num_inference_steps: g.u32("default-num-inference-steps")?,
            default_guidance_scale: g.f64("default-guidance-scale")?,
            default_num_frames: g.u32("default-num-frames")?,
            default_num_images_per_prompt: g.u32("default-num-images-per-prompt")?,
        },
        runtime,
        network: Network {
            rpc_host: g
                .opt_string("rpc-host")?
                .unwrap_or_else(|| default_bind_host(advertise.as_deref())),
            rpc_port: g.port("rpc-port")?,
            kv_transfer_port: g.port("kv-transfer-port")?,
            rpc_advertise_host: advertise.clone(),
            system_host: g
                .opt_string("system-host")?
                .unwrap_or_else(|| default_bind_host(advertise.as_deref())),
            system_port: g.port("system-port")?,
        },
        engine: built.options,
        print_config: g.bool("print-config")?,
        warnings,
    })
}

/// The router's limits on image inputs (`--allowed-local-media-path`, `--max-file-size-mb`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MediaLimits {
    pub allowed_local_media_path: Option<std::path::PathBuf>,
    pub max_file_size_mb: u32,
    /// Most images per chat request (`--max-images-per-request`).
    pub max_images_per_request: u32,
    /// http(s) image URLs may reach internal addresses (`--media-allow-internal`).
    pub allow_internal: bool,
    /// Bound on fetching one http(s) image URL.
    pub fetch_timeout_secs: u32,
}

/// Request migration (Dynamo's semantics): a request whose worker's stream breaks is sent
/// again, with the output so far, to another worker, up to `limit` times.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct MigrationConfig {
    /// `--migration-limit`: 0 turns migration off.
    pub limit: u32,
    /// `--migration-max-seq-len`: a request whose prompt plus output is longer does not
    /// migrate (`None`: any length).
    pub max_seq_len: Option<u32>,
}

/// The router's configuration.
#[derive(Clone, Debug, Serialize)]
pub struct RouterConfig {
    pub http_host: String,
    pub http_port: u16,
    pub http_body_limit_mb: u32,
    pub request_timeout_secs: u32,
    /// Image inputs: where `file:` URLs may be read from and how large an image may be.
    pub media: MediaLimits,
    pub sse_idle_timeout_secs: u32,
    /// Request migration when a worker's stream breaks.
    pub migration: MigrationConfig,
    pub http: HttpServerConfig,
    pub admission: AdmissionConfig,
    pub routing: RoutingConfig,
    pub security: SecurityConfig,
    pub runtime: RuntimeConfig,
    #[serde(skip)]
    pub print_config: bool,
    #[serde(skip)]
    pub warnings: Vec<String>,
}

/// How the router's HTTP server treats connections.
#[derive(Clone, Debug, Serialize)]
pub struct HttpServerConfig {
    pub header_read_timeout_secs: u32,
    pub body_read_timeout_secs: u32,
    pub max_connections: u32,
}

/// Who may use the public port, over what, and what it tells them.
#[derive(Clone, Debug, Serialize)]
pub struct SecurityConfig {
    /// `--api-key`, `TANDEM_API_KEYS` and `--api-key-file`, without duplicates, in that order.
    pub api_keys: ApiKeys,
    /// `--admin-host`/`--admin-port`; `None`: no admin listener.
    pub admin: Option<AdminListener>,
    /// `--expose-worker-id`.
    pub expose_worker_id: bool,
    /// `--cache-salt-per-api-key`: each key's requests are hashed under a salt of its own.
    pub cache_salt_per_api_key: bool,
    /// `--tls-cert-path`/`--tls-key-path`; `None`: plain HTTP.
    pub tls: Option<TlsFiles>,
}

/// The API keys. Neither `Debug` nor `Serialize` shows them (`--print-config` prints how
/// many there are).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ApiKeys(Vec<String>);

impl ApiKeys {
    pub fn new(keys: Vec<String>) -> Self {
        let mut unique: Vec<String> = Vec::with_capacity(keys.len());
        for k in keys {
            if !unique.contains(&k) {
                unique.push(k);
            }
        }
        ApiKeys(unique)
    }
    pub fn keys(&self) -> &[String] {
        &self.0
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} redacted)", self.0.len())
    }
}

impl Serialize for ApiKeys {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{} key(s), redacted", self.0.len()))
    }
}

/// Where the admin listener binds.
#[derive(Clone, Debug, Serialize)]
pub struct AdminListener {
    pub host: String,
    pub port: u16,
}

/// The public port's certificate chain and private key, PEM files.
#[derive(Clone, Debug, Serialize)]
pub struct TlsFiles {
    pub cert_path: std::path::PathBuf,
    pub key_path: std::path::PathBuf,
}

/// Which requests the router admits now, which wait, and which it refuses.
#[derive(Clone, Debug, Serialize)]
pub struct AdmissionConfig {
    /// Dynamo's `router_queue_threshold`: a fraction of `max_num_batched_tokens`; `None`: no
    /// queue (busy workers give 503).
    pub queue_threshold: Option<f64>,
    /// Shortest prompt first among equal priorities (`wspt`), else arrival order (`fcfs`).
    pub queue_shortest_first: bool,
    pub queue_max_requests: u32,
    /// Token-bucket rates; 0 turns a limit off.
    pub rate_limit_requests_per_sec: f64,
    pub rate_limit_tokens_per_sec: f64,
}

/// KV-aware routing settings (Dynamo's `KvRouterConfig` names).
#[derive(Clone, Debug, Serialize)]
pub struct RoutingConfig {
    pub router_mode: String,
    pub overlap_score_weight: f64,
    pub router_temperature: f64,
    pub use_kv_events: bool,
    pub track_active_blocks: bool,
    pub assume_kv_reuse: bool,
    pub track_prefill_tokens: bool,
    pub active_decode_blocks_threshold: f64,
    pub active_prefill_tokens_threshold: u32,
    pub active_prefill_tokens_threshold_frac: f64,
    pub router_min_initial_workers: u32,
    pub router_ttl_secs: f64,
    pub router_max_tree_size: u32,
    pub router_prune_target_ratio: f64,
    /// Always prefill on a prefill worker when the model has decode workers in `pd`/`decode`.
    pub enforce_disagg: bool,
    /// Prefill locally when fewer prompt tokens than this are uncached on the decode worker.
    pub disagg_prefill_threshold_tokens: u32,
    /// Prefill locally when the decode worker holds at least this fraction of the prompt.
    pub disagg_decode_hit_ratio: f64,
    /// `--router-replica-sync`: share in-flight load with the other routers over NATS.
    pub replica_sync: bool,
}

pub fn parse_router(args: &[String], env: EnvLookup<'_>) -> Result<RouterConfig, ConfigError> {
    let resolved = resolve(router_command(), Scope::Router, args, env)?;
    crate::validate::reject_unimplemented_router(&resolved)?;
    let g = Get(&resolved);
    let port = g.u32("http-port")?;
    let http_port = u16::try_from(port).map_err(|_| ConfigError::InvalidValue {
        origin: resolved.origin("http-port"),
        value: port.to_string(),
        reason: "must be a TCP port (0-65535)".into(),
    })?;
    let non_negative = |name: &str| -> Result<f64, ConfigError> {
        let v = g.f64(name)?;
        if v < 0.0 {
            return Err(ConfigError::InvalidValue {
                origin: resolved.origin(name),
                value: v.to_string(),
                reason: "must be >= 0".into(),
            });
        }
        Ok(v)
    };
    Ok(RouterConfig {
        http_host: g.string("http-host")?,
        http_port,
        http_body_limit_mb: g.u32("http-body-limit-mb")?,
        media: MediaLimits {
            allowed_local_media_path: g
                .opt_string("allowed-local-media-path")?
                .filter(|p| !p.is_empty())
                .map(Into::into),
            max_file_size_mb: g.u32("max-file-size-mb")?,
            max_images_per_request: g.u32("max-images-per-request")?,
            allow_internal: g.bool("media-allow-internal")?,
            fetch_timeout_secs: g.u32("media-fetch-timeout-secs")?,
        },
        request_timeout_secs: g.u32("request-timeout-secs")?,
        sse_idle_timeout_secs: g.u32("sse-idle-timeout-secs")?,
        migration: MigrationConfig {
            limit: g.u32("migration-limit")?,
            max_seq_len: g.opt_u32("migration-max-seq-len")?,
        },
        http: HttpServerConfig {
            header_read_timeout_secs: g.u32("http-header-read-timeout-secs")?,
            body_read_timeout_secs: g.u32("http-body-read-timeout-secs")?,
            max_connections: g.u32("http-max-connections")?,
        },
        admission: admission(&resolved)?,
        security: security(&resolved)?,
        routing: RoutingConfig {
            router_mode: g.string("router-mode")?,
            overlap_score_weight: non_negative("router-kv-overlap-score-weight")?,
            router_temperature: non_negative("router-temperature")?,
            use_kv_events: g.bool("router-kv-events")?,
            track_active_blocks: g.bool("router-track-active-blocks")?,
            assume_kv_reuse: g.bool("router-assume-kv-reuse")?,
            track_prefill_tokens: g.bool("router-track-prefill-tokens")?,
            active_decode_blocks_threshold: non_negative("active-decode-blocks-threshold")?,
            active_prefill_tokens_threshold: g.u32("active-prefill-tokens-threshold")?,
            active_prefill_tokens_threshold_frac: non_negative(
                "active-prefill-tokens-threshold-frac",
            )?,
            router_min_initial_workers: g.u32("router-min-initial-workers")?,
            router_ttl_secs: non_negative("router-ttl-secs")?,
            router_max_tree_size: g.u32("router-max-tree-size")?,
            replica_sync: replica_sync(&resolved)?,
            enforce_disagg: g.bool("enforce-disagg")?,
            disagg_prefill_threshold_tokens: g.u32("disagg-prefill-threshold-tokens")?,
            disagg_decode_hit_ratio: {
                let v = g.f64("disagg-decode-hit-ratio")?;
                if !(0.0..=1.0).contains(&v) {
                    return Err(ConfigError::InvalidValue {
                        origin: resolved.origin("disagg-decode-hit-ratio"),
                        value: v.to_string(),
                        reason: "must be in [0, 1]".into(),
                    });
                }
                v
            },
            router_prune_target_ratio: {
                let v = g.f64("router-prune-target-ratio")?;
                if !(0.0..=1.0).contains(&v) {
                    return Err(ConfigError::InvalidValue {
                        origin: resolved.origin("router-prune-target-ratio"),
                        value: v.to_string(),
                        reason: "must be in [0, 1]".into(),
                    });
                }
                v
            },
        },
        runtime: RuntimeConfig::from_resolved(&resolved, false, env)?,
        print_config: g.bool("print-config")?,
        warnings: resolved.warnings.clone(),
    })
}

/// `--router-replica-sync`, which travels on the NATS event plane.
fn replica_sync(resolved: &Resolved) -> Result<bool, ConfigError> {
    let g = Get(resolved);
    let on = g.bool("router-replica-sync")?;
    if on && g.string("event-plane")? != "nats" {
        return Err(ConfigError::InvalidValue {
            origin: resolved.origin("router-replica-sync"),
            value: "true".into(),
            reason: "router replicas share their load over NATS: it needs --event-plane nats"
                .into(),
        });
    }
    Ok(on)
}

/// The public port's API keys, admin listener, worker-id header and TLS files.
fn security(resolved: &Resolved) -> Result<SecurityConfig, ConfigError> {
    let g = Get(resolved);
    let mut keys: Vec<String> = resolved
        .get("api-key")
        .and_then(|v| v.as_list())
        .map(<[String]>::to_vec)
        .unwrap_or_default();
    if let Some(path) = g.opt_string("api-key-file")? {
        keys.extend(read_key_file(std::path::Path::new(&path))?);
    }
    // A key travels in an HTTP header: visible ASCII only. The error never shows the key.
    if let Some(i) = keys
        .iter()
        .position(|k| !k.bytes().all(|b| b.is_ascii_graphic()))
    {
        return Err(ConfigError::Invalid(format!(
            "API key #{} (--api-key / TANDEM_API_KEYS): only visible ASCII characters are allowed",
            i + 1
        )));
    }
    let admin = match g.opt_u32("admin-port")? {
        None => None,
        Some(port) => Some(AdminListener {
            host: g.string("admin-host")?,
            port: u16::try_from(port).map_err(|_| ConfigError::InvalidValue {
                origin: resolved.origin("admin-port"),
                value: port.to_string(),
                reason: "must be a TCP port (0-65535)".into(),
            })?,
        }),
    };
    let cert = g.opt_string("tls-cert-path")?.filter(|s| !s.is_empty());
    let key = g.opt_string("tls-key-path")?.filter(|s| !s.is_empty());
    let tls = match (cert, key) {
        (None, None) => None,
        (Some(cert), Some(key)) => Some(TlsFiles {
            cert_path: cert.into(),
            key_path: key.into(),
        }),
        (Some(_), None) | (None, Some(_)) => {
            return Err(ConfigError::Invalid(
                "--tls-cert-path and --tls-key-path go together: give both to serve HTTPS, \
                 or neither"
                    .into(),
            ))
        }
    };
    let api_keys = ApiKeys::new(keys);
    let cache_salt_per_api_key = g.bool("cache-salt-per-api-key")?;
    if cache_salt_per_api_key && api_keys.is_empty() {
        return Err(ConfigError::Invalid(
            "--cache-salt-per-api-key salts each API key's KV cache, but no API key is set: \
             give --api-key, TANDEM_API_KEYS or --api-key-file"
                .into(),
        ));
    }
    Ok(SecurityConfig {
        api_keys,
        admin,
        expose_worker_id: g.bool("expose-worker-id")?,
        cache_salt_per_api_key,
        tls,
    })
}

/// The keys of an `--api-key-file`: one a line, surrounding blanks trimmed, blank lines and
/// `#` comments skipped. A file without any key is an error: it would leave the API open.
fn read_key_file(path: &std::path::Path) -> Result<Vec<String>, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        ConfigError::Invalid(format!(
            "--api-key-file {}: cannot read the file: {e}",
            path.display()
        ))
    })?;
    let mut keys = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if !line.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ConfigError::Invalid(format!(
                "--api-key-file {}: line {}: an API key is one word of visible ASCII characters",
                path.display(),
                n + 1
            )));
        }
        keys.push(line.to_string());
    }
    if keys.is_empty() {
        return Err(ConfigError::Invalid(format!(
            "--api-key-file {}: no API key in the file (one key per line; blank lines and # \
             comments are ignored)",
            path.display()
        )));
    }
    Ok(keys)
}

/// The router's queue and rate limits.
fn admission(resolved: &Resolved) -> Result<AdmissionConfig, ConfigError> {
    let g = Get(resolved);
    let invalid = |name: &str, value: String, reason: &str| ConfigError::InvalidValue {
        origin: resolved.origin(name),
        value,
        reason: reason.into(),
    };
    let raw = g.string("router-queue-threshold")?;
    let queue_threshold = match raw.trim() {
        "none" | "None" | "off" => None,
        v => match v.parse::<f64>() {
            Ok(f) if f.is_finite() && f >= 0.0 => Some(f),
            _ => {
                return Err(invalid(
                    "router-queue-threshold",
                    raw,
                    "must be a number >= 0 or `none`",
                ))
            }
        },
    };
    let rate = |name: &str| -> Result<f64, ConfigError> {
        let v = g.f64(name)?;
        if v < 0.0 {
            return Err(invalid(
                name,
                v.to_string(),
                "must be >= 0 (0 turns the limit off)",
            ));
        }
        Ok(v)
    };
    Ok(AdmissionConfig {
        queue_threshold,
        queue_shortest_first: g.string("router-queue-policy")? == "wspt",
        queue_max_requests: g.u32("router-queue-max-requests")?,
        rate_limit_requests_per_sec: rate("rate-limit-requests-per-sec")?,
        rate_limit_tokens_per_sec: rate("rate-limit-tokens-per-sec")?,
    })
}

impl WorkerConfig {
    /// The resolved config and engine options as pretty JSON (`--print-config`).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }

    /// Writes the JSON to `--dump-config-to`, if given.
    pub fn dump_if_requested(&self) -> Result<(), ConfigError> {
        if let Some(path) = &self.runtime.dump_config_to {
            std::fs::write(path, self.to_json()).map_err(|source| ConfigError::Io {
                path: path.clone(),
                source,
            })?;
        }
        Ok(())
    }

    /// The endpoint this worker serves: `--endpoint`, else `dyn://{ns}.{component}.generate`.
    pub fn endpoint(&self) -> crate::endpoint::EndpointAddr {
        if let Some(e) = &self.runtime.endpoint {
            return e.clone();
        }
        let component = match self.disaggregation.disaggregation_mode {
            DisaggregationMode::Prefill => "prefill",
            DisaggregationMode::Encode => "encode",
            _ => "backend",
        };
        crate::endpoint::EndpointAddr {
            namespace: self.runtime.namespace.clone(),
            component: component.into(),
            endpoint: "generate".into(),
        }
    }
}
