//! What applies the planner's decisions, behind one trait: [`VirtualActuator`] (records them,
//! for simulation and dry runs of a whole deployment), [`LocalActuator`] (worker processes on
//! this machine), [`DockerActuator`] (the replicas of Docker Compose services, through the
//! Docker Engine API) and [`SlurmActuator`] (worker job steps inside a Slurm allocation).
//! Scaling down always drains: the worker gets SIGTERM, deregisters, and finishes its
//! in-flight requests before it exits.

mod docker;
mod local;
mod slurm;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;

use crate::load::Role;

pub use docker::{ComposeServices, DockerActuator, DockerError};
pub use local::{
    Direct, Launcher, LocalActuator, LocalSpec, ProcessActuator, Worker, WorkerCommand,
};
pub use slurm::{SlurmActuator, SlurmError};

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
    #[error("the {0} worker's srun_args apply to --actuator slurm only; the local actuator would ignore them")]
    SrunArgsLocal(&'static str),
    #[error(transparent)]
    Docker(#[from] DockerError),
    #[error(transparent)]
    Slurm(#[from] SlurmError),
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
