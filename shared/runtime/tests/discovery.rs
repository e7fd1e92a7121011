//! Discovery contract against every backend, with real etcd for the `etcd` backend, plus
//! crash behaviour: an owner that stops heartbeating (or is SIGKILLed) disappears within the
//! TTL.

use serde_json::json;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;
use tandem_runtime::discovery::etcd::{EtcdDiscovery, EtcdOptions};
use tandem_runtime::discovery::file::{FileDiscovery, FileOptions};
use tandem_runtime::discovery::mem::MemDiscovery;
use tandem_runtime::discovery::{
    new_instance_id, Discovery, DiscoveryEvent, DiscoveryWatch, Instance,
};
use tandem_test_support::{wait_until, EtcdServer, TempDir};

const EVENT_TIMEOUT: Duration = Duration::from_secs(10);
const CHILD_ENV: &str = "TANDEM_RUNTIME_CRASH_CHILD";

fn instance(ns: &str, comp: &str, role: &str) -> Instance {
    Instance {
        namespace: ns.into(),
        component: comp.into(),
        endpoint: "generate".into(),
        instance_id: new_instance_id(),
        grpc_addr: "127.0.0.1:50051".into(),
        http_addr: Some("127.0.0.1:9090".into()),
        role: role.into(),
    }
}

fn unique_ns(tag: &str) -> String {
    format!("t-{tag}-{:x}", new_instance_id())
}

async fn next(w: &mut DiscoveryWatch) -> DiscoveryEvent {
    tokio::time::timeout(EVENT_TIMEOUT, w.recv())
        .await
        .expect("discovery event within timeout")
        .expect("watch still open")
}

fn added_id(ev: &DiscoveryEvent) -> u64 {
    match ev {
        DiscoveryEvent::Added { instance, .. } => instance.instance_id,
        other => panic!("expected Added, got {other:?}"),
    }
}

/// register / list / watch / deregister / drop, the same for every backend.
async fn contract(d: Arc<dyn Discovery>) {
    let ns = unique_ns("contract");
    let mut w = d.watch(&ns).await.unwrap();

    let a = instance(&ns, "backend", "decode");
    let b = instance(&ns, "prefill", "prefill");
    let ra = d
        .register(a.clone(), json!({"name": "a", "kv_block_size": 32}))
        .await
        .unwrap();
    let rb = d.register(b.clone(), json!({"name": "b"})).await.unwrap();
    assert_eq!(ra.instance(), &a);

    let mut seen = vec![added_id(&next(&mut w).await), added_id(&next(&mut w).await)];
    seen.sort();
    let mut want = vec![a.instance_id, b.instance_id];
    want.sort();
    assert_eq!(seen, want);

    let all = d.list(&ns, None).await.unwrap();
    assert_eq!(all.len(), 2);
    let only_prefill = d.list(&ns, Some("prefill")).await.unwrap();
    assert_eq!(only_prefill.len(), 1);
    assert_eq!(only_prefill[0].instance, b);
    assert_eq!(only_prefill[0].card, json!({"name": "b"}));

    // A late watcher starts with the current set, cards included.
    let mut late = d.watch(&ns).await.unwrap();
    let mut initial = Vec::new();
    for _ in 0..2 {
        match next(&mut late).await {
            DiscoveryEvent::Added { instance, card } => initial.push((instance, card)),
            other => panic!("expected Added, got {other:?}"),
        }
    }
    assert!(initial.contains(&(a.clone(), json!({"name": "a", "kv_block_size": 32}))));

    // Other namespaces are invisible.
    let other_ns = unique_ns("other");
    let _elsewhere = d
        .register(instance(&other_ns, "backend", "agg"), json!({}))
        .await
        .unwrap();

    ra.deregister().await.unwrap();
    assert_eq!(
        next(&mut w).await,
        DiscoveryEvent::Removed {
            instance_id: a.instance_id
        }
    );
    assert_eq!(
        next(&mut late).await,
        DiscoveryEvent::Removed {
            instance_id: a.instance_id
        }
    );
    assert_eq!(d.list(&ns, None).await.unwrap().len(), 1);

    drop(rb);
    assert_eq!(
        next(&mut w).await,
        DiscoveryEvent::Removed {
            instance_id: b.instance_id
        }
    );
    assert!(d.list(&ns, None).await.unwrap().is_empty());

    // A card update reaches watchers as an upsert.
    let c = instance(&ns, "backend", "agg");
    let rc = d.register(c.clone(), json!({"v": 1})).await.unwrap();
    assert_eq!(added_id(&next(&mut w).await), c.instance_id);
    rc.update_card(json!({"v": 2})).await.unwrap();
    match next(&mut w).await {
        DiscoveryEvent::Added { instance, card } => {
            assert_eq!(instance, c);
            assert_eq!(card, json!({"v": 2}));
        }
        other => panic!("expected Added, got {other:?}"),
    }
    assert_eq!(d.list(&ns, None).await.unwrap()[0].card, json!({"v": 2}));
    rc.deregister().await.unwrap();
    assert_eq!(
        next(&mut w).await,
        DiscoveryEvent::Removed {
            instance_id: c.instance_id
        }
    );
    // Nothing else trails behind (e.g. a heartbeat resurrecting the entry or an old card).
    let quiet = tokio::time::timeout(Duration::from_millis(500), w.recv()).await;
    assert!(quiet.is_err(), "unexpected event {quiet:?}");
}

#[tokio::test]
async fn mem_contract() {
    contract(Arc::new(MemDiscovery::new())).await;
}

#[tokio::test]
async fn mem_rejects_bad_names() {
    let d = MemDiscovery::new();
    let mut i = instance("ns", "backend", "agg");
    i.component = "../etc".into();
    assert!(d.register(i, json!({})).await.is_err());
}

fn file_backend(root: &TempDir, ttl: Duration) -> FileDiscovery {
    FileDiscovery::new(
        FileOptions::new(root.path())
            .with_ttl(ttl)
            .with_poll_interval(Duration::from_millis(100)),
    )
    .unwrap()
}

#[tokio::test]
async fn file_contract() {
    let root = TempDir::new("tandem-file-kv").unwrap();
    contract(Arc::new(file_backend(&root, Duration::from_secs(10)))).await;
}

#[tokio::test]
async fn file_layout_is_etcd_like() {
    let root = TempDir::new("tandem-file-kv").unwrap();
    let d = file_backend(&root, Duration::from_secs(10));
    let i = instance("dynamo", "backend", "agg");
    let reg = d.register(i.clone(), json!({"m": 1})).await.unwrap();
    let inst_path = root.path().join(i.instance_key());
    let mdc_path = root.path().join(i.mdc_key());
    let stored: Instance = serde_json::from_slice(&std::fs::read(&inst_path).unwrap()).unwrap();
    assert_eq!(stored, i);
    let card: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&mdc_path).unwrap()).unwrap();
    assert_eq!(card, json!({"m": 1}));
    reg.deregister().await.unwrap();
    assert!(!inst_path.exists() && !mdc_path.exists());
}

#[tokio::test]
async fn file_heartbeat_keeps_entry_alive_past_ttl() {
    let root = TempDir::new("tandem-file-kv").unwrap();
    let ttl = Duration::from_millis(1500);
    let d = file_backend(&root, ttl);
    let ns = unique_ns("beat");
    let i = instance(&ns, "backend", "agg");
    let _reg = d.register(i.clone(), json!({})).await.unwrap();
    let mut w = d.watch(&ns).await.unwrap();
    assert_eq!(added_id(&next(&mut w).await), i.instance_id);
    // Across three TTLs nothing may be reported: the owner's heartbeat refreshes the files.
    let quiet = tokio::time::timeout(ttl * 3, w.recv()).await;
    assert!(quiet.is_err(), "unexpected event {quiet:?}");
    assert_eq!(d.list(&ns, None).await.unwrap().len(), 1);
}

#[tokio::test]
async fn file_abandoned_entry_expires_and_is_deleted() {
    let root = TempDir::new("tandem-file-kv").unwrap();
    let ttl = Duration::from_secs(1);
    let d = file_backend(&root, ttl);
    let ns = unique_ns("stale");
    let i = instance(&ns, "backend", "agg");
    let mut w = d.watch(&ns).await.unwrap();
    let reg = d.register(i.clone(), json!({})).await.unwrap();
    assert_eq!(added_id(&next(&mut w).await), i.instance_id);
    let started = std::time::Instant::now();
    reg.abandon();
    let ev = tokio::time::timeout(ttl + Duration::from_secs(3), w.recv())
        .await
        .expect("removal within TTL + margin")
        .expect("watch open");
    assert_eq!(
        ev,
        DiscoveryEvent::Removed {
            instance_id: i.instance_id
        }
    );
    // The last heartbeat was up to a third of the TTL before `abandon`.
    assert!(
        started.elapsed() >= ttl * 2 / 3,
        "removed before the TTL ran out"
    );
    assert!(
        !root.path().join(i.instance_key()).exists(),
        "stale file deleted"
    );
    assert!(
        !root.path().join(i.mdc_key()).exists(),
        "stale card deleted"
    );
}

#[tokio::test]
async fn file_stale_files_from_a_dead_process_are_ignored_and_removed() {
    let root = TempDir::new("tandem-file-kv").unwrap();
    let d = file_backend(&root, Duration::from_secs(2));
    let ns = unique_ns("dead");
    let i = instance(&ns, "backend", "agg");
    // Files as a crashed process would leave them: written long ago, never refreshed.
    let old = std::time::SystemTime::now() - Duration::from_secs(60);
    for (key, body) in [
        (i.instance_key(), serde_json::to_vec(&i).unwrap()),
        (i.mdc_key(), b"{}".to_vec()),
    ] {
        let path = root.path().join(key);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, body).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(old)
            .unwrap();
    }
    assert!(d.list(&ns, None).await.unwrap().is_empty());
    assert!(!root.path().join(i.instance_key()).exists());
    // Junk in the folder is skipped, not fatal.
    let junk = root
        .path()
        .join(format!("v1/instances/{ns}/backend/generate/zz"));
    std::fs::write(&junk, b"not json").unwrap();
    assert!(d.list(&ns, None).await.unwrap().is_empty());
}

/// Runs in a child process (the test binary re-executed) when `CHILD_ENV` is set: registers
/// and then waits to be killed. Without the env var it does nothing.
#[tokio::test]
async fn crash_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let parts: Vec<&str> = spec.split('|').collect();
    let [backend, location, ns, id, ttl_ms] = parts[..] else {
        panic!("bad {CHILD_ENV}: {spec}");
    };
    let ttl = Duration::from_millis(ttl_ms.parse().unwrap());
    let d: Arc<dyn Discovery> = match backend {
        "file" => Arc::new(FileDiscovery::new(FileOptions::new(location).with_ttl(ttl)).unwrap()),
        "etcd" => Arc::new(
            EtcdDiscovery::connect(
                &[location.to_string()],
                EtcdOptions::default().with_ttl(ttl),
            )
            .await
            .unwrap(),
        ),
        other => panic!("unknown backend {other}"),
    };
    let mut i = instance(ns, "backend", "agg");
    i.instance_id = id.parse().unwrap();
    let _reg = d.register(i, json!({"child": true})).await.unwrap();
    // Bounded, so an orphaned child cannot linger if the parent dies first.
    tokio::time::sleep(Duration::from_secs(120)).await;
}

/// Starts a child that registers, waits until it is visible, SIGKILLs it, and checks that
/// watchers see it removed within the TTL (plus a margin for polling and lease checks).
async fn kill_child_and_expect_removal(
    d: Arc<dyn Discovery>,
    backend: &str,
    location: &str,
    ttl: Duration,
) {
    let ns = unique_ns("crash");
    let id = new_instance_id();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["crash_child", "--exact", "--nocapture", "--test-threads=1"])
        .env(
            CHILD_ENV,
            format!("{backend}|{location}|{ns}|{id}|{}", ttl.as_millis()),
        )
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut w = d.watch(&ns).await.unwrap();
    let ev = tokio::time::timeout(Duration::from_secs(30), w.recv())
        .await
        .expect("child registered within 30 s")
        .unwrap();
    assert_eq!(added_id(&ev), id);
    child.kill().unwrap(); // SIGKILL: no deregistration, no lease revoke
    child.wait().unwrap();
    let killed = std::time::Instant::now();
    let ev = tokio::time::timeout(ttl + Duration::from_secs(4), w.recv())
        .await
        .unwrap_or_else(|_| panic!("{backend}: killed child still registered after TTL + 4 s"))
        .unwrap();
    assert_eq!(ev, DiscoveryEvent::Removed { instance_id: id });
    eprintln!(
        "{backend}: removal {:?} after SIGKILL (ttl {ttl:?})",
        killed.elapsed()
    );
    assert!(d.list(&ns, None).await.unwrap().is_empty());
}

#[tokio::test]
async fn file_killed_process_disappears_within_ttl() {
    let root = TempDir::new("tandem-file-kv").unwrap();
    let ttl = Duration::from_secs(2);
    let d = Arc::new(file_backend(&root, ttl));
    let location = root.path().to_str().unwrap().to_string();
    kill_child_and_expect_removal(d, "file", &location, ttl).await;
}

async fn etcd_backend(server: &EtcdServer, ttl: Duration) -> EtcdDiscovery {
    EtcdDiscovery::connect(&[server.endpoint()], EtcdOptions::default().with_ttl(ttl))
        .await
        .expect("connect to test etcd")
}

#[tokio::test]
async fn etcd_contract() {
    let server = EtcdServer::start().expect("etcd for tests");
    contract(Arc::new(
        etcd_backend(&server, Duration::from_secs(10)).await,
    ))
    .await;
}

#[tokio::test]
async fn etcd_keys_are_lease_bound_with_dynamo_layout() {
    let server = EtcdServer::start().expect("etcd for tests");
    let d = etcd_backend(&server, Duration::from_secs(10)).await;
    let i = instance("dynamo", "backend", "agg");
    let _reg = d.register(i.clone(), json!({"m": 1})).await.unwrap();
    let mut client = d.client();
    for key in [i.instance_key(), i.mdc_key()] {
        let resp = client.get(key.clone(), None).await.unwrap();
        let kv = resp
            .kvs()
            .first()
            .unwrap_or_else(|| panic!("{key} missing"));
        assert_ne!(kv.lease(), 0, "{key} must be attached to a lease");
        let ttl = client.lease_time_to_live(kv.lease(), None).await.unwrap();
        assert!(
            ttl.ttl() > 0 && ttl.granted_ttl() == 10,
            "ttl {:?}",
            ttl.granted_ttl()
        );
    }
}

#[tokio::test]
async fn etcd_lease_expires_when_keep_alive_stops() {
    let server = EtcdServer::start().expect("etcd for tests");
    let ttl = Duration::from_secs(3);
    let d = etcd_backend(&server, ttl).await;
    let ns = unique_ns("lease");
    let i = instance(&ns, "backend", "agg");
    let mut w = d.watch(&ns).await.unwrap();
    let reg = d.register(i.clone(), json!({})).await.unwrap();
    assert_eq!(added_id(&next(&mut w).await), i.instance_id);
    // Kept alive well past its TTL while the registration lives.
    let quiet = tokio::time::timeout(ttl * 2, w.recv()).await;
    assert!(quiet.is_err(), "unexpected event {quiet:?}");
    reg.abandon();
    let ev = tokio::time::timeout(ttl + Duration::from_secs(4), w.recv())
        .await
        .expect("lease expiry within TTL + margin")
        .unwrap();
    assert_eq!(
        ev,
        DiscoveryEvent::Removed {
            instance_id: i.instance_id
        }
    );
}

#[tokio::test]
async fn etcd_killed_process_disappears_within_ttl() {
    let server = EtcdServer::start().expect("etcd for tests");
    let ttl = Duration::from_secs(3);
    let d = Arc::new(etcd_backend(&server, ttl).await);
    kill_child_and_expect_removal(d, "etcd", &server.endpoint(), ttl).await;
}

#[tokio::test]
async fn etcd_unreachable_fails_fast() {
    let port = tandem_test_support::free_port().unwrap();
    let opts = EtcdOptions {
        request_timeout: Duration::from_secs(2),
        ..EtcdOptions::default()
    };
    let started = std::time::Instant::now();
    let result = EtcdDiscovery::connect(&[format!("http://127.0.0.1:{port}")], opts).await;
    assert!(result.is_err());
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[tokio::test]
async fn etcd_two_clients_see_each_other() {
    // Two processes' worth of clients against one etcd: a registration made through one
    // client is seen by the other's watch and list.
    let server = EtcdServer::start().expect("etcd for tests");
    let a = etcd_backend(&server, Duration::from_secs(10)).await;
    let b = etcd_backend(&server, Duration::from_secs(10)).await;
    let ns = unique_ns("two");
    let mut w = b.watch(&ns).await.unwrap();
    let i = instance(&ns, "backend", "agg");
    let _reg = a.register(i.clone(), json!({})).await.unwrap();
    assert_eq!(added_id(&next(&mut w).await), i.instance_id);
    let found = wait_until(EVENT_TIMEOUT, || async {
        let l = b.list(&ns, Some("backend")).await.ok()?;
        (l.len() == 1).then_some(l)
    })
    .await
    .expect("listed");
    assert_eq!(found[0].instance, i);
}

#[tokio::test]
async fn etcd_outage_watch_and_registration_recover() {
    let mut server = EtcdServer::start().expect("etcd for tests");
    let ttl = Duration::from_secs(3);
    let owner = etcd_backend(&server, ttl).await;
    let router = etcd_backend(&server, ttl).await;
    let ns = unique_ns("outage");
    let a = instance(&ns, "backend", "agg");
    let _ra = owner.register(a.clone(), json!({})).await.unwrap();
    let mut w = router.watch(&ns).await.unwrap();
    assert_eq!(added_id(&next(&mut w).await), a.instance_id);

    server.kill();
    server
        .restart()
        .expect("etcd restarts on the same ports and data");

    // The watch re-lists after its stream broke and sees registrations made after the outage.
    let late = etcd_backend(&server, ttl).await;
    let b = instance(&ns, "backend", "agg");
    let _rb = late.register(b.clone(), json!({})).await.unwrap();
    let ev = next(&mut w).await;
    assert_eq!(
        added_id(&ev),
        b.instance_id,
        "no spurious removal of the live instance"
    );

    // The first owner's keep-alive reconnected: its entry outlives several TTLs.
    let quiet = tokio::time::timeout(ttl * 2, w.recv()).await;
    assert!(quiet.is_err(), "unexpected event {quiet:?}");
    let ids: Vec<u64> = router
        .list(&ns, None)
        .await
        .unwrap()
        .iter()
        .map(|e| e.instance.instance_id)
        .collect();
    assert!(
        ids.contains(&a.instance_id) && ids.contains(&b.instance_id),
        "{ids:?}"
    );
}

#[tokio::test]
async fn etcd_registration_comes_back_after_its_lease_is_lost() {
    let server = EtcdServer::start().expect("etcd for tests");
    let ttl = Duration::from_secs(3);
    let d = etcd_backend(&server, ttl).await;
    let ns = unique_ns("lost");
    let i = instance(&ns, "backend", "agg");
    let mut w = d.watch(&ns).await.unwrap();
    let _reg = d.register(i.clone(), json!({"m": 1})).await.unwrap();
    assert_eq!(added_id(&next(&mut w).await), i.instance_id);
    // What a process cut off from etcd past its TTL finds when it is back: its lease is gone
    // (revoked here, as etcd expires it). It registers again under a new lease.
    let mut client = d.client();
    let resp = client.get(i.instance_key(), None).await.unwrap();
    let lease = resp.kvs().first().expect("registered").lease();
    client.lease_revoke(lease).await.unwrap();
    assert_eq!(
        next(&mut w).await,
        DiscoveryEvent::Removed {
            instance_id: i.instance_id
        }
    );
    assert_eq!(added_id(&next(&mut w).await), i.instance_id);
    let listed = d.list(&ns, None).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].card, json!({"m": 1}));
}
