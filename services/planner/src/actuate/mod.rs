//! What applies the planner's decisions, behind one trait: [`VirtualActuator`] (records them,
//! for simulation and dry runs of a whole deployment), [`LocalActuator`] (worker processes on
//! this machine), [`DockerActuator`] (the replicas of Docker Compose services, through the
//! Docker Engine API) and [`SlurmActuator`] (worker job steps inside a Slurm allocation).
//! Scaling down always drains: the worker gets SIGTERM, deregisters, and finishes its
//! in-flight requests before it exits.

mod docker;
#[cfg(feature = "kubernetes")]
mod kubernetes;
mod local;
mod slurm;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;

use crate::load::Role;

pub use docker::{DockerActuator, DockerError};
#[cfg(feature = "kubernetes")]
pub use kubernetes::{KubeError, KubernetesActuator};
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
    #[error("{flag} {text:?}: expected role=name pairs (roles prefill, decode, agg)")]
    BadRoleNames { flag: &'static str, text: String },
    #[error("{flag} names nothing for the {role} role")]
    NoRoleName {
        flag: &'static str,
        role: &'static str,
    },
    #[error(transparent)]
    Docker(#[from] DockerError),
    #[cfg(feature = "kubernetes")]
    #[error(transparent)]
    Kube(#[from] KubeError),
    #[error(transparent)]
    Slurm(#[from] SlurmError),
}

/// What each role is called where an actuator scales it: the Compose service
/// (`--compose-services`) or the Deployment (`--kubernetes-deployments`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoleNames {
    flag: &'static str,
    names: BTreeMap<Role, String>,
}

impl RoleNames {
    /// `prefill=prefill,decode=decode,agg=worker`, as given to `flag`.
    pub fn parse(flag: &'static str, text: &str) -> Result<RoleNames, ActuateError> {
        let bad = || ActuateError::BadRoleNames {
            flag,
            text: text.to_string(),
        };
        let mut names = BTreeMap::new();
        for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (role, name) = pair.split_once('=').ok_or_else(bad)?;
            let role = match role.trim() {
                "prefill" => Role::Prefill,
                "decode" => Role::Decode,
                "agg" => Role::Aggregated,
                _ => return Err(bad()),
            };
            let name = name.trim();
            if name.is_empty() {
                return Err(bad());
            }
            names.insert(role, name.to_string());
        }
        Ok(RoleNames { flag, names })
    }

    pub fn of(&self, role: Role) -> Result<&str, ActuateError> {
        self.names
            .get(&role)
            .map(String::as_str)
            .ok_or(ActuateError::NoRoleName {
                flag: self.flag,
                role: role.name(),
            })
    }
}

/// What a scale request did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// Workers are starting or draining (or the orchestrator was told to).
    Changed,
    /// The actuator already runs that many: some of them are not in discovery (a worker
    /// still draining after an outside SIGTERM, say). The planner decides afresh next time.
    Unchanged,
}

/// Applies replica counts.
pub trait Actuator: Send {
    /// Brings `role` to `replicas`; returns once the change is under way (new workers
    /// starting, surplus ones draining), not when it has landed: the planner sees that in
    /// discovery.
    fn scale(&mut self, role: Role, replicas: u32) -> BoxFuture<'_, Result<Applied, ActuateError>>;

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
    fn scale(&mut self, role: Role, replicas: u32) -> BoxFuture<'_, Result<Applied, ActuateError>> {
        self.replicas.insert(role, replicas);
        Box::pin(async { Ok(Applied::Changed) })
    }
    fn replicas(&self, role: Role) -> Option<u32> {
        Some(self.replicas.get(&role).copied().unwrap_or(0))
    }
    fn shutdown(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_names_parse_and_name_what_is_wrong() {
        let s = RoleNames::parse("--compose-services", "prefill=p, decode=d,agg=worker").unwrap();
        assert_eq!(s.of(Role::Decode).unwrap(), "d");
        assert_eq!(s.of(Role::Aggregated).unwrap(), "worker");
        for bad in ["encode=e", "decode", "decode="] {
            let e = RoleNames::parse("--compose-services", bad).unwrap_err();
            assert!(matches!(e, ActuateError::BadRoleNames { .. }), "{bad}");
            assert!(e.to_string().contains("--compose-services"));
        }
        let only = RoleNames::parse("--kubernetes-deployments", "decode=d").unwrap();
        let e = only.of(Role::Prefill).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--kubernetes-deployments names nothing for the prefill role"
        );
    }
}
