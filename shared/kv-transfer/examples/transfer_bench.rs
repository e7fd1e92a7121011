//! KV transfer throughput between two processes, with the block layout of a Qwen3-0.6B-shaped
//! model: 28 layers, 8 KV heads, head dim 128, block size 32, bf16.
//!
//! - one layer of one block (K and V) = 2 × 32 × 8 × 128 × 2 B = 131,072 B
//! - one block = 28 × 131,072 B = 3,670,016 B (layout: block-major, layer inside)
//!
//! The receiver's pool holds `2 × --blocks` blocks; the `--blocks` source blocks (default 64)
//! go to distinct destination blocks picked by a fixed pseudo-random permutation, so
//! destinations are scattered, as decode block ids are. Patterns, each timed per iteration
//! over all `--blocks` blocks (every figure includes the batches' completion and one
//! notification at the end, as the serving path answers once per prompt):
//! - `serving B`: what the serving path does after each prefill chunk: one batch of `B`
//!   whole-block puts (3.67 MB each) to scattered destinations, waited for before the next;
//!   for each `B` of `--batch` (default `64,16`);
//! - `per-layer`: after each layer, one batch of `--blocks` puts of 131 KB (that layer of
//!   every block) — 28 batches (a finer-grained alternative);
//! - `hot`: `--blocks` puts of 3.67 MB, every one from the same source block to the same
//!   destination block — the access pattern of `ucx_perftest` (cache-hot), which isolates the
//!   transport's own overhead from memory bandwidth.
//!
//! It also prints a local copy of the same volume with 1 thread and with `--lanes` threads
//! (the machine's memory-bandwidth ceiling for distinct, cache-cold memory).
//!
//! With `--pool cuda` (built with the `cuda-bench` feature, run with a CUDA-enabled UCX) the
//! source blocks and the receiver's pool are GPU memory (of devices `--cuda-device` and
//! `--receiver-cuda-device`, 0 unless given) and every batch goes GPU
//! to GPU (`write_device`), as the serving path of CUDA workers does.
//!
//! Usage: `transfer_bench [--backend UCX|TCP] [--blocks N] [--iters N] [--pool alloc|heap|cuda]
//! [--lanes N] [--batch B,B,..] [--ucx NAME=VALUE]... [--cuda-device N]
//! [--receiver-cuda-device N]`. The program starts itself again as the
//! receiver (`--receiver`), reads its descriptor from the child's stdout, and checks the
//! received blocks by hash at the end. Prints MiB/s (2^20 bytes, the unit of `ucx_perftest`).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tandem_kv_transfer::{
    default_ucx_lanes, open, AnyConnection, Backend, Bytes, DeviceBatch, DevicePut, Event,
    KvConnection, KvTransport, LocalMemory, Put, Registration, RemoteRegion, TransportConfig,
};

const LAYERS: usize = 28;
const LAYER_BYTES: usize = 2 * 32 * 8 * 128 * 2;
const BLOCK_BYTES: usize = LAYERS * LAYER_BYTES;

fn fnv(h: &mut u64, data: &[u8]) {
    for &b in data {
        *h ^= b as u64;
        *h = h.wrapping_mul(0x100_0000_01b3);
    }
}

const FNV_START: u64 = 0xcbf2_9ce4_8422_2325;

struct Args {
    backend: Backend,
    blocks: usize,
    iters: usize,
    receiver: bool,
    /// Receiver pool: `alloc` = `KvTransport::allocate` (UCX-allocated, shared memory),
    /// `heap` = our own heap buffer registered with `register`.
    pool: String,
    lanes: usize,
    batches: Vec<usize>,
    ucx: Vec<(String, String)>,
    /// `--pool cuda`: the GPU of the sender's blocks, and of the receiver's pool.
    cuda_device: usize,
    receiver_cuda_device: usize,
}

/// This process's GPU (`--cuda-device`), read when its context is first made.
static CUDA_DEVICE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn args() -> Args {
    let mut a = Args {
        backend: Backend::Ucx,
        blocks: 64,
        iters: 5,
        receiver: false,
        pool: "alloc".into(),
        lanes: default_ucx_lanes(),
        batches: vec![64, 16],
        ucx: Vec::new(),
        cuda_device: 0,
        receiver_cuda_device: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{x} needs a value"));
        match x.as_str() {
            "--backend" => a.backend = val().parse().expect("backend"),
            "--blocks" => a.blocks = val().parse().expect("blocks"),
            "--iters" => a.iters = val().parse().expect("iters"),
            "--receiver" => a.receiver = true,
            "--pool" => a.pool = val(),
            "--lanes" => a.lanes = val().parse().expect("lanes"),
            "--cuda-device" => a.cuda_device = val().parse().expect("cuda device"),
            "--receiver-cuda-device" => {
                a.receiver_cuda_device = val().parse().expect("receiver cuda device")
            }
            "--batch" => {
                a.batches = val()
                    .split(',')
                    .map(|b| b.trim().parse().expect("batch"))
                    .collect()
            }
            "--ucx" => {
                let v = val();
                let (k, v) = v.split_once('=').expect("--ucx NAME=VALUE");
                a.ucx.push((k.to_string(), v.to_string()));
            }
            other => panic!("unknown argument {other}"),
        }
    }
    CUDA_DEVICE.store(a.cuda_device, std::sync::atomic::Ordering::Relaxed);
    a
}

fn config(a: &Args) -> TransportConfig {
    let mut c = TransportConfig::new(a.backend);
    c.op_timeout = Duration::from_secs(60);
    c.ucx_lanes = a.lanes;
    c.ucx_config = a.ucx.clone();
    c
}

async fn receiver(a: Args) {
    let t = open(config(&a)).await.expect("open transport");
    let mut events = t.take_notifications().expect("notifications");
    let len = 2 * a.blocks * BLOCK_BYTES;
    let mut gpu = None;
    let (reg, pool) = if a.pool == "cuda" {
        let (buf, ptr) = gpu::alloc(len);
        // SAFETY: the device buffer lives (in `gpu`) until exit; read only after "hash".
        let reg = t
            .register(unsafe { LocalMemory::cuda(ptr as *mut u8, len, a.cuda_device as u32) })
            .await
            .expect("register GPU memory");
        gpu = Some(buf);
        (reg, std::ptr::null_mut())
    } else if a.pool == "heap" {
        let pool = Box::into_raw(vec![0u8; len].into_boxed_slice()) as *mut u8;
        // SAFETY: the pool is leaked (lives until exit) and only read after "hash" arrives,
        // when the sender has no write in flight.
        (
            t.register(unsafe { LocalMemory::host(pool, len) })
                .await
                .expect("register"),
            pool,
        )
    } else {
        t.allocate(len).await.expect("allocate")
    };
    println!(
        "DESC {}",
        serde_json::to_string(reg.descriptor()).expect("json")
    );
    std::io::stdout().flush().ok();
    while let Some(ev) = events.recv().await {
        if let Event::Notification(n) = ev {
            if let Some(ids) = n.strip_prefix(b"hash ") {
                // The destination block ids, in source order: hash those blocks.
                let ids: Vec<usize> = std::str::from_utf8(ids)
                    .expect("ids")
                    .split(',')
                    .map(|s| s.parse().expect("id"))
                    .collect();
                let mut h = FNV_START;
                let host = gpu.as_ref().map(gpu::to_host);
                for id in ids {
                    let block = match &host {
                        Some(h) => &h[id * BLOCK_BYTES..(id + 1) * BLOCK_BYTES],
                        // SAFETY: see above.
                        None => unsafe {
                            std::slice::from_raw_parts(pool.add(id * BLOCK_BYTES), BLOCK_BYTES)
                        },
                    };
                    fnv(&mut h, block);
                }
                println!("HASH {h:016x}");
                std::io::stdout().flush().ok();
            } else if n == b"quit" {
                break;
            }
        }
    }
}

fn mib_s(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / (1024.0 * 1024.0)
}

/// Copies `src` into `dst` with `threads` threads (contiguous shares), timed.
fn parallel_copy(dst: &mut [u8], src: &[u8], threads: usize) -> Duration {
    let share = src.len().div_ceil(threads.max(1));
    let s = Instant::now();
    std::thread::scope(|sc| {
        for (d, s) in dst.chunks_mut(share).zip(src.chunks(share)) {
            sc.spawn(move || d.copy_from_slice(s));
        }
    });
    s.elapsed()
}

/// Best and mean of `iters` timed runs.
struct Timing {
    best: Duration,
    sum: Duration,
    n: u32,
}

impl Timing {
    fn new() -> Self {
        Timing {
            best: Duration::MAX,
            sum: Duration::ZERO,
            n: 0,
        }
    }

    fn add(&mut self, d: Duration) {
        self.best = self.best.min(d);
        self.sum += d;
        self.n += 1;
    }

    fn line(&self, bytes: usize) -> String {
        format!(
            "best {:.1} MiB/s, mean {:.1} MiB/s",
            mib_s(bytes, self.best),
            mib_s(bytes, self.sum / self.n.max(1))
        )
    }
}

async fn sender(a: Args) {
    let mut child = Command::new(std::env::current_exe().expect("exe"))
        .args([
            "--receiver",
            "--backend",
            a.backend.as_str(),
            "--blocks",
            &a.blocks.to_string(),
            "--pool",
            &a.pool,
            "--cuda-device",
            &a.receiver_cuda_device.to_string(),
        ])
        .args(
            a.ucx
                .iter()
                .flat_map(|(k, v)| ["--ucx".to_string(), format!("{k}={v}")]),
        )
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn receiver");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let desc: RemoteRegion = loop {
        let l = lines.next().expect("receiver exited").expect("read");
        if let Some(j) = l.strip_prefix("DESC ") {
            break serde_json::from_str(j).expect("descriptor");
        }
    };
    let t = open(config(&a)).await.expect("open transport");
    let conn = t.connect(&desc.peer).await.expect("connect");

    // Source KV: random-ish bytes, one Bytes for the whole pool; puts are zero-copy slices.
    let len = a.blocks * BLOCK_BYTES;
    let mut src = vec![0u8; len];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for c in src.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
    let mut expect = FNV_START;
    fnv(&mut expect, &src);
    let device_src = (a.pool == "cuda").then(|| gpu::upload(&src));
    // As a CUDA worker registers its own KV pool with its transport (its puts then name the
    // registration's handle), the sender registers its source blocks.
    let _source_registration = match &device_src {
        // SAFETY: the upload stays allocated until the end of this function, after the
        // registration (declared later, dropped first).
        Some((_, ptr)) => Some(
            t.register(unsafe {
                tandem_kv_transfer::LocalMemory::cuda(*ptr as *mut u8, len, a.cuda_device as u32)
            })
            .await
            .expect("register the source blocks"),
        ),
        None => None,
    };
    let src = Bytes::from(src);
    let source = Source {
        host: src.clone(),
        device: device_src.as_ref().map(|(_, ptr)| *ptr),
    };

    // Destination block of source block b: a fixed permutation of the pool's 2 × blocks ids
    // (Fisher-Yates with a fixed seed), first `blocks` of it: distinct and scattered.
    let mut ids: Vec<usize> = (0..2 * a.blocks).collect();
    let mut r = 0x2545_f491_4f6c_dd1du64;
    for i in (1..ids.len()).rev() {
        r ^= r << 13;
        r ^= r >> 7;
        r ^= r << 17;
        ids.swap(i, (r % (i as u64 + 1)) as usize);
    }
    let dst: Vec<usize> = ids[..a.blocks].to_vec();

    // Puts as (source offset, length, destination offset).
    let block_put = |b: usize| (b * BLOCK_BYTES, BLOCK_BYTES, dst[b] * BLOCK_BYTES);
    let per_layer = |k: usize| -> Vec<(usize, usize, usize)> {
        (0..a.blocks)
            .map(|b| {
                let off = b * BLOCK_BYTES + k * LAYER_BYTES;
                (off, LAYER_BYTES, dst[b] * BLOCK_BYTES + k * LAYER_BYTES)
            })
            .collect()
    };
    // As ucx_perftest: the same source bytes to the same destination, `blocks` times.
    let hot = || -> Vec<(usize, usize, usize)> { (0..a.blocks).map(|_| block_put(0)).collect() };

    // Warm-up (connection establishment, rkey unpack, page faults on both sides).
    source
        .write(&conn, &desc, (0..a.blocks).map(block_put).collect())
        .await
        .expect("warm-up");

    let mut hot_t = Timing::new();
    for _ in 0..a.iters {
        let s = Instant::now();
        source.write(&conn, &desc, hot()).await.expect("hot write");
        conn.notify(Bytes::from_static(b"blocks done"))
            .await
            .expect("notify");
        hot_t.add(s.elapsed());
    }

    // References: a local copy of the same amount of distinct memory, 1 and `lanes` threads.
    let mut scratch = vec![0u8; len];
    parallel_copy(&mut scratch, &src, 1);
    let copy1 = parallel_copy(&mut scratch, &src, 1);
    let copy_n = parallel_copy(&mut scratch, &src, a.lanes);
    std::hint::black_box(&scratch);
    drop(scratch);

    let mut layer_t = Timing::new();
    let mut serving_t: Vec<Timing> = a.batches.iter().map(|_| Timing::new()).collect();
    for _ in 0..a.iters {
        let s = Instant::now();
        for k in 0..LAYERS {
            source
                .write(&conn, &desc, per_layer(k))
                .await
                .expect("per-layer write");
        }
        conn.notify(Bytes::from_static(b"layers done"))
            .await
            .expect("notify");
        layer_t.add(s.elapsed());

        for (i, &batch) in a.batches.iter().enumerate() {
            let s = Instant::now();
            let mut b = 0;
            while b < a.blocks {
                let end = (b + batch.max(1)).min(a.blocks);
                source
                    .write(&conn, &desc, (b..end).map(block_put).collect())
                    .await
                    .expect("serving write");
                b = end;
            }
            // One message per prompt, as serving's answer to the decode worker.
            conn.notify(Bytes::from_static(b"blocks done"))
                .await
                .expect("notify");
            serving_t[i].add(s.elapsed());
        }
    }
    let ids = dst
        .iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(",");
    conn.notify(Bytes::from(format!("hash {ids}")))
        .await
        .expect("notify");
    let got = loop {
        let l = lines.next().expect("receiver exited").expect("read");
        if let Some(h) = l.strip_prefix("HASH ") {
            break h.to_string();
        }
    };
    let ok = got == format!("{expect:016x}");
    conn.notify(Bytes::from_static(b"quit")).await.ok();
    let _ = child.wait();

    println!(
        "backend={} pool={} lanes={} blocks={} iters={} bytes_per_iter={} ({} MiB) data_check={}",
        a.backend,
        a.pool,
        if a.backend == Backend::Ucx {
            a.lanes.max(1)
        } else {
            1
        },
        a.blocks,
        a.iters,
        len,
        len >> 20,
        if ok { "ok" } else { "MISMATCH" }
    );
    for (i, &batch) in a.batches.iter().enumerate() {
        println!(
            "serving {batch} (batches of {batch} whole-block puts of {BLOCK_BYTES} B to scattered blocks, one notify): {}",
            serving_t[i].line(len)
        );
    }
    println!(
        "per-layer (28 batches x {} puts of {LAYER_BYTES} B, one notify): {}",
        a.blocks,
        layer_t.line(len)
    );
    println!(
        "hot ({} puts of {BLOCK_BYTES} B, same source and destination, as ucx_perftest): {}",
        a.blocks,
        hot_t.line(len)
    );
    println!(
        "local copy of {} MiB: 1 thread {:.1} MiB/s, {} threads {:.1} MiB/s",
        len >> 20,
        mib_s(len, copy1),
        a.lanes.max(1),
        mib_s(len, copy_n)
    );
    if !ok {
        std::process::exit(1);
    }
}

/// The sender's blocks: host bytes, and with `--pool cuda` the same bytes in GPU memory.
struct Source {
    host: Bytes,
    device: Option<u64>,
}

impl Source {
    /// One batch of (source offset, length, destination offset) puts: host or GPU memory.
    async fn write(
        &self,
        conn: &AnyConnection,
        desc: &RemoteRegion,
        puts: Vec<(usize, usize, usize)>,
    ) -> tandem_kv_transfer::Result<()> {
        match self.device {
            Some(base) => {
                let puts = puts
                    .into_iter()
                    .map(|(s, len, d)| DevicePut {
                        src: base + s as u64,
                        len: len as u64,
                        offset: d as u64,
                    })
                    .collect();
                // SAFETY: the device source lives until the end of `sender`, after every
                // write has completed, and nothing writes it meanwhile.
                let device = CUDA_DEVICE.load(std::sync::atomic::Ordering::Relaxed) as u32;
                let batch = unsafe { DeviceBatch::new(device, puts, Box::new(())) };
                conn.write_device(desc, batch).await
            }
            None => {
                let puts = puts
                    .into_iter()
                    .map(|(s, len, d)| Put {
                        local: self.host.slice(s..s + len),
                        offset: d as u64,
                    })
                    .collect();
                conn.write(desc, puts).await
            }
        }
    }
}

/// GPU memory for `--pool cuda`, through cudarc (the `cuda-bench` feature): `cuMemAlloc`
/// allocations, which CUDA IPC can export (stream-ordered pool memory cannot), as the
/// engine's KV pool is. Never freed: the benchmark's processes end with them.
#[cfg(feature = "cuda-bench")]
mod gpu {
    use cudarc::driver::{result, CudaContext};

    pub struct Buf {
        ptr: u64,
        len: usize,
    }

    /// The device's context, held for the whole run (dropping the last handle would release
    /// the primary context and every allocation with it).
    fn context() -> &'static std::sync::Arc<CudaContext> {
        static CTX: std::sync::OnceLock<std::sync::Arc<CudaContext>> = std::sync::OnceLock::new();
        let device = super::CUDA_DEVICE.load(std::sync::atomic::Ordering::Relaxed);
        CTX.get_or_init(|| CudaContext::new(device).expect("the CUDA device (--cuda-device)"))
    }

    fn malloc(len: usize) -> u64 {
        context().bind_to_thread().expect("bind the context");
        // SAFETY: a fresh allocation, written before use.
        unsafe { result::malloc_sync(len) }.expect("cuMemAlloc")
    }

    pub fn alloc(len: usize) -> (Buf, u64) {
        let ptr = malloc(len);
        // SAFETY: `len` bytes at `ptr`, just allocated (the context is bound by malloc).
        unsafe { result::memset_d8_sync(ptr, 0, len) }.expect("cuMemsetD8");
        (Buf { ptr, len }, ptr)
    }

    pub fn upload(data: &[u8]) -> (Buf, u64) {
        let ptr = malloc(data.len());
        // SAFETY: `data.len()` bytes at `ptr`, just allocated.
        unsafe { result::memcpy_htod_sync(ptr, data) }.expect("copy to the GPU");
        (
            Buf {
                ptr,
                len: data.len(),
            },
            ptr,
        )
    }

    pub fn to_host(b: &Buf) -> Vec<u8> {
        let mut out = vec![0u8; b.len];
        context().bind_to_thread().expect("bind the context");
        // SAFETY: the buffer holds `b.len` bytes.
        unsafe { result::memcpy_dtoh_sync(&mut out, b.ptr) }.expect("copy from the GPU");
        out
    }
}

#[cfg(not(feature = "cuda-bench"))]
mod gpu {
    pub struct Buf;

    fn missing() -> ! {
        eprintln!("--pool cuda needs the `cuda-bench` feature (cargo build --features cuda-bench)");
        std::process::exit(2)
    }

    pub fn alloc(_len: usize) -> (Buf, u64) {
        missing()
    }

    pub fn upload(_data: &[u8]) -> (Buf, u64) {
        missing()
    }

    pub fn to_host(_b: &Buf) -> Vec<u8> {
        missing()
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let a = args();
    if a.receiver {
        receiver(a).await
    } else {
        sender(a).await
    }
}
