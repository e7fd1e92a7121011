//! [`CudaBackend`]: the decoder forward pass of [`crate::model::decoder`] on one GPU.
//!
//! Compute modes: [`ComputeMode::F32`] (weights widened to f32, f32 GEMMs: the exact mode,
//! compared with the CPU backend), [`ComputeMode::Bf16`] (weights resident in bf16, bf16 ×
//! bf16 GEMMs accumulating in f32; the producers of each GEMM input write bf16 directly),
//! [`ComputeMode::Bf16Split`] (bf16 weights, activations near f32: f32 rows in the GEMVs of
//! one or two rows, each GEMM input as hi + lo bf16 rows from three; the default) and
//! [`ComputeMode::F16`] (the bf16 mode's kernels compiled for IEEE half: weights, GEMM inputs
//! and KV in f16). The
//! residual stream, norms, RoPE and softmax stay in f32 in all. The paged KV
//! pool lives in GPU memory in the layout's dtype, with the same [`KvLayout`] as the CPU
//! backend, so exported blocks are interchangeable. Activations live in a workspace reused
//! from step to step (grown when a step is larger than any before).

use super::graphs::{replay_seconds, run_step, GraphCache, GraphStats};
pub use super::precision::ComputeMode;
use super::precision::PoolElem;
use super::rope_kv::MAX_HEAD_DIM;
use super::step::{AnyWorkspace, DeviceModel, Readout, StepInputs, StepRows, Workspace};
use super::switches::{decode_tc_min, pdl_from_env, tiled_prefill_attention};
use super::weights::{upload_weights, DeviceWeights};
use super::{AttentionScratch, CudaDevice, KvPool, PoolShape, TileSlots};
use crate::backend::fence::ArmedLayers;
use crate::backend::{
    Backend, BlocksReady, DeviceBlocks, DevicePool, DeviceSample, KvPoolMemory, LogitsMode,
    SeqInput, StepOutput,
};
use crate::error::EngineError;
use crate::kv::layout::{KvDtype, KvLayout, LAYOUT_VERSION};
use crate::model::config::ModelConfig;
use crate::model::decoder::DecoderWeights;
use crate::model::LoadedModel;
use crate::sampler::{SamplePlan, TokenLogprob};

/// How many KV blocks the pool gets.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PoolSize {
    Blocks(usize),
    /// This fraction of the device memory free once the weights and the workspace are
    /// allocated (`kv_cache_config.free_gpu_memory_fraction`).
    FreeFraction(f64),
}

/// Everything [`CudaBackend::new`] needs besides the model.
#[derive(Clone, Copy, Debug)]
pub struct CudaOptions {
    pub ordinal: usize,
    pub mode: ComputeMode,
    pub kv_dtype: KvDtype,
    pub block_size: usize,
    pub pool: PoolSize,
    /// Tokens per step the workspace is sized for up front (`max_num_tokens`), so that the
    /// pool, sized after it, leaves room for the activations.
    pub max_step_tokens: usize,
    /// Decode steps (one token per sequence) of at most this many sequences are captured
    /// into CUDA graphs, one per batch size, on their second occurrence, and replayed
    /// after (`cuda_graph_config.max_batch_size`; 0 turns graphs off).
    pub graph_max_batch: usize,
}

/// The decoder on one GPU.
pub struct CudaBackend {
    /// What keeps the pool registered with the KV transport (a decode worker whose prefill
    /// workers write into its GPU pool directly); declared first so it is dropped, and the
    /// registration undone, before the pool's memory is freed.
    registration: Option<Box<dyn std::any::Any + Send>>,
    model: DeviceModel,
    ws: AnyWorkspace,
    layout: KvLayout,
    mode: ComputeMode,
    /// Host memory remote prefills write blocks into (a decode worker of disaggregated
    /// serving), laid out as the pool; copied into the GPU pool on activation.
    staging: Option<KvPoolMemory>,
    graphs: GraphCache,
    /// Layer fences handed out for the next step (`device_blocks_by_layers`).
    armed: Option<ArmedLayers>,
}

impl CudaBackend {
    /// A backend on GPU `opts.ordinal` over `model`'s weights with a zeroed pool.
    pub fn new(model: &LoadedModel, opts: &CudaOptions) -> Result<Self, EngineError> {
        if !model.weights_loaded {
            return Err(EngineError::InvalidInput(format!(
                "{} was loaded without its weights",
                model.path.display()
            )));
        }
        let dev = CudaDevice::with_float16(opts.ordinal, opts.mode.float16())?;
        Self::from_parts(
            dev,
            model.config.clone(),
            &model.weights,
            model.model_id.clone(),
            opts,
        )
    }

    /// A backend from weights built elsewhere (checks, random models).
    pub fn from_parts(
        mut dev: CudaDevice,
        config: ModelConfig,
        weights: &DecoderWeights,
        model_id: String,
        opts: &CudaOptions,
    ) -> Result<Self, EngineError> {
        if config.head_dim > MAX_HEAD_DIM || !config.head_dim.is_multiple_of(2) {
            return Err(EngineError::Config(format!(
                "the CUDA backend serves an even head_dim of at most {MAX_HEAD_DIM} (this \
                 model: {}); use --device cpu",
                config.head_dim
            )));
        }
        let layout = kv_layout(&config, model_id, opts)?;
        let mode = opts.mode;
        if dev.float16() != mode.float16() {
            return Err(EngineError::InvalidInput(format!(
                "{mode:?} mode needs a device compiled for {} (CudaDevice::with_float16), not {}",
                mode.float16().name(),
                dev.float16().name()
            )));
        }
        let pool_elem = PoolElem::of(mode, opts.kv_dtype)?;
        if pool_elem == PoolElem::Fp8
            && !(layout.block_size * layout.num_kv_heads).is_multiple_of(4)
        {
            // Each part's scales follow its slots: 16-byte aligned rows need 4 | size × heads.
            return Err(EngineError::Config(format!(
                "an fp8 KV cache needs the KV block size (--kv-block-size) × KV heads \
                 divisible by 4 (here {} × {})",
                layout.block_size, layout.num_kv_heads
            )));
        }
        let DeviceWeights {
            layers,
            embed,
            lm_head,
            norm,
            inv_freq,
        } = upload_weights(&dev, mode, &config, weights)?;
        // The workspace first, at the step size the engine schedules, so the pool sized from
        // the free memory leaves it room.
        let ws = new_workspace(&dev, &config, mode, opts.max_step_tokens)?;
        let group = config.num_attention_heads / config.num_key_value_heads.max(1);
        let mut scratch = AttentionScratch::for_model(&dev, group, config.head_dim)?;
        scratch.fp8_pool = pool_elem == PoolElem::Fp8;
        let inputs = attention_setup(&mut dev, &config, mode, pool_elem)?;
        // Programmatic launch in decode graphs where the GPU and driver have it (asked for
        // or not, TANDEM_CUDA_PDL is checked so a bad value is an error everywhere).
        let pdl = pdl_from_env()? && dev.pdl_capable();
        let shape = pool_shape(&dev, &layout, opts.pool)?;
        // In exportable memory, so that a decode worker's pool can be registered with UCX
        // for GPU-to-GPU writes from prefill workers (cuda_ipc maps it).
        let pool = match pool_elem {
            PoolElem::F32 => KvPool::F32(dev.zeros_exportable(shape.elems())?),
            PoolElem::Own16 => KvPool::Bf16(dev.zeros_exportable(shape.elems())?),
            PoolElem::HalfBesideBf16 => KvPool::Half(dev.zeros_exportable(shape.elems())?),
            PoolElem::Fp8 => KvPool::Fp8(dev.zeros_exportable(shape.elems())?),
        };
        tracing::info!(
            device = dev.name(),
            arch = dev.arch(),
            ?mode,
            kv_dtype = %layout.dtype,
            num_blocks = shape.num_blocks,
            pool_gib = (shape.num_blocks * layout.block_bytes()) as f64 / (1u64 << 30) as f64,
            "CUDA backend ready"
        );
        Ok(CudaBackend {
            registration: None,
            model: DeviceModel {
                dev,
                config,
                shape,
                pool,
                embed,
                layers,
                norm,
                lm_head,
                inv_freq,
                scratch,
                inputs,
                layer_marks: Default::default(),
            },
            ws,
            layout,
            mode,
            staging: None,
            graphs: GraphCache::new(opts.graph_max_batch, pdl),
            armed: None,
        })
    }

    /// Gives the backend host memory that remote prefills write KV blocks into (the
    /// transport-registered region of a decode worker); it must hold the whole pool's bytes.
    pub fn with_staging(mut self, memory: KvPoolMemory) -> Result<Self, EngineError> {
        let need = self.model.shape.num_blocks * self.layout.block_bytes();
        if memory.len() < need {
            return Err(EngineError::InvalidInput(format!(
                "KV staging memory of {} bytes, the pool needs {need}",
                memory.len()
            )));
        }
        self.staging = Some(memory);
        Ok(self)
    }

    /// Keeps `registration` (the KV transport's registration of [`Backend::device_pool`])
    /// alive as long as the pool, and drops it first.
    pub fn with_registration(mut self, registration: Box<dyn std::any::Any + Send>) -> Self {
        self.registration = Some(registration);
        self
    }

    /// The pool's first byte on the device.
    fn pool_ptr(&self) -> u64 {
        self.model.pool.device_addr(self.model.dev.stream())
    }

    fn ordinal(&self) -> u32 {
        self.model.dev.stream().context().ordinal() as u32
    }

    pub fn device(&self) -> &CudaDevice {
        &self.model.dev
    }

    pub fn mode(&self) -> ComputeMode {
        self.mode
    }

    /// Captured, refused and replayed decode-step graphs so far.
    pub fn graph_stats(&self) -> GraphStats {
        self.graphs.stats()
    }

    /// One step with greedy sampling on the device: per sequence, the argmax token of each
    /// row it asked for (the logits never leave the GPU).
    pub fn forward_greedy(&mut self, batch: &[SeqInput<'_>]) -> Result<Vec<Vec<u32>>, EngineError> {
        let (counts, rows) = self.step(batch, Readout::Argmax, None)?;
        ids_per_sequence(&counts, rows)
    }

    /// Benchmarks: the GPU's seconds per greedy decode step of `batch` (its captured graph
    /// replayed `n` times back to back), or `None` before the graph exists.
    pub fn graph_replay_seconds(
        &mut self,
        batch: &[SeqInput<'_>],
        n: usize,
    ) -> Result<Option<f64>, EngineError> {
        crate::backend::check_batch(batch, self.layout.block_size, self.model.shape.num_blocks)?;
        match &mut self.ws {
            AnyWorkspace::F32(ws) => replay_seconds(&mut self.model, ws, &self.graphs, batch, n),
            AnyWorkspace::Bf16(ws) => replay_seconds(&mut self.model, ws, &self.graphs, batch, n),
        }
    }

    /// Runs a step; returns the number of rows per sequence and the rows. Decode steps
    /// (one token and its logits per sequence) replay a captured CUDA graph when one exists.
    fn step(
        &mut self,
        batch: &[SeqInput<'_>],
        readout: Readout,
        plans: Option<&[Option<&SamplePlan>]>,
    ) -> Result<(Vec<usize>, StepRows), EngineError> {
        // Layer fences handed out for this step: resolved as its eager launches pass each
        // group, the rest (a replayed graph's) once all of its work is queued; a step that
        // fails drops them, failing their waiters.
        let marks = self.armed.take().map(ArmedLayers::into_setters);
        crate::backend::check_batch(batch, self.layout.block_size, self.model.shape.num_blocks)?;
        let decode_shaped = !batch.is_empty()
            && batch
                .iter()
                .all(|s| s.tokens.len() == 1 && s.logits == LogitsMode::Last);
        let graphable =
            decode_shaped && batch.len() <= self.graphs.max_batch && !self.model.dev.profiling();
        self.model.layer_marks = marks.unwrap_or_default();
        let out = self.step_in_workspace(batch, readout, plans, graphable);
        let mut marks = std::mem::take(&mut self.model.layer_marks);
        if out.is_ok() {
            let dev = &self.model.dev;
            marks.finish(|| dev.kv_event().map(|e| Box::new(e) as _))?;
        }
        out
    }

    fn step_in_workspace(
        &mut self,
        batch: &[SeqInput<'_>],
        readout: Readout,
        plans: Option<&[Option<&SamplePlan>]>,
        graphable: bool,
    ) -> Result<(Vec<usize>, StepRows), EngineError> {
        match &mut self.ws {
            AnyWorkspace::F32(ws) => run_step(
                &mut self.model,
                ws,
                &mut self.graphs,
                batch,
                readout,
                plans,
                graphable,
            ),
            AnyWorkspace::Bf16(ws) => run_step(
                &mut self.model,
                ws,
                &mut self.graphs,
                batch,
                readout,
                plans,
                graphable,
            ),
        }
    }

    /// The tokens a device-sampled step drew (its `rows`), per sequence, with the logprobs
    /// its plans asked for.
    fn device_samples(
        &self,
        counts: &[usize],
        rows: StepRows,
        plans: &[Option<&SamplePlan>],
    ) -> Result<Vec<Option<DeviceSample>>, EngineError> {
        // One row per sequence with a plan, in batch order (`prepare` checked it).
        let row_plans: Vec<&SamplePlan> = plans.iter().flatten().copied().collect();
        let mut logprobs = self
            .model
            .inputs
            .sampling
            .logprobs(&self.model.dev, &row_plans)?
            .into_iter();
        Ok(ids_per_sequence(counts, rows)?
            .into_iter()
            .zip(plans)
            .map(|(ids, plan)| {
                let token = *ids.last()?;
                plan.as_ref()?;
                let logprob = logprobs.next().flatten().map(|lp| TokenLogprob {
                    token,
                    logprob: lp.token,
                    top: lp.top,
                });
                Some(DeviceSample { token, logprob })
            })
            .collect())
    }

    /// Checked `blocks` of the pool as device addresses, readable as `ready` says.
    fn pool_blocks(&self, blocks: &[u32], ready: BlocksReady) -> DeviceBlocks {
        let bb = self.layout.block_bytes();
        let base = self.pool_ptr();
        DeviceBlocks {
            device: self.ordinal(),
            block_bytes: bb,
            ptrs: blocks
                .iter()
                .map(|&b| base + b as u64 * bb as u64)
                .collect(),
            ready,
        }
    }

    fn block_range(&self, b: u32) -> std::ops::Range<usize> {
        let per = self.model.shape.elems() / self.model.shape.num_blocks;
        b as usize * per..(b as usize + 1) * per
    }
}

impl Backend for CudaBackend {
    fn layout(&self) -> &KvLayout {
        &self.layout
    }

    fn num_blocks(&self) -> usize {
        self.model.shape.num_blocks
    }

    fn vocab_size(&self) -> usize {
        self.model.config.vocab_size
    }

    /// Media rows are f32 rows of the hidden size, copied over their tokens' embeddings
    /// (the residual stream is f32 in every precision) in eager steps.
    fn media_embedding_width(&self) -> Option<usize> {
        Some(self.model.config.hidden_size)
    }

    fn forward(&mut self, batch: &[SeqInput<'_>]) -> Result<StepOutput, EngineError> {
        let (counts, rows) = self.step(batch, Readout::Logits, None)?;
        let flat = match rows {
            StepRows::Logits(v) => v,
            StepRows::Ids(_) => Vec::new(),
        };
        let v = self.model.config.vocab_size;
        let mut it = flat.chunks_exact(v).map(<[f32]>::to_vec);
        let logits = counts
            .iter()
            .map(|&c| it.by_ref().take(c).collect())
            .collect();
        Ok(StepOutput { logits })
    }

    fn samples_on_device(&self) -> bool {
        true
    }

    fn forward_sampled(
        &mut self,
        batch: &[SeqInput<'_>],
        plans: &[Option<&SamplePlan>],
    ) -> Result<Vec<Option<DeviceSample>>, EngineError> {
        check_plans(batch, plans)?;
        let (counts, rows) = self.step(batch, Readout::Sample, Some(plans))?;
        self.device_samples(&counts, rows, plans)
    }

    /// The forward pass is launched first (its logits stay on the device, nothing waits for
    /// it); the masks are computed on the host meanwhile, go to the device with the plans, and
    /// the sampler runs after the forward pass in stream order.
    fn forward_sampled_with_masks(
        &mut self,
        batch: &[SeqInput<'_>],
        plans: &[Option<&SamplePlan>],
        masks: &mut dyn FnMut() -> Vec<Option<Vec<u32>>>,
    ) -> Result<Vec<Option<DeviceSample>>, EngineError> {
        check_plans(batch, plans)?;
        let (counts, _) = self.step(batch, Readout::Deferred, Some(plans))?;
        let owned = crate::backend::with_masks(plans, masks());
        let refs: Vec<Option<&SamplePlan>> = owned.iter().map(Option::as_ref).collect();
        let row_plans: Vec<&SamplePlan> = owned.iter().flatten().collect();
        let vocab = self.model.config.vocab_size;
        let rows = counts.iter().sum();
        let model = &mut self.model;
        model.inputs.sampling.fill(&model.dev, &row_plans, vocab)?;
        let ids = match &mut self.ws {
            AnyWorkspace::F32(ws) => model.sample_deferred(ws, rows)?,
            AnyWorkspace::Bf16(ws) => model.sample_deferred(ws, rows)?,
        };
        self.device_samples(&counts, ids, &refs)
    }

    fn device_pool(&self) -> Option<DevicePool> {
        Some(DevicePool {
            ptr: self.pool_ptr(),
            len: self.model.shape.num_blocks * self.layout.block_bytes(),
            device: self.ordinal(),
        })
    }

    /// The blocks' addresses, and an event recorded on the compute stream after the work
    /// queued so far (the steps that wrote them): a writer waits for that event, not for the
    /// device, and the next step is queued meanwhile.
    fn device_blocks(&mut self, blocks: &[u32]) -> Result<Option<DeviceBlocks>, EngineError> {
        crate::backend::check_blocks(blocks, self.model.shape.num_blocks)?;
        let event = self.model.dev.kv_event()?;
        Ok(Some(
            self.pool_blocks(blocks, BlocksReady::Whole(Box::new(event))),
        ))
    }

    /// The blocks' addresses, and layer fences that the next step resolves as its launches
    /// pass each group (see `DeviceModel::mark_layers`).
    fn device_blocks_by_layers(
        &mut self,
        blocks: &[u32],
        groups: usize,
    ) -> Result<Option<DeviceBlocks>, EngineError> {
        crate::backend::check_blocks(blocks, self.model.shape.num_blocks)?;
        let layers = self.layout.num_layers;
        let fences = self
            .armed
            .get_or_insert_with(|| ArmedLayers::new(layers, groups))
            .fences();
        let ready = BlocksReady::Layers {
            layer_bytes: self.layout.layer_bytes(),
            groups: fences,
        };
        Ok(Some(self.pool_blocks(blocks, ready)))
    }

    fn load_received_blocks(&mut self, blocks: &[u32]) -> Result<(), EngineError> {
        let Some(staging) = &self.staging else {
            return Ok(());
        };
        crate::backend::check_blocks(blocks, self.model.shape.num_blocks)?;
        let bb = self.layout.block_bytes();
        let base = staging.as_ptr();
        let elem = match self.model.pool {
            KvPool::F32(_) => std::mem::size_of::<f32>(),
            KvPool::Bf16(_) | KvPool::Half(_) => std::mem::size_of::<u16>(),
            KvPool::Fp8(_) => 1,
        };
        if !(base as usize).is_multiple_of(elem) || !bb.is_multiple_of(elem) {
            return Err(EngineError::Backend(format!(
                "staging memory at {base:p} is not aligned to the pool's {elem}-byte elements"
            )));
        }
        let stream = self.model.dev.stream().clone();
        let err = |e| EngineError::Backend(format!("CUDA received-block copy: {e:?}"));
        // Straight from the staging memory into the pool, one copy per block and one wait.
        for &b in blocks {
            let range = self.block_range(b);
            let n = range.len();
            // SAFETY: the staging memory holds the whole pool (checked in with_staging), the
            // block id is in the pool (checked above) and the start is aligned for the element
            // type (checked above); the remote writer finished these blocks before the
            // activation that calls this, and nothing writes them until the wait below.
            let at = unsafe { base.add(b as usize * bb) };
            match &mut self.model.pool {
                KvPool::F32(p) => {
                    // SAFETY: as above; n f32 elements are one block's bytes.
                    let src = unsafe { std::slice::from_raw_parts(at as *const f32, n) };
                    stream
                        .memcpy_htod(src, &mut p.slice_mut(range))
                        .map_err(err)?;
                }
                KvPool::Bf16(p) | KvPool::Half(p) => {
                    // SAFETY: as above; n bf16 elements are one block's bytes.
                    let src = unsafe { std::slice::from_raw_parts(at as *const u16, n) };
                    stream
                        .memcpy_htod(src, &mut p.slice_mut(range))
                        .map_err(err)?;
                }
                KvPool::Fp8(p) => {
                    // SAFETY: as above; n bytes are one block's bytes.
                    let src = unsafe { std::slice::from_raw_parts(at, n) };
                    stream
                        .memcpy_htod(src, &mut p.slice_mut(range))
                        .map_err(err)?;
                }
            }
        }
        // The copies read the staging memory, which the transport may reuse after this.
        self.model.dev.synchronize()
    }

    fn export_blocks(&self, blocks: &[u32]) -> Result<Vec<u8>, EngineError> {
        crate::backend::check_blocks(blocks, self.model.shape.num_blocks)?;
        let mut out = Vec::with_capacity(blocks.len() * self.layout.block_bytes());
        let stream = self.model.dev.stream();
        let err = |e| EngineError::Backend(format!("CUDA block export: {e:?}"));
        for &b in blocks {
            let range = self.block_range(b);
            match &self.model.pool {
                KvPool::F32(p) => {
                    let v: Vec<f32> = stream.clone_dtoh(&p.slice(range)).map_err(err)?;
                    out.extend(v.iter().flat_map(|x| x.to_le_bytes()));
                }
                KvPool::Bf16(p) | KvPool::Half(p) => {
                    let v: Vec<u16> = stream.clone_dtoh(&p.slice(range)).map_err(err)?;
                    out.extend(v.iter().flat_map(|x| x.to_le_bytes()));
                }
                KvPool::Fp8(p) => {
                    let v: Vec<u8> = stream.clone_dtoh(&p.slice(range)).map_err(err)?;
                    out.extend(v);
                }
            }
        }
        Ok(out)
    }

    fn import_blocks(&mut self, blocks: &[u32], data: &[u8]) -> Result<(), EngineError> {
        crate::backend::check_blocks(blocks, self.model.shape.num_blocks)?;
        let bb = self.layout.block_bytes();
        if data.len() != blocks.len() * bb {
            return Err(EngineError::InvalidInput(format!(
                "import of {} blocks needs {} bytes, got {}",
                blocks.len(),
                blocks.len() * bb,
                data.len()
            )));
        }
        let err = |e| EngineError::Backend(format!("CUDA block import: {e:?}"));
        for (&b, bytes) in blocks.iter().zip(data.chunks_exact(bb)) {
            let range = self.block_range(b);
            let stream = self.model.dev.stream().clone();
            match &mut self.model.pool {
                KvPool::F32(p) => {
                    let v: Vec<f32> = bytes
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect();
                    stream
                        .memcpy_htod(&v, &mut p.slice_mut(range))
                        .map_err(err)?;
                }
                KvPool::Bf16(p) | KvPool::Half(p) => {
                    let v: Vec<u16> = bytes
                        .chunks_exact(2)
                        .map(|c| u16::from_le_bytes([c[0], c[1]]))
                        .collect();
                    stream
                        .memcpy_htod(&v, &mut p.slice_mut(range))
                        .map_err(err)?;
                }
                KvPool::Fp8(p) => {
                    stream
                        .memcpy_htod(bytes, &mut p.slice_mut(range))
                        .map_err(err)?;
                }
            }
            // The copy reads `v`, dropped at the end of this iteration.
            self.model.dev.synchronize()?;
        }
        Ok(())
    }
}

impl Drop for CudaBackend {
    /// Undoes the transport registration, then frees the pool (a `cuMemAlloc` allocation,
    /// see `CudaDevice::zeros_exportable`) in its place, a one-element stand-in taking its
    /// field for the rest of the drop.
    fn drop(&mut self) {
        drop(self.registration.take());
        let Ok(stand_in) = self.model.dev.zeros::<u16>(1) else {
            return;
        };
        match std::mem::replace(&mut self.model.pool, KvPool::Bf16(stand_in)) {
            KvPool::F32(p) => self.model.dev.free_exportable(p),
            KvPool::Bf16(p) | KvPool::Half(p) => self.model.dev.free_exportable(p),
            KvPool::Fp8(p) => self.model.dev.free_exportable(p),
        }
    }
}

/// The pool's layout: the model's KV heads and layers in blocks of `opts.block_size` (not 0)
/// tokens of `opts.kv_dtype`.
fn kv_layout(
    config: &ModelConfig,
    model_id: String,
    opts: &CudaOptions,
) -> Result<KvLayout, EngineError> {
    if opts.block_size == 0 {
        return Err(EngineError::InvalidInput("block_size must be > 0".into()));
    }
    Ok(KvLayout {
        version: LAYOUT_VERSION,
        model_id,
        dtype: opts.kv_dtype,
        block_size: opts.block_size,
        num_layers: config.num_hidden_layers,
        num_kv_heads: config.num_key_value_heads,
        head_dim: config.head_dim,
    })
}

/// The activation workspace of `mode` for steps of `tokens` tokens (and up to 256 logits
/// rows): f32 GEMM inputs in the f32 mode, 16-bit ones (hi and lo rows in the split mode)
/// otherwise.
fn new_workspace(
    dev: &CudaDevice,
    config: &ModelConfig,
    mode: ComputeMode,
    tokens: usize,
) -> Result<AnyWorkspace, EngineError> {
    let rows = 256;
    Ok(match mode {
        ComputeMode::F32 => AnyWorkspace::F32(Workspace::new(dev, config, tokens, rows, false)?),
        ComputeMode::Bf16 | ComputeMode::Bf16Split | ComputeMode::F16 => {
            let split = mode == ComputeMode::Bf16Split;
            AnyWorkspace::Bf16(Workspace::new(dev, config, tokens, rows, split)?)
        }
    })
}

/// The attention kernels a model of `config` in `mode` over a pool of `pool_elem` takes,
/// compiled or loaded now rather than in the first step, and the step inputs whose token maps
/// send prefill chunks and decode rows to the tensor-core kernels where they serve.
fn attention_setup(
    dev: &mut CudaDevice,
    config: &ModelConfig,
    mode: ComputeMode,
    pool_elem: PoolElem,
) -> Result<StepInputs, EngineError> {
    let group = config.num_attention_heads / config.num_key_value_heads.max(1);
    // The attention instance decode launches.
    let out = match mode {
        ComputeMode::F32 => "f32",
        ComputeMode::Bf16 | ComputeMode::Bf16Split | ComputeMode::F16 => "bf16",
    };
    let pool16 = pool_elem != PoolElem::F32;
    if pool_elem == PoolElem::Fp8 {
        // Only the tensor-core kernels of the FP8-KV program read an FP8 pool.
        return fp8_attention_setup(dev, config, group);
    }
    dev.preload_attention(pool_elem.kernel_suffix(), out, config.head_dim, group)?;
    if mode == ComputeMode::Bf16Split {
        // Steps of one or two rows read their attention output in f32.
        dev.preload_attention(pool_elem.kernel_suffix(), "f32", config.head_dim, group)?;
    }
    // An f16 cache beside bf16 weights takes its tensor-core attention (Q and P in f16)
    // from the half-KV program.
    let half_kv = pool_elem == PoolElem::HalfBesideBf16;
    if half_kv {
        dev.load_half_kv_attention()?;
    }
    let mut inputs = StepInputs::new(dev)?;
    // Prefill chunks and decode rows on tensor cores in the bf16 and f16 modes and in the
    // split mode with an f16 cache (its Q and P rounded to f16, 8× finer than bf16); the
    // f32 mode, and the split mode with an f32 or bf16 cache, keep the exact attention.
    let tensor_cores = matches!(mode, ComputeMode::Bf16 | ComputeMode::F16) || half_kv;
    if tensor_cores && tiled_prefill_attention()? {
        if let Some(n) = CudaDevice::prefill_tile_tokens(pool16, config.head_dim, group) {
            inputs.maps.tile_tokens = n;
            inputs.maps.tile_slots = tile_slots(dev, config, false)?;
            inputs.maps.pieces =
                dev.prefill_piece_schedule(config.head_dim, config.num_key_value_heads)?;
            // attention_decode.cu holds a group in one 16-row fragment.
            if group <= 16 {
                inputs.maps.decode_tc_min = decode_tc_min()?;
            }
        }
    }
    Ok(inputs)
}

/// The step inputs of an FP8 pool: every prefill chunk in tensor-core tiles and every decode
/// row by the tensor-core decode kernel, both from the FP8-KV program (Q and P in f16, the
/// keys and values dequantised into f16 as they are staged); a shape those kernels do not
/// serve is a configuration error, as is turning the tiled attention off.
fn fp8_attention_setup(
    dev: &mut CudaDevice,
    config: &ModelConfig,
    group: usize,
) -> Result<StepInputs, EngineError> {
    let tiles = CudaDevice::prefill_tile_tokens(true, config.head_dim, group)
        .filter(|_| group <= 16)
        .ok_or_else(|| {
            EngineError::Config(format!(
                "an fp8 KV cache needs head_dim 64 or 128 and at most 16 q heads per KV head \
                 (this model: head_dim {}, {group} q heads per KV head); use \
                 kv_cache_config.dtype auto",
                config.head_dim
            ))
        })?;
    if !tiled_prefill_attention()? {
        return Err(EngineError::Config(
            "an fp8 KV cache is read only by the tensor-core attention, which \
             TANDEM_CUDA_PREFILL_ATTENTION=fast turns off"
                .into(),
        ));
    }
    dev.load_fp8_kv_attention()?;
    let mut inputs = StepInputs::new(dev)?;
    inputs.maps.tile_tokens = tiles;
    inputs.maps.tile_slots = tile_slots(dev, config, true)?;
    inputs.maps.decode_tc_min = 0;
    Ok(inputs)
}

/// [`TokenMaps::tile_slots`](super::TokenMaps::tile_slots) of the model's prefill tiles
/// (none where [`super::switches::PREFILL_TILE_ORDER_ENV`] asks for the longest-first order
/// alone); `fp8`: over an FP8 pool.
fn tile_slots(
    dev: &CudaDevice,
    config: &ModelConfig,
    fp8: bool,
) -> Result<Option<TileSlots>, EngineError> {
    if !super::switches::paired_tile_order()? {
        return Ok(None);
    }
    dev.prefill_tile_slots(config.head_dim, config.num_key_value_heads, fp8)
        .map(Some)
}

/// The pool's shape: `size` blocks, or as many as the fraction of the device memory free now
/// holds (at least one).
fn pool_shape(
    dev: &CudaDevice,
    layout: &KvLayout,
    size: PoolSize,
) -> Result<PoolShape, EngineError> {
    let per_block = layout.block_bytes();
    let num_blocks = match size {
        PoolSize::Blocks(n) => n,
        PoolSize::FreeFraction(f) => {
            if !(f > 0.0 && f <= 1.0) {
                return Err(EngineError::InvalidInput(format!(
                    "free_gpu_memory_fraction must be in (0, 1], got {f}"
                )));
            }
            dev.synchronize()?;
            let (free, _) = dev.mem_info()?;
            (free as f64 * f) as usize / per_block.max(1)
        }
    };
    if num_blocks == 0 {
        return Err(EngineError::Config(format!(
            "the KV pool gets no block of {per_block} bytes (pool size {size:?})"
        )));
    }
    Ok(PoolShape {
        num_blocks,
        num_layers: layout.num_layers,
        block_size: layout.block_size,
        num_kv_heads: layout.num_kv_heads,
        head_dim: layout.head_dim,
        scales: layout.dtype.scale_bytes() > 0,
    })
}

/// A device-sampled step has one plan slot per sequence.
fn check_plans(batch: &[SeqInput<'_>], plans: &[Option<&SamplePlan>]) -> Result<(), EngineError> {
    if plans.len() != batch.len() {
        return Err(EngineError::InvalidInput(format!(
            "device sampling: {} plans for {} sequences",
            plans.len(),
            batch.len()
        )));
    }
    Ok(())
}

/// A step's token ids split per sequence (`counts[i]` rows each, in batch order). A negative
/// id is a row whose logits held NaN or +inf (the f16 program's `sampling.cu` check): an
/// error for the step, naming the likely cause.
fn ids_per_sequence(counts: &[usize], rows: StepRows) -> Result<Vec<Vec<u32>>, EngineError> {
    let ids = match rows {
        StepRows::Ids(ids) => ids,
        StepRows::Logits(_) => Vec::new(),
    };
    let bad = ids.iter().filter(|&&id| id < 0).count();
    if bad > 0 {
        return Err(EngineError::Backend(format!(
            "non-finite logits (NaN or +inf) in {bad} of the step's {} rows: an activation \
             beyond f16's range (±65,504); run with --cuda-precision bf16",
            ids.len()
        )));
    }
    let mut it = ids.into_iter();
    Ok(counts
        .iter()
        .map(|&c| it.by_ref().take(c).map(|id| id as u32).collect())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_ids_split_per_sequence_and_a_flagged_row_is_an_error() {
        let ids = ids_per_sequence(&[2, 0, 1], StepRows::Ids(vec![5, 7, 9])).unwrap();
        assert_eq!(ids, vec![vec![5, 7], vec![], vec![9]]);
        let e = ids_per_sequence(&[1, 1], StepRows::Ids(vec![3, -1]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("1 of the step's 2 rows") && e.contains("--cuda-precision bf16"),
            "{e}"
        );
    }
}
