//! The router's shared routing state under concurrent requests: threads route, complete the
//! prefill of and free requests through one `KvRouter`, 128 requests in flight in all, and
//! the program prints the request lifecycles per second for 1 and for 2 threads (this
//! machine's cores) and what a second thread adds. With one lock over the state a second
//! thread adds little or loses; with the state sharded it should add close to a core.
//!
//! Only the `KvRouter` API is used, so the same file measures an older revision too.
//!
//! Run: `cargo bench -p tandem-kv-router --bench contention` (`SECS`, default 3 per case).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use tandem_kv_router::protocols::LocalBlockHash;
use tandem_kv_router::scheduling::rng::SplitMix64;
use tandem_kv_router::{KvRouter, KvRouterConfig, RouterMode, SelectOptions, WorkerInfo};

const WORKERS: u64 = 4;
const IN_FLIGHT: usize = 128;
/// 32-block prompts, each starting with one of 16 shared 24-block prefixes.
const PREFIXES: u64 = 16;
const PREFIX_BLOCKS: u64 = 24;
const PROMPT_BLOCKS: u64 = 32;
const BLOCK_SIZE: u32 = 16;

fn candidates() -> Vec<WorkerInfo> {
    (1..=WORKERS)
        .map(|id| WorkerInfo {
            id,
            total_blocks: 1 << 20,
            max_num_batched_tokens: 1 << 20,
            block_size: BLOCK_SIZE,
        })
        .collect()
}

fn prompt(rng: &mut SplitMix64, n: u64) -> Vec<LocalBlockHash> {
    let prefix = rng.below(PREFIXES);
    (0..PROMPT_BLOCKS)
        .map(|b| match b < PREFIX_BLOCKS {
            true => LocalBlockHash(prefix * 1000 + b),
            false => LocalBlockHash(1 << 40 | n << 8 | b),
        })
        .collect()
}

/// Request lifecycles (route, prefill done, free) completed by one thread in `secs`, keeping
/// `in_flight` of its own requests routed.
fn run_thread(router: &KvRouter, thread: u64, in_flight: usize, secs: Duration) -> u64 {
    let workers = candidates();
    let opts = SelectOptions::default();
    let mut rng = SplitMix64::new(thread + 1);
    let mut live: VecDeque<String> = VecDeque::with_capacity(in_flight);
    let mut done = 0u64;
    let mut n = 0u64;
    let end = Instant::now() + secs;
    while Instant::now() < end {
        for _ in 0..64 {
            let id = format!("{thread}-{n}");
            let locals = prompt(&mut rng, n);
            n += 1;
            if router
                .route(
                    &id,
                    &locals,
                    (PROMPT_BLOCKS as usize) * BLOCK_SIZE as usize,
                    &workers,
                    &opts,
                )
                .is_err()
            {
                continue;
            }
            router.mark_prefill_completed(&id);
            live.push_back(id);
            if live.len() > in_flight {
                if let Some(old) = live.pop_front() {
                    router.free(&old);
                    done += 1;
                }
            }
        }
    }
    for id in live {
        router.free(&id);
    }
    done
}

fn rate(threads: u64, secs: Duration) -> f64 {
    let config = KvRouterConfig {
        router_mode: RouterMode::Kv,
        ..Default::default()
    };
    let router = KvRouter::new(config, Some(7));
    let per_thread = IN_FLIGHT / threads as usize;
    let total: u64 = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let router = &router;
                s.spawn(move || run_thread(router, t, per_thread, secs))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or(0)).sum()
    });
    total as f64 / secs.as_secs_f64()
}

fn main() {
    let secs = std::env::var("SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(Duration::from_secs(3), Duration::from_secs_f64);
    let one = rate(1, secs);
    let two = rate(2, secs);
    println!(
        "{{\"in_flight\": {IN_FLIGHT}, \"one_thread_per_s\": {one:.0}, \"two_threads_per_s\": {two:.0}, \"second_thread_adds\": {:.2}}}",
        two / one - 1.0
    );
}
