//! Embedding, norms, RoPE, SiLU·mul, gathers against the CPU code.

use cudarc::driver::CudaSlice;
use serde_json::json;
use tandem_engine::backend::cpu_ops::{
    bf16_to_f32, rms_norm_rows, rms_norm_rows_inplace, rope_apply, silu_mul, Matrix,
};
use tandem_engine::backend::cuda::ops::HeadNorms;
use tandem_engine::backend::cuda::{CudaDevice, DeviceElem, DeviceMatrix, KvPool, TokenMaps};
use tandem_engine::error::EngineError;

use super::common::*;

/// Embedding (and an out-of-vocabulary id refused), RMSNorm plain and fused with the residual add, the split-bf16 output and the fold.
pub(crate) fn norms_and_embedding(cx: &mut Ctx) -> Result<(), EngineError> {
    let Ctx { dev, rep, rng } = cx;
    let seqs = sequences();
    let (_, tokens) = step_tokens(&seqs);
    let t = tokens.len();
    // Embedding (exact).
    let table = rng.vec(VOCAB * HIDDEN);
    let ids: Vec<u32> = (0..t).map(|_| rng.below(VOCAB) as u32).collect();
    for bf in [false, true] {
        let m = if bf {
            Matrix::Bf16(table.iter().map(|v| bf16(*v)).collect())
        } else {
            Matrix::F32(table.clone())
        };
        let mut want = vec![0.0f32; t * HIDDEN];
        for (row, id) in want.chunks_exact_mut(HIDDEN).zip(&ids) {
            m.row_into(*id as usize, HIDDEN, row);
        }
        let dm = match &m {
            Matrix::F32(v) => DeviceMatrix::F32(dev.upload(v)?),
            Matrix::Bf16(v) => DeviceMatrix::Bf16(dev.upload(v)?),
        };
        let mut out = dev.zeros::<f32>(t * HIDDEN)?;
        dev.embedding(&mut out, &dm, &ids, HIDDEN)?;
        let got = dev.download(&out)?;
        rep.add(
            "embedding",
            if bf { "bf16" } else { "f32" },
            &got,
            &want,
            0.0,
        );
    }
    // An out-of-vocabulary id is refused on the host.
    {
        let dm = DeviceMatrix::F32(dev.upload(&table)?);
        let mut out = dev.zeros::<f32>(HIDDEN)?;
        let refused = dev
            .embedding(&mut out, &dm, &[VOCAB as u32], HIDDEN)
            .is_err();
        rep.flag(
            "embedding",
            "id outside vocab refused",
            refused,
            json!(refused),
        );
    }

    // RMSNorm, plain and with the fused residual add.
    let w = rng.vec(HIDDEN);
    let x0 = rng.vec(t * HIDDEN);
    let res = rng.vec(t * HIDDEN);
    let dw = dev.upload(&w)?;
    for fused in [false, true] {
        let mut xs = x0.clone();
        if fused {
            for (a, b) in xs.iter_mut().zip(&res) {
                *a += b;
            }
        }
        let mut want = vec![0.0f32; t * HIDDEN];
        rms_norm_rows(&xs, &w, EPS, &mut want);
        let mut dx = dev.upload(&x0)?;
        let dres = dev.upload(&res)?;
        let mut out = dev.zeros::<f32>(t * HIDDEN)?;
        dev.rms_norm(
            &mut out,
            &mut dx,
            fused.then_some(&dres),
            norm(&dw),
            t,
            false,
        )?;
        let got = dev.download(&out)?;
        let case = if fused { "residual add + norm" } else { "norm" };
        rep.add("rms_norm", case, &got, &want, 1e-5);
        if !fused {
            let mut dx = dev.upload(&x0)?;
            let mut out16 = dev.zeros::<u16>(t * HIDDEN)?;
            dev.rms_norm(&mut out16, &mut dx, None, norm(&dw), t, false)?;
            let got = widen(&dev.download(&out16)?);
            rep.add("rms_norm", "norm, bf16 out", &got, &want, bf16_tol(&want));
            // Split bf16 (hi rows, then lo rows): hi + lo carries ~16 bits.
            let mut dx = dev.upload(&x0)?;
            let mut split = dev.zeros::<u16>(2 * t * HIDDEN)?;
            dev.rms_norm(&mut split, &mut dx, None, norm(&dw), t, true)?;
            let got = fold_halves(&dev.download(&split)?);
            rep.add(
                "rms_norm",
                "norm, split bf16 out (hi + lo)",
                &got,
                &want,
                split_tol(&want),
            );
            // With the residual a split GEMM's unfolded output too: the width of the model
            // (the float4 path) and an odd one (the strided loop).
            split_norm(dev, rep, rng, t, HIDDEN)?;
            split_norm(dev, rep, rng, 5, 1030)?;
            // A prefill-sized step: the warp-per-row form (1,024 rows and more).
            split_norm(dev, rep, rng, 1100, HIDDEN)?;
            warp_norm(dev, rep, rng, 1100)?;
            // The fold of a split GEMM output: first half += second half.
            let a = rng.vec(2 * HIDDEN);
            let want_f: Vec<f32> = (0..HIDDEN).map(|i| a[i] + a[HIDDEN + i]).collect();
            let mut da = dev.upload(&a)?;
            dev.fold_rows(&mut da, HIDDEN)?;
            let got_f = dev.download(&da)?;
            rep.add("fold_rows", "f32", &got_f[..HIDDEN], &want_f, 0.0);
        }
        if fused {
            rep.add(
                "rms_norm",
                "residual sum written back",
                &dev.download(&dx)?,
                &xs,
                0.0,
            );
        }
    }
    Ok(())
}

/// hi + lo of a split bf16 output (hi rows, then as many lo rows).
fn fold_halves(split: &[u16]) -> Vec<f32> {
    let halves = widen(split);
    let (hi, lo) = halves.split_at(halves.len() / 2);
    hi.iter().zip(lo).map(|(a, b)| a + b).collect()
}

/// A split output carries ~16 bits of the largest value.
fn split_tol(want: &[f32]) -> f32 {
    want.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 32768.0 + 1e-5
}

/// RMSNorm of `rows` rows of `dim` with an unfolded split residual (hi rows, then lo rows)
/// into a split bf16 output, against the CPU norm of x + hi + lo; the sum written back too.
fn split_norm(
    dev: &CudaDevice,
    rep: &mut Report,
    rng: &mut Rng,
    rows: usize,
    dim: usize,
) -> Result<(), EngineError> {
    let n = rows * dim;
    let (w, x0, res) = (rng.vec(dim), rng.vec(n), rng.vec(2 * n));
    let xs: Vec<f32> = (0..n).map(|i| x0[i] + (res[i] + res[n + i])).collect();
    let mut want = vec![0.0f32; n];
    rms_norm_rows(&xs, &w, EPS, &mut want);
    let dw = dev.upload(&w)?;
    let mut dx = dev.upload(&x0)?;
    let dres = dev.upload(&res)?;
    let mut split = dev.zeros::<u16>(2 * n)?;
    dev.rms_norm_split_residual(
        &mut split,
        &mut dx,
        Some((&dres, true)),
        norm(&dw),
        rows,
        true,
    )?;
    let case = format!("split residual + norm, split bf16 out, {rows} x {dim}");
    let got = fold_halves(&dev.download(&split)?);
    rep.add("rms_norm", &case, &got, &want, split_tol(&want));
    let sum = dev.download(&dx)?;
    rep.add(
        "rms_norm",
        &format!("{case}: sum written back"),
        &sum,
        &xs,
        1e-6,
    );
    Ok(())
}

/// RMSNorm with the residual add over `rows` rows of the model's width into f32, against the
/// CPU (the warp-per-row form from 1,024 rows on).
fn warp_norm(
    dev: &CudaDevice,
    rep: &mut Report,
    rng: &mut Rng,
    rows: usize,
) -> Result<(), EngineError> {
    let n = rows * HIDDEN;
    let (w, x0, res) = (rng.vec(HIDDEN), rng.vec(n), rng.vec(n));
    let xs: Vec<f32> = x0.iter().zip(&res).map(|(a, b)| a + b).collect();
    let mut want = vec![0.0f32; n];
    rms_norm_rows(&xs, &w, EPS, &mut want);
    let dw = dev.upload(&w)?;
    let (mut dx, dres) = (dev.upload(&x0)?, dev.upload(&res)?);
    let mut out = dev.zeros::<f32>(n)?;
    dev.rms_norm(&mut out, &mut dx, Some(&dres), norm(&dw), rows, false)?;
    let case = format!("residual add + norm, {rows} rows");
    rep.add("rms_norm", &case, &dev.download(&out)?, &want, 1e-5);
    let sum = dev.download(&dx)?;
    rep.add(
        "rms_norm",
        &format!("{case}: sum written back"),
        &sum,
        &xs,
        0.0,
    );
    Ok(())
}

/// A prefill step of 300 tokens: from 256 tokens on, each token's heads are walked by the
/// warps of one block (one rotation per token); the rows against the CPU, and the fused KV
/// write against `kv_write` of the same rows, into an f16 pool whose blocks are permuted.
fn rope_many_tokens(
    dev: &CudaDevice,
    rep: &mut Report,
    rng: &mut Rng,
    rope_in: &RopeInputs,
) -> Result<(), EngineError> {
    const T: usize = 300;
    let table: Vec<u32> = (0..POOL_SHAPE.num_blocks as u32).rev().collect();
    let refs: Vec<SeqRef<'_>> = vec![(table.as_slice(), 0..T)];
    let maps = dev.token_maps(&refs, BS, usize::MAX)?;
    let q0 = rng.vec(T * ROW);
    let mut want = q0.clone();
    for (row, pos) in want.chunks_exact_mut(ROW).zip(0..T) {
        for (h, head) in row[..(NQ + NKV) * HD].chunks_exact_mut(HD).enumerate() {
            rms_norm_rows_inplace(head, if h < NQ { &rope_in.qn } else { &rope_in.kn }, EPS);
            rope_apply(head, pos, &rope_in.inv64);
        }
    }
    let heads = rope_in.heads();
    let (mut q1, mut q2) = (dev.upload(&q0)?, dev.upload(&q0)?);
    dev.qk_norm_rope(&mut q1, ROW, &heads, &maps)?;
    rep.add(
        "qk_norm_rope",
        "q/k norm + rope, 300 tokens",
        &dev.download(&q1)?,
        &want,
        2e-5,
    );
    let zeros = vec![0u16; POOL_SHAPE.elems()];
    let (mut p1, mut p2) = (
        KvPool::Half(dev.upload(&zeros)?),
        KvPool::Half(dev.upload(&zeros)?),
    );
    dev.kv_write(kv_at(&mut p1, 1), &q1, ROW, NQ * HD, &maps)?;
    dev.qk_norm_rope_kv(&mut q2, ROW, &heads, &maps, kv_at(&mut p2, 1))?;
    rep.add(
        "qk_norm_rope_kv",
        "f16 pool, 300 tokens",
        &download_pool(dev, &p2)?,
        &download_pool(dev, &p1)?,
        0.0,
    );
    rope_in16(dev, rep, &q0, &heads, &maps)
}

/// The 16-bit-row form (`qk_norm_rope_kv_in16`: a rounded qkv GEMM output in, the q heads out
/// in f32, K and V into a bf16 pool) against the f32 form on the same rounded rows: the q
/// heads and the pool bit-equal.
fn rope_in16(
    dev: &CudaDevice,
    rep: &mut Report,
    q0: &[f32],
    heads: &HeadNorms<'_>,
    maps: &TokenMaps,
) -> Result<(), EngineError> {
    let rows16: Vec<u16> = q0.iter().map(|v| bf16(*v)).collect();
    let zeros = vec![0u16; POOL_SHAPE.elems()];
    let (mut p1, mut p2) = (
        KvPool::Bf16(dev.upload(&zeros)?),
        KvPool::Bf16(dev.upload(&zeros)?),
    );
    let mut want_q = dev.upload(&widen(&rows16))?;
    dev.qk_norm_rope_kv(&mut want_q, ROW, heads, maps, kv_at(&mut p1, 1))?;
    let src = dev.upload(&rows16)?;
    let mut got_q = dev.zeros::<f32>(q0.len())?;
    dev.qk_norm_rope_kv_in16(&src, &mut got_q, ROW, heads, maps, kv_at(&mut p2, 1))?;
    let q_heads = |rows: Vec<f32>| -> Vec<f32> {
        rows.chunks_exact(ROW)
            .flat_map(|r| r[..NQ * HD].to_vec())
            .collect()
    };
    let want_rows = dev.download(&want_q)?;
    let (got, want) = (q_heads(dev.download(&got_q)?), q_heads(want_rows.clone()));
    let case = "bf16 rows in, 300 tokens";
    rep.add(
        "qk_norm_rope_kv (16-bit in)",
        &format!("{case}: q heads"),
        &got,
        &want,
        0.0,
    );
    let (got, want) = (download_pool(dev, &p2)?, download_pool(dev, &p1)?);
    rep.add(
        "qk_norm_rope_kv (16-bit in)",
        &format!("{case}: bf16 pool"),
        &got,
        &want,
        0.0,
    );
    // The q heads rounded back into the 16-bit rows themselves (`qk_norm_rope_kv_q16`, what
    // the warpgroup prefill reads): each the f32 form's value rounded to bf16, the k and v
    // heads left as they were, the pool bit-equal.
    let mut rows = dev.upload(&rows16)?;
    let mut p3 = KvPool::Bf16(dev.upload(&zeros)?);
    dev.qk_norm_rope_kv_q16(&mut rows, ROW, heads, maps, kv_at(&mut p3, 1))?;
    let want16: Vec<f32> = want_rows
        .chunks_exact(ROW)
        .zip(rows16.chunks_exact(ROW))
        .flat_map(|(w, r)| {
            let q = w[..NQ * HD].iter().map(|v| bf16_to_f32(bf16(*v)));
            q.chain(widen(&r[NQ * HD..])).collect::<Vec<_>>()
        })
        .collect();
    let case = "bf16 rows in place, 300 tokens";
    let got16 = widen(&dev.download(&rows)?);
    rep.add(
        "qk_norm_rope_kv (16-bit q out)",
        &format!("{case}: rows"),
        &got16,
        &want16,
        0.0,
    );
    let (got, want) = (download_pool(dev, &p3)?, download_pool(dev, &p1)?);
    rep.add(
        "qk_norm_rope_kv (16-bit q out)",
        &format!("{case}: bf16 pool"),
        &got,
        &want,
        0.0,
    );
    Ok(())
}

/// Per-head q/k norm + RoPE and RoPE alone, at positions up to several thousand; SiLU·mul.
pub(crate) fn rope_and_silu(cx: &mut Ctx) -> Result<(), EngineError> {
    let Ctx { dev, rep, rng } = cx;
    let seqs = sequences();
    let (seq_refs, tokens) = step_tokens(&seqs);
    let t = tokens.len();
    // Per-head q/k norm + RoPE (Qwen3), and RoPE alone (Llama-like), at positions up to
    // several thousand.
    let rope_in = rope_inputs(dev, rng)?;
    let RopeInputs { inv64, qn, kn, .. } = &rope_in;
    let qkv0 = rng.vec(t * ROW);
    let maps = dev.token_maps(&seq_refs, BS, usize::MAX)?;
    for norms in [true, false] {
        let mut want = qkv0.clone();
        for (row, (_, pos)) in want.chunks_exact_mut(ROW).zip(&tokens) {
            for (h, head) in row[..(NQ + NKV) * HD].chunks_exact_mut(HD).enumerate() {
                if norms {
                    rms_norm_rows_inplace(head, if h < NQ { qn } else { kn }, EPS);
                }
                rope_apply(head, *pos, inv64);
            }
        }
        let mut dq = dev.upload(&qkv0)?;
        dev.qk_norm_rope(&mut dq, ROW, &rope_in.heads_with_norms(norms), &maps)?;
        let got = dev.download(&dq)?;
        let case = if norms {
            "q/k norm + rope"
        } else {
            "rope only"
        };
        rep.add("qk_norm_rope", case, &got, &want, 2e-5);
    }
    {
        // Long positions: the angle rounding of f32 inv_freq × pos as in HF.
        let long: Vec<(Vec<u32>, std::ops::Range<usize>)> = vec![((0..400).collect(), 6000..6040)];
        let long_refs: Vec<(&[u32], std::ops::Range<usize>)> = long
            .iter()
            .map(|(t, r)| (t.as_slice(), r.clone()))
            .collect();
        let lmaps = dev.token_maps(&long_refs, BS, usize::MAX)?;
        let q0 = rng.vec(40 * ROW);
        let mut want = q0.clone();
        for (row, pos) in want.chunks_exact_mut(ROW).zip(6000..6040) {
            for head in row[..(NQ + NKV) * HD].chunks_exact_mut(HD) {
                rope_apply(head, pos, inv64);
            }
        }
        let mut dq = dev.upload(&q0)?;
        dev.qk_norm_rope(&mut dq, ROW, &rope_in.heads_with_norms(false), &lmaps)?;
        rep.add(
            "qk_norm_rope",
            "rope at positions 6000..6040",
            &dev.download(&dq)?,
            &want,
            1e-4,
        );
    }

    rope_many_tokens(dev, rep, rng, &rope_in)?;

    // SiLU·mul: the model's shape (f32 and bf16 out), an odd width (one column per thread)
    // and more rows than the launch's grid holds (its rows stride).
    for (rows, im) in [(t, IM), (5, 7), (65_537, 2)] {
        silu_mul_case(dev, rep, rng, rows, im)?;
    }
    Ok(())
}

/// Row gather into f32 and bf16, and the bias add.
pub(crate) fn gather_and_bias(cx: &mut Ctx) -> Result<(), EngineError> {
    let Ctx { dev, rep, rng } = cx;
    let seqs = sequences();
    let (_, tokens) = step_tokens(&seqs);
    let t = tokens.len();
    // Row gather into f32 and bf16, and the bias add.
    {
        let src = rng.vec(t * HIDDEN);
        let rows: Vec<u32> = vec![0, (t - 1) as u32, 5, 5];
        let want: Vec<f32> = rows
            .iter()
            .flat_map(|r| src[*r as usize * HIDDEN..(*r as usize + 1) * HIDDEN].to_vec())
            .collect();
        let dsrc = dev.upload(&src)?;
        let mut out = dev.zeros::<f32>(rows.len() * HIDDEN)?;
        dev.gather_rows(&mut out, &dsrc, t, &rows, HIDDEN, false)?;
        rep.add("gather_rows", "f32", &dev.download(&out)?, &want, 0.0);
        let mut out16 = dev.zeros::<u16>(rows.len() * HIDDEN)?;
        dev.gather_rows(&mut out16, &dsrc, t, &rows, HIDDEN, false)?;
        let want16: Vec<f32> = want.iter().map(|v| bf16_to_f32(bf16(*v))).collect();
        rep.add(
            "gather_rows",
            "bf16 out",
            &widen(&dev.download(&out16)?),
            &want16,
            0.0,
        );
        let b = rng.vec(HIDDEN);
        let mut want_b = src.clone();
        for row in want_b.chunks_exact_mut(HIDDEN) {
            for (v, bb) in row.iter_mut().zip(&b) {
                *v += bb;
            }
        }
        let mut dx = dev.upload(&src)?;
        dev.bias_add(&mut dx, &dev.upload(&b)?, t)?;
        rep.add("bias_add", "f32", &dev.download(&dx)?, &want_b, 0.0);
    }
    Ok(())
}

/// SiLU·mul of `rows` rows of width `im` against the CPU code (bf16 output too at the model's
/// width).
fn silu_mul_case(
    dev: &CudaDevice,
    rep: &mut Report,
    rng: &mut Rng,
    rows: usize,
    im: usize,
) -> Result<(), EngineError> {
    let gu = rng
        .vec(rows * 2 * im)
        .iter()
        .map(|v| v * 8.0)
        .collect::<Vec<_>>();
    let mut want = vec![0.0f32; rows * im];
    for (o, row) in want.chunks_exact_mut(im).zip(gu.chunks_exact(2 * im)) {
        let (g, u) = row.split_at(im);
        let mut g = g.to_vec();
        silu_mul(&mut g, u);
        o.copy_from_slice(&g);
    }
    // The device takes each row's gate and up values interleaved (g0, u0, g1, u1, ...),
    // as the backend's interleaved gate_up weights produce them.
    let gu_interleaved: Vec<f32> = gu
        .chunks_exact(2 * im)
        .flat_map(|row| (0..im).flat_map(move |c| [row[c], row[im + c]]))
        .collect();
    let dgu = dev.upload(&gu_interleaved)?;
    let case = format!("{rows}x{im}");
    let bf16_case = (im == IM).then(|| format!("{case}, bf16 out"));
    let cases = (format!("{case}, f32"), bf16_case);
    silu_outputs(dev, rep, &dgu, (rows, im), &want, cases)?;
    if im.is_multiple_of(2) {
        silu_mul_in16(dev, rep, &gu_interleaved, rows, im)?;
    }
    Ok(())
}

/// SiLU·mul of interleaved gate/up rows given in bf16 (a GEMM's rounded output), into f32 and
/// bf16, against the CPU code on the rounded values.
fn silu_mul_in16(
    dev: &CudaDevice,
    rep: &mut Report,
    gu_interleaved: &[f32],
    rows: usize,
    im: usize,
) -> Result<(), EngineError> {
    let gu16: Vec<u16> = gu_interleaved.iter().map(|v| bf16(*v)).collect();
    let rounded = widen(&gu16);
    let mut want = vec![0.0f32; rows * im];
    for (o, row) in want.chunks_exact_mut(im).zip(rounded.chunks_exact(2 * im)) {
        let mut g: Vec<f32> = row.iter().step_by(2).copied().collect();
        let u: Vec<f32> = row.iter().skip(1).step_by(2).copied().collect();
        silu_mul(&mut g, &u);
        o.copy_from_slice(&g);
    }
    let dgu = dev.upload(&gu16)?;
    let case = format!("{rows}x{im}, bf16 in");
    let cases = (
        format!("{case}, f32 out"),
        Some(format!("{case}, bf16 out")),
    );
    silu_outputs(dev, rep, &dgu, (rows, im), &want, cases)
}

/// SiLU·mul of `gu` (rows × 2·im, gate and up interleaved) into f32 against `want` as case
/// `cases.0`, and into bf16 as `cases.1` where given.
fn silu_outputs<I: DeviceElem>(
    dev: &CudaDevice,
    rep: &mut Report,
    gu: &CudaSlice<I>,
    (rows, im): (usize, usize),
    want: &[f32],
    cases: (String, Option<String>),
) -> Result<(), EngineError> {
    let mut dout = dev.zeros::<f32>(rows * im)?;
    dev.silu_mul_split_input(&mut dout, gu, false, rows, im, false)?;
    rep.add("silu_mul", &cases.0, &dev.download(&dout)?, want, 1e-5);
    if let Some(case) = cases.1 {
        let mut dout = dev.zeros::<u16>(rows * im)?;
        dev.silu_mul_split_input(&mut dout, gu, false, rows, im, false)?;
        let got = widen(&dev.download(&dout)?);
        rep.add("silu_mul", &case, &got, want, bf16_tol(want));
    }
    Ok(())
}
