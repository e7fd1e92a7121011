//! Offline replay: a Mooncake trace through N simulated engines on a virtual clock, with a
//! simple in-process router. No sockets and no wall clock: the engines' steps are released
//! one at a time by this driver in virtual-time order, so a replay's results are exactly the
//! same on every run.
//!
//! Lockstep protocol: each engine's backend, on `forward`, reports the step's simulated time
//! and blocks until the driver lets it end. The driver keeps each worker either idle or
//! "in a step ending at t". It takes the earliest event (a step end, or a trace arrival; step
//! ends first on ties, then lower worker index), lets that step end, and asks the engine for
//! its stats: the engine answers only after the step's outputs are emitted and before it
//! starts the next step, so the outputs get the step's end time and the driver knows whether
//! another step follows (then it waits for that step's report).

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tandem_config::WorkerConfig;
use tandem_engine::engine::{EngineHandle, RequestStream};
use tandem_engine::request::Request;
use tandem_engine::sampler::SamplingParams;

use crate::backend::Pacer;
use crate::cost::CostModel;

/// How the in-process router picks a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReplayRouter {
    RoundRobin,
    /// Fewest blocks to prefill plus blocks held by in-flight requests (a simplified form of
    /// Dynamo's cost), over the prefixes this router has sent to each worker.
    Kv,
}

#[derive(Debug, Deserialize)]
struct TraceLine {
    timestamp: f64,
    input_length: usize,
    output_length: usize,
    #[serde(default)]
    hash_ids: Vec<u64>,
}

struct Arrival {
    at_ms: f64,
    prompt: Vec<u32>,
    blocks: Vec<u64>,
    max_tokens: usize,
}

/// Reads a Mooncake JSONL trace. Block `h` is always the same `trace_block` tokens, drawn
/// from a generator seeded by `h`, so equal hash ids give equal prefixes.
fn read_trace(path: &Path, trace_block: usize, vocab: u32) -> anyhow::Result<Vec<Arrival>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read trace {}: {e}", path.display()))?;
    anyhow::ensure!(trace_block > 0, "--trace-block-size must be > 0");
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let t: TraceLine = serde_json::from_str(line)
            .map_err(|e| anyhow::anyhow!("trace {} line {}: {e}", path.display(), i + 1))?;
        let mut prompt = Vec::with_capacity(t.input_length);
        for h in &t.hash_ids {
            let mut s = *h ^ 0x5EED;
            prompt.extend((0..trace_block).map(|_| (splitmix(&mut s) % vocab as u64) as u32));
        }
        let mut s = (i as u64) << 32 | 0xF00D;
        while prompt.len() < t.input_length.max(1) {
            prompt.push((splitmix(&mut s) % vocab as u64) as u32);
        }
        prompt.truncate(t.input_length.max(1));
        out.push(Arrival {
            at_ms: t.timestamp,
            blocks: Vec::new(),
            prompt,
            max_tokens: t.output_length.max(1),
        });
    }
    // Stable sort keeps file order among equal timestamps.
    out.sort_by(|a, b| a.at_ms.total_cmp(&b.at_ms));
    Ok(out)
}

fn splitmix(s: &mut u64) -> u64 {
    *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *s;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Chained hashes of the prompt's full blocks (the router's own view; the engine keeps its
/// own hashes).
fn block_hashes(prompt: &[u32], block: usize) -> Vec<u64> {
    let mut h = 0u64;
    prompt
        .chunks_exact(block)
        .map(|c| {
            for t in c {
                h ^= *t as u64;
                h = splitmix(&mut h);
            }
            h
        })
        .collect()
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Dist {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

fn dist(mut v: Vec<f64>) -> Dist {
    if v.is_empty() {
        return Dist::default();
    }
    v.sort_by(f64::total_cmp);
    let q = |p: f64| {
        let r = p * (v.len() - 1) as f64;
        let (lo, hi) = (r.floor() as usize, r.ceil() as usize);
        v[lo] + (v[hi] - v[lo]) * (r - lo as f64)
    };
    Dist {
        mean: v.iter().sum::<f64>() / v.len() as f64,
        p50: q(0.5),
        p90: q(0.9),
        p99: q(0.99),
    }
}

/// Simulated results, all times in virtual milliseconds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ReplayReport {
    pub router: Option<ReplayRouter>,
    pub workers: usize,
    pub requests: usize,
    pub completed: usize,
    pub makespan_ms: f64,
    pub ttft_ms: Dist,
    pub itl_ms: Dist,
    pub e2e_ms: Dist,
    pub output_tokens: usize,
    pub cached_tokens: usize,
    pub steps: u64,
    /// Requests per worker, in worker order.
    pub per_worker: Vec<usize>,
}

struct Live {
    /// None until a submission sent mid-step is acknowledged.
    stream: Option<RequestStream>,
    worker: usize,
    arrival: f64,
    first: Option<f64>,
    last: f64,
    tokens: usize,
    blocks: usize,
}

struct Worker {
    engine: EngineHandle,
    /// End time of the step it is blocked in, if any.
    step_end: Option<f64>,
    go: mpsc::Sender<()>,
    seen: HashSet<u64>,
    inflight_blocks: usize,
    /// Submissions sent while the engine was inside a step; acknowledged after it.
    pending: Vec<PendingSubmit>,
}

type PendingSubmit =
    std::pin::Pin<Box<dyn std::future::Future<Output = anyhow::Result<RequestStream>> + Send>>;

const STEP_REPORT_TIMEOUT: Duration = Duration::from_secs(60);

/// Replays `trace` through `workers` simulated engines built from `cfg`.
pub fn replay(
    cfg: &WorkerConfig,
    workers: usize,
    vocab: Option<usize>,
    cost: CostModel,
    trace: &Path,
    trace_block: usize,
    router: ReplayRouter,
) -> anyhow::Result<ReplayReport> {
    let rt = tokio::runtime::Builder::new_current_thread().build()?;
    let (report_tx, report_rx) = mpsc::channel::<f64>();
    let mut ws = Vec::with_capacity(workers);
    for _ in 0..workers {
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let tx = report_tx.clone();
        let hook = Box::new(move |_: &crate::cost::StepShape, ms: f64| {
            // The driver is gone only when the replay failed; let the engine run on.
            if tx.send(ms).is_ok() {
                let _ = go_rx.recv();
            }
        });
        let built = crate::build_sim_engine(cfg, vocab, cost.clone(), Pacer::Hook(hook))?;
        ws.push(Worker {
            engine: built.engine,
            step_end: None,
            go: go_tx,
            seen: HashSet::new(),
            inflight_blocks: 0,
            pending: Vec::new(),
        });
    }
    let block = cfg.kv_cache.kv_block_size as usize;
    let vocab_ids = vocab.unwrap_or(30_000).min(u32::MAX as usize) as u32;
    let mut arrivals = read_trace(trace, trace_block, vocab_ids)?;
    for a in arrivals.iter_mut() {
        a.blocks = block_hashes(&a.prompt, block);
    }
    let mut report = ReplayReport {
        router: Some(router),
        workers,
        requests: arrivals.len(),
        per_worker: vec![0; workers],
        ..ReplayReport::default()
    };
    let mut live: HashMap<String, Live> = HashMap::new();
    let mut done: Vec<Live> = Vec::new();
    let mut next = 0usize;
    let mut rr = 0usize;
    let mut now = 0.0f64;

    // The next step's simulated time, once the engine has reported it.
    let wait_report = || -> anyhow::Result<f64> {
        report_rx
            .recv_timeout(STEP_REPORT_TIMEOUT)
            .map_err(|_| anyhow::anyhow!("a simulated engine has work but did not step"))
    };

    loop {
        let step = ws
            .iter()
            .enumerate()
            .filter_map(|(i, w)| w.step_end.map(|t| (t, i)))
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let arrival = arrivals.get(next).map(|a| a.at_ms);
        match (step, arrival) {
            (None, None) => break,
            (Some((t, i)), a) if a.is_none_or(|a| t <= a) => {
                now = t;
                report.steps += 1;
                let w = &mut ws[i];
                // Stats is queued before the step may end, so the engine answers it after
                // emitting this step's outputs and before deciding on the next step.
                let stats = w.engine.stats();
                w.go.send(())
                    .map_err(|_| anyhow::anyhow!("simulated engine {i} stopped"))?;
                let st = rt.block_on(stats)?;
                w.step_end = if st.running + st.waiting > 0 {
                    Some(now + wait_report()?)
                } else {
                    None
                };
                for fut in std::mem::take(&mut w.pending) {
                    let stream = rt.block_on(fut)?;
                    let l = live
                        .get_mut(stream.request_id())
                        .ok_or_else(|| anyhow::anyhow!("unknown submission"))?;
                    l.stream = Some(stream);
                }
                collect(&mut live, &mut done, &mut ws, i, now, &mut report);
            }
            (_, Some(at)) => {
                now = at;
                let a = &arrivals[next];
                let idx = next;
                next += 1;
                let i = match router {
                    ReplayRouter::RoundRobin => {
                        rr = (rr + 1) % workers;
                        (rr + workers - 1) % workers
                    }
                    ReplayRouter::Kv => pick_kv(&ws, &a.blocks),
                };
                report.per_worker[i] += 1;
                let w = &mut ws[i];
                w.seen.extend(a.blocks.iter().copied());
                let nblocks = a.prompt.len().div_ceil(block) + a.max_tokens.div_ceil(block);
                w.inflight_blocks += nblocks;
                let mut params = SamplingParams::greedy();
                params.max_tokens = Some(a.max_tokens);
                params.min_tokens = a.max_tokens;
                params.ignore_eos = true;
                params.seed = Some(idx as u64);
                let req = Request {
                    request_id: format!("r{idx}"),
                    prompt: a.prompt.clone(),
                    params,
                };
                let fut = w.engine.submit(req);
                let stream = if w.step_end.is_some() {
                    // The engine is inside a step: the ack comes after it ends.
                    w.pending.push(Box::pin(async move { Ok(fut.await?) }));
                    None
                } else {
                    // An accepted request is work: the idle engine starts a step for it.
                    let s = rt.block_on(fut)?;
                    w.step_end = Some(now + wait_report()?);
                    Some(s)
                };
                live.insert(
                    format!("r{idx}"),
                    Live {
                        stream,
                        worker: i,
                        arrival: now,
                        first: None,
                        last: now,
                        tokens: 0,
                        blocks: nblocks,
                    },
                );
            }
            (Some(_), None) => unreachable!("handled by the step arm"),
        }
    }
    report.makespan_ms = now;
    report.completed = done.len();
    report.output_tokens = done.iter().map(|l| l.tokens).sum();
    report.ttft_ms = dist(
        done.iter()
            .filter_map(|l| l.first.map(|f| f - l.arrival))
            .collect(),
    );
    report.e2e_ms = dist(done.iter().map(|l| l.last - l.arrival).collect());
    report.itl_ms = dist(
        done.iter()
            .filter(|l| l.tokens > 1)
            .filter_map(|l| l.first.map(|f| (l.last - f) / (l.tokens - 1) as f64))
            .collect(),
    );
    for w in &ws {
        w.engine.shutdown();
    }
    Ok(report)
}

/// Worker with the lowest cost: blocks it would have to prefill (the prompt's blocks after
/// the longest prefix this router has sent it) plus blocks held by its in-flight requests.
/// Ties go to the lower index, so the choice is deterministic.
fn pick_kv(ws: &[Worker], blocks: &[u64]) -> usize {
    let mut best = (usize::MAX, 0);
    for (i, w) in ws.iter().enumerate() {
        let overlap = blocks.iter().take_while(|h| w.seen.contains(h)).count();
        let cost = (blocks.len() - overlap) + w.inflight_blocks;
        if cost < best.0 {
            best = (cost, i);
        }
    }
    best.1
}

/// The stream's next output if it is already there (`recv` is cancel-safe, so dropping the
/// pending future loses nothing).
fn poll_now(stream: &mut RequestStream) -> Option<tandem_engine::request::RequestOutput> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let fut = std::pin::pin!(stream.next());
    match std::future::Future::poll(fut, &mut cx) {
        std::task::Poll::Ready(o) => o,
        std::task::Poll::Pending => None,
    }
}

/// Takes the outputs that worker `i`'s last step emitted, stamped with the step's end.
fn collect(
    live: &mut HashMap<String, Live>,
    done: &mut Vec<Live>,
    ws: &mut [Worker],
    i: usize,
    now: f64,
    report: &mut ReplayReport,
) {
    // Sorted ids keep the order of work independent of the map's iteration order.
    let mut ids: Vec<String> = live
        .iter()
        .filter(|(_, l)| l.worker == i && l.stream.is_some())
        .map(|(k, _)| k.clone())
        .collect();
    ids.sort();
    for id in ids {
        let Some(l) = live.get_mut(&id) else { continue };
        let mut finished = false;
        if let Some(stream) = l.stream.as_mut() {
            // Outputs of a step are in the channel before the engine answers `stats`.
            while let Some(o) = poll_now(stream) {
                if !o.token_ids.is_empty() {
                    l.first.get_or_insert(now);
                    l.last = now;
                    l.tokens += o.token_ids.len();
                }
                if let Some(u) = o.usage {
                    report.cached_tokens += u.cached_tokens;
                }
                if o.finish_reason.is_some() {
                    finished = true;
                    break;
                }
            }
        }
        if finished {
            if let Some(l) = live.remove(&id) {
                ws[i].inflight_blocks = ws[i].inflight_blocks.saturating_sub(l.blocks);
                done.push(l);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_hashes_chain_and_skip_partial_blocks() {
        let a = block_hashes(&[1, 2, 3, 4, 5], 2);
        let b = block_hashes(&[1, 2, 9, 9], 2);
        assert_eq!(a.len(), 2);
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
    }

    #[test]
    fn dist_interpolates() {
        let d = dist(vec![4.0, 1.0, 2.0, 3.0]);
        assert_eq!(d.p50, 2.5);
        assert_eq!(d.mean, 2.5);
    }
}
