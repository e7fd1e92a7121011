//! Graceful shutdown: SIGTERM / SIGINT become a [`ShutdownToken`] that every part of a service
//! can await, so the order is deregister → stop accepting → drain in-flight work → exit
//! (Dynamo's graceful shutdown).
//!
//! ```no_run
//! # async fn serve() {
//! let token = tandem_runtime::shutdown::on_signals();
//! // ... register, serve ...
//! token.cancelled().await;
//! // deregister first, so routers stop sending; then drain with a deadline; then return.
//! # }
//! ```

use tokio::sync::watch;

/// The trigger side; cloneable, and triggering more than once is harmless.
#[derive(Clone, Debug)]
pub struct Shutdown {
    tx: watch::Sender<bool>,
}

/// The observing side; cheap to clone into every task.
#[derive(Clone, Debug)]
pub struct ShutdownToken {
    rx: watch::Receiver<bool>,
}

/// A new, untriggered pair.
pub fn channel() -> (Shutdown, ShutdownToken) {
    let (tx, rx) = watch::channel(false);
    (Shutdown { tx }, ShutdownToken { rx })
}

impl Shutdown {
    pub fn trigger(&self) {
        // `send_replace` stores the value even when no token is alive any more.
        self.tx.send_replace(true);
    }

    pub fn token(&self) -> ShutdownToken {
        ShutdownToken {
            rx: self.tx.subscribe(),
        }
    }
}

impl ShutdownToken {
    pub fn is_triggered(&self) -> bool {
        *self.rx.borrow()
    }

    /// Resolves once shutdown is triggered. If every trigger is dropped untriggered this never
    /// resolves: nobody asked to stop, so the service keeps running.
    pub async fn cancelled(&self) {
        let mut rx = self.rx.clone();
        if rx.wait_for(|triggered| *triggered).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Spawns a task that triggers shutdown on the first SIGTERM or SIGINT (Ctrl-C), and exits
/// the process with status 130 on a second one, so an operator can always get out of a drain
/// that hangs. Must be called inside a Tokio runtime.
pub fn on_signals() -> ShutdownToken {
    let (trigger, token) = channel();
    spawn_signal_listener(trigger);
    token
}

/// Like [`on_signals`], for an existing trigger (e.g. one also fired by an admin endpoint).
/// The handlers are installed before this returns, so a signal sent right afterwards is never
/// handled by the default action (which would kill the process without draining).
pub fn spawn_signal_listener(trigger: Shutdown) {
    let mut signals = Signals::install();
    tokio::spawn(async move {
        let mut seen = 0u32;
        loop {
            let name = signals.recv().await;
            seen += 1;
            if seen == 1 {
                tracing::info!(signal = name, "shutting down: deregistering and draining");
                trigger.trigger();
            } else {
                tracing::warn!(signal = name, "second signal: exiting immediately");
                std::process::exit(130);
            }
        }
    });
}

#[cfg(unix)]
enum Signals {
    Unix {
        term: tokio::signal::unix::Signal,
        int: tokio::signal::unix::Signal,
    },
    CtrlC,
}

#[cfg(unix)]
impl Signals {
    fn install() -> Self {
        use tokio::signal::unix::{signal, SignalKind};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(term), Ok(int)) => Self::Unix { term, int },
            // Only fails without signal support in the runtime; Ctrl-C still works then.
            (Err(err), _) | (_, Err(err)) => {
                tracing::warn!(%err, "cannot install SIGTERM/SIGINT handlers; using Ctrl-C only");
                Self::CtrlC
            }
        }
    }

    async fn recv(&mut self) -> &'static str {
        match self {
            Self::Unix { term, int } => tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            },
            Self::CtrlC => {
                if tokio::signal::ctrl_c().await.is_err() {
                    // No way to receive signals at all: never report one.
                    std::future::pending::<()>().await;
                }
                "SIGINT"
            }
        }
    }
}

#[cfg(not(unix))]
struct Signals;

#[cfg(not(unix))]
impl Signals {
    fn install() -> Self {
        Self
    }

    async fn recv(&mut self) -> &'static str {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
        "ctrl-c"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn trigger_wakes_all_tokens() {
        let (trigger, token) = channel();
        let other = trigger.token();
        assert!(!token.is_triggered());
        let waiter = tokio::spawn({
            let t = token.clone();
            async move { t.cancelled().await }
        });
        trigger.trigger();
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("token woke")
            .expect("task ok");
        assert!(token.is_triggered() && other.is_triggered());
        // Already triggered: returns at once.
        tokio::time::timeout(Duration::from_secs(1), other.cancelled())
            .await
            .expect("immediate");
    }

    #[tokio::test]
    async fn dropped_trigger_is_not_a_shutdown() {
        let (trigger, token) = channel();
        drop(trigger);
        let waited = tokio::time::timeout(Duration::from_millis(50), token.cancelled()).await;
        assert!(waited.is_err(), "must keep waiting");
        assert!(!token.is_triggered());
    }
}
