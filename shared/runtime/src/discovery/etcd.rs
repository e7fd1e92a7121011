//! Discovery in etcd: the same key layout as the other backends, with both keys of an instance
//! attached to one lease. The owner keeps the lease alive (every third of the TTL); if the
//! process dies the lease expires and etcd deletes the keys, which every watcher sees as a
//! delete. Watches start at the revision of the initial listing, so nothing falls in between,
//! and re-list after any watch failure (compaction, lost connection).

use super::tracker::Tracker;
use super::{
    BoxFuture, Discovery, DiscoveryError, DiscoveryEvent, DiscoveryWatch, Entry, Instance,
    Registration, RegistrationInner, Result, DEFAULT_TTL, INSTANCES_BUCKET, MDC_BUCKET,
};
use etcd_client::{
    Client, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchOptions,
};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

#[derive(Clone, Debug)]
pub struct EtcdOptions {
    /// Lease TTL (rounded up to whole seconds; etcd's minimum is a few seconds).
    pub ttl: Duration,
    /// Bound on connecting and on every unary call, so a dead etcd fails fast instead of
    /// hanging startup or shutdown.
    pub request_timeout: Duration,
    /// Pause before retrying after a broken keep-alive or watch stream.
    pub retry_delay: Duration,
    /// The deployment's identity for etcd's TLS; plaintext when `None`.
    pub tls: Option<tandem_pki::InternalIdentity>,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        Self {
            ttl: DEFAULT_TTL,
            request_timeout: Duration::from_secs(5),
            retry_delay: Duration::from_millis(500),
            tls: None,
        }
    }
}

impl EtcdOptions {
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Reach etcd over TLS as this identity (every endpoint must then be https://).
    pub fn with_tls(mut self, tls: Option<tandem_pki::InternalIdentity>) -> Self {
        self.tls = tls;
        self
    }

    /// The client options: TLS with the deployment's certificate when there is one. Endpoints
    /// must agree: all https:// with TLS, none without.
    fn connect_options(&self, endpoints: &[String]) -> Result<ConnectOptions> {
        let timeout = self.request_timeout;
        // No per-request gRPC deadline in ConnectOptions: it would also cut the long-lived
        // watch and keep-alive streams. Calls are bounded individually instead.
        let opts = ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_keep_alive(Duration::from_secs(10), timeout);
        let https = |e: &String| e.to_ascii_lowercase().starts_with("https://");
        match &self.tls {
            Some(id) => {
                if let Some(e) = endpoints.iter().find(|e| !https(e)) {
                    return Err(DiscoveryError::PlaintextEtcd(e.clone()));
                }
                Ok(opts.with_tls(id.client_tls()))
            }
            None => match endpoints.iter().find(|e| https(e)) {
                Some(e) => Err(DiscoveryError::EtcdTlsWithoutIdentity(e.clone())),
                None => Ok(opts),
            },
        }
    }

    fn ttl_secs(&self) -> i64 {
        let secs = self.ttl.as_secs() + u64::from(self.ttl.subsec_nanos() > 0);
        i64::try_from(secs.max(1)).unwrap_or(i64::MAX)
    }

    /// Keep-alive period: a third of the TTL, so two lost beats still leave time to recover.
    fn keep_alive_period(&self) -> Duration {
        (Duration::from_secs(self.ttl_secs().unsigned_abs()) / 3).max(Duration::from_millis(300))
    }
}

#[derive(Clone)]
pub struct EtcdDiscovery {
    client: Client,
    endpoints: Vec<String>,
    opts: Arc<EtcdOptions>,
}

impl EtcdDiscovery {
    /// Connects and checks that etcd answers, within `opts.request_timeout`.
    pub async fn connect(endpoints: &[String], opts: EtcdOptions) -> Result<Self> {
        let timeout = opts.request_timeout;
        let endpoints = endpoints.to_vec();
        let timed_out = || DiscoveryError::EtcdTimeout {
            endpoints: endpoints.clone(),
            timeout,
        };
        let connect_opts = opts.connect_options(&endpoints)?;
        let mut client =
            tokio::time::timeout(timeout, Client::connect(&endpoints, Some(connect_opts)))
                .await
                .map_err(|_| timed_out())??;
        tokio::time::timeout(timeout, client.status())
            .await
            .map_err(|_| timed_out())??;
        Ok(Self {
            client,
            endpoints,
            opts: Arc::new(opts),
        })
    }

    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// The underlying client, for callers that need etcd beyond discovery.
    pub fn client(&self) -> Client {
        self.client.clone()
    }
}

async fn bounded<T>(
    opts: &EtcdOptions,
    fut: impl std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
) -> Result<T> {
    match tokio::time::timeout(opts.request_timeout, fut).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(DiscoveryError::EtcdRequestTimeout(opts.request_timeout)),
    }
}

/// What a registration needs to (re)create its keys.
struct Record {
    instance_key: String,
    mdc_key: String,
    instance_json: Vec<u8>,
    /// Replaced by `update_card`; a re-registration after a lost lease uses the latest.
    card_json: std::sync::Mutex<Vec<u8>>,
}

impl Record {
    fn card(&self) -> Vec<u8> {
        self.card_json
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// Grants a lease and writes both keys under it in one transaction, so a watcher never sees
/// one without the other for longer than a single revision.
async fn put_with_new_lease(client: &mut Client, opts: &EtcdOptions, rec: &Record) -> Result<i64> {
    let lease = bounded(opts, client.lease_grant(opts.ttl_secs(), None))
        .await?
        .id();
    let put = |k: &str, v: &[u8]| TxnOp::put(k, v, Some(PutOptions::new().with_lease(lease)));
    let txn = Txn::new().and_then(vec![
        put(&rec.mdc_key, &rec.card()),
        put(&rec.instance_key, &rec.instance_json),
    ]);
    if let Err(err) = bounded(opts, client.txn(txn)).await {
        // Do not leave an orphan lease behind; it would expire anyway, so errors are moot.
        let _ = bounded(opts, client.lease_revoke(lease)).await;
        return Err(err);
    }
    Ok(lease)
}

enum KeepAliveEnd {
    /// etcd says the lease no longer exists (expired while we were cut off).
    LeaseLost,
    Failed(DiscoveryError),
}

/// Refreshes `lease` until something goes wrong.
async fn keep_alive(client: &mut Client, opts: &EtcdOptions, lease: i64) -> KeepAliveEnd {
    let (mut keeper, mut stream) = match bounded(opts, client.lease_keep_alive(lease)).await {
        Ok(pair) => pair,
        Err(err) => return KeepAliveEnd::Failed(err),
    };
    let mut tick = tokio::time::interval(opts.keep_alive_period());
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Err(err) = keeper.keep_alive().await {
            return KeepAliveEnd::Failed(err.into());
        }
        match tokio::time::timeout(opts.request_timeout, stream.message()).await {
            Ok(Ok(Some(resp))) if resp.ttl() <= 0 => return KeepAliveEnd::LeaseLost,
            Ok(Ok(Some(_))) => {}
            Ok(Ok(None)) => return KeepAliveEnd::Failed(DiscoveryError::Closed),
            Ok(Err(err)) => return KeepAliveEnd::Failed(err.into()),
            Err(_) => {
                return KeepAliveEnd::Failed(DiscoveryError::EtcdRequestTimeout(
                    opts.request_timeout,
                ))
            }
        }
    }
}

/// Keeps a registration alive for as long as the task runs. If the lease is lost (the process
/// was partitioned from etcd longer than the TTL), the keys are written again under a new
/// lease: the instance is still serving, so it should become visible again.
async fn keep_registered(
    mut client: Client,
    opts: Arc<EtcdOptions>,
    rec: Arc<Record>,
    lease: Arc<AtomicI64>,
) {
    loop {
        let current = lease.load(Ordering::SeqCst);
        match keep_alive(&mut client, &opts, current).await {
            KeepAliveEnd::LeaseLost => {
                tracing::warn!(key = %rec.instance_key, "etcd lease expired; registering again");
                register_again(&mut client, &opts, &rec, &lease).await;
            }
            // A failed keep-alive on a lease etcd no longer has (it expired while this process
            // was cut off) would fail for ever: register again instead.
            KeepAliveEnd::Failed(_) if lease_expired(&mut client, &opts, current).await => {
                tracing::warn!(key = %rec.instance_key, "etcd lease expired; registering again");
                register_again(&mut client, &opts, &rec, &lease).await;
            }
            KeepAliveEnd::Failed(err) => {
                tracing::warn!(%err, key = %rec.instance_key, "etcd keep-alive interrupted; retrying");
                tokio::time::sleep(opts.retry_delay).await;
            }
        }
    }
}

/// Writes the record again under a new lease, retrying until etcd takes it.
async fn register_again(client: &mut Client, opts: &EtcdOptions, rec: &Record, lease: &AtomicI64) {
    loop {
        match put_with_new_lease(client, opts, rec).await {
            Ok(new) => {
                lease.store(new, Ordering::SeqCst);
                return;
            }
            Err(err) => {
                tracing::warn!(%err, "etcd re-registration failed; retrying");
                tokio::time::sleep(opts.retry_delay).await;
            }
        }
    }
}

/// Whether etcd answers that `lease` no longer exists (its TimeToLive reports TTL -1 for an
/// unknown lease). False when etcd cannot be asked.
async fn lease_expired(client: &mut Client, opts: &EtcdOptions, lease: i64) -> bool {
    matches!(
        bounded(opts, client.lease_time_to_live(lease, None)).await,
        Ok(resp) if resp.ttl() <= 0
    )
}

struct EtcdRegistration {
    client: Client,
    opts: Arc<EtcdOptions>,
    rec: Arc<Record>,
    lease: Arc<AtomicI64>,
    task: JoinHandle<()>,
}

async fn revoke(mut client: Client, opts: Arc<EtcdOptions>, lease: i64) -> Result<()> {
    match bounded(&opts, client.lease_revoke(lease)).await {
        Ok(_) => Ok(()),
        // Already expired: the keys are gone, which is what was asked for.
        Err(_) if lease_expired(&mut client, &opts, lease).await => Ok(()),
        Err(e) => Err(e),
    }
}

impl RegistrationInner for EtcdRegistration {
    fn update_card(&self, card: serde_json::Value) -> BoxFuture<'static, Result<()>> {
        let mut client = self.client.clone();
        let opts = self.opts.clone();
        let rec = self.rec.clone();
        let lease = self.lease.clone();
        Box::pin(async move {
            let json = serde_json::to_vec(&card)?;
            *rec.card_json.lock().unwrap_or_else(|p| p.into_inner()) = json.clone();
            let put_opts = PutOptions::new().with_lease(lease.load(Ordering::SeqCst));
            bounded(&opts, client.put(rec.mdc_key.clone(), json, Some(put_opts))).await?;
            Ok(())
        })
    }
    fn deregister(self: Box<Self>) -> BoxFuture<'static, Result<()>> {
        self.task.abort();
        let lease = self.lease.load(Ordering::SeqCst);
        Box::pin(revoke(self.client, self.opts, lease))
    }

    fn remove_now(self: Box<Self>) {
        self.task.abort();
        let lease = self.lease.load(Ordering::SeqCst);
        // Drop cannot await; without a runtime the lease simply expires after the TTL.
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                if let Err(err) = revoke(self.client, self.opts, lease).await {
                    tracing::warn!(%err, "revoking etcd lease on drop");
                }
            });
        }
    }

    fn abandon(self: Box<Self>) {
        self.task.abort();
    }
}

fn prefixes(namespace: &str) -> [String; 2] {
    [
        format!("{INSTANCES_BUCKET}/{namespace}/"),
        format!("{MDC_BUCKET}/{namespace}/"),
    ]
}

/// Both buckets of a namespace at one revision; returns the snapshot and that revision.
async fn snapshot(
    client: &mut Client,
    opts: &EtcdOptions,
    namespace: &str,
) -> Result<(Tracker, i64)> {
    let [inst_prefix, mdc_prefix] = prefixes(namespace);
    let first = bounded(
        opts,
        client.get(inst_prefix, Some(GetOptions::new().with_prefix())),
    )
    .await?;
    let revision = first.header().map(|h| h.revision()).unwrap_or(0);
    let mut get_opts = GetOptions::new().with_prefix();
    if revision > 0 {
        get_opts = get_opts.with_revision(revision);
    }
    let second = bounded(opts, client.get(mdc_prefix, Some(get_opts))).await?;
    let mut tracker = Tracker::default();
    let kvs = first.kvs().iter().chain(second.kvs());
    tracker.replace_all(kvs.filter_map(|kv| Some((kv.key_str().ok()?, kv.value()))));
    Ok((tracker, revision))
}

/// Follows both buckets from `from_revision` until a stream breaks or the receiver goes away.
/// Returns `true` when the watcher should stop for good.
async fn follow(
    client: &mut Client,
    namespace: &str,
    from_revision: i64,
    tracker: &mut Tracker,
    tx: &mpsc::UnboundedSender<DiscoveryEvent>,
) -> Result<bool> {
    let [inst_prefix, mdc_prefix] = prefixes(namespace);
    let opts = || {
        WatchOptions::new()
            .with_prefix()
            .with_start_revision(from_revision)
    };
    let mut w1 = client.watch(inst_prefix, Some(opts())).await?;
    let mut w2 = client.watch(mdc_prefix, Some(opts())).await?;
    loop {
        let msg = tokio::select! {
            _ = tx.closed() => return Ok(true),
            m = w1.message() => m,
            m = w2.message() => m,
        };
        let Some(resp) = msg? else {
            return Err(DiscoveryError::Closed);
        };
        if resp.canceled() || resp.compact_revision() > 0 {
            // Compacted past our revision or cancelled by the server: re-list.
            return Err(DiscoveryError::Closed);
        }
        for ev in resp.events() {
            let Some(kv) = ev.kv() else { continue };
            let Ok(key) = kv.key_str() else { continue };
            match ev.event_type() {
                EventType::Put => tracker.put(key, kv.value()),
                EventType::Delete => tracker.delete(key),
            }
        }
        for ev in tracker.flush() {
            if tx.send(ev).is_err() {
                return Ok(true);
            }
        }
    }
}

impl Discovery for EtcdDiscovery {
    fn register(
        &self,
        instance: Instance,
        card: serde_json::Value,
    ) -> BoxFuture<'_, Result<Registration>> {
        Box::pin(async move {
            instance.validate()?;
            let rec = Arc::new(Record {
                instance_key: instance.instance_key(),
                mdc_key: instance.mdc_key(),
                instance_json: serde_json::to_vec(&instance)?,
                card_json: std::sync::Mutex::new(serde_json::to_vec(&card)?),
            });
            let mut client = self.client.clone();
            let lease = put_with_new_lease(&mut client, &self.opts, &rec).await?;
            let lease = Arc::new(AtomicI64::new(lease));
            let task = tokio::spawn(keep_registered(
                client.clone(),
                self.opts.clone(),
                rec.clone(),
                lease.clone(),
            ));
            let inner = EtcdRegistration {
                client,
                opts: self.opts.clone(),
                rec,
                lease,
                task,
            };
            Ok(Registration::new(instance, Box::new(inner)))
        })
    }

    fn list<'a>(
        &'a self,
        namespace: &'a str,
        component: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Vec<Entry>>> {
        Box::pin(async move {
            super::validate_name("namespace", namespace)?;
            let mut client = self.client.clone();
            let (tracker, _) = snapshot(&mut client, &self.opts, namespace).await?;
            Ok(tracker.entries(component))
        })
    }

    fn watch<'a>(&'a self, namespace: &'a str) -> BoxFuture<'a, Result<DiscoveryWatch>> {
        Box::pin(async move {
            super::validate_name("namespace", namespace)?;
            let mut client = self.client.clone();
            let opts = self.opts.clone();
            let namespace = namespace.to_string();
            let (mut tracker, mut revision) = snapshot(&mut client, &opts, &namespace).await?;
            let (tx, rx) = mpsc::unbounded_channel();
            for ev in tracker.flush() {
                let _ = tx.send(ev);
            }
            tokio::spawn(async move {
                loop {
                    match follow(&mut client, &namespace, revision + 1, &mut tracker, &tx).await {
                        Ok(true) => return,
                        Ok(false) => {}
                        Err(err) => {
                            tracing::warn!(%err, %namespace, "etcd watch broken; re-listing")
                        }
                    }
                    // Re-list until etcd answers; the diff against what we already reported
                    // becomes the next events, so nothing is lost or repeated.
                    loop {
                        tokio::select! {
                            _ = tx.closed() => return,
                            _ = tokio::time::sleep(opts.retry_delay) => {}
                        }
                        match snapshot(&mut client, &opts, &namespace).await {
                            Ok((fresh, rev)) => {
                                tracker.adopt(fresh);
                                revision = rev;
                                break;
                            }
                            Err(err) => tracing::warn!(%err, "etcd re-list failed; retrying"),
                        }
                    }
                    for ev in tracker.flush() {
                        if tx.send(ev).is_err() {
                            return;
                        }
                    }
                }
            });
            Ok(DiscoveryWatch::new(rx))
        })
    }
}
