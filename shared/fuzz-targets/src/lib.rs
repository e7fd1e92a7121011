//! The bodies of Tandem's fuzz targets, one plain function per target taking the raw input.
//!
//! Each function must never panic (nor abort, hang or allocate without bound) whatever the
//! bytes; where a check is cheap it also asserts a round trip or an invariant. Two callers:
//! - `fuzz/` (cargo-fuzz, nightly, excluded from the workspace): one thin `fuzz_target!` per
//!   entry of [`TARGETS`], run by `scripts/fuzz` for a bounded time in CI;
//! - `tests/corpora.rs` (stable): replays every file of `fuzz/corpus/<target>/` and
//!   `fuzz/regressions/<target>/` through the same function, so `cargo test --workspace`
//!   replays the corpora and every crasher ever found.
//!
//! The seed corpora are written by `cargo test -p tandem-fuzz-targets -- --ignored seeds`
//! (`tests/seeds.rs`).

pub mod config;
pub mod kv_events;
pub mod kv_transfer;
pub mod model_files;
pub mod openai;

/// A fuzz target: its name (the folder of its corpus and the `fuzz/` binary) and its body.
pub type Target = (&'static str, fn(&[u8]));

/// Every target, in the order `scripts/fuzz` runs them.
pub const TARGETS: &[Target] = &[
    ("openai_request", openai::openai_request),
    ("config_yaml", config::config_yaml),
    ("config_pyliteral", config::config_pyliteral),
    ("config_cli_env", config::config_cli_env),
    ("gguf_header", model_files::gguf_header),
    ("safetensors_header", model_files::safetensors_header),
    ("model_config", model_files::model_config),
    ("kv_transfer_frames", kv_transfer::kv_transfer_frames),
    (
        "kv_transfer_descriptor",
        kv_transfer::kv_transfer_descriptor,
    ),
    ("kv_events", kv_events::kv_events),
];

/// A scratch folder of this process for the targets whose parser reads a file (`/dev/shm`
/// when there is one, so writes stay in memory).
pub(crate) fn scratch_dir() -> &'static std::path::Path {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let shm = std::path::Path::new("/dev/shm");
        let base = if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("tandem-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create the fuzz scratch folder");
        dir
    })
}
