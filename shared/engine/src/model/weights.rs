//! Safetensors weights, memory-mapped: one `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`. Tensors are converted to f32 on request (bf16, f16, f32).

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, SafeTensors};
use sha2::{Digest, Sha256};

use crate::backend::cpu_ops::Matrix;
use crate::error::EngineError;

const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";

struct Shard {
    path: PathBuf,
    mmap: Mmap,
    /// Offset of the data section (after the 8-byte length and the JSON header).
    data_start: usize,
    meta: Metadata,
}

/// The weights of a model folder.
pub struct Weights {
    shards: Vec<Shard>,
    /// Tensor name → index into `shards`.
    index: HashMap<String, usize>,
    identity: String,
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Weights")
            .field(
                "shards",
                &self.shards.iter().map(|s| &s.path).collect::<Vec<_>>(),
            )
            .field("tensors", &self.index.len())
            .field("identity", &self.identity)
            .finish()
    }
}

impl Weights {
    /// Maps the weights of `folder`: the index file when present, else `model.safetensors`.
    pub fn load(folder: &Path) -> Result<Self, EngineError> {
        let index_path = folder.join(INDEX_FILE);
        let files: Vec<String> = if index_path.is_file() {
            let bytes = std::fs::read(&index_path).map_err(|e| EngineError::io(&index_path, e))?;
            let v: serde_json::Value =
                serde_json::from_slice(&bytes).map_err(|e| EngineError::BadFile {
                    path: index_path.clone(),
                    message: format!("not valid JSON: {e}"),
                })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| EngineError::BadFile {
                    path: index_path.clone(),
                    message: "no \"weight_map\" object".into(),
                })?;
            let mut files: Vec<String> = map
                .values()
                .filter_map(|f| f.as_str().map(String::from))
                .collect();
            files.sort();
            files.dedup();
            files
        } else if folder.join(SINGLE_FILE).is_file() {
            vec![SINGLE_FILE.to_string()]
        } else {
            return Err(EngineError::MissingFile {
                folder: folder.to_path_buf(),
                file: format!("{SINGLE_FILE} (or {INDEX_FILE})"),
            });
        };
        let mut shards = Vec::with_capacity(files.len());
        let mut index = HashMap::new();
        let mut hasher = Sha256::new();
        for (i, name) in files.iter().enumerate() {
            let path = folder.join(name);
            tracing::info!(shard = %path.display(), "mapping weights {}/{}", i + 1, files.len());
            let file = File::open(&path).map_err(|e| EngineError::io(&path, e))?;
            // SAFETY: the file is opened read-only; a model folder is not rewritten while served.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| EngineError::io(&path, e))?;
            let (header_len, meta) =
                SafeTensors::read_metadata(&mmap).map_err(|e| EngineError::BadFile {
                    path: path.clone(),
                    message: format!("not a valid safetensors file: {e}"),
                })?;
            let data_start = 8 + header_len;
            hash_identity(&mut hasher, name, &mmap, data_start);
            for tname in meta.tensors().keys() {
                index.insert(tname.clone(), i);
            }
            shards.push(Shard {
                path,
                mmap,
                data_start,
                meta,
            });
        }
        let identity = hex(&hasher.finalize());
        Ok(Weights {
            shards,
            index,
            identity,
        })
    }

    /// A cheap identity of the weights: sha256 over each shard's name, size, header and 16
    /// samples of 4 KiB spread over its data. Hashing whole checkpoints (GBs) on every start
    /// would cost seconds; the header fixes names, shapes and dtypes, the samples catch
    /// different values of the same shapes.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Names of all tensors.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// The path of the file that holds `name` (for error messages), or of the first shard.
    pub fn file_of(&self, name: &str) -> PathBuf {
        let i = self.index.get(name).copied().unwrap_or(0);
        self.shards
            .get(i)
            .map(|s| s.path.clone())
            .unwrap_or_default()
    }

    /// The tensor `name` as a [`Matrix`], checking its shape: bf16 stays bf16 (the CPU
    /// kernels read it directly), f16 and f32 become f32.
    pub fn tensor_matrix(&self, name: &str, shape: &[usize]) -> Result<Matrix, EngineError> {
        if self.dtype_of(name) == Some(Dtype::BF16) {
            let v = self.tensor_with(name, shape, |bytes, n, err| {
                if bytes.len() != n * 2 {
                    return Err(err(format!(
                        "{} data bytes do not hold {n} elements",
                        bytes.len()
                    )));
                }
                Ok(bytes
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]]))
                    .collect())
            })?;
            return Ok(Matrix::Bf16(v));
        }
        self.tensor_f32(name, shape).map(Matrix::F32)
    }

    fn dtype_of(&self, name: &str) -> Option<Dtype> {
        let i = *self.index.get(name)?;
        self.shards[i].meta.info(name).map(|info| info.dtype)
    }

    /// The tensor `name` as f32, checking that its shape is `shape`.
    pub fn tensor_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, EngineError> {
        self.tensor_with(name, shape, |bytes, n, err| {
            let info_dtype = self.dtype_of(name);
            let out = match info_dtype {
                Some(Dtype::F32) => convert(bytes, n, 4, |b| {
                    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
                }),
                Some(Dtype::BF16) => convert(bytes, n, 2, |b| {
                    f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)
                }),
                Some(Dtype::F16) => convert(bytes, n, 2, |b| {
                    half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
                }),
                other => {
                    return Err(err(format!(
                        "dtype {} is not supported (expected bf16, f16 or f32)",
                        other.map(|d| format!("{d:?}")).unwrap_or_default()
                    )))
                }
            };
            out.ok_or_else(|| {
                err(format!(
                    "{} data bytes do not hold {n} elements",
                    bytes.len()
                ))
            })
        })
    }

    /// Finds `name`, checks its shape and hands its bytes and element count to `read`.
    fn tensor_with<T>(
        &self,
        name: &str,
        shape: &[usize],
        read: impl FnOnce(&[u8], usize, &dyn Fn(String) -> EngineError) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        let Some(&i) = self.index.get(name) else {
            let files: Vec<String> = self
                .shards
                .iter()
                .map(|s| s.path.display().to_string())
                .collect();
            return Err(EngineError::Tensor {
                path: PathBuf::from(files.join(", ")),
                tensor: name.to_string(),
                message: "missing".into(),
            });
        };
        let shard = &self.shards[i];
        let err = |message: String| EngineError::Tensor {
            path: shard.path.clone(),
            tensor: name.to_string(),
            message,
        };
        let info = shard
            .meta
            .info(name)
            .ok_or_else(|| err("missing from the header".into()))?;
        if info.shape != shape {
            return Err(err(format!("shape {:?}, expected {:?}", info.shape, shape)));
        }
        let (lo, hi) = info.data_offsets;
        let bytes = shard
            .mmap
            .get(shard.data_start + lo..shard.data_start + hi)
            .ok_or_else(|| err("data lies past the end of the file".into()))?;
        let n: usize = shape.iter().product();
        if !matches!(info.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
            return Err(err(format!(
                "dtype {:?} is not supported (expected bf16, f16 or f32)",
                info.dtype
            )));
        }
        read(bytes, n, &err)
    }
}

fn convert(bytes: &[u8], n: usize, width: usize, f: impl Fn(&[u8]) -> f32) -> Option<Vec<f32>> {
    if bytes.len() != n * width {
        return None;
    }
    Some(bytes.chunks_exact(width).map(f).collect())
}

fn hash_identity(hasher: &mut Sha256, name: &str, mmap: &[u8], data_start: usize) {
    hasher.update(name.as_bytes());
    hasher.update((mmap.len() as u64).to_le_bytes());
    hasher.update(&mmap[..data_start.min(mmap.len())]);
    let data = &mmap[data_start.min(mmap.len())..];
    const SAMPLES: usize = 16;
    const SAMPLE: usize = 4096;
    for k in 0..SAMPLES {
        let at = data.len().saturating_sub(SAMPLE) * k / (SAMPLES - 1);
        hasher.update(&data[at..(at + SAMPLE).min(data.len())]);
    }
}

/// Lowercase hex of bytes.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// sha256 of a whole file, streamed (used to pin the weights the goldens were made from).
pub fn file_sha256(path: &Path) -> Result<String, EngineError> {
    let mut f = File::open(path).map_err(|e| EngineError::io(path, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| EngineError::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    fn write(dir: &Path, file: &str, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        let bytes = safetensors::serialize(views, None).unwrap();
        std::fs::write(dir.join(file), bytes).unwrap();
    }

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tandem-w-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn converts_every_float_dtype_and_checks_shapes() {
        let d = tmp("dtypes");
        let f32s: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let bf: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        let f16: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect();
        write(
            &d,
            SINGLE_FILE,
            &[
                ("a", Dtype::F32, vec![2], f32s),
                ("b", Dtype::BF16, vec![1, 2], bf),
                ("c", Dtype::F16, vec![2], f16),
                ("i", Dtype::I32, vec![1], vec![0; 4]),
            ],
        );
        let w = Weights::load(&d).unwrap();
        assert_eq!(w.tensor_f32("a", &[2]).unwrap(), vec![1.5, -2.0]);
        assert_eq!(w.tensor_f32("b", &[1, 2]).unwrap(), vec![1.5, -2.0]);
        assert_eq!(w.tensor_f32("c", &[2]).unwrap(), vec![1.5, -2.0]);
        // bf16 stays bf16 for the CPU kernels; f16 and f32 become f32.
        let b = w.tensor_matrix("b", &[1, 2]).unwrap();
        assert!(matches!(b, Matrix::Bf16(_)));
        assert_eq!(b.into_f32(), vec![1.5, -2.0]);
        assert!(matches!(
            w.tensor_matrix("c", &[2]).unwrap(),
            Matrix::F32(_)
        ));
        assert!(w.tensor_matrix("b", &[2]).is_err());
        let e = w.tensor_f32("b", &[2]).unwrap_err().to_string();
        assert!(
            e.contains("tensor b") && e.contains("shape") && e.contains(SINGLE_FILE),
            "{e}"
        );
        let e = w.tensor_f32("i", &[1]).unwrap_err().to_string();
        assert!(e.contains("tensor i") && e.contains("I32"), "{e}");
        let e = w.tensor_f32("zz", &[1]).unwrap_err().to_string();
        assert!(e.contains("tensor zz") && e.contains("missing"), "{e}");
        assert_eq!(w.identity().len(), 64);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn reads_sharded_checkpoints_through_the_index() {
        let d = tmp("shards");
        let one = 1.0f32.to_le_bytes().to_vec();
        let two = 2.0f32.to_le_bytes().to_vec();
        write(
            &d,
            "model-00001-of-00002.safetensors",
            &[("x", Dtype::F32, vec![1], one)],
        );
        write(
            &d,
            "model-00002-of-00002.safetensors",
            &[("y", Dtype::F32, vec![1], two)],
        );
        std::fs::write(
            d.join(INDEX_FILE),
            r#"{"metadata":{},"weight_map":{"x":"model-00001-of-00002.safetensors","y":"model-00002-of-00002.safetensors"}}"#,
        )
        .unwrap();
        let w = Weights::load(&d).unwrap();
        assert_eq!(w.tensor_f32("y", &[1]).unwrap(), vec![2.0]);
        assert!(w.file_of("y").ends_with("model-00002-of-00002.safetensors"));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_folder_without_weights_is_a_clear_error() {
        let d = tmp("none");
        let e = Weights::load(&d).unwrap_err().to_string();
        assert!(e.contains(SINGLE_FILE), "{e}");
        std::fs::write(d.join(SINGLE_FILE), b"garbage").unwrap();
        let e = Weights::load(&d).unwrap_err().to_string();
        assert!(e.contains("not a valid safetensors"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
