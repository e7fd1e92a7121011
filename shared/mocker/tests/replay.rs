//! Offline replay on the virtual clock: the same trace gives byte-identical reports, and the
//! KV-aware in-process router gets more prefix-cache hits than round-robin on a trace whose
//! requests share prefixes.

use std::path::PathBuf;

use tandem_config::Role;
use tandem_mocker::args::MockerArgs;
use tandem_mocker::replay::{replay, ReplayOptions, ReplayReport, ReplayRouter};

fn run(router: ReplayRouter, prefill_workers: usize) -> ReplayReport {
    run_with(router, prefill_workers, &[])
}

fn run_with(router: ReplayRouter, prefill_workers: usize, extra: &[&str]) -> ReplayReport {
    let args: Vec<String> = ["tandem-mocker", "--num-workers", "4", "--block-size", "16"]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect();
    let (mine, rest) = tandem_mocker::args::split(&args);
    let m = <MockerArgs as clap::Parser>::parse_from(&mine);
    let mut cfg = tandem_config::parse_worker(Role::Decode, &rest, &|_| None).expect("config");
    tandem_mocker::apply(&mut cfg, &m).expect("apply");
    let cost = tandem_mocker::cost_model(&m).expect("cost");
    let trace = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/sample_trace.jsonl");
    let opts = ReplayOptions {
        workers: 4 - prefill_workers,
        prefill_workers,
        vocab: None,
        trace_block: 64,
        router,
        transfer_gb_s: 1.0,
        kv_bytes_per_token: 114_688,
        sla_ttft_ms: Some(1e9),
        sla_itl_ms: None,
    };
    replay(&cfg, cost, &trace, &opts).expect("replay")
}

#[test]
fn replay_is_exactly_reproducible_and_kv_routing_reuses_prefixes() {
    let a = run(ReplayRouter::Kv, 0);
    let b = run(ReplayRouter::Kv, 0);
    let json = |r: &ReplayReport| serde_json::to_string(r).expect("json");
    assert_eq!(json(&a), json(&b), "two replays of one trace differ");
    assert_eq!(a.completed, a.requests);
    assert!(a.ttft_ms.p50 > 0.0 && a.makespan_ms > 0.0);
    let rr = run(ReplayRouter::RoundRobin, 0);
    assert_eq!(rr.completed, rr.requests);
    assert_eq!(rr.per_worker, vec![15, 15, 15, 15]);
    assert!(
        a.cached_tokens > rr.cached_tokens,
        "kv {} vs round-robin {} cached tokens",
        a.cached_tokens,
        rr.cached_tokens
    );
}

#[test]
fn disaggregated_replay_completes_every_request_reproducibly() {
    let a = run(ReplayRouter::Kv, 2);
    let b = run(ReplayRouter::Kv, 2);
    assert_eq!(
        serde_json::to_string(&a).ok(),
        serde_json::to_string(&b).ok()
    );
    assert_eq!(a.completed, a.requests);
    assert_eq!(a.sla_met, a.requests);
    // Every request went through one of 2 prefill and one of 2 decode workers.
    assert_eq!(a.per_worker[..2].iter().sum::<usize>(), a.requests);
    assert_eq!(a.per_worker[2..].iter().sum::<usize>(), a.requests);
}

/// The mocker only simulates time: a model folder with `config.json` and the tokenizer files
/// but no weights serves it (as Dynamo's mocker does), with the same results.
#[test]
fn a_model_folder_without_weights_is_enough() {
    let tiny = tandem_tiny_model::ensure_tiny_model().expect("tiny model");
    let dir = tandem_test_support::TempDir::new("mocker-no-weights").expect("temp dir");
    let mut copied = 0;
    for entry in std::fs::read_dir(&tiny).expect("tiny model folder") {
        let path = entry.expect("entry").path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if path.is_file() && !name.ends_with(".safetensors") && !name.ends_with(".index.json") {
            std::fs::copy(&path, dir.path().join(name)).expect("copy");
            copied += 1;
        }
    }
    assert!(copied >= 2, "config and tokenizer files copied");
    assert!(!dir.path().join("model.safetensors").exists());
    let folder = dir.path().to_str().expect("utf-8 path");
    let without = run_with(ReplayRouter::Kv, 0, &["--model-path", folder]);
    assert_eq!(without.completed, without.requests);
    let with = run_with(
        ReplayRouter::Kv,
        0,
        &["--model-path", tiny.to_str().expect("utf-8")],
    );
    let json = |r: &ReplayReport| serde_json::to_string(r).expect("json");
    assert_eq!(json(&without), json(&with));
}
