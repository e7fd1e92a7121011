//! `tandem-planner profile`: measures a running worker through the router's OpenAI API and
//! writes the [`ProfileData`] the planner's time models interpolate (and `tandem-mocker
//! --planner-profile-data` simulates from).
//!
//! - Prefill: one request at a time of ISL tokens and one output token; the median wall time
//!   of `repeats` runs is the prefill time of that ISL.
//! - Decode: B concurrent requests of a C-token prompt, run twice, with D₁ and D₂ output
//!   tokens; the step time at (B, C) is the difference of the two wall times over D₂ − D₁
//!   (the prefill and the router's overhead cancel out).
//!
//! Prompts are random token ids, different in every request, so no prefix cache hit shortens
//! a prefill. The worker's KV capacity and batch limits come from its status page. Run it
//! against a router in front of one worker of the role to profile, with nothing else loading
//! it.

use std::time::{Duration, Instant};

use serde_json::json;
use tandem_runtime::metrics::names::component;

use crate::profile::{DecodeGrid, ProfileData};
use crate::prom::Page;

#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    #[error("{what}: {source}")]
    Http {
        what: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{what}: HTTP {status}: {body}")]
    Status {
        what: String,
        status: u16,
        body: String,
    },
    #[error("the worker's status page {url} has no {gauge} (is it a Tandem worker?)")]
    MissingGauge { url: String, gauge: &'static str },
    #[error("the worker's status page: {0}")]
    Parse(#[from] crate::prom::ParseError),
    #[error("the router lists no model")]
    NoModel,
    #[error("{0}")]
    Plan(String),
}

/// What to measure.
#[derive(Clone, Debug)]
pub struct SweepPlan {
    /// Router base URL (`/v1/completions` is appended).
    pub url: String,
    /// The profiled worker's `/metrics`.
    pub worker_metrics_url: String,
    pub model: Option<String>,
    pub api_key: Option<String>,
    pub isl: Vec<usize>,
    pub contexts: Vec<usize>,
    pub batches: Vec<usize>,
    /// D₂; D₁ is a quarter of it (at least 1).
    pub decode_tokens: usize,
    pub repeats: usize,
}

/// The worker's limits, from its status page.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WorkerLimits {
    pub kv_capacity_tokens: f64,
    pub context_length: f64,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
}

impl WorkerLimits {
    pub fn from_page(page: &Page, url: &str) -> Result<WorkerLimits, SweepError> {
        let get = |gauge: &'static str| {
            page.max(gauge).ok_or(SweepError::MissingGauge {
                url: url.to_string(),
                gauge,
            })
        };
        Ok(WorkerLimits {
            kv_capacity_tokens: get(component::KV_CAPACITY_TOKENS)?,
            context_length: get(component::CONTEXT_LENGTH)?,
            max_num_seqs: get(component::MAX_NUM_SEQS)? as usize,
            max_num_batched_tokens: get(component::MAX_NUM_BATCHED_TOKENS)? as usize,
        })
    }
}

impl SweepPlan {
    /// Every point fits the worker: prompts within its context, a batch's KV within its pool
    /// and its batch limit.
    pub fn check(&self, w: &WorkerLimits) -> Result<(), SweepError> {
        let bad = |m: String| Err(SweepError::Plan(m));
        if self.isl.is_empty() || self.contexts.is_empty() || self.batches.len() < 2 {
            return bad("give at least one ISL, one context and two batch sizes".into());
        }
        for (name, list) in [
            ("--isl", &self.isl),
            ("--contexts", &self.contexts),
            ("--batches", &self.batches),
        ] {
            let mut sorted = list.clone();
            sorted.sort_unstable();
            sorted.dedup();
            if sorted.len() != list.len() || sorted.first() == Some(&0) {
                return bad(format!("{name} repeats a value or has a 0: {list:?}"));
            }
        }
        if self.decode_tokens < 2 || self.repeats == 0 {
            return bad("--decode-tokens must be at least 2 and --repeats at least 1".into());
        }
        let longest = self
            .isl
            .iter()
            .chain(&self.contexts)
            .max()
            .copied()
            .unwrap_or(0);
        if (longest + self.decode_tokens) as f64 > w.context_length {
            return bad(format!(
                "a {longest}-token prompt plus {} output tokens is over the worker's context \
                 length {}",
                self.decode_tokens, w.context_length
            ));
        }
        let (b, c) = (
            self.batches.iter().max().copied().unwrap_or(0),
            self.contexts.iter().max().copied().unwrap_or(0),
        );
        if b > w.max_num_seqs || (b * (c + self.decode_tokens)) as f64 > w.kv_capacity_tokens {
            return bad(format!(
                "a batch of {b} at context {c} does not fit the worker ({} sequences, {} KV \
                 tokens)",
                w.max_num_seqs, w.kv_capacity_tokens
            ));
        }
        Ok(())
    }
}

/// Drives the measurements.
pub struct Sweeper {
    plan: SweepPlan,
    client: reqwest::Client,
    model: String,
    /// Distinct prompts: a counter folded into the token ids.
    serial: u64,
}

impl Sweeper {
    /// Reads the worker's limits, checks the plan against them and finds the model.
    pub async fn new(plan: SweepPlan) -> Result<(Sweeper, WorkerLimits), SweepError> {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(600))
            .build()
            .map_err(|source| SweepError::Http {
                what: "building the HTTP client".into(),
                source,
            })?;
        let text = get_text(&client, &plan.worker_metrics_url, None).await?;
        let limits = WorkerLimits::from_page(&Page::parse(&text)?, &plan.worker_metrics_url)?;
        plan.check(&limits)?;
        let model = match &plan.model {
            Some(m) => m.clone(),
            None => {
                let url = format!("{}/v1/models", plan.url);
                let list: serde_json::Value =
                    serde_json::from_str(&get_text(&client, &url, plan.api_key.as_deref()).await?)
                        .map_err(|_| SweepError::NoModel)?;
                list["data"][0]["id"]
                    .as_str()
                    .ok_or(SweepError::NoModel)?
                    .to_string()
            }
        };
        let sweeper = Sweeper {
            plan,
            client,
            model,
            serial: 0,
        };
        Ok((sweeper, limits))
    }

    /// Runs every measurement; `progress` hears each point as it lands.
    pub async fn run(
        &mut self,
        limits: &WorkerLimits,
        mut progress: impl FnMut(&str),
    ) -> Result<ProfileData, SweepError> {
        let mut prefill = Vec::new();
        for isl in self.plan.isl.clone() {
            let mut runs = Vec::new();
            for _ in 0..self.plan.repeats {
                runs.push(self.batch(1, isl, 1).await?);
            }
            let ms = median(&mut runs);
            progress(&format!("prefill {isl} tokens: {ms:.2} ms"));
            prefill.push((isl as f64, ms));
        }
        let d2 = self.plan.decode_tokens;
        let d1 = (d2 / 4).max(1);
        let mut grid = Vec::new();
        let mut usage = Vec::new();
        for c in self.plan.contexts.clone() {
            let mut row = Vec::new();
            for b in self.plan.batches.clone() {
                let (mut short, mut long) = (Vec::new(), Vec::new());
                for _ in 0..self.plan.repeats {
                    short.push(self.batch(b, c, d1).await?);
                    long.push(self.batch(b, c, d2).await?);
                }
                let step = ((median(&mut long) - median(&mut short)) / (d2 - d1) as f64).max(0.0);
                progress(&format!(
                    "decode batch {b} at context {c}: {step:.3} ms a step"
                ));
                let held = b as f64 * (c as f64 + (d1 + d2) as f64 / 2.0);
                usage.push(((held / limits.kv_capacity_tokens).min(1.0), step));
                row.push(step);
            }
            grid.push(row);
        }
        Ok(ProfileData {
            prefill,
            decode: merge_equal_x(usage),
            decode_grid: Some(DecodeGrid {
                contexts: self.plan.contexts.iter().map(|c| *c as f64).collect(),
                batches: self.plan.batches.iter().map(|b| *b as f64).collect(),
                ms: grid,
            }),
            kv_capacity_tokens: limits.kv_capacity_tokens,
            max_num_batched_tokens: limits.max_num_batched_tokens,
            max_num_seqs: limits.max_num_seqs,
        })
    }

    /// Wall time, in ms, of `batch` concurrent requests of `prompt` tokens and `out` output
    /// tokens each.
    async fn batch(&mut self, batch: usize, prompt: usize, out: usize) -> Result<f64, SweepError> {
        let url = format!("{}/v1/completions", self.plan.url);
        let bodies: Vec<serde_json::Value> = (0..batch)
            .map(|_| {
                self.serial += 1;
                json!({
                    "model": self.model,
                    "prompt": prompt_ids(self.serial, prompt),
                    "max_tokens": out,
                    "ignore_eos": true,
                })
            })
            .collect();
        let start = Instant::now();
        let url = url.as_str();
        let calls = bodies.iter().map(|body| {
            let mut req = self.client.post(url).json(body);
            if let Some(k) = &self.plan.api_key {
                req = req.bearer_auth(k);
            }
            async move {
                let what = || format!("POST {url}");
                let resp = req.send().await.map_err(|source| SweepError::Http {
                    what: what(),
                    source,
                })?;
                let status = resp.status().as_u16();
                if status != 200 {
                    let body = resp.text().await.unwrap_or_default();
                    return Err(SweepError::Status {
                        what: what(),
                        status,
                        body,
                    });
                }
                resp.bytes()
                    .await
                    .map(|_| ())
                    .map_err(|source| SweepError::Http {
                        what: what(),
                        source,
                    })
            }
        });
        for r in futures_util::future::join_all(calls).await {
            r?;
        }
        Ok(start.elapsed().as_secs_f64() * 1e3)
    }
}

async fn get_text(
    client: &reqwest::Client,
    url: &str,
    api_key: Option<&str>,
) -> Result<String, SweepError> {
    let mut req = client.get(url);
    if let Some(k) = api_key {
        req = req.bearer_auth(k);
    }
    let what = || format!("GET {url}");
    let resp = req.send().await.map_err(|source| SweepError::Http {
        what: what(),
        source,
    })?;
    let status = resp.status().as_u16();
    let body = resp.text().await.map_err(|source| SweepError::Http {
        what: what(),
        source,
    })?;
    if status != 200 {
        return Err(SweepError::Status {
            what: what(),
            status,
            body,
        });
    }
    Ok(body)
}

/// `n` token ids, distinct for every `serial` (ids 100..30000, clear of special tokens).
fn prompt_ids(serial: u64, n: usize) -> Vec<u32> {
    let mut x = serial.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            100 + (x % 29_900) as u32
        })
        .collect()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Points sorted by x, those with equal x averaged (a curve needs increasing x).
pub fn merge_equal_x(mut points: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut out: Vec<(f64, f64, usize)> = Vec::new();
    for (x, y) in points {
        match out.last_mut() {
            Some(last) if last.0 == x => {
                last.1 += y;
                last.2 += 1;
            }
            _ => out.push((x, y, 1)),
        }
    }
    out.into_iter().map(|(x, y, n)| (x, y / n as f64)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> WorkerLimits {
        WorkerLimits {
            kv_capacity_tokens: 4096.0,
            context_length: 2048.0,
            max_num_seqs: 16,
            max_num_batched_tokens: 512,
        }
    }

    fn plan() -> SweepPlan {
        SweepPlan {
            url: "http://x".into(),
            worker_metrics_url: "http://y/metrics".into(),
            model: None,
            api_key: None,
            isl: vec![64, 256],
            contexts: vec![64, 128],
            batches: vec![1, 8],
            decode_tokens: 16,
            repeats: 1,
        }
    }

    #[test]
    fn plans_that_do_not_fit_the_worker_are_refused() {
        assert!(plan().check(&limits()).is_ok());
        let mut p = plan();
        p.batches = vec![1, 32];
        assert!(p
            .check(&limits())
            .unwrap_err()
            .to_string()
            .contains("batch of 32"));
        let mut p = plan();
        p.isl = vec![2040];
        assert!(p
            .check(&limits())
            .unwrap_err()
            .to_string()
            .contains("context length"));
        let mut p = plan();
        p.batches = vec![4];
        assert!(p.check(&limits()).is_err(), "one batch size is no curve");
        let mut p = plan();
        p.batches = vec![8, 8];
        assert!(p
            .check(&limits())
            .unwrap_err()
            .to_string()
            .contains("repeats"));
    }

    #[test]
    fn prompts_differ_and_equal_points_merge() {
        assert_ne!(prompt_ids(1, 8), prompt_ids(2, 8));
        assert!(prompt_ids(3, 100).iter().all(|t| (100..30_000).contains(t)));
        assert_eq!(
            merge_equal_x(vec![(0.5, 2.0), (0.1, 1.0), (0.5, 4.0)]),
            vec![(0.1, 1.0), (0.5, 3.0)]
        );
    }

    #[test]
    fn limits_come_from_the_workers_gauges() {
        let page = Page::parse(
            "dynamo_component_kv_capacity_tokens{worker_id=\"1\"} 1024\n\
             dynamo_component_context_length{worker_id=\"1\"} 4096\n\
             dynamo_component_max_num_seqs{worker_id=\"1\"} 64\n\
             dynamo_component_max_num_batched_tokens{worker_id=\"1\"} 8192\n",
        )
        .unwrap();
        let l = WorkerLimits::from_page(&page, "u").unwrap();
        assert_eq!((l.max_num_seqs, l.kv_capacity_tokens), (64, 1024.0));
        let err = WorkerLimits::from_page(&Page::parse("x 1").unwrap(), "u").unwrap_err();
        assert!(err.to_string().contains("kv_capacity_tokens"));
    }
}
