//! Launch wrappers of the q/k norms + RoPE (`qk_norm_rope.cu`, with the KV write in the same
//! launch) and of the plain KV write (`kv_write.cu`), over the heads [`HeadNorms`] describes.

use cudarc::driver::{CudaSlice, LaunchArgs, LaunchConfig, PushKernelArg};

use super::ops::HeadNorms;
use super::{
    bad, check_len, cuda_err, threads_for, to_i32, CudaDevice, KvPool, PoolShape, TokenMaps,
};
use crate::error::EngineError;

/// Where a launch stores the step's K and V: `layer` of `pool`, laid out as `shape`.
pub struct KvTarget<'a> {
    pub pool: &'a mut KvPool,
    pub shape: PoolShape,
    pub layer: usize,
}

impl KvTarget<'_> {
    /// The kernels' block size, layer and layer count.
    fn ints(&self) -> Result<[i32; 3], EngineError> {
        Ok([
            to_i32("block size", self.shape.block_size)?,
            to_i32("layer", self.layer)?,
            to_i32("layers", self.shape.num_layers)?,
        ])
    }

    /// Pushes the pool (whichever element it holds).
    fn push_pool<'b>(&'b self, b: &mut LaunchArgs<'b>) {
        match &*self.pool {
            KvPool::F32(p) => b.arg(p),
            KvPool::Bf16(p) | KvPool::Half(p) => b.arg(p),
            KvPool::Fp8(p) => b.arg(p),
        };
    }
}

impl CudaDevice {
    /// Per-head RMSNorm (when `heads.q_norm`/`k_norm` are given, each `head_dim` long) and
    /// RoPE in place on the first `nq + nkv` heads of each of the `maps.tokens` rows of `qkv`
    /// (rows `row_stride` apart).
    pub fn qk_norm_rope(
        &self,
        qkv: &mut CudaSlice<f32>,
        row_stride: usize,
        heads: &HeadNorms<'_>,
        maps: &TokenMaps,
    ) -> Result<(), EngineError> {
        self.qk_norm_rope_into(qkv, row_stride, heads, maps, None)
    }

    /// [`Self::qk_norm_rope`], then the rotated K and the V heads (after the k heads in each
    /// row) stored into `kv`: the KV write of [`Self::kv_write`] in the same launch.
    pub fn qk_norm_rope_kv(
        &self,
        qkv: &mut CudaSlice<f32>,
        row_stride: usize,
        heads: &HeadNorms<'_>,
        maps: &TokenMaps,
        kv: KvTarget<'_>,
    ) -> Result<(), EngineError> {
        self.qk_norm_rope_kv_split_input(qkv, false, row_stride, heads, maps, kv)
    }

    /// [`Self::qk_norm_rope_kv`] over a split GEMM's unfolded output when `unfolded` (hi rows,
    /// then as many lo rows): each value is read as hi + lo, the q and k heads written back
    /// folded (the v heads' hi rows stay as they are; the pool holds them folded).
    pub fn qk_norm_rope_kv_split_input(
        &self,
        qkv: &mut CudaSlice<f32>,
        unfolded: bool,
        row_stride: usize,
        heads: &HeadNorms<'_>,
        maps: &TokenMaps,
        kv: KvTarget<'_>,
    ) -> Result<(), EngineError> {
        let kernel = "qk_norm_rope_kv";
        heads.check_pool(kernel, row_stride, kv.pool, kv.shape, kv.layer)?;
        let in_lo = if unfolded {
            check_len(
                "qk_norm_rope_kv qkv",
                qkv.len(),
                2 * maps.tokens * row_stride,
            )?;
            maps.tokens * row_stride
        } else {
            0
        };
        self.qk_norm_rope_into(qkv, row_stride, heads, maps, Some((kv, in_lo)))
    }

    /// Whether [`Self::qk_norm_rope_kv_in16`] takes a step of `tokens` tokens into `pool`: the
    /// warp-per-head form over a pool of the 16-bit element.
    pub fn rope_reads_16(&self, tokens: usize, pool: &KvPool) -> bool {
        RopeForm::of(tokens, false) == RopeForm::WarpPerHead && matches!(pool, KvPool::Bf16(_))
    }

    /// [`Self::qk_norm_rope_kv`] reading the rows from `src`, the qkv GEMM's output rounded to
    /// the 16-bit element ([`Self::matmul_t_16`]): the rotated q heads are written to the f32
    /// rows of `qkv` (the attention's input; the k and v heads go to the pool only). Steps
    /// [`Self::rope_reads_16`] takes; anything else is an error.
    pub fn qk_norm_rope_kv_in16(
        &self,
        src: &CudaSlice<u16>,
        qkv: &mut CudaSlice<f32>,
        row_stride: usize,
        heads: &HeadNorms<'_>,
        maps: &TokenMaps,
        kv: KvTarget<'_>,
    ) -> Result<(), EngineError> {
        check_rope_rows(qkv.len(), row_stride, heads, maps.tokens)?;
        self.rope_16(src, Some(qkv), row_stride, heads, maps, kv)
    }

    /// [`Self::qk_norm_rope_kv_in16`] with the rotated q heads rounded back into the 16-bit
    /// rows of `qkv16` themselves (`qk_norm_rope_kv_tokens_q16_bf16`), for the warpgroup
    /// prefill attention to read as they are ([`AttentionInputs::q16`]); head_dim 128 and a
    /// row stride that is a multiple of 4 only.
    ///
    /// [`AttentionInputs::q16`]: super::AttentionInputs::q16
    pub fn qk_norm_rope_kv_q16(
        &self,
        qkv16: &mut CudaSlice<u16>,
        row_stride: usize,
        heads: &HeadNorms<'_>,
        maps: &TokenMaps,
        kv: KvTarget<'_>,
    ) -> Result<(), EngineError> {
        if heads.head_dim != 128 || !row_stride.is_multiple_of(4) {
            return Err(bad(format!(
                "qk_norm_rope: 16-bit q heads out need head_dim 128 (not {}) and a row stride \
                 that is a multiple of 4 (not {row_stride})",
                heads.head_dim
            )));
        }
        self.rope_16(qkv16, None, row_stride, heads, maps, kv)
    }

    /// The launch of both 16-bit-row forms: q heads to the f32 rows of `out`, or (none) back
    /// into `src`.
    fn rope_16(
        &self,
        src: &CudaSlice<u16>,
        out: Option<&mut CudaSlice<f32>>,
        row_stride: usize,
        heads: &HeadNorms<'_>,
        maps: &TokenMaps,
        kv: KvTarget<'_>,
    ) -> Result<(), EngineError> {
        let t = maps.tokens;
        if !self.rope_reads_16(t, kv.pool) {
            return Err(bad(format!(
                "qk_norm_rope: 16-bit rows need {WARP_PER_HEAD_TOKENS}+ tokens (not {t}) and \
                 a pool of the 16-bit element"
            )));
        }
        heads.check_pool("qk_norm_rope_kv", row_stride, kv.pool, kv.shape, kv.layer)?;
        check_rope_rows(src.len(), row_stride, heads, t)?;
        let heads_per_row = heads.nq + 2 * heads.nkv;
        let ints = rope_ints(row_stride, heads, heads_per_row)?;
        let tail = kv.ints()?;
        let cfg = RopeForm::WarpPerHead.launch(t, heads_per_row, heads.head_dim);
        let name = if out.is_some() {
            "qk_norm_rope_kv_tokens_in16_bf16"
        } else {
            "qk_norm_rope_kv_tokens_q16_bf16"
        };
        let f = self.func(name)?;
        let null = 0u64;
        let mut b = self.stream.launch_builder(f);
        b.arg(src);
        match out.as_deref() {
            Some(q) => b.arg(q),
            None => b.arg(src),
        };
        for i in &ints {
            b.arg(i);
        }
        b.arg(&maps.positions).arg(heads.inv_freq);
        for n in [heads.q_norm, heads.k_norm] {
            match n {
                Some(n) => b.arg(n),
                None => b.arg(&null),
            };
        }
        b.arg(&heads.eps);
        kv.push_pool(&mut b);
        b.arg(&maps.token_block)
            .arg(&tail[0])
            .arg(&tail[1])
            .arg(&tail[2]);
        // SAFETY: signature matches; src (and out) hold t rows of the stride (checked); the
        // pool holds the whole shape and the block ids come from tables the caller validated
        // against `shape.num_blocks`. In place, each warp reads a head before writing it back.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching qk_norm_rope (16-bit rows)"))?;
        Ok(())
    }

    /// One `qk_norm_rope.cu` launch: the plain kernel, or with `kv` (and the offset of the lo
    /// rows, 0 for folded input) the one that also writes K and V.
    fn qk_norm_rope_into(
        &self,
        qkv: &mut CudaSlice<f32>,
        row_stride: usize,
        heads: &HeadNorms<'_>,
        maps: &TokenMaps,
        kv: Option<(KvTarget<'_>, usize)>,
    ) -> Result<(), EngineError> {
        let t = maps.tokens;
        if t == 0 {
            return Ok(());
        }
        check_rope_rows(qkv.len(), row_stride, heads, t)?;
        let (nq, nkv, head_dim) = (heads.nq, heads.nkv, heads.head_dim);
        let heads_per_row = if kv.is_some() { nq + 2 * nkv } else { nq + nkv };
        let ints = rope_ints(row_stride, heads, heads_per_row)?;
        let fp8 = matches!(&kv, Some((k, _)) if matches!(&*k.pool, KvPool::Fp8(_)));
        let form = RopeForm::of(t, fp8);
        let cfg = form.launch(t, heads_per_row, head_dim);
        let name = match (&kv, form) {
            (None, RopeForm::BlockPerHead) => "qk_norm_rope_f32",
            (None, RopeForm::WarpPerHead) => "qk_norm_rope_tokens_f32",
            (Some((k, _)), RopeForm::BlockPerHead) => match &*k.pool {
                KvPool::F32(_) => "qk_norm_rope_kv_f32",
                KvPool::Bf16(_) => "qk_norm_rope_kv_bf16",
                KvPool::Half(_) => "qk_norm_rope_kv_h16",
                KvPool::Fp8(_) => "qk_norm_rope_kv_fp8",
            },
            (Some((k, _)), RopeForm::WarpPerHead) => match &*k.pool {
                KvPool::F32(_) => "qk_norm_rope_kv_tokens_f32",
                KvPool::Bf16(_) => "qk_norm_rope_kv_tokens_bf16",
                KvPool::Half(_) => "qk_norm_rope_kv_tokens_h16",
                KvPool::Fp8(_) => {
                    return Err(bad(
                        "qk_norm_rope: FP8 pools take the block-per-head form".into()
                    ))
                }
            },
        };
        let f = self.func(name)?;
        let null = 0u64;
        let mut b = self.stream.launch_builder(f);
        b.arg(qkv).arg(&ints[0]).arg(&ints[1]);
        if kv.is_some() {
            b.arg(&ints[2]);
        }
        if form == RopeForm::WarpPerHead {
            b.arg(&ints[3]);
        }
        b.arg(&ints[4]).arg(&maps.positions).arg(heads.inv_freq);
        for n in [heads.q_norm, heads.k_norm] {
            match n {
                Some(n) => b.arg(n),
                None => b.arg(&null),
            };
        }
        b.arg(&heads.eps);
        let (tail, in_lo);
        if let Some((kv, lo)) = &kv {
            tail = kv.ints()?;
            in_lo = *lo as i64;
            kv.push_pool(&mut b);
            b.arg(&maps.token_block)
                .arg(&tail[0])
                .arg(&tail[1])
                .arg(&tail[2])
                .arg(&in_lo);
        }
        // SAFETY: signature matches (the pool arguments only for the _kv kernels); shapes
        // checked above; with a pool, it holds the whole shape and the block ids come from
        // tables the caller validated against `shape.num_blocks`.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching qk_norm_rope"))?;
        Ok(())
    }

    /// Stores the K and V of every token of `maps` (in `qkv` at column `k_off`, K then V,
    /// `num_kv_heads * head_dim` each) into `kv`, at the layout's address.
    pub fn kv_write(
        &self,
        kv: KvTarget<'_>,
        qkv: &CudaSlice<f32>,
        row_stride: usize,
        k_off: usize,
        maps: &TokenMaps,
    ) -> Result<(), EngineError> {
        let t = maps.tokens;
        if t == 0 {
            return Ok(());
        }
        let (shape, layer) = (kv.shape, kv.layer);
        let kvd = shape.num_kv_heads * shape.head_dim;
        if k_off + 2 * kvd > row_stride || layer >= shape.num_layers {
            return Err(bad(format!(
                "kv_write: k offset {k_off} + 2×{kvd} over row stride {row_stride}, or layer {layer} ≥ {}",
                shape.num_layers
            )));
        }
        check_len("kv_write pool", kv.pool.len(), shape.elems())?;
        check_len("kv_write qkv", qkv.len(), t * row_stride)?;
        // FP8: one warp per (token, KV head), for the head's largest magnitude.
        let cfg = match &*kv.pool {
            KvPool::Fp8(_) => LaunchConfig {
                grid_dim: (t as u32, shape.num_kv_heads as u32, 1),
                block_dim: (32, 1, 1),
                shared_mem_bytes: 0,
            },
            _ => LaunchConfig {
                grid_dim: (t as u32, 1, 1),
                block_dim: (threads_for(kvd).min(256), 1, 1),
                shared_mem_bytes: 0,
            },
        };
        let args = [
            to_i32("row stride", row_stride)?,
            to_i32("k offset", k_off)?,
            to_i32("kv width", kvd)?,
        ];
        let tail = kv.ints()?;
        let name = match &*kv.pool {
            KvPool::F32(_) => "kv_write_f32",
            KvPool::Bf16(_) => "kv_write_bf16",
            KvPool::Half(_) => "kv_write_h16",
            KvPool::Fp8(_) => "kv_write_fp8",
        };
        let f = self.func(name)?;
        let mut b = self.stream.launch_builder(f);
        kv.push_pool(&mut b);
        b.arg(qkv)
            .arg(&args[0])
            .arg(&args[1])
            .arg(&args[2])
            .arg(&maps.token_block)
            .arg(&maps.positions)
            .arg(&tail[0])
            .arg(&tail[1])
            .arg(&tail[2]);
        // SAFETY: signature matches; the pool holds the whole shape (checked) and the block
        // ids come from tables the caller validated against `shape.num_blocks`.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching kv_write"))?;
        Ok(())
    }
}

/// The two forms of `qk_norm_rope.cu`. A block per head for decode-sized steps: a warp per
/// head measured 4–8% slower at decode batch 64 in CUDA graphs with programmatic launch (its
/// loads wait behind the keys the attention launched early stages; without PDL it was equal),
/// and for FP8 pools, whose per-head scale the block form reduces. A warp per head, the
/// token's 8 warps walking its heads with one rotation, for steps of
/// [`WARP_PER_HEAD_TOKENS`] tokens and more: a 2,048-token prefill's 28 launches 2.33 → 1.41
/// ms on an H200.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum RopeForm {
    BlockPerHead,
    WarpPerHead,
}

/// Steps of this many tokens and more take the warp-per-head form.
const WARP_PER_HEAD_TOKENS: usize = 256;
/// Warps per block of the warp-per-head form; the largest head it serves (32 lanes × its
/// QR_PAIRS pairs).
const QR_WARPS: u32 = 8;
pub(super) const MAX_HEAD_DIM: usize = 256;

impl RopeForm {
    fn of(tokens: usize, fp8_pool: bool) -> Self {
        if tokens >= WARP_PER_HEAD_TOKENS && !fp8_pool {
            RopeForm::WarpPerHead
        } else {
            RopeForm::BlockPerHead
        }
    }

    /// The launch over `tokens` rows of `heads` heads each.
    fn launch(self, tokens: usize, heads: usize, head_dim: usize) -> LaunchConfig {
        let (grid_y, threads) = match self {
            RopeForm::BlockPerHead => (heads as u32, threads_for(head_dim / 2)),
            RopeForm::WarpPerHead => (1, QR_WARPS * 32),
        };
        LaunchConfig {
            grid_dim: (tokens as u32, grid_y, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// The kernels' row stride, nq, nkv, heads per row and head_dim.
fn rope_ints(
    row_stride: usize,
    heads: &HeadNorms<'_>,
    heads_per_row: usize,
) -> Result<[i32; 5], EngineError> {
    Ok([
        to_i32("row stride", row_stride)?,
        to_i32("nq", heads.nq)?,
        to_i32("nkv", heads.nkv)?,
        to_i32("heads", heads_per_row)?,
        to_i32("head_dim", heads.head_dim)?,
    ])
}

/// The heads fit `t` rows of `qkv` (`qkv_len` elements, rows `row_stride` apart, even
/// head_dim), and the frequencies and norm weights are long enough.
fn check_rope_rows(
    qkv_len: usize,
    row_stride: usize,
    heads: &HeadNorms<'_>,
    t: usize,
) -> Result<(), EngineError> {
    let (nq, nkv, head_dim) = (heads.nq, heads.nkv, heads.head_dim);
    if !head_dim.is_multiple_of(2) || head_dim > MAX_HEAD_DIM || (nq + nkv) * head_dim > row_stride
    {
        return Err(bad(format!(
            "qk_norm_rope: head_dim {head_dim} (even, at most {MAX_HEAD_DIM}), {nq}+{nkv} \
             heads, row stride {row_stride}"
        )));
    }
    check_len("qk_norm_rope qkv", qkv_len, t * row_stride)?;
    heads.check_lengths("qk_norm_rope")
}

#[cfg(test)]
mod tests {
    use super::{RopeForm, WARP_PER_HEAD_TOKENS};

    #[test]
    fn long_steps_take_a_warp_per_head_except_over_fp8_pools() {
        assert_eq!(RopeForm::of(1, false), RopeForm::BlockPerHead);
        assert_eq!(
            RopeForm::of(WARP_PER_HEAD_TOKENS - 1, false),
            RopeForm::BlockPerHead
        );
        assert_eq!(
            RopeForm::of(WARP_PER_HEAD_TOKENS, false),
            RopeForm::WarpPerHead
        );
        assert_eq!(RopeForm::of(8192, true), RopeForm::BlockPerHead);
        let c = RopeForm::WarpPerHead.launch(300, 32, 128);
        assert_eq!((c.grid_dim, c.block_dim), ((300, 1, 1), (256, 1, 1)));
        let c = RopeForm::BlockPerHead.launch(64, 32, 128);
        assert_eq!((c.grid_dim, c.block_dim), ((64, 32, 1), (64, 1, 1)));
    }
}
