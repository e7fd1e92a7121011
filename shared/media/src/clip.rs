use serde::Deserialize;

use crate::{DecodedImage, MediaError, Result};

/// OpenAI CLIP normalisation, transformers' defaults (its decimal literals, kept verbatim).
#[allow(clippy::excessive_precision)]
const OPENAI_CLIP_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
#[allow(clippy::excessive_precision)]
const OPENAI_CLIP_STD: [f32; 3] = [0.268_629_54, 0.261_302_58, 0.275_777_11];

/// Resized images above this many pixels are refused (an extreme aspect ratio would otherwise
/// make the shortest-edge resize allocate gigabytes before the crop).
const MAX_RESIZED_PIXELS: u64 = 1 << 26;

/// Pillow resampling filters this crate reproduces (see `resample.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resample {
    /// PIL `BILINEAR` (2).
    Bilinear,
    /// PIL `BICUBIC` (3).
    Bicubic,
}

impl Resample {
    fn from_pil(v: i64) -> Result<Self> {
        match v {
            2 => Ok(Self::Bilinear),
            3 => Ok(Self::Bicubic),
            other => Err(MediaError::UnsupportedResample(other)),
        }
    }
}

/// `size` of a preprocessor config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResizeSize {
    /// Resize so that the shorter edge is this long, keeping the aspect ratio.
    ShortestEdge(u32),
    /// Resize to exactly this size.
    Exact { height: u32, width: u32 },
}

/// `crop_size` of a preprocessor config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CropSize {
    pub height: u32,
    pub width: u32,
}

/// Preprocessed pixels: CHW order, 3 channels, `data.len() == 3 * height * width`.
#[derive(Debug, Clone, PartialEq)]
pub struct PixelValues {
    pub height: u32,
    pub width: u32,
    pub data: Vec<f32>,
}

impl PixelValues {
    pub const CHANNELS: usize = 3;
}

/// transformers' CLIP image preprocessing (`CLIPImageProcessor`, PIL backend):
/// resize (PIL resampling on u8), center crop, rescale, normalise.
#[derive(Debug, Clone, PartialEq)]
pub struct ClipImageProcessor {
    pub do_resize: bool,
    pub size: ResizeSize,
    pub resample: Resample,
    pub do_center_crop: bool,
    pub crop_size: CropSize,
    pub do_rescale: bool,
    pub rescale_factor: f64,
    pub do_normalize: bool,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
    /// Informational: [`crate::decode_image`] always converts to RGB as transformers'
    /// `convert_to_rgb` does.
    pub do_convert_rgb: bool,
}

impl Default for ClipImageProcessor {
    /// transformers' `CLIPImageProcessor` defaults (224 px).
    fn default() -> Self {
        Self {
            do_resize: true,
            size: ResizeSize::ShortestEdge(224),
            resample: Resample::Bicubic,
            do_center_crop: true,
            crop_size: CropSize {
                height: 224,
                width: 224,
            },
            do_rescale: true,
            rescale_factor: 1.0 / 255.0,
            do_normalize: true,
            image_mean: OPENAI_CLIP_MEAN,
            image_std: OPENAI_CLIP_STD,
            do_convert_rgb: true,
        }
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawSize {
    Int(u32),
    Dict {
        shortest_edge: Option<u32>,
        longest_edge: Option<u32>,
        height: Option<u32>,
        width: Option<u32>,
    },
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawFloats {
    One(f32),
    Many(Vec<f32>),
}

#[derive(Deserialize)]
struct RawConfig {
    do_resize: Option<bool>,
    size: Option<RawSize>,
    resample: Option<i64>,
    do_center_crop: Option<bool>,
    crop_size: Option<RawSize>,
    do_rescale: Option<bool>,
    rescale_factor: Option<f64>,
    do_normalize: Option<bool>,
    image_mean: Option<RawFloats>,
    image_std: Option<RawFloats>,
    do_convert_rgb: Option<bool>,
}

fn positive(v: u32, field: &'static str) -> Result<u32> {
    if v == 0 {
        Err(MediaError::InvalidConfigValue {
            field,
            reason: "must be positive",
        })
    } else {
        Ok(v)
    }
}

fn three(v: RawFloats, field: &'static str) -> Result<[f32; 3]> {
    let out = match v {
        RawFloats::One(x) => [x; 3],
        RawFloats::Many(v) => {
            <[f32; 3]>::try_from(v.as_slice()).map_err(|_| MediaError::InvalidConfigValue {
                field,
                reason: "must have 3 values",
            })?
        }
    };
    if out.iter().any(|x| !x.is_finite()) {
        return Err(MediaError::InvalidConfigValue {
            field,
            reason: "must be finite",
        });
    }
    Ok(out)
}

impl ClipImageProcessor {
    /// Parses a Hugging Face `preprocessor_config.json` (missing fields take transformers'
    /// CLIP defaults; unknown fields are ignored).
    pub fn from_json(json: &str) -> Result<Self> {
        let raw: RawConfig = serde_json::from_str(json)?;
        let mut p = Self::default();
        if let Some(v) = raw.do_resize {
            p.do_resize = v;
        }
        if let Some(size) = raw.size {
            p.size = match size {
                // A bare int is a shortest edge (transformers: default_to_square=False).
                RawSize::Int(n) => ResizeSize::ShortestEdge(positive(n, "size")?),
                RawSize::Dict {
                    shortest_edge: Some(n),
                    longest_edge: None,
                    ..
                } => ResizeSize::ShortestEdge(positive(n, "size.shortest_edge")?),
                RawSize::Dict {
                    shortest_edge: Some(_),
                    longest_edge: Some(_),
                    ..
                } => {
                    return Err(MediaError::InvalidConfigValue {
                        field: "size",
                        reason: "shortest_edge with longest_edge is not supported",
                    })
                }
                RawSize::Dict {
                    height: Some(h),
                    width: Some(w),
                    ..
                } => ResizeSize::Exact {
                    height: positive(h, "size.height")?,
                    width: positive(w, "size.width")?,
                },
                RawSize::Dict { .. } => {
                    return Err(MediaError::InvalidConfigValue {
                        field: "size",
                        reason: "expected {\"shortest_edge\": N} or {\"height\": H, \"width\": W}",
                    })
                }
            };
        }
        if let Some(r) = raw.resample {
            p.resample = Resample::from_pil(r)?;
        }
        if let Some(v) = raw.do_center_crop {
            p.do_center_crop = v;
        }
        if let Some(c) = raw.crop_size {
            p.crop_size = match c {
                RawSize::Int(n) => {
                    let n = positive(n, "crop_size")?;
                    CropSize {
                        height: n,
                        width: n,
                    }
                }
                RawSize::Dict {
                    height: Some(h),
                    width: Some(w),
                    ..
                } => CropSize {
                    height: positive(h, "crop_size.height")?,
                    width: positive(w, "crop_size.width")?,
                },
                RawSize::Dict { .. } => {
                    return Err(MediaError::InvalidConfigValue {
                        field: "crop_size",
                        reason: "expected {\"height\": H, \"width\": W} or an int",
                    })
                }
            };
        }
        if let Some(v) = raw.do_rescale {
            p.do_rescale = v;
        }
        if let Some(f) = raw.rescale_factor {
            if !f.is_finite() {
                return Err(MediaError::InvalidConfigValue {
                    field: "rescale_factor",
                    reason: "must be finite",
                });
            }
            p.rescale_factor = f;
        }
        if let Some(v) = raw.do_normalize {
            p.do_normalize = v;
        }
        if let Some(m) = raw.image_mean {
            p.image_mean = three(m, "image_mean")?;
        }
        if let Some(s) = raw.image_std {
            p.image_std = three(s, "image_std")?;
            if p.image_std.contains(&0.0) {
                return Err(MediaError::InvalidConfigValue {
                    field: "image_std",
                    reason: "must not be zero",
                });
            }
        }
        if let Some(v) = raw.do_convert_rgb {
            p.do_convert_rgb = v;
        }
        Ok(p)
    }

    /// The (height, width) the image is resized to, as transformers computes it
    /// (`get_resize_output_image_size(default_to_square=False)`: the long edge is
    /// `int(N * long / short)`, truncated).
    pub fn resized_size(&self, height: u32, width: u32) -> (u32, u32) {
        if !self.do_resize {
            return (height, width);
        }
        match self.size {
            ResizeSize::Exact { height, width } => (height, width),
            ResizeSize::ShortestEdge(n) => {
                let (short, long) = if width <= height {
                    (width, height)
                } else {
                    (height, width)
                };
                let short = short.max(1);
                let new_long = ((n as u64 * long as u64) as f64 / short as f64) as u32;
                if width <= height {
                    (new_long, n)
                } else {
                    (n, new_long)
                }
            }
        }
    }

    /// The (height, width) of the pixel values for an image of this size.
    pub fn output_size(&self, height: u32, width: u32) -> (u32, u32) {
        if self.do_center_crop {
            (self.crop_size.height, self.crop_size.width)
        } else {
            self.resized_size(height, width)
        }
    }

    /// Resize, center crop, rescale and normalise, as transformers' slow (PIL)
    /// `CLIPImageProcessor` does. Output is CHW.
    pub fn preprocess(&self, image: &DecodedImage) -> Result<PixelValues> {
        let (w0, h0) = (image.width, image.height);
        if w0 == 0 || h0 == 0 || image.rgb.len() as u64 != w0 as u64 * h0 as u64 * 3 {
            return Err(MediaError::BadDecodedImage {
                width: w0,
                height: h0,
                len: image.rgb.len(),
            });
        }
        let (rh, rw) = self.resized_size(h0, w0);
        if rh == 0 || rw == 0 || rh as u64 * rw as u64 > MAX_RESIZED_PIXELS {
            return Err(MediaError::ImageTooLarge {
                width: rw,
                height: rh,
                max_dimension: u32::MAX,
                max_pixels: MAX_RESIZED_PIXELS,
            });
        }
        let resized;
        let (rgb, h, w): (&[u8], u32, u32) = if (rh, rw) == (h0, w0) {
            (&image.rgb, h0, w0)
        } else {
            resized = self.resize(image, rh, rw);
            (&resized, rh, rw)
        };

        let (oh, ow, top, left) = if self.do_center_crop {
            let (ch, cw) = (self.crop_size.height, self.crop_size.width);
            // transformers' center_crop: offset (orig - crop) // 2 (floor), and when the crop
            // is larger than the image, zero padding of ceil((crop - orig) / 2) before it.
            let top = crop_offset(h, ch);
            let left = crop_offset(w, cw);
            (ch, cw, top, left)
        } else {
            (h, w, 0, 0)
        };

        let plane = oh as usize * ow as usize;
        let mut data = vec![0f32; 3 * plane];
        let scale = self.rescale_factor;
        let value = |v: u8, c: usize| -> f32 {
            let x = if self.do_rescale {
                (v as f64 * scale) as f32
            } else {
                v as f32
            };
            if self.do_normalize {
                (x - self.image_mean[c]) / self.image_std[c]
            } else {
                x
            }
        };
        // Padding (zeros in u8) goes through rescale/normalise like any pixel.
        let pad: [f32; 3] = [value(0, 0), value(0, 1), value(0, 2)];
        for y in 0..oh as i64 {
            let sy = y + top;
            for x in 0..ow as i64 {
                let sx = x + left;
                let i = y as usize * ow as usize + x as usize;
                if sy >= 0 && sy < h as i64 && sx >= 0 && sx < w as i64 {
                    let s = (sy as usize * w as usize + sx as usize) * 3;
                    for c in 0..3 {
                        data[c * plane + i] = value(rgb[s + c], c);
                    }
                } else {
                    for c in 0..3 {
                        data[c * plane + i] = pad[c];
                    }
                }
            }
        }
        Ok(PixelValues {
            height: oh,
            width: ow,
            data,
        })
    }

    fn resize(&self, image: &DecodedImage, height: u32, width: u32) -> Vec<u8> {
        crate::resample::resize_rgb8(
            &image.rgb,
            image.width as usize,
            image.height as usize,
            width as usize,
            height as usize,
            self.resample,
        )
    }
}

/// Offset into the (possibly unpadded) image of the crop's first row/column: transformers
/// computes `(orig - crop) // 2` and shifts by the padding `ceil((crop - orig) / 2)` when the
/// crop is larger; relative to the unpadded image that is `(orig - crop) // 2` in both cases
/// (the padding cancels out against reading zeros outside the image).
fn crop_offset(orig: u32, crop: u32) -> i64 {
    (orig as i64 - crop as i64).div_euclid(2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_llava_config() {
        let json = r#"{
          "crop_size": 336, "do_center_crop": true, "do_normalize": true, "do_resize": true,
          "feature_extractor_type": "CLIPFeatureExtractor",
          "image_mean": [0.48145466, 0.4578275, 0.40821073],
          "image_processor_type": "CLIPImageProcessor",
          "image_std": [0.26862954, 0.26130258, 0.27577711],
          "resample": 3, "size": {"shortest_edge": 336}
        }"#;
        let p = ClipImageProcessor::from_json(json).unwrap();
        assert_eq!(p.size, ResizeSize::ShortestEdge(336));
        assert_eq!(
            p.crop_size,
            CropSize {
                height: 336,
                width: 336
            }
        );
        assert_eq!(p.resample, Resample::Bicubic);
        assert!((p.rescale_factor - 1.0 / 255.0).abs() < 1e-12);
        let p = ClipImageProcessor::from_json(
            r#"{"size": {"height": 30, "width": 40}, "crop_size": {"height": 20, "width": 10}, "image_mean": 0.5, "resample": 2}"#,
        )
        .unwrap();
        assert_eq!(
            p.size,
            ResizeSize::Exact {
                height: 30,
                width: 40
            }
        );
        assert_eq!(
            p.crop_size,
            CropSize {
                height: 20,
                width: 10
            }
        );
        assert_eq!(p.image_mean, [0.5; 3]);
        assert_eq!(p.resample, Resample::Bilinear);
    }

    #[test]
    fn config_errors() {
        assert!(matches!(
            ClipImageProcessor::from_json(r#"{"resample": 1}"#),
            Err(MediaError::UnsupportedResample(1))
        ));
        assert!(matches!(
            ClipImageProcessor::from_json(r#"{"size": {"foo": 1}}"#),
            Err(MediaError::InvalidConfigValue { field: "size", .. })
        ));
        assert!(matches!(
            ClipImageProcessor::from_json(r#"{"image_std": [1, 2]}"#),
            Err(MediaError::InvalidConfigValue {
                field: "image_std",
                ..
            })
        ));
        assert!(matches!(
            ClipImageProcessor::from_json(r#"{"image_std": [1, 0, 2]}"#),
            Err(MediaError::InvalidConfigValue {
                field: "image_std",
                ..
            })
        ));
        assert!(matches!(
            ClipImageProcessor::from_json(r#"{"size": 0}"#),
            Err(MediaError::InvalidConfigValue { .. })
        ));
        assert!(matches!(
            ClipImageProcessor::from_json("not json"),
            Err(MediaError::InvalidConfig(_))
        ));
    }

    #[test]
    fn resize_size_like_transformers() {
        let p = ClipImageProcessor {
            size: ResizeSize::ShortestEdge(56),
            ..Default::default()
        };
        // (h, w) -> (h', w')
        assert_eq!(p.resized_size(48, 64), (56, 74)); // int(56*64/48)=74.67 -> 74
        assert_eq!(p.resized_size(91, 37), (137, 56)); // int(56*91/37)=137.7 -> 137
        assert_eq!(p.resized_size(20, 20), (56, 56));
        assert_eq!(p.resized_size(1, 3), (56, 168));
    }

    #[test]
    fn crop_with_padding() {
        // A 2x2 image, no resize, crop 4x3: padded with zeros as transformers does.
        let p = ClipImageProcessor {
            do_resize: false,
            crop_size: CropSize {
                height: 4,
                width: 3,
            },
            do_rescale: false,
            do_normalize: false,
            ..Default::default()
        };
        let img = DecodedImage::new(2, 2, (1..=12).collect()).unwrap();
        let out = p.preprocess(&img).unwrap();
        assert_eq!((out.height, out.width), (4, 3));
        // Channel 0 (R values 1, 4 / 7, 10): top pad 1, left pad ceil(1/2)=1.
        assert_eq!(
            &out.data[..12],
            &[0., 0., 0., 0., 1., 4., 0., 7., 10., 0., 0., 0.]
        );
    }

    #[test]
    fn extreme_aspect_ratio_refused() {
        let p = ClipImageProcessor::default();
        let img = DecodedImage::new(16384, 1, vec![0; 16384 * 3]).unwrap();
        assert!(matches!(
            p.preprocess(&img),
            Err(MediaError::ImageTooLarge { .. })
        ));
    }
}
