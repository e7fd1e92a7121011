//! Writing a random checkpoint: weights ([`crate::weights`]) in `model.safetensors`,
//! `config.json` and `generation_config.json`.

use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};

use crate::tokenizer::{copy_tokenizer_files, ensure_tokenizer_files};
use crate::{
    qwen3_config_json, random_init, random_tensor, shapes::tensor_shapes, TinyDims, TinyModelError,
    SHAPE_CHECK, SHAPE_CHECK_SEED, TINY, TINY_SEED,
};

/// Element type of a written checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDtype {
    F32,
    Bf16,
}

/// Writes the tiny model into `out_dir` (created if absent): weights, configs and the
/// tokenizer files (fetched into the cache first if needed).
pub fn write_tiny_model(out_dir: &Path) -> Result<(), TinyModelError> {
    let tok_dir = ensure_tokenizer_files()?;
    write_random_qwen3(out_dir, &TINY, TINY_SEED, WeightDtype::F32)?;
    copy_tokenizer_files(&tok_dir, out_dir)
}

/// Writes the shape-check model ([`SHAPE_CHECK`]) into `out_dir`, with the tokenizer files
/// when `with_tokenizer` (the engine's loader wants them; transformers needs only the weights).
pub fn write_shape_check_model(out_dir: &Path, with_tokenizer: bool) -> Result<(), TinyModelError> {
    write_random_qwen3(out_dir, &SHAPE_CHECK, SHAPE_CHECK_SEED, WeightDtype::Bf16)?;
    if with_tokenizer {
        copy_tokenizer_files(&ensure_tokenizer_files()?, out_dir)?;
    }
    Ok(())
}

/// Writes a random Qwen3 checkpoint (weights from [`random_tensor`] with [`random_init`]),
/// `config.json` and `generation_config.json` into `out_dir`.
pub fn write_random_qwen3(
    out_dir: &Path,
    dims: &TinyDims,
    seed: u64,
    dtype: WeightDtype,
) -> Result<(), TinyModelError> {
    let torch_dtype = match dtype {
        WeightDtype::F32 => "float32",
        WeightDtype::Bf16 => "bfloat16",
    };
    write_random_model(out_dir, &qwen3_config_json(dims, torch_dtype), seed, dtype)
}

/// Writes a random checkpoint of any supported family for this `config.json` (weights from
/// [`random_tensor`] with [`random_init`], the tensors of [`tensor_shapes`]), the config and
/// `generation_config.json` into `out_dir`.
pub fn write_random_model(
    out_dir: &Path,
    cfg: &serde_json::Value,
    seed: u64,
    dtype: WeightDtype,
) -> Result<(), TinyModelError> {
    std::fs::create_dir_all(out_dir).map_err(|e| TinyModelError::io(out_dir, e))?;
    let tensors = random_tensors(&tensor_shapes(cfg)?, seed, dtype, random_init);
    let st_path = out_dir.join("model.safetensors");
    write_file(&st_path, &serialize_safetensors(&st_path, &tensors, dtype)?)?;
    write_file(&out_dir.join("config.json"), &pretty(cfg))?;
    write_file(
        &out_dir.join("generation_config.json"),
        &pretty(&generation_config()),
    )
}

/// A named tensor's shape and little-endian bytes.
pub(crate) type TensorBytes = (String, Vec<usize>, Vec<u8>);

/// Every tensor's values ([`random_tensor`] with the mean and std `init` gives for the
/// tensor's name and shape, [`random_init`] for the decoders) in `dtype`.
pub(crate) fn random_tensors(
    shapes: &[(String, Vec<usize>)],
    seed: u64,
    dtype: WeightDtype,
    init: impl Fn(&str, &[usize]) -> (f32, f32),
) -> Vec<TensorBytes> {
    shapes
        .iter()
        .map(|(name, shape)| {
            let (mean, std) = init(name, shape);
            let n = shape.iter().product();
            let values = random_tensor(seed, name, n, mean, std);
            let bytes = match dtype {
                WeightDtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                WeightDtype::Bf16 => values
                    .iter()
                    .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                    .collect(),
            };
            (name.clone(), shape.clone(), bytes)
        })
        .collect()
}

/// The safetensors file of these tensors (`st_path` names it in errors).
pub(crate) fn serialize_safetensors(
    st_path: &Path,
    tensors: &[TensorBytes],
    dtype: WeightDtype,
) -> Result<Vec<u8>, TinyModelError> {
    let st_dtype = match dtype {
        WeightDtype::F32 => Dtype::F32,
        WeightDtype::Bf16 => Dtype::BF16,
    };
    let tensor_error = |tensor: &str, e: safetensors::SafeTensorError| TinyModelError::Tensor {
        path: st_path.to_path_buf(),
        tensor: tensor.to_string(),
        message: e.to_string(),
    };
    let mut views = Vec::with_capacity(tensors.len());
    for (name, shape, bytes) in tensors {
        let view =
            TensorView::new(st_dtype, shape.clone(), bytes).map_err(|e| tensor_error(name, e))?;
        views.push((name.clone(), view));
    }
    safetensors::serialize(views, None).map_err(|e| tensor_error("*", e))
}

/// `generation_config.json` as Qwen3's.
pub(crate) fn generation_config() -> serde_json::Value {
    serde_json::json!({
        "bos_token_id": 151643,
        "do_sample": true,
        "eos_token_id": [151645, 151643],
        "pad_token_id": 151643,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95
    })
}

pub(crate) fn pretty(v: &serde_json::Value) -> Vec<u8> {
    let mut s = serde_json::to_vec_pretty(v).unwrap_or_default();
    s.push(b'\n');
    s
}

pub(crate) fn write_file(path: &Path, bytes: &[u8]) -> Result<(), TinyModelError> {
    std::fs::write(path, bytes).map_err(|e| TinyModelError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{family_model_spec, FAMILY_MODELS};
    use sha2::{Digest, Sha256};

    /// sha256 of each tiny model's `model.safetensors`, as the goldens in
    /// `shared/engine/tests/goldens/` were made from (their `weights_sha256`).
    const WEIGHTS_SHA256: [(&str, &str); 6] = [
        (
            "tiny",
            "973137d9ddc5f0c76aec1a68163e902e61fe662ca088d41910877ba9b4987082",
        ),
        (
            "shape-check",
            "84e205f7442e462098ba344774a9df420ee4f783e66066d33b4934699ad36be3",
        ),
        (
            "qwen2",
            "f0346ae8c1212e53d016d747952193298bfb5eaa5ef502ba8d52478beb19d6b4",
        ),
        (
            "llama3",
            "94a622adb0bcf4671239a0f70b1029f21443f6e096c2e94a1adc358511611677",
        ),
        (
            "mistral",
            "dfd83975a67b557fa5b06ce6ae061bfc0cd79f5660b50cac16ad203cd342208e",
        ),
        (
            "llama-bias",
            "cf00eb23a69f57e9f674a7724683f058adf83c44aa7eb7b0ebfef8683ea24302",
        ),
    ];

    fn weights_sha256(dir: &Path) -> String {
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    #[test]
    fn written_weights_are_the_goldens_weights() {
        let root = std::env::temp_dir().join(format!("tandem-tiny-pin-{}", std::process::id()));
        for (name, want) in WEIGHTS_SHA256 {
            let dir = root.join(name);
            match name {
                "tiny" => write_random_qwen3(&dir, &TINY, TINY_SEED, WeightDtype::F32),
                "shape-check" => {
                    write_random_qwen3(&dir, &SHAPE_CHECK, SHAPE_CHECK_SEED, WeightDtype::Bf16)
                }
                _ => {
                    let (_, cfg, seed) = family_model_spec(name).unwrap();
                    write_random_model(&dir, &cfg, seed, WeightDtype::F32)
                }
            }
            .unwrap();
            assert_eq!(weights_sha256(&dir), want, "{name}");
        }
        assert_eq!(FAMILY_MODELS.len() + 2, WEIGHTS_SHA256.len());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
