//! The split mode's folds inside the kernels that read a split GEMM's output (its hi rows,
//! then as many lo rows): each equals `fold_rows` followed by the plain kernel, bit for bit.

use tandem_engine::backend::cuda::{CudaDevice, KvPool};
use tandem_engine::error::EngineError;

use super::common::*;

/// A copy of `v` (hi rows, then lo rows) with its first half folded, as `fold_rows` leaves it.
fn folded(dev: &CudaDevice, v: &[f32]) -> Result<cudarc::driver::CudaSlice<f32>, EngineError> {
    let mut d = dev.upload(v)?;
    dev.fold_rows(&mut d, v.len() / 2)?;
    Ok(d)
}

/// rms_norm with an unfolded residual, silu_mul with an unfolded input and qk_norm_rope_kv
/// with an unfolded qkv (bf16 and f16 pools) against fold + the plain kernel.
pub(crate) fn split_inputs(cx: &mut Ctx) -> Result<(), EngineError> {
    let Ctx { dev, rep, rng } = cx;
    let seqs = sequences();
    let (seq_refs, tokens) = step_tokens(&seqs);
    let t = tokens.len();
    // RMSNorm whose residual is an unfolded o_proj / down output.
    {
        let (x0, res2, w) = (
            rng.vec(t * HIDDEN),
            rng.vec(2 * t * HIDDEN),
            rng.vec(HIDDEN),
        );
        let dw = dev.upload(&w)?;
        let (mut x_want, mut x_got) = (dev.upload(&x0)?, dev.upload(&x0)?);
        let mut want = dev.zeros::<u16>(2 * t * HIDDEN)?;
        let res_folded = folded(dev, &res2)?;
        dev.rms_norm(
            &mut want,
            &mut x_want,
            Some(&res_folded),
            norm(&dw),
            t,
            true,
        )?;
        let mut got = dev.zeros::<u16>(2 * t * HIDDEN)?;
        let dres2 = dev.upload(&res2)?;
        let res = Some((&dres2, true));
        dev.rms_norm_split_residual(&mut got, &mut x_got, res, norm(&dw), t, true)?;
        let (got, want) = (widen(&dev.download(&got)?), widen(&dev.download(&want)?));
        rep.add(
            "rms_norm (unfolded residual)",
            "split out",
            &got,
            &want,
            0.0,
        );
        let (xg, xw) = (dev.download(&x_got)?, dev.download(&x_want)?);
        rep.add(
            "rms_norm (unfolded residual)",
            "residual sum",
            &xg,
            &xw,
            0.0,
        );
    }
    // SiLU·mul over an unfolded gate_up output.
    {
        let gu2 = rng.vec(2 * t * 2 * IM);
        let mut want = dev.zeros::<u16>(2 * t * IM)?;
        dev.silu_mul(&mut want, &folded(dev, &gu2)?, t, IM, true)?;
        let mut got = dev.zeros::<u16>(2 * t * IM)?;
        dev.silu_mul_split_input(&mut got, &dev.upload(&gu2)?, true, t, IM, true)?;
        let (got, want) = (widen(&dev.download(&got)?), widen(&dev.download(&want)?));
        rep.add("silu_mul (unfolded input)", "split out", &got, &want, 0.0);
    }
    // q/k norm + RoPE + KV write over an unfolded qkv output.
    let rope_in = rope_inputs(dev, rng)?;
    let heads = rope_in.heads();
    let maps = dev.token_maps(&seq_refs, BS, usize::MAX)?;
    let shape = POOL_SHAPE;
    let qkv2 = rng.vec(2 * t * ROW);
    for half in [false, true] {
        let new_pool = || -> Result<KvPool, EngineError> {
            Ok(if half {
                KvPool::Half(dev.zeros(shape.elems())?)
            } else {
                KvPool::Bf16(dev.zeros(shape.elems())?)
            })
        };
        let (mut want_pool, mut got_pool) = (new_pool()?, new_pool()?);
        let mut want = folded(dev, &qkv2)?;
        dev.qk_norm_rope_kv(&mut want, ROW, &heads, &maps, kv_at(&mut want_pool, 1))?;
        let mut got = dev.upload(&qkv2)?;
        dev.qk_norm_rope_kv_split_input(
            &mut got,
            true,
            ROW,
            &heads,
            &maps,
            kv_at(&mut got_pool, 1),
        )?;
        // The q and k heads of each row (the v heads' hi rows are left unfolded).
        let qk = |v: Vec<f32>| -> Vec<f32> {
            v.chunks_exact(ROW)
                .take(t)
                .flat_map(|r| r[..(NQ + NKV) * HD].to_vec())
                .collect()
        };
        let case = if half { "f16 pool" } else { "bf16 pool" };
        rep.add(
            "qk_norm_rope_kv (unfolded qkv)",
            &format!("{case}, q and k rows"),
            &qk(dev.download(&got)?),
            &qk(dev.download(&want)?),
            0.0,
        );
        rep.add(
            "qk_norm_rope_kv (unfolded qkv)",
            &format!("{case}, pool"),
            &download_pool(dev, &got_pool)?,
            &download_pool(dev, &want_pool)?,
            0.0,
        );
    }
    Ok(())
}
