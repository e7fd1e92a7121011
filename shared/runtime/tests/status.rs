//! The metrics recorder and the status server over real HTTP.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tandem_runtime::metrics::{install_recorder, names, serve_status, serve_status_until};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Minimal HTTP/1.0 GET: (status code, body).
async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).await.unwrap();
        let code = raw.split_whitespace().nth(1).unwrap().parse().unwrap();
        let body = raw
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        (code, body)
    };
    tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .expect("HTTP answer")
}

#[tokio::test]
async fn metrics_health_and_live() {
    let handle = install_recorder().unwrap();
    // Idempotent: a second call returns the same recorder instead of failing.
    let again = install_recorder().unwrap();

    metrics::histogram!(names::frontend::TIME_TO_FIRST_TOKEN_SECONDS, "model" => "tiny")
        .record(0.02);
    metrics::histogram!(names::frontend::INPUT_SEQUENCE_TOKENS, "model" => "tiny").record(300.0);
    metrics::histogram!(names::router_overhead::TOTAL_MS).record(0.3);
    metrics::counter!(names::frontend::REQUESTS_TOTAL, "model" => "tiny", "status" => "success")
        .increment(2);
    metrics::gauge!(names::component::GPU_CACHE_USAGE_PERCENT).set(12.5);

    let healthy = Arc::new(AtomicBool::new(true));
    let h = healthy.clone();
    let addr = serve_status(
        "127.0.0.1:0",
        handle,
        Arc::new(move || h.load(Ordering::SeqCst)),
    )
    .await
    .unwrap();
    assert_ne!(addr.port(), 0);

    let (code, body) = get(addr, "/metrics").await;
    assert_eq!(code, 200);
    assert!(
        body.contains("dynamo_frontend_requests_total{model=\"tiny\",status=\"success\"} 2"),
        "{body}"
    );
    // Histograms (not summaries), with buckets chosen by suffix.
    assert!(
        body.contains(
            "dynamo_frontend_time_to_first_token_seconds_bucket{model=\"tiny\",le=\"0.025\"} 1"
        ),
        "{body}"
    );
    assert!(
        body.contains("dynamo_frontend_input_sequence_tokens_bucket{model=\"tiny\",le=\"512\"} 1"),
        "{body}"
    );
    assert!(
        body.contains("dynamo_router_overhead_total_ms_bucket{le=\"0.5\"} 1"),
        "{body}"
    );
    assert!(
        body.contains("dynamo_component_gpu_cache_usage_percent 12.5"),
        "{body}"
    );
    assert!(again.render().contains("dynamo_frontend_requests_total"));

    let (code, body) = get(addr, "/health").await;
    assert_eq!(code, 200);
    assert!(body.contains("\"healthy\""), "{body}");
    healthy.store(false, Ordering::SeqCst);
    let (code, body) = get(addr, "/health").await;
    assert_eq!(code, 503);
    assert!(body.contains("\"unhealthy\""), "{body}");
    let (code, _) = get(addr, "/live").await;
    assert_eq!(code, 200);
    let (code, _) = get(addr, "/nope").await;
    assert_eq!(code, 404);
}

#[tokio::test]
async fn status_server_stops_on_shutdown() {
    let handle = install_recorder().unwrap();
    let (trigger, token) = tandem_runtime::shutdown::channel();
    let addr = serve_status_until("127.0.0.1:0", handle, Arc::new(|| true), token)
        .await
        .unwrap();
    assert_eq!(get(addr, "/live").await.0, 200);
    trigger.trigger();
    let closed = tandem_test_support::wait_until(Duration::from_secs(10), || async {
        tokio::net::TcpStream::connect(addr)
            .await
            .is_err()
            .then_some(())
    })
    .await;
    assert!(closed.is_some(), "listener closed after shutdown");
}

#[tokio::test]
async fn bind_error_names_the_address() {
    let handle = install_recorder().unwrap();
    let err = serve_status("not-an-address", handle, Arc::new(|| true))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not-an-address"), "{err}");
}
