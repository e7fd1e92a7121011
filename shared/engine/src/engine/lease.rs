//! The decode side of disaggregated serving: reservations (leases) of KV blocks that a remote
//! prefill writes into, and the activation that continues the request from them.
//!
//! A reservation holds every block of a prompt: the prefix this engine already caches
//! (attached, so it cannot be evicted) and fresh blocks for the rest, which the remote prefill
//! writes straight into the pool memory. Its blocks count as referenced; the cache cannot be
//! cleared while one exists. Releasing it returns the fresh blocks to the free list *without*
//! registering them in the prefix cache (their content is unknown); activating it makes its
//! blocks the table of a new sequence and registers the prompt's full blocks.

use std::collections::HashMap;

use tokio::sync::mpsc as tmpsc;

use super::core::Core;
use crate::error::EngineError;
use crate::kv::block_manager::HashContext;
use crate::kv::block_manager::{BlockManager, BlockTable};
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

/// One reservation: the prompt and every block of it.
struct Lease {
    prompt: Vec<u32>,
    table: BlockTable,
    cached_tokens: usize,
}

impl Lease {
    /// Holds the blocks of `prompt`: the cached prefix (of its salt) attached, fresh blocks
    /// for the rest.
    fn reserve(
        bm: &mut BlockManager,
        prompt: Vec<u32>,
        hashing: HashContext,
    ) -> Result<Self, EngineError> {
        let mut table = BlockTable::hashed(hashing);
        let cached_tokens = bm.attach_prefix(&mut table, &prompt);
        if let Err(e) = bm.ensure_capacity(&mut table, prompt.len()) {
            bm.release(&mut table);
            return Err(EngineError::OutOfBlocks {
                needed: e.needed,
                available: e.available,
            });
        }
        Ok(Self {
            prompt,
            table,
            cached_tokens,
        })
    }

    fn reservation(&self, lease_id: u64) -> Reservation {
        Reservation {
            lease_id,
            block_ids: self.table.ids().to_vec(),
            cached_tokens: self.cached_tokens,
        }
    }

    /// Gives the blocks back. Fresh blocks were never hashed, so `release` puts them on the
    /// free list; the attached prefix blocks go back to the LRU as after any request.
    fn release(mut self, bm: &mut BlockManager) {
        bm.release(&mut self.table);
    }

    /// Checks that `st` continues exactly this lease's prompt, computed by the remote prefill,
    /// with its first token sampled.
    fn check_state(&self, lease_id: u64, st: &SequenceState) -> Result<(), EngineError> {
        let bad = |m: String| Err(EngineError::BadSnapshot(m));
        let pl = self.prompt.len();
        if st.prompt_len != pl || st.tokens.get(..pl) != Some(&self.prompt[..]) {
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
        if st.cache_salt != self.table.salt() {
            return bad(format!(
                "the state's cache salt is not the one lease {lease_id} was reserved under"
            ));
        }
        if st.media.as_slice() != self.table.hashing().media() {
            return bad(format!(
                "the state's media spans are not the ones lease {lease_id} was reserved under"
            ));
        }
        Ok(())
    }

    /// The blocks the remote prefill wrote (those after the cached prefix).
    fn fresh_blocks(&self, block_size: usize) -> &[u32] {
        let ids = self.table.ids();
        &ids[(self.cached_tokens / block_size).min(ids.len())..]
    }
}

/// The live reservations, by lease id.
pub(super) struct Leases {
    live: HashMap<u64, Lease>,
}

impl Leases {
    pub(super) fn new() -> Self {
        Self {
            live: HashMap::new(),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    pub(super) fn len(&self) -> usize {
        self.live.len()
    }

    /// Blocks held by every live lease.
    pub(super) fn reserved_blocks(&self) -> usize {
        self.live.values().map(|l| l.table.len()).sum()
    }

    fn contains(&self, lease_id: u64) -> bool {
        self.live.contains_key(&lease_id)
    }

    fn get(&self, lease_id: u64) -> Result<&Lease, EngineError> {
        self.live
            .get(&lease_id)
            .ok_or(EngineError::UnknownLease(lease_id))
    }

    fn take(&mut self, lease_id: u64) -> Result<Lease, EngineError> {
        self.live
            .remove(&lease_id)
            .ok_or(EngineError::UnknownLease(lease_id))
    }

    fn insert(&mut self, lease_id: u64, lease: Lease) {
        self.live.insert(lease_id, lease);
    }

    /// Takes every lease out.
    fn drain(&mut self) -> impl Iterator<Item = Lease> {
        std::mem::take(&mut self.live).into_values()
    }
}

impl Core {
    pub(super) fn reserve(
        &mut self,
        lease_id: u64,
        prompt: Vec<u32>,
        params: &SamplingParams,
        hashing: HashContext,
    ) -> Result<Reservation, EngineError> {
        if self.leases.contains(lease_id) {
            return Err(EngineError::DuplicateLease(lease_id));
        }
        self.check_request_limit()?;
        self.validate_prompt(&prompt, params)?;
        if params.use_beam_search {
            return Err(EngineError::InvalidRequest(
                "beam search (use_beam_search) cannot be served by a decode reservation".into(),
            ));
        }
        let lease = Lease::reserve(self.sched.blocks_mut(), prompt, hashing)?;
        let r = lease.reservation(lease_id);
        self.leases.insert(lease_id, lease);
        Ok(r)
    }

    pub(super) fn release_reservation(&mut self, lease_id: u64) -> Result<(), EngineError> {
        let lease = self.leases.take(lease_id)?;
        lease.release(self.sched.blocks_mut());
        Ok(())
    }

    /// Releases every reservation (engine shutdown).
    pub(super) fn drop_leases(&mut self) {
        for lease in self.leases.drain() {
            lease.release(self.sched.blocks_mut());
        }
    }

    pub(super) fn activate(
        &mut self,
        lease_id: u64,
        st: SequenceState,
        key: u64,
        out: tmpsc::UnboundedSender<RequestOutput>,
    ) -> Result<(), EngineError> {
        let lease = self.leases.get(lease_id)?;
        lease.check_state(lease_id, &st)?;
        let pl = st.prompt_len;
        self.check_continuable(&st)?;
        let guide = self.guide_for(&st.params, &st.tokens[st.prompt_len..])?;
        let lease = self.leases.take(lease_id)?;
        // The blocks the remote prefill wrote become visible to compute (a backend whose
        // transfer memory is not its pool copies them in; the CPU pool is that memory).
        let bs = self.sched.blocks_mut().block_size();
        if let Err(e) = self.backend.load_received_blocks(lease.fresh_blocks(bs)) {
            self.leases.insert(lease_id, lease);
            return Err(e);
        }
        let state_cached = st.cached_prompt_tokens;
        let (mut seq, request_id) = self.continued_sequence(st, guide);
        seq.table = lease.table;
        seq.cached_prompt_tokens = Some(state_cached.max(lease.cached_tokens));
        self.queue_continued(seq, pl, request_id, key, out);
        Ok(())
    }
}
