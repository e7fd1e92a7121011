//! KV-aware routing and cancellation with two real workers.

mod common;

use std::time::{Duration, Instant};

use common::Topology;
use serde_json::{json, Value};
use tandem_protocol::worker::GenerateRequest;
use tandem_text::SamplingParams;
use tokio_stream::StreamExt;

use common::{worker_blocks, worker_client as client, worker_stats as stats};

async fn router_index(t: &Topology) -> Value {
    reqwest::get(format!("{}/debug/kv_index", t.admin_base()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Waits (bounded) until the router has applied every event each worker has published.
async fn wait_synced(t: &Topology) {
    let deadline = Instant::now() + Duration::from_secs(20);
    'outer: loop {
        assert!(
            Instant::now() < deadline,
            "router index never caught up: {}",
            router_index(t).await
        );
        let index = router_index(t).await;
        for i in 0..t.workers.len() {
            let want = stats(&t.worker_grpc(i)).await.last_event_id;
            let have = index["workers"][t.worker_id(i).to_string()]["last_event_id"]
                .as_u64()
                .unwrap_or(0);
            if have != want {
                tokio::time::sleep(Duration::from_millis(25)).await;
                continue 'outer;
            }
        }
        return;
    }
}

async fn direct_generate(addr: &str, id: &str, prompt: Vec<u32>) {
    let mut s = client(addr)
        .await
        .generate(GenerateRequest {
            replayed_tokens: 0,
            request_id: id.into(),
            cache_salt: None,
            prompt,
            sampling_params: Some(tandem_router::wire::sampling_params(&SamplingParams {
                max_tokens: Some(1),
                ..SamplingParams::greedy()
            })),
            media: Default::default(),
        })
        .await
        .expect("generate")
        .into_inner();
    while let Some(item) = s.next().await {
        item.expect("output");
    }
}

fn prefix() -> Vec<u32> {
    (1000..1000 + 320).collect()
}

fn with_suffix(extra: u32) -> Vec<u32> {
    let mut p = prefix();
    p.extend([40000 + extra, 40001 + extra]);
    p
}

async fn complete(t: &Topology, prompt: Vec<u32>) -> (u64, u64) {
    let (status, body, headers) = t
        .post(
            "/v1/completions",
            json!({"model": "tandem-tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let worker: u64 = headers["x-tandem-worker-id"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    (
        worker,
        body["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_prefixes_go_to_the_worker_holding_them_and_follow_eviction() {
    let t = Topology::start_healthy(
        2,
        &["--trtllm.kv_cache_config.max_tokens", "1024"],
        &["--admin-port", "0", "--expose-worker-id"],
    )
    .await;
    let (first, _) = complete(&t, with_suffix(0)).await;
    wait_synced(&t).await;
    for i in 1..4 {
        let (w, cached) = complete(&t, with_suffix(i * 10)).await;
        assert_eq!(
            w, first,
            "request {i} with the shared prefix went elsewhere"
        );
        assert!(cached >= 320, "cached tokens {cached}");
        wait_synced(&t).await;
    }
    // Give the other worker the prefix too, then evict it from the first one: routing follows.
    let holder = (0..2).find(|i| t.worker_id(*i) == first).unwrap();
    let other = 1 - holder;
    direct_generate(&t.worker_grpc(other), "prime", with_suffix(99)).await;
    for k in 0..4u32 {
        let junk: Vec<u32> = (0..600).map(|i| 60000 + k * 1000 + i).collect();
        direct_generate(&t.worker_grpc(holder), &format!("evict-{k}"), junk).await;
    }
    let (_, holder_blocks) = worker_blocks(&t.worker_grpc(holder)).await;
    let (_, other_blocks) = worker_blocks(&t.worker_grpc(other)).await;
    let prefix_first_block = other_blocks.iter().find(|h| !holder_blocks.contains(h));
    assert!(prefix_first_block.is_some(), "eviction did not happen");
    wait_synced(&t).await;
    let (w, cached) = complete(&t, with_suffix(500)).await;
    assert_eq!(w, t.worker_id(other), "routing did not follow the eviction");
    assert!(cached >= 320);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_spreads_and_the_index_equals_the_workers_dumps() {
    let t = Topology::start_healthy(
        2,
        &[],
        &[
            "--router-mode",
            "round-robin",
            "--admin-port",
            "0",
            "--expose-worker-id",
        ],
    )
    .await;
    let mut seen = std::collections::HashSet::new();
    let mut handles = Vec::new();
    for i in 0..8u32 {
        let base = t.base.clone();
        handles.push(tokio::spawn(async move {
            let mut prompt: Vec<u32> = (2000 + i * 7..2000 + i * 7 + 100).collect();
            prompt.push(i);
            let r = reqwest::Client::new()
                .post(format!("{base}/v1/completions"))
                .json(&json!({"model": "tandem-tiny", "prompt": prompt, "max_tokens": 3}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status().as_u16(), 200);
            r.headers()["x-tandem-worker-id"]
                .to_str()
                .unwrap()
                .to_string()
        }));
    }
    for h in handles {
        seen.insert(h.await.unwrap());
    }
    assert_eq!(seen.len(), 2, "round-robin used {seen:?}");
    wait_synced(&t).await;
    let index = router_index(&t).await;
    for i in 0..2 {
        let (_, blocks) = worker_blocks(&t.worker_grpc(i)).await;
        let ours: Vec<u64> = serde_json::from_value(
            index["workers"][t.worker_id(i).to_string()]["block_hashes"].clone(),
        )
        .unwrap();
        assert!(!blocks.is_empty());
        assert_eq!(ours, blocks, "router index differs from worker {i}'s dump");
    }
}

async fn wait_blocks_released(addr: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = stats(addr).await;
        if s.referenced_blocks == 0 && s.running == 0 && s.waiting == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "blocks still referenced after cancellation: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_frees_the_workers_blocks() {
    let t = Topology::start_healthy(1, &[], &[]).await;
    let addr = t.worker_grpc(0);
    assert_eq!(stats(&addr).await.referenced_blocks, 0);
    // Streaming: read one chunk, then drop the connection.
    let mut resp = reqwest::Client::new()
        .post(format!("{}/v1/completions", t.base))
        .json(&json!({"model": "tandem-tiny", "prompt": "Tell me a long story", "max_tokens": 4000, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .unwrap();
    let first = resp.chunk().await.unwrap().expect("a first chunk");
    assert!(String::from_utf8_lossy(&first).contains("data:"));
    assert!(stats(&addr).await.referenced_blocks > 0);
    drop(resp);
    wait_blocks_released(&addr).await;

    // Non-streaming: give up on the request while it runs.
    let base = t.base.clone();
    let req = tokio::spawn(async move {
        reqwest::Client::new()
            .post(format!("{base}/v1/completions"))
            .json(&json!({"model": "tandem-tiny", "prompt": "Another long one", "max_tokens": 4000, "ignore_eos": true}))
            .send()
            .await
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while stats(&addr).await.running == 0 {
        assert!(Instant::now() < deadline, "request never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    req.abort();
    wait_blocks_released(&addr).await;
    // The router still serves.
    let (status, _, _) = t
        .post(
            "/v1/completions",
            json!({"model": "tandem-tiny", "prompt": "ok", "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_mode_takes_its_target_from_the_header_or_nvext() {
    let t =
        Topology::start_healthy(2, &[], &["--router-mode", "direct", "--expose-worker-id"]).await;
    let send = |target: Option<String>, body: Value| {
        let url = format!("{}/v1/completions", t.base);
        async move {
            let mut r = reqwest::Client::new().post(url).json(&body);
            if let Some(id) = target {
                r = r.header("x-tandem-worker-id", id);
            }
            let r = r.send().await.expect("request");
            let worker = r
                .headers()
                .get("x-tandem-worker-id")
                .map(|v| v.to_str().unwrap().to_string());
            let status = r.status().as_u16();
            (status, worker, r.text().await.unwrap())
        }
    };
    let body = json!({"model": "tandem-tiny", "prompt": "Hello", "max_tokens": 2});
    for i in 0..2 {
        let id = t.worker_id(i).to_string();
        for _ in 0..2 {
            let (status, worker, text) = send(Some(id.clone()), body.clone()).await;
            assert_eq!(
                (status, worker.as_deref()),
                (200, Some(id.as_str())),
                "{text}"
            );
        }
        let nvext = json!({"model": "tandem-tiny", "prompt": "Hello", "max_tokens": 2,
            "nvext": {"backend_instance_id": t.worker_id(i)}});
        let (status, worker, text) = send(None, nvext).await;
        assert_eq!(
            (status, worker.as_deref()),
            (200, Some(id.as_str())),
            "{text}"
        );
    }
    for (target, needle) in [
        (None, "needs the target worker"),
        (Some("12345".to_string()), "12345"),
        (Some("abc".to_string()), "instance id"),
    ] {
        let (status, _, text) = send(target, body.clone()).await;
        assert_eq!(status, 400, "{text}");
        assert!(text.contains(needle), "{text}");
    }
}
