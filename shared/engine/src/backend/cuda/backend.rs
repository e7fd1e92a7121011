//! [`CudaBackend`]: the decoder forward pass of [`crate::model::decoder`] on one GPU.
//!
//! Compute modes: [`ComputeMode::F32`] (weights widened to f32, f32 GEMMs: the exact mode,
//! compared with the CPU backend), [`ComputeMode::Bf16`] (weights resident in bf16, bf16 ×
//! bf16 GEMMs accumulating in f32; the producers of each GEMM input write bf16 directly) and
//! [`ComputeMode::Bf16Split`] (bf16 weights, each GEMM input as hi + lo bf16 rows). The
//! residual stream, norms, RoPE and softmax stay in f32 in all. The paged KV
//! pool lives in GPU memory in the layout's dtype, with the same [`KvLayout`] as the CPU
//! backend, so exported blocks are interchangeable. Activations live in a workspace reused
//! from step to step (grown when a step is larger than any before).

use cudarc::driver::CudaSlice;

use super::{AttentionScratch, CudaDevice, DeviceElem, DeviceMatrix, KvPool, PoolShape};
use crate::backend::cpu_ops::Matrix;
use crate::backend::{Backend, KvPoolMemory, LogitsMode, SeqInput, StepOutput};
use crate::error::EngineError;
use crate::kv::layout::{KvDtype, KvLayout, LAYOUT_VERSION};
use crate::model::config::ModelConfig;
use crate::model::decoder::DecoderWeights;
use crate::model::LoadedModel;

/// The element type of weights and GEMM inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ComputeMode {
    /// f32 weights and GEMMs: for exact comparisons with the CPU backend.
    F32,
    /// bf16 weights and GEMM inputs, f32 accumulation: the fast serving mode.
    Bf16,
    /// bf16 weights; each GEMM input split into two bf16 terms (hi = bf16(x), lo =
    /// bf16(x - hi)) stacked as twice the rows of one GEMM whose output halves are then
    /// added, so activations keep ~16 bits of mantissa: near-f32 results with the weights
    /// resident (and read once) in bf16, for twice the GEMM FLOPs.
    Bf16Split,
}

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
}

struct DeviceLayer {
    input_norm: CudaSlice<f32>,
    qkv: DeviceMatrix,
    qkv_bias: Option<CudaSlice<f32>>,
    q_norm: Option<CudaSlice<f32>>,
    k_norm: Option<CudaSlice<f32>>,
    o_proj: DeviceMatrix,
    o_bias: Option<CudaSlice<f32>>,
    post_norm: CudaSlice<f32>,
    gate_up: DeviceMatrix,
    down: DeviceMatrix,
}

/// The weights and the KV pool on the device.
struct DeviceModel {
    dev: CudaDevice,
    config: ModelConfig,
    shape: PoolShape,
    pool: KvPool,
    embed: DeviceMatrix,
    layers: Vec<DeviceLayer>,
    norm: CudaSlice<f32>,
    lm_head: Option<DeviceMatrix>,
    inv_freq: CudaSlice<f32>,
    scratch: AttentionScratch,
}

/// Activation buffers of a step; `A` is the GEMM input type (f32 or bf16 as u16).
struct Workspace<A: DeviceElem> {
    tokens: usize,
    /// Split-bf16 GEMM inputs ([`ComputeMode::Bf16Split`]).
    split: bool,
    x: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    proj: CudaSlice<f32>,
    gu: CudaSlice<f32>,
    normed: CudaSlice<A>,
    attn: CudaSlice<A>,
    act: CudaSlice<A>,
    rows: usize,
    sel_x: CudaSlice<f32>,
    sel_res: CudaSlice<f32>,
    sel: CudaSlice<A>,
    logits: CudaSlice<f32>,
    ids: CudaSlice<i32>,
}

impl<A: DeviceElem> Workspace<A> {
    fn new(
        dev: &CudaDevice,
        cfg: &ModelConfig,
        tokens: usize,
        rows: usize,
        split: bool,
    ) -> Result<Self, EngineError> {
        let (h, qd, kvd, im) = dims(cfg);
        let (t, r) = (tokens.max(1), rows.max(1));
        // Split mode: GEMM inputs and outputs hold twice the rows (hi and lo halves).
        let m = if split { 2 } else { 1 };
        Ok(Workspace {
            tokens: t,
            split,
            x: dev.zeros(t * h)?,
            qkv: dev.zeros(m * t * (qd + 2 * kvd))?,
            proj: dev.zeros(m * t * h)?,
            gu: dev.zeros(m * t * 2 * im)?,
            normed: dev.zeros(m * t * h)?,
            attn: dev.zeros(m * t * qd)?,
            act: dev.zeros(m * t * im)?,
            rows: r,
            sel_x: dev.zeros(r * h)?,
            sel_res: dev.zeros(r * h)?,
            sel: dev.zeros(m * r * h)?,
            logits: dev.zeros(m * r * cfg.vocab_size)?,
            ids: dev.zeros(r)?,
        })
    }

    /// Grows to hold `tokens` tokens and `rows` logits rows.
    fn ensure(
        &mut self,
        dev: &CudaDevice,
        cfg: &ModelConfig,
        tokens: usize,
        rows: usize,
    ) -> Result<(), EngineError> {
        if tokens > self.tokens || rows > self.rows {
            let (t, r) = (tokens.max(self.tokens), rows.max(self.rows));
            *self = Workspace::new(dev, cfg, t, r, self.split)?;
        }
        Ok(())
    }
}

enum AnyWorkspace {
    F32(Workspace<f32>),
    Bf16(Workspace<u16>),
}

/// (hidden, q width, kv width, intermediate).
fn dims(cfg: &ModelConfig) -> (usize, usize, usize, usize) {
    (
        cfg.hidden_size,
        cfg.num_attention_heads * cfg.head_dim,
        cfg.num_key_value_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
}

/// What a step brings back from the device.
enum Readout {
    Logits,
    Argmax,
}

/// The flattened rows a step brought back, in the order of the batch.
enum StepRows {
    Logits(Vec<f32>),
    Ids(Vec<i32>),
}

/// The decoder on one GPU.
pub struct CudaBackend {
    model: DeviceModel,
    ws: AnyWorkspace,
    layout: KvLayout,
    mode: ComputeMode,
    /// Host memory remote prefills write blocks into (a decode worker of disaggregated
    /// serving), laid out as the pool; copied into the GPU pool on activation.
    staging: Option<KvPoolMemory>,
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
        let dev = CudaDevice::new(opts.ordinal)?;
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
        dev: CudaDevice,
        config: ModelConfig,
        weights: &DecoderWeights,
        model_id: String,
        opts: &CudaOptions,
    ) -> Result<Self, EngineError> {
        let block_size = opts.block_size;
        if block_size == 0 {
            return Err(EngineError::InvalidInput("block_size must be > 0".into()));
        }
        let layout = KvLayout {
            version: LAYOUT_VERSION,
            model_id,
            dtype: opts.kv_dtype,
            block_size,
            num_layers: config.num_hidden_layers,
            num_kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
        };
        let mode = opts.mode;
        let up = |m: &Matrix| -> Result<DeviceMatrix, EngineError> {
            Ok(match (mode, m) {
                (ComputeMode::F32, Matrix::F32(v)) => DeviceMatrix::F32(dev.upload(v)?),
                // Widening bf16 to f32 is exact.
                (ComputeMode::F32, Matrix::Bf16(_)) => {
                    DeviceMatrix::F32(dev.upload(&m.clone().into_f32())?)
                }
                (ComputeMode::Bf16 | ComputeMode::Bf16Split, Matrix::Bf16(v)) => {
                    DeviceMatrix::Bf16(dev.upload(v)?)
                }
                (ComputeMode::Bf16 | ComputeMode::Bf16Split, Matrix::F32(v)) => DeviceMatrix::Bf16(
                    dev.upload(
                        &v.iter()
                            .map(|x| half::bf16::from_f32(*x).to_bits())
                            .collect::<Vec<u16>>(),
                    )?,
                ),
            })
        };
        let vec = |v: &[f32]| dev.upload(v);
        let opt = |v: &Option<Vec<f32>>| v.as_deref().map(|v| dev.upload(v)).transpose();
        let mut layers = Vec::with_capacity(weights.layers.len());
        for lw in &weights.layers {
            layers.push(DeviceLayer {
                input_norm: vec(&lw.input_norm)?,
                qkv: up(&lw.qkv)?,
                qkv_bias: opt(&lw.qkv_bias)?,
                q_norm: opt(&lw.q_norm)?,
                k_norm: opt(&lw.k_norm)?,
                o_proj: up(&lw.o_proj)?,
                o_bias: opt(&lw.o_bias)?,
                post_norm: vec(&lw.post_norm)?,
                gate_up: up(&lw.gate_up)?,
                down: up(&lw.down)?,
            });
        }
        let inv: Vec<f32> = config.rope_inv_freq().iter().map(|f| *f as f32).collect();
        let embed = up(&weights.embed)?;
        let lm_head = weights.lm_head.as_ref().map(&up).transpose()?;
        let norm = vec(&weights.norm)?;
        let inv_freq = dev.upload(&inv)?;
        // The workspace first, at the step size the engine schedules, so the pool sized from
        // the free memory leaves it room.
        let rows = 256;
        let ws = match mode {
            ComputeMode::F32 => AnyWorkspace::F32(Workspace::new(
                &dev,
                &config,
                opts.max_step_tokens,
                rows,
                false,
            )?),
            ComputeMode::Bf16 | ComputeMode::Bf16Split => AnyWorkspace::Bf16(Workspace::new(
                &dev,
                &config,
                opts.max_step_tokens,
                rows,
                mode == ComputeMode::Bf16Split,
            )?),
        };
        let scratch = AttentionScratch::new(&dev)?;
        let per_block = layout.block_bytes();
        let num_blocks = match opts.pool {
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
                "the KV pool gets no block of {per_block} bytes (pool size {:?})",
                opts.pool
            )));
        }
        let shape = PoolShape {
            num_blocks,
            num_layers: layout.num_layers,
            block_size,
            num_kv_heads: layout.num_kv_heads,
            head_dim: layout.head_dim,
        };
        let pool = match layout.dtype {
            KvDtype::F32 => KvPool::F32(dev.zeros(shape.elems())?),
            KvDtype::Bf16 => KvPool::Bf16(dev.zeros(shape.elems())?),
        };
        tracing::info!(
            device = dev.name(),
            arch = dev.arch(),
            ?mode,
            num_blocks,
            pool_gib = (num_blocks * per_block) as f64 / (1u64 << 30) as f64,
            "CUDA backend ready"
        );
        Ok(CudaBackend {
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
            },
            ws,
            layout,
            mode,
            staging: None,
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

    pub fn device(&self) -> &CudaDevice {
        &self.model.dev
    }

    pub fn mode(&self) -> ComputeMode {
        self.mode
    }

    /// One step with greedy sampling on the device: per sequence, the argmax token of each
    /// row it asked for (the logits never leave the GPU).
    pub fn forward_greedy(&mut self, batch: &[SeqInput<'_>]) -> Result<Vec<Vec<u32>>, EngineError> {
        let (counts, rows) = self.step(batch, Readout::Argmax)?;
        let ids = match rows {
            StepRows::Ids(ids) => ids,
            StepRows::Logits(_) => Vec::new(),
        };
        let mut it = ids.into_iter();
        Ok(counts
            .iter()
            .map(|&c| it.by_ref().take(c).map(|id| id as u32).collect())
            .collect())
    }

    /// Runs a step; returns the number of rows per sequence and the rows.
    fn step(
        &mut self,
        batch: &[SeqInput<'_>],
        readout: Readout,
    ) -> Result<(Vec<usize>, StepRows), EngineError> {
        crate::backend::check_batch(batch, self.layout.block_size, self.model.shape.num_blocks)?;
        match &mut self.ws {
            AnyWorkspace::F32(ws) => self.model.step(ws, batch, readout),
            AnyWorkspace::Bf16(ws) => self.model.step(ws, batch, readout),
        }
    }

    fn block_range(&self, b: u32) -> std::ops::Range<usize> {
        let per = self.model.shape.elems() / self.model.shape.num_blocks;
        b as usize * per..(b as usize + 1) * per
    }
}

impl DeviceModel {
    fn step<A: DeviceElem>(
        &mut self,
        ws: &mut Workspace<A>,
        batch: &[SeqInput<'_>],
        readout: Readout,
    ) -> Result<(Vec<usize>, StepRows), EngineError> {
        let cfg = &self.config;
        let dev = &self.dev;
        let (h, qd, kvd, im) = dims(cfg);
        let (hd, nq, nkv, eps) = (
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.rms_norm_eps,
        );
        let qkv_w = qd + 2 * kvd;
        let window = cfg.sliding_window.unwrap_or(usize::MAX);
        let scale = 1.0 / (hd as f32).sqrt();
        let ids: Vec<u32> = batch
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let t = ids.len();
        // The rows whose logits are wanted, and how many per sequence.
        let mut rows: Vec<u32> = Vec::new();
        let mut counts = Vec::with_capacity(batch.len());
        let mut first = 0u32;
        for seq in batch {
            let n = seq.tokens.len() as u32;
            let before = rows.len();
            match seq.logits {
                LogitsMode::None => {}
                LogitsMode::Last if n > 0 => rows.push(first + n - 1),
                LogitsMode::Last => {}
                LogitsMode::All => rows.extend(first..first + n),
            }
            counts.push(rows.len() - before);
            first += n;
        }
        let empty = match readout {
            Readout::Logits => StepRows::Logits(Vec::new()),
            Readout::Argmax => StepRows::Ids(Vec::new()),
        };
        if t == 0 {
            return Ok((counts, empty));
        }
        let r = rows.len();
        ws.ensure(dev, cfg, t, r)?;
        let seqs: Vec<(&[u32], std::ops::Range<usize>)> = batch
            .iter()
            .map(|s| (s.block_table, s.start_pos..s.start_pos + s.tokens.len()))
            .collect();
        let maps = dev.token_maps(&seqs, self.shape.block_size, window)?;

        // Split mode: each GEMM runs over the stacked [hi; lo] rows of its input (m rows),
        // then its output's halves are folded into the first t rows.
        let split = ws.split;
        let m = if split { 2 * t } else { t };
        let fold = |dev: &CudaDevice, out: &mut CudaSlice<f32>, elems: usize| {
            if split {
                dev.fold_rows(out, elems)
            } else {
                Ok(())
            }
        };
        dev.embedding(&mut ws.x, &self.embed, &ids, h)?;
        for (l, lw) in self.layers.iter().enumerate() {
            // The previous layer's MLP output joins the residual stream here (fused add).
            let residual = (l > 0).then_some(&ws.proj);
            dev.rms_norm(
                &mut ws.normed,
                &mut ws.x,
                residual,
                &lw.input_norm,
                t,
                eps,
                split,
            )?;
            dev.matmul_t(&ws.normed, m, h, &lw.qkv, qkv_w, &mut ws.qkv)?;
            fold(dev, &mut ws.qkv, t * qkv_w)?;
            if let Some(b) = &lw.qkv_bias {
                dev.bias_add(&mut ws.qkv, b, t)?;
            }
            dev.qk_norm_rope(
                &mut ws.qkv,
                qkv_w,
                nq,
                nkv,
                hd,
                &maps,
                &self.inv_freq,
                lw.q_norm.as_ref(),
                lw.k_norm.as_ref(),
                eps,
            )?;
            dev.kv_write(&mut self.pool, self.shape, l, &ws.qkv, qkv_w, qd, &maps)?;
            dev.attention_fast(
                &mut ws.attn,
                &ws.qkv,
                qkv_w,
                &self.pool,
                self.shape,
                l,
                nq,
                &maps,
                scale,
                &mut self.scratch,
                split,
            )?;
            dev.matmul_t(&ws.attn, m, qd, &lw.o_proj, h, &mut ws.proj)?;
            fold(dev, &mut ws.proj, t * h)?;
            if let Some(b) = &lw.o_bias {
                dev.bias_add(&mut ws.proj, b, t)?;
            }
            dev.rms_norm(
                &mut ws.normed,
                &mut ws.x,
                Some(&ws.proj),
                &lw.post_norm,
                t,
                eps,
                split,
            )?;
            dev.matmul_t(&ws.normed, m, h, &lw.gate_up, 2 * im, &mut ws.gu)?;
            fold(dev, &mut ws.gu, t * 2 * im)?;
            dev.silu_mul(&mut ws.act, &ws.gu, t, im, split)?;
            dev.matmul_t(&ws.act, m, im, &lw.down, h, &mut ws.proj)?;
            fold(dev, &mut ws.proj, t * h)?;
        }
        if r == 0 {
            return Ok((counts, empty));
        }
        // Only the wanted rows: gather the residual stream and the last MLP output, then the
        // final norm (with its fused add) and the lm_head GEMM on those rows alone.
        dev.gather_rows(&mut ws.sel_x, &ws.x, t, &rows, h, false)?;
        let residual = if self.layers.is_empty() {
            None
        } else {
            dev.gather_rows(&mut ws.sel_res, &ws.proj, t, &rows, h, false)?;
            Some(&ws.sel_res)
        };
        dev.rms_norm(
            &mut ws.sel,
            &mut ws.sel_x,
            residual,
            &self.norm,
            r,
            eps,
            split,
        )?;
        let v = cfg.vocab_size;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let head_rows = if split { 2 * r } else { r };
        dev.matmul_t(&ws.sel, head_rows, h, head, v, &mut ws.logits)?;
        fold(dev, &mut ws.logits, r * v)?;
        let out = match readout {
            Readout::Logits => {
                let host: Vec<f32> = dev
                    .stream()
                    .clone_dtoh(&ws.logits.slice(..r * v))
                    .map_err(|e| EngineError::Backend(format!("CUDA logits copy: {e:?}")))?;
                StepRows::Logits(host)
            }
            Readout::Argmax => {
                dev.argmax(&mut ws.ids, &ws.logits, r, v)?;
                let host: Vec<i32> = dev
                    .stream()
                    .clone_dtoh(&ws.ids.slice(..r))
                    .map_err(|e| EngineError::Backend(format!("CUDA argmax copy: {e:?}")))?;
                StepRows::Ids(host)
            }
        };
        Ok((counts, out))
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

    fn forward(&mut self, batch: &[SeqInput<'_>]) -> Result<StepOutput, EngineError> {
        let (counts, rows) = self.step(batch, Readout::Logits)?;
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

    fn load_received_blocks(&mut self, blocks: &[u32]) -> Result<(), EngineError> {
        let Some(staging) = &self.staging else {
            return Ok(());
        };
        crate::backend::check_blocks(blocks, self.model.shape.num_blocks)?;
        let bb = self.layout.block_bytes();
        let mut data = Vec::with_capacity(blocks.len() * bb);
        for &b in blocks {
            let at = b as usize * bb;
            // SAFETY: the staging memory holds the whole pool (checked in with_staging) and
            // the block id is in the pool (checked above); the remote writer finished these
            // blocks before the activation that calls this.
            let bytes = unsafe { std::slice::from_raw_parts(staging.as_ptr().add(at), bb) };
            data.extend_from_slice(bytes);
        }
        self.import_blocks(blocks, &data)
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
                KvPool::Bf16(p) => {
                    let v: Vec<u16> = stream.clone_dtoh(&p.slice(range)).map_err(err)?;
                    out.extend(v.iter().flat_map(|x| x.to_le_bytes()));
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
                KvPool::Bf16(p) => {
                    let v: Vec<u16> = bytes
                        .chunks_exact(2)
                        .map(|c| u16::from_le_bytes([c[0], c[1]]))
                        .collect();
                    stream
                        .memcpy_htod(&v, &mut p.slice_mut(range))
                        .map_err(err)?;
                }
            }
            // The copy reads `v`, dropped at the end of this iteration.
            self.model.dev.synchronize()?;
        }
        Ok(())
    }
}
