//! The prefill side of disaggregated serving: compute a prompt here, stream its KV blocks out
//! as they complete, sample the first token, and hand the request's state over to the engine
//! that decodes it (which holds a [`super::Reservation`] for the blocks).
//!
//! A prefill request is an ordinary sequence (same admission, prefix cache, chunking and
//! sampler) whose outputs go to a [`PrefillStream`] instead of a request stream. After every
//! step, the prompt blocks it has completed since the last report go out in one
//! [`PrefillEvent::Blocks`]; the blocks complete before a step (a cached prefix, the previous
//! chunk) go out just before that step's forward pass, so sending overlaps compute. Once the
//! prompt is computed and the first token sampled, the last (partial) block goes out, then
//! [`PrefillEvent::Done`], and the sequence ends here: its full blocks stay in the prefix cache
//! as for a finished request.
//!
//! Preemption (under `MAX_UTILIZATION`) restarts the prompt like any recompute; blocks already
//! sent are not sent again (what was sent was complete and valid), so each block index is
//! still reported exactly once, in order.

use std::collections::HashMap;
use std::ops::Range;

use tokio::sync::mpsc as tmpsc;

use super::core::{Command, Core};
use super::queue::CommandQueue;
use super::requests::{Entry, Sink};
use crate::error::EngineError;
use crate::kv::block_manager::BlockManager;
use crate::request::{Request, RequestOutput, SequenceState};
use crate::scheduler::ScheduledSeq;
use crate::sequence::{SeqId, Sequence};

/// What a [`PrefillStream`] yields.
// One `Done` per request: boxing its fields is not worth a less direct API.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum PrefillEvent {
    /// Whole blocks `first_block ..` of the prompt (index in the prompt's block list), bytes in
    /// export format (layout byte order), `data.len() == k * block_bytes`.
    Blocks { first_block: usize, data: Vec<u8> },
    /// The last event. Three cases, told apart by `output.finish_reason`:
    /// - `None`: the prompt is computed and the first token sampled; `output` carries that
    ///   token (text, logprobs) and `state` continues the request elsewhere (`num_computed ==
    ///   prompt_len`, `tokens` = prompt + token), e.g. through `EngineHandle::activate`;
    /// - `Stop` / `Length`: the first token already ended the request (`output` has its
    ///   `stop_reason` and `usage`); there is nothing to continue;
    /// - `Abort`: the prefill failed or was aborted (`output.error` says why when the engine
    ///   failed it); `state` is where it stood and must not be activated.
    Done {
        output: RequestOutput,
        state: SequenceState,
    },
}

/// The events of one prefill request: `Blocks`, then exactly one `Done`; `next` returns None
/// after `Done` (or if the engine stopped). Dropping it before `Done` aborts the request.
pub struct PrefillStream {
    request_id: String,
    key: u64,
    done: bool,
    rx: tmpsc::UnboundedReceiver<PrefillEvent>,
    tx: CommandQueue,
}

impl PrefillStream {
    pub(super) fn new(
        request_id: String,
        key: u64,
        rx: tmpsc::UnboundedReceiver<PrefillEvent>,
        tx: CommandQueue,
    ) -> Self {
        Self {
            request_id,
            key,
            done: false,
            rx,
            tx,
        }
    }

    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// The next event, or None after `Done`.
    pub async fn next(&mut self) -> Option<PrefillEvent> {
        if self.done {
            return None;
        }
        let ev = self.rx.recv().await;
        if matches!(ev, None | Some(PrefillEvent::Done { .. })) {
            self.done = true;
        }
        ev
    }
}

impl Drop for PrefillStream {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.tx.send(Command::AbortKey(self.key));
        }
    }
}

/// The prefill-only sequences, each with the index of the next prompt block to send.
pub(super) struct PrefillCursors {
    next: HashMap<SeqId, usize>,
}

impl PrefillCursors {
    pub(super) fn new() -> Self {
        Self {
            next: HashMap::new(),
        }
    }

    pub(super) fn contains(&self, id: SeqId) -> bool {
        self.next.contains_key(&id)
    }

    /// Makes `id` a prefill-only sequence whose blocks are sent from `first_block` on.
    fn start(&mut self, id: SeqId, first_block: usize) {
        self.next.insert(id, first_block);
    }

    pub(super) fn remove(&mut self, id: SeqId) {
        self.next.remove(&id);
    }

    /// The prompt blocks of prefill sequence `seq` that are complete and not sent yet: full
    /// computed blocks, and once the whole prompt is computed, the last partial one. None when
    /// there are none, or `seq` is no prefill.
    fn ready(&self, seq: &Sequence, bm: &BlockManager) -> Option<Range<usize>> {
        let next = *self.next.get(&seq.id)?;
        let ready = if seq.num_computed >= seq.prompt_len {
            bm.blocks_for(seq.prompt_len)
        } else {
            seq.num_computed / bm.block_size()
        }
        .min(seq.table.len());
        (ready > next).then_some(next..ready)
    }

    /// Blocks before `to` of `id` are sent.
    fn sent(&mut self, id: SeqId, to: usize) {
        self.next.insert(id, to);
    }
}

impl Core {
    pub(super) fn prefill(
        &mut self,
        req: Request,
        send_from_block: usize,
        key: u64,
        out: tmpsc::UnboundedSender<PrefillEvent>,
    ) -> Result<(), EngineError> {
        if req.params.use_beam_search {
            return Err(EngineError::InvalidRequest(
                "beam search (use_beam_search) cannot run as a remote prefill".into(),
            ));
        }
        if req.params.n != 1 {
            return Err(EngineError::InvalidRequest(format!(
                "a prefill request must have n = 1, not {}",
                req.params.n
            )));
        }
        let nblocks = self.sched.blocks().blocks_for(req.prompt.len());
        if send_from_block > nblocks {
            return Err(EngineError::InvalidRequest(format!(
                "send_from_block {send_from_block} is beyond the prompt's {nblocks} blocks"
            )));
        }
        let rid = req.request_id.clone();
        self.submit(req, key, Sink::Prefill(out))?;
        if let Some(&id) = self.requests.get(&rid).and_then(|e| e.seqs().first()) {
            self.prefills.start(id, send_from_block);
        }
        Ok(())
    }

    /// Sends the complete, unsent prompt blocks of every prefill sequence among `pieces`.
    pub(super) fn flush_prefills(&mut self, pieces: &[ScheduledSeq]) {
        for p in pieces {
            if self.prefills.contains(p.id) {
                self.flush_prefill(p.id);
            }
        }
    }

    /// Sends the prompt blocks of prefill sequence `id` that are complete and not sent yet
    /// (see [`PrefillCursors::ready`]).
    pub(super) fn flush_prefill(&mut self, id: SeqId) {
        let Some(seq) = self.sched.get(id) else {
            return;
        };
        let Some(blocks) = self.prefills.ready(seq, self.sched.blocks()) else {
            return;
        };
        let Some(rid) = self.requests.request_of(id).map(str::to_owned) else {
            return;
        };
        match self.backend.export_blocks(&seq.table.ids()[blocks.clone()]) {
            Ok(data) => {
                self.prefills.sent(id, blocks.end);
                if let Some(Sink::Prefill(tx)) = self.requests.get(&rid).map(Entry::sink) {
                    // A receiver that is gone aborts the request through its stream's drop.
                    let _ = tx.send(PrefillEvent::Blocks {
                        first_block: blocks.start,
                        data,
                    });
                }
            }
            Err(e) => {
                tracing::error!("exporting prefill blocks of {rid:?}: {e}");
                self.fail(&rid, Some(format!("exporting KV blocks: {e}")));
            }
        }
    }
}
