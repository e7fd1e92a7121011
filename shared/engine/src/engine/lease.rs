//! The decode side of disaggregated serving: reservations (leases) of KV blocks that a remote
//! prefill writes into, and the activation that continues the request from them.
//!
//! A reservation holds every block of a prompt: the prefix this engine already caches
//! (attached, so it cannot be evicted) and fresh blocks for the rest, which the remote prefill
//! writes straight into the pool memory. Its blocks count as referenced; the cache cannot be
//! cleared while one exists. Releasing it returns the fresh blocks to the free list *without*
//! registering them in the prefix cache (their content is unknown); activating it makes its
//! blocks the table of a new sequence and registers the prompt's full blocks.

use tokio::sync::mpsc as tmpsc;

use super::core::Core;
use crate::error::EngineError;
use crate::kv::block_manager::BlockTable;
use crate::request::{RequestOutput, SequenceState};
use crate::sampler::SamplingParams;

/// Blocks held for a prompt whose KV a remote prefill writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub lease_id: u64,
    /// Every block of the prompt, in order: `blocks_for(prompt.len())` ids.
    pub block_ids: Vec<u32>,
    /// Prompt tokens already cached here (a multiple of the block size); blocks
    /// `[cached_tokens / block_size ..]` are the ones a remote prefill must write.
    pub cached_tokens: usize,
}

pub(crate) struct Lease {
    prompt: Vec<u32>,
    pub(super) table: BlockTable,
    cached_tokens: usize,
}

impl Core {
    pub(super) fn reserve(
        &mut self,
        lease_id: u64,
        prompt: Vec<u32>,
        params: &SamplingParams,
    ) -> Result<Reservation, EngineError> {
        if self.leases.contains_key(&lease_id) {
            return Err(EngineError::DuplicateLease(lease_id));
        }
        self.validate_prompt(&prompt, params)?;
        if params.use_beam_search {
            return Err(EngineError::InvalidRequest(
                "beam search (use_beam_search) cannot be served by a decode reservation".into(),
            ));
        }
        let bm = self.sched.blocks_mut();
        let mut table = BlockTable::default();
        let cached_tokens = bm.attach_prefix(&mut table, &prompt);
        if let Err(e) = bm.ensure_capacity(&mut table, prompt.len()) {
            bm.release(&mut table);
            return Err(EngineError::OutOfBlocks {
                needed: e.needed,
                available: e.available,
            });
        }
        let r = Reservation {
            lease_id,
            block_ids: table.ids().to_vec(),
            cached_tokens,
        };
        self.leases.insert(
            lease_id,
            Lease {
                prompt,
                table,
                cached_tokens,
            },
        );
        Ok(r)
    }

    pub(super) fn release_reservation(&mut self, lease_id: u64) -> Result<(), EngineError> {
        let mut lease = self
            .leases
            .remove(&lease_id)
            .ok_or(EngineError::UnknownLease(lease_id))?;
        // Fresh blocks were never hashed, so `release` puts them on the free list; the
        // attached prefix blocks go back to the LRU as after any request.
        self.sched.blocks_mut().release(&mut lease.table);
        Ok(())
    }

    /// Releases every reservation (engine shutdown).
    pub(super) fn drop_leases(&mut self) {
        for (_, mut lease) in std::mem::take(&mut self.leases) {
            self.sched.blocks_mut().release(&mut lease.table);
        }
    }

    pub(super) fn activate(
        &mut self,
        lease_id: u64,
        st: SequenceState,
        key: u64,
        out: tmpsc::UnboundedSender<RequestOutput>,
    ) -> Result<(), EngineError> {
        let lease = self
            .leases
            .get(&lease_id)
            .ok_or(EngineError::UnknownLease(lease_id))?;
        let bad = |m: String| Err(EngineError::BadSnapshot(m));
        let pl = lease.prompt.len();
        if st.prompt_len != pl || st.tokens.get(..pl) != Some(&lease.prompt[..]) {
            return bad(format!(
                "the state's prompt ({} tokens) is not the prompt reserved under lease {lease_id} \
                 ({pl} tokens)",
                st.prompt_len
            ));
        }
        if st.num_computed != pl {
            return bad(format!(
                "num_computed ({}) must equal the prompt length ({pl})",
                st.num_computed
            ));
        }
        if st.tokens.len() <= pl {
            return bad("the state has no generated token to continue from".into());
        }
        self.check_continuable(&st)?;
        let Some(lease) = self.leases.remove(&lease_id) else {
            return Err(EngineError::UnknownLease(lease_id));
        };
        // The blocks the remote prefill wrote become visible to compute (a backend whose
        // transfer memory is not its pool copies them in; the CPU pool is that memory).
        let bs = self.sched.blocks_mut().block_size();
        let fresh = &lease.table.ids()[(lease.cached_tokens / bs).min(lease.table.ids().len())..];
        if let Err(e) = self.backend.load_received_blocks(fresh) {
            self.leases.insert(lease_id, lease);
            return Err(e);
        }
        let state_cached = st.cached_prompt_tokens;
        let (mut seq, request_id) = self.continued_sequence(st);
        seq.table = lease.table;
        seq.cached_prompt_tokens = Some(state_cached.max(lease.cached_tokens));
        self.queue_continued(seq, pl, request_id, key, out);
        Ok(())
    }
}
