//! The FP8 KV cache: its writers against the CPU's quantisation (`kv::fp8`, byte for byte),
//! and the FP8-KV program's tensor-core attention against the decoder's attention over the
//! dequantised pool.

use cudarc::driver::CudaSlice;
use tandem_engine::backend::cuda::{
    AttentionInputs, AttentionScratch, CudaDevice, DecodeLaunch, KvPool, KvTarget, PoolShape,
    TokenMaps,
};
use tandem_engine::error::EngineError;
use tandem_engine::kv::fp8;
use tandem_engine::kv::layout::{KvDtype, KvLayout, KvPart, LAYOUT_VERSION};

use super::common::*;

/// The checks' pool shape with FP8 scales.
const SHAPE: PoolShape = PoolShape {
    scales: true,
    ..POOL_SHAPE
};

/// The layout the FP8 pool follows (kv/layout.rs's scale addresses).
fn layout() -> KvLayout {
    KvLayout {
        version: LAYOUT_VERSION,
        model_id: "check".into(),
        dtype: KvDtype::Fp8,
        block_size: BS,
        num_layers: LAYERS,
        num_kv_heads: NKV,
        head_dim: HD,
    }
}

/// A host FP8 pool: the bytes, and each head's values as they read back (code × scale).
struct HostPool {
    bytes: Vec<u8>,
    values: Vec<f32>,
}

impl HostPool {
    /// Random heads (some scaled down by 2^-2 or 2^-5, so that the scales differ; larger
    /// values would make the scores so peaked that Q's rounding to f16 alone moves the
    /// softmax beyond the tolerance), quantised.
    fn random(l: &KvLayout, rng: &mut Rng) -> Self {
        let blocks = SHAPE.num_blocks;
        let mut p = HostPool {
            bytes: vec![0; blocks * l.block_bytes()],
            values: vec![0.0; blocks * l.block_bytes()],
        };
        for (block, layer, part, slot, head) in heads(l, blocks) {
            let mag = [1.0, 0.25, 1.0 / 32.0][rng.below(3)];
            let x: Vec<f32> = rng.vec(HD).into_iter().map(|v| v * mag).collect();
            p.store(l, (block, layer, part, slot, head), &x);
        }
        p
    }

    /// One head's values quantised into place.
    fn store(&mut self, l: &KvLayout, at: (usize, usize, KvPart, usize, usize), x: &[f32]) {
        let (block, layer, part, slot, head) = at;
        let a = l.token_offset(block, layer, part, slot, head);
        let scale = fp8::quantize_head(x, &mut self.bytes[a..a + HD]);
        let s = l.scale_offset(block, layer, part, slot, head);
        self.bytes[s..s + 4].copy_from_slice(&scale.to_le_bytes());
        fp8::dequantize_head(&self.bytes[a..a + HD], scale, &mut self.values[a..a + HD]);
    }

    /// The read-back values of one head (indexed by the codes' byte offsets).
    fn head(
        &self,
        l: &KvLayout,
        block: usize,
        layer: usize,
        part: KvPart,
        slot: usize,
        h: usize,
    ) -> &[f32] {
        let a = l.token_offset(block, layer, part, slot, h);
        &self.values[a..a + HD]
    }
}

/// Every (block, layer, part, slot, head) of `blocks` blocks.
fn heads(l: &KvLayout, blocks: usize) -> Vec<(usize, usize, KvPart, usize, usize)> {
    let mut v = Vec::new();
    for block in 0..blocks {
        for layer in 0..l.num_layers {
            for part in [KvPart::K, KvPart::V] {
                for slot in 0..l.block_size {
                    for head in 0..l.num_kv_heads {
                        v.push((block, layer, part, slot, head));
                    }
                }
            }
        }
    }
    v
}

/// The pool's bytes as f32 (for the report's element-wise comparison).
fn as_f32(bytes: &[u8]) -> Vec<f32> {
    bytes.iter().map(|b| *b as f32).collect()
}

/// FP8 writers (fused with the q/k norms and RoPE, and alone) and the FP8-KV program's
/// prefill tiles and decode rows (plain and cluster, one and two stages).
pub(crate) fn fp8_kv_and_attention(cx: &mut Ctx) -> Result<(), EngineError> {
    let Ctx { dev, rep, rng } = cx;
    dev.load_fp8_kv_attention()?;
    let l = layout();
    let seqs = sequences();
    let (seq_refs, tokens) = step_tokens(&seqs);
    let t = tokens.len();
    let rope_in = rope_inputs(dev, rng)?;
    let maps = dev.token_maps(&seq_refs, BS, usize::MAX)?;
    let qkv = rng.vec(t * ROW);
    let layer = 1;
    let host = HostPool::random(&l, rng);
    check_len_is_shape(&host)?;

    let step = Step {
        seqs: &seqs,
        tokens: &tokens,
        qkv: &qkv,
        layer,
    };
    let (host, fused) = check_writers(dev, rep, &rope_in, &maps, &step, &host)?;

    // Attention over the pool as written: every token through the dispatcher (prefill tiles,
    // the decode rows on tensor cores), then the decode rows alone at several launches.
    let dqkv = dev.upload(&qkv)?;
    let pool = fused;
    let mut scratch = AttentionScratch::new(dev)?;
    scratch.fp8_pool = true;
    let vmax = host.values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let tol = vmax / 256.0;
    let tiles = CudaDevice::prefill_tile_tokens(true, HD, NQ / NKV)
        .ok_or_else(|| EngineError::InvalidInput("fp8 check: no tile shape".into()))?;
    for window in [usize::MAX, 8] {
        let want = reference(&l, &host, &step, window);
        let case = if window == usize::MAX {
            "fp8 pool, decode + chunked prefill + prefill".to_string()
        } else {
            format!("fp8 pool, sliding window {window}")
        };
        let mut maps_t = dev.token_maps(&seq_refs, BS, window)?;
        maps_t.tile_tokens = tiles;
        maps_t.decode_tc_min = 0;
        dev.fill_token_maps(&mut maps_t, &seq_refs, BS, window)?;
        let a = inputs(&dqkv, &pool, &maps_t, layer);
        let mut got = dev.zeros::<f32>(t * NQ * HD)?;
        dev.attention(&mut got, &a, &mut scratch, false)?;
        let how = format!(
            "{} tiles + {} single rows",
            maps_t.n_tiles, maps_t.n_singles
        );
        rep.add(
            "attention_prefill",
            &format!("{case}, {how}"),
            &dev.download(&got)?,
            &want,
            tol,
        );
        let mut split = dev.zeros::<u16>(2 * t * NQ * HD)?;
        dev.attention(&mut split, &a, &mut scratch, true)?;
        rep.add(
            "attention_prefill",
            &format!("{case}, {how}, split bf16 out"),
            &fold_split(&dev.download(&split)?),
            &want,
            tol,
        );
        let c = Case {
            seq_refs: &seq_refs,
            qkv: &qkv,
            want: &want,
            tiles,
            window,
            layer,
            name: &case,
            tol,
        };
        decode_rows(dev, rep, &mut scratch, &pool, &c)?;
    }
    Ok(())
}

/// The step's sequences, their tokens (sequence, position), their qkv rows and the layer.
struct Step<'a> {
    seqs: &'a [(Vec<u32>, std::ops::Range<usize>)],
    tokens: &'a [(usize, usize)],
    qkv: &'a [f32],
    layer: usize,
}

/// The FP8 writers (fused with the q/k norms and RoPE, and alone) against the CPU's
/// quantisation of the rows the GPU rotated; returns the pool as expected and the fused one.
fn check_writers(
    dev: &CudaDevice,
    rep: &mut Report,
    rope_in: &RopeInputs,
    maps: &TokenMaps,
    step: &Step<'_>,
    host: &HostPool,
) -> Result<(HostPool, KvPool), EngineError> {
    // Writers: the GPU's bytes equal the CPU's quantisation of the rows the GPU wrote.
    let heads_in = rope_in.heads();
    let mut rows = dev.upload(step.qkv)?;
    dev.qk_norm_rope(&mut rows, ROW, &heads_in, maps)?;
    let rotated = dev.download(&rows)?;
    let mut want = HostPool {
        bytes: host.bytes.clone(),
        values: host.values.clone(),
    };
    write_rows(&layout(), &mut want, step, &rotated);
    let mut fused_rows = dev.upload(step.qkv)?;
    let mut fused = KvPool::Fp8(dev.upload(&host.bytes)?);
    dev.qk_norm_rope_kv(
        &mut fused_rows,
        ROW,
        &heads_in,
        maps,
        KvTarget {
            pool: &mut fused,
            shape: SHAPE,
            layer: step.layer,
        },
    )?;
    let mut alone = KvPool::Fp8(dev.upload(&host.bytes)?);
    dev.kv_write(
        KvTarget {
            pool: &mut alone,
            shape: SHAPE,
            layer: step.layer,
        },
        &rows,
        ROW,
        NQ * HD,
        maps,
    )?;
    let want_bytes = as_f32(&want.bytes);
    for (name, pool) in [("qk_norm_rope_kv", &fused), ("kv_write", &alone)] {
        let KvPool::Fp8(p) = pool else { unreachable!() };
        rep.add(
            name,
            "fp8 pool (codes and scales)",
            &as_f32(&dev.download(p)?),
            &want_bytes,
            0.0,
        );
    }
    Ok((want, fused))
}

/// One attention case: the step's sequences and rows, the reference output, and how the
/// launches see the pool.
struct Case<'a> {
    seq_refs: &'a [SeqRef<'a>],
    qkv: &'a [f32],
    want: &'a [f32],
    tiles: usize,
    window: usize,
    layer: usize,
    name: &'a str,
    tol: f32,
}

/// The decode row of each sequence alone, at (splits, stages) launches, plain and cluster.
fn decode_rows(
    dev: &CudaDevice,
    rep: &mut Report,
    scratch: &mut AttentionScratch,
    pool: &KvPool,
    c: &Case<'_>,
) -> Result<(), EngineError> {
    let (seq_refs, qkv, want, tol, case) = (c.seq_refs, c.qkv, c.want, c.tol, c.name);
    let last: Vec<(&[u32], std::ops::Range<usize>)> = seq_refs
        .iter()
        .map(|(tb, r)| (*tb, r.end - 1..r.end))
        .collect();
    let (mut want_d, mut qkv_d, mut at) = (Vec::new(), Vec::new(), 0);
    for (_, r) in seq_refs {
        at += r.len();
        want_d.extend_from_slice(&want[(at - 1) * NQ * HD..at * NQ * HD]);
        qkv_d.extend_from_slice(&qkv[(at - 1) * ROW..at * ROW]);
    }
    let dqkv = dev.upload(&qkv_d)?;
    let mut maps = dev.token_maps(&last, BS, c.window)?;
    maps.tile_tokens = c.tiles;
    maps.decode_tc_min = 0;
    dev.fill_token_maps(&mut maps, &last, BS, c.window)?;
    let a = inputs(&dqkv, pool, &maps, c.layer);
    let n = last.len() * NQ * HD;
    let mut launches = vec![
        DecodeLaunch::plain(1, 2),
        DecodeLaunch::plain(3, 2),
        DecodeLaunch::plain(1, 1),
        DecodeLaunch::plain(4, 1),
    ];
    if dev.cluster_capable() {
        for (splits, stages) in [(3, 1), (16, 2)] {
            launches.push(DecodeLaunch {
                splits,
                stages,
                cluster: true,
            });
        }
    }
    for launch in launches {
        let how = format!(
            "decode rows only ({} splits, {} stages{})",
            launch.splits,
            launch.stages,
            if launch.cluster { ", cluster" } else { "" }
        );
        let mut got = dev.zeros::<f32>(n)?;
        dev.attention_decode(&mut got, &a, scratch, false, launch)?;
        rep.add(
            "attention_decode",
            &format!("{case}, {how}"),
            &dev.download(&got)?,
            &want_d,
            tol,
        );
        let mut got2 = dev.zeros::<u16>(2 * n)?;
        dev.attention_decode(&mut got2, &a, scratch, true, launch)?;
        rep.add(
            "attention_decode",
            &format!("{case}, {how}, split bf16 out"),
            &fold_split(&dev.download(&got2)?),
            &want_d,
            tol,
        );
    }
    Ok(())
}

fn inputs<'a>(
    qkv: &'a CudaSlice<f32>,
    pool: &'a KvPool,
    maps: &'a TokenMaps,
    layer: usize,
) -> AttentionInputs<'a> {
    AttentionInputs {
        qkv,
        q16: None,
        row_stride: ROW,
        nq: NQ,
        pool,
        shape: SHAPE,
        layer,
        maps,
        scale: 1.0 / (HD as f32).sqrt(),
    }
}

/// The step's K and V rows (after the q heads of each rotated row) quantised into `pool`.
fn write_rows(l: &KvLayout, pool: &mut HostPool, step: &Step<'_>, rows: &[f32]) {
    for (row, (s, pos)) in rows.chunks_exact(ROW).zip(step.tokens) {
        let block = step.seqs[*s].0[pos / BS] as usize;
        for (part, off) in [(KvPart::K, NQ * HD), (KvPart::V, (NQ + NKV) * HD)] {
            for h in 0..NKV {
                let x = &row[off + h * HD..off + (h + 1) * HD];
                pool.store(l, (block, step.layer, part, pos % BS, h), x);
            }
        }
    }
}

/// The decoder's attention over the pool's read-back values.
fn reference(l: &KvLayout, host: &HostPool, step: &Step<'_>, window: usize) -> Vec<f32> {
    reference_attention(
        step.seqs,
        step.tokens,
        step.qkv,
        window,
        |block, slot, part, kvh| host.head(l, block, step.layer, part, slot, kvh),
    )
}

/// The host pool holds exactly the device pool's elements.
fn check_len_is_shape(host: &HostPool) -> Result<(), EngineError> {
    if host.bytes.len() != SHAPE.elems() {
        return Err(EngineError::InvalidInput(format!(
            "fp8 check: the layout's {} bytes against the shape's {}",
            host.bytes.len(),
            SHAPE.elems()
        )));
    }
    Ok(())
}
