//! CI smoke of both tools: `tandem-mocker --num-workers 2` behind a real `tandem-router` on
//! loopback, driven by `tandem-loadtest` for 20 requests; the JSON report must show them all
//! served. Readiness comes from the processes' READY lines, never from sleeping.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const READY_TIMEOUT: Duration = Duration::from_secs(120);

fn bin(name: &str) -> PathBuf {
    let me = PathBuf::from(env!("CARGO_BIN_EXE_tandem-loadtest"));
    let path = me.with_file_name(name);
    assert!(
        path.is_file(),
        "{} is missing: build it first (`cargo build -p {name}`; `cargo test --workspace` does)",
        path.display()
    );
    path
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `cmd` and waits for `count` stdout lines starting with `marker`.
fn spawn_ready(cmd: &mut Command, marker: &'static str, count: usize) -> (Proc, Vec<String>) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    let proc = Proc(child);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.starts_with(marker) {
                let _ = tx.send(line);
            }
        }
    });
    let lines = (0..count)
        .map(|_| {
            rx.recv_timeout(READY_TIMEOUT)
                .unwrap_or_else(|_| panic!("no {marker} line within {READY_TIMEOUT:?}"))
        })
        .collect();
    (proc, lines)
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
    let (_mocker, workers) = spawn_ready(
        Command::new(bin("tandem-mocker"))
            .args(["--num-workers", "2", "--speedup-ratio", "20"])
            .args(["--num-gpu-blocks-override", "1024", "--block-size", "16"])
            .args(["--disaggregation-mode", "agg", "--publish-kv-events"])
            .args(["--rpc-host", "127.0.0.1", "--system-host", "127.0.0.1"])
            .env("DYN_FILE_KV", &disc)
            .env("DYN_DISCOVERY_BACKEND", "file"),
        "TANDEM_WORKER_READY",
        2,
    );
    assert_ne!(
        workers[0], workers[1],
        "each simulated worker has its own identity"
    );
    let (_router, ready) = spawn_ready(
        Command::new(bin("tandem-router"))
            .args(["--http-host", "127.0.0.1", "--http-port", "0"])
            .args(["--router-min-initial-workers", "2", "--router-mode", "kv"])
            .env("DYN_FILE_KV", &disc)
            .env("DYN_DISCOVERY_BACKEND", "file"),
        "TANDEM_ROUTER_READY",
        1,
    );
    let http = ready[0]
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("http="))
        .expect("router address")
        .to_string();
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
