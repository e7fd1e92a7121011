//! Checks every CUDA kernel (compiled by NVRTC for the GPU it runs on) and the cuBLAS GEMM
//! against the CPU implementation (`cpu_ops`, the decoder's attention, the KV layout's address
//! function) on random inputs, and prints a JSON report of max |Δ| per check. Exits 1 when a
//! check fails, 2 when there is no usable GPU.
//!
//! Build here (no CUDA needed), run on the GPU machine:
//! `cargo build --release -p tandem-engine --features cuda --example cuda_kernels_check`

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("cuda_kernels_check needs the `cuda` feature: --features cuda");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
fn main() {
    match check::run() {
        Ok(pass) => std::process::exit(if pass { 0 } else { 1 }),
        Err(e) => {
            println!("{}", serde_json::json!({ "error": e.to_string() }));
            std::process::exit(2);
        }
    }
}

#[cfg(feature = "cuda")]
mod check {
    use std::time::Instant;

    use serde_json::{json, Value};
    use tandem_engine::backend::cpu_ops::{
        bf16_to_f32, dot, matmul_t, rms_norm_rows, rms_norm_rows_inplace, rope_apply,
        rope_inv_freq, silu_mul, MatRef, Matrix,
    };
    use tandem_engine::backend::cuda::ops::{ArgmaxScratch, HeadNorms};
    use tandem_engine::backend::cuda::sampling::SamplingInputs;
    use tandem_engine::backend::cuda::{
        check_libraries, AttentionScratch, CudaDevice, DeviceMatrix, KvPool, PoolShape,
    };
    use tandem_engine::error::EngineError;
    use tandem_engine::kv::layout::{KvDtype, KvLayout, KvPart, LAYOUT_VERSION};
    use tandem_engine::sampler::SamplePlan;

    /// xorshift64*: reproducible inputs without a dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        /// Uniform in [-1, 1).
        fn f(&mut self) -> f32 {
            ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
        fn vec(&mut self, n: usize) -> Vec<f32> {
            (0..n).map(|_| self.f()).collect()
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    fn bf16(v: f32) -> u16 {
        half::bf16::from_f32(v).to_bits()
    }

    fn widen(v: &[u16]) -> Vec<f32> {
        v.iter().map(|b| bf16_to_f32(*b)).collect()
    }

    /// One bf16 rounding of the largest value (2⁻⁸ relative), plus the f32 tolerance.
    fn bf16_tol(want: &[f32]) -> f32 {
        want.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 256.0 + 1e-5
    }

    struct Report {
        checks: Vec<Value>,
        pass: bool,
    }

    impl Report {
        fn add(&mut self, kernel: &str, case: &str, got: &[f32], want: &[f32], tol: f32) {
            let mut max = 0.0f32;
            let mut max_ref = 0.0f32;
            let mut nan = got.len() != want.len();
            for (g, w) in got.iter().zip(want) {
                if g.is_nan() != w.is_nan() {
                    nan = true;
                }
                max = max.max((g - w).abs());
                max_ref = max_ref.max(w.abs());
            }
            let ok = !nan && max <= tol;
            self.pass &= ok;
            self.checks.push(json!({
                "kernel": kernel, "case": case, "elements": want.len(),
                "max_abs_diff": max, "max_abs_ref": max_ref, "tol": tol, "pass": ok,
            }));
        }
    }

    // Qwen3-0.6B-like shapes.
    const HIDDEN: usize = 1024;
    const NQ: usize = 16;
    const NKV: usize = 8;
    const HD: usize = 128;
    const IM: usize = 3072;
    const VOCAB: usize = 1000;
    const EPS: f32 = 1e-6;
    const BS: usize = 16;
    const LAYERS: usize = 2;
    const ROW: usize = (NQ + 2 * NKV) * HD;

    /// The step's sequences: (block table, positions this step).
    fn sequences() -> Vec<(Vec<u32>, std::ops::Range<usize>)> {
        // A decode token at position 100, a prefill chunk over a cached prefix (40..90: two
        // tiles of the tensor-core prefill, keys in two runs) and a fresh prefill (0..33); block
        // ids permuted over a pool of 16.
        vec![
            (vec![3, 9, 0, 14, 6, 11, 1], 100..101),
            (vec![5, 12, 2, 8, 13, 7], 40..90),
            (vec![15, 4, 10], 0..33),
        ]
    }

    pub fn run() -> Result<bool, EngineError> {
        check_libraries()?;
        let t0 = Instant::now();
        let dev = CudaDevice::new(0)?;
        let init_ms = t0.elapsed().as_secs_f64() * 1e3;
        let mut rep = Report {
            checks: Vec::new(),
            pass: true,
        };
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let seqs = sequences();
        let seq_refs: Vec<(&[u32], std::ops::Range<usize>)> = seqs
            .iter()
            .map(|(t, r)| (t.as_slice(), r.clone()))
            .collect();
        let tokens: Vec<(usize, usize)> = seqs
            .iter()
            .enumerate()
            .flat_map(|(s, (_, r))| r.clone().map(move |p| (s, p)))
            .collect();
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
            rep.checks.push(
                json!({"kernel": "embedding", "case": "id outside vocab refused", "pass": refused}),
            );
            rep.pass &= refused;
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
                &dw,
                t,
                EPS,
                false,
            )?;
            let got = dev.download(&out)?;
            let case = if fused { "residual add + norm" } else { "norm" };
            rep.add("rms_norm", case, &got, &want, 1e-5);
            if !fused {
                let mut dx = dev.upload(&x0)?;
                let mut out16 = dev.zeros::<u16>(t * HIDDEN)?;
                dev.rms_norm(&mut out16, &mut dx, None, &dw, t, EPS, false)?;
                let got = widen(&dev.download(&out16)?);
                rep.add("rms_norm", "norm, bf16 out", &got, &want, bf16_tol(&want));
                // Split bf16 (hi rows, then lo rows): hi + lo carries ~16 bits.
                let mut dx = dev.upload(&x0)?;
                let mut split = dev.zeros::<u16>(2 * t * HIDDEN)?;
                dev.rms_norm(&mut split, &mut dx, None, &dw, t, EPS, true)?;
                let halves = widen(&dev.download(&split)?);
                let (hi, lo) = halves.split_at(t * HIDDEN);
                let got: Vec<f32> = hi.iter().zip(lo).map(|(a, b)| a + b).collect();
                let tol = want.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 32768.0 + 1e-5;
                rep.add(
                    "rms_norm",
                    "norm, split bf16 out (hi + lo)",
                    &got,
                    &want,
                    tol,
                );
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

        // Per-head q/k norm + RoPE (Qwen3), and RoPE alone (Llama-like), at positions up to
        // several thousand.
        let inv64 = rope_inv_freq(HD, 1_000_000.0);
        let inv32: Vec<f32> = inv64.iter().map(|v| *v as f32).collect();
        let dinv = dev.upload(&inv32)?;
        let qn = rng.vec(HD);
        let kn = rng.vec(HD);
        let (dqn, dkn) = (dev.upload(&qn)?, dev.upload(&kn)?);
        let qkv0 = rng.vec(t * ROW);
        let maps = dev.token_maps(&seq_refs, BS, usize::MAX)?;
        for norm in [true, false] {
            let mut want = qkv0.clone();
            for (row, (_, pos)) in want.chunks_exact_mut(ROW).zip(&tokens) {
                for (h, head) in row[..(NQ + NKV) * HD].chunks_exact_mut(HD).enumerate() {
                    if norm {
                        rms_norm_rows_inplace(head, if h < NQ { &qn } else { &kn }, EPS);
                    }
                    rope_apply(head, *pos, &inv64);
                }
            }
            let mut dq = dev.upload(&qkv0)?;
            let (a, b) = if norm {
                (Some(&dqn), Some(&dkn))
            } else {
                (None, None)
            };
            dev.qk_norm_rope(&mut dq, ROW, NQ, NKV, HD, &maps, &dinv, a, b, EPS)?;
            let got = dev.download(&dq)?;
            let case = if norm { "q/k norm + rope" } else { "rope only" };
            rep.add("qk_norm_rope", case, &got, &want, 2e-5);
        }
        {
            // Long positions: the angle rounding of f32 inv_freq × pos as in HF.
            let long: Vec<(Vec<u32>, std::ops::Range<usize>)> =
                vec![((0..400).collect(), 6000..6040)];
            let long_refs: Vec<(&[u32], std::ops::Range<usize>)> = long
                .iter()
                .map(|(t, r)| (t.as_slice(), r.clone()))
                .collect();
            let lmaps = dev.token_maps(&long_refs, BS, usize::MAX)?;
            let q0 = rng.vec(40 * ROW);
            let mut want = q0.clone();
            for (row, pos) in want.chunks_exact_mut(ROW).zip(6000..6040) {
                for head in row[..(NQ + NKV) * HD].chunks_exact_mut(HD) {
                    rope_apply(head, pos, &inv64);
                }
            }
            let mut dq = dev.upload(&q0)?;
            dev.qk_norm_rope(&mut dq, ROW, NQ, NKV, HD, &lmaps, &dinv, None, None, EPS)?;
            rep.add(
                "qk_norm_rope",
                "rope at positions 6000..6040",
                &dev.download(&dq)?,
                &want,
                1e-4,
            );
        }

        // SiLU·mul.
        let gu = rng
            .vec(t * 2 * IM)
            .iter()
            .map(|v| v * 8.0)
            .collect::<Vec<_>>();
        let mut want = vec![0.0f32; t * IM];
        for (o, row) in want.chunks_exact_mut(IM).zip(gu.chunks_exact(2 * IM)) {
            let (g, u) = row.split_at(IM);
            let mut g = g.to_vec();
            silu_mul(&mut g, u);
            o.copy_from_slice(&g);
        }
        // The device takes each row's gate and up values interleaved (g0, u0, g1, u1, ...),
        // as the backend's interleaved gate_up weights produce them.
        let gu_interleaved: Vec<f32> = gu
            .chunks_exact(2 * IM)
            .flat_map(|row| (0..IM).flat_map(move |c| [row[c], row[IM + c]]))
            .collect();
        let dgu = dev.upload(&gu_interleaved)?;
        let mut dout = dev.zeros::<f32>(t * IM)?;
        dev.silu_mul(&mut dout, &dgu, t, IM, false)?;
        rep.add("silu_mul", "f32", &dev.download(&dout)?, &want, 1e-5);
        {
            let mut dout = dev.zeros::<u16>(t * IM)?;
            dev.silu_mul(&mut dout, &dgu, t, IM, false)?;
            let got = widen(&dev.download(&dout)?);
            rep.add("silu_mul", "bf16 out", &got, &want, bf16_tol(&want));
        }

        // KV write and paged attention, f32 and bf16 pools.
        let shape = PoolShape {
            num_blocks: 16,
            num_layers: LAYERS,
            block_size: BS,
            num_kv_heads: NKV,
            head_dim: HD,
        };
        let n = shape.elems();
        let qkv = rng.vec(t * ROW);
        let dqkv = dev.upload(&qkv)?;
        let scale = 1.0 / (HD as f32).sqrt();
        let mut scratch = AttentionScratch::new(&dev)?;
        for dtype in [KvDtype::F32, KvDtype::Bf16] {
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
            if dtype == KvDtype::Bf16 {
                host.iter_mut().for_each(|v| *v = bf16_to_f32(bf16(*v)));
            }
            let upload_pool = |host: &[f32]| -> Result<KvPool, EngineError> {
                Ok(match dtype {
                    KvDtype::F32 => KvPool::F32(dev.upload(host)?),
                    KvDtype::Bf16 => KvPool::Bf16(
                        dev.upload(&host.iter().map(|v| bf16(*v)).collect::<Vec<_>>())?,
                    ),
                })
            };
            let download_pool = |pool: &KvPool| -> Result<Vec<f32>, EngineError> {
                Ok(match pool {
                    KvPool::F32(p) => dev.download(p)?,
                    KvPool::Bf16(p) => dev.download(p)?.into_iter().map(bf16_to_f32).collect(),
                })
            };
            let mut pool = upload_pool(&host)?;
            // The fused q/k norm + RoPE + KV write against the two kernels it replaces, on
            // the same pool and rows: identical.
            {
                let heads = HeadNorms {
                    nq: NQ,
                    nkv: NKV,
                    head_dim: HD,
                    inv_freq: &dinv,
                    q_norm: Some(&dqn),
                    k_norm: Some(&dkn),
                    eps: EPS,
                };
                let (mut q1, mut q2) = (dev.upload(&qkv)?, dev.upload(&qkv)?);
                let (mut p1, mut p2) = (upload_pool(&host)?, upload_pool(&host)?);
                dev.qk_norm_rope(
                    &mut q1,
                    ROW,
                    NQ,
                    NKV,
                    HD,
                    &maps,
                    &dinv,
                    Some(&dqn),
                    Some(&dkn),
                    EPS,
                )?;
                dev.kv_write(&mut p1, shape, layer, &q1, ROW, NQ * HD, &maps)?;
                dev.qk_norm_rope_kv(&mut q2, ROW, &heads, &maps, &mut p2, shape, layer)?;
                let case = format!("{dtype} pool");
                rep.add(
                    "qk_norm_rope_kv",
                    &case,
                    &download_pool(&p2)?,
                    &download_pool(&p1)?,
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
            // backend's store.
            let round = |v: f32| match dtype {
                KvDtype::F32 => v,
                KvDtype::Bf16 => bf16_to_f32(bf16(v)),
            };
            for (row, (s, pos)) in qkv.chunks_exact(ROW).zip(&tokens) {
                let block = seqs[*s].0[pos / BS] as usize;
                for (part, off) in [(KvPart::K, NQ * HD), (KvPart::V, (NQ + NKV) * HD)] {
                    let at = el(block, layer, part, pos % BS, 0);
                    for i in 0..NKV * HD {
                        host[at + i] = round(row[off + i]);
                    }
                }
            }
            dev.kv_write(&mut pool, shape, layer, &dqkv, ROW, NQ * HD, &maps)?;
            let got = download_pool(&pool)?;
            rep.add("kv_write", &dtype.to_string(), &got, &host, 0.0);

            // Attention over the pool as written, without and with a sliding window.
            for window in [usize::MAX, 8] {
                let maps_w = dev.token_maps(&seq_refs, BS, window)?;
                let mut want = vec![0.0f32; t * NQ * HD];
                for (ti, (s, pos)) in tokens.iter().enumerate() {
                    let table = &seqs[*s].0;
                    let lo = (pos + 1).saturating_sub(window);
                    for h in 0..NQ {
                        let kvh = h / (NQ / NKV);
                        let q = &qkv[ti * ROW + h * HD..ti * ROW + (h + 1) * HD];
                        let head = |p: usize, part| {
                            let at = el(table[p / BS] as usize, layer, part, p % BS, kvh);
                            &host[at..at + HD]
                        };
                        let scores: Vec<f32> = (lo..=*pos)
                            .map(|p| dot(q, head(p, KvPart::K)) * scale)
                            .collect();
                        let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                        let e: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                        let sum: f32 = e.iter().sum();
                        let out = &mut want[(ti * NQ + h) * HD..(ti * NQ + h + 1) * HD];
                        for (p, ev) in (lo..=*pos).zip(&e) {
                            let a = ev / sum;
                            for (o, v) in out.iter_mut().zip(head(p, KvPart::V)) {
                                *o += a * v;
                            }
                        }
                    }
                }
                let case = if window == usize::MAX {
                    format!("{dtype} pool, decode + chunked prefill + prefill")
                } else {
                    format!("{dtype} pool, sliding window {window}")
                };
                let mut fast = dev.zeros::<f32>(t * NQ * HD)?;
                dev.attention_fast(
                    &mut fast,
                    &dqkv,
                    ROW,
                    &pool,
                    shape,
                    layer,
                    NQ,
                    &maps_w,
                    scale,
                    &mut scratch,
                    false,
                )?;
                rep.add("attention_fast", &case, &dev.download(&fast)?, &want, 1e-5);
                let mut fast16 = dev.zeros::<u16>(t * NQ * HD)?;
                dev.attention_fast(
                    &mut fast16,
                    &dqkv,
                    ROW,
                    &pool,
                    shape,
                    layer,
                    NQ,
                    &maps_w,
                    scale,
                    &mut scratch,
                    false,
                )?;
                let got = widen(&dev.download(&fast16)?);
                rep.add(
                    "attention_fast",
                    &format!("{case}, bf16 out"),
                    &got,
                    &want,
                    bf16_tol(&want),
                );
                // The tensor-core prefill for the chunks, attention_fast for the decode row (Q
                // and P rounded to bf16: within a bf16 step of the largest V value).
                if let (KvDtype::Bf16, Some(n)) =
                    (dtype, CudaDevice::prefill_tile_tokens(true, HD, NQ / NKV))
                {
                    // Singles by attention_fast, then by the tensor-core decode kernel.
                    for decode_tc_min in [usize::MAX, 0] {
                        let mut maps_t = dev.token_maps(&seq_refs, BS, window)?;
                        maps_t.tile_tokens = n;
                        maps_t.decode_tc_min = decode_tc_min;
                        dev.fill_token_maps(&mut maps_t, &seq_refs, BS, window)?;
                        let mut tiled = dev.zeros::<f32>(t * NQ * HD)?;
                        dev.attention(
                            &mut tiled,
                            &dqkv,
                            ROW,
                            &pool,
                            shape,
                            layer,
                            NQ,
                            &maps_t,
                            scale,
                            &mut scratch,
                            false,
                        )?;
                        let vmax = host.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                        rep.add(
                            "attention_prefill",
                            &format!(
                                "{case}, {} tiles + {} single rows ({})",
                                maps_t.n_tiles,
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
                dev.attention_fast(
                    &mut split,
                    &dqkv_d,
                    ROW,
                    &pool,
                    shape,
                    layer,
                    NQ,
                    &maps_d,
                    scale,
                    &mut scratch,
                    false,
                )?;
                let splits = scratch.splits_for(last.len() * NKV);
                rep.add(
                    "attention_fast",
                    &format!("{case}, decode rows only ({splits} splits)"),
                    &dev.download(&split)?,
                    &want_d,
                    1e-5,
                );
                // The same rows on tensor cores (Q and P in bf16), one block per (row, head)
                // and the keys split over 2 and 4 blocks, f32 and bf16 outputs.
                if let (KvDtype::Bf16, Some(n)) =
                    (dtype, CudaDevice::prefill_tile_tokens(true, HD, NQ / NKV))
                {
                    let mut maps_dt = dev.token_maps(&last, BS, window)?;
                    maps_dt.tile_tokens = n;
                    maps_dt.decode_tc_min = 0;
                    dev.fill_token_maps(&mut maps_dt, &last, BS, window)?;
                    let vmax = host.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    for splits in [1, 2, 4] {
                        let mut got = dev.zeros::<f32>(last.len() * NQ * HD)?;
                        dev.attention_decode(
                            &mut got,
                            &dqkv_d,
                            ROW,
                            &pool,
                            shape,
                            layer,
                            NQ,
                            &maps_dt,
                            scale,
                            &mut scratch,
                            false,
                            splits,
                        )?;
                        rep.add(
                            "attention_decode",
                            &format!("{case}, decode rows only ({splits} splits)"),
                            &dev.download(&got)?,
                            &want_d,
                            vmax / 256.0,
                        );
                    }
                    let mut got16 = dev.zeros::<u16>(last.len() * NQ * HD)?;
                    dev.attention(
                        &mut got16,
                        &dqkv_d,
                        ROW,
                        &pool,
                        shape,
                        layer,
                        NQ,
                        &maps_dt,
                        scale,
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

        // GEMM (cuBLAS sgemm, the f32 mode) at decode and prefill row counts.
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
                &format!("{m}x{k}x{nn}"),
                &dev.download(&dout)?,
                &want,
                1e-3,
            );
        }
        // GEMM in bf16 (weights and inputs rounded to bf16, f32 accumulation) against the f32
        // product of the same rounded values.
        // Few rows go through gemv.cu (k = 1000 and 8: its tail loop), more through cuBLAS.
        for (m, k, nn) in [
            (1, HIDDEN, ROW),
            (2, IM, HIDDEN),
            (1, 1000, 77),
            (2, 8, 33),
            (8, HIDDEN, 2 * IM),
            (64, HIDDEN, 2 * IM),
            (300, IM, HIDDEN),
        ] {
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
            let mut dout = dev.zeros::<f32>(m * nn)?;
            dev.matmul_t(&dx, m, k, &dwm, nn, &mut dout)?;
            rep.add(
                if m <= 8 {
                    "gemm_bf16 (gemv)"
                } else {
                    "gemm_bf16"
                },
                &format!("{m}x{k}x{nn}"),
                &dev.download(&dout)?,
                &want,
                1e-3,
            );
        }
        // The fused decode launches of gemv.cu (norm + GEMV, norm + gate_up + SiLU·mul)
        // against the separate kernels they replace, on the same rows: equal but for the
        // norm's summation order (a bf16 step of a normalised value, now and then).
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
                let mut x_ref = dev.upload(&x)?;
                let mut normed = dev.zeros::<u16>(m * k)?;
                dev.rms_norm(&mut normed, &mut x_ref, Some(&dres), &dnw, m, EPS, false)?;
                let mut gemm = dev.zeros::<f32>(m * w_rows)?;
                dev.matmul_t(&normed, m, k, &dwm, w_rows, &mut gemm)?;
                let mut x_out = dev.zeros::<f32>(m * k)?;
                let case = format!("{m}x{k}x{n}{}", if silu { ", silu" } else { "" });
                let (got, want) = if silu {
                    let mut act = dev.zeros::<u16>(m * n)?;
                    dev.silu_mul(&mut act, &gemm, m, n, false)?;
                    let mut fused = dev.zeros::<u16>(m * n)?;
                    dev.norm_gemv(
                        &mut fused,
                        &dx,
                        Some(&dres),
                        &mut x_out,
                        &dnw,
                        EPS,
                        &dwm,
                        m,
                        k,
                        n,
                        true,
                    )?;
                    (widen(&dev.download(&fused)?), widen(&dev.download(&act)?))
                } else {
                    let mut fused = dev.zeros::<f32>(m * n)?;
                    dev.norm_gemv(
                        &mut fused,
                        &dx,
                        Some(&dres),
                        &mut x_out,
                        &dnw,
                        EPS,
                        &dwm,
                        m,
                        k,
                        n,
                        false,
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
        // A bf16 GEMM input against f32 weights is refused.
        {
            let dx = dev.zeros::<u16>(HIDDEN)?;
            let dwm = DeviceMatrix::F32(dev.zeros::<f32>(HIDDEN)?);
            let mut dout = dev.zeros::<f32>(1)?;
            let refused = dev.matmul_t(&dx, 1, HIDDEN, &dwm, 1, &mut dout).is_err();
            rep.checks
                .push(json!({"kernel": "gemm", "case": "mixed dtypes refused", "pass": refused}));
            rep.pass &= refused;
        }

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

        // Device argmax over vocabulary-sized rows, with a planted tie (lowest index wins).
        {
            const V: usize = 151_936;
            let rows = 5;
            let mut logits = rng.vec(rows * V);
            logits[2 * V + 70_000] = 50.0;
            logits[2 * V + 90_000] = 50.0;
            logits[4 * V + V - 1] = 60.0;
            let want: Vec<f32> = logits
                .chunks_exact(V)
                .map(|r| {
                    let mut best = 0;
                    for (i, x) in r.iter().enumerate() {
                        if *x > r[best] {
                            best = i;
                        }
                    }
                    best as f32
                })
                .collect();
            let dl = dev.upload(&logits)?;
            let mut ids = dev.zeros::<i32>(rows)?;
            let mut scratch = ArgmaxScratch::new(&dev, rows)?;
            // Twice: the second launch finds the counters reset by the first.
            for round in ["", ", again"] {
                dev.argmax(&mut ids, &dl, rows, V, &mut scratch)?;
                let got: Vec<f32> = dev.download(&ids)?.into_iter().map(|i| i as f32).collect();
                rep.add(
                    "argmax",
                    &format!("5 rows of 151936, tie{round}"),
                    &got,
                    &want,
                    0.0,
                );
            }
        }

        // Sampling on the device against the CPU rule (SamplePlan::sample_row) with the same
        // uniforms: penalties, mask, greedy, temperature, top-k, top-p, min-p and mixes, on
        // vocabulary-sized rows, 8 uniforms per plan.
        {
            const V: usize = 151_936;
            let base = SamplePlan {
                greedy: false,
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                repetition_penalty: 1.0,
                frequency_penalty: 0.0,
                presence_penalty: 0.0,
                seen: Vec::new(),
                counts: Vec::new(),
                masked: Vec::new(),
                uniform: 0.0,
            };
            let seen: Vec<u32> = (0..300).map(|i| (i * 499 % V) as u32).collect();
            let with = |f: &dyn Fn(&mut SamplePlan)| {
                let mut p = base.clone();
                f(&mut p);
                p
            };
            let kinds: Vec<(&str, SamplePlan)> = vec![
                (
                    "greedy + repetition 1.3 + mask",
                    with(&|p| {
                        p.greedy = true;
                        p.repetition_penalty = 1.3;
                        p.seen = seen.clone();
                        p.masked = vec![7, 151_643];
                    }),
                ),
                ("temperature 0.7", with(&|p| p.temperature = 0.7)),
                ("top_k 50", with(&|p| p.top_k = 50)),
                ("top_p 0.9", with(&|p| p.top_p = 0.9)),
                ("min_p 0.05", with(&|p| p.min_p = 0.05)),
                (
                    "top_k 40 + top_p 0.8 + min_p 0.02 + penalties",
                    with(&|p| {
                        p.top_k = 40;
                        p.top_p = 0.8;
                        p.min_p = 0.02;
                        p.temperature = 0.9;
                        p.frequency_penalty = 0.5;
                        p.presence_penalty = 0.3;
                        p.counts = vec![(11, 3), (500, 1), (70_000, 2)];
                    }),
                ),
                (
                    "top_p 0.95 at temperature 5 (wide nucleus)",
                    with(&|p| {
                        p.top_p = 0.95;
                        p.temperature = 5.0;
                    }),
                ),
            ];
            let per = 8;
            let mut plans = Vec::new();
            let mut logits = Vec::new();
            for (_, plan) in &kinds {
                for _ in 0..per {
                    let mut p = plan.clone();
                    p.uniform = (rng.next() >> 11) as f64 / (1u64 << 53) as f64;
                    plans.push(p);
                    // Logits like a model's: a spread of 3 and a few strong candidates.
                    let mut row: Vec<f32> = (0..V).map(|_| rng.f() * 3.0).collect();
                    for j in 0..20 {
                        row[rng.below(V)] = 8.0 + j as f32 * 0.25;
                    }
                    logits.extend(row);
                }
            }
            let rows = plans.len();
            let want: Vec<f32> = plans
                .iter()
                .zip(logits.chunks_exact(V))
                .map(|(p, r)| p.sample_row(r) as f32)
                .collect();
            let mut inputs = SamplingInputs::new(&dev)?;
            let refs: Vec<&SamplePlan> = plans.iter().collect();
            inputs.fill(&dev, &refs)?;
            let mut dl = dev.upload(&logits)?;
            let mut ids = dev.zeros::<i32>(rows)?;
            dev.sample_rows(&mut ids, &mut dl, rows, V, &inputs)?;
            let got: Vec<f32> = dev.download(&ids)?.into_iter().map(|i| i as f32).collect();
            for (k, (name, _)) in kinds.iter().enumerate() {
                let r = k * per..(k + 1) * per;
                rep.add("sample_rows", name, &got[r.clone()], &want[r], 0.0);
            }
        }

        dev.synchronize()?;
        let (free, total) = dev.mem_info()?;
        let report = json!({
            "device": dev.name(),
            "arch": dev.arch(),
            "init_and_nvrtc_compile_ms": init_ms,
            "total_ms": t0.elapsed().as_secs_f64() * 1e3,
            "mem_free_total_bytes": [free, total],
            "checks": rep.checks,
            "all_pass": rep.pass,
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&report).unwrap_or_default()
        );
        Ok(rep.pass)
    }
}
