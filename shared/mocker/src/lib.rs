//! `tandem-mocker`: the Tandem engine with a simulated backend, for measuring routing and
//! scheduling at scale without GPUs. The engine (scheduler, KV block manager, prefix cache,
//! KV events), the worker gRPC service, discovery and drain are the real ones; only the
//! forward step is replaced by simulated time ([`backend::SimBackend`], [`cost::CostModel`]).

pub mod args;
pub mod backend;
pub mod cost;
pub mod replay;

use tandem_config::WorkerConfig;
use tandem_engine::model::LoadOptions;
use tandem_worker::{BuiltEngine, EngineBuilder};

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
    // A simulated prefill or decode role needs the KV handoff and a simulated transfer; until
    // then refuse rather than register an aggregated engine under another role.
    if !matches!(cfg.disaggregation.disaggregation_mode, Mode::Agg) {
        anyhow::bail!(
            "--disaggregation-mode {} is not simulated yet; the mocker serves agg only",
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
        &LoadOptions { weights: false },
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

/// An [`EngineBuilder`] for `tandem_worker::run_with` (wall-clock pacing).
pub fn engine_builder(vocab: Option<usize>, cost: CostModel) -> EngineBuilder {
    Box::new(move |cfg, _transport| build_sim_engine(cfg, vocab, cost, Pacer::Sleep))
}
