//! The GGUF container (versions 2 and 3), memory-mapped: the metadata key/values, the tensor
//! infos and the aligned data section. Little-endian files only (what llama.cpp writes).

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::dequant::GgmlType;
use crate::error::EngineError;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U64(u64),
    I64(i64),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U64(v) => Some(v),
            Value::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F64(v) => Some(v),
            Value::U64(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor's entry in the header.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// GGUF order: `dims[0]` is the fastest-varying (a Hugging Face `[out, in]` weight is
    /// `[in, out]` here, with the same bytes).
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    /// Offset from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// The shape in Hugging Face (row-major, slowest first) order.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    /// The element count, or `None` when the dims' product overflows (a corrupt header).
    pub fn n_elements(&self) -> Option<usize> {
        self.dims
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(usize::try_from(d).ok()?))
    }
}

/// A mapped GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
    mmap: Mmap,
    data_start: usize,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("tensors", &self.tensors.len())
            .finish_non_exhaustive()
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| format!("truncated header (at byte {})", self.pos))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().unwrap_or_default(),
        ))
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().unwrap_or_default(),
        ))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().unwrap_or_default(),
        ))
    }

    fn string(&mut self) -> Result<String, String> {
        let n = self.u64()? as usize;
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<Value, String> {
        Ok(match ty {
            0 => Value::U64(self.u8()? as u64),
            1 => Value::I64(self.u8()? as i8 as i64),
            2 => Value::U64(self.u16()? as u64),
            3 => Value::I64(self.u16()? as i16 as i64),
            4 => Value::U64(self.u32()? as u64),
            5 => Value::I64(self.u32()? as i32 as i64),
            6 => Value::F64(f32::from_bits(self.u32()?) as f64),
            7 => Value::Bool(self.u8()? != 0),
            8 => Value::Str(self.string()?),
            9 => {
                if depth > 4 {
                    return Err("arrays nested too deep".into());
                }
                let ety = self.u32()?;
                let n = self.u64()? as usize;
                // Each element takes at least one byte: bound the allocation by what is left.
                if n > self.buf.len() - self.pos {
                    return Err(format!("array of {n} elements is longer than the file"));
                }
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(ety, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(self.u64()? as i64),
            12 => Value::F64(f64::from_bits(self.u64()?)),
            other => return Err(format!("unknown metadata value type {other}")),
        })
    }
}

impl GgufFile {
    /// Maps and parses a GGUF file. Errors name the file.
    pub fn open(path: &Path) -> Result<Self, EngineError> {
        let file = File::open(path).map_err(|e| EngineError::io(path, e))?;
        // SAFETY: opened read-only; a model file is not rewritten while served.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| EngineError::io(path, e))?;
        let bad = |message: String| EngineError::BadFile {
            path: path.to_path_buf(),
            message,
        };
        let mut r = Reader { buf: &mmap, pos: 0 };
        if r.take(4).map_err(&bad)? != b"GGUF" {
            return Err(bad("not a GGUF file (no GGUF magic)".into()));
        }
        let version = r.u32().map_err(&bad)?;
        if !(2..=3).contains(&version) {
            return Err(bad(format!(
                "GGUF version {version} is not supported (2 and 3 are)"
            )));
        }
        let n_tensors = r.u64().map_err(&bad)? as usize;
        let n_kv = r.u64().map_err(&bad)? as usize;
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = r.string().map_err(&bad)?;
            let ty = r.u32().map_err(&bad)?;
            let v = r
                .value(ty, 0)
                .map_err(|e| bad(format!("metadata {key}: {e}")))?;
            metadata.insert(key, v);
        }
        let mut tensors = Vec::with_capacity(n_tensors.min(1 << 20));
        let mut index = HashMap::new();
        for _ in 0..n_tensors {
            let name = r.string().map_err(&bad)?;
            let nd = r.u32().map_err(&bad)? as usize;
            if nd > 8 {
                return Err(bad(format!("tensor {name}: {nd} dimensions")));
            }
            let dims = (0..nd).map(|_| r.u64()).collect::<Result<Vec<_>, _>>();
            let dims = dims.map_err(&bad)?;
            let ggml_type = r.u32().map_err(&bad)?;
            let offset = r.u64().map_err(&bad)?;
            index.insert(name.clone(), tensors.len());
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        let align = metadata
            .get("general.alignment")
            .and_then(Value::as_u64)
            .unwrap_or(32)
            .max(1) as usize;
        let data_start = r.pos.div_ceil(align) * align;
        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            index,
            mmap,
            data_start,
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of the whole file (header included), for the identity hash.
    pub fn bytes(&self) -> &[u8] {
        &self.mmap
    }

    /// Offset of the data section in the file.
    pub fn data_start(&self) -> usize {
        self.data_start
    }

    fn err(&self, tensor: &str, message: String) -> EngineError {
        EngineError::Tensor {
            path: self.path.clone(),
            tensor: tensor.to_string(),
            message,
        }
    }

    /// The tensor `name` dequantized to f32, checking that its (Hugging Face order) shape is
    /// `shape`.
    pub fn tensor_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, EngineError> {
        let info = self
            .tensor(name)
            .ok_or_else(|| self.err(name, "missing".into()))?;
        if info.shape() != shape {
            return Err(self.err(
                name,
                format!("shape {:?}, expected {:?}", info.shape(), shape),
            ));
        }
        let ty = GgmlType::from_id(info.ggml_type).ok_or_else(|| {
            self.err(
                name,
                format!(
                    "ggml type {} ({}) is not supported (supported: {})",
                    info.ggml_type,
                    super::dequant::type_name(info.ggml_type),
                    GgmlType::SUPPORTED
                ),
            )
        })?;
        let n = info
            .n_elements()
            .ok_or_else(|| self.err(name, format!("dims {:?} overflow", info.dims)))?;
        let row = info.dims.first().copied().unwrap_or(1) as usize;
        if !row.is_multiple_of(ty.block_elems()) {
            return Err(self.err(
                name,
                format!(
                    "rows of {row} elements are not whole {} blocks of {}",
                    ty.name(),
                    ty.block_elems()
                ),
            ));
        }
        let past_end = || self.err(name, "data lies past the end of the file".into());
        let len = (n / ty.block_elems())
            .checked_mul(ty.block_bytes())
            .ok_or_else(past_end)?;
        let start = usize::try_from(info.offset)
            .ok()
            .and_then(|o| self.data_start.checked_add(o))
            .ok_or_else(past_end)?;
        let end = start.checked_add(len).ok_or_else(past_end)?;
        let bytes = self.mmap.get(start..end).ok_or_else(past_end)?;
        Ok(ty.dequantize(bytes))
    }
}
