//! A TCP fault proxy for fault drills: it relays connections from a listen address to a
//! target, and while a fault is on it delays what it relays (latency), holds some chunks for a
//! retransmission timeout (loss, as TCP shows it to the application: late bytes, in order), or
//! relays nothing at all (a partition: connections stay open and silent). Used where the
//! kernel's `netem` is not available; `tandem-faultproxy` is its command line.
//!
//! The fault can change at run time: [`FaultSwitch`] is read per chunk, and the command line
//! points it at a file whose presence (and content) turns the fault on.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// What the proxy does to the bytes it relays, in both directions.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Fault {
    /// Added to every chunk's delivery.
    pub latency: Duration,
    /// Fraction of chunks, in [0, 1], held another `rto` (a lost segment resent).
    pub loss: f64,
    /// The hold of a lost chunk.
    pub rto: Duration,
    /// Relay nothing until the fault changes (bytes wait, in order).
    pub blackhole: bool,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum FaultError {
    #[error("fault spec {0:?}: expected KEY=VALUE pairs (latency_ms, loss, rto_ms, blackhole)")]
    Syntax(String),
    #[error("fault spec: {key} = {value:?} is not valid ({why})")]
    Value {
        key: String,
        value: String,
        why: &'static str,
    },
}

impl Fault {
    /// Parses `latency_ms=50 loss=0.02 rto_ms=200 blackhole=1` (any subset, any order,
    /// whitespace or comma separated); the empty spec is no fault.
    pub fn parse(spec: &str) -> Result<Fault, FaultError> {
        let mut f = Fault {
            rto: Duration::from_millis(200),
            ..Fault::default()
        };
        for pair in spec.split([' ', ',', '\n', '\t']).filter(|p| !p.is_empty()) {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| FaultError::Syntax(pair.to_string()))?;
            let bad = |why| FaultError::Value {
                key: key.to_string(),
                value: value.to_string(),
                why,
            };
            let ms = || value.parse::<u64>().map(Duration::from_millis);
            match key {
                "latency_ms" => f.latency = ms().map_err(|_| bad("milliseconds"))?,
                "rto_ms" => f.rto = ms().map_err(|_| bad("milliseconds"))?,
                "loss" => {
                    f.loss = value
                        .parse::<f64>()
                        .ok()
                        .filter(|p| (0.0..=1.0).contains(p))
                        .ok_or_else(|| bad("a fraction in [0, 1]"))?
                }
                "blackhole" => f.blackhole = matches!(value, "1" | "true" | "on"),
                _ => return Err(FaultError::Syntax(pair.to_string())),
            }
        }
        Ok(f)
    }

    /// When a chunk read at `now` is delivered, given the previous chunk's delivery (order is
    /// kept) and a uniform draw in [0, 1).
    fn release(&self, now: Instant, previous: Instant, draw: f64) -> Instant {
        let mut at = now + self.latency;
        if draw < self.loss {
            at += self.rto;
        }
        at.max(previous)
    }
}

/// The fault in force, shared by every connection of a proxy.
#[derive(Clone, Default)]
pub struct FaultSwitch(Arc<Mutex<Fault>>);

impl FaultSwitch {
    pub fn set(&self, f: Fault) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = f;
    }

    pub fn get(&self) -> Fault {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Relays every connection accepted on `listener` to `target` under `switch`'s fault, until
/// the task is dropped.
pub async fn serve(listener: TcpListener, target: SocketAddr, switch: FaultSwitch) {
    let mut seed = 0x5EED_u64;
    loop {
        let client = match listener.accept().await {
            Ok((client, _)) => client,
            Err(e) => {
                // Out of descriptors, say: pause instead of spinning on the error.
                tracing::warn!("fault proxy: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        seed = tandem_rng::splitmix64(&mut seed);
        let switch = switch.clone();
        tokio::spawn(async move {
            match TcpStream::connect(target).await {
                Ok(server) => relay(client, server, switch, seed).await,
                Err(e) => tracing::warn!(%target, "fault proxy: cannot reach the target: {e}"),
            }
        });
    }
}

async fn relay(client: TcpStream, server: TcpStream, switch: FaultSwitch, seed: u64) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    tokio::join!(
        pump(cr, sw, switch.clone(), seed),
        pump(sr, cw, switch, seed ^ tandem_rng::GOLDEN_GAMMA)
    );
}

/// One direction: reads chunks, and a writer task delivers each at its release time.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    switch: FaultSwitch,
    mut seed: u64,
) {
    let (tx, mut rx) = mpsc::channel::<(Instant, Vec<u8>)>(1024);
    let writer = tokio::spawn({
        let switch = switch.clone();
        async move {
            while let Some((at, chunk)) = rx.recv().await {
                tokio::time::sleep_until(at).await;
                // A partition holds everything, in order, until it heals.
                while switch.get().blackhole {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                if to.write_all(&chunk).await.is_err() {
                    return;
                }
            }
            let _ = to.shutdown().await;
        }
    });
    let mut previous = Instant::now();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let draw = tandem_rng::unit_f64(tandem_rng::splitmix64(&mut seed));
        previous = switch.get().release(Instant::now(), previous, draw);
        if tx.send((previous, buf[..n].to_vec())).await.is_err() {
            break;
        }
    }
    drop(tx);
    let _ = writer.await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sends "ping" and reads it back; the time it took.
    async fn round_trip(c: &mut TcpStream) -> std::time::Duration {
        let t = std::time::Instant::now();
        c.write_all(b"ping").await.unwrap();
        let mut b = [0u8; 4];
        c.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"ping");
        t.elapsed()
    }

    #[test]
    fn specs_parse_and_bad_ones_are_named() {
        let f = Fault::parse("latency_ms=50, loss=0.02 rto_ms=300").unwrap();
        assert_eq!(f.latency, Duration::from_millis(50));
        assert_eq!(f.loss, 0.02);
        assert_eq!(f.rto, Duration::from_millis(300));
        assert!(!f.blackhole);
        assert!(Fault::parse("blackhole=1").unwrap().blackhole);
        assert_eq!(Fault::parse("").unwrap().latency, Duration::ZERO);
        assert!(matches!(
            Fault::parse("loss=2"),
            Err(FaultError::Value { .. })
        ));
        assert!(matches!(
            Fault::parse("jitter=3"),
            Err(FaultError::Syntax(_))
        ));
        assert!(matches!(
            Fault::parse("latency_ms"),
            Err(FaultError::Syntax(_))
        ));
    }

    #[test]
    fn releases_keep_order_and_add_the_hold_of_a_loss() {
        let f = Fault::parse("latency_ms=10 loss=0.5 rto_ms=100").unwrap();
        let t0 = Instant::now();
        let kept = f.release(t0, t0, 0.9);
        assert_eq!(kept, t0 + Duration::from_millis(10));
        let lost = f.release(t0, t0, 0.1);
        assert_eq!(lost, t0 + Duration::from_millis(110));
        // A chunk read after a lost one is not delivered before it.
        assert_eq!(f.release(t0 + Duration::from_millis(1), lost, 0.9), lost);
    }

    #[tokio::test]
    async fn relays_both_ways_with_the_latency_in_force() {
        let echo = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = echo.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = echo.accept().await {
                tokio::spawn(async move {
                    let mut b = [0u8; 1024];
                    while let Ok(n) = s.read(&mut b).await {
                        if n == 0 || s.write_all(&b[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let switch = FaultSwitch::default();
        tokio::spawn(serve(listener, target, switch.clone()));
        let mut c = TcpStream::connect(addr).await.unwrap();
        round_trip(&mut c).await;
        switch.set(Fault::parse("latency_ms=100").unwrap());
        // Both directions are delayed: at least 200 ms for the round trip.
        assert!(round_trip(&mut c).await >= Duration::from_millis(200));
        switch.set(Fault::parse("blackhole=1").unwrap());
        c.write_all(b"held").await.unwrap();
        let mut b = [0u8; 4];
        let held = tokio::time::timeout(Duration::from_millis(300), c.read_exact(&mut b)).await;
        assert!(held.is_err(), "a partition relays nothing");
        switch.set(Fault::default());
        c.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"held", "held bytes arrive, in order, once it heals");
    }
}
