//! Moving a request between engine instances: export takes a sequence out with its KV bytes
//! and sampling state; import checks the layout, writes the KV into fresh blocks, registers
//! them for reuse and queues the sequence to continue exactly where it was.

use std::sync::Arc;

use tokio::sync::mpsc as tmpsc;

use super::core::{normalized, output, state_of, usage, Core};
use super::requests::{Entry, Sink};
use crate::error::EngineError;
use crate::kv::block_manager::HashContext;
use crate::request::{FinishReason, RequestOutput, RequestSnapshot, SequenceState};
use crate::sampler::guide::Guide;
use crate::sequence::{NewSequence, Sequence};

impl Core {
    pub(super) fn export(&mut self, request_id: &str) -> Result<RequestSnapshot, EngineError> {
        let e = self
            .requests
            .get(request_id)
            .ok_or_else(|| EngineError::UnknownRequest(request_id.to_owned()))?;
        if matches!(e.sink(), Sink::Prefill(_)) {
            return Err(EngineError::BadSnapshot(format!(
                "request {request_id:?} is a prefill; it hands its state over when done"
            )));
        }
        if self.beams.contains(request_id) {
            return Err(EngineError::BadSnapshot(format!(
                "request {request_id:?} is a beam search; it cannot be exported"
            )));
        }
        let &[id] = e.seqs() else {
            return Err(EngineError::BadSnapshot(format!(
                "request {request_id:?} has {} live choices; only n = 1 can be exported",
                e.seqs().len()
            )));
        };
        let mut seq = self
            .sched
            .take(id)
            .ok_or_else(|| EngineError::UnknownRequest(request_id.to_owned()))?;
        let nblocks = self.sched.blocks().blocks_for(seq.num_computed);
        let kv = match self.backend.export_blocks(&seq.table.ids()[..nblocks]) {
            Ok(kv) => kv,
            Err(err) => {
                // Leave the request running here.
                self.sched.add(seq);
                return Err(err);
            }
        };
        let state = state_of(&seq);
        self.sched.blocks_mut().release(&mut seq.table);
        if let Some(Sink::Stream(tx)) = self.requests.remove(request_id).as_ref().map(Entry::sink) {
            let mut o = output(request_id, seq.index);
            o.finish_reason = Some(FinishReason::Migrated);
            o.usage = Some(usage(&seq));
            self.outbox.push(tx, o);
        }
        Ok(RequestSnapshot {
            layout: self.backend.layout().clone(),
            state,
            kv,
        })
    }

    pub(super) fn import(
        &mut self,
        snap: RequestSnapshot,
        key: u64,
        out: tmpsc::UnboundedSender<RequestOutput>,
    ) -> Result<(), EngineError> {
        self.backend.layout().check_compatible(&snap.layout)?;
        let st = snap.state;
        let bad = |m: &str| Err(EngineError::BadSnapshot(m.to_owned()));
        if st.prompt_len == 0 || st.prompt_len > st.tokens.len() {
            return bad("prompt_len is 0 or beyond the tokens");
        }
        if st.num_computed >= st.tokens.len() {
            return bad("num_computed must leave the last token to compute");
        }
        self.check_continuable(&st)?;
        let guide = self.guide_for(&st.params, &st.tokens[st.prompt_len..])?;
        let bm = self.sched.blocks_mut();
        let nblocks = bm.blocks_for(st.num_computed);
        let want = nblocks * snap.layout.block_bytes();
        if snap.kv.len() != want {
            return Err(EngineError::BadSnapshot(format!(
                "KV data has {} bytes; {nblocks} blocks need {want}",
                snap.kv.len()
            )));
        }
        let num_computed = st.num_computed;
        let (mut seq, request_id) = self.continued_sequence(st, guide);
        let bm = self.sched.blocks_mut();
        bm.ensure_capacity(&mut seq.table, num_computed)
            .map_err(|e| EngineError::OutOfBlocks {
                needed: e.needed,
                available: e.available,
            })?;
        if let Err(e) = self.backend.import_blocks(seq.table.ids(), &snap.kv) {
            self.sched.blocks_mut().release(&mut seq.table);
            return Err(e);
        }
        seq.cached_prompt_tokens = Some(num_computed.min(seq.prompt_len));
        self.queue_continued(seq, num_computed, request_id, key, out);
        Ok(())
    }

    /// Checks a state to continue here against this engine's limits (shared by import and
    /// activation).
    pub(super) fn check_continuable(&self, st: &SequenceState) -> Result<(), EngineError> {
        let bad = |m: &str| Err(EngineError::BadSnapshot(m.to_owned()));
        if st.params.n != 1 && st.index >= st.params.n {
            return bad("choice index out of range");
        }
        if st.prompt_len > st.tokens.len() {
            return bad("prompt_len exceeds the tokens");
        }
        if let Err(e) = HashContext::new(st.cache_salt, st.media.clone()) {
            return Err(EngineError::BadSnapshot(e.to_string()));
        }
        if st
            .media
            .iter()
            .any(|m| m.start.saturating_add(m.len) > st.prompt_len)
        {
            return bad("a media span ends past the prompt");
        }
        let max_tokens = self.validate(&st.request_id, &st.tokens[..st.prompt_len], &st.params)?;
        if st.max_tokens > max_tokens || st.tokens.len() - st.prompt_len > st.max_tokens {
            return bad("max_tokens does not fit this engine or is already exceeded");
        }
        let vocab = self.backend.vocab_size();
        if st.tokens.iter().any(|&t| t as usize >= vocab) {
            return bad("a token id is outside the vocabulary");
        }
        Ok(())
    }

    /// A new sequence continuing `st` (its blocks are the caller's to attach); returns it with
    /// its request id.
    pub(super) fn continued_sequence(
        &mut self,
        st: SequenceState,
        guide: Option<Box<Guide>>,
    ) -> (Sequence, String) {
        let mut seq = Sequence::new(NewSequence {
            id: self.requests.new_seq_id(),
            request_id: Arc::from(st.request_id.as_str()),
            index: st.index,
            tokens: st.tokens,
            max_tokens: st.max_tokens,
            arrival: self.requests.new_arrival(),
            params: Arc::new(normalized(st.params)),
            sampler: st.sampler,
            // Checked by `check_continuable`.
            hashing: HashContext::new(st.cache_salt, st.media)
                .unwrap_or_else(|_| HashContext::salted(st.cache_salt)),
            media: Arc::from([]),
        });
        seq.prompt_len = st.prompt_len;
        seq.stop = st.stop;
        seq.guide = guide;
        (seq, st.request_id)
    }

    /// Marks the first `computed` tokens computed (registering their full blocks for reuse),
    /// replays the detokenizer over the generated ids (its state is a function of them) and
    /// queues the sequence.
    pub(super) fn queue_continued(
        &mut self,
        mut seq: Sequence,
        computed: usize,
        request_id: String,
        key: u64,
        out: tmpsc::UnboundedSender<RequestOutput>,
    ) {
        seq.num_computed = computed;
        self.sched
            .blocks_mut()
            .commit_computed(&mut seq.table, &seq.tokens, computed);
        seq.decoder = self.new_decoder(&seq.params);
        if let (Some(dec), Some(tk)) = (seq.decoder.as_mut(), self.tokenizer.as_deref()) {
            for &t in &seq.tokens[seq.prompt_len..] {
                let _ = dec.push(tk, t);
            }
        }
        let id = seq.id;
        self.sched.add(seq);
        self.requests
            .insert(request_id, Entry::new(key, vec![id], Sink::Stream(out)));
    }
}
