//! Admission checks of a request against the engine's limits (vocabulary, lengths, the pool,
//! beam width, stop strings), before anything is scheduled.

use super::core::Core;
use crate::error::EngineError;
use crate::kv::block_manager::HashContext;
use crate::kv::hash::CacheSalt;
use crate::request::MediaEmbedding;
use crate::sampler::SamplingParams;

impl Core {
    /// Refuses new work while the engine holds `request_limit` requests (running and waiting,
    /// decode reservations included).
    pub(super) fn check_request_limit(&self) -> Result<(), EngineError> {
        match self.cfg.request_limit {
            Some(limit) if self.requests.len() + self.leases.len() >= limit => {
                Err(EngineError::Overloaded { limit })
            }
            _ => Ok(()),
        }
    }

    /// Checks a request against the engine's limits; returns the resolved max_tokens.
    pub(super) fn validate(
        &self,
        request_id: &str,
        prompt: &[u32],
        params: &SamplingParams,
    ) -> Result<usize, EngineError> {
        if self.requests.contains(request_id) {
            return Err(EngineError::DuplicateRequest(request_id.to_owned()));
        }
        self.validate_prompt(prompt, params)
    }

    /// The hash context of a prompt with `media` embeddings under `salt`, once the embeddings
    /// are checked: each span lies inside the prompt, spans do not overlap, and each holds
    /// `span.len` rows of the model's hidden size (a backend that cannot splice embeddings
    /// refuses any).
    pub(super) fn media_context(
        &self,
        prompt: &[u32],
        salt: Option<CacheSalt>,
        media: &[MediaEmbedding],
    ) -> Result<HashContext, EngineError> {
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        if media.is_empty() {
            return Ok(HashContext::salted(salt));
        }
        let Some(hidden) = self.backend.media_embedding_width() else {
            return bad("this backend does not take media (image) embeddings".into());
        };
        for (i, m) in media.iter().enumerate() {
            if m.span.start.saturating_add(m.span.len) > prompt.len() {
                return bad(format!(
                    "media item {i}: span {}..+{} ends past the prompt ({} tokens)",
                    m.span.start,
                    m.span.len,
                    prompt.len()
                ));
            }
            if Some(m.data.len()) != m.span.len.checked_mul(hidden) {
                return bad(format!(
                    "media item {i}: {} values are not {} rows of the hidden size {hidden}",
                    m.data.len(),
                    m.span.len
                ));
            }
        }
        HashContext::new(salt, media.iter().map(|m| m.span).collect())
            .map_err(|e| EngineError::InvalidRequest(e.to_string()))
    }

    /// The checks of [`Core::validate`] that do not depend on a request id.
    pub(super) fn validate_prompt(
        &self,
        prompt: &[u32],
        params: &SamplingParams,
    ) -> Result<usize, EngineError> {
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        params.validate()?;
        let width = params.beam_width();
        if width > self.cfg.max_beam_width {
            return bad(format!(
                "the beam width ({width}) exceeds the engine's max_beam_width ({})",
                self.cfg.max_beam_width
            ));
        }
        if width > self.cfg.max_batch_size {
            return bad(format!(
                "the beam width ({width}) exceeds max_batch_size ({})",
                self.cfg.max_batch_size
            ));
        }
        if prompt.is_empty() {
            return bad("the prompt is empty".into());
        }
        let vocab = self.backend.vocab_size();
        if let Some(t) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return bad(format!("token id {t} is outside the vocabulary ({vocab})"));
        }
        if let Some(t) = params.stop_token_ids.iter().find(|&&t| t as usize >= vocab) {
            return bad(format!(
                "stop_token_ids: {t} is outside the vocabulary ({vocab})"
            ));
        }
        if let Some((t, _)) = params.logit_bias.iter().find(|(t, _)| *t as usize >= vocab) {
            return bad(format!(
                "logit_bias: {t} is outside the vocabulary ({vocab})"
            ));
        }
        if !params.stop.is_empty() && self.tokenizer.is_none() {
            return bad("stop strings need a tokenizer, and this engine has none".into());
        }
        let max_seq_len = self.cfg.max_seq_len;
        if prompt.len() >= max_seq_len {
            return bad(format!(
                "the prompt has {} tokens; max_seq_len is {max_seq_len}, leaving no room to \
                 generate",
                prompt.len()
            ));
        }
        // Without max_tokens, a request may run up to max_seq_len, or as far as the whole pool
        // can hold it, whichever is less: a small pool must not turn every request without
        // max_tokens into an error.
        let pool_tokens = self.cfg.num_blocks.saturating_mul(self.cfg.kv_block_size);
        let max_tokens = params.max_tokens.unwrap_or_else(|| {
            max_seq_len
                .min(pool_tokens)
                .saturating_sub(prompt.len())
                .max(1)
        });
        // max_tokens comes from a client (up to u64::MAX over gRPC): no sum may overflow.
        let total = prompt.len().saturating_add(max_tokens);
        if total > max_seq_len {
            return bad(format!(
                "prompt ({} tokens) + max_tokens ({max_tokens}) exceeds max_seq_len \
                 ({max_seq_len})",
                prompt.len(),
            ));
        }
        // Beams share their prefix, but each may grow to the full length alone.
        let need = self.sched.blocks().blocks_for(total).saturating_mul(width);
        if need > self.cfg.num_blocks {
            return bad(format!(
                "prompt + max_tokens needs {need} KV blocks{}; the pool has {}",
                if width > 1 {
                    format!(" ({width} beams)")
                } else {
                    String::new()
                },
                self.cfg.num_blocks
            ));
        }
        if !self.cfg.enable_chunked_prefill && prompt.len() > self.cfg.max_num_tokens {
            return bad(format!(
                "the prompt ({} tokens) exceeds max_num_tokens ({}) and chunked prefill is off",
                prompt.len(),
                self.cfg.max_num_tokens
            ));
        }
        Ok(max_tokens)
    }
}
