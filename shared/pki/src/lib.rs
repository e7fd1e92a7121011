//! Mutual TLS between Tandem's roles.
//!
//! A deployment has one certificate authority. Its certificate (`ca.crt`) and one node
//! certificate it signed (`node.crt`, `node.key`) sit in a folder given to every process with
//! `--internal-tls-dir`. Every internal gRPC channel (router → workers, decode → prefill, the
//! direct KV-event plane) is then TLS 1.3 in both directions: a server accepts only clients
//! presenting a certificate of the deployment's CA, and a client accepts only servers whose
//! certificate the same CA signed for [`INTERNAL_SERVER_NAME`]. Certificates name the deployment,
//! not the host, so one folder serves every node of it; the CA's private key is never written:
//! nothing can issue more certificates for a deployment once its folder exists.
//!
//! Services only load a folder ([`InternalIdentity::load`]); `tandem certs` and `tandem up` make
//! one (feature `generate`).

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

#[cfg(feature = "generate")]
mod generate;
#[cfg(feature = "generate")]
pub use generate::{generate, Generated};

/// The name every internal server certificate carries and every internal client checks.
pub const INTERNAL_SERVER_NAME: &str = "tandem.internal";
/// The deployment CA's certificate in a TLS folder.
pub const CA_FILE: &str = "ca.crt";
/// The node certificate (server and client) in a TLS folder.
pub const CERT_FILE: &str = "node.crt";
/// The node certificate's private key in a TLS folder.
pub const KEY_FILE: &str = "node.key";

/// How long a TLS handshake may take on an internal channel.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} holds no PEM {what}")]
    NoPem { path: PathBuf, what: &'static str },
    #[error("{path} is not a valid PEM {what}: {reason}")]
    BadPem {
        path: PathBuf,
        what: &'static str,
        reason: String,
    },
    #[error("{0} exists but {1} does not: the TLS folder is incomplete")]
    Incomplete(PathBuf, PathBuf),
    #[cfg(feature = "generate")]
    #[error("generating certificates: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("invalid internal address {addr:?}: {reason}")]
    Address { addr: String, reason: String },
}

/// A deployment's CA and this node's certificate and key, as PEM.
#[derive(Clone)]
pub struct InternalIdentity {
    dir: PathBuf,
    ca_pem: Vec<u8>,
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
}

impl fmt::Debug for InternalIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InternalIdentity")
            .field("dir", &self.dir)
            .field("key", &"<redacted>")
            .finish()
    }
}

fn read(path: &Path) -> Result<Vec<u8>, PkiError> {
    std::fs::read(path).map_err(|source| PkiError::Read {
        path: path.to_owned(),
        source,
    })
}

fn check_certs(path: &Path, pem: &[u8]) -> Result<(), PkiError> {
    let mut n = 0;
    for cert in CertificateDer::pem_slice_iter(pem) {
        cert.map_err(|e| PkiError::BadPem {
            path: path.to_owned(),
            what: "certificate",
            reason: e.to_string(),
        })?;
        n += 1;
    }
    if n == 0 {
        return Err(PkiError::NoPem {
            path: path.to_owned(),
            what: "certificate",
        });
    }
    Ok(())
}

fn check_key(path: &Path, pem: &[u8]) -> Result<(), PkiError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| match e {
        rustls_pki_types::pem::Error::NoItemsFound => PkiError::NoPem {
            path: path.to_owned(),
            what: "private key",
        },
        e => PkiError::BadPem {
            path: path.to_owned(),
            what: "private key",
            reason: e.to_string(),
        },
    })?;
    Ok(())
}

impl InternalIdentity {
    /// Loads `ca.crt`, `node.crt` and `node.key` from `dir`, checking that each parses.
    pub fn load(dir: &Path) -> Result<Self, PkiError> {
        let ca_path = dir.join(CA_FILE);
        let cert_path = dir.join(CERT_FILE);
        let key_path = dir.join(KEY_FILE);
        let ca_pem = read(&ca_path)?;
        check_certs(&ca_path, &ca_pem)?;
        let cert_pem = read(&cert_path)?;
        check_certs(&cert_path, &cert_pem)?;
        let key_pem = read(&key_path)?;
        check_key(&key_path, &key_pem)?;
        Ok(Self {
            dir: dir.to_owned(),
            ca_pem,
            cert_pem,
            key_pem,
        })
    }

    /// The folder it was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The CA certificate's file (for clients that load files themselves, like NATS's).
    pub fn ca_path(&self) -> PathBuf {
        self.dir.join(CA_FILE)
    }

    /// The node certificate's file.
    pub fn cert_path(&self) -> PathBuf {
        self.dir.join(CERT_FILE)
    }

    /// The node key's file.
    pub fn key_path(&self) -> PathBuf {
        self.dir.join(KEY_FILE)
    }

    fn identity(&self) -> Identity {
        Identity::from_pem(&self.cert_pem, &self.key_pem)
    }

    /// A gRPC server's TLS: this node's certificate, clients must present one of the CA's.
    pub fn server_tls(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.identity())
            .client_ca_root(Certificate::from_pem(&self.ca_pem))
            .timeout(HANDSHAKE_TIMEOUT)
    }

    /// A gRPC client's TLS: servers must present a CA certificate for
    /// [`INTERNAL_SERVER_NAME`]; this node presents its own.
    pub fn client_tls(&self) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca_pem))
            .identity(self.identity())
            .domain_name(INTERNAL_SERVER_NAME)
            .timeout(HANDSHAKE_TIMEOUT)
    }
}

/// What protects a process's internal channels: the deployment's mutual TLS, or nothing (only
/// when the operator asked for `--insecure-internal`).
#[derive(Clone, Debug)]
pub enum ChannelSecurity {
    MutualTls(InternalIdentity),
    Plaintext,
}

impl ChannelSecurity {
    /// Loads the identity from `dir`, or plaintext when `dir` is `None` (the caller has checked
    /// that the operator asked for it); plaintext is logged as a warning.
    pub fn from_dir(dir: Option<&Path>) -> Result<Self, PkiError> {
        match dir {
            Some(dir) => Ok(Self::MutualTls(InternalIdentity::load(dir)?)),
            None => {
                tracing::warn!(
                    "--insecure-internal: internal gRPC channels are PLAINTEXT and \
                     UNAUTHENTICATED; anyone who reaches a worker port can drive it"
                );
                Ok(Self::Plaintext)
            }
        }
    }

    /// A lazily connecting endpoint for the internal gRPC service at `addr` (`host:port`).
    pub fn endpoint(&self, addr: &str) -> Result<Endpoint, PkiError> {
        let bad = |reason: String| PkiError::Address {
            addr: addr.to_owned(),
            reason,
        };
        match self {
            Self::MutualTls(id) => Endpoint::from_shared(format!("https://{addr}"))
                .map_err(|e| bad(e.to_string()))?
                .tls_config(id.client_tls())
                .map_err(|e| bad(e.to_string())),
            Self::Plaintext => {
                Endpoint::from_shared(format!("http://{addr}")).map_err(|e| bad(e.to_string()))
            }
        }
    }

    /// The server TLS config, if any.
    pub fn server_tls(&self) -> Option<ServerTlsConfig> {
        match self {
            Self::MutualTls(id) => Some(id.server_tls()),
            Self::Plaintext => None,
        }
    }

    pub fn is_tls(&self) -> bool {
        matches!(self, Self::MutualTls(_))
    }

    /// The deployment's identity, when channels use TLS.
    pub fn identity(&self) -> Option<&InternalIdentity> {
        match self {
            Self::MutualTls(id) => Some(id),
            Self::Plaintext => None,
        }
    }
}

#[cfg(test)]
mod tests;
