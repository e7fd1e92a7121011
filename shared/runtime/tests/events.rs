//! NATS event plane against a real nats-server.

use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;
use tandem_runtime::events::{kv_events_subject, EventError, EventSigner, NatsEventPlane};
use tandem_test_support::NatsServer;

const TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct KvEvent {
    event_id: u64,
    stored: Vec<u64>,
}

fn signer() -> Arc<EventSigner> {
    Arc::new(EventSigner::generate().expect("signing key"))
}

#[tokio::test]
async fn kv_events_round_trip_with_worker_id() {
    let server = NatsServer::start().expect("nats-server for tests");
    let plane = NatsEventPlane::connect(&server.url(), TIMEOUT, None)
        .await
        .unwrap();
    let mut sub = plane
        .kv_events_subscriber::<KvEvent>("dynamo", "backend")
        .await
        .unwrap();
    // Publisher on its own connection, as a separate worker process would have.
    let worker = NatsEventPlane::connect(&server.url(), TIMEOUT, None)
        .await
        .unwrap();
    let key = signer();
    let publisher = worker
        .kv_events_publisher::<KvEvent>("dynamo", "backend", 42, key.clone())
        .unwrap();
    assert_eq!(
        publisher.subject(),
        "namespace.dynamo.component.backend.kv-events"
    );
    for id in 0..3 {
        publisher
            .publish(&KvEvent {
                event_id: id,
                stored: vec![id, id + 100],
            })
            .await
            .unwrap();
    }
    publisher.flush().await.unwrap();
    for id in 0..3 {
        let got = tokio::time::timeout(TIMEOUT, sub.next())
            .await
            .expect("event within timeout")
            .expect("subscription open")
            .expect("decodes");
        assert_eq!(got.worker_id, 42);
        // Signed by the worker's key, and by no other.
        got.verify(&key.public_key_hex())
            .expect("signed by the worker");
        assert!(got.verify(&signer().public_key_hex()).is_err());
        assert_eq!(
            got.event,
            KvEvent {
                event_id: id,
                stored: vec![id, id + 100]
            }
        );
    }
}

#[tokio::test]
async fn undecodable_message_is_an_error_item_not_the_end() {
    let server = NatsServer::start().expect("nats-server for tests");
    let plane = NatsEventPlane::connect(&server.url(), TIMEOUT, None)
        .await
        .unwrap();
    let mut sub = plane
        .kv_events_subscriber::<KvEvent>("ns", "comp")
        .await
        .unwrap();
    let subject = kv_events_subject("ns", "comp").unwrap();
    plane
        .client()
        .publish(subject, "garbage".into())
        .await
        .unwrap();
    let good = plane
        .kv_events_publisher::<KvEvent>("ns", "comp", 7, signer())
        .unwrap();
    good.publish(&KvEvent {
        event_id: 9,
        stored: vec![],
    })
    .await
    .unwrap();
    good.flush().await.unwrap();
    let first = tokio::time::timeout(TIMEOUT, sub.next())
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(first, Err(EventError::Decode { .. })), "{first:?}");
    let second = tokio::time::timeout(TIMEOUT, sub.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!((second.worker_id, second.event.event_id), (7, 9));
}

#[tokio::test]
async fn components_are_separate_subjects() {
    let server = NatsServer::start().expect("nats-server for tests");
    let plane = NatsEventPlane::connect(&server.url(), TIMEOUT, None)
        .await
        .unwrap();
    let mut prefill = plane
        .kv_events_subscriber::<KvEvent>("ns", "prefill")
        .await
        .unwrap();
    let decode = plane
        .kv_events_publisher::<KvEvent>("ns", "decode", 1, signer())
        .unwrap();
    let prefill_pub = plane
        .kv_events_publisher::<KvEvent>("ns", "prefill", 2, signer())
        .unwrap();
    decode
        .publish(&KvEvent {
            event_id: 1,
            stored: vec![],
        })
        .await
        .unwrap();
    prefill_pub
        .publish(&KvEvent {
            event_id: 2,
            stored: vec![],
        })
        .await
        .unwrap();
    plane.client().flush().await.unwrap();
    let got = tokio::time::timeout(TIMEOUT, prefill.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        got.worker_id, 2,
        "only the prefill component's event arrives"
    );
}

#[tokio::test]
async fn unreachable_server_fails_fast() {
    let port = tandem_test_support::free_port().unwrap();
    let started = std::time::Instant::now();
    let result = NatsEventPlane::connect(
        &format!("nats://127.0.0.1:{port}"),
        Duration::from_secs(2),
        None,
    )
    .await;
    assert!(result.is_err());
    assert!(started.elapsed() < Duration::from_secs(10));
}
