//! SIGTERM turns into a shutdown token (its own test binary: it signals its own process).

use std::time::Duration;

#[tokio::test]
async fn sigterm_triggers_shutdown() {
    let token = tandem_runtime::shutdown::on_signals();
    assert!(!token.is_triggered());
    let status = std::process::Command::new("kill")
        .args(["-TERM", &std::process::id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success());
    tokio::time::timeout(Duration::from_secs(10), token.cancelled())
        .await
        .expect("SIGTERM observed");
    assert!(token.is_triggered());
}
