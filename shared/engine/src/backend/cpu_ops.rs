//! Numeric kernels of the CPU backend: the weight GEMM (matrixmultiply, split over rayon
//! threads), dot products, RMSNorm, RoPE and SiLU. Weights stay in the Hugging Face layout
//! `[out, in]` (row-major); the GEMM reads them transposed through strides, so no copy is made.

use rayon::prelude::*;

/// Up to this many rows a matrix product is a set of dot products: packing the weight for a
/// GEMM would read it twice for little reuse (decode is memory bound); above it the GEMM's
/// cache blocking wins (measured with examples/bench_cpu.rs on decode batch 8 vs prefill).
const GEMV_MAX_ROWS: usize = 16;

/// Output columns per rayon task; a multiple of the GEMM kernels' widths.
const MIN_COLS_PER_TASK: usize = 64;

/// `out[m, n] = x[m, k] · w[n, k]ᵀ` (all row-major, contiguous).
pub fn matmul_t(x: &[f32], m: usize, k: usize, w: &[f32], n: usize, out: &mut [f32]) {
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
        let wc = &w[n0 * k..(n0 + nc) * k];
        let o = out_ptr;
        if m <= GEMV_MAX_ROWS {
            // Weight rows outer, input rows inner: each weight row is read from memory once
            // and reused from L1 for all m inputs (the m input rows stay in cache).
            for j in 0..nc {
                let wj = &wc[j * k..(j + 1) * k];
                for i in 0..m {
                    let v = dot(&x[i * k..(i + 1) * k], wj);
                    // SAFETY: tasks own disjoint column ranges n0..n0+nc of `out`, and
                    // (i, n0 + j) lies inside the m×n buffer checked above.
                    unsafe { *o.get().add(i * n + n0 + j) = v };
                }
            }
        } else {
            // SAFETY: a is m×k with row stride k; b = wcᵀ is k×nc read with strides (1, k);
            // c is the m×nc window of `out` starting at column n0 with row stride n. The
            // windows of different tasks do not overlap.
            unsafe {
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
                    o.get().add(n0),
                    n as isize,
                    1,
                );
            }
        }
    });
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

fn dot_generic(a: &[f32], b: &[f32]) -> f32 {
    dot_lanes(a, b, |x, y, acc| x * y + acc)
}

/// 32 independent accumulators so that the reduction vectorises without reassociation.
#[inline(always)]
fn dot_lanes(a: &[f32], b: &[f32], fma: impl Fn(f32, f32, f32) -> f32) -> f32 {
    let n = a.len().min(b.len());
    let (ca, ra) = a[..n].as_chunks::<32>();
    let (cb, rb) = b[..n].as_chunks::<32>();
    let mut acc = [0.0f32; 32];
    for (x, y) in ca.iter().zip(cb) {
        for l in 0..32 {
            acc[l] = fma(x[l], y[l], acc[l]);
        }
    }
    let mut s = 0.0f32;
    for (x, y) in ra.iter().zip(rb) {
        s = fma(*x, *y, s);
    }
    acc.iter().sum::<f32>() + s
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
        for &(m, k, n) in &[(1, 37, 130), (3, 64, 257), (9, 33, 70), (17, 128, 300)] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0)
                .collect();
            let w: Vec<f32> = (0..n * k)
                .map(|i| ((i * 5 % 11) as f32 - 5.0) / 9.0)
                .collect();
            let mut o = vec![0.0; m * n];
            matmul_t(&x, m, k, &w, n, &mut o);
            let r = naive(&x, m, k, &w, n);
            for (a, b) in o.iter().zip(&r) {
                assert!((a - b).abs() < 1e-4, "{m}x{k}x{n}: {a} vs {b}");
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
