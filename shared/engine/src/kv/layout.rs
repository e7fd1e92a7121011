//! The versioned KV-cache layout descriptor, shared by the CPU and CUDA backends, block
//! export/import and the transfer layer.
//!
//! # Address function (layout version 1)
//!
//! The pool is one byte array of `num_blocks * block_bytes()` bytes. Inside it:
//!
//! ```text
//! pool   = block[0] block[1] ... block[num_blocks-1]
//! block  = layer[0] ... layer[num_layers-1]              (block_bytes = num_layers * layer_bytes)
//! layer  = K V                                           (layer_bytes = 2 * part_bytes)
//! part   = slot[0] ... slot[block_size-1]                (part_bytes = block_size * token_bytes)
//! slot   = head[0] ... head[num_kv_heads-1]              (token_bytes = num_kv_heads * head_bytes)
//! head   = x[0] ... x[head_dim-1]  in `dtype`, little endian (head_bytes = head_dim * dtype.bytes())
//!
//! address(block, layer, part, slot, head, i) =
//!     block * block_bytes + layer * layer_bytes + part * part_bytes
//!   + slot * token_bytes + head * head_bytes + i * dtype.bytes()        (part: K = 0, V = 1)
//! ```
//!
//! An FP8 pool (`fp8`: e4m3, [`super::fp8`]) keeps one f32 scale per (token, KV head) after
//! the part's slots, so a part is `slot[0] ... slot[block_size-1] scale[0] ... scale[block_size *
//! num_kv_heads - 1]` (part_bytes = block_size * (token_bytes + num_kv_heads * 4)):
//!
//! ```text
//! scale_address(block, layer, part, slot, head) =
//!     block * block_bytes + layer * layer_bytes + part * part_bytes
//!   + block_size * token_bytes + (slot * num_kv_heads + head) * 4
//! ```
//!
//! Element i of that head is `fp8::decode(x[i]) * scale`. The other dtypes have no scales.
//!
//! Blocks are outermost so that one block (all layers) is one contiguous range — export, import
//! and transfer move whole blocks — and layers come next so that one layer of one block is
//! contiguous too (a layer-by-layer transfer can start before the whole forward ends). Within a
//! part, a token's heads are adjacent so that writing one token's K or V is one copy.

use serde::{Deserialize, Serialize};

use crate::error::EngineError;

/// The version of the address function above. Bump it whenever the byte order changes.
pub const LAYOUT_VERSION: u32 = 1;

/// The element type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    F32,
    Bf16,
    /// IEEE half (the CUDA backend's f16 precision).
    F16,
    /// FP8 e4m3 (±448, 3 mantissa bits) with an f32 scale per (token, KV head): half the
    /// bytes of a 16-bit cache (see the module docs and [`super::fp8`]).
    Fp8,
}

impl KvDtype {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 | KvDtype::F16 => 2,
            KvDtype::Fp8 => 1,
        }
    }

    /// Bytes of the scale each (token, KV head) carries: 4 (an f32) for FP8, else 0.
    pub fn scale_bytes(self) -> usize {
        match self {
            KvDtype::Fp8 => 4,
            KvDtype::F32 | KvDtype::Bf16 | KvDtype::F16 => 0,
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
            KvDtype::F16 => "f16",
            KvDtype::Fp8 => "fp8",
        })
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" | "float" => Ok(KvDtype::F32),
            "bf16" | "bfloat16" => Ok(KvDtype::Bf16),
            "f16" | "float16" | "fp16" | "half" => Ok(KvDtype::F16),
            "fp8" | "fp8_e4m3" | "e4m3" => Ok(KvDtype::Fp8),
            other => Err(format!(
                "unknown KV dtype {other:?} (expected f32, bf16, f16 or fp8)"
            )),
        }
    }
}

/// Keys or values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvPart {
    K,
    V,
}

impl KvPart {
    fn index(self) -> usize {
        match self {
            KvPart::K => 0,
            KvPart::V => 1,
        }
    }
}

/// Describes how a KV pool is laid out in bytes; two engines can exchange blocks only when
/// their descriptors are equal.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    /// [`LAYOUT_VERSION`] of the engine that made the blocks.
    pub version: u32,
    /// Identity of the model (hash of config.json and the weights' identity).
    pub model_id: String,
    pub dtype: KvDtype,
    /// Tokens per block.
    pub block_size: usize,
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayout {
    /// Bytes of one head of one token.
    pub fn head_bytes(&self) -> usize {
        self.head_dim * self.dtype.bytes()
    }

    /// Bytes of one token's K (or V) in one layer: all KV heads.
    pub fn token_bytes(&self) -> usize {
        self.num_kv_heads * self.head_bytes()
    }

    /// Bytes of the scales of one token's K (or V) in one layer (FP8 only, else 0).
    pub fn token_scale_bytes(&self) -> usize {
        self.num_kv_heads * self.dtype.scale_bytes()
    }

    /// Bytes of the K (or V) part of one layer of one block: its slots, then (FP8) its scales.
    pub fn part_bytes(&self) -> usize {
        self.block_size * (self.token_bytes() + self.token_scale_bytes())
    }

    /// One layer of one block, K and V.
    pub fn layer_bytes(&self) -> usize {
        2 * self.part_bytes()
    }

    /// One whole block: all layers, K and V.
    pub fn block_bytes(&self) -> usize {
        self.num_layers * self.layer_bytes()
    }

    /// Byte offset in the pool of the K or V part of `layer` in `block`.
    pub fn offset(&self, block: usize, layer: usize, part: KvPart) -> usize {
        block * self.block_bytes() + layer * self.layer_bytes() + part.index() * self.part_bytes()
    }

    /// Byte offset of block `id` in the pool (`id * block_bytes`): where a transfer writes it.
    pub fn block_offset(&self, id: u32) -> u64 {
        id as u64 * self.block_bytes() as u64
    }

    /// Byte offset of element 0 of `head` of the token in `slot` (0..block_size): the full
    /// address function of the module docs.
    pub fn token_offset(
        &self,
        block: usize,
        layer: usize,
        part: KvPart,
        slot: usize,
        head: usize,
    ) -> usize {
        self.offset(block, layer, part) + slot * self.token_bytes() + head * self.head_bytes()
    }

    /// Byte offset of the f32 scale of `head` of the token in `slot`: FP8 pools only (the
    /// other dtypes have none), see the module docs.
    pub fn scale_offset(
        &self,
        block: usize,
        layer: usize,
        part: KvPart,
        slot: usize,
        head: usize,
    ) -> usize {
        self.offset(block, layer, part)
            + self.block_size * self.token_bytes()
            + (slot * self.num_kv_heads + head) * self.dtype.scale_bytes()
    }

    /// Ok when blocks made under `other` can be used under `self`; otherwise names the first
    /// differing field, in the order version, model, dtype, block size, shapes.
    pub fn check_compatible(&self, other: &KvLayout) -> Result<(), EngineError> {
        fn differ(
            field: &'static str,
            ours: impl ToString,
            theirs: impl ToString,
        ) -> Result<(), EngineError> {
            Err(EngineError::LayoutMismatch {
                field,
                ours: ours.to_string(),
                theirs: theirs.to_string(),
            })
        }
        if self.version != other.version {
            return differ("version", self.version, other.version);
        }
        if self.model_id != other.model_id {
            return differ("model_id", &self.model_id, &other.model_id);
        }
        if self.dtype != other.dtype {
            return differ("dtype", self.dtype, other.dtype);
        }
        if self.block_size != other.block_size {
            return differ("block_size", self.block_size, other.block_size);
        }
        if self.num_layers != other.num_layers {
            return differ("num_layers", self.num_layers, other.num_layers);
        }
        if self.num_kv_heads != other.num_kv_heads {
            return differ("num_kv_heads", self.num_kv_heads, other.num_kv_heads);
        }
        if self.head_dim != other.head_dim {
            return differ("head_dim", self.head_dim, other.head_dim);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(dtype: KvDtype) -> KvLayout {
        KvLayout {
            version: LAYOUT_VERSION,
            model_id: "m".into(),
            dtype,
            block_size: 4,
            num_layers: 3,
            num_kv_heads: 2,
            head_dim: 8,
        }
    }

    #[test]
    fn sizes_follow_the_documented_formula() {
        let l = layout(KvDtype::F32);
        assert_eq!(l.head_bytes(), 32);
        assert_eq!(l.token_bytes(), 64);
        assert_eq!(l.part_bytes(), 256);
        assert_eq!(l.layer_bytes(), 512);
        assert_eq!(l.block_bytes(), 1536);
        let b = layout(KvDtype::Bf16);
        assert_eq!(b.block_bytes(), 768);
        // FP8: 8 bytes per head, then a 4-byte scale per (token, head) after each part's slots.
        let f = layout(KvDtype::Fp8);
        assert_eq!(f.token_bytes(), 16);
        assert_eq!(f.token_scale_bytes(), 8);
        assert_eq!(f.part_bytes(), 4 * 16 + 4 * 8);
        assert_eq!(f.block_bytes(), 3 * 2 * 96);
        assert_eq!(
            f.scale_offset(1, 2, KvPart::V, 3, 1),
            576 + 2 * 192 + 96 + 64 + 7 * 4
        );
    }

    #[test]
    fn fp8_data_and_scales_tile_each_block_without_overlap() {
        let l = layout(KvDtype::Fp8);
        let mut seen = vec![false; 2 * l.block_bytes()];
        let mut mark = |a: usize, n: usize| {
            for (b, s) in seen.iter_mut().enumerate().skip(a).take(n) {
                assert!(!*s, "byte {b} used twice");
                *s = true;
            }
        };
        for block in 0..2 {
            for layer in 0..l.num_layers {
                for part in [KvPart::K, KvPart::V] {
                    for slot in 0..l.block_size {
                        for head in 0..l.num_kv_heads {
                            mark(
                                l.token_offset(block, layer, part, slot, head),
                                l.head_bytes(),
                            );
                            mark(l.scale_offset(block, layer, part, slot, head), 4);
                        }
                    }
                }
            }
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn every_element_has_a_distinct_address_and_blocks_and_layers_are_contiguous() {
        let l = layout(KvDtype::Bf16);
        let blocks = 3;
        let mut seen = vec![false; blocks * l.block_bytes() / l.dtype.bytes()];
        for block in 0..blocks {
            let mut lo = usize::MAX;
            let mut hi = 0;
            for layer in 0..l.num_layers {
                let mut llo = usize::MAX;
                let mut lhi = 0;
                for part in [KvPart::K, KvPart::V] {
                    for slot in 0..l.block_size {
                        for head in 0..l.num_kv_heads {
                            for i in 0..l.head_dim {
                                let a = l.token_offset(block, layer, part, slot, head)
                                    + i * l.dtype.bytes();
                                assert!(!seen[a / 2], "address {a} used twice");
                                seen[a / 2] = true;
                                llo = llo.min(a);
                                lhi = lhi.max(a + 2);
                            }
                        }
                    }
                }
                // One layer of one block is exactly one contiguous range starting at its offset.
                assert_eq!(llo, l.offset(block, layer, KvPart::K));
                assert_eq!(lhi - llo, l.layer_bytes());
                lo = lo.min(llo);
                hi = hi.max(lhi);
            }
            assert_eq!(lo, block * l.block_bytes());
            assert_eq!(hi - lo, l.block_bytes());
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn compatibility_names_the_first_differing_field() {
        let a = layout(KvDtype::F32);
        assert!(a.check_compatible(&a.clone()).is_ok());
        let mut b = a.clone();
        b.dtype = KvDtype::Bf16;
        b.block_size = 8;
        let err = a.check_compatible(&b).unwrap_err().to_string();
        assert!(err.contains("dtype"), "{err}");
        let mut c = a.clone();
        c.model_id = "other".into();
        let err = a.check_compatible(&c).unwrap_err().to_string();
        assert!(err.contains("model_id"), "{err}");
        let mut d = a.clone();
        d.version = 2;
        assert!(a
            .check_compatible(&d)
            .unwrap_err()
            .to_string()
            .contains("version"));
        let mut e = a.clone();
        e.head_dim = 4;
        assert!(a
            .check_compatible(&e)
            .unwrap_err()
            .to_string()
            .contains("head_dim"));
    }

    #[test]
    fn dtype_serialises_lowercase_and_parses() {
        assert_eq!(serde_json::to_string(&KvDtype::Bf16).unwrap(), "\"bf16\"");
        assert_eq!("F32".parse::<KvDtype>().unwrap(), KvDtype::F32);
        assert!("f8".parse::<KvDtype>().is_err());
        assert_eq!("fp8".parse::<KvDtype>().unwrap(), KvDtype::Fp8);
        assert_eq!(serde_json::to_string(&KvDtype::Fp8).unwrap(), "\"fp8\"");
        assert_eq!("float16".parse::<KvDtype>().unwrap(), KvDtype::F16);
        assert_eq!(serde_json::to_string(&KvDtype::F16).unwrap(), "\"f16\"");
        assert_eq!(KvDtype::F16.bytes(), 2);
    }
}
