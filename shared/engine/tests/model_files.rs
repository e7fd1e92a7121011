//! Loading model folders: every broken folder is a clear error naming the file (and tensor).

use std::path::{Path, PathBuf};

use tandem_engine::backend::cpu::CpuBackend;
use tandem_engine::backend::Backend;
use tandem_engine::kv::layout::{KvDtype, LAYOUT_VERSION};
use tandem_engine::model::{LoadOptions, LoadedModel};

/// A scratch folder linking the tiny model's files, with `config.json` rewritten by `edit`
/// and the files in `drop` left out.
fn variant(tag: &str, edit: impl Fn(&mut serde_json::Value), drop: &[&str]) -> PathBuf {
    let src = tandem_engine::tiny::ensure_tiny_model().expect("tiny model");
    let dir = std::env::temp_dir().join(format!("tandem-mf-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        if !drop.contains(&f) {
            std::os::unix::fs::symlink(src.join(f), dir.join(f)).expect("symlink");
        }
    }
    if !drop.contains(&"config.json") {
        let mut cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(src.join("config.json")).expect("read"))
                .expect("parse");
        edit(&mut cfg);
        std::fs::write(dir.join("config.json"), cfg.to_string()).expect("write");
    }
    dir
}

fn load_err(dir: &Path) -> String {
    let e = LoadedModel::load(dir, &LoadOptions::default())
        .expect_err("load should fail")
        .to_string();
    let _ = std::fs::remove_dir_all(dir);
    e
}

#[test]
fn loads_the_tiny_model_with_everything() {
    let dir = tandem_engine::tiny::ensure_tiny_model().expect("tiny model");
    let m = LoadedModel::load(&dir, &LoadOptions::default()).expect("load");
    assert_eq!(m.config.num_hidden_layers, 2);
    assert_eq!(m.eos_token_ids(), vec![151645, 151643]);
    assert!(m.chat_template.is_some());
    assert_eq!(m.model_id.len(), 64);
    let be = CpuBackend::new(&m, KvDtype::Bf16, 32, 4).expect("backend");
    let l = be.layout();
    assert_eq!(l.version, LAYOUT_VERSION);
    assert_eq!(l.model_id, m.model_id);
    assert_eq!(l.block_bytes(), 2 * 2 * 32 * 2 * 16 * 2);
    assert_eq!(be.vocab_size(), 151_936);
    // The same folder gives the same identity; a router can skip the weights.
    let m2 = LoadedModel::load(&dir, &LoadOptions::no_weights()).expect("load");
    assert_eq!(m2.model_id, m.model_id);
    assert_eq!(m2.tokenizer_hash, m.tokenizer_hash);
    let e = CpuBackend::new(&m2, KvDtype::F32, 32, 4)
        .err()
        .expect("no weights, no backend");
    assert!(e.to_string().contains("without its weights"), "{e}");
}

#[test]
fn missing_path_and_files_are_named() {
    let e = load_err(Path::new("/nonexistent/model"));
    assert!(e.contains("/nonexistent/model"), "{e}");
    let e = load_err(&variant("nocfg", |_| {}, &["config.json"]));
    assert!(e.contains("config.json"), "{e}");
    let e = load_err(&variant("nowts", |_| {}, &["model.safetensors"]));
    assert!(e.contains("model.safetensors"), "{e}");
    let e = load_err(&variant("notok", |_| {}, &["tokenizer.json"]));
    assert!(e.contains("tokenizer.json"), "{e}");
}

#[test]
fn unknown_architecture_is_named() {
    let e = load_err(&variant(
        "arch",
        |c| c["architectures"] = serde_json::json!(["GPTNeoXForCausalLM"]),
        &[],
    ));
    assert!(
        e.contains("GPTNeoXForCausalLM") && e.contains("config.json"),
        "{e}"
    );
}

#[test]
fn wrong_shapes_name_the_file_and_tensor() {
    let e = load_err(&variant(
        "shape",
        |c| c["intermediate_size"] = 96.into(),
        &[],
    ));
    assert!(
        e.contains("model.layers.0.mlp.gate_proj.weight") && e.contains("model.safetensors"),
        "{e}"
    );
    assert!(e.contains("[128, 64]") && e.contains("[96, 64]"), "{e}");
    let e = load_err(&variant(
        "untied",
        |c| c["tie_word_embeddings"] = false.into(),
        &[],
    ));
    assert!(e.contains("lm_head.weight") && e.contains("missing"), "{e}");
}
