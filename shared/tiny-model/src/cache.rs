//! Tandem's cache of generated models ([`tandem_config::paths::cache_dir`]): each folder is
//! built once, in a temp folder renamed into place, so that concurrent builders never see a
//! half-written one.

use std::path::{Path, PathBuf};

use tandem_config::paths::cache_dir;

use crate::{
    write_shape_check_model, write_tiny_model, TinyModelError, SHAPE_CHECK_VERSION,
    TINY_MODEL_VERSION,
};

/// The default tiny model's folder in the cache, built there if absent. Idempotent and safe
/// when several processes call it at once: each builds in its own temp folder and renames it
/// into place; a loser of the race drops its copy and uses the winner's.
pub fn ensure_tiny_model() -> Result<PathBuf, TinyModelError> {
    let dir = cache_dir().join(format!("tiny-qwen3-v{TINY_MODEL_VERSION}"));
    build_once(&dir, write_tiny_model)?;
    Ok(dir)
}

/// The shape-check model's folder in the cache (with tokenizer files), built if absent.
pub fn ensure_shape_check_model() -> Result<PathBuf, TinyModelError> {
    let dir = cache_dir().join(format!("qwen3-shape-check-v{SHAPE_CHECK_VERSION}"));
    build_once(&dir, |tmp| write_shape_check_model(tmp, true))?;
    Ok(dir)
}

/// Runs `build` into a fresh temp sibling of `dir` and renames it to `dir`, unless `dir`
/// exists already (a complete folder, since it only ever appears by rename).
pub fn build_once<E: From<TinyModelError>>(
    dir: &Path,
    build: impl FnOnce(&Path) -> Result<(), E>,
) -> Result<(), E> {
    if dir.is_dir() {
        return Ok(());
    }
    let parent = dir.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| TinyModelError::io(parent, e))?;
    // Unique per process and per call, so that threads of one test process do not collide.
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("dir");
    let tmp = parent.join(format!(".{name}.tmp-{}-{call}", std::process::id()));
    // A leftover of a crashed process with the same pid would mix files: start empty.
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| TinyModelError::io(&tmp, e))?;
    let result = build(&tmp).and_then(|()| match std::fs::rename(&tmp, dir) {
        Ok(()) => Ok(()),
        // Another process finished first: its folder is as good as ours.
        Err(_) if dir.is_dir() => Ok(()),
        Err(e) => Err(TinyModelError::io(dir, e).into()),
    });
    let _ = std::fs::remove_dir_all(&tmp);
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::write::write_file;

    #[test]
    fn build_once_keeps_the_first_complete_folder() {
        let root = std::env::temp_dir().join(format!("tandem-once-{}", std::process::id()));
        let dir = root.join("thing");
        build_once(&dir, |t| write_file(&t.join("a"), b"1")).unwrap();
        build_once(&dir, |t| write_file(&t.join("a"), b"2")).unwrap();
        assert_eq!(std::fs::read(dir.join("a")).unwrap(), b"1");
        let bad = root.join("bad");
        assert!(build_once(&bad, |_| Err(TinyModelError::Fetch("no".into()))).is_err());
        assert!(!bad.exists());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
