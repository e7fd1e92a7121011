//! Discovery on etcd and KV events on NATS, with real servers; event gaps on both event
//! planes (made with a failpoint) are healed so the router's index equals the workers' dumps.

mod common;

use std::time::{Duration, Instant};

use common::{start_router, start_worker_env, temp_dir, Proc, Topology};
use serde_json::{json, Value};

async fn worker_state(addr: &str) -> (u64, Vec<u64>) {
    // The stats' last event id, not the dump's: the index must be current with the worker.
    let last = common::worker_stats(addr).await.last_event_id;
    (last, common::worker_blocks(addr).await.1)
}

/// The router's index, from its admin listener.
async fn kv_index(t: &Topology) -> Value {
    reqwest::get(format!("{}/debug/kv_index", t.admin_base()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Waits until the router's index for every worker equals the worker's own dump.
async fn wait_index_matches(t: &Topology) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let index = kv_index(t).await;
        let mut all = true;
        for i in 0..t.workers.len() {
            let (last, blocks) = worker_state(&t.worker_grpc(i)).await;
            let w = &index["workers"][t.worker_id(i).to_string()];
            let ours: Vec<u64> =
                serde_json::from_value(w["block_hashes"].clone()).unwrap_or_default();
            all &=
                w["last_event_id"].as_u64() == Some(last) && ours == blocks && !blocks.is_empty();
        }
        if all {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "router index never matched the worker dumps: {index}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

async fn traffic(t: &Topology, n: u32) {
    for i in 0..n {
        let prompt: Vec<u32> = (3000 + i * 50..3000 + i * 50 + 70).collect();
        let (status, body, _) = t
            .post(
                "/v1/completions",
                json!({"model": "tandem-tiny", "prompt": prompt, "max_tokens": 2}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }
}

const SKIP: (&str, &str) = ("TANDEM_FAILPOINT_SKIP_KV_EVENT_IDS", "2,3");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_event_plane_heals_a_gap_by_replay() {
    let discovery = temp_dir("direct-gap");
    let w = start_worker_env(&discovery, &[], &[SKIP]);
    let r = start_router(&discovery, 1, &["--admin-port", "0"]);
    let base = format!("http://{}", common::field(r.ready_line(), "http="));
    let t = Topology {
        workers: vec![w],
        router: Some(r),
        base,
        discovery,
    };
    t.wait_healthy().await;
    traffic(&t, 4).await;
    wait_index_matches(&t).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_discovery_and_nats_events_with_a_gap_and_a_killed_worker() {
    // Both under the deployment's mutual TLS, as every process of it is.
    let tls = tandem_test_support::internal_tls_dir();
    let etcd = tandem_test_support::EtcdServer::start_tls(tls)
        .expect("etcd (Debian etcd-server) must be installed");
    let nats =
        tandem_test_support::NatsServer::start_tls(tls).expect("nats-server must be installed");
    let discovery = temp_dir("unused");
    let ep = etcd.endpoint();
    let url = nats.url();
    let planes = [
        "--discovery-backend",
        "etcd",
        "--etcd-endpoints",
        ep.as_str(),
        "--event-plane",
        "nats",
        "--nats-server",
        url.as_str(),
    ];
    let w0 = start_worker_env(&discovery, &planes, &[SKIP]);
    let w1 = start_worker_env(&discovery, &planes, &[]);
    let router_args = [&planes[..], &["--admin-port", "0", "--expose-worker-id"]].concat();
    let r = start_router(&discovery, 2, &router_args);
    let base = format!("http://{}", common::field(r.ready_line(), "http="));
    let mut t = Topology {
        workers: vec![w0, w1],
        router: Some(r),
        base,
        discovery,
    };
    t.wait_healthy().await;
    traffic(&t, 6).await;
    wait_index_matches(&t).await;

    // kill -9 one worker: its lease expires and the router stops routing to it.
    let dead_id = t.worker_id(0);
    let mut dead: Proc = t.workers.remove(0);
    dead.child.kill().expect("kill -9");
    let _ = dead.child.wait();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let index = kv_index(&t).await;
        if index["workers"].get(dead_id.to_string()).is_none() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "killed worker still routed to after 30 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for _ in 0..4 {
        let (status, body, headers) = t
            .post(
                "/v1/completions",
                json!({"model": "tandem-tiny", "prompt": "still there?", "max_tokens": 2}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            headers["x-tandem-worker-id"].to_str().unwrap(),
            t.worker_id(0).to_string()
        );
    }
}

/// The value of a counter with labels on the router's `/metrics`, 0 when absent.
async fn counter(base: &str, series: &str) -> f64 {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(series))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_nats_event_is_dropped_and_counted() {
    use std::sync::Arc;
    use tandem_kv_protocol::events::{KvCacheEvent, KvCacheEventData};
    use tandem_runtime::events::{EventSigner, NatsEventPlane};

    let tls = tandem_test_support::internal_tls_dir();
    let nats =
        tandem_test_support::NatsServer::start_tls(tls).expect("nats-server must be installed");
    let url = nats.url();
    let planes = ["--event-plane", "nats", "--nats-server", url.as_str()];
    let discovery = temp_dir("forged");
    let w = start_worker_env(&discovery, &planes, &[]);
    let router_args = [&planes[..], &["--admin-port", "0"]].concat();
    let r = start_router(&discovery, 1, &router_args);
    let base = format!("http://{}", common::field(r.ready_line(), "http="));
    let t = Topology {
        workers: vec![w],
        router: Some(r),
        base,
        discovery,
    };
    t.wait_healthy().await;
    traffic(&t, 3).await;
    wait_index_matches(&t).await;
    let before = kv_index(&t).await;

    // A member of the deployment (it has the TLS folder, so NATS lets it publish) claims to
    // be the worker, with a key of its own: a `Cleared` that would empty the worker's index.
    let identity = tandem_test_support::internal_security();
    let plane = NatsEventPlane::connect(&url, Duration::from_secs(5), identity.identity())
        .await
        .expect("connect to NATS");
    let forger = Arc::new(EventSigner::generate().expect("key"));
    let publisher = plane
        .kv_events_publisher::<KvCacheEvent>("dynamo", "backend", t.worker_id(0), forger)
        .expect("publisher");
    let series = "tandem_router_kv_events_rejected_total{reason=\"signature\"}";
    assert_eq!(counter(&t.base, series).await, 0.0);
    let last = before["workers"][t.worker_id(0).to_string()]["last_event_id"]
        .as_u64()
        .expect("the worker is indexed");
    publisher
        .publish(&KvCacheEvent {
            event_id: last + 1,
            data: KvCacheEventData::Cleared,
            dp_rank: 0,
        })
        .await
        .expect("publish");
    publisher.flush().await.expect("flush");

    // The router handles NATS messages in order: once the counter moved, the event was seen.
    let deadline = Instant::now() + Duration::from_secs(20);
    while counter(&t.base, series).await < 1.0 {
        assert!(Instant::now() < deadline, "forged event never counted");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let after = kv_index(&t).await;
    assert_eq!(before, after, "a forged event changed the index");
    // The worker's own (signed) events still apply.
    traffic(&t, 2).await;
    wait_index_matches(&t).await;
}
