//! Long-lived control-plane tasks (a discovery watcher, an event-plane follower) that must not
//! end for good on one error: [`restart_forever`] runs one again with backoff each time it
//! stops, and says so in the log and in `tandem_task_restarts_total{task}`.

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// First wait before a restart; doubled while the task keeps failing, up to [`MAX_BACKOFF`].
pub const FIRST_BACKOFF: Duration = Duration::from_millis(200);
pub const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// A run this long resets the backoff.
const STABLE: Duration = Duration::from_secs(60);

const RESTARTS: &str = "tandem_task_restarts_total";

/// Runs `run()` for ever: each time it returns (an error, or `Ok` when its input ended), it
/// is logged and started again after the backoff.
pub async fn restart_forever<F, Fut, E>(task: &'static str, mut run: F) -> !
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: Display,
{
    let mut backoff = FIRST_BACKOFF;
    loop {
        let started = Instant::now();
        let why = match run().await {
            Ok(()) => "it ended".to_string(),
            Err(e) => format!("{e:#}"),
        };
        if started.elapsed() >= STABLE {
            backoff = FIRST_BACKOFF;
        }
        tracing::error!("{task} stopped ({why}); restarting it in {backoff:?}");
        metrics::counter!(RESTARTS, "task" => task).increment(1);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    #[tokio::test(start_paused = true)]
    async fn a_failing_task_is_restarted_with_doubling_backoff() {
        let runs = Arc::new(AtomicU32::new(0));
        let counted = runs.clone();
        let t0 = Instant::now();
        let task = tokio::spawn(restart_forever("test", move || {
            let n = counted.fetch_add(1, Ordering::SeqCst);
            async move {
                if n < 3 {
                    Err(format!("failure {n}"))
                } else {
                    std::future::pending().await
                }
            }
        }));
        // Three failures: waits of 200, 400 and 800 ms before the fourth run.
        while runs.load(Ordering::SeqCst) < 4 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(t0.elapsed().as_millis() / 100, 14, "{:?}", t0.elapsed());
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert_eq!(
            runs.load(Ordering::SeqCst),
            4,
            "the fourth run keeps running"
        );
        task.abort();
    }
}
