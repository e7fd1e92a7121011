//! Argmax and sampling on the device against the host rules.

use tandem_engine::backend::cuda::ops::ArgmaxScratch;
use tandem_engine::backend::cuda::sampling::SamplingInputs;
use tandem_engine::error::EngineError;
use tandem_engine::sampler::SamplePlan;

use super::common::*;

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
        let mut inputs = SamplingInputs::new(dev)?;
        let refs: Vec<&SamplePlan> = plans.iter().collect();
        inputs.fill(dev, &refs)?;
        let mut dl = dev.upload(&logits)?;
        let mut ids = dev.zeros::<i32>(rows)?;
        dev.sample_rows(&mut ids, &mut dl, rows, V, &inputs)?;
        let got: Vec<f32> = dev.download(&ids)?.into_iter().map(|i| i as f32).collect();
        for (k, (name, _)) in kinds.iter().enumerate() {
            let r = k * per..(k + 1) * per;
            rep.add("sample_rows", name, &got[r.clone()], &want[r], 0.0);
        }
    }
    Ok(())
}
