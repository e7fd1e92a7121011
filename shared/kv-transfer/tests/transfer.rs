//! Transfer tests for both transports on loopback: in one process and across two processes
//! (the test binary re-executes itself as the receiver with `KV_TEST_CHILD` set).
//!
//! UCX: no `UCX_TLS` is set; Debian's UCX 1.13 picks among tcp/shm (posix, sysv)/cma/self on
//! this VM by itself.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{fnv, transport, Pool, Rng};
use tandem_kv_transfer::{
    Backend, Bytes, Event, KvConnection, KvTransport, Put, Registration, RemoteRegion,
    TransferError,
};

const T: Duration = Duration::from_secs(10);
const BACKENDS: [Backend; 2] = [Backend::Tcp, Backend::Ucx];

/// A batch of non-overlapping random puts (sizes 1 B..64 KiB, some empty) applied to `shadow`.
fn random_batch(rng: &mut Rng, region_len: usize, shadow: &mut [u8]) -> Vec<Put> {
    let slots = 64;
    let slot = region_len / slots;
    let mut used = vec![false; slots];
    let mut puts = Vec::new();
    for _ in 0..(1 + rng.below(40)) {
        let s = rng.below(slots as u64) as usize;
        if used[s] {
            continue;
        }
        used[s] = true;
        let len = rng.below(slot.min(64 * 1024) as u64 + 1) as usize;
        let off = s * slot + rng.below((slot - len) as u64 + 1) as usize;
        let data = rng.bytes(len);
        shadow[off..off + len].copy_from_slice(&data);
        puts.push(Put {
            local: Bytes::from(data),
            offset: off as u64,
        });
    }
    puts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_puts_land_byte_exact_and_notifications_follow_them() {
    for backend in BACKENDS {
        let rx = transport(backend, T).await;
        let tx = transport(backend, T).await;
        let mut events = rx.take_notifications().unwrap();
        assert!(rx.take_notifications().is_none());
        let len = 4 << 20;
        let pool = Pool::new(len);
        let reg = rx.register(pool.memory()).await.unwrap();
        // The descriptor travels as JSON in the real system.
        let desc: RemoteRegion =
            serde_json::from_str(&serde_json::to_string(reg.descriptor()).unwrap()).unwrap();
        let conn = tx.connect(&desc.peer).await.unwrap();
        let mut shadow = vec![0u8; len];
        let mut rng = Rng(0x5eed_0000 + backend as u64);
        for round in 0..20u32 {
            let puts = random_batch(&mut rng, len, &mut shadow);
            conn.write(&desc, puts).await.unwrap();
            conn.notify(Bytes::from(format!("round {round}")))
                .await
                .unwrap();
            // Ordering: when the notification arrives, that round's puts are in memory.
            let note = events.next_notification(T).await.unwrap();
            assert_eq!(note, format!("round {round}").into_bytes());
            assert!(
                pool.snapshot() == shadow,
                "{backend}: memory differs after round {round}"
            );
        }
        drop(conn);
        drop(reg);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_batches_then_one_notification() {
    // Notifications sent back to back after many writes still arrive in order, each after
    // its writes.
    for backend in BACKENDS {
        let rx = transport(backend, T).await;
        let tx = transport(backend, T).await;
        let mut events = rx.take_notifications().unwrap();
        let pool = Pool::new(1 << 20);
        let reg = rx.register(pool.memory()).await.unwrap();
        let desc = reg.descriptor().clone();
        let conn = tx.connect(&desc.peer).await.unwrap();
        for i in 0..50u64 {
            let data = vec![i as u8 + 1; 4096];
            conn.write(
                &desc,
                vec![Put {
                    local: data.into(),
                    offset: i * 4096,
                }],
            )
            .await
            .unwrap();
            conn.notify(Bytes::from(i.to_le_bytes().to_vec()))
                .await
                .unwrap();
        }
        for i in 0..50u64 {
            let n = events.next_notification(T).await.unwrap();
            assert_eq!(n, i.to_le_bytes());
        }
        let snap = pool.snapshot();
        for i in 0..50usize {
            assert!(
                snap[i * 4096..(i + 1) * 4096]
                    .iter()
                    .all(|&b| b == i as u8 + 1),
                "{backend}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_bounds_and_malformed_descriptors_are_refused() {
    for backend in BACKENDS {
        let rx = transport(backend, T).await;
        let tx = transport(backend, T).await;
        let pool = Pool::new(64 * 1024);
        let reg = rx.register(pool.memory()).await.unwrap();
        let desc = reg.descriptor().clone();
        let conn = tx.connect(&desc.peer).await.unwrap();
        let put = |offset: u64, len: usize| Put {
            local: vec![0xAB; len].into(),
            offset,
        };

        // A batch with one bad put writes nothing at all.
        let e = conn
            .write(&desc, vec![put(0, 16), put(64 * 1024 - 8, 16)])
            .await
            .unwrap_err();
        assert!(
            matches!(e, TransferError::OutOfBounds { .. }),
            "{backend}: {e}"
        );
        let e = conn
            .write(&desc, vec![put(u64::MAX - 4, 16)])
            .await
            .unwrap_err();
        assert!(
            matches!(e, TransferError::OutOfBounds { .. }),
            "{backend}: {e}"
        );
        let mut wrapping = RemoteRegion {
            base: u64::MAX - 100,
            ..desc.clone()
        };
        wrapping.seal();
        let e = conn.write(&wrapping, vec![put(0, 1)]).await.unwrap_err();
        assert!(
            matches!(e, TransferError::BadDescriptor(_)),
            "{backend}: {e}"
        );
        let mut other_peer = RemoteRegion {
            peer: tandem_kv_transfer::PeerAddress(b"1.2.3.4:5".to_vec()),
            ..desc.clone()
        };
        other_peer.seal();
        let e = conn.write(&other_peer, vec![put(0, 1)]).await.unwrap_err();
        assert!(
            matches!(e, TransferError::BadDescriptor(_)),
            "{backend}: {e}"
        );
        let e = conn
            .notify(Bytes::from(vec![0; 65 * 1024]))
            .await
            .unwrap_err();
        assert!(
            matches!(e, TransferError::NotificationTooLarge(_)),
            "{backend}: {e}"
        );
        assert!(
            pool.snapshot().iter().all(|&b| b == 0),
            "{backend}: refused batch wrote"
        );

        if backend == Backend::Tcp {
            // Altered without resealing: refused by the sender's checksum.
            let mut forged = RemoteRegion {
                len: 1 << 30,
                ..desc.clone()
            };
            let e = conn
                .write(&forged, vec![put(1 << 20, 16)])
                .await
                .unwrap_err();
            assert!(matches!(e, TransferError::BadDescriptor(_)), "{e}");
            // A forged (resealed) descriptor that claims a bigger region passes the sender's
            // checks, but the receiver checks against what it registered, and closes the
            // connection on the put's header.
            forged.seal();
            let e = conn
                .write(&forged, vec![put(1 << 20, 16)])
                .await
                .unwrap_err();
            assert!(matches!(e, TransferError::Io(_)), "{e}");
            // The receiver closed that connection: later writes fail rather than hang.
            assert!(conn.write(&desc, vec![put(0, 16)]).await.is_err());
            let conn = tx.connect(&desc.peer).await.unwrap();
            let mut forged = RemoteRegion {
                region_id: desc.region_id ^ 1,
                ..desc.clone()
            };
            forged.seal();
            assert!(conn.write(&forged, vec![put(0, 16)]).await.is_err());
            assert!(pool.snapshot().iter().all(|&b| b == 0), "forged put wrote");
            // A new connection with the real descriptor still writes.
            let conn = tx.connect(&desc.peer).await.unwrap();
            conn.write(&desc, vec![put(0, 16)]).await.unwrap();
        } else {
            // A mangled rkey (truncated, garbage, empty) is an error, not a crash: UCX itself
            // would crash on it, so the descriptor checksum must catch it first.
            let half = desc.rkey[..desc.rkey.len() / 2].to_vec();
            for rkey in [vec![], half, vec![0xff; 16], vec![0; 3]] {
                let bad = RemoteRegion {
                    rkey,
                    ..desc.clone()
                };
                let r = conn.write(&bad, vec![put(0, 1)]).await;
                assert!(matches!(r, Err(TransferError::BadDescriptor(_))), "{r:?}");
            }
            conn.write(&desc, vec![put(0, 16)]).await.unwrap();
        }
        assert_eq!(&pool.snapshot()[..16], &[0xAB; 16]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_registration_and_transport_releases_memory() {
    // TCP: the receiver enforces it, so a put after unregistration is refused.
    let rx = transport(Backend::Tcp, T).await;
    let tx = transport(Backend::Tcp, T).await;
    let pool = Pool::new(4096);
    let reg = rx.register(pool.memory()).await.unwrap();
    let desc = reg.descriptor().clone();
    let conn = tx.connect(&desc.peer).await.unwrap();
    conn.write(
        &desc,
        vec![Put {
            local: vec![1; 8].into(),
            offset: 0,
        }],
    )
    .await
    .unwrap();
    drop(reg);
    assert!(conn
        .write(
            &desc,
            vec![Put {
                local: vec![2; 8].into(),
                offset: 0
            }]
        )
        .await
        .is_err());
    let reg2 = rx.register(pool.memory()).await.unwrap();
    let desc2 = reg2.descriptor().clone();
    drop(rx); // the transport goes: listener, connections and registrations with it
    let start = Instant::now();
    assert!(conn
        .write(
            &desc2,
            vec![Put {
                local: vec![3; 8].into(),
                offset: 0
            }]
        )
        .await
        .is_err());
    assert!(start.elapsed() < T);
    assert_eq!(&pool.snapshot()[..8], &[1; 8]);
    drop(reg2); // after its transport: must not hang or crash

    // UCX: dropping the transport unmaps every registration and joins the progress thread;
    // a registration dropped afterwards is a no-op.
    let rx = transport(Backend::Ucx, T).await;
    let reg = rx.register(pool.memory()).await.unwrap();
    let reg_b = rx.register(pool.memory()).await.unwrap();
    drop(reg_b);
    let start = Instant::now();
    drop(rx);
    drop(reg);
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn backend_selection_has_no_silent_fallback() {
    use tandem_kv_transfer::open;
    // A UCX that cannot initialise (here: a transport list naming nothing that exists) is an
    // error that names TCP, run in a child so the env var does not leak into other tests.
    if std::env::var("KV_TEST_BAD_UCX").is_ok() {
        let e = open(common::config(Backend::Ucx, T))
            .await
            .err()
            .expect("must fail");
        let msg = e.to_string();
        assert!(
            msg.contains("UCX cannot be initialised") && msg.contains("TCP"),
            "{msg}"
        );
        return;
    }
    let t = transport(Backend::Ucx, T).await;
    assert_eq!(t.backend(), Backend::Ucx);
    assert_eq!(transport(Backend::Tcp, T).await.backend(), Backend::Tcp);
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "backend_selection_has_no_silent_fallback",
            "--nocapture",
        ])
        .env("KV_TEST_BAD_UCX", "1")
        .env("UCX_TLS", "no_such_transport")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

// ---------------------------------------------------------------------------------------
// Cross-process tests.
// ---------------------------------------------------------------------------------------

const CHILD_LEN: usize = 8 << 20;

/// The receiver child: registers a pool, prints its descriptor, then answers every
/// notification with the pool's hash. Runs only when `KV_TEST_CHILD` names a backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_receiver() {
    let Ok(backend) = std::env::var("KV_TEST_CHILD") else {
        return;
    };
    let backend: Backend = backend.parse().unwrap();
    let rx = transport(backend, T).await;
    let mut events = rx.take_notifications().unwrap();
    let pool = Pool::new(CHILD_LEN);
    let reg = rx.register(pool.memory()).await.unwrap();
    println!("DESC {}", serde_json::to_string(reg.descriptor()).unwrap());
    while let Ok(ev) = events.recv_timeout(Duration::from_secs(60)).await {
        match ev {
            Event::Notification(n) if n == b"quit" => break,
            Event::Notification(n) => {
                println!(
                    "HASH {} {:016x}",
                    String::from_utf8_lossy(&n),
                    fnv(&pool.snapshot())
                )
            }
            Event::PeerClosed { .. } => {}
        }
    }
}

struct ChildReceiver {
    child: Child,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

impl ChildReceiver {
    fn spawn(backend: Backend) -> (Self, RemoteRegion) {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "child_receiver",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("KV_TEST_CHILD", backend.as_str())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let desc = loop {
            let line = lines
                .next()
                .expect("child exited before its descriptor")
                .unwrap();
            // libtest prints "test child_receiver ... " on the same line first.
            if let Some(i) = line.find("DESC ") {
                break serde_json::from_str(&line[i + 5..]).unwrap();
            }
        };
        (ChildReceiver { child, lines }, desc)
    }

    fn next_hash(&mut self) -> String {
        loop {
            let line = self.lines.next().expect("child exited").unwrap();
            if let Some(i) = line.find("HASH ") {
                return line[i + 5..].to_string();
            }
        }
    }
}

impl Drop for ChildReceiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_process_random_puts_land_byte_exact() {
    if std::env::var("KV_TEST_CHILD").is_ok() {
        return;
    }
    for backend in BACKENDS {
        let (mut child, desc) = tokio::task::block_in_place(|| ChildReceiver::spawn(backend));
        let tx = transport(backend, T).await;
        let conn = tx.connect(&desc.peer).await.unwrap();
        let mut shadow = vec![0u8; CHILD_LEN];
        let mut rng = Rng(0xc0ffee + backend as u64);
        for round in 0..10 {
            let puts = random_batch(&mut rng, CHILD_LEN, &mut shadow);
            conn.write(&desc, puts).await.unwrap();
            conn.notify(Bytes::from(format!("r{round}"))).await.unwrap();
            let got = tokio::task::block_in_place(|| child.next_hash());
            assert_eq!(
                got,
                format!("r{round} {:016x}", fnv(&shadow)),
                "{backend} round {round}"
            );
        }
        conn.notify(Bytes::from_static(b"quit")).await.unwrap();
        let status = tokio::task::block_in_place(|| child.child.wait()).unwrap();
        assert!(status.success(), "{backend}: child failed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receiver_killed_mid_transfer_gives_an_error_not_a_hang() {
    if std::env::var("KV_TEST_CHILD").is_ok() {
        return;
    }
    // UCX twice: its default error mode (a dead peer surfaces as the 5 s op timeout) and
    // UCP_ERR_HANDLING_MODE_PEER (surfaces at once, over tcp).
    for (backend, peer_eh) in [
        (Backend::Tcp, false),
        (Backend::Ucx, false),
        (Backend::Ucx, true),
    ] {
        let (mut child, desc) = tokio::task::block_in_place(|| ChildReceiver::spawn(backend));
        let mut cfg = common::config(backend, Duration::from_secs(5));
        cfg.ucx_peer_error_handling = peer_eh;
        let tx = tandem_kv_transfer::open(cfg).await.unwrap();
        let conn = tx.connect(&desc.peer).await.unwrap();
        let block = Bytes::from(vec![7u8; 1 << 20]);
        let batch = || {
            (0..8)
                .map(|i| Put {
                    local: block.clone(),
                    offset: i << 20,
                })
                .collect::<Vec<_>>()
        };
        conn.write(&desc, batch()).await.unwrap();
        let start = Instant::now();
        let killer = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            child.child.kill().unwrap();
        };
        let writer = async {
            loop {
                if let Err(e) = conn.write(&desc, batch()).await {
                    return e;
                }
                if start.elapsed() > Duration::from_secs(30) {
                    panic!("{backend}: writes kept succeeding after the receiver was killed");
                }
            }
        };
        let (_, err) = tokio::join!(killer, writer);
        eprintln!(
            "{backend} (peer error handling {peer_eh}): error after {:?}: {err}",
            start.elapsed()
        );
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{backend}: took {:?}",
            start.elapsed()
        );
        // The connection stays failed rather than hanging later calls.
        let again = tokio::time::timeout(Duration::from_secs(15), conn.write(&desc, batch())).await;
        assert!(matches!(again, Ok(Err(_))), "{backend}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_receiver_sees_a_sender_that_dies() {
    let rx = transport(Backend::Tcp, T).await;
    let mut events = rx.take_notifications().unwrap();
    let tx = transport(Backend::Tcp, T).await;
    let pool = Pool::new(4096);
    let reg = rx.register(pool.memory()).await.unwrap();
    let conn = tx.connect(&rx.address()).await.unwrap();
    // TCP notifies only once the connection presented a region's secret (by writing).
    let e = conn.notify(Bytes::from_static(b"hello")).await.unwrap_err();
    assert!(matches!(e, TransferError::NotAuthenticated(_)), "{e}");
    conn.write(
        reg.descriptor(),
        vec![Put {
            local: vec![1; 8].into(),
            offset: 0,
        }],
    )
    .await
    .unwrap();
    conn.notify(Bytes::from_static(b"hello")).await.unwrap();
    assert_eq!(events.next_notification(T).await.unwrap(), b"hello");
    drop(conn);
    drop(tx);
    let e = events.next_notification(T).await.unwrap_err();
    assert!(matches!(e, TransferError::PeerFailed(_)), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocated_regions_receive_writes_and_are_freed() {
    for backend in BACKENDS {
        let rx = transport(backend, T).await;
        let tx = transport(backend, T).await;
        let mut events = rx.take_notifications().unwrap();
        let len = 1 << 20;
        let (reg, ptr) = rx.allocate(len).await.unwrap();
        let desc = reg.descriptor().clone();
        assert_eq!((desc.base, desc.len), (ptr as u64, len as u64));
        let conn = tx.connect(&desc.peer).await.unwrap();
        let mut rng = Rng(77);
        let data = rng.bytes(len);
        let puts = (0..16).map(|i| Put {
            local: Bytes::copy_from_slice(&data[i << 16..(i + 1) << 16]),
            offset: (i << 16) as u64,
        });
        conn.write(&desc, puts.collect()).await.unwrap();
        conn.notify(Bytes::from_static(b"done")).await.unwrap();
        assert_eq!(events.next_notification(T).await.unwrap(), b"done");
        // SAFETY: the registration is alive and no write is in flight.
        let got = unsafe { std::slice::from_raw_parts(ptr, len) };
        assert!(got == &data[..], "{backend}");
        drop(reg);
        assert!(rx.allocate(0).await.is_err(), "{backend}");
    }
}

/// UCX with 4 lanes: every batch is large enough to be striped over all of them (puts split
/// between lanes at unaligned sizes, scattered destinations, one batch of a single large put),
/// and each notification arrives after all of its batch's bytes, into an allocated pool and
/// into a registered heap pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_lane_writes_land_byte_exact_before_their_notification() {
    let mut cfg = common::config(Backend::Ucx, T);
    cfg.ucx_lanes = 4;
    let rx = tandem_kv_transfer::open(cfg.clone()).await.unwrap();
    let tx = tandem_kv_transfer::open(cfg).await.unwrap();
    let mut events = rx.take_notifications().unwrap();
    const BLOCK: usize = (1 << 20) + 4100;
    const BLOCKS: usize = 24;
    let len = BLOCK * BLOCKS;
    let heap = Pool::new(len);
    let (alloc_reg, alloc_ptr) = rx.allocate(len).await.unwrap();
    let heap_reg = rx.register(heap.memory()).await.unwrap();
    let conn = tx.connect(&rx.address()).await.unwrap();
    match &conn {
        tandem_kv_transfer::AnyConnection::Ucx(c) => assert_eq!(c.lanes(), 4),
        _ => unreachable!(),
    }
    let mut rng = Rng(0x1a_e5);
    for (name, desc) in [
        ("allocated", alloc_reg.descriptor().clone()),
        ("heap", heap_reg.descriptor().clone()),
    ] {
        let mut shadow = vec![0u8; len];
        for round in 0..6u32 {
            // Round 0: one put of 6 blocks (split over the lanes); then 5 whole blocks to
            // scattered, distinct destination blocks.
            let puts: Vec<Put> = if round == 0 {
                let data = rng.bytes(6 * BLOCK);
                let off = 3 * BLOCK;
                shadow[off..off + data.len()].copy_from_slice(&data);
                vec![Put {
                    local: data.into(),
                    offset: off as u64,
                }]
            } else {
                let mut ids: Vec<usize> = (0..BLOCKS).collect();
                for i in (1..BLOCKS).rev() {
                    ids.swap(i, rng.below(i as u64 + 1) as usize);
                }
                ids[..5]
                    .iter()
                    .map(|&id| {
                        let data = rng.bytes(BLOCK);
                        shadow[id * BLOCK..(id + 1) * BLOCK].copy_from_slice(&data);
                        Put {
                            local: data.into(),
                            offset: (id * BLOCK) as u64,
                        }
                    })
                    .collect()
            };
            conn.write(&desc, puts).await.unwrap();
            conn.notify(Bytes::from(format!("{name} {round}")))
                .await
                .unwrap();
            let note = events.next_notification(T).await.unwrap();
            assert_eq!(note, format!("{name} {round}").into_bytes());
            let got = if name == "heap" {
                heap.snapshot()
            } else {
                // SAFETY: the registration is alive and no write is in flight.
                unsafe { std::slice::from_raw_parts(alloc_ptr, len) }.to_vec()
            };
            assert!(got == shadow, "{name}: memory differs after round {round}");
        }
    }
    drop(conn);
    drop(alloc_reg);
    drop(heap_reg);
}

// ---------------------------------------------------------------------------------------
// TCP: a region is a capability (random id + secret); hostile frames are refused.
// ---------------------------------------------------------------------------------------

mod raw {
    //! Hand-made frames on a plain TCP stream, as a hostile peer would send them.
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    pub fn hello(id: u64, secret: &[u8]) -> Vec<u8> {
        let mut f = vec![4u8];
        f.extend(id.to_le_bytes());
        f.extend(secret);
        f
    }

    /// A put header; the payload is whatever follows (possibly nothing).
    pub fn put_header(id: u64, offset: u64, len: u64) -> Vec<u8> {
        let mut f = vec![1u8];
        f.extend(id.to_le_bytes());
        f.extend(offset.to_le_bytes());
        f.extend(len.to_le_bytes());
        f
    }

    pub fn flush(seq: u64) -> Vec<u8> {
        let mut f = vec![2u8];
        f.extend(seq.to_le_bytes());
        f
    }

    pub fn notify(payload: &[u8]) -> Vec<u8> {
        let mut f = vec![3u8];
        f.extend((payload.len() as u32).to_le_bytes());
        f.extend(payload);
        f
    }

    pub async fn connect(desc: &RemoteRegion) -> TcpStream {
        let addr = std::str::from_utf8(&desc.peer.0).unwrap().to_string();
        tokio::time::timeout(T, TcpStream::connect(addr))
            .await
            .expect("connect in time")
            .expect("connect")
    }

    /// Sends `bytes` (the peer may already have closed: a write error is fine) and waits,
    /// bounded, for the receiver to close the connection.
    pub async fn expect_closed(stream: &mut TcpStream, bytes: &[u8]) {
        let _ = stream.write_all(bytes).await;
        let mut b = [0u8; 64];
        loop {
            match tokio::time::timeout(T, stream.read(&mut b)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return,
                // A flush ack sent before the refusal: keep reading until the close.
                Ok(Ok(_)) => continue,
                Err(_) => panic!("the receiver kept the connection open"),
            }
        }
    }

    /// Sends `bytes`, then a flush, and returns the ack's status (0: every put landed).
    pub async fn flush_status(stream: &mut TcpStream, bytes: &[u8], seq: u64) -> u8 {
        stream.write_all(bytes).await.unwrap();
        stream.write_all(&flush(seq)).await.unwrap();
        let read = async {
            let got = stream.read_u64_le().await?;
            let status = stream.read_u8().await?;
            let len = stream.read_u32_le().await?;
            let mut msg = vec![0u8; len as usize];
            stream.read_exact(&mut msg).await?;
            Ok::<_, std::io::Error>((got, status))
        };
        let (got, status) = tokio::time::timeout(T, read).await.unwrap().unwrap();
        assert_eq!(got, seq);
        status
    }
}

async fn tcp_receiver() -> (tandem_kv_transfer::TcpTransport, Pool, impl Registration) {
    let rx = tandem_kv_transfer::TcpTransport::bind(common::config(Backend::Tcp, T))
        .await
        .unwrap();
    let pool = Pool::new(64 * 1024);
    let reg = rx.register(pool.memory()).await.unwrap();
    (rx, pool, reg)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_regions_get_random_ids_and_secrets() {
    let (rx, pool, reg) = tcp_receiver().await;
    let other = rx.register(pool.memory()).await.unwrap();
    let (a, b) = (reg.descriptor(), other.descriptor());
    assert_ne!(a.region_id, b.region_id);
    assert_ne!(a.region_id + 1, b.region_id, "ids are not a counter");
    assert_eq!(
        a.secret.as_bytes().len(),
        tandem_kv_transfer::RegionSecret::LEN
    );
    assert_ne!(a.secret, b.secret);
    // Debug output (e.g. a logged descriptor) never shows the secret.
    let printed = format!("{a:?}");
    assert!(printed.contains("redacted"), "{printed}");
    let bytes = format!("{:?}", a.secret.as_bytes());
    assert!(!printed.contains(&bytes[1..bytes.len() - 1]), "{printed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_puts_without_the_right_secret_are_refused_and_the_pool_untouched() {
    let (rx, pool, reg) = tcp_receiver().await;
    let desc = reg.descriptor().clone();
    let data = [0xEE; 64];
    let put = |id: u64| [raw::put_header(id, 0, 64), data.to_vec()].concat();

    // No hello at all.
    let mut s = raw::connect(&desc).await;
    raw::expect_closed(&mut s, &put(desc.region_id)).await;
    assert_eq!(rx.refused().unauthenticated, 1);

    // A wrong secret (one bit flipped), a truncated one, and the right secret for a region
    // id that does not exist.
    let mut wrong = desc.secret.as_bytes().to_vec();
    wrong[7] ^= 1;
    let mut s = raw::connect(&desc).await;
    raw::expect_closed(
        &mut s,
        &[raw::hello(desc.region_id, &wrong), put(desc.region_id)].concat(),
    )
    .await;
    let mut s = raw::connect(&desc).await;
    raw::expect_closed(
        &mut s,
        &[raw::hello(desc.region_id, &[0u8; 32]), put(desc.region_id)].concat(),
    )
    .await;
    let mut s = raw::connect(&desc).await;
    raw::expect_closed(
        &mut s,
        &[raw::hello(desc.region_id ^ 1, desc.secret.as_bytes())].concat(),
    )
    .await;
    assert_eq!(rx.refused().bad_secret, 3);

    // Through the API: a descriptor whose secret was altered or removed.
    let tx = transport(Backend::Tcp, T).await;
    let forged = RemoteRegion {
        secret: tandem_kv_transfer::RegionSecret::from_bytes(wrong.clone()),
        ..desc.clone()
    };
    let conn = tx.connect(&desc.peer).await.unwrap();
    let p = Put {
        local: Bytes::from(data.to_vec()),
        offset: 0,
    };
    assert!(conn.write(&forged, vec![p.clone()]).await.is_err());
    let missing = RemoteRegion {
        secret: tandem_kv_transfer::RegionSecret::default(),
        ..desc.clone()
    };
    let conn = tx.connect(&desc.peer).await.unwrap();
    let e = conn.write(&missing, vec![p.clone()]).await.unwrap_err();
    assert!(matches!(e, TransferError::BadDescriptor(_)), "{e}");
    assert_eq!(rx.refused().bad_secret, 4);
    assert!(
        pool.snapshot().iter().all(|&b| b == 0),
        "a refused put wrote"
    );

    // A secret presented for one region does not open another.
    let other = Pool::new(4096);
    let other_reg = rx.register(other.memory()).await.unwrap();
    let mut s = raw::connect(&desc).await;
    raw::expect_closed(
        &mut s,
        &[
            raw::hello(desc.region_id, desc.secret.as_bytes()),
            put(other_reg.descriptor().region_id),
        ]
        .concat(),
    )
    .await;
    assert_eq!(rx.refused().unauthenticated, 2);
    assert!(other.snapshot().iter().all(|&b| b == 0));
    assert!(pool.snapshot().iter().all(|&b| b == 0));

    // The right secret still works, raw and through the API.
    let mut s = raw::connect(&desc).await;
    let frames = [
        raw::hello(desc.region_id, desc.secret.as_bytes()),
        put(desc.region_id),
    ]
    .concat();
    assert_eq!(raw::flush_status(&mut s, &frames, 1).await, 0);
    assert_eq!(&pool.snapshot()[..64], &data[..]);
    let conn = tx.connect(&desc.peer).await.unwrap();
    let p = Put {
        local: Bytes::from(vec![0x11; 16]),
        offset: 100,
    };
    conn.write(&desc, vec![p]).await.unwrap();
    assert_eq!(&pool.snapshot()[100..116], &[0x11; 16]);
    assert_eq!(rx.refused().total(), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_puts_past_the_region_are_refused_on_their_header() {
    let (rx, pool, reg) = tcp_receiver().await;
    let desc = reg.descriptor().clone();
    let hello = raw::hello(desc.region_id, desc.secret.as_bytes());
    // Headers only, no payload: the receiver must decide (and close) on the header alone,
    // without waiting for, reading or allocating the payload.
    for (offset, len) in [
        (desc.len - 8, 16), // past the end
        (0, desc.len + 1),  // longer than the region
        (0, 1 << 32),       // 4 GiB
        (0, u64::MAX),      // absurd
        (u64::MAX - 4, 16), // offset + len overflows
        (desc.len, 1),      // starts at the end
    ] {
        let mut s = raw::connect(&desc).await;
        raw::expect_closed(
            &mut s,
            &[hello.clone(), raw::put_header(desc.region_id, offset, len)].concat(),
        )
        .await;
    }
    assert_eq!(rx.refused().out_of_bounds, 6);
    assert_eq!(rx.refused().total(), 6);
    assert!(
        pool.snapshot().iter().all(|&b| b == 0),
        "a refused put wrote"
    );
    // A put that ends exactly at the region's end is accepted.
    let mut s = raw::connect(&desc).await;
    let frames = [
        hello,
        raw::put_header(desc.region_id, desc.len - 4, 4),
        vec![9; 4],
    ]
    .concat();
    assert_eq!(raw::flush_status(&mut s, &frames, 7).await, 0);
    assert_eq!(&pool.snapshot()[desc.len as usize - 4..], &[9; 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_notification_floods_are_bounded() {
    let (rx, pool, reg) = tcp_receiver().await;
    let desc = reg.descriptor().clone();
    let mut events = rx.take_notifications().unwrap();
    // Unauthenticated and oversized notifications are refused at once.
    let mut s = raw::connect(&desc).await;
    raw::expect_closed(&mut s, &raw::notify(b"x")).await;
    assert_eq!(rx.refused().unauthenticated, 1);
    let hello = raw::hello(desc.region_id, desc.secret.as_bytes());
    let mut s = raw::connect(&desc).await;
    let mut big = vec![3u8];
    big.extend((tandem_kv_transfer::MAX_NOTIFICATION_BYTES as u32 + 1).to_le_bytes());
    raw::expect_closed(&mut s, &[hello.clone(), big].concat()).await;
    assert_eq!(rx.refused().oversized_notification, 1);

    // The two refused connections' close events.
    for _ in 0..2 {
        let ev = events.recv_timeout(T).await.unwrap();
        assert!(matches!(ev, Event::PeerClosed { .. }), "{ev:?}");
    }
    // A flood from an authenticated peer while nobody drains the stream: the queue holds
    // EVENT_QUEUE events, the first one past it is refused and the connection closed.
    let flood: Vec<u8> = (0..tandem_kv_transfer::EVENT_QUEUE + 100)
        .flat_map(|i| raw::notify(format!("n{i}").as_bytes()))
        .collect();
    let mut s = raw::connect(&desc).await;
    raw::expect_closed(&mut s, &[hello.clone(), flood].concat()).await;
    assert_eq!(rx.refused().event_queue_full, 1);
    for i in 0..tandem_kv_transfer::EVENT_QUEUE {
        let n = events.next_notification(T).await.unwrap();
        assert_eq!(n, format!("n{i}").into_bytes());
    }
    // Nothing past the bound was queued (at most the flood's own close event, if it was sent
    // after the queue started draining).
    let after = events.recv_timeout(Duration::from_millis(50)).await;
    assert!(!matches!(after, Ok(Event::Notification(_))), "{after:?}");
    assert!(pool.snapshot().iter().all(|&b| b == 0));

    // Drained, the queue accepts notifications again.
    let tx = transport(Backend::Tcp, T).await;
    let conn = tx.connect(&desc.peer).await.unwrap();
    conn.write(
        &desc,
        vec![Put {
            local: Bytes::from(vec![5; 8]),
            offset: 0,
        }],
    )
    .await
    .unwrap();
    conn.notify(Bytes::from_static(b"after")).await.unwrap();
    assert_eq!(events.next_notification(T).await.unwrap(), b"after");
    assert_eq!(&pool.snapshot()[..8], &[5; 8]);
}

/// `e` refuses GPU memory on `backend`, naming what it lacks: UCX (for TCP), or the
/// CUDA-enabled UCX of libucx-cu13 (for a UCX without CUDA support).
fn assert_names_what_gpu_memory_needs(e: TransferError, backend: Backend) {
    match e {
        TransferError::GpuMemoryUnsupported {
            backend: b,
            missing,
        } => {
            assert_eq!(b, backend);
            let needs = if backend == Backend::Tcp {
                "UCX"
            } else {
                "libucx-cu13"
            };
            assert!(missing.contains(needs), "{backend}: {missing}");
        }
        other => panic!("{backend}: {other}"),
    }
}

/// GPU memory is never staged through the host behind the caller's back: TCP refuses to
/// register it, a UCX without CUDA support (Debian's, which CI runs) refuses naming the UCX it
/// needs, a host-memory batch into a region that says it is GPU memory is refused before
/// anything moves, and so is a GPU batch where the transport or its UCX cannot move it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_memory_is_refused_where_it_cannot_be_moved() {
    let pool = Pool::new(4096);
    for backend in BACKENDS {
        let t = transport(backend, T).await;
        let e = t
            .register(pool.as_gpu_memory())
            .await
            .map(|_| ())
            .unwrap_err();
        assert_names_what_gpu_memory_needs(e, backend);
        // A descriptor claiming GPU memory takes no host-memory puts.
        let rx = transport(backend, T).await;
        let reg = rx.register(pool.memory()).await.unwrap();
        let mut desc = reg.descriptor().clone();
        desc.memory = tandem_kv_transfer::MemoryKind::Cuda { device: 0 };
        desc.seal();
        let conn = t.connect(&desc.peer).await.unwrap();
        let put = Put {
            local: vec![1u8; 8].into(),
            offset: 0,
        };
        let e = conn.write(&desc, vec![put]).await.unwrap_err();
        assert!(
            matches!(e, TransferError::GpuMemoryUnsupported { .. }),
            "{backend}: {e}"
        );
        assert_eq!(pool.snapshot()[..8], [0u8; 8], "{backend}: nothing written");
        // A batch from GPU memory: TCP refuses it, and so does a UCX without CUDA support
        // (its progress thread checks before issuing anything), naming what is missing.
        let src = [7u8; 8];
        let device_batch = || {
            let put = tandem_kv_transfer::DevicePut {
                src: src.as_ptr() as u64,
                len: 8,
                offset: 0,
            };
            // SAFETY: refused before any byte is read (asserted below).
            unsafe { tandem_kv_transfer::DeviceBatch::new(0, vec![put], Box::new(())) }
        };
        let e = conn.write_device(&desc, device_batch()).await.unwrap_err();
        assert_names_what_gpu_memory_needs(e, backend);
        // Nor does GPU memory ever land in a host region.
        let host_desc = reg.descriptor().clone();
        let e = conn
            .write_device(&host_desc, device_batch())
            .await
            .unwrap_err();
        assert!(
            matches!(e, TransferError::GpuMemoryUnsupported { .. }),
            "{backend}: {e}"
        );
        assert_eq!(pool.snapshot()[..8], [0u8; 8], "{backend}: nothing written");
    }
}

/// A sender whose source bytes lie in a region it registered itself (as a CUDA worker's own
/// KV pool is): its puts name that registration's handle, and land byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn puts_from_the_senders_own_registration_land_byte_exact() {
    let rx = transport(Backend::Ucx, T).await;
    let tx = transport(Backend::Ucx, T).await;
    let len = 1 << 20;
    let pool = Pool::new(len);
    let reg = rx.register(pool.memory()).await.unwrap();
    let desc = reg.descriptor().clone();
    let conn = tx.connect(&desc.peer).await.unwrap();
    let mut rng = Rng(0x0a11_0ca7);
    let src: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
    let src = Bytes::from(src);
    // SAFETY: `src` is kept alive (and unmodified) until after the registration is dropped.
    let own = tx
        .register(unsafe {
            tandem_kv_transfer::LocalMemory::host(src.as_ptr() as *mut u8, src.len())
        })
        .await
        .unwrap();
    // Blocks of 64 KiB, each to the mirrored offset.
    let puts: Vec<Put> = (0..len / 65536)
        .map(|b| Put {
            local: src.slice(b * 65536..(b + 1) * 65536),
            offset: (len - (b + 1) * 65536) as u64,
        })
        .collect();
    conn.write(&desc, puts).await.unwrap();
    let got = pool.snapshot();
    for b in 0..len / 65536 {
        let at = len - (b + 1) * 65536;
        assert!(
            got[at..at + 65536] == src[b * 65536..(b + 1) * 65536],
            "block {b}"
        );
    }
    drop(conn);
    drop(own);
    drop(reg);
    drop(src);
}
