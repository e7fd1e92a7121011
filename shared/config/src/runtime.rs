//! Cross-cutting runtime flags shared by every process (Dynamo's `DynamoRuntimeArgGroup`, with
//! Tandem's discovery, event-plane and request-plane values).

use crate::endpoint::EndpointAddr;
use crate::error::ConfigError;
use crate::resolve::{EnvLookup, Resolved};
use crate::worker::Get;
use serde::Serialize;
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DiscoveryBackend {
    Mem,
    File,
    Etcd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EventPlane {
    Direct,
    Nats,
}

/// Runtime settings; worker-only fields are `None`/empty on the router.
#[derive(Clone, Debug, Serialize)]
pub struct RuntimeConfig {
    pub namespace: String,
    pub endpoint: Option<EndpointAddr>,
    pub discovery_backend: DiscoveryBackend,
    pub file_kv_root: PathBuf,
    pub etcd_endpoints: Vec<String>,
    pub request_plane: String,
    pub event_plane: EventPlane,
    pub nats_server: String,
    pub connector: Vec<String>,
    pub dyn_tool_call_parser: Option<String>,
    pub dyn_reasoning_parser: Option<String>,
    pub exclude_tools_when_tool_choice_none: bool,
    pub custom_jinja_template: Option<PathBuf>,
    pub endpoint_types: Vec<String>,
    pub dump_config_to: Option<PathBuf>,
    pub multimodal_embedding_cache_capacity_gb: f64,
    pub output_modalities: Vec<String>,
    pub media_output_fs_url: String,
    pub media_output_http_url: Option<String>,
    pub engine_request_limit: Option<u32>,
    pub drain_timeout_secs: u32,
    /// The deployment's mutual-TLS folder (`--internal-tls-dir`).
    pub internal_tls_dir: Option<PathBuf>,
    /// `--insecure-internal`: plaintext internal channels (never together with a TLS folder).
    pub insecure_internal: bool,
}

impl RuntimeConfig {
    pub(crate) fn from_resolved(
        resolved: &Resolved,
        is_worker: bool,
        env: EnvLookup<'_>,
    ) -> Result<Self, ConfigError> {
        let g = Get(resolved);
        let mut namespace = g.string("namespace")?;
        if is_worker {
            if let Some(suffix) = env("DYN_NAMESPACE_WORKER_SUFFIX").filter(|s| !s.is_empty()) {
                namespace = format!("{namespace}-{suffix}");
            }
        }
        let endpoint =
            match g.opt_string("endpoint")? {
                None => None,
                Some(text) => Some(EndpointAddr::parse(&text).map_err(|reason| {
                    ConfigError::InvalidValue {
                        origin: resolved.origin("endpoint"),
                        value: text,
                        reason,
                    }
                })?),
            };
        let tmp = std::env::temp_dir();
        let custom_jinja_template = match g.opt_string("custom-jinja-template")? {
            None => None,
            Some(raw) => {
                let path = PathBuf::from(expand_path(&raw, env));
                if !path.is_file() {
                    return Err(ConfigError::InvalidValue {
                        origin: resolved.origin("custom-jinja-template"),
                        value: raw,
                        reason: format!("file {} not found", path.display()),
                    });
                }
                Some(path)
            }
        };
        Ok(RuntimeConfig {
            namespace,
            endpoint,
            discovery_backend: match g.string("discovery-backend")?.as_str() {
                "mem" => DiscoveryBackend::Mem,
                "etcd" => DiscoveryBackend::Etcd,
                _ => DiscoveryBackend::File,
            },
            file_kv_root: g
                .opt_string("file-kv-root")?
                .map(PathBuf::from)
                .unwrap_or_else(|| tmp.join("tandem_store_kv")),
            etcd_endpoints: g.list("etcd-endpoints")?,
            request_plane: g.string("request-plane")?,
            event_plane: match g.string("event-plane")?.as_str() {
                "nats" => EventPlane::Nats,
                _ => EventPlane::Direct,
            },
            nats_server: g.string("nats-server")?,
            connector: if is_worker {
                g.list("connector")?
            } else {
                vec![]
            },
            dyn_tool_call_parser: g.opt_string("dyn-tool-call-parser")?,
            dyn_reasoning_parser: g.opt_string("dyn-reasoning-parser")?,
            exclude_tools_when_tool_choice_none: !is_worker
                || g.bool("exclude-tools-when-tool-choice-none")?,
            custom_jinja_template,
            endpoint_types: if is_worker {
                g.list("endpoint-types")?
            } else {
                vec![]
            },
            dump_config_to: g.opt_string("dump-config-to")?.map(PathBuf::from),
            multimodal_embedding_cache_capacity_gb: if is_worker {
                g.f64("multimodal-embedding-cache-capacity-gb")?
            } else {
                0.0
            },
            output_modalities: if is_worker {
                g.list("output-modalities")?
            } else {
                vec![]
            },
            media_output_fs_url: g
                .opt_string("media-output-fs-url")?
                .unwrap_or_else(|| format!("file://{}", tmp.join("dynamo_media").display())),
            media_output_http_url: g.opt_string("media-output-http-url")?,
            engine_request_limit: g.opt_u32("engine-request-limit")?,
            drain_timeout_secs: g.u32("drain-timeout-secs")?,
            internal_tls_dir: internal_tls_dir(resolved, env)?,
            insecure_internal: g.bool("insecure-internal")?,
        })
    }

    /// The TLS folder internal channels must use, `None` when the operator chose plaintext;
    /// an error when neither was chosen (a process that serves or dials internal channels
    /// calls this before doing so).
    pub fn internal_tls(&self) -> Result<Option<&std::path::Path>, ConfigError> {
        match (&self.internal_tls_dir, self.insecure_internal) {
            (Some(dir), _) => Ok(Some(dir)),
            (None, true) => Ok(None),
            (None, false) => Err(ConfigError::Invalid(
                "internal channels are authenticated by default: pass --internal-tls-dir DIR \
                 (TANDEM_INTERNAL_TLS_DIR; make one with `tandem certs --out DIR`) or, on one \
                 trusted host only, --insecure-internal"
                    .into(),
            )),
        }
    }
}

/// `--internal-tls-dir`, checked against `--insecure-internal`: exactly one of them.
fn internal_tls_dir(
    resolved: &Resolved,
    env: EnvLookup<'_>,
) -> Result<Option<PathBuf>, ConfigError> {
    let g = Get(resolved);
    let insecure = g.bool("insecure-internal")?;
    match (g.opt_string("internal-tls-dir")?, insecure) {
        (Some(raw), false) => {
            let path = PathBuf::from(expand_path(&raw, env));
            if !path.is_dir() {
                return Err(ConfigError::InvalidValue {
                    origin: resolved.origin("internal-tls-dir"),
                    value: raw,
                    reason: format!(
                        "folder {} not found (make one with `tandem certs --out DIR`)",
                        path.display()
                    ),
                });
            }
            Ok(Some(path))
        }
        (None, _) => Ok(None),
        (Some(_), true) => Err(ConfigError::Invalid(format!(
            "{} and {} contradict each other: pass one",
            resolved.origin("internal-tls-dir"),
            resolved.origin("insecure-internal")
        ))),
    }
}

/// Expands a leading `~` and `$VAR` / `${VAR}` references (unknown variables expand to "").
pub fn expand_path(raw: &str, env: EnvLookup<'_>) -> String {
    let mut text = raw.to_string();
    if text == "~" || text.starts_with("~/") {
        if let Some(home) = env("HOME") {
            text = format!("{home}{}", &text[1..]);
        }
    }
    let mut out = String::with_capacity(text.len());
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        if chars[i] == '$' {
            let braced = chars.get(i + 1) == Some(&'{');
            let start = if braced { i + 2 } else { i + 1 };
            let mut end = start;
            while end < chars.len() && (chars[end].is_ascii_alphanumeric() || chars[end] == '_') {
                end += 1;
            }
            let closed = !braced || chars.get(end) == Some(&'}');
            if end > start && closed {
                let name: String = chars[start..end].iter().collect();
                out.push_str(&env(&name).unwrap_or_default());
                i = if braced { end + 1 } else { end };
                continue;
            }
        }
        out.push(chars[i]);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_expand_home_and_variables() {
        let env = |k: &str| match k {
            "HOME" => Some("/home/u".to_string()),
            "DIR" => Some("tpl".to_string()),
            _ => None,
        };
        assert_eq!(
            expand_path("~/a/$DIR/${DIR}.jinja", &env),
            "/home/u/a/tpl/tpl.jinja"
        );
        assert_eq!(expand_path("/x/$NOPE/y", &env), "/x//y");
        assert_eq!(expand_path("/cost$", &env), "/cost$");
    }
}
