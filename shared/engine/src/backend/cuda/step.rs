//! The device state of [`super::CudaBackend`] and one decoder step, in three parts so that
//! the middle one can be captured into a CUDA graph: [`DeviceModel::prepare`] (host checks,
//! the step's inputs copied into persistent device buffers), [`DeviceModel::launch`] (kernels
//! and GEMMs only: no copy, no allocation; `forward.rs`) and [`DeviceModel::read_back`].

use cudarc::driver::CudaSlice;

use super::sampling::SamplingInputs;
pub(super) use super::workspace::{dims, AnyWorkspace, Workspace};
use super::{AttentionScratch, CudaDevice, DeviceElem, DeviceMatrix, KvPool, PoolShape, TokenMaps};
use crate::backend::fence::LayerMarks;
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
    /// Layer fences the running step resolves as its launches pass each group
    /// ([`crate::backend::Backend::device_blocks_by_layers`]); empty between steps.
    pub(super) layer_marks: LayerMarks,
}

/// What a step brings back from the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Readout {
    Logits,
    Argmax,
    /// One token per row by the step's sampling plans (`sampling.cu`).
    Sample,
    /// The logits stay on the device, nothing is read back (and nothing waited for): the
    /// sampling is launched after the step, once its grammar masks are ready
    /// ([`DeviceModel::sample_deferred`]).
    Deferred,
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

/// What [`DeviceModel::prepare`] found: tokens, logits rows, rows per sequence, and the
/// media embedding rows that replace token embeddings.
pub(super) struct Prepared {
    pub(super) t: usize,
    pub(super) r: usize,
    pub(super) counts: Vec<usize>,
    pub(super) media: Vec<MediaRows>,
}

/// Media embedding rows of a step: `rows` (whole rows of the hidden size) replace the token
/// embeddings of the step's tokens from `first` on.
pub(super) struct MediaRows {
    pub(super) first: usize,
    pub(super) rows: Vec<f32>,
}

/// The media rows of `batch`'s tokens, in contiguous runs.
fn media_rows(batch: &[SeqInput<'_>], hidden: usize) -> Vec<MediaRows> {
    let mut out: Vec<MediaRows> = Vec::new();
    let mut at = 0;
    for seq in batch {
        for i in 0..seq.tokens.len() {
            let pos = seq.start_pos + i;
            if let Some(row) = seq.media.iter().find_map(|m| m.row(pos, hidden)) {
                match out.last_mut() {
                    Some(run) if run.first + run.rows.len() / hidden == at + i => {
                        run.rows.extend_from_slice(row)
                    }
                    _ => out.push(MediaRows {
                        first: at + i,
                        rows: row.to_vec(),
                    }),
                }
            }
        }
        at += seq.tokens.len();
    }
    out
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
        let media = media_rows(batch, self.config.hidden_size);
        if t == 0 {
            return Ok(Prepared {
                t,
                r,
                counts,
                media,
            });
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
            let vocab = self.config.vocab_size;
            self.inputs.sampling.fill(&self.dev, &row_plans, vocab)?;
        }
        Ok(Prepared {
            t,
            r,
            counts,
            media,
        })
    }

    /// Buffer generation of everything a launch reads or writes: a graph captured at one
    /// generation is valid only while it is unchanged.
    pub(super) fn generation<A: DeviceElem>(&self, ws: &Workspace<A>) -> u64 {
        self.inputs.generation() + self.scratch.generation + ws.generation
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
            Readout::Deferred => StepRows::Ids(Vec::new()),
            Readout::Argmax | Readout::Sample => StepRows::Ids(if r == 0 {
                Vec::new()
            } else {
                s.clone_dtoh(&ws.ids.slice(..r))
                    .map_err(|e| EngineError::Backend(format!("CUDA argmax copy: {e:?}")))?
            }),
        })
    }
}
