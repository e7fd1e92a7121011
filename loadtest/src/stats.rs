//! Per-request records and their summary: TTFT, ITL, E2E percentiles, throughput, goodput.

use serde::Serialize;

/// What one request did, in seconds from the run's start.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Record {
    pub start: f64,
    /// Arrival time of every chunk that carried output, in order.
    #[serde(skip)]
    pub chunk_times: Vec<f64>,
    pub end: f64,
    pub input_tokens: usize,
    pub output_tokens: usize,
    /// The server's prompt tokens and how many of them it found cached (its usage block).
    #[serde(skip)]
    pub server_prompt: Option<(usize, usize)>,
    /// Error class when the request failed (see `client::ErrorClass`).
    pub error: Option<String>,
    /// The start of the server's error message, when it sent one.
    pub detail: Option<String>,
    /// The output with its logprobs (`--save-outputs`).
    #[serde(skip)]
    pub output: Option<Output>,
}

/// A request's output tokens, as `--save-outputs` records them.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Output {
    /// The seed sent with the request (a hash of its prompt): names the request across runs.
    pub seed: u64,
    pub tokens: Vec<String>,
    /// Each token's top-1 minus top-2 logprob (0 when the server sent fewer than two).
    pub margins: Vec<f64>,
}

impl Record {
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }

    pub fn ttft(&self) -> Option<f64> {
        self.chunk_times.first().map(|t| t - self.start)
    }

    pub fn e2e(&self) -> f64 {
        self.end - self.start
    }

    /// Mean inter-token latency: time from the first to the last token over the tokens after
    /// the first. `None` with fewer than two tokens.
    pub fn itl(&self) -> Option<f64> {
        let (first, last) = (self.chunk_times.first()?, self.chunk_times.last()?);
        if self.output_tokens < 2 {
            return None;
        }
        Some((last - first) / (self.output_tokens - 1) as f64)
    }

    /// The gaps between consecutive output chunks (a chunk may carry several tokens): the
    /// stalls a reader of the stream sees, which a request's mean ITL averages away.
    pub fn gaps(&self) -> impl Iterator<Item = f64> + '_ {
        self.chunk_times.windows(2).map(|w| w[1] - w[0])
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Dist {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub min: f64,
    pub max: f64,
}

/// Percentile by linear interpolation between closest ranks, over sorted values.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

impl Dist {
    pub fn of(mut v: Vec<f64>) -> Dist {
        if v.is_empty() {
            return Dist::default();
        }
        v.sort_by(f64::total_cmp);
        Dist {
            count: v.len(),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: percentile(&v, 50.0),
            p90: percentile(&v, 90.0),
            p99: percentile(&v, 99.0),
            min: v[0],
            max: v[v.len() - 1],
        }
    }

    /// The same distribution in milliseconds.
    pub fn ms(&self) -> Dist {
        let f = |x: f64| x * 1000.0;
        Dist {
            count: self.count,
            mean: f(self.mean),
            p50: f(self.p50),
            p90: f(self.p90),
            p99: f(self.p99),
            min: f(self.min),
            max: f(self.max),
        }
    }
}

/// A service-level objective; a request meets it when both bounds hold.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Sla {
    pub ttft_ms: f64,
    pub itl_ms: f64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Summary {
    pub requests: usize,
    pub succeeded: usize,
    pub failed: usize,
    pub errors: std::collections::BTreeMap<String, usize>,
    pub duration_s: f64,
    pub ttft_ms: Dist,
    pub itl_ms: Dist,
    /// Every gap between output chunks of every successful request ([`Record::gaps`]).
    pub gap_ms: Dist,
    pub e2e_ms: Dist,
    pub request_throughput: f64,
    pub output_token_throughput: f64,
    pub input_token_throughput: f64,
    /// Cached prompt tokens over prompt tokens, as the server's usage reported them
    /// (`prompt_tokens_details.cached_tokens`); `None` when no request reported them.
    pub prompt_cache_hit_rate: Option<f64>,
    /// Successful requests per second that met the SLA (0 without an SLA).
    pub goodput: f64,
    pub sla_met: usize,
    /// The SLA goodput was measured against; `None`: no goodput was measured.
    pub sla: Option<Sla>,
    /// Which limit ended the run (its request count or its duration).
    pub ended_by: String,
    /// Up to five distinct server error messages.
    pub error_samples: Vec<String>,
}

/// Summarises records of a run that lasted `duration_s`.
pub fn summarize(records: &[Record], duration_s: f64, sla: Option<Sla>) -> Summary {
    let ok: Vec<&Record> = records.iter().filter(|r| r.ok()).collect();
    let mut errors = std::collections::BTreeMap::new();
    for r in records {
        if let Some(e) = &r.error {
            *errors.entry(e.clone()).or_insert(0) += 1;
        }
    }
    let dur = duration_s.max(1e-9);
    let met = |r: &&&Record| match sla {
        None => false,
        Some(s) => {
            r.ttft().is_some_and(|t| t * 1000.0 <= s.ttft_ms)
                && r.itl().is_none_or(|t| t * 1000.0 <= s.itl_ms)
        }
    };
    let sla_met = ok.iter().filter(met).count();
    let mut error_samples: Vec<String> = Vec::new();
    for d in records.iter().filter_map(|r| r.detail.as_ref()) {
        if error_samples.len() < 5 && !error_samples.contains(d) {
            error_samples.push(d.clone());
        }
    }
    Summary {
        requests: records.len(),
        succeeded: ok.len(),
        failed: records.len() - ok.len(),
        errors,
        duration_s,
        ttft_ms: Dist::of(ok.iter().filter_map(|r| r.ttft()).collect()).ms(),
        itl_ms: Dist::of(ok.iter().filter_map(|r| r.itl()).collect()).ms(),
        gap_ms: Dist::of(ok.iter().flat_map(|r| r.gaps()).collect()).ms(),
        e2e_ms: Dist::of(ok.iter().map(|r| r.e2e()).collect()).ms(),
        request_throughput: ok.len() as f64 / dur,
        output_token_throughput: ok.iter().map(|r| r.output_tokens).sum::<usize>() as f64 / dur,
        input_token_throughput: ok.iter().map(|r| r.input_tokens).sum::<usize>() as f64 / dur,
        prompt_cache_hit_rate: hit_rate(&ok),
        goodput: sla_met as f64 / dur,
        sla_met,
        sla,
        ended_by: String::new(),
        error_samples,
    }
}

/// Cached over prompt tokens of the requests whose usage reported both.
fn hit_rate(ok: &[&Record]) -> Option<f64> {
    let (prompt, cached) = ok
        .iter()
        .filter_map(|r| r.server_prompt)
        .fold((0, 0), |(p, c), (rp, rc)| (p + rp, c + rc));
    (prompt > 0).then(|| cached as f64 / prompt as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request that starts at `start`, gets its first token after `ttft` and then one
    /// token every `itl` seconds, `n` tokens in all.
    fn stream(start: f64, ttft: f64, itl: f64, n: usize) -> Record {
        let chunk_times: Vec<f64> = (0..n).map(|i| start + ttft + itl * i as f64).collect();
        Record {
            start,
            end: *chunk_times.last().unwrap() + 0.001,
            chunk_times,
            input_tokens: 100,
            output_tokens: n,
            server_prompt: None,
            error: None,
            detail: None,
            output: None,
        }
    }

    #[test]
    fn the_hit_rate_counts_the_requests_that_reported_their_prompt() {
        let with = |prompt| Record {
            server_prompt: prompt,
            ..stream(0.0, 0.1, 0.01, 3)
        };
        let recs = [with(Some((100, 80))), with(Some((300, 0))), with(None)];
        let s = summarize(&recs, 1.0, None);
        assert_eq!(s.prompt_cache_hit_rate, Some(0.2));
        assert_eq!(summarize(&recs[2..], 1.0, None).prompt_cache_hit_rate, None);
    }

    #[test]
    fn percentiles_interpolate() {
        let v: Vec<f64> = (1..=101).map(|x| x as f64).collect();
        assert_eq!(percentile(&v, 50.0), 51.0);
        assert_eq!(percentile(&v, 99.0), 100.0);
        assert_eq!(percentile(&[1.0, 2.0], 50.0), 1.5);
        assert_eq!(percentile(&[], 50.0), 0.0);
        let d = Dist::of(vec![3.0, 1.0, 2.0]);
        assert_eq!((d.min, d.p50, d.max, d.mean), (1.0, 2.0, 3.0, 2.0));
    }

    #[test]
    fn known_streams_give_known_latencies() {
        let recs = vec![
            stream(0.0, 0.100, 0.010, 11),
            stream(1.0, 0.300, 0.020, 11),
            Record {
                start: 2.0,
                end: 2.5,
                error: Some("http_5xx".into()),
                ..Record::default()
            },
        ];
        assert!((recs[0].itl().unwrap() - 0.010).abs() < 1e-12);
        let s = summarize(
            &recs,
            10.0,
            Some(Sla {
                ttft_ms: 200.0,
                itl_ms: 15.0,
            }),
        );
        assert_eq!((s.requests, s.succeeded, s.failed), (3, 2, 1));
        assert_eq!(s.errors.get("http_5xx"), Some(&1));
        assert!((s.ttft_ms.p50 - 200.0).abs() < 1e-9);
        assert!((s.ttft_ms.min - 100.0).abs() < 1e-9);
        assert!((s.itl_ms.mean - 15.0).abs() < 1e-9);
        // 10 gaps of each stream: 10 ms and 20 ms.
        assert_eq!(s.gap_ms.count, 20);
        assert!((s.gap_ms.min - 10.0).abs() < 1e-9 && (s.gap_ms.max - 20.0).abs() < 1e-9);
        assert!((s.e2e_ms.max - (300.0 + 200.0 + 1.0)).abs() < 1e-9);
        assert!((s.request_throughput - 0.2).abs() < 1e-12);
        assert!((s.output_token_throughput - 2.2).abs() < 1e-12);
        // Only the first meets TTFT ≤ 200 ms and ITL ≤ 15 ms.
        assert_eq!(s.sla_met, 1);
        assert!((s.goodput - 0.1).abs() < 1e-12);
    }

    #[test]
    fn single_token_has_no_itl_and_empty_run_is_zero() {
        let r = stream(0.0, 0.05, 0.0, 1);
        assert_eq!(r.itl(), None);
        assert!((r.ttft().unwrap() - 0.05).abs() < 1e-12);
        let s = summarize(&[], 1.0, None);
        assert_eq!(s.ttft_ms, Dist::default());
        assert_eq!(s.goodput, 0.0);
    }
}
