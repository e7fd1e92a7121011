//! Replays every seed-corpus file (`fuzz/corpus/<target>/`) and every crasher kept as a
//! regression (`fuzz/regressions/<target>/`) through its target's function, on stable, as
//! part of `cargo test --workspace`. A file that panics fails the test, named.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use tandem_fuzz_targets::TARGETS;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

#[test]
fn every_corpus_file_and_regression_replays_without_panicking() {
    let root = fuzz_dir();
    let mut failures = Vec::new();
    for (name, body) in TARGETS {
        let corpus = files(&root.join("corpus").join(name));
        assert!(!corpus.is_empty(), "fuzz/corpus/{name}/ has no seed");
        for path in corpus
            .into_iter()
            .chain(files(&root.join("regressions").join(name)))
        {
            let data = std::fs::read(&path).expect("read a corpus file");
            if catch_unwind(AssertUnwindSafe(|| body(&data))).is_err() {
                failures.push(path.display().to_string());
            }
        }
    }
    assert!(failures.is_empty(), "inputs that panic: {failures:#?}");
}

/// Every target has its `fuzz_target!` wrapper and a `[[bin]]` in fuzz/Cargo.toml, and every
/// corpus folder belongs to a target.
#[test]
fn the_fuzz_crate_wraps_every_target() {
    let root = fuzz_dir();
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).expect("fuzz/Cargo.toml");
    for (name, _) in TARGETS {
        let wrapper = root.join("fuzz_targets").join(format!("{name}.rs"));
        let text = std::fs::read_to_string(&wrapper)
            .unwrap_or_else(|_| panic!("{} is missing", wrapper.display()));
        assert!(
            text.contains(&format!("::{name}(")),
            "{} does not call {name}",
            wrapper.display()
        );
        assert!(
            manifest.contains(&format!("name = \"{name}\"")),
            "fuzz/Cargo.toml has no [[bin]] {name}"
        );
    }
    for sub in ["corpus", "regressions"] {
        for dir in std::fs::read_dir(root.join(sub))
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = dir.file_name().to_string_lossy().into_owned();
            assert!(
                TARGETS.iter().any(|(t, _)| *t == name),
                "fuzz/{sub}/{name} belongs to no target"
            );
        }
    }
}
