//! Inputs, tolerances and the report shared by the kernel checks.

use cudarc::driver::CudaSlice;
use serde_json::{json, Value};
use tandem_engine::backend::cpu_ops::{bf16_to_f32, dot, rope_inv_freq};
use tandem_engine::backend::cuda::ops::HeadNorms;
use tandem_engine::backend::cuda::{CudaDevice, KvPool, KvTarget, Norm, PoolShape};
use tandem_engine::error::EngineError;
use tandem_engine::kv::layout::KvPart;

/// xorshift64*: reproducible inputs without a dependency.
pub(crate) struct Rng(pub(crate) u64);
impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    pub(crate) fn f(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub(crate) fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f()).collect()
    }
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// An RMSNorm of weights `w` at the checks' epsilon.
pub(crate) fn norm(w: &CudaSlice<f32>) -> Norm<'_> {
    Norm { w, eps: EPS }
}

/// Layer `layer` of a pool of the checks' shape, as a KV write's destination.
pub(crate) fn kv_at(pool: &mut KvPool, layer: usize) -> KvTarget<'_> {
    KvTarget {
        pool,
        shape: POOL_SHAPE,
        layer,
    }
}

pub(crate) fn bf16(v: f32) -> u16 {
    half::bf16::from_f32(v).to_bits()
}

pub(crate) fn widen(v: &[u16]) -> Vec<f32> {
    v.iter().map(|b| bf16_to_f32(*b)).collect()
}

/// One bf16 rounding of the largest value (2⁻⁸ relative), plus the f32 tolerance.
pub(crate) fn bf16_tol(want: &[f32]) -> f32 {
    want.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 256.0 + 1e-5
}

pub(crate) struct Report {
    pub(crate) checks: Vec<Value>,
    pub(crate) pass: bool,
}

impl Report {
    pub(crate) fn add(&mut self, kernel: &str, case: &str, got: &[f32], want: &[f32], tol: f32) {
        let mut max = 0.0f32;
        let mut max_ref = 0.0f32;
        let mut nan = got.len() != want.len();
        for (g, w) in got.iter().zip(want) {
            if g.is_nan() != w.is_nan() {
                nan = true;
            }
            max = max.max((g - w).abs());
            max_ref = max_ref.max(w.abs());
        }
        let ok = !nan && max <= tol;
        self.pass &= ok;
        self.checks.push(json!({
            "kernel": kernel, "case": case, "elements": want.len(),
            "max_abs_diff": max, "max_abs_ref": max_ref, "tol": tol, "pass": ok,
        }));
    }

    /// A check that is a condition rather than a comparison of values; `got` is reported.
    pub(crate) fn flag(&mut self, kernel: &str, case: &str, ok: bool, got: Value) {
        self.pass &= ok;
        self.checks
            .push(json!({"kernel": kernel, "case": case, "got": got, "pass": ok}));
    }
}

// Qwen3-0.6B-like shapes.
pub(crate) const HIDDEN: usize = 1024;
pub(crate) const NQ: usize = 16;
pub(crate) const NKV: usize = 8;
pub(crate) const HD: usize = 128;
pub(crate) const IM: usize = 3072;
pub(crate) const VOCAB: usize = 1000;
pub(crate) const EPS: f32 = 1e-6;
pub(crate) const BS: usize = 16;
pub(crate) const LAYERS: usize = 2;
pub(crate) const ROW: usize = (NQ + 2 * NKV) * HD;

/// The step's sequences: (block table, positions this step).
pub(crate) fn sequences() -> Vec<(Vec<u32>, std::ops::Range<usize>)> {
    // A decode token at position 150 (three runs of 64 keys: one block of two stages stages
    // two before the PDL wait and the third, holding the step's own key, after it), a prefill
    // chunk over a cached prefix (40..110: two tiles of the tensor-core prefill at 64 tokens
    // per tile, the second of 6 tokens, keys in two runs) and a fresh prefill (0..33); block
    // ids permuted over a pool of 20.
    vec![
        (vec![3, 9, 0, 14, 6, 11, 1, 16, 19, 17], 150..151),
        (vec![5, 12, 2, 8, 13, 7, 18], 40..110),
        (vec![15, 4, 10], 0..33),
    ]
}

/// What every group of checks works with: the device, the report, the random stream.
pub(crate) struct Ctx {
    pub(crate) dev: CudaDevice,
    pub(crate) rep: Report,
    pub(crate) rng: Rng,
}

/// A sequence's block table and the positions it has in a step.
pub(crate) type SeqRef<'a> = (&'a [u32], std::ops::Range<usize>);

/// The step's sequences as borrowed tables and, per token, (sequence, position).
pub(crate) fn step_tokens(
    seqs: &[(Vec<u32>, std::ops::Range<usize>)],
) -> (Vec<SeqRef<'_>>, Vec<(usize, usize)>) {
    let seq_refs = seqs
        .iter()
        .map(|(t, r)| (t.as_slice(), r.clone()))
        .collect();
    let tokens = seqs
        .iter()
        .enumerate()
        .flat_map(|(s, (_, r))| r.clone().map(move |p| (s, p)))
        .collect();
    (seq_refs, tokens)
}

/// RoPE frequencies of the model shape (f64 for the CPU reference, on the device as f32) and
/// random q / k norm weights, on the host and the device.
pub(crate) struct RopeInputs {
    pub(crate) inv64: Vec<f64>,
    pub(crate) dinv: CudaSlice<f32>,
    pub(crate) qn: Vec<f32>,
    pub(crate) kn: Vec<f32>,
    pub(crate) dqn: CudaSlice<f32>,
    pub(crate) dkn: CudaSlice<f32>,
}

pub(crate) fn rope_inputs(dev: &CudaDevice, rng: &mut Rng) -> Result<RopeInputs, EngineError> {
    let inv64 = rope_inv_freq(HD, 1_000_000.0);
    let inv32: Vec<f32> = inv64.iter().map(|v| *v as f32).collect();
    let (qn, kn) = (rng.vec(HD), rng.vec(HD));
    Ok(RopeInputs {
        dinv: dev.upload(&inv32)?,
        dqn: dev.upload(&qn)?,
        dkn: dev.upload(&kn)?,
        inv64,
        qn,
        kn,
    })
}

impl RopeInputs {
    /// The model shape's heads with these frequencies and norm weights.
    pub(crate) fn heads(&self) -> HeadNorms<'_> {
        self.heads_with_norms(true)
    }

    /// [`Self::heads`], with the q/k norm weights or without (RoPE only).
    pub(crate) fn heads_with_norms(&self, norms: bool) -> HeadNorms<'_> {
        HeadNorms {
            nq: NQ,
            nkv: NKV,
            head_dim: HD,
            inv_freq: &self.dinv,
            q_norm: norms.then_some(&self.dqn),
            k_norm: norms.then_some(&self.dkn),
            eps: EPS,
        }
    }
}

/// The checks' paged pool: 20 blocks (the step's tables use ids below 20) of the model shape.
pub(crate) const POOL_SHAPE: PoolShape = PoolShape {
    num_blocks: 20,
    num_layers: LAYERS,
    block_size: BS,
    num_kv_heads: NKV,
    head_dim: HD,
    scales: false,
};

/// A pool's elements as f32 (bf16, IEEE half or f32 on the device).
pub(crate) fn download_pool(dev: &CudaDevice, pool: &KvPool) -> Result<Vec<f32>, EngineError> {
    Ok(match pool {
        KvPool::F32(p) => dev.download(p)?,
        KvPool::Half(p) => dev
            .download(p)?
            .into_iter()
            .map(|b| half::f16::from_bits(b).to_f32())
            .collect(),
        KvPool::Bf16(p) => dev.download(p)?.into_iter().map(bf16_to_f32).collect(),
        KvPool::Fp8(_) => {
            return Err(EngineError::InvalidInput(
                "download_pool: an fp8 pool holds codes and scales (fp8.rs reads its bytes)".into(),
            ))
        }
    })
}

/// hi + lo of a split bf16 buffer (the first half the hi rows, the second the lo rows).
pub(crate) fn fold_split(v: &[u16]) -> Vec<f32> {
    let (hi, lo) = v.split_at(v.len() / 2);
    hi.iter()
        .zip(lo)
        .map(|(h, l)| bf16_to_f32(*h) + bf16_to_f32(*l))
        .collect()
}

/// The decoder's attention of every token of the step over positions within `window` of its
/// own, with `head(block, slot, part, kv_head)` giving a head's K or V values as the pool
/// holds them: `[tokens, NQ * HD]`.
pub(crate) fn reference_attention<'h>(
    seqs: &[(Vec<u32>, std::ops::Range<usize>)],
    tokens: &[(usize, usize)],
    qkv: &[f32],
    window: usize,
    head: impl Fn(usize, usize, KvPart, usize) -> &'h [f32],
) -> Vec<f32> {
    let scale = 1.0 / (HD as f32).sqrt();
    let mut want = vec![0.0f32; tokens.len() * NQ * HD];
    for (ti, (s, pos)) in tokens.iter().enumerate() {
        let table = &seqs[*s].0;
        let lo = (pos + 1).saturating_sub(window);
        for h in 0..NQ {
            let kvh = h / (NQ / NKV);
            let q = &qkv[ti * ROW + h * HD..ti * ROW + (h + 1) * HD];
            let at = |p: usize, part| head(table[p / BS] as usize, p % BS, part, kvh);
            let scores: Vec<f32> = (lo..=*pos)
                .map(|p| dot(q, at(p, KvPart::K)) * scale)
                .collect();
            let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f32 = e.iter().sum();
            let out = &mut want[(ti * NQ + h) * HD..(ti * NQ + h + 1) * HD];
            for (p, ev) in (lo..=*pos).zip(&e) {
                let a = ev / sum;
                for (o, v) in out.iter_mut().zip(at(p, KvPart::V)) {
                    *o += a * v;
                }
            }
        }
    }
    want
}
