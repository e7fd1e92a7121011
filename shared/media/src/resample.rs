//! Pillow's convolution resampling of 8-bit images (`libImaging/Resample.c`), bit for bit:
//! the same filters, coefficient bounds, 22-bit fixed-point coefficients and rounding, and
//! the same pass order (horizontal first, the intermediate image rounded to u8).
//!
//! fast_image_resize implements the same filters but, for u8 images, does the vertical pass
//! first and uses 16-bit coefficients; it differed from Pillow by up to 2 uint8 steps on the
//! goldens, `image::imageops::resize` (CatmullRom, f32) by up to 4. This port is exact.

use crate::clip::Resample;

const PRECISION_BITS: u32 = 32 - 8 - 2;

fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

fn bilinear(x: f64) -> f64 {
    let x = x.abs();
    if x < 1.0 {
        1.0 - x
    } else {
        0.0
    }
}

/// Per output pixel: first input index and fixed-point coefficients.
struct Coeffs {
    bounds: Vec<(usize, usize)>,
    ksize: usize,
    kk: Vec<i32>,
}

fn precompute(in_size: usize, out_size: usize, resample: Resample) -> Coeffs {
    let (filter, support): (fn(f64) -> f64, f64) = match resample {
        Resample::Bicubic => (bicubic, 2.0),
        Resample::Bilinear => (bilinear, 1.0),
    };
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = support * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut bounds = Vec::with_capacity(out_size);
    let mut kk = vec![0i32; out_size * ksize];
    let mut k = vec![0f64; ksize];
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        // C's (int) truncates toward zero; negatives are clamped to 0 anyway.
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64).max(0) as usize;
        let n = xmax.saturating_sub(xmin).min(ksize);
        let mut ww = 0.0;
        for (x, kx) in k.iter_mut().enumerate().take(n) {
            let w = filter((x as f64 + xmin as f64 - center + 0.5) * ss);
            *kx = w;
            ww += w;
        }
        for (x, &kx) in k.iter().enumerate().take(n) {
            let w = if ww != 0.0 { kx / ww } else { kx };
            let v = w * (1u32 << PRECISION_BITS) as f64;
            kk[xx * ksize + x] = if v < 0.0 {
                (v - 0.5) as i32
            } else {
                (v + 0.5) as i32
            };
        }
        bounds.push((xmin, n));
    }
    Coeffs { bounds, ksize, kk }
}

#[inline]
fn clip8(v: i64) -> u8 {
    (v >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Resizes an RGB8 image (row-major, 3 bytes per pixel) to `out_w` x `out_h` as Pillow's
/// `Image.resize(..., resample, reducing_gap=None)` does.
pub(crate) fn resize_rgb8(
    src: &[u8],
    w: usize,
    h: usize,
    out_w: usize,
    out_h: usize,
    resample: Resample,
) -> Vec<u8> {
    let horizontal;
    let src: &[u8] = if out_w != w {
        let c = precompute(w, out_w, resample);
        let mut out = vec![0u8; out_w * h * 3];
        for y in 0..h {
            let row = &src[y * w * 3..(y + 1) * w * 3];
            let orow = &mut out[y * out_w * 3..(y + 1) * out_w * 3];
            for (xx, &(xmin, n)) in c.bounds.iter().enumerate() {
                let k = &c.kk[xx * c.ksize..xx * c.ksize + n];
                let mut ss = [1i64 << (PRECISION_BITS - 1); 3];
                for (x, &kx) in k.iter().enumerate() {
                    let p = (xmin + x) * 3;
                    for (ch, s) in ss.iter_mut().enumerate() {
                        *s += row[p + ch] as i64 * kx as i64;
                    }
                }
                for ch in 0..3 {
                    orow[xx * 3 + ch] = clip8(ss[ch]);
                }
            }
        }
        horizontal = out;
        &horizontal
    } else {
        src
    };
    if out_h == h {
        return src.to_vec();
    }
    let c = precompute(h, out_h, resample);
    let stride = out_w * 3;
    let mut out = vec![0u8; stride * out_h];
    for (yy, &(ymin, n)) in c.bounds.iter().enumerate() {
        let k = &c.kk[yy * c.ksize..yy * c.ksize + n];
        let orow = &mut out[yy * stride..(yy + 1) * stride];
        for (i, o) in orow.iter_mut().enumerate() {
            let mut ss = 1i64 << (PRECISION_BITS - 1);
            for (y, &ky) in k.iter().enumerate() {
                ss += src[(ymin + y) * stride + i] as i64 * ky as i64;
            }
            *o = clip8(ss);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_and_constant() {
        let src: Vec<u8> = (0..4 * 3 * 3).map(|v| v as u8).collect();
        assert_eq!(resize_rgb8(&src, 4, 3, 4, 3, Resample::Bicubic), src);
        let flat = vec![77u8; 5 * 7 * 3];
        for (w, h) in [(1, 1), (9, 3), (13, 20), (2, 50)] {
            for r in [Resample::Bicubic, Resample::Bilinear] {
                let out = resize_rgb8(&flat, 5, 7, w, h, r);
                assert_eq!(out.len(), w * h * 3);
                assert!(out.iter().all(|&v| v == 77), "{w}x{h} {r:?}");
            }
        }
    }
}
