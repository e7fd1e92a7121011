//! Worker processes the planner starts and drains: [`LocalActuator`] runs them on this
//! machine; the Slurm actuator runs the same commands as job steps, through a [`Launcher`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde::Deserialize;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinSet;

use super::{ActuateError, Actuator, Applied, BoxFuture};
use crate::load::Role;

/// How to start one role's worker.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WorkerCommand {
    pub program: PathBuf,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// `--actuator slurm` only: options of the `srun` that runs the worker as a job step
    /// (say `--gpus-per-task=1`, `--output=logs/{step}.log`: `{step}` is the step's name).
    #[serde(default)]
    pub srun_args: Vec<String>,
}

fn default_drain_secs() -> u64 {
    40
}

/// The `--local-workers-spec` file (the `local` and `slurm` actuators).
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

    /// [`LocalSpec::check`], and no `srun_args` (they would be silently ignored).
    pub fn check_local(&self, roles: &[Role]) -> Result<(), ActuateError> {
        self.check(roles)?;
        for r in roles {
            if !self.command(*r)?.srun_args.is_empty() {
                return Err(ActuateError::SrunArgsLocal(r.name()));
            }
        }
        Ok(())
    }
}

/// How a worker's process is started and asked to drain.
pub trait Launcher: Send + 'static {
    /// The command that runs `cmd` as a `role` worker, and the worker's name in logs (its job
    /// step's name under Slurm).
    fn command(&mut self, role: Role, cmd: &WorkerCommand) -> (Command, String);

    /// Asks `worker` to drain: SIGTERM to the worker (not to a launcher between).
    fn terminate(&self, worker: &Worker) -> BoxFuture<'static, ()>;

    /// `worker` exited or is draining: whatever it held is free.
    fn ended(&mut self, _worker: &Worker) {}
}

/// Runs the worker directly, as a child of the planner.
#[derive(Debug, Default)]
pub struct Direct;

impl Launcher for Direct {
    fn command(&mut self, role: Role, cmd: &WorkerCommand) -> (Command, String) {
        let mut command = Command::new(&cmd.program);
        command.args(&cmd.args);
        (command, role.name().to_string())
    }

    fn terminate(&self, worker: &Worker) -> BoxFuture<'static, ()> {
        if let Some(pid) = worker.child.id() {
            // SAFETY: kill(2) on a child this process started and has not reaped.
            unsafe {
                libc::kill(pid as i32, libc::SIGTERM);
            }
        }
        Box::pin(async {})
    }
}

/// A started worker.
pub struct Worker {
    pub child: Child,
    /// The launcher's name for it (the job step's name under Slurm).
    pub name: String,
}

/// Worker processes started through a [`Launcher`].
pub struct ProcessActuator<L: Launcher> {
    spec: LocalSpec,
    launcher: L,
    running: BTreeMap<Role, Vec<Worker>>,
    draining: JoinSet<()>,
}

/// Worker processes on this machine.
pub type LocalActuator = ProcessActuator<Direct>;

impl LocalActuator {
    pub fn new(spec: LocalSpec) -> LocalActuator {
        ProcessActuator::with_launcher(spec, Direct)
    }
}

impl<L: Launcher> ProcessActuator<L> {
    pub fn with_launcher(spec: LocalSpec, launcher: L) -> ProcessActuator<L> {
        ProcessActuator {
            spec,
            launcher,
            running: BTreeMap::new(),
            draining: JoinSet::new(),
        }
    }

    /// Forgets workers that exited by themselves (they are restarted by the next decision).
    fn reap(&mut self) {
        let launcher = &mut self.launcher;
        for (role, workers) in self.running.iter_mut() {
            workers.retain_mut(|w| match w.child.try_wait() {
                Ok(Some(status)) => {
                    tracing::warn!(
                        "{} worker {} exited by itself ({status})",
                        role.name(),
                        w.name
                    );
                    launcher.ended(w);
                    false
                }
                _ => true,
            });
        }
        while self.draining.try_join_next().is_some() {}
    }

    fn start(&mut self, role: Role) -> Result<(), ActuateError> {
        let cmd = self.spec.command(role)?.clone();
        let (mut command, name) = self.launcher.command(role, &cmd);
        // SAFETY: prctl(2) only, between fork and exec: a worker (or its srun) whose planner
        // dies, even by SIGKILL, gets SIGTERM and drains instead of running on unmanaged.
        #[cfg(target_os = "linux")]
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let mut child = command
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
            let tag = format!("{} worker {name}", role.name());
            let tag = format!("{tag} (pid {})", child.id().unwrap_or(0));
            tokio::spawn(async move {
                let mut lines = BufReader::new(out).lines();
                while let Ok(Some(l)) = lines.next_line().await {
                    tracing::info!("{tag}: {l}");
                }
            });
        }
        tracing::info!(
            "started {} worker {name} (pid {})",
            role.name(),
            child.id().unwrap_or(0)
        );
        self.running
            .entry(role)
            .or_default()
            .push(Worker { child, name });
        Ok(())
    }

    /// SIGTERM, then wait for the drain to end (SIGKILL past the drain timeout).
    fn drain(&mut self, role: Role, mut worker: Worker) {
        let terminate = self.launcher.terminate(&worker);
        self.launcher.ended(&worker);
        let limit = Duration::from_secs(self.spec.drain_timeout_secs);
        let role = role.name();
        self.draining.spawn(async move {
            terminate.await;
            let name = &worker.name;
            match tokio::time::timeout(limit, worker.child.wait()).await {
                Ok(Ok(status)) => tracing::info!("{role} worker {name} drained ({status})"),
                _ => {
                    tracing::warn!(
                        "{role} worker {name} still running {}s after SIGTERM; killing it",
                        limit.as_secs()
                    );
                    let _ = worker.child.kill().await;
                }
            }
        });
    }

    /// How many workers of `role` run now (the Slurm launcher spreads them by node).
    pub fn running(&self, role: Role) -> usize {
        self.running.get(&role).map_or(0, Vec::len)
    }
}

impl<L: Launcher> Actuator for ProcessActuator<L> {
    fn scale(&mut self, role: Role, replicas: u32) -> BoxFuture<'_, Result<Applied, ActuateError>> {
        Box::pin(async move {
            self.reap();
            let have = self.running(role);
            let want = replicas as usize;
            if want == have {
                return Ok(Applied::Unchanged);
            }
            for _ in have..want {
                self.start(role)?;
            }
            if want < have {
                // The newest go first: the oldest hold the warmest prefix caches.
                let surplus = self
                    .running
                    .get_mut(&role)
                    .map(|w| w.split_off(want))
                    .unwrap_or_default();
                for worker in surplus.into_iter().rev() {
                    self.drain(role, worker);
                }
            }
            Ok(Applied::Changed)
        })
    }

    fn replicas(&self, _role: Role) -> Option<u32> {
        None
    }

    fn shutdown(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let all: Vec<(Role, Worker)> = std::mem::take(&mut self.running)
                .into_iter()
                .flat_map(|(r, ws)| ws.into_iter().map(move |w| (r, w)))
                .collect();
            for (role, worker) in all {
                self.drain(role, worker);
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
        assert!(spec.check_local(&[Role::Decode]).is_ok());
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
        let srun: LocalSpec = serde_json::from_str(
            r#"{"decode": {"program": "/bin/true", "srun_args": ["--gpus-per-task=1"]}}"#,
        )
        .unwrap();
        assert!(srun.check(&[Role::Decode]).is_ok());
        assert!(matches!(
            srun.check_local(&[Role::Decode]),
            Err(ActuateError::SrunArgsLocal("decode"))
        ));
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
                srun_args: vec![],
            }),
            agg: None,
            drain_timeout_secs: 10,
        };
        let mut a = LocalActuator::new(spec);
        assert_eq!(a.scale(Role::Decode, 2).await.unwrap(), Applied::Changed);
        assert_eq!(a.running[&Role::Decode].len(), 2);
        // Already there (one of them may be draining after an outside SIGTERM): nothing to do,
        // and the planner is told so.
        assert_eq!(a.scale(Role::Decode, 2).await.unwrap(), Applied::Unchanged);
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
