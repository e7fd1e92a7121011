//! Making a deployment's TLS folder: a fresh CA, one node certificate it signs, and the CA's key
//! thrown away.

use std::io::Write;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use crate::{PkiError, CA_FILE, CERT_FILE, INTERNAL_SERVER_NAME, KEY_FILE};

/// Years a generated certificate is valid.
const VALIDITY_YEARS: i32 = 10;

/// What [`generate`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Generated {
    /// The folder already held a complete set; nothing was written.
    Existing,
    /// A new CA and node certificate were written.
    Created,
}

fn this_year() -> i32 {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    // Mean Gregorian year; a day off at a year boundary does not matter with a margin of one.
    1970 + (secs / 31_556_952) as i32
}

fn validity(params: &mut CertificateParams) {
    let year = this_year();
    params.not_before = rcgen::date_time_ymd(year - 1, 1, 1);
    params.not_after = rcgen::date_time_ymd(year + VALIDITY_YEARS, 1, 1);
}

fn write(path: &Path, contents: &str, private: bool) -> Result<(), PkiError> {
    let err = |source| PkiError::Write {
        path: path.to_owned(),
        source,
    };
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    if private {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    #[cfg(not(unix))]
    let _ = private;
    let mut file = options.open(path).map_err(err)?;
    file.write_all(contents.as_bytes()).map_err(err)?;
    file.sync_all().map_err(err)
}

/// Makes `dir` a deployment TLS folder unless it already is one. `hosts` are extra names
/// (DNS names or IP addresses) put in the node certificate beside [`INTERNAL_SERVER_NAME`],
/// for clients that check a host name of their own (etcd, NATS). Safe against concurrent
/// callers: a new folder is written beside `dir` and renamed into place, and a loser of that
/// race uses the winner's.
pub fn generate(dir: &Path, hosts: &[String]) -> Result<Generated, PkiError> {
    match state(dir)? {
        State::Complete => return Ok(Generated::Existing),
        State::Empty => {
            write_set(dir, hosts)?;
            return Ok(Generated::Created);
        }
        State::Absent => {}
    }
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let staging = dir.with_file_name(format!(
        ".{name}.new-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&staging);
    let created = write_set(&staging, hosts).and_then(|()| {
        std::fs::rename(&staging, dir).map_err(|source| PkiError::Write {
            path: dir.to_owned(),
            source,
        })
    });
    match created {
        Ok(()) => Ok(Generated::Created),
        Err(e) => {
            let _ = std::fs::remove_dir_all(&staging);
            // Another process made the folder first: use its set.
            match state(dir) {
                Ok(State::Complete) => Ok(Generated::Existing),
                _ => Err(e),
            }
        }
    }
}

enum State {
    Absent,
    Empty,
    Complete,
}

fn state(dir: &Path) -> Result<State, PkiError> {
    if !dir.exists() {
        return Ok(State::Absent);
    }
    let paths: [PathBuf; 3] = [dir.join(CA_FILE), dir.join(CERT_FILE), dir.join(KEY_FILE)];
    let present: Vec<bool> = paths.iter().map(|p| p.exists()).collect();
    match (
        present.iter().position(|p| *p),
        present.iter().position(|p| !*p),
    ) {
        (Some(_), None) => Ok(State::Complete),
        (None, _) => Ok(State::Empty),
        (Some(i), Some(missing)) => Err(PkiError::Incomplete(
            paths[i].clone(),
            paths[missing].clone(),
        )),
    }
}

/// Writes a new CA's certificate and a node certificate and key into `dir`.
fn write_set(dir: &Path, hosts: &[String]) -> Result<(), PkiError> {
    std::fs::create_dir_all(dir).map_err(|source| PkiError::Write {
        path: dir.to_owned(),
        source,
    })?;

    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "Tandem deployment CA");
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    validity(&mut ca_params);
    let ca_cert = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, ca_key);

    let mut names = vec![INTERNAL_SERVER_NAME.to_owned()];
    names.extend(hosts.iter().cloned());
    let node_key = KeyPair::generate()?;
    let mut node = CertificateParams::new(names)?;
    node.distinguished_name
        .push(DnType::CommonName, INTERNAL_SERVER_NAME);
    node.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    node.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    validity(&mut node);
    let node_cert = node.signed_by(&node_key, &issuer)?;

    write(&dir.join(KEY_FILE), &node_key.serialize_pem(), true)?;
    write(&dir.join(CERT_FILE), &node_cert.pem(), false)?;
    write(&dir.join(CA_FILE), &ca_cert.pem(), false)
}
