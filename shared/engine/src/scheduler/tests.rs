//! Scheduler tests driven by a deterministic stand-in for the model: a sampled token is a
//! function of the sequence id and position, and a sequence stops at `max_tokens`.

use std::sync::Arc;

use super::*;
use crate::kv::events::KvEventPublisher;
use crate::sampler::{SamplerState, SamplingParams};
use crate::sequence::NewSequence;

fn sched(
    num_blocks: usize,
    block_size: usize,
    max_batch_size: usize,
    max_num_tokens: usize,
    chunked: bool,
    policy: CapacitySchedulerPolicy,
) -> Scheduler {
    let bm = BlockManager::new(num_blocks, block_size, true, KvEventPublisher::new(16, 0));
    Scheduler::new(
        SchedulerConfig {
            max_batch_size,
            max_num_tokens,
            enable_chunked_prefill: chunked,
            policy,
        },
        bm,
    )
}

fn seq(id: SeqId, prompt: Vec<u32>, max_tokens: usize) -> Sequence {
    Sequence::new(NewSequence {
        id,
        request_id: Arc::from(format!("r{id}")),
        index: 0,
        tokens: prompt,
        max_tokens,
        arrival: id,
        params: Arc::new(SamplingParams::greedy()),
        sampler: SamplerState::new(0, 0),
        hashing: Default::default(),
        media: Arc::from([]),
    })
}

/// Runs one step: marks pieces computed, samples where due, finishes at max_tokens.
/// Returns the schedule and the ids finished in this step.
fn step(s: &mut Scheduler) -> (Schedule, Vec<SeqId>) {
    let sch = s.schedule();
    let mut done = Vec::new();
    for p in &sch.seqs {
        s.mark_computed(p);
        if p.sample {
            let seq = s.get_mut(p.id).unwrap();
            let t = 1000 + (p.id as u32) * 100 + seq.num_generated() as u32;
            seq.tokens.push(t);
            if seq.num_generated() >= seq.max_tokens {
                s.remove(p.id, FinishReason::Length);
                done.push(p.id);
            }
        }
    }
    check(s);
    (sch, done)
}

fn check(s: &Scheduler) {
    let st = s.block_stats();
    assert_eq!(st.referenced + st.cached + st.free, st.total);
    assert!(s.num_running() <= s.config().max_batch_size);
}

/// Runs to completion with a bounded number of steps; returns finish order and the
/// generated tokens per id.
fn run_all(s: &mut Scheduler, max_steps: usize) -> Vec<SeqId> {
    let mut order = Vec::new();
    for _ in 0..max_steps {
        if s.is_idle() {
            return order;
        }
        let (sch, done) = step(s);
        assert!(sch.num_tokens() <= s.config().max_num_tokens);
        order.extend(done);
    }
    panic!("did not finish in {max_steps} steps");
}

fn toks(base: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| base + i).collect()
}

#[test]
fn token_budget_and_chunking() {
    let mut s = sched(64, 4, 8, 16, true, CapacitySchedulerPolicy::MaxUtilization);
    s.add(seq(1, toks(0, 10), 2));
    s.add(seq(2, toks(100, 10), 2));
    let (sch, _) = step(&mut s);
    let pieces: Vec<_> = sch
        .seqs
        .iter()
        .map(|p| (p.id, p.start, p.len, p.sample))
        .collect();
    assert_eq!(pieces, vec![(1, 0, 10, true), (2, 0, 6, false)]);
    let (sch, _) = step(&mut s);
    let pieces: Vec<_> = sch
        .seqs
        .iter()
        .map(|p| (p.id, p.start, p.len, p.sample))
        .collect();
    // Decode of 1 first, then the rest of 2's prompt.
    assert_eq!(pieces, vec![(1, 10, 1, true), (2, 6, 4, true)]);
}

#[test]
fn queued_load_counts_prompts_not_yet_prefilled() {
    // Budget 16: seq 1 (10 tokens) runs whole, seq 2 (10) gets 6, seq 3 (10) waits.
    let mut s = sched(64, 4, 8, 16, true, CapacitySchedulerPolicy::MaxUtilization);
    for id in 1..=3 {
        s.add(seq(id, toks(100 * id as u32, 10), 2));
    }
    let before = s.queued_load();
    assert_eq!(before.prefill_tokens, 30);
    assert_eq!(before.kv_tokens, 30, "all three wait without blocks");
    step(&mut s);
    let after = s.queued_load();
    // Seq 2 has 4 prompt tokens left, seq 3 all 10; only seq 3 still waits for blocks.
    assert_eq!(after.prefill_tokens, 14);
    assert_eq!(after.kv_tokens, 10);
    run_all(&mut s, 50);
    assert_eq!(s.queued_load(), QueuedLoad::default());
}

#[test]
fn without_chunking_a_prompt_waits_for_a_whole_budget() {
    let mut s = sched(64, 4, 8, 16, false, CapacitySchedulerPolicy::MaxUtilization);
    s.add(seq(1, toks(0, 10), 5));
    s.add(seq(2, toks(100, 10), 5));
    let (sch, _) = step(&mut s);
    assert_eq!(sch.seqs.len(), 1);
    // Next step: seq 2's prompt goes first (prefill priority), then seq 1's decode.
    let (sch, _) = step(&mut s);
    let pieces: Vec<_> = sch.seqs.iter().map(|p| (p.id, p.len)).collect();
    assert_eq!(pieces, vec![(2, 10), (1, 1)]);
    run_all(&mut s, 100);
}

#[test]
fn max_batch_size_limits_running() {
    let mut s = sched(64, 4, 2, 100, true, CapacitySchedulerPolicy::MaxUtilization);
    for i in 1..=4 {
        s.add(seq(i, toks(i as u32 * 10, 3), 3));
    }
    let (sch, _) = step(&mut s);
    assert_eq!(sch.seqs.len(), 2);
    assert_eq!(s.num_waiting(), 2);
    let order = run_all(&mut s, 100);
    assert_eq!(order, vec![1, 2, 3, 4]);
}

#[test]
fn preemption_by_recompute_completes_everything_without_leaks() {
    // 6 blocks of 4 tokens; each sequence grows to 4 + 12 = 16 tokens = 4 blocks.
    let mut s = sched(6, 4, 8, 64, true, CapacitySchedulerPolicy::MaxUtilization);
    for i in 1..=4 {
        s.add(seq(i, toks(i as u32 * 1000, 4), 12));
    }
    let mut preempted = 0;
    let mut order = Vec::new();
    for _ in 0..500 {
        if s.is_idle() {
            break;
        }
        let (sch, done) = step(&mut s);
        // The victim is always newer than every sequence still scheduled.
        for v in &sch.preempted {
            assert!(sch.seqs.iter().all(|p| p.id < *v));
        }
        preempted += sch.preempted.len();
        order.extend(done);
    }
    assert!(s.is_idle());
    assert!(preempted > 0, "the pool is too small for all four at once");
    order.sort();
    assert_eq!(order, vec![1, 2, 3, 4]);
    assert_eq!(s.block_stats().referenced, 0);
}

#[test]
fn recompute_continues_the_same_tokens() {
    let mut s = sched(6, 4, 8, 64, true, CapacitySchedulerPolicy::MaxUtilization);
    for i in 1..=3 {
        s.add(seq(i, toks(i as u32 * 1000, 4), 12));
    }
    let mut finished = Vec::new();
    for _ in 0..500 {
        if s.is_idle() {
            break;
        }
        let sch = s.schedule();
        for p in &sch.seqs {
            s.mark_computed(p);
            if p.sample {
                let seq = s.get_mut(p.id).unwrap();
                let t = 1000 + (p.id as u32) * 100 + seq.num_generated() as u32;
                seq.tokens.push(t);
                if seq.num_generated() >= seq.max_tokens {
                    finished.push(s.remove(p.id, FinishReason::Length).unwrap());
                }
            }
        }
    }
    for f in finished {
        let want: Vec<u32> = (0..12).map(|k| 1000 + f.id as u32 * 100 + k).collect();
        assert_eq!(f.generated(), &want[..]);
    }
}

#[test]
fn guaranteed_no_evict_never_preempts() {
    let mut s = sched(
        6,
        4,
        8,
        64,
        true,
        CapacitySchedulerPolicy::GuaranteedNoEvict,
    );
    for i in 1..=4 {
        s.add(seq(i, toks(i as u32 * 1000, 4), 12));
    }
    let (_, _) = step(&mut s);
    // Each needs 4 blocks to completion: only one fits in 6.
    assert_eq!(s.num_running(), 1);
    let mut order = Vec::new();
    for _ in 0..500 {
        if s.is_idle() {
            break;
        }
        let (sch, done) = step(&mut s);
        assert!(sch.preempted.is_empty());
        order.extend(done);
    }
    assert_eq!(order, vec![1, 2, 3, 4], "FCFS order");
}

#[test]
fn fcfs_head_is_not_overtaken() {
    let mut s = sched(
        8,
        4,
        8,
        64,
        true,
        CapacitySchedulerPolicy::GuaranteedNoEvict,
    );
    s.add(seq(1, toks(0, 8), 16)); // 6 blocks to completion
    s.add(seq(2, toks(100, 8), 16)); // 6 blocks: must wait for 1
    s.add(seq(3, toks(200, 2), 2)); // 1 block: would fit, but must not overtake 2
    let mut admitted = Vec::new();
    for _ in 0..200 {
        if s.is_idle() {
            break;
        }
        let (sch, _) = step(&mut s);
        for p in &sch.seqs {
            if !admitted.contains(&p.id) {
                admitted.push(p.id);
            }
        }
        if admitted.len() == 1 {
            assert_eq!(s.num_waiting(), 2, "3 must not overtake 2");
        }
    }
    assert!(s.is_idle());
    assert_eq!(admitted, vec![1, 2, 3]);
}

#[test]
fn abort_frees_blocks() {
    let mut s = sched(16, 4, 8, 64, true, CapacitySchedulerPolicy::MaxUtilization);
    s.add(seq(1, toks(0, 9), 10));
    s.add(seq(2, toks(50, 9), 10));
    step(&mut s);
    assert!(s.block_stats().referenced > 0);
    s.remove(1, FinishReason::Abort).unwrap();
    s.remove(2, FinishReason::Abort).unwrap();
    assert!(s.is_idle());
    let st = s.block_stats();
    assert_eq!(st.referenced, 0);
    assert_eq!(st.cached + st.free, 16);
    assert!(s.remove(1, FinishReason::Abort).is_none());
}

#[test]
fn prefix_cache_hit_skips_computed_blocks() {
    let mut s = sched(16, 4, 8, 64, true, CapacitySchedulerPolicy::MaxUtilization);
    s.add(seq(1, toks(0, 9), 1));
    run_all(&mut s, 10);
    s.add(seq(2, toks(0, 9), 1));
    let (sch, _) = step(&mut s);
    assert_eq!((sch.seqs[0].start, sch.seqs[0].len), (8, 1));
    // A fully cached prompt still computes its last token.
    s.add(seq(3, toks(0, 8), 1));
    let (sch, _) = step(&mut s);
    assert_eq!((sch.seqs[0].start, sch.seqs[0].len), (7, 1));
}

#[test]
fn blocks_held_by_queued_imports_never_deadlock_the_head() {
    let mut s = sched(4, 4, 8, 64, true, CapacitySchedulerPolicy::MaxUtilization);
    // An imported sequence, queued with its KV already in 3 blocks, arrived after `head`.
    let mut imported = seq(10, toks(500, 13), 2);
    s.blocks_mut()
        .ensure_capacity(&mut imported.table, 12)
        .unwrap();
    imported.num_computed = 12;
    s.add(imported);
    // The head needs 3 of the 4 blocks; only 1 is free and nothing runs to free more.
    s.add(seq(1, toks(0, 8), 4));
    let (sch, _) = step(&mut s);
    assert_eq!(sch.seqs[0].id, 1, "the head is admitted");
    assert_eq!(s.get(10).unwrap().num_computed, 0, "the import recomputes");
    let order = run_all(&mut s, 100);
    assert_eq!(order, vec![1, 10]);
    assert_eq!(s.block_stats().referenced, 0);
}
