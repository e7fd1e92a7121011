//! CI smoke of both tools: `tandem-mocker --num-workers 2` behind a real `tandem-router` on
//! loopback, driven by `tandem-loadtest` for 20 requests; the JSON report must show them all
//! served. Readiness comes from the processes' READY lines, never from sleeping.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use tandem_test_support::{field, sibling_bin, spawn_ready, spawn_ready_n};

fn bin(name: &str) -> PathBuf {
    sibling_bin(env!("CARGO_BIN_EXE_tandem-loadtest"), name)
}

fn temp_dir(tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let d = std::env::temp_dir().join(format!("tandem-lt-{tag}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

#[test]
fn mocker_router_loadtest_smoke() {
    let disc = temp_dir("disc");
    let out = temp_dir("out");
    let mocker = spawn_ready_n(
        Command::new(bin("tandem-mocker"))
            .args(["--num-workers", "2", "--speedup-ratio", "20"])
            .args(["--num-gpu-blocks-override", "1024", "--block-size", "16"])
            .args(["--disaggregation-mode", "agg", "--publish-kv-events"])
            .args(["--rpc-host", "127.0.0.1", "--system-host", "127.0.0.1"])
            // Benchmark set-ups may run plaintext on one host: this smoke test keeps that
            // path working (the other tests run the default, mutual TLS).
            .arg("--insecure-internal")
            .env("DYN_FILE_KV", &disc)
            .env("DYN_DISCOVERY_BACKEND", "file"),
        "TANDEM_WORKER_READY",
        2,
    );
    assert_ne!(
        mocker.ready_lines[0], mocker.ready_lines[1],
        "each simulated worker has its own identity"
    );
    let router = spawn_ready(
        Command::new(bin("tandem-router"))
            .args(["--http-host", "127.0.0.1", "--http-port", "0"])
            .args(["--router-min-initial-workers", "2", "--router-mode", "kv"])
            .arg("--insecure-internal")
            // The load tester authenticates (here from $OPENAI_API_KEY): without the key every
            // request, /v1/models included, would be a 401.
            .args(["--api-key", "smoke-key"])
            .env("DYN_FILE_KV", &disc)
            .env("DYN_DISCOVERY_BACKEND", "file"),
        "TANDEM_ROUTER_READY",
    );
    let http = field(router.ready_line(), "http=");
    let status = Command::new(bin("tandem-loadtest"))
        .args(["--url", &format!("http://{http}")])
        .args([
            "--workload",
            "shared-prefix",
            "--groups",
            "2",
            "--prefix-len",
            "64",
        ])
        .args(["--num-requests", "20", "--concurrency", "4", "--osl", "8"])
        .args([
            "--sla-ttft-ms",
            "60000",
            "--timeout",
            "60",
            "--duration",
            "120",
        ])
        .arg("--quiet")
        .env("OPENAI_API_KEY", "smoke-key")
        .arg("--out")
        .arg(&out)
        .stdout(Stdio::null())
        .status()
        .expect("run loadtest");
    assert!(status.success(), "loadtest failed: {status}");
    let text = std::fs::read_to_string(out.join("report.json")).expect("report.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("report is JSON");
    let s = &v["summary"];
    assert_eq!(s["requests"], 20, "{text}");
    assert_eq!(s["succeeded"], 20, "{text}");
    assert_eq!(s["sla_met"], 20, "{text}");
    assert!(s["ttft_ms"]["p50"].as_f64().unwrap_or(0.0) > 0.0, "{text}");
    assert!(s["output_token_throughput"].as_f64().unwrap_or(0.0) > 0.0);
    let csv = std::fs::read_to_string(out.join("requests.csv")).expect("csv");
    assert_eq!(csv.lines().count(), 21);
    assert!(out.join("latency_cdf.svg").is_file());
    let _ = std::fs::remove_dir_all(&disc);
    let _ = std::fs::remove_dir_all(&out);
}
