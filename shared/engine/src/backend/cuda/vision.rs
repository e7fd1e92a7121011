//! The CLIP vision tower and LLaVA's projector on the GPU ([`CudaVision`]): the same
//! computation as `model::vision` (which documents it), with f32 weights and activations and
//! the GEMMs through cuBLAS — exact f32 ([`VisionPrecision::F32`]) or on the tensor cores in
//! TF32 ([`VisionPrecision::Tf32`], the default: inputs rounded to a 10-bit mantissa, f32
//! accumulation). The unmasked attention is two strided-batched GEMMs per image (one batch
//! entry per head) around a row softmax; LayerNorm, bias + activation and the patch unfold are
//! `kernels/vision.cu`.

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t};
use cudarc::driver::{
    CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PinnedHostSlice, PushKernelArg,
};

use rayon::prelude::*;

use super::{check_len, cuda_err, threads_for, to_i32, CudaDevice, LaunchTime};
use crate::error::EngineError;
use crate::model::vision::{Activation, FeatureSelect, VisionConfig, VisionWeights};

/// The arithmetic of the tower's GEMMs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum VisionPrecision {
    /// f32 inputs, f32 accumulation: the CPU tower's arithmetic (the goldens' 1e-4 mode).
    F32,
    /// TF32 tensor cores (inputs rounded to 10 mantissa bits, f32 accumulation).
    #[default]
    Tf32,
}

impl VisionPrecision {
    fn compute_type(self) -> cublasComputeType_t {
        match self {
            VisionPrecision::F32 => cublasComputeType_t::CUBLAS_COMPUTE_32F,
            VisionPrecision::Tf32 => cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        }
    }
}

/// A linear layer on the device: `w` `[out, inp]` row-major, `b` `[out]` (zeros where the
/// checkpoint has no bias).
struct DevLinear {
    w: CudaSlice<f32>,
    b: CudaSlice<f32>,
    out: usize,
    inp: usize,
}

struct DevNorm {
    w: CudaSlice<f32>,
    b: CudaSlice<f32>,
}

/// One encoder layer; q, k and v are one `[3 * hidden, hidden]` projection.
struct DevLayer {
    norm1: DevNorm,
    qkv: DevLinear,
    o: DevLinear,
    norm2: DevNorm,
    fc1: DevLinear,
    fc2: DevLinear,
}

/// The buffers of a run for up to `images` images, kept between runs (allocating and freeing
/// hundreds of MB per layer costs more than the layer) and grown to the largest batch seen.
struct Workspace {
    images: usize,
    pixels: CudaSlice<f32>,
    patches: CudaSlice<f32>,
    patch_out: CudaSlice<f32>,
    x: CudaSlice<f32>,
    normed: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    mid: CudaSlice<f32>,
    scores: CudaSlice<f32>,
    proj_mid: CudaSlice<f32>,
    proj_out: CudaSlice<f32>,
    /// Page-locked host memory the result is copied into (a copy from the device into
    /// pageable memory runs at a fraction of the link's speed).
    host: PinnedHostSlice<f32>,
}

/// The vision tower and projector of a model in GPU memory.
pub struct CudaVision {
    dev: CudaDevice,
    precision: VisionPrecision,
    cfg: VisionConfig,
    patch: DevLinear,
    class: CudaSlice<f32>,
    positions: CudaSlice<f32>,
    pre_norm: DevNorm,
    layers: Vec<DevLayer>,
    proj1: DevLinear,
    proj2: DevLinear,
    workspace: Option<Workspace>,
}

/// An operand of [`CudaVision::gemm`]: a buffer and the element its matrix starts at.
struct At<'a>(&'a CudaSlice<f32>, usize);

/// One cuBLAS strided-batched GEMM in cuBLAS's column-major terms:
/// `c[i] = alpha · op(a[i]) · op(b[i]) + beta · c[i]` for `batch` entries, `op(a)` `m × k`,
/// `op(b)` `k × n`, `c` `m × n`.
struct Gemm {
    trans_a: bool,
    trans_b: bool,
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    ldc: usize,
    strides: [usize; 3],
    batch: usize,
    alpha: f32,
    beta: f32,
}

/// Elements from a column-major `rows × cols` matrix's first to its last, over `batch` entries.
fn extent(rows: usize, cols: usize, ld: usize, stride: usize, batch: usize) -> usize {
    (batch - 1) * stride + ld * (cols - 1) + rows
}

fn activation_code(a: Option<Activation>) -> i32 {
    match a {
        None => 0,
        Some(Activation::QuickGelu) => 1,
        Some(Activation::Gelu) => 2,
    }
}

impl CudaVision {
    /// Opens GPU `ordinal` and uploads the tower and projector.
    pub fn new(
        cfg: &VisionConfig,
        weights: &VisionWeights,
        ordinal: usize,
        precision: VisionPrecision,
    ) -> Result<Self, EngineError> {
        let dev = CudaDevice::new(ordinal)?;
        let up = |v: &[f32]| dev.upload(v);
        let linear = |l: &crate::model::vision::Linear| -> Result<DevLinear, EngineError> {
            let b = match &l.b {
                Some(b) => up(b)?,
                None => dev.zeros(l.out)?,
            };
            Ok(DevLinear {
                w: up(l.w.f32_values()?)?,
                b,
                out: l.out,
                inp: l.inp,
            })
        };
        let norm = |n: &crate::model::vision::LayerNorm| -> Result<DevNorm, EngineError> {
            Ok(DevNorm {
                w: up(&n.w)?,
                b: up(&n.b)?,
            })
        };
        let mut layers = Vec::with_capacity(weights.layers.len());
        for l in &weights.layers {
            let qkv = crate::model::vision::Linear::stacked(&[&l.q, &l.k, &l.v])?;
            layers.push(DevLayer {
                norm1: norm(&l.norm1)?,
                qkv: linear(&qkv)?,
                o: linear(&l.o)?,
                norm2: norm(&l.norm2)?,
                fc1: linear(&l.fc1)?,
                fc2: linear(&l.fc2)?,
            });
        }
        let h = cfg.hidden_size;
        let k = cfg.num_channels * cfg.patch_size * cfg.patch_size;
        let vision = CudaVision {
            patch: DevLinear {
                w: up(weights.patch.f32_values()?)?,
                b: dev.zeros(h)?,
                out: h,
                inp: k,
            },
            class: up(&weights.class)?,
            positions: up(&weights.positions)?,
            pre_norm: norm(&weights.pre_norm)?,
            layers,
            proj1: linear(&weights.proj1)?,
            proj2: linear(&weights.proj2)?,
            precision,
            cfg: cfg.clone(),
            dev,
            workspace: None,
        };
        vision.dev.synchronize()?;
        Ok(vision)
    }

    /// [`Self::run`] with every launch timed (benchmarks' breakdown): GPU time per launch
    /// name, longest first.
    pub fn profile_run(&mut self, pixels: &[f32]) -> Result<Vec<LaunchTime>, EngineError> {
        self.dev.start_profile();
        let run = self.run(pixels, true);
        let times = self.dev.finish_profile();
        run?;
        times
    }

    /// The device's name (logs).
    pub fn device_name(&self) -> &str {
        self.dev.name()
    }

    /// Runs `pixels` (whole preprocessed images, one after the other) through the tower and,
    /// with `project`, the projector: `[n, tokens_per_image, width]` rows, `width` the text
    /// model's hidden size with `project`, the tower's without.
    pub fn run(&mut self, pixels: &[f32], project: bool) -> Result<Vec<f32>, EngineError> {
        let per = self.cfg.pixels_per_image();
        if pixels.is_empty() || !pixels.len().is_multiple_of(per) {
            return Err(EngineError::InvalidInput(format!(
                "{} pixel values are not a whole number of {per}-value images",
                pixels.len()
            )));
        }
        let n = pixels.len() / per;
        let mut ws = match self.workspace.take() {
            Some(ws) if ws.images >= n => ws,
            old => {
                drop(old);
                self.workspace_for(n)?
            }
        };
        let result = self.run_in(&mut ws, pixels, n, project);
        self.workspace = Some(ws);
        result
    }

    /// Buffers for runs of up to `n` images.
    fn workspace_for(&self, n: usize) -> Result<Workspace, EngineError> {
        let cfg = &self.cfg;
        let (h, g) = (cfg.hidden_size, cfg.grid());
        let rows = n * (g * g + 1);
        let t = g * g + 1;
        let inter = self.layers.first().map_or(0, |l| l.fc1.out);
        let zeros = |len: usize| self.dev.zeros::<f32>(len.max(1));
        let host_len = rows * h.max(self.proj2.out);
        // SAFETY: plain page-locked memory (no write-combining: the host reads it); it is
        // zeroed below before anything reads it.
        let mut host = unsafe {
            self.dev
                .ctx
                .alloc_pinned_with_flags::<f32>(host_len.max(1), 0)
        }
        .map_err(cuda_err("allocating page-locked memory"))?;
        host.as_mut_slice()
            .map_err(cuda_err("page-locked memory"))?
            .fill(0.0);
        Ok(Workspace {
            host,
            images: n,
            pixels: zeros(n * cfg.pixels_per_image())?,
            patches: zeros(n * g * g * self.patch.inp)?,
            patch_out: zeros(n * g * g * h)?,
            x: zeros(rows * h)?,
            normed: zeros(rows * h)?,
            qkv: zeros(rows * 3 * h)?,
            mid: zeros(rows * inter)?,
            scores: zeros(cfg.num_attention_heads * t * t)?,
            proj_mid: zeros(rows * self.proj1.out)?,
            proj_out: zeros(rows * self.proj2.out)?,
        })
    }

    /// [`Self::run`] of `n` images in `ws`.
    fn run_in(
        &self,
        ws: &mut Workspace,
        pixels: &[f32],
        n: usize,
        project: bool,
    ) -> Result<Vec<f32>, EngineError> {
        let cfg = &self.cfg;
        let t = cfg.grid() * cfg.grid() + 1;
        self.dev
            .stream
            .memcpy_htod(pixels, &mut ws.pixels)
            .map_err(cuda_err("host→device copy"))?;
        self.embeddings(ws, n)?;
        self.layer_norm(&mut ws.normed, &ws.x, &self.pre_norm, n * t)?;
        std::mem::swap(&mut ws.x, &mut ws.normed);
        for layer in &self.layers {
            self.layer(layer, ws, n, t)?;
        }
        if !project {
            return self.download_selected(&ws.x, &mut ws.host, n, t, cfg.hidden_size);
        }
        self.linear(&ws.x, n * t, &self.proj1, &mut ws.proj_mid, false)?;
        self.bias_act(
            &mut ws.proj_mid,
            &self.proj1.b,
            n * t,
            Some(cfg.projector_act),
        )?;
        self.linear(&ws.proj_mid, n * t, &self.proj2, &mut ws.proj_out, false)?;
        self.bias_act(&mut ws.proj_out, &self.proj2.b, n * t, None)?;
        self.download_selected(&ws.proj_out, &mut ws.host, n, t, self.proj2.out)
    }

    /// The kept rows of `n` images of `t` rows of `width` in `buf`: every row, or all but
    /// each image's class token; one copy into `host` (cudarc's copy into a host slice copies
    /// the whole slice, hence the raw call), then the kept rows out of it.
    fn download_selected(
        &self,
        buf: &CudaSlice<f32>,
        host: &mut PinnedHostSlice<f32>,
        n: usize,
        t: usize,
        width: usize,
    ) -> Result<Vec<f32>, EngineError> {
        let skip = match self.cfg.select {
            FeatureSelect::DropClass => 1,
            FeatureSelect::Full => 0,
        };
        let all = n * t * width;
        check_len("vision rows", buf.len(), all)?;
        check_len("vision host rows", host.len(), all)?;
        let rows = &mut host
            .as_mut_slice()
            .map_err(cuda_err("page-locked memory"))?[..all];
        self.dev.count_launch(|| "vision rows to the host".into());
        {
            let stream = &self.dev.stream;
            let (src, _guard) = buf.device_ptr(stream);
            // SAFETY: `rows` is page-locked host memory of exactly the `all` elements copied,
            // `buf` a live device buffer holding them (checked above); the stream is synchronised
            // below before `rows` is read or the buffer reused.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(rows, src, stream.cu_stream()) }
                .map_err(cuda_err("device→host copy"))?;
        }
        self.dev.synchronize()?;
        // Into fresh memory on every core: at 32 images of llava-1.5 the 302 MB's page
        // faults, not the copy, are most of the time.
        let kept = t - skip;
        let mut out = vec![0.0f32; n * kept * width];
        out.par_chunks_mut(width).enumerate().for_each(|(r, dst)| {
            let from = ((r / kept) * t + skip + r % kept) * width;
            dst.copy_from_slice(&rows[from..from + width]);
        });
        Ok(out)
    }

    /// The patch embeddings (unfold, then one GEMM by the convolution's weight), the class
    /// token first, plus the positions: `ws.x` `[n * t, hidden]`.
    fn embeddings(&self, ws: &mut Workspace, n: usize) -> Result<(), EngineError> {
        let cfg = &self.cfg;
        let (h, g) = (cfg.hidden_size, cfg.grid());
        let t = g * g + 1;
        let ni = to_i32("images", n)?;
        let (si, pi, gi) = (
            to_i32("image_size", cfg.image_size)?,
            to_i32("patch_size", cfg.patch_size)?,
            to_i32("grid", g)?,
        );
        let patch_values = n * g * g * self.patch.inp;
        check_len("vision pixels", ws.pixels.len(), n * cfg.pixels_per_image())?;
        check_len("vision patches", ws.patches.len(), patch_values)?;
        let f = self.dev.func("vision_patches_f32")?;
        let mut b = self.dev.stream.launch_builder(f);
        b.arg(&ws.pixels)
            .arg(&mut ws.patches)
            .arg(&ni)
            .arg(&si)
            .arg(&pi)
            .arg(&gi);
        // SAFETY: signature matches; pixels holds n images of 3 * size², patches n * g² rows
        // of 3 * patch² (checked).
        unsafe { b.launch(grid_stride(patch_values)) }
            .map_err(cuda_err("launching vision_patches"))?;
        self.linear(
            &ws.patches,
            n * g * g,
            &self.patch,
            &mut ws.patch_out,
            false,
        )?;
        check_len("vision x", ws.x.len(), n * t * h)?;
        let (ti, hi) = (to_i32("tokens", t)?, to_i32("hidden", h)?);
        let f = self.dev.func("vision_embed_f32")?;
        let mut b = self.dev.stream.launch_builder(f);
        b.arg(&mut ws.x)
            .arg(&ws.patch_out)
            .arg(&self.class)
            .arg(&self.positions)
            .arg(&ni)
            .arg(&ti)
            .arg(&hi);
        // SAFETY: signature matches; x holds n * t * h (checked), patch_out n * (t - 1) * h
        // (written by the GEMM above), positions t * h and class h (uploaded from shapes the
        // loader checked).
        unsafe { b.launch(grid_stride(n * t * h)) }.map_err(cuda_err("launching vision_embed"))?;
        Ok(())
    }

    /// One pre-norm encoder layer over `n` images of `t` tokens, `ws.x` updated in place.
    fn layer(
        &self,
        l: &DevLayer,
        ws: &mut Workspace,
        n: usize,
        t: usize,
    ) -> Result<(), EngineError> {
        let rows = n * t;
        self.layer_norm(&mut ws.normed, &ws.x, &l.norm1, rows)?;
        self.linear(&ws.normed, rows, &l.qkv, &mut ws.qkv, false)?;
        self.bias_act(&mut ws.qkv, &l.qkv.b, rows, None)?;
        // The heads' outputs reuse `normed` (read by nothing after the QKV projection).
        self.attention(&ws.qkv, &mut ws.normed, &mut ws.scores, n, t)?;
        self.linear(&ws.normed, rows, &l.o, &mut ws.x, true)?;
        self.bias_act(&mut ws.x, &l.o.b, rows, None)?;
        self.layer_norm(&mut ws.normed, &ws.x, &l.norm2, rows)?;
        self.linear(&ws.normed, rows, &l.fc1, &mut ws.mid, false)?;
        self.bias_act(&mut ws.mid, &l.fc1.b, rows, Some(self.cfg.hidden_act))?;
        self.linear(&ws.mid, rows, &l.fc2, &mut ws.x, true)?;
        self.bias_act(&mut ws.x, &l.fc2.b, rows, None)
    }

    /// Unmasked multi-head attention of each image: `qkv` `[n * t, 3 * hidden]` in, the
    /// heads' outputs `[n * t, hidden]` into `out`.
    fn attention(
        &self,
        qkv: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        scores: &mut CudaSlice<f32>,
        n: usize,
        t: usize,
    ) -> Result<(), EngineError> {
        let h = self.cfg.hidden_size;
        let heads = self.cfg.num_attention_heads;
        let hd = h / heads;
        for image in 0..n {
            let base = image * t * 3 * h;
            // scores[head][q][k] = scale · q_head[q] · k_head[k]: column-major, the keys'
            // matrix transposed (t × hd, ld 3h) times the queries' (hd × t, ld 3h).
            let qk = Gemm {
                trans_a: true,
                trans_b: false,
                m: t,
                n: t,
                k: hd,
                lda: 3 * h,
                ldb: 3 * h,
                ldc: t,
                strides: [hd, hd, t * t],
                batch: heads,
                alpha: 1.0 / (hd as f32).sqrt(),
                beta: 0.0,
            };
            self.gemm(&qk, At(qkv, base + h), At(qkv, base), (scores, 0))?;
            self.softmax_rows(scores, heads * t, t)?;
            // out_head[q] = Σ_k p[q][k] · v_head[k]: column-major hd × t = v (hd × t, ld 3h)
            // times pᵀ (t × t, ld t), written at the head's columns of the image's rows.
            let pv = Gemm {
                trans_a: false,
                trans_b: false,
                m: hd,
                n: t,
                k: t,
                lda: 3 * h,
                ldb: t,
                ldc: h,
                strides: [hd, t * t, hd],
                batch: heads,
                alpha: 1.0,
                beta: 0.0,
            };
            self.gemm(
                &pv,
                At(qkv, base + 2 * h),
                At(scores, 0),
                (out, image * t * h),
            )?;
        }
        Ok(())
    }

    /// `out[rows, w.out] (+)= x[rows, w.inp] · w.wᵀ` (accumulating into `out` with
    /// `accumulate`: the residual adds); the bias is the caller's.
    fn linear(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        w: &DevLinear,
        out: &mut CudaSlice<f32>,
        accumulate: bool,
    ) -> Result<(), EngineError> {
        let g = Gemm {
            trans_a: true,
            trans_b: false,
            m: w.out,
            n: rows,
            k: w.inp,
            lda: w.inp,
            ldb: w.inp,
            ldc: w.out,
            strides: [0, 0, 0],
            batch: 1,
            alpha: 1.0,
            beta: if accumulate { 1.0 } else { 0.0 },
        };
        self.gemm(&g, At(&w.w, 0), At(x, 0), (out, 0))
    }

    /// One [`Gemm`], its operands' extents checked against their buffers first.
    fn gemm(
        &self,
        g: &Gemm,
        a: At<'_>,
        b: At<'_>,
        c: (&mut CudaSlice<f32>, usize),
    ) -> Result<(), EngineError> {
        if g.m == 0 || g.n == 0 || g.k == 0 || g.batch == 0 {
            return Ok(());
        }
        let (ar, ac) = if g.trans_a { (g.k, g.m) } else { (g.m, g.k) };
        let (br, bc) = if g.trans_b { (g.n, g.k) } else { (g.k, g.n) };
        let [sa, sb, sc] = g.strides;
        check_len(
            "gemm a",
            a.0.len(),
            a.1 + extent(ar, ac, g.lda, sa, g.batch),
        )?;
        check_len(
            "gemm b",
            b.0.len(),
            b.1 + extent(br, bc, g.ldb, sb, g.batch),
        )?;
        check_len(
            "gemm c",
            c.0.len(),
            c.1 + extent(g.m, g.n, g.ldc, sc, g.batch),
        )?;
        let op = |t: bool| match t {
            true => cublasOperation_t::CUBLAS_OP_T,
            false => cublasOperation_t::CUBLAS_OP_N,
        };
        let int = |what, v| to_i32(what, v);
        let (m, n, k) = (int("m", g.m)?, int("n", g.n)?, int("k", g.k)?);
        let (lda, ldb, ldc) = (int("lda", g.lda)?, int("ldb", g.ldb)?, int("ldc", g.ldc)?);
        let batch = int("batch", g.batch)?;
        let f32_type = cudarc::cublas::sys::cudaDataType::CUDA_R_32F;
        self.dev
            .count_launch(|| format!("vision gemm m={} n={} k={}", g.m, g.n, g.k));
        let stream = &self.dev.stream;
        let (a_ptr, _ga) = a.0.device_ptr(stream);
        let (b_ptr, _gb) = b.0.device_ptr(stream);
        let (c_ptr, _gc) = c.0.device_ptr_mut(stream);
        let elem = std::mem::size_of::<f32>() as u64;
        // SAFETY: every operand's last element lies inside its live device buffer (checked
        // above); the handle works on the device's stream; alpha/beta are f32 as the f32
        // compute types require.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *self.dev.blas.handle(),
                op(g.trans_a),
                op(g.trans_b),
                m,
                n,
                k,
                (&g.alpha) as *const f32 as *const _,
                (a_ptr + a.1 as u64 * elem) as *const _,
                f32_type,
                lda,
                sa as i64,
                (b_ptr + b.1 as u64 * elem) as *const _,
                f32_type,
                ldb,
                sb as i64,
                (&g.beta) as *const f32 as *const _,
                (c_ptr + c.1 as u64 * elem) as *mut _,
                f32_type,
                ldc,
                sc as i64,
                batch,
                self.precision.compute_type(),
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| EngineError::Backend(format!("cuBLAS GemmStridedBatchedEx: {e:?}")))
    }

    /// LayerNorm of `rows` rows of the hidden width, `x` into `out`.
    fn layer_norm(
        &self,
        out: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        norm: &DevNorm,
        rows: usize,
    ) -> Result<(), EngineError> {
        let dim = self.cfg.hidden_size;
        check_len("layer_norm x", x.len(), rows * dim)?;
        check_len("layer_norm out", out.len(), rows * dim)?;
        let (d, eps) = (to_i32("dim", dim)?, self.cfg.layer_norm_eps);
        let cfg = LaunchConfig {
            grid_dim: (to_i32("rows", rows)? as u32, 1, 1),
            block_dim: (threads_for(dim), 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.dev.func("layer_norm_f32")?;
        let mut b = self.dev.stream.launch_builder(f);
        b.arg(out)
            .arg(x)
            .arg(&norm.w)
            .arg(&norm.b)
            .arg(&d)
            .arg(&eps);
        // SAFETY: signature matches; x and out hold rows * dim (checked), w and b dim.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching layer_norm"))?;
        Ok(())
    }

    /// `x = act(x + b)` over `rows` rows of `b.len()`.
    fn bias_act(
        &self,
        x: &mut CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        rows: usize,
        act: Option<Activation>,
    ) -> Result<(), EngineError> {
        let cols = bias.len();
        check_len("bias_act x", x.len(), rows * cols)?;
        let (r, c, a) = (
            to_i32("rows", rows)?,
            to_i32("cols", cols)?,
            activation_code(act),
        );
        self.dev
            .count_launch(|| format!("bias_act cols={cols} act={a}"));
        let f = self.dev.loaded("bias_act_f32")?;
        let mut b = self.dev.stream.launch_builder(f);
        b.arg(&mut *x).arg(bias).arg(&r).arg(&c).arg(&a);
        let cfg = LaunchConfig {
            grid_dim: (rows.clamp(1, 1 << 20) as u32, 1, 1),
            block_dim: (threads_for(cols).min(256), 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: signature matches; x holds rows * cols (checked).
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching bias_act"))?;
        Ok(())
    }

    /// Softmax of `rows` rows of `cols` in place.
    fn softmax_rows(
        &self,
        s: &mut CudaSlice<f32>,
        rows: usize,
        cols: usize,
    ) -> Result<(), EngineError> {
        check_len("softmax s", s.len(), rows * cols)?;
        let c = to_i32("cols", cols)?;
        let cfg = LaunchConfig {
            grid_dim: (to_i32("rows", rows)? as u32, 1, 1),
            block_dim: (threads_for(cols).min(256), 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.dev.func("softmax_rows_f32")?;
        let mut b = self.dev.stream.launch_builder(f);
        b.arg(s).arg(&c);
        // SAFETY: signature matches; s holds rows * cols (checked).
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching softmax_rows"))?;
        Ok(())
    }
}

/// A grid-stride launch over `n` elements.
fn grid_stride(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 65_535 * 8) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q_k_and_v_stack_into_one_projection() {
        use crate::backend::cpu_ops::Matrix;
        use crate::model::vision::Linear;
        let lin = |w: Vec<f32>, b: Option<Vec<f32>>| Linear {
            out: w.len() / 2,
            w: Matrix::F32(w),
            b,
            inp: 2,
        };
        let q = lin(vec![1., 2., 3., 4.], Some(vec![10., 20.]));
        let k = lin(vec![5., 6.], Some(vec![30.]));
        let s = Linear::stacked(&[&q, &k]).unwrap();
        assert_eq!((s.out, s.inp), (3, 2));
        assert_eq!(s.w.f32_values().unwrap(), &[1., 2., 3., 4., 5., 6.]);
        assert_eq!(s.b, Some(vec![10., 20., 30.]));
        // Parts without a bias, or of other input widths, do not stack.
        assert!(Linear::stacked(&[&q, &lin(vec![1., 2.], None)]).is_err());
        let wide = Linear {
            inp: 1,
            ..lin(vec![1., 2.], Some(vec![0., 0.]))
        };
        assert!(Linear::stacked(&[&q, &wide]).is_err());
    }

    #[test]
    fn extents_reach_the_last_element() {
        // A 2 × 3 column-major matrix with ld 4, 2 entries 10 apart: 10 + 4 * 2 + 2.
        assert_eq!(extent(2, 3, 4, 10, 2), 20);
        assert_eq!(extent(5, 1, 5, 0, 1), 5);
    }
}
