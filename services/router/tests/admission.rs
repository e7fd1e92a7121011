//! Admission end to end, router + a real tiny-model worker: bursts wait in the router's queue
//! instead of failing, a full queue answers 503 with Retry-After, rate limits answer 429, and
//! each kind of abusive input gets a clear 4xx while a small request keeps being served.

mod common;

use std::time::{Duration, Instant};

use common::Topology;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const MODEL: &str = "tandem-tiny";

fn small_completion(max_tokens: u32) -> Value {
    json!({"model": MODEL, "prompt": "Hello there", "max_tokens": max_tokens, "temperature": 0})
}

/// A client with one connection per request in flight and no pool limit.
fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .expect("client")
}

/// Posts `body` and returns the status, the `Retry-After` header and the time to the answer.
async fn post(
    c: &reqwest::Client,
    base: &str,
    path: &str,
    body: &Value,
) -> (u16, Option<String>, Duration) {
    let t = Instant::now();
    let r = c
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .expect("request");
    let status = r.status().as_u16();
    let retry = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let _ = r.bytes().await;
    (status, retry, t.elapsed())
}

/// The sum and count of a Prometheus histogram in the router's `/metrics`.
async fn histogram(base: &str, name: &str) -> (f64, f64) {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    let value = |suffix: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("{name}_{suffix}")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (value("sum"), value("count"))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_requests_wait_in_the_queue_and_all_succeed() {
    // A low threshold makes the queue hold nearly the whole burst: a worker is saturated as
    // soon as a few prompts are prefilling.
    let t = Topology::start_healthy(1, &[], &["--router-queue-threshold", "0.02"]).await;
    let c = client();
    let started = Instant::now();
    let tasks: Vec<_> = (0..1000)
        .map(|_| {
            let (c, base) = (c.clone(), t.base.clone());
            tokio::spawn(
                async move { post(&c, &base, "/v1/completions", &small_completion(2)).await },
            )
        })
        .collect();
    let mut latencies = Vec::new();
    for task in tasks {
        let (status, _, took) = task.await.expect("task");
        assert_eq!(
            status, 200,
            "a request was refused while the queue had room"
        );
        latencies.push(took);
    }
    latencies.sort();
    let (wait_sum, waited) = histogram(&t.base, "tandem_router_queue_wait_seconds").await;
    assert!(waited > 0.0, "no request waited in the queue");
    println!(
        "1000 concurrent: all 200 in {:.2} s; latency p50 {:?} p90 {:?} p99 {:?} max {:?}; {} queued, mean wait {:.3} s",
        started.elapsed().as_secs_f64(),
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.9),
        percentile(&latencies, 0.99),
        latencies.last().unwrap(),
        waited,
        wait_sum / waited
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_queue_bound_requests_get_503_with_retry_after() {
    let t = Topology::start_healthy(
        1,
        &[],
        &[
            "--router-queue-threshold",
            "0.0001",
            "--router-queue-max-requests",
            "4",
        ],
    )
    .await;
    let c = client();
    // Long answers keep the worker saturated while the burst arrives.
    let body =
        json!({"model": MODEL, "prompt": "Hello there", "max_tokens": 64, "ignore_eos": true});
    let tasks: Vec<_> = (0..40)
        .map(|_| {
            let (c, base, body) = (c.clone(), t.base.clone(), body.clone());
            tokio::spawn(async move { post(&c, &base, "/v1/completions", &body).await })
        })
        .collect();
    let (mut ok, mut full) = (0, 0);
    for task in tasks {
        let (status, retry, _) = task.await.expect("task");
        match status {
            200 => ok += 1,
            503 => {
                let secs: u64 = retry.expect("Retry-After on 503").parse().expect("seconds");
                assert!(secs >= 1);
                full += 1;
            }
            other => panic!("unexpected status {other}"),
        }
    }
    assert!(full > 0, "the queue never filled");
    assert!(ok >= 5, "only {ok} served");
    // Once the burst is over, the queue has room again.
    let (status, _, _) = post(&c, &t.base, "/v1/completions", &small_completion(2)).await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_limit_answers_429_with_retry_after() {
    let t = Topology::start_healthy(1, &[], &["--rate-limit-requests-per-sec", "2"]).await;
    let c = client();
    let mut statuses = Vec::new();
    for _ in 0..6 {
        let (status, retry, _) = post(&c, &t.base, "/v1/completions", &small_completion(1)).await;
        if status == 429 {
            assert!(retry.is_some(), "429 without Retry-After");
        }
        statuses.push(status);
    }
    assert!(statuses.contains(&429), "{statuses:?}");
    assert_eq!(statuses[0], 200);
}

/// One abusive input, and the status it must get.
struct Abuse {
    what: &'static str,
    path: &'static str,
    body: Value,
    status: u16,
}

fn abuses() -> Vec<Abuse> {
    let chat = |extra: Value| {
        let mut b = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let many_messages: Vec<Value> = (0..5000)
        .map(|_| json!({"role": "user", "content": "x"}))
        .collect();
    let many_tools: Vec<Value> = (0..300)
        .map(|i| json!({"type": "function", "function": {"name": format!("f{i}"), "parameters": {}}}))
        .collect();
    vec![
        Abuse {
            what: "30 MB prompt",
            path: "/v1/completions",
            body: json!({"model": MODEL, "prompt": "a ".repeat(15 << 20), "max_tokens": 1}),
            status: 400,
        },
        Abuse {
            what: "5000 messages",
            path: "/v1/chat/completions",
            body: chat(json!({"messages": many_messages})),
            status: 400,
        },
        Abuse {
            what: "300 tools",
            path: "/v1/chat/completions",
            body: chat(json!({"tools": many_tools})),
            status: 400,
        },
        Abuse {
            what: "17 stop strings",
            path: "/v1/chat/completions",
            body: chat(json!({"stop": (0..17).map(|i| i.to_string()).collect::<Vec<_>>()})),
            status: 400,
        },
        Abuse {
            what: "a 2 kB stop string",
            path: "/v1/chat/completions",
            body: chat(json!({"stop": ["s".repeat(2048)]})),
            status: 400,
        },
        Abuse {
            what: "100k stop_token_ids",
            path: "/v1/chat/completions",
            body: chat(json!({"stop_token_ids": (0..100_000u32).collect::<Vec<_>>()})),
            status: 400,
        },
        Abuse {
            what: "a stop_token_id outside the vocabulary",
            path: "/v1/chat/completions",
            body: chat(json!({"stop_token_ids": [4_000_000_000u32]})),
            status: 400,
        },
        Abuse {
            what: "max_tokens near u64::MAX",
            path: "/v1/chat/completions",
            body: chat(json!({"max_tokens": i64::MAX})),
            status: 400,
        },
        Abuse {
            what: "n = 100000",
            path: "/v1/chat/completions",
            body: chat(json!({"n": 100000})),
            status: 400,
        },
        Abuse {
            what: "a priority outside i32",
            path: "/v1/chat/completions",
            body: chat(json!({"priority": 1i64 << 40})),
            status: 400,
        },
        Abuse {
            what: "an unknown model",
            path: "/v1/chat/completions",
            body: chat(json!({"model": "no-such-model-7f3a"})),
            status: 404,
        },
    ]
}

/// Sends small requests one after another until `stop` flips; returns their latencies.
fn spawn_prober(
    base: String,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<Vec<Duration>> {
    tokio::spawn(async move {
        let c = client();
        let mut seen = Vec::new();
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            let (status, _, took) = post(&c, &base, "/v1/completions", &small_completion(2)).await;
            assert_eq!(status, 200, "a small request failed during the abuse");
            seen.push(took);
        }
        seen
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abusive_inputs_get_4xx_while_a_small_request_is_served() {
    let t = Topology::start_healthy(1, &[], &[]).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let prober = spawn_prober(t.base.clone(), stop.clone());
    let c = client();
    for a in abuses() {
        let (status, _, took) = post(&c, &t.base, a.path, &a.body).await;
        println!("{}: {status} in {took:?}", a.what);
        assert_eq!(status, a.status, "{}", a.what);
    }
    // A body that is not JSON by its content type.
    let r = c
        .post(format!("{}/v1/completions", t.base))
        .header("content-type", "text/plain")
        .body(small_completion(1).to_string())
        .send()
        .await
        .expect("request");
    assert_eq!(r.status().as_u16(), 415);
    // Unknown model names never become metric labels.
    let metrics = reqwest::get(format!("{}/metrics", t.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        !metrics.contains("no-such-model-7f3a"),
        "an unknown model became a label"
    );
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut seen = prober.await.expect("prober");
    seen.sort();
    assert!(!seen.is_empty());
    println!(
        "small requests during the abuse: {} served, p50 {:?}, max {:?}",
        seen.len(),
        percentile(&seen, 0.5),
        seen.last().unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_dropped_and_others_still_get_in() {
    let t = Topology::start_healthy(
        1,
        &[],
        &[
            "--http-header-read-timeout-secs",
            "1",
            "--http-body-read-timeout-secs",
            "1",
            "--http-max-connections",
            "3",
        ],
    )
    .await;
    let addr = t.base.trim_start_matches("http://").to_string();
    // Two clients that send half a header and stall hold two of the three connections.
    let mut stalled = Vec::new();
    for _ in 0..2 {
        let mut s = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect");
        s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        stalled.push(s);
    }
    // A client that sends its headers but not the whole body gets 408.
    let mut slow_body = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    slow_body
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\"")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let read =
        tokio::time::timeout(Duration::from_secs(20), slow_body.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "the slow body was never answered");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    // The stalled headers are cut off by the header timeout.
    for mut s in stalled {
        let mut buf = Vec::new();
        let r = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut buf)).await;
        assert!(r.is_ok(), "a stalled client kept its connection");
    }
    // Meanwhile and after, a normal request is served.
    let (status, _, took) = post(&client(), &t.base, "/v1/completions", &small_completion(2)).await;
    assert_eq!(status, 200);
    println!("a request after the slow clients: {took:?}");
}
