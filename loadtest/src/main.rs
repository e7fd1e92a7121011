//! `tandem-loadtest` command line.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Parser, ValueEnum};
use serde::Serialize;
use tandem_loadtest::client::{Client, Images, PromptMode, Sampling};
use tandem_loadtest::rng::Rng;
use tandem_loadtest::runner::{self, Arrivals};
use tandem_loadtest::stats::{summarize, Sla, Summary};
use tandem_loadtest::workload::{self, Job, LenDist, Vocab};
use tandem_loadtest::{plot, report};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
enum Kind {
    Synthetic,
    SharedPrefix,
    MultiTurn,
    Trace,
}

#[derive(Parser, Debug, Clone, Serialize)]
#[command(
    name = "tandem-loadtest",
    about = "Load generator for OpenAI-compatible endpoints"
)]
struct Args {
    /// Base URL of the server (`/v1/completions` is appended).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// API key sent as `Authorization: Bearer KEY` (default: $OPENAI_API_KEY when set).
    #[arg(long)]
    api_key: Option<String>,
    /// Model name; default: the first of `/v1/models`.
    #[arg(long)]
    model: Option<String>,
    #[arg(long, value_enum, default_value_t = PromptMode::Tokens)]
    #[serde(skip)]
    prompt_mode: PromptMode,
    /// Send chat completions with one image each, from the PNG, JPEG and WebP files of this
    /// folder (in turn, in name order), the prompt as text after it (a multimodal model's
    /// `/v1/chat/completions`; ISL then counts the text only).
    #[arg(long)]
    images: Option<std::path::PathBuf>,
    #[arg(long, value_enum, default_value_t = Kind::Synthetic)]
    workload: Kind,
    /// Requests to send (sessions for multi-turn: requests = sessions × turns). Default: 100,
    /// or with --duration and --rate as many as the rate can send in that time.
    #[arg(long)]
    num_requests: Option<usize>,
    /// Stop sending after this many seconds.
    #[arg(long)]
    duration: Option<f64>,
    /// Closed loop: requests in flight (ignored with --rate or a trace).
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Open loop: Poisson arrivals at this rate (req/s).
    #[arg(long)]
    rate: Option<f64>,
    /// Ramp the Poisson rate linearly from --rate to this over --ramp-secs.
    #[arg(long)]
    rate_to: Option<f64>,
    #[arg(long, default_value_t = 0.0)]
    ramp_secs: f64,
    /// Input length: N, uniform:LO:HI or normal:MEAN:STD.
    #[arg(long, default_value = "128")]
    isl: String,
    /// Output length (same syntax).
    #[arg(long, default_value = "32")]
    osl: String,
    #[arg(long, default_value_t = 16)]
    groups: usize,
    #[arg(long, default_value_t = 512)]
    prefix_len: usize,
    /// Fraction of each prompt that is the group's prefix.
    #[arg(long, default_value_t = 0.8)]
    prefix_ratio: f64,
    #[arg(long, default_value_t = 3)]
    turns: usize,
    /// Mooncake trace (JSONL with timestamp, input_length, output_length, hash_ids).
    #[arg(long)]
    trace: Option<PathBuf>,
    #[arg(long, default_value_t = 512)]
    trace_block_size: usize,
    /// Divides trace timestamps.
    #[arg(long, default_value_t = 1.0)]
    trace_speedup: f64,
    /// Token ids are drawn from [--vocab-lo, --vocab-hi).
    #[arg(long, default_value_t = 100)]
    vocab_lo: u32,
    #[arg(long, default_value_t = 30000)]
    vocab_hi: u32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Goodput SLA: TTFT bound (ms).
    #[arg(long)]
    sla_ttft_ms: Option<f64>,
    /// Goodput SLA: ITL bound (ms).
    #[arg(long)]
    sla_itl_ms: Option<f64>,
    /// Per-request timeout (s).
    #[arg(long, default_value_t = 600.0)]
    timeout: f64,
    /// Sampling temperature sent with every request (default: the server's).
    #[arg(long)]
    temperature: Option<f64>,
    /// Ask for the top-2 logprobs of every token and write each successful request's output
    /// tokens with their top-2 margins to <out>/outputs.jsonl (to compare runs).
    #[arg(long)]
    save_outputs: bool,
    /// Run once per value (closed-loop concurrency), plotting throughput against latency.
    #[arg(long, value_delimiter = ',')]
    sweep_concurrency: Vec<usize>,
    /// Run once per value (Poisson rate).
    #[arg(long, value_delimiter = ',')]
    sweep_rate: Vec<f64>,
    /// Folder for report.json, requests.csv and the plots.
    #[arg(long, default_value = "loadtest-out")]
    out: PathBuf,
    /// Seconds to wait for `/v1/models` to list a model (without --model).
    #[arg(long, default_value_t = 30.0)]
    wait_for_model: f64,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

/// Jobs a closed-loop run bound by its duration only prepares at a time.
const FEED_BATCH: usize = 1_000;

/// How many requests a run prepares: `--num-requests`, else enough for an open-loop run to
/// last its `--duration` (a quarter more than the highest rate sends, so Poisson's spread does
/// not end it early), else a first batch for a duration-bound closed loop (fed more as it
/// goes, see [`job_feed`]), else 100.
fn request_count(a: &Args, arrivals: Arrivals) -> usize {
    const DEFAULT: usize = 100;
    match (a.num_requests, a.duration, arrivals) {
        (Some(n), _, _) => n,
        (None, Some(d), Arrivals::Poisson { from, to, .. }) => {
            (from.max(to) * d * 1.25).ceil() as usize + 16
        }
        (None, Some(_), Arrivals::Trace) => usize::MAX,
        (None, Some(_), Arrivals::Closed(_)) => FEED_BATCH,
        _ => DEFAULT,
    }
}

/// More of the same workload (the generator's stream goes on) for a closed-loop run that only
/// its `--duration` bounds; `None` for every other run.
fn job_feed(a: &Args, arrivals: Arrivals, mut rng: Rng) -> Option<runner::JobFeed> {
    let fed = a.num_requests.is_none()
        && a.duration.is_some()
        && matches!(arrivals, Arrivals::Closed(_))
        && a.workload != Kind::Trace;
    let a = a.clone();
    fed.then(|| -> runner::JobFeed {
        Box::new(move || build_jobs(&a, FEED_BATCH, &mut rng).unwrap_or_default())
    })
}

fn build_jobs(a: &Args, n: usize, rng: &mut Rng) -> anyhow::Result<Vec<Job>> {
    anyhow::ensure!(
        a.vocab_hi > a.vocab_lo,
        "--vocab-hi must be above --vocab-lo"
    );
    let v = Vocab {
        lo: a.vocab_lo,
        hi: a.vocab_hi,
    };
    let isl: LenDist = a.isl.parse().context("--isl")?;
    let osl: LenDist = a.osl.parse().context("--osl")?;
    Ok(match a.workload {
        Kind::Synthetic => workload::synthetic(n, isl, osl, v, rng),
        Kind::SharedPrefix => {
            workload::shared_prefix(n, a.groups, a.prefix_len, a.prefix_ratio, osl, v, rng)?
        }
        Kind::MultiTurn => {
            let sessions = n.div_ceil(a.turns.max(1));
            workload::multi_turn(sessions, a.turns, isl, osl, v, rng)
        }
        Kind::Trace => {
            let path = a
                .trace
                .as_ref()
                .context("--workload trace needs --trace FILE")?;
            let mut jobs =
                workload::mooncake(path, a.trace_block_size, a.trace_speedup, v, a.seed)?;
            jobs.truncate(n);
            jobs
        }
    })
}

/// Which limit ended a run that sent `sent` requests of the `prepared` ones (the first batch
/// of a fed run); `by_deadline`: its `--duration` ran out first.
fn ended_by(a: &Args, by_deadline: bool, sent: usize, prepared: usize) -> String {
    match (by_deadline, a.duration) {
        (true, Some(d)) => format!("--duration {d} s ({sent} requests sent)"),
        (false, Some(d)) => format!(
            "all {prepared} requests sent before --duration {d} s ran out (raise \
             --num-requests, or leave it out, to fill it)"
        ),
        (_, None) => format!("all {prepared} requests sent (--num-requests)"),
    }
}

/// `Authorization: Bearer KEY` from `--api-key`, else `$OPENAI_API_KEY`; none without either.
fn auth_headers(flag: Option<String>) -> anyhow::Result<reqwest::header::HeaderMap> {
    let mut headers = reqwest::header::HeaderMap::new();
    let key = flag.or_else(|| {
        std::env::var("OPENAI_API_KEY")
            .ok()
            .filter(|k| !k.is_empty())
    });
    if let Some(key) = key {
        let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {key}"))
            .map_err(|_| anyhow::anyhow!("--api-key holds characters a header cannot carry"))?;
        value.set_sensitive(true);
        headers.insert(reqwest::header::AUTHORIZATION, value);
    }
    Ok(headers)
}

async fn first_model_once(http: &reqwest::Client, base: &str) -> anyhow::Result<String> {
    let v: serde_json::Value = http
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .with_context(|| format!("cannot reach {base}/v1/models"))?
        .json()
        .await
        .context("/v1/models did not answer JSON")?;
    v.pointer("/data/0/id")
        .and_then(|x| x.as_str())
        .map(str::to_string)
        .context("/v1/models lists no model; pass --model")
}

/// The first served model, polling up to `wait` for one: a router may be up before its
/// workers' model cards are in.
async fn first_model(http: &reqwest::Client, base: &str, wait: f64) -> anyhow::Result<String> {
    let deadline = Instant::now() + Duration::from_secs_f64(wait);
    loop {
        match first_model_once(http, base).await {
            Ok(m) => return Ok(m),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// The `data:` URLs of the PNG, JPEG and WebP files of `dir`, in name order.
fn load_images(dir: &std::path::Path) -> anyhow::Result<Vec<String>> {
    use base64::Engine as _;
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("--images {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    files.sort();
    let mut urls = Vec::new();
    for f in files {
        let ext = f.extension().and_then(|e| e.to_str()).unwrap_or("");
        let media = match ext.to_ascii_lowercase().as_str() {
            "png" => "image/png",
            "jpg" | "jpeg" => "image/jpeg",
            "webp" => "image/webp",
            _ => continue,
        };
        let bytes = std::fs::read(&f).with_context(|| format!("reading {}", f.display()))?;
        let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
        urls.push(format!("data:{media};base64,{b64}"));
    }
    anyhow::ensure!(
        !urls.is_empty(),
        "--images {}: no PNG, JPEG or WebP file in it",
        dir.display()
    );
    Ok(urls)
}

async fn one_run(
    a: &Args,
    http: &reqwest::Client,
    model: &str,
    arrivals: Arrivals,
    out: &std::path::Path,
) -> anyhow::Result<Summary> {
    let mut rng = Rng::new(a.seed);
    let jobs = build_jobs(a, request_count(a, arrivals), &mut rng)?;
    let prepared = jobs.iter().map(|j| j.turns.len()).sum::<usize>();
    let feed = job_feed(a, arrivals, rng);
    let fed = feed.is_some();
    let images = match &a.images {
        Some(dir) => Some(std::sync::Arc::new(Images::new(load_images(dir)?))),
        None => None,
    };
    let endpoint = if images.is_some() {
        "chat/completions"
    } else {
        "completions"
    };
    let client = Client {
        http: http.clone(),
        url: format!("{}/v1/{endpoint}", a.url.trim_end_matches('/')),
        model: model.to_string(),
        mode: a.prompt_mode,
        images,
        sampling: Sampling {
            temperature: a.temperature,
            logprobs: a.save_outputs,
        },
        t0: Instant::now(),
    };
    let duration = a.duration.map(Duration::from_secs_f64);
    let end = runner::run(client, jobs, feed, arrivals, duration, a.seed, a.quiet).await;
    let (records, secs) = (end.records, end.secs);
    let sla = match (a.sla_ttft_ms, a.sla_itl_ms) {
        (None, None) => None,
        (t, i) => Some(Sla {
            ttft_ms: t.unwrap_or(f64::INFINITY),
            itl_ms: i.unwrap_or(f64::INFINITY),
        }),
    };
    let mut summary = summarize(&records, secs, sla);
    summary.ended_by = ended_by(a, end.by_deadline || fed, records.len(), prepared);
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    report::write_json(&out.join("report.json"), a, &summary)?;
    report::write_csv(&out.join("requests.csv"), &records)?;
    if a.save_outputs {
        report::write_outputs(&out.join("outputs.jsonl"), &records)?;
    }
    plot::latency_cdf(&out.join("latency_cdf.svg"), &records)?;
    report::print_summary(&summary);
    Ok(summary)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    for (name, ok) in [
        ("--rate", a.rate.is_none_or(|r| r > 0.0 && r.is_finite())),
        (
            "--rate-to",
            a.rate_to.is_none_or(|r| r > 0.0 && r.is_finite()),
        ),
        ("--timeout", a.timeout > 0.0 && a.timeout.is_finite()),
        (
            "--temperature",
            a.temperature.is_none_or(|t| t >= 0.0 && t.is_finite()),
        ),
        (
            "--duration",
            a.duration.is_none_or(|d| d > 0.0 && d.is_finite()),
        ),
        (
            "--sweep-rate",
            a.sweep_rate.iter().all(|r| *r > 0.0 && r.is_finite()),
        ),
    ] {
        anyhow::ensure!(ok, "{name} must be a positive number");
    }
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs_f64(a.timeout))
        .tcp_nodelay(true)
        .default_headers(auth_headers(a.api_key.clone())?)
        .build()?;
    let base = a.url.trim_end_matches('/').to_string();
    let model = match &a.model {
        Some(m) => m.clone(),
        None => first_model(&http, &base, a.wait_for_model).await?,
    };
    let arrivals = |rate: Option<f64>, conc: usize| match (a.workload, rate) {
        (Kind::Trace, _) => Arrivals::Trace,
        (_, Some(r)) => Arrivals::Poisson {
            from: r,
            to: a.rate_to.unwrap_or(r),
            over: a.ramp_secs,
        },
        (_, None) => Arrivals::Closed(conc),
    };
    let mut sweep: Vec<(String, Summary)> = Vec::new();
    for &c in &a.sweep_concurrency {
        let s = one_run(
            &a,
            &http,
            &model,
            Arrivals::Closed(c),
            &a.out.join(format!("c{c}")),
        )
        .await?;
        sweep.push((format!("concurrency {c}"), s));
    }
    for &r in &a.sweep_rate {
        let s = one_run(
            &a,
            &http,
            &model,
            arrivals(Some(r), 0),
            &a.out.join(format!("r{r}")),
        )
        .await?;
        sweep.push((format!("rate {r}"), s));
    }
    if sweep.is_empty() {
        one_run(&a, &http, &model, arrivals(a.rate, a.concurrency), &a.out).await?;
    } else {
        std::fs::write(
            a.out.join("sweep.json"),
            serde_json::to_string_pretty(&sweep)?,
        )?;
        plot::sweep(&a.out.join("sweep.svg"), &sweep)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> Args {
        Args::parse_from(["tandem-loadtest"].iter().chain(extra))
    }

    #[test]
    fn a_duration_bound_open_loop_prepares_enough_requests_and_says_what_ended_it() {
        let poisson = |r: f64| Arrivals::Poisson {
            from: r,
            to: r,
            over: 0.0,
        };
        // 10 req/s for 60 s: 750 + 16 prepared, not the default 100.
        let a = args(&["--rate", "10", "--duration", "60"]);
        assert_eq!(request_count(&a, poisson(10.0)), 766);
        assert_eq!(
            ended_by(&a, true, 601, 766),
            "--duration 60 s (601 requests sent)"
        );
        // An explicit count wins, and a run that sent it all before the duration says so.
        let a = args(&["--rate", "10", "--duration", "60", "--num-requests", "50"]);
        assert_eq!(request_count(&a, poisson(10.0)), 50);
        assert!(
            ended_by(&a, false, 50, 50).starts_with("all 50 requests sent before --duration 60 s")
        );
        let a = args(&[]);
        assert_eq!(request_count(&a, Arrivals::Closed(1)), 100);
        assert!(job_feed(&a, Arrivals::Closed(1), Rng::new(1)).is_none());
        assert_eq!(
            ended_by(&a, false, 100, 100),
            "all 100 requests sent (--num-requests)"
        );
    }

    #[test]
    fn a_duration_bound_closed_loop_is_fed_the_same_workload() {
        let a = args(&["--duration", "5", "--concurrency", "2"]);
        assert_eq!(request_count(&a, Arrivals::Closed(2)), FEED_BATCH);
        let mut rng = Rng::new(a.seed);
        let first = build_jobs(&a, FEED_BATCH, &mut rng).unwrap();
        let mut feed = job_feed(&a, Arrivals::Closed(2), rng).expect("fed");
        let more = feed();
        assert_eq!(more.len(), FEED_BATCH);
        assert_ne!(
            more[0], first[0],
            "the stream goes on rather than repeating"
        );
    }
}
