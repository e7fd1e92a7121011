//! Batches images across encode requests: calls queue their preprocessed images, and one task
//! runs the vision tower over everything queued (up to a batch limit) at once on the blocking
//! pool, while the next calls queue behind it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tandem_engine::model::VisionEncoder;
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

/// Gauge of images waiting for the tower.
pub const QUEUE_GAUGE: &str = "tandem_encode_queue_images";
/// Histogram of images per tower run.
pub const BATCH_HISTOGRAM: &str = "tandem_encode_batch_images";
/// Histogram of seconds per tower run.
pub const RUN_SECONDS: &str = "tandem_encode_run_seconds";

/// Calls queued at most (each waits for room beyond this).
const QUEUE_CALLS: usize = 1024;

struct Job {
    /// `images` images' pixel values, one after the other.
    pixels: Vec<f32>,
    images: usize,
    reply: oneshot::Sender<Result<Vec<f32>, String>>,
}

#[derive(Clone)]
pub struct Batcher {
    tx: mpsc::Sender<Job>,
    queued: Arc<AtomicUsize>,
}

impl Batcher {
    /// Starts the batching task over `encoder`; a run takes at most `max_images` images
    /// (a single call with more runs alone).
    pub fn start(encoder: Arc<VisionEncoder>, max_images: usize) -> Self {
        let (tx, rx) = mpsc::channel(QUEUE_CALLS);
        let queued = Arc::new(AtomicUsize::new(0));
        tokio::spawn(run(encoder, rx, max_images.max(1), queued.clone()));
        Batcher { tx, queued }
    }

    /// The embedding rows of `images` images whose pixel values are `pixels`.
    pub async fn encode(&self, pixels: Vec<f32>, images: usize) -> Result<Vec<f32>, Status> {
        let (reply, rx) = oneshot::channel();
        let n = self.queued.fetch_add(images, Ordering::SeqCst) + images;
        metrics::gauge!(QUEUE_GAUGE).set(n as f64);
        let job = Job {
            pixels,
            images,
            reply,
        };
        if self.tx.send(job).await.is_err() {
            return Err(Status::unavailable("the image encoder has stopped"));
        }
        match rx.await {
            Ok(Ok(rows)) => Ok(rows),
            Ok(Err(e)) => Err(Status::internal(format!("encoding images: {e}"))),
            Err(_) => Err(Status::unavailable("the image encoder stopped mid-batch")),
        }
    }
}

async fn run(
    encoder: Arc<VisionEncoder>,
    mut rx: mpsc::Receiver<Job>,
    max_images: usize,
    queued: Arc<AtomicUsize>,
) {
    while let Some(first) = rx.recv().await {
        let mut images = first.images;
        let mut jobs = vec![first];
        while images < max_images {
            match rx.try_recv() {
                Ok(j) => {
                    images += j.images;
                    jobs.push(j);
                }
                Err(_) => break,
            }
        }
        let left = queued.fetch_sub(images, Ordering::SeqCst) - images;
        metrics::gauge!(QUEUE_GAUGE).set(left as f64);
        run_batch(&encoder, jobs, images).await;
    }
}

/// One tower run over every job's images; each job gets its own rows back.
async fn run_batch(encoder: &Arc<VisionEncoder>, jobs: Vec<Job>, images: usize) {
    let (pixels, replies): (Vec<Vec<f32>>, Vec<(usize, oneshot::Sender<_>)>) = jobs
        .into_iter()
        .map(|j| (j.pixels, (j.images, j.reply)))
        .unzip();
    let enc = encoder.clone();
    let started = std::time::Instant::now();
    let result = tokio::task::spawn_blocking(move || enc.encode(&pixels.concat()))
        .await
        .map_err(|e| format!("the encoder task failed: {e}"))
        .and_then(|r| r.map_err(|e| e.to_string()));
    metrics::histogram!(BATCH_HISTOGRAM).record(images as f64);
    metrics::histogram!(RUN_SECONDS).record(started.elapsed().as_secs_f64());
    let per_image = encoder.config.tokens_per_image() * encoder.config.text_hidden_size;
    match result {
        Ok(rows) => {
            let mut at = 0;
            for (n, reply) in replies {
                let end = (at + n * per_image).min(rows.len());
                let _ = reply.send(Ok(rows[at..end].to_vec()));
                at = end;
            }
        }
        Err(e) => {
            for (_, reply) in replies {
                let _ = reply.send(Err(e.clone()));
            }
        }
    }
}
