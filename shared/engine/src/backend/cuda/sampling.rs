//! Sampling on the device (`sampling.cu`'s `sample_rows_f32`): the step's plans flattened into
//! persistent device buffers, and the launch.

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits};

use super::{bad, check_len, cuda_err, to_i32, CudaDevice, DevAddr};
use crate::error::EngineError;
use crate::sampler::SamplePlan;

/// Threads per row of `sample_rows_f32` and `row_logprobs` (their SAMPLE_THREADS).
const SAMPLE_THREADS: u32 = 1024;
/// The most alternatives a row's logprobs carry (`sampling.cu`'s LOGPROBS_MAX).
pub const LOGPROBS_MAX: usize = 20;
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
    /// Per row: how many top logprobs it asks for, or -1 for none.
    lp_k: DevAddr,
    /// The logit-bias list offsets (rows + 1) and (id, f32 bits) pairs.
    bias_off: DevAddr,
    biases: CudaSlice<i32>,
    /// Whether any row of the last `fill` asks for logprobs.
    pub any_logprobs: bool,
    /// `row_logprobs`' outputs: per row the token's logprob then LOGPROBS_MAX alternatives'
    /// (f32), and the alternatives' ids.
    lp_out: CudaSlice<f32>,
    lp_ids: CudaSlice<i32>,
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
            lp_k: base,
            bias_off: base,
            biases: dev.zeros(2)?,
            any_logprobs: false,
            lp_out: dev.zeros(LOGPROBS_MAX + 1)?,
            lp_ids: dev.zeros(LOGPROBS_MAX)?,
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
        let mut lists = PlanLists::new(plans.len());
        for p in plans {
            lists.push(p, vocab)?;
        }
        let r = plans.len();
        let at = lists.fixed_part(&mut self.host);
        let g = &mut self.generation;
        put(dev, &mut self.fixed, &self.host, g)?;
        let base = dev.list_of(&self.fixed).addr;
        let addr = |k: usize| base.offset_bytes(at[k]);
        self.rows = r;
        (self.uniforms, self.fparams, self.iparams) = (addr(0), addr(1), addr(2));
        (self.seen_off, self.count_off, self.mask_off) = (addr(3), addr(4), addr(5));
        (self.allow_off, self.lp_k, self.bias_off) = (addr(6), addr(7), addr(8));
        self.any_logprobs = plans.iter().any(|p| p.logprobs.is_some());
        // Sized for every row (the kernel's addresses then depend on the row count alone).
        grow(dev, &mut self.lp_out, r * (LOGPROBS_MAX + 1), g)?;
        grow(dev, &mut self.lp_ids, r * LOGPROBS_MAX, g)?;
        put(dev, &mut self.seen, &lists.seen, g)?;
        put(dev, &mut self.counts, &lists.counts, g)?;
        put(dev, &mut self.masked, &lists.masked, g)?;
        put(dev, &mut self.allowed, &lists.allowed, g)?;
        put(dev, &mut self.biases, &lists.biases, g)
    }
}

/// A step's plans flattened for the kernels: per-row parameters, and each variable-length
/// list with its per-row offsets.
struct PlanLists {
    f: Vec<f32>,
    i: Vec<i32>,
    u: Vec<f64>,
    seen_off: Vec<i32>,
    seen: Vec<i32>,
    count_off: Vec<i32>,
    counts: Vec<i32>,
    mask_off: Vec<i32>,
    masked: Vec<i32>,
    allow_off: Vec<i32>,
    allowed: Vec<u32>,
    lp_k: Vec<i32>,
    bias_off: Vec<i32>,
    biases: Vec<i32>,
}

impl PlanLists {
    fn new(rows: usize) -> Self {
        PlanLists {
            f: Vec::with_capacity(rows * FLOATS),
            i: Vec::with_capacity(rows * INTS),
            u: Vec::with_capacity(rows),
            seen_off: vec![0],
            seen: Vec::new(),
            count_off: vec![0],
            counts: Vec::new(),
            mask_off: vec![0],
            masked: Vec::new(),
            allow_off: Vec::with_capacity(rows),
            allowed: Vec::new(),
            lp_k: Vec::with_capacity(rows),
            bias_off: vec![0],
            biases: Vec::new(),
        }
    }

    /// Appends one row's plan.
    fn push(&mut self, p: &SamplePlan, vocab: usize) -> Result<(), EngineError> {
        let valid_temperature = p.temperature > 0.0 && p.temperature.is_finite();
        if !p.greedy && !valid_temperature {
            return Err(bad(format!(
                "device sampling: temperature {} is not a positive number",
                p.temperature
            )));
        }
        let id = |t: u32| to_i32("token id", t as usize);
        self.f.extend_from_slice(&[
            p.temperature,
            p.top_p,
            p.min_p,
            p.repetition_penalty,
            p.frequency_penalty,
            p.presence_penalty,
        ]);
        self.i.push(p.greedy as i32);
        self.i.push(to_i32("top_k", p.top_k)?);
        self.u.push(p.uniform);
        for &t in &p.seen {
            self.seen.push(id(t)?);
        }
        self.seen_off.push(to_i32("penalty list", self.seen.len())?);
        for &(t, c) in &p.counts {
            self.counts.push(id(t)?);
            self.counts.push(to_i32("token count", c as usize)?);
        }
        self.count_off
            .push(to_i32("penalty list", self.counts.len() / 2)?);
        // An id past i32 cannot index a logits row (the engine refuses ids outside the
        // vocabulary anyway): leaving it out cannot change the draw, while failing would
        // fail the whole batch. The same for the logit bias below.
        (self.masked).extend(p.masked.iter().filter_map(|&t| i32::try_from(t).ok()));
        self.mask_off.push(to_i32("mask list", self.masked.len())?);
        match &p.allowed {
            Some(words) => {
                self.allow_off
                    .push(to_i32("grammar masks", self.allowed.len())?);
                self.allowed.extend_from_slice(words);
                // The kernel reads (vocab + 31) / 32 words of each mask: short masks (a
                // tokenizer vocabulary smaller than the model's) end in forbidden tokens.
                let missing = dev_words(vocab).saturating_sub(words.len());
                self.allowed.resize(self.allowed.len() + missing, 0);
            }
            None => self.allow_off.push(-1),
        }
        for &(t, b) in &p.logit_bias {
            if let Ok(t) = i32::try_from(t) {
                self.biases.push(t);
                self.biases.push(b.to_bits() as i32);
            }
        }
        self.bias_off
            .push(to_i32("logit bias list", self.biases.len() / 2)?);
        self.lp_k.push(match p.logprobs {
            Some(k) => to_i32("logprobs", k.min(LOGPROBS_MAX))?,
            None => -1,
        });
        Ok(())
    }

    /// Writes the per-row part into `host` (f64 first keeps every list aligned to its
    /// element) and returns each list's byte offset: uniforms, fparams, iparams, then the
    /// seen / count / mask / allow offsets, lp_k and the bias offsets.
    fn fixed_part(&self, host: &mut Vec<u8>) -> Vec<usize> {
        host.clear();
        let mut at = Vec::with_capacity(9);
        at.push(host.len());
        self.u
            .iter()
            .for_each(|v| host.extend_from_slice(&v.to_ne_bytes()));
        at.push(host.len());
        self.f
            .iter()
            .for_each(|v| host.extend_from_slice(&v.to_ne_bytes()));
        for list in [
            &self.i,
            &self.seen_off,
            &self.count_off,
            &self.mask_off,
            &self.allow_off,
            &self.lp_k,
            &self.bias_off,
        ] {
            at.push(host.len());
            list.iter()
                .for_each(|v| host.extend_from_slice(&v.to_ne_bytes()));
        }
        at
    }
}

/// Grows `dst` to at least `len` elements (by doubling, bumping `generation`).
fn grow<T: DeviceRepr + ValidAsZeroBits>(
    dev: &CudaDevice,
    dst: &mut CudaSlice<T>,
    len: usize,
    generation: &mut u64,
) -> Result<(), EngineError> {
    if len > dst.len() {
        *dst = dev.zeros(len.next_power_of_two())?;
        *generation += 1;
    }
    Ok(())
}

/// One row's logprobs as `row_logprobs` left them: the token's, and `k` alternatives.
pub struct RowLogprobs {
    pub token: f32,
    pub top: Vec<(u32, f32)>,
}

impl SamplingInputs {
    /// The logprobs `row_logprobs` computed for the last step's rows (one plan per row),
    /// after the stream has run it: per row, None where its plan asked for none.
    pub fn logprobs(
        &self,
        dev: &CudaDevice,
        plans: &[&SamplePlan],
    ) -> Result<Vec<Option<RowLogprobs>>, EngineError> {
        let r = plans.len();
        if !self.any_logprobs || r == 0 {
            return Ok(plans.iter().map(|_| None).collect());
        }
        let s = dev.stream();
        let copy = |e| EngineError::Backend(format!("CUDA logprobs copy: {e:?}"));
        let vals = s
            .clone_dtoh(&self.lp_out.slice(..r * (LOGPROBS_MAX + 1)))
            .map_err(copy)?;
        let ids = s
            .clone_dtoh(&self.lp_ids.slice(..r * LOGPROBS_MAX))
            .map_err(copy)?;
        Ok(plans
            .iter()
            .enumerate()
            .map(|(row, p)| {
                let k = p.logprobs?.min(LOGPROBS_MAX);
                let v = &vals[row * (LOGPROBS_MAX + 1)..(row + 1) * (LOGPROBS_MAX + 1)];
                let t = &ids[row * LOGPROBS_MAX..(row + 1) * LOGPROBS_MAX];
                let top = (0..k)
                    .filter_map(|j| Some((u32::try_from(t[j]).ok()?, v[1 + j])))
                    .collect();
                Some(RowLogprobs { token: v[0], top })
            })
            .collect())
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
        b.arg(&mut *out)
            .arg(&mut *logits)
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
            .arg(&inputs.allowed)
            .arg(&inputs.bias_off)
            .arg(&inputs.biases);
        // SAFETY: signature matches; shapes checked above; the lists' offsets were written by
        // `fill` for at least these rows, and the kernel skips ids outside the vocabulary.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching sample_rows"))?;
        // The logprobs of the rows that ask (the others return at once).
        let f = self.func("row_logprobs")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&*logits)
            .arg(&v)
            .arg(&*out)
            .arg(&inputs.lp_k)
            .arg(&inputs.lp_out)
            .arg(&inputs.lp_ids);
        // SAFETY: signature matches; `fill` sized lp_out and lp_ids for at least these rows.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching row_logprobs"))?;
        Ok(())
    }
}
