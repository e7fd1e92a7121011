//! The `tandem-prefill` binary's command line: its role is fixed, its transport flags resolve,
//! and a bad value exits with a message naming the flag. (Serving is tested end to end in
//! `services/router/tests/disagg.rs`, which also needs this binary built.)

use std::process::{Command, Output};

fn prefill(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem-prefill"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run tandem-prefill")
}

fn config(o: &Output) -> serde_json::Value {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).expect("--print-config prints JSON")
}

#[test]
fn the_role_is_prefill_and_the_transport_flag_resolves() {
    let c = config(&prefill(&["--print-config"], &[]));
    assert_eq!(c["disaggregation"]["disaggregation_mode"], "prefill");
    assert_eq!(
        c["engine"]["cache_transceiver_config"]["backend"],
        "DEFAULT"
    );
    let c = config(&prefill(&["--print-config", "--kv-transport", "tcp"], &[]));
    assert_eq!(c["engine"]["cache_transceiver_config"]["backend"], "TCP");
    let c = config(&prefill(
        &["--print-config"],
        &[("DYN_TRTLLM_KV_TRANSPORT", "ucx")],
    ));
    assert_eq!(c["engine"]["cache_transceiver_config"]["backend"], "UCX");
}

#[test]
fn other_roles_and_bad_transports_are_refused_by_name() {
    let out = prefill(&["--disaggregation-mode", "agg"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("disaggregation-mode"));
    let out = prefill(&["--kv-transport", "nixl"], &[]);
    assert_ne!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stderr).contains("kv-transport"));
}
