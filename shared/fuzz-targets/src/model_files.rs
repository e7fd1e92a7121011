//! Model files as the engine loads them: GGUF headers (with the metadata → config and
//! tokenizer conversions and the tensor reads), safetensors headers (with the tensor reads),
//! and `config.json` / `generation_config.json`.

use std::path::{Path, PathBuf};

use tandem_engine::model::gguf::{config_json, GgufFile};
use tandem_engine::model::{GenerationConfig, ModelConfig, Weights};
use tandem_engine::tokenizer::gguf::tokenizer_files;

/// Tensors read per input at most (each read is bounded by the file's size anyway).
const MAX_TENSOR_READS: usize = 16;

/// Writes `data` to `name` in this process's scratch folder (the loaders take paths and map
/// the file) and returns its path.
fn scratch_file(sub: &str, name: &str, data: &[u8]) -> PathBuf {
    let dir = crate::scratch_dir().join(sub);
    std::fs::create_dir_all(&dir).expect("create a scratch folder");
    let path = dir.join(name);
    std::fs::write(&path, data).expect("write a scratch file");
    path
}

/// A GGUF file: the header; then, as loading a model does, the config and tokenizer built
/// from its metadata and the tensors read (dequantized) with their own shapes.
pub fn gguf_header(data: &[u8]) {
    let path = scratch_file("gguf", "model.gguf", data);
    let Ok(f) = GgufFile::open(&path) else {
        return;
    };
    if let Ok(config) = config_json(&f) {
        let bytes = serde_json::to_vec(&config).expect("a JSON value prints");
        let _ = ModelConfig::parse(&bytes, &path);
    }
    let _ = tokenizer_files(&f);
    for t in f.tensors.iter().take(MAX_TENSOR_READS) {
        if let Ok(v) = f.tensor_f32(&t.name, &t.shape()) {
            assert_eq!(Some(v.len()), t.n_elements(), "{}", t.name);
        }
    }
}

/// A `model.safetensors`: the header as the engine maps it, then every tensor read with the
/// shape its header gives (f32 and bf16 matrices).
pub fn safetensors_header(data: &[u8]) {
    let path = scratch_file("safetensors", "model.safetensors", data);
    let folder = path.parent().unwrap_or(Path::new("."));
    let Ok(weights) = Weights::load(folder) else {
        return;
    };
    let Ok((_, meta)) = safetensors::SafeTensors::read_metadata(data) else {
        panic!("the engine loaded a header that safetensors itself refuses");
    };
    for (name, info) in meta.tensors().into_iter().take(MAX_TENSOR_READS) {
        assert!(weights.contains(&name), "{name}");
        let n: usize = info.shape.iter().product();
        if let Ok(v) = weights.tensor_f32(&name, &info.shape) {
            assert_eq!(v.len(), n, "{name}");
        }
        let _ = weights.tensor_matrix(&name, &info.shape);
    }
}

/// `config.json` and `generation_config.json` bytes.
pub fn model_config(data: &[u8]) {
    let path = Path::new("config.json");
    if let Ok(cfg) = ModelConfig::parse(data, path) {
        // What the decoder derives from a config must not panic either.
        let _ = cfg.group_size();
        let _ = cfg.rope_inv_freq();
    }
    let _ = GenerationConfig::parse(data, Path::new("generation_config.json"));
}
