//! Image inputs on a worker that runs the vision tower itself (aggregated serving, or the
//! local prefill of a `pd` worker): each image of a request is decoded, checked against the
//! content hash the router computed, preprocessed as the model's `preprocessor_config.json`
//! says, and encoded into embedding rows that the engine splices at its placeholder tokens.

use std::sync::Arc;

use tandem_engine::model::{LoadedModel, VisionEncoder};
use tandem_engine::request::{MediaEmbedding, MediaSpan};
use tandem_media::{decode_image, ClipImageProcessor, ImageHash, MediaPolicy};
use tandem_protocol::worker as pb;
use tonic::Status;

/// The most images one request may carry.
pub const MAX_IMAGES_PER_REQUEST: usize = 16;

/// A model's vision tower with its image preprocessing.
pub struct MediaEncoder {
    encoder: Arc<VisionEncoder>,
    processor: ClipImageProcessor,
    policy: MediaPolicy,
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
    pub fn for_model(model: &LoadedModel) -> anyhow::Result<Option<Self>> {
        let Some(encoder) = model.vision.clone() else {
            return Ok(None);
        };
        let path = model.path.join("preprocessor_config.json");
        let json = std::fs::read_to_string(&path)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let processor = ClipImageProcessor::from_json(&json)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(Some(MediaEncoder {
            encoder,
            processor,
            policy: MediaPolicy::default(),
        }))
    }

    /// The embeddings of `inputs`, checked against `prompt`: each span is the model's number
    /// of image tokens, all placeholders, and the image's decoded pixels hash to what the
    /// router sent. Runs on the blocking pool.
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
        let this = Arc::clone(self);
        let started = std::time::Instant::now();
        let rows = tokio::task::spawn_blocking(move || this.encode_all(&inputs))
            .await
            .map_err(|e| Status::internal(format!("the image encoder stopped: {e}")))??;
        metrics::counter!("tandem_worker_images_encoded_total").increment(spans.len() as u64);
        metrics::histogram!("tandem_worker_image_encode_seconds")
            .record(started.elapsed().as_secs_f64());
        let per = self.encoder.config.tokens_per_image() * self.encoder.config.text_hidden_size;
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
        let want = self.encoder.config.tokens_per_image();
        if len != want {
            return bad(format!(
                "span.len {len} is not the model's {want} image tokens"
            ));
        }
        let image_token = self.encoder.config.image_token_index;
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

    /// Decodes, checks and preprocesses every image, then runs the tower over all of them
    /// as one batch.
    fn encode_all(&self, inputs: &[pb::MediaInput]) -> Result<Vec<f32>, Status> {
        let mut pixels = Vec::with_capacity(inputs.len() * self.encoder.config.pixels_per_image());
        for (i, m) in inputs.iter().enumerate() {
            let bad = |what: String| Status::invalid_argument(format!("media[{i}]: {what}"));
            let image = decode_image(&m.data, &self.policy).map_err(|e| bad(e.to_string()))?;
            let hash = ImageHash::of(&image);
            let span_hash = m.span.as_ref().map(|s| s.hash);
            if hash.0.as_slice() != m.content_hash.as_slice() || span_hash != Some(hash.as_u64()) {
                return Err(bad("the image does not match its content hash".into()));
            }
            let px = self
                .processor
                .preprocess(&image)
                .map_err(|e| bad(e.to_string()))?;
            if px.data.len() != self.encoder.config.pixels_per_image() {
                return Err(bad(format!(
                    "preprocessed to {}x{}, not the tower's {}",
                    px.height, px.width, self.encoder.config.image_size
                )));
            }
            pixels.extend_from_slice(&px.data);
        }
        self.encoder
            .encode(&pixels)
            .map_err(|e| Status::internal(format!("encoding images: {e}")))
    }
}
