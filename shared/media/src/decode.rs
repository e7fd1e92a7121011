use std::io::Cursor;

use image::{DynamicImage, ImageDecoder, ImageReader, Limits};

use crate::{MediaError, MediaPolicy, Result};

/// The accepted container formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ImageFormat {
    Png,
    Jpeg,
    Webp,
}

impl ImageFormat {
    fn to_image(self) -> image::ImageFormat {
        match self {
            Self::Png => image::ImageFormat::Png,
            Self::Jpeg => image::ImageFormat::Jpeg,
            Self::Webp => image::ImageFormat::WebP,
        }
    }
}

/// A decoded image: RGB8, row-major, `rgb.len() == width * height * 3`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedImage {
    pub width: u32,
    pub height: u32,
    pub rgb: Vec<u8>,
}

impl DecodedImage {
    /// Checks that the buffer matches the dimensions.
    pub fn new(width: u32, height: u32, rgb: Vec<u8>) -> Result<Self> {
        let expected = (width as u64) * (height as u64) * 3;
        if width == 0 || height == 0 || rgb.len() as u64 != expected {
            return Err(MediaError::BadDecodedImage {
                width,
                height,
                len: rgb.len(),
            });
        }
        Ok(Self { width, height, rgb })
    }
}

/// Detects the format from the magic bytes: `Ok` for PNG, JPEG and WebP, a typed
/// `UnsupportedFormat` naming other known formats, `UnknownFormat` otherwise.
pub fn sniff_format(bytes: &[u8]) -> Result<ImageFormat> {
    let starts = |sig: &[u8]| bytes.starts_with(sig);
    if bytes.is_empty() {
        return Err(MediaError::Empty);
    }
    if starts(b"\x89PNG\r\n\x1a\n") {
        return Ok(ImageFormat::Png);
    }
    if starts(b"\xff\xd8\xff") {
        return Ok(ImageFormat::Jpeg);
    }
    if bytes.len() >= 12 && starts(b"RIFF") && &bytes[8..12] == b"WEBP" {
        return Ok(ImageFormat::Webp);
    }
    let format = if starts(b"GIF87a") || starts(b"GIF89a") {
        "GIF"
    } else if starts(b"BM") {
        "BMP"
    } else if starts(b"II*\0") || starts(b"MM\0*") {
        "TIFF"
    } else if starts(b"\0\0\x01\0") {
        "ICO"
    } else if starts(b"qoif") {
        "QOI"
    } else if starts(b"8BPS") {
        "PSD"
    } else if starts(b"\x76\x2f\x31\x01") {
        "OpenEXR"
    } else if starts(b"#?RADIANCE") {
        "HDR"
    } else if starts(b"\0\0\0\x0cjP  ") || starts(b"\xff\x4f\xff\x51") {
        "JPEG 2000"
    } else if starts(b"\xff\x0a") || starts(b"\0\0\0\x0cJXL ") {
        "JPEG XL"
    } else if bytes.len() >= 12 && &bytes[4..8] == b"ftyp" {
        match &bytes[8..12] {
            b"avif" | b"avis" => "AVIF",
            b"heic" | b"heix" | b"mif1" | b"msf1" | b"hevc" => "HEIF",
            _ => "ISO media (ftyp)",
        }
    } else if starts(b"RIFF") {
        "RIFF (not WebP)"
    } else if starts(b"P1")
        || starts(b"P2")
        || starts(b"P3")
        || starts(b"P4")
        || starts(b"P5")
        || starts(b"P6")
    {
        "PNM"
    } else if starts(b"<?xml") || starts(b"<svg") {
        "SVG"
    } else {
        return Err(MediaError::UnknownFormat);
    };
    Err(MediaError::UnsupportedFormat { format })
}

/// Decodes a PNG, JPEG or WebP image into RGB8 within the policy's limits.
///
/// The conversion follows transformers' `convert_to_rgb` (transformers 5): an image with
/// alpha (or PNG `tRNS` transparency) is composited onto a white background with Pillow's
/// `alpha_composite` integer arithmetic; grayscale is replicated to three channels.
/// EXIF orientation is not applied (as `PIL.Image.open`).
pub fn decode_image(bytes: &[u8], policy: &MediaPolicy) -> Result<DecodedImage> {
    let format = sniff_format(bytes)?;
    let mut limits = Limits::default();
    limits.max_image_width = Some(policy.max_dimension);
    limits.max_image_height = Some(policy.max_dimension);
    // Decoders may hold up to 16-bit RGBA (8 bytes per pixel) plus the conversion.
    limits.max_alloc = Some(policy.max_pixels.saturating_mul(16).max(1 << 20));

    let mut reader = ImageReader::with_format(Cursor::new(bytes), format.to_image());
    reader.limits(limits);
    let decoder = reader.into_decoder().map_err(map_image_err)?;
    let (width, height) = decoder.dimensions();
    if width == 0 || height == 0 {
        return Err(MediaError::EmptyImage);
    }
    if width > policy.max_dimension
        || height > policy.max_dimension
        || (width as u64) * (height as u64) > policy.max_pixels
    {
        return Err(MediaError::ImageTooLarge {
            width,
            height,
            max_dimension: policy.max_dimension,
            max_pixels: policy.max_pixels,
        });
    }
    let image = DynamicImage::from_decoder(decoder).map_err(map_image_err)?;
    let rgb = to_rgb_like_transformers(image);
    DecodedImage::new(width, height, rgb)
}

fn map_image_err(e: image::ImageError) -> MediaError {
    match e {
        image::ImageError::Limits(_) => MediaError::LimitsExceeded(e),
        other => MediaError::Decode(other),
    }
}

fn to_rgb_like_transformers(image: DynamicImage) -> Vec<u8> {
    if !image.color().has_alpha() {
        return image.into_rgb8().into_raw();
    }
    let rgba = image.into_rgba8().into_raw();
    let mut out = Vec::with_capacity(rgba.len() / 4 * 3);
    for px in rgba.chunks_exact(4) {
        let a = px[3];
        for &c in &px[..3] {
            out.push(composite_on_white(c, a));
        }
    }
    out
}

/// Pillow's `Image.alpha_composite(white, src)` for one channel (AlphaComposite.c).
fn composite_on_white(c: u8, a: u8) -> u8 {
    const PRECISION_BITS: u32 = 7;
    if a == 0 {
        return 255;
    }
    let (c, a) = (c as u32, a as u32);
    let blend = 255 * (255 - a);
    let outa255 = a * 255 + blend;
    let coef1 = a * 255 * 255 * (1 << PRECISION_BITS) / outa255;
    let coef2 = 255 * (1 << PRECISION_BITS) - coef1;
    let tmp = c * coef1 + 255 * coef2 + (0x80 << PRECISION_BITS);
    let v = (((tmp >> 8) + tmp) >> 8) >> PRECISION_BITS;
    v.min(255) as u8
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::{ImageEncoder, ImageFormat as F};

    fn encode(img: &DynamicImage, f: F) -> Vec<u8> {
        let mut out = Cursor::new(Vec::new());
        img.write_to(&mut out, f).unwrap();
        out.into_inner()
    }

    fn test_image(w: u32, h: u32) -> DynamicImage {
        DynamicImage::ImageRgb8(image::RgbImage::from_fn(w, h, |x, y| {
            image::Rgb([(x * 7) as u8, (y * 13) as u8, ((x + y) * 3) as u8])
        }))
    }

    #[test]
    fn png_roundtrip() {
        let img = test_image(5, 3);
        let d = decode_image(&encode(&img, F::Png), &MediaPolicy::default()).unwrap();
        assert_eq!((d.width, d.height), (5, 3));
        assert_eq!(d.rgb, img.to_rgb8().into_raw());
    }

    #[test]
    fn webp_lossless_roundtrip() {
        let img = test_image(6, 4);
        let d = decode_image(&encode(&img, F::WebP), &MediaPolicy::default()).unwrap();
        assert_eq!(d.rgb, img.to_rgb8().into_raw());
    }

    #[test]
    fn unsupported_formats() {
        let p = MediaPolicy::default();
        for (bytes, name) in [
            (&b"GIF89a\x01\x00\x01\x00\x00\x00\x00;"[..], "GIF"),
            (&b"BM\x3a\0\0\0\0\0\0\0\x36\0\0\0"[..], "BMP"),
            (&b"II*\0\x08\0\0\0"[..], "TIFF"),
            (&b"\0\0\0\x1cftypavif\0\0\0\0"[..], "AVIF"),
        ] {
            match decode_image(bytes, &p) {
                Err(MediaError::UnsupportedFormat { format }) => assert_eq!(format, name),
                other => panic!("{name}: {other:?}"),
            }
        }
        assert!(matches!(
            decode_image(b"hello world", &p),
            Err(MediaError::UnknownFormat)
        ));
        assert!(matches!(decode_image(b"", &p), Err(MediaError::Empty)));
        assert!(matches!(
            decode_image(b"RIFF", &p),
            Err(MediaError::UnsupportedFormat { .. })
        ));
    }

    #[test]
    fn truncated_png() {
        let bytes = encode(&test_image(40, 30), F::Png);
        let p = MediaPolicy::default();
        for cut in [8, 20, 33, bytes.len() / 2, bytes.len() - 13] {
            let err = decode_image(&bytes[..cut], &p).unwrap_err();
            assert!(matches!(err, MediaError::Decode(_)), "cut {cut}: {err}");
        }
    }

    #[test]
    fn truncated_or_garbage_never_panics() {
        let p = MediaPolicy::default();
        for f in [F::Png, F::Jpeg, F::WebP] {
            let bytes = encode(&test_image(33, 17), f);
            for cut in 0..bytes.len() {
                let _ = decode_image(&bytes[..cut], &p);
            }
            let mut flipped = bytes.clone();
            for i in (16..flipped.len()).step_by(7) {
                flipped[i] ^= 0x5a;
                let _ = decode_image(&flipped, &p);
            }
        }
    }

    #[test]
    fn too_large_dimensions() {
        let bytes = encode(&test_image(64, 48), F::Png);
        let p = MediaPolicy {
            max_dimension: 32,
            ..MediaPolicy::default()
        };
        assert!(matches!(
            decode_image(&bytes, &p),
            Err(MediaError::ImageTooLarge { .. } | MediaError::LimitsExceeded(_))
        ));
        let p = MediaPolicy {
            max_pixels: 64 * 48 - 1,
            ..MediaPolicy::default()
        };
        assert!(matches!(
            decode_image(&bytes, &p),
            Err(MediaError::ImageTooLarge {
                width: 64,
                height: 48,
                ..
            })
        ));
    }

    #[test]
    fn bomb_header_refused_before_allocating() {
        // A PNG header claiming 100000 x 100000 pixels (valid IHDR CRC, no data).
        let mut png = Vec::new();
        {
            let enc = image::codecs::png::PngEncoder::new(&mut png);
            enc.write_image(&[0; 3], 1, 1, image::ExtendedColorType::Rgb8)
                .unwrap();
        }
        // Patch width/height in IHDR and recompute its CRC.
        png[16..20].copy_from_slice(&100_000u32.to_be_bytes());
        png[20..24].copy_from_slice(&100_000u32.to_be_bytes());
        let crc = crc32(&png[12..29]);
        png[29..33].copy_from_slice(&crc.to_be_bytes());
        let err = decode_image(&png, &MediaPolicy::default()).unwrap_err();
        assert!(
            matches!(
                err,
                MediaError::ImageTooLarge { .. } | MediaError::LimitsExceeded(_)
            ),
            "{err}"
        );
    }

    fn crc32(data: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &b in data {
            crc ^= b as u32;
            for _ in 0..8 {
                crc = if crc & 1 != 0 {
                    (crc >> 1) ^ 0xedb8_8320
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }

    #[test]
    fn alpha_composited_on_white_grayscale_replicated() {
        let rgba = DynamicImage::ImageRgba8(
            image::RgbaImage::from_raw(
                3,
                1,
                vec![10, 20, 30, 255, 10, 20, 30, 0, 200, 100, 0, 128],
            )
            .unwrap(),
        );
        let d = decode_image(&encode(&rgba, F::Png), &MediaPolicy::default()).unwrap();
        assert_eq!(&d.rgb[..6], &[10, 20, 30, 255, 255, 255]);
        // 200*a + 255*(1-a) with a = 128/255 ≈ 227.4; 100 → 177.4; 0 → 127.0
        assert_eq!(&d.rgb[6..], &[227, 177, 127]);

        let gray =
            DynamicImage::ImageLuma8(image::GrayImage::from_raw(2, 1, vec![7, 250]).unwrap());
        let d = decode_image(&encode(&gray, F::Png), &MediaPolicy::default()).unwrap();
        assert_eq!(d.rgb, vec![7, 7, 7, 250, 250, 250]);
    }

    #[test]
    fn decoded_image_new_checks_len() {
        assert!(DecodedImage::new(2, 2, vec![0; 12]).is_ok());
        assert!(matches!(
            DecodedImage::new(2, 2, vec![0; 11]),
            Err(MediaError::BadDecodedImage { .. })
        ));
        assert!(DecodedImage::new(0, 2, vec![]).is_err());
    }
}
