use std::path::PathBuf;

/// Everything that can go wrong with an image input.
#[derive(Debug, thiserror::Error)]
pub enum MediaError {
    // --- image_url parsing ---
    #[error("unsupported image URL scheme {scheme:?} (expected data:, file: or http(s):)")]
    UnsupportedScheme { scheme: String },
    #[error("image URL has no scheme")]
    MissingScheme,
    #[error("malformed data URL: no ',' between header and payload")]
    MalformedDataUrl,
    #[error("unsupported data URL media type {media_type:?} (expected image/png, image/jpeg or image/webp)")]
    UnsupportedMediaType { media_type: String },
    #[error("data URL of media type {media_type:?} is not base64-encoded")]
    DataUrlNotBase64 { media_type: String },
    #[error("invalid base64 in data URL: {0}")]
    InvalidBase64(#[from] base64::DecodeError),
    #[error("data URL payload of {size} bytes exceeds the limit of {max} bytes")]
    DataTooLarge { size: u64, max: u64 },
    #[error("file URL host {host:?} is not supported (only local files)")]
    FileUrlHost { host: String },
    #[error("invalid percent-encoding in file URL")]
    InvalidPercentEncoding,
    #[error("file URL path {path:?} is not absolute")]
    RelativePath { path: PathBuf },

    // --- local files ---
    #[error("local media files are disabled (no allowed local media path is set)")]
    LocalMediaDisabled,
    #[error("cannot access {path:?}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path:?} lies outside the allowed local media folder")]
    OutsideAllowedFolder { path: PathBuf },
    #[error("{path:?} is not a regular file")]
    NotAFile { path: PathBuf },
    #[error("file {path:?} of {size} bytes exceeds the limit of {max} bytes")]
    FileTooLarge { path: PathBuf, size: u64, max: u64 },

    // --- decoding ---
    #[error("empty image data")]
    Empty,
    #[error("unknown image format (no known signature)")]
    UnknownFormat,
    #[error("unsupported image format {format} (expected PNG, JPEG or WebP)")]
    UnsupportedFormat { format: &'static str },
    #[error("image of {width}x{height} exceeds the limits (max dimension {max_dimension}, max pixels {max_pixels})")]
    ImageTooLarge {
        width: u32,
        height: u32,
        max_dimension: u32,
        max_pixels: u64,
    },
    #[error("image has zero width or height")]
    EmptyImage,
    #[error("image limits exceeded while decoding: {0}")]
    LimitsExceeded(#[source] image::ImageError),
    #[error("cannot decode the image: {0}")]
    Decode(#[source] image::ImageError),

    // --- preprocessing ---
    #[error("invalid preprocessor config: {0}")]
    InvalidConfig(#[from] serde_json::Error),
    #[error("unsupported resample filter {0} (3 = bicubic and 2 = bilinear are supported)")]
    UnsupportedResample(i64),
    #[error("invalid preprocessor config field {field}: {reason}")]
    InvalidConfigValue {
        field: &'static str,
        reason: &'static str,
    },
    #[error("decoded image buffer of {len} bytes does not match {width}x{height} RGB")]
    BadDecodedImage { width: u32, height: u32, len: usize },
}

pub type Result<T, E = MediaError> = std::result::Result<T, E>;
