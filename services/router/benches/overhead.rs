//! Router overhead per request, from the received body to the dispatch decision: JSON parse,
//! chat template, tokenization, sampling parameters, block hashing, and worker selection
//! against a populated KV index (16 workers). The HTTP framing and the gRPC call are not
//! included. Baseline in the same run: the same pipeline with round-robin selection (no
//! index lookup), so the KV-aware part shows as a ratio.
//!
//! Run: `cargo bench -p tandem-router --bench overhead`. Besides criterion's estimates it
//! prints p50 / p99 over 3,000 timed requests.

use std::time::Instant;

use criterion::Criterion;
use tandem_kv_protocol::{
    KvCacheEvent, KvCacheEventData, KvCacheStoreData, KvCacheStoredBlockData,
};
use tandem_kv_router::{
    KvRouter, KvRouterConfig, RouterEvent, RouterMode, SelectOptions, WorkerInfo,
};
use tandem_router::models::ModelAssets;
use tandem_router::openai::{parse_body, ChatCompletionRequest};
use tandem_text::{ChatTemplate, Tokenizer};

const WORKERS: u64 = 16;
const BLOCK: u32 = 32;

fn assets() -> ModelAssets {
    let dir = tandem_tiny_model::ensure_tiny_model().expect("tiny model");
    let tokenizer = Tokenizer::load(&dir).expect("tokenizer");
    let template = ChatTemplate::load(&dir).expect("template");
    ModelAssets {
        hash: String::new(),
        tokenizer,
        template,
    }
}

/// A system prompt shared by every request (the usual real-world prefix) and a user turn.
fn body(i: usize) -> Vec<u8> {
    let system = "You are a helpful assistant. ".repeat(60);
    serde_json::to_vec(&serde_json::json!({
        "model": "m",
        "messages": [{"role": "system", "content": system},
                     {"role": "user", "content": format!("Question number {i}: what is {i} + {i}?")}],
        "max_tokens": 64,
        "temperature": 0.7,
    }))
    .expect("json")
}

fn router(mode: RouterMode, assets: &ModelAssets) -> KvRouter {
    let kv = KvRouter::new(
        KvRouterConfig {
            router_mode: mode,
            ..KvRouterConfig::default()
        },
        Some(1),
    );
    // Each worker holds the shared prefix (some of it) plus private chains.
    let req: ChatCompletionRequest = parse_body(&body(0)).expect("body");
    let prompt = tandem_router::chat::chat_prompt(assets, &req).expect("prompt");
    for w in 0..WORKERS {
        let mut tokens: Vec<u32> = prompt[..prompt.len() * (w as usize % 4 + 1) / 4].to_vec();
        tokens.extend((0..3200).map(|t| 100_000 + (w as u32) * 5000 + t));
        let hashes = tandem_kv_protocol::block_hashes(&tokens, BLOCK as usize);
        let blocks = hashes
            .iter()
            .map(|(local, seq)| KvCacheStoredBlockData {
                block_hash: *seq,
                tokens_hash: *local,
            })
            .collect();
        let event = KvCacheEvent {
            event_id: 1,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: None,
                start_position: None,
                blocks,
            }),
            dp_rank: 0,
        };
        let _ = kv.apply_event(RouterEvent::new(w, event));
    }
    kv
}

fn candidates() -> Vec<WorkerInfo> {
    (0..WORKERS)
        .map(|id| WorkerInfo {
            id,
            total_blocks: 10_000,
            max_num_batched_tokens: 8192,
            block_size: BLOCK,
        })
        .collect()
}

fn one_request(kv: &KvRouter, assets: &ModelAssets, workers: &[WorkerInfo], body: &[u8], id: &str) {
    let req: ChatCompletionRequest = parse_body(body).expect("body");
    let prompt = tandem_router::chat::chat_prompt(assets, &req).expect("prompt");
    let params = tandem_router::params::sampling_params(req.common(), None).expect("params");
    std::hint::black_box(&params);
    let hashes = tandem_kv_router::protocols::request_block_hashes(&prompt, BLOCK, None);
    kv.route(
        id,
        &hashes,
        prompt.len(),
        workers,
        &SelectOptions::default(),
    )
    .expect("route");
    kv.free(id);
}

fn percentiles(name: &str, kv: &KvRouter, assets: &ModelAssets, bodies: &[Vec<u8>]) -> f64 {
    let workers = candidates();
    let mut us: Vec<f64> = bodies
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let t = Instant::now();
            one_request(kv, assets, &workers, b, &format!("p{i}"));
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    us.sort_by(f64::total_cmp);
    let p = |q: f64| us[((us.len() as f64 - 1.0) * q) as usize];
    println!(
        "{name}: p50 {:.1} us, p99 {:.1} us, mean {:.1} us over {} requests",
        p(0.5),
        p(0.99),
        us.iter().sum::<f64>() / us.len() as f64,
        us.len()
    );
    p(0.5)
}

fn main() {
    let assets = assets();
    let kv = router(RouterMode::Kv, &assets);
    let rr = router(RouterMode::RoundRobin, &assets);
    let bodies: Vec<Vec<u8>> = (0..3000).map(body).collect();
    let req: ChatCompletionRequest = parse_body(&bodies[0]).expect("body");
    println!(
        "prompt tokens: {}",
        tandem_router::chat::chat_prompt(&assets, &req)
            .expect("prompt")
            .len()
    );
    let a = percentiles("kv (16 workers, populated index)", &kv, &assets, &bodies);
    let b = percentiles("round-robin baseline", &rr, &assets, &bodies);
    println!("kv / round-robin p50 ratio: {:.2}", a / b);

    let mut c = Criterion::default().configure_from_args().sample_size(50);
    let workers = candidates();
    let body0 = bodies[1].clone();
    c.bench_function("router_overhead_kv_16_workers", |bch| {
        bch.iter(|| one_request(&kv, &assets, &workers, &body0, "bench"))
    });
    c.bench_function("router_overhead_round_robin_16_workers", |bch| {
        bch.iter(|| one_request(&rr, &assets, &workers, &body0, "bench"))
    });
    c.final_summary();
}
