//! The device state of [`super::CudaBackend`] and one decoder step, in three parts so that
//! the middle one can be captured into a CUDA graph: [`DeviceModel::prepare`] (host checks,
//! the step's inputs copied into persistent device buffers), [`DeviceModel::launch`] (kernels
//! and GEMMs only: no copy, no allocation) and [`DeviceModel::read_back`].

use cudarc::driver::CudaSlice;

use super::gemm::GemvInput;
use super::ops::HeadNorms;
use super::sampling::SamplingInputs;
pub(super) use super::workspace::{dims, AnyWorkspace, Workspace};
use super::{AttentionScratch, CudaDevice, DeviceElem, DeviceMatrix, KvPool, PoolShape, TokenMaps};
use crate::backend::{LogitsMode, SeqInput};
use crate::error::EngineError;
use crate::model::config::ModelConfig;
use crate::sampler::SamplePlan;

pub(super) struct DeviceLayer {
    pub(super) input_norm: CudaSlice<f32>,
    pub(super) qkv: DeviceMatrix,
    pub(super) qkv_bias: Option<CudaSlice<f32>>,
    pub(super) q_norm: Option<CudaSlice<f32>>,
    pub(super) k_norm: Option<CudaSlice<f32>>,
    pub(super) o_proj: DeviceMatrix,
    pub(super) o_bias: Option<CudaSlice<f32>>,
    pub(super) post_norm: CudaSlice<f32>,
    pub(super) gate_up: DeviceMatrix,
    pub(super) down: DeviceMatrix,
}

/// The weights and the KV pool on the device.
pub(super) struct DeviceModel {
    pub(super) dev: CudaDevice,
    pub(super) config: ModelConfig,
    pub(super) shape: PoolShape,
    pub(super) pool: KvPool,
    pub(super) embed: DeviceMatrix,
    pub(super) layers: Vec<DeviceLayer>,
    pub(super) norm: CudaSlice<f32>,
    pub(super) lm_head: Option<DeviceMatrix>,
    pub(super) inv_freq: CudaSlice<f32>,
    pub(super) scratch: AttentionScratch,
    pub(super) inputs: StepInputs,
}

/// What a step brings back from the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Readout {
    Logits,
    Argmax,
    /// One token per row by the step's sampling plans (`sampling.cu`).
    Sample,
}

/// The flattened rows a step brought back, in the order of the batch.
pub(super) enum StepRows {
    Logits(Vec<f32>),
    Ids(Vec<i32>),
}

/// A step's inputs on the device, in buffers kept from step to step (a captured graph reads
/// them at fixed addresses): token ids, the rows whose logits are wanted and the token maps
/// (one buffer, [`TokenMaps`]), the sampling parameters.
pub(super) struct StepInputs {
    pub(super) maps: TokenMaps,
    pub(super) sampling: SamplingInputs,
}

impl StepInputs {
    pub(super) fn new(dev: &CudaDevice) -> Result<Self, EngineError> {
        Ok(StepInputs {
            maps: TokenMaps::empty(dev)?,
            sampling: SamplingInputs::new(dev)?,
        })
    }

    /// Changes whenever any buffer moved.
    pub(super) fn generation(&self) -> u64 {
        self.maps.generation + self.sampling.generation
    }
}

/// What [`DeviceModel::prepare`] found: tokens, logits rows, rows per sequence.
pub(super) struct Prepared {
    pub(super) t: usize,
    pub(super) r: usize,
    pub(super) counts: Vec<usize>,
}

impl DeviceModel {
    /// Host side of a step: checks, workspace size, inputs copied to the device (with
    /// `plans`, one per sequence, those of the sampled rows too).
    pub(super) fn prepare<A: DeviceElem>(
        &mut self,
        ws: &mut Workspace<A>,
        batch: &[SeqInput<'_>],
        plans: Option<&[Option<&SamplePlan>]>,
    ) -> Result<Prepared, EngineError> {
        let ids: Vec<u32> = batch
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let t = ids.len();
        let vocab = self.config.vocab_size;
        if let Some(id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(EngineError::InvalidInput(format!(
                "token id {id} is outside the vocabulary ({vocab})"
            )));
        }
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
        let r = rows.len();
        if t == 0 {
            return Ok(Prepared { t, r, counts });
        }
        ws.ensure(&self.dev, &self.config, t, r)?;
        let window = self.config.sliding_window.unwrap_or(usize::MAX);
        let seqs: Vec<(&[u32], std::ops::Range<usize>)> = batch
            .iter()
            .map(|s| (s.block_table, s.start_pos..s.start_pos + s.tokens.len()))
            .collect();
        let bs = self.shape.block_size;
        (self.dev).fill_step_maps(&mut self.inputs.maps, &ids, &rows, &seqs, bs, window)?;
        if let Some(plans) = plans {
            // Every row is one sequence's last token (LogitsMode::Last), in batch order.
            let mut row_plans = Vec::with_capacity(r);
            for (i, seq) in batch.iter().enumerate() {
                match (seq.logits, plans.get(i).copied().flatten()) {
                    (LogitsMode::Last, Some(p)) if !seq.tokens.is_empty() => row_plans.push(p),
                    (LogitsMode::None, None) => {}
                    (LogitsMode::Last, None) if seq.tokens.is_empty() => {}
                    _ => {
                        return Err(EngineError::InvalidInput(format!(
                            "device sampling: sequence {i} needs a plan exactly when it asks \
                             for its last row (it asks for {:?})",
                            seq.logits
                        )))
                    }
                }
            }
            self.inputs.sampling.fill(&self.dev, &row_plans)?;
        }
        Ok(Prepared { t, r, counts })
    }

    /// Buffer generation of everything a launch reads or writes: a graph captured at one
    /// generation is valid only while it is unchanged.
    pub(super) fn generation<A: DeviceElem>(&self, ws: &Workspace<A>) -> u64 {
        self.inputs.generation() + self.scratch.generation + ws.generation
    }

    /// The kernels of a prepared step of `t` tokens and `r` logits rows (argmax too for
    /// `Readout::Argmax`). No copy or allocation happens here.
    pub(super) fn launch<A: DeviceElem>(
        &mut self,
        ws: &mut Workspace<A>,
        t: usize,
        r: usize,
        readout: Readout,
    ) -> Result<(), EngineError> {
        if t == 0 {
            return Ok(());
        }
        let cfg = &self.config;
        let dev = &self.dev;
        let inputs = &self.inputs;
        let (h, qd, kvd, im) = dims(cfg);
        let (hd, nq, nkv, eps) = (
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.rms_norm_eps,
        );
        let qkv_w = qd + 2 * kvd;
        let scale = 1.0 / (hd as f32).sqrt();
        // Split mode: each GEMM runs over the stacked [hi; lo] rows of its input (m rows),
        // then its output's halves are folded into the first t rows — by the kernel that reads
        // the output next where it can (`*_split_*`: no fold launch), else by `fold`.
        let split = ws.split;
        let m = if split { 2 * t } else { t };
        let fold = |dev: &CudaDevice, out: &mut CudaSlice<f32>, elems: usize| {
            if split {
                dev.fold_rows(out, elems)
            } else {
                Ok(())
            }
        };
        let gemv_in = if split {
            GemvInput::F32
        } else {
            GemvInput::Bf16
        };
        // Decode of one or two sequences: each norm rides in the GEMV after it, which reads
        // the stream from `x` and writes the sum to `x2` (and back for the second norm), so the
        // launches per layer drop from ten to six. The split mode's GEMVs read their rows in
        // f32 instead of as hi + lo bf16 (`f32_rows`): nothing to fold. Every layer has the
        // same shapes, so the first decides for all (and `proj` is never left unfolded here).
        let fused = self.layers.first().is_some_and(|lw| {
            dev.norm_gemv_fits(t, h, &lw.qkv, gemv_in)
                && dev.norm_gemv_fits(t, h, &lw.gate_up, gemv_in)
        });
        let f32_rows = fused && split;
        dev.embedding_dev(&mut ws.x, &self.embed, inputs.maps.id_list(), h)?;
        // Whether `proj` (the last GEMM into the residual stream) still holds split halves.
        let mut proj_unfolded = false;
        for (l, lw) in self.layers.iter().enumerate() {
            let heads = HeadNorms {
                nq,
                nkv,
                head_dim: hd,
                inv_freq: &self.inv_freq,
                q_norm: lw.q_norm.as_ref(),
                k_norm: lw.k_norm.as_ref(),
                eps,
            };
            // The previous layer's MLP output joins the residual stream here (fused add).
            let residual = (l > 0).then_some(&ws.proj);
            let mut qkv_unfolded = false;
            if fused {
                dev.norm_gemv(
                    &mut ws.qkv,
                    &ws.x,
                    residual,
                    &mut ws.x2,
                    &lw.input_norm,
                    eps,
                    &lw.qkv,
                    t,
                    h,
                    qkv_w,
                    false,
                    gemv_in,
                )?;
            } else {
                dev.rms_norm_split_residual(
                    &mut ws.normed,
                    &mut ws.x,
                    residual.map(|r| (r, proj_unfolded)),
                    &lw.input_norm,
                    t,
                    eps,
                    split,
                )?;
                dev.matmul_t(&ws.normed, m, h, &lw.qkv, qkv_w, &mut ws.qkv)?;
                // Folded by qk_norm_rope_kv, unless a bias comes first.
                if lw.qkv_bias.is_some() {
                    fold(dev, &mut ws.qkv, t * qkv_w)?;
                } else {
                    qkv_unfolded = split;
                }
            }
            if let Some(b) = &lw.qkv_bias {
                dev.bias_add(&mut ws.qkv, b, t)?;
            }
            // RoPE'd K and V into the pool in the same launch.
            dev.qk_norm_rope_kv_split_input(
                &mut ws.qkv,
                qkv_unfolded,
                qkv_w,
                &heads,
                &inputs.maps,
                &mut self.pool,
                self.shape,
                l,
            )?;
            let (pool, shape, maps) = (&self.pool, self.shape, &inputs.maps);
            if f32_rows {
                let out = &mut ws.attn_f32;
                let scratch = &mut self.scratch;
                dev.attention(
                    out, &ws.qkv, qkv_w, pool, shape, l, nq, maps, scale, scratch, false,
                )?;
            } else {
                let out = &mut ws.attn;
                let scratch = &mut self.scratch;
                dev.attention(
                    out, &ws.qkv, qkv_w, pool, shape, l, nq, maps, scale, scratch, split,
                )?;
            }
            if f32_rows {
                dev.matmul_t(&ws.attn_f32, t, qd, &lw.o_proj, h, &mut ws.proj)?;
            } else {
                dev.matmul_t(&ws.attn, m, qd, &lw.o_proj, h, &mut ws.proj)?;
                // Folded by the next norm, unless a bias comes first.
                if lw.o_bias.is_some() {
                    fold(dev, &mut ws.proj, t * h)?;
                } else {
                    proj_unfolded = split;
                }
            }
            if let Some(b) = &lw.o_bias {
                dev.bias_add(&mut ws.proj, b, t)?;
            }
            if f32_rows {
                let (x2, proj) = (&ws.x2, Some(&ws.proj));
                let (norm, gu) = (&lw.post_norm, &lw.gate_up);
                let out = &mut ws.act_f32;
                dev.norm_gemv(
                    out, x2, proj, &mut ws.x, norm, eps, gu, t, h, im, true, gemv_in,
                )?;
                dev.matmul_t(&ws.act_f32, t, im, &lw.down, h, &mut ws.proj)?;
                continue;
            }
            if fused {
                dev.norm_gemv(
                    &mut ws.act,
                    &ws.x2,
                    Some(&ws.proj),
                    &mut ws.x,
                    &lw.post_norm,
                    eps,
                    &lw.gate_up,
                    t,
                    h,
                    im,
                    true,
                    gemv_in,
                )?;
            } else {
                dev.rms_norm_split_residual(
                    &mut ws.normed,
                    &mut ws.x,
                    Some((&ws.proj, proj_unfolded)),
                    &lw.post_norm,
                    t,
                    eps,
                    split,
                )?;
                dev.matmul_t(&ws.normed, m, h, &lw.gate_up, 2 * im, &mut ws.gu)?;
                dev.silu_mul_split_input(&mut ws.act, &ws.gu, split, t, im, split)?;
            }
            dev.matmul_t(&ws.act, m, im, &lw.down, h, &mut ws.proj)?;
            proj_unfolded = split;
        }
        if r == 0 {
            return Ok(());
        }
        let v = cfg.vocab_size;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        if proj_unfolded && r < t {
            fold(dev, &mut ws.proj, t * h)?;
            proj_unfolded = false;
        }
        {
            // The final norm (with its fused add of the last MLP output) and the lm_head GEMM
            // on the wanted rows alone: all of them in place (r == t, decode steps), else
            // gathered first.
            let layers = !self.layers.is_empty();
            let (stream, mlp_out) = if r == t {
                (&mut ws.x, layers.then_some(&ws.proj))
            } else {
                dev.gather_rows_dev(&mut ws.sel_x, &ws.x, t, inputs.maps.row_list(), h, false)?;
                if layers {
                    dev.gather_rows_dev(
                        &mut ws.sel_res,
                        &ws.proj,
                        t,
                        inputs.maps.row_list(),
                        h,
                        false,
                    )?;
                }
                (&mut ws.sel_x, layers.then_some(&ws.sel_res))
            };
            let mlp_out = mlp_out.map(|p| (p, proj_unfolded));
            if split && dev.f32_rows_gemv_fits(r, h, head) {
                // One or two rows in the split mode: the lm_head GEMV reads them in f32 (no
                // hi and lo rows, no fold of 151,936-wide logits rows at the 0.6B shape).
                let out = &mut ws.sel_f32;
                dev.rms_norm_split_residual(out, stream, mlp_out, &self.norm, r, eps, false)?;
                dev.matmul_t(&ws.sel_f32, r, h, head, v, &mut ws.logits)?;
            } else {
                let out = &mut ws.sel;
                dev.rms_norm_split_residual(out, stream, mlp_out, &self.norm, r, eps, split)?;
                let head_rows = if split { 2 * r } else { r };
                dev.matmul_t(&ws.sel, head_rows, h, head, v, &mut ws.logits)?;
                fold(dev, &mut ws.logits, r * v)?;
            }
        }
        match readout {
            Readout::Argmax => dev.argmax(&mut ws.ids, &ws.logits, r, v, &mut ws.argmax)?,
            Readout::Sample => {
                dev.sample_rows(&mut ws.ids, &mut ws.logits, r, v, &inputs.sampling)?
            }
            Readout::Logits => {}
        }
        Ok(())
    }

    /// Copies back what a launched step produced.
    pub(super) fn read_back<A: DeviceElem>(
        &self,
        ws: &Workspace<A>,
        r: usize,
        readout: Readout,
    ) -> Result<StepRows, EngineError> {
        let s = self.dev.stream();
        Ok(match readout {
            Readout::Logits => StepRows::Logits(if r == 0 {
                Vec::new()
            } else {
                s.clone_dtoh(&ws.logits.slice(..r * self.config.vocab_size))
                    .map_err(|e| EngineError::Backend(format!("CUDA logits copy: {e:?}")))?
            }),
            Readout::Argmax | Readout::Sample => StepRows::Ids(if r == 0 {
                Vec::new()
            } else {
                s.clone_dtoh(&ws.ids.slice(..r))
                    .map_err(|e| EngineError::Backend(format!("CUDA argmax copy: {e:?}")))?
            }),
        })
    }
}
