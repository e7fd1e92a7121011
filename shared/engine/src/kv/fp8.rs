//! FP8 e4m3 ("e4m3fn": 4 exponent bits of bias 7, 3 mantissa bits, no infinities, ±448 the
//! largest finite value, `0x7f`/`0xff` NaN) and the per-head scaling of an FP8 KV cache.
//!
//! A head of `head_dim` values `x` is stored as `scale = amax / 448` (amax = max |x|) and the
//! codes `encode(x * (448 / amax))`; reading gives `decode(code) * scale`. A head of zeros has
//! scale 0 and zero codes. The arithmetic is the CUDA kernels' own (one f32 division for each
//! factor, round to nearest even, saturating), so the CPU and CUDA backends store the same
//! bytes for the same values.

/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// The e4m3 code nearest to `x` (ties to even), saturated to ±448; NaN gives NaN (`0x7f`).
/// What PTX's `cvt.rn.satfinite.e4m3x2.f32` gives.
pub fn encode(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    // Subnormals and zero: multiples of 2^-9 below 2^-6 (code 8 is 2^-6 itself, the first
    // normal, so rounding up into it needs no special case).
    let code = if a < 2f32.powi(-6) {
        (a * 512.0).round_ties_even() as u8
    } else if a >= E4M3_MAX {
        0x7e
    } else {
        let e = a.log2().floor() as i32;
        // log2 may land one off near powers of two: correct so that 2^e <= a < 2^(e+1).
        let e = if 2f32.powi(e) > a {
            e - 1
        } else if 2f32.powi(e + 1) <= a {
            e + 1
        } else {
            e
        };
        let m = ((a / 2f32.powi(e) - 1.0) * 8.0).round_ties_even() as i32;
        let (e, m) = if m == 8 { (e + 1, 0) } else { (e, m) };
        (((e + 7) << 3) | m).min(0x7e) as u8
    };
    sign | code
}

/// The value of an e4m3 code (NaN for `0x7f` / `0xff`).
pub fn decode(code: u8) -> f32 {
    let e = (code >> 3) & 0x0f;
    let m = (code & 7) as f32;
    let v = match (e, code & 7) {
        (0, _) => m * 2f32.powi(-9),
        (15, 7) => f32::NAN,
        _ => (1.0 + m / 8.0) * 2f32.powi(e as i32 - 7),
    };
    if code & 0x80 != 0 {
        -v
    } else {
        v
    }
}

/// Stores one head: its codes into `codes` (as long as `x`), and returns its scale.
pub fn quantize_head(x: &[f32], codes: &mut [u8]) -> f32 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let inv = if amax > 0.0 { E4M3_MAX / amax } else { 0.0 };
    for (c, v) in codes.iter_mut().zip(x) {
        *c = encode(v * inv);
    }
    amax / E4M3_MAX
}

/// Reads one head back: `decode(code) * scale` into `out`.
pub fn dequantize_head(codes: &[u8], scale: f32, out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(codes) {
        *o = decode(*c) * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_decodes_and_encodes_back_to_itself() {
        for c in 0..=255u8 {
            let v = decode(c);
            if c & 0x7f == 0x7f {
                assert!(v.is_nan());
                continue;
            }
            // -0 encodes as 0x80, its own code.
            assert_eq!(encode(v), c, "code {c:#04x} = {v}");
        }
        assert_eq!(decode(0x7e), 448.0);
        assert_eq!(decode(0x08), 2f32.powi(-6));
        assert_eq!(decode(0x01), 2f32.powi(-9));
    }

    #[test]
    fn encoding_rounds_to_nearest_even_and_saturates() {
        // 1.0625 is halfway between 1.0 (even mantissa 0) and 1.125: down; 1.1875 between
        // 1.125 (odd) and 1.25: up.
        assert_eq!(decode(encode(1.0625)), 1.0);
        assert_eq!(decode(encode(1.1875)), 1.25);
        assert_eq!(decode(encode(1.07)), 1.125);
        assert_eq!(encode(1e9), 0x7e);
        assert_eq!(encode(f32::INFINITY), 0x7e);
        assert_eq!(encode(-1e9), 0xfe);
        assert_eq!(encode(f32::NAN), 0x7f);
        // Subnormals: 3 × 2^-10 is halfway between 1 and 2 × 2^-9: to even (2).
        assert_eq!(encode(3.0 * 2f32.powi(-10)), 2);
        assert_eq!(encode(1e-6), 0);
        // Between every pair of neighbouring codes, the nearer one wins.
        for c in 0..0x7du8 {
            let (a, b) = (decode(c), decode(c + 1));
            assert_eq!(encode(a + (b - a) * 0.49), c);
            assert_eq!(encode(a + (b - a) * 0.51), c + 1);
        }
    }

    #[test]
    fn a_head_keeps_its_largest_value_and_the_relative_error_of_three_mantissa_bits() {
        let x: Vec<f32> = (0..128)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        let mut codes = vec![0u8; 128];
        let scale = quantize_head(&x, &mut codes);
        let mut back = vec![0f32; 128];
        dequantize_head(&codes, scale, &mut back);
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (a, b) in x.iter().zip(&back) {
            // Half a unit in the last place: 2^-4 relative for normals, 2^-10 of amax below.
            let tol = (a.abs() / 16.0).max(amax / 448.0 * 2f32.powi(-10)) * 1.0001;
            assert!((a - b).abs() <= tol, "{a} read back as {b}");
        }
        let zeros = [0.0f32; 8];
        let mut c = [1u8; 8];
        assert_eq!(quantize_head(&zeros, &mut c), 0.0);
        assert_eq!(c, [0; 8]);
    }
}
