//! The gRPC `Worker` service over a running engine.

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

use tandem_engine::engine::{EngineHandle, RequestStream};

use crate::decode::DecodeSide;
use crate::media::MediaEncoder;
use crate::prefill::PrefillSide;
use crate::status::engine_status;
use crate::wire::{EngineIntoWire, EngineTryFromWire, IntoWire};
use tandem_engine::kv::events::KvCacheEvent;
use tandem_engine::request::{Request, RequestOutput};
use tandem_protocol::worker::worker_server::Worker;
use tandem_protocol::worker::{
    AbortReply, AbortRequest, DumpKvBlocksRequest, FenceLeaseReply, FenceLeaseRequest,
    GenerateDisaggRequest, GenerateOutput, GenerateRequest, HealthReply, HealthRequest, KvDump,
    KvEvent, LoadStatsReply, LoadStatsRequest, ModelFiles, ModelFilesRequest, PrefillProgress,
    PrefillRequest, SubscribeKvEventsRequest,
};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request as GrpcRequest, Response, Status};

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// Files a router needs to tokenize for this worker's model.
#[derive(Clone, Debug)]
pub struct ModelFilesSource {
    /// The model folder, or a GGUF file.
    pub folder: PathBuf,
    pub tokenizer_hash: String,
    /// `--custom-jinja-template`'s source: sent as the `chat_template` of
    /// tokenizer_config.json in place of the model's own.
    pub chat_template: Option<String>,
}

/// tokenizer_config.json (or an empty one) with `chat_template` set to `source`.
fn with_chat_template(config_json: &str, source: &str) -> Result<String, Status> {
    let mut cfg: serde_json::Value = match config_json.trim() {
        "" => serde_json::json!({}),
        text => serde_json::from_str(text)
            .map_err(|e| Status::internal(format!("tokenizer_config.json: {e}")))?,
    };
    let obj = cfg
        .as_object_mut()
        .ok_or_else(|| Status::internal("tokenizer_config.json is not a JSON object"))?;
    obj.insert("chat_template".into(), source.into());
    Ok(cfg.to_string())
}

pub struct WorkerService {
    engine: EngineHandle,
    files: ModelFilesSource,
    /// False once the worker is draining: new requests are refused.
    accepting: Arc<std::sync::atomic::AtomicBool>,
    /// Set on decode workers in `pd` / `decode` mode.
    decode: Option<Arc<DecodeSide>>,
    /// Set on prefill workers.
    prefill: Option<Arc<PrefillSide>>,
    /// Set when the model takes images (its vision tower runs here).
    media: Option<Arc<MediaEncoder>>,
}

impl WorkerService {
    pub fn new(engine: EngineHandle, files: ModelFilesSource) -> Self {
        WorkerService {
            engine,
            files,
            accepting: Arc::new(true.into()),
            decode: None,
            prefill: None,
            media: None,
        }
    }

    pub fn with_media(mut self, media: Option<Arc<MediaEncoder>>) -> Self {
        self.media = media;
        self
    }

    pub fn with_decode(mut self, decode: Option<Arc<DecodeSide>>) -> Self {
        self.decode = decode;
        self
    }

    pub fn with_prefill(mut self, prefill: Option<Arc<PrefillSide>>) -> Self {
        self.prefill = prefill;
        self
    }

    fn check_accepting(&self) -> Result<(), Status> {
        if !self.accepting.load(std::sync::atomic::Ordering::SeqCst) {
            Err(Status::unavailable("worker is draining"))
        } else if !self.engine.is_running() {
            Err(Status::unavailable("the worker's engine has stopped"))
        } else {
            Ok(())
        }
    }

    /// A flag that, once cleared, makes `Generate` refuse new requests (drain on SIGTERM).
    pub fn accepting_flag(&self) -> Arc<std::sync::atomic::AtomicBool> {
        self.accepting.clone()
    }
}

/// Forwards a broadcast of live events to a gRPC stream, ending it with an error when the
/// subscriber fell behind (it must then resubscribe from its last id, or take a dump).
fn forward_events(
    backlog: Vec<KvCacheEvent>,
    mut live: broadcast::Receiver<KvCacheEvent>,
    after: u64,
) -> BoxStream<KvEvent> {
    let (tx, rx) = mpsc::channel(256);
    tokio::spawn(async move {
        let mut last = after;
        for e in backlog {
            last = e.event_id;
            if tx.send(Ok(e.into_wire())).await.is_err() {
                return;
            }
        }
        loop {
            match live.recv().await {
                Ok(e) if e.event_id <= last => continue,
                Ok(e) if crate::failpoints::skipped_kv_event(e.event_id) => continue,
                Ok(e) => {
                    last = e.event_id;
                    if tx.send(Ok(e.into_wire())).await.is_err() {
                        return;
                    }
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    let _ = tx
                        .send(Err(Status::data_loss(format!(
                            "subscriber lagged by {n} events after event {last}; resubscribe"
                        ))))
                        .await;
                    return;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            }
        }
    });
    Box::pin(ReceiverStream::new(rx))
}

/// Messages a Generate stream holds for a caller that reads slower than tokens come: fewer
/// than the engine makes in a burst, so that the rest wait in the engine's stream and go out
/// merged ([`forward`]).
pub(crate) const STREAM_BUFFER: usize = 4;

/// Forwards a local engine stream to a gRPC caller; a caller gone aborts the request at once
/// instead of at the next token. Outputs of a choice that are ready together go out as one
/// message (a caller that fell behind catches up with fewer, larger messages).
pub(crate) async fn forward(
    mut stream: RequestStream,
    tx: &mpsc::Sender<Result<GenerateOutput, Status>>,
    engine: &EngineHandle,
) {
    let rid = stream.request_id().to_owned();
    let mut held: Option<RequestOutput> = None;
    loop {
        let next = match held.take() {
            Some(out) => Some(out),
            None => tokio::select! {
                out = stream.next() => out,
                _ = tx.closed() => break,
            },
        };
        match next {
            Some(mut out) => {
                while let Some(more) = stream.try_next() {
                    if let Err(other) = out.absorb(more) {
                        held = Some(*other);
                        break;
                    }
                }
                if tx.send(Ok(out.into_wire())).await.is_err() {
                    break;
                }
            }
            None if stream.was_cut() => {
                // The engine thread died with the request in flight.
                let _ = tx
                    .send(Err(Status::unavailable(
                        "the engine stopped before the request finished",
                    )))
                    .await;
                return;
            }
            None => return,
        }
    }
    tracing::info!(request_id = %rid, "client went away; aborting");
    engine.abort(&rid);
}

#[tonic::async_trait]
impl Worker for WorkerService {
    type GenerateStream = BoxStream<GenerateOutput>;
    type SubscribeKvEventsStream = BoxStream<KvEvent>;
    type GenerateDisaggStream = BoxStream<GenerateOutput>;
    type PrefillStream = BoxStream<PrefillProgress>;

    async fn generate_disagg(
        &self,
        request: GrpcRequest<GenerateDisaggRequest>,
    ) -> Result<Response<Self::GenerateDisaggStream>, Status> {
        let decode = self.decode.as_ref().ok_or_else(|| {
            Status::unimplemented(
                "this worker does not serve disaggregated requests (start it with \
                 --disaggregation-mode pd or decode)",
            )
        })?;
        self.check_accepting()?;
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        decode.start(request.into_inner(), tx).await?;
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn prefill(
        &self,
        request: GrpcRequest<PrefillRequest>,
    ) -> Result<Response<Self::PrefillStream>, Status> {
        let prefill = self.prefill.as_ref().ok_or_else(|| {
            Status::unimplemented(
                "this worker is not a prefill worker (tandem-prefill, --disaggregation-mode prefill)",
            )
        })?;
        // Refused before anything is written, so the decode worker may release at once.
        if !self.accepting.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Status::failed_precondition("prefill worker is draining"));
        }
        let rx = prefill.start(request.into_inner()).await?;
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn fence_lease(
        &self,
        request: GrpcRequest<FenceLeaseRequest>,
    ) -> Result<Response<FenceLeaseReply>, Status> {
        let prefill = self.prefill.as_ref().ok_or_else(|| {
            Status::unimplemented("this worker is not a prefill worker; it writes no leases")
        })?;
        Ok(Response::new(prefill.fence(request.into_inner()).await))
    }

    async fn generate(
        &self,
        request: GrpcRequest<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        self.check_accepting()?;
        let mut wire = request.into_inner();
        let media = std::mem::take(&mut wire.media);
        let mut req = Request::try_from_wire(wire)?;
        if req.request_id.is_empty() {
            return Err(Status::invalid_argument("request_id is empty"));
        }
        req.params.validate().map_err(Status::invalid_argument)?;
        if !media.is_empty() {
            let encoder = self.media.as_ref().ok_or_else(|| {
                Status::invalid_argument("media: this worker's model does not take images")
            })?;
            req.media = encoder.embed(&req.prompt, media).await?;
        }
        let stream = self.engine.submit(req).await.map_err(engine_status)?;
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let engine = self.engine.clone();
        tokio::spawn(async move { forward(stream, &tx, &engine).await });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn abort(
        &self,
        request: GrpcRequest<AbortRequest>,
    ) -> Result<Response<AbortReply>, Status> {
        self.engine.abort(&request.into_inner().request_id);
        Ok(Response::new(AbortReply { found: true }))
    }

    async fn subscribe_kv_events(
        &self,
        request: GrpcRequest<SubscribeKvEventsRequest>,
    ) -> Result<Response<Self::SubscribeKvEventsStream>, Status> {
        match request.into_inner().from_event_id {
            None => {
                let live = self.engine.subscribe_events();
                Ok(Response::new(forward_events(vec![], live, 0)))
            }
            Some(from) => match self.engine.subscribe_events_from(from) {
                Ok((backlog, live)) => Ok(Response::new(forward_events(
                    backlog,
                    live,
                    from.saturating_sub(1),
                ))),
                Err(gap) => Err(Status::failed_precondition(format!(
                    "event {} is no longer buffered (oldest {}); take a dump",
                    gap.requested, gap.oldest
                ))),
            },
        }
    }

    async fn dump_kv_blocks(
        &self,
        _request: GrpcRequest<DumpKvBlocksRequest>,
    ) -> Result<Response<KvDump>, Status> {
        let (dump, _live) = self.engine.dump_stored_blocks();
        Ok(Response::new(dump.into_wire()))
    }

    async fn health(
        &self,
        _request: GrpcRequest<HealthRequest>,
    ) -> Result<Response<HealthReply>, Status> {
        let accepting = self.accepting.load(std::sync::atomic::Ordering::SeqCst);
        // Not through the command queue: a full queue is load, not ill health.
        let healthy = accepting && self.engine.is_running();
        let status = if !accepting {
            "draining"
        } else if healthy {
            "ready"
        } else {
            "engine stopped"
        };
        Ok(Response::new(HealthReply {
            healthy,
            status: status.into(),
        }))
    }

    async fn load_stats(
        &self,
        _request: GrpcRequest<LoadStatsRequest>,
    ) -> Result<Response<LoadStatsReply>, Status> {
        let s = self.engine.stats().await.map_err(engine_status)?;
        Ok(Response::new(LoadStatsReply {
            running: s.running as u32,
            waiting: s.waiting as u32,
            total_blocks: s.blocks.total as u32,
            referenced_blocks: s.blocks.referenced as u32,
            cached_blocks: s.blocks.cached as u32,
            free_blocks: s.blocks.free as u32,
            last_event_id: s.last_event_id,
            preemptions: s.preemptions,
            prompt_tokens_computed: s.prompt_tokens_computed,
            kv_bytes_received: self
                .decode
                .as_ref()
                .map(|d| d.bytes_received.load(std::sync::atomic::Ordering::Relaxed))
                .unwrap_or(0),
            leases_live: self
                .decode
                .as_ref()
                .map(|d| d.leases.counts().0)
                .unwrap_or(0) as u32,
            leases_quarantined: self
                .decode
                .as_ref()
                .map(|d| d.leases.counts().1)
                .unwrap_or(0) as u32,
            kv_bytes_sent: self
                .prefill
                .as_ref()
                .map(|p| p.bytes_sent.load(std::sync::atomic::Ordering::Relaxed))
                .unwrap_or(0),
        }))
    }

    async fn get_model_files(
        &self,
        _request: GrpcRequest<ModelFilesRequest>,
    ) -> Result<Response<ModelFiles>, Status> {
        // A GGUF model has no tokenizer files: serve those derived from its metadata (written
        // once into the cache; the tokenizer hash matches the loaded model's).
        let folder = if tandem_engine::model::gguf::is_gguf(&self.files.folder) {
            tandem_engine::model::gguf::write_model_files(&self.files.folder)
                .map_err(|e| Status::internal(format!("GGUF tokenizer files: {e}")))?
        } else {
            self.files.folder.clone()
        };
        let read = |name: &str, required: bool| -> Result<String, Status> {
            match std::fs::read_to_string(folder.join(name)) {
                Ok(text) => Ok(text),
                Err(_) if !required => Ok(String::new()),
                Err(e) => Err(Status::internal(format!("{name}: {e}"))),
            }
        };
        let mut tokenizer_config_json = read("tokenizer_config.json", false)?;
        if let Some(source) = &self.files.chat_template {
            tokenizer_config_json = with_chat_template(&tokenizer_config_json, source)?;
        }
        Ok(Response::new(ModelFiles {
            tokenizer_json: read("tokenizer.json", true)?,
            tokenizer_config_json,
            generation_config_json: read("generation_config.json", false)?,
            tokenizer_hash: self.files.tokenizer_hash.clone(),
        }))
    }
}
