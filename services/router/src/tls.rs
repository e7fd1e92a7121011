//! HTTPS on the public port (`--tls-cert-path`, `--tls-key-path`): rustls with the ring
//! provider, TLS 1.2 and 1.3, ALPN `h2` and `http/1.1`. The files are read once at start-up;
//! a missing file, a file without PEM blocks of the right kind, or a key that does not go with
//! the certificate stops the router with an error naming the file.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tandem_config::TlsFiles;
use tokio_rustls::rustls::pki_types::pem::{self, PemObject};
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{self, ServerConfig};
use tokio_rustls::TlsAcceptor;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("--tls-cert-path {}: {reason}", path.display())]
    Cert { path: PathBuf, reason: String },
    #[error("--tls-key-path {}: {reason}", path.display())]
    Key { path: PathBuf, reason: String },
    #[error(
        "--tls-cert-path {} with --tls-key-path {}: {source}",
        cert.display(),
        key.display()
    )]
    Config {
        cert: PathBuf,
        key: PathBuf,
        source: rustls::Error,
    },
}

fn pem_reason(e: pem::Error, what: &str) -> String {
    match e {
        pem::Error::Io(io) => format!("cannot read the file: {io}"),
        pem::Error::NoItemsFound => format!("no {what} PEM block in the file"),
        other => format!("not a valid PEM file: {other}"),
    }
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let err = |reason: String| TlsError::Cert {
        path: path.to_path_buf(),
        reason,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| err(pem_reason(e, "CERTIFICATE")))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(pem_reason(e, "CERTIFICATE")))?;
    if certs.is_empty() {
        return Err(err(pem_reason(pem::Error::NoItemsFound, "CERTIFICATE")));
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::Key {
        path: path.to_path_buf(),
        reason: pem_reason(e, "PRIVATE KEY"),
    })
}

/// The rustls server config for `files`.
pub fn server_config(files: &TlsFiles) -> Result<ServerConfig, TlsError> {
    let certs = read_certs(&files.cert_path)?;
    let key = read_key(&files.key_path)?;
    let config_err = |source| TlsError::Config {
        cert: files.cert_path.clone(),
        key: files.key_path.clone(),
        source,
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(config_err)?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(config_err)?;
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(cfg)
}

/// The acceptor for `files`.
pub fn acceptor(files: &TlsFiles) -> Result<TlsAcceptor, TlsError> {
    Ok(TlsAcceptor::from(Arc::new(server_config(files)?)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tandem-tls-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let p = dir.join(name);
        std::fs::write(&p, text).expect("write");
        p
    }

    fn files(cert: &Path, key: &Path) -> TlsFiles {
        TlsFiles {
            cert_path: cert.to_path_buf(),
            key_path: key.to_path_buf(),
        }
    }

    #[test]
    fn a_generated_pair_loads_and_bad_files_are_named() {
        let c = rcgen::generate_simple_self_signed(vec!["localhost".into()]).expect("cert");
        let cert = temp("cert.pem", &c.cert.pem());
        let key = temp("key.pem", &c.signing_key.serialize_pem());
        let cfg = server_config(&files(&cert, &key)).expect("valid pair");
        assert_eq!(cfg.alpn_protocols[1], b"http/1.1");

        let garbage = temp("garbage.pem", "this is not PEM\n");
        let e = server_config(&files(&garbage, &key))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--tls-cert-path") && e.contains("garbage.pem"),
            "{e}"
        );
        // A certificate where the key should be: no key in that file.
        let e = server_config(&files(&cert, &cert)).unwrap_err().to_string();
        assert!(
            e.contains("--tls-key-path") && e.contains("cert.pem"),
            "{e}"
        );
        let missing = cert.with_file_name("missing.pem");
        let e = server_config(&files(&missing, &key))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("missing.pem") && e.contains("cannot read"),
            "{e}"
        );
        // A key of another certificate.
        let other = rcgen::generate_simple_self_signed(vec!["other".into()]).expect("cert");
        let other_key = temp("other-key.pem", &other.signing_key.serialize_pem());
        let e = server_config(&files(&cert, &other_key))
            .unwrap_err()
            .to_string();
        assert!(e.contains("cert.pem") && e.contains("other-key.pem"), "{e}");
    }
}
