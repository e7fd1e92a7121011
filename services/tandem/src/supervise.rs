//! The processes of a `tandem up` topology: started in order and waited for, kept serving
//! (a worker or the planner that exits is restarted with backoff), and stopped together. Only
//! the router's exit stops the topology: without it nothing is served.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};

/// How a process is started: its program, arguments and the stdout line that says it is
/// ready.
#[derive(Clone, Debug)]
pub struct Launch {
    pub bin: PathBuf,
    pub args: Vec<String>,
    pub marker: &'static str,
}

/// Whether a process is started again when it exits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnExit {
    Restart,
    /// Its exit stops the topology (the router).
    Stop,
}

/// First wait before a restart; doubled for each restart in a row, up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A process that served this long before exiting starts again from the first backoff.
const STABLE: Duration = Duration::from_secs(60);
/// How often exits are looked for.
const POLL: Duration = Duration::from_millis(200);

struct Member {
    name: String,
    launch: Launch,
    on_exit: OnExit,
    child: Child,
    started: Instant,
    /// Restarts in a row (reset by a stable run).
    restarts: u32,
    /// When it is due to start again after an exit.
    restart_at: Option<Instant>,
}

/// The topology's processes and its discovery folder (removed at the end).
pub struct Topology {
    members: Vec<Member>,
    root: PathBuf,
    ready_timeout: Duration,
}

impl Drop for Topology {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

impl Topology {
    /// An empty topology whose processes discover each other through files under `root`.
    pub fn new(root: PathBuf, ready_timeout: Duration) -> Topology {
        Topology {
            members: Vec::new(),
            root,
            ready_timeout,
        }
    }

    /// Starts `launch` as `name` and waits for its ready line, which it returns.
    pub async fn start(
        &mut self,
        name: &str,
        launch: Launch,
        on_exit: OnExit,
    ) -> anyhow::Result<String> {
        let mut child = spawn(&launch, &self.root)?;
        let out = child.stdout.take().context("child stdout")?;
        self.members.push(Member {
            name: name.to_string(),
            launch: launch.clone(),
            on_exit,
            child,
            started: Instant::now(),
            restarts: 0,
            restart_at: None,
        });
        wait_ready(out, launch.marker, name, self.ready_timeout).await
    }

    /// Keeps the restartable processes running; returns why the topology must stop (a
    /// process that stops it exited).
    pub async fn supervise(&mut self) -> String {
        loop {
            for m in self.members.iter_mut() {
                if let Some(why) = m.check(&self.root, self.ready_timeout) {
                    return why;
                }
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// SIGTERM to every process (workers deregister and drain), then waits for each (killing
    /// one that takes longer than 40 s).
    pub async fn shutdown(mut self) {
        for m in &self.members {
            terminate(&m.child);
        }
        for m in &mut self.members {
            if m.restart_at.is_some() {
                continue;
            }
            match tokio::time::timeout(Duration::from_secs(40), m.child.wait()).await {
                Ok(Ok(status)) => println!("tandem: {} exited ({status})", m.name),
                _ => {
                    println!("tandem: {} did not stop in time; killing it", m.name);
                    let _ = m.child.kill().await;
                }
            }
        }
    }
}

impl Member {
    /// Notices an exit (scheduling the restart, or saying why the topology stops) and
    /// restarts when due.
    fn check(&mut self, root: &Path, ready_timeout: Duration) -> Option<String> {
        if self.restart_at.is_none() {
            let status = self.child.try_wait().ok()??;
            if self.on_exit == OnExit::Stop {
                return Some(format!("{} exited unexpectedly ({status})", self.name));
            }
            if self.started.elapsed() >= STABLE {
                self.restarts = 0;
            }
            let wait = backoff(self.restarts);
            println!(
                "tandem: {} exited unexpectedly ({status}); restarting it in {}s",
                self.name,
                wait.as_secs()
            );
            self.restart_at = Some(Instant::now() + wait);
        }
        if self.restart_at.is_some_and(|at| Instant::now() >= at) {
            self.restart(root, ready_timeout);
        }
        None
    }

    /// Starts the process again; its ready line (or why it never came) is reported in the
    /// background, and a failed start is retried after the next backoff.
    fn restart(&mut self, root: &Path, ready_timeout: Duration) {
        self.restarts += 1;
        self.started = Instant::now();
        let mut child = match spawn(&self.launch, root) {
            Ok(c) => c,
            Err(e) => {
                let wait = backoff(self.restarts);
                println!(
                    "tandem: restarting {}: {e:#}; again in {}s",
                    self.name,
                    wait.as_secs()
                );
                self.restart_at = Some(Instant::now() + wait);
                return;
            }
        };
        self.restart_at = None;
        let name = self.name.clone();
        let marker = self.launch.marker;
        if let Some(out) = child.stdout.take() {
            tokio::spawn(async move {
                match wait_ready(out, marker, &name, ready_timeout).await {
                    Ok(line) => println!("tandem: {name} restarted: {line}"),
                    Err(e) => println!("tandem: {name} did not come back: {e:#}"),
                }
            });
        }
        self.child = child;
    }
}

/// The wait before restart number `restarts + 1` in a row.
fn backoff(restarts: u32) -> Duration {
    FIRST_BACKOFF
        .saturating_mul(1u32 << restarts.min(5))
        .min(MAX_BACKOFF)
}

fn terminate(child: &Child) {
    if let Some(pid) = child.id() {
        // SIGTERM lets workers deregister and drain.
        unsafe {
            libc::kill(pid as i32, libc::SIGTERM);
        }
    }
}

fn spawn(launch: &Launch, discovery_root: &Path) -> anyhow::Result<Child> {
    Command::new(&launch.bin)
        .args(&launch.args)
        // The flags carry the security choice; an inherited variable must not contradict it.
        .env_remove("TANDEM_INTERNAL_TLS_DIR")
        .env_remove("TANDEM_INSECURE_INTERNAL")
        .env("DYN_FILE_KV", discovery_root)
        .env("DYN_DISCOVERY_BACKEND", "file")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("cannot start {}", launch.bin.display()))
}

/// Reads a child's stdout until the line starting with `marker`, echoing everything, then keeps
/// echoing in the background.
async fn wait_ready<R: AsyncRead + Unpin + Send + 'static>(
    out: R,
    marker: &str,
    what: &str,
    timeout: Duration,
) -> anyhow::Result<String> {
    let mut lines = BufReader::new(out).lines();
    let deadline = Instant::now() + timeout;
    loop {
        let line = tokio::time::timeout_at(deadline.into(), lines.next_line())
            .await
            .with_context(|| format!("{what} did not become ready within {}s", timeout.as_secs()))?
            .with_context(|| format!("reading {what}'s output"))?;
        match line {
            Some(l) if l.starts_with(marker) => {
                tokio::spawn(async move {
                    while let Ok(Some(l)) = lines.next_line().await {
                        println!("{l}");
                    }
                });
                return Ok(l);
            }
            Some(l) => println!("{l}"),
            None => bail!("{what} exited before becoming ready (see its log above)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_thirty_seconds() {
        let secs: Vec<u64> = (0..8).map(|n| backoff(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 30, 30, 30]);
    }
}
