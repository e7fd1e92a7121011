//! Numeric kernels of the CPU backend: the weight GEMM (matrixmultiply, split over rayon
//! threads), dot products, RMSNorm, RoPE and SiLU. Weights stay in the Hugging Face layout
//! `[out, in]` (row-major); the GEMM reads them transposed through strides, so no copy is made.
//! Weight matrices are f32, or bf16 kept as stored (half the bytes to stream per decode step;
//! bf16 → f32 is exact, so results equal those of converted weights).

use rayon::prelude::*;

/// Up to this many rows a matrix product is a set of dot products: packing the weight for a
/// GEMM would read it twice for little reuse (decode is memory bound); above it the GEMM's
/// cache blocking wins (measured with examples/bench_cpu.rs on decode batch 8 vs prefill).
const GEMV_MAX_ROWS: usize = 16;

/// Output columns per rayon task; a multiple of the GEMM kernels' widths.
const MIN_COLS_PER_TASK: usize = 64;

/// Columns of a bf16 weight converted to f32 at a time before a GEMM (bounds the scratch).
const BF16_GEMM_COLS: usize = 128;

/// A weight matrix `[rows, cols]`, row-major, in the element type it was stored in.
#[derive(Clone, Debug, PartialEq)]
pub enum Matrix {
    F32(Vec<f32>),
    /// bf16 bit patterns.
    Bf16(Vec<u16>),
}

/// A borrowed [`Matrix`] (or part of one).
#[derive(Clone, Copy, Debug)]
pub enum MatRef<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl Matrix {
    pub fn len(&self) -> usize {
        match self {
            Matrix::F32(v) => v.len(),
            Matrix::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn as_ref(&self) -> MatRef<'_> {
        match self {
            Matrix::F32(v) => MatRef::F32(v),
            Matrix::Bf16(v) => MatRef::Bf16(v),
        }
    }

    /// The elements of an f32 matrix; an error for a bf16 one.
    pub fn f32_values(&self) -> Result<&[f32], crate::error::EngineError> {
        match self {
            Matrix::F32(v) => Ok(v),
            Matrix::Bf16(_) => Err(crate::error::EngineError::Backend(
                "an f32 matrix was expected, this one is bf16".into(),
            )),
        }
    }

    /// All elements as f32 (norm weights and the like).
    pub fn into_f32(self) -> Vec<f32> {
        match self {
            Matrix::F32(v) => v,
            Matrix::Bf16(v) => v.into_iter().map(bf16_to_f32).collect(),
        }
    }

    /// Row `i` of a matrix with `cols` columns, as f32, into `out`.
    pub fn row_into(&self, i: usize, cols: usize, out: &mut [f32]) {
        match self {
            Matrix::F32(v) => out.copy_from_slice(&v[i * cols..(i + 1) * cols]),
            Matrix::Bf16(v) => {
                for (o, b) in out.iter_mut().zip(&v[i * cols..(i + 1) * cols]) {
                    *o = bf16_to_f32(*b);
                }
            }
        }
    }

    /// Rows `rows` of a matrix with `cols` columns (a shard of the output dimension).
    pub fn row_range(&self, rows: std::ops::Range<usize>, cols: usize) -> Matrix {
        let span = rows.start * cols..rows.end * cols;
        match self {
            Matrix::F32(v) => Matrix::F32(v[span].to_vec()),
            Matrix::Bf16(v) => Matrix::Bf16(v[span].to_vec()),
        }
    }

    /// Columns `take` of every row of a matrix with `cols` columns (a shard of the input
    /// dimension).
    pub fn col_range(&self, take: std::ops::Range<usize>, cols: usize) -> Matrix {
        fn pick<T: Copy>(v: &[T], take: &std::ops::Range<usize>, cols: usize) -> Vec<T> {
            v.chunks_exact(cols)
                .flat_map(|row| row[take.clone()].iter().copied())
                .collect()
        }
        match self {
            Matrix::F32(v) => Matrix::F32(pick(v, &take, cols)),
            Matrix::Bf16(v) => Matrix::Bf16(pick(v, &take, cols)),
        }
    }

    /// The rows of `parts` one after another; bf16 stays bf16 when every part is bf16.
    pub fn concat(parts: Vec<Matrix>) -> Matrix {
        if parts.iter().all(|p| matches!(p, Matrix::Bf16(_))) {
            let mut out = Vec::with_capacity(parts.iter().map(Matrix::len).sum());
            for p in parts {
                if let Matrix::Bf16(v) = p {
                    out.extend(v);
                }
            }
            Matrix::Bf16(out)
        } else {
            let mut out = Vec::with_capacity(parts.iter().map(Matrix::len).sum());
            for p in parts {
                out.extend(p.into_f32());
            }
            Matrix::F32(out)
        }
    }
}

impl MatRef<'_> {
    pub fn len(&self) -> usize {
        match self {
            MatRef::F32(v) => v.len(),
            MatRef::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// bf16 bits → f32 (exact).
#[inline]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// `out[m, n] = x[m, k] · w[n, k]ᵀ` (all row-major, contiguous).
pub fn matmul_t(x: &[f32], m: usize, k: usize, w: MatRef<'_>, n: usize, out: &mut [f32]) {
    assert_eq!(x.len(), m * k, "matmul_t: x is not m×k");
    assert_eq!(w.len(), n * k, "matmul_t: w is not n×k");
    assert_eq!(out.len(), m * n, "matmul_t: out is not m×n");
    if m == 0 || n == 0 {
        return;
    }
    let threads = rayon::current_num_threads().max(1);
    let per_task = n.div_ceil(threads).div_ceil(MIN_COLS_PER_TASK).max(1) * MIN_COLS_PER_TASK;
    let tasks = n.div_ceil(per_task);
    let out_ptr = SendPtr(out.as_mut_ptr());
    (0..tasks).into_par_iter().for_each(|t| {
        let n0 = t * per_task;
        let nc = per_task.min(n - n0);
        let o = out_ptr;
        match w {
            MatRef::F32(w) => {
                let wc = &w[n0 * k..(n0 + nc) * k];
                if m <= GEMV_MAX_ROWS {
                    gemv_rows(m, nc, n, n0, o, |i, j| {
                        dot(&x[i * k..(i + 1) * k], &wc[j * k..(j + 1) * k])
                    });
                } else {
                    // SAFETY: see `sgemm_window`; tasks own disjoint column windows.
                    unsafe { sgemm_window(x, m, k, wc, nc, n, o.get().add(n0)) };
                }
            }
            MatRef::Bf16(w) => {
                let wc = &w[n0 * k..(n0 + nc) * k];
                if m <= GEMV_MAX_ROWS {
                    gemv_rows(m, nc, n, n0, o, |i, j| {
                        dot_bf16(&x[i * k..(i + 1) * k], &wc[j * k..(j + 1) * k])
                    });
                } else {
                    // Convert a few weight rows at a time, then a regular GEMM on them.
                    let mut scratch = vec![0.0f32; BF16_GEMM_COLS.min(nc) * k];
                    let mut c0 = 0;
                    while c0 < nc {
                        let cc = BF16_GEMM_COLS.min(nc - c0);
                        for (d, s) in scratch.iter_mut().zip(&wc[c0 * k..(c0 + cc) * k]) {
                            *d = bf16_to_f32(*s);
                        }
                        // SAFETY: see `sgemm_window`; the window n0+c0..n0+c0+cc is this
                        // task's.
                        unsafe {
                            sgemm_window(x, m, k, &scratch[..cc * k], cc, n, o.get().add(n0 + c0))
                        };
                        c0 += cc;
                    }
                }
            }
        }
    });
}

/// Small-m product: weight rows outer, input rows inner, so that each weight row is read from
/// memory once and reused from L1 for all m inputs (the m input rows stay in cache).
#[inline]
fn gemv_rows(
    m: usize,
    nc: usize,
    n: usize,
    n0: usize,
    o: SendPtr,
    dot_ij: impl Fn(usize, usize) -> f32,
) {
    for j in 0..nc {
        for i in 0..m {
            let v = dot_ij(i, j);
            // SAFETY: tasks own disjoint column ranges n0..n0+nc of `out`, and (i, n0 + j)
            // lies inside the m×n buffer checked by `matmul_t`.
            unsafe { *o.get().add(i * n + n0 + j) = v };
        }
    }
}

/// `c[m, nc] = x[m, k] · wc[nc, k]ᵀ` into a window of a row-major buffer with row stride `n`.
///
/// # Safety
/// `c` must point to an m×nc window (row stride n) that nobody else reads or writes meanwhile.
unsafe fn sgemm_window(
    x: &[f32],
    m: usize,
    k: usize,
    wc: &[f32],
    nc: usize,
    n: usize,
    c: *mut f32,
) {
    // a is m×k with row stride k; b = wcᵀ is k×nc read with strides (1, k).
    matrixmultiply::sgemm(
        m,
        k,
        nc,
        1.0,
        x.as_ptr(),
        k as isize,
        1,
        wc.as_ptr(),
        1,
        k as isize,
        0.0,
        c,
        n as isize,
        1,
    );
}

/// A raw pointer that rayon tasks may share; each task writes a disjoint range.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: used only for writes to disjoint ranges, see `matmul_t`.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
impl SendPtr {
    // A method (not field access) so closures capture the whole Send wrapper.
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Dot product, with an AVX2+FMA version picked at run time (the build targets plain x86-64).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has the features the function is compiled for.
            return unsafe { dot_avx2(a, b) };
        }
    }
    dot_generic(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    // Plain Rust over fixed-size arrays; with the target feature LLVM emits four ymm FMA
    // accumulators. (Hand-written `_mm256_loadu_ps` was 3x slower in the dev profile: its
    // debug-assertion UB checks spill every load to the stack.)
    dot_lanes(a, b, f32::mul_add)
}

/// Dot product of f32 activations with a bf16 weight row.
pub fn dot_bf16(a: &[f32], b: &[u16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has the features the function is compiled for.
            return unsafe { dot_bf16_avx2(a, b) };
        }
    }
    dot_lanes_conv(a, b, bf16_to_f32, |x, y, acc| x * y + acc)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_bf16_avx2(a: &[f32], b: &[u16]) -> f32 {
    dot_lanes_conv(a, b, bf16_to_f32, f32::mul_add)
}

/// [`dot_lanes`] over a second operand of another element type.
#[inline(always)]
fn dot_lanes_conv<T: Copy>(
    a: &[f32],
    b: &[T],
    conv: impl Fn(T) -> f32,
    fma: impl Fn(f32, f32, f32) -> f32,
) -> f32 {
    let n = a.len().min(b.len());
    let (ca, ra) = a[..n].as_chunks::<32>();
    let (cb, rb) = b[..n].as_chunks::<32>();
    let mut acc = [0.0f32; 32];
    for (x, y) in ca.iter().zip(cb) {
        for l in 0..32 {
            acc[l] = fma(x[l], conv(y[l]), acc[l]);
        }
    }
    let mut s = 0.0f32;
    for (x, y) in ra.iter().zip(rb) {
        s = fma(*x, conv(*y), s);
    }
    acc.iter().sum::<f32>() + s
}

fn dot_generic(a: &[f32], b: &[f32]) -> f32 {
    dot_lanes(a, b, |x, y, acc| x * y + acc)
}

/// 32 independent accumulators so that the reduction vectorises without reassociation.
#[inline(always)]
fn dot_lanes(a: &[f32], b: &[f32], fma: impl Fn(f32, f32, f32) -> f32) -> f32 {
    dot_lanes_conv(a, b, |v| v, fma)
}

/// `y += a * x`.
#[inline]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// RMSNorm of each `dim`-long row of `x` into `out`: `w * x / sqrt(mean(x²) + eps)`, as
/// Hugging Face's Qwen3RMSNorm computes it in f32.
pub fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let dim = w.len();
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let ss = dot(xr, xr) / dim as f32;
        let r = 1.0 / (ss + eps).sqrt();
        for ((o, xv), wv) in or.iter_mut().zip(xr).zip(w) {
            *o = wv * (xv * r);
        }
    }
}

/// In-place RMSNorm of each `dim`-long row.
pub fn rms_norm_rows_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let dim = w.len();
    for xr in x.chunks_exact_mut(dim) {
        let ss = dot(xr, xr) / dim as f32;
        let r = 1.0 / (ss + eps).sqrt();
        for (xv, wv) in xr.iter_mut().zip(w) {
            *xv = wv * (*xv * r);
        }
    }
}

/// RoPE tables: `inv_freq[j] = theta^(-2j/d)` for `j < d/2`.
pub fn rope_inv_freq(head_dim: usize, theta: f32) -> Vec<f64> {
    (0..head_dim / 2)
        .map(|j| 1.0 / (theta as f64).powf((2 * j) as f64 / head_dim as f64))
        .collect()
}

/// Applies RoPE in place to one head vector at position `pos`, in Hugging Face's rotate_half
/// convention: the pairs are (j, j + d/2), not adjacent elements.
pub fn rope_apply(v: &mut [f32], pos: usize, inv_freq: &[f64]) {
    let half = inv_freq.len();
    for (j, f) in inv_freq.iter().enumerate() {
        // HF computes the angle in f32 (inv_freq f32 × position); do the same so that long
        // positions round like the reference.
        let angle = (*f as f32) * pos as f32;
        let (s, c) = angle.sin_cos();
        let a = v[j];
        let b = v[j + half];
        v[j] = a * c - b * s;
        v[j + half] = b * c + a * s;
    }
}

/// `silu(g) * u`, elementwise, written into `g`.
pub fn silu_mul(g: &mut [f32], u: &[f32]) {
    for (gv, uv) in g.iter_mut().zip(u) {
        let s = *gv / (1.0 + (-*gv).exp());
        *gv = s * uv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
        let mut o = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                o[i * n + j] = (0..k).map(|p| x[i * k + p] * w[j * k + p]).sum();
            }
        }
        o
    }

    #[test]
    fn matmul_matches_naive_for_gemv_and_gemm_sizes() {
        for &(m, k, n) in &[
            (1, 37, 130),
            (3, 64, 257),
            (9, 33, 70),
            (17, 128, 300),
            (20, 40, 700),
        ] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0)
                .collect();
            let w: Vec<f32> = (0..n * k)
                .map(|i| ((i * 5 % 11) as f32 - 5.0) / 9.0)
                .collect();
            let mut o = vec![0.0; m * n];
            matmul_t(&x, m, k, MatRef::F32(&w), n, &mut o);
            let r = naive(&x, m, k, &w, n);
            for (a, b) in o.iter().zip(&r) {
                assert!((a - b).abs() < 1e-4, "{m}x{k}x{n}: {a} vs {b}");
            }
            // bf16 weights give the product of their (exactly) converted values.
            let wb: Vec<u16> = w
                .iter()
                .map(|v| half::bf16::from_f32(*v).to_bits())
                .collect();
            let wr: Vec<f32> = wb.iter().map(|b| bf16_to_f32(*b)).collect();
            matmul_t(&x, m, k, MatRef::Bf16(&wb), n, &mut o);
            let r = naive(&x, m, k, &wr, n);
            for (a, b) in o.iter().zip(&r) {
                assert!((a - b).abs() < 1e-4, "bf16 {m}x{k}x{n}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn dot_versions_agree() {
        let a: Vec<f32> = (0..103).map(|i| i as f32 * 0.5).collect();
        let b: Vec<f32> = (0..103).map(|i| 1.0 - i as f32 * 0.01).collect();
        let expect: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - expect).abs() < 1e-2);
        assert!((dot_generic(&a, &b) - expect).abs() < 1e-2);
    }

    #[test]
    fn rope_rotates_pairs_half_apart_and_keeps_norm() {
        let inv = rope_inv_freq(4, 10000.0);
        let mut v = vec![1.0, 0.0, 0.0, 0.0];
        rope_apply(&mut v, 1, &inv);
        // pair (0, 2) rotates by 1 rad; pair (1, 3) by 0.01 rad
        assert!((v[0] - 1f32.cos()).abs() < 1e-6 && (v[2] - 1f32.sin()).abs() < 1e-6);
        assert_eq!(v[1], 0.0);
        let mut w = vec![0.3, -1.2, 2.0, 0.7];
        let n0: f32 = w.iter().map(|x| x * x).sum();
        rope_apply(&mut w, 17, &inv);
        let n1: f32 = w.iter().map(|x| x * x).sum();
        assert!((n0 - n1).abs() < 1e-5);
    }

    #[test]
    fn rms_norm_normalises() {
        let x = [3.0f32, 4.0];
        let mut o = [0.0f32; 2];
        rms_norm_rows(&x, &[1.0, 2.0], 0.0, &mut o);
        let r = (12.5f32).sqrt();
        assert!((o[0] - 3.0 / r).abs() < 1e-6 && (o[1] - 8.0 / r).abs() < 1e-6);
    }
}
