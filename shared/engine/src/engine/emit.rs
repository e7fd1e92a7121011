//! One sampled token: draw it from the logits row (or the RNG), run the stop checks and the
//! detokenizer, and send the output (or end the sequence).

use super::core::{output, Core};
use crate::backend::DeviceSample;
use crate::request::{FinishReason, RequestOutput, StopReason};
use crate::sampler::guide::GuideError;
use crate::sampler::{
    record_device_sample, sample, sample_without_logits, SampleContext, Sampled, SamplingParams,
    TokenLogprob,
};
use crate::sequence::{SeqId, Sequence};
use crate::tokenizer::Tokenizer;

impl Core {
    pub(super) fn sample_and_emit(&mut self, id: SeqId, row: Option<&[f32]>) {
        match self.draw(id, row) {
            Some(Ok(sampled)) => self.emit_sampled(id, sampled),
            Some(Err(e)) => {
                if let Some(rid) = self.requests.request_of(id).map(str::to_owned) {
                    self.fail(&rid, Some(e.to_string()));
                }
            }
            None => {}
        }
    }

    /// Draws sequence `id`'s next token from its row (None: the backend gave no logits),
    /// inside its grammar when it has one. None when the sequence is gone.
    fn draw(&mut self, id: SeqId, row: Option<&[f32]>) -> Option<Result<Sampled, GuideError>> {
        let vocab = self.backend.vocab_size();
        let eos = &self.cfg.eos_token_ids;
        let seq = self.sched.get_mut(id)?;
        let masked: Vec<f32>;
        let row: &[f32] = match (seq.guide.as_mut(), row) {
            (Some(guide), row) => {
                // Without logits (a simulated backend), uniform over what the grammar allows.
                let mut m = row.map_or_else(|| vec![0.0; vocab], <[f32]>::to_vec);
                if let Err(e) = guide.mask_logits(&mut m) {
                    return Some(Err(e));
                }
                masked = m;
                &masked
            }
            (None, Some(r)) => r,
            (None, None) => return Some(Ok(sample_without_logits(vocab, &mut seq.sampler))),
        };
        let ctx = SampleContext {
            all_tokens: &seq.tokens,
            eos_token_ids: eos,
        };
        let sampled = sample(row, &seq.params, &mut seq.sampler, &ctx);
        if let Some(guide) = seq.guide.as_mut() {
            if let Err(e) = guide.advance(sampled.token) {
                return Some(Err(e));
            }
        }
        Some(Ok(sampled))
    }

    /// Emits a token the backend sampled on its device (with the plan taken before the step,
    /// inside its grammar's mask when it has one; its guide has followed the token already,
    /// `Core::advance_guides`).
    pub(super) fn emit_device_sample(&mut self, id: SeqId, sample: DeviceSample) {
        let Some(seq) = self.sched.get_mut(id) else {
            return;
        };
        let sampled = record_device_sample(&mut seq.sampler, sample.token, sample.logprob);
        self.emit_sampled(id, sampled);
    }

    /// Appends a sampled token: stop checks, detokenizing, and the output (or the end).
    fn emit_sampled(&mut self, id: SeqId, sampled: Sampled) {
        let tokenizer = self.tokenizer.clone();
        let Some(seq) = self.sched.get_mut(id) else {
            return;
        };
        let (o, finish) = append_token(seq, sampled, &self.cfg.eos_token_ids, tokenizer.as_deref());
        match finish {
            Some(reason) => self.finish(id, reason, o),
            // A prefill-only sequence stops here and continues elsewhere.
            None if self.prefills.contains(id) => {
                self.finish_seq(id, FinishReason::Migrated, o, true)
            }
            None => {
                let rid = o.request_id.clone();
                let sent = self
                    .requests
                    .stream_of(&rid)
                    .is_some_and(|tx| self.outbox.push(tx, o));
                if !sent {
                    // Nobody listens any more: stop spending compute on it.
                    self.abort(&rid);
                }
            }
        }
    }
}

/// Appends `sampled` to `seq`: its output (token, logprob, text) and, when it ends the
/// sequence, why.
fn append_token(
    seq: &mut Sequence,
    sampled: Sampled,
    eos: &[u32],
    tokenizer: Option<&Tokenizer>,
) -> (RequestOutput, Option<FinishReason>) {
    crate::failpoints::panic_request(&seq.request_id);
    crate::failpoints::stall_request(&seq.request_id, seq.num_generated());
    let tok = sampled.token;
    seq.tokens.push(tok);
    let mut o = output(&seq.request_id, seq.index);
    o.token_ids.push(tok);
    o.logprobs.extend::<Option<TokenLogprob>>(sampled.logprob);
    o.stop_reason = stop_token(&seq.params, eos, tok);
    let mut finish = o.stop_reason.as_ref().map(|_| FinishReason::Stop);
    if let (None, Some(tk)) = (finish, tokenizer) {
        if let Some(m) = detokenize(seq, tk, tok, &mut o) {
            finish = Some(FinishReason::Stop);
            o.stop_reason = Some(StopReason::String(m));
        }
    }
    if finish.is_none() && seq.num_generated() >= seq.max_tokens {
        finish = Some(FinishReason::Length);
    }
    if finish.is_some() && !matches!(o.stop_reason, Some(StopReason::String(_))) {
        release_held_text(seq, tokenizer, &mut o);
    }
    (o, finish)
}

/// The stop reason when `tok` is an EOS (unless `ignore_eos`) or a stop token id (sorted,
/// see `core::normalized`).
fn stop_token(params: &SamplingParams, eos: &[u32], tok: u32) -> Option<StopReason> {
    if eos.contains(&tok) && !params.ignore_eos {
        Some(StopReason::Eos(tok))
    } else if params.stop_token_ids.binary_search(&tok).is_ok() {
        Some(StopReason::TokenId(tok))
    } else {
        None
    }
}

/// Detokenizes `tok` into `o.text` through the stop-string matcher; returns the stop string
/// it completed, if any. Like vLLM, stop strings only count once min_tokens are generated.
fn detokenize(
    seq: &mut Sequence,
    tk: &Tokenizer,
    tok: u32,
    o: &mut RequestOutput,
) -> Option<String> {
    let dec = seq.decoder.as_mut()?;
    let delta = dec.push(tk, tok).unwrap_or_else(|e| {
        tracing::warn!("detokenizing token {tok}: {e}");
        String::new()
    });
    let f = if seq.num_generated() < seq.params.min_tokens {
        seq.stop.pass(&delta)
    } else {
        seq.stop.feed(&delta)
    };
    o.text = f.emit;
    f.matched
}

/// Releases held-back text at the end: the incomplete tail of the detokenizer, then whatever
/// the stop matcher kept as a possible (now never completed) stop string.
fn release_held_text(seq: &mut Sequence, tokenizer: Option<&Tokenizer>, o: &mut RequestOutput) {
    if let (Some(dec), Some(tk)) = (seq.decoder.as_mut(), tokenizer) {
        if let Ok(rest) = dec.flush(tk) {
            let f = seq.stop.feed(&rest);
            o.text.push_str(&f.emit);
        }
    }
    o.text.push_str(&seq.stop.flush());
}
