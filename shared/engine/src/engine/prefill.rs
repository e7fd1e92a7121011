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
//!
//! Blocks leave in one of two forms ([`BlockExport`]): copied out in export format
//! ([`PrefillEvent::Blocks`], host memory, what TCP and host-memory UCX send), or — where the
//! pool is GPU memory and the decode worker's is too — as the pool's own GPU memory
//! ([`PrefillEvent::DeviceBlocks`]): no copy, the transport reads the blocks where they are.
//! Such blocks are pinned (referenced, so neither evicted nor reused) until the event's
//! [`BlockPin`] is dropped, i.e. until the writer has finished reading them. In GPU memory
//! the blocks a step completes may also leave *before* that step runs, by groups of layers
//! ([`BlockExport::Device`] with `layer_groups`): the backend resolves each group's fence as
//! the step's launches pass it, and the writer puts that group's bytes of every block while
//! the step computes the later layers.

use std::collections::HashMap;
use std::ops::Range;

use tokio::sync::mpsc as tmpsc;

use super::core::{Command, Core};
use super::queue::CommandQueue;
use super::requests::{Entry, Sink};
use crate::backend::DeviceBlocks;
use crate::error::EngineError;
use crate::kv::block_manager::BlockManager;
use crate::kv::block_manager::BlockTable;
use crate::request::{Request, RequestOutput, SequenceState};
use crate::scheduler::ScheduledSeq;
use crate::sequence::{SeqId, Sequence};

/// How a prefill's blocks leave the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BlockExport {
    /// Copied out in export format ([`PrefillEvent::Blocks`]).
    #[default]
    Host,
    /// As GPU memory of the pool, pinned until written ([`PrefillEvent::DeviceBlocks`]); a
    /// pool that is not GPU memory fails the request. `layer_groups` 0: the blocks a step
    /// completes leave once the step is done, whole; `n` ≥ 1: they leave before the step
    /// runs, in `n` groups of layers, each readable as soon as the step has written it
    /// ([`crate::backend::BlocksReady::Layers`]), so the write overlaps the step's compute
    /// (a backend that cannot fence by layer sends them whole after the step).
    Device { layer_groups: usize },
}

/// Keeps blocks of a [`PrefillEvent::DeviceBlocks`] referenced in the engine; dropping it
/// releases them (they stay in the prefix cache as any finished prompt's blocks).
pub struct BlockPin {
    id: u64,
    tx: CommandQueue,
}

impl std::fmt::Debug for BlockPin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BlockPin({})", self.id)
    }
}

impl Drop for BlockPin {
    fn drop(&mut self) {
        // A cleanup command: never refused while the engine runs; a stopped engine has
        // released everything already.
        let _ = self.tx.send(Command::Unpin(self.id));
    }
}

/// What a [`PrefillStream`] yields.
// One `Done` per request: boxing its fields is not worth a less direct API.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum PrefillEvent {
    /// Whole blocks `first_block ..` of the prompt (index in the prompt's block list), bytes in
    /// export format (layout byte order), `data.len() == k * block_bytes`.
    Blocks { first_block: usize, data: Vec<u8> },
    /// Whole blocks `first_block ..` of the prompt as GPU memory of this engine's pool
    /// ([`BlockExport::Device`]): read them (or each group of their layers) once
    /// `blocks.ready` says so, and before dropping `pin`.
    DeviceBlocks {
        first_block: usize,
        blocks: DeviceBlocks,
        pin: BlockPin,
    },
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

/// How a prefill sequence's blocks leave: copied, or pinned in place (with the queue its
/// pins' release goes through).
enum Exporter {
    Host,
    Device {
        queue: CommandQueue,
        layer_groups: usize,
    },
}

/// The prefill-only sequences, each with the index of the next prompt block to send, and the
/// blocks pinned for GPU-to-GPU writes still in progress.
pub(super) struct PrefillCursors {
    next: HashMap<SeqId, (usize, Exporter)>,
    pins: HashMap<u64, BlockTable>,
    next_pin: u64,
}

impl PrefillCursors {
    pub(super) fn new() -> Self {
        Self {
            next: HashMap::new(),
            pins: HashMap::new(),
            next_pin: 0,
        }
    }

    pub(super) fn contains(&self, id: SeqId) -> bool {
        self.next.contains_key(&id)
    }

    /// Makes `id` a prefill-only sequence whose blocks are sent from `first_block` on.
    fn start(&mut self, id: SeqId, first_block: usize, exporter: Exporter) {
        self.next.insert(id, (first_block, exporter));
    }

    pub(super) fn remove(&mut self, id: SeqId) {
        self.next.remove(&id);
    }

    /// References `blocks` until [`PrefillCursors::unpin`] of the returned id.
    fn pin(&mut self, bm: &mut BlockManager, blocks: &[u32]) -> u64 {
        self.next_pin += 1;
        self.pins.insert(self.next_pin, bm.pin(blocks));
        self.next_pin
    }

    /// Releases the blocks of pin `id` (a [`BlockPin`] was dropped).
    pub(super) fn unpin(&mut self, bm: &mut BlockManager, id: u64) {
        if let Some(mut table) = self.pins.remove(&id) {
            bm.release(&mut table);
        }
    }

    /// The prompt blocks of prefill sequence `seq` that are complete and not sent yet: full
    /// computed blocks, and once the whole prompt is computed, the last partial one. None when
    /// there are none, or `seq` is no prefill.
    fn ready(&self, seq: &Sequence, bm: &BlockManager) -> Option<Range<usize>> {
        self.ready_at(seq, bm, seq.num_computed)
    }

    /// [`PrefillCursors::ready`] once `seq` has `computed` tokens computed.
    fn ready_at(&self, seq: &Sequence, bm: &BlockManager, computed: usize) -> Option<Range<usize>> {
        let next = self.next.get(&seq.id)?.0;
        let ready = if computed >= seq.prompt_len {
            bm.blocks_for(seq.prompt_len)
        } else {
            computed / bm.block_size()
        }
        .min(seq.table.len());
        (ready > next).then_some(next..ready)
    }

    /// The release queue and group count of a prefill sequence that sends by layer groups.
    fn by_layers(&self, id: SeqId) -> Option<(CommandQueue, usize)> {
        match self.next.get(&id)?.1 {
            Exporter::Device {
                ref queue,
                layer_groups,
            } if layer_groups > 0 => Some((queue.clone(), layer_groups)),
            _ => None,
        }
    }

    /// Blocks before `to` of `id` are sent.
    fn sent(&mut self, id: SeqId, to: usize) {
        if let Some(e) = self.next.get_mut(&id) {
            e.0 = to;
        }
    }
}

impl Core {
    pub(super) fn prefill(
        &mut self,
        req: Request,
        send_from_block: usize,
        (export, queue): (BlockExport, CommandQueue),
        key: u64,
        out: tmpsc::UnboundedSender<PrefillEvent>,
    ) -> Result<(), EngineError> {
        if matches!(export, BlockExport::Device { .. }) && self.backend.device_pool().is_none() {
            return Err(EngineError::InvalidRequest(
                "GPU-to-GPU KV export asked of an engine whose KV pool is not in GPU memory".into(),
            ));
        }
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
            let exporter = match export {
                BlockExport::Host => Exporter::Host,
                BlockExport::Device { layer_groups } => Exporter::Device {
                    queue,
                    layer_groups,
                },
            };
            self.prefills.start(id, send_from_block, exporter);
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
        let ids = seq.table.ids()[blocks.clone()].to_vec();
        let event = match self.prefills.next.get(&id).map(|e| &e.1) {
            Some(Exporter::Device { queue, .. }) => {
                let queue = queue.clone();
                self.device_event(&ids, blocks.start, queue).map(Some)
            }
            _ => self.backend.export_blocks(&ids).map(|data| {
                Some(PrefillEvent::Blocks {
                    first_block: blocks.start,
                    data,
                })
            }),
        };
        self.send_prefill_event(id, blocks.end, event);
    }

    /// Blocks that this step completes, of prefill sequences among `pieces` that send by
    /// layer groups: handed out before the forward pass, each group of layers behind a
    /// fence the step resolves as it passes the group's last layer, so that writing them
    /// overlaps the rest of the step. Where the backend cannot fence by layer they stay
    /// unsent, and leave whole after the step.
    pub(super) fn send_prefills_by_layers(&mut self, pieces: &[ScheduledSeq]) {
        for p in pieces {
            let Some((queue, groups)) = self.prefills.by_layers(p.id) else {
                continue;
            };
            let Some(seq) = self.sched.get(p.id) else {
                continue;
            };
            let bm = self.sched.blocks();
            let Some(blocks) = self.prefills.ready_at(seq, bm, p.start + p.len) else {
                continue;
            };
            let ids = seq.table.ids()[blocks.clone()].to_vec();
            let event = self.layered_event(&ids, blocks.start, groups, queue);
            if !matches!(event, Ok(None)) {
                self.send_prefill_event(p.id, blocks.end, event);
            }
        }
    }

    /// Hands `event` (blocks up to `to` of prefill sequence `id`) to the request's stream;
    /// a failed export fails the request.
    fn send_prefill_event(
        &mut self,
        id: SeqId,
        to: usize,
        event: Result<Option<PrefillEvent>, EngineError>,
    ) {
        let Some(rid) = self.requests.request_of(id).map(str::to_owned) else {
            return;
        };
        match event {
            Ok(Some(event)) => {
                self.prefills.sent(id, to);
                if let Some(Sink::Prefill(tx)) = self.requests.get(&rid).map(Entry::sink) {
                    // A receiver that is gone aborts the request through its stream's drop
                    // (and drops the event, whose pin then releases its blocks).
                    let _ = tx.send(event);
                }
            }
            Ok(None) => {}
            Err(e) => {
                tracing::error!("exporting prefill blocks of {rid:?}: {e}");
                self.fail(&rid, Some(format!("exporting KV blocks: {e}")));
            }
        }
    }

    /// Blocks `ids` (prompt blocks `first_block..`) in place in the GPU pool, pinned, each
    /// of `groups` layer groups behind the next step's fence for it; `None` when the
    /// backend cannot fence by layer.
    fn layered_event(
        &mut self,
        ids: &[u32],
        first_block: usize,
        groups: usize,
        queue: CommandQueue,
    ) -> Result<Option<PrefillEvent>, EngineError> {
        let Some(blocks) = self.backend.device_blocks_by_layers(ids, groups)? else {
            return Ok(None);
        };
        let id = self.prefills.pin(self.sched.blocks_mut(), ids);
        Ok(Some(PrefillEvent::DeviceBlocks {
            first_block,
            blocks,
            pin: BlockPin { id, tx: queue },
        }))
    }

    /// Blocks `ids` (prompt blocks `first_block..`) in place in the GPU pool, pinned.
    fn device_event(
        &mut self,
        ids: &[u32],
        first_block: usize,
        queue: CommandQueue,
    ) -> Result<PrefillEvent, EngineError> {
        let blocks = self
            .backend
            .device_blocks(ids)?
            .ok_or_else(|| EngineError::Backend("the KV pool is not in GPU memory".into()))?;
        let id = self.prefills.pin(self.sched.blocks_mut(), ids);
        Ok(PrefillEvent::DeviceBlocks {
            first_block,
            blocks,
            pin: BlockPin { id, tx: queue },
        })
    }
}
