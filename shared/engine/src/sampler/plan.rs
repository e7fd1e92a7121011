//! One sequence's sampling step as data: what a backend needs to sample on its own device
//! (penalty lists, the mask, the filters and the uniform for the draw), and the CPU rules that
//! [`super::sample`] applies with it. A device sampler follows the same rules, so an engine can
//! sample on either side and keep each sequence's RNG stream identical.

use super::{
    argmax, draw_with, token_logprob, SampleContext, SamplerState, SamplingParams, TokenLogprob,
};

/// Everything of a sampling step except the logits.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplePlan {
    /// Argmax after penalties and the mask (temperature ~0 or top_k == 1).
    pub greedy: bool,
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// Distinct prompt and output tokens (filled only with a repetition penalty).
    pub seen: Vec<u32>,
    /// Output token counts (filled only with a frequency or presence penalty).
    pub counts: Vec<(u32, u32)>,
    /// `logit_bias`: added to these tokens' logits first (ids are distinct).
    pub logit_bias: Vec<(u32, f32)>,
    /// Token ids masked to -inf (EOS and stop ids until `min_tokens`).
    pub masked: Vec<u32>,
    /// A grammar's allowed tokens as bitmask words (bit `t % 32` of word `t / 32`; a token
    /// past the words is not allowed): every other token is masked to -inf. None: no grammar.
    pub allowed: Option<Vec<u32>>,
    /// The draw's uniform in [0, 1), taken from the sequence's RNG (0 when greedy: a greedy
    /// step takes nothing from it).
    pub uniform: f64,
    /// Logprobs asked for: the token's and this many alternatives' (of the row as sampled:
    /// penalised, masked, and scaled unless greedy). None: none.
    pub logprobs: Option<usize>,
}

impl SamplePlan {
    /// The plan of the sequence's next token; takes the draw's uniform from its RNG unless
    /// the step is greedy (as the CPU sampler does).
    pub fn new(params: &SamplingParams, state: &mut SamplerState, ctx: &SampleContext<'_>) -> Self {
        let mut plan = Self::unmasked(params, state, ctx);
        plan.masked = masked_ids(params, state, ctx).collect();
        plan.logit_bias = params.logit_bias.clone();
        plan
    }

    /// Like [`SamplePlan::new`] with empty `masked` and `logit_bias`: the CPU sampler applies
    /// both straight from the parameters instead of copying them into every step's plan.
    pub(super) fn unmasked(
        params: &SamplingParams,
        state: &mut SamplerState,
        ctx: &SampleContext<'_>,
    ) -> Self {
        let seen = if params.repetition_penalty != 1.0 {
            let mut s = ctx.all_tokens.to_vec();
            s.sort_unstable();
            s.dedup();
            s
        } else {
            Vec::new()
        };
        let counts = if params.frequency_penalty != 0.0 || params.presence_penalty != 0.0 {
            state.output_counts.iter().map(|(&t, &c)| (t, c)).collect()
        } else {
            Vec::new()
        };
        let greedy = params.is_greedy();
        let uniform = if greedy { 0.0 } else { state.rng.next_f64() };
        SamplePlan {
            greedy,
            temperature: params.temperature,
            top_k: params.top_k,
            top_p: params.top_p,
            min_p: params.min_p,
            repetition_penalty: params.repetition_penalty,
            frequency_penalty: params.frequency_penalty,
            presence_penalty: params.presence_penalty,
            seen,
            counts,
            logit_bias: Vec::new(),
            masked: Vec::new(),
            allowed: None,
            uniform,
            logprobs: params.logprobs,
        }
    }

    /// The logit bias, penalties (repetition, then frequency / presence) and the masks, in
    /// place.
    pub fn penalize(&self, logits: &mut [f32]) {
        for &(t, bias) in &self.logit_bias {
            if let Some(x) = logits.get_mut(t as usize) {
                *x += bias;
            }
        }
        if self.repetition_penalty != 1.0 {
            for &t in &self.seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    if *l > 0.0 {
                        *l /= self.repetition_penalty;
                    } else {
                        *l *= self.repetition_penalty;
                    }
                }
            }
        }
        for &(t, c) in &self.counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= self.frequency_penalty * c as f32 + self.presence_penalty;
            }
        }
        mask_in_place(logits, self.masked.iter().copied());
        if let Some(words) = &self.allowed {
            for (t, l) in logits.iter_mut().enumerate() {
                let word = words.get(t / 32).copied().unwrap_or(0);
                if word & (1 << (t % 32)) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }

    /// Divides penalised logits by the temperature in place (not for greedy plans).
    pub fn scale(&self, logits: &mut [f32]) {
        let inv_t = 1.0 / self.temperature;
        for x in logits.iter_mut() {
            *x *= inv_t;
        }
    }

    /// The token of penalised (and, unless greedy, scaled) logits.
    pub fn choose(&self, prepared: &[f32]) -> u32 {
        if self.greedy {
            argmax(prepared)
        } else {
            draw_with(prepared, self.top_k, self.top_p, self.min_p, self.uniform)
        }
    }

    /// The whole CPU rule on a raw logits row: what a device sampler must reproduce.
    pub fn sample_row(&self, logits: &[f32]) -> u32 {
        self.sample_row_with_logprobs(logits).0
    }

    /// [`SamplePlan::sample_row`] with the logprobs the plan asks for, as the CPU sampler
    /// computes them (log-softmax of the row as sampled).
    pub fn sample_row_with_logprobs(&self, logits: &[f32]) -> (u32, Option<TokenLogprob>) {
        let mut l = logits.to_vec();
        self.penalize(&mut l);
        if !self.greedy {
            self.scale(&mut l);
        }
        let token = self.choose(&l);
        (token, self.logprobs.map(|k| token_logprob(&l, token, k)))
    }
}

/// The ids masked at this step: EOS and the stop token ids until `min_tokens` are generated.
pub(super) fn masked_ids<'a>(
    params: &'a SamplingParams,
    state: &SamplerState,
    ctx: &SampleContext<'a>,
) -> impl Iterator<Item = u32> + 'a {
    let active = state.num_generated() < params.min_tokens;
    let (eos, stop): (&[u32], &[u32]) = if active {
        (ctx.eos_token_ids, &params.stop_token_ids)
    } else {
        (&[], &[])
    };
    eos.iter().chain(stop).copied()
}

/// Sets the logits of `ids` to -inf (ids outside the row are ignored).
pub(super) fn mask_in_place(logits: &mut [f32], ids: impl Iterator<Item = u32>) {
    for t in ids {
        if let Some(x) = logits.get_mut(t as usize) {
            *x = f32::NEG_INFINITY;
        }
    }
}
