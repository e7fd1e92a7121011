//! What applies the planner's decisions, behind one trait: [`VirtualActuator`] (records them,
//! for simulation and dry runs of a whole deployment) and [`LocalActuator`] (worker processes
//! on this machine). Scaling down always drains: the worker gets SIGTERM, deregisters, and
//! finishes its in-flight requests before it exits.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::Stdio;
use std::time::Duration;

use serde::Deserialize;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinSet;

use crate::load::Role;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

#[derive(Debug, thiserror::Error)]
pub enum ActuateError {
    #[error("cannot read the local workers spec {path}: {source}")]
    SpecIo {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the local workers spec {path} is not valid: {source}")]
    SpecJson {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("the local workers spec has no command for the {0} role")]
    NoCommand(&'static str),
    #[error("worker program {0} does not exist or is not a file")]
    NoProgram(PathBuf),
    #[error("starting a {role} worker ({program}): {source}")]
    Spawn {
        role: &'static str,
        program: String,
        #[source]
        source: std::io::Error,
    },
}

/// Applies replica counts.
pub trait Actuator: Send {
    /// Brings `role` to `replicas`; returns once the change is under way (new workers
    /// starting, surplus ones draining), not when it has landed: the planner sees that in
    /// discovery.
    fn scale(&mut self, role: Role, replicas: u32) -> BoxFuture<'_, Result<(), ActuateError>>;

    /// The replicas this actuator believes `role` has, when it is the only source of truth
    /// (the virtual actuator); `None` to use what discovery shows.
    fn replicas(&self, role: Role) -> Option<u32>;

    /// Stops what this actuator started (draining), at the planner's exit.
    fn shutdown(&mut self) -> BoxFuture<'_, ()>;
}

/// Decisions only: the replicas it was told, nothing started.
#[derive(Debug, Default)]
pub struct VirtualActuator {
    replicas: BTreeMap<Role, u32>,
}

impl Actuator for VirtualActuator {
    fn scale(&mut self, role: Role, replicas: u32) -> BoxFuture<'_, Result<(), ActuateError>> {
        self.replicas.insert(role, replicas);
        Box::pin(async { Ok(()) })
    }
    fn replicas(&self, role: Role) -> Option<u32> {
        Some(self.replicas.get(&role).copied().unwrap_or(0))
    }
    fn shutdown(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}

/// How to start one role's worker.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WorkerCommand {
    pub program: PathBuf,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

fn default_drain_secs() -> u64 {
    40
}

/// The `--local-workers-spec` file.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LocalSpec {
    pub prefill: Option<WorkerCommand>,
    pub decode: Option<WorkerCommand>,
    pub agg: Option<WorkerCommand>,
    /// How long a draining worker may take before it is killed.
    #[serde(default = "default_drain_secs")]
    pub drain_timeout_secs: u64,
}

impl LocalSpec {
    pub fn load(path: &Path) -> Result<LocalSpec, ActuateError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ActuateError::SpecIo {
            path: p.clone(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|source| ActuateError::SpecJson { path: p, source })
    }

    pub fn command(&self, role: Role) -> Result<&WorkerCommand, ActuateError> {
        match role {
            Role::Prefill => self.prefill.as_ref(),
            Role::Decode => self.decode.as_ref(),
            Role::Aggregated => self.agg.as_ref(),
        }
        .ok_or(ActuateError::NoCommand(role.name()))
    }

    /// Every role in `roles` has a command whose program exists (checked at start).
    pub fn check(&self, roles: &[Role]) -> Result<(), ActuateError> {
        for r in roles {
            let c = self.command(*r)?;
            if !c.program.is_file() {
                return Err(ActuateError::NoProgram(c.program.clone()));
            }
        }
        Ok(())
    }
}

/// Worker processes on this machine.
pub struct LocalActuator {
    spec: LocalSpec,
    running: BTreeMap<Role, Vec<Child>>,
    draining: JoinSet<()>,
}

impl LocalActuator {
    pub fn new(spec: LocalSpec) -> LocalActuator {
        LocalActuator {
            spec,
            running: BTreeMap::new(),
            draining: JoinSet::new(),
        }
    }

    /// Forgets workers that exited by themselves (they are restarted by the next decision).
    fn reap(&mut self) {
        for (role, children) in self.running.iter_mut() {
            children.retain_mut(|c| match c.try_wait() {
                Ok(Some(status)) => {
                    tracing::warn!("a {} worker exited by itself ({status})", role.name());
                    false
                }
                _ => true,
            });
        }
        while self.draining.try_join_next().is_some() {}
    }

    fn start(&mut self, role: Role) -> Result<(), ActuateError> {
        let cmd = self.spec.command(role)?;
        let mut command = Command::new(&cmd.program);
        // SAFETY: prctl(2) only, between fork and exec: a worker whose planner dies (even by
        // SIGKILL) gets SIGTERM and drains instead of running on unmanaged.
        #[cfg(target_os = "linux")]
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let mut child = command
            .args(&cmd.args)
            .envs(&cmd.env)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| ActuateError::Spawn {
                role: role.name(),
                program: cmd.program.display().to_string(),
                source,
            })?;
        // Relay the worker's stdout (its READY line included) to the planner's log.
        if let Some(out) = child.stdout.take() {
            let tag = format!("{} worker {}", role.name(), child.id().unwrap_or(0));
            tokio::spawn(async move {
                let mut lines = BufReader::new(out).lines();
                while let Ok(Some(l)) = lines.next_line().await {
                    tracing::info!("{tag}: {l}");
                }
            });
        }
        tracing::info!(
            "started a {} worker (pid {})",
            role.name(),
            child.id().unwrap_or(0)
        );
        self.running.entry(role).or_default().push(child);
        Ok(())
    }

    /// SIGTERM, then wait for the drain to end (SIGKILL past the drain timeout).
    fn drain(&mut self, role: Role, mut child: Child) {
        let pid = child.id();
        if let Some(pid) = pid {
            // SAFETY: kill(2) on a child this process started and has not reaped.
            unsafe {
                libc::kill(pid as i32, libc::SIGTERM);
            }
        }
        let limit = Duration::from_secs(self.spec.drain_timeout_secs);
        let name = role.name();
        self.draining.spawn(async move {
            match tokio::time::timeout(limit, child.wait()).await {
                Ok(Ok(status)) => tracing::info!("{name} worker {pid:?} drained ({status})"),
                _ => {
                    tracing::warn!(
                        "{name} worker {pid:?} still running {}s after SIGTERM; killing it",
                        limit.as_secs()
                    );
                    let _ = child.kill().await;
                }
            }
        });
    }
}

impl Actuator for LocalActuator {
    fn scale(&mut self, role: Role, replicas: u32) -> BoxFuture<'_, Result<(), ActuateError>> {
        Box::pin(async move {
            self.reap();
            let have = self.running.get(&role).map_or(0, Vec::len);
            let want = replicas as usize;
            for _ in have..want {
                self.start(role)?;
            }
            if want < have {
                // The newest go first: the oldest hold the warmest prefix caches.
                let surplus = self
                    .running
                    .get_mut(&role)
                    .map(|c| c.split_off(want))
                    .unwrap_or_default();
                for child in surplus.into_iter().rev() {
                    self.drain(role, child);
                }
            }
            Ok(())
        })
    }

    fn replicas(&self, _role: Role) -> Option<u32> {
        None
    }

    fn shutdown(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let all: Vec<(Role, Child)> = std::mem::take(&mut self.running)
                .into_iter()
                .flat_map(|(r, cs)| cs.into_iter().map(move |c| (r, c)))
                .collect();
            for (role, child) in all {
                self.drain(role, child);
            }
            while self.draining.join_next().await.is_some() {}
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spec_names_what_is_missing() {
        let spec: LocalSpec = serde_json::from_str(
            r#"{"decode": {"program": "/bin/true", "args": ["-x"], "env": {"A": "1"}}}"#,
        )
        .unwrap();
        assert_eq!(spec.drain_timeout_secs, 40);
        assert!(spec.check(&[Role::Decode]).is_ok());
        assert!(matches!(
            spec.check(&[Role::Prefill]),
            Err(ActuateError::NoCommand("prefill"))
        ));
        let bad: LocalSpec =
            serde_json::from_str(r#"{"agg": {"program": "/no/such/worker"}}"#).unwrap();
        assert!(matches!(
            bad.check(&[Role::Aggregated]),
            Err(ActuateError::NoProgram(_))
        ));
        assert!(serde_json::from_str::<LocalSpec>(r#"{"decoder": {}}"#).is_err());
    }

    #[tokio::test]
    async fn local_workers_start_and_drain_on_sigterm() {
        // `sleep` stands in for a worker: it ends on SIGTERM like a drained one.
        let spec = LocalSpec {
            prefill: None,
            decode: Some(WorkerCommand {
                program: "/bin/sleep".into(),
                args: vec!["30".into()],
                env: BTreeMap::new(),
            }),
            agg: None,
            drain_timeout_secs: 10,
        };
        let mut a = LocalActuator::new(spec);
        a.scale(Role::Decode, 2).await.unwrap();
        assert_eq!(a.running[&Role::Decode].len(), 2);
        a.scale(Role::Decode, 1).await.unwrap();
        assert_eq!(a.running[&Role::Decode].len(), 1);
        let drained = tokio::time::timeout(Duration::from_secs(10), a.draining.join_next())
            .await
            .expect("the surplus worker ends on SIGTERM");
        assert!(drained.is_some());
        a.shutdown().await;
        assert!(a.running.is_empty());
    }
}
