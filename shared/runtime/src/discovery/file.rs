//! Discovery for one machine without a server: a folder laid out like the etcd keys.
//!
//! `{root}/v1/instances/{ns}/{comp}/{ep}/{id:x}` and `{root}/v1/mdc/{ns}/{comp}/{ep}/{id:x}`
//! hold JSON, always written to a temporary file and renamed into place, so a reader sees a
//! whole record or none. Liveness is the file's modification time: the owner rewrites both
//! files every `heartbeat` (a third of the TTL); anyone scanning the folder treats a file older
//! than `ttl` as left behind by a dead process and deletes it. So a `kill -9`'d worker vanishes
//! within the TTL, and a stalled owner that lost its files recreates them on its next beat.
//!
//! Watchers poll the folder (default every 300 ms): a scan is a few `readdir`s and small reads,
//! cheap next to any inotify machinery, and it works on every filesystem.

use super::tracker::Tracker;
use super::{
    BoxFuture, Discovery, DiscoveryError, DiscoveryWatch, Entry, Instance, Registration,
    RegistrationInner, Result, DEFAULT_TTL, INSTANCES_BUCKET, MDC_BUCKET,
};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// `$DYN_FILE_KV` if set, else `$TMPDIR/tandem_store_kv`.
pub fn default_root() -> PathBuf {
    match std::env::var_os("DYN_FILE_KV") {
        Some(v) if !v.is_empty() => PathBuf::from(v),
        _ => std::env::temp_dir().join("tandem_store_kv"),
    }
}

#[derive(Clone, Debug)]
pub struct FileOptions {
    pub root: PathBuf,
    /// Files older than this are considered abandoned.
    pub ttl: Duration,
    /// How often an owner refreshes its files.
    pub heartbeat: Duration,
    /// How often a watcher rescans.
    pub poll_interval: Duration,
}

impl FileOptions {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            ttl: DEFAULT_TTL,
            heartbeat: DEFAULT_TTL / 3,
            poll_interval: Duration::from_millis(300),
        }
    }

    /// Sets the TTL and a heartbeat of a third of it, so two beats may be missed (a busy
    /// machine, a slow disk) before the entry expires.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self.heartbeat = (ttl / 3).max(Duration::from_millis(50));
        self
    }

    pub fn with_poll_interval(mut self, poll_interval: Duration) -> Self {
        self.poll_interval = poll_interval.max(Duration::from_millis(10));
        self
    }
}

#[derive(Clone)]
pub struct FileDiscovery {
    opts: Arc<FileOptions>,
}

impl FileDiscovery {
    pub fn new(opts: FileOptions) -> Result<Self> {
        std::fs::create_dir_all(&opts.root).map_err(|source| DiscoveryError::Io {
            path: opts.root.clone(),
            source,
        })?;
        Ok(Self {
            opts: Arc::new(opts),
        })
    }

    pub fn root(&self) -> &Path {
        &self.opts.root
    }
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> DiscoveryError + '_ {
    move |source| DiscoveryError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `bytes` to `path` via a temporary sibling and a rename (atomic on POSIX).
fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no parent"))?;
    std::fs::create_dir_all(dir)?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("entry");
    // Dot-prefixed so scanners skip it; pid + counter so concurrent writers never collide.
    let tmp = dir.join(format!(
        ".{name}.{}.{}.tmp",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

fn remove_if_exists(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

struct Owned {
    /// `false` once deregistered or abandoned.
    live: bool,
    card_json: Vec<u8>,
}

struct Shared {
    /// Held while writing or removing, so a heartbeat can never re-create files after the
    /// registration removed them, nor write a stale card over a new one.
    owned: Mutex<Owned>,
    instance_path: PathBuf,
    mdc_path: PathBuf,
    instance_json: Vec<u8>,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Owned> {
        self.owned.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn write_files(&self, owned: &Owned) -> io::Result<()> {
        // Card first: a scanner that sees the instance file can then also read the card.
        write_atomic(&self.mdc_path, &owned.card_json)?;
        write_atomic(&self.instance_path, &self.instance_json)
    }

    fn beat(&self) {
        let owned = self.lock();
        if owned.live {
            if let Err(err) = self.write_files(&owned) {
                tracing::warn!(path = %self.instance_path.display(), %err, "discovery heartbeat failed");
            }
        }
    }

    fn update_card(&self, card_json: Vec<u8>) -> Result<()> {
        let mut owned = self.lock();
        if !owned.live {
            return Err(DiscoveryError::Closed);
        }
        owned.card_json = card_json;
        self.write_files(&owned).map_err(io_err(&self.mdc_path))
    }

    fn remove(&self) -> Result<()> {
        let mut owned = self.lock();
        owned.live = false;
        // Instance first: without it the entry is gone for every reader.
        remove_if_exists(&self.instance_path).map_err(io_err(&self.instance_path))?;
        remove_if_exists(&self.mdc_path).map_err(io_err(&self.mdc_path))
    }
}

struct FileRegistration {
    shared: Arc<Shared>,
    heartbeat: JoinHandle<()>,
}

impl RegistrationInner for FileRegistration {
    fn update_card(&self, card: serde_json::Value) -> BoxFuture<'static, Result<()>> {
        let result = serde_json::to_vec(&card)
            .map_err(DiscoveryError::from)
            .and_then(|json| self.shared.update_card(json));
        Box::pin(async move { result })
    }
    fn deregister(self: Box<Self>) -> BoxFuture<'static, Result<()>> {
        self.heartbeat.abort();
        let result = self.shared.remove();
        Box::pin(async move { result })
    }
    fn remove_now(self: Box<Self>) {
        self.heartbeat.abort();
        if let Err(err) = self.shared.remove() {
            tracing::warn!(%err, "removing discovery files on drop");
        }
    }
    fn abandon(self: Box<Self>) {
        self.heartbeat.abort();
        self.shared.lock().live = false;
    }
}

/// Reads every live key of `namespace` and deletes abandoned files on the way.
fn scan(opts: &FileOptions, namespace: &str) -> io::Result<Vec<(String, Vec<u8>)>> {
    let now = SystemTime::now();
    let mut out = Vec::new();
    for bucket in [INSTANCES_BUCKET, MDC_BUCKET] {
        let ns_dir = opts.root.join(bucket).join(namespace);
        for comp in read_dir_names(&ns_dir)? {
            let comp_dir = ns_dir.join(&comp);
            for ep in read_dir_names(&comp_dir)? {
                let ep_dir = comp_dir.join(&ep);
                for id in read_dir_names(&ep_dir)? {
                    let path = ep_dir.join(&id);
                    let modified = match std::fs::metadata(&path).and_then(|m| m.modified()) {
                        Ok(t) => t,
                        Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                        Err(e) => return Err(e),
                    };
                    // A time in the future (clock step) reads as fresh, never as expired.
                    let age = now.duration_since(modified).unwrap_or_default();
                    if age > opts.ttl {
                        tracing::info!(path = %path.display(), ?age, "removing expired discovery entry");
                        remove_if_exists(&path)?;
                        continue;
                    }
                    if id.starts_with('.') {
                        continue; // a temporary file still being written
                    }
                    match std::fs::read(&path) {
                        Ok(bytes) => {
                            out.push((format!("{bucket}/{namespace}/{comp}/{ep}/{id}"), bytes))
                        }
                        Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                        Err(e) => return Err(e),
                    }
                }
            }
        }
    }
    Ok(out)
}

/// UTF-8 entry names of `dir`; a missing folder is empty.
fn read_dir_names(dir: &Path) -> io::Result<Vec<String>> {
    let iter = match std::fs::read_dir(dir) {
        Ok(it) => it,
        Err(e)
            if e.kind() == io::ErrorKind::NotFound || e.kind() == io::ErrorKind::NotADirectory =>
        {
            return Ok(Vec::new())
        }
        Err(e) => return Err(e),
    };
    let mut names = Vec::new();
    for entry in iter {
        let entry = entry?;
        if let Ok(name) = entry.file_name().into_string() {
            names.push(name);
        }
    }
    Ok(names)
}

async fn scan_async(opts: Arc<FileOptions>, namespace: String) -> Result<Vec<(String, Vec<u8>)>> {
    let root = opts.root.clone();
    tokio::task::spawn_blocking(move || scan(&opts, &namespace))
        .await
        .map_err(|_| DiscoveryError::Closed)?
        .map_err(|source| DiscoveryError::Io { path: root, source })
}

fn tracker_from(kvs: &[(String, Vec<u8>)]) -> Tracker {
    let mut t = Tracker::default();
    t.replace_all(kvs.iter().map(|(k, v)| (k.as_str(), v.as_slice())));
    t
}

impl Discovery for FileDiscovery {
    fn register(
        &self,
        instance: Instance,
        card: serde_json::Value,
    ) -> BoxFuture<'_, Result<Registration>> {
        Box::pin(async move {
            instance.validate()?;
            let shared = Arc::new(Shared {
                owned: Mutex::new(Owned {
                    live: true,
                    card_json: serde_json::to_vec(&card)?,
                }),
                instance_path: self.opts.root.join(instance.instance_key()),
                mdc_path: self.opts.root.join(instance.mdc_key()),
                instance_json: serde_json::to_vec(&instance)?,
            });
            shared
                .write_files(&shared.lock())
                .map_err(io_err(&shared.instance_path))?;
            let beat = shared.clone();
            let period = self.opts.heartbeat;
            // Plain file writes of a few hundred bytes: done inline on the runtime rather than
            // via spawn_blocking, which could finish after an abort and resurrect the files.
            let heartbeat = tokio::spawn(async move {
                let mut tick = tokio::time::interval(period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                tick.tick().await;
                loop {
                    tick.tick().await;
                    beat.beat();
                }
            });
            Ok(Registration::new(
                instance,
                Box::new(FileRegistration { shared, heartbeat }),
            ))
        })
    }

    fn list<'a>(
        &'a self,
        namespace: &'a str,
        component: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Vec<Entry>>> {
        Box::pin(async move {
            super::validate_name("namespace", namespace)?;
            let kvs = scan_async(self.opts.clone(), namespace.to_string()).await?;
            Ok(tracker_from(&kvs).entries(component))
        })
    }

    fn watch<'a>(&'a self, namespace: &'a str) -> BoxFuture<'a, Result<DiscoveryWatch>> {
        Box::pin(async move {
            super::validate_name("namespace", namespace)?;
            let opts = self.opts.clone();
            let namespace = namespace.to_string();
            // The first scan happens here so that errors (unreadable root) reach the caller and
            // the initial set is queued before this returns.
            let kvs = scan_async(opts.clone(), namespace.clone()).await?;
            let mut tracker = tracker_from(&kvs);
            let (tx, rx) = mpsc::unbounded_channel();
            for ev in tracker.flush() {
                let _ = tx.send(ev);
            }
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = tx.closed() => return,
                        _ = tokio::time::sleep(opts.poll_interval) => {}
                    }
                    match scan_async(opts.clone(), namespace.clone()).await {
                        Ok(kvs) => {
                            tracker
                                .replace_all(kvs.iter().map(|(k, v)| (k.as_str(), v.as_slice())));
                            for ev in tracker.flush() {
                                if tx.send(ev).is_err() {
                                    return;
                                }
                            }
                        }
                        // Keep the last known view: a transient error must not look like
                        // every worker leaving at once.
                        Err(err) => tracing::warn!(%err, "discovery folder scan failed"),
                    }
                }
            });
            Ok(DiscoveryWatch::new(rx))
        })
    }
}
