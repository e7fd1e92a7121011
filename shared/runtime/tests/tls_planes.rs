//! etcd and NATS under the deployment's mutual TLS, against real servers: a client of the
//! deployment works; a client without a certificate, with one of another deployment's CA, or
//! pointed at a plaintext URL while it has an identity, is refused.

use std::time::Duration;

use serde_json::json;
use tandem_pki::InternalIdentity;
use tandem_runtime::discovery::etcd::{EtcdDiscovery, EtcdOptions};
use tandem_runtime::discovery::{new_instance_id, Discovery, DiscoveryError, Instance};
use tandem_runtime::events::{EventError, NatsEventPlane};
use tandem_test_support::{internal_tls_dir, EtcdServer, NatsServer, TempDir};

const TIMEOUT: Duration = Duration::from_secs(5);

fn ours() -> InternalIdentity {
    InternalIdentity::load(internal_tls_dir()).expect("test TLS folder")
}

/// An identity of another deployment (its own CA).
fn foreign(scratch: &TempDir) -> InternalIdentity {
    let dir = scratch.path().join("pki");
    tandem_test_support::tls::make_deployment(&dir);
    InternalIdentity::load(&dir).expect("foreign TLS folder")
}

fn options(tls: Option<InternalIdentity>) -> EtcdOptions {
    EtcdOptions {
        request_timeout: TIMEOUT,
        ..EtcdOptions::default()
    }
    .with_tls(tls)
}

#[tokio::test]
async fn etcd_serves_only_the_deployment() {
    let server = EtcdServer::start_tls(internal_tls_dir()).expect("etcd for tests");
    let endpoint = server.endpoint();
    assert!(endpoint.starts_with("https://"), "{endpoint}");

    // The deployment's client registers and reads back.
    let d = EtcdDiscovery::connect(std::slice::from_ref(&endpoint), options(Some(ours())))
        .await
        .expect("a client of the deployment connects");
    let ns = format!("tls-{:x}", new_instance_id());
    let inst = Instance {
        namespace: ns.clone(),
        component: "backend".into(),
        endpoint: "generate".into(),
        instance_id: new_instance_id(),
        grpc_addr: "127.0.0.1:1".into(),
        http_addr: None,
        role: "agg".into(),
    };
    let _reg = d
        .register(inst.clone(), json!({"m": 1}))
        .await
        .expect("register");
    let listed = d.list(&ns, None).await.expect("list");
    assert_eq!(listed.len(), 1);

    // Another deployment's certificate: refused at the handshake.
    let scratch = TempDir::new("tandem-tls-etcd").expect("temp dir");
    let other = EtcdDiscovery::connect(
        std::slice::from_ref(&endpoint),
        options(Some(foreign(&scratch))),
    )
    .await;
    assert!(other.is_err(), "client of another CA accepted");

    // No identity and an https endpoint: refused before dialling, naming the endpoint.
    match EtcdDiscovery::connect(std::slice::from_ref(&endpoint), options(None)).await {
        Err(DiscoveryError::EtcdTlsWithoutIdentity(e)) => assert_eq!(e, endpoint),
        Err(e) => panic!("unexpected error: {e}"),
        Ok(_) => panic!("connected without a certificate"),
    }

    // An identity and a plaintext endpoint: refused, never sent in the clear.
    let plain = endpoint.replacen("https://", "http://", 1);
    match EtcdDiscovery::connect(std::slice::from_ref(&plain), options(Some(ours()))).await {
        Err(DiscoveryError::PlaintextEtcd(e)) => assert_eq!(e, plain),
        Err(e) => panic!("unexpected error: {e}"),
        Ok(_) => panic!("connected in plaintext"),
    }
}

#[tokio::test]
async fn nats_serves_only_the_deployment() {
    let server = NatsServer::start_tls(internal_tls_dir()).expect("nats-server for tests");
    let url = server.url();
    assert!(url.starts_with("tls://"), "{url}");

    let plane = NatsEventPlane::connect(&url, TIMEOUT, Some(&ours()))
        .await
        .expect("a client of the deployment connects");
    plane.client().flush().await.expect("flush");

    let scratch = TempDir::new("tandem-tls-nats").expect("temp dir");
    let other = foreign(&scratch);
    assert!(
        NatsEventPlane::connect(&url, TIMEOUT, Some(&other))
            .await
            .is_err(),
        "client of another CA accepted"
    );
    assert!(matches!(
        NatsEventPlane::connect(&url, TIMEOUT, None).await,
        Err(EventError::NatsTlsWithoutIdentity(_))
    ));
    // A plaintext client of the TLS server (its URL forced to nats://) is refused by the
    // server: it requires TLS.
    let plain = url.replacen("tls://", "nats://", 1);
    assert!(matches!(
        NatsEventPlane::connect(&plain, TIMEOUT, Some(&ours())).await,
        Err(EventError::PlaintextNats(_))
    ));
    assert!(
        NatsEventPlane::connect(&plain, TIMEOUT, None)
            .await
            .is_err(),
        "plaintext client served by a TLS-only server"
    );
}
