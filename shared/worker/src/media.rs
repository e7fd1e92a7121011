//! Image inputs of a prefill or aggregated worker: each image of a request is decoded,
//! checked against the content hash the router computed, preprocessed as the model's
//! `preprocessor_config.json` says, and encoded into embedding rows that the engine splices
//! at its placeholder tokens — by this worker's own vision tower, or (E/P/D) by an encode
//! worker that writes the rows into this worker's memory.

use std::path::Path;
use std::sync::Arc;

use tandem_engine::model::{LoadedModel, VisionConfig, VisionEncoder};
use tandem_engine::request::{MediaEmbedding, MediaSpan};
use tandem_media::{decode_image, ClipImageProcessor, ImageHash, MediaPolicy};
use tandem_protocol::worker as pb;
use tonic::Status;

use crate::encode::client::RemoteEncoder;
use crate::engine_setup::{place_vision, Device};

/// The most images one request may carry.
pub const MAX_IMAGES_PER_REQUEST: usize = 16;

/// Where a worker's image embeddings come from: its own vision tower (aggregated, EP/D), or
/// an encode worker that writes them into this worker's memory (E/P/D, `--encode-endpoint`).
pub struct MediaEncoder {
    config: VisionConfig,
    source: EmbeddingSource,
}

enum EmbeddingSource {
    Local {
        encoder: Arc<VisionEncoder>,
        prep: ImagePrep,
    },
    Remote(Arc<RemoteEncoder>),
}

/// Decoding, checking and preprocessing images for a model's vision tower, as its
/// `preprocessor_config.json` says.
pub struct ImagePrep {
    processor: ClipImageProcessor,
    policy: MediaPolicy,
    pixels_per_image: usize,
    image_size: usize,
}

impl ImagePrep {
    /// The preprocessing of the model folder `folder`, for a tower configured as `config`.
    pub fn for_folder(folder: &Path, config: &VisionConfig) -> anyhow::Result<Self> {
        let path = folder.join("preprocessor_config.json");
        let json = std::fs::read_to_string(&path)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let processor = ClipImageProcessor::from_json(&json)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(ImagePrep {
            processor,
            policy: MediaPolicy::default(),
            pixels_per_image: config.pixels_per_image(),
            image_size: config.image_size,
        })
    }

    /// Image `i`'s pixel values: decoded, checked against its content hash (and its span's
    /// hash, when it has a span), preprocessed to the tower's input size.
    pub fn prepare(&self, i: usize, m: &pb::MediaInput) -> Result<Vec<f32>, Status> {
        let bad = |what: String| Status::invalid_argument(format!("media[{i}]: {what}"));
        let image = decode_image(&m.data, &self.policy).map_err(|e| bad(e.to_string()))?;
        let hash = ImageHash::of(&image);
        let span_ok = m.span.as_ref().is_none_or(|s| s.hash == hash.as_u64());
        if hash.0.as_slice() != m.content_hash.as_slice() || !span_ok {
            return Err(bad("the image does not match its content hash".into()));
        }
        let px = self
            .processor
            .preprocess(&image)
            .map_err(|e| bad(e.to_string()))?;
        if px.data.len() != self.pixels_per_image {
            return Err(bad(format!(
                "preprocessed to {}x{}, not the tower's {}",
                px.height, px.width, self.image_size
            )));
        }
        Ok(px.data)
    }

    /// Every image's pixel values, one after the other.
    pub fn prepare_all(&self, inputs: &[pb::MediaInput]) -> Result<Vec<f32>, Status> {
        let mut pixels = Vec::with_capacity(inputs.len() * self.pixels_per_image);
        for (i, m) in inputs.iter().enumerate() {
            pixels.extend_from_slice(&self.prepare(i, m)?);
        }
        Ok(pixels)
    }
}

/// What the router needs to know to build image prompts for this worker's model.
pub fn multimodal_card(model: &LoadedModel) -> Option<tandem_protocol::MultimodalCard> {
    let v = model.config.vision.as_ref()?;
    Some(tandem_protocol::MultimodalCard {
        image_token_id: v.image_token_index,
        tokens_per_image: v.tokens_per_image() as u32,
        max_images_per_request: MAX_IMAGES_PER_REQUEST as u32,
    })
}

impl MediaEncoder {
    /// The encoder of a multimodal model loaded with weights; `None` for a text model.
    /// The tower runs on `device` (uploaded to the GPU on CUDA).
    pub fn for_model(model: &LoadedModel, device: Device) -> anyhow::Result<Option<Self>> {
        let Some(encoder) = model.vision.clone() else {
            return Ok(None);
        };
        let encoder = place_vision(encoder, device)?;
        let prep = ImagePrep::for_folder(&model.path, &encoder.config)?;
        Ok(Some(MediaEncoder {
            config: encoder.config.clone(),
            source: EmbeddingSource::Local { encoder, prep },
        }))
    }

    /// Embeddings from the encode workers `client` reaches, for a tower configured as `config`.
    pub fn remote(config: VisionConfig, client: Arc<RemoteEncoder>) -> Self {
        MediaEncoder {
            config,
            source: EmbeddingSource::Remote(client),
        }
    }

    /// Where the embeddings come from, for logs: `local` or the encode endpoint.
    pub fn source(&self) -> String {
        match &self.source {
            EmbeddingSource::Local { .. } => "local".into(),
            EmbeddingSource::Remote(c) => c.endpoint().to_string(),
        }
    }

    /// The embeddings of `inputs`, checked against `prompt`: each span is the model's number
    /// of image tokens, all placeholders, and the image's decoded pixels hash to what the
    /// router sent (checked where the image is decoded).
    pub async fn embed(
        self: &Arc<Self>,
        prompt: &[u32],
        inputs: Vec<pb::MediaInput>,
    ) -> Result<Vec<MediaEmbedding>, Status> {
        if inputs.len() > MAX_IMAGES_PER_REQUEST {
            return Err(Status::invalid_argument(format!(
                "media: {} images exceed the limit of {MAX_IMAGES_PER_REQUEST} per request",
                inputs.len()
            )));
        }
        let spans = inputs
            .iter()
            .enumerate()
            .map(|(i, m)| self.check_span(i, m, prompt))
            .collect::<Result<Vec<_>, _>>()?;
        let started = std::time::Instant::now();
        let rows = match &self.source {
            EmbeddingSource::Local { .. } => {
                let this = Arc::clone(self);
                tokio::task::spawn_blocking(move || this.encode_locally(&inputs))
                    .await
                    .map_err(|e| Status::internal(format!("the image encoder stopped: {e}")))??
            }
            EmbeddingSource::Remote(client) => client.encode(inputs).await?,
        };
        metrics::counter!("tandem_worker_images_encoded_total").increment(spans.len() as u64);
        metrics::histogram!("tandem_worker_image_encode_seconds")
            .record(started.elapsed().as_secs_f64());
        let per = self.config.tokens_per_image() * self.config.text_hidden_size;
        if rows.len() != per * spans.len() {
            return Err(Status::internal(format!(
                "the encoder returned {} values for {} images of {per}",
                rows.len(),
                spans.len()
            )));
        }
        Ok(spans
            .into_iter()
            .zip(rows.chunks_exact(per))
            .map(|(span, data)| MediaEmbedding {
                span,
                data: Arc::new(data.to_vec()),
            })
            .collect())
    }

    fn check_span(
        &self,
        i: usize,
        m: &pb::MediaInput,
        prompt: &[u32],
    ) -> Result<MediaSpan, Status> {
        let bad = |what: String| Err(Status::invalid_argument(format!("media[{i}]: {what}")));
        let Some(span) = m.span.as_ref() else {
            return bad("span is missing".into());
        };
        let (start, len) = (span.start as usize, span.len as usize);
        let want = self.config.tokens_per_image();
        if len != want {
            return bad(format!(
                "span.len {len} is not the model's {want} image tokens"
            ));
        }
        let image_token = self.config.image_token_index;
        match prompt.get(start..start.saturating_add(len)) {
            Some(ids) if ids.iter().all(|&t| t == image_token) => {}
            _ => {
                return bad(format!(
                    "prompt positions {start}..{} are not all the image token {image_token}",
                    start.saturating_add(len)
                ))
            }
        }
        if m.content_hash.len() != 32 {
            return bad("content_hash is not 32 bytes".into());
        }
        Ok(MediaSpan {
            start,
            len,
            hash: span.hash,
        })
    }

    /// Decodes, checks and preprocesses every image, then runs this worker's tower over all
    /// of them as one batch.
    fn encode_locally(&self, inputs: &[pb::MediaInput]) -> Result<Vec<f32>, Status> {
        let EmbeddingSource::Local { encoder, prep } = &self.source else {
            return Err(Status::internal(
                "this worker has no vision tower of its own",
            ));
        };
        let pixels = prep.prepare_all(inputs)?;
        encoder
            .encode(&pixels)
            .map_err(|e| Status::internal(format!("encoding images: {e}")))
    }
}
