//! The shape of one flag definition. Every flag of every role is one `FlagSpec` in
//! [`crate::flags::FLAGS`]; the CLI, environment handling, `--help`, `docs/config.md` and the
//! table-driven tests are all generated from that one list.

/// Which processes accept a flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Every Tandem process (router, workers and planner).
    All,
    /// Engine workers only (prefill, decode, encode).
    Worker,
    /// The HTTP router only.
    Router,
    /// The planner only.
    Planner,
}

/// `--help` section, in the order of the seed page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Group {
    ModelLoading,
    Parallelism,
    BatchAndSequenceLimits,
    KvCacheAndEvents,
    EngineArgsPassthrough,
    DisaggregationAndMultimodal,
    GuidedDecoding,
    Diffusion,
    DiffusionRequestDefaults,
    Router,
    Planner,
    Runtime,
}

impl Group {
    pub const ALL: [Group; 12] = [
        Group::ModelLoading,
        Group::Parallelism,
        Group::BatchAndSequenceLimits,
        Group::KvCacheAndEvents,
        Group::EngineArgsPassthrough,
        Group::DisaggregationAndMultimodal,
        Group::GuidedDecoding,
        Group::Diffusion,
        Group::DiffusionRequestDefaults,
        Group::Router,
        Group::Planner,
        Group::Runtime,
    ];

    pub fn title(self) -> &'static str {
        match self {
            Group::ModelLoading => "Model loading",
            Group::Parallelism => "Parallelism",
            Group::BatchAndSequenceLimits => "Batch and sequence limits",
            Group::KvCacheAndEvents => "KV cache and events",
            Group::EngineArgsPassthrough => "Engine args passthrough",
            Group::DisaggregationAndMultimodal => "Disaggregation and multimodal",
            Group::GuidedDecoding => "Guided decoding",
            Group::Diffusion => "Diffusion (experimental)",
            Group::DiffusionRequestDefaults => "Diffusion request defaults (experimental)",
            Group::Router => "Router",
            Group::Planner => "Planner",
            Group::Runtime => "Runtime",
        }
    }
}

/// Value type of a flag, which decides how CLI and env strings are parsed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    /// Negatable boolean: `--x` / `--no-x`; env accepts true/1/yes/on and false/0/no/off.
    Bool,
    /// Integer that must be at least `min`.
    Int { min: i64 },
    /// Floating-point number.
    Float,
    /// Free-form string.
    Str,
    /// Filesystem path.
    Path,
    /// One of a fixed set of strings.
    Choice(&'static [&'static str]),
    /// Comma- or whitespace-separated list of strings.
    List,
}

/// One flag: its names, env vars, default, help text and type.
#[derive(Clone, Copy, Debug)]
pub struct FlagSpec {
    /// Canonical long name without the leading dashes, e.g. `max-batch-size`.
    pub name: &'static str,
    /// Other accepted long names (no dashes).
    pub aliases: &'static [&'static str],
    /// Deprecated long names: accepted, with a warning that names the replacement.
    pub deprecated_aliases: &'static [&'static str],
    /// Environment variable consulted when the flag is absent from the command line.
    pub env: Option<&'static str>,
    /// Deprecated environment variable, honoured (with a warning) only when `env` is unset.
    pub deprecated_env: Option<&'static str>,
    pub kind: Kind,
    /// Default as the user would type it; `None` means unset.
    pub default: Option<&'static str>,
    /// How the default reads in help when it is not a plain value.
    pub default_note: Option<&'static str>,
    pub group: Group,
    pub scope: Scope,
    pub help: &'static str,
    /// A list flag that may be given several times on the command line (the values add up).
    pub repeatable: bool,
}

impl FlagSpec {
    pub const fn new(name: &'static str, kind: Kind, group: Group, help: &'static str) -> Self {
        FlagSpec {
            name,
            aliases: &[],
            deprecated_aliases: &[],
            env: None,
            deprecated_env: None,
            kind,
            default: None,
            default_note: None,
            group,
            scope: Scope::Worker,
            help,
            repeatable: false,
        }
    }
    pub const fn env(mut self, var: &'static str) -> Self {
        self.env = Some(var);
        self
    }
    pub const fn default(mut self, value: &'static str) -> Self {
        self.default = Some(value);
        self
    }
    pub const fn default_note(mut self, note: &'static str) -> Self {
        self.default_note = Some(note);
        self
    }
    pub const fn aliases(mut self, names: &'static [&'static str]) -> Self {
        self.aliases = names;
        self
    }
    pub const fn deprecated(
        mut self,
        names: &'static [&'static str],
        env: Option<&'static str>,
    ) -> Self {
        self.deprecated_aliases = names;
        self.deprecated_env = env;
        self
    }
    pub const fn scope(mut self, scope: Scope) -> Self {
        self.scope = scope;
        self
    }

    pub const fn repeatable(mut self) -> Self {
        self.repeatable = true;
        self
    }

    pub fn is_bool(&self) -> bool {
        matches!(self.kind, Kind::Bool)
    }

    /// The `--no-` spelling of a boolean flag.
    pub fn negated(&self) -> String {
        format!("no-{}", self.name)
    }

    /// Human-readable type for help and docs.
    pub fn type_name(&self) -> String {
        match self.kind {
            Kind::Bool => "bool".into(),
            Kind::Int { .. } => "int".into(),
            Kind::Float => "float".into(),
            Kind::Str => "string".into(),
            Kind::Path => "path".into(),
            Kind::Choice(c) => c.join("|"),
            Kind::List => "list".into(),
        }
    }

    pub fn default_display(&self) -> String {
        if let Some(note) = self.default_note {
            return note.to_string();
        }
        match self.default {
            Some("") => "\"\"".into(),
            Some(v) => v.into(),
            None => "unset".into(),
        }
    }
}
