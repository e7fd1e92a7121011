//! Goldens against transformers' CLIP image processor (PIL backend).
//!
//! Regenerate (deterministic) from the repository root with
//! `python3 shared/media/tests/goldens/make_goldens.py` (needs `pip install transformers pillow
//! numpy`, no torch); `goldens/manifest.json` records the versions used.
//!
//! Every value must lie within one uint8 step after normalisation:
//! |ours - theirs| <= (1/255) / min(std) + 1e-5. The test prints the largest difference seen,
//! in uint8 steps, for our resize (a port of Pillow's Resample.c) and, for
//! comparison only, for `image::imageops::resize` with CatmullRom.
//!
//! PNG and WebP (lossless and lossy) decode to the same pixels as Pillow, so they are checked
//! end to end. JPEG decoders differ by a few uint8 steps, so for JPEGs the one-step check runs
//! on Pillow's decoded pixels (stored beside the goldens) and our own decode is held to
//! [`JPEG_DECODER_TOLERANCE_STEPS`].

use std::path::{Path, PathBuf};

use serde::Deserialize;
use tandem_media::{
    decode_image, ClipImageProcessor, CropSize, DecodedImage, MediaPolicy, PixelValues, ResizeSize,
};

#[derive(Deserialize)]
struct Manifest {
    transformers: String,
    image_mean: [f32; 3],
    image_std: [f32; 3],
    goldens: Vec<Golden>,
}

#[derive(Deserialize)]
struct Golden {
    image: String,
    size: u32,
    shape: [u32; 3],
    encoding: String,
    expected: String,
    /// Pillow's decoded RGB (JPEGs): the strict check runs on these pixels.
    pil_rgb: Option<String>,
}

/// JPEG decoders differ (libjpeg-turbo in Pillow, zune-jpeg in `image`): by up to 4 uint8
/// steps on these goldens' decoded pixels, less after the resize averages them. End to end,
/// JPEGs are held to this looser bound; the preprocessing of Pillow's own decoded pixels is
/// held to one step like everything else.
const JPEG_DECODER_TOLERANCE_STEPS: f32 = 4.0;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens")
}

fn processor(m: &Manifest, n: u32) -> ClipImageProcessor {
    ClipImageProcessor {
        size: ResizeSize::ShortestEdge(n),
        crop_size: CropSize {
            height: n,
            width: n,
        },
        image_mean: m.image_mean,
        image_std: m.image_std,
        ..ClipImageProcessor::default()
    }
}

fn expected(m: &Manifest, g: &Golden, p: &ClipImageProcessor) -> Vec<f32> {
    let bytes = std::fs::read(dir().join(&g.expected)).unwrap();
    match g.encoding.as_str() {
        "f32le_chw" => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        // uint8 before rescale/normalise (the script checks this reproduces transformers).
        "u8_chw" => {
            let plane = (g.shape[1] * g.shape[2]) as usize;
            bytes
                .iter()
                .enumerate()
                .map(|(i, &v)| {
                    let c = i / plane;
                    ((v as f64 * p.rescale_factor) as f32 - m.image_mean[c]) / m.image_std[c]
                })
                .collect()
        }
        other => panic!("unknown encoding {other}"),
    }
}

/// Largest |ours - theirs| in uint8 steps (per-channel std).
fn max_steps(ours: &PixelValues, theirs: &[f32], std: [f32; 3]) -> f32 {
    assert_eq!(ours.data.len(), theirs.len());
    let plane = (ours.height * ours.width) as usize;
    ours.data
        .iter()
        .zip(theirs)
        .enumerate()
        .map(|(i, (a, b))| (a - b).abs() * std[i / plane] * 255.0)
        .fold(0.0, f32::max)
}

/// The same pipeline with `image::imageops::resize(CatmullRom)` instead (for comparison).
fn preprocess_with_imageops(p: &ClipImageProcessor, img: &DecodedImage) -> PixelValues {
    let (h, w) = p.resized_size(img.height, img.width);
    let buf = image::RgbImage::from_raw(img.width, img.height, img.rgb.clone()).unwrap();
    let resized = image::imageops::resize(&buf, w, h, image::imageops::FilterType::CatmullRom);
    let resized = DecodedImage::new(w, h, resized.into_raw()).unwrap();
    let no_resize = ClipImageProcessor {
        do_resize: false,
        ..p.clone()
    };
    no_resize.preprocess(&resized).unwrap()
}

#[test]
fn clip_preprocessing_matches_transformers() {
    let m: Manifest =
        serde_json::from_str(&std::fs::read_to_string(dir().join("manifest.json")).unwrap())
            .unwrap();
    let min_std = m.image_std.iter().copied().fold(f32::INFINITY, f32::min);
    let tol = (1.0 / 255.0) / min_std + 1e-5;
    let policy = MediaPolicy::default();
    let (mut worst, mut worst_imageops, mut worst_jpeg) = (0f32, 0f32, 0f32);
    for g in &m.goldens {
        let p = processor(&m, g.size);
        let bytes = std::fs::read(dir().join(&g.image)).unwrap();
        let decoded = decode_image(&bytes, &policy).unwrap();
        let theirs = expected(&m, g, &p);
        let ours_decoded = p.preprocess(&decoded).unwrap();
        assert_eq!(
            [3, ours_decoded.height, ours_decoded.width],
            g.shape,
            "{}",
            g.image
        );
        let decoded_steps = max_steps(&ours_decoded, &theirs, m.image_std);
        // The pixels the strict check starts from: Pillow's for JPEG, ours otherwise.
        let img = match &g.pil_rgb {
            Some(f) => {
                worst_jpeg = worst_jpeg.max(decoded_steps);
                assert!(
                    decoded_steps <= JPEG_DECODER_TOLERANCE_STEPS + 0.01,
                    "{} @{}: {decoded_steps} steps with our JPEG decoder",
                    g.image,
                    g.size
                );
                let rgb = std::fs::read(dir().join(f)).unwrap();
                DecodedImage::new(decoded.width, decoded.height, rgb).unwrap()
            }
            None => decoded,
        };
        let ours = p.preprocess(&img).unwrap();
        let steps = max_steps(&ours, &theirs, m.image_std);
        let steps_imageops = max_steps(&preprocess_with_imageops(&p, &img), &theirs, m.image_std);
        let exact = ours
            .data
            .iter()
            .zip(&theirs)
            .filter(|(a, b)| (*a - *b).abs() <= 1e-6)
            .count();
        println!(
            "{} @{}: max diff {steps:.4} uint8 steps ({:.2}% within 1e-6); imageops CatmullRom: {steps_imageops:.4}{}",
            g.image,
            g.size,
            100.0 * exact as f64 / theirs.len() as f64,
            if g.pil_rgb.is_some() {
                format!(" (from Pillow's decoded pixels; with our JPEG decoder: {decoded_steps:.4})")
            } else {
                String::new()
            }
        );
        worst = worst.max(steps);
        worst_imageops = worst_imageops.max(steps_imageops);
        for (i, (a, b)) in ours.data.iter().zip(&theirs).enumerate() {
            assert!(
                (a - b).abs() <= tol,
                "{} @{}: value {i}: ours {a} theirs {b} (tolerance {tol})",
                g.image,
                g.size
            );
        }
    }
    println!(
        "transformers {}: max diff over all goldens {worst:.4} uint8 steps (imageops CatmullRom: \
         {worst_imageops:.4}); JPEG end to end with our decoder: {worst_jpeg:.4}",
        m.transformers
    );
}
