use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::{MediaError, Result};

/// Limits on image inputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaPolicy {
    /// Local files (`file:` URLs) are only read from inside this folder; `None` refuses them all.
    pub allowed_local_media_path: Option<PathBuf>,
    /// The most bytes of an encoded image (a file, or a data URL once decoded from base64).
    pub max_file_size_bytes: u64,
    /// The most pixels (width * height) of a decoded image.
    pub max_pixels: u64,
    /// The largest width or height of a decoded image.
    pub max_dimension: u32,
}

impl Default for MediaPolicy {
    fn default() -> Self {
        Self {
            allowed_local_media_path: None,
            max_file_size_bytes: 20 * 1024 * 1024,
            max_pixels: 32 * 1024 * 1024,
            max_dimension: 16_384,
        }
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> MediaError + '_ {
    move |source| MediaError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Reads a local image file under `policy`: refused when no allowed folder is set; the path
/// is canonicalised (symlinks and `..` resolved) and must lie inside the canonicalised allowed
/// folder; the size is checked before reading and the read itself is bounded.
pub fn load_local_file(path: &Path, policy: &MediaPolicy) -> Result<Vec<u8>> {
    let allowed = policy
        .allowed_local_media_path
        .as_deref()
        .ok_or(MediaError::LocalMediaDisabled)?;
    let allowed = allowed.canonicalize().map_err(io_err(allowed))?;
    let canonical = path.canonicalize().map_err(io_err(path))?;
    if !canonical.starts_with(&allowed) {
        return Err(MediaError::OutsideAllowedFolder {
            path: path.to_path_buf(),
        });
    }
    let file = File::open(&canonical).map_err(io_err(path))?;
    let meta = file.metadata().map_err(io_err(path))?;
    if !meta.is_file() {
        return Err(MediaError::NotAFile {
            path: path.to_path_buf(),
        });
    }
    let max = policy.max_file_size_bytes;
    if meta.len() > max {
        return Err(MediaError::FileTooLarge {
            path: path.to_path_buf(),
            size: meta.len(),
            max,
        });
    }
    // The file may grow between the check and the read: read at most one byte past the cap.
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    file.take(max.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(io_err(path))?;
    if bytes.len() as u64 > max {
        return Err(MediaError::FileTooLarge {
            path: path.to_path_buf(),
            size: bytes.len() as u64,
            max,
        });
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct TempDir(PathBuf);
    impl TempDir {
        fn new(name: &str) -> Self {
            let p = std::env::temp_dir().join(format!(
                "tandem-media-{name}-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            Self(p)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// root/allowed/img.bin (5 bytes), root/outside.bin, root/allowed/sub/
    fn setup(name: &str) -> (TempDir, MediaPolicy) {
        let t = TempDir::new(name);
        let allowed = t.0.join("allowed");
        std::fs::create_dir_all(allowed.join("sub")).unwrap();
        std::fs::write(allowed.join("img.bin"), b"hello").unwrap();
        std::fs::write(t.0.join("outside.bin"), b"secret").unwrap();
        let policy = MediaPolicy {
            allowed_local_media_path: Some(allowed),
            max_file_size_bytes: 5,
            ..MediaPolicy::default()
        };
        (t, policy)
    }

    #[test]
    fn reads_inside_folder() {
        let (t, p) = setup("inside");
        let path = t.0.join("allowed/sub/../img.bin");
        assert_eq!(load_local_file(&path, &p).unwrap(), b"hello");
    }

    #[test]
    fn disabled_without_folder() {
        let (t, mut p) = setup("disabled");
        p.allowed_local_media_path = None;
        assert!(matches!(
            load_local_file(&t.0.join("allowed/img.bin"), &p),
            Err(MediaError::LocalMediaDisabled)
        ));
    }

    #[test]
    fn outside_folder() {
        let (t, p) = setup("outside");
        assert!(matches!(
            load_local_file(&t.0.join("outside.bin"), &p),
            Err(MediaError::OutsideAllowedFolder { .. })
        ));
    }

    #[test]
    fn dotdot_escape() {
        let (t, p) = setup("dotdot");
        assert!(matches!(
            load_local_file(&t.0.join("allowed/sub/../../outside.bin"), &p),
            Err(MediaError::OutsideAllowedFolder { .. })
        ));
    }

    #[test]
    fn prefix_sibling_is_outside() {
        let (t, p) = setup("sibling");
        let sib = t.0.join("allowed2");
        std::fs::create_dir_all(&sib).unwrap();
        std::fs::write(sib.join("x.bin"), b"x").unwrap();
        assert!(matches!(
            load_local_file(&sib.join("x.bin"), &p),
            Err(MediaError::OutsideAllowedFolder { .. })
        ));
    }

    #[cfg(unix)]
    #[test]
    fn symlink_escape() {
        let (t, p) = setup("symlink");
        let link = t.0.join("allowed/link.bin");
        std::os::unix::fs::symlink(t.0.join("outside.bin"), &link).unwrap();
        assert!(matches!(
            load_local_file(&link, &p),
            Err(MediaError::OutsideAllowedFolder { .. })
        ));
        // A symlinked directory inside the folder pointing outside is refused too.
        let dirlink = t.0.join("allowed/up");
        std::os::unix::fs::symlink(&t.0, &dirlink).unwrap();
        assert!(matches!(
            load_local_file(&dirlink.join("outside.bin"), &p),
            Err(MediaError::OutsideAllowedFolder { .. })
        ));
    }

    #[test]
    fn too_big() {
        let (t, p) = setup("big");
        std::fs::write(t.0.join("allowed/big.bin"), b"123456").unwrap();
        assert!(matches!(
            load_local_file(&t.0.join("allowed/big.bin"), &p),
            Err(MediaError::FileTooLarge {
                size: 6,
                max: 5,
                ..
            })
        ));
    }

    #[test]
    fn missing_and_directory() {
        let (t, p) = setup("missing");
        assert!(matches!(
            load_local_file(&t.0.join("allowed/nope.bin"), &p),
            Err(MediaError::Io { .. })
        ));
        assert!(matches!(
            load_local_file(&t.0.join("allowed/sub"), &p),
            Err(MediaError::NotAFile { .. })
        ));
    }
}
