//! The compute backend: runs the model over a batch of sequences against a paged KV pool.
//! The CPU backend lives in [`cpu`]; the CUDA backend and the simulator's time-only backend
//! implement the same trait.

pub mod cpu;
pub mod cpu_ops;
pub mod fence;
pub mod pool_memory;

#[cfg(feature = "cuda")]
pub mod cuda;

pub use fence::{BlocksReady, DeviceFence, LayerFence};
pub use pool_memory::KvPoolMemory;

use crate::error::EngineError;
use crate::kv::layout::KvLayout;
use crate::request::MediaEmbedding;
use crate::sampler::SamplePlan;

/// Which logits a sequence wants back from a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsMode {
    /// None (a prefill chunk that is not the last).
    None,
    /// Only the last token's row (to sample the next token).
    Last,
    /// One row per input token (teacher-forced checks, prompt logprobs).
    All,
}

/// One sequence's part of a step.
#[derive(Clone, Copy, Debug)]
pub struct SeqInput<'a> {
    /// The new tokens to run this step (a prefill chunk, or 1 decode token).
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`; positions `< start_pos` are already in the KV cache.
    pub start_pos: usize,
    /// Physical block ids covering positions `0..start_pos + tokens.len()`.
    pub block_table: &'a [u32],
    pub logits: LogitsMode,
    /// The sequence's media embeddings: a token whose position a span covers takes the
    /// span's row instead of its token embedding. Empty for text.
    pub media: &'a [MediaEmbedding],
}

/// The result of a step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepOutput {
    /// Per sequence: rows (0 for `None`, 1 for `Last`, `tokens.len()` for `All`), each
    /// `vocab_size` long.
    pub logits: Vec<Vec<Vec<f32>>>,
}

/// A KV pool in GPU memory: `len` bytes at device address `ptr` of CUDA device `device`,
/// block `b` at `ptr + b * block_bytes` (the layout's block-major order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DevicePool {
    pub ptr: u64,
    pub len: usize,
    pub device: u32,
}

/// Blocks of a GPU pool handed out for a GPU-to-GPU write: their device addresses
/// (`block_bytes` each) and the fences after which their contents are final.
pub struct DeviceBlocks {
    pub device: u32,
    pub block_bytes: usize,
    pub ptrs: Vec<u64>,
    pub ready: BlocksReady,
}

impl std::fmt::Debug for DeviceBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBlocks")
            .field("device", &self.device)
            .field("block_bytes", &self.block_bytes)
            .field("ptrs", &self.ptrs)
            .field("ready", &self.ready)
            .finish()
    }
}

/// A model runner over a paged KV pool laid out as [`KvLayout`] describes.
/// A token a backend sampled on its device, with the logprobs its plan asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceSample {
    pub token: u32,
    pub logprob: Option<crate::sampler::TokenLogprob>,
}

/// `plans` with each given mask set as its grammar's `allowed` words.
pub fn with_masks(
    plans: &[Option<&SamplePlan>],
    masks: Vec<Option<Vec<u32>>>,
) -> Vec<Option<SamplePlan>> {
    let mut masks = masks.into_iter();
    plans
        .iter()
        .map(|p| {
            let mask = masks.next().flatten();
            p.map(|p| {
                let mut p = p.clone();
                if mask.is_some() {
                    p.allowed = mask;
                }
                p
            })
        })
        .collect()
}

pub trait Backend: Send {
    fn layout(&self) -> &KvLayout;
    fn num_blocks(&self) -> usize;
    fn vocab_size(&self) -> usize;
    /// The width of the embedding rows [`SeqInput::media`] may carry (the model's hidden
    /// size), or `None` when this backend does not splice media embeddings (the engine then
    /// refuses requests that carry them).
    fn media_embedding_width(&self) -> Option<usize> {
        None
    }
    /// Runs one step: writes the new tokens' K/V into their blocks and returns the asked logits.
    fn forward(&mut self, batch: &[SeqInput<'_>]) -> Result<StepOutput, EngineError>;
    /// Whether [`Backend::forward_sampled`] samples on the backend's own device.
    fn samples_on_device(&self) -> bool {
        false
    }
    /// A step whose sequences sample on the device: `plans[i]` is given for each sequence
    /// with [`LogitsMode::Last`] (and only for those); returns per sequence its sampled token
    /// and the logprobs its plan asks for (None where it had no plan). Follows the CPU rules
    /// of [`SamplePlan::sample_row_with_logprobs`].
    fn forward_sampled(
        &mut self,
        batch: &[SeqInput<'_>],
        plans: &[Option<&SamplePlan>],
    ) -> Result<Vec<Option<DeviceSample>>, EngineError> {
        let _ = (batch, plans);
        Err(EngineError::Backend(
            "this backend does not sample on a device (samples_on_device is false)".into(),
        ))
    }
    /// [`Backend::forward_sampled`] for plans whose grammar masks are computed while the
    /// forward pass runs: `masks()` returns, per plan (batch order), the bitmask words to set
    /// as its `allowed` (None: as given). This default computes them first; a backend that
    /// can start the forward pass before its sampler overrides it to call `masks()` meanwhile.
    fn forward_sampled_with_masks(
        &mut self,
        batch: &[SeqInput<'_>],
        plans: &[Option<&SamplePlan>],
        masks: &mut dyn FnMut() -> Vec<Option<Vec<u32>>>,
    ) -> Result<Vec<Option<DeviceSample>>, EngineError> {
        let owned = with_masks(plans, masks());
        let refs: Vec<Option<&SamplePlan>> = owned.iter().map(Option::as_ref).collect();
        self.forward_sampled(batch, &refs)
    }
    /// The concatenation of whole blocks, in layout byte order.
    fn export_blocks(&self, blocks: &[u32]) -> Result<Vec<u8>, EngineError>;
    /// Writes whole blocks (as [`Backend::export_blocks`] returns them) into `blocks`.
    fn import_blocks(&mut self, blocks: &[u32], data: &[u8]) -> Result<(), EngineError>;
    /// The pool's GPU memory, when the pool lives on a GPU (what a decode worker registers
    /// with the KV transport so prefill workers write into it directly). `None`: host memory.
    fn device_pool(&self) -> Option<DevicePool> {
        None
    }
    /// `blocks` as GPU memory for a GPU-to-GPU write, with a fence after the work queued so
    /// far (no device-wide wait); `None` when the pool is not in GPU memory.
    fn device_blocks(&mut self, blocks: &[u32]) -> Result<Option<DeviceBlocks>, EngineError> {
        let _ = blocks;
        Ok(None)
    }
    /// `blocks` as GPU memory whose K/V the *next* step writes, each of `groups` groups of
    /// layers behind a fence that step records as soon as its launches have written that
    /// group ([`BlocksReady::Layers`]): a writer reads the early layers while the step still
    /// computes the later ones. Every call before that step shares its fences. `None` when
    /// the pool is not GPU memory or the backend cannot fence by layer (the blocks then
    /// leave after the step, through [`Backend::device_blocks`]).
    fn device_blocks_by_layers(
        &mut self,
        blocks: &[u32],
        groups: usize,
    ) -> Result<Option<DeviceBlocks>, EngineError> {
        let _ = (blocks, groups);
        Ok(None)
    }
    /// Makes blocks a remote prefill wrote into this backend's transfer memory visible to
    /// compute. A no-op where that memory is the pool itself (the CPU backend); the CUDA
    /// backend copies them from its host staging memory into the GPU pool.
    fn load_received_blocks(&mut self, blocks: &[u32]) -> Result<(), EngineError> {
        let _ = blocks;
        Ok(())
    }
    /// Copies whole blocks, `(src, dst)` each (beam search's copy-on-write of a partial
    /// block). The default goes through [`Backend::export_blocks`] and
    /// [`Backend::import_blocks`].
    fn copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<(), EngineError> {
        for &(src, dst) in pairs {
            let data = self.export_blocks(&[src])?;
            self.import_blocks(&[dst], &data)?;
        }
        Ok(())
    }
}

/// Checks that every block id lies in a pool of `num_blocks` (shared by the backends).
pub(crate) fn check_blocks(blocks: &[u32], num_blocks: usize) -> Result<(), EngineError> {
    match blocks.iter().find(|&&b| b as usize >= num_blocks) {
        Some(b) => Err(EngineError::InvalidInput(format!(
            "block id {b} is outside the pool of {num_blocks} blocks"
        ))),
        None => Ok(()),
    }
}

/// Checks a step's inputs against the pool: no logits for an empty piece, and a block table
/// that covers every position and names only blocks of the pool.
pub(crate) fn check_batch(
    batch: &[SeqInput<'_>],
    block_size: usize,
    num_blocks: usize,
) -> Result<(), EngineError> {
    for (i, seq) in batch.iter().enumerate() {
        let end = seq.start_pos + seq.tokens.len();
        if seq.tokens.is_empty() && seq.logits != LogitsMode::None {
            return Err(EngineError::InvalidInput(format!(
                "sequence {i}: logits asked for an empty step"
            )));
        }
        let needed = end.div_ceil(block_size);
        if seq.block_table.len() < needed {
            return Err(EngineError::InvalidInput(format!(
                "sequence {i}: block table of {} blocks does not cover positions 0..{end} \
                 (block size {block_size})",
                seq.block_table.len()
            )));
        }
        check_blocks(&seq.block_table[..needed], num_blocks)?;
    }
    Ok(())
}
