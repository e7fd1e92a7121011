//! The models the router serves, learned from discovery: each model's workers (from their
//! model cards) and its tokenizer and chat template, fetched from a worker over gRPC and
//! checked against the card's hash. Workers serving one model name with a different tokenizer
//! are refused loudly.
//!
//! A model's workers come in two sets: the ones that serve `Generate` (roles `agg`, `pd`,
//! `decode`: the decode side, routed on `AppState::kv`) and its prefill workers (role
//! `prefill`, routed on `AppState::prefill_kv`), which only a decode worker calls. A model
//! with prefill workers alone cannot be served.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use dashmap::DashMap;
use std::time::Duration;
use tandem_pki::ChannelSecurity;

use tandem_protocol::worker::worker_client::WorkerClient;
use tandem_protocol::worker::ModelFilesRequest;
use tandem_protocol::{ModelCard, WorkerRole};
use tandem_text::{tokenizer_hash, ChatTemplate, Tokenizer};
use tonic::transport::Channel;

use crate::health::WorkerHealth;

pub type Client = WorkerClient<Channel>;

#[derive(Clone)]
pub struct WorkerEntry {
    pub card: ModelCard,
    pub client: Client,
    /// Its health probes' verdict (see `health`): an unhealthy worker is not routed to.
    pub health: Arc<WorkerHealth>,
}

impl WorkerEntry {
    pub fn healthy(&self) -> bool {
        self.health.healthy()
    }
}

/// What tokenizing for a model needs.
pub struct ModelAssets {
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    pub hash: String,
}

struct Model {
    /// The workers that serve `Generate` (agg, pd, decode).
    workers: HashMap<u64, WorkerEntry>,
    /// The prefill workers (called by decode workers in `GenerateDisagg`).
    prefill: HashMap<u64, WorkerEntry>,
    /// What requests see of it (its name and tokenizer too), rebuilt when a worker comes or
    /// goes; requests share it.
    view: Arc<ModelView>,
}

impl Model {
    fn new(name: String, assets: Arc<ModelAssets>) -> Self {
        let view = Arc::new(ModelView {
            name,
            assets,
            workers: Vec::new(),
            prefill: Vec::new(),
        });
        Self {
            workers: HashMap::new(),
            prefill: HashMap::new(),
            view,
        }
    }

    fn renew_view(&mut self) {
        self.view = Arc::new(ModelView {
            name: self.view.name.clone(),
            assets: self.view.assets.clone(),
            workers: self.workers.values().cloned().collect(),
            prefill: self.prefill.values().cloned().collect(),
        });
    }
}

/// True for a card of a prefill-only worker.
pub fn is_prefill(card: &ModelCard) -> bool {
    card.role == WorkerRole::Prefill
}

struct Owner {
    model: String,
    prefill: bool,
}

/// The models and their workers. Sharded maps: requests read a model's shared view without
/// taking a lock over the registry, and a worker coming or going locks one shard. One change
/// takes its model's entry and its owner's entry one after the other, never both at once.
#[derive(Default)]
pub struct Registry {
    models: DashMap<String, Model>,
    /// worker id → its model name (and set), to find a worker on removal.
    owners: DashMap<u64, Owner>,
}

/// A snapshot of one model for a request.
#[derive(Clone)]
pub struct ModelView {
    pub name: String,
    pub assets: Arc<ModelAssets>,
    /// The workers that serve `Generate` (agg, pd, decode).
    pub workers: Vec<WorkerEntry>,
    /// The prefill workers.
    pub prefill: Vec<WorkerEntry>,
}

impl ModelView {
    /// The tool-call format the model's workers name (`--dyn-tool-call-parser`).
    pub fn tool_format(&self) -> Option<crate::shape::tools::ToolFormat> {
        let name = self.workers.first()?.card.tool_call_parser.as_deref()?;
        crate::shape::tools::ToolFormat::from_name(name)
    }

    /// The reasoning format the model's workers name (`--dyn-reasoning-parser`).
    pub fn reasoning_format(&self) -> Option<crate::shape::reasoning::ReasoningFormat> {
        let name = self.workers.first()?.card.reasoning_parser.as_deref()?;
        crate::shape::reasoning::ReasoningFormat::from_name(name)
    }

    /// How the model takes images, when its workers announce that it does (all of them:
    /// a model some of whose workers cannot take images is served as text-only).
    pub fn multimodal(&self) -> Option<&tandem_protocol::MultimodalCard> {
        let first = self.workers.first()?.card.multimodal.as_ref()?;
        self.workers
            .iter()
            .all(|w| w.card.multimodal.as_ref() == Some(first))
            .then_some(first)
    }
}

/// HTTP/2 pings on every router → worker connection, idle or not: a worker that stops
/// answering (a frozen process, a partitioned host) breaks its calls within interval +
/// timeout, so their requests fail or migrate instead of waiting for the request deadline.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on fetching a worker's tokenizer files.
const FETCH_ASSETS_TIMEOUT: Duration = Duration::from_secs(30);

/// A lazily connecting client of the worker at `addr`, secured as `security` says.
pub fn connect_lazy(security: &ChannelSecurity, addr: &str) -> anyhow::Result<Client> {
    let channel = security
        .endpoint(addr)?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(3))
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true)
        .connect_lazy();
    Ok(WorkerClient::new(channel)
        .max_decoding_message_size(tandem_protocol::MAX_GRPC_MESSAGE_BYTES)
        .max_encoding_message_size(tandem_protocol::MAX_GRPC_MESSAGE_BYTES))
}

fn cache_root() -> PathBuf {
    tandem_config::paths::cache_dir().join("router-tokenizers")
}

/// Fetches the tokenizer files from a worker and loads them, checking the hash.
pub async fn fetch_assets(client: &mut Client, card: &ModelCard) -> anyhow::Result<ModelAssets> {
    let mut request = tonic::Request::new(ModelFilesRequest {});
    request.set_timeout(FETCH_ASSETS_TIMEOUT);
    let files = client
        .get_model_files(request)
        .await
        .map_err(|s| anyhow::anyhow!("GetModelFiles from {}: {}", card.grpc_addr, s.message()))?
        .into_inner();
    anyhow::ensure!(
        files.tokenizer_hash == card.tokenizer_hash,
        "worker {} sent tokenizer files with hash {} but its card says {}",
        card.grpc_addr,
        files.tokenizer_hash,
        card.tokenizer_hash
    );
    let safe_hash: String = card
        .tokenizer_hash
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .collect();
    anyhow::ensure!(
        !safe_hash.is_empty(),
        "worker {} has an empty tokenizer hash",
        card.grpc_addr
    );
    let dir = cache_root().join(&safe_hash);
    let tmp = cache_root().join(format!("{safe_hash}.tmp-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&tmp)?;
    std::fs::write(tmp.join("tokenizer.json"), &files.tokenizer_json)?;
    if !files.tokenizer_config_json.is_empty() {
        std::fs::write(
            tmp.join("tokenizer_config.json"),
            &files.tokenizer_config_json,
        )?;
    }
    let tokenizer = Tokenizer::load(&tmp)?;
    let template = ChatTemplate::load(&tmp)?;
    let hash = tokenizer_hash(&tokenizer, template.as_ref());
    anyhow::ensure!(
        hash == card.tokenizer_hash,
        "tokenizer files from {} hash to {hash}, not the card's {}",
        card.grpc_addr,
        card.tokenizer_hash
    );
    // Keep one copy per hash for inspection; a concurrent writer may have won the race.
    if std::fs::rename(&tmp, &dir).is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    Ok(ModelAssets {
        tokenizer,
        template,
        hash,
    })
}

impl Registry {
    /// The model's current workers, shared (a worker that comes or goes later makes a new
    /// view; this one stays as it was).
    pub fn view(&self, name: &str) -> Option<Arc<ModelView>> {
        self.models.get(name).map(|m| m.view.clone())
    }

    pub fn model_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .models
            .iter()
            .filter(|m| !m.workers.is_empty())
            .map(|m| m.view.name.clone())
            .collect();
        names.sort();
        names
    }

    /// Workers that serve `Generate` (prefill workers are not counted: alone they serve
    /// nothing).
    pub fn worker_count(&self) -> usize {
        self.owners.iter().filter(|o| !o.prefill).count()
    }

    /// `Some(true)` for a registered prefill worker, `Some(false)` for another registered
    /// worker, `None` for an unknown id.
    pub fn is_prefill_worker(&self, id: u64) -> Option<bool> {
        self.owners.get(&id).map(|o| o.prefill)
    }

    /// The tokenizer already loaded for `card`'s model, if its hash matches.
    /// `Err` when the model is known with a different tokenizer.
    pub fn existing_assets(&self, card: &ModelCard) -> Result<Option<Arc<ModelAssets>>, String> {
        match self.models.get(&card.served_model_name) {
            None => Ok(None),
            Some(m) if m.view.assets.hash == card.tokenizer_hash => Ok(Some(m.view.assets.clone())),
            Some(m) => Err(format!(
                "worker {} serves `{}` with tokenizer hash {}, but the other workers of that model \
                 have {}; refusing it",
                card.instance_id, card.served_model_name, card.tokenizer_hash, m.view.assets.hash
            )),
        }
    }

    /// Adds a worker; returns its health, which its probe keeps.
    pub fn add(
        &self,
        card: ModelCard,
        client: Client,
        assets: Arc<ModelAssets>,
    ) -> Arc<WorkerHealth> {
        let health = Arc::new(WorkerHealth::default());
        let id = card.instance_id;
        let name = card.served_model_name.clone();
        let prefill = is_prefill(&card);
        let entry = WorkerEntry {
            card,
            client,
            health: health.clone(),
        };
        {
            let mut model = self
                .models
                .entry(name.clone())
                .or_insert_with(|| Model::new(name.clone(), assets));
            let set = if prefill {
                &mut model.prefill
            } else {
                &mut model.workers
            };
            set.insert(id, entry);
            model.renew_view();
        }
        self.owners.insert(
            id,
            Owner {
                model: name,
                prefill,
            },
        );
        health
    }

    /// Removes a worker.
    pub fn remove(&self, id: u64) -> bool {
        let Some((_, owner)) = self.owners.remove(&id) else {
            return false;
        };
        // A model whose last worker left stays known, so its requests get 503 (no worker
        // available) rather than 404 (no such model); `/v1/models` lists served models only.
        if let Some(mut m) = self.models.get_mut(&owner.model) {
            if owner.prefill {
                m.prefill.remove(&id);
            } else {
                m.workers.remove(&id);
            }
            m.renew_view();
        }
        true
    }

    /// `f` of a registered worker's entry.
    fn with_entry<R>(&self, id: u64, f: impl FnOnce(&WorkerEntry) -> R) -> Option<R> {
        let (name, prefill) = self.owners.get(&id).map(|o| (o.model.clone(), o.prefill))?;
        let m = self.models.get(&name)?;
        let set = if prefill { &m.prefill } else { &m.workers };
        set.get(&id).map(f)
    }

    /// The gRPC client of a worker, if it is registered.
    pub fn client(&self, id: u64) -> Option<Client> {
        self.with_entry(id, |w| w.client.clone())
    }

    /// The key a registered worker signs its NATS KV events with (its card's).
    pub fn event_key(&self, id: u64) -> Option<String> {
        self.with_entry(id, |w| w.card.kv_event_key.clone())
    }

    /// Every registered worker's id.
    pub fn ids(&self) -> Vec<u64> {
        self.owners.iter().map(|o| *o.key()).collect()
    }

    pub fn contains(&self, id: u64) -> bool {
        self.owners.contains_key(&id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn card(role: WorkerRole, id: u64, model: &str) -> ModelCard {
        ModelCard {
            protocol_version: tandem_protocol::WORKER_PROTOCOL_VERSION,
            served_model_name: model.into(),
            tokenizer_hash: "h".into(),
            context_length: 4096,
            kv_cache_block_size: 32,
            kv_dtype: tandem_protocol::KvDtype::Float32,
            kv_layout_id: "L".into(),
            total_kv_blocks: 100,
            max_num_seqs: 8,
            max_num_batched_tokens: 2048,
            role,
            grpc_addr: format!("127.0.0.1:{}", 9000 + id),
            http_addr: String::new(),
            instance_id: id,
            eos_token_ids: vec![],
            kv_event_key: String::new(),
            multimodal: Default::default(),
            tool_call_parser: None,
            reasoning_parser: None,
        }
    }

    fn assets() -> Arc<ModelAssets> {
        let dir =
            std::env::temp_dir().join(format!("tandem-router-models-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(
            dir.join("tokenizer.json"),
            r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
               "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,
               "decoder":null,"model":{"type":"WordLevel","vocab":{"a":0,"<unk>":1},
               "unk_token":"<unk>"}}"#,
        )
        .expect("write");
        let tokenizer = Tokenizer::load(&dir).expect("tokenizer");
        let _ = std::fs::remove_dir_all(&dir);
        Arc::new(ModelAssets {
            tokenizer,
            template: None,
            hash: "h".into(),
        })
    }

    #[tokio::test]
    async fn prefill_workers_are_kept_apart() {
        let r = Registry::default();
        let a = assets();
        let client = || connect_lazy(&ChannelSecurity::Plaintext, "127.0.0.1:1").expect("client");
        r.add(card(WorkerRole::Prefill, 1, "m"), client(), a.clone());
        // Prefill workers alone serve nothing: known (503, not 404) but not listed or counted.
        let v = r.view("m").expect("known");
        assert!(v.workers.is_empty());
        assert_eq!(v.prefill.len(), 1);
        assert!(r.model_names().is_empty());
        assert_eq!(r.worker_count(), 0);
        assert_eq!(r.is_prefill_worker(1), Some(true));
        assert!(r.contains(1) && r.client(1).is_some());

        r.add(card(WorkerRole::Pd, 2, "m"), client(), a.clone());
        let v = r.view("m").expect("known");
        assert_eq!(v.workers.len(), 1);
        assert_eq!(v.workers[0].card.instance_id, 2);
        assert_eq!(v.prefill[0].card.instance_id, 1);
        assert_eq!(r.model_names(), vec!["m".to_string()]);
        assert_eq!(r.worker_count(), 1);
        assert_eq!(r.is_prefill_worker(2), Some(false));
        assert_eq!(r.is_prefill_worker(3), None);

        assert!(r.remove(1));
        assert!(!r.remove(1));
        let v = r.view("m").expect("known");
        assert!(v.prefill.is_empty());
        assert_eq!(v.workers.len(), 1);
        assert!(!r.contains(1) && r.client(1).is_none());
    }
}
