//! Worker gauges (`dynamo_component_*`) refreshed from the engine's stats.

use std::time::Duration;

use tandem_engine::engine::EngineHandle;
use tandem_runtime::shutdown::ShutdownToken;

pub const KV_TOTAL_BLOCKS: &str = "dynamo_component_kv_cache_total_blocks";
pub const KV_REFERENCED_BLOCKS: &str = "dynamo_component_kv_cache_active_blocks";
pub const KV_CACHED_BLOCKS: &str = "dynamo_component_kv_cache_cached_blocks";
pub const KV_USAGE_PERCENT: &str = "dynamo_component_gpu_cache_usage_percent";
pub const PREEMPTIONS: &str = "dynamo_component_preemptions_total";
/// The engine thread's steps and their time (see `EngineStats::step_micros`): over an
/// interval, (step − forward) / steps is what the engine itself spends per step while the
/// device waits.
pub const ENGINE_STEPS: &str = "tandem_engine_steps_total";
pub const ENGINE_STEP_MICROS: &str = "tandem_engine_step_microseconds_total";
pub const ENGINE_FORWARD_MICROS: &str = "tandem_engine_forward_microseconds_total";
/// The steps' `apply` (marking pieces computed, host sampling, emitting), their
/// scheduling, and the engine thread's time between busy steps (see
/// `EngineStats::apply_micros`, `EngineStats::schedule_micros`,
/// `EngineStats::between_steps_micros`).
pub const ENGINE_APPLY_MICROS: &str = "tandem_engine_apply_microseconds_total";
pub const ENGINE_SCHEDULE_MICROS: &str = "tandem_engine_schedule_microseconds_total";
pub const ENGINE_BETWEEN_STEPS_MICROS: &str = "tandem_engine_between_steps_microseconds_total";
// The load report the planner scales on: its names live with the other component names.
pub use tandem_runtime::metrics::names::component::{
    CONTEXT_LENGTH, KV_CAPACITY_TOKENS, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, QUEUED_KV_TOKENS,
    QUEUED_PREFILL_TOKENS, RUNNING_REQUESTS, SCHEDULED_KV_TOKENS, WAITING_REQUESTS,
};

/// Where a disaggregated request's time goes before its first token
/// (`tandem_disagg_phase_seconds`, by `phase`): on the decode worker `reserve` (its blocks
/// reserved under a lease), `first_token` (until the prefill worker's first token) and
/// `prefill_call` (until its `done`, every write complete); on the prefill worker
/// `prefill_compute` (call received until the engine computed the prompt's last blocks),
/// `prefill_first` (until the first token was sent) and `prefill_total` (until `done`).
pub fn disagg_phase(phase: &'static str, took: Duration) {
    metrics::histogram!("tandem_disagg_phase_seconds", "phase" => phase).record(took.as_secs_f64());
}

/// Refreshes the gauges every 500 ms until shutdown.
pub fn spawn_gauges(engine: EngineHandle, instance_id: u64, shutdown: ShutdownToken) {
    tokio::spawn(async move {
        let id = instance_id.to_string();
        let config = engine.config();
        let context_length = config.max_seq_len as f64;
        let limits = (config.max_batch_size as f64, config.max_num_tokens as f64);
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.cancelled() => return,
            }
            let Ok(s) = engine.stats().await else { return };
            let label = [("worker_id", id.clone())];
            metrics::gauge!(KV_TOTAL_BLOCKS, &label).set(s.blocks.total as f64);
            metrics::gauge!(KV_REFERENCED_BLOCKS, &label).set(s.blocks.referenced as f64);
            metrics::gauge!(KV_CACHED_BLOCKS, &label).set(s.blocks.cached as f64);
            let usage = if s.blocks.total == 0 {
                0.0
            } else {
                s.blocks.referenced as f64 / s.blocks.total as f64
            };
            metrics::gauge!(KV_USAGE_PERCENT, &label).set(usage);
            metrics::gauge!(RUNNING_REQUESTS, &label).set(s.running as f64);
            metrics::gauge!(WAITING_REQUESTS, &label).set(s.waiting as f64);
            metrics::gauge!(PREEMPTIONS, &label).set(s.preemptions as f64);
            metrics::counter!(ENGINE_STEPS, &label).absolute(s.steps);
            metrics::counter!(ENGINE_STEP_MICROS, &label).absolute(s.step_micros);
            metrics::counter!(ENGINE_FORWARD_MICROS, &label).absolute(s.forward_micros);
            metrics::counter!(ENGINE_APPLY_MICROS, &label).absolute(s.apply_micros);
            metrics::counter!(ENGINE_SCHEDULE_MICROS, &label).absolute(s.schedule_micros);
            metrics::counter!(ENGINE_BETWEEN_STEPS_MICROS, &label).absolute(s.between_steps_micros);
            let bs = s.block_size as f64;
            metrics::gauge!(QUEUED_PREFILL_TOKENS, &label).set(s.queued_prefill_tokens as f64);
            metrics::gauge!(SCHEDULED_KV_TOKENS, &label).set(s.blocks.referenced as f64 * bs);
            metrics::gauge!(QUEUED_KV_TOKENS, &label).set(s.queued_kv_tokens as f64);
            metrics::gauge!(KV_CAPACITY_TOKENS, &label).set(s.blocks.total as f64 * bs);
            metrics::gauge!(CONTEXT_LENGTH, &label).set(context_length);
            metrics::gauge!(MAX_NUM_SEQS, &label).set(limits.0);
            metrics::gauge!(MAX_NUM_BATCHED_TOKENS, &label).set(limits.1);
        }
    });
}
