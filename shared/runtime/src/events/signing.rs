//! Signed events: each worker signs what it publishes with an Ed25519 key of its own, made at
//! start; the public half is in its discovery card, so a subscriber drops an event whose
//! signature does not match the key of the worker it claims to come from. NATS's TLS says
//! "someone of the deployment"; the signature says "this worker".
//!
//! The signature covers the subject and the payload (so an event cannot be replayed onto
//! another component's subject) and travels in the [`SIGNATURE_HEADER`] header, leaving the
//! payload in Dynamo's shape.

use std::fmt;

use ring::signature::{Ed25519KeyPair, KeyPair, UnparsedPublicKey, ED25519};

/// NATS header carrying the hex Ed25519 signature of an event.
pub const SIGNATURE_HEADER: &str = "Tandem-Signature";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SignatureError {
    #[error("the event carries no signature")]
    Missing,
    #[error("the event's signature is not hex of an Ed25519 signature")]
    Malformed,
    #[error("the worker's event key is not hex of an Ed25519 public key")]
    BadKey,
    #[error("the signature does not match the worker's key")]
    Mismatch,
    #[error("cannot make an event signing key: the system RNG failed")]
    Rng,
}

/// A worker's signing key.
pub struct EventSigner {
    key: Ed25519KeyPair,
}

impl fmt::Debug for EventSigner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventSigner")
            .field("public_key", &self.public_key_hex())
            .finish()
    }
}

fn message(subject: &str, payload: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(subject.len() + 1 + payload.len());
    m.extend_from_slice(subject.as_bytes());
    m.push(b'\n');
    m.extend_from_slice(payload);
    m
}

impl EventSigner {
    /// A fresh key from the system RNG.
    pub fn generate() -> Result<Self, SignatureError> {
        let rng = ring::rand::SystemRandom::new();
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&rng).map_err(|_| SignatureError::Rng)?;
        let key = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).map_err(|_| SignatureError::Rng)?;
        Ok(Self { key })
    }

    /// The public key, hex, as it goes into the worker's card.
    pub fn public_key_hex(&self) -> String {
        to_hex(self.key.public_key().as_ref())
    }

    /// The hex signature of `payload` published on `subject`.
    pub fn sign(&self, subject: &str, payload: &[u8]) -> String {
        to_hex(self.key.sign(&message(subject, payload)).as_ref())
    }
}

/// Checks `signature` (hex, from the header) of `payload` on `subject` against the hex
/// public key `key`.
pub fn verify(
    key: &str,
    subject: &str,
    payload: &[u8],
    signature: Option<&str>,
) -> Result<(), SignatureError> {
    let signature = signature.ok_or(SignatureError::Missing)?;
    let sig = from_hex(signature).ok_or(SignatureError::Malformed)?;
    let key = from_hex(key)
        .filter(|k| k.len() == 32)
        .ok_or(SignatureError::BadKey)?;
    UnparsedPublicKey::new(&ED25519, key)
        .verify(&message(subject, payload), &sig)
        .map_err(|_| SignatureError::Mismatch)
}

fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

fn from_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || s.len() > 256 {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16);
    s.as_bytes()
        .chunks(2)
        .map(|p| Some((digit(p[0])? * 16 + digit(p[1])?) as u8))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_verifies_only_for_its_key_subject_and_payload() {
        let signer = EventSigner::generate().unwrap();
        let other = EventSigner::generate().unwrap();
        let key = signer.public_key_hex();
        assert_eq!(key.len(), 64);
        let sig = signer.sign("s.a", b"{\"x\":1}");
        assert_eq!(verify(&key, "s.a", b"{\"x\":1}", Some(&sig)), Ok(()));
        assert_eq!(
            verify(&key, "s.a", b"{\"x\":2}", Some(&sig)),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify(&key, "s.b", b"{\"x\":1}", Some(&sig)),
            Err(SignatureError::Mismatch)
        );
        let forged = other.sign("s.a", b"{\"x\":1}");
        assert_eq!(
            verify(&key, "s.a", b"{\"x\":1}", Some(&forged)),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify(&key, "s.a", b"{}", None),
            Err(SignatureError::Missing)
        );
        assert_eq!(
            verify(&key, "s.a", b"{}", Some("zz")),
            Err(SignatureError::Malformed)
        );
        assert_eq!(
            verify("", "s.a", b"{}", Some(&sig)),
            Err(SignatureError::BadKey)
        );
        assert_eq!(from_hex("0aFf"), Some(vec![10, 255]));
        assert!(!format!("{signer:?}").contains("pkcs8"));
    }
}
