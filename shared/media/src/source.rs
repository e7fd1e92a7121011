use std::path::PathBuf;

use base64::Engine as _;

use crate::{MediaError, MediaPolicy, Result};

/// The media types accepted in a `data:` URL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ImageMediaType {
    Png,
    Jpeg,
    Webp,
}

impl ImageMediaType {
    /// Parses a media type (case-insensitive; `image/jpg` is accepted for JPEG).
    pub fn parse(media_type: &str) -> Option<Self> {
        match media_type.trim().to_ascii_lowercase().as_str() {
            "image/png" => Some(Self::Png),
            "image/jpeg" | "image/jpg" => Some(Self::Jpeg),
            "image/webp" => Some(Self::Webp),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Png => "image/png",
            Self::Jpeg => "image/jpeg",
            Self::Webp => "image/webp",
        }
    }
}

/// Where an image comes from: an OpenAI `image_url.url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageSource {
    /// `data:image/...;base64,...`, already decoded from base64 (the bytes are still an
    /// encoded image; the media type is what the URL claims, [`crate::decode_image`] sniffs).
    Data {
        media_type: ImageMediaType,
        bytes: Vec<u8>,
    },
    /// `file:///abs/path` or `file:/abs/path` (percent-decoded). Load with
    /// [`crate::load_local_file`], which enforces the allowed folder.
    File(PathBuf),
    /// `http://` or `https://`: fetching is up to the caller.
    Http(String),
}

impl ImageSource {
    /// Parses an `image_url.url`. Data URLs are decoded here, within
    /// `policy.max_file_size_bytes` (the base64 length is checked before decoding).
    pub fn parse(url: &str, policy: &MediaPolicy) -> Result<Self> {
        let url = url.trim();
        let Some((scheme, rest)) = url.split_once(':') else {
            return Err(MediaError::MissingScheme);
        };
        if scheme.is_empty() {
            return Err(MediaError::MissingScheme);
        }
        match scheme.to_ascii_lowercase().as_str() {
            "data" => parse_data(rest, policy.max_file_size_bytes),
            "file" => parse_file(rest).map(Self::File),
            "http" | "https" => Ok(Self::Http(url.to_string())),
            _ => Err(MediaError::UnsupportedScheme {
                scheme: scheme.to_string(),
            }),
        }
    }
}

fn parse_data(rest: &str, max_bytes: u64) -> Result<ImageSource> {
    let (header, payload) = rest.split_once(',').ok_or(MediaError::MalformedDataUrl)?;
    let mut parts = header.split(';');
    let media_type_str = parts.next().unwrap_or_default().trim();
    let is_base64 = parts.any(|p| p.trim().eq_ignore_ascii_case("base64"));
    let media_type =
        ImageMediaType::parse(media_type_str).ok_or_else(|| MediaError::UnsupportedMediaType {
            media_type: media_type_str.to_string(),
        })?;
    if !is_base64 {
        return Err(MediaError::DataUrlNotBase64 {
            media_type: media_type_str.to_string(),
        });
    }
    let payload = payload.trim();
    // At least this many bytes decode from it (padding removes at most 2 per 4 chars).
    let min_decoded = (payload.len() as u64 / 4 * 3).saturating_sub(2);
    if min_decoded > max_bytes {
        return Err(MediaError::DataTooLarge {
            size: min_decoded,
            max: max_bytes,
        });
    }
    let bytes = base64::engine::general_purpose::STANDARD.decode(payload)?;
    if bytes.len() as u64 > max_bytes {
        return Err(MediaError::DataTooLarge {
            size: bytes.len() as u64,
            max: max_bytes,
        });
    }
    Ok(ImageSource::Data { media_type, bytes })
}

/// `file:///abs`, `file://localhost/abs`, `file:/abs` → `/abs` (percent-decoded).
fn parse_file(rest: &str) -> Result<PathBuf> {
    let path = if let Some(after) = rest.strip_prefix("//") {
        let (host, path) = match after.find('/') {
            Some(i) => after.split_at(i),
            None => (after, ""),
        };
        if !(host.is_empty() || host.eq_ignore_ascii_case("localhost")) {
            return Err(MediaError::FileUrlHost {
                host: host.to_string(),
            });
        }
        path
    } else {
        rest
    };
    // Query and fragment are not part of the path.
    let path = path.split(['?', '#']).next().unwrap_or_default();
    let decoded = PathBuf::from(percent_decode(path)?);
    if !decoded.is_absolute() {
        return Err(MediaError::RelativePath { path: decoded });
    }
    Ok(decoded)
}

fn percent_decode(s: &str) -> Result<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .ok_or(MediaError::InvalidPercentEncoding)?;
            let hex = std::str::from_utf8(hex).map_err(|_| MediaError::InvalidPercentEncoding)?;
            let b = u8::from_str_radix(hex, 16).map_err(|_| MediaError::InvalidPercentEncoding)?;
            out.push(b);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| MediaError::InvalidPercentEncoding)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> MediaPolicy {
        MediaPolicy::default()
    }

    #[test]
    fn data_urls() {
        let url = "data:image/png;base64,iVBORw0K";
        match ImageSource::parse(url, &policy()).unwrap() {
            ImageSource::Data { media_type, bytes } => {
                assert_eq!(media_type, ImageMediaType::Png);
                assert_eq!(bytes, b"\x89PNG\r\n");
            }
            other => panic!("{other:?}"),
        }
        for (mt, want) in [
            ("image/jpeg", ImageMediaType::Jpeg),
            ("IMAGE/JPG", ImageMediaType::Jpeg),
            ("image/webp", ImageMediaType::Webp),
        ] {
            let url = format!("data:{mt};base64,AAAA");
            assert!(matches!(
                ImageSource::parse(&url, &policy()).unwrap(),
                ImageSource::Data { media_type, .. } if media_type == want
            ));
        }
    }

    #[test]
    fn bad_base64() {
        let err = ImageSource::parse("data:image/png;base64,!!!notbase64", &policy()).unwrap_err();
        assert!(matches!(err, MediaError::InvalidBase64(_)), "{err}");
    }

    #[test]
    fn wrong_media_type() {
        let err = ImageSource::parse("data:image/gif;base64,AAAA", &policy()).unwrap_err();
        match err {
            MediaError::UnsupportedMediaType { media_type } => assert_eq!(media_type, "image/gif"),
            other => panic!("{other}"),
        }
        let err = ImageSource::parse("data:text/plain;base64,AAAA", &policy()).unwrap_err();
        assert!(err.to_string().contains("text/plain"), "{err}");
    }

    #[test]
    fn not_base64() {
        let err = ImageSource::parse("data:image/png,rawbytes", &policy()).unwrap_err();
        assert!(matches!(err, MediaError::DataUrlNotBase64 { .. }), "{err}");
    }

    #[test]
    fn malformed_and_schemes() {
        assert!(matches!(
            ImageSource::parse("data:image/png;base64", &policy()),
            Err(MediaError::MalformedDataUrl)
        ));
        assert!(matches!(
            ImageSource::parse("ftp://x/y.png", &policy()),
            Err(MediaError::UnsupportedScheme { .. })
        ));
        assert!(matches!(
            ImageSource::parse("no-scheme", &policy()),
            Err(MediaError::MissingScheme)
        ));
        assert!(matches!(
            ImageSource::parse("", &policy()),
            Err(MediaError::MissingScheme)
        ));
    }

    #[test]
    fn data_too_large_before_decoding() {
        let p = MediaPolicy {
            max_file_size_bytes: 10,
            ..MediaPolicy::default()
        };
        // 40 chars → at least 28 bytes: refused without decoding (the payload is not even base64).
        let url = format!("data:image/png;base64,{}", "!".repeat(40));
        assert!(matches!(
            ImageSource::parse(&url, &p),
            Err(MediaError::DataTooLarge { max: 10, .. })
        ));
        // 16 chars → 12 bytes: decoded, then refused on the exact size.
        let url = format!("data:image/png;base64,{}", "A".repeat(16));
        assert!(matches!(
            ImageSource::parse(&url, &p),
            Err(MediaError::DataTooLarge { size: 12, max: 10 })
        ));
    }

    #[test]
    fn file_and_http_urls() {
        for url in [
            "file:///a/b%20c.png",
            "file:/a/b%20c.png",
            "file://localhost/a/b%20c.png",
        ] {
            assert_eq!(
                ImageSource::parse(url, &policy()).unwrap(),
                ImageSource::File(PathBuf::from("/a/b c.png")),
                "{url}"
            );
        }
        assert!(matches!(
            ImageSource::parse("file://evil.com/a.png", &policy()),
            Err(MediaError::FileUrlHost { .. })
        ));
        assert!(matches!(
            ImageSource::parse("file:a.png", &policy()),
            Err(MediaError::RelativePath { .. })
        ));
        assert!(matches!(
            ImageSource::parse("file:///a%zz", &policy()),
            Err(MediaError::InvalidPercentEncoding)
        ));
        assert!(matches!(
            ImageSource::parse("file:///a%2", &policy()),
            Err(MediaError::InvalidPercentEncoding)
        ));
        assert_eq!(
            ImageSource::parse("https://example.com/x.png", &policy()).unwrap(),
            ImageSource::Http("https://example.com/x.png".into())
        );
        assert!(matches!(
            ImageSource::parse("HTTP://example.com/x.png", &policy()).unwrap(),
            ImageSource::Http(_)
        ));
    }
}
