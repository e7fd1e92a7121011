//! The activation buffers of a step ([`Workspace`]), kept from step to step and grown when a
//! step is larger than any before (a captured graph is valid only while they stay put).

use cudarc::driver::CudaSlice;

use super::ops::ArgmaxScratch;
use super::{CudaDevice, DeviceElem};
use crate::error::EngineError;
use crate::model::config::ModelConfig;

/// Activation buffers of a step; `A` is the GEMM input type (f32 or bf16 as u16).
pub(super) struct Workspace<A: DeviceElem> {
    pub(super) tokens: usize,
    /// Bumped on every reallocation (see DeviceModel::generation).
    pub(super) generation: u64,
    /// Split-bf16 GEMM inputs ([`ComputeMode::Bf16Split`]).
    pub(super) split: bool,
    pub(super) x: CudaSlice<f32>,
    /// The residual stream's second buffer: a fused norm GEMV reads one and writes the other.
    pub(super) x2: CudaSlice<f32>,
    pub(super) qkv: CudaSlice<f32>,
    pub(super) proj: CudaSlice<f32>,
    pub(super) gu: CudaSlice<f32>,
    /// The qkv and gate_up GEMMs' outputs rounded to the 16-bit element, for steps whose
    /// GEMMs cuBLAS runs in the bf16 and f16 precisions (`StepPlan::qkv16` / `gu16`): their
    /// readers then move half the bytes. One element each in the other precisions.
    pub(super) qkv16: CudaSlice<u16>,
    pub(super) gu16: CudaSlice<u16>,
    pub(super) normed: CudaSlice<A>,
    pub(super) attn: CudaSlice<A>,
    pub(super) act: CudaSlice<A>,
    /// The attention output and SiLU·mul output in f32: the GEMV inputs of a split-mode step
    /// of one or two rows, which reads its activations unrounded (those rows only; one
    /// element outside the split mode).
    pub(super) attn_f32: CudaSlice<f32>,
    pub(super) act_f32: CudaSlice<f32>,
    /// The final norm's rows in f32 for a split-mode lm_head GEMV (one element otherwise).
    pub(super) sel_f32: CudaSlice<f32>,
    pub(super) rows: usize,
    pub(super) sel_x: CudaSlice<f32>,
    pub(super) sel_res: CudaSlice<f32>,
    pub(super) sel: CudaSlice<A>,
    pub(super) logits: CudaSlice<f32>,
    pub(super) ids: CudaSlice<i32>,
    pub(super) argmax: ArgmaxScratch,
}

impl<A: DeviceElem> Workspace<A> {
    pub(super) fn new(
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
        let rounded = !split && A::SUFFIX != "f32";
        let rounded_len = |n: usize| if rounded { t * n } else { 1 };
        Ok(Workspace {
            tokens: t,
            generation: 0,
            split,
            x: dev.zeros(t * h)?,
            x2: dev.zeros(t * h)?,
            qkv: dev.zeros(m * t * (qd + 2 * kvd))?,
            proj: dev.zeros(m * t * h)?,
            gu: dev.zeros(m * t * 2 * im)?,
            qkv16: dev.zeros(rounded_len(qd + 2 * kvd))?,
            gu16: dev.zeros(rounded_len(2 * im))?,
            normed: dev.zeros(m * t * h)?,
            attn: dev.zeros(m * t * qd)?,
            act: dev.zeros(m * t * im)?,
            // Only steps the GEMVs take read them (at most GEMV_MAX_ROWS rows).
            attn_f32: dev.zeros(if split { gemv_input_rows(t) * qd } else { 1 })?,
            act_f32: dev.zeros(if split { gemv_input_rows(t) * im } else { 1 })?,
            sel_f32: dev.zeros(if split { gemv_input_rows(r) * h } else { 1 })?,
            rows: r,
            sel_x: dev.zeros(r * h)?,
            sel_res: dev.zeros(r * h)?,
            sel: dev.zeros(m * r * h)?,
            logits: dev.zeros(m * r * cfg.vocab_size)?,
            ids: dev.zeros(r)?,
            argmax: ArgmaxScratch::new(dev, r)?,
        })
    }

    /// Grows to hold `tokens` tokens and `rows` logits rows.
    pub(super) fn ensure(
        &mut self,
        dev: &CudaDevice,
        cfg: &ModelConfig,
        tokens: usize,
        rows: usize,
    ) -> Result<(), EngineError> {
        if tokens > self.tokens || rows > self.rows {
            let (t, r) = (tokens.max(self.tokens), rows.max(self.rows));
            let generation = self.generation + 1;
            *self = Workspace::new(dev, cfg, t, r, self.split)?;
            self.generation = generation;
        }
        Ok(())
    }
}

/// Rows of the f32 GEMV inputs a workspace of `n` rows keeps (the GEMVs take at most two).
fn gemv_input_rows(n: usize) -> usize {
    n.min(super::gemm::GEMV_MAX_ROWS)
}

pub(super) enum AnyWorkspace {
    F32(Workspace<f32>),
    Bf16(Workspace<u16>),
}

/// (hidden, q width, kv width, intermediate).
pub(super) fn dims(cfg: &ModelConfig) -> (usize, usize, usize, usize) {
    (
        cfg.hidden_size,
        cfg.num_attention_heads * cfg.head_dim,
        cfg.num_key_value_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
}
