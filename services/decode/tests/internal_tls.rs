//! The worker's gRPC service under the deployment's mutual TLS (the default): a client without
//! a certificate, or with one of another deployment's CA, is refused before any RPC; a worker
//! started with neither a TLS folder nor `--insecure-internal` refuses to start.

use std::process::Command;
use std::time::Duration;

use tandem_pki::{ChannelSecurity, InternalIdentity};
use tandem_protocol::worker::worker_client::WorkerClient;
use tandem_protocol::worker::LoadStatsRequest;
use tandem_test_support::{field, spawn_ready, tls_args, Proc, TempDir};

fn worker(discovery: &TempDir) -> Proc {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem-decode"));
    cmd.args(["--disaggregation-mode", "agg"])
        .args(["--rpc-host", "127.0.0.1", "--system-host", "127.0.0.1"])
        .args(["--trtllm.kv_cache_config.max_tokens", "2048"])
        .args(tls_args())
        .env("DYN_FILE_KV", discovery.path())
        .env("DYN_DISCOVERY_BACKEND", "file");
    spawn_ready(&mut cmd, "TANDEM_WORKER_READY")
}

/// `LoadStats` through `security`; the error text when refused.
async fn load_stats(security: &ChannelSecurity, addr: &str) -> Result<(), String> {
    let endpoint = security
        .endpoint(addr)
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10));
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| format!("connect: {e:?}"))?;
    WorkerClient::new(channel)
        .load_stats(LoadStatsRequest {})
        .await
        .map(|_| ())
        .map_err(|s| format!("rpc: {s:?}"))
}

#[tokio::test]
async fn only_clients_of_the_deployment_ca_are_served() {
    let discovery = TempDir::new("tandem-tls").expect("temp dir");
    let w = worker(&discovery);
    let addr = field(w.ready_line(), "grpc=");

    // The deployment's own certificate: served.
    load_stats(&tandem_test_support::internal_security(), &addr)
        .await
        .expect("a client of the deployment is served");

    // Plaintext (no TLS, no certificate): refused.
    let plain = load_stats(&ChannelSecurity::Plaintext, &addr).await;
    assert!(plain.is_err(), "plaintext client served");

    // A certificate of another deployment's CA: refused (the server does not trust the
    // client's CA, and the client does not trust the server's).
    let other = TempDir::new("tandem-tls-other").expect("temp dir");
    let other_dir = other.path().join("pki");
    tandem_test_support::tls::make_deployment(&other_dir);
    let foreign = ChannelSecurity::MutualTls(InternalIdentity::load(&other_dir).expect("load"));
    let refused = load_stats(&foreign, &addr).await;
    assert!(refused.is_err(), "client of another CA served");

    // The worker still serves its own deployment afterwards.
    load_stats(&tandem_test_support::internal_security(), &addr)
        .await
        .expect("still served");
}

#[test]
fn a_worker_without_tls_or_an_explicit_opt_out_refuses_to_start() {
    let discovery = TempDir::new("tandem-tls-none").expect("temp dir");
    let out = Command::new(env!("CARGO_BIN_EXE_tandem-decode"))
        .args(["--disaggregation-mode", "agg"])
        .args(["--rpc-host", "127.0.0.1", "--system-host", "127.0.0.1"])
        .env_remove("TANDEM_INTERNAL_TLS_DIR")
        .env_remove("TANDEM_INSECURE_INTERNAL")
        .env("DYN_FILE_KV", discovery.path())
        .env("DYN_DISCOVERY_BACKEND", "file")
        .output()
        .expect("run tandem-decode");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--internal-tls-dir") && err.contains("--insecure-internal"),
        "{err}"
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("TANDEM_WORKER_READY"));
}

#[test]
fn a_missing_tls_folder_is_named() {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem-decode"))
        .args([
            "--internal-tls-dir",
            "/nonexistent/tandem-pki",
            "--print-config",
        ])
        .output()
        .expect("run tandem-decode");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/tandem-pki"), "{err}");
}
