//! `trtllm_kv_transfer_*` metrics (Dynamo's TensorRT-LLM additions), through
//! the `metrics` facade: the process's exporter decides where they go.

use std::time::Duration;

pub(crate) fn record_transfer(labels: &[(String, String)], bytes: u64, elapsed: Duration) {
    let labels: Vec<metrics::Label> = labels
        .iter()
        .map(|(k, v)| metrics::Label::new(k.clone(), v.clone()))
        .collect();
    let secs = elapsed.as_secs_f64();
    metrics::counter!("trtllm_kv_transfer_success_total", labels.clone()).increment(1);
    metrics::histogram!("trtllm_kv_transfer_latency_seconds", labels.clone()).record(secs);
    metrics::histogram!("trtllm_kv_transfer_bytes", labels.clone()).record(bytes as f64);
    if secs > 0.0 {
        metrics::histogram!("trtllm_kv_transfer_speed_gb_s", labels)
            .record(bytes as f64 / secs / 1e9);
    }
}
