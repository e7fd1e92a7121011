//! Test harness: real `tandem-decode` workers and a real `tandem-router` on loopback, with
//! file discovery in a private folder. Readiness comes from the processes' READY lines, never
//! from sleeps; every wait is bounded.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

pub use tandem_test_support::{field, spawn_ready, Proc, READY_TIMEOUT};

/// The workspace binary `name`, built beside the router.
pub fn bin(name: &str) -> PathBuf {
    tandem_test_support::sibling_bin(env!("CARGO_BIN_EXE_tandem-router"), name)
}

pub struct Topology {
    pub workers: Vec<Proc>,
    pub router: Option<Proc>,
    pub base: String,
    pub discovery: PathBuf,
}

impl Drop for Topology {
    fn drop(&mut self) {
        self.router.take();
        self.workers.clear();
        let _ = std::fs::remove_dir_all(&self.discovery);
    }
}

pub fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "tandem-test-{tag}-{}-{}",
        std::process::id(),
        uuid_like()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn uuid_like() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ N.fetch_add(1, Ordering::SeqCst)
}

pub fn start_worker(discovery: &PathBuf, extra: &[&str]) -> Proc {
    start_worker_env(discovery, extra, &[])
}

pub fn start_worker_env(discovery: &PathBuf, extra: &[&str], env: &[(&str, &str)]) -> Proc {
    start_role(discovery, "tandem-decode", "agg", extra, env)
}

pub fn start_router(discovery: &PathBuf, min_workers: usize, extra: &[&str]) -> Proc {
    let mut cmd = Command::new(bin("tandem-router"));
    cmd.args([
        "--http-host",
        "127.0.0.1",
        "--http-port",
        "0",
        "--router-min-initial-workers",
    ])
    .arg(min_workers.to_string())
    .args(tandem_test_support::tls_args())
    .args(extra)
    .env("DYN_FILE_KV", discovery)
    .env("DYN_DISCOVERY_BACKEND", "file");
    spawn_ready(&mut cmd, "TANDEM_ROUTER_READY")
}

impl Topology {
    pub fn start(workers: usize, worker_args: &[&str], router_args: &[&str]) -> Topology {
        let discovery = temp_dir("disc");
        let ws: Vec<Proc> = (0..workers)
            .map(|_| start_worker(&discovery, worker_args))
            .collect();
        let router = start_router(&discovery, workers, router_args);
        let base = format!("http://{}", field(router.ready_line(), "http="));
        Topology {
            workers: ws,
            router: Some(router),
            base,
            discovery,
        }
    }

    /// Starts the topology and waits until the router has seen every worker.
    pub async fn start_healthy(
        workers: usize,
        worker_args: &[&str],
        router_args: &[&str],
    ) -> Topology {
        let topo = Topology::start(workers, worker_args, router_args);
        topo.wait_healthy().await;
        topo
    }

    pub async fn wait_healthy(&self) {
        let deadline = Instant::now() + READY_TIMEOUT;
        let client = reqwest::Client::new();
        loop {
            if let Ok(r) = client.get(format!("{}/health", self.base)).send().await {
                if r.status().as_u16() == 200 {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "router never became healthy");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn post(
        &self,
        path: &str,
        body: serde_json::Value,
    ) -> (u16, serde_json::Value, reqwest::header::HeaderMap) {
        let r = reqwest::Client::new()
            .post(format!("{}{path}", self.base))
            .json(&body)
            .timeout(Duration::from_secs(60))
            .send()
            .await
            .expect("request");
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let text = r.text().await.expect("body");
        let json = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
        (status, json, headers)
    }

    /// A streaming request's `data:` payloads, in order.
    pub async fn post_sse(&self, path: &str, body: serde_json::Value) -> Vec<String> {
        let r = reqwest::Client::new()
            .post(format!("{}{path}", self.base))
            .json(&body)
            .timeout(Duration::from_secs(60))
            .send()
            .await
            .expect("request");
        assert_eq!(r.status().as_u16(), 200);
        let text = r.text().await.expect("body");
        text.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }

    /// The admin listener's base URL (`/debug/*`); the router must run with `--admin-port`.
    pub fn admin_base(&self) -> String {
        let r = self.router.as_ref().expect("a router");
        format!("http://{}", field(r.ready_line(), "admin="))
    }

    pub fn worker_id(&self, i: usize) -> u64 {
        field(self.workers[i].ready_line(), "instance_id=")
            .parse()
            .expect("instance id")
    }

    pub fn worker_grpc(&self, i: usize) -> String {
        field(self.workers[i].ready_line(), "grpc=")
    }
}

pub type WorkerClient =
    tandem_protocol::worker::worker_client::WorkerClient<tonic::transport::Channel>;

/// A client of a worker the test started (over the test deployment's mutual TLS).
pub async fn worker_client(addr: &str) -> WorkerClient {
    let channel = tandem_test_support::internal_security()
        .endpoint(addr)
        .expect("worker address")
        .connect()
        .await
        .expect("connect to worker");
    WorkerClient::new(channel)
}

pub async fn worker_stats(addr: &str) -> tandem_protocol::worker::LoadStatsReply {
    worker_client(addr)
        .await
        .load_stats(tandem_protocol::worker::LoadStatsRequest {})
        .await
        .expect("load stats")
        .into_inner()
}

/// A worker's dump: its last event id and its stored block hashes, sorted.
pub async fn worker_blocks(addr: &str) -> (u64, Vec<u64>) {
    let dump = worker_client(addr)
        .await
        .dump_kv_blocks(tandem_protocol::worker::DumpKvBlocksRequest {})
        .await
        .expect("dump")
        .into_inner();
    let mut hashes: Vec<u64> = dump.blocks.iter().map(|b| b.block_hash).collect();
    hashes.sort_unstable();
    (dump.last_event_id, hashes)
}

/// A worker of any role: `bin` is `tandem-decode` or `tandem-prefill`, `mode` its
/// `--disaggregation-mode`.
pub fn start_role(
    discovery: &PathBuf,
    bin_name: &str,
    mode: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Proc {
    let mut cmd = Command::new(bin(bin_name));
    cmd.envs(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    cmd.args([
        "--disaggregation-mode",
        mode,
        "--publish-kv-events",
        "--rpc-host",
        "127.0.0.1",
        "--system-host",
        "127.0.0.1",
    ])
    .args(["--trtllm.kv_cache_config.max_tokens", "8192"])
    .args(tandem_test_support::tls_args())
    .args(extra)
    .env("DYN_FILE_KV", discovery)
    .env("DYN_DISCOVERY_BACKEND", "file");
    spawn_ready(&mut cmd, "TANDEM_WORKER_READY")
}

/// Waits (bounded) until `cond` holds on a worker's stats; returns the last stats.
pub async fn wait_stats(
    addr: &str,
    what: &str,
    cond: impl Fn(&tandem_protocol::worker::LoadStatsReply) -> bool,
) -> tandem_protocol::worker::LoadStatsReply {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = worker_stats(addr).await;
        if cond(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "{what}: still {s:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A counter or gauge on the `/metrics` page at `url`, summed over its label sets that
/// contain `labels`; 0 when absent.
pub async fn metric_sum(url: &str, name: &str, labels: &str) -> f64 {
    let text = reqwest::get(url)
        .await
        .expect("/metrics")
        .text()
        .await
        .expect("metrics text");
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(labels))
        .filter(|l| l[name.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
