//! The kubernetes actuator's requests, against a stand-in for the Kubernetes API server (no
//! cluster is reachable here). The stand-in serves the scale subresource the way the API
//! server does (autoscaling/v1 `Scale`, JSON merge patches, server-side dry runs, `Status`
//! errors) and authorizes every request with the Role the manifests give the planner
//! (k8s/components/planner/rbac.yaml), as RBAC would: a request the Role does not allow is a
//! 403, which the tests turn into a failure.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};
use tandem_planner::actuate::{ActuateError, Actuator, KubeError, KubernetesActuator, RoleNames};
use tandem_planner::load::Role;

const NAMESPACE: &str = "tandem";
const RBAC: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../k8s/components/planner/rbac.yaml"
);

/// One rule of a Role.
#[derive(Clone, Debug)]
struct Rule {
    api_groups: Vec<String>,
    resources: Vec<String>,
    resource_names: Vec<String>,
    verbs: Vec<String>,
}

fn strings(v: &Value, key: &str) -> Vec<String> {
    v[key]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// The rules of Role `tandem-planner` in the manifests.
fn manifest_rules() -> Vec<Rule> {
    let text = std::fs::read_to_string(RBAC).expect("k8s/components/planner/rbac.yaml");
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text).expect("the RBAC manifests parse");
    let role = docs
        .iter()
        .find(|d| d["kind"] == "Role" && d["metadata"]["name"] == "tandem-planner")
        .expect("a Role tandem-planner");
    role["rules"]
        .as_array()
        .expect("the Role has rules")
        .iter()
        .map(|r| Rule {
            api_groups: strings(r, "apiGroups"),
            resources: strings(r, "resources"),
            resource_names: strings(r, "resourceNames"),
            verbs: strings(r, "verbs"),
        })
        .collect()
}

fn allows(rules: &[Rule], verb: &str, resource: &str, name: &str) -> bool {
    rules.iter().any(|r| {
        r.api_groups.iter().any(|g| g == "apps" || g == "*")
            && r.resources.iter().any(|x| x == resource || x == "*")
            && r.verbs.iter().any(|v| v == verb || v == "*")
            && (r.resource_names.is_empty() || r.resource_names.iter().any(|n| n == name))
    })
}

/// A request as the stand-in saw it.
#[derive(Clone, Debug)]
struct Seen {
    verb: &'static str,
    deployment: String,
    dry_run: bool,
    content_type: Option<String>,
    body: Option<Value>,
    status: u16,
}

struct Cluster {
    rules: Vec<Rule>,
    replicas: BTreeMap<String, i64>,
    seen: Vec<Seen>,
}

type Shared = Arc<Mutex<Cluster>>;

fn status(code: StatusCode, reason: &str, message: String) -> Response {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code.as_u16(),
    });
    (code, Json(body)).into_response()
}

fn scale(name: &str, replicas: i64) -> Response {
    Json(json!({
        "kind": "Scale", "apiVersion": "autoscaling/v1",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"replicas": replicas},
        "status": {"replicas": replicas, "selector": format!("app.kubernetes.io/component={name}")},
    }))
    .into_response()
}

/// A merge patch of a Scale may set `spec.replicas` (a non-negative integer) and nothing else.
fn replicas_of_patch(body: &Value) -> Option<i64> {
    let obj = body.as_object()?;
    let spec = obj.get("spec")?.as_object()?;
    if obj.len() != 1 || spec.len() != 1 {
        return None;
    }
    spec.get("replicas")?.as_i64().filter(|n| *n >= 0)
}

async fn scale_subresource(
    State(cluster): State<Shared>,
    Path((ns, name)): Path<(String, String)>,
    RawQuery(query): RawQuery,
    method: Method,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let verb = if method == Method::PATCH {
        "patch"
    } else {
        "get"
    };
    let mut c = cluster.lock().unwrap();
    let dry_run = query.as_deref().is_some_and(|q| q.contains("dryRun=All"));
    let content_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let parsed: Option<Value> = serde_json::from_slice(&body).ok();
    let response = if !allows(&c.rules, verb, "deployments/scale", &name) || ns != NAMESPACE {
        status(
            StatusCode::FORBIDDEN,
            "Forbidden",
            format!(
                "deployments.apps \"{name}\" is forbidden: User \
                 \"system:serviceaccount:{NAMESPACE}:tandem-planner\" cannot {verb} resource \
                 \"deployments/scale\" in API group \"apps\" in the namespace \"{ns}\""
            ),
        )
    } else if !c.replicas.contains_key(&name) {
        status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("deployments.apps \"{name}\" not found"),
        )
    } else if verb == "get" {
        scale(&name, c.replicas[&name])
    } else if content_type.as_deref() != Some("application/merge-patch+json") {
        status(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            format!("the body of the request was in an unknown format: {content_type:?}"),
        )
    } else {
        match parsed.as_ref().and_then(replicas_of_patch) {
            None => status(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                format!("Scale.autoscaling \"{name}\" is invalid: {parsed:?}"),
            ),
            Some(n) => {
                if !dry_run {
                    c.replicas.insert(name.clone(), n);
                }
                scale(&name, n)
            }
        }
    };
    c.seen.push(Seen {
        verb,
        deployment: name,
        dry_run,
        content_type,
        body: parsed,
        status: response.status().as_u16(),
    });
    response
}

/// Serves the stand-in; returns its state and URL.
async fn api_server(rules: Vec<Rule>, deployments: &[(&str, i64)]) -> (Shared, String) {
    let cluster = Arc::new(Mutex::new(Cluster {
        rules,
        replicas: deployments
            .iter()
            .map(|(n, r)| (n.to_string(), *r))
            .collect(),
        seen: Vec::new(),
    }));
    let app = Router::new()
        .route(
            "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale",
            get(scale_subresource).patch(scale_subresource),
        )
        .with_state(cluster.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (cluster, format!("http://{addr}"))
}

async fn connect(url: &str, roles: &[Role]) -> Result<KubernetesActuator, ActuateError> {
    let config = kube::Config::new(url.parse().unwrap());
    let deployments = RoleNames::parse(
        "--kubernetes-deployments",
        "prefill=prefill,decode=decode,agg=decode",
    )
    .unwrap();
    KubernetesActuator::connect_with(config, Some(NAMESPACE.into()), deployments, roles).await
}

#[tokio::test]
async fn scales_through_the_scale_subresource_within_the_manifests_role() {
    let rules = manifest_rules();
    let (cluster, url) = api_server(rules, &[("prefill", 1), ("decode", 1), ("router", 1)]).await;
    let mut a = connect(&url, &[Role::Prefill, Role::Decode])
        .await
        .expect("the actuator starts with the manifests' RBAC");
    {
        // At start: each role's scale read, and a dry-run patch that changes nothing.
        let c = cluster.lock().unwrap();
        let start: Vec<_> = c
            .seen
            .iter()
            .map(|s| (s.verb, s.deployment.as_str(), s.dry_run))
            .collect();
        assert_eq!(
            start,
            [
                ("get", "prefill", false),
                ("patch", "prefill", true),
                ("get", "decode", false),
                ("patch", "decode", true)
            ]
        );
        assert_eq!(c.replicas["decode"], 1);
    }
    a.scale(Role::Decode, 3).await.unwrap();
    a.scale(Role::Prefill, 2).await.unwrap();
    a.scale(Role::Decode, 1).await.unwrap();
    let c = cluster.lock().unwrap();
    assert_eq!(c.replicas["decode"], 1);
    assert_eq!(c.replicas["prefill"], 2);
    assert_eq!(
        c.replicas["router"], 1,
        "nothing but the workers is touched"
    );
    let last = c.seen.last().unwrap();
    assert_eq!(
        last.content_type.as_deref(),
        Some("application/merge-patch+json")
    );
    assert_eq!(last.body, Some(json!({"spec": {"replicas": 1}})));
    assert!(!last.dry_run);
    let refused: Vec<_> = c.seen.iter().filter(|s| s.status != 200).collect();
    assert!(
        refused.is_empty(),
        "requests the stand-in refused: {refused:?}"
    );
}

#[tokio::test]
async fn a_role_that_may_not_patch_is_refused_at_start_naming_it() {
    let mut rules = manifest_rules();
    for r in &mut rules {
        r.verbs.retain(|v| v != "patch");
    }
    let (cluster, url) = api_server(rules, &[("prefill", 1), ("decode", 1)]).await;
    let err = connect(&url, &[Role::Prefill, Role::Decode])
        .await
        .err()
        .unwrap();
    assert!(
        matches!(&err, ActuateError::Kube(KubeError::Forbidden { verb: "patch", deployment, .. }) if deployment == "prefill"),
        "{err}"
    );
    assert!(err.to_string().contains("k8s/components/planner"), "{err}");
    assert_eq!(cluster.lock().unwrap().replicas["prefill"], 1);
}

#[tokio::test]
async fn a_deployment_outside_the_role_or_missing_is_named() {
    // The manifests' Role covers prefill and decode only: an `encode` Deployment is refused.
    let (_, url) = api_server(manifest_rules(), &[("decode", 1), ("encode", 1)]).await;
    let config = kube::Config::new(url.parse().unwrap());
    let names = RoleNames::parse("--kubernetes-deployments", "decode=encode").unwrap();
    let err =
        KubernetesActuator::connect_with(config, Some(NAMESPACE.into()), names, &[Role::Decode])
            .await
            .err()
            .unwrap();
    assert!(
        matches!(
            &err,
            ActuateError::Kube(KubeError::Forbidden { verb: "get", .. })
        ),
        "{err}"
    );
    // A Deployment the Role covers but the namespace lacks.
    let err = connect(&url, &[Role::Prefill]).await.err().unwrap();
    assert!(
        matches!(&err, ActuateError::Kube(KubeError::NotFound { deployment, .. }) if deployment == "prefill"),
        "{err}"
    );
}
