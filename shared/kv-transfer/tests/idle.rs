//! An idle transport must not spin a core: the UCX progress thread sleeps on the worker's
//! event fd. Its own test binary so no other test's CPU time is counted.

use std::time::Duration;

use tandem_kv_transfer::{
    open, Backend, KvConnection, KvTransport, Put, Registration, TransportConfig,
};

fn cpu_time() -> Duration {
    // SAFETY: getrusage writes into the zeroed struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_ucx_transport_uses_no_cpu() {
    let rx = open(TransportConfig::new(Backend::Ucx)).await.unwrap();
    let tx = open(TransportConfig::new(Backend::Ucx)).await.unwrap();
    let mut buf = vec![0u8; 1 << 16];
    // SAFETY: `buf` outlives the registration (dropped at the end of the test, after `reg`).
    let reg = rx
        .register(unsafe { tandem_kv_transfer::LocalMemory::host(buf.as_mut_ptr(), buf.len()) })
        .await
        .unwrap();
    let conn = tx.connect(&reg.descriptor().peer).await.unwrap();
    conn.write(
        reg.descriptor(),
        vec![Put {
            local: vec![1u8; 4096].into(),
            offset: 0,
        }],
    )
    .await
    .unwrap();
    // Connected, registered, one transfer done: now idle for 2 s.
    let before = cpu_time();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let used = cpu_time() - before;
    assert!(
        used < Duration::from_millis(300),
        "idle transports used {used:?} of CPU in 2 s"
    );
    drop(conn);
    drop(reg);
    drop(buf);
}
