//! The NATS event plane: typed publish/subscribe of JSON events on Dynamo's subjects.
//!
//! Subject: `namespace.{ns}.component.{comp}.{topic}`; KV events use the topic `kv-events`.
//! Each message is an [`EventEnvelope`] `{"worker_id": .., "event": ..}` (the shape of Dynamo's
//! `RouterEvent`), where `event` is whatever serializable type the caller publishes.
//! Plain core NATS (no JetStream), which works with Debian's nats-server 2.9. Every event is
//! signed by its worker ([`EventSigner`], header [`SIGNATURE_HEADER`]); subscribers check it
//! with [`Received::verify`] against the key in the worker's card.

mod signing;
pub use signing::{verify, EventSigner, SignatureError, SIGNATURE_HEADER};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

/// Topic of KV cache events.
pub const KV_EVENTS_TOPIC: &str = "kv-events";

#[derive(Debug, thiserror::Error)]
pub enum EventError {
    #[error("invalid {what} {value:?} for a NATS subject: {reason}")]
    InvalidName {
        what: &'static str,
        value: String,
        reason: &'static str,
    },
    #[error("connecting to NATS at {url}: {source}")]
    Connect {
        url: String,
        #[source]
        source: async_nats::ConnectError,
    },
    #[error(
        "NATS server {0:?} is plaintext but internal channels use mutual TLS: give a tls:// \
         URL of a nats-server with `tls {{ verify: true }}` and the deployment's CA, or run \
         with --insecure-internal"
    )]
    PlaintextNats(String),
    #[error("NATS server {0:?} is tls:// but this process has no --internal-tls-dir")]
    NatsTlsWithoutIdentity(String),
    #[error("NATS at {url} did not answer within {timeout:?}")]
    ConnectTimeout { url: String, timeout: Duration },
    #[error("publishing on {subject}: {source}")]
    Publish {
        subject: String,
        #[source]
        source: async_nats::PublishError,
    },
    #[error("subscribing to {subject}: {source}")]
    Subscribe {
        subject: String,
        #[source]
        source: async_nats::SubscribeError,
    },
    #[error("flushing NATS connection: {0}")]
    Flush(#[from] async_nats::client::FlushError),
    #[error("encoding event: {0}")]
    Encode(#[source] serde_json::Error),
    #[error("undecodable event on {subject}: {source}")]
    Decode {
        subject: String,
        #[source]
        source: serde_json::Error,
    },
}

pub type Result<T, E = EventError> = std::result::Result<T, E>;

/// One event as it travels: which worker sent it, and the caller's payload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EventEnvelope<T> {
    pub worker_id: u64,
    pub event: T,
}

fn check_token(what: &'static str, value: &str) -> Result<()> {
    let bad = |reason| {
        Err(EventError::InvalidName {
            what,
            value: value.to_string(),
            reason,
        })
    };
    if value.is_empty() {
        return bad("empty");
    }
    // Whitespace splits a NATS protocol line; `*` and `>` are wildcards.
    if value
        .chars()
        .any(|c| c.is_whitespace() || c == '*' || c == '>')
    {
        return bad("whitespace, '*' and '>' are not allowed");
    }
    if value.starts_with('.') || value.ends_with('.') || value.contains("..") {
        return bad("empty subject token");
    }
    Ok(())
}

/// `namespace.{ns}.component.{comp}.{topic}`.
pub fn subject(namespace: &str, component: &str, topic: &str) -> Result<String> {
    check_token("namespace", namespace)?;
    check_token("component", component)?;
    check_token("topic", topic)?;
    Ok(format!(
        "namespace.{namespace}.component.{component}.{topic}"
    ))
}

/// `namespace.{ns}.component.{comp}.kv-events`.
pub fn kv_events_subject(namespace: &str, component: &str) -> Result<String> {
    subject(namespace, component, KV_EVENTS_TOPIC)
}

/// A NATS connection; cheap to clone (it is a handle).
#[derive(Clone, Debug)]
pub struct NatsEventPlane {
    client: async_nats::Client,
}

impl NatsEventPlane {
    /// Connects to `url` (`NATS_SERVER`, e.g. `nats://127.0.0.1:4222`), failing after `timeout`
    /// instead of retrying forever, so a misconfigured process exits with a clear error.
    /// With `tls`, the server must be `tls://` and is reached with the deployment's CA and
    /// client certificate (the certificate must also name the server's host: `tandem certs
    /// --host`).
    pub async fn connect(
        url: &str,
        timeout: Duration,
        tls: Option<&tandem_pki::InternalIdentity>,
    ) -> Result<Self> {
        let is_tls = url.to_ascii_lowercase().starts_with("tls://");
        let mut opts = async_nats::ConnectOptions::new().connection_timeout(timeout);
        match (tls, is_tls) {
            (Some(id), true) => {
                opts = opts
                    .add_root_certificates(id.ca_path())
                    .add_client_certificate(id.cert_path(), id.key_path())
                    .require_tls(true);
            }
            (Some(_), false) => return Err(EventError::PlaintextNats(url.to_string())),
            (None, true) => return Err(EventError::NatsTlsWithoutIdentity(url.to_string())),
            (None, false) => {}
        }
        let client = tokio::time::timeout(timeout, opts.connect(url))
            .await
            .map_err(|_| EventError::ConnectTimeout {
                url: url.to_string(),
                timeout,
            })?
            .map_err(|source| EventError::Connect {
                url: url.to_string(),
                source,
            })?;
        Ok(Self { client })
    }

    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// A publisher of `T` for `worker_id` on the component's KV-event subject, signing with
    /// `signer`.
    pub fn kv_events_publisher<T: Serialize>(
        &self,
        namespace: &str,
        component: &str,
        worker_id: u64,
        signer: Arc<EventSigner>,
    ) -> Result<EventPublisher<T>> {
        self.publisher(namespace, component, KV_EVENTS_TOPIC, worker_id, signer)
    }

    pub fn publisher<T: Serialize>(
        &self,
        namespace: &str,
        component: &str,
        topic: &str,
        worker_id: u64,
        signer: Arc<EventSigner>,
    ) -> Result<EventPublisher<T>> {
        Ok(EventPublisher {
            client: self.client.clone(),
            subject: subject(namespace, component, topic)?,
            worker_id,
            signer,
            _t: PhantomData,
        })
    }

    /// Subscribes to the component's KV-event subject.
    pub async fn kv_events_subscriber<T: DeserializeOwned>(
        &self,
        namespace: &str,
        component: &str,
    ) -> Result<EventSubscriber<T>> {
        self.subscribe(namespace, component, KV_EVENTS_TOPIC).await
    }

    /// Subscribes and waits until the server has the subscription (a flush round trip), so
    /// that every event published after this returns is delivered.
    pub async fn subscribe<T: DeserializeOwned>(
        &self,
        namespace: &str,
        component: &str,
        topic: &str,
    ) -> Result<EventSubscriber<T>> {
        let subject = subject(namespace, component, topic)?;
        let inner = self
            .client
            .subscribe(subject.clone())
            .await
            .map_err(|source| EventError::Subscribe {
                subject: subject.clone(),
                source,
            })?;
        self.client.flush().await?;
        Ok(EventSubscriber {
            inner,
            _t: PhantomData,
        })
    }
}

/// Publishes `T`s wrapped in an [`EventEnvelope`] with this worker's id, signed.
#[derive(Clone, Debug)]
pub struct EventPublisher<T> {
    client: async_nats::Client,
    subject: String,
    worker_id: u64,
    signer: Arc<EventSigner>,
    _t: PhantomData<fn(&T)>,
}

impl<T: Serialize> EventPublisher<T> {
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// Queues one event (NATS core: at most once; a subscriber detects losses by `event_id`
    /// gaps in the payload and asks the worker to replay).
    pub async fn publish(&self, event: &T) -> Result<()> {
        let payload = serde_json::to_vec(&EventEnvelope {
            worker_id: self.worker_id,
            event,
        })
        .map_err(EventError::Encode)?;
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(
            SIGNATURE_HEADER,
            self.signer.sign(&self.subject, &payload).as_str(),
        );
        self.client
            .publish_with_headers(self.subject.clone(), headers, payload.into())
            .await
            .map_err(|source| EventError::Publish {
                subject: self.subject.clone(),
                source,
            })
    }

    /// Waits until everything published so far has been written to the server.
    pub async fn flush(&self) -> Result<()> {
        Ok(self.client.flush().await?)
    }
}

/// Receives [`EventEnvelope<T>`]s. A message that does not decode (another version, a stray
/// publisher) is returned as an error item rather than ending the stream.
pub struct EventSubscriber<T> {
    inner: async_nats::Subscriber,
    _t: PhantomData<fn() -> T>,
}

/// An event as received: its envelope, and what its signature is checked over.
#[derive(Debug)]
pub struct Received<T> {
    pub worker_id: u64,
    pub event: T,
    subject: String,
    payload: bytes::Bytes,
    signature: Option<String>,
}

impl<T> Received<T> {
    /// Checks the event's signature against `key`, the hex public key in the card of the
    /// worker it claims to come from (`worker_id`).
    pub fn verify(&self, key: &str) -> Result<(), SignatureError> {
        verify(key, &self.subject, &self.payload, self.signature.as_deref())
    }
}

impl<T: DeserializeOwned> EventSubscriber<T> {
    /// The next event; `None` when the subscription ended (connection closed for good).
    pub async fn next(&mut self) -> Option<Result<Received<T>>> {
        std::future::poll_fn(|cx| Pin::new(&mut *self).poll_next_event(cx)).await
    }

    fn poll_next_event(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Received<T>>>> {
        use futures_core::Stream;
        Pin::new(&mut self.inner)
            .poll_next(cx)
            .map(|msg| msg.map(decode))
    }
}

fn decode<T: DeserializeOwned>(msg: async_nats::Message) -> Result<Received<T>> {
    let env: EventEnvelope<T> =
        serde_json::from_slice(&msg.payload).map_err(|source| EventError::Decode {
            subject: msg.subject.to_string(),
            source,
        })?;
    let signature = msg
        .headers
        .as_ref()
        .and_then(|h| h.get(SIGNATURE_HEADER))
        .map(|v| v.as_str().to_owned());
    Ok(Received {
        worker_id: env.worker_id,
        event: env.event,
        subject: msg.subject.to_string(),
        payload: msg.payload,
        signature,
    })
}

impl<T: DeserializeOwned> futures_core::Stream for EventSubscriber<T> {
    type Item = Result<Received<T>>;
    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_next_event(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects() {
        assert_eq!(
            kv_events_subject("dynamo", "backend").unwrap(),
            "namespace.dynamo.component.backend.kv-events"
        );
        for bad in ["", "a b", "a*", "a>", ".a", "a..b"] {
            assert!(kv_events_subject(bad, "backend").is_err(), "{bad:?}");
        }
    }

    #[test]
    fn envelope_shape() {
        let env = EventEnvelope {
            worker_id: 7,
            event: serde_json::json!({"event_id": 1}),
        };
        assert_eq!(
            serde_json::to_string(&env).unwrap(),
            r#"{"worker_id":7,"event":{"event_id":1}}"#
        );
    }
}
