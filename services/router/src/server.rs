//! The HTTP server under the API: at most `--http-max-connections` open connections (further
//! clients wait in the listen backlog, nobody else slows down), each with a header-read
//! timeout (`--http-header-read-timeout-secs`; an idle keep-alive connection is closed after
//! it too), `TCP_NODELAY` so a stream's first token does not wait for Nagle, and a graceful
//! shutdown that lets requests in flight finish. The body-read timeout is the handlers'
//! (see `app`), so it can answer 408. With TLS (`--tls-cert-path`), each accepted connection
//! first completes its handshake within the header-read timeout (a client that sends nothing,
//! or plain HTTP, is dropped) while holding its connection permit.

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
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt;

/// How long a graceful shutdown waits for requests in flight.
const DRAIN: Duration = Duration::from_secs(30);

/// Serves `app` on `listener` (over TLS when `tls` is given) until `shutdown` is cancelled,
/// then drains.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    cfg: &HttpServerConfig,
    tls: Option<TlsAcceptor>,
    shutdown: ShutdownToken,
) {
    let max = cfg.max_connections;
    let permits = Arc::new(Semaphore::new(max as usize));
    let header_timeout = Duration::from_secs(cfg.header_read_timeout_secs.into());
    while let Some((tcp, permit)) = next_connection(&listener, &permits, &shutdown).await {
        let app = app.clone();
        let shutdown = shutdown.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            match tls {
                None => serve_connection(TokioIo::new(tcp), app, header_timeout, shutdown).await,
                Some(acceptor) => {
                    if let Some(stream) = handshake(&acceptor, tcp, header_timeout, &shutdown).await
                    {
                        serve_connection(TokioIo::new(stream), app, header_timeout, shutdown).await;
                    }
                }
            }
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

/// The TLS session of `tcp`, or `None` when the handshake fails, takes longer than
/// `timeout`, or shutdown starts first.
async fn handshake(
    acceptor: &TlsAcceptor,
    tcp: TcpStream,
    timeout: Duration,
    shutdown: &ShutdownToken,
) -> Option<TlsStream<TcpStream>> {
    tokio::select! {
        r = tokio::time::timeout(timeout, acceptor.accept(tcp)) => match r {
            Ok(Ok(stream)) => Some(stream),
            Ok(Err(e)) => {
                tracing::debug!("TLS handshake failed: {e}");
                None
            }
            Err(_) => {
                tracing::debug!("TLS handshake not done within {timeout:?}; connection closed");
                None
            }
        },
        _ = shutdown.cancelled() => None,
    }
}

async fn serve_connection<I>(
    io: TokioIo<I>,
    app: Router,
    header_timeout: Duration,
    shutdown: ShutdownToken,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = TowerToHyperService::new(
        app.map_request(|req: Request<Incoming>| req.map(axum::body::Body::new)),
    );
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
    let conn = builder.serve_connection(io, service);
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
