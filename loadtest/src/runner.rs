//! Schedules jobs: closed loop (a fixed number of in-flight sessions), open loop (Poisson
//! arrivals at a fixed rate or a linear ramp), or the trace's own timestamps. Bounded by the
//! job list (request count) and an optional duration.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

use crate::client::Client;
use crate::rng::Rng;
use crate::stats::Record;
use crate::workload::Job;

#[derive(Clone, Copy, Debug)]
pub enum Arrivals {
    /// `n` sessions in flight at all times.
    Closed(usize),
    /// Poisson arrivals whose rate goes linearly from `from` to `to` req/s over `over` s
    /// (constant when equal).
    Poisson { from: f64, to: f64, over: f64 },
    /// Arrival times from the trace.
    Trace,
}

/// Start times (s) of `n` jobs for a Poisson process whose rate ramps linearly. Each gap is
/// drawn at the current rate (piecewise-constant approximation, fine for ramps much slower
/// than one arrival).
pub fn poisson_times(n: usize, from: f64, to: f64, over: f64, rng: &mut Rng) -> Vec<f64> {
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            let frac = if over > 0.0 { (t / over).min(1.0) } else { 1.0 };
            let rate = (from + (to - from) * frac).max(1e-9);
            t += rng.exp(rate);
            t
        })
        .collect()
}

fn bar(total: usize, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(total as u64);
    if let Ok(style) =
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} requests, {msg}")
    {
        pb.set_style(style);
    }
    pb
}

/// More jobs for a closed-loop run bound by its duration only: called whenever the jobs run
/// out before the deadline.
pub type JobFeed = Box<dyn FnMut() -> Vec<Job> + Send>;

/// How a run went: every request's record (requests not sent by the deadline are left out),
/// the wall duration, and whether the deadline (rather than the job list) ended it.
pub struct RunEnd {
    pub records: Vec<Record>,
    pub secs: f64,
    pub by_deadline: bool,
}

/// Runs `jobs` (and, closed loop, the `feed`'s until the deadline).
pub async fn run(
    client: Client,
    jobs: Vec<Job>,
    feed: Option<JobFeed>,
    arrivals: Arrivals,
    duration: Option<Duration>,
    seed: u64,
    quiet: bool,
) -> RunEnd {
    let total: usize = jobs.iter().map(|j| j.turns.len()).sum();
    let pb = bar(total, quiet);
    let records = Arc::new(Mutex::new(Vec::with_capacity(total)));
    let errors = Arc::new(AtomicUsize::new(0));
    let deadline = duration.map(|d| client.t0 + d);
    let past_deadline = move || deadline.is_some_and(|d| std::time::Instant::now() >= d);

    // One session: its turns in order, each after the previous one's answer.
    let session = {
        let (client, records, pb, errors) =
            (client.clone(), records.clone(), pb.clone(), errors.clone());
        move |job: Job| {
            let (client, records, pb, errors) =
                (client.clone(), records.clone(), pb.clone(), errors.clone());
            async move {
                for spec in &job.turns {
                    if past_deadline() {
                        break;
                    }
                    let rec = client.send(spec).await;
                    if !rec.ok() {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                    pb.inc(1);
                    pb.set_message(format!("{} errors", errors.load(Ordering::Relaxed)));
                    if let Ok(mut r) = records.lock() {
                        r.push(rec);
                    }
                }
            }
        }
    };

    match arrivals {
        Arrivals::Closed(n) => {
            let queue = Arc::new(Mutex::new((jobs.into_iter(), feed)));
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..n.max(1) {
                let (queue, session) = (queue.clone(), session.clone());
                tasks.spawn(async move {
                    loop {
                        let next = queue.lock().ok().and_then(|mut q| {
                            let (jobs, feed) = &mut *q;
                            jobs.next().or_else(|| {
                                *jobs = feed.as_mut().map(|f| f()).unwrap_or_default().into_iter();
                                jobs.next()
                            })
                        });
                        match next {
                            Some(job) if !past_deadline() => session(job).await,
                            _ => break,
                        }
                    }
                });
            }
            while tasks.join_next().await.is_some() {}
        }
        Arrivals::Poisson { .. } | Arrivals::Trace => {
            let times: Vec<f64> = match arrivals {
                Arrivals::Poisson { from, to, over } => {
                    poisson_times(jobs.len(), from, to, over, &mut Rng::new(seed ^ 0xA77))
                }
                _ => jobs.iter().map(|j| j.at.unwrap_or(0.0)).collect(),
            };
            let mut tasks = tokio::task::JoinSet::new();
            for (job, at) in jobs.into_iter().zip(times) {
                let when = client.t0 + Duration::from_secs_f64(at.max(0.0));
                if deadline.is_some_and(|d| when >= d) {
                    break;
                }
                tokio::time::sleep_until(when.into()).await;
                tasks.spawn(session(job));
            }
            while tasks.join_next().await.is_some() {}
        }
    }
    pb.finish_and_clear();
    let secs = client.t0.elapsed().as_secs_f64();
    RunEnd {
        records: records.lock().map(|r| r.clone()).unwrap_or_default(),
        secs,
        by_deadline: past_deadline(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_rate_is_close_and_ramp_speeds_up() {
        let t = poisson_times(20_000, 100.0, 100.0, 0.0, &mut Rng::new(1));
        let rate = t.len() as f64 / t[t.len() - 1];
        assert!((rate - 100.0).abs() < 3.0, "rate {rate}");
        let r = poisson_times(2_000, 10.0, 1000.0, 10.0, &mut Rng::new(2));
        let first_half = r.iter().filter(|&&x| x < r[r.len() - 1] / 2.0).count();
        assert!(first_half < 1_000);
        assert_eq!(
            r,
            poisson_times(2_000, 10.0, 1000.0, 10.0, &mut Rng::new(2))
        );
    }
}
