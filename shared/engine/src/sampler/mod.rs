//! Token sampling: penalties, masking, temperature, top-k / top-p / min-p filtering, seeded
//! draws and logprobs.
//!
//! Order of operations for one step (the vLLM order):
//! 0. `logit_bias` added to the raw logits (a structured-output grammar's mask, applied by the
//!    engine before this, has already set what it forbids to -inf);
//! 1. repetition, frequency and presence penalties;
//! 2. until `min_tokens` are generated, EOS and stop token ids are masked to -inf;
//! 3. greedy: argmax. Otherwise divide by the temperature, then keep the top-k, then the
//!    smallest top-p nucleus, then drop tokens below `min_p * p_max`, and draw from what is
//!    left, renormalised, with the sequence's own [`Rng`].
//!
//! **Logprobs** are the log-softmax of the logits after steps 1–2 and the temperature (the
//! distribution the draw is made from before the truncating filters), so they are finite for
//! every token and sum to one over the vocabulary. For greedy requests no temperature applies.
//!
//! Each draw consumes exactly one `f64` from the sequence's RNG, so the RNG position is simply
//! the number of sampled tokens and can be exported with the rest of [`SamplerState`].

pub mod guide;
pub mod plan;
pub mod rng;

pub use tandem_text::{params, stop};

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use params::SamplingParams;
pub use plan::SamplePlan;
pub use rng::Rng;
pub use stop::{StopFeed, StopMatcher};

/// The mutable per-sequence sampling state, exported with a request so another engine can
/// continue it exactly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "SamplerStateParts")]
pub struct SamplerState {
    pub rng: Rng,
    /// How often each token occurs in the output (for frequency / presence penalties).
    /// Change it through [`SamplerState::record`], which keeps the total in step.
    pub output_counts: BTreeMap<u32, u32>,
    /// Output tokens of those that an earlier engine generated (a migrated request's
    /// replay): penalised like the rest, not counted toward `min_tokens`, which (like
    /// `max_tokens`) then counts the tokens still to come.
    #[serde(default)]
    pub replayed: usize,
    /// The sum of `output_counts`, kept by `record`: sampling asks how many tokens were
    /// generated at every step of every sequence (`min_tokens`), and summing a long
    /// output's counts each time cost ~1 ms a step at 256 sequences.
    #[serde(skip)]
    recorded: usize,
}

/// [`SamplerState`] as serialized: the total is recounted when read.
#[derive(Deserialize)]
struct SamplerStateParts {
    rng: Rng,
    output_counts: BTreeMap<u32, u32>,
    #[serde(default)]
    replayed: usize,
}

impl From<SamplerStateParts> for SamplerState {
    fn from(p: SamplerStateParts) -> Self {
        Self::from_parts(p.rng, p.output_counts, p.replayed)
    }
}

impl SamplerState {
    pub fn new(seed: u64, index: u64) -> Self {
        Self::from_parts(Rng::for_stream(seed, index), BTreeMap::new(), 0)
    }

    /// A state from its parts (another engine's export).
    pub fn from_parts(rng: Rng, output_counts: BTreeMap<u32, u32>, replayed: usize) -> Self {
        let recorded = output_counts.values().map(|&c| c as usize).sum();
        Self {
            rng,
            output_counts,
            replayed,
            recorded,
        }
    }

    /// The state after `output` was sampled under `params` from `seed` (a request migrated
    /// by replay: its output so far comes back as the end of the prompt). Each non-greedy
    /// draw took one `f64` from the RNG; greedy draws took none. The output counts for the
    /// penalties; `min_tokens` counts from here.
    pub fn replayed(seed: u64, index: u64, params: &SamplingParams, output: &[u32]) -> Self {
        let mut state = Self::new(seed, index);
        for &token in output {
            if !params.is_greedy() {
                state.rng.next_f64();
            }
            state.record(token);
        }
        state.replayed = output.len();
        state
    }

    pub fn record(&mut self, token: u32) {
        *self.output_counts.entry(token).or_insert(0) += 1;
        self.recorded += 1;
    }

    /// Tokens sampled since the request (or its replay) started.
    pub fn num_generated(&self) -> usize {
        self.recorded - self.replayed.min(self.recorded)
    }
}

pub use tandem_text::TokenLogprob;

/// One sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: Option<TokenLogprob>,
}

/// What the sampler needs to know about the sequence beyond its state.
pub struct SampleContext<'a> {
    /// Prompt and output tokens so far (for the repetition penalty).
    pub all_tokens: &'a [u32],
    /// Tokens masked while fewer than `min_tokens` were generated (EOS and stop ids).
    pub eos_token_ids: &'a [u32],
}

fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let lse = max as f64 + sum.ln();
    logits.iter().map(|&l| (l as f64 - lse) as f32).collect()
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &l) in logits.iter().enumerate() {
        // Strict comparison keeps the lowest id among ties; NaN never wins.
        if l > logits[best] || logits[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

/// The `k` most likely tokens of a logits row with their log-probabilities (log-softmax of
/// the raw row), most likely first, ties to the lowest id: a beam's candidates.
pub fn top_k_logprobs(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    top_logprobs(&log_softmax(logits), k)
}

/// `token`'s logprob and the `k` most likely alternatives of a row as sampled (penalised,
/// masked, scaled): its log-softmax.
fn token_logprob(row: &[f32], token: u32, k: usize) -> TokenLogprob {
    let lp = log_softmax(row);
    TokenLogprob {
        token,
        logprob: lp.get(token as usize).copied().unwrap_or(f32::NEG_INFINITY),
        top: top_logprobs(&lp, k),
    }
}

fn top_logprobs(lp: &[f32], k: usize) -> Vec<(u32, f32)> {
    if k == 0 {
        return Vec::new();
    }
    let mut idx: Vec<u32> = (0..lp.len() as u32).collect();
    let k = k.min(idx.len());
    let cmp = |a: &u32, b: &u32| lp[*b as usize].total_cmp(&lp[*a as usize]).then(a.cmp(b));
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
    }
    idx.sort_by(cmp);
    idx.into_iter().map(|t| (t, lp[t as usize])).collect()
}

/// Samples one token from one row of logits.
pub fn sample(
    logits: &[f32],
    params: &SamplingParams,
    state: &mut SamplerState,
    ctx: &SampleContext<'_>,
) -> Sampled {
    let plan = SamplePlan::unmasked(params, state, ctx);
    let mut l = logits.to_vec();
    for &(t, bias) in &params.logit_bias {
        if let Some(x) = l.get_mut(t as usize) {
            *x += bias;
        }
    }
    plan.penalize(&mut l);
    plan::mask_in_place(&mut l, plan::masked_ids(params, state, ctx));
    if !plan.greedy {
        plan.scale(&mut l);
    }
    let token = plan.choose(&l);
    let logprob = params.logprobs.map(|k| token_logprob(&l, token, k));
    state.record(token);
    Sampled { token, logprob }
}

/// Records a token sampled elsewhere (on a backend's device, with `plan`, and its logprobs
/// when the plan asked for them) in the state, as [`sample`] does for its own.
pub fn record_device_sample(
    state: &mut SamplerState,
    token: u32,
    logprob: Option<TokenLogprob>,
) -> Sampled {
    state.record(token);
    Sampled { token, logprob }
}

/// Draws a token for a backend that returned no logits (the simulator): uniform over the
/// vocabulary from the sequence's RNG, so it is still reproducible from the seed.
pub fn sample_without_logits(vocab_size: usize, state: &mut SamplerState) -> Sampled {
    let token = state.rng.below(vocab_size.max(1) as u64) as u32;
    state.record(token);
    Sampled {
        token,
        logprob: None,
    }
}

/// Draws from temperature-scaled logits after the truncating filters, with uniform `u`.
fn draw_with(scaled: &[f32], top_k: usize, top_p: f32, min_p: f32, u: f64) -> u32 {
    let max = scaled.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        // Everything masked: nothing sensible to draw; fall back to the lowest id.
        return 0;
    }
    let filtered = top_k > 0 || top_p < 1.0 || min_p > 0.0;
    if !filtered {
        // Inverse CDF in token-id order over the full vocabulary.
        let probs: Vec<f64> = scaled.iter().map(|&x| ((x - max) as f64).exp()).collect();
        return pick(
            &probs,
            (0..scaled.len() as u32).collect::<Vec<_>>().as_slice(),
            u,
        );
    }
    let mut cand: Vec<u32> = (0..scaled.len() as u32)
        .filter(|&i| scaled[i as usize] > f32::NEG_INFINITY)
        .collect();
    let cmp = |a: &u32, b: &u32| {
        scaled[*b as usize]
            .total_cmp(&scaled[*a as usize])
            .then(a.cmp(b))
    };
    if top_k > 0 && top_k < cand.len() {
        cand.select_nth_unstable_by(top_k - 1, cmp);
        cand.truncate(top_k);
    }
    cand.sort_by(cmp);
    let mut probs: Vec<f64> = cand
        .iter()
        .map(|&i| ((scaled[i as usize] - max) as f64).exp())
        .collect();
    let total: f64 = probs.iter().sum();
    if top_p < 1.0 {
        // Smallest prefix whose mass reaches top_p; always at least one token.
        let target = top_p as f64 * total;
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            acc += p;
            if acc >= target {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
        cand.truncate(keep);
    }
    if min_p > 0.0 {
        // probs[0] is the largest; relative threshold, so no renormalisation needed first.
        let thr = min_p as f64 * probs[0];
        let keep = probs.iter().take_while(|&&p| p >= thr).count().max(1);
        probs.truncate(keep);
        cand.truncate(keep);
    }
    pick(&probs, &cand, u)
}

/// Inverse-CDF pick of `ids[i]` with unnormalised weights `probs[i]` for uniform `u`.
fn pick(probs: &[f64], ids: &[u32], u: f64) -> u32 {
    let total: f64 = probs.iter().sum();
    let target = u * total;
    let mut acc = 0.0;
    let mut last = ids[0];
    for (p, &id) in probs.iter().zip(ids) {
        if *p <= 0.0 {
            continue;
        }
        acc += p;
        last = id;
        if target < acc {
            return id;
        }
    }
    last
}

#[cfg(test)]
mod tests;
