//! `tandem-mocker`: N simulated workers in one process, each served like a real one.

use anyhow::Context;
use clap::Parser;
use tandem_mocker::args::{split, MockerArgs};

/// mimalloc: the engine thread allocates per sequence per step (outputs, detokenized text,
/// step plans), and glibc's malloc spent a fifth of its time consolidating small freed
/// chunks before each larger allocation (docs/benchmarks.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The i-th of N consecutive ports, or 0 (ephemeral) for all.
fn nth_port(base: u16, i: usize) -> anyhow::Result<u16> {
    if base == 0 {
        return Ok(0);
    }
    u16::try_from(base as usize + i).context("port range runs past 65535")
}

/// Simulated prefill workers export their blocks as zeros of the layout's size (the engine's
/// handoff checks sizes) that nobody reads. glibc's calloc hands out fresh mmap'd memory for
/// large sizes without touching it, but its threshold adapts upwards (to 32 MiB) after the
/// first free, and from the heap calloc must memset. Pinning the threshold at 1 MiB keeps a
/// big layout's export (megabytes per block for a real model's config) a mapping that is
/// never written: no memory traffic, a syscall per batch.
fn untouched_large_zero_allocations() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only tunes the allocator, under the allocator's own lock.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    untouched_large_zero_allocations();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let all: Vec<String> = std::env::args().collect();
    let (mine, rest) = split(&all);
    let margs = MockerArgs::parse_from(&mine);
    let mut cfg = match tandem_config::parse_worker(
        tandem_mocker::role_of(&rest),
        &rest,
        &tandem_config::process_env,
    ) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("tandem-mocker: error: {e}");
            std::process::exit(e.exit_code());
        }
    };
    for w in &cfg.warnings {
        tracing::warn!("{w}");
    }
    if let Err(e) = tandem_mocker::apply(&mut cfg, &margs) {
        eprintln!("tandem-mocker: error: {e}");
        std::process::exit(2);
    }
    let cost = match tandem_mocker::cost_model(&margs) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("tandem-mocker: error: {e}");
            std::process::exit(2);
        }
    };
    if let Some(trace) = &margs.replay {
        // The replay drives its engines with its own blocking loop: off the async runtime.
        let (rcfg, trace, m) = (cfg.clone(), trace.clone(), margs.clone());
        let report = tokio::task::spawn_blocking(move || {
            let opts = tandem_mocker::replay::ReplayOptions {
                workers: m.num_workers,
                prefill_workers: m.num_prefill_workers,
                vocab: m.vocab_size,
                trace_block: m.trace_block_size,
                router: m.replay_router,
                transfer_gb_s: m.kv_transfer_bandwidth,
                kv_bytes_per_token: m.kv_bytes_per_token.unwrap_or(114_688),
                sla_ttft_ms: m.sla_ttft_ms,
                sla_itl_ms: m.sla_itl_ms,
            };
            tandem_mocker::replay::replay(&rcfg, cost, &trace, &opts)
        })
        .await
        .context("replay task panicked")??;
        let json = serde_json::to_string_pretty(&report)?;
        if let Some(out) = &margs.replay_out {
            std::fs::write(out, &json)
                .with_context(|| format!("cannot write {}", out.display()))?;
        }
        println!("{json}");
        return Ok(());
    }
    let shutdown = tandem_runtime::shutdown::on_signals();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..margs.num_workers {
        let mut c = cfg.clone();
        c.network.rpc_port = nth_port(cfg.network.rpc_port, i)?;
        c.network.system_port = nth_port(cfg.network.system_port, i)?;
        let builder = tandem_mocker::engine_builder(margs.vocab_size, cost.clone());
        let kv = tandem_mocker::kv_transfer(&c, &margs)?;
        let token = shutdown.clone();
        tasks.spawn(async move { tandem_worker::run_with_transfer(c, builder, token, kv).await });
    }
    // One failing worker takes the process down: a partial fleet would skew measurements.
    while let Some(r) = tasks.join_next().await {
        r.context("worker task panicked")??;
    }
    Ok(())
}
