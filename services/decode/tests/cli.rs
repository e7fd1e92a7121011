//! The documented command-line examples, run against the real `tandem-decode` binary.

use std::process::{Command, Output};

fn decode(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem-decode"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run tandem-decode")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn engine_value(o: &Output, key: &str) -> serde_json::Value {
    let json: serde_json::Value =
        serde_json::from_str(&stdout(o)).expect("--print-config prints JSON");
    json["engine"][key].clone()
}

#[test]
fn help_lists_every_seed_page_field() {
    let out = decode(&["--help"], &[]);
    assert!(out.status.success());
    let help = stdout(&out);
    for spec in tandem_config::flags::flags_for(tandem_config::spec::Scope::Worker) {
        assert!(
            help.contains(&format!("--{}", spec.name)),
            "--{} missing",
            spec.name
        );
    }
}

#[test]
fn env_and_cli_precedence_shows_in_print_config() {
    let env = [("DYN_TRTLLM_MAX_BATCH_SIZE", "64")];
    let out = decode(&["--max-batch-size", "32", "--print-config"], &env);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(engine_value(&out, "max_batch_size"), 32);
    let out = decode(&["--print-config"], &env);
    assert_eq!(engine_value(&out, "max_batch_size"), 64);
}

#[test]
fn out_of_range_env_fraction_exits_non_zero_naming_it() {
    let out = decode(
        &["--print-config"],
        &[("DYN_TRTLLM_FREE_GPU_MEMORY_FRACTION", "1.5")],
    );
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("DYN_TRTLLM_FREE_GPU_MEMORY_FRACTION") && err.contains("(0, 1]"),
        "{err}"
    );
}

#[test]
fn python_override_deep_merges() {
    let out = decode(
        &[
            "--override-engine-args",
            "{'kv_cache_config': {'enable_block_reuse': False}}",
            "--print-config",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let kv = engine_value(&out, "kv_cache_config");
    assert_eq!(kv["enable_block_reuse"], false);
    assert_eq!(kv["free_gpu_memory_fraction"], 0.9);
}

#[test]
fn tensor_parallelism_on_cuda_is_not_implemented_yet() {
    let out = decode(&["--tensor-parallel-size", "2", "--device", "cuda"], &[]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("tensor_parallel_size") && err.contains("not implemented yet"),
        "{err}"
    );
    let out = decode(&["--tensor-parallel-size", "2", "--print-config"], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(engine_value(&out, "tensor_parallel_size"), 2);
}
