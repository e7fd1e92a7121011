//! `trtllm_kv_transfer_*` metrics (Dynamo's TensorRT-LLM additions), and the receiver's
//! refusals, through the `metrics` facade: the process's exporter decides where they go.

use std::time::Duration;

/// Counter of frames or events a receiver refused, by `reason` ([`Refusal::as_str`]).
pub const REFUSED_TOTAL: &str = "tandem_kv_transfer_refused_total";

/// Why a receiver refused a frame (the connection is closed, the pool untouched).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A hello naming an unknown region or presenting the wrong secret.
    BadSecret,
    /// A put or notification on a connection that has not presented the region's secret.
    Unauthenticated,
    /// A put whose `offset + len` does not fit the region (checked before its payload is read).
    OutOfBounds,
    /// A notification over [`crate::MAX_NOTIFICATION_BYTES`].
    OversizedNotification,
    /// A notification that found the event queue full ([`crate::EVENT_QUEUE`]).
    EventQueueFull,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::BadSecret => "bad_secret",
            Refusal::Unauthenticated => "unauthenticated",
            Refusal::OutOfBounds => "out_of_bounds",
            Refusal::OversizedNotification => "oversized_notification",
            Refusal::EventQueueFull => "event_queue_full",
        }
    }
}

fn labels_of(labels: &[(String, String)]) -> Vec<metrics::Label> {
    labels
        .iter()
        .map(|(k, v)| metrics::Label::new(k.clone(), v.clone()))
        .collect()
}

pub(crate) fn record_refused(labels: &[(String, String)], reason: Refusal) {
    let mut labels = labels_of(labels);
    labels.push(metrics::Label::new("reason", reason.as_str()));
    metrics::counter!(REFUSED_TOTAL, labels).increment(1);
}

/// One completed write batch, labelled with the transport's labels and the destination's
/// `memory_type` (`host`, `cuda`).
pub(crate) fn record_transfer(
    labels: &[(String, String)],
    memory: crate::MemoryKind,
    bytes: u64,
    elapsed: Duration,
) {
    let mut labels = labels_of(labels);
    labels.push(metrics::Label::new("memory_type", memory.label()));
    let secs = elapsed.as_secs_f64();
    metrics::counter!("trtllm_kv_transfer_success_total", labels.clone()).increment(1);
    metrics::histogram!("trtllm_kv_transfer_latency_seconds", labels.clone()).record(secs);
    metrics::histogram!("trtllm_kv_transfer_bytes", labels.clone()).record(bytes as f64);
    if secs > 0.0 {
        metrics::histogram!("trtllm_kv_transfer_speed_gb_s", labels)
            .record(bytes as f64 / secs / 1e9);
    }
}

/// A write batch's phases on a UCX lane (`tandem_kv_transfer_ucx_phase_seconds`, by `phase`
/// and source `memory_type`): `queue` (command sent until its lane's thread took it),
/// `issue` (its puts and flush issued), `complete` (until UCX reported them done; label
/// `slept`: whether the thread slept meanwhile).
pub(crate) fn record_ucx_phases(
    source: crate::MemoryKind,
    [queue, issue, complete]: [Duration; 3],
    slept: bool,
) {
    const NAME: &str = "tandem_kv_transfer_ucx_phase_seconds";
    let memory = source.label();
    metrics::histogram!(NAME, "phase" => "queue", "memory_type" => memory)
        .record(queue.as_secs_f64());
    metrics::histogram!(NAME, "phase" => "issue", "memory_type" => memory)
        .record(issue.as_secs_f64());
    let slept = if slept { "true" } else { "false" };
    metrics::histogram!(NAME, "phase" => "complete", "memory_type" => memory, "slept" => slept)
        .record(complete.as_secs_f64());
}
