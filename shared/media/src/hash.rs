use std::fmt;

use sha2::{Digest, Sha256};

use crate::DecodedImage;

/// SHA-256 over (width u32 LE, height u32 LE, RGB bytes) of a decoded image: the same
/// pixels hash the same in any container format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ImageHash(pub [u8; 32]);

impl ImageHash {
    pub fn of(image: &DecodedImage) -> Self {
        let mut h = Sha256::new();
        h.update(image.width.to_le_bytes());
        h.update(image.height.to_le_bytes());
        h.update(&image.rgb);
        Self(h.finalize().into())
    }

    /// The first 8 bytes, little-endian.
    pub fn as_u64(&self) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.0[..8]);
        u64::from_le_bytes(b)
    }
}

impl DecodedImage {
    /// See [`ImageHash`].
    pub fn hash(&self) -> ImageHash {
        ImageHash::of(self)
    }
}

impl fmt::Display for ImageHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{decode_image, MediaPolicy};
    use image::{DynamicImage, ImageFormat};
    use std::io::Cursor;

    #[test]
    fn same_pixels_same_hash_across_formats() {
        let img = DynamicImage::ImageRgb8(image::RgbImage::from_fn(9, 7, |x, y| {
            image::Rgb([(x * 20) as u8, (y * 30) as u8, 77])
        }));
        let enc = |f| {
            let mut c = Cursor::new(Vec::new());
            img.write_to(&mut c, f).unwrap();
            c.into_inner()
        };
        let p = MediaPolicy::default();
        let png = decode_image(&enc(ImageFormat::Png), &p).unwrap();
        let webp = decode_image(&enc(ImageFormat::WebP), &p).unwrap();
        assert_eq!(png.hash(), webp.hash());
        assert_eq!(png.hash().as_u64(), webp.hash().as_u64());
        // Same bytes, other shape: another hash.
        let reshaped = DecodedImage::new(7, 9, png.rgb.clone()).unwrap();
        assert_ne!(png.hash(), reshaped.hash());
    }

    #[test]
    fn known_value_and_display() {
        let img = DecodedImage::new(1, 1, vec![1, 2, 3]).unwrap();
        let h = img.hash();
        let mut expect = Sha256::new();
        expect.update([1, 0, 0, 0, 1, 0, 0, 0, 1, 2, 3]);
        let expect: [u8; 32] = expect.finalize().into();
        assert_eq!(h.0, expect);
        let s = h.to_string();
        assert_eq!(s.len(), 64);
        assert_eq!(&s[..2], &format!("{:02x}", expect[0]));
        assert_eq!(
            h.as_u64(),
            u64::from_le_bytes(expect[..8].try_into().unwrap())
        );
    }
}
