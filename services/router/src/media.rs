//! Image inputs of chat requests: the `image_url` content parts are read (`data:` URLs,
//! `file:` URLs inside `--allowed-local-media-path`, and http(s) URLs through
//! [`crate::media_fetch`]), decoded and hashed off the async threads,
//! and, once the prompt is tokenized, each image's one placeholder token from the chat
//! template becomes the model's number of image tokens, whose span and content hash go to
//! the worker and into the block hashes the router routes on.

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use serde_json::Value;
use tandem_config::MediaLimits;
use tandem_kv_protocol::{CacheSalt, HashContext, MediaSpan};
use tandem_media::{
    decode_image, load_local_file, ImageHash, ImageSource, MediaError, MediaPolicy,
};
use tandem_protocol::MultimodalCard;

use crate::error::ApiError;
use crate::media_fetch::{FetchError, Fetcher};

/// One image of a request: its encoded bytes (sent on to the worker) and content hash.
#[derive(Clone, Debug)]
pub struct ImageInput {
    /// Where the client put it (`messages[0].content[1]`), for errors.
    pub param: String,
    pub data: Arc<Vec<u8>>,
    pub hash: ImageHash,
}

/// An image placed in the prompt: its input and the span of its image tokens.
#[derive(Clone, Debug)]
pub struct PlacedImage {
    pub input: ImageInput,
    pub span: MediaSpan,
}

/// The limits of `--allowed-local-media-path` and `--max-file-size-mb`.
pub fn policy(limits: &MediaLimits) -> MediaPolicy {
    MediaPolicy {
        allowed_local_media_path: limits.allowed_local_media_path.clone(),
        max_file_size_bytes: u64::from(limits.max_file_size_mb) * 1024 * 1024,
        ..MediaPolicy::default()
    }
}

/// The `image_url` parts of `messages`, in prompt order, as `(param, url)`.
pub fn image_urls(messages: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let Some(list) = messages.as_array() else {
        return out;
    };
    for (i, msg) in list.iter().enumerate() {
        let Some(parts) = msg.get("content").and_then(Value::as_array) else {
            continue;
        };
        for (j, part) in parts.iter().enumerate() {
            if part.get("type").and_then(Value::as_str) != Some("image_url") {
                continue;
            }
            let url = part
                .get("image_url")
                .and_then(|u| u.get("url").or(Some(u)))
                .and_then(Value::as_str)
                .unwrap_or_default();
            out.push((format!("messages[{i}].content[{j}]"), url.to_owned()));
        }
    }
    out
}

/// The status of a media error: 413 for what is too large, else 400.
fn status_of(e: &MediaError) -> StatusCode {
    match e {
        MediaError::DataTooLarge { .. }
        | MediaError::FileTooLarge { .. }
        | MediaError::ImageTooLarge { .. }
        | MediaError::LimitsExceeded(_) => StatusCode::PAYLOAD_TOO_LARGE,
        _ => StatusCode::BAD_REQUEST,
    }
}

fn media_error(param: &str, e: &MediaError) -> ApiError {
    let status = status_of(e);
    let kind = match status {
        StatusCode::PAYLOAD_TOO_LARGE => "payload_too_large",
        _ => "invalid_request_error",
    };
    ApiError::new(status, kind, format!("`{param}.image_url`: {e}")).with_param(Some(param))
}

/// The fetcher of http(s) image URLs under `limits`.
pub fn fetcher(limits: &MediaLimits) -> anyhow::Result<Fetcher> {
    Ok(Fetcher::new(
        limits.allow_internal,
        Duration::from_secs(limits.fetch_timeout_secs.max(1).into()),
        u64::from(limits.max_file_size_mb) * 1024 * 1024,
    )?)
}

/// Reads every image: http(s) URLs fetched on the async runtime (all at once), then every
/// image read (`file:`), decoded and hashed on the blocking pool (never on the async
/// threads).
pub async fn load(
    urls: Vec<(String, String)>,
    policy: MediaPolicy,
    fetcher: &Fetcher,
) -> Result<Vec<ImageInput>, ApiError> {
    let sources = urls
        .into_iter()
        .map(|(param, url)| {
            let source = ImageSource::parse(&url, &policy).map_err(|e| media_error(&param, &e))?;
            Ok((param, source))
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let fetched =
        futures_util::future::try_join_all(sources.into_iter().map(|(param, source)| async move {
            let source = match source {
                ImageSource::Http(url) => match fetcher.fetch(&url).await {
                    Ok(bytes) => Fetched::Bytes(bytes),
                    Err(e) => return Err(fetch_error(&param, &e)),
                },
                other => Fetched::Source(other),
            };
            Ok((param, source))
        }))
        .await?;
    let handle = tokio::task::spawn_blocking(move || {
        fetched
            .into_iter()
            .map(|(param, source)| load_one(param, source, &policy))
            .collect::<Result<Vec<_>, _>>()
    });
    handle
        .await
        .map_err(|e| ApiError::internal(format!("reading the images failed: {e}")))?
}

/// An image's bytes as fetched, or its source to read.
enum Fetched {
    Bytes(Vec<u8>),
    Source(ImageSource),
}

fn fetch_error(param: &str, e: &FetchError) -> ApiError {
    let status = match e {
        FetchError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
        _ => StatusCode::BAD_REQUEST,
    };
    let kind = match status {
        StatusCode::PAYLOAD_TOO_LARGE => "payload_too_large",
        _ => "invalid_request_error",
    };
    ApiError::new(status, kind, format!("`{param}.image_url`: {e}")).with_param(Some(param))
}

fn load_one(param: String, source: Fetched, policy: &MediaPolicy) -> Result<ImageInput, ApiError> {
    let fail = |e: MediaError| media_error(&param, &e);
    let data = match source {
        Fetched::Bytes(bytes) => bytes,
        Fetched::Source(ImageSource::Data { bytes, .. }) => bytes,
        Fetched::Source(ImageSource::File(path)) => load_local_file(&path, policy).map_err(fail)?,
        Fetched::Source(ImageSource::Http(_)) => {
            return Err(ApiError::internal(format!(
                "`{param}.image_url`: an http(s) image was not fetched"
            )))
        }
    };
    let image = decode_image(&data, policy).map_err(fail)?;
    Ok(ImageInput {
        hash: image.hash(),
        param,
        data: Arc::new(data),
    })
}

/// Expands each image token of `prompt` (one per image, where the chat template placed it)
/// into `tokens_per_image` of them and places the images' spans; the template must have
/// placed exactly one image token per image.
pub fn place(
    prompt: Vec<u32>,
    images: Vec<ImageInput>,
    mm: &MultimodalCard,
) -> Result<(Vec<u32>, Vec<PlacedImage>), ApiError> {
    let placeholders = prompt.iter().filter(|&&t| t == mm.image_token_id).count();
    if placeholders != images.len() {
        return Err(ApiError::bad_request(
            format!(
                "the prompt holds {placeholders} image tokens for {} images: the chat template \
                 must place each image once (and the text must not contain the image token)",
                images.len()
            ),
            Some("messages"),
        ));
    }
    let per = mm.tokens_per_image as usize;
    let mut out = Vec::with_capacity(prompt.len() + images.len() * per);
    let mut images = images.into_iter();
    let mut placed = Vec::new();
    for t in prompt {
        if t != mm.image_token_id {
            out.push(t);
            continue;
        }
        // Counted above: one image per placeholder.
        let Some(input) = images.next() else { break };
        placed.push(PlacedImage {
            span: MediaSpan {
                start: out.len(),
                len: per,
                hash: input.hash.as_u64(),
            },
            input,
        });
        out.resize(out.len() + per, mm.image_token_id);
    }
    Ok((out, placed))
}

/// The hash context of a prompt: its salt and its images' spans.
pub fn hash_context(salt: Option<CacheSalt>, images: &[PlacedImage]) -> HashContext {
    // Spans from `place` are in order and disjoint.
    HashContext::new(salt, images.iter().map(|i| i.span).collect())
        .unwrap_or_else(|_| HashContext::salted(salt))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(n: u8) -> ImageInput {
        ImageInput {
            param: format!("p{n}"),
            data: Arc::new(vec![n]),
            hash: ImageHash([n; 32]),
        }
    }

    const MM: MultimodalCard = MultimodalCard {
        image_token_id: 9,
        tokens_per_image: 3,
        max_images_per_request: 4,
    };

    #[test]
    fn each_placeholder_becomes_the_images_tokens() {
        let (prompt, placed) = place(vec![1, 9, 2, 9], vec![input(1), input(2)], &MM).unwrap();
        assert_eq!(prompt, vec![1, 9, 9, 9, 2, 9, 9, 9]);
        assert_eq!((placed[0].span.start, placed[0].span.len), (1, 3));
        assert_eq!(placed[1].span.start, 5);
        assert_eq!(placed[1].span.hash, ImageHash([2; 32]).as_u64());
    }

    #[test]
    fn a_placeholder_count_other_than_the_images_is_refused() {
        assert!(place(vec![1, 9, 9], vec![input(1)], &MM).is_err());
        assert!(place(vec![1, 2], vec![input(1)], &MM).is_err());
    }

    #[test]
    fn image_urls_are_found_in_order_with_their_place() {
        let m = serde_json::json!([
            {"role": "user", "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "data:x"}},
            ]},
            {"role": "user", "content": "plain"},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:/y"}}]},
        ]);
        assert_eq!(
            image_urls(&m),
            vec![
                ("messages[0].content[1]".to_string(), "data:x".to_string()),
                ("messages[2].content[0]".to_string(), "file:/y".to_string()),
            ]
        );
    }
}
