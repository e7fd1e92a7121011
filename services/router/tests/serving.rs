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
    let t =
        Topology::start_healthy(1, &["--max-seq-len", "64"], &["--http-body-limit-mb", "1"]).await;
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
            json!({"model": "tandem-tiny", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}),
            400,
            "response_format",
        ),
        (
            json!({"model": "tandem-tiny", "messages": [{"role": "wizard", "content": "x"}]}),
            400,
            "role",
        ),
        (
            json!({"model": "tandem-tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            400,
            "image_url",
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
    let big = "x".repeat(2 * 1024 * 1024);
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
            json!({"model": "tandem-tiny", "prompt": ["a", "b"], "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, 400, "{body}");
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
