//! Behaviour of the resolved worker config: the documented examples, one test per error class,
//! merge semantics of the engine-option layers, and the not-implemented table.

use std::collections::HashMap;
use std::io::Write;
use tandem_config::engine_options::{CapacitySchedulerPolicy, KvCacheDtype};
use tandem_config::validate::NOT_IMPLEMENTED_FLAGS;
use tandem_config::{parse_worker, ConfigError, DisaggregationMode, Role, WorkerConfig};

fn parse_env(role: Role, args: &[&str], env: &[(&str, &str)]) -> Result<WorkerConfig, ConfigError> {
    let env: HashMap<String, String> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let mut argv = vec![role.binary().to_string()];
    argv.extend(args.iter().map(|s| s.to_string()));
    parse_worker(role, &argv, &|k: &str| env.get(k).cloned())
}

fn parse(args: &[&str]) -> Result<WorkerConfig, ConfigError> {
    parse_env(Role::Decode, args, &[])
}

fn err(args: &[&str]) -> String {
    match parse(args) {
        Ok(_) => panic!("{args:?} should fail"),
        Err(e) => e.to_string(),
    }
}

fn yaml(text: &str) -> tempfile_path::TempPath {
    tempfile_path::TempPath::with(text)
}

/// A small self-deleting temp file (no extra crate needed).
mod tempfile_path {
    pub struct TempPath(pub std::path::PathBuf);
    impl TempPath {
        pub fn with(text: &str) -> Self {
            use std::sync::atomic::{AtomicUsize, Ordering};
            static N: AtomicUsize = AtomicUsize::new(0);
            let path = std::env::temp_dir().join(format!(
                "tandem-config-test-{}-{}.yaml",
                std::process::id(),
                N.fetch_add(1, Ordering::SeqCst)
            ));
            let mut f = std::fs::File::create(&path).expect("create temp file");
            super::Write::write_all(&mut f, text.as_bytes()).expect("write temp file");
            TempPath(path)
        }
        pub fn as_str(&self) -> &str {
            self.0.to_str().expect("utf-8 temp path")
        }
    }
    impl Drop for TempPath {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

#[test]
fn issue_examples_cli_beats_env_and_env_beats_default() {
    let env = [("DYN_TRTLLM_MAX_BATCH_SIZE", "64")];
    let cfg = parse_env(Role::Decode, &["--max-batch-size", "32"], &env).unwrap();
    assert_eq!(cfg.limits.max_batch_size, 32);
    assert_eq!(cfg.engine.max_batch_size, 32);
    let cfg = parse_env(Role::Decode, &[], &env).unwrap();
    assert_eq!(cfg.engine.max_batch_size, 64);
    assert_eq!(parse(&[]).unwrap().engine.max_batch_size, 2048);
}

#[test]
fn free_gpu_memory_fraction_out_of_range_names_the_variable_and_range() {
    let e = parse_env(
        Role::Decode,
        &[],
        &[("DYN_TRTLLM_FREE_GPU_MEMORY_FRACTION", "1.5")],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("DYN_TRTLLM_FREE_GPU_MEMORY_FRACTION") && e.contains("(0, 1]"),
        "{e}"
    );
    for bad in ["0", "-0.1", "1.0001"] {
        let e = err(&["--free-gpu-memory-fraction", bad]);
        assert!(
            e.contains("--free-gpu-memory-fraction") && e.contains("(0, 1]"),
            "{e}"
        );
    }
    assert!(parse(&["--free-gpu-memory-fraction", "1"]).is_ok());
    let e = err(&["--trtllm.kv_cache_config.free_gpu_memory_fraction", "2"]);
    assert!(
        e.contains("kv_cache_config.free_gpu_memory_fraction") && e.contains("(0, 1]"),
        "{e}"
    );
}

#[test]
fn python_override_deep_merges_over_flags() {
    let cfg = parse(&[
        "--free-gpu-memory-fraction",
        "0.5",
        "--override-engine-args",
        "{'kv_cache_config': {'enable_block_reuse': False}}",
    ])
    .unwrap();
    assert!(!cfg.engine.kv_cache_config.enable_block_reuse);
    assert_eq!(cfg.engine.kv_cache_config.free_gpu_memory_fraction, 0.5);
}

#[test]
fn yaml_kv_cache_config_merges_with_the_flag_instead_of_discarding_it() {
    let f = yaml(
        "kv_cache_config:\n  enable_block_reuse: false\n  max_tokens: 4096\nmax_num_tokens: 1024\n",
    );
    let cfg = parse(&[
        "--free-gpu-memory-fraction",
        "0.7",
        "--extra-engine-args",
        f.as_str(),
    ])
    .unwrap();
    let kv = &cfg.engine.kv_cache_config;
    assert_eq!(
        (
            kv.free_gpu_memory_fraction,
            kv.enable_block_reuse,
            kv.max_tokens
        ),
        (0.7, false, Some(4096))
    );
    assert_eq!(cfg.engine.max_num_tokens, 1024);
}

#[test]
fn layers_apply_in_order_and_collisions_with_explicit_flags_warn() {
    let f = yaml("max_batch_size: 16\nkv_cache_config: {free_gpu_memory_fraction: 0.6}\n");
    let cfg = parse(&[
        "--max-batch-size",
        "8",
        "--extra-engine-args",
        f.as_str(),
        "--override-engine-args",
        r#"{"max_batch_size": 4}"#,
    ])
    .unwrap();
    assert_eq!(cfg.engine.max_batch_size, 4);
    assert_eq!(cfg.engine.kv_cache_config.free_gpu_memory_fraction, 0.6);
    assert!(
        cfg.warnings
            .iter()
            .any(|w| w.contains("max_batch_size") && w.contains("--max-batch-size")),
        "{:?}",
        cfg.warnings
    );
    // No warning when the flag was left at its default.
    assert!(
        !cfg.warnings
            .iter()
            .any(|w| w.contains("--free-gpu-memory-fraction")),
        "{:?}",
        cfg.warnings
    );
}

#[test]
fn dynamic_flags_set_nested_options_and_exclude_override() {
    let cfg = parse(&[
        "--trtllm.kv_cache_config.enable_block_reuse",
        "false",
        "--trtllm.scheduler_config.capacity_scheduler_policy",
        "MAX_UTILIZATION",
        "--trtllm.kv_cache_config.dtype=bfloat16",
        "--trtllm.cuda_graph_config.batch_sizes",
        "None",
    ])
    .unwrap();
    assert!(!cfg.engine.kv_cache_config.enable_block_reuse);
    assert_eq!(
        cfg.engine.scheduler_config.capacity_scheduler_policy,
        CapacitySchedulerPolicy::MaxUtilization
    );
    assert_eq!(cfg.engine.kv_cache_config.dtype, KvCacheDtype::Bfloat16);
    for name in ["fp8", "fp8_e4m3", "e4m3"] {
        let cfg = parse(&[&format!("--trtllm.kv_cache_config.dtype={name}")]).unwrap();
        assert_eq!(
            cfg.engine.kv_cache_config.dtype,
            KvCacheDtype::Fp8,
            "{name}"
        );
    }
    let e = err(&[
        "--trtllm.max_batch_size",
        "4",
        "--override-engine-args",
        "{}",
    ]);
    assert!(e.contains("mutually exclusive"), "{e}");
    let e = err(&[
        "--trtllm.kv_cache_config",
        "1",
        "--trtllm.kv_cache_config.max_tokens",
        "2",
    ]);
    assert!(e.contains("conflicts"), "{e}");
    let e = err(&["--trtllm.max_batch_size"]);
    assert!(e.contains("must be followed by a value"), "{e}");
    let e = err(&["--trtllm..x", "1"]);
    assert!(e.contains("empty key"), "{e}");
}

#[test]
fn unknown_engine_keys_warn_by_default_and_fail_when_strict() {
    let cfg = parse(&[
        "--override-engine-args",
        r#"{"kv_cache_config": {"bogus_key": 1}, "nope": 2}"#,
    ])
    .unwrap();
    let w = cfg.warnings.join("\n");
    assert!(
        w.contains("kv_cache_config.bogus_key") && w.contains("nope"),
        "{w}"
    );
    let e = err(&[
        "--strict-engine-args",
        "--override-engine-args",
        r#"{"nope": 2}"#,
    ]);
    assert!(e.contains("nope") && e.contains("strict"), "{e}");
}

#[test]
fn wrong_types_name_the_key_path() {
    let e = err(&[
        "--override-engine-args",
        r#"{"kv_cache_config": {"enable_block_reuse": "sometimes"}}"#,
    ]);
    assert!(e.contains("kv_cache_config.enable_block_reuse"), "{e}");
    let e = err(&["--override-engine-args", r#"{"max_batch_size": -1}"#]);
    assert!(e.contains("max_batch_size"), "{e}");
    let e = err(&[
        "--override-engine-args",
        r#"{"scheduler_config": {"capacity_scheduler_policy": "FAST"}}"#,
    ]);
    assert!(
        e.contains("scheduler_config.capacity_scheduler_policy"),
        "{e}"
    );
}

#[test]
fn files_that_do_not_parse_report_line_and_column() {
    let f = yaml("max_batch_size: 4\nkv_cache_config:\n  enable_block_reuse: [unclosed\n");
    let e = err(&["--extra-engine-args", f.as_str()]);
    assert!(
        e.contains(f.as_str()) && e.contains("line") && e.contains("column"),
        "{e}"
    );
    let e = err(&["--extra-engine-args", "/no/such/file.yaml"]);
    assert!(e.contains("/no/such/file.yaml"), "{e}");
    let f = yaml("- just\n- a list\n");
    assert!(err(&["--extra-engine-args", f.as_str()]).contains("mapping"));
    let e = err(&["--override-engine-args", "{'a': 1,\n 'b': Flase}"]);
    assert!(
        e.contains("--override-engine-args") && e.contains("line 2, column 7"),
        "{e}"
    );
}

#[test]
fn non_positive_sizes_are_rejected() {
    for flag in [
        "--max-batch-size",
        "--max-num-tokens",
        "--max-seq-len",
        "--kv-block-size",
        "--max-beam-width",
    ] {
        let e = err(&[flag, "0"]);
        assert!(e.contains(flag) && e.contains("positive"), "{e}");
    }
    let e = err(&[
        "--override-engine-args",
        r#"{"kv_cache_config": {"max_tokens": 0}}"#,
    ]);
    assert!(
        e.contains("kv_cache_config.max_tokens") && e.contains("positive"),
        "{e}"
    );
    let e = err(&[
        "--override-engine-args",
        r#"{"cuda_graph_config": {"batch_sizes": [1, 0]}}"#,
    ]);
    assert!(e.contains("cuda_graph_config.batch_sizes"), "{e}");
}

#[test]
fn parallel_sizes_that_cannot_fit_the_gpus_are_rejected() {
    let e = err(&[
        "--gpus-per-node",
        "4",
        "--tensor-parallel-size",
        "3",
        "--pipeline-parallel-size",
        "2",
    ]);
    assert!(e.contains("--gpus-per-node") && e.contains("6"), "{e}");
    let e = err(&["--tensor-parallel-size", "4", "--expert-parallel-size", "3"]);
    assert!(e.contains("expert parallel size 3"), "{e}");
}

#[test]
fn multimodal_with_diffusion_and_bad_endpoints_are_rejected() {
    let e = err(&["--enable-multimodal", "--modality", "video_diffusion"]);
    assert!(
        e.contains("--enable-multimodal") && e.contains("video_diffusion"),
        "{e}"
    );
    for bad in ["dyn://a.b", "dyn://a..c", "http://x"] {
        let e = err(&["--endpoint", bad]);
        assert!(e.contains("--endpoint") && e.contains("malformed"), "{e}");
        let e = err(&["--encode-endpoint", bad]);
        assert!(
            e.contains("--encode-endpoint") && e.contains("malformed"),
            "{e}"
        );
    }
    let cfg = parse(&["--endpoint", "dyn://ns.comp.gen"]).unwrap();
    assert_eq!(cfg.endpoint().to_string(), "dyn://ns.comp.gen");
}

#[test]
fn every_not_implemented_flag_exits_with_a_message_naming_it() {
    // A non-default sample value for each flag in the table.
    let sample = |name: &str| -> Vec<String> {
        let spec = tandem_config::flags::spec(name).expect("flag in table");
        let flag = format!("--{name}");
        match spec.kind {
            tandem_config::spec::Kind::Bool => {
                if spec.default == Some("true") {
                    vec![format!("--{}", spec.negated())]
                } else {
                    vec![flag]
                }
            }
            tandem_config::spec::Kind::Int { .. } => vec![flag, "2".into()],
            tandem_config::spec::Kind::Float => vec![flag, "1.5".into()],
            tandem_config::spec::Kind::Choice(c) => {
                let v = c
                    .iter()
                    .find(|v| Some(**v) != spec.default)
                    .expect("a non-default choice");
                vec![flag, v.to_string()]
            }
            tandem_config::spec::Kind::List => vec![flag, "chat".into()],
            _ => match name {
                "model-loader-extra-config" => vec![flag, r#"{"gms_read_only": true}"#.into()],
                "encode-endpoint" => vec![flag, "dyn://ns.encode.generate".into()],
                "custom-jinja-template" => {
                    vec![flag, env!("CARGO_MANIFEST_DIR").to_string() + "/Cargo.toml"]
                }
                _ => vec![flag, "x".into()],
            },
        }
    };
    let mut names: Vec<&str> = NOT_IMPLEMENTED_FLAGS.iter().map(|(n, _)| *n).collect();
    names.extend(
        tandem_config::flags::FLAGS
            .iter()
            .filter(|s| {
                matches!(
                    s.group,
                    tandem_config::spec::Group::Diffusion
                        | tandem_config::spec::Group::DiffusionRequestDefaults
                )
            })
            .map(|s| s.name),
    );
    for name in names {
        let args = sample(name);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let e = err(&args);
        assert!(
            e.contains("not implemented yet") && e.contains(&format!("--{name}")),
            "{args:?}: {e}"
        );
    }
    let e = err(&["--connector", "kvbm"]);
    assert!(
        e.contains("--connector") && e.contains("not implemented yet"),
        "{e}"
    );
    for (key, value) in [
        ("speculative_config", r#"{"decoding_type": "Eagle"}"#),
        ("lora_config", r#"{"max_lora_rank": 8}"#),
        ("enable_attention_dp", "true"),
        ("backend", r#""tensorrt""#),
    ] {
        let e = err(&["--override-engine-args", &format!("{{\"{key}\": {value}}}")]);
        assert!(
            e.contains(key) && e.contains("not implemented yet"),
            "{key}: {e}"
        );
    }
    // Tensor parallelism runs on the CPU backend; on CUDA it is not built yet.
    assert!(parse(&["--tensor-parallel-size", "2", "--device", "cpu"]).is_ok());
    assert!(parse(&["--override-engine-args", r#"{"tensor_parallel_size": 2}"#]).is_ok());
    let e = err(&["--tensor-parallel-size", "2", "--device", "cuda:1"]);
    assert!(
        e.contains("tensor_parallel_size") && e.contains("not implemented yet"),
        "{e}"
    );
    // The tool-call and reasoning formats the router parses are accepted; the others named.
    assert!(parse(&[
        "--dyn-tool-call-parser",
        "hermes",
        "--dyn-reasoning-parser",
        "qwen3"
    ])
    .is_ok());
    for (flag, value) in [
        ("--dyn-tool-call-parser", "default"),
        ("--dyn-reasoning-parser", "gpt_oss"),
    ] {
        let e = err(&[flag, value]);
        assert!(
            e.contains(flag) && e.contains(value) && e.contains("not implemented yet"),
            "{e}"
        );
    }
    // Beam search is implemented: a wider beam is accepted.
    assert!(parse(&["--max-beam-width", "4"]).is_ok());
    assert!(parse(&["--override-engine-args", r#"{"max_beam_width": 4}"#]).is_ok());
    // One expert-parallel rank is no parallelism at all.
    assert!(parse(&["--expert-parallel-size", "1"]).is_ok());
    let e = err(&[
        "--trtllm.moe_expert_parallel_size",
        "2",
        "--trtllm.tensor_parallel_size",
        "2",
    ]);
    assert!(e.contains("not implemented yet"), "{e}");
}

#[test]
fn roles_fix_or_restrict_the_disaggregation_mode() {
    assert_eq!(
        parse(&[]).unwrap().disaggregation.disaggregation_mode,
        DisaggregationMode::Decode
    );
    for (mode, want) in [
        ("agg", DisaggregationMode::Agg),
        ("pd", DisaggregationMode::Pd),
        ("decode", DisaggregationMode::Decode),
    ] {
        assert_eq!(
            parse(&["--disaggregation-mode", mode])
                .unwrap()
                .disaggregation
                .disaggregation_mode,
            want
        );
    }
    let cfg = parse(&["--disaggregation-mode", "prefill_and_decode"]).unwrap();
    assert_eq!(
        cfg.disaggregation.disaggregation_mode,
        DisaggregationMode::Agg
    );
    assert!(
        cfg.warnings
            .iter()
            .any(|w| w.contains("agg") && w.contains("pd")),
        "{:?}",
        cfg.warnings
    );
    let e = err(&["--disaggregation-mode", "prefill"]);
    assert!(e.contains("tandem-decode accepts only"), "{e}");
    let p = parse_env(Role::Prefill, &[], &[]).unwrap();
    assert_eq!(
        p.disaggregation.disaggregation_mode,
        DisaggregationMode::Prefill
    );
    assert_eq!(p.endpoint().to_string(), "dyn://dynamo.prefill.generate");
    assert!(parse_env(Role::Prefill, &["--disaggregation-mode", "decode"], &[]).is_err());
    assert!(parse_env(Role::Encode, &["--disaggregation-mode", "agg"], &[]).is_err());
}

#[test]
fn legacy_publish_flag_and_env_are_accepted_with_a_warning() {
    let cfg = parse(&["--publish-events-and-metrics"]).unwrap();
    assert!(cfg.kv_cache.publish_kv_events);
    assert!(cfg
        .warnings
        .iter()
        .any(|w| w.contains("--publish-events-and-metrics") && w.contains("deprecated")));
    let cfg = parse(&["--no-publish-events-and-metrics"]).unwrap();
    assert!(!cfg.kv_cache.publish_kv_events);
    let cfg = parse_env(
        Role::Decode,
        &[],
        &[("DYN_TRTLLM_PUBLISH_EVENTS_AND_METRICS", "true")],
    )
    .unwrap();
    assert!(cfg.kv_cache.publish_kv_events);
    assert!(cfg
        .warnings
        .iter()
        .any(|w| w.contains("DYN_TRTLLM_PUBLISH_EVENTS_AND_METRICS")));
    // The new variable wins over the old one.
    let cfg = parse_env(
        Role::Decode,
        &[],
        &[
            ("DYN_TRTLLM_PUBLISH_EVENTS_AND_METRICS", "true"),
            ("DYN_TRTLLM_PUBLISH_KV_EVENTS", "false"),
        ],
    )
    .unwrap();
    assert!(!cfg.kv_cache.publish_kv_events);
    assert!(
        parse(&["--model", "/m/qwen"])
            .unwrap()
            .model
            .model_path
            .as_deref()
            == Some("/m/qwen")
    );
}

#[test]
fn namespace_suffix_served_name_and_print_config() {
    let cfg = parse_env(
        Role::Decode,
        &["--model-path", "/models/Qwen3-0.6B/"],
        &[("DYN_NAMESPACE_WORKER_SUFFIX", "blue")],
    )
    .unwrap();
    assert_eq!(cfg.runtime.namespace, "dynamo-blue");
    assert_eq!(cfg.served_model_name(), "Qwen3-0.6B");
    assert_eq!(parse(&[]).unwrap().served_model_name(), "tandem-tiny");
    let json: serde_json::Value =
        serde_json::from_str(&parse(&["--max-seq-len", "4096"]).unwrap().to_json()).unwrap();
    assert_eq!(json["engine"]["max_seq_len"], 4096);
    assert_eq!(json["runtime"]["discovery_backend"], "file");
    assert_eq!(json["runtime"]["event_plane"], "direct");
    assert_eq!(json["runtime"]["request_plane"], "grpc");
}

#[test]
fn dump_config_to_writes_the_resolved_json() {
    let path = std::env::temp_dir().join(format!("tandem-dump-{}.json", std::process::id()));
    let p = path.to_str().expect("utf-8");
    let cfg = parse(&["--dump-config-to", p, "--max-num-tokens", "512"]).unwrap();
    cfg.dump_if_requested().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(json["engine"]["max_num_tokens"], 512);
    let e = parse(&["--dump-config-to", "/no/such/dir/x.json"])
        .unwrap()
        .dump_if_requested()
        .unwrap_err();
    assert!(e.to_string().contains("/no/such/dir/x.json"));
}

#[test]
fn custom_template_must_exist() {
    let e = err(&["--custom-jinja-template", "/no/such/template.jinja"]);
    assert!(
        e.contains("--custom-jinja-template") && e.contains("not found"),
        "{e}"
    );
}

/// `tandem-router` followed by `args`.
fn router_argv(args: &[&str]) -> Vec<String> {
    std::iter::once("tandem-router")
        .chain(args.iter().copied())
        .map(String::from)
        .collect()
}

#[test]
fn router_flags_parse_and_reject_bad_ports() {
    let argv = router_argv;
    let none = |_: &str| None;
    let cfg = tandem_config::parse_router(&argv(&["--http-port", "9000"]), &none).unwrap();
    assert_eq!((cfg.http_host.as_str(), cfg.http_port), ("0.0.0.0", 9000));
    assert!(
        tandem_config::parse_router(&argv(&["--http-port", "70000"]), &none)
            .unwrap_err()
            .to_string()
            .contains("0-65535")
    );
    // Worker-only flags are not router flags.
    assert!(tandem_config::parse_router(&argv(&["--max-batch-size", "3"]), &none).is_err());
}

#[test]
fn router_admission_flags_parse_with_dynamo_defaults() {
    let argv = router_argv;
    let none = |_: &str| None;
    let cfg = tandem_config::parse_router(&argv(&[]), &none).unwrap();
    assert_eq!(cfg.admission.queue_threshold, Some(4.0));
    assert_eq!(cfg.admission.queue_max_requests, 4096);
    assert!(!cfg.admission.queue_shortest_first);
    assert_eq!(cfg.admission.rate_limit_requests_per_sec, 0.0);
    assert!(cfg.http.max_connections >= 1024);
    let cfg = tandem_config::parse_router(
        &argv(&[
            "--router-queue-threshold",
            "none",
            "--router-queue-policy",
            "wspt",
        ]),
        &none,
    )
    .unwrap();
    assert_eq!(cfg.admission.queue_threshold, None);
    assert!(cfg.admission.queue_shortest_first);
    let env = |k: &str| (k == "DYN_ROUTER_QUEUE_THRESHOLD").then(|| "0.5".to_string());
    let cfg = tandem_config::parse_router(&argv(&[]), &env).unwrap();
    assert_eq!(cfg.admission.queue_threshold, Some(0.5));
    for bad in [
        &["--router-queue-threshold", "-1"][..],
        &["--router-queue-threshold", "lots"],
        &["--rate-limit-tokens-per-sec", "-3"],
        &["--http-max-connections", "0"],
    ] {
        let e = tandem_config::parse_router(&argv(bad), &none)
            .unwrap_err()
            .to_string();
        assert!(e.contains(bad[0]), "{bad:?}: {e}");
    }
}

#[test]
fn router_api_keys_add_up_from_flags_env_and_file_and_never_print() {
    let argv = router_argv;
    let none = |_: &str| None;
    let cfg = tandem_config::parse_router(&argv(&[]), &none).unwrap();
    assert!(cfg.security.api_keys.is_empty());
    assert!(cfg.security.admin.is_none());
    assert!(cfg.security.tls.is_none());
    assert!(!cfg.security.expose_worker_id);

    let file = yaml("# ops keys\n\n  key-from-file  \nk1\n# k9\n");
    let path = file.0.display().to_string();
    let cfg = tandem_config::parse_router(
        &argv(&[
            "--api-key",
            "k1",
            "--api-key",
            "k2",
            "--api-key-file",
            &path,
        ]),
        &none,
    )
    .unwrap();
    // Repeated flags add up; the file's keys follow; duplicates go.
    assert_eq!(cfg.security.api_keys.keys(), ["k1", "k2", "key-from-file"]);
    let shown = format!(
        "{:?} {}",
        cfg.security,
        serde_json::to_string(&cfg).unwrap()
    );
    assert!(
        !shown.contains("k1") && !shown.contains("key-from-file"),
        "{shown}"
    );

    let env = |k: &str| (k == "TANDEM_API_KEYS").then(|| "e1,e2".to_string());
    let cfg = tandem_config::parse_router(&argv(&[]), &env).unwrap();
    assert_eq!(cfg.security.api_keys.keys(), ["e1", "e2"]);

    let empty = yaml("# nothing but comments\n\n");
    let e = tandem_config::parse_router(
        &argv(&["--api-key-file", &empty.0.display().to_string()]),
        &none,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("no API key") && e.contains(&empty.0.display().to_string()),
        "{e}"
    );
    let e = tandem_config::parse_router(&argv(&["--api-key-file", "/nonexistent/keys"]), &none)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("/nonexistent/keys") && e.contains("cannot read"),
        "{e}"
    );
}

#[test]
fn per_key_cache_salting_needs_api_keys() {
    let argv = router_argv;
    let none = |_: &str| None;
    let cfg = tandem_config::parse_router(&argv(&[]), &none).unwrap();
    assert!(!cfg.security.cache_salt_per_api_key);
    let e = tandem_config::parse_router(&argv(&["--cache-salt-per-api-key"]), &none)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--cache-salt-per-api-key") && e.contains("--api-key"),
        "{e}"
    );
    let env = |k: &str| (k == "TANDEM_CACHE_SALT_PER_API_KEY").then(|| "true".to_string());
    let cfg = tandem_config::parse_router(&argv(&["--api-key", "k1"]), &env).unwrap();
    assert!(cfg.security.cache_salt_per_api_key);
}

#[test]
fn router_admin_listener_and_tls_flags() {
    let argv = router_argv;
    let none = |_: &str| None;
    let cfg =
        tandem_config::parse_router(&argv(&["--admin-port", "0", "--expose-worker-id"]), &none)
            .unwrap();
    let admin = cfg.security.admin.expect("admin listener");
    assert_eq!((admin.host.as_str(), admin.port), ("127.0.0.1", 0));
    assert!(cfg.security.expose_worker_id);
    let e = tandem_config::parse_router(&argv(&["--admin-port", "70000"]), &none)
        .unwrap_err()
        .to_string();
    assert!(e.contains("admin-port"), "{e}");
    let cfg = tandem_config::parse_router(
        &argv(&["--tls-cert-path", "/c.pem", "--tls-key-path", "/k.pem"]),
        &none,
    )
    .unwrap();
    let tls = cfg.security.tls.expect("tls");
    assert_eq!(tls.cert_path, std::path::Path::new("/c.pem"));
    assert_eq!(tls.key_path, std::path::Path::new("/k.pem"));
    for one in [["--tls-cert-path", "/c.pem"], ["--tls-key-path", "/k.pem"]] {
        let e = tandem_config::parse_router(&argv(&one), &none)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--tls-cert-path and --tls-key-path"), "{e}");
    }
}

#[test]
fn every_not_implemented_router_flag_exits_with_a_message_naming_it() {
    let argv = |a: Vec<String>| -> Vec<String> {
        std::iter::once("tandem-router".to_string())
            .chain(a)
            .collect()
    };
    let none = |_: &str| None;
    for (name, _) in tandem_config::validate::ROUTER_NOT_IMPLEMENTED_FLAGS {
        let spec = tandem_config::flags::spec(name).expect("flag in table");
        let flag = format!("--{name}");
        let args = match spec.kind {
            tandem_config::spec::Kind::Bool => vec![flag],
            tandem_config::spec::Kind::Choice(c) => vec![flag, c[c.len() - 1].to_string()],
            tandem_config::spec::Kind::Float => vec![flag, "2.5".into()],
            _ => vec![flag, "7".into()],
        };
        let e = tandem_config::parse_router(&argv(args.clone()), &none)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("not implemented yet") && e.contains(&format!("--{name}")),
            "{args:?}: {e}"
        );
    }
    let ok =
        tandem_config::parse_router(&argv(vec!["--router-ttl-secs".into(), "30".into()]), &none)
            .unwrap();
    assert_eq!(ok.routing.router_ttl_secs, 30.0);
    let e = tandem_config::parse_router(
        &argv(vec!["--router-prune-target-ratio".into(), "1.5".into()]),
        &none,
    )
    .unwrap_err();
    assert!(e.to_string().contains("[0, 1]"));
}

#[test]
fn kv_transport_is_a_shorthand_for_the_transceiver_backend() {
    use tandem_config::engine_options::TransceiverBackend;
    let backend = |args: &[&str]| parse(args).unwrap().engine.cache_transceiver_config.backend;
    assert_eq!(backend(&[]), TransceiverBackend::Default);
    assert_eq!(backend(&["--kv-transport", "tcp"]), TransceiverBackend::Tcp);
    assert_eq!(backend(&["--kv-transport", "ucx"]), TransceiverBackend::Ucx);
    let env = parse_env(Role::Prefill, &[], &[("DYN_TRTLLM_KV_TRANSPORT", "tcp")]).unwrap();
    assert_eq!(
        env.engine.cache_transceiver_config.backend,
        TransceiverBackend::Tcp
    );
    let e = err(&["--kv-transport", "nixl"]);
    assert!(e.contains("kv-transport"), "{e}");
    let cfg = parse(&["--kv-lease-ttl-secs", "7"]).unwrap();
    assert_eq!(cfg.disaggregation.kv_lease_ttl_secs, 7);
    assert!(err(&["--kv-lease-ttl-secs", "0"]).contains("kv-lease-ttl-secs"));
}

#[test]
fn internal_listeners_bind_the_advertised_interface_unless_told() {
    // No flags: loopback for both, never the wildcard.
    let c = parse(&[]).unwrap();
    assert_eq!(c.network.rpc_host, "127.0.0.1");
    assert_eq!(c.network.system_host, "127.0.0.1");
    // An advertised host: both bind it (its host part), flag or env.
    let c = parse(&["--rpc-advertise-host", "10.0.0.7:9000"]).unwrap();
    assert_eq!(c.network.rpc_host, "10.0.0.7");
    assert_eq!(c.network.system_host, "10.0.0.7");
    let c = parse_env(
        Role::Decode,
        &[],
        &[("DYN_TCP_RPC_ADVERTISE_HOST", "decode-0.tandem")],
    )
    .unwrap();
    assert_eq!(c.network.rpc_host, "decode-0.tandem");
    let c = parse(&["--rpc-advertise-host", "fd00::7"]).unwrap();
    assert_eq!(c.network.rpc_host, "[fd00::7]");
    // 0.0.0.0 only when asked, each listener on its own.
    let c = parse(&["--rpc-advertise-host", "10.0.0.7", "--rpc-host", "0.0.0.0"]).unwrap();
    assert_eq!(c.network.rpc_host, "0.0.0.0");
    assert_eq!(c.network.system_host, "10.0.0.7");
    let c = parse_env(Role::Decode, &[], &[("DYN_SYSTEM_HOST", "0.0.0.0")]).unwrap();
    assert_eq!(c.network.system_host, "0.0.0.0");
    assert_eq!(c.network.rpc_host, "127.0.0.1");
}

#[test]
fn advertise_host_parts() {
    use tandem_config::worker::advertise_host_part as part;
    assert_eq!(part("10.0.0.7"), Some("10.0.0.7"));
    assert_eq!(part("10.0.0.7:5000"), Some("10.0.0.7"));
    assert_eq!(part("decode-0.tandem"), Some("decode-0.tandem"));
    assert_eq!(part("decode-0.tandem:5000"), Some("decode-0.tandem"));
    assert_eq!(part("fd00::7"), Some("fd00::7"));
    assert_eq!(part("[fd00::7]:5000"), Some("fd00::7"));
    assert_eq!(part(" "), None);
}

#[test]
fn device_takes_a_gpu_index() {
    use tandem_config::worker::DeviceChoice;
    assert_eq!(parse(&[]).unwrap().model.device, DeviceChoice::Auto);
    assert_eq!(
        parse(&["--device", "cpu"]).unwrap().model.device,
        DeviceChoice::Cpu
    );
    assert_eq!(
        parse(&["--device", "cuda"]).unwrap().model.device,
        DeviceChoice::Cuda { ordinal: 0 }
    );
    assert_eq!(
        parse(&["--device", "cuda:3"]).unwrap().model.device,
        DeviceChoice::Cuda { ordinal: 3 }
    );
    let cfg = parse_env(Role::Decode, &[], &[("DYN_TRTLLM_DEVICE", "cuda:1")]).unwrap();
    assert_eq!(cfg.model.device, DeviceChoice::Cuda { ordinal: 1 });
    for bad in ["gpu", "cuda:", "cuda:-1", "cuda:x", "cuda1"] {
        let e = err(&["--device", bad]);
        assert!(
            e.contains("--device") && e.contains(bad) && e.contains("cuda:N"),
            "{e}"
        );
    }
}

/// A flag given twice takes its last value (`tandem up` appends per-role flags after the
/// flags every worker gets).
#[test]
fn a_repeated_flag_takes_its_last_value() {
    use tandem_config::worker::DeviceChoice;
    let cfg = parse(&["--device", "cuda", "--device", "cuda:1"]).unwrap();
    assert_eq!(cfg.model.device, DeviceChoice::Cuda { ordinal: 1 });
}

/// GPU-to-GPU prefill writes leave whole after each step unless layer groups are asked for
/// (measured faster on one GPU, docs/benchmarks.md).
#[test]
fn kv_transfer_layer_groups_default_to_whole_blocks() {
    assert_eq!(
        parse(&[]).unwrap().disaggregation.kv_transfer_layer_groups,
        0
    );
    let cfg = parse(&["--kv-transfer-layer-groups", "4"]).unwrap();
    assert_eq!(cfg.disaggregation.kv_transfer_layer_groups, 4);
    assert!(err(&["--kv-transfer-layer-groups", "-1"]).contains("kv-transfer-layer-groups"));
}
