//! Builds the clap command line from the flag table and splits off the dynamic
//! `--trtllm.a.b value` flags, which clap cannot know in advance.

use crate::spec::{FlagSpec, Group, Kind, Scope};
use clap::{Arg, ArgAction, Command};

/// The command for one binary, with every flag of its scope grouped as the seed page does.
pub fn command(bin: &'static str, about: &'static str, scope: Scope) -> Command {
    let mut cmd = Command::new(bin)
        .about(about)
        .version(env!("CARGO_PKG_VERSION"))
        .args_override_self(true)
        .max_term_width(110);
    for group in Group::ALL {
        for spec in crate::flags::flags_for(scope).filter(|f| f.group == group) {
            for arg in args_for(spec) {
                cmd = cmd.arg(arg.help_heading(group.title()));
            }
        }
    }
    if scope == Scope::Worker {
        cmd = cmd.after_help(
            "Engine options can also be set one key at a time with --trtllm.<key>[.<key>...] VALUE \
             (for example --trtllm.kv_cache_config.enable_block_reuse false); these exclude \
             --override-engine-args. See docs/config.md for the merge rules.",
        );
    }
    cmd
}

fn help_text(spec: &FlagSpec) -> String {
    let mut text = spec.help.to_string();
    if let Kind::Choice(choices) = spec.kind {
        text.push_str(&format!(" [possible values: {}]", choices.join(", ")));
    }
    if spec.kind == Kind::Bool {
        text.push_str(&format!(" [negate: --{}]", spec.negated()));
    }
    if let Some(env) = spec.env {
        text.push_str(&format!(" [env: {env}]"));
    }
    text.push_str(&format!(" [default: {}]", spec.default_display()));
    text
}

fn args_for(spec: &'static FlagSpec) -> Vec<Arg> {
    let mut aliases: Vec<&'static str> = spec.aliases.to_vec();
    aliases.extend_from_slice(spec.deprecated_aliases);
    if spec.kind == Kind::Bool {
        let negated: Vec<String> = aliases.iter().map(|a| format!("no-{a}")).collect();
        let no_name = spec.negated();
        vec![
            Arg::new(spec.name)
                .long(spec.name)
                .aliases(aliases)
                .action(ArgAction::SetTrue)
                .overrides_with(no_name.clone())
                .help(help_text(spec)),
            Arg::new(no_name.clone())
                .long(no_name)
                .aliases(negated)
                .action(ArgAction::SetTrue)
                .overrides_with(spec.name)
                .hide(true),
        ]
    } else {
        let value_name = match spec.kind {
            Kind::Int { .. } => "INT",
            Kind::Float => "FLOAT",
            Kind::Path => "PATH",
            Kind::List => "LIST",
            _ => "VALUE",
        };
        vec![Arg::new(spec.name)
            .long(spec.name)
            .aliases(aliases)
            .value_name(value_name)
            .num_args(1)
            .allow_hyphen_values(true)
            .action(if spec.repeatable {
                ArgAction::Append
            } else {
                ArgAction::Set
            })
            .help(help_text(spec))]
    }
}

/// A `--trtllm.a.b value` flag: the key path and the raw value.
#[derive(Clone, Debug, PartialEq)]
pub struct DynamicFlag {
    pub path: Vec<String>,
    pub raw: String,
}

/// Removes `--trtllm.*` flags (with their values) from `args`, returning them in order.
pub fn split_dynamic_flags(args: &[String]) -> Result<(Vec<String>, Vec<DynamicFlag>), String> {
    let mut rest = Vec::with_capacity(args.len());
    let mut dynamic = Vec::new();
    let mut it = args.iter().peekable();
    while let Some(arg) = it.next() {
        let Some(key) = arg.strip_prefix("--trtllm.") else {
            rest.push(arg.clone());
            continue;
        };
        let (key, raw) = match key.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => match it.next() {
                Some(v) if !v.starts_with("--") => (key.to_string(), v.clone()),
                _ => return Err(format!("--trtllm.{key} must be followed by a value")),
            },
        };
        let path: Vec<String> = key.split('.').map(str::to_string).collect();
        if path.iter().any(String::is_empty) {
            return Err(format!("--trtllm.{key}: empty key segment"));
        }
        dynamic.push(DynamicFlag { path, raw });
    }
    Ok((rest, dynamic))
}

/// Whether the command line spells a deprecated alias of `spec` (either polarity).
pub fn uses_deprecated_alias(spec: &FlagSpec, args: &[String]) -> Option<String> {
    for alias in spec.deprecated_aliases {
        for form in [format!("--{alias}"), format!("--no-{alias}")] {
            if args
                .iter()
                .any(|a| a == &form || a.starts_with(&format!("{form}=")))
            {
                return Some(form);
            }
        }
    }
    None
}
