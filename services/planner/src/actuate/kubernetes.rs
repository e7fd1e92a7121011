//! The `kubernetes` actuator (cargo feature `kubernetes`): sets `spec.replicas` of each role's
//! Deployment through its scale subresource (`PATCH .../deployments/<name>/scale`, a JSON
//! merge patch), with the ServiceAccount the k8s manifests give the planner
//! (`k8s/components/planner`: get and patch on `deployments/scale`, its namespace only).
//! Kubernetes then starts pods, or sends SIGTERM to surplus ones, which drain within their
//! `terminationGracePeriodSeconds`.
//!
//! At start it reads every role's scale and sends a server-side dry-run patch of it, so a
//! missing Deployment or a missing permission is an error before the first decision.

use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, Config};
use serde_json::json;

use super::{ActuateError, Actuator, Applied, BoxFuture, RoleNames};
use crate::load::Role;

#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    #[error("no Kubernetes configuration: not in a pod with a ServiceAccount, and no usable kubeconfig: {0}")]
    Config(#[from] kube::config::InferConfigError),
    #[error("building the Kubernetes client: {0}")]
    Client(#[source] kube::Error),
    #[error("the planner may not {verb} deployments/scale of {deployment} in namespace {namespace}: {message} (apply k8s/components/planner: its Role and RoleBinding)")]
    Forbidden {
        verb: &'static str,
        deployment: String,
        namespace: String,
        message: String,
    },
    #[error("no Deployment {deployment} in namespace {namespace} (--kubernetes-deployments)")]
    NotFound {
        deployment: String,
        namespace: String,
    },
    #[error("Kubernetes API: {what}: {source}")]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
}

/// The Deployments of one namespace.
pub struct KubernetesActuator {
    api: Api<Deployment>,
    namespace: String,
    deployments: RoleNames,
}

impl KubernetesActuator {
    /// The in-cluster configuration (or the kubeconfig), then [`KubernetesActuator::connect_with`].
    pub async fn connect(
        namespace: Option<String>,
        deployments: RoleNames,
        roles: &[Role],
    ) -> Result<KubernetesActuator, ActuateError> {
        let config = Config::infer().await.map_err(KubeError::from)?;
        KubernetesActuator::connect_with(config, namespace, deployments, roles).await
    }

    /// Checks that every role's Deployment exists and that its scale may be read and patched.
    pub async fn connect_with(
        config: Config,
        namespace: Option<String>,
        deployments: RoleNames,
        roles: &[Role],
    ) -> Result<KubernetesActuator, ActuateError> {
        let namespace = namespace.unwrap_or_else(|| config.default_namespace.clone());
        let client = Client::try_from(config).map_err(KubeError::Client)?;
        let a = KubernetesActuator {
            api: Api::namespaced(client, &namespace),
            namespace,
            deployments,
        };
        for role in roles {
            let name = a.deployments.of(*role)?;
            let scale = a
                .api
                .get_scale(name)
                .await
                .map_err(|e| a.classify("get", name, e))?;
            let replicas = scale.spec.and_then(|s| s.replicas).unwrap_or(0);
            a.patch(name, replicas, true).await?;
            tracing::info!(
                "kubernetes actuator: {} is Deployment {}/{name} ({replicas} replicas)",
                role.name(),
                a.namespace
            );
        }
        Ok(a)
    }

    /// Sets `spec.replicas` of `deployment` (a server-side dry run when `dry_run`).
    async fn patch(&self, deployment: &str, replicas: i32, dry_run: bool) -> Result<(), KubeError> {
        let params = if dry_run {
            PatchParams::default().dry_run()
        } else {
            PatchParams::default()
        };
        let body = Patch::Merge(json!({ "spec": { "replicas": replicas } }));
        self.api
            .patch_scale(deployment, &params, &body)
            .await
            .map_err(|e| self.classify("patch", deployment, e))?;
        Ok(())
    }

    fn classify(&self, verb: &'static str, deployment: &str, e: kube::Error) -> KubeError {
        match e {
            kube::Error::Api(status) if status.code == 403 => KubeError::Forbidden {
                verb,
                deployment: deployment.to_string(),
                namespace: self.namespace.clone(),
                message: status.message,
            },
            kube::Error::Api(status) if status.code == 404 => KubeError::NotFound {
                deployment: deployment.to_string(),
                namespace: self.namespace.clone(),
            },
            source => KubeError::Api {
                what: format!("{verb} deployments/{deployment}/scale"),
                source,
            },
        }
    }
}

impl Actuator for KubernetesActuator {
    fn scale(&mut self, role: Role, replicas: u32) -> BoxFuture<'_, Result<Applied, ActuateError>> {
        Box::pin(async move {
            let name = self.deployments.of(role)?;
            let replicas = i32::try_from(replicas).unwrap_or(i32::MAX);
            self.patch(name, replicas, false).await?;
            tracing::info!("kubernetes actuator: Deployment {name} set to {replicas} replicas");
            Ok(Applied::Changed)
        })
    }

    fn replicas(&self, _role: Role) -> Option<u32> {
        None
    }

    /// The Deployments keep their replicas when the planner stops.
    fn shutdown(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}
