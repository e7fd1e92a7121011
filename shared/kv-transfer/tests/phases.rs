//! A UCX write batch reports where its time went (`tandem_kv_transfer_ucx_phase_seconds`:
//! queue, issue, complete). Its own test binary: it installs the process's metrics recorder.

use tandem_kv_transfer::{
    open, Backend, KvConnection, KvTransport, Put, Registration, TransportConfig,
};

/// The `_count` of the phase histogram with these labels, 0 when absent.
fn count(text: &str, phase: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with("tandem_kv_transfer_ucx_phase_seconds_count{"))
        .filter(|l| l.contains(&format!("phase=\"{phase}\"")) && l.contains("memory_type=\"host\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_write_batches_record_their_phases() {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .expect("the only recorder of this test binary");
    let rx = open(TransportConfig::new(Backend::Ucx)).await.unwrap();
    let mut cfg = TransportConfig::new(Backend::Ucx);
    cfg.ucx_lanes = 1;
    let tx = open(cfg).await.unwrap();
    let mut buf = vec![0u8; 1 << 16];
    // SAFETY: `buf` outlives the registration (dropped at the end of the test, after `reg`).
    let reg = rx
        .register(unsafe { tandem_kv_transfer::LocalMemory::host(buf.as_mut_ptr(), buf.len()) })
        .await
        .unwrap();
    let conn = tx.connect(&reg.descriptor().peer).await.unwrap();
    for i in 0..3u8 {
        let put = Put {
            local: vec![i; 4096].into(),
            offset: 4096 * i as u64,
        };
        conn.write(reg.descriptor(), vec![put]).await.unwrap();
    }
    let text = handle.render();
    for phase in ["queue", "issue", "complete"] {
        assert_eq!(count(&text, phase), 3.0, "{phase} in:\n{text}");
    }
    assert!(
        text.lines()
            .any(|l| l.starts_with("tandem_kv_transfer_ucx_phase_seconds")
                && l.contains("phase=\"complete\"")
                && l.contains("slept=")),
        "the complete phase says whether the lane slept:\n{text}"
    );
    drop(conn);
    drop(reg);
    drop(buf);
}
