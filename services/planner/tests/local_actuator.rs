//! The planner's `local` actuator follows a load ramp against simulated workers and scales
//! back down without failing a request: a real `tandem-planner --actuator local` starts and
//! drains `tandem-mocker` aggregated workers (file discovery in a private folder, mutual TLS),
//! a real `tandem-router` serves them, and concurrent clients push the workers' KV load over
//! the latency target's threshold, then fall to a trickle of tiny requests under the lower
//! one. The decisions come from `--decisions-out`; every wait is bounded; nothing is timed.
//!
//! Needs the router and mocker binaries next to the planner's (`scripts/test` builds every
//! binary).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tandem_test_support::{field, sibling_bin, spawn_ready, Proc, READY_TIMEOUT};

fn planner_bin() -> &'static str {
    env!("CARGO_BIN_EXE_tandem-planner")
}

/// The aggregated worker: 64 blocks of 16 tokens, so a few long requests fill its KV pool.
fn write_spec(dir: &Path, disc: &Path) -> PathBuf {
    let mocker = sibling_bin(planner_bin(), "tandem-mocker");
    let mut args: Vec<String> = [
        "--disaggregation-mode",
        "agg",
        "--publish-kv-events",
        "--rpc-host",
        "127.0.0.1",
        "--system-host",
        "127.0.0.1",
        "--block-size",
        "16",
        "--num-gpu-blocks-override",
        "64",
    ]
    .map(String::from)
    .to_vec();
    args.extend(tandem_test_support::tls_args());
    let spec = json!({
        "agg": {
            "program": mocker,
            "args": args,
            "env": {"DYN_FILE_KV": disc, "DYN_DISCOVERY_BACKEND": "file"},
        },
        "drain_timeout_secs": 60,
    });
    let path = dir.join("workers.json");
    std::fs::write(&path, spec.to_string()).expect("spec");
    path
}

fn decisions(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("a decision is one JSON object per line"))
        .collect()
}

/// Waits (bounded) until a decision satisfies `want`.
async fn wait_decision(path: &Path, what: &str, want: impl Fn(&Value) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !decisions(path).iter().any(&want) {
        assert!(
            Instant::now() < deadline,
            "{what}: decisions so far {:?}",
            decisions(path)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Clients posting completions in a loop until `stop`; every status is kept.
/// The model the workers serve, once the router lists it (bounded wait).
async fn served_model(base: &str) -> String {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let models: Value = reqwest::get(format!("{base}/v1/models"))
            .await
            .expect("GET /v1/models")
            .json()
            .await
            .expect("models JSON");
        if let Some(id) = models["data"][0]["id"].as_str() {
            return id.to_string();
        }
        assert!(Instant::now() < deadline, "the router never listed a model");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `(clients, prompt words, max tokens)`.
type Shape = (usize, usize, u32);

fn clients(
    base: &str,
    model: &str,
    (n, prompt_words, max_tokens): Shape,
    stop: Arc<AtomicBool>,
    statuses: Arc<Mutex<Vec<(u16, String)>>>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..n)
        .map(|i| {
            let url = format!("{base}/v1/completions");
            let (stop, statuses) = (stop.clone(), statuses.clone());
            let model = model.to_string();
            tokio::spawn(async move {
                let client = reqwest::Client::new();
                let mut k = 0;
                while !stop.load(Ordering::Relaxed) {
                    // Distinct prompts: no prefix cache hits shrink the load.
                    let prompt = format!("{i} {k} {}", "load ".repeat(prompt_words));
                    let body = json!({"model": model, "prompt": prompt,
                                      "max_tokens": max_tokens, "ignore_eos": true});
                    let resp = client
                        .post(&url)
                        .json(&body)
                        .timeout(Duration::from_secs(120))
                        .send()
                        .await;
                    let outcome = match resp {
                        Ok(r) if r.status().as_u16() == 200 => (200, String::new()),
                        Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
                        Err(e) => (0, e.to_string()),
                    };
                    statuses.lock().unwrap().push(outcome);
                    k += 1;
                }
            })
        })
        .collect()
}

fn sigterm(p: &Proc) {
    // SAFETY: kill(2) on a child this test started and has not reaped.
    unsafe {
        libc::kill(p.child.id() as i32, libc::SIGTERM);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_actuator_follows_a_ramp_and_scales_down_without_failing_a_request() {
    let tmp = tandem_test_support::TempDir::new("tandem-planner-local").expect("temp dir");
    let dir = tmp.path();
    let disc = dir.join("discovery");
    std::fs::create_dir_all(&disc).expect("discovery dir");
    let spec = write_spec(dir, &disc);
    let out = dir.join("decisions.jsonl");
    let router = spawn_ready(
        Command::new(sibling_bin(planner_bin(), "tandem-router"))
            .args(["--http-host", "127.0.0.1", "--http-port", "0"])
            .args(["--router-min-initial-workers", "0"])
            .args(tandem_test_support::tls_args())
            .env("DYN_FILE_KV", &disc)
            .env("DYN_DISCOVERY_BACKEND", "file"),
        "TANDEM_ROUTER_READY",
    );
    let base = format!("http://{}", field(router.ready_line(), "http="));
    let mut planner = spawn_ready(
        Command::new(planner_bin())
            .args(["--planner-mode", "agg", "--actuator", "local"])
            .arg("--local-workers-spec")
            .arg(&spec)
            .args(["--optimization-target", "latency"])
            .args([
                "--load-adjustment-interval",
                "1",
                "--scale-down-intervals",
                "2",
            ])
            .args(["--min-endpoint", "1", "--max-endpoint", "3"])
            .args(["--max-gpu-budget", "3"])
            .arg("--router-metrics-url")
            .arg(format!("{base}/metrics"))
            .arg("--decisions-out")
            .arg(&out)
            .args(tandem_test_support::tls_args())
            .env("DYN_FILE_KV", &disc)
            .env("DYN_DISCOVERY_BACKEND", "file"),
        "TANDEM_PLANNER_READY",
    );
    // Ready means the minimum (one worker) is registered; the first decision started it.
    let first = decisions(&out);
    assert_eq!(first.len(), 1, "{first:?}");
    assert_eq!(
        (first[0]["current"].as_u64(), first[0]["desired"].as_u64()),
        (Some(0), Some(1))
    );
    assert!(first[0]["reason"].as_str().unwrap().contains("minimum"));

    let model = served_model(&base).await;
    let statuses = Arc::new(Mutex::new(Vec::new()));
    // The ramp: 8 clients of ~100-token prompts and 200 output tokens each hold ~300 KV
    // tokens, over the 0.4 × 1,024 of one engine; the planner adds engines up to 3.
    let stop_heavy = Arc::new(AtomicBool::new(false));
    let heavy = clients(
        &base,
        &model,
        (8, 100, 200),
        stop_heavy.clone(),
        statuses.clone(),
    );
    wait_decision(&out, "scale up to 3", |d| d["desired"] == 3).await;
    let up = decisions(&out);
    assert!(up
        .iter()
        .all(|d| d["role"] == "agg" && d["applied"] == true));
    assert!(
        up[1]["reason"].as_str().unwrap().contains("KV load"),
        "{up:?}"
    );
    // Then a trickle of tiny requests (well under 0.1 of a pool): down to one, one step
    // an interval, each surplus worker draining while requests keep coming.
    stop_heavy.store(true, Ordering::Relaxed);
    let stop_light = Arc::new(AtomicBool::new(false));
    let light = clients(
        &base,
        &model,
        (1, 4, 4),
        stop_light.clone(),
        statuses.clone(),
    );
    for h in heavy {
        tokio::time::timeout(Duration::from_secs(120), h)
            .await
            .expect("heavy clients finish")
            .expect("client task");
    }
    let scaled_up = decisions(&out).len();
    wait_decision(&out, "scale back down to 1", |d| {
        d["desired"] == 1 && d["current"] == 2
    })
    .await;
    stop_light.store(true, Ordering::Relaxed);
    for h in light {
        tokio::time::timeout(Duration::from_secs(60), h)
            .await
            .expect("light client finishes")
            .expect("client task");
    }
    let all = decisions(&out);
    let downs: Vec<_> = all[scaled_up..].iter().collect();
    assert!(
        downs
            .iter()
            .all(|d| d["reason"].as_str().unwrap().contains("below 0.1")),
        "{downs:?}"
    );
    let statuses = statuses.lock().unwrap().clone();
    let failed: Vec<_> = statuses.iter().filter(|(s, _)| *s != 200).collect();
    assert!(statuses.len() > 8, "{} requests", statuses.len());
    assert!(
        failed.is_empty(),
        "every request succeeds across scaling: {} of {} failed, first {:?}; decisions {all:?}",
        failed.len(),
        statuses.len(),
        failed.first()
    );
    // SIGTERM: the planner drains the worker it still runs and exits.
    sigterm(&planner);
    let deadline = Instant::now() + READY_TIMEOUT;
    let status = loop {
        if let Some(s) = planner.child.try_wait().expect("wait") {
            break s;
        }
        assert!(Instant::now() < deadline, "the planner did not exit");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(status.success(), "{status}");
    drop(router);
}
