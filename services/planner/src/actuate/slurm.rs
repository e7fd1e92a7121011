//! The `slurm` actuator: inside an allocation (`SLURM_JOB_ID`), each worker is a job step
//! started with `srun` on the allocation's node that runs the fewest of the planner's workers,
//! and drained with `scancel --signal=TERM <job>.<step>`. The commands are those of
//! `--local-workers-spec`, with each role's `srun_args` (GPUs, CPUs, output file). A step whose
//! srun is gone is replaced at the next decision like any worker that exited.

use std::collections::BTreeMap;
use std::process::Output;

use tokio::process::Command;

use super::local::{Launcher, LocalSpec, ProcessActuator, Worker, WorkerCommand};
use super::{ActuateError, BoxFuture};
use crate::load::Role;

#[derive(Debug, thiserror::Error)]
pub enum SlurmError {
    #[error("--actuator slurm runs inside a Slurm allocation (sbatch or salloc): SLURM_JOB_ID is not set")]
    NotInAllocation,
    #[error("running `{what}`: {source} (is Slurm's client installed on this node?)")]
    Run {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{what}` failed ({status}): {stderr}")]
    Failed {
        what: String,
        status: std::process::ExitStatus,
        stderr: String,
    },
    #[error("the allocation's node list {0:?} names no node")]
    NoNodes(String),
}

/// In a role's `srun_args`, stands for the step's name (say `--output=logs/{step}.log`; srun's
/// own `%x` is the job's name, not the step's).
const STEP_PLACEHOLDER: &str = "{step}";

/// Runs `program args` and returns its stdout, or what went wrong.
async fn run(program: &str, args: &[&str]) -> Result<String, SlurmError> {
    let what = format!("{program} {}", args.join(" "));
    let Output {
        status,
        stdout,
        stderr,
    } = Command::new(program)
        .args(args)
        .output()
        .await
        .map_err(|source| SlurmError::Run {
            what: what.clone(),
            source,
        })?;
    if !status.success() {
        return Err(SlurmError::Failed {
            what,
            status,
            stderr: String::from_utf8_lossy(&stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&stdout).into_owned())
}

/// Starts workers as job steps of one allocation.
pub struct Srun {
    job_id: String,
    nodes: Vec<String>,
    /// Workers placed per node, by step name.
    placed: BTreeMap<String, String>,
    seq: u64,
}

impl Srun {
    /// The allocation this process runs in, and its nodes.
    pub async fn from_env() -> Result<Srun, SlurmError> {
        let job_id = std::env::var("SLURM_JOB_ID").map_err(|_| SlurmError::NotInAllocation)?;
        let list = std::env::var("SLURM_JOB_NODELIST")
            .or_else(|_| std::env::var("SLURM_NODELIST"))
            .map_err(|_| SlurmError::NotInAllocation)?;
        let nodes: Vec<String> = run("scontrol", &["show", "hostnames", &list])
            .await?
            .split_whitespace()
            .map(str::to_string)
            .collect();
        if nodes.is_empty() {
            return Err(SlurmError::NoNodes(list));
        }
        // scancel and squeue are what draining needs: check them now, not at the first drain.
        run("squeue", &["-h", "-j", &job_id, "-o", "%i"]).await?;
        Ok(Srun::new(job_id, nodes))
    }

    fn new(job_id: String, nodes: Vec<String>) -> Srun {
        Srun {
            job_id,
            nodes,
            placed: BTreeMap::new(),
            seq: 0,
        }
    }

    /// The node with the fewest of our workers (the first such in the node list).
    fn least_loaded(&self) -> &str {
        let count = |n: &String| self.placed.values().filter(|p| *p == n).count();
        self.nodes
            .iter()
            .min_by_key(|n| count(n))
            .map_or("", String::as_str)
    }
}

/// The step id (`<job>.<step>`) named `name` in `squeue -s` output (`%i %j` lines).
fn step_id<'a>(squeue: &'a str, name: &str) -> Option<&'a str> {
    squeue.lines().find_map(|l| {
        let (id, n) = l.trim().split_once(' ')?;
        (n.trim() == name).then_some(id)
    })
}

/// The id of job `job`'s step named `name`, asking squeue a few times: a step just started
/// takes a moment to be listed.
async fn find_step(job: &str, name: &str) -> Option<String> {
    for attempt in 0..10 {
        if attempt > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        }
        match run("squeue", &["-h", "-s", "-j", job, "-o", "%i %j"]).await {
            Ok(listed) => {
                if let Some(id) = step_id(&listed, name) {
                    return Some(id.to_string());
                }
            }
            Err(e) => tracing::warn!("slurm actuator: {e}"),
        }
    }
    None
}

impl Launcher for Srun {
    fn command(&mut self, role: Role, cmd: &WorkerCommand) -> (Command, String) {
        self.seq += 1;
        let name = format!("{}-planner-{}", role.name(), self.seq);
        let node = self.least_loaded().to_string();
        let mut command = Command::new("srun");
        command
            .arg(format!("--jobid={}", self.job_id))
            .args(["--nodes=1", "--ntasks=1"])
            .arg(format!("--nodelist={node}"))
            .arg(format!("--job-name={name}"))
            .arg("--kill-on-bad-exit=1")
            .args(
                cmd.srun_args
                    .iter()
                    .map(|a| a.replace(STEP_PLACEHOLDER, &name)),
            )
            .arg(&cmd.program)
            .args(&cmd.args);
        tracing::info!("slurm actuator: step {name} on {node}");
        self.placed.insert(name.clone(), node);
        (command, name)
    }

    fn terminate(&self, worker: &Worker) -> BoxFuture<'static, ()> {
        let job = self.job_id.clone();
        let step = worker.name.clone();
        let srun = worker.child.id();
        Box::pin(async move {
            let Some(id) = find_step(&job, &step).await else {
                // Never started (or already gone): stopping its srun ends whatever is left.
                tracing::warn!("slurm actuator: step {step} is not in squeue; stopping its srun");
                if let Some(pid) = srun {
                    // SAFETY: kill(2) on the srun this process started and has not reaped.
                    unsafe {
                        libc::kill(pid as i32, libc::SIGTERM);
                    }
                }
                return;
            };
            // Not SIGTERM to srun: srun takes that as "terminate the step" (SIGKILL after
            // KillWait). scancel --signal delivers SIGTERM alone, and the worker drains. Slurm
            // 22.05's scancel exits non-zero ("Invalid job id") after signalling a step, so its
            // status says nothing; a signal that was not delivered ends at the drain timeout.
            match run("scancel", &["--signal=TERM", &id]).await {
                Ok(_) => tracing::info!("slurm actuator: SIGTERM to step {id} ({step})"),
                Err(e) => tracing::info!("slurm actuator: SIGTERM to step {id} ({step}): {e}"),
            }
        })
    }

    fn ended(&mut self, worker: &Worker) {
        self.placed.remove(&worker.name);
    }
}

/// Worker job steps inside the allocation this process runs in.
pub type SlurmActuator = ProcessActuator<Srun>;

impl SlurmActuator {
    pub async fn connect(spec: LocalSpec) -> Result<SlurmActuator, ActuateError> {
        let srun = Srun::from_env().await?;
        tracing::info!(
            "slurm actuator: job {} on nodes {}",
            srun.job_id,
            srun.nodes.join(",")
        );
        Ok(ProcessActuator::with_launcher(spec, srun))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmd() -> WorkerCommand {
        WorkerCommand {
            program: "/opt/tandem/bin/tandem-decode".into(),
            args: vec!["--model-path".into(), "/m".into()],
            env: BTreeMap::new(),
            srun_args: vec!["--overlap".into(), "--output=/logs/{step}.log".into()],
        }
    }

    #[test]
    fn steps_spread_over_the_nodes_and_carry_the_role_options() {
        let mut s = Srun::new("42".into(), vec!["n1".into(), "n2".into()]);
        let (c1, a) = s.command(Role::Decode, &cmd());
        let (_, b) = s.command(Role::Prefill, &cmd());
        let (_, c) = s.command(Role::Decode, &cmd());
        assert_eq!(
            (a.as_str(), b.as_str()),
            ("decode-planner-1", "prefill-planner-2")
        );
        assert_eq!(s.placed[&a], "n1");
        assert_eq!(s.placed[&b], "n2");
        assert_eq!(s.placed[&c], "n1");
        let args: Vec<String> = c1
            .as_std()
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(c1.as_std().get_program(), "srun");
        assert_eq!(
            args,
            [
                "--jobid=42",
                "--nodes=1",
                "--ntasks=1",
                "--nodelist=n1",
                "--job-name=decode-planner-1",
                "--kill-on-bad-exit=1",
                "--overlap",
                "--output=/logs/decode-planner-1.log",
                "/opt/tandem/bin/tandem-decode",
                "--model-path",
                "/m"
            ]
        );
        // A step that ended frees its node: the next one goes there.
        s.placed.remove(&b);
        s.placed.remove(&c);
        let (_, d) = s.command(Role::Decode, &cmd());
        assert_eq!(s.placed[&d], "n2");
    }

    #[test]
    fn the_step_id_is_found_by_name() {
        let out = "42.0 etcd\n42.5 decode-planner-1\n 42.7 decode-planner-11\n";
        assert_eq!(step_id(out, "decode-planner-1"), Some("42.5"));
        assert_eq!(step_id(out, "decode-planner-11"), Some("42.7"));
        assert_eq!(step_id(out, "prefill-planner-1"), None);
    }
}
