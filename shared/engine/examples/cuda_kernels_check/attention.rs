//! The KV write and the attention kernels against the decoder's attention on the CPU.

use cudarc::driver::CudaSlice;
use tandem_engine::backend::cpu_ops::bf16_to_f32;
use tandem_engine::backend::cuda::{
    AttentionInputs, AttentionScratch, Balance, CudaDevice, DecodeLaunch, DeviceElem, KvPool,
    PieceSchedule, TokenMaps,
};
use tandem_engine::error::EngineError;
use tandem_engine::kv::layout::{KvDtype, KvLayout, KvPart, LAYOUT_VERSION};

use super::common::*;

/// KV write (alone and fused with q/k norm + RoPE) and every paged attention kernel, f32 and bf16 pools, with and without a sliding window.
pub(crate) fn kv_and_attention(cx: &mut Ctx) -> Result<(), EngineError> {
    let Ctx { dev, rep, rng } = cx;
    dev.load_half_kv_attention()?;
    let seqs = sequences();
    let (seq_refs, tokens) = step_tokens(&seqs);
    let t = tokens.len();
    let rope_in = rope_inputs(dev, rng)?;
    let maps = dev.token_maps(&seq_refs, BS, usize::MAX)?;
    // KV write and paged attention, f32 and bf16 pools.
    let shape = POOL_SHAPE;
    let n = shape.elems();
    let qkv = rng.vec(t * ROW);
    let dqkv = dev.upload(&qkv)?;
    let mut scratch = AttentionScratch::new(dev)?;
    // F16: an f16 pool beside the bf16 program's element (KvPool::Half, the bf16x2
    // precision's f16 cache).
    for dtype in [KvDtype::F32, KvDtype::Bf16, KvDtype::F16] {
        let layout = KvLayout {
            version: LAYOUT_VERSION,
            model_id: "check".into(),
            dtype,
            block_size: BS,
            num_layers: LAYERS,
            num_kv_heads: NKV,
            head_dim: HD,
        };
        let el = |block: usize, layer: usize, part: KvPart, slot: usize, head: usize| {
            layout.token_offset(block, layer, part, slot, head) / dtype.bytes()
        };
        let layer = 1;
        // Host pool: random (the cached prefix), as f32 values exactly representable in
        // the pool's dtype.
        let mut host: Vec<f32> = rng.vec(n);
        let round = |v: f32| match dtype {
            KvDtype::F32 => v,
            KvDtype::Bf16 => bf16_to_f32(bf16(v)),
            KvDtype::F16 => half::f16::from_f32(v).to_f32(),
            KvDtype::Fp8 => unreachable!("fp8 pools: fp8.rs"),
        };
        host.iter_mut().for_each(|v| *v = round(*v));
        let upload_pool = |host: &[f32]| -> Result<KvPool, EngineError> {
            Ok(match dtype {
                KvDtype::F32 => KvPool::F32(dev.upload(host)?),
                KvDtype::Bf16 => {
                    KvPool::Bf16(dev.upload(&host.iter().map(|v| bf16(*v)).collect::<Vec<_>>())?)
                }
                KvDtype::F16 => KvPool::Half(
                    dev.upload(
                        &host
                            .iter()
                            .map(|v| half::f16::from_f32(*v).to_bits())
                            .collect::<Vec<_>>(),
                    )?,
                ),
                KvDtype::Fp8 => unreachable!("fp8 pools: fp8.rs"),
            })
        };
        let mut pool = upload_pool(&host)?;
        // The fused q/k norm + RoPE + KV write against the two kernels it replaces, on
        // the same pool and rows: identical.
        {
            let heads = rope_in.heads();
            let (mut q1, mut q2) = (dev.upload(&qkv)?, dev.upload(&qkv)?);
            let (mut p1, mut p2) = (upload_pool(&host)?, upload_pool(&host)?);
            dev.qk_norm_rope(&mut q1, ROW, &heads, &maps)?;
            dev.kv_write(kv_at(&mut p1, layer), &q1, ROW, NQ * HD, &maps)?;
            dev.qk_norm_rope_kv(&mut q2, ROW, &heads, &maps, kv_at(&mut p2, layer))?;
            let case = format!("{dtype} pool");
            rep.add(
                "qk_norm_rope_kv",
                &case,
                &download_pool(dev, &p2)?,
                &download_pool(dev, &p1)?,
                0.0,
            );
            rep.add(
                "qk_norm_rope_kv",
                &format!("{case}, rows"),
                &dev.download(&q2)?,
                &dev.download(&q1)?,
                0.0,
            );
        }
        // Reference write: the layout's address function, values rounded like the CPU
        // backend's store (`round`).
        for (row, (s, pos)) in qkv.chunks_exact(ROW).zip(&tokens) {
            let block = seqs[*s].0[pos / BS] as usize;
            for (part, off) in [(KvPart::K, NQ * HD), (KvPart::V, (NQ + NKV) * HD)] {
                let at = el(block, layer, part, pos % BS, 0);
                for i in 0..NKV * HD {
                    host[at + i] = round(row[off + i]);
                }
            }
        }
        dev.kv_write(kv_at(&mut pool, layer), &dqkv, ROW, NQ * HD, &maps)?;
        let got = download_pool(dev, &pool)?;
        rep.add("kv_write", &dtype.to_string(), &got, &host, 0.0);

        // Attention over the pool as written, without and with a sliding window.
        for window in [usize::MAX, 8] {
            let maps_w = dev.token_maps(&seq_refs, BS, window)?;
            let want =
                reference_attention(&seqs, &tokens, &qkv, window, |block, slot, part, kvh| {
                    let at = el(block, layer, part, slot, kvh);
                    &host[at..at + HD]
                });
            let case = if window == usize::MAX {
                format!("{dtype} pool, decode + chunked prefill + prefill")
            } else {
                format!("{dtype} pool, sliding window {window}")
            };
            let mut fast = dev.zeros::<f32>(t * NQ * HD)?;
            Att::new(&dqkv, &pool, &maps_w, layer).fast(dev, &mut fast, &mut scratch)?;
            rep.add("attention_fast", &case, &dev.download(&fast)?, &want, 1e-5);
            let mut fast16 = dev.zeros::<u16>(t * NQ * HD)?;
            Att::new(&dqkv, &pool, &maps_w, layer).fast(dev, &mut fast16, &mut scratch)?;
            let got = widen(&dev.download(&fast16)?);
            rep.add(
                "attention_fast",
                &format!("{case}, bf16 out"),
                &got,
                &want,
                bf16_tol(&want),
            );
            // The tensor-core prefill for the chunks, attention_fast for the decode row (Q
            // and P rounded to bf16: within a bf16 step of the largest V value). An f16 pool
            // takes the half-KV program's kernels (Q and P in f16).
            if let (KvDtype::Bf16 | KvDtype::F16, Some(n)) =
                (dtype, CudaDevice::prefill_tile_tokens(true, HD, NQ / NKV))
            {
                // Singles by attention_fast, then by the tensor-core decode kernel.
                for decode_tc_min in [usize::MAX, 0] {
                    let mut maps_t = dev.token_maps(&seq_refs, BS, window)?;
                    maps_t.tile_tokens = n;
                    maps_t.decode_tc_min = decode_tc_min;
                    maps_t.pieces = dev.prefill_piece_schedule(HD, NKV)?;
                    dev.fill_token_maps(&mut maps_t, &seq_refs, BS, window)?;
                    let mut tiled = dev.zeros::<f32>(t * NQ * HD)?;
                    Att::new(&dqkv, &pool, &maps_t, layer).any(
                        dev,
                        &mut tiled,
                        &mut scratch,
                        false,
                    )?;
                    let vmax = host.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    rep.add(
                        "attention_prefill",
                        &format!(
                            "{case}, {} tiles ({}) + {} single rows ({})",
                            maps_t.n_tiles,
                            dev.prefill_tile_kernel(),
                            maps_t.n_singles,
                            if maps_t.decode_tc {
                                "tensor-core decode"
                            } else {
                                "attention_fast"
                            }
                        ),
                        &dev.download(&tiled)?,
                        &want,
                        vmax / 256.0,
                    );
                    if dtype == KvDtype::F16 {
                        // Split bf16 outputs (hi + lo rows) for the bf16x2 GEMMs.
                        let mut tiled2 = dev.zeros::<u16>(2 * t * NQ * HD)?;
                        Att::new(&dqkv, &pool, &maps_t, layer).any(
                            dev,
                            &mut tiled2,
                            &mut scratch,
                            true,
                        )?;
                        rep.add(
                            "attention_prefill",
                            &format!(
                                "{case}, split bf16 out ({} tiles, decode_tc_min {decode_tc_min})",
                                dev.prefill_tile_kernel()
                            ),
                            &fold_split(&dev.download(&tiled2)?),
                            &want,
                            vmax / 256.0,
                        );
                    }
                }
            }
            // Only the decode token of each sequence: few (token, head) pairs, so the
            // positions split over several blocks merged in the launch.
            let last: Vec<(&[u32], std::ops::Range<usize>)> = seq_refs
                .iter()
                .map(|(tb, r)| (*tb, r.end - 1..r.end))
                .collect();
            let maps_d = dev.token_maps(&last, BS, window)?;
            let mut want_d = Vec::new();
            let mut at = 0;
            for (_, r) in &seq_refs {
                at += r.len();
                want_d.extend_from_slice(&want[(at - 1) * NQ * HD..at * NQ * HD]);
            }
            let mut qkv_d = Vec::new();
            let mut at = 0;
            for (_, r) in &seq_refs {
                at += r.len();
                qkv_d.extend_from_slice(&qkv[(at - 1) * ROW..at * ROW]);
            }
            let dqkv_d = dev.upload(&qkv_d)?;
            let mut split = dev.zeros::<f32>(last.len() * NQ * HD)?;
            Att::new(&dqkv_d, &pool, &maps_d, layer).fast(dev, &mut split, &mut scratch)?;
            let splits = scratch.splits_for(last.len() * NKV);
            rep.add(
                "attention_fast",
                &format!("{case}, decode rows only ({splits} splits)"),
                &dev.download(&split)?,
                &want_d,
                1e-5,
            );
            // The same rows on tensor cores (Q and P in bf16), one block per (row, head)
            // and the keys split over 2, 3 and 4 blocks, with one and two shared-memory
            // stages, f32 and bf16 outputs.
            if let (KvDtype::Bf16 | KvDtype::F16, Some(n)) =
                (dtype, CudaDevice::prefill_tile_tokens(true, HD, NQ / NKV))
            {
                let mut maps_dt = dev.token_maps(&last, BS, window)?;
                maps_dt.tile_tokens = n;
                maps_dt.decode_tc_min = 0;
                dev.fill_token_maps(&mut maps_dt, &last, BS, window)?;
                let vmax = host.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                for (splits, stages) in [(1, 2), (2, 2), (4, 2), (1, 1), (3, 1)] {
                    let mut got = dev.zeros::<f32>(last.len() * NQ * HD)?;
                    Att::new(&dqkv_d, &pool, &maps_dt, layer).decode(
                        dev,
                        &mut got,
                        &mut scratch,
                        false,
                        DecodeLaunch::plain(splits, stages),
                    )?;
                    rep.add(
                        "attention_decode",
                        &format!("{case}, decode rows only ({splits} splits, {stages} stages)"),
                        &dev.download(&got)?,
                        &want_d,
                        vmax / 256.0,
                    );
                }
                if dtype == KvDtype::F16 {
                    // The half-KV program: split bf16 outputs through the dispatcher, then its
                    // cluster variants (it has no fused q/k norms).
                    let mut got2 = dev.zeros::<u16>(2 * last.len() * NQ * HD)?;
                    Att::new(&dqkv_d, &pool, &maps_dt, layer).any(
                        dev,
                        &mut got2,
                        &mut scratch,
                        true,
                    )?;
                    rep.add(
                        "attention_decode",
                        &format!("{case}, decode rows only, split bf16 out (dispatcher)"),
                        &fold_split(&dev.download(&got2)?),
                        &want_d,
                        vmax / 256.0,
                    );
                    // Its cluster variants, f32 and split bf16 outputs.
                    if dev.cluster_capable() {
                        for (splits, stages) in [(3, 1), (16, 2)] {
                            let launch = DecodeLaunch {
                                splits,
                                stages,
                                cluster: true,
                            };
                            let rows = last.len() * NQ * HD;
                            let mut got = dev.zeros::<f32>(rows)?;
                            Att::new(&dqkv_d, &pool, &maps_dt, layer).decode(
                                dev,
                                &mut got,
                                &mut scratch,
                                false,
                                launch,
                            )?;
                            let how = format!("{splits} splits, {stages} stages");
                            rep.add(
                                "attention_decode_cluster",
                                &format!("{case}, decode rows only ({how})"),
                                &dev.download(&got)?,
                                &want_d,
                                vmax / 256.0,
                            );
                            let mut got2 = dev.zeros::<u16>(2 * rows)?;
                            Att::new(&dqkv_d, &pool, &maps_dt, layer).decode(
                                dev,
                                &mut got2,
                                &mut scratch,
                                true,
                                launch,
                            )?;
                            rep.add(
                                "attention_decode_cluster",
                                &format!("{case}, decode rows only ({how}), split bf16 out"),
                                &fold_split(&dev.download(&got2)?),
                                &want_d,
                                vmax / 256.0,
                            );
                        }
                    }
                    continue;
                }
                // The cluster variant (sm_90 on): the splits of a (row, head) as one cluster,
                // merged over distributed shared memory, at 2, 3 and 16 splits.
                if dev.cluster_capable() {
                    for (splits, stages) in [(2, 2), (3, 1), (16, 1), (16, 2)] {
                        let mut got16 = dev.zeros::<u16>(last.len() * NQ * HD)?;
                        Att::new(&dqkv_d, &pool, &maps_dt, layer).decode(
                            dev,
                            &mut got16,
                            &mut scratch,
                            false,
                            DecodeLaunch {
                                splits,
                                stages,
                                cluster: true,
                            },
                        )?;
                        let got = widen(&dev.download(&got16)?);
                        rep.add(
                            "attention_decode_cluster",
                            &format!("{case}, decode rows only ({splits} splits, {stages} stages)"),
                            &got,
                            &want_d,
                            vmax / 256.0 + bf16_tol(&want_d),
                        );
                    }
                }
                let mut got16 = dev.zeros::<u16>(last.len() * NQ * HD)?;
                Att::new(&dqkv_d, &pool, &maps_dt, layer).any(
                    dev,
                    &mut got16,
                    &mut scratch,
                    false,
                )?;
                let got = widen(&dev.download(&got16)?);
                rep.add(
                    "attention_decode",
                    &format!("{case}, decode rows only, bf16 out (dispatcher)"),
                    &got,
                    &want_d,
                    vmax / 256.0 + bf16_tol(&want_d),
                );
            }
        }
    }
    Ok(())
}

/// The warpgroup prefill's piece schedules (`prefill_schedule.rs`) on a fresh 300-token
/// prefill over a bf16 pool (tiles of 1 to 5 runs of keys, a block table of 19 permuted ids):
/// the device's own schedule, a block per tile, and forced cuts — a run per piece (a 5-run
/// tile in 5 parts), 40 blocks with a 2-run floor, 45 blocks with a piece's own cost — and
/// fewer blocks than tiles (a block per tile again), each launched twice (the second after
/// the first's merges reset the counters) against the decoder's attention.
pub(crate) fn prefill_pieces(cx: &mut Ctx) -> Result<(), EngineError> {
    let Ctx { dev, rep, rng } = cx;
    let Some(schedule) = dev.prefill_piece_schedule(HD, NKV)? else {
        eprintln!("piece schedules: not checked (no warpgroup prefill on this device)");
        return Ok(());
    };
    let Some(tile_tokens) = CudaDevice::prefill_tile_tokens(true, HD, NQ / NKV) else {
        return Ok(());
    };
    let table: Vec<u32> = (0..19).map(|i| (i * 7 + 3) % 20).collect();
    let seqs = vec![(table, 0..300)];
    let (seq_refs, tokens) = step_tokens(&seqs);
    let qkv = rng.vec(tokens.len() * ROW);
    let dqkv = dev.upload(&qkv)?;
    let q16 = dev.upload(&qkv.iter().map(|v| bf16(*v)).collect::<Vec<_>>())?;
    let host: Vec<f32> = rng
        .vec(POOL_SHAPE.elems())
        .into_iter()
        .map(|v| bf16_to_f32(bf16(v)))
        .collect();
    let pool = KvPool::Bf16(dev.upload(&host.iter().map(|v| bf16(*v)).collect::<Vec<_>>())?);
    let layout = KvLayout {
        version: LAYOUT_VERSION,
        model_id: "check".into(),
        dtype: KvDtype::Bf16,
        block_size: BS,
        num_layers: LAYERS,
        num_kv_heads: NKV,
        head_dim: HD,
    };
    let layer = 1;
    let want = reference_attention(
        &seqs,
        &tokens,
        &qkv,
        usize::MAX,
        |block, slot, part, kvh| {
            let at = layout.token_offset(block, layer, part, slot, kvh) / 2;
            &host[at..at + HD]
        },
    );
    let vmax = host.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let forced = |blocks, min_runs, piece_runs| PieceSchedule {
        balance: Some(Balance {
            blocks,
            min_runs,
            piece_runs,
        }),
        ..schedule
    };
    let mut scratch = AttentionScratch::new(dev)?;
    for (name, pieces) in [
        ("the device's schedule", schedule),
        (
            "a block per tile",
            PieceSchedule {
                balance: None,
                ..schedule
            },
        ),
        ("a run per piece", forced(1000, 1, 0)),
        ("40 blocks, pieces of 2+ runs", forced(40, 2, 0)),
        ("45 blocks, a piece costing 3 runs", forced(45, 1, 3)),
        ("12 blocks: one per tile past a wave", forced(12, 1, 0)),
    ] {
        let mut maps = dev.token_maps(&seq_refs, BS, usize::MAX)?;
        maps.tile_tokens = tile_tokens;
        maps.pieces = Some(pieces);
        dev.fill_token_maps(&mut maps, &seq_refs, BS, usize::MAX)?;
        for launch in ["first", "second"] {
            let mut got = dev.zeros::<f32>(tokens.len() * NQ * HD)?;
            Att::new(&dqkv, &pool, &maps, layer).any(dev, &mut got, &mut scratch, false)?;
            rep.add(
                "attention_prefill",
                &format!(
                    "bf16 pool, 300-token prefill, {name} ({} blocks, {} state slots), {launch} launch",
                    maps.piece_blocks, maps.state_slots
                ),
                &dev.download(&got)?,
                &want,
                vmax / 256.0,
            );
        }
        // Q from 16-bit rows (the q/k norm kernel's rounding of the same values), bf16 out:
        // against the reference, and bit-equal to f32 q rows where no tile is cut (a cut
        // tile's merge order follows its pieces' finishing order).
        let mut att = Att::new(&dqkv, &pool, &maps, layer);
        let mut from_f32 = dev.zeros::<u16>(tokens.len() * NQ * HD)?;
        att.any(dev, &mut from_f32, &mut scratch, false)?;
        att.q16 = Some(&q16);
        let mut from_16 = dev.zeros::<u16>(tokens.len() * NQ * HD)?;
        att.any(dev, &mut from_16, &mut scratch, false)?;
        let got = widen(&dev.download(&from_16)?);
        let case = format!("bf16 pool, 300-token prefill, {name}, 16-bit q rows, bf16 out");
        rep.add(
            "attention_prefill",
            &case,
            &got,
            &want,
            vmax / 256.0 + bf16_tol(&want),
        );
        if maps.state_slots == 0 {
            let f32_rows = widen(&dev.download(&from_f32)?);
            let case = format!("{case}: equal to f32 q rows");
            rep.add("attention_prefill", &case, &got, &f32_rows, 0.0);
        }
    }
    Ok(())
}

/// What the attention launches of one case share beside the check's constants (the pool's
/// shape, q heads, row stride, scale): the rows' qkv, the pool, the token maps and the layer.
struct Att<'a> {
    qkv: &'a CudaSlice<f32>,
    q16: Option<&'a CudaSlice<u16>>,
    pool: &'a KvPool,
    maps: &'a TokenMaps,
    layer: usize,
}

impl<'a> Att<'a> {
    fn new(qkv: &'a CudaSlice<f32>, pool: &'a KvPool, maps: &'a TokenMaps, layer: usize) -> Self {
        Att {
            qkv,
            q16: None,
            pool,
            maps,
            layer,
        }
    }

    /// The launches' inputs: these rows, pool, maps and layer in the checks' shape.
    fn inputs(&self) -> AttentionInputs<'a> {
        AttentionInputs {
            qkv: self.qkv,
            q16: self.q16,
            row_stride: ROW,
            nq: NQ,
            pool: self.pool,
            shape: POOL_SHAPE,
            layer: self.layer,
            maps: self.maps,
            scale: 1.0 / (HD as f32).sqrt(),
        }
    }

    /// `attention_fast` over every row of the maps.
    fn fast<O: DeviceElem>(
        &self,
        dev: &CudaDevice,
        out: &mut CudaSlice<O>,
        scratch: &mut AttentionScratch,
    ) -> Result<(), EngineError> {
        dev.attention_fast(out, &self.inputs(), scratch, false)
    }

    /// The step's dispatcher (prefill tiles, decode rows).
    fn any<O: DeviceElem>(
        &self,
        dev: &CudaDevice,
        out: &mut CudaSlice<O>,
        scratch: &mut AttentionScratch,
        split: bool,
    ) -> Result<(), EngineError> {
        dev.attention(out, &self.inputs(), scratch, split)
    }

    /// The tensor-core decode kernel with a given launch.
    fn decode<O: DeviceElem>(
        &self,
        dev: &CudaDevice,
        out: &mut CudaSlice<O>,
        scratch: &mut AttentionScratch,
        split: bool,
        launch: DecodeLaunch,
    ) -> Result<(), EngineError> {
        dev.attention_decode(out, &self.inputs(), scratch, split, launch)
    }
}
