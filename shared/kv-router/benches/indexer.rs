//! Indexer and selection benchmarks at router scale: 64 workers × 100k cached blocks each.
//!
//! Workload: 256 shared "system prompt" prefixes of 32 blocks, and per worker sequences made
//! of one shared prefix plus 96 unique blocks, until the worker holds 100k blocks. Baselines
//! measured in the same run: a naive index (std `HashMap<worker, HashSet<sequence hash>>`,
//! matched by probing every worker block by block) and round-robin selection.
//!
//! Run: `cargo bench -p tandem-kv-router --bench indexer -- --warm-up-time 1 --measurement-time 3`

use std::collections::{HashMap, HashSet};
use std::hint::black_box;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tandem_kv_router::protocols::{
    chain_hash, sequence_hashes, ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData,
    KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
    WorkerId,
};
use tandem_kv_router::scheduling::rng::SplitMix64;
use tandem_kv_router::{
    ActiveSequences, KvIndexer, KvRouterConfig, NewRequest, OverlapScores, RouterMode,
    SelectOptions, WorkerInfo, WorkerSelector,
};

const WORKERS: u64 = 64;
const BLOCKS_PER_WORKER: usize = 100_000;
const PREFIXES: usize = 256;
const PREFIX_LEN: usize = 32;
const SUFFIX_LEN: usize = 96;
const BLOCK_SIZE: u32 = 16;

/// One cached sequence: (worker, local hashes).
struct Workload {
    prefixes: Vec<Vec<LocalBlockHash>>,
    /// Every sequence each worker stores, in order.
    seqs: Vec<(WorkerId, Vec<LocalBlockHash>)>,
}

fn workload() -> Workload {
    let mut rng = SplitMix64::new(0x07a4_de11);
    let prefixes: Vec<Vec<LocalBlockHash>> = (0..PREFIXES)
        .map(|_| (0..PREFIX_LEN).map(|_| random_local(&mut rng)).collect())
        .collect();
    let mut seqs = Vec::new();
    for w in 0..WORKERS {
        let mut held = HashSet::new();
        let mut blocks = 0;
        while blocks < BLOCKS_PER_WORKER {
            // Popular prompts are more popular: square the uniform draw.
            let f = rng.next_f64();
            let p = ((f * f) * PREFIXES as f64) as usize;
            let mut locals = prefixes[p].clone();
            locals.extend((0..SUFFIX_LEN).map(|_| random_local(&mut rng)));
            blocks += SUFFIX_LEN + if held.insert(p) { PREFIX_LEN } else { 0 };
            seqs.push((w, locals));
        }
    }
    Workload { prefixes, seqs }
}

fn random_local(rng: &mut SplitMix64) -> LocalBlockHash {
    LocalBlockHash(rng.next_u64())
}

fn store_event(
    worker: WorkerId,
    id: u64,
    parent: Option<ExternalSequenceBlockHash>,
    locals: &[LocalBlockHash],
    seqs: &[ExternalSequenceBlockHash],
) -> RouterEvent {
    RouterEvent::new(
        worker,
        KvCacheEvent {
            event_id: id,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: parent,
                start_position: None,
                blocks: locals
                    .iter()
                    .zip(seqs)
                    .map(|(&l, &s)| KvCacheStoredBlockData {
                        block_hash: s,
                        tokens_hash: l,
                    })
                    .collect(),
            }),
            dp_rank: 0,
        },
    )
}

/// The naive baseline: per worker, the set of sequence hashes it holds.
#[derive(Default)]
struct NaiveIndex {
    workers: HashMap<WorkerId, HashSet<ExternalSequenceBlockHash>>,
}

impl NaiveIndex {
    fn store(&mut self, w: WorkerId, seqs: &[ExternalSequenceBlockHash]) {
        self.workers
            .entry(w)
            .or_default()
            .extend(seqs.iter().copied());
    }
    fn remove(&mut self, w: WorkerId, seqs: &[ExternalSequenceBlockHash]) {
        if let Some(s) = self.workers.get_mut(&w) {
            for h in seqs {
                s.remove(h);
            }
        }
    }
    fn find_matches(&self, seqs: &[ExternalSequenceBlockHash]) -> HashMap<WorkerId, u32> {
        let mut out = HashMap::new();
        for (&w, held) in &self.workers {
            let n = seqs.iter().take_while(|h| held.contains(h)).count() as u32;
            if n > 0 {
                out.insert(w, n);
            }
        }
        out
    }
}

fn bench_indexer(c: &mut Criterion) {
    let t = Instant::now();
    let wl = workload();
    let gen_s = t.elapsed().as_secs_f64();
    let hashed: Vec<(
        WorkerId,
        Vec<LocalBlockHash>,
        Vec<ExternalSequenceBlockHash>,
    )> = wl
        .seqs
        .iter()
        .map(|(w, l)| (*w, l.clone(), sequence_hashes(l)))
        .collect();

    // Bulk load: every sequence as one stored event, through the real ordering path.
    let mut ix = KvIndexer::new();
    let mut next_id = vec![1u64; WORKERS as usize];
    let t = Instant::now();
    let mut blocks_in_events = 0usize;
    for (w, l, s) in &hashed {
        let id = next_id[*w as usize];
        next_id[*w as usize] += 1;
        blocks_in_events += l.len();
        let _ = ix.apply_event(store_event(*w, id, None, l, s));
    }
    let load_s = t.elapsed().as_secs_f64();
    let mut naive = NaiveIndex::default();
    let t = Instant::now();
    for (w, _, s) in &hashed {
        naive.store(*w, s);
    }
    let naive_load_s = t.elapsed().as_secs_f64();
    let min_blocks = (0..WORKERS)
        .map(|w| ix.tree().tree_size(w))
        .min()
        .unwrap_or(0);
    println!(
        "workload: {} workers, >= {} blocks each ({} sequences, {} blocks in events, {} radix nodes), generated in {:.1}s",
        WORKERS,
        min_blocks,
        hashed.len(),
        blocks_in_events,
        ix.tree().node_count(),
        gen_s
    );
    println!(
        "bulk load: radix {:.2}s = {:.0} events/s, {:.2} M blocks/s; naive {:.2}s = {:.2} M blocks/s",
        load_s,
        hashed.len() as f64 / load_s,
        blocks_in_events as f64 / load_s / 1e6,
        naive_load_s,
        blocks_in_events as f64 / naive_load_s / 1e6
    );

    // Queries: half replay a cached sequence (deep match on one worker, prefix on many),
    // half a popular prefix with a fresh suffix (prefix match on many workers).
    let mut rng = SplitMix64::new(99);
    let queries: Vec<(Vec<LocalBlockHash>, Vec<ExternalSequenceBlockHash>)> = (0..1024)
        .map(|i| {
            let locals = if i % 2 == 0 {
                hashed[rng.below(hashed.len() as u64) as usize].1.clone()
            } else {
                let mut l = wl.prefixes[rng.below(8) as usize].clone();
                l.extend((0..SUFFIX_LEN).map(|_| random_local(&mut rng)));
                l
            };
            let seqs = sequence_hashes(&locals);
            (locals, seqs)
        })
        .collect();
    let mut g = c.benchmark_group("find_matches_64w_100k");
    g.throughput(Throughput::Elements(1));
    let mut qi = 0;
    g.bench_function("radix", |b| {
        b.iter(|| {
            qi = (qi + 1) % queries.len();
            black_box(ix.find_matches(&queries[qi].0))
        })
    });
    g.bench_function("naive_baseline", |b| {
        b.iter(|| {
            qi = (qi + 1) % queries.len();
            black_box(naive.find_matches(&queries[qi].1))
        })
    });
    g.finish();

    // Steady-state churn: store an 8-block continuation under a prefix the worker holds, then
    // evict it tail first, as the engine's LRU does (2 events, 16 block updates), so the index
    // stays at full size.
    let churn: Vec<(
        WorkerId,
        ExternalSequenceBlockHash,
        Vec<LocalBlockHash>,
        Vec<ExternalSequenceBlockHash>,
    )> = (0..4096)
        .map(|_| {
            let (w, l, s) = &hashed[rng.below(hashed.len() as u64) as usize];
            let parent = s[PREFIX_LEN - 1];
            let locals: Vec<LocalBlockHash> = (0..8).map(|_| random_local(&mut rng)).collect();
            let mut seqs = Vec::with_capacity(8);
            let mut p = parent;
            for &x in &locals {
                p = chain_hash(Some(p), x);
                seqs.push(p);
            }
            debug_assert_eq!(l.len(), PREFIX_LEN + SUFFIX_LEN);
            (*w, parent, locals, seqs)
        })
        .collect();
    let mut g = c.benchmark_group("apply_events_64w_100k");
    g.throughput(Throughput::Elements(2));
    let mut ci = 0;
    g.bench_function("radix_store_remove", |b| {
        b.iter(|| {
            ci = (ci + 1) % churn.len();
            let (w, parent, l, s) = &churn[ci];
            let id = next_id[*w as usize];
            next_id[*w as usize] += 2;
            let _ = ix.apply_event(store_event(*w, id, Some(*parent), l, s));
            let rm = RouterEvent::new(
                *w,
                KvCacheEvent {
                    event_id: id + 1,
                    data: KvCacheEventData::Removed(KvCacheRemoveData {
                        block_hashes: s.iter().rev().copied().collect(),
                    }),
                    dp_rank: 0,
                },
            );
            black_box(ix.apply_event(rm))
        })
    });
    g.bench_function("naive_baseline_store_remove", |b| {
        b.iter(|| {
            ci = (ci + 1) % churn.len();
            let (w, _, _, s) = &churn[ci];
            naive.store(*w, s);
            naive.remove(*w, s);
        })
    });
    g.finish();
    assert!(ix.tree().check_invariants().is_ok());
}

fn bench_selection(c: &mut Criterion) {
    let mut g = c.benchmark_group("select");
    g.throughput(Throughput::Elements(1));
    let mut rng = SplitMix64::new(5);
    for &n in &[16u64, 64] {
        let workers: Vec<WorkerInfo> = (0..n)
            .map(|id| WorkerInfo {
                id,
                total_blocks: 100_000,
                max_num_batched_tokens: 8192,
                block_size: BLOCK_SIZE,
            })
            .collect();
        // A 2048-token prompt (128 blocks); each worker has 16 requests of 128 blocks in
        // flight, half of them sharing the prompt's first 32 blocks.
        let locals: Vec<LocalBlockHash> = (0..128).map(|_| random_local(&mut rng)).collect();
        let seqs = ActiveSequences::new(&KvRouterConfig::default());
        for w in 0..n {
            for r in 0..16 {
                let mut l = if r % 2 == 0 {
                    locals[..32].to_vec()
                } else {
                    Vec::new()
                };
                while l.len() < 128 {
                    l.push(random_local(&mut rng));
                }
                let s = sequence_hashes(&l);
                let id = format!("{w}-{r}");
                let _ = seqs.add_request(NewRequest {
                    request_id: &id,
                    worker_id: w,
                    seq_hashes: &s,
                    isl_tokens: 2048,
                    overlap_blocks: 0,
                    block_size: BLOCK_SIZE,
                });
            }
        }
        let overlaps = OverlapScores {
            scores: (0..n).map(|w| (w, (w % 40) as u32)).collect(),
            tree_sizes: (0..n).map(|w| (w, 100_000)).collect(),
        };
        for mode in [RouterMode::Kv, RouterMode::RoundRobin] {
            let cfg = KvRouterConfig {
                router_mode: mode,
                ..Default::default()
            };
            let sel = WorkerSelector::new(cfg, Some(1));
            let name = if mode == RouterMode::Kv {
                "kv"
            } else {
                "round_robin_baseline"
            };
            g.bench_with_input(BenchmarkId::new(name, n), &n, |b, _| {
                b.iter(|| {
                    black_box(sel.select(
                        &locals,
                        2048,
                        &workers,
                        &overlaps,
                        &seqs,
                        &SelectOptions::default(),
                    ))
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench_indexer, bench_selection);
criterion_main!(benches);
