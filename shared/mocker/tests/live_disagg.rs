//! Live disaggregated serving with simulated workers: `tandem-mocker` prefill workers and pd
//! workers (two of each, `--num-workers 2`, one process per role) behind a real
//! `tandem-router --enforce-disagg`, file discovery in a private folder, on loopback. Every
//! request is prefilled remotely (the decode workers compute no prompt token), the simulated
//! transfer reports exactly the bytes the leases asked for (blocks × `--kv-bytes-per-token` ×
//! block size), leases end released, and the prefill worker chosen follows KV overlap (the
//! simulated engines' KV events reach the router). Readiness comes from READY lines; every
//! wait is bounded; nothing is timed.
//!
//! Needs the router binary next to the mocker's: `cargo build -p tandem-router -p tandem-mocker`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tandem_protocol::worker::worker_client::WorkerClient;
use tandem_protocol::worker::{LoadStatsReply, LoadStatsRequest};
use tandem_test_support::{field, sibling_bin, spawn_ready, spawn_ready_n, Proc, READY_TIMEOUT};

const BLOCK: u64 = 16;
const BYTES_PER_TOKEN: u64 = 1000;

fn router_bin() -> PathBuf {
    sibling_bin(env!("CARGO_BIN_EXE_tandem-mocker"), "tandem-router")
}

fn mocker(disc: &Path, mode: &str, workers: usize) -> Proc {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem-mocker"));
    cmd.args(["--disaggregation-mode", mode, "--num-workers"])
        .arg(workers.to_string())
        .args([
            "--publish-kv-events",
            "--rpc-host",
            "127.0.0.1",
            "--system-host",
            "127.0.0.1",
            "--block-size",
            &BLOCK.to_string(),
            "--num-gpu-blocks-override",
            "1024",
            "--speedup-ratio",
            "20",
            "--kv-bytes-per-token",
            &BYTES_PER_TOKEN.to_string(),
        ])
        .args(tandem_test_support::tls_args())
        .env("DYN_FILE_KV", disc)
        .env("DYN_DISCOVERY_BACKEND", "file");
    spawn_ready_n(&mut cmd, "TANDEM_WORKER_READY", workers)
}

async fn stats(addr: &str) -> LoadStatsReply {
    let channel = tandem_test_support::internal_security()
        .endpoint(addr)
        .expect("worker address")
        .connect()
        .await
        .expect("connect to worker");
    WorkerClient::new(channel)
        .load_stats(LoadStatsRequest {})
        .await
        .expect("load stats")
        .into_inner()
}

async fn wait_stats(addr: &str, what: &str, cond: impl Fn(&LoadStatsReply) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = stats(addr).await;
        if cond(&s) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: still {s:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn post(base: &str, body: Value) -> (u16, Value, reqwest::header::HeaderMap) {
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .expect("request");
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let json = r.json().await.unwrap_or(Value::Null);
    (status, json, headers)
}

/// The bytes a remote prefill of `prompt_tokens` (nothing cached on the decode side) moves.
fn wire_bytes(prompt_tokens: u64) -> u64 {
    prompt_tokens.div_ceil(BLOCK) * BLOCK * BYTES_PER_TOKEN
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulated_prefill_and_pd_workers_serve_behind_the_real_router() {
    let disc = std::env::temp_dir().join(format!(
        "tandem-mocker-disagg-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    ));
    std::fs::create_dir_all(&disc).expect("temp dir");
    let prefill = mocker(&disc, "prefill", 2);
    let decode = mocker(&disc, "pd", 2);
    let router = spawn_ready(
        Command::new(router_bin())
            .args(["--http-host", "127.0.0.1", "--http-port", "0"])
            .args(["--router-min-initial-workers", "2", "--enforce-disagg"])
            .args(tandem_test_support::tls_args())
            // The tests read x-tandem-prefill-worker-id.
            .arg("--expose-worker-id")
            .env("DYN_FILE_KV", &disc)
            .env("DYN_DISCOVERY_BACKEND", "file"),
        "TANDEM_ROUTER_READY",
    );
    let base = format!("http://{}", field(router.ready_line(), "http="));
    let deadline = Instant::now() + READY_TIMEOUT;
    let client = reqwest::Client::new();
    loop {
        let ok = client
            .get(format!("{base}/health"))
            .send()
            .await
            .map(|r| r.status().as_u16() == 200)
            .unwrap_or(false);
        if ok {
            break;
        }
        assert!(Instant::now() < deadline, "router never became healthy");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let addrs =
        |p: &Proc| -> Vec<String> { p.ready_lines.iter().map(|l| field(l, "grpc=")).collect() };
    let (prefill_addrs, decode_addrs) = (addrs(&prefill), addrs(&decode));
    let prefill_ids: Vec<String> = prefill
        .ready_lines
        .iter()
        .map(|l| field(l, "instance_id="))
        .collect();

    // Distinct prompts (they differ in their first tokens: no block is shared), concurrently.
    let mut set = tokio::task::JoinSet::new();
    for i in 0..8 {
        let body = json!({
            "model": "tandem-tiny",
            "prompt": format!("{i} request asks about {}", "the simulated transfer ".repeat(5 + 7 * i)),
            "max_tokens": 6,
            "temperature": 0,
        });
        let base = base.clone();
        set.spawn(async move { post(&base, body).await });
    }
    let mut expected = 0;
    while let Some(r) = set.join_next().await {
        let (status, json, headers) = r.expect("request task");
        assert_eq!(status, 200, "{json}");
        let pid = headers
            .get("x-tandem-prefill-worker-id")
            .unwrap_or_else(|| panic!("not disaggregated: {headers:?}"))
            .to_str()
            .expect("header")
            .to_string();
        assert!(prefill_ids.contains(&pid), "{pid} is not a prefill worker");
        assert_eq!(json["usage"]["completion_tokens"], 6, "{json}");
        expected += wire_bytes(json["usage"]["prompt_tokens"].as_u64().expect("usage"));
    }

    let mut received = 0;
    for a in &decode_addrs {
        let s = stats(a).await;
        assert_eq!(
            s.prompt_tokens_computed, 0,
            "decode worker {a} computed a prompt"
        );
        received += s.kv_bytes_received;
    }
    let mut sent = 0;
    for a in &prefill_addrs {
        sent += stats(a).await.kv_bytes_sent;
    }
    assert_eq!(
        received, expected,
        "bytes the decode workers were told about"
    );
    assert_eq!(sent, expected, "bytes the prefill workers' links carried");
    // The simulated writes show in the transfer metrics as real ones do.
    let metrics = client
        .get(format!(
            "http://{}/metrics",
            field(prefill.ready_line(), "http=")
        ))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    assert!(
        metrics.contains("trtllm_kv_transfer_success_total"),
        "no transfer metrics on a simulated prefill worker"
    );

    // Router decisions on the simulated engines' KV events: requests sharing a long prefix
    // go to the prefill worker that holds it.
    for k in 0..3 {
        let prefix = format!("Shared context {k}: ").repeat(40);
        let mut chosen = None;
        for j in 0..3 {
            let body = json!({"model": "tandem-tiny", "prompt": format!("{prefix} question {j}?"), "max_tokens": 2});
            let (s, j_, h) = post(&base, body).await;
            assert_eq!(s, 200, "{j_}");
            let pid = h["x-tandem-prefill-worker-id"]
                .to_str()
                .expect("header")
                .to_string();
            match &chosen {
                None => chosen = Some(pid),
                Some(c) => assert_eq!(c, &pid, "prefix {k}, request {j}: another prefill worker"),
            }
        }
    }

    // Every lease ended released; nothing stays referenced.
    for a in prefill_addrs.iter().chain(&decode_addrs) {
        wait_stats(a, "idle", |s| {
            s.referenced_blocks == 0 && s.leases_live == 0 && s.leases_quarantined == 0
        })
        .await;
    }
    for a in &decode_addrs {
        assert_eq!(stats(a).await.prompt_tokens_computed, 0);
    }
    drop((router, decode, prefill));
    let _ = std::fs::remove_dir_all(&disc);
}
