//! The table of every flag. Names, env vars, defaults and choices follow the TensorRT-LLM
//! worker of Dynamo (the TensorRT-LLM backend's configuration reference); Tandem-specific
//! values (discovery `file`, event plane `direct`, gRPC request plane, the built-in tiny
//! model) are listed in docs/config.md.

use crate::spec::{FlagSpec, Group::*, Kind::*, Scope};

pub const MODALITIES: &[&str] = &["text", "multimodal", "video_diffusion", "image_diffusion"];
pub const DISAGGREGATION_MODES: &[&str] = &[
    "agg",
    "pd",
    "prefill",
    "decode",
    "encode",
    "prefill_and_decode",
];
pub const TOOL_CALL_PARSERS: &[&str] = &[
    "hermes",
    "nemotron_deci",
    "llama3_json",
    "mistral",
    "phi4",
    "pythonic",
    "harmony",
    "deepseek_v3",
    "deepseek_v3_1",
    "deepseek_v3_2",
    "qwen3_coder",
    "jamba",
    "minimax_m2",
    "glm47",
    "kimi_k2",
    "default",
    "nemotron_nano",
];
/// The tool-call formats the router parses (the others are refused as not implemented yet).
pub const TOOL_CALL_PARSERS_BUILT: &[&str] = &[
    "hermes",
    "llama3_json",
    "mistral",
    "jamba",
    "nemotron_deci",
    "phi4",
    "pythonic",
    "qwen3_coder",
    "deepseek_v3",
    "deepseek_v3_1",
    "deepseek_v3_2",
    "kimi_k2",
    "minimax_m2",
    "glm47",
    "nemotron_nano",
    "harmony",
];
/// The reasoning formats the router splits (`<think>` ... `</think>`).
pub const REASONING_PARSERS_BUILT: &[&str] = &["deepseek_r1", "qwen3", "basic"];
pub const REASONING_PARSERS: &[&str] = &[
    "deepseek_r1",
    "basic",
    "gpt_oss",
    "qwen3",
    "nemotron_deci",
    "kimi",
    "kimi_k25",
    "step3",
    "mistral",
    "granite",
    "nemotron_nano",
    "nemotron3",
    "glm45",
];

const INT1: crate::spec::Kind = Int { min: 1 };
const INT0: crate::spec::Kind = Int { min: 0 };

/// Every flag of every role, in `--help` order.
pub static FLAGS: &[FlagSpec] = &[
    // ---- Model loading
    FlagSpec::new("model-path", Str, ModelLoading,
        "Path to a local Hugging Face model folder (or a hub id when online) to serve.")
        .aliases(&["model"]).env("DYN_TRTLLM_MODEL")
        .default_note("the built-in tiny model (generated locally, no download)"),
    FlagSpec::new("served-model-name", Str, ModelLoading,
        "Name to serve the model under in the API; derived from the model path when unset.")
        .env("DYN_TRTLLM_SERVED_MODEL_NAME"),
    FlagSpec::new("load-format", Str, ModelLoading,
        "Model weight loading format; `auto` detects it from the files.")
        .env("DYN_TRTLLM_LOAD_FORMAT").default("auto"),
    FlagSpec::new("device", Str, ModelLoading,
        "Where the engine runs: cuda or cuda:N (the GPU backend on GPU N of those \
         CUDA_VISIBLE_DEVICES leaves visible, cuda being cuda:0; needs a binary built with \
         `--features cuda` and the CUDA driver, NVRTC and cuBLAS libraries), cpu, or auto (cuda \
         when this binary has it and a GPU is visible, else cpu).")
        .env("DYN_TRTLLM_DEVICE").default("auto"),
    FlagSpec::new("cuda-precision", Choice(&["bf16", "bf16x2", "f16"]), ModelLoading,
        "CUDA backend, weights in bf16 throughout: bf16x2 (default: near-f32 activations, as \
         f32 rows in the GEMVs of one- and two-row decode steps and as two bf16 terms per GEMM \
         input from three rows on, for twice those GEMMs' FLOPs; within 3e-3 of f32 logits), \
         bf16 (GEMM inputs rounded to bf16: fastest, ~4e-2 of f32 logits), or f16 (weights \
         converted from bf16, exactly above ~1e-5, GEMM inputs and KV cache in IEEE half: \
         bf16's speed with 8x finer rounding, values limited to +-65504). \
         kv_cache_config.dtype auto picks bf16 for bf16, f16 for bf16x2 and f16; float32 goes \
         with every precision, bfloat16 with bf16 and bf16x2, fp8 (e4m3, a scale per token \
         and KV head: half the bytes) with bf16x2 and bf16.")
        .env("DYN_TRTLLM_CUDA_PRECISION").default("bf16x2"),
    FlagSpec::new("model-loader-extra-config", Str, ModelLoading,
        "JSON object passed as extra configuration to the model loader.")
        .env("DYN_TRTLLM_MODEL_LOADER_EXTRA_CONFIG").default(""),
    // ---- Parallelism
    FlagSpec::new("tensor-parallel-size", INT1, Parallelism,
        "Tensor parallelism degree: ranks each layer's weights, attention heads and KV cache \
         are split across (CPU: threads of the worker; CUDA: not implemented yet).")
        .env("DYN_TRTLLM_TENSOR_PARALLEL_SIZE").default("1"),
    FlagSpec::new("pipeline-parallel-size", INT1, Parallelism,
        "Pipeline parallelism degree (stages the layers are distributed over).")
        .env("DYN_TRTLLM_PIPELINE_PARALLEL_SIZE").default("1"),
    FlagSpec::new("expert-parallel-size", INT1, Parallelism,
        "Expert parallelism degree for mixture-of-experts models; unset means none.")
        .env("DYN_TRTLLM_EXPERT_PARALLEL_SIZE"),
    FlagSpec::new("enable-attention-dp", Bool, Parallelism,
        "Attention data parallelism (attention_dp_size = tensor_parallel_size).")
        .env("DYN_TRTLLM_ENABLE_ATTENTION_DP").default("false"),
    FlagSpec::new("conversation-affinity", Bool, Parallelism,
        "Route each conversation to one attention-DP rank.")
        .env("DYN_ENGINE_CONV_AFFINITY").default("false"),
    FlagSpec::new("conversation-affinity-dp-rank-source", Choice(&["engine", "dynamo"]), Parallelism,
        "Who picks the attention-DP rank under conversation affinity.")
        .env("DYN_ENGINE_CONV_AFFINITY_DP_RANK_SOURCE").default("engine"),
    FlagSpec::new("gpus-per-node", INT1, Parallelism,
        "Number of GPUs per node; inferred from the system when unset.")
        .env("DYN_TRTLLM_GPUS_PER_NODE"),
    // ---- Batch and sequence limits
    FlagSpec::new("max-batch-size", INT1, BatchAndSequenceLimits,
        "Maximum number of requests scheduled in one forward pass (published as max_num_seqs).")
        .env("DYN_TRTLLM_MAX_BATCH_SIZE").default("2048"),
    FlagSpec::new("max-num-tokens", INT1, BatchAndSequenceLimits,
        "Maximum number of batched tokens in one forward pass (published as max_num_batched_tokens).")
        .env("DYN_TRTLLM_MAX_NUM_TOKENS").default("8192"),
    FlagSpec::new("max-seq-len", INT1, BatchAndSequenceLimits,
        "Maximum total length (prompt + output) of one request; deduced from the model when unset.")
        .env("DYN_TRTLLM_MAX_SEQ_LEN"),
    FlagSpec::new("max-beam-width", INT1, BatchAndSequenceLimits,
        "Maximum number of beams for beam search; 1 means no beam search.")
        .env("DYN_TRTLLM_MAX_BEAM_WIDTH").default("1"),
    // ---- KV cache and events
    FlagSpec::new("kv-block-size", INT1, KvCacheAndEvents,
        "Tokens per KV cache block; also the router's hashing granularity.")
        .env("DYN_TRTLLM_KV_BLOCK_SIZE").default("32"),
    FlagSpec::new("free-gpu-memory-fraction", Float, KvCacheAndEvents,
        "Fraction of free accelerator memory (after weights) for the KV cache pool, in (0, 1].")
        .env("DYN_TRTLLM_FREE_GPU_MEMORY_FRACTION").default("0.9"),
    FlagSpec::new("publish-kv-events", Bool, KvCacheAndEvents,
        "Publish KV cache block events for KV-aware routing and disaggregated transfer.")
        .env("DYN_TRTLLM_PUBLISH_KV_EVENTS").default("false")
        .deprecated(&["publish-events-and-metrics"], Some("DYN_TRTLLM_PUBLISH_EVENTS_AND_METRICS")),
    // ---- Engine args passthrough
    FlagSpec::new("extra-engine-args", Path, EngineArgsPassthrough,
        "YAML file of engine options, deep-merged over the flags (see docs/config.md).")
        .env("DYN_TRTLLM_EXTRA_ENGINE_ARGS").default(""),
    FlagSpec::new("override-engine-args", Str, EngineArgsPassthrough,
        "JSON or Python dict literal deep-merged over the YAML; excludes --trtllm.* flags.")
        .env("DYN_TRTLLM_OVERRIDE_ENGINE_ARGS").default(""),
    FlagSpec::new("strict-engine-args", Bool, EngineArgsPassthrough,
        "Treat unknown engine option keys as errors instead of warnings.")
        .env("DYN_TRTLLM_STRICT_ENGINE_ARGS").default("false"),
    // ---- Disaggregation and multimodal
    FlagSpec::new("disaggregation-mode", Choice(DISAGGREGATION_MODES), DisaggregationAndMultimodal,
        "Worker role: agg (prefill+decode), pd (decode that may prefill itself), prefill, decode, encode. \
         The legacy prefill_and_decode maps to agg.")
        .env("DYN_TRTLLM_DISAGGREGATION_MODE").default_note("fixed by the binary (tandem-decode: decode)"),
    FlagSpec::new("enable-multimodal", Bool, DisaggregationAndMultimodal,
        "Enable multimodal (vision-language) request processing.")
        .env("DYN_TRTLLM_ENABLE_MULTIMODAL").default("false"),
    FlagSpec::new("modality", Choice(MODALITIES), DisaggregationAndMultimodal,
        "Modality of the served model.")
        .env("DYN_TRTLLM_MODALITY").default("text"),
    FlagSpec::new("encode-endpoint", Str, DisaggregationAndMultimodal,
        "dyn://namespace.component.endpoint of the encode worker in an EPD topology.")
        .env("DYN_TRTLLM_ENCODE_ENDPOINT").default(""),
    FlagSpec::new("kv-transport", Choice(&["ucx", "tcp"]), DisaggregationAndMultimodal,
        "KV transfer between prefill and decode workers: ucx or tcp. Shorthand for the engine \
         option cache_transceiver_config.backend (default UCX); never falls back silently.")
        .env("DYN_TRTLLM_KV_TRANSPORT"),
    FlagSpec::new("kv-lease-ttl-secs", INT1, DisaggregationAndMultimodal,
        "Decode worker: seconds a reservation of KV blocks for a remote prefill may stay \
         unfinished before it is revoked.")
        .env("DYN_TRTLLM_KV_LEASE_TTL_SECS").default("30"),
    FlagSpec::new("kv-transfer-layer-groups", INT0, DisaggregationAndMultimodal,
        "Prefill worker writing GPU to GPU (--device cuda, UCX): 0 (default) sends the KV \
         blocks a prefill step completes whole, once the step is done; N leaves them in N \
         groups of layers, each put as soon as the step has computed it, so the transfer \
         overlaps the rest of the step (at most one group per layer). On one GPU (cuda_ipc) \
         the grouped writes measured slower (docs/benchmarks.md).")
        .env("DYN_KV_TRANSFER_LAYER_GROUPS").default("0"),
    FlagSpec::new("first-token-before-kv-writes", Bool, DisaggregationAndMultimodal,
        "Prefill worker: send the first token to the decode worker (which streams it at once) \
         as soon as it is sampled, while the prompt's last KV blocks are still being written; \
         false holds it until every write is done, so TTFT includes the transfer. A prefill \
         worker failing after its first token went out fails the request (the router's \
         --migration-limit may continue it elsewhere).")
        .env("DYN_FIRST_TOKEN_BEFORE_KV_WRITES").default("true"),
    FlagSpec::new("kv-lease-reclaim-margin-secs", INT0, DisaggregationAndMultimodal,
        "Decode worker: a revoked reservation whose prefill worker neither answers FenceLease \
         nor is gone is reclaimed this many seconds after its TTL ended (the prefill worker \
         stops writing at the TTL by its own clock; the margin covers the lease's transit and a \
         write in flight).")
        .env("DYN_TRTLLM_KV_LEASE_RECLAIM_MARGIN_SECS").default("30"),
    FlagSpec::new("allowed-local-media-path", Path, DisaggregationAndMultimodal,
        "Local directory that file: image URLs may be read from (the router reads them); \
         unset refuses file: URLs.")
        .env("DYN_TRTLLM_ALLOWED_LOCAL_MEDIA_PATH").default("").scope(Scope::All),
    FlagSpec::new("max-file-size-mb", INT1, DisaggregationAndMultimodal,
        "Maximum size in MB of one image (a file, or a data: URL once decoded) or embedding \
         file; larger ones get 413.")
        .env("DYN_TRTLLM_MAX_FILE_SIZE_MB").default("50").scope(Scope::All),
    FlagSpec::new("max-images-per-request", INT1, DisaggregationAndMultimodal,
        "Most images one chat request may carry (also capped by the model's own limit); with \
         --max-file-size-mb it sets the chat completions body limit.")
        .env("DYN_MAX_IMAGES_PER_REQUEST").default("4").scope(Scope::Router),
    FlagSpec::new("media-allow-internal", Bool, DisaggregationAndMultimodal,
        "Let http(s) image URLs reach loopback, private, link-local and other internal \
         addresses (refused by default, also after a redirect: a guard against SSRF).")
        .env("DYN_MM_ALLOW_INTERNAL").default("false").scope(Scope::Router),
    FlagSpec::new("media-fetch-timeout-secs", INT1, DisaggregationAndMultimodal,
        "Seconds an http(s) image URL may take to fetch (connect, redirects and body).")
        .env("DYN_MEDIA_FETCH_TIMEOUT_SECS").default("10").scope(Scope::Router),
    FlagSpec::new("frontend-decoding", Bool, DisaggregationAndMultimodal,
        "Decode images in the router and ship them to the worker over the KV transport.")
        .env("DYN_TRTLLM_FRONTEND_DECODING").default("false"),
    // ---- Guided decoding
    FlagSpec::new("guided-decoding-backend", Choice(&["xgrammar", "llguidance"]), GuidedDecoding,
        "Backend for guided (structured) decoding; disabled when unset.")
        .env("DYN_TRTLLM_GUIDED_DECODING_BACKEND"),
    // ---- Diffusion
    FlagSpec::new("quant-algo",
        Choice(&["FP8", "FP8_BLOCK_SCALES", "NVFP4", "W4A16_AWQ", "W4A8_AWQ", "W8A8_SQ_PER_CHANNEL"]),
        Diffusion, "Quantization algorithm for diffusion models; none when unset.")
        .env("DYN_TRTLLM_QUANT_ALGO"),
    FlagSpec::new("quant-dynamic", Bool, Diffusion,
        "Quantize BF16 weights on the fly while loading.")
        .env("DYN_TRTLLM_QUANT_DYNAMIC").default("true"),
    FlagSpec::new("enable-teacache", Bool, Diffusion,
        "TeaCache: reuse transformer hidden states across timesteps.")
        .env("DYN_TRTLLM_ENABLE_TEACACHE").default("false"),
    FlagSpec::new("teacache-use-ret-steps", Bool, Diffusion,
        "Use retention steps to choose which timesteps TeaCache caches.")
        .env("DYN_TRTLLM_TEACACHE_USE_RET_STEPS").default("true"),
    FlagSpec::new("teacache-thresh", Float, Diffusion,
        "TeaCache similarity threshold.")
        .env("DYN_TRTLLM_TEACACHE_THRESH").default("0.2"),
    FlagSpec::new("torch-dtype", Choice(&["bfloat16", "float16", "float32"]), Diffusion,
        "Data type for diffusion model loading.")
        .env("DYN_TRTLLM_TORCH_DTYPE").default("bfloat16"),
    FlagSpec::new("revision", Str, Diffusion,
        "Hub revision (branch, tag or commit) of the diffusion model.")
        .env("DYN_TRTLLM_REVISION"),
    FlagSpec::new("disable-torch-compile", Bool, Diffusion,
        "Run the diffusion transformer eagerly instead of compiled.")
        .env("DYN_TRTLLM_DISABLE_TORCH_COMPILE").default("false"),
    FlagSpec::new("enable-fullgraph", Bool, Diffusion,
        "Compile the whole diffusion graph without breaks.")
        .env("DYN_TRTLLM_ENABLE_FULLGRAPH").default("false"),
    FlagSpec::new("enable-cuda-graph", Bool, Diffusion,
        "Capture diffusion transformer forward passes as CUDA graphs.")
        .env("DYN_TRTLLM_ENABLE_CUDA_GRAPH").default("false"),
    FlagSpec::new("attn-backend", Choice(&["VANILLA", "TRTLLM"]), Diffusion,
        "Attention backend of the diffusion transformer.")
        .env("DYN_TRTLLM_ATTN_BACKEND").default("VANILLA"),
    FlagSpec::new("dit-ulysses-size", INT1, Diffusion,
        "Ulysses sequence-parallel degree of the diffusion transformer.")
        .env("DYN_TRTLLM_DIT_ULYSSES_SIZE").default("1"),
    FlagSpec::new("dit-ring-size", INT1, Diffusion,
        "Ring-attention parallel degree of the diffusion transformer.")
        .env("DYN_TRTLLM_DIT_RING_SIZE").default("1"),
    FlagSpec::new("dit-cfg-size", INT1, Diffusion,
        "Classifier-free-guidance parallel degree of the diffusion transformer.")
        .env("DYN_TRTLLM_DIT_CFG_SIZE").default("1"),
    FlagSpec::new("enable-layerwise-nvtx-marker", Bool, Diffusion,
        "Per-layer NVTX ranges in the diffusion forward pass.")
        .env("DYN_TRTLLM_ENABLE_LAYERWISE_NVTX_MARKER").default("false"),
    FlagSpec::new("skip-warmup", Bool, Diffusion,
        "Skip the warm-up inference pass at start-up.")
        .env("DYN_TRTLLM_SKIP_WARMUP").default("false"),
    // ---- Diffusion request defaults
    FlagSpec::new("default-height", INT1, DiffusionRequestDefaults,
        "Default output height in pixels.")
        .env("DYN_TRTLLM_DEFAULT_HEIGHT").default("480"),
    FlagSpec::new("default-width", INT1, DiffusionRequestDefaults,
        "Default output width in pixels.")
        .env("DYN_TRTLLM_DEFAULT_WIDTH").default("832"),
    FlagSpec::new("default-num-inference-steps", INT1, DiffusionRequestDefaults,
        "Default number of denoising steps.")
        .env("DYN_TRTLLM_DEFAULT_NUM_INFERENCE_STEPS").default("50"),
    FlagSpec::new("default-guidance-scale", Float, DiffusionRequestDefaults,
        "Default classifier-free guidance scale.")
        .env("DYN_TRTLLM_DEFAULT_GUIDANCE_SCALE").default("5.0"),
    FlagSpec::new("default-num-frames", INT1, DiffusionRequestDefaults,
        "Default number of video frames.")
        .env("DYN_TRTLLM_DEFAULT_NUM_FRAMES").default("81"),
    FlagSpec::new("default-num-images-per-prompt", INT1, DiffusionRequestDefaults,
        "Default number of images per prompt.")
        .env("DYN_TRTLLM_DEFAULT_NUM_IMAGES_PER_PROMPT").default("1"),
    // ---- Router
    FlagSpec::new("http-host", Str, Router, "Address the OpenAI HTTP API binds to.")
        .env("DYN_HTTP_HOST").default("0.0.0.0").scope(Scope::Router),
    FlagSpec::new("http-port", INT0, Router, "Port of the OpenAI HTTP API; 0 picks a free one.")
        .env("DYN_HTTP_PORT").default("8000").scope(Scope::Router),
    FlagSpec::new("http-body-limit-mb", INT1, Router,
        "Largest accepted request body in MiB; larger bodies get 413. Chat completions take at \
         least --max-images-per-request images of --max-file-size-mb as base64 data: URLs plus \
         1 MiB of text.")
        .env("DYN_HTTP_BODY_LIMIT_MB").default("32").scope(Scope::Router),
    FlagSpec::new("request-timeout-secs", INT1, Router,
        "Deadline of one request, from arrival to its last token.")
        .env("DYN_REQUEST_TIMEOUT_SECS").default("600").scope(Scope::Router),
    FlagSpec::new("sse-idle-timeout-secs", INT1, Router,
        "A streaming client that reads nothing for this long is dropped (its request aborted).")
        .env("DYN_SSE_IDLE_TIMEOUT_SECS").default("30").scope(Scope::Router),
    FlagSpec::new("http-header-read-timeout-secs", INT1, Router,
        "A client must send a request's headers within this many seconds, or its connection is closed.")
        .env("DYN_HTTP_HEADER_READ_TIMEOUT_SECS").default("10").scope(Scope::Router),
    FlagSpec::new("http-body-read-timeout-secs", INT1, Router,
        "A client must send a request's whole body within this many seconds, or gets 408.")
        .env("DYN_HTTP_BODY_READ_TIMEOUT_SECS").default("30").scope(Scope::Router),
    FlagSpec::new("http-max-connections", INT1, Router,
        "Most open HTTP connections; further clients wait to be accepted.")
        .env("DYN_HTTP_MAX_CONNECTIONS").default("4096").scope(Scope::Router),
    FlagSpec::new("rate-limit-requests-per-sec", Float, Router,
        "Requests per second the router admits (token bucket, a second of burst); 0: no limit. \
         Over it, 429 with Retry-After. Per API key when --api-key is set.")
        .env("DYN_RATE_LIMIT_REQUESTS_PER_SEC").default("0").scope(Scope::Router),
    FlagSpec::new("rate-limit-tokens-per-sec", Float, Router,
        "Prompt plus output tokens per second the router admits (token bucket, a second of \
         burst); 0: no limit. Over it, 429 with Retry-After. Per API key when --api-key is set.")
        .env("DYN_RATE_LIMIT_TOKENS_PER_SEC").default("0").scope(Scope::Router),
    FlagSpec::new("router-mode",
        Choice(&["kv", "round-robin", "random", "least-loaded", "power-of-two", "direct"]), Router,
        "How the router picks a worker. Tandem defaults to kv (Dynamo defaults to round-robin).")
        .env("DYN_ROUTER_MODE").default("kv").scope(Scope::Router),
    FlagSpec::new("router-kv-overlap-score-weight", Float, Router,
        "Weight of prefill blocks against decode blocks in the KV routing cost (>= 0).")
        .env("DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT").default("1.0").scope(Scope::Router),
    FlagSpec::new("router-temperature", Float, Router,
        "Softmax temperature over worker costs; 0 picks the cheapest worker.")
        .env("DYN_ROUTER_TEMPERATURE").default("0.0").scope(Scope::Router),
    FlagSpec::new("router-kv-events", Bool, Router,
        "Route on the KV events workers publish.")
        .env("DYN_ROUTER_USE_KV_EVENTS").default("true").scope(Scope::Router),
    FlagSpec::new("router-track-active-blocks", Bool, Router,
        "Count the decode blocks of requests in flight per worker.")
        .env("DYN_ROUTER_TRACK_ACTIVE_BLOCKS").default("true").scope(Scope::Router),
    FlagSpec::new("router-assume-kv-reuse", Bool, Router,
        "Assume blocks shared by requests in flight are stored once.")
        .env("DYN_ROUTER_ASSUME_KV_REUSE").default("true").scope(Scope::Router),
    FlagSpec::new("router-track-prefill-tokens", Bool, Router,
        "Count the prefill tokens of requests in flight per worker.")
        .env("DYN_ROUTER_TRACK_PREFILL_TOKENS").default("true").scope(Scope::Router),
    FlagSpec::new("active-decode-blocks-threshold", Float, Router,
        "A worker whose active decode blocks exceed this fraction of its KV blocks is busy.")
        .env("DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD").default("1.0").scope(Scope::Router),
    FlagSpec::new("active-prefill-tokens-threshold", INT1, Router,
        "A worker with more active prefill tokens than this is busy.")
        .env("DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD").default("10000000").scope(Scope::Router),
    FlagSpec::new("active-prefill-tokens-threshold-frac", Float, Router,
        "A worker with more active prefill tokens than this times max_num_batched_tokens is busy.")
        .env("DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC").default("10.0").scope(Scope::Router),
    FlagSpec::new("router-ttl-secs", Float, Router,
        "Without KV events (--no-router-kv-events): how long a routing decision counts as cached blocks.")
        .env("DYN_ROUTER_TTL_SECS").default("120.0").scope(Scope::Router),
    FlagSpec::new("router-max-tree-size", INT1, Router,
        "Without KV events: most predicted blocks kept before pruning.")
        .env("DYN_ROUTER_MAX_TREE_SIZE").default("1048576").scope(Scope::Router),
    FlagSpec::new("router-prune-target-ratio", Float, Router,
        "Without KV events: prune down to this fraction of --router-max-tree-size, in [0, 1].")
        .env("DYN_ROUTER_PRUNE_TARGET_RATIO").default("0.8").scope(Scope::Router),
    FlagSpec::new("router-track-output-blocks", Bool, Router,
        "Also count the blocks that outputs will grow into.")
        .env("DYN_ROUTER_TRACK_OUTPUT_BLOCKS").default("false").scope(Scope::Router),
    FlagSpec::new("router-replica-sync", Bool, Router,
        "Share the load of in-flight requests with the namespace's other router replicas, over \
         NATS (needs --event-plane nats), so a load balancer can front several routers.")
        .env("DYN_ROUTER_REPLICA_SYNC").default("false").scope(Scope::Router),
    FlagSpec::new("router-durable-kv-events", Bool, Router,
        "Deprecated JetStream-backed KV events.")
        .env("DYN_ROUTER_DURABLE_KV_EVENTS").default("false").scope(Scope::Router),
    FlagSpec::new("router-snapshot-threshold", INT1, Router,
        "JetStream mode: events between index snapshots.")
        .env("DYN_ROUTER_SNAPSHOT_THRESHOLD").default("1000000").scope(Scope::Router),
    FlagSpec::new("router-reset-states", Bool, Router,
        "JetStream mode: purge stored router state at start-up.")
        .env("DYN_ROUTER_RESET_STATES").default("false").scope(Scope::Router),
    FlagSpec::new("router-prefill-load-model", Choice(&["none", "aic"]), Router,
        "Model of prefill load used in routing.")
        .env("DYN_ROUTER_PREFILL_LOAD_MODEL").default("none").scope(Scope::Router),
    FlagSpec::new("router-queue-threshold", Str, Router,
        "Requests wait in the router's queue while every worker has more active prefill tokens \
         than this fraction of its max_num_batched_tokens, or is busy; `none`: no queue, busy \
         workers give 503.")
        .env("DYN_ROUTER_QUEUE_THRESHOLD").default("4.0").scope(Scope::Router),
    FlagSpec::new("router-queue-policy", Choice(&["fcfs", "wspt"]), Router,
        "Order of the request queue after `priority`: fcfs by arrival, wspt shortest prompt first.")
        .env("DYN_ROUTER_QUEUE_POLICY").default("fcfs").scope(Scope::Router),
    FlagSpec::new("router-queue-max-requests", INT1, Router,
        "Most requests waiting in the router's queue; past it, 503 with Retry-After.")
        .env("DYN_ROUTER_QUEUE_MAX_REQUESTS").default("4096").scope(Scope::Router),
    FlagSpec::new("router-event-threads", INT1, Router,
        "Threads applying KV events to the index (Tandem's index is one lock-protected tree).")
        .env("DYN_ROUTER_EVENT_THREADS").default("1").scope(Scope::Router),
    FlagSpec::new("use-remote-indexer", Bool, Router,
        "Query a remote KV indexer instead of keeping one.")
        .env("DYN_USE_REMOTE_INDEXER").default("false").scope(Scope::Router),
    FlagSpec::new("serve-indexer", Bool, Router,
        "Serve this router's KV index to other routers.")
        .env("DYN_SERVE_INDEXER").default("false").scope(Scope::Router),
    FlagSpec::new("enforce-disagg", Bool, Router,
        "Always prefill on a prefill worker (no conditional disaggregation).")
        .env("DYN_ENFORCE_DISAGG").default("false").scope(Scope::Router),
    FlagSpec::new("disagg-prefill-threshold-tokens", INT0, Router,
        "Conditional disaggregation: prefill on the decode worker itself when fewer prompt \
         tokens than this are uncached there. 0: every request with a prefill worker goes remote.")
        .env("DYN_DISAGG_PREFILL_THRESHOLD_TOKENS").default("256").scope(Scope::Router),
    FlagSpec::new("disagg-decode-hit-ratio", Float, Router,
        "Conditional disaggregation: prefill on the decode worker itself when it already holds \
         at least this fraction of the prompt (1 disables the rule).")
        .env("DYN_DISAGG_DECODE_HIT_RATIO").default("0.8").scope(Scope::Router),
    FlagSpec::new("migration-limit", INT0, Router,
        "Times a request may move to another worker when its worker's stream breaks (the \
         prompt and the output so far are replayed there; the client sees one stream); 0: off.")
        .env("DYN_MIGRATION_LIMIT").default("0").scope(Scope::Router),
    FlagSpec::new("migration-max-seq-len", INT1, Router,
        "Longest request (prompt plus output, in tokens) that may migrate.")
        .env("DYN_MIGRATION_MAX_SEQ_LEN").scope(Scope::Router),
    FlagSpec::new("router-min-initial-workers", INT0, Router,
        "Wait for this many workers before serving.")
        .env("DYN_ROUTER_MIN_INITIAL_WORKERS").default("0").scope(Scope::Router),
    // ---- Router: public port security
    FlagSpec::new("api-key", List, Router,
        "API key a client must send (`Authorization: Bearer KEY` or `x-api-key: KEY`) on every \
         route but /health and /live; repeat the flag for several keys (TANDEM_API_KEYS: \
         comma-separated). No key (here or in --api-key-file): the API is open. With keys, \
         the rate limits apply per key.")
        .env("TANDEM_API_KEYS").repeatable().scope(Scope::Router),
    FlagSpec::new("api-key-file", Path, Router,
        "File of API keys, one per line (blank lines and `#` comments ignored), added to \
         --api-key; a missing, unreadable or empty file stops the router at start-up.")
        .env("DYN_API_KEY_FILE").scope(Scope::Router),
    FlagSpec::new("admin-port", INT0, Router,
        "Port of the admin listener, which serves /debug/* (off the public port); 0 picks a \
         free one. Unset: no admin listener.")
        .env("DYN_ADMIN_PORT").scope(Scope::Router),
    FlagSpec::new("admin-host", Str, Router,
        "Address the admin listener binds to (the API keys apply there too).")
        .env("DYN_ADMIN_HOST").default("127.0.0.1").scope(Scope::Router),
    FlagSpec::new("expose-worker-id", Bool, Router,
        "Send the `x-tandem-worker-id` (and `x-tandem-prefill-worker-id`) response headers, \
         which name the worker instances that served a request.")
        .env("DYN_EXPOSE_WORKER_ID").default("false").scope(Scope::Router),
    FlagSpec::new("cache-salt-per-api-key", Bool, Router,
        "Isolate each API key's KV cache: its requests' block hashes are salted with a value \
         derived from the key, so tenants never share cache entries (nor learn from routing \
         or cached-token counts what another tenant sent). Needs API keys. A request's own \
         `cache_salt` is mixed in under its key's.")
        .env("TANDEM_CACHE_SALT_PER_API_KEY").default("false").scope(Scope::Router),
    FlagSpec::new("tls-cert-path", Path, Router,
        "PEM certificate chain of the public port; with --tls-key-path the API is served over \
         HTTPS only. Both or neither.")
        .env("DYN_TLS_CERT_PATH").scope(Scope::Router),
    FlagSpec::new("tls-key-path", Path, Router,
        "PEM private key (PKCS#8, PKCS#1 or SEC1) of --tls-cert-path.")
        .env("DYN_TLS_KEY_PATH").scope(Scope::Router),
    // ---- Runtime (every process)
    FlagSpec::new("rpc-host", Str, Runtime,
        "Address the worker's gRPC service and its TCP KV transfer listener bind to. \
         Default: the host of --rpc-advertise-host when set, else 127.0.0.1; internal \
         listeners never bind every interface unless asked (0.0.0.0, e.g. behind NAT where \
         the advertised address is not local).")
        .env("DYN_TCP_RPC_HOST"),
    FlagSpec::new("rpc-port", INT0, Runtime,
        "Port of the worker's gRPC service; 0 picks a free one.")
        .env("DYN_TCP_RPC_PORT").default("0"),
    FlagSpec::new("kv-transfer-port", INT0, Runtime,
        "Port of the TCP KV transfer listener (on --rpc-host); 0 picks a free one. Fixed, it \
         can be opened in a firewall or a network policy.")
        .env("DYN_KV_TRANSFER_PORT").default("0"),
    FlagSpec::new("rpc-advertise-host", Str, Runtime,
        "Host other processes use to reach the gRPC service (behind NAT, in pods); \
         the bind host, or 127.0.0.1 for a wildcard bind, when unset.")
        .env("DYN_TCP_RPC_ADVERTISE_HOST"),
    FlagSpec::new("system-host", Str, Runtime,
        "Address the worker's /metrics and /health HTTP server binds to. Default: as \
         --rpc-host (the host of --rpc-advertise-host, else 127.0.0.1); 0.0.0.0 only when \
         set explicitly.")
        .env("DYN_SYSTEM_HOST"),
    FlagSpec::new("system-port", INT0, Runtime,
        "Port of the worker's /metrics and /health server; 0 picks a free one.")
        .env("DYN_SYSTEM_PORT").default("0"),
    FlagSpec::new("drain-timeout-secs", INT1, Runtime,
        "On SIGTERM, how long in-flight requests may take to finish after deregistration.")
        .env("DYN_DRAIN_TIMEOUT_SECS").default("30").scope(Scope::All),
    FlagSpec::new("namespace", Str, Runtime,
        "Namespace of this deployment; DYN_NAMESPACE_WORKER_SUFFIX appends -SUFFIX on workers.")
        .env("DYN_NAMESPACE").default("dynamo").scope(Scope::All),
    FlagSpec::new("endpoint", Str, Runtime,
        "dyn://namespace.component.endpoint this worker serves; derived from the role when unset.")
        .env("DYN_ENDPOINT"),
    FlagSpec::new("discovery-backend", Choice(&["mem", "file", "etcd"]), Runtime,
        "Service discovery: file (one machine, no server), etcd (leases), mem (in-process only).")
        .env("DYN_DISCOVERY_BACKEND").default("file").scope(Scope::All),
    FlagSpec::new("file-kv-root", Path, Runtime,
        "Root folder of the file discovery backend.")
        .env("DYN_FILE_KV").default_note("$TMPDIR/tandem_store_kv").scope(Scope::All),
    FlagSpec::new("etcd-endpoints", List, Runtime,
        "etcd endpoints for --discovery-backend etcd (comma-separated).")
        .env("ETCD_ENDPOINTS").default("http://localhost:2379").scope(Scope::All),
    FlagSpec::new("request-plane", Choice(&["grpc"]), Runtime,
        "Transport for requests and control messages between processes.")
        .env("DYN_REQUEST_PLANE").default("grpc").scope(Scope::All),
    FlagSpec::new("event-plane", Choice(&["direct", "nats"]), Runtime,
        "KV event transport: direct (router subscribes to each worker over gRPC) or nats.")
        .env("DYN_EVENT_PLANE").default("direct").scope(Scope::All),
    FlagSpec::new("nats-server", Str, Runtime,
        "NATS server URL for --event-plane nats.")
        .env("NATS_SERVER").default("nats://localhost:4222").scope(Scope::All),
    FlagSpec::new("connector", List, Runtime,
        "KV connector; at most one of: none, kvbm.")
        .env("DYN_CONNECTOR").default(""),
    FlagSpec::new("dyn-tool-call-parser", Choice(TOOL_CALL_PARSERS), Runtime,
        "Tool-call parser applied to model output.")
        .env("DYN_TOOL_CALL_PARSER"),
    FlagSpec::new("dyn-reasoning-parser", Choice(REASONING_PARSERS), Runtime,
        "Reasoning parser applied to model output.")
        .env("DYN_REASONING_PARSER"),
    FlagSpec::new("exclude-tools-when-tool-choice-none", Bool, Runtime,
        "Drop tools from the prompt when tool_choice is none.")
        .env("DYN_EXCLUDE_TOOLS_WHEN_TOOL_CHOICE_NONE").default("true"),
    FlagSpec::new("custom-jinja-template", Path, Runtime,
        "Chat template file overriding the model's own (~ and $VARS are expanded).")
        .env("DYN_CUSTOM_JINJA_TEMPLATE"),
    FlagSpec::new("endpoint-types", List, Runtime,
        "API endpoint types to register: chat, completions, or none.")
        .aliases(&["dyn-endpoint-types"]).env("DYN_ENDPOINT_TYPES").default("chat,completions"),
    FlagSpec::new("dump-config-to", Path, Runtime,
        "Write the resolved config and engine options as JSON to this file at start-up.")
        .env("DYN_DUMP_CONFIG_TO").scope(Scope::All),
    FlagSpec::new("multimodal-embedding-cache-capacity-gb", Float, Runtime,
        "Capacity of the multimodal embedding cache in GB; 0 disables it.")
        .env("DYN_MULTIMODAL_EMBEDDING_CACHE_CAPACITY_GB").default("0"),
    FlagSpec::new("output-modalities", List, Runtime,
        "Output modalities of the served model.")
        .env("DYN_OUTPUT_MODALITIES").default("text"),
    FlagSpec::new("media-output-fs-url", Str, Runtime,
        "Where generated media are written.")
        .env("DYN_MEDIA_OUTPUT_FS_URL").default_note("file://$TMPDIR/dynamo_media"),
    FlagSpec::new("media-output-http-url", Str, Runtime,
        "Public URL prefix of generated media.")
        .env("DYN_MEDIA_OUTPUT_HTTP_URL"),
    FlagSpec::new("engine-request-limit", INT1, Runtime,
        "Worker-side limit of concurrent requests (running and waiting) before rejection \
         (gRPC RESOURCE_EXHAUSTED); unlimited when unset.")
        .env("DYN_ENGINE_REQUEST_LIMIT"),
    // ---- Planner
    FlagSpec::new("planner-mode", Choice(&["disagg", "agg", "prefill", "decode"]), Planner,
        "Roles the planner scales: disagg (prefill and decode workers), agg (aggregated \
         workers), or prefill / decode alone.")
        .env("DYN_PLANNER_MODE").default("disagg").scope(Scope::Planner),
    FlagSpec::new("actuator", Choice(&["virtual", "local", "docker", "slurm", "kubernetes"]), Planner,
        "What applies the decisions: virtual (decisions only, for simulation), local (starts \
         and stops worker processes on this machine from --local-workers-spec), docker (the \
         replicas of the Compose services in --compose-services, through the Docker Engine \
         API), slurm (worker job steps in the allocation the planner runs in, from \
         --local-workers-spec) or kubernetes (the scale of the Deployments in \
         --kubernetes-deployments; a tandem-planner built with the `kubernetes` feature).")
        .env("DYN_ACTUATOR").default("virtual").scope(Scope::Planner),
    FlagSpec::new("local-workers-spec", Path, Planner,
        "JSON file for --actuator local and slurm: per role (prefill, decode, agg) the worker \
         command to start, `{\"decode\": {\"program\": \"...\", \"args\": [...], \"env\": \
         {...}, \"srun_args\": [...]}}` (srun_args: slurm only; `{step}` in them is the job \
         step's name); `tandem up --planner` and the Slurm scripts write one.")
        .env("DYN_LOCAL_WORKERS_SPEC").scope(Scope::Planner),
    FlagSpec::new("docker-host", Str, Planner,
        "--actuator docker: the Docker engine's socket (unix:// only).")
        .env("DOCKER_HOST").default("unix:///var/run/docker.sock").scope(Scope::Planner),
    FlagSpec::new("compose-project", Str, Planner,
        "--actuator docker: the Compose project whose services are scaled; by default the \
         project of the container the planner runs in.")
        .env("DYN_COMPOSE_PROJECT").scope(Scope::Planner),
    FlagSpec::new("compose-services", Str, Planner,
        "--actuator docker: the Compose service of each role, as role=service pairs.")
        .env("DYN_COMPOSE_SERVICES").default("prefill=prefill,decode=decode,agg=worker")
        .scope(Scope::Planner),
    FlagSpec::new("kubernetes-namespace", Str, Planner,
        "--actuator kubernetes: the namespace of the Deployments; by default the planner's \
         own (its ServiceAccount's, or the kubeconfig context's).")
        .env("DYN_KUBERNETES_NAMESPACE").scope(Scope::Planner),
    FlagSpec::new("kubernetes-deployments", Str, Planner,
        "--actuator kubernetes: the Deployment of each role, as role=name pairs (k8s/: the \
         agg overlay runs its aggregated workers as `decode`).")
        .env("DYN_KUBERNETES_DEPLOYMENTS").default("prefill=prefill,decode=decode,agg=decode")
        .scope(Scope::Planner),
    FlagSpec::new("optimization-target", Choice(&["throughput", "latency"]), Planner,
        "Thresholds of load scaling: throughput (fill engines before adding one: prefill \
         queue >= 1 context up, < 0.1 down; KV load > 1.0 up, < 0.6 down) or latency \
         (headroom: queue >= 0.1 up, empty down; KV load > 0.4 up, < 0.1 down).")
        .env("DYN_OPTIMIZATION_TARGET").default("throughput").scope(Scope::Planner),
    FlagSpec::new("enable-load-scaling", Bool, Planner,
        "Reactive scaling, one replica per --load-adjustment-interval, on the workers' queued \
         prefill tokens and KV load.")
        .env("DYN_ENABLE_LOAD_SCALING").default("true").scope(Scope::Planner),
    FlagSpec::new("load-signal", Choice(&["thresholds", "sla"]), Planner,
        "What load scaling measures engines by: thresholds (queued prefill tokens and KV load \
         against --optimization-target's thresholds) or sla (each engine's estimated TTFT, its \
         queue prefilled, and ITL, a step of its batch, from --planner-profile-data, over \
         --ttft and --itl: up over 1.0, down under 0.6).")
        .env("DYN_LOAD_SIGNAL").default("thresholds").scope(Scope::Planner),
    FlagSpec::new("scale-down-intervals", INT1, Planner,
        "Load scaling steps a role down only after this many consecutive intervals qualified \
         (its engines' load gauges are instantaneous); steps up at once.")
        .env("DYN_SCALE_DOWN_INTERVALS").default("5").scope(Scope::Planner),
    FlagSpec::new("enable-throughput-scaling", Bool, Planner,
        "Predictive (SLA) scaling every --throughput-adjustment-interval: predicts request \
         rate, ISL and OSL and sizes each role from --planner-profile-data to meet --ttft and \
         --itl. With load scaling on as well, its result is a lower bound.")
        .env("DYN_ENABLE_THROUGHPUT_SCALING").default("false").scope(Scope::Planner),
    FlagSpec::new("planner-profile-data", Path, Planner,
        "Profile JSON of the time models of throughput scaling: the file `tandem-mocker \
         --planner-profile-data` runs from (prefill ms by tokens, decode ms by KV usage) plus \
         kv_capacity_tokens, max_num_batched_tokens, max_num_seqs and optionally measured \
         decode_grid step times (docs/architecture.md, Planner).")
        .env("DYN_PLANNER_PROFILE_DATA").scope(Scope::Planner),
    FlagSpec::new("ttft", Float, Planner,
        "Time-to-first-token target of throughput scaling, milliseconds.")
        .env("DYN_TTFT").default("500").scope(Scope::Planner),
    FlagSpec::new("itl", Float, Planner,
        "Inter-token latency target of throughput scaling, milliseconds.")
        .env("DYN_ITL").default("50").scope(Scope::Planner),
    FlagSpec::new("load-predictor", Str, Planner,
        "Predictor of the next interval's rate, ISL and OSL: constant, moving-average:N, or \
         kalman (local linear trend).")
        .env("DYN_LOAD_PREDICTOR").default("kalman").scope(Scope::Planner),
    FlagSpec::new("throughput-adjustment-interval", INT1, Planner,
        "Seconds between throughput (SLA) scaling decisions.")
        .env("DYN_THROUGHPUT_ADJUSTMENT_INTERVAL").default("180").scope(Scope::Planner),
    FlagSpec::new("load-adjustment-interval", INT1, Planner,
        "Seconds between load scaling decisions (and metric reads).")
        .env("DYN_LOAD_ADJUSTMENT_INTERVAL").default("5").scope(Scope::Planner),
    FlagSpec::new("min-endpoint", INT0, Planner,
        "Fewest replicas of each scaled role.")
        .env("DYN_MIN_ENDPOINT").default("1").scope(Scope::Planner),
    FlagSpec::new("max-endpoint", INT1, Planner,
        "Most replicas of each scaled role.")
        .env("DYN_MAX_ENDPOINT").default("8").scope(Scope::Planner),
    FlagSpec::new("max-gpu-budget", INT1, Planner,
        "GPUs all scaled roles may use together.")
        .env("DYN_MAX_GPU_BUDGET").default("8").scope(Scope::Planner),
    FlagSpec::new("prefill-engine-num-gpu", INT1, Planner,
        "GPUs of one prefill (or aggregated) worker.")
        .env("DYN_PREFILL_ENGINE_NUM_GPU").default("1").scope(Scope::Planner),
    FlagSpec::new("decode-engine-num-gpu", INT1, Planner,
        "GPUs of one decode worker.")
        .env("DYN_DECODE_ENGINE_NUM_GPU").default("1").scope(Scope::Planner),
    FlagSpec::new("router-metrics-url", Str, Planner,
        "The router's Prometheus page, read every interval (request rate, ISL, OSL, TTFT, ITL, \
         KV hit rate).")
        .env("DYN_ROUTER_METRICS_URL").default("http://127.0.0.1:8000/metrics").scope(Scope::Planner),
    FlagSpec::new("decisions-out", Path, Planner,
        "Append one JSON object per decision (time, role, current, desired, reason) to this file.")
        .env("DYN_DECISIONS_OUT").scope(Scope::Planner),
    FlagSpec::new("dry-run", Bool, Planner,
        "Decide and report, but change nothing.")
        .env("DYN_DRY_RUN").default("false").scope(Scope::Planner),
    FlagSpec::new("planner-metrics-host", Str, Planner,
        "Address the planner's /metrics and /health server binds to.")
        .env("DYN_PLANNER_METRICS_HOST").default("127.0.0.1").scope(Scope::Planner),
    FlagSpec::new("planner-metrics-port", INT0, Planner,
        "Port of the planner's /metrics and /health server; 0 picks a free one.")
        .env("DYN_PLANNER_METRICS_PORT").default("0").scope(Scope::Planner),
    // ---- Runtime: internal channel security
    FlagSpec::new("internal-tls-dir", Path, Runtime,
        "Folder of the deployment's mutual-TLS material (ca.crt, node.crt, node.key; \
         `tandem certs --out DIR` makes one): every internal gRPC channel is TLS with client \
         certificates of that CA. Required unless --insecure-internal.")
        .env("TANDEM_INTERNAL_TLS_DIR").scope(Scope::All),
    FlagSpec::new("insecure-internal", Bool, Runtime,
        "Run internal gRPC channels in plaintext without authentication (benchmarks on one \
         trusted host only; logged as a warning).")
        .env("TANDEM_INSECURE_INTERNAL").default("false").scope(Scope::All),
    FlagSpec::new("print-config", Bool, Runtime,
        "Print the resolved config and engine options as JSON and exit.")
        .default("false").scope(Scope::All),
];

/// Looks a flag up by its canonical name.
pub fn spec(name: &str) -> Option<&'static FlagSpec> {
    FLAGS.iter().find(|f| f.name == name)
}

/// The flags a process of the given scope accepts.
pub fn flags_for(scope: Scope) -> impl Iterator<Item = &'static FlagSpec> {
    FLAGS.iter().filter(move |f| match scope {
        Scope::All => f.scope == Scope::All,
        Scope::Worker => f.scope == Scope::All || f.scope == Scope::Worker,
        Scope::Router => f.scope == Scope::All || f.scope == Scope::Router,
        Scope::Planner => f.scope == Scope::All || f.scope == Scope::Planner,
    })
}
