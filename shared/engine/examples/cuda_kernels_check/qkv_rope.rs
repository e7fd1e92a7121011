//! The qkv GEMV with the q/k norms, RoPE and KV write in its tail (`gemv_norm_rope_*`,
//! `TANDEM_CUDA_DECODE_FUSION=qkv-rope`) against the two launches it replaces: bf16 rows
//! over a bf16 pool, and f32 rows over an f16 pool (the bf16x2 precision's f16 cache).

use cudarc::driver::CudaSlice;
use tandem_engine::backend::cuda::{CudaDevice, DeviceMatrix, GemvInput, KvPool, QkvRope};
use tandem_engine::error::EngineError;

use super::common::*;

/// One and two decode rows (the last token of the first sequences), each launched twice so
/// the second launch runs on the counters the first reset: the rows and the pool equal
/// `norm_gemv` followed by `qk_norm_rope_kv` exactly (the same arithmetic in each).
pub(crate) fn qkv_rope(cx: &mut Ctx) -> Result<(), EngineError> {
    let Ctx { dev, rep, rng } = cx;
    let seqs = sequences();
    let (seq_refs, _) = step_tokens(&seqs);
    let rope_in = rope_inputs(dev, rng)?;
    let heads = rope_in.heads();
    let shape = POOL_SHAPE;
    let layer = 1;
    let w: Vec<u16> = rng.vec(ROW * HIDDEN).into_iter().map(bf16).collect();
    let dw = DeviceMatrix::Bf16(dev.upload(&w)?);
    let nw = dev.upload(&rng.vec(HIDDEN))?;
    let counters = dev.zeros::<u32>(NQ + 2 * NKV)?;
    let new_pool = |dev: &CudaDevice, input: GemvInput| -> Result<KvPool, EngineError> {
        Ok(match input {
            GemvInput::Bf16 => KvPool::Bf16(dev.zeros(shape.elems())?),
            GemvInput::F32 => KvPool::Half(dev.zeros(shape.elems())?),
        })
    };
    for (rows, input) in [
        (1, GemvInput::Bf16),
        (2, GemvInput::Bf16),
        (1, GemvInput::F32),
        (2, GemvInput::F32),
    ] {
        let last: Vec<SeqRef<'_>> = seq_refs
            .iter()
            .take(rows)
            .map(|(tb, r)| (*tb, r.end - 1..r.end))
            .collect();
        let maps = dev.token_maps(&last, BS, usize::MAX)?;
        let x = dev.upload(&rng.vec(rows * HIDDEN))?;
        let res = dev.upload(&rng.vec(rows * HIDDEN))?;
        let mut x_out = dev.zeros::<f32>(rows * HIDDEN)?;
        // The qkv GEMV over these rows, with or without the RoPE tail.
        let mut qkv_gemv = |out: &mut CudaSlice<f32>, rope: Option<QkvRope<'_>>| {
            dev.norm_gemv(
                out,
                &x,
                Some(&res),
                &mut x_out,
                &nw,
                EPS,
                &dw,
                rows,
                HIDDEN,
                ROW,
                false,
                input,
                None,
                rope,
            )
        };
        // The separate launches.
        let mut want = dev.zeros::<f32>(rows * ROW)?;
        let mut want_pool = new_pool(dev, input)?;
        qkv_gemv(&mut want, None)?;
        dev.qk_norm_rope_kv(&mut want, ROW, &heads, &maps, &mut want_pool, shape, layer)?;
        let (want, want_pool) = (dev.download(&want)?, download_pool(dev, &want_pool)?);
        for launch in ["first launch", "second launch"] {
            let mut got = dev.zeros::<f32>(rows * ROW)?;
            let mut pool = new_pool(dev, input)?;
            let rope = QkvRope {
                heads: &heads,
                maps: &maps,
                pool: &mut pool,
                shape,
                layer,
                counters: &counters,
            };
            qkv_gemv(&mut got, Some(rope))?;
            let case = format!("{rows} rows of {input:?}, {launch}");
            rep.add("gemv_norm_rope", &case, &dev.download(&got)?, &want, 0.0);
            rep.add(
                "gemv_norm_rope",
                &format!("{case}, pool"),
                &download_pool(dev, &pool)?,
                &want_pool,
                0.0,
            );
        }
        rep.add(
            "gemv_norm_rope",
            &format!("{rows} rows of {input:?}, counters reset"),
            &dev.download(&counters)?
                .into_iter()
                .map(|c| c as f32)
                .collect::<Vec<_>>(),
            &[0.0; NQ + 2 * NKV],
            0.0,
        );
    }
    Ok(())
}
