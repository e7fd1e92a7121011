//! The encode worker (`tandem-encode`, `--disaggregation-mode encode`): runs a multimodal
//! model's vision tower and projector for prefill and aggregated workers (E/P/D).
//!
//! A caller registers a region with its transfer layer and sends the images with the
//! region's descriptor under a lease; this worker takes each image's rows from its
//! embedding cache or encodes it (batched with other calls' images), writes the rows into the
//! region through the transport (UCX or TCP), and answers once the writes are complete at the
//! receiver. The write runs as a lease write ([`LeaseWrites`]): a caller that gave up fences
//! the lease before it frees the region.

pub mod batcher;
pub mod cache;
pub mod client;
pub mod serve;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tandem_engine::model::VisionEncoder;
use tandem_kv_transfer::{AnyTransport, Bytes, KvConnection, Put, RemoteRegion};
use tandem_protocol::worker::encoder_server::Encoder;
use tandem_protocol::worker::{
    EncodeReply, EncodeRequest, FenceLeaseReply, FenceLeaseRequest, HealthReply, HealthRequest,
    MediaInput,
};
use tandem_protocol::WireError;
use tonic::{Request as GrpcRequest, Response, Status};

use crate::lease_writes::{Cancel, LeaseWrites};
use crate::media::{ImagePrep, MAX_IMAGES_PER_REQUEST};
use crate::transport::Connections;
use crate::wire::engine_sub;
use batcher::Batcher;
use cache::EmbeddingCache;

/// Counter of images served, by `cache` = `hit` / `miss`.
pub const IMAGES_TOTAL: &str = "tandem_encode_images_total";
/// Counter of embedding bytes written into callers' regions.
pub const BYTES_WRITTEN: &str = "tandem_encode_bytes_written_total";

/// What an encode worker runs: the tower, its preprocessing, the cache and the batcher.
pub struct EncodeParts {
    pub encoder: Arc<VisionEncoder>,
    pub prep: ImagePrep,
    pub model_id: String,
    pub cache: EmbeddingCache,
    /// Images per tower run at most.
    pub max_batch_images: usize,
}

pub struct EncodeService {
    encoder: Arc<VisionEncoder>,
    prep: Arc<ImagePrep>,
    model_id: String,
    cache: EmbeddingCache,
    batcher: Batcher,
    transport: Arc<AnyTransport>,
    connections: Connections,
    writes: Arc<LeaseWrites>,
    accepting: Arc<AtomicBool>,
}

/// A checked `Encode` call: its images and where their rows go.
struct EncodeJob {
    images: Vec<MediaInput>,
    region: RemoteRegion,
    stride: u64,
}

impl EncodeService {
    /// Starts the batcher (needs a Tokio runtime).
    pub fn new(parts: EncodeParts, transport: Arc<AnyTransport>) -> Arc<Self> {
        let batcher = Batcher::start(parts.encoder.clone(), parts.max_batch_images);
        Arc::new(EncodeService {
            encoder: parts.encoder,
            prep: Arc::new(parts.prep),
            model_id: parts.model_id,
            cache: parts.cache,
            batcher,
            transport,
            connections: Connections::default(),
            writes: Arc::default(),
            accepting: Arc::new(AtomicBool::new(true)),
        })
    }

    /// Bytes of one image's rows (f32).
    fn row_bytes(&self) -> u64 {
        let c = &self.encoder.config;
        (c.tokens_per_image() * c.text_hidden_size * std::mem::size_of::<f32>()) as u64
    }

    /// A flag that, once cleared, makes `Encode` refuse new calls (drain on SIGTERM).
    pub fn accepting_flag(&self) -> Arc<AtomicBool> {
        self.accepting.clone()
    }

    /// Leases being written now.
    pub fn active(&self) -> usize {
        self.writes.active()
    }

    pub async fn encode(self: &Arc<Self>, req: EncodeRequest) -> Result<EncodeReply, Status> {
        if !self.accepting.load(Ordering::SeqCst) {
            return Err(Status::unavailable("encode worker is draining"));
        }
        let key = (req.owner_instance_id, req.lease_id);
        let epoch = req.epoch;
        let job = self.check(req)?;
        let me = self.clone();
        self.writes
            .run(key, epoch, "encode", move |cancel| async move {
                me.serve(job, &cancel).await
            })
            .await
    }

    pub async fn fence(&self, req: FenceLeaseRequest) -> FenceLeaseReply {
        let key = (req.owner_instance_id, req.lease_id);
        FenceLeaseReply {
            was_active: self.writes.fence(key, req.epoch).await,
        }
    }

    /// Refuses a malformed call before anything is decoded or written: no images or too
    /// many, another model, a bad region, or rows that would not fit in it.
    fn check(&self, req: EncodeRequest) -> Result<EncodeJob, Status> {
        let n = req.images.len();
        if n == 0 || n > MAX_IMAGES_PER_REQUEST {
            return Err(Status::invalid_argument(format!(
                "images: {n} images (1 to {MAX_IMAGES_PER_REQUEST} per call)"
            )));
        }
        if req.model_id != self.model_id {
            return Err(Status::failed_precondition(format!(
                "this encode worker serves model {}, not {}",
                self.model_id, req.model_id
            )));
        }
        for (i, m) in req.images.iter().enumerate() {
            if m.content_hash.len() != 32 {
                return Err(Status::invalid_argument(format!(
                    "images[{i}].content_hash is not 32 bytes"
                )));
            }
        }
        let region: RemoteRegion = engine_sub::<_, RemoteRegion>(req.region, "region")
            .map_err(|e: WireError| Status::from(e))?;
        region
            .validate()
            .map_err(|e| Status::invalid_argument(format!("region: {e}")))?;
        let row = self.row_bytes();
        if req.stride < row {
            return Err(Status::invalid_argument(format!(
                "stride {} is less than an image's {row} bytes of rows",
                req.stride
            )));
        }
        for i in 0..n as u64 {
            let at = i.checked_mul(req.stride).ok_or_else(|| {
                Status::invalid_argument(format!("stride {} overflows", req.stride))
            })?;
            region
                .check_bounds(at, row)
                .map_err(|e| Status::invalid_argument(format!("region: {e}")))?;
        }
        Ok(EncodeJob {
            images: req.images,
            region,
            stride: req.stride,
        })
    }

    /// Every image's rows (cached or encoded), then one write batch into the region.
    async fn serve(&self, job: EncodeJob, cancel: &Cancel) -> Result<EncodeReply, Status> {
        let (rows, cache_hits) = self.embeddings(&job.images).await?;
        if cancel.is_set() {
            return Err(Status::aborted("the lease was fenced"));
        }
        let puts: Vec<Put> = rows
            .iter()
            .enumerate()
            .map(|(i, r)| Put {
                local: Bytes::from(f32_bytes(r)),
                offset: i as u64 * job.stride,
            })
            .collect();
        let bytes: u64 = puts.iter().map(|p| p.local.len() as u64).sum();
        let conn = (self.connections)
            .get(&self.transport, &job.region.peer)
            .await
            .map_err(|e| {
                Status::aborted(format!("cannot connect to the caller's transport: {e}"))
            })?;
        crate::failpoints::encode_hold().await;
        if let Err(e) = conn.write(&job.region, puts).await {
            self.connections.forget(&job.region.peer).await;
            return Err(Status::aborted(format!(
                "writing embeddings to the caller failed: {e}"
            )));
        }
        metrics::counter!(BYTES_WRITTEN).increment(bytes);
        let c = &self.encoder.config;
        Ok(EncodeReply {
            cache_hits,
            bytes_written: bytes,
            tokens_per_image: c.tokens_per_image() as u32,
            hidden_size: c.text_hidden_size as u32,
        })
    }

    /// Each image's rows: from the cache, or decoded, checked, preprocessed and encoded (the
    /// misses of this call as one job of the batcher), then cached.
    async fn embeddings(
        &self,
        images: &[MediaInput],
    ) -> Result<(Vec<Arc<Vec<f32>>>, Vec<bool>), Status> {
        let mut rows: Vec<Option<Arc<Vec<f32>>>> = images
            .iter()
            .map(|m| self.cache.get(&hash_key(&m.content_hash)))
            .collect();
        let hits: Vec<bool> = rows.iter().map(Option::is_some).collect();
        let misses: Vec<usize> = (0..images.len()).filter(|&i| !hits[i]).collect();
        for hit in [true, false] {
            let n = hits.iter().filter(|&&h| h == hit).count() as u64;
            let label = if hit { "hit" } else { "miss" };
            metrics::counter!(IMAGES_TOTAL, "cache" => label).increment(n);
        }
        if !misses.is_empty() {
            let todo: Vec<(usize, MediaInput)> =
                misses.iter().map(|&i| (i, images[i].clone())).collect();
            let prep = self.prep.clone();
            let pixels = tokio::task::spawn_blocking(move || {
                let mut px = Vec::new();
                for (i, m) in &todo {
                    px.extend(prep.prepare(*i, m)?);
                }
                Ok::<_, Status>(px)
            })
            .await
            .map_err(|e| Status::internal(format!("image preprocessing stopped: {e}")))??;
            let out = self.batcher.encode(pixels, misses.len()).await?;
            let per = (self.row_bytes() / 4) as usize;
            for (&i, chunk) in misses.iter().zip(out.chunks_exact(per)) {
                let r = Arc::new(chunk.to_vec());
                self.cache
                    .insert(hash_key(&images[i].content_hash), r.clone());
                rows[i] = Some(r);
            }
        }
        let rows = rows
            .into_iter()
            .enumerate()
            .map(|(i, r)| r.ok_or_else(|| Status::internal(format!("image {i} was not encoded"))))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((rows, hits))
    }
}

/// The cache key of a content hash (checked to be 32 bytes before).
fn hash_key(h: &[u8]) -> [u8; 32] {
    let mut k = [0u8; 32];
    let n = h.len().min(32);
    k[..n].copy_from_slice(&h[..n]);
    k
}

/// Rows as little-endian bytes.
pub fn f32_bytes(rows: &[f32]) -> Vec<u8> {
    rows.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The gRPC face of an [`EncodeService`].
pub struct EncoderGrpc(pub Arc<EncodeService>);

#[tonic::async_trait]
impl Encoder for EncoderGrpc {
    async fn encode(
        &self,
        request: GrpcRequest<EncodeRequest>,
    ) -> Result<Response<EncodeReply>, Status> {
        Ok(Response::new(self.0.encode(request.into_inner()).await?))
    }

    async fn fence_encode(
        &self,
        request: GrpcRequest<FenceLeaseRequest>,
    ) -> Result<Response<FenceLeaseReply>, Status> {
        Ok(Response::new(self.0.fence(request.into_inner()).await))
    }

    async fn health(
        &self,
        _request: GrpcRequest<HealthRequest>,
    ) -> Result<Response<HealthReply>, Status> {
        let accepting = self.0.accepting.load(Ordering::SeqCst);
        Ok(Response::new(HealthReply {
            healthy: accepting,
            status: if accepting { "ready" } else { "draining" }.into(),
        }))
    }
}
