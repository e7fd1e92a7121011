//! [`DeviceModel::launch`]: the kernels and GEMMs of one prepared step, in order (no copy, no
//! allocation: a decode step's launch is what a CUDA graph captures). Each layer is its
//! attention half (input norm, qkv GEMM, q/k norms + RoPE + KV write, attention, o
//! projection) and its MLP half (post-attention norm, gate_up GEMM, SiLU·mul, down GEMM);
//! then the final norm and the lm_head GEMM over the wanted rows, and the readout.

use cudarc::driver::CudaSlice;

use super::gemm::{GemvInput, GemvWeights, ResidualRows};
use super::ops::{HeadNorms, Norm};
use super::step::{dims, DeviceLayer, DeviceModel, MediaRows, Readout, Workspace};
use super::{AttentionInputs, CudaDevice, DeviceElem, KvTarget};
use crate::error::EngineError;

/// What every layer of a step shares: its sizes and how its GEMMs run.
#[derive(Clone, Copy)]
struct StepPlan {
    t: usize,
    /// Rows of each GEMM input: the split mode stacks [hi; lo] rows (2t), else t.
    m: usize,
    /// Split mode: each GEMM's output halves are folded into the first t rows by the kernel
    /// that reads the output next where it can (`*_split_*`: no fold launch), else by
    /// `fold_rows`.
    split: bool,
    /// Decode of one or two sequences: each norm rides in the GEMV after it, which reads the
    /// stream from `x` and writes the sum to `x2` (and back for the second norm), so the
    /// launches per layer drop from ten to six.
    fused: bool,
    /// The split mode's fused GEMVs read their rows in f32 instead of as hi + lo bf16:
    /// nothing to fold.
    f32_rows: bool,
    gemv_in: GemvInput,
    /// What the GEMMs cuBLAS runs do past the product.
    epi: Epilogues,
    hidden: usize,
    q_dim: usize,
    inter: usize,
    /// The qkv GEMM's output width (q, k and v heads).
    qkv_w: usize,
    eps: f32,
    scale: f32,
}

impl StepPlan {
    fn new<A: DeviceElem>(model: &DeviceModel, ws: &Workspace<A>, t: usize) -> Self {
        let cfg = &model.config;
        let (hidden, q_dim, kv_dim, inter) = dims(cfg);
        let split = ws.split;
        let gemv_in = if split {
            GemvInput::F32
        } else {
            GemvInput::Bf16
        };
        let dev = &model.dev;
        // Every layer has the same shapes, so the first decides for all.
        let fused = model.layers.first().is_some_and(|lw| {
            dev.norm_gemv_fits(t, hidden, &lw.qkv, gemv_in)
                && dev.norm_gemv_fits(t, hidden, &lw.gate_up, gemv_in)
        });
        let epi = match model.layers.first() {
            Some(lw) if !split && !fused => Epilogues::plan::<A>(model, lw, t),
            _ => Epilogues::default(),
        };
        StepPlan {
            t,
            m: if split { 2 * t } else { t },
            split,
            fused,
            f32_rows: fused && split,
            gemv_in,
            epi,
            hidden,
            q_dim,
            inter,
            qkv_w: q_dim + 2 * kv_dim,
            eps: cfg.rms_norm_eps,
            scale: 1.0 / (cfg.head_dim as f32).sqrt(),
        }
    }

    /// Folds a split GEMM's output (`elems` per half) in place; nothing outside the split mode.
    fn fold(
        &self,
        dev: &CudaDevice,
        out: &mut CudaSlice<f32>,
        elems: usize,
    ) -> Result<(), EngineError> {
        if self.split {
            dev.fold_rows(out, elems)
        } else {
            Ok(())
        }
    }
}

/// The GEMM epilogues of a step in the bf16 and f16 precisions, where cuBLAS runs the GEMMs
/// (17 rows and more, no split, no fused GEMVs; `TANDEM_CUDA_GEMM_EPILOGUE`).
#[derive(Clone, Copy, Default)]
struct Epilogues {
    /// The qkv GEMM writes 16-bit rows (`ws.qkv16`) that the q/k norm + RoPE reads (its
    /// warp-per-head form, over a 16-bit pool; no qkv bias).
    qkv16: bool,
    /// With `qkv16`: the q/k norm + RoPE writes the rotated q heads back into `ws.qkv16` for
    /// the warpgroup prefill attention to read (a step of prefill tiles alone, head_dim 128).
    q16: bool,
    /// The gate_up GEMM writes 16-bit rows (`ws.gu16`) that SiLU·mul reads.
    gu16: bool,
    /// The o and down GEMMs add their outputs into the residual stream `ws.x` (cuBLAS's
    /// beta = 1; no o bias), so the norms after them have nothing to add.
    add_in_gemm: bool,
}

impl Epilogues {
    /// For a step of `t` tokens of a model whose layers are shaped like `lw` (every layer
    /// is), in a mode without split GEMM inputs.
    fn plan<A: DeviceElem>(model: &DeviceModel, lw: &DeviceLayer, t: usize) -> Self {
        let (dev, cfg) = (&model.dev, &model.config);
        let (hidden, q_dim, kv_dim, inter) = dims(cfg);
        let switch = dev.gemm_epilogue();
        let cublas =
            |w: &super::DeviceMatrix, n: usize, k: usize| dev.gemm_writes_16::<A>(t, n, k, w);
        let qkv16 = switch
            && cublas(&lw.qkv, q_dim + 2 * kv_dim, hidden)
            && lw.qkv_bias.is_none()
            && dev.rope_reads_16(t, &model.pool);
        let maps = &model.inputs.maps;
        Epilogues {
            qkv16,
            q16: qkv16
                && dev.prefill_q16()
                && maps.n_tiles > 0
                && maps.n_singles == 0
                && maps.pieces.is_some()
                && cfg.head_dim == 128
                && (q_dim + 2 * kv_dim).is_multiple_of(4),
            gu16: switch && cublas(&lw.gate_up, 2 * inter, hidden),
            add_in_gemm: switch
                && cublas(&lw.o_proj, hidden, q_dim)
                && cublas(&lw.down, hidden, inter)
                && lw.o_bias.is_none(),
        }
    }
}

/// Where the last projection into the residual stream (an o or down GEMM) left its output.
#[derive(Clone, Copy)]
enum Pending {
    /// In `ws.proj`, for the next norm to add; `unfolded`: a split GEMM's halves still apart.
    Proj { unfolded: bool },
    /// Nothing to add: the GEMM added itself into `ws.x` (or no layer ran yet).
    Added,
}

impl Pending {
    /// The output the next norm adds (and whether its halves are apart), if any.
    fn residual(self, proj: &CudaSlice<f32>) -> Option<(&CudaSlice<f32>, bool)> {
        match self {
            Pending::Proj { unfolded } => Some((proj, unfolded)),
            Pending::Added => None,
        }
    }
}

impl DeviceModel {
    /// The kernels of a prepared step of `t` tokens and `r` logits rows (argmax or sampling
    /// too, by `readout`). No copy or allocation happens here, but for `media` rows (image
    /// embeddings over their tokens' embeddings), which only eager steps have: a step with
    /// them is never captured into a graph.
    pub(super) fn launch<A: DeviceElem>(
        &mut self,
        ws: &mut Workspace<A>,
        t: usize,
        r: usize,
        readout: Readout,
        media: &[MediaRows],
    ) -> Result<(), EngineError> {
        if t == 0 {
            return Ok(());
        }
        let plan = StepPlan::new(self, ws, t);
        let ids = self.inputs.maps.id_list();
        (self.dev).embedding_dev(&mut ws.x, &self.embed, ids, plan.hidden)?;
        self.splice_media(ws, media, t, plan.hidden)?;
        let mut pending = Pending::Added;
        for l in 0..self.layers.len() {
            let qkv_unfolded = self.qkv_projection(ws, &plan, l, pending)?;
            pending = self.attention_and_o_proj(ws, &plan, l, qkv_unfolded)?;
            // Layer l's K/V are written: a fence for writers waiting on it.
            self.mark_layers(l + 1)?;
            pending = self.mlp(ws, &plan, l, pending)?;
        }
        if r == 0 {
            return Ok(());
        }
        self.final_norm_and_lm_head(ws, &plan, r, pending)?;
        self.readout(ws, r, readout)
    }

    /// Resolves the armed layer fences of groups that end at or before `layers_done` layers
    /// with events recorded here (after the launches of those layers). None are armed while
    /// a graph is captured: the eager run before a capture resolves them all.
    pub(super) fn mark_layers(&mut self, layers_done: usize) -> Result<(), EngineError> {
        if self.layer_marks.is_empty() {
            return Ok(());
        }
        let dev = &self.dev;
        self.layer_marks
            .passed(layers_done, || dev.kv_event().map(|e| Box::new(e) as _))
    }

    /// Copies media rows over their tokens' embeddings in `ws.x` (f32 rows of `hidden`).
    fn splice_media<A: DeviceElem>(
        &self,
        ws: &mut Workspace<A>,
        media: &[MediaRows],
        t: usize,
        hidden: usize,
    ) -> Result<(), EngineError> {
        for run in media {
            let n = run.rows.len() / hidden;
            if run.rows.len() % hidden != 0 || run.first + n > t {
                return Err(EngineError::InvalidInput(format!(
                    "media rows {}..{} do not fit the step's {t} tokens",
                    run.first,
                    run.first + n
                )));
            }
            let range = run.first * hidden..(run.first + n) * hidden;
            self.dev
                .stream()
                .memcpy_htod(&run.rows, &mut ws.x.slice_mut(range))
                .map_err(|e| EngineError::Backend(format!("CUDA media rows copy: {e:?}")))?;
        }
        Ok(())
    }

    /// Layer `l`'s input norm (the previous layer's MLP output joining the residual stream
    /// first, where `pending`: a fused add) and qkv GEMM into `ws.qkv` (`ws.qkv16` by the
    /// plan), and its bias. Returns whether `qkv` holds unfolded split halves (folded by the
    /// q/k norm kernel that reads it).
    fn qkv_projection<A: DeviceElem>(
        &self,
        ws: &mut Workspace<A>,
        p: &StepPlan,
        l: usize,
        pending: Pending,
    ) -> Result<bool, EngineError> {
        let (dev, lw) = (&self.dev, &self.layers[l]);
        let norm = Norm {
            w: &lw.input_norm,
            eps: p.eps,
        };
        let mut qkv_unfolded = false;
        if p.fused {
            let rows = ResidualRows {
                x: &ws.x,
                residual: pending.residual(&ws.proj).map(|(r, _)| r),
                x_out: &mut ws.x2,
                m: p.t,
                k: p.hidden,
            };
            let weights = GemvWeights {
                w: &lw.qkv,
                n: p.qkv_w,
                silu: false,
            };
            dev.norm_gemv(&mut ws.qkv, rows, norm, weights, p.gemv_in)?;
        } else {
            let residual = pending.residual(&ws.proj);
            let (normed, x) = (&mut ws.normed, &mut ws.x);
            dev.rms_norm_split_residual(normed, x, residual, norm, p.t, p.split)?;
            if p.epi.qkv16 {
                // Read by qk_norm_rope_kv_in16 (no bias: the plan checked).
                let qkv16 = &mut ws.qkv16;
                return dev
                    .matmul_t_16(&ws.normed, p.m, p.hidden, &lw.qkv, p.qkv_w, qkv16)
                    .map(|_| false);
            }
            dev.matmul_t(&ws.normed, p.m, p.hidden, &lw.qkv, p.qkv_w, &mut ws.qkv)?;
            // Folded by qk_norm_rope_kv, unless a bias comes first.
            if lw.qkv_bias.is_some() {
                p.fold(dev, &mut ws.qkv, p.t * p.qkv_w)?;
            } else {
                qkv_unfolded = p.split;
            }
        }
        if let Some(b) = &lw.qkv_bias {
            dev.bias_add(&mut ws.qkv, b, p.t)?;
        }
        Ok(qkv_unfolded)
    }

    /// Layer `l`'s q/k norms and RoPE with the step's K and V written into the pool (one
    /// launch), the attention and the o projection into `ws.proj` (and its bias), or added
    /// into the stream by the plan. Returns where its output waits.
    fn attention_and_o_proj<A: DeviceElem>(
        &mut self,
        ws: &mut Workspace<A>,
        p: &StepPlan,
        l: usize,
        qkv_unfolded: bool,
    ) -> Result<Pending, EngineError> {
        let DeviceModel {
            dev,
            config,
            shape,
            pool,
            layers,
            inv_freq,
            scratch,
            inputs,
            ..
        } = self;
        let lw: &DeviceLayer = &layers[l];
        let heads = HeadNorms {
            nq: config.num_attention_heads,
            nkv: config.num_key_value_heads,
            head_dim: config.head_dim,
            inv_freq,
            q_norm: lw.q_norm.as_ref(),
            k_norm: lw.k_norm.as_ref(),
            eps: p.eps,
        };
        let maps = &inputs.maps;
        let kv = KvTarget {
            pool,
            shape: *shape,
            layer: l,
        };
        let qkv = &mut ws.qkv;
        if p.epi.q16 {
            dev.qk_norm_rope_kv_q16(&mut ws.qkv16, p.qkv_w, &heads, maps, kv)?;
        } else if p.epi.qkv16 {
            dev.qk_norm_rope_kv_in16(&ws.qkv16, qkv, p.qkv_w, &heads, maps, kv)?;
        } else {
            dev.qk_norm_rope_kv_split_input(qkv, qkv_unfolded, p.qkv_w, &heads, maps, kv)?;
        }
        let a = AttentionInputs {
            qkv: &ws.qkv,
            q16: p.epi.q16.then_some(&ws.qkv16),
            row_stride: p.qkv_w,
            nq: heads.nq,
            pool,
            shape: *shape,
            layer: l,
            maps,
            scale: p.scale,
        };
        let (t, h) = (p.t, p.hidden);
        let mut proj_unfolded = false;
        if p.f32_rows {
            dev.attention(&mut ws.attn_f32, &a, scratch, false)?;
            dev.matmul_t(&ws.attn_f32, t, p.q_dim, &lw.o_proj, h, &mut ws.proj)?;
        } else if p.epi.add_in_gemm {
            // No bias: the plan checked.
            dev.attention(&mut ws.attn, &a, scratch, false)?;
            dev.matmul_t_add(&ws.attn, t, p.q_dim, &lw.o_proj, h, &mut ws.x)?;
            return Ok(Pending::Added);
        } else {
            dev.attention(&mut ws.attn, &a, scratch, p.split)?;
            dev.matmul_t(&ws.attn, p.m, p.q_dim, &lw.o_proj, h, &mut ws.proj)?;
            // Folded by the next norm, unless a bias comes first.
            if lw.o_bias.is_some() {
                p.fold(dev, &mut ws.proj, t * h)?;
            } else {
                proj_unfolded = p.split;
            }
        }
        if let Some(b) = &lw.o_bias {
            dev.bias_add(&mut ws.proj, b, t)?;
        }
        Ok(Pending::Proj {
            unfolded: proj_unfolded,
        })
    }

    /// Layer `l`'s post-attention norm (the attention output joining the residual stream,
    /// where `pending`), gate_up GEMM, SiLU·mul and down GEMM into `ws.proj` (or added into
    /// the stream by the plan). Returns where its output waits.
    fn mlp<A: DeviceElem>(
        &self,
        ws: &mut Workspace<A>,
        p: &StepPlan,
        l: usize,
        pending: Pending,
    ) -> Result<Pending, EngineError> {
        let (dev, lw) = (&self.dev, &self.layers[l]);
        let (t, h, im) = (p.t, p.hidden, p.inter);
        let norm = Norm {
            w: &lw.post_norm,
            eps: p.eps,
        };
        if p.fused {
            // The stream back from `x2` into `x`.
            let rows = ResidualRows {
                x: &ws.x2,
                residual: pending.residual(&ws.proj).map(|(r, _)| r),
                x_out: &mut ws.x,
                m: t,
                k: h,
            };
            let weights = GemvWeights {
                w: &lw.gate_up,
                n: im,
                silu: true,
            };
            if p.f32_rows {
                dev.norm_gemv(&mut ws.act_f32, rows, norm, weights, p.gemv_in)?;
                dev.matmul_t(&ws.act_f32, t, im, &lw.down, h, &mut ws.proj)?;
                return Ok(Pending::Proj { unfolded: false });
            }
            dev.norm_gemv(&mut ws.act, rows, norm, weights, p.gemv_in)?;
        } else {
            let residual = pending.residual(&ws.proj);
            let (normed, x) = (&mut ws.normed, &mut ws.x);
            dev.rms_norm_split_residual(normed, x, residual, norm, t, p.split)?;
            if p.epi.gu16 {
                dev.matmul_t_16(&ws.normed, p.m, h, &lw.gate_up, 2 * im, &mut ws.gu16)?;
                dev.silu_mul_split_input(&mut ws.act, &ws.gu16, false, t, im, false)?;
            } else {
                dev.matmul_t(&ws.normed, p.m, h, &lw.gate_up, 2 * im, &mut ws.gu)?;
                dev.silu_mul_split_input(&mut ws.act, &ws.gu, p.split, t, im, p.split)?;
            }
        }
        if p.epi.add_in_gemm {
            dev.matmul_t_add(&ws.act, p.m, im, &lw.down, h, &mut ws.x)?;
            return Ok(Pending::Added);
        }
        dev.matmul_t(&ws.act, p.m, im, &lw.down, h, &mut ws.proj)?;
        Ok(Pending::Proj { unfolded: p.split })
    }

    /// The final norm (with its fused add of the last MLP output, where `pending`) and the
    /// lm_head GEMM on the wanted rows alone: all of them in place (r == t: rows are
    /// increasing, so every row in order; decode steps), else gathered first.
    fn final_norm_and_lm_head<A: DeviceElem>(
        &self,
        ws: &mut Workspace<A>,
        p: &StepPlan,
        r: usize,
        mut pending: Pending,
    ) -> Result<(), EngineError> {
        let (dev, t, h) = (&self.dev, p.t, p.hidden);
        let v = self.config.vocab_size;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        if matches!(pending, Pending::Proj { unfolded: true }) && r < t {
            p.fold(dev, &mut ws.proj, t * h)?;
            pending = Pending::Proj { unfolded: false };
        }
        let (stream, mlp_out) = if r == t {
            (&mut ws.x, pending.residual(&ws.proj))
        } else {
            let rows = self.inputs.maps.row_list();
            dev.gather_rows_dev(&mut ws.sel_x, &ws.x, t, rows, h, false)?;
            if let Pending::Proj { unfolded } = pending {
                dev.gather_rows_dev(&mut ws.sel_res, &ws.proj, t, rows, h, false)?;
                (&mut ws.sel_x, Some((&ws.sel_res, unfolded)))
            } else {
                (&mut ws.sel_x, None)
            }
        };
        let norm = Norm {
            w: &self.norm,
            eps: p.eps,
        };
        if p.split && dev.f32_rows_gemv_fits(r, h, head) {
            // One or two rows in the split mode: the lm_head GEMV reads them in f32 (no hi
            // and lo rows, no fold of 151,936-wide logits rows at the 0.6B shape).
            dev.rms_norm_split_residual(&mut ws.sel_f32, stream, mlp_out, norm, r, false)?;
            dev.matmul_t(&ws.sel_f32, r, h, head, v, &mut ws.logits)
        } else {
            dev.rms_norm_split_residual(&mut ws.sel, stream, mlp_out, norm, r, p.split)?;
            let head_rows = if p.split { 2 * r } else { r };
            dev.matmul_t(&ws.sel, head_rows, h, head, v, &mut ws.logits)?;
            p.fold(dev, &mut ws.logits, r * v)
        }
    }

    /// The device-side readout of the `r` logits rows: argmax or sampled ids into `ws.ids`,
    /// or nothing (the logits themselves are copied back).
    fn readout<A: DeviceElem>(
        &self,
        ws: &mut Workspace<A>,
        r: usize,
        readout: Readout,
    ) -> Result<(), EngineError> {
        let (dev, v) = (&self.dev, self.config.vocab_size);
        match readout {
            Readout::Argmax => dev.argmax(&mut ws.ids, &ws.logits, r, v, &mut ws.argmax),
            Readout::Sample => {
                let sampling = &self.inputs.sampling;
                dev.sample_rows(&mut ws.ids, &mut ws.logits, r, v, sampling)
            }
            Readout::Logits | Readout::Deferred => Ok(()),
        }
    }

    /// Samples the `r` logits rows a [`Readout::Deferred`] step left on the device, by the
    /// plans last filled into the sampling inputs (with their grammar masks now), and reads
    /// the tokens back.
    pub(super) fn sample_deferred<A: DeviceElem>(
        &self,
        ws: &mut Workspace<A>,
        r: usize,
    ) -> Result<super::step::StepRows, EngineError> {
        self.readout(ws, r, Readout::Sample)?;
        self.read_back(ws, r, Readout::Sample)
    }
}
