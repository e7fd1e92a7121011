//! `tandem-planner profile` against a real router and a simulated worker: it measures every
//! point it was asked for, writes a profile the planner's time models accept, and a
//! `tandem-mocker` starts from the same file (planning and simulation share the data). Every
//! wait is bounded; no figure is asserted (timings are the benchmark's business).

use std::process::Command;
use std::time::{Duration, Instant};

use tandem_planner::profile::ProfileData;
use tandem_test_support::{field, sibling_bin, spawn_ready, READY_TIMEOUT};

fn mocker(disc: &std::path::Path, extra: &[&str]) -> Command {
    let mut cmd = Command::new(sibling_bin(
        env!("CARGO_BIN_EXE_tandem-planner"),
        "tandem-mocker",
    ));
    cmd.args(["--disaggregation-mode", "agg", "--rpc-host", "127.0.0.1"])
        .args(["--system-host", "127.0.0.1", "--block-size", "16"])
        .args(["--num-gpu-blocks-override", "256", "--speedup-ratio", "10"])
        .args(extra)
        .args(tandem_test_support::tls_args())
        .env("DYN_FILE_KV", disc)
        .env("DYN_DISCOVERY_BACKEND", "file");
    cmd
}

/// `tandem-planner profile` of the worker behind `base`, written to `out`.
fn profile(base: &str, worker_metrics: &str, out: &std::path::Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem-planner"));
    cmd.args([
        "profile",
        "--url",
        base,
        "--worker-metrics-url",
        worker_metrics,
    ])
    .arg("--out")
    .arg(out);
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profile_of_a_worker_drives_the_planner_and_the_mocker() {
    let tmp = tandem_test_support::TempDir::new("tandem-planner-profile").expect("temp dir");
    let dir = tmp.path();
    let disc = dir.join("discovery");
    std::fs::create_dir_all(&disc).expect("temp dir");
    let worker = spawn_ready(&mut mocker(&disc, &[]), "TANDEM_WORKER_READY");
    let router = spawn_ready(
        Command::new(sibling_bin(
            env!("CARGO_BIN_EXE_tandem-planner"),
            "tandem-router",
        ))
        .args(["--http-host", "127.0.0.1", "--http-port", "0"])
        .args(["--router-min-initial-workers", "1"])
        .args(tandem_test_support::tls_args())
        .env("DYN_FILE_KV", &disc)
        .env("DYN_DISCOVERY_BACKEND", "file"),
        "TANDEM_ROUTER_READY",
    );
    let base = format!("http://{}", field(router.ready_line(), "http="));
    // The router's health turns 200 once it holds the worker's card.
    let deadline = Instant::now() + READY_TIMEOUT;
    while reqwest::get(format!("{base}/health"))
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
        != 200
    {
        assert!(Instant::now() < deadline, "router never healthy");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let out = dir.join("profile.json");
    let worker_metrics = format!("http://{}/metrics", field(worker.ready_line(), "http="));
    let status = tokio::process::Command::from(profile(&base, &worker_metrics, &out))
        .args([
            "--isl",
            "32,256",
            "--contexts",
            "32,128",
            "--batches",
            "1,4",
        ])
        .args(["--decode-tokens", "8", "--repeats", "1"])
        .status();
    let status = tokio::time::timeout(Duration::from_secs(120), status)
        .await
        .expect("the profile finishes")
        .expect("run tandem-planner profile");
    assert!(status.success(), "{status}");
    let data = ProfileData::load(&out).expect("a profile");
    assert_eq!(data.prefill.len(), 2);
    let grid = data.decode_grid.as_ref().expect("a measured grid");
    assert_eq!((grid.ms.len(), grid.ms[0].len()), (2, 2));
    assert!(data
        .prefill
        .iter()
        .all(|(_, ms)| ms.is_finite() && *ms > 0.0));
    // 256 blocks of 16 tokens.
    assert_eq!(data.kv_capacity_tokens, 4096.0);
    data.models().expect("the planner's time models");
    // A worker that cannot fit the sweep is refused before any request.
    let refused = profile(&base, &worker_metrics, &dir.join("never.json"))
        .args(["--contexts", "4096", "--batches", "1,64"])
        .output()
        .expect("run");
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("does not fit the worker"));
    // The same file simulates a worker.
    let simulated = spawn_ready(
        &mut mocker(
            &disc,
            &["--planner-profile-data", out.to_str().expect("utf-8")],
        ),
        "TANDEM_WORKER_READY",
    );
    drop((simulated, router, worker));
}
