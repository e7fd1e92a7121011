//! The HTTP server under the API: at most `--http-max-connections` open connections (further
//! clients wait in the listen backlog, nobody else slows down), each with a header-read
//! timeout (`--http-header-read-timeout-secs`; an idle keep-alive connection is closed after
//! it too), `TCP_NODELAY` so a stream's first token does not wait for Nagle, and a graceful
//! shutdown that lets requests in flight finish. The body-read timeout is the handlers'
//! (see `app`), so it can answer 408.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::Request;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tandem_config::HttpServerConfig;
use tandem_runtime::shutdown::ShutdownToken;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tower::ServiceExt;

/// How long a graceful shutdown waits for requests in flight.
const DRAIN: Duration = Duration::from_secs(30);

/// Serves `app` on `listener` until `shutdown` is cancelled, then drains.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    cfg: &HttpServerConfig,
    shutdown: ShutdownToken,
) {
    let max = cfg.max_connections;
    let permits = Arc::new(Semaphore::new(max as usize));
    let header_timeout = Duration::from_secs(cfg.header_read_timeout_secs.into());
    while let Some((tcp, permit)) = next_connection(&listener, &permits, &shutdown).await {
        let app = app.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            serve_connection(tcp, app, header_timeout, shutdown).await;
            drop(permit);
        });
    }
    // Every permit back: every connection has ended.
    if tokio::time::timeout(DRAIN, permits.acquire_many(max))
        .await
        .is_err()
    {
        tracing::warn!("requests still in flight after {DRAIN:?}; stopping anyway");
    }
}

/// The next accepted connection with its permit, or `None` on shutdown. Waits for a permit
/// before accepting, so past the limit clients queue in the kernel's backlog.
async fn next_connection(
    listener: &TcpListener,
    permits: &Arc<Semaphore>,
    shutdown: &ShutdownToken,
) -> Option<(TcpStream, OwnedSemaphorePermit)> {
    loop {
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => p.ok()?,
            _ = shutdown.cancelled() => return None,
        };
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.cancelled() => return None,
        };
        match accepted {
            Ok((tcp, _)) => {
                let _ = tcp.set_nodelay(true);
                return Some((tcp, permit));
            }
            Err(e) => {
                // Out of file descriptors and the like: back off rather than spin.
                tracing::warn!("accepting an HTTP connection failed: {e}");
                drop(permit);
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                    _ = shutdown.cancelled() => return None,
                }
            }
        }
    }
}

async fn serve_connection(
    tcp: TcpStream,
    app: Router,
    header_timeout: Duration,
    shutdown: ShutdownToken,
) {
    let service = TowerToHyperService::new(
        app.map_request(|req: Request<Incoming>| req.map(axum::body::Body::new)),
    );
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
    let conn = builder.serve_connection(TokioIo::new(tcp), service);
    tokio::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => log_end(r),
        _ = shutdown.cancelled() => {
            conn.as_mut().graceful_shutdown();
            log_end(conn.await);
        }
    }
}

fn log_end(r: Result<(), Box<dyn std::error::Error + Send + Sync>>) {
    if let Err(e) = r {
        tracing::debug!("HTTP connection ended: {e}");
    }
}
