//! A deterministic stand-in backend for the engine's tests. Its logits depend on every
//! (token, position) pair *read back from its paged KV pool*: a wrong block table, a lost block
//! or a bad export/import changes the output, so equality with a solo run checks all of them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::backend::{Backend, DeviceSample, LogitsMode, SeqInput, StepOutput};
use crate::error::EngineError;
use crate::kv::layout::{KvDtype, KvLayout, KvPart, LAYOUT_VERSION};
use crate::sampler::SamplePlan;

pub(super) const VOCAB: usize = 64;
pub(super) const EOS: u32 = 63;
pub(super) const T: Duration = Duration::from_secs(60);

pub(super) struct TestBackend {
    layout: KvLayout,
    num_blocks: usize,
    pool: Vec<u8>,
    /// Tokens computed, over all steps.
    pub(super) computed: Arc<AtomicUsize>,
    /// Return no logits rows, like the simulator.
    pub(super) no_logits: bool,
    /// Sample "on the device" (forward_sampled with the engine's plans), as the CUDA backend.
    pub(super) device_sampling: bool,
    /// Steps that went through forward_sampled.
    pub(super) sampled_steps: Arc<AtomicUsize>,
    /// Panic in the forward pass (a fatal fault in the batched part).
    pub(super) panic_in_forward: bool,
    /// Each forward pass takes at least this long (a device's compute).
    pub(super) forward_time: Duration,
    /// When set, every step first takes one permit: the test decides how far the engine runs.
    gate: Option<std::sync::mpsc::Receiver<()>>,
    /// When set, told after every step.
    done: Option<std::sync::mpsc::Sender<()>>,
}

impl TestBackend {
    pub(super) fn new(block_size: usize, num_blocks: usize) -> Self {
        let layout = KvLayout {
            version: LAYOUT_VERSION,
            model_id: "test-backend".into(),
            dtype: KvDtype::F32,
            block_size,
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 2,
        };
        let pool = vec![0; layout.block_bytes() * num_blocks];
        Self {
            layout,
            num_blocks,
            pool,
            computed: Arc::new(AtomicUsize::new(0)),
            no_logits: false,
            device_sampling: false,
            sampled_steps: Arc::new(AtomicUsize::new(0)),
            panic_in_forward: false,
            forward_time: Duration::ZERO,
            gate: None,
            done: None,
        }
    }

    /// A backend that runs one step per permit sent on the returned channel.
    pub(super) fn gated(
        block_size: usize,
        num_blocks: usize,
    ) -> (Self, std::sync::mpsc::Sender<()>) {
        let (tx, rx) = std::sync::mpsc::channel();
        let mut b = Self::new(block_size, num_blocks);
        b.gate = Some(rx);
        (b, tx)
    }

    /// Like [`TestBackend::gated`], and also reports each finished step on the returned
    /// receiver, so a test knows where the engine is.
    pub(super) fn gated_reporting(
        block_size: usize,
        num_blocks: usize,
    ) -> (
        Self,
        std::sync::mpsc::Sender<()>,
        std::sync::mpsc::Receiver<()>,
    ) {
        let (mut b, permits) = Self::gated(block_size, num_blocks);
        let (tx, rx) = std::sync::mpsc::channel();
        b.done = Some(tx);
        (b, permits, rx)
    }

    fn slot(&self, table: &[u32], pos: usize) -> Result<usize, EngineError> {
        let bs = self.layout.block_size;
        let block = *table
            .get(pos / bs)
            .ok_or_else(|| EngineError::InvalidInput(format!("no block for position {pos}")))?;
        if block as usize >= self.num_blocks {
            return Err(EngineError::InvalidInput(format!(
                "block {block} out of range"
            )));
        }
        Ok(self.layout.offset(block as usize, 0, KvPart::K) + (pos % bs) * 8)
    }

    fn read(&self, off: usize) -> u32 {
        u32::from_le_bytes(self.pool[off..off + 4].try_into().unwrap())
    }
}

/// The test backend's hash of a KV slot's token and position: MurmurHash3's 64-bit finaliser
/// (a mixer, not a generator). The beam tests' reference rows use it too.
pub(super) fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51afd7ed558ccd);
    x ^= x >> 33;
    x
}

impl Backend for TestBackend {
    fn layout(&self) -> &KvLayout {
        &self.layout
    }
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn forward(&mut self, batch: &[SeqInput<'_>]) -> Result<StepOutput, EngineError> {
        assert!(
            !self.panic_in_forward,
            "test backend: panic in the forward pass"
        );
        if let Some(g) = &self.gate {
            g.recv_timeout(T)
                .map_err(|_| EngineError::InvalidInput("test gate closed or timed out".into()))?;
        }
        std::thread::sleep(self.forward_time);
        let mut logits = Vec::new();
        for s in batch {
            for (i, &t) in s.tokens.iter().enumerate() {
                let off = self.slot(s.block_table, s.start_pos + i)?;
                self.pool[off..off + 4].copy_from_slice(&t.to_le_bytes());
                self.pool[off + 4..off + 8]
                    .copy_from_slice(&((s.start_pos + i) as u32 + 1).to_le_bytes());
            }
            self.computed.fetch_add(s.tokens.len(), Ordering::Relaxed);
            if s.logits == LogitsMode::None || self.no_logits {
                logits.push(Vec::new());
                continue;
            }
            let end = s.start_pos + s.tokens.len();
            let mut h = 0u64;
            for pos in 0..end {
                let off = self.slot(s.block_table, pos)?;
                if self.read(off + 4) != pos as u32 + 1 {
                    return Err(EngineError::InvalidInput(format!("KV missing at {pos}")));
                }
                h = mix(h ^ (self.read(off) as u64) ^ ((pos as u64) << 32));
            }
            let row: Vec<f32> = (0..VOCAB as u64)
                .map(|j| (mix(h ^ (j * 0x9E37_79B9)) % 1000) as f32 / 200.0)
                .collect();
            logits.push(vec![row]);
        }
        if let Some(d) = &self.done {
            let _ = d.send(());
        }
        Ok(StepOutput { logits })
    }
    fn samples_on_device(&self) -> bool {
        self.device_sampling
    }
    fn forward_sampled(
        &mut self,
        batch: &[SeqInput<'_>],
        plans: &[Option<&SamplePlan>],
    ) -> Result<Vec<Option<DeviceSample>>, EngineError> {
        if !self.device_sampling || plans.len() != batch.len() {
            return Err(EngineError::InvalidInput(
                "unexpected forward_sampled".into(),
            ));
        }
        self.sampled_steps.fetch_add(1, Ordering::Relaxed);
        let out = self.forward(batch)?;
        Ok(out
            .logits
            .iter()
            .zip(plans)
            .map(|(rows, plan)| match (rows.last(), plan) {
                (Some(row), Some(p)) => {
                    let (token, logprob) = p.sample_row_with_logprobs(row);
                    Some(DeviceSample { token, logprob })
                }
                _ => None,
            })
            .collect())
    }
    fn export_blocks(&self, blocks: &[u32]) -> Result<Vec<u8>, EngineError> {
        let bb = self.layout.block_bytes();
        let mut v = Vec::new();
        for &b in blocks {
            let o = b as usize * bb;
            v.extend_from_slice(&self.pool[o..o + bb]);
        }
        Ok(v)
    }
    fn import_blocks(&mut self, blocks: &[u32], data: &[u8]) -> Result<(), EngineError> {
        let bb = self.layout.block_bytes();
        if data.len() != blocks.len() * bb {
            return Err(EngineError::InvalidInput("size".into()));
        }
        for (i, &b) in blocks.iter().enumerate() {
            let o = b as usize * bb;
            self.pool[o..o + bb].copy_from_slice(&data[i * bb..(i + 1) * bb]);
        }
        Ok(())
    }
}
