//! Image inputs for multimodal requests.
//!
//! * [`ImageSource`]: parsing of an OpenAI `image_url.url` string (data URL, `file:` URL, http(s)).
//! * [`MediaPolicy`] and [`load_local_file`]: local files, only inside one allowed folder.
//! * [`decode_image`]: PNG, JPEG and WebP only, with limits against decompression bombs,
//!   converted to RGB8 as transformers' `convert_to_rgb` does.
//! * [`ImageHash`]: a content hash of the decoded pixels (independent of the container format).
//! * [`ClipImageProcessor`]: transformers' CLIP image preprocessing (PIL backend), giving
//!   [`PixelValues`] for a CLIP / LLaVA vision tower. The resize is a port of Pillow's
//!   `Resample.c` (bit-exact against transformers' goldens, see `tests/goldens.rs`).
//!
//! Fetching http(s) images is not done here.

mod clip;
mod decode;
mod error;
mod hash;
mod policy;
mod resample;
mod source;

pub use clip::{ClipImageProcessor, CropSize, PixelValues, Resample, ResizeSize};
pub use decode::{decode_image, sniff_format, DecodedImage, ImageFormat};
pub use error::{MediaError, Result};
pub use hash::ImageHash;
pub use policy::{load_local_file, MediaPolicy};
pub use source::{ImageMediaType, ImageSource};
