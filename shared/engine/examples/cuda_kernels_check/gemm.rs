//! GEMMs and GEMVs against cpu_ops::matmul_t.

use cudarc::driver::CudaSlice;
use serde_json::json;
use tandem_engine::backend::cpu_ops::{bf16_to_f32, matmul_t, MatRef};
use tandem_engine::backend::cuda::switches::{GEMM_TUNING_ENV, SKINNY_GEMM_ENV};
use tandem_engine::backend::cuda::{
    CudaDevice, DeviceMatrix, GemmRoute, GemvInput, GemvWeights, ResidualRows,
};
use tandem_engine::error::EngineError;

use super::common::*;

/// cuBLAS sgemm and bf16 GEMMs, the GEMV kernels and their fused norm / SiLU forms, and a refused type mix.
pub(crate) fn gemms(cx: &mut Ctx) -> Result<(), EngineError> {
    sgemms(cx, "")?;
    bf16_gemms(cx, ALL_ON)?;
    fused_gemvs(cx, ALL_ON)?;
    gemvs_f32_rows(cx, ALL_ON)?;
    let Ctx { dev, rep, .. } = cx;
    // A bf16 GEMM input against f32 weights is refused.
    {
        let dx = dev.zeros::<u16>(HIDDEN)?;
        let dwm = DeviceMatrix::F32(dev.zeros::<f32>(HIDDEN)?);
        let mut dout = dev.zeros::<f32>(1)?;
        let refused = dev.matmul_t(&dx, 1, HIDDEN, &dwm, 1, &mut dout).is_err();
        rep.flag("gemm", "mixed dtypes refused", refused, json!(refused));
    }
    Ok(())
}

/// GEMMs of f32 rows (cuBLAS sgemm, the f32 mode) at decode and prefill row counts.
fn sgemms(cx: &mut Ctx, tag: &str) -> Result<(), EngineError> {
    let Ctx { dev, rep, rng } = cx;
    for (m, k, nn) in [(1, HIDDEN, ROW), (37, HIDDEN, 2 * IM), (37, IM, HIDDEN)] {
        let x = rng.vec(m * k);
        let wv = rng.vec(nn * k);
        let mut want = vec![0.0f32; m * nn];
        matmul_t(&x, m, k, MatRef::F32(&wv), nn, &mut want);
        let dx = dev.upload(&x)?;
        let dwm = DeviceMatrix::F32(dev.upload(&wv)?);
        let mut dout = dev.zeros::<f32>(m * nn)?;
        dev.matmul_t(&dx, m, k, &dwm, nn, &mut dout)?;
        rep.add(
            "gemm_sgemm",
            &format!("{m}x{k}x{nn}{tag}"),
            &dev.download(&dout)?,
            &want,
            1e-3,
        );
    }
    Ok(())
}

/// The cuBLAS GEMMs again on a device that tunes them (`TANDEM_CUDA_GEMM_TUNING=on`: each
/// shape class on the fastest of cublasGemmEx and cuBLASLt's candidates), their 16-bit and
/// accumulating forms included; each case twice, bit-equal the second time.
pub(crate) fn gemms_tuned(cx: &mut Ctx) -> Result<(), EngineError> {
    std::env::set_var(GEMM_TUNING_ENV, "on");
    let dev = CudaDevice::new(0);
    std::env::remove_var(GEMM_TUNING_ENV);
    let first = std::mem::replace(&mut cx.dev, dev?);
    let pass = Pass {
        tag: ", tuned",
        gemvs_only: false,
    };
    let run = sgemms(cx, pass.tag).and_then(|()| bf16_gemms(cx, pass));
    cx.dev = first;
    run
}

/// Which device a pass of the small-row checks runs on.
#[derive(Clone, Copy)]
pub(crate) struct Pass {
    /// Appended to each case's name.
    tag: &'static str,
    /// Whether every GEMV case must go to `gemv.cu` (else a case the skinny GEMM takes
    /// instead is left to the other pass).
    gemvs_only: bool,
}

/// The default device: the skinny GEMM takes 16-bit rows of one to 16, the GEMVs the rest.
const ALL_ON: Pass = Pass {
    tag: "",
    gemvs_only: false,
};

/// The GEMVs again on a device with the skinny GEMM off (`TANDEM_CUDA_SKINNY_GEMM=off`), where
/// they take every GEMM of one or two rows, and their fused norm forms with them.
pub(crate) fn gemvs_without_skinny(cx: &mut Ctx) -> Result<(), EngineError> {
    std::env::set_var(SKINNY_GEMM_ENV, "off");
    let dev = CudaDevice::new(0);
    std::env::remove_var(SKINNY_GEMM_ENV);
    let first = std::mem::replace(&mut cx.dev, dev?);
    let pass = Pass {
        tag: ", skinny off",
        gemvs_only: true,
    };
    let run = bf16_gemms(cx, pass)
        .and_then(|()| fused_gemvs(cx, pass))
        .and_then(|()| gemvs_f32_rows(cx, pass));
    cx.dev = first;
    run
}

/// Records a GEMV case the device sends elsewhere: a failure where the pass wants GEMVs only.
fn not_a_gemv(rep: &mut Report, kernel: &str, case: &str, pass: Pass) {
    if pass.gemvs_only {
        rep.flag(kernel, case, false, json!("not taken by gemv.cu"));
    }
}

/// GEMMs in bf16 (weights and inputs rounded to bf16, f32 accumulation) against the f32
/// product of the same rounded values, each labelled by the kernel the device picks.
/// Few rows go through gemv.cu (k = 1000 and 8: its tail loop; one row with its first weights
/// loaded before the PDL wait, `_early_`) or gemm_skinny.cu (n = 1001: a block's columns past
/// n), more through cuBLAS.
fn bf16_gemms(cx: &mut Ctx, pass: Pass) -> Result<(), EngineError> {
    let Ctx { dev, rep, rng } = cx;
    for (m, k, nn) in [
        (1, HIDDEN, ROW),
        (2, IM, HIDDEN),
        (1, 1000, 77),
        (2, 8, 33),
        (3, HIDDEN, ROW),
        (8, HIDDEN, 2 * IM),
        (16, IM, HIDDEN),
        (13, 2048, 1001),
        (32, HIDDEN, 2 * IM),
        (64, HIDDEN, 2 * IM),
        // Shapes of the classes just tuned (rows up to the same power of two): cuBLASLt's
        // algorithm measured on 64 or 300 rows, checked for these.
        (48, HIDDEN, 2 * IM),
        (300, IM, HIDDEN),
        (260, IM, HIDDEN),
        (1100, 256, 96),
    ] {
        if pass.gemvs_only && m > 2 {
            continue;
        }
        let x: Vec<f32> = rng
            .vec(m * k)
            .into_iter()
            .map(|v| bf16_to_f32(bf16(v)))
            .collect();
        let wv: Vec<f32> = rng
            .vec(nn * k)
            .into_iter()
            .map(|v| bf16_to_f32(bf16(v)))
            .collect();
        let mut want = vec![0.0f32; m * nn];
        matmul_t(&x, m, k, MatRef::F32(&wv), nn, &mut want);
        let dx = dev.upload(&x.iter().map(|v| bf16(*v)).collect::<Vec<u16>>())?;
        let dwm =
            DeviceMatrix::Bf16(dev.upload(&wv.iter().map(|v| bf16(*v)).collect::<Vec<u16>>())?);
        let case = format!("{m}x{k}x{nn}{}", pass.tag);
        let label = match dev.gemm_route(m, nn, k, &dwm, GemvInput::Bf16) {
            GemmRoute::Gemv { .. } => "gemm_bf16 (gemv)",
            GemmRoute::Skinny { .. } => "gemm_bf16 (skinny)",
            GemmRoute::Cublas => "gemm_bf16",
        };
        if label != "gemm_bf16 (gemv)" {
            not_a_gemv(rep, "gemm_bf16 (gemv)", &case, pass);
        }
        let mut dout = dev.zeros::<f32>(m * nn)?;
        dev.matmul_t(&dx, m, k, &dwm, nn, &mut dout)?;
        let got = dev.download(&dout)?;
        rep.add(label, &case, &got, &want, 1e-3);
        // The same call again: the very same values (what a graph's replay relies on).
        dev.matmul_t(&dx, m, k, &dwm, nn, &mut dout)?;
        let again = dev.download(&dout)?;
        let same = again
            .iter()
            .zip(&got)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        rep.flag("gemm_bf16 repeat", &case, same, json!(same));
        rounded_output(dev, rep, (&dx, &dwm), (m, k, nn), &case, &want)?;
    }
    Ok(())
}

/// The same GEMM with its output rounded to bf16 (`matmul_t_16`) and added into what its
/// output holds (`matmul_t_add`: a residual stream) where cuBLAS runs it; both refused on the
/// other routes.
fn rounded_output(
    dev: &CudaDevice,
    rep: &mut Report,
    (dx, dwm): (&CudaSlice<u16>, &DeviceMatrix),
    (m, k, nn): (usize, usize, usize),
    case: &str,
    want: &[f32],
) -> Result<(), EngineError> {
    let mut d16 = dev.zeros::<u16>(m * nn)?;
    let run = dev.matmul_t_16(dx, m, k, dwm, nn, &mut d16);
    // A stream of ones to add into.
    let mut dsum = dev.upload(&vec![1.0f32; m * nn])?;
    let run_add = dev.matmul_t_add(dx, m, k, dwm, nn, &mut dsum);
    if dev.gemm_writes_16::<u16>(m, nn, k, dwm) {
        run?;
        run_add?;
        let got = widen(&dev.download(&d16)?);
        let tol = bf16_tol(want) + 1e-3;
        rep.add("gemm_bf16 (16-bit out)", case, &got, want, tol);
        let want_sum: Vec<f32> = want.iter().map(|v| v + 1.0).collect();
        let got = dev.download(&dsum)?;
        rep.add("gemm_bf16 (added into out)", case, &got, &want_sum, 1e-3);
    } else {
        let refused = run.is_err() && run_add.is_err();
        let case = format!("{case}: refused off cuBLAS");
        rep.flag(
            "gemm_bf16 (16-bit out, added)",
            &case,
            refused,
            json!(refused),
        );
    }
    Ok(())
}

/// The fused decode launches of gemv.cu (norm + GEMV, norm + gate_up + SiLU·mul) against the
/// separate kernels they replace, on the same rows: equal but for the norm's summation order
/// (a bf16 step of a normalised value, now and then).
fn fused_gemvs(cx: &mut Ctx, pass: Pass) -> Result<(), EngineError> {
    let Ctx { dev, rep, rng } = cx;
    for (m, k) in [(1, HIDDEN), (2, HIDDEN), (1, 1000)] {
        let x = rng.vec(m * k);
        let res = rng.vec(m * k);
        let nw = rng.vec(k);
        let sum: Vec<f32> = x.iter().zip(&res).map(|(a, b)| a + b).collect();
        let (dx, dres, dnw) = (dev.upload(&x)?, dev.upload(&res)?, dev.upload(&nw)?);
        for (silu, n) in [(false, ROW), (true, IM)] {
            let w_rows = if silu { 2 * n } else { n };
            let dwm = DeviceMatrix::Bf16(
                dev.upload(
                    &rng.vec(w_rows * k)
                        .iter()
                        .map(|v| bf16(*v))
                        .collect::<Vec<u16>>(),
                )?,
            );
            let case = format!(
                "{m}x{k}x{n}{}{}",
                if silu { ", silu" } else { "" },
                pass.tag
            );
            if !dev.norm_gemv_fits(m, k, &dwm, GemvInput::Bf16) {
                not_a_gemv(rep, "gemv_norm", &case, pass);
                continue;
            }
            let mut x_ref = dev.upload(&x)?;
            let mut normed = dev.zeros::<u16>(m * k)?;
            dev.rms_norm(&mut normed, &mut x_ref, Some(&dres), norm(&dnw), m, false)?;
            let mut gemm = dev.zeros::<f32>(m * w_rows)?;
            dev.matmul_t(&normed, m, k, &dwm, w_rows, &mut gemm)?;
            let mut x_out = dev.zeros::<f32>(m * k)?;
            let (got, want) = if silu {
                let mut act = dev.zeros::<u16>(m * n)?;
                dev.silu_mul(&mut act, &gemm, m, n, false)?;
                let mut fused = dev.zeros::<u16>(m * n)?;
                dev.norm_gemv(
                    &mut fused,
                    ResidualRows {
                        x: &dx,
                        residual: Some(&dres),
                        x_out: &mut x_out,
                        m,
                        k,
                    },
                    norm(&dnw),
                    GemvWeights {
                        w: &dwm,
                        n,
                        silu: true,
                    },
                    GemvInput::Bf16,
                )?;
                (widen(&dev.download(&fused)?), widen(&dev.download(&act)?))
            } else {
                let mut fused = dev.zeros::<f32>(m * n)?;
                dev.norm_gemv(
                    &mut fused,
                    ResidualRows {
                        x: &dx,
                        residual: Some(&dres),
                        x_out: &mut x_out,
                        m,
                        k,
                    },
                    norm(&dnw),
                    GemvWeights {
                        w: &dwm,
                        n,
                        silu: false,
                    },
                    GemvInput::Bf16,
                )?;
                (dev.download(&fused)?, dev.download(&gemm)?)
            };
            let tol = want.iter().fold(0.0f32, |a, v| a.max(v.abs())) / 64.0 + 1e-4;
            rep.add("gemv_norm", &case, &got, &want, tol);
            rep.add(
                "gemv_norm",
                &format!("{case}, residual sum"),
                &dev.download(&x_out)?,
                &sum,
                0.0,
            );
        }
    }
    Ok(())
}

/// The GEMVs that read f32 rows (`_xf32_`, the bf16x2 precision's one- and two-row steps)
/// against the host: f32 rows (never rounded) times bf16 weights; the fused norm forms
/// against the norm, GEMM and SiLU·mul computed on the host in f32.
fn gemvs_f32_rows(cx: &mut Ctx, pass: Pass) -> Result<(), EngineError> {
    let Ctx { dev, rep, rng } = cx;
    let bf16_weights = |rng: &mut Rng, n: usize| -> (Vec<u16>, Vec<f32>) {
        let w: Vec<u16> = rng.vec(n).into_iter().map(bf16).collect();
        let wf = widen(&w);
        (w, wf)
    };
    {
        for (m, k, nn) in [(1, HIDDEN, ROW), (2, IM, HIDDEN), (1, 1000, 77), (2, 8, 33)] {
            let x = rng.vec(m * k);
            let (w, wf) = bf16_weights(rng, nn * k);
            let mut want = vec![0.0f32; m * nn];
            matmul_t(&x, m, k, MatRef::F32(&wf), nn, &mut want);
            let (dx, dwm) = (dev.upload(&x)?, DeviceMatrix::Bf16(dev.upload(&w)?));
            let case = format!("{m}x{k}x{nn}{}", pass.tag);
            if !dev.f32_rows_gemv_fits(m, k, &dwm) {
                not_a_gemv(rep, "gemv (f32 rows)", &case, pass);
                continue;
            }
            let mut dout = dev.zeros::<f32>(m * nn)?;
            dev.matmul_t(&dx, m, k, &dwm, nn, &mut dout)?;
            rep.add("gemv (f32 rows)", &case, &dev.download(&dout)?, &want, 1e-3);
        }
        for (m, k) in [(1, HIDDEN), (2, HIDDEN), (1, 1000)] {
            let (x, res, nw) = (rng.vec(m * k), rng.vec(m * k), rng.vec(k));
            // The host's norm of x + residual, in f32.
            let mut normed = vec![0.0f32; m * k];
            for r in 0..m {
                let v: Vec<f32> = (0..k).map(|i| x[r * k + i] + res[r * k + i]).collect();
                let inv = 1.0 / (v.iter().map(|a| a * a).sum::<f32>() / k as f32 + EPS).sqrt();
                for i in 0..k {
                    normed[r * k + i] = nw[i] * (v[i] * inv);
                }
            }
            let (dx, dres, dnw) = (dev.upload(&x)?, dev.upload(&res)?, dev.upload(&nw)?);
            for (silu, n) in [(false, ROW), (true, IM)] {
                let w_rows = if silu { 2 * n } else { n };
                let (w, wf) = bf16_weights(rng, w_rows * k);
                let mut gemm = vec![0.0f32; m * w_rows];
                matmul_t(&normed, m, k, MatRef::F32(&wf), w_rows, &mut gemm);
                // Gate and up rows interleaved: column 2c the gate, 2c + 1 the up of c.
                let want: Vec<f32> = if silu {
                    (0..m * n)
                        .map(|i| {
                            let (r, c) = (i / n, i % n);
                            let (g, u) = (gemm[r * w_rows + 2 * c], gemm[r * w_rows + 2 * c + 1]);
                            g / (1.0 + (-g).exp()) * u
                        })
                        .collect()
                } else {
                    gemm
                };
                let dwm = DeviceMatrix::Bf16(dev.upload(&w)?);
                let case = format!(
                    "{m}x{k}x{n}{}{}",
                    if silu { ", silu" } else { "" },
                    pass.tag
                );
                if !dev.norm_gemv_fits(m, k, &dwm, GemvInput::F32) {
                    not_a_gemv(rep, "gemv_norm (f32 rows)", &case, pass);
                    continue;
                }
                let mut out = dev.zeros::<f32>(m * n)?;
                let mut x_out = dev.zeros::<f32>(m * k)?;
                dev.norm_gemv(
                    &mut out,
                    ResidualRows {
                        x: &dx,
                        residual: Some(&dres),
                        x_out: &mut x_out,
                        m,
                        k,
                    },
                    norm(&dnw),
                    GemvWeights { w: &dwm, n, silu },
                    GemvInput::F32,
                )?;
                let tol = want.iter().fold(0.0f32, |a, v| a.max(v.abs())) * 1e-5 + 1e-4;
                rep.add(
                    "gemv_norm (f32 rows)",
                    &case,
                    &dev.download(&out)?,
                    &want,
                    tol,
                );
            }
        }
    }
    Ok(())
}
