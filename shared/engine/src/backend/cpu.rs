//! The CPU backend: f32 weights, GEMMs through matrixmultiply on rayon threads, and the KV
//! pool held in host memory in the byte order of [`KvLayout`] (f32 or bf16 elements).

use std::sync::Arc;

use crate::backend::pool_memory::KvPoolMemory;
use crate::backend::{Backend, SeqInput, StepOutput};
use crate::error::EngineError;
use crate::kv::fp8;
use crate::kv::layout::{KvDtype, KvLayout, KvPart, LAYOUT_VERSION};
use crate::model::config::ModelConfig;
use crate::model::decoder::{self, KvStore};
use crate::model::tp::{RankCtx, Shard, ThreadCollective};
use crate::model::LoadedModel;
use crate::model::Qwen3Weights;

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

/// The KV pool: `num_blocks * block_bytes` bytes of [`KvPoolMemory`] in the byte order of
/// the layout, read and written in place (f32 elements, or bf16 bit patterns).
///
/// A tensor-parallel rank's view addresses only its KV heads, from `first_head` on: the
/// ranks share one pool in the layout of the whole model (so blocks move between workers of
/// any tensor-parallel size) and write disjoint heads of each token.
///
/// Every access takes a slice of just the range it touches (one token's heads, one block) and
/// only of blocks the engine hands the backend (the batch's block tables, export/import lists),
/// never a reference over the whole pool: remote writers may be writing other (reserved)
/// blocks at the same time.
struct CpuKv {
    layout: KvLayout,
    mem: Arc<KvPoolMemory>,
    first_head: usize,
}

impl KvStore for CpuKv {
    fn write_token(&mut self, layer: usize, block: usize, slot: usize, part: KvPart, data: &[f32]) {
        let at = self
            .layout
            .token_offset(block, layer, part, slot, self.first_head);
        match self.layout.dtype {
            KvDtype::F32 => {
                // SAFETY: `&mut self` excludes every other access of this view, and other
                // tensor-parallel ranks' views touch other heads; the block is one the engine
                // computes on, so no remote writer touches it; bounds are checked.
                let d = unsafe { self.mem.slice_mut::<f32>(at, data.len()) };
                d.copy_from_slice(data);
            }
            KvDtype::Bf16 => {
                // SAFETY: as above.
                let d = unsafe { self.mem.slice_mut::<u16>(at, data.len()) };
                for (d, s) in d.iter_mut().zip(data) {
                    *d = half::bf16::from_f32(*s).to_bits();
                }
            }
            KvDtype::F16 => {
                // SAFETY: as above.
                let d = unsafe { self.mem.slice_mut::<u16>(at, data.len()) };
                for (d, s) in d.iter_mut().zip(data) {
                    *d = half::f16::from_f32(*s).to_bits();
                }
            }
            KvDtype::Fp8 => self.write_fp8_token(layer, block, slot, part, data),
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
        let head = self.first_head + head;
        let at = self.layout.token_offset(block, layer, part, slot, head);
        let hd = self.layout.head_dim;
        match self.layout.dtype {
            // SAFETY: reads happen under `&self` (no engine write meanwhile), of a block in a
            // running sequence's table (no remote writer); bounds are checked.
            KvDtype::F32 => unsafe { self.mem.slice::<f32>(at, hd) },
            KvDtype::Bf16 => {
                // SAFETY: as above.
                let s = unsafe { self.mem.slice::<u16>(at, hd) };
                for (d, s) in scratch.iter_mut().zip(s) {
                    *d = f32::from_bits((*s as u32) << 16);
                }
                &scratch[..hd]
            }
            KvDtype::F16 => {
                // SAFETY: as above.
                let s = unsafe { self.mem.slice::<u16>(at, hd) };
                for (d, s) in scratch.iter_mut().zip(s) {
                    *d = half::f16::from_bits(*s).to_f32();
                }
                &scratch[..hd]
            }
            KvDtype::Fp8 => {
                let sat = self.layout.scale_offset(block, layer, part, slot, head);
                // SAFETY: as above.
                let (codes, scale) =
                    unsafe { (self.mem.slice::<u8>(at, hd), self.mem.slice::<u8>(sat, 4)) };
                let scale = f32::from_le_bytes([scale[0], scale[1], scale[2], scale[3]]);
                fp8::dequantize_head(codes, scale, &mut scratch[..hd]);
                &scratch[..hd]
            }
        }
    }
}

impl CpuKv {
    /// One token's K or V (every KV head) as e4m3 codes and a scale per head.
    fn write_fp8_token(
        &mut self,
        layer: usize,
        block: usize,
        slot: usize,
        part: KvPart,
        data: &[f32],
    ) {
        let hd = self.layout.head_dim;
        for (head, x) in (self.first_head..).zip(data.chunks_exact(hd)) {
            let at = self.layout.token_offset(block, layer, part, slot, head);
            let sat = self.layout.scale_offset(block, layer, part, slot, head);
            // SAFETY: as in `write_token`: `&mut self`, a block the engine computes on,
            // bounds checked; the codes and the scale are disjoint ranges (layout docs).
            let codes = unsafe { self.mem.slice_mut::<u8>(at, hd) };
            let scale = fp8::quantize_head(x, codes);
            // SAFETY: as above.
            let d = unsafe { self.mem.slice_mut::<u8>(sat, 4) };
            d.copy_from_slice(&scale.to_le_bytes());
        }
    }
}

/// Runs the decoder families of [`crate::model`] (Qwen3, Qwen2, Llama, Mistral) on the CPU.
pub struct CpuBackend {
    config: ModelConfig,
    weights: Arc<Qwen3Weights>,
    kv: CpuKv,
    num_blocks: usize,
    /// With tensor parallelism: the ranks that run each step instead of `weights`.
    ranks: Option<Ranks>,
}

/// The tensor-parallel ranks of a CPU backend, run as scoped threads each step.
struct Ranks {
    ranks: Vec<Rank>,
    collective: ThreadCollective,
}

/// One rank: its shard of the weights and its view of the pool (its KV heads).
struct Rank {
    shard: Shard,
    weights: Qwen3Weights,
    kv: CpuKv,
}

impl Ranks {
    /// One step on every rank at once (rank 0 on the calling thread); rank 0's logits, or
    /// the error of the rank that failed first.
    fn forward(
        &mut self,
        cfg: &ModelConfig,
        block_size: usize,
        batch: &[SeqInput<'_>],
    ) -> Result<StepOutput, EngineError> {
        self.collective.reset();
        let collective = &self.collective;
        let mut results = std::thread::scope(|s| {
            let (first, rest) = self.ranks.split_at_mut(1);
            let others: Vec<_> = rest
                .iter_mut()
                .map(|rank| s.spawn(move || rank.run(cfg, block_size, batch, collective)))
                .collect();
            let mut results = vec![first[0].run(cfg, block_size, batch, collective)];
            for (i, h) in others.into_iter().enumerate() {
                let failed = EngineError::RankFailed { rank: i + 1 };
                results.push(h.join().unwrap_or(Err(failed)));
            }
            results
        });
        // A rank's own error says more than the others' "rank N failed".
        let cause = results
            .iter()
            .position(|r| matches!(r, Err(e) if !matches!(e, EngineError::RankFailed { .. })));
        match cause {
            Some(i) => results.swap_remove(i),
            None => results.swap_remove(0),
        }
    }
}

impl Rank {
    /// This rank's part of a step; a failure (or a panic) poisons the collective so that
    /// the other ranks stop at their next one instead of waiting for this rank.
    fn run(
        &mut self,
        cfg: &ModelConfig,
        block_size: usize,
        batch: &[SeqInput<'_>],
        collective: &ThreadCollective,
    ) -> Result<StepOutput, EngineError> {
        struct PoisonUnlessDone<'c>(&'c ThreadCollective, usize, bool);
        impl Drop for PoisonUnlessDone<'_> {
            fn drop(&mut self) {
                if !self.2 {
                    self.0.poison(self.1);
                }
            }
        }
        let mut guard = PoisonUnlessDone(collective, self.shard.rank, false);
        let ctx = RankCtx {
            shard: self.shard,
            collective: Some(collective),
        };
        let out = decoder::forward_rank(cfg, &self.weights, &mut self.kv, block_size, batch, ctx);
        guard.2 = out.is_ok();
        out
    }
}

impl CpuBackend {
    /// A backend over `model`'s weights (shared, not copied) with a fresh, zeroed KV pool.
    pub fn new(
        model: &LoadedModel,
        kv_dtype: KvDtype,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, EngineError> {
        Self::check_model(model)?;
        Self::from_parts(
            model.config.clone(),
            model.weights.clone(),
            model.model_id.clone(),
            kv_dtype,
            block_size,
            num_blocks,
        )
    }

    /// Like [`CpuBackend::new`], with the KV pool in `memory` (e.g. memory registered with the
    /// KV transport, so that a remote prefill can write reserved blocks straight into it).
    /// `memory` must hold at least `num_blocks * block_bytes` bytes; block `id` starts at
    /// [`CpuBackend::block_offset`]. Its content is not cleared.
    pub fn new_in(
        model: &LoadedModel,
        kv_dtype: KvDtype,
        block_size: usize,
        num_blocks: usize,
        memory: KvPoolMemory,
    ) -> Result<Self, EngineError> {
        Self::check_model(model)?;
        Self::build(
            model.config.clone(),
            model.weights.clone(),
            model.model_id.clone(),
            kv_dtype,
            block_size,
            num_blocks,
            Some(memory),
        )
    }

    fn check_model(model: &LoadedModel) -> Result<(), EngineError> {
        if !model.weights_loaded {
            return Err(EngineError::InvalidInput(format!(
                "{} was loaded without its weights (LoadOptions::no_weights)",
                model.path.display()
            )));
        }
        Ok(())
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
        Self::build(
            config, weights, model_id, kv_dtype, block_size, num_blocks, None,
        )
    }

    /// Like [`CpuBackend::from_parts`], with the KV pool in `memory` (see
    /// [`CpuBackend::new_in`]).
    pub fn from_parts_in(
        config: ModelConfig,
        weights: Arc<Qwen3Weights>,
        model_id: String,
        kv_dtype: KvDtype,
        block_size: usize,
        num_blocks: usize,
        memory: KvPoolMemory,
    ) -> Result<Self, EngineError> {
        Self::build(
            config,
            weights,
            model_id,
            kv_dtype,
            block_size,
            num_blocks,
            Some(memory),
        )
    }

    fn build(
        config: ModelConfig,
        weights: Arc<Qwen3Weights>,
        model_id: String,
        kv_dtype: KvDtype,
        block_size: usize,
        num_blocks: usize,
        memory: Option<KvPoolMemory>,
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
        let bytes = num_blocks
            .checked_mul(layout.block_bytes())
            .ok_or_else(|| EngineError::InvalidInput("KV pool size overflows".into()))?;
        let mem = match memory {
            None => KvPoolMemory::owned(bytes)?,
            Some(m) if m.len() < bytes => {
                return Err(EngineError::InvalidInput(format!(
                    "KV pool memory of {} bytes is too small for {num_blocks} blocks of {} \
                     bytes ({bytes} bytes needed)",
                    m.len(),
                    layout.block_bytes()
                )))
            }
            Some(m) if !(m.as_ptr() as usize).is_multiple_of(kv_dtype.bytes()) => {
                return Err(EngineError::InvalidInput(format!(
                    "KV pool memory at {:p} is not aligned for {kv_dtype} elements",
                    m.as_ptr()
                )))
            }
            Some(m) => m,
        };
        Ok(CpuBackend {
            config,
            weights,
            kv: CpuKv {
                layout,
                mem: Arc::new(mem),
                first_head: 0,
            },
            num_blocks,
            ranks: None,
        })
    }

    /// Splits the model over `world` tensor-parallel ranks (threads of this process, joined
    /// by an in-process all-reduce: see [`crate::model::tp`]); 1 leaves it whole. Each rank
    /// holds a copy of its shard of the weights and computes its KV heads in the shared
    /// pool, whose layout does not change. Refused when `world` does not divide the KV
    /// heads, the query heads and the intermediate size.
    pub fn with_tensor_parallel(mut self, world: usize) -> Result<Self, EngineError> {
        Shard::check(&self.config, world)?;
        self.ranks = (world > 1).then(|| {
            let ranks = (0..world)
                .map(|rank| {
                    let shard = Shard { rank, world };
                    Rank {
                        shard,
                        weights: shard.weights(&self.config, &self.weights),
                        kv: CpuKv {
                            layout: self.kv.layout.clone(),
                            mem: self.kv.mem.clone(),
                            first_head: shard.part(self.config.num_key_value_heads).start,
                        },
                    }
                })
                .collect();
            Ranks {
                ranks,
                collective: ThreadCollective::new(world),
            }
        });
        Ok(self)
    }

    /// Tensor-parallel ranks (1 when the model is whole).
    pub fn tensor_parallel_size(&self) -> usize {
        self.ranks.as_ref().map_or(1, |r| r.ranks.len())
    }

    /// Byte offset of block `id` inside the pool memory (`id * block_bytes`).
    pub fn block_offset(&self, id: u32) -> u64 {
        self.kv.layout.block_offset(id)
    }

    /// The memory the KV pool lives in.
    pub fn pool_memory(&self) -> &KvPoolMemory {
        &self.kv.mem
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn check_blocks(&self, blocks: &[u32]) -> Result<(), EngineError> {
        super::check_blocks(blocks, self.num_blocks)
    }

    fn check_batch(&self, batch: &[SeqInput<'_>]) -> Result<(), EngineError> {
        super::check_batch(batch, self.kv.layout.block_size, self.num_blocks)
    }
}

impl Backend for CpuBackend {
    fn layout(&self) -> &KvLayout {
        &self.kv.layout
    }

    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn media_embedding_width(&self) -> Option<usize> {
        Some(self.config.hidden_size)
    }

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn forward(&mut self, batch: &[SeqInput<'_>]) -> Result<StepOutput, EngineError> {
        self.check_batch(batch)?;
        let bs = self.kv.layout.block_size;
        match &mut self.ranks {
            None => decoder::forward(&self.config, &self.weights, &mut self.kv, bs, batch),
            Some(ranks) => ranks.forward(&self.config, bs, batch),
        }
    }

    fn export_blocks(&self, blocks: &[u32]) -> Result<Vec<u8>, EngineError> {
        self.check_blocks(blocks)?;
        let bb = self.kv.layout.block_bytes();
        let mut out = Vec::with_capacity(blocks.len() * bb);
        for &b in blocks {
            // SAFETY: one block the engine owns (no remote writer), read under `&self`; the
            // pool is in layout byte order, so the bytes are the export format.
            let src = unsafe { self.kv.mem.slice::<u8>(b as usize * bb, bb) };
            out.extend_from_slice(src);
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
            // SAFETY: one block the engine owns, written under `&mut self`.
            let dst = unsafe { self.kv.mem.slice_mut::<u8>(b as usize * bb, bb) };
            dst.copy_from_slice(src);
        }
        Ok(())
    }

    fn copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<(), EngineError> {
        let bb = self.kv.layout.block_bytes();
        for &(src, dst) in pairs {
            self.check_blocks(&[src, dst])?;
            if src == dst {
                continue;
            }
            let (lo, hi) = (src.min(dst) as usize, src.max(dst) as usize);
            // SAFETY: blocks the engine owns, under `&mut self`; one span covering both.
            let span = unsafe { self.kv.mem.slice_mut::<u8>(lo * bb, (hi - lo + 1) * bb) };
            let (s, d) = ((src as usize - lo) * bb, (dst as usize - lo) * bb);
            span.copy_within(s..s + bb, d);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu_ops::Matrix;
    use crate::backend::LogitsMode;
    use crate::tiny::{qwen3_config_json, random_init, random_tensor, TinyDims};

    /// A micro Qwen3 (vocab 50, hidden 16) built in memory, no files.
    fn micro(kv: KvDtype, blocks: usize) -> CpuBackend {
        micro_in(kv, blocks, None)
    }

    fn micro_in(kv: KvDtype, blocks: usize, mem: Option<KvPoolMemory>) -> CpuBackend {
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
        match mem {
            None => CpuBackend::from_parts(cfg, Arc::new(w), "micro".into(), kv, 4, blocks),
            Some(m) => {
                CpuBackend::from_parts_in(cfg, Arc::new(w), "micro".into(), kv, 4, blocks, m)
            }
        }
        .unwrap()
    }

    fn seq<'a>(tokens: &'a [u32], start: usize, table: &'a [u32], l: LogitsMode) -> SeqInput<'a> {
        SeqInput {
            tokens,
            start_pos: start,
            block_table: table,
            logits: l,
            media: Default::default(),
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
    fn sixteen_bit_blocks_round_trip_through_export_and_import() {
        for dtype in [KvDtype::Bf16, KvDtype::F16, KvDtype::Fp8] {
            let mut a = micro(dtype, 4);
            a.forward(&[seq(&[1, 2, 3, 4, 5, 6], 0, &[3, 1], LogitsMode::None)])
                .unwrap();
            let data = a.export_blocks(&[3, 1]).unwrap();
            assert_eq!(data.len(), 2 * a.layout().block_bytes());
            assert!(data.iter().any(|&b| b != 0));
            let mut b = micro(dtype, 4);
            b.import_blocks(&[0, 2], &data).unwrap();
            assert_eq!(b.export_blocks(&[0, 2]).unwrap(), data);
            // Both continue identically from their own copies.
            let la = a
                .forward(&[seq(&[7], 6, &[3, 1], LogitsMode::Last)])
                .unwrap();
            let lb = b
                .forward(&[seq(&[7], 6, &[0, 2], LogitsMode::Last)])
                .unwrap();
            assert_eq!(la, lb, "{dtype}");
        }
    }

    #[test]
    fn an_f16_pool_holds_f16_values() {
        // The cache holds each K/V element rounded to f16: 3 mantissa bits more than bf16,
        // so logits over it stay closer to the f32 pool's.
        let toks: Vec<u32> = (1..13).collect();
        let exact = micro_logits(KvDtype::F32, &toks);
        let logits = |dtype| micro_logits(dtype, &toks);
        let err = |v: Vec<f32>| {
            v.iter()
                .zip(&exact)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max)
        };
        let (e16, eb16) = (err(logits(KvDtype::F16)), err(logits(KvDtype::Bf16)));
        assert!(e16 > 0.0 && e16 * 3.0 < eb16, "f16 {e16} vs bf16 {eb16}");
        // The first layer's K/V (computed before any attention read the pool) are the f16
        // bit patterns of what an f32 pool holds.
        let mut f32_pool = micro(KvDtype::F32, 4);
        let mut f16_pool = micro(KvDtype::F16, 4);
        for be in [&mut f32_pool, &mut f16_pool] {
            be.forward(&[seq(&toks[..4], 0, &[2], LogitsMode::None)])
                .unwrap();
        }
        let layer0 = f32_pool.layout().token_offset(0, 1, KvPart::K, 0, 0) / 4;
        let wide = f32_pool.export_blocks(&[2]).unwrap();
        let narrow = f16_pool.export_blocks(&[2]).unwrap();
        let narrow = &narrow[..2 * layer0];
        let want: Vec<u8> = wide[..4 * layer0]
            .chunks_exact(4)
            .flat_map(|c| {
                let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                half::f16::from_f32(v).to_bits().to_le_bytes()
            })
            .collect();
        assert_eq!(narrow, want);
    }

    #[test]
    fn an_fp8_pool_holds_scaled_e4m3_heads_close_to_the_f32_pool() {
        let toks: Vec<u32> = (1..13).collect();
        let exact = micro_logits(KvDtype::F32, &toks);
        let logits = |dtype| micro_logits(dtype, &toks);
        let (lo, hi) = exact
            .iter()
            .fold((f32::MAX, f32::MIN), |(a, b), v| (a.min(*v), b.max(*v)));
        let e8 = logits(KvDtype::Fp8)
            .iter()
            .zip(&exact)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        // Coarser than a 16-bit cache, but a few percent of the logits' spread at most.
        assert!(
            e8 > 0.0 && e8 < 0.05 * (hi - lo),
            "fp8 {e8}, spread {}",
            hi - lo
        );
        // The first layer's heads are the codes and scales of what an f32 pool holds.
        let mut f32_pool = micro(KvDtype::F32, 4);
        let mut fp8_pool = micro(KvDtype::Fp8, 4);
        for be in [&mut f32_pool, &mut fp8_pool] {
            be.forward(&[seq(&toks[..4], 0, &[2], LogitsMode::None)])
                .unwrap();
        }
        let (wl, nl) = (f32_pool.layout().clone(), fp8_pool.layout().clone());
        let wide = f32_pool.export_blocks(&[2]).unwrap();
        let narrow = fp8_pool.export_blocks(&[2]).unwrap();
        let hd = wl.head_dim;
        for part in [KvPart::K, KvPart::V] {
            for slot in 0..4 {
                for head in 0..wl.num_kv_heads {
                    let at = wl.token_offset(0, 0, part, slot, head);
                    let x: Vec<f32> = wide[at..at + 4 * hd]
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect();
                    let mut codes = vec![0u8; hd];
                    let scale = fp8::quantize_head(&x, &mut codes);
                    let at = nl.token_offset(0, 0, part, slot, head);
                    assert_eq!(&narrow[at..at + hd], &codes[..]);
                    let at = nl.scale_offset(0, 0, part, slot, head);
                    assert_eq!(&narrow[at..at + 4], &scale.to_le_bytes());
                }
            }
        }
    }

    /// Every position's logits of `toks` prefilled into a fresh micro backend of `dtype`.
    fn micro_logits(dtype: KvDtype, toks: &[u32]) -> Vec<f32> {
        let out = micro(dtype, 4)
            .forward(&[seq(toks, 0, &[0, 1, 2], LogitsMode::All)])
            .unwrap();
        out.logits.concat().concat()
    }

    /// A buffer the test owns, handed to the pool as external memory (as a transport
    /// registration would be); returns the memory and the buffer's address.
    fn external(bytes: usize) -> (KvPoolMemory, usize) {
        let mut buf = vec![0u64; bytes.div_ceil(8)];
        let ptr = buf.as_mut_ptr() as *mut u8;
        // SAFETY: the Vec's heap buffer does not move when the Vec is boxed, and lives as
        // long as the pool (it is the keep-alive).
        let m = unsafe { KvPoolMemory::external(ptr, bytes, Box::new(buf)) }.unwrap();
        (m, ptr as usize)
    }

    #[test]
    fn external_pool_matches_owned_pool() {
        for dtype in [KvDtype::F32, KvDtype::Bf16, KvDtype::F16] {
            let mut owned = micro(dtype, 6);
            let bb = owned.layout().block_bytes();
            let (mem, addr) = external(6 * bb);
            let mut ext = micro_in(dtype, 6, Some(mem));
            assert!(ext.pool_memory().is_external());
            assert_eq!(ext.pool_memory().as_ptr() as usize, addr);
            assert_eq!(ext.block_offset(3), 3 * bb as u64);
            let toks: Vec<u32> = (1..11).collect();
            let a = owned
                .forward(&[seq(&toks, 0, &[4, 0, 2], LogitsMode::All)])
                .unwrap();
            let b = ext
                .forward(&[seq(&toks, 0, &[4, 0, 2], LogitsMode::All)])
                .unwrap();
            assert_eq!(a, b, "{dtype}");
            let data = owned.export_blocks(&[4, 0, 2]).unwrap();
            assert_eq!(ext.export_blocks(&[4, 0, 2]).unwrap(), data);
            // Block 4 is where the transport would find it.
            // SAFETY: the engine is not running; nothing else touches the memory.
            let raw = unsafe { std::slice::from_raw_parts((addr as *const u8).add(4 * bb), bb) };
            assert_eq!(raw, &data[..bb]);

            // Import into another external pool at other ids, then continue identically.
            let (mem2, _) = external(6 * bb);
            let mut ext2 = micro_in(dtype, 6, Some(mem2));
            ext2.import_blocks(&[1, 5, 3], &data).unwrap();
            assert_eq!(ext2.export_blocks(&[1, 5, 3]).unwrap(), data);
            let la = owned
                .forward(&[seq(&[7], 10, &[4, 0, 2], LogitsMode::Last)])
                .unwrap();
            let lb = ext2
                .forward(&[seq(&[7], 10, &[1, 5, 3], LogitsMode::Last)])
                .unwrap();
            assert_eq!(la, lb, "{dtype}");
        }
    }

    #[test]
    fn external_pool_too_small_is_refused() {
        let be = micro(KvDtype::F32, 2);
        let bb = be.layout().block_bytes();
        let (mem, _) = external(2 * bb - 4);
        let e = CpuBackend::from_parts_in(
            be.config().clone(),
            be.weights.clone(),
            "m".into(),
            KvDtype::F32,
            4,
            2,
            mem,
        )
        .err()
        .unwrap();
        assert!(e.to_string().contains("too small"), "{e}");
    }

    /// A micro Qwen3 with q/k/v/o biases, 4 query and 2 KV heads, an untied lm_head (or a
    /// tied one) and a vocabulary of 51 (uneven over 2 ranks), split over `world` ranks.
    fn micro_tp(kv: KvDtype, world: usize, tied: bool) -> Result<CpuBackend, EngineError> {
        let d = TinyDims {
            hidden: 16,
            intermediate: 32,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            vocab: 51,
            tied,
        };
        let mut json = qwen3_config_json(&d, "float32");
        json["attention_bias"] = true.into();
        let cfg = ModelConfig::parse(&serde_json::to_vec(&json).unwrap(), "tp".as_ref()).unwrap();
        assert!(cfg.qkv_bias && cfg.o_bias);
        let w = Qwen3Weights::from_source(&cfg, |name, shape| {
            let (mean, std) = random_init(name, shape);
            let n = shape.iter().product();
            Ok(Matrix::F32(random_tensor(5, name, n, mean, std)))
        })
        .unwrap();
        CpuBackend::from_parts(cfg, Arc::new(w), "tp".into(), kv, 4, 16)?
            .with_tensor_parallel(world)
    }

    /// Prefill chunks of two sequences and decode steps, all rows of logits.
    fn tp_steps(be: &mut CpuBackend) -> Vec<Vec<Vec<f32>>> {
        let a: Vec<u32> = (0..9).collect();
        let b: Vec<u32> = (20..26).collect();
        let mut rows = Vec::new();
        let steps: [[(&[u32], usize); 2]; 3] = [
            [(&a[..5], 0), (&b[..], 0)],
            [(&a[5..], 5), (&[50], 6)],
            [(&[7], 9), (&[3], 7)],
        ];
        for [(ta, sa), (tb, sb)] in steps {
            let out = be
                .forward(&[
                    seq(ta, sa, &[0, 1, 2], LogitsMode::All),
                    seq(tb, sb, &[4, 5], LogitsMode::All),
                ])
                .unwrap();
            rows.extend(out.logits);
        }
        rows
    }

    #[test]
    fn tensor_parallel_ranks_compute_the_unsplit_model() {
        for (dtype, tol) in [(KvDtype::F32, 2e-5), (KvDtype::Fp8, 2e-5)] {
            for tied in [false, true] {
                let want = tp_steps(&mut micro_tp(dtype, 1, tied).unwrap());
                let mut two = micro_tp(dtype, 2, tied).unwrap();
                assert_eq!(two.tensor_parallel_size(), 2);
                let got = tp_steps(&mut two);
                assert_eq!(got.len(), want.len());
                for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
                    assert_eq!(g.len(), 51);
                    for (u, v) in g.iter().zip(w) {
                        assert!(
                            (u - v).abs() <= tol * (1.0 + v.abs()),
                            "{dtype}: {u} vs {v}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn tensor_parallel_blocks_continue_on_a_whole_model() {
        // The ranks fill one pool in the whole model's layout: blocks a 2-rank backend wrote
        // continue on a 1-rank one (and back), as a disaggregated pair of either size does.
        let mut two = micro_tp(KvDtype::F32, 2, false).unwrap();
        let mut one = micro_tp(KvDtype::F32, 1, false).unwrap();
        let prompt: Vec<u32> = (1..8).collect();
        two.forward(&[seq(&prompt, 0, &[3, 6], LogitsMode::None)])
            .unwrap();
        one.forward(&[seq(&prompt, 0, &[0, 1], LogitsMode::None)])
            .unwrap();
        assert_eq!(two.layout(), one.layout());
        let (from_two, from_one) = (
            two.export_blocks(&[3, 6]).unwrap(),
            one.export_blocks(&[0, 1]).unwrap(),
        );
        for (x, y) in from_two.chunks_exact(4).zip(from_one.chunks_exact(4)) {
            let (x, y) = (
                f32::from_le_bytes([x[0], x[1], x[2], x[3]]),
                f32::from_le_bytes([y[0], y[1], y[2], y[3]]),
            );
            assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{x} vs {y}");
        }
        one.import_blocks(&[8, 9], &from_two).unwrap();
        let a = one
            .forward(&[seq(&[9], 7, &[8, 9], LogitsMode::Last)])
            .unwrap();
        let b = two
            .forward(&[seq(&[9], 7, &[3, 6], LogitsMode::Last)])
            .unwrap();
        for (u, v) in a.logits[0][0].iter().zip(&b.logits[0][0]) {
            assert!((u - v).abs() <= 2e-5 * (1.0 + v.abs()), "{u} vs {v}");
        }
    }

    #[test]
    fn tensor_parallel_errors_name_the_cause() {
        // 3 ranks cannot split 2 KV heads.
        let err = micro_tp(KvDtype::F32, 3, false).err().unwrap().to_string();
        assert!(err.contains("num_key_value_heads (2)"), "{err}");
        // A bad token fails every rank before any collective: the step's error is the
        // token's, and the next step runs.
        let mut two = micro_tp(KvDtype::F32, 2, false).unwrap();
        let err = two
            .forward(&[seq(&[51], 0, &[0], LogitsMode::Last)])
            .unwrap_err();
        assert!(err.to_string().contains("vocabulary"), "{err}");
        let ok = two
            .forward(&[seq(&[1, 2], 0, &[0], LogitsMode::Last)])
            .unwrap();
        assert_eq!(ok.logits[0][0].len(), 51);
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
