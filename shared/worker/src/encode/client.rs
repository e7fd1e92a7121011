//! A prefill or aggregated worker's side of E/P/D (`--encode-endpoint`): for each request's
//! images it allocates a region through its own transfer layer, picks an encode worker of the
//! endpoint from discovery (round robin), and has it write the images' rows into the region
//! under a lease. A region whose call failed or was cancelled is released only once the
//! encode worker answered `FenceEncode` or is gone, so a late write never lands in reused
//! memory.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_config::endpoint::EndpointAddr;
use tandem_kv_transfer::{AnyRegistration, AnyTransport, KvTransport, Registration};
use tandem_pki::ChannelSecurity;
use tandem_protocol::worker::encoder_client::EncoderClient;
use tandem_protocol::worker::{EncodeRequest, FenceLeaseRequest, MediaInput};
use tandem_runtime::discovery::Discovery;
use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::leases::{listener_gone, random_u64};
use crate::wire::EngineIntoWire;

/// Gauge of embedding regions by state (`live`: a call in flight; `quarantined`: waiting for
/// the encode worker's fence).
pub const REGIONS_GAUGE: &str = "tandem_worker_embedding_regions";
/// Counter of embedding bytes encode workers wrote into this worker.
pub const BYTES_RECEIVED: &str = "tandem_worker_embedding_bytes_received_total";

/// Oldest discovery snapshot of the encode workers used.
const SNAPSHOT_AGE: Duration = Duration::from_secs(2);
/// Bound on one discovery look-up and on one fence call.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(5);
/// Between two fence attempts of a quarantined region.
const FENCE_RETRY: Duration = Duration::from_secs(1);

/// What a [`RemoteEncoder`] needs.
pub struct RemoteEncoderConfig {
    pub endpoint: EndpointAddr,
    pub store: Arc<dyn Discovery>,
    pub security: ChannelSecurity,
    pub transport: Arc<AnyTransport>,
    /// This worker's instance id (owner of the leases).
    pub instance_id: u64,
    /// The model's identity; the encode worker must serve the same model.
    pub model_id: String,
    /// Bytes of one image's rows.
    pub row_bytes: usize,
    /// Bound on one `Encode` call.
    pub timeout: Duration,
}

pub struct RemoteEncoder {
    cfg: RemoteEncoderConfig,
    next: AtomicUsize,
    clients: Mutex<HashMap<String, EncoderClient<Channel>>>,
    snapshot: tokio::sync::Mutex<(Option<Instant>, Vec<String>)>,
    regions: Arc<RegionCounts>,
}

/// Live and quarantined regions, published as [`REGIONS_GAUGE`].
#[derive(Default)]
struct RegionCounts {
    live: AtomicUsize,
    quarantined: AtomicUsize,
}

impl RegionCounts {
    fn publish(&self) {
        let live = self.live.load(Ordering::SeqCst) as f64;
        let q = self.quarantined.load(Ordering::SeqCst) as f64;
        metrics::gauge!(REGIONS_GAUGE, "state" => "live").set(live);
        metrics::gauge!(REGIONS_GAUGE, "state" => "quarantined").set(q);
    }
}

/// A region lent to an encode worker under a lease. Dropped without [`LeasedRegion::take`]
/// (the call failed or was cancelled), it is fenced in the background and released after.
struct LeasedRegion {
    registration: Option<AnyRegistration>,
    ptr: *mut u8,
    len: usize,
    fence: Option<PendingFence>,
    counts: Arc<RegionCounts>,
}

// SAFETY: the pointer is the registration's memory, owned by this value; it is read only
// after the writer finished (the Encode reply), from one task at a time.
unsafe impl Send for LeasedRegion {}

/// What fencing a region's lease needs.
struct PendingFence {
    client: EncoderClient<Channel>,
    addr: String,
    request: FenceLeaseRequest,
}

impl LeasedRegion {
    /// The region's bytes, once its writer finished; releases the region.
    fn take(mut self) -> Vec<u8> {
        // SAFETY: `ptr..ptr+len` is the registration's memory, alive until it is dropped
        // below, and the encode worker's writes completed before its reply.
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr, self.len) }.to_vec();
        self.fence = None;
        self.registration = None;
        bytes
    }
}

impl Drop for LeasedRegion {
    fn drop(&mut self) {
        self.counts.live.fetch_sub(1, Ordering::SeqCst);
        let (Some(registration), Some(fence)) = (self.registration.take(), self.fence.take())
        else {
            self.counts.publish();
            return;
        };
        self.counts.quarantined.fetch_add(1, Ordering::SeqCst);
        self.counts.publish();
        let counts = self.counts.clone();
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            // No runtime (process exit): the memory goes with the process.
            std::mem::forget(registration);
            return;
        };
        rt.spawn(async move {
            fence_then_release(fence).await;
            drop(registration);
            counts.quarantined.fetch_sub(1, Ordering::SeqCst);
            counts.publish();
        });
    }
}

/// Returns once the encode worker answered the fence or no longer listens.
async fn fence_then_release(mut f: PendingFence) {
    loop {
        let call = f.client.fence_encode(f.request);
        match tokio::time::timeout(CONTROL_TIMEOUT, call).await {
            Ok(Ok(_)) => return,
            _ if listener_gone(&f.addr).await => return,
            _ => {
                tracing::warn!(
                    encode_worker = %f.addr,
                    lease_id = f.request.lease_id,
                    "the encode worker did not answer the fence; its region stays quarantined"
                );
                tokio::time::sleep(FENCE_RETRY).await;
            }
        }
    }
}

impl RemoteEncoder {
    pub fn new(cfg: RemoteEncoderConfig) -> Self {
        RemoteEncoder {
            cfg,
            next: AtomicUsize::new(0),
            clients: Mutex::new(HashMap::new()),
            snapshot: tokio::sync::Mutex::new((None, Vec::new())),
            regions: Arc::default(),
        }
    }

    pub fn endpoint(&self) -> &EndpointAddr {
        &self.cfg.endpoint
    }

    /// The rows of `inputs`, one image after the other, written by an encode worker.
    pub async fn encode(&self, inputs: Vec<MediaInput>) -> Result<Vec<f32>, Status> {
        let addr = self.pick().await?;
        let mut client = self.client(&addr)?;
        let n = inputs.len();
        let mut region = self.lease_region(n * self.cfg.row_bytes).await?;
        let rng = |e: crate::leases::LeaseRngError| Status::internal(e.to_string());
        let lease_id = random_u64().map_err(rng)?;
        let epoch = random_u64().map_err(rng)?;
        let descriptor = region
            .registration
            .as_ref()
            .map(|r| r.descriptor().clone())
            .ok_or_else(|| Status::internal("the embedding region is gone"))?;
        region.fence = Some(PendingFence {
            client: client.clone(),
            addr: addr.clone(),
            request: FenceLeaseRequest {
                owner_instance_id: self.cfg.instance_id,
                lease_id,
                epoch,
            },
        });
        let request = EncodeRequest {
            images: inputs,
            region: Some(descriptor.into_wire()),
            stride: self.cfg.row_bytes as u64,
            owner_instance_id: self.cfg.instance_id,
            lease_id,
            epoch,
            model_id: self.cfg.model_id.clone(),
        };
        let reply = match tokio::time::timeout(self.cfg.timeout, client.encode(request)).await {
            Ok(Ok(r)) => r.into_inner(),
            // The region is fenced and released in the background (LeasedRegion's drop).
            Ok(Err(status)) => return Err(encode_failed(&addr, status)),
            Err(_) => {
                return Err(Status::unavailable(format!(
                    "encode worker {addr} did not answer within {:?}",
                    self.cfg.timeout
                )))
            }
        };
        if reply.bytes_written != (n * self.cfg.row_bytes) as u64 {
            return Err(Status::internal(format!(
                "encode worker {addr} wrote {} bytes, not {}",
                reply.bytes_written,
                n * self.cfg.row_bytes
            )));
        }
        let bytes = region.take();
        metrics::counter!(BYTES_RECEIVED).increment(bytes.len() as u64);
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// `len` bytes registered with the transport, counted as a live region.
    async fn lease_region(&self, len: usize) -> Result<LeasedRegion, Status> {
        let (registration, ptr) = self.cfg.transport.allocate(len).await.map_err(|e| {
            Status::resource_exhausted(format!("cannot allocate an embedding region: {e}"))
        })?;
        self.regions.live.fetch_add(1, Ordering::SeqCst);
        self.regions.publish();
        Ok(LeasedRegion {
            registration: Some(registration),
            ptr,
            len,
            fence: None,
            counts: self.regions.clone(),
        })
    }

    /// The next encode worker of the endpoint, round robin over discovery's list.
    async fn pick(&self) -> Result<String, Status> {
        let mut snap = self.snapshot.lock().await;
        if snap.0.is_none_or(|t| t.elapsed() > SNAPSHOT_AGE) || snap.1.is_empty() {
            snap.1 = self.list().await?;
            snap.0 = Some(Instant::now());
        }
        if snap.1.is_empty() {
            return Err(Status::unavailable(format!(
                "no encode worker is registered at {}",
                self.cfg.endpoint
            )));
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % snap.1.len();
        Ok(snap.1[i].clone())
    }

    async fn list(&self) -> Result<Vec<String>, Status> {
        let e = &self.cfg.endpoint;
        let listed = tokio::time::timeout(
            CONTROL_TIMEOUT,
            self.cfg.store.list(&e.namespace, Some(&e.component)),
        )
        .await
        .map_err(|_| Status::unavailable("discovery did not answer"))?
        .map_err(|err| Status::unavailable(format!("cannot list encode workers: {err}")))?;
        let mut addrs: Vec<String> = listed
            .into_iter()
            .filter(|x| x.instance.role == "encode" && x.instance.endpoint == e.endpoint)
            .map(|x| x.instance.grpc_addr)
            .collect();
        addrs.sort();
        Ok(addrs)
    }

    fn client(&self, addr: &str) -> Result<EncoderClient<Channel>, Status> {
        let mut m = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = m.get(addr) {
            return Ok(c.clone());
        }
        let channel = self
            .cfg
            .security
            .endpoint(addr)
            .map_err(|e| Status::internal(format!("bad encode worker address {addr}: {e}")))?
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(3))
            .connect_lazy();
        let c = EncoderClient::new(channel)
            .max_decoding_message_size(tandem_protocol::MAX_GRPC_MESSAGE_BYTES)
            .max_encoding_message_size(tandem_protocol::MAX_GRPC_MESSAGE_BYTES);
        m.insert(addr.to_owned(), c.clone());
        Ok(c)
    }
}

/// An encode worker's refusal as this worker's: a bad image stays the caller's fault (400 at
/// the router), anything else is the encode tier being unavailable.
fn encode_failed(addr: &str, status: Status) -> Status {
    let message = format!("encode worker {addr}: {}", status.message());
    match status.code() {
        Code::InvalidArgument => Status::invalid_argument(message),
        Code::FailedPrecondition => Status::failed_precondition(message),
        _ => Status::unavailable(message),
    }
}
