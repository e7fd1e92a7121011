//! Where Tandem keeps files of its own on the local machine.

use std::path::PathBuf;

/// The cache folder (the built-in tiny model, the tokenizer files, the router's tokenizer
/// cache): `$TANDEM_CACHE_DIR`, else `$XDG_CACHE_HOME/tandem`, else `~/.cache/tandem`, else a
/// folder under the system temp dir.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TANDEM_CACHE_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("tandem");
    }
    if let Some(h) = std::env::var_os("HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(h).join(".cache").join("tandem");
    }
    std::env::temp_dir().join("tandem-cache")
}
