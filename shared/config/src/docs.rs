//! Generates `docs/config.md` from the flag table, so the reference never drifts from the code.

use crate::engine_options::EngineOptions;
use crate::spec::{Group, Scope};
use std::fmt::Write;

const INTRO: &str = "# Configuration reference

_Generated from `shared/config/src/flags.rs` by `cargo test -p tandem-config` with
`UPDATE_DOCS=1`; a test fails when this file is stale._

Every flag is also an environment variable. The command line wins over the environment, the
environment over the default. Boolean flags are negatable (`--x` / `--no-x`); boolean
environment values accept `true/1/yes/on` and `false/0/no/off` in any case, and anything else is
an error naming the variable. `--print-config` prints the resolved configuration and engine
options as JSON and exits; `--dump-config-to FILE` writes the same JSON at start-up.

Worker binaries (`tandem-prefill`, `tandem-decode`, `tandem-encode`) accept every flag below
except the Router and Planner groups; `tandem-router` accepts the Router and the shared Runtime
flags, `tandem-planner` the Planner and the shared Runtime flags.
`tandem-prefill` and `tandem-encode` fix their `--disaggregation-mode`; `tandem-decode` defaults
to `decode` and also accepts `agg` and `pd`. The legacy `prefill_and_decode` is accepted as `agg`
with a deprecation warning.

## Engine options and their merge rules

The engine's options use TensorRT-LLM's LLM-API key names. They are built in three layers, each
**deep-merged** over the one before (objects merge key by key; scalars and lists replace):

1. the flags (`--max-batch-size` → `max_batch_size`, `--free-gpu-memory-fraction` →
   `kv_cache_config.free_gpu_memory_fraction`, ...);
2. `--extra-engine-args FILE.yaml`;
3. `--override-engine-args` (JSON, or a Python dict literal such as
   `{'kv_cache_config': {'enable_block_reuse': False}}`) **or** the dynamic
   `--trtllm.<key>[.<key>...] VALUE` flags (values are read as none/null, int, float, bool, else
   string). The two forms of layer 3 are mutually exclusive.

Unlike Dynamo, a YAML `kv_cache_config:` block does not discard `--free-gpu-memory-fraction`:
the two merge, and only keys the YAML names change. When a later layer changes a value set
explicitly by a flag or env var, a warning names both. Unknown keys are reported by name and
ignored (a warning), or rejected with `--strict-engine-args`. A value of the wrong type is an
error naming its key path. TensorRT-LLM options that Tandem does not implement yet (for example
`speculative_config`, `lora_config`) are rejected with \"not implemented yet\".
";

/// The whole reference page.
pub fn config_markdown() -> String {
    let mut out = String::from(INTRO);
    let defaults = serde_json::to_string_pretty(&EngineOptions::default()).unwrap_or_default();
    let _ = write!(
        out,
        "\nDefault engine options (before any flag):\n\n```json\n{defaults}\n```\n"
    );
    for group in Group::ALL {
        let flags: Vec<_> = crate::flags::FLAGS
            .iter()
            .filter(|f| f.group == group)
            .collect();
        if flags.is_empty() {
            continue;
        }
        let _ = write!(
            out,
            "\n## {}\n\n| Flag | Env var | Type | Default | Description |\n|---|---|---|---|---|\n",
            group.title()
        );
        for f in flags {
            let mut names = format!("`--{}`", f.name);
            if f.is_bool() {
                let _ = write!(names, " / `--{}`", f.negated());
            }
            for a in f.aliases {
                let _ = write!(names, "<br>alias `--{a}`");
            }
            for a in f.deprecated_aliases {
                let _ = write!(names, "<br>deprecated `--{a}`");
            }
            let mut env = f
                .env
                .map(|e| format!("`{e}`"))
                .unwrap_or_else(|| "-".into());
            if let Some(old) = f.deprecated_env {
                let _ = write!(env, "<br>deprecated `{old}`");
            }
            let scope = match f.scope {
                Scope::All => " (all processes)",
                Scope::Router => " (router)",
                Scope::Planner => " (planner)",
                Scope::Worker => "",
            };
            let _ = writeln!(
                out,
                "| {names} | {env} | {} | {} | {}{scope} |",
                f.type_name().replace('|', "\\|"),
                f.default_display(),
                f.help.replace('|', "\\|")
            );
        }
    }
    out.push_str("\n## Not implemented yet\n\nThese flags exist for compatibility; a non-default value exits at start-up with a\n\"not implemented yet\" message naming the flag.\n\n");
    for (name, what) in crate::validate::NOT_IMPLEMENTED_FLAGS {
        let _ = writeln!(out, "- `--{name}`: {what}");
    }
    for (name, what) in crate::validate::ROUTER_NOT_IMPLEMENTED_FLAGS {
        let _ = writeln!(out, "- `--{name}` (router): {what}");
    }
    out.push_str("- every flag of the Diffusion groups: diffusion models\n- `--connector kvbm`: KV connectors\n");
    out.push_str("- engine options: `tensor_parallel_size` above 1 with `--device cuda`, `pipeline_parallel_size` and `moe_expert_parallel_size` above 1, `enable_attention_dp`, `guided_decoding_backend`, `scheduler_config.capacity_scheduler_policy: STATIC_BATCH`, `cache_transceiver_config.backend` NIXL or MPI\n");
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn docs_config_md_is_current() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/config.md");
        let fresh = super::config_markdown();
        if std::env::var_os("UPDATE_DOCS").is_some() {
            std::fs::write(&path, &fresh).expect("write docs/config.md");
        }
        let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            on_disk == fresh,
            "docs/config.md is stale: run `UPDATE_DOCS=1 cargo test -p tandem-config docs` and commit it"
        );
    }
}
