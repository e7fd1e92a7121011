//! The simulated backend: a [`Backend`] whose `forward` computes nothing and returns no logits
//! (the engine then draws each token from the sequence's seeded RNG) but takes the time the
//! cost model gives for the batch. Scheduler, block manager, prefix cache and KV events are
//! the engine's own.

use std::time::Duration;

use tandem_engine::backend::{Backend, SeqInput, StepOutput};
use tandem_engine::error::EngineError;
use tandem_engine::kv::layout::KvLayout;

use crate::cost::{CostModel, StepShape};

/// Called with a step's shape and simulated milliseconds.
pub type StepHook = Box<dyn FnMut(&StepShape, f64) + Send>;

/// How a step's simulated time passes.
pub enum Pacer {
    /// The engine thread sleeps for it (live serving).
    Sleep,
    /// A virtual clock: the hook gets the step's shape and milliseconds and may block until
    /// the driver lets the step end (offline replay).
    Hook(StepHook),
}

pub struct SimBackend {
    layout: KvLayout,
    num_blocks: usize,
    vocab_size: usize,
    cost: CostModel,
    pacer: Pacer,
}

impl SimBackend {
    pub fn new(
        layout: KvLayout,
        num_blocks: usize,
        vocab_size: usize,
        cost: CostModel,
        pacer: Pacer,
    ) -> Self {
        SimBackend {
            layout,
            num_blocks,
            vocab_size,
            cost,
            pacer,
        }
    }
}

/// Splits a batch into the cost model's view. A piece of one new token after cached context
/// is a decode; anything else (a chunk, or a whole one-token prompt) is prefill.
pub fn step_shape(batch: &[SeqInput<'_>], total_kv_tokens: usize) -> StepShape {
    let mut s = StepShape {
        total_kv_tokens,
        ..StepShape::default()
    };
    for piece in batch {
        let n = piece.tokens.len();
        if n == 1 && piece.start_pos > 0 {
            s.decode_seqs += 1;
        } else {
            s.prefill_tokens += n;
        }
        s.active_kv_tokens += piece.start_pos + n;
    }
    s
}

impl Backend for SimBackend {
    fn layout(&self) -> &KvLayout {
        &self.layout
    }

    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn forward(&mut self, batch: &[SeqInput<'_>]) -> Result<StepOutput, EngineError> {
        let shape = step_shape(batch, self.num_blocks * self.layout.block_size);
        let ms = self.cost.step_ms(&shape);
        match &mut self.pacer {
            Pacer::Sleep => std::thread::sleep(Duration::from_secs_f64(ms / 1000.0)),
            Pacer::Hook(h) => h(&shape, ms),
        }
        // No rows: the engine samples without logits.
        Ok(StepOutput {
            logits: vec![Vec::new(); batch.len()],
        })
    }

    /// Simulated blocks hold no data; an export is zeros of the layout's size so that the
    /// migration and prefill handoff paths (which check sizes) still run. Nothing reads it:
    /// a simulated prefill worker's link only counts its blocks. `vec![0; n]` is calloc, which
    /// for large sizes maps fresh zero pages without writing them (the binary pins glibc's
    /// mmap threshold at 1 MiB for this), so a big layout costs address space, not bandwidth.
    fn export_blocks(&self, blocks: &[u32]) -> Result<Vec<u8>, EngineError> {
        Ok(vec![0u8; blocks.len() * self.layout.block_bytes()])
    }

    fn import_blocks(&mut self, blocks: &[u32], data: &[u8]) -> Result<(), EngineError> {
        let want = blocks.len() * self.layout.block_bytes();
        if data.len() != want {
            return Err(EngineError::Config(format!(
                "import of {} blocks needs {want} bytes, got {}",
                blocks.len(),
                data.len()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_engine::backend::LogitsMode;

    #[test]
    fn shape_separates_prefill_and_decode() {
        let toks = [1u32, 2, 3, 4];
        let table = [0u32, 1];
        let batch = [
            SeqInput {
                tokens: &toks,
                start_pos: 0,
                block_table: &table,
                logits: LogitsMode::Last,
                media: Default::default(),
            },
            SeqInput {
                tokens: &toks[..1],
                start_pos: 9,
                block_table: &table,
                logits: LogitsMode::Last,
                media: Default::default(),
            },
        ];
        let s = step_shape(&batch, 100);
        assert_eq!(s.prefill_tokens, 4);
        assert_eq!(s.decode_seqs, 1);
        assert_eq!(s.active_kv_tokens, 4 + 10);
        assert!((s.kv_usage() - 0.14).abs() < 1e-12);
    }
}
