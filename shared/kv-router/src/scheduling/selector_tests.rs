use rustc_hash::FxHashMap;

use super::*;
use crate::protocols::ExternalSequenceBlockHash;

/// Loads from a table; no block is shared, so every request block is new.
#[derive(Default)]
struct Loads(FxHashMap<WorkerId, WorkerLoad>);

impl Loads {
    fn set(mut self, w: WorkerId, requests: usize, decode: usize, prefill: u64) -> Self {
        self.0.insert(
            w,
            WorkerLoad {
                active_requests: requests,
                active_decode_blocks: decode,
                active_prefill_tokens: prefill,
            },
        );
        self
    }
}

impl LoadSource for Loads {
    fn load(&self, w: WorkerId) -> WorkerLoad {
        self.0.get(&w).copied().unwrap_or_default()
    }
    fn new_blocks(&self, _: WorkerId, seqs: &[ExternalSequenceBlockHash]) -> usize {
        seqs.len()
    }
}

fn workers(ids: &[WorkerId]) -> Vec<WorkerInfo> {
    ids.iter()
        .map(|&id| WorkerInfo {
            id,
            total_blocks: 100,
            max_num_batched_tokens: 1000,
            block_size: 4,
        })
        .collect()
}

fn overlaps(scores: &[(WorkerId, u32)], sizes: &[(WorkerId, usize)]) -> OverlapScores {
    OverlapScores {
        scores: scores.iter().copied().collect(),
        tree_sizes: sizes.iter().copied().collect(),
    }
}

fn selector(mode: RouterMode, f: impl FnOnce(&mut KvRouterConfig)) -> WorkerSelector {
    let mut c = KvRouterConfig {
        router_mode: mode,
        ..Default::default()
    };
    f(&mut c);
    WorkerSelector::new(c, Some(7))
}

const HASHES: [LocalBlockHash; 4] = [
    LocalBlockHash(1),
    LocalBlockHash(2),
    LocalBlockHash(3),
    LocalBlockHash(4),
];

#[test]
fn kv_mode_cost_on_a_hand_computed_example() {
    // 16-token prompt, 4 blocks of 4. Worker 1 caches 3 blocks but has 10 active blocks:
    //   prefill (16 - 12) / 4 = 1, decode 10 + 4 = 14 → 15.
    // Worker 2 caches nothing and is idle: prefill 16 / 4 = 4, decode 0 + 4 = 4 → 8.
    let ws = workers(&[1, 2]);
    let ov = overlaps(&[(1, 3)], &[(1, 3), (2, 0)]);
    let loads = Loads::default().set(1, 2, 10, 0);
    let s = selector(RouterMode::Kv, |_| {});
    let sel = s
        .select(&HASHES, 16, &ws, &ov, &loads, &SelectOptions::default())
        .unwrap();
    assert_eq!((sel.worker_id, sel.logit), (2, Some(8.0)));
    assert_eq!(
        (
            sel.overlap_blocks,
            sel.cached_tokens,
            sel.new_prefill_tokens
        ),
        (0, 0, 16)
    );
    // Weight 5 values the cache more: worker 1 = 5 + 14 = 19, worker 2 = 20 + 4 = 24.
    let opts = SelectOptions {
        overlap_score_weight: Some(5.0),
        ..Default::default()
    };
    let sel = s.select(&HASHES, 16, &ws, &ov, &loads, &opts).unwrap();
    assert_eq!((sel.worker_id, sel.logit), (1, Some(19.0)));
    assert_eq!(
        (
            sel.overlap_blocks,
            sel.cached_tokens,
            sel.new_prefill_tokens
        ),
        (3, 12, 4)
    );
    // Queued prefill counts: 40 tokens already queued on worker 1 add 10 blocks × 5.
    let loads = Loads::default().set(1, 2, 10, 40);
    let sel = s.select(&HASHES, 16, &ws, &ov, &loads, &opts).unwrap();
    assert_eq!(sel.worker_id, 2);
}

#[test]
fn kv_ties_go_to_the_smaller_tree_then_random() {
    let ws = workers(&[1, 2, 3]);
    let ov = overlaps(&[], &[(1, 500), (2, 20), (3, 20)]);
    let s = selector(RouterMode::Kv, |_| {});
    let mut seen = FxHashMap::default();
    for _ in 0..200 {
        let sel = s
            .select(
                &HASHES,
                16,
                &ws,
                &ov,
                &Loads::default(),
                &SelectOptions::default(),
            )
            .unwrap();
        *seen.entry(sel.worker_id).or_insert(0) += 1;
    }
    assert_eq!(seen.get(&1), None, "larger tree loses the tie");
    assert!(seen[&2] > 50 && seen[&3] > 50, "{seen:?}");
}

#[test]
fn kv_temperature_samples_reproducibly() {
    let ws = workers(&[1, 2]);
    let ov = overlaps(&[(1, 4)], &[]);
    let run = |seed| {
        let mut c = KvRouterConfig {
            router_mode: RouterMode::Kv,
            router_temperature: 1.0,
            ..Default::default()
        };
        c.router_track_active_blocks = true;
        let s = WorkerSelector::new(c, Some(seed));
        (0..2000)
            .map(|_| {
                s.select(
                    &HASHES,
                    16,
                    &ws,
                    &ov,
                    &Loads::default(),
                    &SelectOptions::default(),
                )
                .unwrap()
                .worker_id
            })
            .collect::<Vec<_>>()
    };
    let a = run(11);
    assert_eq!(a, run(11), "same seed, same choices");
    // Logits: worker 1 = 0 + 4 = 4, worker 2 = 4 + 4 = 8 → normalised 0 and 1, T = 1:
    // p(worker 1) = 1 / (1 + e^-1) ≈ 0.731.
    let p1 = a.iter().filter(|&&w| w == 1).count() as f64 / a.len() as f64;
    assert!((p1 - 0.731).abs() < 0.03, "p1 = {p1}");
}

#[test]
fn busy_workers_are_excluded_and_all_busy_is_no_worker_available() {
    let ws = workers(&[1, 2]);
    let ov = OverlapScores::default();
    let opts = SelectOptions::default();
    let s = selector(RouterMode::RoundRobin, |_| {});
    // Decode blocks above 1.0 × 100 total blocks.
    let loads = Loads::default().set(1, 1, 101, 0);
    for _ in 0..4 {
        assert_eq!(
            s.select(&HASHES, 16, &ws, &ov, &loads, &opts)
                .unwrap()
                .worker_id,
            2
        );
    }
    // Prefill tokens above 10 × 1000 batched tokens.
    let loads = Loads::default().set(2, 1, 0, 10_001);
    assert_eq!(
        s.select(&HASHES, 16, &ws, &ov, &loads, &opts)
            .unwrap()
            .worker_id,
        1
    );
    assert!(
        !s.is_busy(
            &ws[0],
            &WorkerLoad {
                active_requests: 1,
                active_decode_blocks: 100,
                active_prefill_tokens: 10_000,
            }
        ),
        "at the threshold is not above it"
    );
    // Absolute prefill threshold.
    let s = selector(RouterMode::Kv, |c| {
        c.active_prefill_tokens_threshold = Some(50)
    });
    let loads = Loads::default().set(1, 1, 0, 51).set(2, 1, 0, 60);
    let err = s.select(&HASHES, 16, &ws, &ov, &loads, &opts).unwrap_err();
    assert_eq!(
        err,
        SelectError::NoWorkerAvailable {
            candidates: 2,
            busy: 2
        }
    );
    assert!(err.to_string().contains("no worker available"));
    // Disabled thresholds never exclude.
    let s = selector(RouterMode::Kv, |c| {
        c.active_decode_blocks_threshold = None;
        c.active_prefill_tokens_threshold = None;
        c.active_prefill_tokens_threshold_frac = None;
    });
    let loads = Loads::default().set(1, 1, 10_000, 1 << 40);
    assert!(s.select(&HASHES, 16, &ws[..1], &ov, &loads, &opts).is_ok());
    // No candidates at all.
    assert!(matches!(
        s.select(&HASHES, 16, &[], &ov, &loads, &opts),
        Err(SelectError::NoWorkerAvailable { candidates: 0, .. })
    ));
}

#[test]
fn round_robin_cycles() {
    let ws = workers(&[10, 20, 30]);
    let s = selector(RouterMode::RoundRobin, |_| {});
    let picks: Vec<_> = (0..6)
        .map(|_| {
            s.select(
                &[],
                5,
                &ws,
                &OverlapScores::default(),
                &Loads::default(),
                &SelectOptions::default(),
            )
            .unwrap()
            .worker_id
        })
        .collect();
    assert_eq!(picks, vec![10, 20, 30, 10, 20, 30]);
}

#[test]
fn random_covers_every_worker_reproducibly() {
    let ws = workers(&[1, 2, 3, 4]);
    let run = || {
        let s = selector(RouterMode::Random, |_| {});
        (0..400)
            .map(|_| {
                s.select(
                    &[],
                    5,
                    &ws,
                    &OverlapScores::default(),
                    &Loads::default(),
                    &SelectOptions::default(),
                )
                .unwrap()
                .worker_id
            })
            .collect::<Vec<_>>()
    };
    let a = run();
    assert_eq!(a, run());
    for w in 1..=4 {
        let c = a.iter().filter(|&&x| x == w).count();
        assert!((60..140).contains(&c), "worker {w}: {c}");
    }
}

#[test]
fn least_loaded_and_power_of_two() {
    let ws = workers(&[1, 2, 3]);
    let loads = Loads::default()
        .set(1, 3, 0, 0)
        .set(2, 1, 5, 0)
        .set(3, 1, 2, 0);
    let ov = OverlapScores::default();
    let opts = SelectOptions::default();
    let s = selector(RouterMode::LeastLoaded, |_| {});
    assert_eq!(
        s.select(&[], 5, &ws, &ov, &loads, &opts).unwrap().worker_id,
        3
    );
    // Power of two: of any two sampled, the less loaded wins, so worker 1 (most requests)
    // can never be chosen, and with two workers the lighter one always is.
    let s = selector(RouterMode::PowerOfTwo, |_| {});
    let mut seen = FxHashMap::default();
    for _ in 0..300 {
        let w = s.select(&[], 5, &ws, &ov, &loads, &opts).unwrap().worker_id;
        *seen.entry(w).or_insert(0) += 1;
    }
    assert_eq!(seen.get(&1), None);
    assert!(seen[&3] > seen[&2], "{seen:?}");
    for _ in 0..20 {
        assert_eq!(
            s.select(&[], 5, &ws[..2], &ov, &loads, &opts)
                .unwrap()
                .worker_id,
            2
        );
    }
    assert_eq!(
        s.select(&[], 5, &ws[..1], &ov, &loads, &opts)
            .unwrap()
            .worker_id,
        1
    );
}

#[test]
fn direct_mode_and_unsupported_mode() {
    let ws = workers(&[1, 2]);
    let ov = overlaps(&[(2, 2)], &[]);
    // Busy does not matter for direct.
    let loads = Loads::default().set(2, 1, 1000, 0);
    let s = selector(RouterMode::Direct, |_| {});
    let opts = SelectOptions {
        worker_id: Some(2),
        ..Default::default()
    };
    let sel = s.select(&HASHES, 10, &ws, &ov, &loads, &opts).unwrap();
    assert_eq!(
        (sel.worker_id, sel.mode, sel.cached_tokens),
        (2, RouterMode::Direct, 8)
    );
    assert_eq!(
        s.select(&HASHES, 10, &ws, &ov, &loads, &SelectOptions::default()),
        Err(SelectError::DirectTargetMissing)
    );
    let opts = SelectOptions {
        worker_id: Some(9),
        ..Default::default()
    };
    assert_eq!(
        s.select(&HASHES, 10, &ws, &ov, &loads, &opts),
        Err(SelectError::UnknownWorker(9))
    );
    let s = selector(RouterMode::DeviceAwareWeighted, |_| {});
    let err = s
        .select(&HASHES, 10, &ws, &ov, &loads, &SelectOptions::default())
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "router mode device-aware-weighted is not implemented"
    );
}
