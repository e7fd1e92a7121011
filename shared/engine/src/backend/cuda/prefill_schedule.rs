//! Which block of the warpgroup prefill attention (`attention_prefill_wg.cu`) takes which
//! keys of which tile: its schedule, built on the host with the step's token maps.
//!
//! A tile's work for one KV head (a *job*) is its runs of [`super::attention::FA_KEYS`] keys;
//! a causal prefill's tiles grow by a run each. One block per job leaves SMs with a long tile
//! alone once their short one is done, and a block alone on an SM runs its keys ~1.7× slower
//! per run than two blocks sharing one (measured on an H100 at 2,048 tokens: one wave of 256
//! jobs for 264 slots). The balanced schedule launches as many blocks as the GPU holds at
//! once and gives each the same number of runs: jobs laid end to end and cut where a block
//! is full (McNaughton's wrap-around rule), a cut job's pieces writing their partial
//! softmax states for the last of them to merge.

use crate::error::EngineError;

/// Ints per piece in the schedule: first token, tokens, KV head, first run, end run, the
/// job's first state slot (-1: the job is not cut), this piece's part, the job's parts.
pub const PIECE_INTS: usize = 8;

/// f32 values of one partial state of a cut tile (the kernel's WG_STATE_F4 float4s for each of
/// its 128 threads at head_dim 128: the accumulators of 128 rows × 128 columns, the rows'
/// maxima and sums).
pub const STATE_FLOATS: usize = 34 * 4 * 128;

/// How a step's prefill jobs become blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PieceSchedule {
    /// KV heads: each tile is one job per head.
    pub heads: usize,
    /// `None`: one block per job, in the tiles' order (the kernel's launch before this
    /// schedule). Else the balanced schedule over that many blocks.
    pub balance: Option<Balance>,
}

/// The balanced schedule's shape: `blocks` resident at once on the GPU (occupancy × SMs),
/// the fewest runs a cut piece gets, and what a piece costs beyond its runs, in runs (staging
/// its Q tile and first keys, storing its rows: on an H100 about as long as four runs of a
/// block alone on an SM before the prologue's loads overlapped).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Balance {
    pub blocks: usize,
    pub min_runs: usize,
    pub piece_runs: usize,
}

/// A job: one tile (its first token and tokens in the step) for one KV head, `runs` runs
/// of keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Job {
    pub tok0: usize,
    pub ntok: usize,
    pub head: usize,
    pub runs: usize,
}

/// A schedule as the kernel reads it: `blocks + 1` piece offsets (block b takes pieces
/// `starts[b] .. starts[b + 1]`), then the pieces ([`PIECE_INTS`] each).
#[derive(Debug, PartialEq, Eq)]
pub struct Schedule {
    pub ints: Vec<i32>,
    pub blocks: usize,
    /// Partial-state slots the cut jobs use (their parts, summed).
    pub state_slots: usize,
}

/// One piece before its slot is known: job `job`, runs `r0 .. r1`.
#[derive(Clone, Copy, Debug)]
struct Cut {
    job: usize,
    r0: usize,
    r1: usize,
}

/// The schedule of `jobs` (in launch order) under `how`: balanced where the jobs fit one wave
/// of blocks; past that, one block per job, the GPU handing each SM its next job as one ends
/// (measured faster on an H100 from 512 jobs on: blocks that start together walk the same
/// keys together, and the many waves even out by themselves).
pub fn schedule(jobs: &[Job], how: PieceSchedule) -> Result<Schedule, EngineError> {
    let blocks: Vec<Vec<Cut>> = match how.balance {
        Some(b) if jobs.len() <= b.blocks => balanced(jobs, b),
        _ => (0..jobs.len())
            .map(|job| {
                vec![Cut {
                    job,
                    r0: 0,
                    r1: jobs[job].runs,
                }]
            })
            .collect(),
    };
    encode(jobs, &blocks)
}

/// Blocks of about the same cost (runs, plus `b.piece_runs` a piece), at most `b.blocks` of
/// them: the target per block starts at the even share of the jobs' cost (at least a piece of
/// `b.min_runs`) and grows until the cuts fit.
fn balanced(jobs: &[Job], b: Balance) -> Vec<Vec<Cut>> {
    let total: usize = jobs.iter().map(|j| j.runs + b.piece_runs).sum();
    let min_runs = b.min_runs.max(1);
    let mut target = total.div_ceil(b.blocks.max(1)).max(min_runs + b.piece_runs);
    loop {
        let blocks = wrap(jobs, target, min_runs, b.piece_runs);
        if blocks.len() <= b.blocks.max(1) {
            return blocks;
        }
        target += (target / 16).max(1);
    }
}

/// McNaughton's wrap-around with a floor on piece sizes: jobs in order fill a block up to a
/// cost of `target` (each piece its runs and `piece_runs`), the job that crosses the line cut
/// there, unless a piece would get fewer than `min_runs` (then the cut moves back to leave the
/// next piece `min_runs`, or the job goes whole to a fresh block, or a fresh block takes it
/// whole past the line).
fn wrap(jobs: &[Job], target: usize, min_runs: usize, piece_runs: usize) -> Vec<Vec<Cut>> {
    let mut blocks = Vec::new();
    let mut cur: Vec<Cut> = Vec::new();
    let mut load = 0;
    for (job, j) in jobs.iter().enumerate() {
        let mut r0 = 0;
        while r0 < j.runs {
            let left = j.runs - r0;
            let room = target.saturating_sub(load + piece_runs);
            let take = if left <= room {
                left
            } else if room >= min_runs && left - room >= min_runs {
                room
            } else if room >= min_runs && left >= 2 * min_runs && left - min_runs <= room {
                left - min_runs
            } else if load > 0 {
                blocks.push(std::mem::take(&mut cur));
                load = 0;
                continue;
            } else {
                left
            };
            cur.push(Cut {
                job,
                r0,
                r1: r0 + take,
            });
            load += take + piece_runs;
            r0 += take;
            if load >= target {
                blocks.push(std::mem::take(&mut cur));
                load = 0;
            }
        }
    }
    if !cur.is_empty() {
        blocks.push(cur);
    }
    blocks
}

/// The kernel's ints for `blocks`: each cut job gets consecutive state slots, one per part
/// (its counter is its first slot's).
fn encode(jobs: &[Job], blocks: &[Vec<Cut>]) -> Result<Schedule, EngineError> {
    let mut parts = vec![0usize; jobs.len()];
    for c in blocks.iter().flatten() {
        parts[c.job] += 1;
    }
    let mut slot0 = vec![-1i64; jobs.len()];
    let mut next = 0usize;
    for (job, &p) in parts.iter().enumerate() {
        if p > 1 {
            slot0[job] = next as i64;
            next += p;
        }
    }
    let n: usize = blocks.iter().map(Vec::len).sum();
    let mut ints = Vec::with_capacity(blocks.len() + 1 + n * PIECE_INTS);
    let mut at = 0;
    for b in blocks {
        ints.push(int("piece offset", at)?);
        at += b.len();
    }
    ints.push(int("piece offset", at)?);
    let mut seen = vec![0usize; jobs.len()];
    for c in blocks.iter().flatten() {
        let j = &jobs[c.job];
        let part = seen[c.job];
        seen[c.job] += 1;
        for v in [j.tok0, j.ntok, j.head, c.r0, c.r1] {
            ints.push(int("piece field", v)?);
        }
        ints.push(slot0[c.job] as i32); // below `next`, an i32 (checked below)
        ints.push(int("piece part", part)?);
        ints.push(int("piece parts", parts[c.job])?);
    }
    int("state slots", next)?;
    Ok(Schedule {
        ints,
        blocks: blocks.len(),
        state_slots: next,
    })
}

fn int(what: &str, v: usize) -> Result<i32, EngineError> {
    super::to_i32(what, v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Jobs of a causal prefill of `tiles` tiles (tile i: i + 1 runs) over `heads` heads,
    /// longest first.
    fn causal(tiles: usize, heads: usize) -> Vec<Job> {
        let mut jobs = Vec::new();
        for t in (0..tiles).rev() {
            for head in 0..heads {
                jobs.push(Job {
                    tok0: 64 * t,
                    ntok: 64,
                    head,
                    runs: t + 1,
                });
            }
        }
        jobs
    }

    /// The balanced schedule over `heads` with `blocks`, `min_runs` and `piece_runs`.
    fn on(heads: usize, blocks: usize, min_runs: usize, piece_runs: usize) -> PieceSchedule {
        PieceSchedule {
            heads,
            balance: Some(Balance {
                blocks,
                min_runs,
                piece_runs,
            }),
        }
    }

    /// Decodes `s` into per-block lists of (job index by (tok0, head), r0, r1, slot0, part,
    /// parts).
    fn pieces(s: &Schedule) -> Vec<Vec<[i32; PIECE_INTS]>> {
        let starts = &s.ints[..=s.blocks];
        let p = &s.ints[s.blocks + 1..];
        (0..s.blocks)
            .map(|b| {
                (starts[b] as usize..starts[b + 1] as usize)
                    .map(|i| p[i * PIECE_INTS..(i + 1) * PIECE_INTS].try_into().unwrap())
                    .collect()
            })
            .collect()
    }

    /// Every job's runs covered exactly once, in parts numbered 0.. with one slot range per
    /// cut job, disjoint from the others'.
    fn assert_covers(jobs: &[Job], s: &Schedule) {
        let mut runs: std::collections::HashMap<(i32, i32), Vec<[i32; PIECE_INTS]>> =
            Default::default();
        for p in pieces(s).into_iter().flatten() {
            runs.entry((p[0], p[2])).or_default().push(p);
        }
        let mut slots = vec![false; s.state_slots];
        for j in jobs {
            let mut ps = runs.remove(&(j.tok0 as i32, j.head as i32)).unwrap();
            ps.sort_by_key(|p| p[3]);
            let mut at = 0;
            for (i, p) in ps.iter().enumerate() {
                assert_eq!(p[1], j.ntok as i32);
                assert_eq!(p[3], at, "pieces meet");
                assert!(p[4] > p[3], "no empty piece");
                at = p[4];
                assert_eq!(p[7] as usize, ps.len());
                if ps.len() == 1 {
                    assert_eq!((p[5], p[6]), (-1, 0));
                } else {
                    let slot = (p[5] + p[6]) as usize;
                    assert!(!slots[slot], "slot {slot} used twice");
                    slots[slot] = true;
                    assert_eq!(p[5], ps[0][5], "one slot range per job");
                }
                assert_eq!(p[6] as usize, i, "parts in run order");
            }
            assert_eq!(at as usize, j.runs);
        }
        assert!(runs.is_empty());
        assert!(slots.iter().all(|&s| s), "every slot used");
    }

    fn loads(s: &Schedule) -> Vec<i32> {
        pieces(s)
            .iter()
            .map(|b| b.iter().map(|p| p[4] - p[3]).sum())
            .collect()
    }

    #[test]
    fn one_block_per_job_keeps_the_order() {
        let jobs = causal(4, 2);
        let s = schedule(
            &jobs,
            PieceSchedule {
                heads: 2,
                balance: None,
            },
        )
        .unwrap();
        assert_eq!(s.blocks, 8);
        assert_eq!(s.state_slots, 0);
        assert_covers(&jobs, &s);
        assert_eq!(loads(&s), vec![4, 4, 3, 3, 2, 2, 1, 1]);
    }

    #[test]
    fn a_2k_prefill_on_264_slots_gets_16_runs_a_block() {
        // 32 tiles of 64 tokens over 8 KV heads: 4,224 runs, 264 slots.
        let jobs = causal(32, 8);
        let how = on(8, 264, 4, 0);
        let s = schedule(&jobs, how).unwrap();
        assert_covers(&jobs, &s);
        let l = loads(&s);
        assert!(s.blocks <= 264, "{} blocks", s.blocks);
        assert!(l.iter().all(|&r| r <= 17), "{l:?}");
        assert!(s.state_slots <= 2 * 264);
    }

    #[test]
    fn a_piece_costs_runs_of_its_own() {
        // The same prefill with each piece costing 4 runs: no block takes much more than the
        // even share of runs and pieces (4,224 runs and at least 256 pieces over 264 blocks:
        // 20 a block), so the short tiles no longer pile up in one block.
        let jobs = causal(32, 8);
        let how = on(8, 264, 4, 4);
        let s = schedule(&jobs, how).unwrap();
        assert_covers(&jobs, &s);
        assert!(s.blocks <= 264, "{} blocks", s.blocks);
        let costs: Vec<i32> = pieces(&s)
            .iter()
            .map(|b| b.iter().map(|p| p[4] - p[3] + 4).sum())
            .collect();
        let max = *costs.iter().max().unwrap();
        assert!(max <= 24, "{costs:?}");
        let most_pieces = pieces(&s).iter().map(Vec::len).max().unwrap();
        assert!(most_pieces <= 4, "{most_pieces} pieces in one block");
    }

    #[test]
    fn pieces_keep_their_floor() {
        let jobs = causal(9, 3);
        for blocks in [1, 2, 5, 13, 40, 1000] {
            for min_runs in [1, 2, 3, 4] {
                let b = Balance {
                    blocks,
                    min_runs,
                    piece_runs: min_runs % 3,
                };
                let s = encode(&jobs, &balanced(&jobs, b)).unwrap();
                assert_covers(&jobs, &s);
                assert!(s.blocks <= blocks);
                for p in pieces(&s).into_iter().flatten() {
                    if p[7] > 1 {
                        assert!(p[4] - p[3] >= min_runs as i32, "{p:?} under {min_runs}");
                    }
                }
            }
        }
    }

    #[test]
    fn past_one_wave_each_job_is_a_block() {
        // 4,096 tokens: 512 jobs for 264 blocks.
        let jobs = causal(64, 8);
        let how = on(8, 264, 2, 3);
        let s = schedule(&jobs, how).unwrap();
        assert_covers(&jobs, &s);
        assert_eq!((s.blocks, s.state_slots), (512, 0));
    }

    #[test]
    fn one_run_pieces_cut_every_long_job() {
        // The GPU check's forcing: a run per piece, every job of k runs in k parts.
        let jobs = causal(3, 2);
        let how = on(2, 1000, 1, 0);
        let s = schedule(&jobs, how).unwrap();
        assert_covers(&jobs, &s);
        assert_eq!(s.blocks, 12);
        assert_eq!(s.state_slots, 2 * (3 + 2));
        assert!(loads(&s).iter().all(|&r| r == 1));
    }

    #[test]
    fn no_jobs_no_blocks() {
        let how = on(8, 264, 4, 4);
        let s = schedule(&[], how).unwrap();
        assert_eq!((s.blocks, s.state_slots, s.ints.clone()), (0, 0, vec![0]));
    }
}
