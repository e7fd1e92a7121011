//! Launch wrappers of the elementwise, normalisation, embedding and gather kernels (the q/k
//! norms, RoPE and KV writes: `rope_kv.rs`).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{
    bad, check_len, cuda_err, threads_for, to_i32, CudaDevice, DeviceElem, DeviceList,
    DeviceMatrix, KvPool, PoolShape,
};
use crate::error::EngineError;

/// The per-head work of [`CudaDevice::qk_norm_rope_kv`]: head counts and size, RoPE
/// frequencies (`head_dim / 2`, f32) and the optional q / k RMSNorm weights.
#[derive(Clone, Copy)]
pub struct HeadNorms<'a> {
    pub nq: usize,
    pub nkv: usize,
    pub head_dim: usize,
    pub inv_freq: &'a CudaSlice<f32>,
    pub q_norm: Option<&'a CudaSlice<f32>>,
    pub k_norm: Option<&'a CudaSlice<f32>>,
    pub eps: f32,
}

impl HeadNorms<'_> {
    /// The frequencies hold `head_dim / 2` values and each norm weight `head_dim`; `kernel`
    /// names the launch in the error.
    pub(super) fn check_lengths(&self, kernel: &str) -> Result<(), EngineError> {
        let hd = self.head_dim;
        let short = |what: &str, len: usize, want: usize| {
            bad(format!("{kernel} {what}: {len} elements, need {want}"))
        };
        if self.inv_freq.len() < hd / 2 {
            return Err(short("inv_freq", self.inv_freq.len(), hd / 2));
        }
        for n in [self.q_norm, self.k_norm].into_iter().flatten() {
            if n.len() < hd {
                return Err(short("norm weight", n.len(), hd));
            }
        }
        Ok(())
    }

    /// These heads fit rows of `row_stride` and write into `pool` of `shape` at `layer`
    /// (its KV heads and head size theirs, the layer in it, the pool the shape's size);
    /// `kernel` names the launch in the error.
    pub(super) fn check_pool(
        &self,
        kernel: &str,
        row_stride: usize,
        pool: &KvPool,
        shape: PoolShape,
        layer: usize,
    ) -> Result<(), EngineError> {
        if shape.num_kv_heads != self.nkv
            || shape.head_dim != self.head_dim
            || layer >= shape.num_layers
            || (self.nq + 2 * self.nkv) * self.head_dim > row_stride
        {
            return Err(bad(format!(
                "{kernel}: {}+2×{} heads of {} over row stride {row_stride} into a pool of {} KV \
                 heads of {}, layer {layer} of {}",
                self.nq,
                self.nkv,
                self.head_dim,
                shape.num_kv_heads,
                shape.head_dim,
                shape.num_layers
            )));
        }
        check_len(&format!("{kernel} pool"), pool.len(), shape.elems())
    }
}

/// An RMSNorm's weights (one per element of a row; the row length is theirs) and epsilon.
#[derive(Clone, Copy)]
pub struct Norm<'a> {
    pub w: &'a CudaSlice<f32>,
    pub eps: f32,
}

impl CudaDevice {
    /// `out[t, :] = table[ids[t], :]` as f32 (`hidden` columns). Ids must be below the
    /// table's row count; `vocab` is checked here on the host copy of the ids.
    pub fn embedding(
        &self,
        out: &mut CudaSlice<f32>,
        table: &DeviceMatrix,
        ids_host: &[u32],
        hidden: usize,
    ) -> Result<(), EngineError> {
        let vocab = table.len() / hidden.max(1);
        if let Some(id) = ids_host.iter().find(|&&id| id as usize >= vocab) {
            return Err(bad(format!(
                "token id {id} is outside the vocabulary ({vocab})"
            )));
        }
        let t = ids_host.len();
        if t == 0 {
            return Ok(());
        }
        let ids = self.upload(ids_host)?;
        self.embedding_dev(out, table, self.list_of(&ids), hidden)
    }

    /// [`CudaDevice::embedding`] with the ids already on the device (one per token): the
    /// caller has checked them against the vocabulary (no copy: graph-capturable).
    pub fn embedding_dev(
        &self,
        out: &mut CudaSlice<f32>,
        table: &DeviceMatrix,
        ids: DeviceList,
        hidden: usize,
    ) -> Result<(), EngineError> {
        let t = ids.len;
        if t == 0 {
            return Ok(());
        }
        check_len("embedding out", out.len(), t * hidden)?;
        let h = to_i32("hidden", hidden)?;
        let cfg = LaunchConfig {
            grid_dim: (t as u32, 1, 1),
            block_dim: (threads_for(hidden).min(256), 1, 1),
            shared_mem_bytes: 0,
        };
        let name = match table {
            DeviceMatrix::F32(_) => "embedding_f32",
            DeviceMatrix::Bf16(_) => "embedding_bf16",
        };
        let f = self.func(name)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out);
        match table {
            DeviceMatrix::F32(s) => b.arg(s),
            DeviceMatrix::Bf16(s) => b.arg(s),
        };
        b.arg(&ids.addr).arg(&h);
        // SAFETY: the argument list matches the kernel's signature; every index is in bounds
        // (ids < vocab checked by the caller, out holds t*hidden).
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching embedding"))?;
        Ok(())
    }

    /// RMSNorm of `rows` rows of `norm.w.len()`: with `residual`, first `x += residual`
    /// (written back), then `out = w * x / sqrt(mean(x²) + eps)`; `out` is f32 or bf16 (a bf16
    /// GEMM's input), with `split` its hi and lo halves.
    pub fn rms_norm<O: DeviceElem>(
        &self,
        out: &mut CudaSlice<O>,
        x: &mut CudaSlice<f32>,
        residual: Option<&CudaSlice<f32>>,
        norm: Norm<'_>,
        rows: usize,
        split: bool,
    ) -> Result<(), EngineError> {
        let residual = residual.map(|r| (r, false));
        self.rms_norm_split_residual(out, x, residual, norm, rows, split)
    }

    /// [`Self::rms_norm`] whose residual may be a split GEMM's unfolded output (`(buffer,
    /// true)`: hi rows, then as many lo rows), folded as it is read: one launch fewer than
    /// `fold_rows` first.
    pub fn rms_norm_split_residual<O: DeviceElem>(
        &self,
        out: &mut CudaSlice<O>,
        x: &mut CudaSlice<f32>,
        residual: Option<(&CudaSlice<f32>, bool)>,
        norm: Norm<'_>,
        rows: usize,
        split: bool,
    ) -> Result<(), EngineError> {
        let Norm { w, eps } = norm;
        let dim = w.len();
        if rows == 0 {
            return Ok(());
        }
        let lo_off = lo_offset::<O>("rms_norm out", out.len(), rows * dim, split)?;
        check_len("rms_norm x", x.len(), rows * dim)?;
        let mut res_lo = 0i64;
        if let Some((r, unfolded)) = residual {
            let halves = if unfolded { 2 } else { 1 };
            check_len("rms_norm residual", r.len(), halves * rows * dim)?;
            if unfolded {
                res_lo = (rows * dim) as i64;
            }
        }
        let residual = residual.map(|(r, _)| r);
        let (r, d) = (to_i32("rows", rows)?, to_i32("dim", dim)?);
        let null = 0u64;
        let warp_form = rms_norm_warp_form(rows, dim, lo_off, res_lo);
        let (name, cfg) = if warp_form {
            let blocks = rows.div_ceil(RMS_WARP_ROWS_PER_BLOCK) as u32;
            let threads = (32 * RMS_WARP_ROWS_PER_BLOCK) as u32;
            (
                "rms_norm_rows",
                LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (threads, 1, 1),
                    shared_mem_bytes: 0,
                },
            )
        } else {
            (
                "rms_norm",
                LaunchConfig {
                    grid_dim: (rows as u32, 1, 1),
                    block_dim: (threads_for(dim).min(256), 1, 1),
                    shared_mem_bytes: 0,
                },
            )
        };
        let f = self.func(&format!("{name}_{}", O::SUFFIX))?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out).arg(x);
        match residual {
            Some(r) => b.arg(r),
            None => b.arg(&null),
        };
        b.arg(w);
        if warp_form {
            b.arg(&r);
        }
        b.arg(&d).arg(&eps).arg(&lo_off).arg(&res_lo);
        // SAFETY: signature matches (the warp form's takes the row count after w); every buffer
        // holds rows*dim (checked; out twice that when split, the residual twice that when
        // unfolded), w holds dim.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching rms_norm"))?;
        Ok(())
    }

    /// `out[r, c] = silu(gu[r, 2c]) * gu[r, 2c + 1]` for `rows` rows (gate and up interleaved,
    /// as the backend's gate_up weights are); `out` f32 or bf16.
    pub fn silu_mul<O: DeviceElem>(
        &self,
        out: &mut CudaSlice<O>,
        gu: &CudaSlice<f32>,
        rows: usize,
        im: usize,
        split: bool,
    ) -> Result<(), EngineError> {
        self.silu_mul_split_input(out, gu, false, rows, im, split)
    }

    /// [`Self::silu_mul`] over a split GEMM's unfolded output when `unfolded` (hi rows, then
    /// as many lo rows), folded as it is read; `gu` in f32 or (a GEMM's output rounded by
    /// [`Self::matmul_t_16`]) in the 16-bit element.
    pub fn silu_mul_split_input<O: DeviceElem, I: DeviceElem>(
        &self,
        out: &mut CudaSlice<O>,
        gu: &CudaSlice<I>,
        unfolded: bool,
        rows: usize,
        im: usize,
        split: bool,
    ) -> Result<(), EngineError> {
        if rows * im == 0 {
            return Ok(());
        }
        let lo_off = lo_offset::<O>("silu_mul out", out.len(), rows * im, split)?;
        let halves = if unfolded { 2 } else { 1 };
        check_len("silu_mul gu", gu.len(), halves * rows * 2 * im)?;
        let in_lo = if unfolded { (rows * 2 * im) as i64 } else { 0 };
        let (r, i) = (to_i32("rows", rows)?, to_i32("im", im)?);
        // silu_mul.cu: x over a row's columns (four or two per thread where im allows), y
        // over rows.
        let per_thread = silu_mul_columns(im);
        let cfg = LaunchConfig {
            grid_dim: (
                (im / per_thread).div_ceil(256) as u32,
                rows.min(65_535) as u32,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let input = if I::SUFFIX == "f32" { "" } else { "in16_" };
        let f = self.func(&format!("silu_mul_{input}{}", O::SUFFIX))?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out).arg(gu).arg(&r).arg(&i).arg(&lo_off).arg(&in_lo);
        // SAFETY: signature matches; shapes checked above (gu twice its rows when unfolded).
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching silu_mul"))?;
        Ok(())
    }

    /// `out[r, :] = src[rows[r], :]` for `width`-long f32 rows, into f32 or bf16: the rows a
    /// step wants logits for, as the lm_head GEMM's input. `src_rows` bounds the row ids.
    pub fn gather_rows<O: DeviceElem>(
        &self,
        out: &mut CudaSlice<O>,
        src: &CudaSlice<f32>,
        src_rows: usize,
        rows_host: &[u32],
        width: usize,
        split: bool,
    ) -> Result<(), EngineError> {
        if let Some(r) = rows_host.iter().find(|&&r| r as usize >= src_rows) {
            return Err(bad(format!("gather: row {r} of {src_rows}")));
        }
        let r = rows_host.len();
        if r == 0 {
            return Ok(());
        }
        let rows = self.upload(rows_host)?;
        self.gather_rows_dev(out, src, src_rows, self.list_of(&rows), width, split)
    }

    /// [`CudaDevice::gather_rows`] with the row ids already on the device, checked by the
    /// caller against `src_rows` (no copy: graph-capturable).
    pub fn gather_rows_dev<O: DeviceElem>(
        &self,
        out: &mut CudaSlice<O>,
        src: &CudaSlice<f32>,
        src_rows: usize,
        rows: DeviceList,
        width: usize,
        split: bool,
    ) -> Result<(), EngineError> {
        let r = rows.len;
        if r == 0 {
            return Ok(());
        }
        let lo_off = lo_offset::<O>("gather out", out.len(), r * width, split)?;
        check_len("gather src", src.len(), src_rows * width)?;
        let w = to_i32("width", width)?;
        let cfg = LaunchConfig {
            grid_dim: (r as u32, 1, 1),
            block_dim: (threads_for(width).min(256), 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.func(&format!("gather_rows_{}", O::SUFFIX))?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out).arg(src).arg(&rows.addr).arg(&w).arg(&lo_off);
        // SAFETY: signature matches; rows < src_rows (checked), out holds r*width.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching gather_rows"))?;
        Ok(())
    }

    /// `x[i] += x[half + i]` for `i < half`: the fold of a split-bf16 GEMM's output.
    pub fn fold_rows(&self, x: &mut CudaSlice<f32>, half: usize) -> Result<(), EngineError> {
        if half == 0 {
            return Ok(());
        }
        check_len("fold_rows x", x.len(), 2 * half)?;
        let h = half as i64;
        let cfg = LaunchConfig {
            grid_dim: (half.div_ceil(256).min(65_535 * 8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.func("fold_rows_f32")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(x).arg(&h);
        // SAFETY: signature matches; x holds 2*half (checked).
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching fold_rows"))?;
        Ok(())
    }

    /// `x[r, c] += b[c]` over `rows` rows of `b.len()` columns.
    pub fn bias_add(
        &self,
        x: &mut CudaSlice<f32>,
        b: &CudaSlice<f32>,
        rows: usize,
    ) -> Result<(), EngineError> {
        let cols = b.len();
        if rows * cols == 0 {
            return Ok(());
        }
        check_len("bias_add x", x.len(), rows * cols)?;
        let (r, c) = (to_i32("rows", rows)?, to_i32("cols", cols)?);
        let cfg = LaunchConfig {
            grid_dim: ((rows * cols).div_ceil(256).min(65_535 * 8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.func("bias_add_f32")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(x).arg(b).arg(&r).arg(&c);
        // SAFETY: signature matches; x holds rows*cols (checked).
        unsafe { lb.launch(cfg) }.map_err(cuda_err("launching bias_add"))?;
        Ok(())
    }

    /// Greedy sampling on the device: `out[r]` = the index of the largest of logits row `r`
    /// (`rows` rows of `vocab`), ties to the lowest index like the CPU sampler; each row is
    /// scanned by several blocks whose results meet through `scratch` (sized for the rows).
    pub fn argmax(
        &self,
        out: &mut CudaSlice<i32>,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        scratch: &mut ArgmaxScratch,
    ) -> Result<(), EngineError> {
        if rows == 0 {
            return Ok(());
        }
        check_len("argmax out", out.len(), rows)?;
        check_len("argmax logits", logits.len(), rows * vocab)?;
        check_len("argmax scratch", scratch.counters.len(), rows)?;
        let v = to_i32("vocab", vocab)?;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, ARGMAX_SPLITS, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.func("argmax_f32")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out)
            .arg(logits)
            .arg(&v)
            .arg(&mut scratch.part_v)
            .arg(&mut scratch.part_i)
            .arg(&mut scratch.counters);
        // SAFETY: signature matches; shapes checked above (the scratch holds ARGMAX_SPLITS
        // partials and a zeroed counter per row, which the merging block resets).
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching argmax"))?;
        Ok(())
    }
}

/// Blocks per row of `argmax_f32` (its ARGMAX_SPLITS).
const ARGMAX_SPLITS: u32 = 32;

/// The per-row partial results and counters of the split argmax.
pub struct ArgmaxScratch {
    part_v: CudaSlice<f32>,
    part_i: CudaSlice<i32>,
    counters: CudaSlice<u32>,
}

impl ArgmaxScratch {
    /// Room for `rows` rows (zeroed counters).
    pub fn new(dev: &CudaDevice, rows: usize) -> Result<Self, EngineError> {
        let r = rows.max(1);
        Ok(ArgmaxScratch {
            part_v: dev.zeros(r * ARGMAX_SPLITS as usize)?,
            part_i: dev.zeros(r * ARGMAX_SPLITS as usize)?,
            counters: dev.zeros(r)?,
        })
    }
}

/// The kernels' `lo_off` for an output of `elems` elements: 0 unsplit; with `split` (bf16
/// outputs only), the offset of the remainder half, which `out` must also hold.
pub(super) fn lo_offset<O: DeviceElem>(
    what: &str,
    len: usize,
    elems: usize,
    split: bool,
) -> Result<i64, EngineError> {
    if split && O::SUFFIX != "bf16" {
        return Err(bad(format!("{what}: a split output must be bf16")));
    }
    check_len(what, len, if split { 2 * elems } else { elems })?;
    Ok(if split { elems as i64 } else { 0 })
}

/// Columns of a row each `silu_mul.cu` thread takes: four where `im` is a multiple of 4, two
/// where it is even, else one (the kernel picks the same way).
fn silu_mul_columns(im: usize) -> usize {
    if im.is_multiple_of(4) {
        4
    } else if im.is_multiple_of(2) {
        2
    } else {
        1
    }
}

/// Rows from which an RMSNorm runs its warp-per-row form (`rms_norm_rows_*`): prefill chunks.
/// Below it a block per row keeps more SMs busy on the few rows of a decode step.
const RMS_WARP_ROWS: usize = 1024;
/// The warp form's largest row (32 lanes × RMS_WARP_CHUNKS float4).
const RMS_WARP_MAX_DIM: usize = 1024;
/// Rows per block of the warp form (its warps).
const RMS_WARP_ROWS_PER_BLOCK: usize = 8;

/// Whether an RMSNorm of `rows` rows of `dim` (with the lo offsets of a split output and an
/// unfolded residual) takes the warp-per-row form.
fn rms_norm_warp_form(rows: usize, dim: usize, lo_off: i64, res_lo: i64) -> bool {
    rows >= RMS_WARP_ROWS
        && dim <= RMS_WARP_MAX_DIM
        && dim.is_multiple_of(4)
        && lo_off % 4 == 0
        && res_lo % 4 == 0
}

#[cfg(test)]
mod tests {
    use super::{rms_norm_warp_form, silu_mul_columns};

    #[test]
    fn silu_mul_takes_four_two_or_one_columns_per_thread() {
        assert_eq!(silu_mul_columns(3072), 4);
        assert_eq!(silu_mul_columns(6), 2);
        assert_eq!(silu_mul_columns(7), 1);
    }

    #[test]
    fn long_steps_of_narrow_aligned_rows_take_the_warp_form() {
        assert!(rms_norm_warp_form(2048, 1024, 2048 * 1024, 0));
        assert!(!rms_norm_warp_form(64, 1024, 0, 0));
        assert!(!rms_norm_warp_form(2048, 2048, 0, 0));
        assert!(!rms_norm_warp_form(2048, 1030, 0, 0));
        assert!(!rms_norm_warp_form(2048, 1024, 6, 0));
    }
}
