//! The OpenAI API end to end: router + real workers on loopback, the tiny model, the real
//! Qwen3 tokenizer.

mod common;

use common::Topology;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_and_completions_stream_and_not() {
    let t = Topology::start_healthy(1, &[], &[]).await;

    let (status, models, _) = t.post("/v1/models", json!({})).await;
    assert_eq!(status, 405, "{models}");
    let r = reqwest::get(format!("{}/v1/models", t.base))
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap();
    assert_eq!(r["data"][0]["id"], "tandem-tiny");

    let (status, body, headers) = t
        .post("/v1/chat/completions", json!({"model": "tandem-tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0}))
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["completion_tokens"], 8);
    assert!(body["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    assert!(headers.contains_key("x-request-id"));
    let greedy_text = body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();

    // The same request streamed gives the same text, chunk by chunk, then usage and [DONE].
    let events = t
        .post_sse("/v1/chat/completions", json!({"model": "tandem-tiny", "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 8, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}}))
        .await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"].as_array().unwrap().len(), 0);
    assert_eq!(usage["usage"]["completion_tokens"], 8);
    let streamed: String = chunks[..chunks.len() - 1]
        .iter()
        .map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert_eq!(streamed, greedy_text);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");

    // Completions with token ids and with text, n > 1, logprobs.
    let (status, body, _) = t
        .post(
            "/v1/completions",
            json!({"model": "tandem-tiny", "prompt": "The capital of France is", "max_tokens": 4,
            "n": 2, "seed": 7, "temperature": 0.8, "logprobs": 2}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"].as_array().unwrap().len(), 2);
    assert_eq!(
        body["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .unwrap()
            .len(),
        4
    );
    assert_eq!(body["usage"]["completion_tokens"], 8);
    let (status, body, _) = t
        .post("/v1/completions", json!({"model": "tandem-tiny", "prompt": [785, 6722, 315, 9625, 374], "max_tokens": 3, "temperature": 0}))
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], 5);

    // The same seeded request twice gives the same text.
    let req = json!({"model": "tandem-tiny", "prompt": "Once upon a time", "max_tokens": 6, "seed": 42, "temperature": 1.0, "top_p": 0.9});
    let a = t.post("/v1/completions", req.clone()).await.1;
    let b = t.post("/v1/completions", req).await.1;
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_input_class_gets_its_status_and_the_router_keeps_serving() {
    // Chat bodies take 1 MiB or one 1 MiB image as base64 plus 1 MiB of text: 2.33 MiB.
    let t = Topology::start_healthy(
        1,
        &["--max-seq-len", "64"],
        &[
            "--http-body-limit-mb",
            "1",
            "--max-file-size-mb",
            "1",
            "--max-images-per-request",
            "1",
        ],
    )
    .await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", t.base);
    let raw = |body: &'static str| {
        client
            .post(&url)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let r = raw("{not json").await.unwrap();
    assert_eq!(r.status().as_u16(), 400);
    assert!(r.text().await.unwrap().contains("malformed JSON"));

    let cases: Vec<(Value, u16, &str)> = vec![
        (
            json!({"model": "tandem-tiny", "messages": "hi"}),
            400,
            "messages",
        ),
        (
            json!({"model": "tandem-tiny", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
            400,
            "temperature",
        ),
        (
            json!({"model": "tandem-tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 7}),
            400,
            "temperature",
        ),
        (
            json!({"model": "tandem-tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
            400,
            "max_tokens",
        ),
        (
            json!({"model": "tandem-tiny", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}),
            400,
            "response_format",
        ),
        (
            json!({"model": "tandem-tiny", "messages": [{"role": "user", "content": "x"}], "guided_regex": "a+", "guided_choice": ["a"]}),
            400,
            "cannot be combined",
        ),
        (
            json!({"model": "tandem-tiny", "messages": [{"role": "user", "content": "x"}], "nvext": {"guided_decoding_backend": "xgrammar"}}),
            400,
            "llguidance",
        ),
        (
            json!({"model": "tandem-tiny", "messages": [{"role": "user", "content": "x"}], "nvext": {"backend_instance_id": 7}}),
            400,
            "only taken with --router-mode direct",
        ),
        (
            json!({"model": "tandem-tiny", "messages": [{"role": "wizard", "content": "x"}]}),
            400,
            "role",
        ),
        (
            json!({"model": "tandem-tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            400,
            "does not take images",
        ),
        (
            json!({"model": "tandem-tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100}),
            400,
            "context length",
        ),
        (
            json!({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}),
            404,
            "no-such-model",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}]}),
            400,
            "model",
        ),
    ];
    for (body, want, needle) in cases {
        let (status, resp, _) = t.post("/v1/chat/completions", body.clone()).await;
        assert_eq!(status, want, "{body} -> {resp}");
        assert!(
            resp.to_string().contains(needle),
            "{body} -> {resp} lacks {needle}"
        );
        assert!(resp["error"]["message"].is_string(), "{resp}");
    }
    let big = "x".repeat(3 * 1024 * 1024);
    let r = client
        .post(&url)
        .header("content-type", "application/json")
        .body(format!("{{\"model\": \"{big}\"}}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 413);
    let (status, body, _) = t
        .post(
            "/v1/completions",
            json!({"model": "tandem-tiny", "prompt": ["a", {"b": 1}], "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert!(body.to_string().contains("prompt[1]"), "{body}");
    let (status, body, _) = t
        .post(
            "/v1/completions",
            json!({"model": "tandem-tiny", "prompt": [999999999], "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    // Still healthy and serving.
    let (status, body, _) = t
        .post("/v1/chat/completions", json!({"model": "tandem-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}))
        .await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_requests_then_the_model_is_unavailable() {
    let mut t = Topology::start_healthy(1, &[], &[]).await;
    let base = t.base.clone();
    // A streamed request: its first chunk proves the worker runs it (no polling race with a
    // request that may finish between two polls); 1,000 tokens keep it running past SIGTERM.
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let req = tokio::spawn(async move {
        let mut resp = reqwest::Client::new()
            .post(format!("{base}/v1/completions"))
            .json(
                &json!({"model": "tandem-tiny", "prompt": "drain me", "max_tokens": 1000,
                "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}}),
            )
            .send()
            .await
            .unwrap();
        let mut text = String::new();
        let mut started = Some(started_tx);
        while let Some(chunk) = resp.chunk().await.unwrap() {
            text.push_str(&String::from_utf8_lossy(&chunk));
            if let Some(tx) = started.take() {
                let _ = tx.send(());
            }
        }
        text
    });
    tokio::time::timeout(std::time::Duration::from_secs(20), started_rx)
        .await
        .expect("the request never started streaming")
        .expect("the request task ended before its first chunk");
    let pid = t.workers[0].child.id();
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    let stream = req.await.unwrap();
    let events: Vec<Value> = stream
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(stream.trim_end().ends_with("data: [DONE]"), "{stream}");
    let usage = events
        .iter()
        .find(|e| !e["usage"].is_null())
        .expect("usage");
    assert_eq!(usage["usage"]["completion_tokens"], 1000, "{usage}");
    let finish = events
        .iter()
        .filter_map(|e| e["choices"][0]["finish_reason"].as_str())
        .next_back();
    assert_eq!(finish, Some("length"));
    let status = t.workers[0].child.wait().unwrap();
    assert!(status.success(), "worker exit: {status}");
    let (status, body, _) = t
        .post(
            "/v1/completions",
            json!({"model": "tandem-tiny", "prompt": "anyone?", "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, 503, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_use_dynamo_names() {
    let t = Topology::start_healthy(1, &[], &[]).await;
    let (status, _, _) = t
        .post(
            "/v1/completions",
            json!({"model": "tandem-tiny", "prompt": "count me", "max_tokens": 3, "stream": false}),
        )
        .await;
    assert_eq!(status, 200);
    let m = reqwest::get(format!("{}/metrics", t.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in [
        "dynamo_frontend_requests_total",
        "dynamo_frontend_time_to_first_token_seconds",
        "dynamo_frontend_inter_token_latency_seconds",
        "dynamo_frontend_input_sequence_tokens",
        "dynamo_frontend_output_sequence_tokens",
        "dynamo_frontend_request_duration_seconds",
        "dynamo_router_overhead_total_ms",
        "dynamo_router_overhead_block_hashing_ms",
        "dynamo_router_overhead_scheduling_ms",
    ] {
        assert!(m.contains(name), "{name} missing from /metrics");
    }
    let worker_metrics = common::field(t.workers[0].ready_line(), "http=");
    let m = reqwest::get(format!("http://{worker_metrics}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(m.contains("dynamo_component_kv_cache_total_blocks"), "{m}");
    let live = reqwest::get(format!("{}/live", t.base)).await.unwrap();
    assert_eq!(live.status().as_u16(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_a_different_tokenizer_for_the_same_model_is_refused() {
    // A copy of the tiny model whose chat template differs: same name, different tokenizer hash.
    let tiny = tandem_tiny_model::ensure_tiny_model().unwrap();
    let odd = common::temp_dir("odd-model");
    for f in std::fs::read_dir(&tiny).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, odd.join(f.file_name().unwrap())).unwrap();
    }
    let cfg_path = odd.join("tokenizer_config.json");
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["chat_template"] = json!("{% for m in messages %}{{ m['content'] }}{% endfor %}");
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();

    let t = Topology::start_healthy(1, &[], &["--expose-worker-id"]).await;
    let odd_path = odd.to_str().unwrap().to_string();
    let other = common::start_worker(
        &t.discovery,
        &[
            "--model-path",
            &odd_path,
            "--served-model-name",
            "tandem-tiny",
        ],
    );
    let other_id = common::field(other.ready_line(), "instance_id=");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let m = reqwest::get(format!("{}/metrics", t.base))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if m.contains("tandem_router_refused_workers_total") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the odd worker was not refused"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    for _ in 0..4 {
        let (status, _, headers) = t
            .post(
                "/v1/completions",
                json!({"model": "tandem-tiny", "prompt": "x", "max_tokens": 1}),
            )
            .await;
        assert_eq!(status, 200);
        assert_ne!(headers["x-tandem-worker-id"].to_str().unwrap(), other_id);
    }
    drop(other);
    let _ = std::fs::remove_dir_all(&odd);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_request_id_is_honoured_even_when_two_clients_reuse_it() {
    let t = Topology::start_healthy(1, &[], &[]).await;
    let send = |base: String| async move {
        reqwest::Client::new()
            .post(format!("{base}/v1/completions"))
            .header("x-request-id", "same-id")
            .json(&json!({"model": "tandem-tiny", "prompt": "hi", "max_tokens": 20, "ignore_eos": true}))
            .send()
            .await
            .unwrap()
    };
    let (a, b) = tokio::join!(send(t.base.clone()), send(t.base.clone()));
    for r in [a, b] {
        assert_eq!(r.status().as_u16(), 200);
        assert_eq!(r.headers()["x-request-id"], "same-id");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["id"], "cmpl-same-id");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_chat_template_is_what_the_router_renders() {
    let dir = common::temp_dir("custom-template");
    let path = dir.join("chat.jinja");
    std::fs::write(
        &path,
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}",
    )
    .unwrap();
    let path = path.to_str().unwrap().to_string();
    let t = Topology::start_healthy(1, &["--custom-jinja-template", &path], &[]).await;
    let chat = json!({"model": "tandem-tiny", "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 6, "temperature": 0});
    let (status, chat, _) = t.post("/v1/chat/completions", chat).await;
    assert_eq!(status, 200, "{chat}");
    // The same text as a plain completion: same prompt tokens, same greedy output.
    let plain = json!({"model": "tandem-tiny", "prompt": "[user] Hello\n[assistant] ",
        "max_tokens": 6, "temperature": 0});
    let (status, plain, _) = t.post("/v1/completions", plain).await;
    assert_eq!(status, 200, "{plain}");
    assert_eq!(
        chat["usage"]["prompt_tokens"],
        plain["usage"]["prompt_tokens"]
    );
    assert_eq!(
        chat["choices"][0]["message"]["content"],
        plain["choices"][0]["text"]
    );

    // A template that does not compile stops the worker with a message naming the flag.
    std::fs::write(dir.join("bad.jinja"), "{% for %}").unwrap();
    let bad = dir.join("bad.jinja");
    let run = tokio::process::Command::new(common::bin("tandem-decode"))
        .args(["--rpc-host", "127.0.0.1", "--system-host", "127.0.0.1"])
        .args(tandem_test_support::tls_args())
        .arg("--custom-jinja-template")
        .arg(&bad)
        .env("DYN_DISCOVERY_BACKEND", "file")
        .env("DYN_FILE_KV", &dir)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(std::time::Duration::from_secs(120), run)
        .await
        .expect("the worker exits")
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("--custom-jinja-template"), "{err}");
}
