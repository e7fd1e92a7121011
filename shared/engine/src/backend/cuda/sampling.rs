//! Sampling on the device (`sampling.cu`'s `sample_rows_f32`): the step's plans flattened into
//! persistent device buffers, and the launch.

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits};

use super::{bad, check_len, cuda_err, to_i32, CudaDevice};
use crate::error::EngineError;
use crate::sampler::SamplePlan;

/// Threads per row of `sample_rows_f32` (its SAMPLE_THREADS).
const SAMPLE_THREADS: u32 = 1024;
/// Floats and ints of one row's parameters (the kernel's fparams / iparams strides).
const FLOATS: usize = 6;
const INTS: usize = 2;

/// The plans of a step's logits rows on the device, in buffers kept from step to step (a
/// captured graph reads them at fixed addresses).
pub struct SamplingInputs {
    fparams: CudaSlice<f32>,
    iparams: CudaSlice<i32>,
    uniforms: CudaSlice<f64>,
    seen_off: CudaSlice<i32>,
    seen: CudaSlice<i32>,
    count_off: CudaSlice<i32>,
    counts: CudaSlice<i32>,
    mask_off: CudaSlice<i32>,
    masked: CudaSlice<i32>,
    /// Bumped whenever a buffer is reallocated.
    pub generation: u64,
}

impl SamplingInputs {
    pub fn new(dev: &CudaDevice) -> Result<Self, EngineError> {
        Ok(SamplingInputs {
            fparams: dev.zeros(FLOATS)?,
            iparams: dev.zeros(INTS)?,
            uniforms: dev.zeros(1)?,
            seen_off: dev.zeros(2)?,
            seen: dev.zeros(1)?,
            count_off: dev.zeros(2)?,
            counts: dev.zeros(2)?,
            mask_off: dev.zeros(2)?,
            masked: dev.zeros(1)?,
            generation: 0,
        })
    }

    /// Copies the plans (one per logits row, in row order) to the device.
    pub fn fill(&mut self, dev: &CudaDevice, plans: &[&SamplePlan]) -> Result<(), EngineError> {
        let mut f = Vec::with_capacity(plans.len() * FLOATS);
        let mut i = Vec::with_capacity(plans.len() * INTS);
        let mut u = Vec::with_capacity(plans.len());
        let (mut seen_off, mut seen) = (vec![0i32], Vec::new());
        let (mut count_off, mut counts) = (vec![0i32], Vec::new());
        let (mut mask_off, mut masked) = (vec![0i32], Vec::new());
        let id = |t: u32| to_i32("token id", t as usize);
        for p in plans {
            let valid_temperature = p.temperature > 0.0 && p.temperature.is_finite();
            if !p.greedy && !valid_temperature {
                return Err(bad(format!(
                    "device sampling: temperature {} is not a positive number",
                    p.temperature
                )));
            }
            f.extend_from_slice(&[
                p.temperature,
                p.top_p,
                p.min_p,
                p.repetition_penalty,
                p.frequency_penalty,
                p.presence_penalty,
            ]);
            i.push(p.greedy as i32);
            i.push(to_i32("top_k", p.top_k)?);
            u.push(p.uniform);
            for &t in &p.seen {
                seen.push(id(t)?);
            }
            seen_off.push(to_i32("penalty list", seen.len())?);
            for &(t, c) in &p.counts {
                counts.push(id(t)?);
                counts.push(to_i32("token count", c as usize)?);
            }
            count_off.push(to_i32("penalty list", counts.len() / 2)?);
            for &t in &p.masked {
                masked.push(id(t)?);
            }
            mask_off.push(to_i32("mask list", masked.len())?);
        }
        let g = &mut self.generation;
        put(dev, &mut self.fparams, &f, g)?;
        put(dev, &mut self.iparams, &i, g)?;
        put(dev, &mut self.uniforms, &u, g)?;
        put(dev, &mut self.seen_off, &seen_off, g)?;
        put(dev, &mut self.seen, &seen, g)?;
        put(dev, &mut self.count_off, &count_off, g)?;
        put(dev, &mut self.counts, &counts, g)?;
        put(dev, &mut self.mask_off, &mask_off, g)?;
        put(dev, &mut self.masked, &masked, g)
    }
}

/// Copies `src` into `dst`, growing it (by doubling, bumping `generation`) when too small.
fn put<T: DeviceRepr + ValidAsZeroBits>(
    dev: &CudaDevice,
    dst: &mut CudaSlice<T>,
    src: &[T],
    generation: &mut u64,
) -> Result<(), EngineError> {
    if src.len() > dst.len() {
        *dst = dev.zeros(src.len().next_power_of_two())?;
        *generation += 1;
    }
    if src.is_empty() {
        return Ok(());
    }
    dev.stream()
        .memcpy_htod(src, &mut dst.slice_mut(..src.len()))
        .map_err(cuda_err("host→device copy"))
}

impl CudaDevice {
    /// Samples one token per logits row (`rows` rows of `vocab`, rewritten in place) by the
    /// plans in `inputs` (filled for these rows): `out[r]` is row r's token.
    pub fn sample_rows(
        &self,
        out: &mut CudaSlice<i32>,
        logits: &mut CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        inputs: &SamplingInputs,
    ) -> Result<(), EngineError> {
        if rows == 0 {
            return Ok(());
        }
        check_len("sample out", out.len(), rows)?;
        check_len("sample logits", logits.len(), rows * vocab)?;
        check_len("sample params", inputs.fparams.len(), rows * FLOATS)?;
        check_len("sample uniforms", inputs.uniforms.len(), rows)?;
        check_len("sample offsets", inputs.seen_off.len(), rows + 1)?;
        let v = to_i32("vocab", vocab)?;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (SAMPLE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.func("sample_rows_f32")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out)
            .arg(logits)
            .arg(&v)
            .arg(&inputs.fparams)
            .arg(&inputs.iparams)
            .arg(&inputs.uniforms)
            .arg(&inputs.seen_off)
            .arg(&inputs.seen)
            .arg(&inputs.count_off)
            .arg(&inputs.counts)
            .arg(&inputs.mask_off)
            .arg(&inputs.masked);
        // SAFETY: signature matches; shapes checked above; the lists' offsets were written by
        // `fill` for at least these rows, and the kernel skips ids outside the vocabulary.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching sample_rows"))?;
        Ok(())
    }
}
