//! The workspace's binaries as child processes: spawned with stdout piped, awaited (bounded)
//! until they print their ready lines (`TANDEM_WORKER_READY ...`, `TANDEM_ROUTER_READY ...`),
//! killed and reaped on drop.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long a process may take to print its ready lines (the tiny model is built on first
/// use; 2 busy cores make that slow).
pub const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// A child process, killed and reaped on drop, with the ready lines it printed.
pub struct Proc {
    pub child: Child,
    /// The lines that started with the ready marker, in order.
    pub ready_lines: Vec<String>,
}

impl Proc {
    /// The first ready line.
    pub fn ready_line(&self) -> &str {
        &self.ready_lines[0]
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Spawns `cmd` and waits (bounded by [`READY_TIMEOUT`]) for a stdout line starting with
/// `marker`. Panics when none comes: this is test code.
pub fn spawn_ready(cmd: &mut Command, marker: &'static str) -> Proc {
    spawn_ready_n(cmd, marker, 1)
}

/// Spawns `cmd` and waits (bounded by [`READY_TIMEOUT`]) for `count` stdout lines starting
/// with `marker` (one per worker of a multi-worker process). Stdout keeps being drained
/// afterwards so that the child never blocks on a full pipe; stderr is discarded.
pub fn spawn_ready_n(cmd: &mut Command, marker: &'static str, count: usize) -> Proc {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut sent = 0;
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if sent < count && line.starts_with(marker) {
                let _ = tx.send(line);
                sent += 1;
            }
        }
    });
    let mut proc = Proc {
        child,
        ready_lines: Vec::with_capacity(count),
    };
    let deadline = Instant::now() + READY_TIMEOUT;
    while proc.ready_lines.len() < count {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => proc.ready_lines.push(line),
            // Dropping `proc` kills the child.
            Err(_) => panic!(
                "{} of {count} {marker} lines within {READY_TIMEOUT:?}",
                proc.ready_lines.len()
            ),
        }
    }
    proc
}

/// The value of `key` (e.g. `"http="`) in a ready line of `key=value` words.
pub fn field(line: &str, key: &str) -> String {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key))
        .unwrap_or_else(|| panic!("{key} missing in {line:?}"))
        .to_string()
}

/// The binary `name` next to `exe` (another package's binary in the same target folder,
/// e.g. beside `env!("CARGO_BIN_EXE_tandem-router")`); panics, saying how to build it, when
/// it is missing.
pub fn sibling_bin(exe: &str, name: &str) -> PathBuf {
    let path = Path::new(exe).with_file_name(name);
    assert!(
        path.is_file(),
        "{} is missing: build it first (`cargo build -p {name}`; scripts/test builds every \
         binary)",
        path.display()
    );
    path
}
