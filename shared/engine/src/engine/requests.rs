//! The live requests: where each request's outputs go and which sequences it has live, which
//! request each live sequence serves, and the ids and arrival order given to new sequences.

use std::collections::HashMap;

use tokio::sync::mpsc as tmpsc;

use super::prefill::PrefillEvent;
use crate::request::RequestOutput;
use crate::sequence::SeqId;

/// Where a request's outputs go.
pub(super) enum Sink {
    /// A [`super::RequestStream`]: every output.
    Stream(tmpsc::UnboundedSender<RequestOutput>),
    /// A [`super::PrefillStream`]: KV blocks, then one `Done` with the first output and the
    /// state that continues the request elsewhere.
    Prefill(tmpsc::UnboundedSender<PrefillEvent>),
}

/// One live request.
pub(super) struct Entry {
    /// The key of its stream (a dropped stream aborts by key, so a reused request id is
    /// never hit).
    key: u64,
    /// Its live sequences (choices, or beams).
    seqs: Vec<SeqId>,
    out: Sink,
}

impl Entry {
    pub(super) fn new(key: u64, seqs: Vec<SeqId>, out: Sink) -> Self {
        Self { key, seqs, out }
    }

    pub(super) fn seqs(&self) -> &[SeqId] {
        &self.seqs
    }

    pub(super) fn sink(&self) -> &Sink {
        &self.out
    }
}

/// The table of live requests and the counters of sequence ids and arrivals.
pub(super) struct Requests {
    by_id: HashMap<String, Entry>,
    /// The request each live sequence serves.
    by_seq: HashMap<SeqId, String>,
    next_seq: SeqId,
    next_arrival: u64,
}

impl Requests {
    pub(super) fn new() -> Self {
        Self {
            by_id: HashMap::new(),
            by_seq: HashMap::new(),
            next_seq: 1,
            next_arrival: 0,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.by_id.len()
    }

    pub(super) fn contains(&self, request_id: &str) -> bool {
        self.by_id.contains_key(request_id)
    }

    pub(super) fn get(&self, request_id: &str) -> Option<&Entry> {
        self.by_id.get(request_id)
    }

    /// Every live request id.
    pub(super) fn ids(&self) -> Vec<String> {
        self.by_id.keys().cloned().collect()
    }

    /// The request whose stream has `key`.
    pub(super) fn with_key(&self, key: u64) -> Option<String> {
        self.by_id
            .iter()
            .find(|(_, e)| e.key == key)
            .map(|(id, _)| id.clone())
    }

    /// The request that live sequence `id` serves.
    pub(super) fn request_of(&self, id: SeqId) -> Option<&str> {
        self.by_seq.get(&id).map(String::as_str)
    }

    /// A fresh sequence id.
    pub(super) fn new_seq_id(&mut self) -> SeqId {
        let id = self.next_seq;
        self.next_seq += 1;
        id
    }

    /// The arrival number of a newly queued sequence (FCFS order).
    pub(super) fn new_arrival(&mut self) -> u64 {
        self.next_arrival += 1;
        self.next_arrival
    }

    /// Registers a request with its sequences.
    pub(super) fn insert(&mut self, request_id: String, entry: Entry) {
        for &id in &entry.seqs {
            self.by_seq.insert(id, request_id.clone());
        }
        self.by_id.insert(request_id, entry);
    }

    /// Adds live sequence `id` to request `request_id`.
    pub(super) fn add_seq(&mut self, request_id: &str, id: SeqId) {
        self.by_seq.insert(id, request_id.to_owned());
        if let Some(e) = self.by_id.get_mut(request_id) {
            e.seqs.push(id);
        }
    }

    /// Removes sequence `id` from request `request_id` (which stays, even without sequences).
    pub(super) fn detach_seq(&mut self, request_id: &str, id: SeqId) {
        self.by_seq.remove(&id);
        if let Some(e) = self.by_id.get_mut(request_id) {
            e.seqs.retain(|&s| s != id);
        }
    }

    /// Removes request `request_id` once it has no live sequence left.
    pub(super) fn remove_if_done(&mut self, request_id: &str) {
        if self
            .by_id
            .get(request_id)
            .is_some_and(|e| e.seqs.is_empty())
        {
            self.by_id.remove(request_id);
        }
    }

    /// Removes a request and every sequence it still has; returns it.
    pub(super) fn remove(&mut self, request_id: &str) -> Option<Entry> {
        let e = self.by_id.remove(request_id)?;
        for id in &e.seqs {
            self.by_seq.remove(id);
        }
        Some(e)
    }

    /// Sends an output on request `request_id`'s stream; false when it has none, or nobody
    /// listens any more.
    /// The output stream of request `request_id` (None for a prefill-only request, or when
    /// it is gone).
    pub(super) fn stream_of(
        &self,
        request_id: &str,
    ) -> Option<&tmpsc::UnboundedSender<RequestOutput>> {
        match self.by_id.get(request_id).map(Entry::sink) {
            Some(Sink::Stream(tx)) => Some(tx),
            _ => None,
        }
    }
}
