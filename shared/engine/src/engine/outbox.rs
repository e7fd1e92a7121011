//! Outputs leave the engine thread a step at a time. Sending one on a request's stream wakes
//! the task that reads it, and waking a task of the async runtime from this thread can cost
//! a system call: at 256 sequences a step that is hundreds of wake-ups while the GPU waits
//! for the next step. The engine thread only queues each output here; `flush` hands the
//! step's outputs, in order, to a thread of their own that sends them while the engine thread
//! goes on with the next step. One thread sends them all, in the order they were queued, so
//! a request's outputs (and its last one) arrive in order; the streams stay open until their
//! queued outputs are sent (the queue holds a sender of each).

use std::sync::mpsc;
use std::thread::JoinHandle;

use tokio::sync::mpsc as tmpsc;

use crate::request::RequestOutput;

type Stream = tmpsc::UnboundedSender<RequestOutput>;
type Batch = Vec<Item>;

/// An output for its stream, or work (a command's reply) that must happen after the outputs
/// queued before it.
enum Item {
    Output(Stream, RequestOutput),
    Then(Box<dyn FnOnce() + Send>),
}

pub(super) struct Outbox {
    pending: Batch,
    /// The sending thread (None once closed, or when it could not start: outputs are then
    /// sent here).
    sender: Option<SenderThread>,
}

/// The thread that sends the batches, its queue, and the emptied batches it gives back so a
/// step's queue reuses their memory.
struct SenderThread {
    queue: mpsc::Sender<Batch>,
    handle: JoinHandle<()>,
    spare: mpsc::Receiver<Batch>,
}

impl Outbox {
    pub(super) fn new() -> Self {
        let (queue, batches) = mpsc::channel::<Batch>();
        let (give_back, spare) = mpsc::channel::<Batch>();
        let spawned = std::thread::Builder::new()
            .name("tandem-engine-out".into())
            .spawn(move || send_batches(&batches, &give_back));
        let sender = match spawned {
            Ok(handle) => Some(SenderThread {
                queue,
                handle,
                spare,
            }),
            Err(e) => {
                tracing::warn!("cannot start the engine's output thread ({e}): the engine thread sends its outputs itself");
                None
            }
        };
        Self {
            pending: Vec::new(),
            sender,
        }
    }

    /// Queues `o` for `stream`. False when nobody reads the stream any more.
    pub(super) fn push(&mut self, stream: &Stream, o: RequestOutput) -> bool {
        if stream.is_closed() {
            return false;
        }
        self.pending.push(Item::Output(stream.clone(), o));
        true
    }

    /// Runs `f` once every output queued so far has been sent (a reply that promises its
    /// caller the outputs made before it, as `stats` does).
    pub(super) fn then(&mut self, f: impl FnOnce() + Send + 'static) {
        self.pending.push(Item::Then(Box::new(f)));
    }

    /// Hands what is queued to the sending thread (sends it here when that thread is gone).
    pub(super) fn flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let next = self
            .sender
            .as_ref()
            .and_then(|s| s.spare.try_recv().ok())
            .unwrap_or_default();
        let batch = std::mem::replace(&mut self.pending, next);
        let batch = match &self.sender {
            Some(s) => match s.queue.send(batch) {
                Ok(()) => return,
                Err(mpsc::SendError(batch)) => batch,
            },
            None => batch,
        };
        send_all(batch);
    }
}

impl Drop for Outbox {
    /// Sends what is still queued, then waits for the sending thread to finish: when the
    /// engine has stopped, every output it made has reached its stream.
    fn drop(&mut self) {
        self.flush();
        if let Some(SenderThread { queue, handle, .. }) = self.sender.take() {
            drop(queue);
            if handle.join().is_err() {
                tracing::error!("the engine's output thread panicked");
            }
        }
    }
}

fn send_batches(batches: &mpsc::Receiver<Batch>, give_back: &mpsc::Sender<Batch>) {
    for mut batch in batches {
        batch.drain(..).for_each(deliver);
        let _ = give_back.send(batch);
    }
}

fn send_all(batch: Batch) {
    batch.into_iter().for_each(deliver);
}

fn deliver(item: Item) {
    match item {
        // A stream whose reader left meanwhile: the engine aborts it when it next sees the
        // stream closed.
        Item::Output(stream, o) => {
            let _ = stream.send(o);
        }
        Item::Then(f) => f(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::core::output;

    #[test]
    fn outputs_arrive_in_order_and_streams_close_after_their_last() {
        let (a_tx, mut a_rx) = tmpsc::unbounded_channel();
        let (b_tx, mut b_rx) = tmpsc::unbounded_channel();
        let mut outbox = Outbox::new();
        for step in 0..50u32 {
            for (tx, rid) in [(&a_tx, "a"), (&b_tx, "b")] {
                let mut o = output(rid, 0);
                o.token_ids.push(step);
                assert!(outbox.push(tx, o));
            }
            outbox.flush();
        }
        // The engine drops a finished request's sender at once; its queued outputs still
        // arrive, then the stream ends.
        drop(a_tx);
        drop(outbox);
        let mut seen = Vec::new();
        while let Some(o) = a_rx.blocking_recv() {
            seen.push(o.token_ids[0]);
        }
        assert_eq!(seen, (0..50).collect::<Vec<_>>());
        for step in 0..50u32 {
            assert_eq!(b_rx.try_recv().map(|o| o.token_ids[0]), Ok(step));
        }
    }

    #[test]
    fn work_queued_after_outputs_runs_once_they_are_sent() {
        let (tx, mut rx) = tmpsc::unbounded_channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let mut outbox = Outbox::new();
        for step in 0..20u32 {
            let mut o = output("a", 0);
            o.token_ids.push(step);
            assert!(outbox.push(&tx, o));
            outbox.then({
                let done_tx = done_tx.clone();
                move || {
                    let _ = done_tx.send(step);
                }
            });
            outbox.flush();
        }
        for step in 0..20u32 {
            assert_eq!(done_rx.recv().ok(), Some(step));
            // The step's output was sent before the work ran.
            assert_eq!(rx.try_recv().map(|o| o.token_ids[0]), Ok(step));
        }
    }

    #[test]
    fn a_closed_stream_is_refused() {
        let (tx, rx) = tmpsc::unbounded_channel();
        drop(rx);
        let mut outbox = Outbox::new();
        assert!(!outbox.push(&tx, output("gone", 0)));
    }
}
