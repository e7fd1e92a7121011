//! Argmax and sampling on the device against the host rules.

use tandem_engine::backend::cuda::kernels::Float16;
use tandem_engine::backend::cuda::ops::ArgmaxScratch;
use tandem_engine::backend::cuda::sampling::SamplingInputs;
use tandem_engine::backend::cuda::CudaDevice;
use tandem_engine::error::EngineError;
use tandem_engine::sampler::SamplePlan;

use super::common::*;

/// The CPU's argmax rule: strict `>` in index order, so the lowest index wins a tie and NaN
/// never wins (as an f32, for the report).
fn host_argmax(row: &[f32]) -> f32 {
    let mut best = 0;
    for (i, x) in row.iter().enumerate() {
        if *x > row[best] {
            best = i;
        }
    }
    best as f32
}

/// Sampling at temperature 1 with no filter or penalty (tests change what they exercise).
fn plain_plan() -> SamplePlan {
    SamplePlan {
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
        logit_bias: Vec::new(),
        masked: Vec::new(),
        allowed: None,
        uniform: 0.0,
        logprobs: None,
    }
}

/// A grammar's bitmask allowing `tokens`, `words` words long.
fn allow_only(tokens: impl IntoIterator<Item = usize>, words: usize) -> Vec<u32> {
    let mut w = vec![0u32; words];
    for t in tokens {
        w[t / 32] |= 1 << (t % 32);
    }
    w
}

/// Device argmax (with a planted tie) and device sampling against SamplePlan::sample_row.
pub(crate) fn argmax_and_sampling(cx: &mut Ctx) -> Result<(), EngineError> {
    let Ctx { dev, rep, rng } = cx;
    // Device argmax over vocabulary-sized rows, with a planted tie (lowest index wins).
    {
        const V: usize = 151_936;
        let rows = 5;
        let mut logits = rng.vec(rows * V);
        logits[2 * V + 70_000] = 50.0;
        logits[2 * V + 90_000] = 50.0;
        logits[4 * V + V - 1] = 60.0;
        let want: Vec<f32> = logits.chunks_exact(V).map(host_argmax).collect();
        let dl = dev.upload(&logits)?;
        let mut ids = dev.zeros::<i32>(rows)?;
        let mut scratch = ArgmaxScratch::new(dev, rows)?;
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
    // uniforms: penalties, mask, grammar masks, greedy, temperature, top-k, top-p, min-p and
    // mixes, on
    // vocabulary-sized rows, 8 uniforms per plan.
    {
        const V: usize = 151_936;
        let base = plain_plan();
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
                "grammar mask: 100 tokens allowed, temperature 0.8 + top_p 0.9",
                with(&|p| {
                    p.temperature = 0.8;
                    p.top_p = 0.9;
                    p.allowed = Some(allow_only((0..100).map(|i| i * 1511 % V), V.div_ceil(32)));
                }),
            ),
            (
                "greedy + short grammar mask (tokens past its 40 words forbidden)",
                with(&|p| {
                    p.greedy = true;
                    p.allowed = Some(allow_only([3, 700, 1201], 40));
                }),
            ),
            (
                "logit bias (+9 on three tokens, -100 on token 0) + temperature 0.9",
                with(&|p| {
                    p.temperature = 0.9;
                    p.logit_bias = vec![(5, 9.0), (77_777, 9.0), (151_000, 9.0), (0, -100.0)];
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
        // Logprobs on some rows: none, the token's only, 3, and the API's most (20).
        for (i, p) in plans.iter_mut().enumerate() {
            p.logprobs = [None, Some(0), Some(3), Some(20)][i % 4];
        }
        let rows = plans.len();
        let want: Vec<f32> = plans
            .iter()
            .zip(logits.chunks_exact(V))
            .map(|(p, r)| p.sample_row(r) as f32)
            .collect();
        let mut inputs = SamplingInputs::new(dev)?;
        let refs: Vec<&SamplePlan> = plans.iter().collect();
        inputs.fill(dev, &refs, V)?;
        let mut dl = dev.upload(&logits)?;
        let mut ids = dev.zeros::<i32>(rows)?;
        dev.sample_rows(&mut ids, &mut dl, rows, V, &inputs)?;
        let got: Vec<f32> = dev.download(&ids)?.into_iter().map(|i| i as f32).collect();
        for (k, (name, _)) in kinds.iter().enumerate() {
            let r = k * per..(k + 1) * per;
            rep.add("sample_rows", name, &got[r.clone()], &want[r], 0.0);
        }
        // row_logprobs (launched with sample_rows) against the CPU's log-softmax of the same
        // processed rows: values within 1e-4, alternatives' ids exactly.
        let lps = inputs.logprobs(dev, &refs)?;
        for (k, (name, _)) in kinds.iter().enumerate() {
            let (mut gv, mut wv, mut gi, mut wi) = (vec![], vec![], vec![], vec![]);
            for row in k * per..(k + 1) * per {
                let (_, want_lp) =
                    plans[row].sample_row_with_logprobs(&logits[row * V..(row + 1) * V]);
                match (&lps[row], want_lp) {
                    (Some(g), Some(w)) => {
                        gv.push(g.token);
                        wv.push(w.logprob);
                        gv.extend(g.top.iter().map(|t| t.1));
                        wv.extend(w.top.iter().map(|t| t.1));
                        gi.extend(g.top.iter().map(|t| t.0 as f32));
                        wi.extend(w.top.iter().map(|t| t.0 as f32));
                    }
                    (None, None) => {}
                    // A row with logprobs on one side only: a length mismatch fails the check.
                    _ => gv.push(f32::NAN),
                }
            }
            rep.add("row_logprobs", &format!("{name}: logprobs"), &gv, &wv, 1e-4);
            rep.add("row_logprobs", &format!("{name}: top ids"), &gi, &wi, 0.0);
        }
    }
    Ok(())
}

/// The f16 program's overflow check: rows whose logits hold NaN or +inf give -1 from the device
/// argmax and from greedy and temperature sampling, finite rows (with -inf entries, as masking
/// writes) their token; the bf16 program keeps the CPU's rule for the same rows (NaN never
/// wins, +inf does).
pub(crate) fn f16_overflow_rows(cx: &mut Ctx) -> Result<(), EngineError> {
    const V: usize = 151_936;
    let Ctx { dev, rep, rng } = cx;
    let dev16 = CudaDevice::with_float16(0, Float16::F16)?;
    // Rows: finite (max at 1234), one NaN, one +inf (at 77), finite with -inf entries (max 99).
    let mut logits = rng.vec(4 * V);
    logits[1234] = 40.0;
    logits[V + 5000] = f32::NAN;
    logits[2 * V + 77] = f32::INFINITY;
    logits[3 * V + 99] = 40.0;
    logits[3 * V + 10..3 * V + 20].fill(f32::NEG_INFINITY);
    // The CPU rule (strict >, so NaN never wins), for the bf16 program.
    let host: Vec<f32> = logits.chunks_exact(V).map(host_argmax).collect();
    for (name, d, want) in [
        ("f16 program", &dev16, vec![1234.0f32, -1.0, -1.0, 99.0]),
        ("bf16 program", &*dev, host),
    ] {
        let dl = d.upload(&logits)?;
        let mut ids = d.zeros::<i32>(4)?;
        let mut scratch = ArgmaxScratch::new(d, 4)?;
        d.argmax(&mut ids, &dl, 4, V, &mut scratch)?;
        let got: Vec<f32> = d.download(&ids)?.into_iter().map(|i| i as f32).collect();
        rep.add("argmax overflow check", name, &got, &want, 0.0);
    }
    for (kind, greedy, temperature) in [("greedy", true, 1.0f32), ("temperature 0.8", false, 0.8)] {
        let plan = SamplePlan {
            greedy,
            temperature,
            uniform: 0.5,
            ..plain_plan()
        };
        let plans = [&plan, &plan, &plan, &plan];
        let mut inputs = SamplingInputs::new(&dev16)?;
        inputs.fill(&dev16, &plans, V)?;
        let mut dl = dev16.upload(&logits)?;
        let mut ids = dev16.zeros::<i32>(4)?;
        dev16.sample_rows(&mut ids, &mut dl, 4, V, &inputs)?;
        let got: Vec<i32> = dev16.download(&ids)?;
        // Bad rows flagged; finite rows give a real token (the greedy one exactly).
        let token = |i: i32| (0..V as i32).contains(&i);
        let ok = got[1] == -1
            && got[2] == -1
            && token(got[0])
            && token(got[3])
            && (!greedy || (got[0] == 1234 && got[3] == 99));
        rep.flag(
            "sample_rows overflow check",
            &format!("f16 program, {kind}"),
            ok,
            serde_json::json!(got),
        );
    }
    Ok(())
}
