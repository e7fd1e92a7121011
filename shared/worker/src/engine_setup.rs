//! From a validated [`WorkerConfig`] to a running engine: model folder (or the built-in tiny
//! model), KV pool size and dtype, and the engine's scheduling limits.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use tandem_config::engine_options::{CapacitySchedulerPolicy as Policy, KvCacheDtype};
use tandem_config::worker::DeviceChoice;
use tandem_config::WorkerConfig;
use tandem_engine::backend::cpu::{
    cpu_kv_blocks_from_memory, CpuBackend, DEFAULT_CPU_KV_CAP_BYTES,
};
use tandem_engine::backend::Backend;
use tandem_engine::backend::KvPoolMemory;
use tandem_engine::engine::{CapacitySchedulerPolicy, Engine, EngineConfig, EngineHandle};
use tandem_engine::kv::layout::{KvDtype, KvLayout, LAYOUT_VERSION};
use tandem_engine::model::{LoadOptions, LoadedModel, VisionEncoder};
use tandem_kv_transfer::{AnyRegistration, AnyTransport, RemoteRegion};

/// A started engine and the model it runs.
pub struct BuiltEngine {
    pub engine: EngineHandle,
    pub model: Arc<LoadedModel>,
    pub num_blocks: usize,
    /// The KV pool as remote writers see it, when it lives in transport-registered memory
    /// (decode workers of disaggregated serving).
    pub kv_region: Option<RemoteRegion>,
}

/// The model to load: `--model-path` (a folder, or a `.gguf` file), or the built-in tiny model
/// (generated on first use).
pub fn model_folder(cfg: &WorkerConfig) -> anyhow::Result<PathBuf> {
    match &cfg.model.model_path {
        Some(p) => Ok(PathBuf::from(p)),
        None => Ok(tandem_engine::tiny::ensure_tiny_model()?),
    }
}

/// The device a worker's engine computes on (`--device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    /// GPU `ordinal` among the visible ones.
    Cuda(usize),
}

/// Resolves `--device`: `cuda[:N]` is an error when this binary lacks the `cuda` feature or
/// GPU N cannot be used; `auto` takes GPU 0 when it can be used, else the CPU.
pub fn choose_device(requested: DeviceChoice) -> anyhow::Result<Device> {
    match requested {
        DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Cuda { ordinal } => cuda_device(ordinal as usize),
        DeviceChoice::Auto => Ok(if cuda_usable() {
            Device::Cuda(0)
        } else {
            Device::Cpu
        }),
    }
}

#[cfg(feature = "cuda")]
fn cuda_device(ordinal: usize) -> anyhow::Result<Device> {
    tandem_engine::backend::cuda::check_libraries()
        .map_err(|e| anyhow::anyhow!("--device cuda:{ordinal}: {e}"))?;
    let visible = tandem_engine::backend::cuda::device_count();
    anyhow::ensure!(
        ordinal < visible,
        "--device cuda:{ordinal}: the CUDA driver sees {visible} GPU(s) (numbered from 0 among \
         those CUDA_VISIBLE_DEVICES leaves visible; check it and the driver)"
    );
    Ok(Device::Cuda(ordinal))
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(ordinal: usize) -> anyhow::Result<Device> {
    anyhow::bail!(
        "--device cuda:{ordinal}: this binary was built without CUDA support; build it with \
         `cargo build --release --features cuda` or run with --device cpu"
    )
}

#[cfg(feature = "cuda")]
fn cuda_usable() -> bool {
    tandem_engine::backend::cuda::available()
}

#[cfg(not(feature = "cuda"))]
fn cuda_usable() -> bool {
    false
}

/// The KV pool's element type: `kv_cache_config.dtype`, where `auto` follows the device and,
/// on CUDA, `--cuda-precision` (the f16 precision's kernels read an f16 pool; bf16x2 keeps
/// its cache in f16 too, within 3e-3 of f32 where a bf16 cache alone costs ~2e-2).
fn kv_dtype(dtype: KvCacheDtype, device: Device, cuda_precision: &str) -> KvDtype {
    match (dtype, device) {
        // The CPU backend computes in f32; keeping the cache in f32 makes it exact.
        (KvCacheDtype::Auto, Device::Cpu) | (KvCacheDtype::Float32, _) => KvDtype::F32,
        (KvCacheDtype::Auto, Device::Cuda(_)) if matches!(cuda_precision, "f16" | "bf16x2") => {
            KvDtype::F16
        }
        // The CUDA backend otherwise computes in bf16.
        (KvCacheDtype::Auto, Device::Cuda(_)) | (KvCacheDtype::Bfloat16, _) => KvDtype::Bf16,
        (KvCacheDtype::Float16, _) => KvDtype::F16,
        (KvCacheDtype::Fp8, _) => KvDtype::Fp8,
    }
}

/// Loads the model and starts the engine with the merged engine options.
pub fn build_engine(cfg: &WorkerConfig) -> anyhow::Result<BuiltEngine> {
    build_engine_on(cfg, None)
}

/// Like [`build_engine`]; with a transport, the KV pool is allocated and registered through
/// it so that prefill workers can write blocks straight into it. Must run where a tokio
/// runtime is current (e.g. `spawn_blocking`).
pub fn build_engine_on(
    cfg: &WorkerConfig,
    transport: Option<Arc<AnyTransport>>,
) -> anyhow::Result<BuiltEngine> {
    let device = choose_device(cfg.model.device)?;
    let tp = cfg.engine.tensor_parallel_size as usize;
    if let Device::Cuda(ordinal) = device {
        anyhow::ensure!(
            tp == 1,
            "--tensor-parallel-size {tp} on cuda:{ordinal}: {} is not implemented yet",
            tandem_config::validate::TP_ON_CUDA
        );
        return build_cuda_engine(cfg, ordinal, transport);
    }
    if tp > 1 {
        tracing::info!(
            "tensor parallel: {tp} ranks on CPU threads, each with its shard of the weights \
             and its KV heads of the shared pool"
        );
    }
    let mut region = None;
    let mut built = build_engine_with(
        cfg,
        &load_options(cfg),
        device,
        |model, layout, num_blocks| {
            let Some(t) = transport else {
                let backend = CpuBackend::new(model, layout.dtype, layout.block_size, num_blocks)?
                    .with_tensor_parallel(tp)?;
                return Ok(Box::new(backend) as Box<dyn Backend>);
            };
            let (memory, descriptor) = registered_memory(&t, num_blocks * layout.block_bytes())?;
            region = Some(descriptor);
            let backend =
                CpuBackend::new_in(model, layout.dtype, layout.block_size, num_blocks, memory)?
                    .with_tensor_parallel(tp)?;
            Ok(Box::new(backend) as Box<dyn Backend>)
        },
    )?;
    built.kv_region = region;
    Ok(built)
}

/// `encoder` where `device` computes: as it is on the CPU, its weights uploaded to the GPU on
/// CUDA (TF32 GEMMs, f32 activations).
pub fn place_vision(
    encoder: Arc<VisionEncoder>,
    device: Device,
) -> anyhow::Result<Arc<VisionEncoder>> {
    match device {
        Device::Cpu => Ok(encoder),
        Device::Cuda(ordinal) => vision_on_cuda(&encoder, ordinal).map(Arc::new),
    }
}

#[cfg(feature = "cuda")]
fn vision_on_cuda(encoder: &VisionEncoder, ordinal: usize) -> anyhow::Result<VisionEncoder> {
    use tandem_engine::backend::cuda::vision::VisionPrecision;
    encoder
        .on_cuda(ordinal, VisionPrecision::Tf32)
        .context("uploading the vision tower to the GPU")
}

#[cfg(not(feature = "cuda"))]
fn vision_on_cuda(_encoder: &VisionEncoder, ordinal: usize) -> anyhow::Result<VisionEncoder> {
    Err(cuda_device(ordinal)
        .err()
        .unwrap_or_else(|| anyhow::anyhow!("this binary has no CUDA backend")))
}

/// What a worker loads: the vision tower only where this worker encodes images itself
/// (`--enable-multimodal` without `--encode-endpoint`).
fn load_options(cfg: &WorkerConfig) -> LoadOptions {
    let d = &cfg.disaggregation;
    LoadOptions {
        weights: true,
        vision: d.enable_multimodal && d.encode_endpoint.is_none(),
    }
}

/// The engine on the CUDA backend (bf16 weights and GEMMs), its KV pool in GPU memory sized
/// by `kv_cache_config.max_tokens` or else `free_gpu_memory_fraction` of the memory left free
/// by the weights and the activation workspace.
#[cfg(feature = "cuda")]
fn build_cuda_engine(
    cfg: &WorkerConfig,
    ordinal: usize,
    transport: Option<Arc<AnyTransport>>,
) -> anyhow::Result<BuiltEngine> {
    use tandem_engine::backend::cuda::{ComputeMode, CudaBackend, CudaOptions, PoolSize};
    use tandem_kv_transfer::KvTransport;
    let opts = &cfg.engine;
    let mut region = None;
    let mut built = build_engine_with(
        cfg,
        &load_options(cfg),
        Device::Cuda(ordinal),
        |model, layout, num_blocks| {
            // Over TCP the pool is mirrored in registered host memory that remote prefills
            // write into; over UCX the GPU pool itself is registered. Either way a decode
            // worker keeps the size computed by the caller (bounded, so that a prefill worker
            // started beside it on the same GPU finds memory too).
            let host_mirror = transport
                .as_ref()
                .is_some_and(|t| t.backend() == tandem_kv_transfer::Backend::Tcp);
            let pool = match (opts.kv_cache_config.max_tokens, &transport) {
                (None, None) => {
                    PoolSize::FreeFraction(opts.kv_cache_config.free_gpu_memory_fraction)
                }
                _ => PoolSize::Blocks(num_blocks),
            };
            let cuda = CudaOptions {
                ordinal,
                mode: match cfg.model.cuda_precision.as_str() {
                    "bf16x2" => ComputeMode::Bf16Split,
                    "f16" => ComputeMode::F16,
                    _ => ComputeMode::Bf16,
                },
                kv_dtype: layout.dtype,
                block_size: layout.block_size,
                pool,
                max_step_tokens: opts.max_num_tokens as usize,
                graph_max_batch: opts
                    .cuda_graph_config
                    .as_ref()
                    .map_or(0, |g| g.max_batch_size as usize),
            };
            let backend = CudaBackend::new(model, &cuda)?;
            let Some(t) = transport else {
                return Ok(Box::new(backend) as Box<dyn Backend>);
            };
            if host_mirror {
                let (memory, descriptor) =
                    registered_memory(&t, backend.num_blocks() * layout.block_bytes())?;
                region = Some(descriptor);
                return Ok(Box::new(backend.with_staging(memory)?) as Box<dyn Backend>);
            }
            let (registration, descriptor) = registered_gpu_pool(&t, &backend)?;
            region = Some(descriptor);
            Ok(Box::new(backend.with_registration(Box::new(registration))) as Box<dyn Backend>)
        },
    )?;
    built.kv_region = region;
    Ok(built)
}

/// Registers the CUDA backend's GPU pool with the (UCX) transport: prefill workers put blocks
/// straight into it, GPU to GPU. A UCX without CUDA support is an error naming what is
/// missing (never a silent host-memory fallback).
#[cfg(feature = "cuda")]
fn registered_gpu_pool(
    t: &Arc<AnyTransport>,
    backend: &tandem_engine::backend::cuda::CudaBackend,
) -> anyhow::Result<(AnyRegistration, RemoteRegion)> {
    use tandem_kv_transfer::{KvTransport, Registration};
    let pool = backend
        .device_pool()
        .context("the CUDA backend reports no GPU pool")?;
    // SAFETY: the pool is `pool.len` bytes of device memory owned by the backend, which keeps
    // the registration (with_registration) and drops it before freeing the pool; remote
    // writers only write blocks the engine reserved for them under a lease.
    let memory = unsafe {
        tandem_kv_transfer::LocalMemory::cuda(pool.ptr as *mut u8, pool.len, pool.device)
    };
    let registration = tokio::runtime::Handle::try_current()
        .context("registering the GPU KV pool needs a tokio runtime")?
        .block_on(t.register(memory))
        .context(
            "cannot register the GPU KV pool with UCX for GPU-to-GPU transfers (use the \
             CUDA-enabled UCX of PyPI libucx-cu13, or --kv-transport tcp for host staging)",
        )?;
    let descriptor = registration.descriptor().clone();
    tracing::info!(
        bytes = pool.len,
        device = pool.device,
        "GPU KV pool registered with UCX: prefill workers write into it directly"
    );
    Ok((registration, descriptor))
}

#[cfg(not(feature = "cuda"))]
fn build_cuda_engine(
    _cfg: &WorkerConfig,
    ordinal: usize,
    _transport: Option<Arc<AnyTransport>>,
) -> anyhow::Result<BuiltEngine> {
    Err(cuda_device(ordinal)
        .err()
        .unwrap_or_else(|| anyhow::anyhow!("this binary has no CUDA backend")))
}

/// `len` bytes of memory allocated and registered by the transport (remote writers reach it
/// through the returned descriptor), owning its registration. Needs a current tokio runtime.
fn registered_memory(
    t: &Arc<AnyTransport>,
    len: usize,
) -> anyhow::Result<(KvPoolMemory, RemoteRegion)> {
    let pool = tokio::runtime::Handle::try_current()
        .context("allocating a registered KV pool needs a tokio runtime")?
        .block_on(crate::transport::allocate_pool(t, len))?;
    let descriptor = pool.descriptor.clone();
    // SAFETY: the transport allocated `pool.len` bytes at `pool.ptr`, valid until the
    // registration (moved into the memory as its keep-alive) is dropped with the backend.
    let memory = unsafe {
        KvPoolMemory::external(
            pool.ptr,
            pool.len,
            Box::new(RegistrationGuard(pool.registration)),
        )?
    };
    Ok((memory, descriptor))
}

/// Keeps a transport registration alive inside the KV pool that lives in its memory.
struct RegistrationGuard(#[allow(dead_code)] AnyRegistration);

/// Like [`build_engine`] with the backend from `backend` (given the model, the KV layout and
/// the pool size): the mocker's simulated backend runs the same engine this way.
pub fn build_engine_with(
    cfg: &WorkerConfig,
    load: &LoadOptions,
    device: Device,
    backend: impl FnOnce(&LoadedModel, &KvLayout, usize) -> anyhow::Result<Box<dyn Backend>>,
) -> anyhow::Result<BuiltEngine> {
    let folder = model_folder(cfg)?;
    let mut model = LoadedModel::load(&folder, load)?;
    if let Some(path) = &cfg.runtime.custom_jinja_template {
        let source = std::fs::read_to_string(path)
            .with_context(|| format!("--custom-jinja-template: cannot read {}", path.display()))?;
        model
            .use_chat_template(source)
            .with_context(|| format!("--custom-jinja-template {}", path.display()))?;
        tracing::info!(template = %path.display(), "serving a custom chat template");
    }
    let model = Arc::new(model);
    let layout = kv_layout(cfg, &model, device);
    let backend = backend(&model, &layout, pool_blocks(cfg, &layout)?)?;
    // The backend may size its own pool (the CUDA backend, from the free GPU memory).
    let num_blocks = backend.num_blocks();
    let engine_cfg = engine_config(cfg, &model, num_blocks);
    // The engine thread owns its own tokenizer handle (a clone of the model's: a GGUF model's
    // tokenizer comes from its metadata, not from a tokenizer.json in a folder).
    let tokenizer = Arc::new(model.tokenizer.clone());
    let max_seq_len = engine_cfg.max_seq_len;
    let engine = Engine::start(backend, Some(tokenizer), engine_cfg)?;
    tracing::info!(
        model = %folder.display(),
        ?device,
        num_blocks,
        block_size = layout.block_size,
        max_seq_len,
        "engine started"
    );
    Ok(BuiltEngine {
        engine,
        model,
        num_blocks,
        kv_region: None,
    })
}

/// The KV layout of `model` in the configured block size and the device's cache dtype.
fn kv_layout(cfg: &WorkerConfig, model: &LoadedModel, device: Device) -> KvLayout {
    KvLayout {
        version: LAYOUT_VERSION,
        model_id: model.model_id.clone(),
        dtype: kv_dtype(
            cfg.engine.kv_cache_config.dtype,
            device,
            &cfg.model.cuda_precision,
        ),
        block_size: cfg.kv_cache.kv_block_size as usize,
        num_layers: model.config.num_hidden_layers,
        num_kv_heads: model.config.num_key_value_heads,
        head_dim: model.config.head_dim,
    }
}

/// Blocks in the KV pool: `kv_cache_config.max_tokens`, or else the share of the host's
/// memory `free_gpu_memory_fraction` gives (capped).
fn pool_blocks(cfg: &WorkerConfig, layout: &KvLayout) -> anyhow::Result<usize> {
    let kv = &cfg.engine.kv_cache_config;
    let block_size = layout.block_size;
    Ok(match kv.max_tokens {
        Some(tokens) => {
            let blocks = EngineConfig::num_blocks_for_max_tokens(tokens as usize, block_size);
            anyhow::ensure!(
                blocks > 0,
                "kv_cache_config.max_tokens {tokens} is smaller than one block of {block_size} tokens"
            );
            blocks
        }
        None => cpu_kv_blocks_from_memory(
            layout.block_bytes(),
            kv.free_gpu_memory_fraction,
            DEFAULT_CPU_KV_CAP_BYTES,
        ),
    })
}

/// The engine's scheduling limits from the merged engine options.
fn engine_config(cfg: &WorkerConfig, model: &LoadedModel, num_blocks: usize) -> EngineConfig {
    let opts = &cfg.engine;
    EngineConfig {
        max_batch_size: opts.max_batch_size as usize,
        max_num_tokens: opts.max_num_tokens as usize,
        max_seq_len: opts
            .max_seq_len
            .map(|v| v as usize)
            .unwrap_or(model.config.max_position_embeddings),
        enable_chunked_prefill: opts.enable_chunked_prefill,
        kv_block_size: cfg.kv_cache.kv_block_size as usize,
        num_blocks,
        enable_block_reuse: opts.kv_cache_config.enable_block_reuse,
        event_buffer_max_size: opts.kv_cache_config.event_buffer_max_size as usize,
        capacity_scheduler_policy: match opts.scheduler_config.capacity_scheduler_policy {
            Policy::MaxUtilization => CapacitySchedulerPolicy::MaxUtilization,
            // STATIC_BATCH is refused by the config crate before we get here.
            Policy::GuaranteedNoEvict | Policy::StaticBatch => {
                CapacitySchedulerPolicy::GuaranteedNoEvict
            }
        },
        eos_token_ids: model.eos_token_ids(),
        dp_rank: 0,
        max_beam_width: opts.max_beam_width.max(1) as usize,
        request_limit: cfg.runtime.engine_request_limit.map(|v| v as usize),
        ..EngineConfig::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_choice_is_explicit_about_cuda() {
        assert_eq!(choose_device(DeviceChoice::Cpu).ok(), Some(Device::Cpu));
        match choose_device(DeviceChoice::Cuda { ordinal: 0 }) {
            // A CUDA build on a GPU machine.
            Ok(d) => assert_eq!(d, Device::Cuda(0)),
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.contains("--device cuda:0"), "{msg}");
                // Without a usable GPU, auto falls back to the CPU.
                assert_eq!(choose_device(DeviceChoice::Auto).ok(), Some(Device::Cpu));
            }
        }
        // No machine has a GPU numbered this high: refused, naming the flag's value.
        let e = choose_device(DeviceChoice::Cuda { ordinal: 4096 }).unwrap_err();
        assert!(e.to_string().contains("--device cuda:4096"), "{e}");
    }

    #[test]
    fn the_kv_cache_dtype_follows_the_device() {
        use KvCacheDtype::{Auto, Bfloat16, Float16, Float32, Fp8};
        for (dtype, device, precision, want) in [
            (Auto, Device::Cpu, "f16", KvDtype::F32),
            (Auto, Device::Cuda(0), "bf16", KvDtype::Bf16),
            (Auto, Device::Cuda(0), "bf16x2", KvDtype::F16),
            (Bfloat16, Device::Cuda(0), "bf16x2", KvDtype::Bf16),
            (Auto, Device::Cuda(0), "f16", KvDtype::F16),
            (Float32, Device::Cuda(0), "f16", KvDtype::F32),
            (Bfloat16, Device::Cpu, "bf16", KvDtype::Bf16),
            (Float16, Device::Cpu, "bf16", KvDtype::F16),
            (Fp8, Device::Cuda(0), "bf16x2", KvDtype::Fp8),
            (Fp8, Device::Cpu, "bf16x2", KvDtype::Fp8),
        ] {
            assert_eq!(
                kv_dtype(dtype, device, precision),
                want,
                "{dtype:?} {device:?} {precision}"
            );
        }
    }
}
