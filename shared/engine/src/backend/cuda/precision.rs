//! The precisions of the CUDA backend ([`ComputeMode`]) and what each does with the KV
//! cache's dtype ([`PoolElem`]): which pool element a precision and a
//! `kv_cache_config.dtype` give, or the configuration error saying they do not go together.

use super::kernels::Float16;
use crate::error::EngineError;
use crate::kv::layout::KvDtype;

/// The element type of weights and GEMM inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ComputeMode {
    /// f32 weights and GEMMs: for exact comparisons with the CPU backend.
    F32,
    /// bf16 weights and GEMM inputs, f32 accumulation: the fastest serving mode (~4e-2 of
    /// f32 logits).
    Bf16,
    /// bf16 weights, activations near f32 (the default, `--cuda-precision bf16x2`): GEMVs
    /// of one or two rows read f32 rows; from three rows each GEMM input is split into two
    /// bf16 terms (hi = bf16(x), lo = bf16(x - hi)) stacked as twice the rows of one GEMM
    /// whose output halves the next kernel adds, so activations keep ~16 bits of mantissa,
    /// the weights resident (and read once) in bf16, for twice those GEMMs' FLOPs. With its
    /// default f16 cache (attention on tensor cores) within 3e-3 of f32 logits.
    Bf16Split,
    /// IEEE half weights (converted from bf16 exactly for |w| ≥ 2⁻¹⁷ ≈ 7.6e-6: every bf16
    /// value in f16's normal range and its top subnormals is representable; smaller ones keep
    /// f16's subnormal resolution), GEMM inputs and KV pool, f32 accumulation: bf16's speed with 3 more
    /// mantissa bits (8× finer rounding) for activations and KV, but a range of ±65,504 for
    /// them (a weight beyond it is an error at load; an activation beyond it becomes inf).
    F16,
}

impl ComputeMode {
    /// The 16-bit element of the device program this mode needs.
    pub fn float16(self) -> Float16 {
        match self {
            ComputeMode::F16 => Float16::F16,
            ComputeMode::F32 | ComputeMode::Bf16 | ComputeMode::Bf16Split => Float16::Bf16,
        }
    }

    /// The KV pool element a 16-bit pool must have in this mode (the program's own).
    pub fn kv_dtype16(self) -> KvDtype {
        match self.float16() {
            Float16::Bf16 => KvDtype::Bf16,
            Float16::F16 => KvDtype::F16,
        }
    }
}

/// What a KV pool's elements are on the device, from the precision and the layout's dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PoolElem {
    F32,
    /// The program's own 16-bit element ([`ComputeMode::kv_dtype16`]): `KvPool::Bf16`.
    Own16,
    /// IEEE half beside bf16 weights (bf16x2 with an f16 cache): `KvPool::Half`.
    HalfBesideBf16,
    /// FP8 e4m3 with per-(token, head) scales beside bf16 weights (bf16x2 or bf16):
    /// `KvPool::Fp8`, read by the FP8-KV program.
    Fp8,
}

impl PoolElem {
    /// f32 goes with every precision, the precision's own 16-bit element with its own, f16
    /// also with bf16x2, and fp8 with bf16x2 and bf16; anything else is a configuration error
    /// saying so.
    pub(super) fn of(mode: ComputeMode, kv: KvDtype) -> Result<Self, EngineError> {
        match kv {
            KvDtype::F32 => Ok(PoolElem::F32),
            kv if kv == mode.kv_dtype16() => Ok(PoolElem::Own16),
            KvDtype::F16 if mode == ComputeMode::Bf16Split => Ok(PoolElem::HalfBesideBf16),
            KvDtype::Fp8 if matches!(mode, ComputeMode::Bf16Split | ComputeMode::Bf16) => {
                Ok(PoolElem::Fp8)
            }
            kv => Err(EngineError::Config(format!(
                "a {kv} KV cache does not go with the CUDA {} precision (its 16-bit pool is {}; \
                 kv_cache_config.dtype auto picks it, float32 works in every mode, float16 \
                 also with bf16x2, fp8 with bf16x2 and bf16)",
                match mode {
                    ComputeMode::F32 => "f32",
                    ComputeMode::Bf16 => "bf16",
                    ComputeMode::Bf16Split => "bf16x2",
                    ComputeMode::F16 => "f16",
                },
                mode.kv_dtype16()
            ))),
        }
    }

    /// The suffix of the kernels written for it (see `KvPool::kernel_suffix`).
    pub(super) fn kernel_suffix(self) -> &'static str {
        match self {
            PoolElem::F32 => "f32",
            PoolElem::Own16 => "bf16",
            PoolElem::HalfBesideBf16 => "h16",
            PoolElem::Fp8 => "fp8",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_precision_takes_f32_its_own_16_bit_pool_and_bf16x2_also_f16() {
        use ComputeMode::*;
        for m in [F32, Bf16, Bf16Split, F16] {
            assert_eq!(PoolElem::of(m, KvDtype::F32).unwrap(), PoolElem::F32);
            assert_eq!(PoolElem::of(m, m.kv_dtype16()).unwrap(), PoolElem::Own16);
        }
        assert_eq!(
            PoolElem::of(Bf16Split, KvDtype::F16).unwrap(),
            PoolElem::HalfBesideBf16
        );
        assert_eq!(
            PoolElem::of(Bf16Split, KvDtype::F16)
                .unwrap()
                .kernel_suffix(),
            "h16"
        );
        for m in [Bf16, Bf16Split] {
            assert_eq!(PoolElem::of(m, KvDtype::Fp8).unwrap(), PoolElem::Fp8);
        }
        for (m, kv, name) in [
            (Bf16, KvDtype::F16, "bf16"),
            (F32, KvDtype::F16, "f32"),
            (F16, KvDtype::Bf16, "f16"),
            (F16, KvDtype::Fp8, "f16"),
            (F32, KvDtype::Fp8, "f32"),
        ] {
            let e = PoolElem::of(m, kv).unwrap_err().to_string();
            assert!(
                e.contains(&format!("a {kv} KV cache"))
                    && e.contains(&format!("CUDA {name} precision")),
                "{e}"
            );
        }
    }

    #[test]
    fn each_mode_names_its_program_and_pool() {
        assert_eq!(ComputeMode::F16.float16(), Float16::F16);
        assert_eq!(ComputeMode::F16.kv_dtype16(), KvDtype::F16);
        for m in [ComputeMode::F32, ComputeMode::Bf16, ComputeMode::Bf16Split] {
            assert_eq!(m.float16(), Float16::Bf16);
            assert_eq!(m.kv_dtype16(), KvDtype::Bf16);
        }
    }
}
