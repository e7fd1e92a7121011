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
use tandem_rng::splitmix64;

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
            prompt.extend((0..trace_block).map(|_| (splitmix64(&mut s) % vocab as u64) as u32));
        }
        let mut s = (i as u64) << 32 | 0xF00D;
        while prompt.len() < t.input_length.max(1) {
            prompt.push((splitmix64(&mut s) % vocab as u64) as u32);
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

/// Chained hashes of the prompt's full blocks (the router's own view; the engine keeps its
/// own hashes).
fn block_hashes(prompt: &[u32], block: usize) -> Vec<u64> {
    let mut h = 0u64;
    prompt
        .chunks_exact(block)
        .map(|c| {
            for t in c {
                h ^= *t as u64;
                h = splitmix64(&mut h);
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
    pub prefill_workers: usize,
    pub requests: usize,
    pub completed: usize,
    pub makespan_ms: f64,
    pub ttft_ms: Dist,
    pub itl_ms: Dist,
    pub e2e_ms: Dist,
    pub output_tokens: usize,
    pub cached_tokens: usize,
    pub steps: u64,
    /// Requests per worker, in worker order (prefill workers first).
    pub per_worker: Vec<usize>,
    /// Requests meeting the SLA, and their rate over the makespan (0 without an SLA).
    pub sla_met: usize,
    pub goodput_rps: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Agg,
    Prefill,
    Decode,
}

struct Live {
    /// None until a submission sent mid-step is acknowledged.
    stream: Option<RequestStream>,
    worker: usize,
    phase: Phase,
    /// Index in the trace.
    idx: usize,
    arrival: f64,
    first: Option<f64>,
    last: f64,
    tokens: usize,
    blocks: usize,
    cached: usize,
    first_token: Option<u32>,
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

/// What to replay on which fleet.
#[derive(Clone, Debug)]
pub struct ReplayOptions {
    /// Aggregated workers, or decode workers when `prefill_workers > 0`.
    pub workers: usize,
    /// Prefill workers of a disaggregated fleet (0: aggregated).
    pub prefill_workers: usize,
    pub vocab: Option<usize>,
    pub trace_block: usize,
    pub router: ReplayRouter,
    /// Simulated KV transfer bandwidth, GB/s.
    pub transfer_gb_s: f64,
    /// KV bytes per token (all layers, K and V).
    pub kv_bytes_per_token: usize,
    pub sla_ttft_ms: Option<f64>,
    pub sla_itl_ms: Option<f64>,
}

/// A request ready to be handed to a decode worker at `at`.
struct Handoff {
    at: f64,
    idx: usize,
    arrival: f64,
    first: f64,
    prompt: Vec<u32>,
    max_tokens: usize,
}

/// Sends `req` to `w` at `now`. An idle engine starts a step for an accepted request (its
/// report is awaited here); a busy one acknowledges after its step ends.
fn submit(
    rt: &tokio::runtime::Runtime,
    w: &mut Worker,
    req: Request,
    now: f64,
    wait_report: &dyn Fn() -> anyhow::Result<f64>,
) -> anyhow::Result<Option<RequestStream>> {
    let fut = w.engine.submit(req);
    if w.step_end.is_some() {
        w.pending.push(Box::pin(async move { Ok(fut.await?) }));
        return Ok(None);
    }
    let s = rt.block_on(fut)?;
    w.step_end = Some(now + wait_report()?);
    Ok(Some(s))
}

fn request(idx: usize, suffix: &str, prompt: Vec<u32>, max_tokens: usize) -> Request {
    let mut params = SamplingParams::greedy();
    params.max_tokens = Some(max_tokens);
    params.min_tokens = max_tokens;
    params.ignore_eos = true;
    params.seed = Some(idx as u64);
    Request {
        replayed: 0,
        request_id: format!("r{idx}{suffix}"),
        cache_salt: None,
        prompt,
        params,
        media: Default::default(),
    }
}

/// Replays `trace` through simulated engines built from `cfg`.
pub fn replay(
    cfg: &WorkerConfig,
    cost: CostModel,
    trace: &Path,
    o: &ReplayOptions,
) -> anyhow::Result<ReplayReport> {
    anyhow::ensure!(o.workers > 0, "a replay needs at least one (decode) worker");
    let disagg = o.prefill_workers > 0;
    anyhow::ensure!(
        !disagg || (o.transfer_gb_s.is_finite() && o.transfer_gb_s > 0.0),
        "--kv-transfer-bandwidth must be a positive number of GB/s"
    );
    let rt = tokio::runtime::Builder::new_current_thread().build()?;
    let (report_tx, report_rx) = mpsc::channel::<f64>();
    let total = o.prefill_workers + o.workers;
    let mut ws = Vec::with_capacity(total);
    for i in 0..total {
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let tx = report_tx.clone();
        let hook = Box::new(move |_: &crate::cost::StepShape, ms: f64| {
            // The driver is gone only when the replay failed; let the engine run on.
            if tx.send(ms).is_ok() {
                let _ = go_rx.recv();
            }
        });
        let mut c = cost.clone();
        c.prefill_free = disagg && i >= o.prefill_workers;
        let built = crate::build_sim_engine(cfg, o.vocab, c, Pacer::Hook(hook))?;
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
    let vocab_ids = o.vocab.unwrap_or(30_000).min(u32::MAX as usize) as u32;
    let mut arrivals = read_trace(trace, o.trace_block, vocab_ids)?;
    for a in arrivals.iter_mut() {
        a.blocks = block_hashes(&a.prompt, block);
    }
    let mut report = ReplayReport {
        router: Some(o.router),
        workers: o.workers,
        prefill_workers: o.prefill_workers,
        requests: arrivals.len(),
        per_worker: vec![0; total],
        ..ReplayReport::default()
    };
    let mut live: HashMap<String, Live> = HashMap::new();
    let mut done: Vec<Live> = Vec::new();
    let mut handoffs: Vec<Handoff> = Vec::new();
    let mut next = 0usize;
    let mut rr = 0usize;
    let mut now = 0.0f64;
    let wait_report = || -> anyhow::Result<f64> {
        report_rx
            .recv_timeout(STEP_REPORT_TIMEOUT)
            .map_err(|_| anyhow::anyhow!("a simulated engine has work but did not step"))
    };
    // Workers that take new prompts.
    let front = if disagg { o.prefill_workers } else { o.workers };

    loop {
        let step = ws
            .iter()
            .enumerate()
            .filter_map(|(i, w)| w.step_end.map(|t| (t, i)))
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let arrival = arrivals.get(next).map(|a| a.at_ms);
        let handoff = handoffs.first().map(|h| h.at);
        let earliest_in = [arrival, handoff].into_iter().flatten().reduce(f64::min);
        match (step, earliest_in) {
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
                for l in collect(&mut live, &mut ws, i, now, &mut report) {
                    if l.phase != Phase::Prefill {
                        done.push(l);
                        continue;
                    }
                    // Prefill done: the uncached prompt's KV moves to a decode worker.
                    let a = &arrivals[l.idx];
                    let first = l.first.unwrap_or(now);
                    let remaining = a.max_tokens.saturating_sub(1);
                    if remaining == 0 {
                        done.push(l);
                        continue;
                    }
                    let bytes = (a.prompt.len() - l.cached.min(a.prompt.len())) as f64
                        * o.kv_bytes_per_token as f64;
                    let at = now + bytes / (o.transfer_gb_s * 1e9) * 1000.0;
                    let mut prompt = a.prompt.clone();
                    prompt.push(l.first_token.unwrap_or(0));
                    let h = Handoff {
                        at,
                        idx: l.idx,
                        arrival: l.arrival,
                        first,
                        prompt,
                        max_tokens: remaining,
                    };
                    let pos = handoffs
                        .iter()
                        .position(|x| (x.at, x.idx) > (h.at, h.idx))
                        .unwrap_or(handoffs.len());
                    handoffs.insert(pos, h);
                }
            }
            (_, Some(_)) if handoff.is_some_and(|h| arrival.is_none_or(|a| h < a)) => {
                let h = handoffs.remove(0);
                now = h.at;
                // Decode worker: fewest blocks held by in-flight requests, lower index on ties.
                let i = (o.prefill_workers..total)
                    .min_by_key(|&i| (ws[i].inflight_blocks, i))
                    .unwrap_or(o.prefill_workers);
                report.per_worker[i] += 1;
                let nblocks = (h.prompt.len() + h.max_tokens).div_ceil(block);
                ws[i].inflight_blocks += nblocks;
                let req = request(h.idx, "d", h.prompt, h.max_tokens);
                let stream = submit(&rt, &mut ws[i], req, now, &wait_report)?;
                live.insert(
                    format!("r{}d", h.idx),
                    Live {
                        stream,
                        worker: i,
                        phase: Phase::Decode,
                        idx: h.idx,
                        arrival: h.arrival,
                        first: Some(h.first),
                        last: h.first,
                        tokens: 1,
                        blocks: nblocks,
                        cached: 0,
                        first_token: None,
                    },
                );
            }
            (Some(_), None) => unreachable!("handled by the step arm"),
            (_, Some(_)) => {
                let Some(at) = arrival else { continue };
                now = at;
                let idx = next;
                next += 1;
                let a = &arrivals[idx];
                let i = match o.router {
                    ReplayRouter::RoundRobin => {
                        rr = (rr + 1) % front;
                        (rr + front - 1) % front
                    }
                    ReplayRouter::Kv => pick_kv(&ws[..front], &a.blocks),
                };
                report.per_worker[i] += 1;
                let max_tokens = if disagg { 1 } else { a.max_tokens };
                let nblocks = (a.prompt.len() + max_tokens).div_ceil(block);
                let w = &mut ws[i];
                w.seen.extend(a.blocks.iter().copied());
                w.inflight_blocks += nblocks;
                let req = request(idx, "", a.prompt.clone(), max_tokens);
                let stream = submit(&rt, w, req, now, &wait_report)?;
                live.insert(
                    format!("r{idx}"),
                    Live {
                        stream,
                        worker: i,
                        phase: if disagg { Phase::Prefill } else { Phase::Agg },
                        idx,
                        arrival: now,
                        first: None,
                        last: now,
                        tokens: 0,
                        blocks: nblocks,
                        cached: 0,
                        first_token: None,
                    },
                );
            }
        }
    }
    report.makespan_ms = now;
    report.completed = done.len();
    report.output_tokens = done.iter().map(|l| l.tokens).sum();
    let ttft = |l: &Live| l.first.map(|f| f - l.arrival);
    let itl = |l: &Live| match l.first {
        Some(f) if l.tokens > 1 => Some((l.last - f) / (l.tokens - 1) as f64),
        _ => None,
    };
    report.ttft_ms = dist(done.iter().filter_map(ttft).collect());
    report.e2e_ms = dist(done.iter().map(|l| l.last - l.arrival).collect());
    report.itl_ms = dist(done.iter().filter_map(itl).collect());
    if o.sla_ttft_ms.is_some() || o.sla_itl_ms.is_some() {
        let (st, si) = (
            o.sla_ttft_ms.unwrap_or(f64::INFINITY),
            o.sla_itl_ms.unwrap_or(f64::INFINITY),
        );
        report.sla_met = done
            .iter()
            .filter(|l| ttft(l).is_some_and(|t| t <= st) && itl(l).is_none_or(|t| t <= si))
            .count();
        report.goodput_rps = report.sla_met as f64 / (report.makespan_ms / 1000.0).max(1e-9);
    }
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

/// Takes the outputs that worker `i`'s last step emitted, stamped with the step's end;
/// returns the requests that finished on it.
fn collect(
    live: &mut HashMap<String, Live>,
    ws: &mut [Worker],
    i: usize,
    now: f64,
    report: &mut ReplayReport,
) -> Vec<Live> {
    // Sorted ids keep the order of work independent of the map's iteration order.
    let mut ids: Vec<String> = live
        .iter()
        .filter(|(_, l)| l.worker == i && l.stream.is_some())
        .map(|(k, _)| k.clone())
        .collect();
    ids.sort();
    let mut finished_all = Vec::new();
    for id in ids {
        let Some(l) = live.get_mut(&id) else { continue };
        let mut finished = false;
        if let Some(stream) = l.stream.as_mut() {
            // Outputs of a step are in the channel before the engine answers `stats`.
            while let Some(o) = poll_now(stream) {
                if let Some(&t) = o.token_ids.first() {
                    l.first.get_or_insert(now);
                    l.first_token.get_or_insert(t);
                    l.last = now;
                    l.tokens += o.token_ids.len();
                }
                if let Some(u) = o.usage {
                    report.cached_tokens += u.cached_tokens;
                    l.cached = u.cached_tokens;
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
                finished_all.push(l);
            }
        }
    }
    finished_all
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
