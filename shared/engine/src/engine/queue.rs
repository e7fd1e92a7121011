//! The channel from the handles to the engine thread, bounded for new work: commands that
//! start or ask for something (submit, prefill, reserve, stats, ...) count against a capacity
//! and are refused with [`EngineError::QueueFull`] when it is reached, never blocking the
//! caller; commands that end something already admitted (abort, release, shutdown) always go
//! through, so cleanup is never lost. A flood of calls therefore cannot grow the engine's
//! memory without bound.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvError, Sender, TryRecvError};
use std::sync::Arc;

use super::core::Command;
use crate::error::EngineError;

/// The sending side; cloned into every handle and stream.
#[derive(Clone)]
pub(crate) struct CommandQueue {
    tx: Sender<Command>,
    /// Counted commands sent and not yet received by the engine thread.
    queued: Arc<AtomicUsize>,
    capacity: usize,
}

/// The engine thread's side.
pub(crate) struct CommandReceiver {
    rx: Receiver<Command>,
    queued: Arc<AtomicUsize>,
}

/// A queue of `capacity` counted commands (at least one).
pub(crate) fn command_queue(capacity: usize) -> (CommandQueue, CommandReceiver) {
    let (tx, rx) = mpsc::channel();
    let queued = Arc::new(AtomicUsize::new(0));
    let q = CommandQueue {
        tx,
        queued: queued.clone(),
        capacity: capacity.max(1),
    };
    (q, CommandReceiver { rx, queued })
}

impl CommandQueue {
    /// Queues `cmd`: `Stopped` when the engine thread is gone, `QueueFull` when `capacity`
    /// counted commands wait already and `cmd` is counted.
    pub(crate) fn send(&self, cmd: Command) -> Result<(), EngineError> {
        let counted = !cmd.is_cleanup();
        if counted {
            let before = self.queued.fetch_add(1, Ordering::AcqRel);
            if before >= self.capacity {
                self.queued.fetch_sub(1, Ordering::AcqRel);
                return Err(EngineError::QueueFull {
                    capacity: self.capacity,
                });
            }
        }
        self.tx.send(cmd).map_err(|_| {
            if counted {
                self.queued.fetch_sub(1, Ordering::AcqRel);
            }
            EngineError::Stopped
        })
    }
}

impl CommandReceiver {
    fn took(&self, cmd: Command) -> Command {
        if !cmd.is_cleanup() {
            self.queued.fetch_sub(1, Ordering::AcqRel);
        }
        cmd
    }

    pub(crate) fn recv(&self) -> Result<Command, RecvError> {
        self.rx.recv().map(|c| self.took(c))
    }

    pub(crate) fn try_recv(&self) -> Result<Command, TryRecvError> {
        self.rx.try_recv().map(|c| self.took(c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counted_commands_are_bounded_and_cleanup_always_passes() {
        let (q, rx) = command_queue(2);
        let stats = || Command::Stats(tokio::sync::oneshot::channel().0);
        q.send(stats()).expect("first");
        q.send(stats()).expect("second");
        assert!(matches!(
            q.send(stats()),
            Err(EngineError::QueueFull { capacity: 2 })
        ));
        // Cleanup is not counted: it goes through a full queue.
        q.send(Command::AbortKey(7))
            .expect("abort through a full queue");
        // Taking one counted command frees one place.
        assert!(matches!(rx.try_recv(), Ok(Command::Stats(_))));
        q.send(stats()).expect("room again");
        assert!(q.send(stats()).is_err());
        drop(rx);
        q.queued.store(0, Ordering::SeqCst);
        assert!(matches!(q.send(stats()), Err(EngineError::Stopped)));
        assert_eq!(
            q.queued.load(Ordering::SeqCst),
            0,
            "a failed send is not counted"
        );
    }
}
