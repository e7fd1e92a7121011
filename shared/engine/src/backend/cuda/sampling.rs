//! Sampling on the device (`sampling.cu`'s `sample_rows_f32`): the step's plans flattened into
//! persistent device buffers, and the launch.

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits};

use super::{bad, check_len, cuda_err, to_i32, CudaDevice, DevAddr};
use crate::error::EngineError;
use crate::sampler::SamplePlan;

/// Threads per row of `sample_rows_f32` (its SAMPLE_THREADS).
const SAMPLE_THREADS: u32 = 1024;
/// Floats and ints of one row's parameters (the kernel's fparams / iparams strides).
const FLOATS: usize = 6;
const INTS: usize = 2;

/// The plans of a step's logits rows on the device, in buffers kept from step to step (a
/// captured graph reads them at fixed addresses): the per-row parameters and list offsets in
/// one buffer written by one copy, the penalty and mask lists (empty for most requests) each
/// in its own.
pub struct SamplingInputs {
    /// Per row: uniforms (f64), fparams (FLOATS f32), iparams (INTS i32), then the seen /
    /// count / mask list offsets (rows + 1 i32 each); laid out by the row count alone, so a
    /// step of the same batch size has the same addresses.
    fixed: CudaSlice<u8>,
    host: Vec<u8>,
    rows: usize,
    uniforms: DevAddr,
    fparams: DevAddr,
    iparams: DevAddr,
    seen_off: DevAddr,
    count_off: DevAddr,
    mask_off: DevAddr,
    /// Per row: the word offset of its grammar bitmask in `allowed`, or -1.
    allow_off: DevAddr,
    seen: CudaSlice<i32>,
    counts: CudaSlice<i32>,
    masked: CudaSlice<i32>,
    allowed: CudaSlice<u32>,
    /// Bumped whenever a buffer is reallocated.
    pub generation: u64,
}

impl SamplingInputs {
    pub fn new(dev: &CudaDevice) -> Result<Self, EngineError> {
        let fixed: CudaSlice<u8> = dev.zeros(256)?;
        let base = dev.list_of(&fixed).addr;
        Ok(SamplingInputs {
            fixed,
            host: Vec::new(),
            rows: 0,
            uniforms: base,
            fparams: base,
            iparams: base,
            seen_off: base,
            count_off: base,
            mask_off: base,
            allow_off: base,
            seen: dev.zeros(1)?,
            counts: dev.zeros(2)?,
            masked: dev.zeros(1)?,
            allowed: dev.zeros(1)?,
            generation: 0,
        })
    }

    /// Copies the plans (one per logits row, in row order) to the device.
    pub fn fill(
        &mut self,
        dev: &CudaDevice,
        plans: &[&SamplePlan],
        vocab: usize,
    ) -> Result<(), EngineError> {
        let r = plans.len();
        let mut f = Vec::with_capacity(r * FLOATS);
        let mut i = Vec::with_capacity(r * INTS);
        let mut u = Vec::with_capacity(r);
        let (mut seen_off, mut seen) = (vec![0i32], Vec::new());
        let (mut count_off, mut counts) = (vec![0i32], Vec::new());
        let (mut mask_off, mut masked) = (vec![0i32], Vec::new());
        let (mut allow_off, mut allowed) = (Vec::with_capacity(r), Vec::<u32>::new());
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
            // An id past i32 cannot index a logits row (the engine refuses ids outside the
            // vocabulary anyway): leaving it out cannot change the draw, while failing would
            // fail the whole batch.
            masked.extend(p.masked.iter().filter_map(|&t| i32::try_from(t).ok()));
            mask_off.push(to_i32("mask list", masked.len())?);
            match &p.allowed {
                Some(words) => {
                    allow_off.push(to_i32("grammar masks", allowed.len())?);
                    allowed.extend_from_slice(words);
                    // The kernel reads (vocab + 31) / 32 words of each mask: short masks (a
                    // tokenizer vocabulary smaller than the model's) end in forbidden tokens.
                    allowed.resize(
                        allowed.len() + dev_words(vocab).saturating_sub(words.len()),
                        0,
                    );
                }
                None => allow_off.push(-1),
            }
        }
        // The fixed part: f64 first keeps every list aligned to its element.
        let host = &mut self.host;
        host.clear();
        let mut at = Vec::with_capacity(6);
        at.push(host.len());
        u.iter()
            .for_each(|v| host.extend_from_slice(&v.to_ne_bytes()));
        at.push(host.len());
        f.iter()
            .for_each(|v| host.extend_from_slice(&v.to_ne_bytes()));
        for list in [&i, &seen_off, &count_off, &mask_off, &allow_off] {
            at.push(host.len());
            list.iter()
                .for_each(|v| host.extend_from_slice(&v.to_ne_bytes()));
        }
        let g = &mut self.generation;
        put(dev, &mut self.fixed, &self.host, g)?;
        let base = dev.list_of(&self.fixed).addr;
        let addr = |k: usize| base.offset_bytes(at[k]);
        self.rows = r;
        (self.uniforms, self.fparams, self.iparams) = (addr(0), addr(1), addr(2));
        (self.seen_off, self.count_off, self.mask_off) = (addr(3), addr(4), addr(5));
        self.allow_off = addr(6);
        put(dev, &mut self.seen, &seen, g)?;
        put(dev, &mut self.counts, &counts, g)?;
        put(dev, &mut self.masked, &masked, g)?;
        put(dev, &mut self.allowed, &allowed, g)
    }
}

/// Bitmask words of a `vocab`-token row.
fn dev_words(vocab: usize) -> usize {
    vocab.div_ceil(32)
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
        check_len("sample plans", inputs.rows, rows)?;
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
            .arg(&inputs.masked)
            .arg(&inputs.allow_off)
            .arg(&inputs.allowed);
        // SAFETY: signature matches; shapes checked above; the lists' offsets were written by
        // `fill` for at least these rows, and the kernel skips ids outside the vocabulary.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching sample_rows"))?;
        Ok(())
    }
}
