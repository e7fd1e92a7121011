//! The internal mutual-TLS folder the tests' processes share: made once per test process in a
//! temp folder, as `tandem certs` makes one.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tandem_pki::{ChannelSecurity, InternalIdentity};

/// A TLS folder of its own deployment (own CA) for this test process.
pub fn internal_tls_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("tandem-test-pki-{}", std::process::id()));
        // A folder left by an earlier process of the same pid is another deployment's.
        let _ = std::fs::remove_dir_all(&dir);
        make_deployment(&dir);
        dir
    })
}

/// Makes a TLS folder of a new deployment (a CA of its own) at `dir`; its node certificate
/// also names 127.0.0.1 and localhost, for the test's etcd and nats-server.
pub fn make_deployment(dir: &Path) {
    let hosts = ["127.0.0.1".to_string(), "localhost".to_string()];
    if let Err(e) = tandem_pki::generate(dir, &hosts) {
        panic!("cannot make a test TLS folder at {}: {e}", dir.display());
    }
}

/// The flags that give a process [`internal_tls_dir`].
pub fn tls_args() -> [String; 2] {
    [
        "--internal-tls-dir".to_string(),
        internal_tls_dir().display().to_string(),
    ]
}

/// What a test's own gRPC clients of the processes it started use.
pub fn internal_security() -> ChannelSecurity {
    match InternalIdentity::load(internal_tls_dir()) {
        Ok(id) => ChannelSecurity::MutualTls(id),
        Err(e) => panic!("cannot load the test TLS folder: {e}"),
    }
}
