//! Router settings: the fields behind the router flags (docs/config.md), with Dynamo's defaults.
//!
//! This is a plain struct; the config crate owns the flags and env vars and fills it in. Field
//! names follow the flags' destination names (`--router-track-active-blocks` →
//! `router_track_active_blocks`, with the two exceptions Dynamo itself makes:
//! `--router-kv-overlap-score-weight` → `overlap_score_weight`, `--router-kv-events` →
//! `use_kv_events`); serde also accepts the short spellings without `router_`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// `--router-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RouterMode {
    #[default]
    RoundRobin,
    Random,
    PowerOfTwo,
    Kv,
    Direct,
    LeastLoaded,
    /// Accepted by the parser for compatibility; selecting with it fails clearly.
    DeviceAwareWeighted,
}

impl RouterMode {
    pub const ALL: [RouterMode; 7] = [
        RouterMode::RoundRobin,
        RouterMode::Random,
        RouterMode::PowerOfTwo,
        RouterMode::Kv,
        RouterMode::Direct,
        RouterMode::LeastLoaded,
        RouterMode::DeviceAwareWeighted,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RouterMode::RoundRobin => "round-robin",
            RouterMode::Random => "random",
            RouterMode::PowerOfTwo => "power-of-two",
            RouterMode::Kv => "kv",
            RouterMode::Direct => "direct",
            RouterMode::LeastLoaded => "least-loaded",
            RouterMode::DeviceAwareWeighted => "device-aware-weighted",
        }
    }
}

impl fmt::Display for RouterMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for RouterMode {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RouterMode::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| ConfigError::UnknownRouterMode(s.to_string()))
    }
}

/// `--router-queue-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QueuePolicy {
    #[default]
    Fcfs,
    Wspt,
}

/// `--router-prefill-load-model`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrefillLoadModel {
    #[default]
    None,
    Aic,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("unknown router mode {0:?} (expected one of round-robin, random, power-of-two, kv, direct, least-loaded, device-aware-weighted)")]
    UnknownRouterMode(String),
    #[error("{field} must be {rule}, got {value}")]
    OutOfRange {
        field: &'static str,
        rule: &'static str,
        value: f64,
    },
    #[error("{0}")]
    Conflict(&'static str),
}

/// Settings of the KV-aware router. `Option` thresholds: `None` disables that check.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvRouterConfig {
    pub router_mode: RouterMode,
    /// Weight of prefill blocks against decode blocks in the cost; 0 disables the indexer.
    pub overlap_score_weight: f64,
    pub router_temperature: f64,
    pub use_kv_events: bool,
    #[serde(alias = "durable_kv_events")]
    pub router_durable_kv_events: bool,
    #[serde(alias = "replica_sync")]
    pub router_replica_sync: bool,
    #[serde(alias = "track_active_blocks")]
    pub router_track_active_blocks: bool,
    #[serde(alias = "track_output_blocks")]
    pub router_track_output_blocks: bool,
    #[serde(alias = "assume_kv_reuse")]
    pub router_assume_kv_reuse: bool,
    #[serde(alias = "track_prefill_tokens")]
    pub router_track_prefill_tokens: bool,
    #[serde(alias = "prefill_load_model")]
    pub router_prefill_load_model: PrefillLoadModel,
    #[serde(alias = "snapshot_threshold")]
    pub router_snapshot_threshold: Option<u64>,
    #[serde(alias = "reset_states")]
    pub router_reset_states: bool,
    /// Approximate mode (`use_kv_events = false`): lifetime of predicted blocks.
    #[serde(alias = "ttl_secs")]
    pub router_ttl_secs: f64,
    #[serde(alias = "max_tree_size")]
    pub router_max_tree_size: usize,
    #[serde(alias = "prune_target_ratio")]
    pub router_prune_target_ratio: f64,
    /// Fraction of `max_num_batched_tokens`; above it on every worker, requests queue.
    pub router_queue_threshold: Option<f64>,
    #[serde(alias = "event_threads")]
    pub router_event_threads: u32,
    #[serde(alias = "queue_policy")]
    pub router_queue_policy: QueuePolicy,
    /// Busy when active decode blocks exceed this fraction of the worker's KV blocks.
    pub active_decode_blocks_threshold: Option<f64>,
    /// Busy when active prefill tokens exceed this many tokens.
    pub active_prefill_tokens_threshold: Option<u64>,
    /// Busy when active prefill tokens exceed this multiple of `max_num_batched_tokens`.
    pub active_prefill_tokens_threshold_frac: Option<f64>,
    /// Requests older than this are freed by [`crate::ActiveSequences::expire_stale`]
    /// (upstream `DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS`).
    pub active_request_expiry_secs: u64,
}

impl Default for KvRouterConfig {
    fn default() -> Self {
        Self {
            router_mode: RouterMode::RoundRobin,
            overlap_score_weight: 1.0,
            router_temperature: 0.0,
            use_kv_events: true,
            router_durable_kv_events: false,
            router_replica_sync: false,
            router_track_active_blocks: true,
            router_track_output_blocks: false,
            router_assume_kv_reuse: true,
            router_track_prefill_tokens: true,
            router_prefill_load_model: PrefillLoadModel::None,
            router_snapshot_threshold: Some(1_000_000),
            router_reset_states: false,
            router_ttl_secs: 120.0,
            router_max_tree_size: 1 << 20,
            router_prune_target_ratio: 0.8,
            router_queue_threshold: Some(4.0),
            router_event_threads: 4,
            router_queue_policy: QueuePolicy::Fcfs,
            active_decode_blocks_threshold: Some(1.0),
            active_prefill_tokens_threshold: Some(10_000_000),
            active_prefill_tokens_threshold_frac: Some(10.0),
            active_request_expiry_secs: 300,
        }
    }
}

impl KvRouterConfig {
    /// The checks of Dynamo's `validate_kv_router_config` plus value ranges.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let non_neg = |field, value: f64| {
            if value >= 0.0 && value.is_finite() {
                Ok(())
            } else {
                Err(ConfigError::OutOfRange {
                    field,
                    rule: ">= 0",
                    value,
                })
            }
        };
        non_neg("overlap_score_weight", self.overlap_score_weight)?;
        non_neg("router_temperature", self.router_temperature)?;
        non_neg("router_ttl_secs", self.router_ttl_secs)?;
        if let Some(v) = self.active_decode_blocks_threshold {
            non_neg("active_decode_blocks_threshold", v)?;
        }
        if let Some(v) = self.active_prefill_tokens_threshold_frac {
            non_neg("active_prefill_tokens_threshold_frac", v)?;
        }
        if let Some(v) = self.router_queue_threshold {
            non_neg("router_queue_threshold", v)?;
        }
        if !(0.0..=1.0).contains(&self.router_prune_target_ratio) {
            return Err(ConfigError::OutOfRange {
                field: "router_prune_target_ratio",
                rule: "in [0, 1]",
                value: self.router_prune_target_ratio,
            });
        }
        if self.router_event_threads < 1 {
            return Err(ConfigError::OutOfRange {
                field: "router_event_threads",
                rule: ">= 1",
                value: f64::from(self.router_event_threads),
            });
        }
        if self.router_durable_kv_events && !self.use_kv_events {
            return Err(ConfigError::Conflict(
                "--router-durable-kv-events requires --router-kv-events",
            ));
        }
        if self.router_track_output_blocks && !self.router_track_active_blocks {
            return Err(ConfigError::Conflict(
                "--router-track-output-blocks requires --router-track-active-blocks",
            ));
        }
        if self.router_prefill_load_model == PrefillLoadModel::Aic
            && (!self.router_track_prefill_tokens || self.router_queue_policy != QueuePolicy::Fcfs)
        {
            return Err(ConfigError::Conflict(
                "--router-prefill-load-model aic requires --router-track-prefill-tokens and --router-queue-policy fcfs",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_dynamos() {
        let c = KvRouterConfig::default();
        assert_eq!(c.router_mode, RouterMode::RoundRobin);
        assert_eq!(c.overlap_score_weight, 1.0);
        assert_eq!(c.router_temperature, 0.0);
        assert!(c.use_kv_events && c.router_track_active_blocks && c.router_assume_kv_reuse);
        assert!(c.router_track_prefill_tokens && !c.router_track_output_blocks);
        assert_eq!(c.active_decode_blocks_threshold, Some(1.0));
        assert_eq!(c.active_prefill_tokens_threshold, Some(10_000_000));
        assert_eq!(c.active_prefill_tokens_threshold_frac, Some(10.0));
        assert_eq!(c.router_queue_threshold, Some(4.0));
        assert_eq!(c.router_max_tree_size, 1 << 20);
        c.validate().unwrap();
    }

    #[test]
    fn router_mode_names() {
        for m in RouterMode::ALL {
            assert_eq!(m.as_str().parse::<RouterMode>(), Ok(m));
            let j = serde_json::to_string(&m).unwrap();
            assert_eq!(j, format!("\"{m}\""));
        }
        assert!("kv-aware".parse::<RouterMode>().is_err());
    }

    #[test]
    fn serde_accepts_short_names_and_rejects_unknown() {
        let c: KvRouterConfig = serde_json::from_str(
            r#"{"router_mode":"kv","track_active_blocks":false,"router_temperature":0.5,
                "active_prefill_tokens_threshold":null}"#,
        )
        .unwrap();
        assert_eq!(c.router_mode, RouterMode::Kv);
        assert!(!c.router_track_active_blocks);
        assert_eq!(c.active_prefill_tokens_threshold, None);
        assert!(serde_json::from_str::<KvRouterConfig>(r#"{"nope":1}"#).is_err());
    }

    #[test]
    fn validation_rules() {
        let bad = |f: fn(&mut KvRouterConfig)| {
            let mut c = KvRouterConfig::default();
            f(&mut c);
            c.validate().unwrap_err()
        };
        bad(|c| c.overlap_score_weight = -1.0);
        bad(|c| c.router_temperature = f64::NAN);
        bad(|c| c.router_prune_target_ratio = 1.5);
        bad(|c| c.router_event_threads = 0);
        bad(|c| {
            c.use_kv_events = false;
            c.router_durable_kv_events = true;
        });
        bad(|c| {
            c.router_track_active_blocks = false;
            c.router_track_output_blocks = true;
        });
        let e = bad(|c| {
            c.router_prefill_load_model = PrefillLoadModel::Aic;
            c.router_queue_policy = QueuePolicy::Wspt;
        });
        assert!(e.to_string().contains("aic"));
    }
}
