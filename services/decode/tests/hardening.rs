//! A real `tandem-decode` worker process under hostile or failing input, driven over its own
//! gRPC (no router): the caps hold when the router is skipped, `--engine-request-limit`
//! refuses with RESOURCE_EXHAUSTED, and (with the `failpoints` feature) a panicking request
//! fails alone while a dead engine thread fails `/health` and leaves discovery.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use tandem_protocol::wire::IntoWire;
use tandem_protocol::worker::worker_client::WorkerClient;
use tandem_protocol::worker::{
    GenerateDisaggRequest, GenerateOutput, GenerateRequest, LoadStatsRequest, PrefillTarget,
};
use tandem_test_support::{field, spawn_ready, Proc, TempDir};
use tandem_text::limits::{MAX_STOP_STRING_BYTES, MAX_STOP_TOKEN_IDS};
use tandem_text::SamplingParams;
use tonic::transport::Channel;
use tonic::Code;

const T: Duration = Duration::from_secs(60);

struct Worker {
    proc: Proc,
    /// Removed on drop; read by the fault tests.
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    discovery: TempDir,
}

impl Worker {
    fn start(extra: &[&str], env: &[(&str, &str)]) -> Worker {
        let discovery = TempDir::new("tandem-hardening").expect("temp dir");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem-decode"));
        cmd.args(["--disaggregation-mode", "agg"])
            .args(["--rpc-host", "127.0.0.1", "--system-host", "127.0.0.1"])
            .args(["--trtllm.kv_cache_config.max_tokens", "8192"])
            .args(tandem_test_support::tls_args())
            .args(extra)
            .env("DYN_FILE_KV", discovery.path())
            .env("DYN_DISCOVERY_BACKEND", "file")
            .envs(env.iter().copied());
        let proc = spawn_ready(&mut cmd, "TANDEM_WORKER_READY");
        Worker { proc, discovery }
    }

    fn line(&self, key: &str) -> String {
        field(self.proc.ready_line(), key)
    }

    async fn client(&self) -> WorkerClient<Channel> {
        let channel = tandem_test_support::internal_security()
            .endpoint(&self.line("grpc="))
            .expect("worker address")
            .connect()
            .await
            .expect("connect to the worker");
        WorkerClient::new(channel)
    }

    /// The worker's entry in file discovery, if it is there.
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    fn registered(&self) -> bool {
        let id: u64 = self.line("instance_id=").parse().expect("instance id");
        find_file(
            &self.discovery.path().join("v1/instances"),
            &format!("{id:x}"),
        )
    }

    /// The HTTP status of `GET /health`, or None when nothing answers.
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    fn health(&self) -> Option<u16> {
        let mut s = std::net::TcpStream::connect(self.line("http=")).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        s.write_all(b"GET /health HTTP/1.1\r\nHost: w\r\nConnection: close\r\n\r\n")
            .ok()?;
        let mut head = String::new();
        s.read_to_string(&mut head).ok()?;
        head.split_whitespace().nth(1)?.parse().ok()
    }
}

#[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
fn find_file(dir: &Path, name: &str) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().any(|e| {
        let p: PathBuf = e.path();
        if p.is_dir() {
            find_file(&p, name)
        } else {
            p.file_name().is_some_and(|f| f == name)
        }
    })
}

fn greedy(max_tokens: Option<usize>) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ignore_eos: true,
        ..SamplingParams::greedy()
    }
}

fn request(id: &str, params: SamplingParams) -> GenerateRequest {
    GenerateRequest {
        replayed_tokens: 0,
        request_id: id.into(),
        cache_salt: None,
        prompt: vec![1, 2, 3, 4, 5, 6, 7, 8],
        sampling_params: Some(params.into_wire()),
        media: Default::default(),
    }
}

/// Every output of a request, or the status that ended its stream.
async fn run(
    c: &mut WorkerClient<Channel>,
    r: GenerateRequest,
) -> Result<Vec<GenerateOutput>, tonic::Status> {
    let mut stream = c.generate(r).await?.into_inner();
    let mut outs = Vec::new();
    while let Some(o) = tokio::time::timeout(T, stream.message())
        .await
        .expect("an output within the timeout")?
    {
        outs.push(o);
    }
    Ok(outs)
}

fn refused(r: Result<Vec<GenerateOutput>, tonic::Status>, code: Code, naming: &str) {
    match r {
        Ok(outs) => panic!("admitted ({} outputs), expected {code:?}", outs.len()),
        Err(s) => {
            assert_eq!(s.code(), code, "{}", s.message());
            assert!(
                s.message().contains(naming),
                "{:?} lacks {naming}",
                s.message()
            );
        }
    }
}

fn generated(outs: &[GenerateOutput]) -> usize {
    outs.iter().map(|o| o.token_ids.len()).sum()
}

#[tokio::test]
async fn direct_grpc_calls_cannot_skip_the_caps() {
    let w = Worker::start(&[], &[]);
    let mut c = w.client().await;
    let mut huge_n = request("n", greedy(Some(4))).sampling_params.unwrap();
    huge_n.n = u64::MAX;
    let huge_n = GenerateRequest {
        sampling_params: Some(huge_n),
        ..request("n", greedy(None))
    };
    refused(
        run(&mut c, huge_n).await,
        Code::InvalidArgument,
        "n must be",
    );
    for m in [u64::MAX, u64::MAX - 7, 1 << 63] {
        let mut p = request("m", greedy(Some(4))).sampling_params.unwrap();
        p.max_tokens = Some(m);
        let r = GenerateRequest {
            sampling_params: Some(p),
            ..request("m", greedy(None))
        };
        refused(run(&mut c, r).await, Code::InvalidArgument, "max_tokens");
    }
    let ids = SamplingParams {
        stop_token_ids: vec![5; MAX_STOP_TOKEN_IDS + 1],
        ..greedy(Some(4))
    };
    refused(
        run(&mut c, request("ids", ids)).await,
        Code::InvalidArgument,
        "stop_token_ids",
    );
    let oov = SamplingParams {
        stop_token_ids: vec![u32::MAX],
        min_tokens: 2,
        ..greedy(Some(4))
    };
    refused(
        run(&mut c, request("oov", oov)).await,
        Code::InvalidArgument,
        "stop_token_ids",
    );
    let long = SamplingParams {
        stop: vec!["x".repeat(MAX_STOP_STRING_BYTES + 1)],
        ..greedy(Some(4))
    };
    refused(
        run(&mut c, request("long", long)).await,
        Code::InvalidArgument,
        "stop[0]",
    );
    // The worker still serves.
    let outs = run(&mut c, request("fine", greedy(Some(4))))
        .await
        .expect("served");
    assert_eq!(generated(&outs), 4);
}

#[tokio::test]
async fn the_engine_request_limit_refuses_with_resource_exhausted() {
    let w = Worker::start(&["--engine-request-limit", "1"], &[]);
    let mut c = w.client().await;
    // Runs until it is dropped (no max_tokens, EOS ignored).
    let mut long = c
        .generate(request("long", greedy(None)))
        .await
        .expect("admitted")
        .into_inner();
    let first = tokio::time::timeout(T, long.message())
        .await
        .expect("output");
    assert!(first.expect("no error").is_some(), "the long request runs");
    refused(
        run(&mut c, request("second", greedy(Some(2)))).await,
        Code::ResourceExhausted,
        "--engine-request-limit",
    );
    drop(long);
    // The cancelled stream aborts the long request; then there is room again.
    let deadline = Instant::now() + T;
    loop {
        let s = c
            .load_stats(LoadStatsRequest {})
            .await
            .expect("stats")
            .into_inner();
        if s.running + s.waiting == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the long request never ended: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let outs = run(&mut c, request("third", greedy(Some(2))))
        .await
        .expect("room again");
    assert_eq!(generated(&outs), 2);
}

#[cfg(feature = "failpoints")]
#[tokio::test]
async fn a_panicking_request_fails_alone_and_its_batch_mates_complete() {
    const MATE_TOKENS: usize = 1000;
    let w = Worker::start(&[], &[("TANDEM_FAILPOINT_PANIC_REQUEST", "boom")]);
    let mut c = w.client().await;
    // Three requests running (each has streamed a token) when the panicking one joins them.
    let mut mates = Vec::new();
    for i in 0..3 {
        let r = request(&format!("mate-{i}"), greedy(Some(MATE_TOKENS)));
        let mut stream = c.generate(r).await.expect("admitted").into_inner();
        let first = tokio::time::timeout(T, stream.message())
            .await
            .expect("output");
        let first = first.expect("no error").expect("a first output");
        mates.push((first, stream));
    }
    let boom = run(&mut c, request("req-boom-1", greedy(Some(MATE_TOKENS))))
        .await
        .expect("the stream itself ends normally");
    let last = boom.last().expect("an output");
    assert_eq!(
        last.finish_reason,
        tandem_protocol::worker::FinishReason::Abort as i32
    );
    assert!(
        last.error.contains("internal engine error"),
        "{:?}",
        last.error
    );
    for (first, mut stream) in mates {
        let mut outs = vec![first];
        while let Some(o) = tokio::time::timeout(T, stream.message())
            .await
            .expect("an output within the timeout")
            .expect("a batch-mate was served")
        {
            outs.push(o);
        }
        assert_eq!(generated(&outs), MATE_TOKENS);
        assert_eq!(
            outs.last().unwrap().finish_reason,
            tandem_protocol::worker::FinishReason::Length as i32
        );
        assert!(outs.iter().all(|o| o.error.is_empty()));
    }
    assert_eq!(w.health(), Some(200), "the engine thread survived");
    let s = c
        .load_stats(LoadStatsRequest {})
        .await
        .expect("stats")
        .into_inner();
    assert_eq!(s.referenced_blocks, 0, "no KV block leaked: {s:?}");
    let outs = run(&mut c, request("after", greedy(Some(3))))
        .await
        .expect("served");
    assert_eq!(generated(&outs), 3);
}

#[cfg(feature = "failpoints")]
#[tokio::test]
async fn a_dead_engine_thread_fails_health_and_leaves_discovery() {
    let mut w = Worker::start(&[], &[("TANDEM_FAILPOINT_ENGINE_DIE_AFTER_STEPS", "3")]);
    assert_eq!(w.health(), Some(200));
    assert!(w.registered(), "registered in discovery");
    let mut c = w.client().await;
    let r = run(&mut c, request("victim", greedy(Some(50)))).await;
    refused(r, Code::Unavailable, "engine stopped");
    let died = Instant::now();
    let limit = Duration::from_secs(5);
    while w.health() == Some(200) {
        assert!(died.elapsed() < limit, "/health still 200 after {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    while w.registered() {
        assert!(died.elapsed() < limit, "still in discovery after {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let status = loop {
        if let Some(s) = w.proc.child.try_wait().expect("wait") {
            break s;
        }
        assert!(died.elapsed() < T, "the worker did not exit");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(!status.success(), "a dead engine exits non-zero: {status}");
}

/// A decode worker dials only prefill workers that discovery lists in its namespace: a
/// `GenerateDisagg` naming any other address (here: the worker itself, and a port nobody
/// registered) is refused with PERMISSION_DENIED naming it, and no lease is granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_disagg_naming_an_unknown_prefill_worker_is_refused() {
    let w = Worker::start(
        &["--disaggregation-mode", "decode", "--kv-transport", "tcp"],
        &[],
    );
    let mut c = w.client().await;
    let own_id: u64 = w.line("instance_id=").parse().expect("instance id");
    for (instance_id, addr) in [
        (7u64, "127.0.0.1:1".to_string()),
        // Registered, but a decode worker, not a prefill worker.
        (own_id, w.line("grpc=")),
    ] {
        let req = GenerateDisaggRequest {
            request: Some(request("disagg-unknown", greedy(Some(4)))),
            prefill_workers: vec![PrefillTarget {
                instance_id,
                grpc_addr: addr.clone(),
            }],
        };
        let r = tokio::time::timeout(T, c.generate_disagg(req))
            .await
            .expect("an answer within the timeout");
        let status = r.expect_err("refused");
        assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
        assert!(
            status.message().contains(&addr),
            "the message names the address: {status:?}"
        );
    }
}
