//! [`CudaBackend`]: the decoder forward pass of [`crate::model::decoder`] on one GPU, in the
//! f32 mode (weights widened to f32 on upload, f32 activations, cuBLAS sgemm), with the paged
//! KV pool in GPU memory in the layout's dtype (f32 or bf16). It follows the CPU path step for
//! step so that the two can be compared exactly; speed (bf16 GEMMs, fused/fast attention,
//! CUDA graphs, GPU sampling) comes later. Families with q/k/v or o biases (Qwen2) are refused
//! with an error until a bias kernel exists.

use cudarc::driver::CudaSlice;

use super::{CudaDevice, DeviceMatrix, KvPool, PoolShape};
use crate::backend::cpu_ops::Matrix;
use crate::backend::{Backend, LogitsMode, SeqInput, StepOutput};
use crate::error::EngineError;
use crate::kv::layout::{KvDtype, KvLayout, LAYOUT_VERSION};
use crate::model::config::ModelConfig;
use crate::model::decoder::DecoderWeights;
use crate::model::LoadedModel;

struct DeviceLayer {
    input_norm: CudaSlice<f32>,
    qkv: DeviceMatrix,
    q_norm: Option<CudaSlice<f32>>,
    k_norm: Option<CudaSlice<f32>>,
    o_proj: DeviceMatrix,
    post_norm: CudaSlice<f32>,
    gate_up: DeviceMatrix,
    down: DeviceMatrix,
}

/// The decoder on one GPU (f32 mode).
pub struct CudaBackend {
    dev: CudaDevice,
    config: ModelConfig,
    layout: KvLayout,
    shape: PoolShape,
    pool: KvPool,
    embed: DeviceMatrix,
    layers: Vec<DeviceLayer>,
    norm: CudaSlice<f32>,
    lm_head: Option<DeviceMatrix>,
    inv_freq: CudaSlice<f32>,
}

impl CudaBackend {
    /// A backend on GPU `ordinal` over `model`'s weights with a zeroed pool of `num_blocks`.
    pub fn new(
        model: &LoadedModel,
        ordinal: usize,
        kv_dtype: KvDtype,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, EngineError> {
        if !model.weights_loaded {
            return Err(EngineError::InvalidInput(format!(
                "{} was loaded without its weights",
                model.path.display()
            )));
        }
        let dev = CudaDevice::new(ordinal)?;
        Self::from_parts(
            dev,
            model.config.clone(),
            &model.weights,
            model.model_id.clone(),
            kv_dtype,
            block_size,
            num_blocks,
        )
    }

    /// A backend from weights built elsewhere (checks, random models).
    pub fn from_parts(
        dev: CudaDevice,
        config: ModelConfig,
        weights: &DecoderWeights,
        model_id: String,
        kv_dtype: KvDtype,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, EngineError> {
        if block_size == 0 || num_blocks == 0 {
            return Err(EngineError::InvalidInput(format!(
                "block_size ({block_size}) and num_blocks ({num_blocks}) must be > 0"
            )));
        }
        if config.qkv_bias || config.o_bias {
            return Err(EngineError::Config(
                "the CUDA backend does not run models with attention biases (Qwen2) yet".into(),
            ));
        }
        let layout = KvLayout {
            version: LAYOUT_VERSION,
            model_id,
            dtype: kv_dtype,
            block_size,
            num_layers: config.num_hidden_layers,
            num_kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
        };
        let shape = PoolShape {
            num_blocks,
            num_layers: layout.num_layers,
            block_size,
            num_kv_heads: layout.num_kv_heads,
            head_dim: layout.head_dim,
        };
        let pool = match kv_dtype {
            KvDtype::F32 => KvPool::F32(dev.zeros(shape.elems())?),
            KvDtype::Bf16 => KvPool::Bf16(dev.zeros(shape.elems())?),
        };
        let up = |m: &Matrix| -> Result<DeviceMatrix, EngineError> {
            // f32 mode: bf16 weights are widened (exactly) to f32.
            Ok(DeviceMatrix::F32(match m {
                Matrix::F32(v) => dev.upload(v)?,
                Matrix::Bf16(_) => dev.upload(&m.clone().into_f32())?,
            }))
        };
        let vec = |v: &[f32]| dev.upload(v);
        let opt = |v: &Option<Vec<f32>>| v.as_deref().map(|v| dev.upload(v)).transpose();
        let mut layers = Vec::with_capacity(weights.layers.len());
        for lw in &weights.layers {
            layers.push(DeviceLayer {
                input_norm: vec(&lw.input_norm)?,
                qkv: up(&lw.qkv)?,
                q_norm: opt(&lw.q_norm)?,
                k_norm: opt(&lw.k_norm)?,
                o_proj: up(&lw.o_proj)?,
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
        Ok(CudaBackend {
            dev,
            config,
            layout,
            shape,
            pool,
            embed,
            layers,
            norm,
            lm_head,
            inv_freq,
        })
    }

    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    fn check_blocks(&self, blocks: &[u32]) -> Result<(), EngineError> {
        crate::backend::check_blocks(blocks, self.shape.num_blocks)
    }

    fn check_batch(&self, batch: &[SeqInput<'_>]) -> Result<(), EngineError> {
        crate::backend::check_batch(batch, self.layout.block_size, self.shape.num_blocks)
    }

    fn block_range(&self, b: u32) -> std::ops::Range<usize> {
        let per = self.shape.elems() / self.shape.num_blocks;
        b as usize * per..(b as usize + 1) * per
    }
}

impl Backend for CudaBackend {
    fn layout(&self) -> &KvLayout {
        &self.layout
    }

    fn num_blocks(&self) -> usize {
        self.shape.num_blocks
    }

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn forward(&mut self, batch: &[SeqInput<'_>]) -> Result<StepOutput, EngineError> {
        self.check_batch(batch)?;
        let cfg = &self.config;
        let dev = &self.dev;
        let (h, hd, nq, nkv) = (
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
        );
        let (qd, kvd, im, eps) = (nq * hd, nkv * hd, cfg.intermediate_size, cfg.rms_norm_eps);
        let qkv_w = qd + 2 * kvd;
        let window = cfg.sliding_window.unwrap_or(usize::MAX);
        let scale = 1.0 / (hd as f32).sqrt();
        let ids: Vec<u32> = batch
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let t = ids.len();
        if t == 0 {
            return Ok(StepOutput {
                logits: vec![Vec::new(); batch.len()],
            });
        }
        let seqs: Vec<(&[u32], std::ops::Range<usize>)> = batch
            .iter()
            .map(|s| (s.block_table, s.start_pos..s.start_pos + s.tokens.len()))
            .collect();
        let maps = dev.token_maps(&seqs, self.layout.block_size, window)?;

        let mut x = dev.zeros::<f32>(t * h)?;
        dev.embedding(&mut x, &self.embed, &ids, h)?;
        let mut normed = dev.zeros::<f32>(t * h)?;
        let mut qkv = dev.zeros::<f32>(t * qkv_w)?;
        let mut attn = dev.zeros::<f32>(t * qd)?;
        let mut proj = dev.zeros::<f32>(t * h)?;
        let mut gu = dev.zeros::<f32>(t * 2 * im)?;
        let mut act = dev.zeros::<f32>(t * im)?;

        for (l, lw) in self.layers.iter().enumerate() {
            // The previous layer's MLP output joins the residual stream here (fused add).
            let residual = (l > 0).then_some(&proj);
            dev.rms_norm(&mut normed, &mut x, residual, &lw.input_norm, t, eps)?;
            dev.matmul_t(&normed, t, h, &lw.qkv, qkv_w, &mut qkv)?;
            dev.qk_norm_rope(
                &mut qkv,
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
            dev.kv_write(&mut self.pool, self.shape, l, &qkv, qkv_w, qd, &maps)?;
            dev.attention(
                &mut attn, &qkv, qkv_w, &self.pool, self.shape, l, nq, &maps, scale,
            )?;
            dev.matmul_t(&attn, t, qd, &lw.o_proj, h, &mut proj)?;
            dev.rms_norm(&mut normed, &mut x, Some(&proj), &lw.post_norm, t, eps)?;
            dev.matmul_t(&normed, t, h, &lw.gate_up, 2 * im, &mut gu)?;
            dev.silu_mul(&mut act, &gu, t, im)?;
            dev.matmul_t(&act, t, im, &lw.down, h, &mut proj)?;
        }
        let residual = (!self.layers.is_empty()).then_some(&proj);
        dev.rms_norm(&mut normed, &mut x, residual, &self.norm, t, eps)?;

        // Logits only for the rows asked for: gather them (the embedding kernel over the
        // normed rows), then the lm_head GEMM.
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
        let r = rows.len();
        let v = cfg.vocab_size;
        let mut out_rows: Vec<Vec<f32>> = Vec::with_capacity(r);
        if r > 0 {
            let normed = DeviceMatrix::F32(normed);
            let mut sel = dev.zeros::<f32>(r * h)?;
            dev.embedding(&mut sel, &normed, &rows, h)?;
            let mut logits = dev.zeros::<f32>(r * v)?;
            let head = self.lm_head.as_ref().unwrap_or(&self.embed);
            dev.matmul_t(&sel, r, h, head, v, &mut logits)?;
            let host = dev.download(&logits)?;
            out_rows = host.chunks_exact(v).map(<[f32]>::to_vec).collect();
        }
        let mut it = out_rows.into_iter();
        let logits = counts
            .iter()
            .map(|&c| it.by_ref().take(c).collect())
            .collect();
        Ok(StepOutput { logits })
    }

    fn export_blocks(&self, blocks: &[u32]) -> Result<Vec<u8>, EngineError> {
        self.check_blocks(blocks)?;
        let mut out = Vec::with_capacity(blocks.len() * self.layout.block_bytes());
        let stream = self.dev.stream();
        let err = |e| EngineError::Backend(format!("CUDA block export: {e:?}"));
        for &b in blocks {
            let range = self.block_range(b);
            match &self.pool {
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
        self.check_blocks(blocks)?;
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
            let stream = self.dev.stream().clone();
            match &mut self.pool {
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
            self.dev.synchronize()?;
        }
        Ok(())
    }
}
