//! The vision side of a LLaVA model (`LlavaForConditionalGeneration`): a CLIP vision tower
//! and the multi-modal projector, turning preprocessed pixels into rows of the language
//! model's embedding space that replace the image tokens' embeddings ([`VisionEncoder`]).
//!
//! Matches transformers' `CLIPVisionModel` (patch convolution without bias, class embedding,
//! learned positions, `pre_layrnorm`, pre-norm encoder layers with biased attention and a
//! `quick_gelu` or `gelu` MLP) and `LlavaMultiModalProjector` (linear → GELU → linear), with
//! LLaVA's feature selection: the hidden state of `vision_feature_layer` (-2: the output of
//! the second-to-last layer, without `post_layernorm`), the class token dropped under the
//! `default` strategy.

use rayon::prelude::*;
use serde::Deserialize;

use crate::backend::cpu_ops::{dot, matmul_t, Matrix};
use crate::error::EngineError;
use crate::model::weights::Weights;

/// An activation of the vision tower or the projector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `x * sigmoid(1.702 x)` (CLIP's default).
    QuickGelu,
    /// The exact (erf) GELU.
    Gelu,
}

impl Activation {
    fn parse(name: &str, key: &str) -> Result<Self, String> {
        match name {
            "quick_gelu" => Ok(Activation::QuickGelu),
            "gelu" => Ok(Activation::Gelu),
            other => Err(format!(
                "{key} {other:?} is not supported (supported: quick_gelu, gelu)"
            )),
        }
    }

    fn apply(self, x: &mut [f32]) {
        match self {
            Activation::QuickGelu => x
                .iter_mut()
                .for_each(|v| *v *= 1.0 / (1.0 + (-1.702 * *v).exp())),
            Activation::Gelu => x.iter_mut().for_each(|v| {
                let f = *v as f64;
                *v = (0.5 * f * (1.0 + erf(f / std::f64::consts::SQRT_2))) as f32
            }),
        }
    }
}

/// erf(x) to about 1e-9 (Numerical Recipes' `erfc` Chebyshev fit), enough for f32 GELU.
fn erf(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let erfc = t * poly.exp();
    if x >= 0.0 {
        1.0 - erfc
    } else {
        erfc - 1.0
    }
}

/// Which vision tokens LLaVA keeps (`vision_feature_select_strategy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FeatureSelect {
    /// Drop the class token (`default`).
    DropClass,
    /// Keep every token (`full`).
    Full,
}

/// The vision tower's and the projector's shapes, and LLaVA's image settings.
#[derive(Clone, Debug, PartialEq)]
pub struct VisionConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub image_size: usize,
    pub patch_size: usize,
    pub num_channels: usize,
    pub layer_norm_eps: f32,
    pub hidden_act: Activation,
    /// The token id standing for one image embedding row in prompts.
    pub image_token_index: u32,
    /// How many encoder layers run: the selected hidden state is the output of the last.
    pub layers_used: usize,
    pub select: FeatureSelect,
    pub projector_act: Activation,
    pub projector_bias: bool,
    /// The language model's hidden size (the projector's output width).
    pub text_hidden_size: usize,
}

#[derive(Deserialize)]
struct RawVision {
    #[serde(default = "d_hidden")]
    hidden_size: usize,
    #[serde(default = "d_intermediate")]
    intermediate_size: usize,
    #[serde(default = "d_layers")]
    num_hidden_layers: usize,
    #[serde(default = "d_heads")]
    num_attention_heads: usize,
    #[serde(default = "d_image")]
    image_size: usize,
    #[serde(default = "d_patch")]
    patch_size: usize,
    #[serde(default = "d_channels")]
    num_channels: usize,
    #[serde(default = "d_eps")]
    layer_norm_eps: f64,
    #[serde(default = "d_act")]
    hidden_act: String,
}

// transformers' CLIPVisionConfig defaults.
fn d_hidden() -> usize {
    768
}
fn d_intermediate() -> usize {
    3072
}
fn d_layers() -> usize {
    12
}
fn d_heads() -> usize {
    12
}
fn d_image() -> usize {
    224
}
fn d_patch() -> usize {
    32
}
fn d_channels() -> usize {
    3
}
fn d_eps() -> f64 {
    1e-5
}
fn d_act() -> String {
    "quick_gelu".into()
}

/// The top-level fields of a LLaVA `config.json` (the text model's are in `text_config`).
#[derive(Deserialize)]
struct RawLlava {
    #[serde(alias = "image_token_id")]
    image_token_index: Option<u32>,
    #[serde(default)]
    vision_feature_layer: Option<serde_json::Value>,
    vision_feature_select_strategy: Option<String>,
    projector_hidden_act: Option<String>,
    multimodal_projector_bias: Option<bool>,
    vision_config: Option<serde_json::Value>,
}

/// Whether a config is a LLaVA one (by `architectures` or `model_type`).
pub fn is_llava(value: &serde_json::Value) -> bool {
    let arch = value
        .get("architectures")
        .and_then(|a| a.as_array())
        .and_then(|a| a.first())
        .and_then(|s| s.as_str());
    arch == Some("LlavaForConditionalGeneration")
        || value.get("model_type").and_then(|m| m.as_str()) == Some("llava")
}

impl VisionConfig {
    /// The vision settings of a LLaVA config whose language model has `text_hidden_size`.
    pub fn from_llava(value: &serde_json::Value, text_hidden_size: usize) -> Result<Self, String> {
        let raw: RawLlava = serde_json::from_value(value.clone())
            .map_err(|e| format!("invalid LLaVA config: {e}"))?;
        let vision_value = raw
            .vision_config
            .ok_or("a LLaVA config needs vision_config")?;
        let v: RawVision = serde_json::from_value(vision_value)
            .map_err(|e| format!("invalid vision_config: {e}"))?;
        if v.num_attention_heads == 0 || !v.hidden_size.is_multiple_of(v.num_attention_heads) {
            return Err(format!(
                "vision_config.hidden_size {} is not a multiple of num_attention_heads {}",
                v.hidden_size, v.num_attention_heads
            ));
        }
        if v.patch_size == 0 || v.image_size == 0 || !v.image_size.is_multiple_of(v.patch_size) {
            return Err(format!(
                "vision_config.image_size {} is not a multiple of patch_size {}",
                v.image_size, v.patch_size
            ));
        }
        if v.num_channels != 3 {
            return Err(format!(
                "vision_config.num_channels {} is not supported (only 3)",
                v.num_channels
            ));
        }
        let layers_used = layers_used(raw.vision_feature_layer.as_ref(), v.num_hidden_layers)?;
        let select = match raw.vision_feature_select_strategy.as_deref() {
            None | Some("default") => FeatureSelect::DropClass,
            Some("full") => FeatureSelect::Full,
            Some(other) => {
                return Err(format!(
                    "vision_feature_select_strategy {other:?} is not supported (default, full)"
                ))
            }
        };
        let image_token_index = raw
            .image_token_index
            .ok_or("a LLaVA config needs image_token_index")?;
        Ok(VisionConfig {
            hidden_size: v.hidden_size,
            intermediate_size: v.intermediate_size,
            num_hidden_layers: v.num_hidden_layers,
            num_attention_heads: v.num_attention_heads,
            image_size: v.image_size,
            patch_size: v.patch_size,
            num_channels: v.num_channels,
            layer_norm_eps: v.layer_norm_eps as f32,
            hidden_act: Activation::parse(&v.hidden_act, "vision_config.hidden_act")?,
            image_token_index,
            layers_used,
            select,
            projector_act: Activation::parse(
                raw.projector_hidden_act.as_deref().unwrap_or("gelu"),
                "projector_hidden_act",
            )?,
            projector_bias: raw.multimodal_projector_bias.unwrap_or(true),
            text_hidden_size,
        })
    }

    /// Patches per side.
    pub fn grid(&self) -> usize {
        self.image_size / self.patch_size
    }

    /// Vision tokens per image (the class token included).
    fn num_positions(&self) -> usize {
        self.grid() * self.grid() + 1
    }

    /// Embedding rows (hence image tokens in the prompt) per image.
    pub fn tokens_per_image(&self) -> usize {
        match self.select {
            FeatureSelect::DropClass => self.grid() * self.grid(),
            FeatureSelect::Full => self.num_positions(),
        }
    }

    /// Values of one preprocessed image (`[3, image_size, image_size]`).
    pub fn pixels_per_image(&self) -> usize {
        self.num_channels * self.image_size * self.image_size
    }
}

/// How many layers to run so that the last one's output is `vision_feature_layer`'s hidden
/// state (transformers' `hidden_states[i]`: 0 is the embeddings, `i` the output of layer
/// `i - 1`; negative counts from the end).
fn layers_used(feature_layer: Option<&serde_json::Value>, layers: usize) -> Result<usize, String> {
    let i = match feature_layer {
        None => -2,
        Some(v) => v.as_i64().ok_or_else(|| {
            format!("vision_feature_layer {v} is not supported (one layer index only, not a list)")
        })?,
    };
    let states = layers as i64 + 1;
    let index = if i < 0 { states + i } else { i };
    if index <= 0 || index >= states {
        return Err(format!(
            "vision_feature_layer {i} is outside the vision tower's {layers} layers"
        ));
    }
    Ok(index as usize)
}

pub(crate) struct Linear {
    pub(crate) w: Matrix,
    pub(crate) b: Option<Vec<f32>>,
    pub(crate) out: usize,
    pub(crate) inp: usize,
}

impl Linear {
    fn load(
        weights: &Names<'_>,
        name: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<Self, EngineError> {
        let w = weights.matrix(&format!("{name}.weight"), &[out, inp])?;
        let b = match bias {
            true => Some(weights.vector(&format!("{name}.bias"), out)?),
            false => None,
        };
        Ok(Linear { w, b, out, inp })
    }

    /// The layers' rows one after another (their outputs side by side): q, k and v as one
    /// projection. Every part has the same input width and a bias, or none has.
    #[cfg(feature = "cuda")]
    pub(crate) fn stacked(parts: &[&Linear]) -> Result<Linear, EngineError> {
        let inp = parts.first().map_or(0, |p| p.inp);
        let mut w = Vec::new();
        let mut b = Vec::new();
        for p in parts {
            if p.inp != inp || p.b.is_none() {
                return Err(EngineError::Backend(
                    "stacked projections need one input width and biases".into(),
                ));
            }
            w.extend_from_slice(p.w.f32_values()?);
            b.extend(p.b.iter().flatten().copied());
        }
        Ok(Linear {
            w: Matrix::F32(w),
            out: b.len(),
            b: Some(b),
            inp,
        })
    }

    /// `x` is `[rows, inp]`; returns `[rows, out]`.
    fn apply(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let mut y = vec![0.0f32; rows * self.out];
        matmul_t(x, rows, self.inp, self.w.as_ref(), self.out, &mut y);
        if let Some(b) = &self.b {
            y.chunks_exact_mut(self.out)
                .for_each(|r| r.iter_mut().zip(b).for_each(|(v, b)| *v += b));
        }
        y
    }
}

pub(crate) struct LayerNorm {
    pub(crate) w: Vec<f32>,
    pub(crate) b: Vec<f32>,
    eps: f32,
}

impl LayerNorm {
    fn load(weights: &Names<'_>, name: &str, n: usize, eps: f32) -> Result<Self, EngineError> {
        Ok(LayerNorm {
            w: weights.vector(&format!("{name}.weight"), n)?,
            b: weights.vector(&format!("{name}.bias"), n)?,
            eps,
        })
    }

    fn apply(&self, x: &[f32]) -> Vec<f32> {
        let n = self.w.len();
        let mut y = vec![0.0f32; x.len()];
        for (xr, yr) in x.chunks_exact(n).zip(y.chunks_exact_mut(n)) {
            let mean = xr.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
            let var = xr.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n as f64;
            let inv = 1.0 / (var + self.eps as f64).sqrt();
            for ((o, &v), (w, b)) in yr.iter_mut().zip(xr).zip(self.w.iter().zip(&self.b)) {
                *o = ((v as f64 - mean) * inv) as f32 * w + b;
            }
        }
        y
    }
}

pub(crate) struct EncoderLayer {
    pub(crate) norm1: LayerNorm,
    pub(crate) q: Linear,
    pub(crate) k: Linear,
    pub(crate) v: Linear,
    pub(crate) o: Linear,
    pub(crate) norm2: LayerNorm,
    pub(crate) fc1: Linear,
    pub(crate) fc2: Linear,
}

/// The weights of the vision tower and the projector.
pub struct VisionWeights {
    pub(crate) patch: Matrix,
    pub(crate) class: Vec<f32>,
    pub(crate) positions: Vec<f32>,
    pub(crate) pre_norm: LayerNorm,
    pub(crate) layers: Vec<EncoderLayer>,
    pub(crate) proj1: Linear,
    pub(crate) proj2: Linear,
}

/// Tensor lookup under the prefixes of the checkpoint layouts: the Hub's and transformers 5's
/// (`vision_tower.…`, `multi_modal_projector.…`) or transformers 4.52–4.57's (`model.…`).
struct Names<'w> {
    weights: &'w Weights,
    prefix: &'static str,
}

impl Names<'_> {
    fn name(&self, n: &str) -> String {
        format!("{}{n}", self.prefix)
    }
    fn matrix(&self, n: &str, shape: &[usize]) -> Result<Matrix, EngineError> {
        self.weights
            .tensor_f32(&self.name(n), shape)
            .map(Matrix::F32)
    }
    fn vector(&self, n: &str, len: usize) -> Result<Vec<f32>, EngineError> {
        self.weights.tensor_f32(&self.name(n), &[len])
    }
}

impl VisionWeights {
    /// Loads the vision tower and the projector from a LLaVA checkpoint.
    pub fn load(cfg: &VisionConfig, weights: &Weights) -> Result<Self, EngineError> {
        let prefix = if weights.contains("model.multi_modal_projector.linear_1.weight") {
            "model."
        } else {
            ""
        };
        let w = Names { weights, prefix };
        let (h, p, c) = (cfg.hidden_size, cfg.patch_size, cfg.num_channels);
        // The Hub's towers nest a CLIPVisionModel (`vision_tower.vision_model.…`); transformers
        // 5 saves the transformer itself (`vision_tower.…`).
        let v = if weights.contains(&w.name("vision_tower.embeddings.class_embedding")) {
            "vision_tower."
        } else {
            "vision_tower.vision_model."
        };
        let eps = cfg.layer_norm_eps;
        let mut layers = Vec::with_capacity(cfg.layers_used);
        // Layers past the selected hidden state are never run: not loaded.
        for l in 0..cfg.layers_used {
            let n = format!("{v}encoder.layers.{l}.");
            let lin =
                |name: &str, out, inp| Linear::load(&w, &format!("{n}{name}"), out, inp, true);
            layers.push(EncoderLayer {
                norm1: LayerNorm::load(&w, &format!("{n}layer_norm1"), h, eps)?,
                q: lin("self_attn.q_proj", h, h)?,
                k: lin("self_attn.k_proj", h, h)?,
                v: lin("self_attn.v_proj", h, h)?,
                o: lin("self_attn.out_proj", h, h)?,
                norm2: LayerNorm::load(&w, &format!("{n}layer_norm2"), h, eps)?,
                fc1: lin("mlp.fc1", cfg.intermediate_size, h)?,
                fc2: lin("mlp.fc2", h, cfg.intermediate_size)?,
            });
        }
        let th = cfg.text_hidden_size;
        let pb = cfg.projector_bias;
        Ok(VisionWeights {
            patch: w.matrix(
                &format!("{v}embeddings.patch_embedding.weight"),
                &[h, c, p, p],
            )?,
            class: w.vector(&format!("{v}embeddings.class_embedding"), h)?,
            positions: w
                .matrix(
                    &format!("{v}embeddings.position_embedding.weight"),
                    &[cfg.num_positions(), h],
                )?
                .into_f32(),
            pre_norm: LayerNorm::load(&w, &format!("{v}pre_layrnorm"), h, eps)?,
            layers,
            proj1: Linear::load(&w, "multi_modal_projector.linear_1", th, h, pb)?,
            proj2: Linear::load(&w, "multi_modal_projector.linear_2", th, th, pb)?,
        })
    }
}

/// The vision tower and projector of a model, ready to encode images: on the CPU, or (with
/// the `cuda` feature) on a GPU ([`VisionEncoder::on_cuda`]).
pub struct VisionEncoder {
    pub config: VisionConfig,
    compute: Compute,
}

// One per loaded encoder: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Compute {
    Cpu(VisionWeights),
    /// Behind a mutex: one stream runs one batch at a time.
    #[cfg(feature = "cuda")]
    Cuda(std::sync::Mutex<crate::backend::cuda::vision::CudaVision>),
}

impl VisionEncoder {
    pub fn new(config: VisionConfig, weights: VisionWeights) -> Self {
        VisionEncoder {
            config,
            compute: Compute::Cpu(weights),
        }
    }

    /// This encoder's weights uploaded to GPU `ordinal`, computing in `precision`; an error
    /// (never a panic) without a usable GPU.
    #[cfg(feature = "cuda")]
    pub fn on_cuda(
        &self,
        ordinal: usize,
        precision: crate::backend::cuda::vision::VisionPrecision,
    ) -> Result<VisionEncoder, EngineError> {
        let Compute::Cpu(weights) = &self.compute else {
            return Err(EngineError::Backend(
                "the vision tower is already on the GPU".into(),
            ));
        };
        let cuda = crate::backend::cuda::vision::CudaVision::new(
            &self.config,
            weights,
            ordinal,
            precision,
        )?;
        Ok(VisionEncoder {
            config: self.config.clone(),
            compute: Compute::Cuda(std::sync::Mutex::new(cuda)),
        })
    }

    /// One GPU run of [`Self::encode`] with every launch timed (benchmarks); an error on the
    /// CPU.
    #[cfg(feature = "cuda")]
    pub fn profile_encode(
        &self,
        pixels: &[f32],
    ) -> Result<Vec<crate::backend::cuda::LaunchTime>, EngineError> {
        match &self.compute {
            Compute::Cuda(c) => lock(c)?.profile_run(pixels),
            Compute::Cpu(_) => Err(EngineError::Backend("profiling needs the GPU tower".into())),
        }
    }

    /// Where the tower runs: `cpu` or `cuda` (logs, metrics).
    pub fn device(&self) -> &'static str {
        match self.compute {
            Compute::Cpu(_) => "cpu",
            #[cfg(feature = "cuda")]
            Compute::Cuda(_) => "cuda",
        }
    }

    /// Encodes `n` images (`pixels`: `n` preprocessed `[3, image_size, image_size]` tensors,
    /// one after the other) into `[n, tokens_per_image, text_hidden_size]` rows.
    pub fn encode(&self, pixels: &[f32]) -> Result<Vec<f32>, EngineError> {
        match &self.compute {
            Compute::Cpu(w) => {
                let hidden = self.vision_features(pixels)?;
                let rows = hidden.len() / self.config.hidden_size;
                let mut x = w.proj1.apply(&hidden, rows);
                self.config.projector_act.apply(&mut x);
                Ok(w.proj2.apply(&x, rows))
            }
            #[cfg(feature = "cuda")]
            Compute::Cuda(c) => lock(c)?.run(pixels, true),
        }
    }

    /// The selected vision hidden states (before the projector), `[n, tokens, vision
    /// hidden]`, class token dropped under the `default` strategy.
    // Without the `cuda` feature the CPU is the only arm.
    #[allow(clippy::infallible_destructuring_match)]
    pub fn vision_features(&self, pixels: &[f32]) -> Result<Vec<f32>, EngineError> {
        let w = match &self.compute {
            Compute::Cpu(w) => w,
            #[cfg(feature = "cuda")]
            Compute::Cuda(c) => return lock(c)?.run(pixels, false),
        };
        let per = self.config.pixels_per_image();
        if pixels.is_empty() || !pixels.len().is_multiple_of(per) {
            return Err(EngineError::InvalidInput(format!(
                "{} pixel values are not a whole number of {per}-value images",
                pixels.len()
            )));
        }
        let per_image: Vec<Vec<f32>> = pixels
            .par_chunks_exact(per)
            .map(|img| self.tower(w, img))
            .collect();
        Ok(per_image.concat())
    }

    /// One image through the tower: embeddings, pre-norm, the used layers, selection.
    fn tower(&self, w: &VisionWeights, image: &[f32]) -> Vec<f32> {
        let cfg = &self.config;
        let h = cfg.hidden_size;
        let t = cfg.num_positions();
        let mut x = self.embeddings(w, image);
        x = w.pre_norm.apply(&x);
        for layer in &w.layers {
            self.layer(layer, &mut x, t);
        }
        match cfg.select {
            FeatureSelect::DropClass => x.split_off(h),
            FeatureSelect::Full => x,
        }
    }

    /// Patch embeddings (the stride-`patch` convolution as a GEMM over unfolded patches),
    /// the class token first, plus the learned positions: `[positions, hidden]`.
    fn embeddings(&self, w: &VisionWeights, image: &[f32]) -> Vec<f32> {
        let cfg = &self.config;
        let (h, p, s, g) = (cfg.hidden_size, cfg.patch_size, cfg.image_size, cfg.grid());
        let k = cfg.num_channels * p * p;
        let mut patches = vec![0.0f32; g * g * k];
        for (idx, patch) in patches.chunks_exact_mut(k).enumerate() {
            let (py, px) = (idx / g, idx % g);
            let mut j = 0;
            for c in 0..cfg.num_channels {
                for ky in 0..p {
                    let row = c * s * s + (py * p + ky) * s + px * p;
                    patch[j..j + p].copy_from_slice(&image[row..row + p]);
                    j += p;
                }
            }
        }
        let mut x = vec![0.0f32; (g * g + 1) * h];
        x[..h].copy_from_slice(&w.class);
        matmul_t(&patches, g * g, k, w.patch.as_ref(), h, &mut x[h..]);
        x.iter_mut().zip(&w.positions).for_each(|(v, p)| *v += p);
        x
    }

    /// One pre-norm encoder layer over `t` tokens, in place.
    fn layer(&self, lw: &EncoderLayer, x: &mut [f32], t: usize) {
        let normed = lw.norm1.apply(x);
        let attn = self.attention(lw, &normed, t);
        let out = lw.o.apply(&attn, t);
        x.iter_mut().zip(&out).for_each(|(v, o)| *v += o);
        let normed = lw.norm2.apply(x);
        let mut mid = lw.fc1.apply(&normed, t);
        self.config.hidden_act.apply(&mut mid);
        let out = lw.fc2.apply(&mid, t);
        x.iter_mut().zip(&out).for_each(|(v, o)| *v += o);
    }

    /// Full (unmasked) multi-head self-attention; returns the heads' outputs `[t, hidden]`.
    fn attention(&self, lw: &EncoderLayer, x: &[f32], t: usize) -> Vec<f32> {
        let h = self.config.hidden_size;
        let heads = self.config.num_attention_heads;
        let hd = h / heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let (q, k, v) = (lw.q.apply(x, t), lw.k.apply(x, t), lw.v.apply(x, t));
        let mut out = vec![0.0f32; t * h];
        out.par_chunks_exact_mut(h)
            .enumerate()
            .for_each(|(i, row)| {
                let mut scores = vec![0.0f32; t];
                for head in 0..heads {
                    let off = head * hd;
                    let qi: Vec<f32> = q[i * h + off..i * h + off + hd]
                        .iter()
                        .map(|v| v * scale)
                        .collect();
                    for (j, s) in scores.iter_mut().enumerate() {
                        *s = dot(&qi, &k[j * h + off..j * h + off + hd]);
                    }
                    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0.0f32;
                    scores.iter_mut().for_each(|s| {
                        *s = (*s - max).exp();
                        sum += *s;
                    });
                    let o = &mut row[off..off + hd];
                    for (j, s) in scores.iter().enumerate() {
                        let w = s / sum;
                        o.iter_mut()
                            .zip(&v[j * h + off..j * h + off + hd])
                            .for_each(|(a, b)| *a += w * b);
                    }
                }
            });
        out
    }
}

/// The GPU tower, its mutex poisoned only by a panic inside a run (an error then, not a
/// second panic).
#[cfg(feature = "cuda")]
fn lock(
    c: &std::sync::Mutex<crate::backend::cuda::vision::CudaVision>,
) -> Result<std::sync::MutexGuard<'_, crate::backend::cuda::vision::CudaVision>, EngineError> {
    c.lock()
        .map_err(|_| EngineError::Backend("the GPU vision tower failed in an earlier run".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_matches_known_values() {
        for (x, want) in [
            (0.0, 0.0),
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (-1.5, -0.966_105_146_475_310_7),
            (3.0, 0.999_977_909_503_001_4),
        ] {
            assert!((erf(x) - want).abs() < 2e-7, "erf({x}) = {}", erf(x));
        }
    }

    #[test]
    fn feature_layer_counts_from_the_embeddings() {
        assert_eq!(layers_used(None, 24).unwrap(), 23);
        assert_eq!(layers_used(Some(&serde_json::json!(-1)), 3).unwrap(), 3);
        assert_eq!(layers_used(Some(&serde_json::json!(2)), 3).unwrap(), 2);
        assert!(layers_used(Some(&serde_json::json!(-4)), 3).is_err());
        assert!(layers_used(Some(&serde_json::json!(4)), 3).is_err());
        assert!(layers_used(Some(&serde_json::json!([-2, -5])), 24).is_err());
    }

    fn llava(vision: serde_json::Value) -> serde_json::Value {
        serde_json::json!({
            "architectures": ["LlavaForConditionalGeneration"],
            "image_token_index": 7,
            "vision_config": vision,
        })
    }

    #[test]
    fn llava_settings_parse_with_clip_defaults() {
        let c = VisionConfig::from_llava(
            &llava(
                serde_json::json!({"hidden_size": 32, "num_attention_heads": 2,
                "image_size": 56, "patch_size": 14, "num_hidden_layers": 3}),
            ),
            64,
        )
        .unwrap();
        assert_eq!(c.tokens_per_image(), 16);
        assert_eq!(c.layers_used, 2);
        assert_eq!(c.hidden_act, Activation::QuickGelu);
        assert_eq!(c.projector_act, Activation::Gelu);
        assert_eq!(c.image_token_index, 7);
        let bad = |v: serde_json::Value| VisionConfig::from_llava(&llava(v), 64).unwrap_err();
        assert!(bad(serde_json::json!({"image_size": 50, "patch_size": 14})).contains("patch_size"));
        assert!(
            bad(serde_json::json!({"hidden_size": 30, "num_attention_heads": 4}))
                .contains("num_attention_heads")
        );
        assert!(bad(serde_json::json!({"hidden_act": "relu"})).contains("relu"));
    }
}
