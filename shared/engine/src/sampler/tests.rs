use super::*;

const DRAWS: usize = 40_000;

fn logits_of(probs: &[f64]) -> Vec<f32> {
    probs.iter().map(|p| p.ln() as f32).collect()
}

fn freqs(logits: &[f32], params: &SamplingParams, seed: u64) -> Vec<f64> {
    let mut st = SamplerState::new(seed, 0);
    let mut counts = vec![0usize; logits.len()];
    let ctx = SampleContext {
        all_tokens: &[],
        eos_token_ids: &[],
    };
    for _ in 0..DRAWS {
        // A fresh count map each draw keeps penalties out of the picture.
        st.output_counts.clear();
        counts[sample(logits, params, &mut st, &ctx).token as usize] += 1;
    }
    counts.iter().map(|&c| c as f64 / DRAWS as f64).collect()
}

fn assert_close(got: &[f64], want: &[f64]) {
    for (g, w) in got.iter().zip(want) {
        // 40k draws: standard error <= 0.0025; allow 4 sigma.
        assert!((g - w).abs() < 0.01, "got {got:?}, want {want:?}");
    }
}

fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
    let mut p = SamplingParams::default();
    f(&mut p);
    p
}

const P: [f64; 4] = [0.1, 0.2, 0.3, 0.4];

#[test]
fn temperature_one_matches_softmax() {
    assert_close(&freqs(&logits_of(&P), &params(|_| {}), 1), &P);
}

#[test]
fn temperature_two_flattens() {
    let s: f64 = P.iter().map(|p| p.sqrt()).sum();
    let want: Vec<f64> = P.iter().map(|p| p.sqrt() / s).collect();
    assert_close(
        &freqs(&logits_of(&P), &params(|p| p.temperature = 2.0), 2),
        &want,
    );
}

#[test]
fn top_p_keeps_the_nucleus() {
    // Sorted: 0.4, 0.3 reach 0.7 >= 0.5; renormalised 4/7, 3/7.
    let got = freqs(&logits_of(&P), &params(|p| p.top_p = 0.5), 3);
    assert_close(&got, &[0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0]);
}

#[test]
fn top_k_and_min_p() {
    let got = freqs(&logits_of(&P), &params(|p| p.top_k = 3), 4);
    assert_close(&got, &[0.0, 2.0 / 9.0, 3.0 / 9.0, 4.0 / 9.0]);
    // min_p 0.6 → threshold 0.24: keeps 0.4 and 0.3.
    let got = freqs(&logits_of(&P), &params(|p| p.min_p = 0.6), 5);
    assert_close(&got, &[0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0]);
}

#[test]
fn greedy_is_argmax_with_lowest_id_on_ties() {
    let mut st = SamplerState::new(0, 0);
    let ctx = SampleContext {
        all_tokens: &[],
        eos_token_ids: &[],
    };
    let s = sample(
        &[1.0, 3.0, 3.0, 2.0],
        &SamplingParams::greedy(),
        &mut st,
        &ctx,
    );
    assert_eq!(s.token, 1);
}

#[test]
fn seed_reproducibility_and_independent_streams() {
    let l = logits_of(&[0.25; 4]);
    let ctx = SampleContext {
        all_tokens: &[],
        eos_token_ids: &[],
    };
    let run = |seed, idx| {
        let mut st = SamplerState::new(seed, idx);
        (0..64)
            .map(|_| sample(&l, &SamplingParams::default(), &mut st, &ctx).token)
            .collect::<Vec<_>>()
    };
    assert_eq!(run(9, 0), run(9, 0));
    assert_ne!(run(9, 0), run(10, 0));
    assert_ne!(run(9, 0), run(9, 1));
}

#[test]
fn exported_state_continues_identically() {
    let l = logits_of(&P);
    let p = params(|p| {
        p.frequency_penalty = 0.5;
        p.presence_penalty = 0.2;
        p.repetition_penalty = 1.3;
    });
    let mut st = SamplerState::new(77, 0);
    let mut toks: Vec<u32> = vec![3, 3];
    for _ in 0..10 {
        let ctx = SampleContext {
            all_tokens: &toks,
            eos_token_ids: &[],
        };
        let t = sample(&l, &p, &mut st, &ctx).token;
        toks.push(t);
    }
    let json = serde_json::to_string(&st).unwrap();
    let mut st2: SamplerState = serde_json::from_str(&json).unwrap();
    let mut toks2 = toks.clone();
    for _ in 0..20 {
        let a = sample(
            &l,
            &p,
            &mut st,
            &SampleContext {
                all_tokens: &toks,
                eos_token_ids: &[],
            },
        )
        .token;
        let b = sample(
            &l,
            &p,
            &mut st2,
            &SampleContext {
                all_tokens: &toks2,
                eos_token_ids: &[],
            },
        )
        .token;
        assert_eq!(a, b);
        toks.push(a);
        toks2.push(b);
    }
}

#[test]
fn penalties_follow_vllm_semantics() {
    let mut st = SamplerState::new(0, 0);
    st.record(2);
    st.record(2);
    let p = params(|p| {
        p.frequency_penalty = 0.5;
        p.presence_penalty = 0.25;
        p.repetition_penalty = 2.0;
    });
    let mut l = vec![1.0f32, -1.0, 4.0, 0.5];
    // Prompt contains token 1 (negative logit) and output contains 2 (positive).
    let ctx = SampleContext {
        all_tokens: &[1, 2, 2],
        eos_token_ids: &[],
    };
    SamplePlan::new(&p, &mut st, &ctx).penalize(&mut l);
    assert_eq!(l, vec![1.0, -2.0, 4.0 / 2.0 - 0.5 * 2.0 - 0.25, 0.5]);
}

/// A backend sampling on its device takes the plan (and its uniform) before the step and
/// applies `SamplePlan::sample_row_with_logprobs` there: the same tokens, logprobs and RNG
/// position as `sample` on the CPU, step after step, whatever the parameters.
#[test]
fn plan_then_sample_row_matches_sample() {
    let mut r = Rng::for_stream(7, 0);
    let cases = [
        params(|_| {}),
        params(|p| p.temperature = 0.0),
        params(|p| {
            p.top_k = 5;
            p.top_p = 0.7;
            p.min_p = 0.05;
            p.temperature = 0.8;
        }),
        params(|p| {
            p.repetition_penalty = 1.3;
            p.frequency_penalty = 0.4;
            p.presence_penalty = 0.2;
            p.min_tokens = 3;
            p.stop_token_ids = vec![4];
        }),
        params(|p| {
            p.temperature = 0.7;
            p.top_p = 0.9;
            p.repetition_penalty = 1.2;
            p.logprobs = Some(5);
        }),
        params(|p| {
            p.temperature = 0.0;
            p.logprobs = Some(0);
        }),
        params(|p| {
            p.logit_bias = vec![(2, 3.0), (9, -20.0)];
            p.logprobs = Some(2);
        }),
    ];
    for (i, p) in cases.iter().enumerate() {
        let mut cpu = SamplerState::new(11, i as u64);
        let mut dev = cpu.clone();
        let mut tokens = vec![1u32, 2, 3];
        for _ in 0..50 {
            let logits: Vec<f32> = (0..40).map(|_| (r.next_f64() * 6.0 - 3.0) as f32).collect();
            let ctx = SampleContext {
                all_tokens: &tokens,
                eos_token_ids: &[0],
            };
            let want = sample(&logits, p, &mut cpu, &ctx);
            let plan = SamplePlan::new(p, &mut dev, &ctx);
            let (token, logprob) = plan.sample_row_with_logprobs(&logits);
            let got = record_device_sample(&mut dev, token, logprob);
            assert_eq!(got.token, want.token, "case {i}");
            assert_eq!(got.logprob, want.logprob, "case {i}: logprobs");
            assert_eq!(got.logprob.is_some(), p.logprobs.is_some(), "case {i}");
            assert_eq!(dev, cpu, "case {i}: the states diverged");
            tokens.push(got.token);
        }
    }
}

#[test]
fn min_tokens_masks_eos_and_stop_ids() {
    let p = params(|p| {
        p.temperature = 0.0;
        p.min_tokens = 2;
        p.stop_token_ids = vec![1];
    });
    let mut st = SamplerState::new(0, 0);
    let l = [5.0f32, 4.0, 1.0];
    let ctx = SampleContext {
        all_tokens: &[],
        eos_token_ids: &[0],
    };
    assert_eq!(sample(&l, &p, &mut st, &ctx).token, 2);
    assert_eq!(sample(&l, &p, &mut st, &ctx).token, 2);
    assert_eq!(
        sample(&l, &p, &mut st, &ctx).token,
        0,
        "masking ends at min_tokens"
    );
}

#[test]
fn logprobs_are_normalised_and_sorted() {
    let p = params(|p| {
        p.temperature = 0.0;
        p.logprobs = Some(3);
    });
    let mut st = SamplerState::new(0, 0);
    let ctx = SampleContext {
        all_tokens: &[],
        eos_token_ids: &[],
    };
    let s = sample(&logits_of(&P), &p, &mut st, &ctx);
    let lp = s.logprob.unwrap();
    assert_eq!(lp.token, 3);
    assert!((lp.logprob - 0.4f32.ln()).abs() < 1e-5);
    let top: Vec<u32> = lp.top.iter().map(|x| x.0).collect();
    assert_eq!(top, vec![3, 2, 1]);
}

#[test]
fn no_logits_draw_is_seeded() {
    let mut a = SamplerState::new(5, 0);
    let mut b = SamplerState::new(5, 0);
    for _ in 0..10 {
        let x = sample_without_logits(100, &mut a).token;
        assert!(x < 100);
        assert_eq!(x, sample_without_logits(100, &mut b).token);
    }
}

#[test]
fn validate_rejects_bad_ranges() {
    assert!(params(|p| p.top_p = 0.0).validate().is_err());
    assert!(params(|p| p.temperature = -1.0).validate().is_err());
    assert!(params(|p| p.n = 0).validate().is_err());
    assert!(params(|p| p.max_tokens = Some(0)).validate().is_err());
    assert!(SamplingParams::default().validate().is_ok());
}

#[test]
fn tiny_temperature_is_greedy_not_overflow() {
    let mut st = SamplerState::new(0, 0);
    let ctx = SampleContext {
        all_tokens: &[],
        eos_token_ids: &[],
    };
    let p = params(|p| p.temperature = 1e-30);
    for _ in 0..10 {
        assert_eq!(sample(&[1.0, 30.0, 2.0], &p, &mut st, &ctx).token, 1);
    }
}

/// The generated count follows `record` and survives a round trip through serde (the
/// total is recounted from the output counts), replayed tokens not counted.
#[test]
fn the_generated_count_follows_records_and_serde() {
    let greedy = SamplingParams::greedy();
    let output = [5, 5, 9, 1, 5, 7, 9, 9, 2];
    for replayed in [0, 3] {
        let mut st = SamplerState::replayed(7, 0, &greedy, &output[..replayed]);
        for (k, &t) in output[replayed..].iter().enumerate() {
            assert_eq!(st.num_generated(), k, "replayed {replayed}");
            let back: SamplerState =
                serde_json::from_str(&serde_json::to_string(&st).unwrap()).unwrap();
            assert_eq!(back, st);
            assert_eq!(back.num_generated(), k);
            st.record(t);
        }
    }
}
