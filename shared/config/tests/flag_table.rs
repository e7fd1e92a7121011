//! Table-driven tests over every flag of the table: CLI name, aliases, env var, default,
//! precedence (CLI over env over default) and negation.

use std::collections::HashMap;
use tandem_config::flags::FLAGS;
use tandem_config::resolve::resolve;
use tandem_config::spec::{FlagSpec, Kind, Scope};
use tandem_config::values::{parse_value, Source, Value};
use tandem_config::{planner_command, router_command, worker_command, Role};

fn run(
    scope: Scope,
    args: &[&str],
    env: &HashMap<String, String>,
) -> tandem_config::resolve::Resolved {
    let mut argv = vec!["bin".to_string()];
    argv.extend(args.iter().map(|s| s.to_string()));
    let lookup = |k: &str| env.get(k).cloned();
    let cmd = command(scope);
    resolve(cmd, scope, &argv, &lookup).unwrap_or_else(|e| panic!("{args:?} {env:?}: {e}"))
}

fn command(scope: Scope) -> clap::Command {
    match scope {
        Scope::Router => router_command(),
        Scope::Planner => planner_command(),
        _ => worker_command(Role::Decode),
    }
}

fn scope_of(spec: &FlagSpec) -> Scope {
    match spec.scope {
        Scope::Router => Scope::Router,
        Scope::Planner => Scope::Planner,
        _ => Scope::Worker,
    }
}

/// Two distinct valid values (env, cli) for a flag.
fn samples(spec: &FlagSpec) -> (String, String) {
    match spec.kind {
        Kind::Bool => ("true".into(), "false".into()),
        Kind::Int { min } => ((min + 6).to_string(), (min + 9).to_string()),
        Kind::Float => ("0.25".into(), "0.5".into()),
        Kind::Str | Kind::Path => ("from-env".into(), "from-cli".into()),
        Kind::Choice(c) => (c[0].to_string(), c[c.len() - 1].to_string()),
        Kind::List => ("a,b".into(), "c".into()),
    }
}

fn expected(spec: &FlagSpec, raw: &str) -> Value {
    parse_value(spec, raw).unwrap_or_else(|e| panic!("--{}: sample {raw:?}: {e}", spec.name))
}

#[test]
fn every_default_parses_and_is_what_an_empty_command_line_resolves_to() {
    for spec in FLAGS {
        let r = run(scope_of(spec), &[], &HashMap::new());
        let want = spec.default.map(|d| expected(spec, d));
        assert_eq!(r.get(spec.name).cloned(), want, "--{}", spec.name);
        assert_eq!(
            r.source(spec.name),
            Some(&Source::Default),
            "--{}",
            spec.name
        );
    }
}

#[test]
fn every_env_var_is_read_and_the_command_line_wins_over_it() {
    for spec in FLAGS {
        let Some(var) = spec.env else { continue };
        let (env_raw, cli_raw) = samples(spec);
        let env = HashMap::from([(var.to_string(), env_raw.clone())]);
        let r = run(scope_of(spec), &[], &env);
        assert_eq!(r.get(spec.name), Some(&expected(spec, &env_raw)), "{var}");
        assert_eq!(r.source(spec.name), Some(&Source::Env(var)), "{var}");

        let flag = format!("--{}", spec.name);
        let args: Vec<String> = if spec.kind == Kind::Bool {
            // env says true; the negated flag must win.
            vec![format!("--{}", spec.negated())]
        } else {
            vec![flag.clone(), cli_raw.clone()]
        };
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let r = run(scope_of(spec), &args, &env);
        assert_eq!(
            r.get(spec.name),
            Some(&expected(spec, &cli_raw)),
            "{flag} over {var}"
        );
        assert_eq!(r.source(spec.name), Some(&Source::Cli), "{flag}");
    }
}

#[test]
fn every_env_var_follows_dynamo_naming() {
    for spec in FLAGS {
        let Some(var) = spec.env else { continue };
        let upper = spec.name.to_uppercase().replace('-', "_");
        let ok = var == format!("DYN_TRTLLM_{upper}")
            || var == format!("DYN_{upper}")
            || [
                "DYN_TRTLLM_MODEL",
                "DYN_ENGINE_CONV_AFFINITY",
                "DYN_ENGINE_CONV_AFFINITY_DP_RANK_SOURCE",
                "DYN_FILE_KV",
                "ETCD_ENDPOINTS",
                "NATS_SERVER",
                "DYN_TOOL_CALL_PARSER",
                "DYN_REASONING_PARSER",
                "DYN_ENGINE_REQUEST_LIMIT",
                "DYN_TCP_RPC_HOST",
                "DYN_TCP_RPC_PORT",
                "DYN_TCP_RPC_ADVERTISE_HOST",
                "DYN_ROUTER_USE_KV_EVENTS",
                // Dynamo's media-fetch SSRF guard.
                "DYN_MM_ALLOW_INTERNAL",
                // Several keys in one variable (Tandem's; Dynamo has no API keys).
                "TANDEM_API_KEYS",
                // Internal channel security (Tandem's own).
                "TANDEM_INTERNAL_TLS_DIR",
                "TANDEM_INSECURE_INTERNAL",
                // Per-key cache isolation (Tandem's own).
                "TANDEM_CACHE_SALT_PER_API_KEY",
                // The Docker CLI's own variable (the planner's docker actuator).
                "DOCKER_HOST",
            ]
            .contains(&var);
        assert!(ok, "--{} uses env var {var}", spec.name);
    }
}

#[test]
fn every_boolean_is_negatable_and_the_last_spelling_wins() {
    for spec in FLAGS.iter().filter(|s| s.is_bool()) {
        let on = format!("--{}", spec.name);
        let off = format!("--{}", spec.negated());
        let scope = scope_of(spec);
        let env = HashMap::new();
        assert_eq!(
            run(scope, &[&on], &env).get(spec.name),
            Some(&Value::Bool(true)),
            "{on}"
        );
        assert_eq!(
            run(scope, &[&off], &env).get(spec.name),
            Some(&Value::Bool(false)),
            "{off}"
        );
        assert_eq!(
            run(scope, &[&on, &off], &env).get(spec.name),
            Some(&Value::Bool(false)),
            "{on} {off}"
        );
        assert_eq!(
            run(scope, &[&off, &on], &env).get(spec.name),
            Some(&Value::Bool(true)),
            "{off} {on}"
        );
        if let Some(var) = spec.env {
            for (raw, want) in [
                ("YES", true),
                ("on", true),
                ("1", true),
                ("Off", false),
                ("no", false),
                ("0", false),
            ] {
                let env = HashMap::from([(var.to_string(), raw.to_string())]);
                assert_eq!(
                    run(scope, &[], &env).get(spec.name),
                    Some(&Value::Bool(want)),
                    "{var}={raw}"
                );
            }
        }
    }
}

#[test]
fn every_alias_sets_the_canonical_field() {
    for spec in FLAGS {
        for alias in spec.aliases.iter().chain(spec.deprecated_aliases) {
            let (_, cli_raw) = samples(spec);
            let flag = format!("--{alias}");
            let args: Vec<&str> = if spec.is_bool() {
                vec![&flag]
            } else {
                vec![&flag, &cli_raw]
            };
            let r = run(scope_of(spec), &args, &HashMap::new());
            let want = if spec.is_bool() {
                Value::Bool(true)
            } else {
                expected(spec, &cli_raw)
            };
            assert_eq!(r.get(spec.name), Some(&want), "{flag}");
        }
    }
}

#[test]
fn bad_env_values_name_the_variable() {
    for spec in FLAGS {
        let Some(var) = spec.env else { continue };
        let bad = match spec.kind {
            Kind::Bool => "maybe",
            Kind::Int { .. } | Kind::Float => "not-a-number",
            Kind::Choice(_) => "no-such-choice",
            _ => continue,
        };
        let env = HashMap::from([(var.to_string(), bad.to_string())]);
        let lookup = |k: &str| env.get(k).cloned();
        let cmd = command(scope_of(spec));
        let err = resolve(cmd, scope_of(spec), &["bin".to_string()], &lookup)
            .unwrap_err()
            .to_string();
        assert!(err.contains(var) && err.contains(bad), "{var}: {err}");
    }
}

#[test]
fn help_lists_every_worker_flag_under_its_group() {
    let help = worker_command(Role::Decode).render_long_help().to_string();
    for spec in FLAGS
        .iter()
        .filter(|s| s.scope == Scope::All || s.scope == Scope::Worker)
    {
        assert!(
            help.contains(&format!("--{}", spec.name)),
            "--{} missing from --help",
            spec.name
        );
    }
    for title in [
        "Model loading",
        "Parallelism",
        "Batch and sequence limits",
        "KV cache and events",
        "Engine args passthrough",
        "Disaggregation and multimodal",
        "Guided decoding",
        "Diffusion (experimental)",
        "Diffusion request defaults (experimental)",
        "Runtime",
    ] {
        assert!(
            help.contains(&format!("{title}:")),
            "group {title} missing from --help"
        );
    }
    assert!(
        help.contains("built-in tiny model"),
        "--model-path default not explained"
    );
}
