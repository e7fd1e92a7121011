//! Two routers with `--router-replica-sync` in front of one worker, with a real NATS (mutual
//! TLS) and file discovery: each counts the other's in-flight requests in the load it routes
//! by, drops a request's load when it ends, and drops all of a router's load when that router
//! is killed with SIGKILL; the survivor serves on.

mod common;

use std::time::Duration;

use common::*;
use futures_util::StreamExt;
use serde_json::json;

/// Bound on every wait of this test (a killed router leaves discovery within its TTL, 10 s).
const BOUND: Duration = Duration::from_secs(60);
const DECODE_BLOCKS: &str = "dynamo_frontend_worker_active_decode_blocks";

fn base(r: &Proc) -> String {
    format!("http://{}", field(r.ready_line(), "http="))
}

async fn metric(base: &str, name: &str, labels: &str) -> f64 {
    metric_sum(&format!("{base}/metrics"), name, labels).await
}

/// Waits (bounded) until `cond` holds on the value of `name{labels}` at `base`.
async fn wait_metric(base: &str, name: &str, labels: &str, cond: impl Fn(f64) -> bool) -> f64 {
    let seen = || async {
        let v = metric(base, name, labels).await;
        cond(v).then_some(v)
    };
    match tandem_test_support::wait_until(BOUND, seen).await {
        Some(v) => v,
        None => panic!(
            "{base}: {name}{{{labels}}} never met the condition (now {})",
            metric(base, name, labels).await
        ),
    }
}

/// A long streamed completion through `base`, its first chunk read: the request is in
/// flight until the returned response is dropped.
async fn long_request(base: &str, rid: &str) -> impl futures_util::Stream + Unpin {
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .header("x-request-id", rid)
        .json(&json!({
            "model": "tandem-tiny",
            "prompt": "A long story about a lighthouse keeper and the sea",
            "max_tokens": 6000,
            "ignore_eos": true,
            "stream": true,
        }))
        .timeout(BOUND)
        .send()
        .await
        .expect("request");
    assert_eq!(r.status().as_u16(), 200, "{rid}");
    let mut body = Box::pin(r.bytes_stream());
    body.next()
        .await
        .expect("a first chunk")
        .expect("a first chunk");
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_load_and_a_killed_router_takes_its_own_with_it() {
    let tls = tandem_test_support::internal_tls_dir();
    let nats =
        tandem_test_support::NatsServer::start_tls(tls).expect("nats-server must be installed");
    let url = nats.url();
    let nats_args = ["--event-plane", "nats", "--nats-server", url.as_str()];
    let discovery = temp_dir("replicas");
    let worker = start_worker(&discovery, &nats_args);
    let worker_id = field(worker.ready_line(), "instance_id=").to_string();
    let on_worker = format!("worker_id=\"{worker_id}\"");
    let router_args = [&nats_args[..], &["--router-replica-sync"]].concat();
    let a = start_router(&discovery, 1, &router_args);
    let b = start_router(&discovery, 1, &router_args);
    let (a_base, b_base) = (base(&a), base(&b));
    for r in [&a_base, &b_base] {
        wait_metric(r, "tandem_router_replica_peers", "", |v| v == 1.0).await;
    }

    // A request through A counts on B as on A; its end frees it on both.
    let stream = long_request(&a_base, "long-1").await;
    let on_a = wait_metric(&a_base, DECODE_BLOCKS, &on_worker, |v| v > 0.0).await;
    wait_metric(&b_base, DECODE_BLOCKS, &on_worker, |v| v == on_a).await;
    drop(stream);
    wait_metric(&a_base, DECODE_BLOCKS, &on_worker, |v| v == 0.0).await;
    wait_metric(&b_base, DECODE_BLOCKS, &on_worker, |v| v == 0.0).await;

    // kill -9 of A with a request in flight: B drops A's load once A leaves discovery, and
    // serves on.
    let stream = long_request(&a_base, "long-2").await;
    wait_metric(&b_base, DECODE_BLOCKS, &on_worker, |v| v > 0.0).await;
    drop(a);
    wait_metric(&b_base, DECODE_BLOCKS, &on_worker, |v| v == 0.0).await;
    wait_metric(&b_base, "tandem_router_replica_peers", "", |v| v == 0.0).await;
    drop(stream);
    let r = reqwest::Client::new()
        .post(format!("{b_base}/v1/completions"))
        .json(&json!({"model": "tandem-tiny", "prompt": "hello", "max_tokens": 4}))
        .timeout(BOUND)
        .send()
        .await
        .expect("B serves");
    assert_eq!(r.status().as_u16(), 200);
    assert!(
        metric(
            &b_base,
            "tandem_router_replica_events_total",
            "outcome=\"applied\""
        )
        .await
            > 0.0
    );
    assert_eq!(
        metric(
            &b_base,
            "tandem_router_replica_events_total",
            "outcome=\"bad_signature\""
        )
        .await,
        0.0
    );
    drop(worker);
    let _ = std::fs::remove_dir_all(&discovery);
}
