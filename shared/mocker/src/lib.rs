//! `tandem-mocker`: the Tandem engine with a simulated backend, for measuring routing and
//! scheduling at scale without GPUs. The engine (scheduler, KV block manager, prefix cache,
//! KV events), the worker gRPC service, discovery and drain are the real ones; only the
//! forward step is replaced by simulated time ([`backend::SimBackend`], [`cost::CostModel`]).
//!
//! Disaggregated roles (`--disaggregation-mode prefill`, `pd` or `decode`) run the worker
//! crate's own disaggregated code (leases, quarantine and fencing, the first-token handoff,
//! activation) with the KV transfer simulated: a decode worker advertises a simulated region
//! ([`tandem_worker::transport::simulated_region`]) instead of registered memory, and a
//! prefill worker's write of a batch of blocks takes `bytes / bandwidth` on a simulated link
//! ([`tandem_worker::transport::SimulatedLink`]); no bytes move.

pub mod args;
pub mod backend;
pub mod cost;
pub mod replay;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tandem_config::{DisaggregationMode, Role, WorkerConfig};
use tandem_engine::model::LoadOptions;
use tandem_worker::transport::{simulated_region, SimulatedLink};
use tandem_worker::{BuiltEngine, EngineBuilder, KvTransfer};

use crate::args::MockerArgs;
use crate::backend::{Pacer, SimBackend};
use crate::cost::{CostModel, Profile, Timing};

/// The cost model the flags ask for.
pub fn cost_model(a: &MockerArgs) -> anyhow::Result<CostModel> {
    let timing = match &a.planner_profile_data {
        Some(p) => Timing::Profile(Profile::load(p)?),
        None => Timing::Polynomial,
    };
    Ok(CostModel::new(
        timing,
        a.speedup_ratio,
        a.decode_speedup_ratio,
    )?)
}

/// Applies the mocker flags over a parsed worker config.
pub fn apply(cfg: &mut WorkerConfig, a: &MockerArgs) -> anyhow::Result<()> {
    a.validate().map_err(anyhow::Error::msg)?;
    use tandem_config::DisaggregationMode as Mode;
    if !matches!(
        cfg.disaggregation.disaggregation_mode,
        Mode::Agg | Mode::Pd | Mode::Decode | Mode::Prefill
    ) {
        anyhow::bail!(
            "--disaggregation-mode {} is not simulated; the mocker serves agg, pd, decode and \
             prefill",
            cfg.disaggregation.disaggregation_mode.name()
        );
    }
    if let Some(b) = a.block_size {
        cfg.kv_cache.kv_block_size = u32::try_from(b)?;
    }
    let block_size = cfg.kv_cache.kv_block_size as u64;
    let e = &mut cfg.engine;
    if let Some(n) = a.max_num_seqs {
        e.max_batch_size = u32::try_from(n)?;
    }
    if let Some(n) = a.max_num_batched_tokens {
        e.max_num_tokens = u32::try_from(n)?;
    }
    // The pool size is a count of blocks here, as in Dynamo's mocker.
    e.kv_cache_config.max_tokens = Some(a.num_gpu_blocks_override as u64 * block_size);
    e.kv_cache_config.enable_block_reuse = a.prefix_caching();
    // Chunked prefill on, as in Dynamo's mocker: long prompts must fit any token budget.
    e.enable_chunked_prefill = true;
    if e.max_seq_len.is_none() {
        e.max_seq_len = Some(u32::try_from(a.max_model_len)?);
    }
    Ok(())
}

/// Builds one simulated engine for the worker crate: the model folder is read for its
/// tokenizer, card and layout only (no weights).
pub fn build_sim_engine(
    cfg: &WorkerConfig,
    vocab: Option<usize>,
    cost: CostModel,
    pacer: Pacer,
) -> anyhow::Result<BuiltEngine> {
    tandem_worker::build_engine_with(
        cfg,
        &LoadOptions::no_weights(),
        // The simulated backend models time only; its layout follows the CPU defaults.
        tandem_worker::Device::Cpu,
        move |model, layout, num_blocks| {
            let vocab = vocab.unwrap_or(model.config.vocab_size);
            Ok(Box::new(SimBackend::new(
                layout.clone(),
                num_blocks,
                vocab,
                cost,
                pacer,
            )))
        },
    )
}

/// An [`EngineBuilder`] for `tandem_worker::run_with_transfer` (wall-clock pacing). A decode
/// worker (`pd` / `decode`) gets a simulated KV region the size of its pool, so the leases it
/// grants are bounds-checked by the (simulated) writer as real ones are.
pub fn engine_builder(vocab: Option<usize>, cost: CostModel) -> EngineBuilder {
    Box::new(move |cfg, _transport| {
        let mut built = build_sim_engine(cfg, vocab, cost, Pacer::Sleep)?;
        if matches!(
            cfg.disaggregation.disaggregation_mode,
            DisaggregationMode::Pd | DisaggregationMode::Decode
        ) {
            let len = built.num_blocks as u64 * built.engine.layout().block_bytes() as u64;
            built.kv_region = Some(simulated_region(next_region_id(), len));
        }
        Ok(built)
    })
}

/// Distinct region ids for the simulated regions of one process.
fn next_region_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    (u64::from(std::process::id()) << 32) | NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The config role a mocker's worker args ask for: the prefill parser for
/// `--disaggregation-mode prefill`, the decode one (agg, pd, decode) otherwise.
pub fn role_of(worker_args: &[String]) -> Role {
    let mut it = worker_args.iter();
    while let Some(a) = it.next() {
        let mode = match a.strip_prefix("--disaggregation-mode") {
            Some("") => it.next().map(String::as_str),
            Some(v) => v.strip_prefix('='),
            None => None,
        };
        if mode == Some("prefill") {
            return Role::Prefill;
        }
    }
    Role::Decode
}

/// How one simulated worker moves KV: a prefill worker gets its own simulated link (one per
/// worker, as one NIC per machine) at `--kv-transfer-bandwidth` × `--speedup-ratio`, blocks
/// counting `--kv-bytes-per-token` × block size bytes when that flag is given.
pub fn kv_transfer(cfg: &WorkerConfig, a: &MockerArgs) -> anyhow::Result<KvTransfer> {
    let wire_block_bytes = a
        .kv_bytes_per_token
        .map(|b| b as u64 * u64::from(cfg.kv_cache.kv_block_size));
    Ok(KvTransfer::Simulated(Arc::new(SimulatedLink::new(
        a.live_link_bytes_per_sec(),
        wire_block_bytes,
    )?)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    fn config(args: &[&str]) -> (WorkerConfig, MockerArgs) {
        let (mine, rest) = args::split(&s(args));
        let m = <MockerArgs as clap::Parser>::parse_from(&mine);
        let mut cfg = tandem_config::parse_worker(role_of(&rest), &rest, &|_| None).unwrap();
        apply(&mut cfg, &m).unwrap();
        (cfg, m)
    }

    #[test]
    fn every_serving_role_is_accepted_with_its_parser() {
        assert_eq!(
            role_of(&s(&["m", "--disaggregation-mode", "prefill"])),
            Role::Prefill
        );
        assert_eq!(
            role_of(&s(&["m", "--disaggregation-mode=prefill"])),
            Role::Prefill
        );
        assert_eq!(
            role_of(&s(&["m", "--disaggregation-mode", "pd"])),
            Role::Decode
        );
        assert_eq!(role_of(&s(&["m"])), Role::Decode);
        for mode in ["agg", "pd", "decode", "prefill"] {
            let (cfg, _) = config(&["m", "--disaggregation-mode", mode]);
            assert_eq!(cfg.disaggregation.disaggregation_mode.name(), mode);
        }
    }

    #[test]
    fn the_link_follows_bandwidth_speedup_and_bytes_per_token() {
        let (cfg, m) = config(&[
            "m",
            "--disaggregation-mode",
            "prefill",
            "--kv-transfer-bandwidth",
            "2",
            "--speedup-ratio",
            "5",
            "--block-size",
            "16",
            "--kv-bytes-per-token",
            "1000",
        ]);
        assert_eq!(m.live_link_bytes_per_sec(), 1e10);
        let KvTransfer::Simulated(link) = kv_transfer(&cfg, &m).unwrap() else {
            panic!("a mocker's transfer is simulated");
        };
        assert_eq!(link.bytes_per_sec(), 1e10);
        let region = simulated_region(1, 1 << 20);
        let bytes = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
            .block_on(link.write(&region, &[0, 4096], 4096))
            .unwrap();
        assert_eq!(bytes, 2 * 16 * 1000);
        let bad =
            <MockerArgs as clap::Parser>::parse_from(s(&["m", "--kv-transfer-bandwidth", "0"]));
        assert!(bad
            .validate()
            .unwrap_err()
            .contains("--kv-transfer-bandwidth"));
    }
}
