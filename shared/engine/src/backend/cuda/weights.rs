//! The model's weights on the GPU in a compute mode's element type: bf16 as stored, widened
//! to f32, or converted to f16 (exact for bf16 values in f16's range, an error naming the
//! tensor otherwise); the gate / up rows interleaved for the fused SiLU·mul readers.

use super::backend::ComputeMode;
use super::step::DeviceLayer;
use super::{CudaDevice, DeviceMatrix};
use crate::backend::cpu_ops::Matrix;
use crate::error::EngineError;
use crate::model::config::ModelConfig;
use crate::model::decoder::DecoderWeights;
use cudarc::driver::CudaSlice;

/// Everything [`upload_weights`] put on the device.
pub(super) struct DeviceWeights {
    pub(super) layers: Vec<DeviceLayer>,
    pub(super) embed: DeviceMatrix,
    pub(super) lm_head: Option<DeviceMatrix>,
    pub(super) norm: CudaSlice<f32>,
    /// RoPE inverse frequencies (head_dim / 2).
    pub(super) inv_freq: CudaSlice<f32>,
}

/// Uploads `weights` in `mode`'s element type.
pub(super) fn upload_weights(
    dev: &CudaDevice,
    mode: ComputeMode,
    config: &ModelConfig,
    weights: &DecoderWeights,
) -> Result<DeviceWeights, EngineError> {
    // `what` names the tensor in the f16 range error.
    let up = |m: &Matrix, what: &str| -> Result<DeviceMatrix, EngineError> {
        Ok(match (mode, m) {
            (ComputeMode::F32, Matrix::F32(v)) => DeviceMatrix::F32(dev.upload(v)?),
            // Widening bf16 to f32 is exact.
            (ComputeMode::F32, Matrix::Bf16(_)) => {
                DeviceMatrix::F32(dev.upload(&m.clone().into_f32())?)
            }
            (ComputeMode::Bf16 | ComputeMode::Bf16Split, Matrix::Bf16(v)) => {
                DeviceMatrix::Bf16(dev.upload(v)?)
            }
            (ComputeMode::Bf16 | ComputeMode::Bf16Split, Matrix::F32(v)) => DeviceMatrix::Bf16(
                dev.upload(
                    &v.iter()
                        .map(|x| half::bf16::from_f32(*x).to_bits())
                        .collect::<Vec<u16>>(),
                )?,
            ),
            (ComputeMode::F16, Matrix::Bf16(v)) => DeviceMatrix::Bf16(dev.upload(&to_f16_bits(
                v.iter().map(|b| half::bf16::from_bits(*b).to_f32()),
                what,
            )?)?),
            (ComputeMode::F16, Matrix::F32(v)) => {
                DeviceMatrix::Bf16(dev.upload(&to_f16_bits(v.iter().copied(), what)?)?)
            }
        })
    };
    let vec = |v: &[f32]| dev.upload(v);
    let opt = |v: &Option<Vec<f32>>| v.as_deref().map(|v| dev.upload(v)).transpose();
    let mut layers = Vec::with_capacity(weights.layers.len());
    for (i, lw) in weights.layers.iter().enumerate() {
        layers.push(DeviceLayer {
            input_norm: vec(&lw.input_norm)?,
            qkv: up(&lw.qkv, &format!("layer {i} qkv_proj"))?,
            qkv_bias: opt(&lw.qkv_bias)?,
            q_norm: opt(&lw.q_norm)?,
            k_norm: opt(&lw.k_norm)?,
            o_proj: up(&lw.o_proj, &format!("layer {i} o_proj"))?,
            o_bias: opt(&lw.o_bias)?,
            post_norm: vec(&lw.post_norm)?,
            gate_up: up(
                &interleave_gate_up(&lw.gate_up, config.intermediate_size)?,
                &format!("layer {i} gate_up_proj"),
            )?,
            down: up(&lw.down, &format!("layer {i} down_proj"))?,
        });
    }
    let inv: Vec<f32> = config.rope_inv_freq().iter().map(|f| *f as f32).collect();
    let embed = up(&weights.embed, "embed_tokens")?;
    let lm_head = weights
        .lm_head
        .as_ref()
        .map(|m| up(m, "lm_head"))
        .transpose()?;
    let norm = vec(&weights.norm)?;
    let inv_freq = dev.upload(&inv)?;
    Ok(DeviceWeights {
        layers,
        embed,
        lm_head,
        norm,
        inv_freq,
    })
}

/// f16 bit patterns of `values`; an error naming `what` when one is beyond f16's finite range
/// (it would become inf). Values below f16's normal range keep f16's subnormal resolution.
fn to_f16_bits(values: impl Iterator<Item = f32>, what: &str) -> Result<Vec<u16>, EngineError> {
    values
        .map(|v| {
            let h = half::f16::from_f32(v);
            if v.is_finite() && h.is_infinite() {
                Err(EngineError::InvalidInput(format!(
                    "{what}: weight {v} is outside f16's range (±65,504); use --cuda-precision bf16"
                )))
            } else {
                Ok(h.to_bits())
            }
        })
        .collect()
}

/// The fused `[gate; up]` weights (2 · `im` rows) with their rows interleaved (row 2c = gate
/// c, 2c + 1 = up c): the order `silu_mul.cu` and the fused decode GEMV of `gemv.cu` read.
fn interleave_gate_up(m: &Matrix, im: usize) -> Result<Matrix, EngineError> {
    fn rows<T: Copy>(v: &[T], im: usize) -> Result<Vec<T>, EngineError> {
        if im == 0 || !v.len().is_multiple_of(2 * im) {
            return Err(EngineError::InvalidInput(format!(
                "gate_up weights of {} elements are not 2 × {im} rows",
                v.len()
            )));
        }
        let cols = v.len() / (2 * im);
        let mut out = Vec::with_capacity(v.len());
        for c in 0..im {
            out.extend_from_slice(&v[c * cols..(c + 1) * cols]);
            out.extend_from_slice(&v[(im + c) * cols..(im + c + 1) * cols]);
        }
        Ok(out)
    }
    Ok(match m {
        Matrix::F32(v) => Matrix::F32(rows(v, im)?),
        Matrix::Bf16(v) => Matrix::Bf16(rows(v, im)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_weights_are_exact_for_bf16_values_in_range() {
        // Every bf16 with a normal f16 counterpart converts exactly.
        let vals: Vec<f32> = [1.0f32, -0.0213, 3.5e-3, 1000.5, -65_280.0]
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_f32())
            .collect();
        let bits = to_f16_bits(vals.iter().copied(), "test").unwrap();
        for (v, b) in vals.iter().zip(bits) {
            assert_eq!(half::f16::from_bits(b).to_f32(), *v);
        }
        // Beyond ±65,504 is an error naming the value and the way out.
        let e = to_f16_bits([1.0f32, 70_000.0].into_iter(), "layer 3")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("layer 3") && e.contains("70000") && e.contains("--cuda-precision bf16"),
            "{e}"
        );
    }

    #[test]
    fn gate_up_rows_interleave() {
        // im = 2, 3 columns: gate rows g0 g1, up rows u0 u1.
        let m = Matrix::F32((0..12).map(|v| v as f32).collect());
        let Matrix::F32(v) = interleave_gate_up(&m, 2).unwrap() else {
            panic!("f32 in, f32 out")
        };
        assert_eq!(
            v,
            [0., 1., 2., 6., 7., 8., 3., 4., 5., 9., 10., 11.].to_vec()
        );
        assert!(interleave_gate_up(&Matrix::Bf16(vec![0; 10]), 3).is_err());
        assert!(interleave_gate_up(&Matrix::Bf16(vec![0; 10]), 0).is_err());
    }
}
