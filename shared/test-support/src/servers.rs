//! Real `etcd` and `nats-server` processes on free loopback ports, each in its
//! own temporary folder, killed on drop. Startup waits are bounded and poll readiness.
//!
//! The binaries come from Debian's `etcd-server` and `nats-server` packages (CI installs them),
//! or from `$ETCD_BIN` / `$NATS_SERVER_BIN`. A missing binary is an error that says what to
//! install: tests that need a server fail loudly instead of silently skipping.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::host::{find_binary, free_port, TempDir};

/// How long a server may take to become ready (2 busy cores can make etcd slow to start).
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error(
        "`{binary}` not found (searched ${env_var}, PATH, /usr/sbin, /usr/bin): install the \
         Debian package `{package}` (apt-get install {package}) or set {env_var}"
    )]
    MissingBinary {
        binary: &'static str,
        package: &'static str,
        env_var: &'static str,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{binary} did not become ready within {waited:?}; log tail:\n{log_tail}")]
    NotReady {
        binary: &'static str,
        waited: Duration,
        log_tail: String,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> HarnessError {
    let what = what.into();
    move |source| HarnessError::Io { what, source }
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let start = text.len().saturating_sub(3000);
    // Cut at a char boundary.
    let start = (start..text.len())
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(text.len());
    text[start..].to_string()
}

/// A child process killed (and reaped) on drop.
#[derive(Debug)]
struct Guard {
    child: Child,
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

enum Probe {
    Ready,
    NotYet,
}

/// Spawns `cmd` (output to `log`) and polls `probe` every 50 ms until it is ready, the child
/// exits, or `STARTUP_TIMEOUT` passes.
fn spawn_and_wait(
    binary: &'static str,
    mut cmd: Command,
    log: &Path,
    mut probe: impl FnMut() -> Probe,
) -> Result<Result<Guard, String>, HarnessError> {
    // Append, so a restarted server's log follows the previous run's.
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(io(format!("creating {}", log.display())))?;
    let err = out.try_clone().map_err(io("cloning log handle"))?;
    cmd.stdin(Stdio::null()).stdout(out).stderr(err);
    let child = cmd.spawn().map_err(io(format!("spawning {binary}")))?;
    let mut guard = Guard { child };
    let start = Instant::now();
    loop {
        if let Ok(Some(status)) = guard.child.try_wait() {
            // Most likely lost the race for the port: the caller retries.
            return Ok(Err(format!(
                "{binary} exited with {status}: {}",
                log_tail(log)
            )));
        }
        if let Probe::Ready = probe() {
            return Ok(Ok(guard));
        }
        if start.elapsed() > STARTUP_TIMEOUT {
            return Err(HarnessError::NotReady {
                binary,
                waited: STARTUP_TIMEOUT,
                log_tail: log_tail(log),
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One HTTP/1.0 GET over a plain socket, for readiness probes without an HTTP client crate.
fn http_get(addr: SocketAddr, path: &str) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    Some(body)
}

/// A single-member etcd on loopback.
#[derive(Debug)]
pub struct EtcdServer {
    guard: Option<Guard>,
    bin: PathBuf,
    ports: EtcdPorts,
    dir: TempDir,
    /// The TLS folder whose CA clients must be of (`--client-cert-auth`), if any.
    tls: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy)]
struct EtcdPorts {
    client: u16,
    peer: u16,
    /// Plain-HTTP `/health` (and `/metrics`), probed for readiness even under TLS.
    metrics: u16,
}

impl EtcdServer {
    /// A plaintext etcd.
    pub fn start() -> Result<Self, HarnessError> {
        Self::start_with(None)
    }

    /// An etcd serving TLS with the node certificate of the TLS folder `tls` and accepting
    /// only clients with a certificate of its CA.
    pub fn start_tls(tls: &Path) -> Result<Self, HarnessError> {
        Self::start_with(Some(tls.to_owned()))
    }

    fn start_with(tls: Option<PathBuf>) -> Result<Self, HarnessError> {
        let bin = find_binary("etcd", "ETCD_BIN").ok_or(HarnessError::MissingBinary {
            binary: "etcd",
            package: "etcd-server",
            env_var: "ETCD_BIN",
        })?;
        let dir = TempDir::new("tandem-etcd").map_err(io("creating etcd temp dir"))?;
        let mut last = String::new();
        for _attempt in 0..3 {
            let ports = EtcdPorts {
                client: free_port().map_err(io("finding a free port"))?,
                peer: free_port().map_err(io("finding a free port"))?,
                metrics: free_port().map_err(io("finding a free port"))?,
            };
            match spawn_etcd(&bin, dir.path(), ports, tls.as_deref())? {
                Ok(guard) => {
                    return Ok(Self {
                        guard: Some(guard),
                        bin,
                        ports,
                        dir,
                        tls,
                    })
                }
                Err(why) => last = why,
            }
        }
        Err(HarnessError::NotReady {
            binary: "etcd",
            waited: STARTUP_TIMEOUT,
            log_tail: last,
        })
    }

    /// `http://127.0.0.1:{port}` (`https://` under TLS), for `ETCD_ENDPOINTS`.
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.ports.client)
    }

    pub fn data_dir(&self) -> &Path {
        self.dir.path()
    }

    /// Kills the server now (SIGKILL).
    pub fn kill(&mut self) {
        self.guard.take();
    }

    /// Starts the server again on the same ports and data (after [`EtcdServer::kill`], or
    /// killing it first): an etcd outage as clients see it.
    pub fn restart(&mut self) -> Result<(), HarnessError> {
        self.guard.take();
        match spawn_etcd(&self.bin, self.dir.path(), self.ports, self.tls.as_deref())? {
            Ok(guard) => {
                self.guard = Some(guard);
                Ok(())
            }
            Err(log_tail) => Err(HarnessError::NotReady {
                binary: "etcd",
                waited: STARTUP_TIMEOUT,
                log_tail,
            }),
        }
    }
}

fn spawn_etcd(
    bin: &Path,
    dir: &Path,
    ports: EtcdPorts,
    tls: Option<&Path>,
) -> Result<Result<Guard, String>, HarnessError> {
    let client_port = ports.client;
    let scheme = if tls.is_some() { "https" } else { "http" };
    let client_url = format!("{scheme}://127.0.0.1:{client_port}");
    let peer_url = format!("http://127.0.0.1:{}", ports.peer);
    let mut cmd = Command::new(bin);
    if let Some(tls) = tls {
        cmd.arg("--cert-file")
            .arg(tls.join("node.crt"))
            .arg("--key-file")
            .arg(tls.join("node.key"))
            .arg("--trusted-ca-file")
            .arg(tls.join("ca.crt"))
            .arg("--client-cert-auth");
    }
    cmd.arg("--listen-metrics-urls")
        .arg(format!("http://127.0.0.1:{}", ports.metrics));
    cmd.arg("--name")
        .arg("tandem-test")
        .arg("--data-dir")
        .arg(dir.join(format!("data-{client_port}")))
        .arg("--listen-client-urls")
        .arg(&client_url)
        .arg("--advertise-client-urls")
        .arg(&client_url)
        .arg("--listen-peer-urls")
        .arg(&peer_url)
        .arg("--initial-advertise-peer-urls")
        .arg(&peer_url)
        .arg("--initial-cluster")
        .arg(format!("tandem-test={peer_url}"))
        .arg("--log-level")
        .arg("warn")
        .arg("--logger")
        .arg("zap");
    let addr = SocketAddr::from(([127, 0, 0, 1], ports.metrics));
    let log = dir.join(format!("etcd-{client_port}.log"));
    let probe = || match http_get(addr, "/health") {
        Some(body) if body.contains("\"health\":\"true\"") => Probe::Ready,
        _ => Probe::NotYet,
    };
    spawn_and_wait("etcd", cmd, &log, probe)
}

/// A plain (no JetStream) nats-server on loopback.
#[derive(Debug)]
pub struct NatsServer {
    guard: Option<Guard>,
    port: u16,
    tls: bool,
    _dir: TempDir,
}

impl NatsServer {
    /// A plaintext nats-server.
    pub fn start() -> Result<Self, HarnessError> {
        Self::start_with(None)
    }

    /// A nats-server requiring TLS with a client certificate of the TLS folder `tls`'s CA,
    /// serving its node certificate (which must name 127.0.0.1).
    pub fn start_tls(tls: &Path) -> Result<Self, HarnessError> {
        Self::start_with(Some(tls))
    }

    fn start_with(tls: Option<&Path>) -> Result<Self, HarnessError> {
        let bin =
            find_binary("nats-server", "NATS_SERVER_BIN").ok_or(HarnessError::MissingBinary {
                binary: "nats-server",
                package: "nats-server",
                env_var: "NATS_SERVER_BIN",
            })?;
        let dir = TempDir::new("tandem-nats").map_err(io("creating nats temp dir"))?;
        let mut last = String::new();
        for _attempt in 0..3 {
            let port = free_port().map_err(io("finding a free port"))?;
            let mut cmd = Command::new(&bin);
            cmd.arg("-a")
                .arg("127.0.0.1")
                .arg("-p")
                .arg(port.to_string());
            if let Some(tls) = tls {
                cmd.arg("--tlsverify")
                    .arg("--tlscert")
                    .arg(tls.join("node.crt"))
                    .arg("--tlskey")
                    .arg(tls.join("node.key"))
                    .arg("--tlscacert")
                    .arg(tls.join("ca.crt"));
            }
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            let log = dir.path().join(format!("nats-{port}.log"));
            // Ready when the server greets a new connection with its INFO line.
            let probe = || {
                let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(500))
                else {
                    return Probe::NotYet;
                };
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let mut buf = [0u8; 5];
                match s.read_exact(&mut buf) {
                    Ok(()) if &buf == b"INFO " => Probe::Ready,
                    _ => Probe::NotYet,
                }
            };
            match spawn_and_wait("nats-server", cmd, &log, probe)? {
                Ok(guard) => {
                    return Ok(Self {
                        guard: Some(guard),
                        port,
                        tls: tls.is_some(),
                        _dir: dir,
                    })
                }
                Err(why) => last = why,
            }
        }
        Err(HarnessError::NotReady {
            binary: "nats-server",
            waited: STARTUP_TIMEOUT,
            log_tail: last,
        })
    }

    /// `nats://127.0.0.1:{port}` (`tls://` under TLS), for `NATS_SERVER`.
    pub fn url(&self) -> String {
        let scheme = if self.tls { "tls" } else { "nats" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    pub fn kill(&mut self) {
        self.guard.take();
    }
}
