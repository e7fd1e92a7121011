//! KV transfer throughput between two processes, with the block layout of a Qwen3-0.6B-shaped
//! model: 28 layers, 8 KV heads, head dim 128, block size 32, bf16.
//!
//! - one layer of one block (K and V) = 2 × 32 × 8 × 128 × 2 B = 131,072 B
//! - one block = 28 × 131,072 B = 3,670,016 B (layout: block-major, layer inside)
//!
//! Two patterns, as the serving path issues them, for `--blocks` blocks (default 64):
//! - `per-layer`: after each layer, one batch of `blocks` puts of 131 KB (that layer of every
//!   block) and a "layer k done" notification — 28 batches;
//! - `whole-block`: one batch of `blocks` puts of 3.67 MB and one notification.
//!
//! It also runs both patterns "hot" (every put from the same source to the same destination,
//! the access pattern of `ucx_perftest`) and prints a local memcpy of the same volume.
//!
//! Usage: `transfer_bench [--backend UCX|TCP] [--blocks N] [--iters N] [--pool alloc|heap]`. The program starts
//! itself again as the receiver (`--receiver`), reads its descriptor from the child's stdout,
//! and checks the received bytes by hash at the end. Prints MiB/s (2^20 bytes, the unit of
//! `ucx_perftest`).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tandem_kv_transfer::{
    open, Backend, Bytes, Event, KvConnection, KvTransport, LocalMemory, Put, Registration,
    RemoteRegion, TransportConfig,
};

const LAYERS: usize = 28;
const LAYER_BYTES: usize = 2 * 32 * 8 * 128 * 2;
const BLOCK_BYTES: usize = LAYERS * LAYER_BYTES;

fn fnv(data: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in data {
        h ^= b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

struct Args {
    backend: Backend,
    blocks: usize,
    iters: usize,
    receiver: bool,
    /// Receiver pool: `alloc` = `KvTransport::allocate` (UCX-allocated, shared memory),
    /// `heap` = our own heap buffer registered with `register`.
    pool: String,
}

fn args() -> Args {
    let mut a = Args {
        backend: Backend::Ucx,
        blocks: 64,
        iters: 5,
        receiver: false,
        pool: "alloc".into(),
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
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

fn config(backend: Backend) -> TransportConfig {
    let mut c = TransportConfig::new(backend);
    c.op_timeout = Duration::from_secs(60);
    c
}

async fn receiver(a: Args) {
    let t = open(config(a.backend)).await.expect("open transport");
    let mut events = t.take_notifications().expect("notifications");
    let len = a.blocks * BLOCK_BYTES;
    let (reg, pool) = if a.pool == "heap" {
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
            if n == b"hash" {
                // SAFETY: see above.
                let data = unsafe { std::slice::from_raw_parts(pool, len) };
                println!("HASH {:016x}", fnv(data));
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
        ])
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
    let t = open(config(a.backend)).await.expect("open transport");
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
    let expect = fnv(&src);
    let src = Bytes::from(src);

    let per_layer = |k: usize| -> Vec<Put> {
        (0..a.blocks)
            .map(|b| {
                let off = b * BLOCK_BYTES + k * LAYER_BYTES;
                Put {
                    local: src.slice(off..off + LAYER_BYTES),
                    offset: off as u64,
                }
            })
            .collect()
    };
    let whole = || -> Vec<Put> {
        (0..a.blocks)
            .map(|b| Put {
                local: src.slice(b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES),
                offset: (b * BLOCK_BYTES) as u64,
            })
            .collect()
    };

    // Warm-up (connection establishment, rkey unpack, page faults on both sides).
    conn.write(&desc, whole()).await.expect("warm-up");

    // "hot": the same message sizes and batch shapes, but every put reads the same source
    // bytes and lands on the same destination (block 0), as `ucx_perftest` does: caches stay
    // warm, so this isolates the transport's own overhead from memory bandwidth.
    let hot = |size: usize| -> Vec<Put> {
        (0..a.blocks)
            .map(|_| Put {
                local: src.slice(0..size),
                offset: 0,
            })
            .collect()
    };
    let (mut hot_layer, mut hot_block) = (Duration::MAX, Duration::MAX);
    for _ in 0..a.iters {
        let s = Instant::now();
        for k in 0..LAYERS {
            conn.write(&desc, hot(LAYER_BYTES))
                .await
                .expect("hot write");
            conn.notify(Bytes::from(format!("layer {k} done")))
                .await
                .expect("notify");
        }
        hot_layer = hot_layer.min(s.elapsed());
        let s = Instant::now();
        conn.write(&desc, hot(BLOCK_BYTES))
            .await
            .expect("hot write");
        conn.notify(Bytes::from_static(b"blocks done"))
            .await
            .expect("notify");
        hot_block = hot_block.min(s.elapsed());
    }

    // Reference: one core's memcpy of the same amount of distinct memory.
    let mut dst = vec![0u8; len];
    dst.copy_from_slice(&src);
    let s = Instant::now();
    dst.copy_from_slice(&src);
    let memcpy = s.elapsed();
    std::hint::black_box(&dst);
    drop(dst);

    let mut best_layer = Duration::MAX;
    let mut best_block = Duration::MAX;
    let (mut sum_layer, mut sum_block) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..a.iters {
        let s = Instant::now();
        for k in 0..LAYERS {
            conn.write(&desc, per_layer(k))
                .await
                .expect("per-layer write");
            conn.notify(Bytes::from(format!("layer {k} done")))
                .await
                .expect("notify");
        }
        let d = s.elapsed();
        best_layer = best_layer.min(d);
        sum_layer += d;

        let s = Instant::now();
        conn.write(&desc, whole()).await.expect("whole-block write");
        conn.notify(Bytes::from_static(b"blocks done"))
            .await
            .expect("notify");
        let d = s.elapsed();
        best_block = best_block.min(d);
        sum_block += d;
    }
    conn.notify(Bytes::from_static(b"hash"))
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

    let n = a.iters as u32;
    println!(
        "backend={} pool={} blocks={} iters={} bytes_per_iter={} ({} MiB) data_check={}",
        a.backend,
        a.pool,
        a.blocks,
        a.iters,
        len,
        len >> 20,
        if ok { "ok" } else { "MISMATCH" }
    );
    println!(
        "per-layer   (28 batches x {} puts of {} B + notify): best {:.1} MiB/s, mean {:.1} MiB/s",
        a.blocks,
        LAYER_BYTES,
        mib_s(len, best_layer),
        mib_s(len, sum_layer / n)
    );
    println!(
        "whole-block (1 batch x {} puts of {} B + notify):  best {:.1} MiB/s, mean {:.1} MiB/s",
        a.blocks,
        BLOCK_BYTES,
        mib_s(len, best_block),
        mib_s(len, sum_block / n)
    );
    println!(
        "hot per-layer   (same source/destination, as ucx_perftest): best {:.1} MiB/s",
        mib_s(len, hot_layer)
    );
    println!(
        "hot whole-block (same source/destination, as ucx_perftest): best {:.1} MiB/s",
        mib_s(len, hot_block)
    );
    println!(
        "local memcpy of {} MiB: {:.1} MiB/s",
        len >> 20,
        mib_s(len, memcpy)
    );
    if !ok {
        std::process::exit(1);
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
