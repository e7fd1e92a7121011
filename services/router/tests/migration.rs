//! Request migration against real processes: a worker hung mid-stream (the engine stall
//! failpoint) is killed with SIGKILL; with `--migration-limit 1` the router replays the prompt
//! and the output so far on another worker and the client reads one unbroken stream whose
//! greedy tokens equal an uninterrupted run's (up to the first near-tie of its top two
//! logprobs); with migration off the client gets a clean error. Two routers share the workers,
//! one with migration on and one off. Needs the failpoints build of `tandem-decode`
//! (`scripts/test` builds it).

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::*;
use futures_util::StreamExt;
use serde_json::{json, Value};

/// A request stalls after this many tokens on any worker (ids containing "stall").
const STALL_AFTER: usize = 8;
/// Long enough to stall once; the replay's own tokens (6) stay under the stall.
const MAX_TOKENS: usize = 14;
/// Bound on every wait of this test.
const BOUND: Duration = Duration::from_secs(60);

/// One token of a streamed chat completion: its text and its top-two logprob margin.
#[derive(Debug, Clone)]
struct Token {
    text: String,
    margin: f64,
}

/// What a streamed response carried.
#[derive(Debug, Default)]
struct Streamed {
    tokens: Vec<Token>,
    finish: Option<String>,
    error: Option<String>,
    completion_tokens: Option<u64>,
}

impl Streamed {
    /// Takes one `data:` payload.
    fn take(&mut self, payload: &str) {
        if payload == "[DONE]" {
            return;
        }
        let v: Value = serde_json::from_str(payload).expect("chunk is JSON");
        if let Some(e) = v.get("error") {
            self.error = Some(e.to_string());
            return;
        }
        if let Some(n) = v
            .pointer("/usage/completion_tokens")
            .and_then(Value::as_u64)
        {
            self.completion_tokens = Some(n);
        }
        let Some(choice) = v.pointer("/choices/0") else {
            return;
        };
        let content = choice
            .pointer("/logprobs/content")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        for lp in content {
            let top: Vec<f64> = lp["top_logprobs"]
                .as_array()
                .expect("top_logprobs")
                .iter()
                .map(|t| t["logprob"].as_f64().expect("logprob"))
                .collect();
            self.tokens.push(Token {
                text: lp["token"].as_str().expect("token").to_string(),
                margin: top[0] - top[1],
            });
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            self.finish = Some(f.to_string());
        }
    }
}

fn body() -> Value {
    json!({
        "model": "tandem-tiny",
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        "max_tokens": MAX_TOKENS,
        // As tandem-loadtest sends it: the replay's min_tokens counts what is still to come.
        "min_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": true,
        "logprobs": true,
        "top_logprobs": 2,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
}

/// A streamed request with id `rid` through `base`: the response's worker and the stream of
/// `data:` payloads.
async fn start_stream(
    base: &str,
    rid: &str,
) -> (u64, impl futures_util::Stream<Item = String> + Unpin) {
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/chat/completions"))
        .header("x-request-id", rid)
        .json(&body())
        .timeout(BOUND)
        .send()
        .await
        .expect("request");
    assert_eq!(r.status().as_u16(), 200, "{rid}");
    let worker = r.headers()["x-tandem-worker-id"]
        .to_str()
        .expect("worker header")
        .parse()
        .expect("worker id");
    let mut buf = String::new();
    let payloads = r
        .bytes_stream()
        .map(move |chunk| {
            buf.push_str(&String::from_utf8_lossy(&chunk.expect("body chunk")));
            let mut out = Vec::new();
            while let Some(end) = buf.find("\n\n") {
                let event: String = buf.drain(..end + 2).collect();
                out.extend(
                    event
                        .lines()
                        .filter_map(|l| l.strip_prefix("data: "))
                        .map(str::to_string),
                );
            }
            futures_util::stream::iter(out)
        })
        .flatten();
    (worker, Box::pin(payloads))
}

/// Reads payloads into `into` until `enough` holds (or the stream ends).
async fn read_until(
    stream: &mut (impl futures_util::Stream<Item = String> + Unpin),
    into: &mut Streamed,
    enough: impl Fn(&Streamed) -> bool,
) {
    let deadline = Instant::now() + BOUND;
    while !enough(into) {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, stream.next()).await {
            Ok(Some(p)) => into.take(&p),
            Ok(None) => return,
            Err(_) => panic!("stream stalled; so far {into:?}"),
        }
    }
}

/// Streams `rid` through `base` until its worker stalls, kills that worker (SIGKILL) and
/// reads the rest. Returns what the client read.
async fn stall_and_kill(base: &str, rid: &str, workers: &mut Vec<(u64, Proc)>) -> Streamed {
    let (worker, mut stream) = start_stream(base, rid).await;
    let mut got = Streamed::default();
    read_until(&mut stream, &mut got, |s| s.tokens.len() >= STALL_AFTER).await;
    assert_eq!(
        got.tokens.len(),
        STALL_AFTER,
        "{rid}: the worker stalls there"
    );
    let i = workers
        .iter()
        .position(|(id, _)| *id == worker)
        .expect("the serving worker is one of ours");
    drop(workers.remove(i));
    read_until(&mut stream, &mut got, |_| false).await;
    got
}

/// Waits until the router at `base` serves (it has the model's assets).
async fn wait_healthy(base: &str) {
    let healthy = || async {
        let r = reqwest::get(format!("{base}/health")).await.ok()?;
        (r.status().as_u16() == 200).then_some(())
    };
    tandem_test_support::wait_until(BOUND, healthy)
        .await
        .expect("the router never became healthy");
}

async fn metric(base: &str, name: &str) -> f64 {
    metric_sum(&format!("{base}/metrics"), name, "").await
}

/// `n` workers of `mode` (`tandem-decode`) whose requests with "stall" in their id stall
/// after [`STALL_AFTER`] tokens, with their instance ids.
fn stalling_workers(discovery: &PathBuf, n: usize, mode: &str, args: &[&str]) -> Vec<(u64, Proc)> {
    let after = STALL_AFTER.to_string();
    let stall = [
        ("TANDEM_FAILPOINT_STALL_REQUEST", "stall"),
        ("TANDEM_FAILPOINT_STALL_AFTER_TOKENS", after.as_str()),
    ];
    (0..n)
        .map(|_| {
            let w = start_role(discovery, "tandem-decode", mode, args, &stall);
            let id = field(w.ready_line(), "instance_id=").parse().expect("id");
            (id, w)
        })
        .collect()
}

/// The whole streamed run of a request that does not stall.
async fn reference(base: &str) -> Streamed {
    let (_, mut s) = start_stream(base, "reference").await;
    let mut reference = Streamed::default();
    read_until(&mut s, &mut reference, |_| false).await;
    assert_eq!(reference.tokens.len(), MAX_TOKENS, "{reference:?}");
    reference
}

/// A migrated stream: one response of MAX_TOKENS tokens, equal to the reference up to its
/// first near-tie.
fn check_migrated(reference: &Streamed, migrated: &Streamed) {
    assert_eq!(migrated.error, None, "{migrated:?}");
    assert_eq!(migrated.finish.as_deref(), Some("length"));
    assert_eq!(migrated.tokens.len(), MAX_TOKENS);
    assert_eq!(migrated.completion_tokens, Some(MAX_TOKENS as u64));
    for (i, (want, got)) in reference.tokens.iter().zip(&migrated.tokens).enumerate() {
        if want.margin < 1e-3 {
            eprintln!(
                "position {i}: top-two margin {} — compared up to here",
                want.margin
            );
            break;
        }
        assert_eq!(
            want.text, got.text,
            "token {i} of {reference:?} vs {migrated:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_workers_stream_migrates_and_without_migration_fails_cleanly() {
    let discovery = temp_dir("migration");
    let mut workers = stalling_workers(&discovery, 3, "agg", &[]);
    let flags = ["--expose-worker-id", "--migration-limit", "1"];
    let on = start_router(&discovery, 3, &flags);
    let off = start_router(&discovery, 3, &flags[..1]);
    let base = |r: &Proc| format!("http://{}", field(r.ready_line(), "http="));
    let (on_router, off_router) = (on, off);
    let (on, off) = (base(&on_router), base(&off_router));
    for b in [&on, &off] {
        wait_healthy(b).await;
    }

    // The uninterrupted run (its id does not stall).
    let reference = reference(&on).await;

    // Migration off: the client gets an error event, not a hang, and no more tokens.
    let t = Instant::now();
    let failed = stall_and_kill(&off, "stall-off", &mut workers).await;
    assert!(failed.error.is_some(), "{failed:?}");
    assert_eq!(failed.tokens.len(), STALL_AFTER);
    assert_eq!(failed.finish, None);
    eprintln!(
        "migration off: failed cleanly {:?} after the kill",
        t.elapsed()
    );

    // Migration on: one stream of MAX_TOKENS tokens, equal to the reference up to its first
    // near-tie, served past the kill by another worker (the dead one may still be listed in
    // discovery: the router skips it when it refuses the connection).
    let t = Instant::now();
    let migrated = stall_and_kill(&on, "stall-on", &mut workers).await;
    eprintln!("migration on: finished {:?} after the kill", t.elapsed());
    check_migrated(&reference, &migrated);
    assert_eq!(
        metric(&on, "dynamo_frontend_model_migration_total").await,
        1.0
    );
    assert_eq!(
        metric(&off, "dynamo_frontend_model_migration_total").await,
        0.0
    );
    assert_eq!(workers.len(), 1, "two workers were killed");
    // The survivor served the replay: nothing left running or holding blocks there.
    let survivor = field(workers[0].1.ready_line(), "grpc=");
    wait_stats(&survivor, "the survivor idle", |s| {
        s.running == 0 && s.waiting == 0 && s.referenced_blocks == 0
    })
    .await;
}

/// Disaggregated: a decode worker killed mid-stream; the replay is prefilled again on the
/// prefill worker (the output so far as part of its prompt) and continues on the other decode
/// worker; no lease is left live or quarantined.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_decode_workers_stream_migrates_through_a_prefill_worker() {
    let discovery = temp_dir("migration-disagg");
    let common = ["--kv-transport", "tcp"];
    let prefill = start_role(&discovery, "tandem-prefill", "prefill", &common, &[]);
    let mut workers = stalling_workers(&discovery, 2, "pd", &common);
    let flags = [
        "--expose-worker-id",
        "--migration-limit",
        "1",
        "--enforce-disagg",
    ];
    let router = start_router(&discovery, 2, &flags);
    let base = format!("http://{}", field(router.ready_line(), "http="));
    wait_healthy(&base).await;
    let reference = reference(&base).await;
    let migrated = stall_and_kill(&base, "stall-disagg", &mut workers).await;
    check_migrated(&reference, &migrated);
    assert_eq!(
        metric(&base, "dynamo_frontend_model_migration_total").await,
        1.0
    );
    let survivor = field(workers[0].1.ready_line(), "grpc=");
    wait_stats(&survivor, "the survivor idle, its leases settled", |s| {
        s.running == 0
            && s.referenced_blocks == 0
            && s.leases_live == 0
            && s.leases_quarantined == 0
    })
    .await;
    // It computed no prompt token: the replay (prompt and output so far) was prefilled on
    // the prefill worker.
    assert_eq!(worker_stats(&survivor).await.prompt_tokens_computed, 0);
    drop(prefill);
}

/// A frozen worker (SIGSTOP: its connections stay open, nothing answers): the router's
/// HTTP/2 keep-alive breaks the stream within interval + timeout (10 s) and the request
/// migrates; its failed health probe keeps new requests off it until it is resumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_workers_stream_migrates_after_the_keepalive_timeout() {
    let discovery = temp_dir("migration-frozen");
    let mut workers = stalling_workers(&discovery, 2, "agg", &[]);
    let router = start_router(
        &discovery,
        2,
        &["--expose-worker-id", "--migration-limit", "1"],
    );
    let base = format!("http://{}", field(router.ready_line(), "http="));
    wait_healthy(&base).await;
    let reference = reference(&base).await;
    let (worker, mut stream) = start_stream(&base, "stall-frozen").await;
    let mut got = Streamed::default();
    read_until(&mut stream, &mut got, |s| s.tokens.len() >= STALL_AFTER).await;
    let frozen = &workers
        .iter()
        .find(|(id, _)| *id == worker)
        .expect("ours")
        .1;
    let signal = |sig: &str| {
        let pid = frozen.child.id().to_string();
        let ok = std::process::Command::new("kill")
            .args([sig, &pid])
            .status();
        assert!(ok.expect("kill").success(), "kill {sig} {pid}");
    };
    signal("-STOP");
    let t = Instant::now();
    read_until(&mut stream, &mut got, |_| false).await;
    eprintln!(
        "frozen worker: migrated and finished {:?} after SIGSTOP",
        t.elapsed()
    );
    check_migrated(&reference, &got);
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    // Its health probe failed meanwhile: new requests go to the other worker only.
    let healthy = |want: f64| {
        let (base, label) = (base.clone(), format!("worker_id=\"{worker}\""));
        move || {
            let (base, label) = (base.clone(), label.clone());
            async move {
                let v = metric_sum(
                    &format!("{base}/metrics"),
                    "tandem_router_worker_healthy",
                    &label,
                )
                .await;
                (v == want).then_some(())
            }
        }
    };
    tandem_test_support::wait_until(BOUND, healthy(0.0))
        .await
        .expect("the frozen worker never failed its probe");
    for i in 0..3 {
        let (served_by, mut s) = start_stream(&base, &format!("after-{i}")).await;
        assert_ne!(served_by, worker, "routed to the frozen worker");
        let mut done = Streamed::default();
        read_until(&mut s, &mut done, |_| false).await;
        assert_eq!(done.tokens.len(), MAX_TOKENS, "{done:?}");
    }
    // Resumed, it passes its probe again.
    signal("-CONT");
    tandem_test_support::wait_until(BOUND, healthy(1.0))
        .await
        .expect("the resumed worker never passed its probe");
    workers.clear();
}
