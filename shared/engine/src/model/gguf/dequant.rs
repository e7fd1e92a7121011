//! Dequantization of GGML tensor types to f32, written to give the same f32 values as the
//! reference dequantizers of the `gguf` Python package (`gguf.quants.dequantize`): the same
//! operations in the same order, in f32 (checked by `tests/gguf_dequant.rs` against goldens).

use rayon::prelude::*;

/// Elements per block of the k-quants.
const QK_K: usize = 256;

/// The GGML tensor types this loader reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q8_0,
    Q4K,
    Q6K,
}

/// The name of a ggml type id (for error messages; "unknown" when not a known id).
pub fn type_name(id: u32) -> &'static str {
    const NAMES: [&str; 40] = [
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2",
        "Q4_3",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "Q4_0_4_4",
        "Q4_0_4_8",
        "Q4_0_8_8",
        "TQ1_0",
        "TQ2_0",
        "IQ4_NL_4_4",
        "IQ4_NL_4_8",
        "IQ4_NL_8_8",
        "MXFP4",
    ];
    NAMES.get(id as usize).copied().unwrap_or("unknown")
}

impl GgmlType {
    /// Names of the supported types, for error messages.
    pub const SUPPORTED: &'static str = "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K";

    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            14 => GgmlType::Q6K,
            30 => GgmlType::Bf16,
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4K => 12,
            GgmlType::Q6K => 14,
            GgmlType::Bf16 => 30,
        }
    }

    pub fn name(self) -> &'static str {
        type_name(self.id())
    }

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => 32,
            GgmlType::Q4K | GgmlType::Q6K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::Bf16 => 2,
            GgmlType::Q4_0 => 2 + 16,
            GgmlType::Q4_1 => 2 + 2 + 16,
            GgmlType::Q8_0 => 2 + 32,
            GgmlType::Q4K => 2 + 2 + 12 + QK_K / 2,
            GgmlType::Q6K => QK_K / 2 + QK_K / 4 + QK_K / 16 + 2,
        }
    }

    /// Dequantizes whole blocks (`bytes.len()` a multiple of [`Self::block_bytes`]).
    pub fn dequantize(self, bytes: &[u8]) -> Vec<f32> {
        let (be, bb) = (self.block_elems(), self.block_bytes());
        let n_blocks = bytes.len() / bb;
        let mut out = vec![0.0f32; n_blocks * be];
        // Chunks of blocks per rayon task: enough work to amortise the task.
        let per_task = (4096 / be).max(1);
        out.par_chunks_mut(per_task * be)
            .zip(bytes.par_chunks(per_task * bb))
            .for_each(|(o, b)| {
                for (o, b) in o.chunks_exact_mut(be).zip(b.chunks_exact(bb)) {
                    self.block(b, o);
                }
            });
        out
    }

    fn block(self, b: &[u8], out: &mut [f32]) {
        match self {
            GgmlType::F32 => out[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            GgmlType::F16 => out[0] = f16(b, 0),
            GgmlType::Bf16 => {
                out[0] = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)
            }
            GgmlType::Q4_0 => {
                let d = f16(b, 0);
                let qs = &b[2..18];
                for (i, &q) in qs.iter().enumerate() {
                    out[i] = d * ((q & 0x0f) as i32 - 8) as f32;
                    out[i + 16] = d * ((q >> 4) as i32 - 8) as f32;
                }
            }
            GgmlType::Q4_1 => {
                let d = f16(b, 0);
                let m = f16(b, 2);
                let qs = &b[4..20];
                for (i, &q) in qs.iter().enumerate() {
                    out[i] = d * (q & 0x0f) as f32 + m;
                    out[i + 16] = d * (q >> 4) as f32 + m;
                }
            }
            GgmlType::Q8_0 => {
                let d = f16(b, 0);
                for (o, &q) in out.iter_mut().zip(&b[2..34]) {
                    *o = q as i8 as f32 * d;
                }
            }
            GgmlType::Q4K => {
                let d = f16(b, 0);
                let dmin = f16(b, 2);
                let scales = &b[4..16];
                let qs = &b[16..16 + QK_K / 2];
                for j in 0..8 {
                    let (sc, m) = q4k_scale_min(scales, j);
                    let dj = d * sc as f32;
                    let mj = dmin * m as f32;
                    let chunk = &qs[(j / 2) * 32..(j / 2) * 32 + 32];
                    let shift = 4 * (j % 2);
                    for (l, &q) in chunk.iter().enumerate() {
                        out[j * 32 + l] = dj * ((q >> shift) & 0x0f) as f32 - mj;
                    }
                }
            }
            GgmlType::Q6K => {
                let ql = &b[..QK_K / 2];
                let qh = &b[QK_K / 2..QK_K / 2 + QK_K / 4];
                let scales = &b[QK_K / 2 + QK_K / 4..QK_K / 2 + QK_K / 4 + QK_K / 16];
                let d = f16(b, QK_K / 2 + QK_K / 4 + QK_K / 16);
                for (e, o) in out.iter_mut().enumerate() {
                    let (h, r) = (e / 128, e % 128);
                    let lo = (ql[h * 64 + r % 64] >> (4 * (r / 64))) & 0x0f;
                    let hi = (qh[h * 32 + r % 32] >> (2 * (r / 32))) & 0x03;
                    let q = (lo | (hi << 4)) as i32 - 32;
                    let s = d * scales[e / 16] as i8 as f32;
                    *o = s * q as f32;
                }
            }
        }
    }
}

#[inline]
fn f16(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Scale and min of sub-block `j` (0..8) of a Q4_K block's 12 packed 6-bit scale bytes.
fn q4k_scale_min(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 2) & 0x30),
            (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_match_ggml() {
        assert_eq!(GgmlType::Q4K.block_bytes(), 144);
        assert_eq!(GgmlType::Q6K.block_bytes(), 210);
        assert_eq!(GgmlType::Q8_0.block_bytes(), 34);
        assert_eq!(type_name(12), "Q4_K");
        assert_eq!(type_name(30), "BF16");
        for id in 0..40 {
            if let Some(t) = GgmlType::from_id(id) {
                assert_eq!(t.id(), id);
            }
        }
    }

    #[test]
    fn q8_0_and_q4_1_by_hand() {
        let mut b = vec![0u8; 34];
        b[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
        b[2] = 4;
        b[3] = (-6i8) as u8;
        let v = GgmlType::Q8_0.dequantize(&b);
        assert_eq!(&v[..3], &[2.0, -3.0, 0.0]);
        let mut b = vec![0u8; 20];
        b[..2].copy_from_slice(&half::f16::from_f32(2.0).to_le_bytes());
        b[2..4].copy_from_slice(&half::f16::from_f32(-1.0).to_le_bytes());
        b[4] = 0x31;
        let v = GgmlType::Q4_1.dequantize(&b);
        assert_eq!((v[0], v[16], v[1]), (1.0, 5.0, -1.0));
    }
}
