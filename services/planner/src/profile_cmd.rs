//! `tandem-planner profile`: the profiler's command line.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use tandem_planner::sweep::{SweepPlan, Sweeper};

/// Measures one worker through the router (prefill time by ISL, decode step time by batch and
/// context) and writes the profile that `--planner-profile-data` of the planner and of
/// `tandem-mocker` read. Run it against a router in front of one idle worker of the role.
#[derive(Parser, Debug)]
#[command(name = "tandem-planner profile")]
struct ProfileArgs {
    /// The router's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// The profiled worker's status page (`http://HOST:SYSTEM_PORT/metrics`): its KV
    /// capacity and batch limits.
    #[arg(long)]
    worker_metrics_url: String,
    /// Where to write the profile (JSON).
    #[arg(long)]
    out: PathBuf,
    /// Model to request (default: the first the router lists).
    #[arg(long)]
    model: Option<String>,
    /// API key for the router (default: $OPENAI_API_KEY when set).
    #[arg(long)]
    api_key: Option<String>,
    /// Prompt lengths of the prefill sweep.
    #[arg(long, value_delimiter = ',', default_value = "128,512,1024,2048,4096")]
    isl: Vec<usize>,
    /// Contexts of the decode sweep.
    #[arg(long, value_delimiter = ',', default_value = "256,1024,4096")]
    contexts: Vec<usize>,
    /// Batch sizes of the decode sweep.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32")]
    batches: Vec<usize>,
    /// Output tokens of the long decode run (the short one has a quarter).
    #[arg(long, default_value_t = 64)]
    decode_tokens: usize,
    /// Runs per point (the median is kept).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
}

pub async fn run(args: impl Iterator<Item = String>) -> anyhow::Result<()> {
    let a = ProfileArgs::parse_from(args);
    let plan = SweepPlan {
        url: a.url.trim_end_matches('/').to_string(),
        worker_metrics_url: a.worker_metrics_url,
        model: a.model,
        api_key: a.api_key.or_else(|| std::env::var("OPENAI_API_KEY").ok()),
        isl: a.isl,
        contexts: a.contexts,
        batches: a.batches,
        decode_tokens: a.decode_tokens,
        repeats: a.repeats,
    };
    let (mut sweeper, limits) = Sweeper::new(plan).await?;
    tracing::info!(
        "profiling a worker of {} KV tokens, {} sequences and {} tokens a step",
        limits.kv_capacity_tokens,
        limits.max_num_seqs,
        limits.max_num_batched_tokens
    );
    let data = sweeper.run(&limits, |p| tracing::info!("{p}")).await?;
    data.models()
        .context("the measured profile does not make time models")?;
    let json = serde_json::to_string_pretty(&data)?;
    std::fs::write(&a.out, json).with_context(|| format!("writing {}", a.out.display()))?;
    println!("profile written to {}", a.out.display());
    Ok(())
}
