//! The CPU backend: f32 weights, GEMMs through matrixmultiply on rayon threads, and the KV
//! pool held in host memory in the byte order of [`KvLayout`] (f32 or bf16 elements).

use std::sync::Arc;

use crate::backend::{Backend, LogitsMode, SeqInput, StepOutput};
use crate::error::EngineError;
use crate::kv::layout::{KvDtype, KvLayout, KvPart, LAYOUT_VERSION};
use crate::model::config::ModelConfig;
use crate::model::qwen3::{self, KvStore, Qwen3Weights};
use crate::model::LoadedModel;

/// Default cap of the CPU KV pool when no size is configured: 4 GiB.
pub const DEFAULT_CPU_KV_CAP_BYTES: u64 = 4 << 30;

/// Number of KV blocks for a CPU pool when `kv_cache_config.max_tokens` is not given.
///
/// The rule: `budget = min(fraction × MemAvailable, cap_bytes)` and
/// `blocks = max(budget / block_bytes, 1)`. `fraction` is the config's
/// `free_gpu_memory_fraction` (the same knob as on GPU, applied to host memory), MemAvailable is
/// read from `/proc/meminfo` (when unreadable, 1 GiB is assumed) and `cap_bytes` bounds the pool
/// so that a large host does not hand most of its memory to one test worker
/// ([`DEFAULT_CPU_KV_CAP_BYTES`] unless the caller has a flag for it).
pub fn cpu_kv_blocks_from_memory(block_bytes: usize, fraction: f64, cap_bytes: u64) -> usize {
    let available = mem_available_bytes().unwrap_or(1 << 30);
    kv_blocks_for_budget(block_bytes, available, fraction, cap_bytes)
}

/// The arithmetic of [`cpu_kv_blocks_from_memory`], for a given MemAvailable.
pub fn kv_blocks_for_budget(
    block_bytes: usize,
    mem_available: u64,
    fraction: f64,
    cap_bytes: u64,
) -> usize {
    let fraction = if fraction.is_finite() {
        fraction.clamp(0.0, 1.0)
    } else {
        0.0
    };
    let budget = ((mem_available as f64 * fraction) as u64).min(cap_bytes);
    ((budget / block_bytes.max(1) as u64) as usize).max(1)
}

/// MemAvailable from `/proc/meminfo`, in bytes.
pub fn mem_available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The pool's elements; byte offsets of the layout divide by the element size.
enum Pool {
    F32(Vec<f32>),
    /// bf16 bit patterns.
    Bf16(Vec<u16>),
}

struct CpuKv {
    layout: KvLayout,
    pool: Pool,
}

impl CpuKv {
    fn elem(&self, block: usize, layer: usize, part: KvPart, slot: usize, head: usize) -> usize {
        self.layout.token_offset(block, layer, part, slot, head) / self.layout.dtype.bytes()
    }
}

impl KvStore for CpuKv {
    fn write_token(&mut self, layer: usize, block: usize, slot: usize, part: KvPart, data: &[f32]) {
        let at = self.elem(block, layer, part, slot, 0);
        match &mut self.pool {
            Pool::F32(p) => p[at..at + data.len()].copy_from_slice(data),
            Pool::Bf16(p) => {
                for (d, s) in p[at..at + data.len()].iter_mut().zip(data) {
                    *d = half::bf16::from_f32(*s).to_bits();
                }
            }
        }
    }

    fn read_head<'a>(
        &'a self,
        layer: usize,
        block: usize,
        slot: usize,
        part: KvPart,
        head: usize,
        scratch: &'a mut [f32],
    ) -> &'a [f32] {
        let at = self.elem(block, layer, part, slot, head);
        let hd = self.layout.head_dim;
        match &self.pool {
            Pool::F32(p) => &p[at..at + hd],
            Pool::Bf16(p) => {
                for (d, s) in scratch.iter_mut().zip(&p[at..at + hd]) {
                    *d = f32::from_bits((*s as u32) << 16);
                }
                &scratch[..hd]
            }
        }
    }
}

/// Runs Qwen3 on the CPU.
pub struct CpuBackend {
    config: ModelConfig,
    weights: Arc<Qwen3Weights>,
    kv: CpuKv,
    num_blocks: usize,
}

impl CpuBackend {
    /// A backend over `model`'s weights (shared, not copied) with a fresh, zeroed KV pool.
    pub fn new(
        model: &LoadedModel,
        kv_dtype: KvDtype,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, EngineError> {
        if !model.weights_loaded {
            return Err(EngineError::InvalidInput(format!(
                "{} was loaded without its weights (LoadOptions {{ weights: false }})",
                model.path.display()
            )));
        }
        Self::from_parts(
            model.config.clone(),
            model.weights.clone(),
            model.model_id.clone(),
            kv_dtype,
            block_size,
            num_blocks,
        )
    }

    /// A backend from weights built elsewhere (benchmarks, random models).
    pub fn from_parts(
        config: ModelConfig,
        weights: Arc<Qwen3Weights>,
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
        let layout = KvLayout {
            version: LAYOUT_VERSION,
            model_id,
            dtype: kv_dtype,
            block_size,
            num_layers: config.num_hidden_layers,
            num_kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
        };
        let elems = num_blocks
            .checked_mul(layout.block_bytes() / kv_dtype.bytes())
            .ok_or_else(|| EngineError::InvalidInput("KV pool size overflows".into()))?;
        let pool = match kv_dtype {
            KvDtype::F32 => Pool::F32(vec![0.0; elems]),
            KvDtype::Bf16 => Pool::Bf16(vec![0; elems]),
        };
        Ok(CpuBackend {
            config,
            weights,
            kv: CpuKv { layout, pool },
            num_blocks,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn check_blocks(&self, blocks: &[u32]) -> Result<(), EngineError> {
        match blocks.iter().find(|&&b| b as usize >= self.num_blocks) {
            Some(b) => Err(EngineError::InvalidInput(format!(
                "block id {b} is outside the pool of {} blocks",
                self.num_blocks
            ))),
            None => Ok(()),
        }
    }

    fn check_batch(&self, batch: &[SeqInput<'_>]) -> Result<(), EngineError> {
        let bs = self.kv.layout.block_size;
        for (i, seq) in batch.iter().enumerate() {
            let end = seq.start_pos + seq.tokens.len();
            if seq.tokens.is_empty() && seq.logits != LogitsMode::None {
                return Err(EngineError::InvalidInput(format!(
                    "sequence {i}: logits asked for an empty step"
                )));
            }
            if seq.block_table.len() < end.div_ceil(bs) {
                return Err(EngineError::InvalidInput(format!(
                    "sequence {i}: block table of {} blocks does not cover positions 0..{end} \
                     (block size {bs})",
                    seq.block_table.len()
                )));
            }
            self.check_blocks(&seq.block_table[..end.div_ceil(bs)])?;
        }
        Ok(())
    }
}

impl Backend for CpuBackend {
    fn layout(&self) -> &KvLayout {
        &self.kv.layout
    }

    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn forward(&mut self, batch: &[SeqInput<'_>]) -> Result<StepOutput, EngineError> {
        self.check_batch(batch)?;
        let bs = self.kv.layout.block_size;
        qwen3::forward(&self.config, &self.weights, &mut self.kv, bs, batch)
    }

    fn export_blocks(&self, blocks: &[u32]) -> Result<Vec<u8>, EngineError> {
        self.check_blocks(blocks)?;
        let bb = self.kv.layout.block_bytes();
        let mut out = Vec::with_capacity(blocks.len() * bb);
        for &b in blocks {
            let lo = b as usize * bb;
            match &self.kv.pool {
                Pool::F32(p) => {
                    for v in &p[lo / 4..(lo + bb) / 4] {
                        out.extend_from_slice(&v.to_le_bytes());
                    }
                }
                Pool::Bf16(p) => {
                    for v in &p[lo / 2..(lo + bb) / 2] {
                        out.extend_from_slice(&v.to_le_bytes());
                    }
                }
            }
        }
        Ok(out)
    }

    fn import_blocks(&mut self, blocks: &[u32], data: &[u8]) -> Result<(), EngineError> {
        self.check_blocks(blocks)?;
        let bb = self.kv.layout.block_bytes();
        if data.len() != blocks.len() * bb {
            return Err(EngineError::InvalidInput(format!(
                "import of {} blocks needs {} bytes, got {}",
                blocks.len(),
                blocks.len() * bb,
                data.len()
            )));
        }
        for (&b, src) in blocks.iter().zip(data.chunks_exact(bb)) {
            let lo = b as usize * bb;
            match &mut self.kv.pool {
                Pool::F32(p) => {
                    for (d, s) in p[lo / 4..(lo + bb) / 4].iter_mut().zip(src.chunks_exact(4)) {
                        *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                    }
                }
                Pool::Bf16(p) => {
                    for (d, s) in p[lo / 2..(lo + bb) / 2].iter_mut().zip(src.chunks_exact(2)) {
                        *d = u16::from_le_bytes([s[0], s[1]]);
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu_ops::Matrix;
    use crate::tiny::{qwen3_config_json, random_init, random_tensor, TinyDims};

    /// A micro Qwen3 (vocab 50, hidden 16) built in memory, no files.
    fn micro(kv: KvDtype, blocks: usize) -> CpuBackend {
        let d = TinyDims {
            hidden: 16,
            intermediate: 32,
            layers: 2,
            heads: 2,
            kv_heads: 1,
            head_dim: 8,
            vocab: 50,
            tied: true,
        };
        let json = serde_json::to_vec(&qwen3_config_json(&d, "float32")).unwrap();
        let cfg = ModelConfig::parse(&json, std::path::Path::new("micro")).unwrap();
        let w = Qwen3Weights::from_source(&cfg, |name, shape| {
            let (mean, std) = random_init(name, shape);
            let n = shape.iter().product();
            Ok(Matrix::F32(random_tensor(3, name, n, mean, std)))
        })
        .unwrap();
        CpuBackend::from_parts(cfg, Arc::new(w), "micro".into(), kv, 4, blocks).unwrap()
    }

    fn seq<'a>(tokens: &'a [u32], start: usize, table: &'a [u32], l: LogitsMode) -> SeqInput<'a> {
        SeqInput {
            tokens,
            start_pos: start,
            block_table: table,
            logits: l,
        }
    }

    #[test]
    fn logits_rows_follow_the_mode() {
        let mut be = micro(KvDtype::F32, 8);
        let out = be
            .forward(&[
                seq(&[1, 2, 3], 0, &[0], LogitsMode::All),
                seq(&[4, 5], 0, &[1], LogitsMode::Last),
                seq(&[6], 0, &[2], LogitsMode::None),
            ])
            .unwrap();
        let rows: Vec<usize> = out.logits.iter().map(Vec::len).collect();
        assert_eq!(rows, vec![3, 1, 0]);
        assert!(out.logits[0].iter().all(|r| r.len() == 50));
        assert!(be.forward(&[]).unwrap().logits.is_empty());
    }

    #[test]
    fn bad_inputs_are_errors_not_panics() {
        let mut be = micro(KvDtype::F32, 4);
        let e = be.forward(&[seq(&[50], 0, &[0], LogitsMode::Last)]);
        assert!(e.unwrap_err().to_string().contains("vocabulary"));
        // 5 positions need 2 blocks of 4.
        let e = be.forward(&[seq(&[1, 2, 3, 4, 5], 0, &[0], LogitsMode::Last)]);
        assert!(e.unwrap_err().to_string().contains("does not cover"));
        let e = be.forward(&[seq(&[1], 0, &[9], LogitsMode::Last)]);
        assert!(e.unwrap_err().to_string().contains("outside the pool"));
        let e = be.forward(&[seq(&[], 0, &[0], LogitsMode::Last)]);
        assert!(e.is_err());
        assert!(be.import_blocks(&[0], &[0u8; 3]).is_err());
        assert!(be.export_blocks(&[4]).is_err());
        assert!(CpuBackend::from_parts(
            be.config().clone(),
            be.weights.clone(),
            "m".into(),
            KvDtype::F32,
            0,
            1
        )
        .is_err());
    }

    #[test]
    fn a_sequence_computes_the_same_alone_and_in_a_batch() {
        let mut be = micro(KvDtype::F32, 16);
        let a: Vec<u32> = (0..7).collect();
        let b: Vec<u32> = (10..30).collect();
        let alone = be.forward(&[seq(&a, 0, &[0, 1], LogitsMode::All)]).unwrap();
        let batched = be
            .forward(&[
                seq(&b, 0, &[5, 6, 7, 8, 9], LogitsMode::None),
                seq(&a, 0, &[2, 3], LogitsMode::All),
            ])
            .unwrap();
        for (x, y) in alone.logits[0].iter().zip(&batched.logits[1]) {
            for (u, v) in x.iter().zip(y) {
                assert!((u - v).abs() <= 1e-5 * (1.0 + u.abs()), "{u} vs {v}");
            }
        }
    }

    #[test]
    fn bf16_blocks_round_trip_through_export_and_import() {
        let mut a = micro(KvDtype::Bf16, 4);
        a.forward(&[seq(&[1, 2, 3, 4, 5, 6], 0, &[3, 1], LogitsMode::None)])
            .unwrap();
        let data = a.export_blocks(&[3, 1]).unwrap();
        assert_eq!(data.len(), 2 * a.layout().block_bytes());
        assert!(data.iter().any(|&b| b != 0));
        let mut b = micro(KvDtype::Bf16, 4);
        b.import_blocks(&[0, 2], &data).unwrap();
        assert_eq!(b.export_blocks(&[0, 2]).unwrap(), data);
        // Both continue identically from their own copies.
        let la = a
            .forward(&[seq(&[7], 6, &[3, 1], LogitsMode::Last)])
            .unwrap();
        let lb = b
            .forward(&[seq(&[7], 6, &[0, 2], LogitsMode::Last)])
            .unwrap();
        assert_eq!(la, lb);
    }

    #[test]
    fn memory_rule_takes_the_fraction_and_the_cap() {
        // 10 GiB available, 0.5 → 5 GiB, capped at 4 GiB, 1 MiB blocks → 4096.
        assert_eq!(kv_blocks_for_budget(1 << 20, 10 << 30, 0.5, 4 << 30), 4096);
        // 2 GiB available, 0.25 → 512 MiB → 512 blocks.
        assert_eq!(kv_blocks_for_budget(1 << 20, 2 << 30, 0.25, 4 << 30), 512);
        // Never zero blocks; nonsense fractions clamp.
        assert_eq!(kv_blocks_for_budget(1 << 20, 1, 0.5, 4 << 30), 1);
        assert_eq!(kv_blocks_for_budget(1 << 20, 2 << 30, f64::NAN, 4 << 30), 1);
        assert!(cpu_kv_blocks_from_memory(1 << 20, 0.01, 1 << 30) >= 1);
    }
}
