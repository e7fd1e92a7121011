//! Disaggregated prefill → decode against real processes on loopback: exact equality with
//! aggregated serving (greedy, seeded sampling with penalties, stop strings, logprobs, chunked
//! prompts, prefixes cached on either side, concurrency) over UCX and TCP, with the bytes
//! moved and the decode worker's prompt compute checked from stats; and the fault paths
//! (cancel, lease timeout, kill -9 of either side mid-transfer, the first token out while the
//! last write is held and its writer then killed, revocation while a write is held, SIGTERM of
//! a prefill worker), made deterministic with the prefill hold failpoint.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use tandem_protocol::worker::{
    GenerateDisaggRequest, GenerateOutput, GenerateRequest, PrefillTarget,
};
use tokio_stream::StreamExt;

const BLOCK: usize = 32;

#[derive(Debug, Clone)]
struct Out {
    tokens: Vec<u32>,
    text: String,
    logprobs: Vec<Value>,
    finish: String,
    completion_tokens: u32,
}

async fn collect(mut s: tonic::Streaming<GenerateOutput>) -> Result<Out, tonic::Status> {
    let mut o = Out {
        tokens: vec![],
        text: String::new(),
        logprobs: vec![],
        finish: String::new(),
        completion_tokens: 0,
    };
    while let Some(item) = tokio::time::timeout(Duration::from_secs(60), s.next())
        .await
        .expect("stream stalled")
    {
        let out = item?;
        o.tokens.extend(&out.token_ids);
        o.text.push_str(&out.text);
        for lp in tandem_router::wire::logprobs(&out.logprobs) {
            o.logprobs
                .push(serde_json::to_value(lp).expect("logprob as JSON"));
        }
        if let Some(u) = out.usage {
            o.completion_tokens += u.completion_tokens;
        }
        if let Some(finish) = tandem_router::wire::finish_reason(&out) {
            assert!(out.error.is_empty(), "worker error: {}", out.error);
            o.finish = finish.to_owned();
        }
    }
    Ok(o)
}

/// Token for token: ids, text and finish reason exactly; logprobs to 1e-4. The CPU engine
/// sums a matrix product in another order when a step has at most 16 rows, so a position
/// computed in a small step on one side and a large one on the other (different batching)
/// differs in its last bits — never enough to change a sampled token here.
impl PartialEq for Out {
    fn eq(&self, o: &Out) -> bool {
        let close = |a: &Value, b: &Value| match (a.as_f64(), b.as_f64()) {
            (Some(x), Some(y)) => (x - y).abs() <= 1e-4,
            _ => a == b,
        };
        let lp_eq = |a: &Value, b: &Value| {
            a["token"] == b["token"]
                && close(&a["logprob"], &b["logprob"])
                && match (a["top"].as_array(), b["top"].as_array()) {
                    (Some(x), Some(y)) => {
                        x.len() == y.len()
                            && x.iter()
                                .all(|e| y.iter().any(|f| e[0] == f[0] && close(&e[1], &f[1])))
                    }
                    _ => a["top"] == b["top"],
                }
        };
        self.tokens == o.tokens
            && self.text == o.text
            && self.finish == o.finish
            && self.completion_tokens == o.completion_tokens
            && self.logprobs.len() == o.logprobs.len()
            && self
                .logprobs
                .iter()
                .zip(&o.logprobs)
                .all(|(a, b)| lp_eq(a, b))
    }
}

/// JSON equal, with numbers equal to 1e-4 (logprobs; see `Out`'s equality).
fn json_close(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => match (x.as_f64(), y.as_f64()) {
            (Some(x), Some(y)) => (x - y).abs() <= 1e-4,
            _ => x == y,
        },
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| json_close(a, b))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| json_close(v, w)))
        }
        _ => a == b,
    }
}

fn request(rid: &str, prompt: &[u32], params: &Value) -> GenerateRequest {
    GenerateRequest {
        replayed_tokens: 0,
        request_id: rid.into(),
        cache_salt: None,
        prompt: prompt.to_vec(),
        sampling_params: Some(tandem_router::wire::sampling_params(
            &serde_json::from_value(params.clone()).expect("sampling params"),
        )),
        media: Default::default(),
    }
}

async fn agg(addr: &str, rid: &str, prompt: &[u32], params: &Value) -> Out {
    let s = worker_client(addr)
        .await
        .generate(request(rid, prompt, params))
        .await
        .expect("generate")
        .into_inner();
    collect(s).await.expect("aggregated stream")
}

fn target(p: &Proc) -> PrefillTarget {
    PrefillTarget {
        instance_id: field(p.ready_line(), "instance_id=").parse().expect("id"),
        grpc_addr: field(p.ready_line(), "grpc="),
    }
}

async fn disagg_to(
    decode: &str,
    rid: &str,
    prompt: &[u32],
    params: &Value,
    targets: Vec<PrefillTarget>,
) -> Result<tonic::Streaming<GenerateOutput>, tonic::Status> {
    Ok(worker_client(decode)
        .await
        .generate_disagg(GenerateDisaggRequest {
            request: Some(request(rid, prompt, params)),
            prefill_workers: targets,
        })
        .await?
        .into_inner())
}

async fn disagg_stream(
    decode: &str,
    rid: &str,
    prompt: &[u32],
    params: &Value,
    prefill: &[&Proc],
) -> Result<tonic::Streaming<GenerateOutput>, tonic::Status> {
    disagg_to(
        decode,
        rid,
        prompt,
        params,
        prefill.iter().map(|p| target(p)).collect(),
    )
    .await
}

/// A disaggregated request running in the background.
fn spawn_disagg(
    decode: &str,
    rid: &str,
    prompt: &[u32],
    params: &Value,
    targets: Vec<PrefillTarget>,
) -> tokio::task::JoinHandle<Result<Out, tonic::Status>> {
    let (decode, rid, prompt, params) = (
        decode.to_owned(),
        rid.to_owned(),
        prompt.to_vec(),
        params.clone(),
    );
    tokio::spawn(async move {
        collect(disagg_to(&decode, &rid, &prompt, &params, targets).await?).await
    })
}

async fn disagg(
    decode: &str,
    rid: &str,
    prompt: &[u32],
    params: &Value,
    prefill: &[&Proc],
) -> Result<Out, tonic::Status> {
    collect(disagg_stream(decode, rid, prompt, params, prefill).await?).await
}

/// Deterministic token ids in a range the tiny model's vocab covers.
fn tokens(seed: u64, len: usize) -> Vec<u32> {
    let mut rng = tandem_rng::SplitMix64::new(
        seed.wrapping_mul(tandem_rng::GOLDEN_GAMMA) ^ 0xD1B5_4A32_D192_ED03,
    );
    (0..len)
        .map(|_| 300 + (rng.next_u64() % 20_000) as u32)
        .collect()
}

/// Bytes of one KV block of the tiny model (f32 cache, block 32).
fn block_bytes() -> u64 {
    let dir = tandem_tiny_model::ensure_tiny_model().expect("tiny model");
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).expect("config"))
            .expect("config json");
    let n = |k: &str| cfg[k].as_u64().expect(k);
    n("num_hidden_layers") * 2 * BLOCK as u64 * n("num_key_value_heads") * n("head_dim") * 4
}

fn blocks_for(tokens: usize) -> u64 {
    tokens.div_ceil(BLOCK) as u64
}

fn addr(p: &Proc) -> String {
    field(p.ready_line(), "grpc=")
}

fn greedy(max_tokens: u32) -> Value {
    json!({"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": true})
}

fn sampled(max_tokens: u32) -> Value {
    json!({
        "max_tokens": max_tokens, "temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 7,
        "presence_penalty": 0.4, "frequency_penalty": 0.3, "repetition_penalty": 1.1,
        "logprobs": 3, "ignore_eos": true
    })
}

/// The aggregated worker that disaggregated outputs must equal, and the KV bytes of a block.
struct Reference<'a> {
    addr: &'a str,
    block_bytes: u64,
}

/// One disaggregated request of the equality test.
struct Case<'a> {
    name: &'a str,
    /// The decode worker's gRPC address.
    decode: &'a str,
    prefill: &'a [&'a Proc],
    prompt: &'a [u32],
    params: &'a Value,
    /// Prompt blocks the decode worker already holds: they are not sent to it.
    decode_cached_blocks: u64,
}

impl Reference<'_> {
    /// Runs `case` disaggregated and checks it against the reference, the decode worker's
    /// received bytes (the blocks it did not hold × block size) and its prompt compute (none).
    async fn check(&self, case: Case<'_>) -> Out {
        let Case {
            name,
            decode,
            prefill,
            prompt,
            params,
            decode_cached_blocks,
        } = case;
        let want = agg(self.addr, &format!("ref-{name}"), prompt, params).await;
        let before = worker_stats(decode).await;
        let got = disagg(decode, &format!("dis-{name}"), prompt, params, prefill)
            .await
            .unwrap_or_else(|s| panic!("{name}: {s}"));
        assert_eq!(
            got, want,
            "{name}: disaggregated output differs from aggregated"
        );
        let after = worker_stats(decode).await;
        assert_eq!(
            after.kv_bytes_received - before.kv_bytes_received,
            (blocks_for(prompt.len()) - decode_cached_blocks) * self.block_bytes,
            "{name}: bytes received"
        );
        assert_eq!(
            after.prompt_tokens_computed, 0,
            "{name}: the decode worker computed prompt tokens"
        );
        got
    }
}

async fn equality(transport: &str) {
    let disc = temp_dir(&format!("disagg-eq-{transport}"));
    let common = ["--max-num-tokens", "64", "--kv-transport", transport];
    let reference = start_role(
        &disc,
        "tandem-decode",
        "agg",
        &["--max-num-tokens", "64"],
        &[],
    );
    let p = [
        start_role(&disc, "tandem-prefill", "prefill", &common, &[]),
        start_role(&disc, "tandem-prefill", "prefill", &common, &[]),
    ];
    let d = [
        start_role(&disc, "tandem-decode", "pd", &common, &[]),
        start_role(&disc, "tandem-decode", "pd", &common, &[]),
    ];
    let (r, d0, d1) = (addr(&reference), addr(&d[0]), addr(&d[1]));
    let agg_ref = Reference {
        addr: &r,
        block_bytes: block_bytes(),
    };
    let a = tokens(1, 100);
    let b = tokens(2, 70);

    // Chunked (100 > max_num_tokens 64), nothing cached anywhere.
    agg_ref
        .check(Case {
            name: "greedy-chunked",
            decode: &d0,
            prefill: &[&p[0]],
            prompt: &a,
            params: &greedy(24),
            decode_cached_blocks: 0,
        })
        .await;
    // Seeded sampling with penalties and logprobs.
    let s = agg_ref
        .check(Case {
            name: "sampled",
            decode: &d0,
            prefill: &[&p[0]],
            prompt: &b,
            params: &sampled(24),
            decode_cached_blocks: 0,
        })
        .await;
    assert_eq!(s.logprobs.len(), s.tokens.len());
    // A stop string taken from that output: both must stop at the same place.
    let chars: Vec<char> = s.text.chars().collect();
    if chars.len() > 8 {
        let stop: String = chars[4..7].iter().collect();
        let mut params = sampled(24);
        params["stop"] = json!([stop]);
        let o = agg_ref
            .check(Case {
                name: "stop",
                decode: &d0,
                prefill: &[&p[0]],
                prompt: &b,
                params: &params,
                decode_cached_blocks: 2,
            })
            .await;
        assert_eq!(o.finish, "stop");
    }
    // Prefix cached on both sides (3 full blocks of `a` on p0 and d0).
    let both: Vec<u32> = a[..96].iter().copied().chain(tokens(3, 30)).collect();
    agg_ref
        .check(Case {
            name: "cached-both",
            decode: &d0,
            prefill: &[&p[0]],
            prompt: &both,
            params: &greedy(16),
            decode_cached_blocks: 3,
        })
        .await;
    // Prefix cached on the decode side only (p1 has never seen `a`).
    let dec_only: Vec<u32> = a[..64].iter().copied().chain(tokens(4, 40)).collect();
    agg_ref
        .check(Case {
            name: "cached-decode",
            decode: &d0,
            prefill: &[&p[1]],
            prompt: &dec_only,
            params: &greedy(16),
            decode_cached_blocks: 2,
        })
        .await;
    // Prefix cached on the prefill side only (d1 has never seen `b`).
    let pre_only: Vec<u32> = b[..64].iter().copied().chain(tokens(5, 20)).collect();
    agg_ref
        .check(Case {
            name: "cached-prefill",
            decode: &d1,
            prefill: &[&p[0]],
            prompt: &pre_only,
            params: &sampled(16),
            decode_cached_blocks: 0,
        })
        .await;
    // A long prompt: five chunks streamed while computing.
    agg_ref
        .check(Case {
            name: "long",
            decode: &d1,
            prefill: &[&p[1]],
            prompt: &tokens(6, 300),
            params: &greedy(12),
            decode_cached_blocks: 0,
        })
        .await;
    // The first token ends the request: no decode step, the reservation is released.
    let one = agg_ref
        .check(Case {
            name: "one-token",
            decode: &d1,
            prefill: &[&p[1]],
            prompt: &tokens(7, 40),
            params: &greedy(1),
            decode_cached_blocks: 0,
        })
        .await;
    assert_eq!((one.tokens.len(), one.finish.as_str()), (1, "length"));

    // Concurrent requests over both pairs.
    let mut set = tokio::task::JoinSet::new();
    for i in 0..6u64 {
        let (r, dd) = (r.clone(), if i % 2 == 0 { d0.clone() } else { d1.clone() });
        let targets = vec![target(&p[(i / 2 % 2) as usize])];
        set.spawn(async move {
            let prompt = tokens(100 + i, 40 + 17 * i as usize);
            let params = if i % 3 == 0 { sampled(20) } else { greedy(20) };
            let want = agg(&r, &format!("ref-c{i}"), &prompt, &params).await;
            let s = disagg_to(&dd, &format!("dis-c{i}"), &prompt, &params, targets)
                .await
                .expect("generate_disagg");
            assert_eq!(collect(s).await.expect("stream"), want, "concurrent {i}");
        });
    }
    while let Some(r) = set.join_next().await {
        r.expect("concurrent request");
    }
    for w in d.iter().chain(p.iter()) {
        let s = wait_stats(&addr(w), "blocks back to baseline", |s| {
            s.referenced_blocks == 0 && s.leases_live == 0 && s.leases_quarantined == 0
        })
        .await;
        assert_eq!(s.running + s.waiting, 0);
    }
    for w in &d {
        assert_eq!(worker_stats(&addr(w)).await.prompt_tokens_computed, 0);
    }
    // Transfers and leases show in metrics (Dynamo's TRT-LLM names for transfers).
    let metrics = |p: &Proc| {
        let url = format!("http://{}/metrics", field(p.ready_line(), "http="));
        async move {
            reqwest::get(url)
                .await
                .expect("metrics")
                .text()
                .await
                .expect("body")
        }
    };
    let pm = metrics(&p[0]).await;
    for name in [
        "trtllm_kv_transfer_success_total",
        "trtllm_kv_transfer_latency_seconds",
        "trtllm_kv_transfer_bytes",
        "trtllm_kv_transfer_speed_gb_s",
    ] {
        assert!(
            pm.contains(name),
            "{name} missing from the prefill worker's metrics"
        );
    }
    let dm = metrics(&d[0]).await;
    assert!(
        dm.contains("tandem_kv_leases{state=\"live\"} 0")
            && dm.contains("tandem_kv_leases{state=\"quarantined\"} 0"),
        "lease gauges missing: {dm}"
    );
    let _ = std::fs::remove_dir_all(&disc);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_equals_aggregated_over_ucx() {
    equality("ucx").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_equals_aggregated_over_tcp() {
    equality("tcp").await;
}

/// Waits (bounded) for a file the failpoint creates.
async fn wait_file(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} never appeared (are the worker binaries built with the failpoints feature? \
             scripts/test builds them so)",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn release(dir: &Path, rid: &str) {
    std::fs::write(dir.join(format!("{rid}.release")), b"").expect("release file");
}

fn reached(dir: &Path, rid: &str) -> PathBuf {
    dir.join(format!("{rid}.reached"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_free_every_block_and_never_touch_live_ones() {
    let disc = temp_dir("disagg-faults");
    let holds = temp_dir("disagg-holds");
    let silent = holds.join("silent");
    let hold_env = [
        (
            "TANDEM_FAILPOINT_PREFILL_HOLD_DIR",
            holds.to_str().expect("utf-8 path"),
        ),
        ("TANDEM_FAILPOINT_PREFILL_HOLD_AT_BLOCK", "2"),
        (
            "TANDEM_FAILPOINT_PREFILL_SILENT_FILE",
            silent.to_str().expect("utf-8 path"),
        ),
    ];
    let common = ["--max-num-tokens", "64", "--kv-transport", "tcp"];
    let reference = start_role(
        &disc,
        "tandem-decode",
        "agg",
        &["--max-num-tokens", "64"],
        &[],
    );
    let mut p0 = Some(start_role(
        &disc,
        "tandem-prefill",
        "prefill",
        &common,
        &hold_env,
    ));
    let mut p1 = Some(start_role(
        &disc,
        "tandem-prefill",
        "prefill",
        &common,
        &hold_env,
    ));
    let d_args = [&common[..], &["--kv-lease-ttl-secs", "3"]].concat();
    let d0 = start_role(&disc, "tandem-decode", "pd", &d_args, &[]);
    let mut d1 = Some(start_role(&disc, "tandem-decode", "pd", &common, &[]));
    let d2_args = [
        &common[..],
        &[
            "--kv-lease-ttl-secs",
            "2",
            "--kv-lease-reclaim-margin-secs",
            "1",
        ],
    ]
    .concat();
    let d2 = start_role(&disc, "tandem-decode", "pd", &d2_args, &[]);
    let (r, d0a) = (addr(&reference), addr(&d0));
    let p0a = addr(p0.as_ref().expect("p0"));
    let prompt = tokens(11, 150);
    let params = greedy(16);
    let want = agg(&r, "ref-faults", &prompt, &params).await;
    // A prefix d0 holds from here on: its blocks must survive every fault below.
    let warm = tokens(12, 90);
    let warm_want = agg(&r, "ref-warm", &warm, &params).await;
    let p0p = p0.as_ref().expect("p0");
    assert_eq!(
        disagg(&d0a, "warm-1", &warm, &params, &[p0p])
            .await
            .expect("warm"),
        warm_want
    );

    // 1. The client cancels while the write is held: the lease is quarantined (not freed)
    // until the writer has stopped; the held write then lands in quarantined blocks only.
    let rid = "hold-cancel";
    let stream = disagg_stream(&d0a, rid, &prompt, &params, &[p0p])
        .await
        .expect("call");
    wait_file(&reached(&holds, rid)).await;
    drop(stream);
    wait_stats(&d0a, "lease quarantined", |s| s.leases_quarantined == 1).await;
    // While quarantined, other requests run and the cached prefix is intact.
    assert_eq!(
        disagg(&d0a, "warm-2", &warm, &params, &[p1.as_ref().expect("p1")])
            .await
            .expect("warm-2"),
        warm_want
    );
    assert_eq!(
        worker_stats(&d0a).await.leases_quarantined,
        1,
        "released before the writer stopped"
    );
    release(&holds, rid);
    wait_stats(&d0a, "quarantine released", |s| {
        s.leases_quarantined == 0 && s.leases_live == 0 && s.referenced_blocks == 0
    })
    .await;
    wait_stats(&p0a, "prefill back to baseline", |s| {
        s.referenced_blocks == 0 && s.running + s.waiting == 0
    })
    .await;
    assert_eq!(
        disagg(&d0a, "warm-3", &warm, &params, &[p0p])
            .await
            .expect("warm-3"),
        warm_want
    );

    // 2. The lease times out (ttl 3 s) while the write is held: a clear error, quarantine
    // until the held write is released.
    let rid = "hold-ttl";
    let t0 = Instant::now();
    let err = disagg(&d0a, rid, &prompt, &params, &[p0p])
        .await
        .expect_err("must time out");
    assert!(err.message().contains("lease TTL"), "{err:?}");
    assert!(t0.elapsed() < Duration::from_secs(20));
    assert_eq!(worker_stats(&d0a).await.leases_quarantined, 1);
    release(&holds, rid);
    wait_stats(&d0a, "ttl quarantine released", |s| {
        s.leases_quarantined == 0 && s.referenced_blocks == 0
    })
    .await;

    // 3. kill -9 of the decode worker mid-transfer: the prefill worker stops and frees.
    let d1a = addr(d1.as_ref().expect("d1"));
    let rid = "hold-kill-decode";
    let stream = disagg_stream(&d1a, rid, &prompt, &params, &[p0p])
        .await
        .expect("call");
    wait_file(&reached(&holds, rid)).await;
    d1.take(); // kill -9
    release(&holds, rid);
    let _ = collect(stream)
        .await
        .expect_err("the decode worker is gone");
    wait_stats(&p0a, "prefill freed after decode death", |s| {
        s.referenced_blocks == 0 && s.running + s.waiting == 0
    })
    .await;

    // 3b. A silent writer: the prefill worker accepts the lease, then neither writes nor
    // answers FenceLease (nor is gone). The decode worker reclaims the lease once its TTL
    // (2 s) and the reclaim margin (1 s) are over; the writer, when it speaks again, refuses
    // by its own clock to write for the ended lease.
    let d2a = addr(&d2);
    std::fs::write(&silent, b"").expect("silent marker");
    let err = disagg(&d2a, "silent-writer", &prompt, &params, &[p0p])
        .await
        .expect_err("must time out");
    assert!(err.message().contains("lease TTL"), "{err:?}");
    wait_stats(&d2a, "silent writer's lease reclaimed", |s| {
        s.leases_quarantined == 0 && s.leases_live == 0 && s.referenced_blocks == 0
    })
    .await;
    std::fs::remove_file(&silent).expect("silent marker");
    wait_stats(&p0a, "the silent writer stopped by its own clock", |s| {
        s.referenced_blocks == 0 && s.running + s.waiting == 0
    })
    .await;
    assert_eq!(
        disagg(&d2a, "after-silence", &prompt, &params, &[p0p])
            .await
            .expect("after the silence"),
        want
    );

    // 4a. The first token leaves while the prompt's last write is still held (90 tokens in
    // chunks of 64: the held batch, block 2, is the last); then kill -9 of that prefill
    // worker: the client has its first token, then an error naming the failure — never a
    // hang — and the dead writer's lease is released (its listener is gone).
    let short = tokens(13, 90);
    let short_want = agg(&r, "ref-short", &short, &params).await;
    let rid = "hold-kill-after-first";
    let mut stream = disagg_stream(&d0a, rid, &short, &params, &[p0p])
        .await
        .expect("call");
    wait_file(&reached(&holds, rid)).await;
    let first = tokio::time::timeout(Duration::from_secs(30), stream.next())
        .await
        .expect("the first token while the last write is held")
        .expect("a message")
        .expect("the first token");
    assert_eq!(first.token_ids, short_want.tokens[..1]);
    p0.take(); // kill -9
    let err = collect(stream)
        .await
        .expect_err("the writer died after the first token");
    assert!(err.message().contains("after the first token"), "{err:?}");
    wait_stats(&d0a, "the dead writer's lease released", |s| {
        s.leases_quarantined == 0 && s.leases_live == 0 && s.referenced_blocks == 0
    })
    .await;

    // 4. kill -9 of the prefill worker mid-transfer: the decode worker retries on the other
    // prefill worker and answers correctly; the dead writer's lease is released (its
    // listener is gone).
    let rid = "hold-kill-prefill";
    let p1p = p1.as_ref().expect("p1");
    let dead = PrefillTarget {
        instance_id: 1,
        grpc_addr: p0a.clone(),
    };
    let call = spawn_disagg(&d0a, rid, &prompt, &params, vec![dead, target(p1p)]);
    wait_file(&reached(&holds, rid)).await;
    p0.take(); // killed in 4a already
               // p1 holds the same request id too: let it through.
    release(&holds, rid);
    let got = call
        .await
        .expect("task")
        .expect("retried on the other prefill worker");
    assert_eq!(got, want);
    wait_stats(&d0a, "dead writer's lease released", |s| {
        s.leases_quarantined == 0 && s.leases_live == 0 && s.referenced_blocks == 0
    })
    .await;
    assert_eq!(worker_stats(&d0a).await.prompt_tokens_computed, 0);

    // 5. SIGTERM of a prefill worker with a write held: it finishes that lease, then exits.
    let rid = "hold-sigterm";
    let call = spawn_disagg(&d0a, rid, &prompt, &params, vec![target(p1p)]);
    wait_file(&reached(&holds, rid)).await;
    let mut p1proc = p1.take().expect("p1");
    let status = std::process::Command::new("kill")
        .args(["-TERM", &p1proc.child.id().to_string()])
        .status()
        .expect("kill -TERM");
    assert!(status.success());
    release(&holds, rid);
    assert_eq!(
        call.await.expect("task").expect("finished during drain"),
        want
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = p1proc.child.try_wait().expect("wait") {
            assert!(status.success(), "prefill worker exit: {status}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "prefill worker did not exit after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    wait_stats(&d0a, "all leases gone", |s| {
        s.leases_quarantined == 0 && s.leases_live == 0 && s.referenced_blocks == 0
    })
    .await;
    drop(p1proc);
    let _ = std::fs::remove_dir_all(&disc);
    let _ = std::fs::remove_dir_all(&holds);
}

/// Through the router: `--enforce-disagg` output equals an aggregated router's, streaming or
/// not, concurrently; the prefill worker chosen follows KV overlap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_enforced_disagg_matches_aggregated_and_follows_prefill_overlap() {
    let agg_topo = Topology::start_healthy(1, &[], &[]).await;
    let disc = temp_dir("disagg-router");
    let p = [
        start_role(&disc, "tandem-prefill", "prefill", &[], &[]),
        start_role(&disc, "tandem-prefill", "prefill", &[], &[]),
    ];
    let d = start_role(&disc, "tandem-decode", "pd", &[], &[]);
    let router = start_router(&disc, 1, &["--enforce-disagg", "--expose-worker-id"]);
    let base = format!("http://{}", field(router.ready_line(), "http="));
    let dis = Topology {
        workers: vec![],
        router: Some(router),
        base,
        discovery: disc.clone(),
    };
    dis.wait_healthy().await;

    let bodies = [
        json!({"model": "tandem-tiny", "prompt": "The quick brown fox jumps over the lazy dog. Then", "max_tokens": 24, "temperature": 0}),
        json!({"model": "tandem-tiny", "prompt": "Once upon a time, in a land far away,", "max_tokens": 24,
               "temperature": 0.8, "seed": 3, "presence_penalty": 0.5, "frequency_penalty": 0.2, "logprobs": 2}),
        json!({"model": "tandem-tiny", "messages": [{"role": "user", "content": "Write a haiku about routers."}],
               "max_tokens": 20, "temperature": 0.7, "seed": 11, "logprobs": true, "top_logprobs": 2}),
    ];
    for (i, body) in bodies.iter().enumerate() {
        let path = if body.get("messages").is_some() {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let (sa, ja, _) = agg_topo.post(path, body.clone()).await;
        let (sd, jd, hd) = dis.post(path, body.clone()).await;
        assert_eq!((sa, sd), (200, 200), "{ja} {jd}");
        assert!(
            json_close(&ja["choices"], &jd["choices"]),
            "request {i}: {ja} vs {jd}"
        );
        assert!(
            hd.get("x-tandem-prefill-worker-id").is_some(),
            "request {i} was not disaggregated"
        );
        // A stop string from the output: both stop at the same place.
        let text = ja["choices"][0]["text"]
            .as_str()
            .or(ja["choices"][0]["message"]["content"].as_str())
            .unwrap_or("")
            .to_string();
        let chars: Vec<char> = text.chars().collect();
        if chars.len() > 10 {
            let mut b = body.clone();
            b["stop"] = json!([chars[5..8].iter().collect::<String>()]);
            let (_, ja, _) = agg_topo.post(path, b.clone()).await;
            let (_, jd, _) = dis.post(path, b).await;
            assert!(
                json_close(&ja["choices"], &jd["choices"]),
                "request {i} with a stop string: {ja} vs {jd}"
            );
        }
        // Streaming: the same text.
        let mut sb = body.clone();
        sb["stream"] = json!(true);
        let join = |events: Vec<String>| -> String {
            events
                .iter()
                .filter(|e| *e != "[DONE]")
                .filter_map(|e| serde_json::from_str::<Value>(e).ok())
                .filter_map(|v| {
                    v["choices"][0]["text"]
                        .as_str()
                        .or(v["choices"][0]["delta"]["content"].as_str())
                        .map(str::to_string)
                })
                .collect()
        };
        assert_eq!(
            join(agg_topo.post_sse(path, sb.clone()).await),
            join(dis.post_sse(path, sb).await),
            "stream {i}"
        );
    }
    // Concurrent.
    let mut set = tokio::task::JoinSet::new();
    for i in 0..4 {
        let body = json!({"model": "tandem-tiny", "prompt": format!("Request number {i} asks for a story about"), "max_tokens": 16, "temperature": 0});
        let (a, b) = (agg_topo.base.clone(), dis.base.clone());
        set.spawn(async move {
            let c = reqwest::Client::new();
            let ja: Value = c
                .post(format!("{a}/v1/completions"))
                .json(&body)
                .send()
                .await
                .expect("agg")
                .json()
                .await
                .expect("json");
            let jd: Value = c
                .post(format!("{b}/v1/completions"))
                .json(&body)
                .send()
                .await
                .expect("dis")
                .json()
                .await
                .expect("json");
            assert!(json_close(&ja["choices"], &jd["choices"]), "{ja} vs {jd}");
        });
    }
    while let Some(r) = set.join_next().await {
        r.expect("concurrent");
    }
    assert_eq!(worker_stats(&addr(&d)).await.prompt_tokens_computed, 0);

    // The prefill worker follows KV overlap: requests sharing a long prefix go where it is.
    for k in 0..3 {
        let prefix = format!("Shared context {k}: ").repeat(40);
        let mut chosen = None;
        for j in 0..3 {
            let body = json!({"model": "tandem-tiny", "prompt": format!("{prefix} question {j}?"), "max_tokens": 2});
            let (s, _, h) = dis.post("/v1/completions", body).await;
            assert_eq!(s, 200);
            let pid = h["x-tandem-prefill-worker-id"]
                .to_str()
                .expect("header")
                .to_string();
            match &chosen {
                None => chosen = Some(pid),
                Some(c) => assert_eq!(
                    c, &pid,
                    "prefix {k}, request {j} went to another prefill worker"
                ),
            }
        }
    }
    for w in p.iter().chain([&d]) {
        wait_stats(&addr(w), "idle", |s| {
            s.referenced_blocks == 0 && s.leases_live == 0
        })
        .await;
    }
}

/// Conditional disaggregation: short prompts prefill on the decode worker, long ones remote;
/// without a prefill worker everything runs locally, unless --enforce-disagg (503).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conditional_disaggregation_follows_the_threshold() {
    let disc = temp_dir("disagg-cond");
    let d = start_role(&disc, "tandem-decode", "pd", &[], &[]);
    let plain = start_router(
        &disc,
        1,
        &[
            "--disagg-prefill-threshold-tokens",
            "100",
            "--expose-worker-id",
        ],
    );
    let enforced = start_router(&disc, 1, &["--enforce-disagg", "--expose-worker-id"]);
    let base = |r: &Proc| format!("http://{}", field(r.ready_line(), "http="));
    let c = reqwest::Client::new();
    let post = |b: String, body: Value| {
        let c = c.clone();
        async move {
            let r = c
                .post(format!("{b}/v1/completions"))
                .json(&body)
                .send()
                .await
                .expect("post");
            let h = r.headers().clone();
            (
                r.status().as_u16(),
                h,
                r.json::<Value>().await.unwrap_or(Value::Null),
            )
        }
    };
    let short = json!({"model": "tandem-tiny", "prompt": "Hi there", "max_tokens": 4});
    let long = json!({"model": "tandem-tiny", "prompt": "word ".repeat(300), "max_tokens": 4});
    // Wait for both routers to see the decode worker.
    for r in [&plain, &enforced] {
        let deadline = Instant::now() + READY_TIMEOUT;
        while c
            .get(format!("{}/health", base(r)))
            .send()
            .await
            .map(|r| r.status().as_u16())
            .unwrap_or(0)
            != 200
        {
            assert!(
                Instant::now() < deadline,
                "a router never saw the decode worker"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // No prefill worker: local prefill, even for a long prompt.
    let (s, h, _) = post(base(&plain), long.clone()).await;
    assert_eq!(s, 200);
    assert!(h.get("x-tandem-prefill-worker-id").is_none());
    let (s, _, j) = post(base(&enforced), short.clone()).await;
    assert_eq!(s, 503, "{j}");
    assert!(j.to_string().contains("enforce-disagg"), "{j}");

    let p = start_role(&disc, "tandem-prefill", "prefill", &[], &[]);
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let (s, h, _) = post(base(&enforced), short.clone()).await;
        if s == 200 && h.get("x-tandem-prefill-worker-id").is_some() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the router never saw the prefill worker"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The plain router learns of the prefill worker on its own schedule: wait until a long
    // warm-up prompt (not used below) goes remote there too.
    let deadline = Instant::now() + READY_TIMEOUT;
    for i in 0.. {
        let warm = json!({"model": "tandem-tiny", "prompt": format!("warm{i} ").repeat(300), "max_tokens": 1});
        let (s, h, _) = post(base(&plain), warm).await;
        if s == 200 && h.get("x-tandem-prefill-worker-id").is_some() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the plain router never saw the prefill worker"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let before_d = worker_stats(&addr(&d)).await.prompt_tokens_computed;
    let before_p = worker_stats(&addr(&p)).await.prompt_tokens_computed;
    let (s, h, _) = post(base(&plain), short).await;
    assert_eq!(s, 200);
    assert!(
        h.get("x-tandem-prefill-worker-id").is_none(),
        "a short prompt went remote"
    );
    let mid_d = worker_stats(&addr(&d)).await.prompt_tokens_computed;
    assert!(mid_d > before_d);
    let long2 = json!({"model": "tandem-tiny", "prompt": "other ".repeat(300), "max_tokens": 4});
    let (s, h, _) = post(base(&plain), long2).await;
    assert_eq!(s, 200);
    assert!(
        h.get("x-tandem-prefill-worker-id").is_some(),
        "a long prompt stayed local"
    );
    assert_eq!(worker_stats(&addr(&d)).await.prompt_tokens_computed, mid_d);
    assert!(worker_stats(&addr(&p)).await.prompt_tokens_computed > before_p);
    drop((plain, enforced, p, d));
    let _ = std::fs::remove_dir_all(&disc);
}
