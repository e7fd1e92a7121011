//! The `docker` actuator: scales the worker services of a Docker Compose project through the
//! Docker Engine API (a Unix socket; API 1.41 and later), so it needs no Compose CLI and runs
//! inside the project itself (compose/*.yml, profile `planner`).
//!
//! A service's replicas are its containers that carry Compose's labels
//! (`com.docker.compose.project` / `.service`). Scaling up starts a stopped replica when there
//! is one, else creates a copy of the newest replica under Compose's name and number scheme
//! (`<project>-<service>-<n>`, the same labels, networks and aliases), which `docker compose
//! ps`, `logs` and `down` then treat as their own. Scaling down stops the highest-numbered
//! running replicas with the service's stop timeout: SIGTERM, the worker deregisters and
//! drains, SIGKILL only past the timeout. Stopped replicas are kept for the next scale-up
//! (their restart policy does not revive a container stopped through the API).

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use bollard::models::{
    ContainerCreateBody, ContainerInspectResponse, ContainerSummary, ContainerSummaryStateEnum,
    EndpointSettings, NetworkConnectRequest, NetworkingConfig,
};
use bollard::query_parameters::{
    CreateContainerOptions, InspectContainerOptions, ListContainersOptions, StopContainerOptions,
};
use bollard::{ClientVersion, Docker};
use tokio::task::JoinSet;

use super::{ActuateError, Actuator, Applied, BoxFuture, RoleNames};
use crate::load::Role;

const PROJECT_LABEL: &str = "com.docker.compose.project";
const SERVICE_LABEL: &str = "com.docker.compose.service";
const NUMBER_LABEL: &str = "com.docker.compose.container-number";
const ONEOFF_LABEL: &str = "com.docker.compose.oneoff";
/// The oldest Engine API the actuator speaks (Docker 20.10); newer engines accept it too.
const API_VERSION: ClientVersion = ClientVersion {
    major_version: 1,
    minor_version: 41,
};
/// A replica's stop timeout when its container does not set one (`stop_grace_period`).
const DEFAULT_STOP_SECS: i64 = 45;

#[derive(Debug, thiserror::Error)]
pub enum DockerError {
    #[error("--docker-host {0}: only unix:// sockets are supported (a TCP engine would need TLS client certificates)")]
    NotUnix(String),
    #[error("cannot reach the Docker engine at {socket}: {source} (the planner needs the socket mounted and its group: DOCKER_GID)")]
    Unreachable {
        socket: String,
        #[source]
        source: bollard::errors::Error,
    },
    #[error("no --compose-project given, and this process is not in a Compose container ({0})")]
    NoProject(String),
    #[error("no container of service {service} in Compose project {project}: start the topology (docker compose up) before the planner")]
    NoService { project: String, service: String },
    #[error("Docker engine: {what}: {source}")]
    Api {
        what: String,
        #[source]
        source: bollard::errors::Error,
    },
    #[error("container {0} as inspected has no configuration to copy")]
    NoTemplate(String),
}

fn api(what: impl Into<String>) -> impl FnOnce(bollard::errors::Error) -> DockerError {
    let what = what.into();
    move |source| DockerError::Api { what, source }
}

/// One replica of a service, as listed.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Replica {
    id: String,
    number: u32,
    running: bool,
}

fn replica_of(c: &ContainerSummary) -> Option<Replica> {
    let labels = c.labels.as_ref()?;
    if labels
        .get(ONEOFF_LABEL)
        .is_some_and(|v| v.eq_ignore_ascii_case("true"))
    {
        return None; // `docker compose run` containers are not replicas
    }
    Some(Replica {
        id: c.id.clone()?,
        number: labels.get(NUMBER_LABEL)?.parse().ok()?,
        running: matches!(
            c.state,
            Some(ContainerSummaryStateEnum::RUNNING | ContainerSummaryStateEnum::RESTARTING)
        ),
    })
}

/// What bringing a service from its replicas to `want` running takes.
#[derive(Debug, Default, PartialEq, Eq)]
struct Change {
    /// Stopped replicas to start (lowest numbers first).
    start: Vec<String>,
    /// New replicas to create, by number.
    create: Vec<u32>,
    /// Running replicas to stop (highest numbers first).
    stop: Vec<String>,
}

/// `replicas` minus those already stopping; the plan is pure so that it is tested alone.
fn plan_change(replicas: &[Replica], stopping: &BTreeSet<String>, want: usize) -> Change {
    let mut running: Vec<&Replica> = replicas
        .iter()
        .filter(|r| r.running && !stopping.contains(&r.id))
        .collect();
    running.sort_by_key(|r| r.number);
    let mut change = Change::default();
    if want < running.len() {
        change.stop = running[want..].iter().rev().map(|r| r.id.clone()).collect();
        return change;
    }
    let mut missing = want - running.len();
    let mut stopped: Vec<&Replica> = replicas
        .iter()
        .filter(|r| !r.running && !stopping.contains(&r.id))
        .collect();
    stopped.sort_by_key(|r| r.number);
    for r in stopped.into_iter().take(missing) {
        change.start.push(r.id.clone());
        missing -= 1;
    }
    let next = replicas.iter().map(|r| r.number).max().unwrap_or(0) + 1;
    change.create = (next..).take(missing).collect();
    change
}

/// The Compose services of one project.
pub struct DockerActuator {
    docker: Docker,
    project: String,
    services: RoleNames,
    /// Containers being stopped (draining) now.
    stopping: BTreeSet<String>,
    stops: JoinSet<String>,
}

impl DockerActuator {
    /// Connects, finds the project (given, or the one this container belongs to) and checks
    /// that every role's service has a replica to copy.
    pub async fn connect(
        host: &str,
        project: Option<String>,
        services: RoleNames,
        roles: &[Role],
    ) -> Result<DockerActuator, ActuateError> {
        let socket = host
            .strip_prefix("unix://")
            .ok_or_else(|| DockerError::NotUnix(host.to_string()))?;
        let unreachable = |source| DockerError::Unreachable {
            socket: socket.to_string(),
            source,
        };
        let docker = Docker::connect_with_unix(socket, 120, &API_VERSION).map_err(unreachable)?;
        docker.ping().await.map_err(unreachable)?;
        let project = match project {
            Some(p) => p,
            None => own_project(&docker).await?,
        };
        let a = DockerActuator {
            docker,
            project,
            services,
            stopping: BTreeSet::new(),
            stops: JoinSet::new(),
        };
        for role in roles {
            let service = a.services.of(*role)?;
            if a.replicas_of(service).await?.is_empty() {
                return Err(DockerError::NoService {
                    project: a.project.clone(),
                    service: service.to_string(),
                }
                .into());
            }
        }
        tracing::info!("docker actuator: Compose project {}", a.project);
        Ok(a)
    }

    async fn replicas_of(&self, service: &str) -> Result<Vec<Replica>, DockerError> {
        let filters = HashMap::from([(
            "label".to_string(),
            vec![
                format!("{PROJECT_LABEL}={}", self.project),
                format!("{SERVICE_LABEL}={service}"),
            ],
        )]);
        let list = self
            .docker
            .list_containers(Some(ListContainersOptions {
                all: true,
                filters: Some(filters),
                ..Default::default()
            }))
            .await
            .map_err(api(format!("listing the containers of {service}")))?;
        Ok(list.iter().filter_map(replica_of).collect())
    }

    async fn start(&self, id: &str) -> Result<(), DockerError> {
        self.docker
            .start_container(id, None)
            .await
            .map_err(api(format!("starting container {id}")))
    }

    /// A new replica numbered `number`, copied from `template`, started.
    async fn create(&self, service: &str, template: &str, number: u32) -> Result<(), DockerError> {
        let inspected = self
            .docker
            .inspect_container(template, None::<InspectContainerOptions>)
            .await
            .map_err(api(format!("inspecting container {template}")))?;
        let name = format!("{}-{service}-{number}", self.project);
        let (body, more_networks) = replica_body(&inspected, service, &name, number)
            .ok_or_else(|| DockerError::NoTemplate(template.to_string()))?;
        let created = self
            .docker
            .create_container(
                Some(CreateContainerOptions {
                    name: Some(name.clone()),
                    ..Default::default()
                }),
                body,
            )
            .await
            .map_err(api(format!("creating container {name}")))?;
        for (network, endpoint) in more_networks {
            self.docker
                .connect_network(
                    &network,
                    NetworkConnectRequest {
                        container: created.id.clone(),
                        endpoint_config: Some(endpoint),
                    },
                )
                .await
                .map_err(api(format!("connecting {name} to network {network}")))?;
        }
        self.start(&created.id).await?;
        tracing::info!("docker actuator: created and started {name}");
        Ok(())
    }

    /// Stops `id` in the background: SIGTERM (the worker drains), SIGKILL past the timeout.
    fn stop(&mut self, id: String, timeout_secs: i64) {
        self.stopping.insert(id.clone());
        let docker = self.docker.clone();
        self.stops.spawn(async move {
            let t = i32::try_from(timeout_secs).unwrap_or(i32::MAX);
            match docker
                .stop_container(
                    &id,
                    Some(StopContainerOptions {
                        t: Some(t),
                        signal: None,
                    }),
                )
                .await
            {
                Ok(()) => tracing::info!("docker actuator: {id:.12} drained and stopped"),
                Err(e) => tracing::warn!("docker actuator: stopping {id:.12}: {e}"),
            }
            id
        });
    }

    fn reap(&mut self) {
        while let Some(done) = self.stops.try_join_next() {
            if let Ok(id) = done {
                self.stopping.remove(&id);
            }
        }
    }

    async fn stop_timeout(&self, id: &str) -> i64 {
        self.docker
            .inspect_container(id, None::<InspectContainerOptions>)
            .await
            .ok()
            .and_then(|c| c.config?.stop_timeout)
            .unwrap_or(DEFAULT_STOP_SECS)
    }

    async fn scale_service(&mut self, role: Role, replicas: u32) -> Result<Applied, ActuateError> {
        self.reap();
        let service = self.services.of(role)?.to_string();
        let listed = self.replicas_of(&service).await?;
        let change = plan_change(&listed, &self.stopping, replicas as usize);
        if change == Change::default() {
            return Ok(Applied::Unchanged);
        }
        for id in &change.start {
            self.start(id).await?;
            tracing::info!("docker actuator: started {service} replica {id:.12}");
        }
        if !change.create.is_empty() {
            let template = listed
                .iter()
                .max_by_key(|r| r.number)
                .map(|r| r.id.clone())
                .ok_or_else(|| DockerError::NoService {
                    project: self.project.clone(),
                    service: service.clone(),
                })?;
            for n in change.create {
                self.create(&service, &template, n).await?;
            }
        }
        for id in change.stop {
            let t = self.stop_timeout(&id).await;
            tracing::info!(
                "docker actuator: stopping {service} replica {id:.12} (drain up to {t}s)"
            );
            self.stop(id, t);
        }
        Ok(Applied::Changed)
    }
}

/// The project label of the container this process runs in (its hostname is the container
/// id unless the service sets one).
async fn own_project(docker: &Docker) -> Result<String, DockerError> {
    let host = std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_string())
        .map_err(|e| DockerError::NoProject(format!("reading /etc/hostname: {e}")))?;
    let me = docker
        .inspect_container(&host, None::<InspectContainerOptions>)
        .await
        .map_err(|e| DockerError::NoProject(format!("no container {host}: {e}")))?;
    me.config
        .and_then(|c| c.labels)
        .and_then(|l| l.get(PROJECT_LABEL).cloned())
        .ok_or_else(|| {
            DockerError::NoProject(format!("container {host} has no {PROJECT_LABEL} label"))
        })
}

/// The create request of replica `number` of `service` from an inspected replica: the same
/// configuration and labels but the number, no hostname of its own (Docker gives the new
/// container's id), and the same networks with the service's alias and the new name. The
/// Engine API attaches one network at create; the others are returned to connect after.
fn replica_body(
    c: &ContainerInspectResponse,
    service: &str,
    name: &str,
    number: u32,
) -> Option<(ContainerCreateBody, Vec<(String, EndpointSettings)>)> {
    // The inspected configuration and the create body share their JSON fields.
    let mut body: ContainerCreateBody =
        serde_json::from_value(serde_json::to_value(c.config.as_ref()?).ok()?).ok()?;
    body.hostname = None;
    body.labels
        .get_or_insert_with(HashMap::new)
        .insert(NUMBER_LABEL.to_string(), number.to_string());
    body.host_config = c.host_config.clone();
    let mut networks: Vec<(String, EndpointSettings)> = c
        .network_settings
        .as_ref()
        .and_then(|n| n.networks.clone())
        .unwrap_or_default()
        .into_keys()
        .map(|net| {
            let endpoint = EndpointSettings {
                aliases: Some(vec![service.to_string(), name.to_string()]),
                ..Default::default()
            };
            (net, endpoint)
        })
        .collect();
    networks.sort_by(|a, b| a.0.cmp(&b.0));
    let first = (!networks.is_empty()).then(|| networks.remove(0));
    body.networking_config = first.map(|(net, endpoint)| NetworkingConfig {
        endpoints_config: Some(HashMap::from([(net, endpoint)])),
    });
    Some((body, networks))
}

impl Actuator for DockerActuator {
    fn scale(&mut self, role: Role, replicas: u32) -> BoxFuture<'_, Result<Applied, ActuateError>> {
        Box::pin(self.scale_service(role, replicas))
    }

    fn replicas(&self, _role: Role) -> Option<u32> {
        None
    }

    /// The replicas stay as they are when the planner stops (they serve); only the drains
    /// under way are waited for.
    fn shutdown(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let wait = Duration::from_secs(DEFAULT_STOP_SECS as u64 + 5);
            let _ = tokio::time::timeout(wait, async {
                while self.stops.join_next().await.is_some() {}
            })
            .await;
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bollard::models::{ContainerConfig, HostConfig, NetworkSettings};

    fn r(id: &str, number: u32, running: bool) -> Replica {
        Replica {
            id: id.into(),
            number,
            running,
        }
    }

    #[test]
    fn scaling_up_starts_stopped_replicas_before_creating() {
        let replicas = [r("a", 1, true), r("b", 2, false), r("c", 4, false)];
        let none = BTreeSet::new();
        let c = plan_change(&replicas, &none, 2);
        assert_eq!(
            c,
            Change {
                start: vec!["b".into()],
                ..Default::default()
            }
        );
        let c = plan_change(&replicas, &none, 5);
        assert_eq!(c.start, vec!["b", "c"]);
        assert_eq!(c.create, vec![5, 6]);
        assert!(c.stop.is_empty());
        assert_eq!(plan_change(&replicas, &none, 1), Change::default());
    }

    #[test]
    fn scaling_down_stops_the_highest_numbers_and_counts_draining_ones_gone() {
        let replicas = [r("a", 1, true), r("b", 2, true), r("c", 3, true)];
        let none = BTreeSet::new();
        assert_eq!(plan_change(&replicas, &none, 1).stop, vec!["c", "b"]);
        assert_eq!(plan_change(&replicas, &none, 0).stop, vec!["c", "b", "a"]);
        // `c` is draining: two are running, and a third is a new one (not `c` again).
        let draining = BTreeSet::from(["c".to_string()]);
        assert_eq!(plan_change(&replicas, &draining, 2), Change::default());
        assert_eq!(plan_change(&replicas, &draining, 3).create, vec![4]);
    }

    #[test]
    fn a_replica_copies_the_template_with_its_own_number_name_and_aliases() {
        let inspected = ContainerInspectResponse {
            config: Some(ContainerConfig {
                hostname: Some("0123456789ab".into()),
                image: Some("tandem:0.1.0".into()),
                env: Some(vec!["A=1".into()]),
                stop_timeout: Some(45),
                labels: Some(HashMap::from([
                    (PROJECT_LABEL.to_string(), "p".to_string()),
                    (SERVICE_LABEL.to_string(), "decode".to_string()),
                    (NUMBER_LABEL.to_string(), "1".to_string()),
                ])),
                ..Default::default()
            }),
            host_config: Some(HostConfig {
                binds: Some(vec!["pki:/etc/tandem/pki:ro".into()]),
                ..Default::default()
            }),
            network_settings: Some(NetworkSettings {
                networks: Some(HashMap::from([
                    ("p_default".to_string(), EndpointSettings::default()),
                    ("p_other".to_string(), EndpointSettings::default()),
                ])),
                ..Default::default()
            }),
            ..Default::default()
        };
        let (body, more) = replica_body(&inspected, "decode", "p-decode-3", 3).unwrap();
        assert_eq!(body.hostname, None);
        assert_eq!(body.image.as_deref(), Some("tandem:0.1.0"));
        assert_eq!(body.env, Some(vec!["A=1".to_string()]));
        assert_eq!(body.stop_timeout, Some(45));
        let labels = body.labels.unwrap();
        assert_eq!(labels[NUMBER_LABEL], "3");
        assert_eq!(labels[SERVICE_LABEL], "decode");
        assert_eq!(
            body.host_config.unwrap().binds.unwrap(),
            vec!["pki:/etc/tandem/pki:ro"]
        );
        let first = body.networking_config.unwrap().endpoints_config.unwrap();
        assert_eq!(
            first["p_default"].aliases.as_deref(),
            Some(&["decode".to_string(), "p-decode-3".to_string()][..])
        );
        assert_eq!(more.len(), 1);
        assert_eq!(more[0].0, "p_other");
        assert!(replica_body(&ContainerInspectResponse::default(), "d", "n", 1).is_none());
    }
}
