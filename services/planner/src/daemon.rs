//! The planner process: checks its configuration, then every load interval reads the
//! system, decides, reports and applies, until SIGTERM; at exit the local actuator drains
//! the workers it started.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use tandem_config::planner::{
    ActuatorKind, LoadSignal, OptimizationTarget, PlannerConfig, PlannerMode,
};
use tandem_pki::ChannelSecurity;
use tandem_planner::actuate::{
    Actuator, Applied, DockerActuator, LocalActuator, LocalSpec, RoleNames, SlurmActuator,
    VirtualActuator,
};
use tandem_planner::load::{Role, Signal, SlaEstimate, Target};
use tandem_planner::observe::{traffic, Backlog, Observer, RoleView, RouterTotals};
use tandem_planner::plan::{Decision, Planner, Settings, ThroughputSettings};
use tandem_planner::predict::PredictorKind;
use tandem_planner::profile::ProfileData;
use tandem_runtime::discovery::{self, DiscoveryOptions};

/// `dynamo_planner_*` gauges and counters.
mod names {
    pub const DESIRED: &str = "dynamo_planner_desired_replicas";
    pub const ACTUAL: &str = "dynamo_planner_actual_replicas";
    pub const DECISIONS: &str = "dynamo_planner_decisions_total";
    pub const LOAD: &str = "dynamo_planner_load";
    pub const LOAD_DECISION: &str = "dynamo_planner_load_scaling_decision";
    pub const METRICS_GAP: &str = "dynamo_planner_metrics_gap";
    pub const PREDICTED_RATE: &str = "dynamo_planner_predicted_request_rate";
    pub const PREDICTED_ISL: &str = "dynamo_planner_predicted_isl";
    pub const PREDICTED_OSL: &str = "dynamo_planner_predicted_osl";
    pub const ESTIMATED_TTFT: &str = "dynamo_planner_estimated_ttft_ms";
    pub const ESTIMATED_ITL: &str = "dynamo_planner_estimated_itl_ms";
    pub const OBSERVED_TTFT: &str = "dynamo_planner_observed_ttft_ms";
    pub const OBSERVED_ITL: &str = "dynamo_planner_observed_itl_ms";
    pub const ROUTER_BACKLOG: &str = "dynamo_planner_router_backlog_tokens";
}

pub async fn run(cfg: PlannerConfig) -> anyhow::Result<()> {
    let settings = settings(&cfg)?;
    let roles = settings.roles.clone();
    let mut actuator = actuator(&cfg, &roles).await?;
    let observer = observer(&cfg).await?;
    let mut throughput = throughput_start(&cfg, &observer).await?;
    let mut log = DecisionLog::open(cfg.decisions_out.as_deref())?;
    let metrics = tandem_runtime::metrics::install_recorder()?;
    let ready = Arc::new(AtomicBool::new(false));
    let health = {
        let ready = ready.clone();
        Arc::new(move || ready.load(Ordering::Relaxed))
    };
    let bind = format!("{}:{}", cfg.metrics_host, cfg.metrics_port);
    let addr = tandem_runtime::metrics::serve_status(&bind, metrics, health).await?;
    let shutdown = tandem_runtime::shutdown::on_signals();
    let mut planner = Planner::new(settings);
    let mut router_queue = RouterQueue::default();
    tracing::info!(
        "planner scaling {:?} with the {:?} actuator{}; /metrics on http://{addr}",
        roles.iter().map(|r| r.name()).collect::<Vec<_>>(),
        cfg.actuator,
        if cfg.dry_run { " (dry run)" } else { "" }
    );
    let mut tick = tokio::time::interval(Duration::from_secs(cfg.load_interval_secs.into()));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.cancelled() => break,
        }
        if let Some(t) = throughput.as_mut() {
            t.step(&observer, &mut planner).await;
        }
        let signal = planner.signal();
        let Some(mut views) = read_views(&observer, actuator.as_ref(), &roles, signal).await else {
            continue;
        };
        router_queue.attach(&observer, &mut views).await;
        for d in planner.decide(&views) {
            apply(&d, &cfg, actuator.as_mut(), &mut log, &mut planner).await;
        }
        report_forecast(&planner);
        if !ready.load(Ordering::Relaxed) && (cfg.dry_run || at_minimum(&views, &roles, &cfg)) {
            ready.store(true, Ordering::Relaxed);
            println!("TANDEM_PLANNER_READY http={addr}");
        }
    }
    tracing::info!("planner stopping; draining the workers it started");
    actuator.shutdown().await;
    Ok(())
}

/// The decision settings from the flags (the predictor named, the profile read).
fn settings(cfg: &PlannerConfig) -> anyhow::Result<Settings> {
    let roles = match cfg.mode {
        PlannerMode::Disagg => vec![Role::Prefill, Role::Decode],
        PlannerMode::Agg => vec![Role::Aggregated],
        PlannerMode::Prefill => vec![Role::Prefill],
        PlannerMode::Decode => vec![Role::Decode],
    };
    let predictor: PredictorKind = cfg.load_predictor.parse().context("--load-predictor")?;
    let models = cfg
        .profile_data
        .as_deref()
        .map(|path| {
            let data = ProfileData::load(path)?;
            data.models()
                .with_context(|| format!("the profile {}", path.display()))
        })
        .transpose()?;
    let throughput = match (&models, cfg.enable_throughput_scaling) {
        (Some(models), true) => Some(ThroughputSettings {
            models: models.clone(),
            ttft_ms: cfg.ttft_ms,
            itl_ms: cfg.itl_ms,
            predictor,
        }),
        _ => None,
    };
    let signal = match (cfg.load_signal, models) {
        (LoadSignal::Sla, Some(m)) => Signal::Sla(SlaEstimate {
            prefill: m.prefill,
            decode: m.decode,
            ttft_ms: cfg.ttft_ms,
            itl_ms: cfg.itl_ms,
        }),
        (LoadSignal::Sla, None) => anyhow::bail!("--load-signal sla needs --planner-profile-data"),
        (LoadSignal::Thresholds, _) => Signal::Thresholds(match cfg.optimization_target {
            OptimizationTarget::Throughput => Target::Throughput,
            OptimizationTarget::Latency => Target::Latency,
        }),
    };
    let b = &cfg.bounds;
    let gpus = BTreeMap::from([
        (Role::Prefill, b.prefill_engine_num_gpu),
        (Role::Aggregated, b.prefill_engine_num_gpu),
        (Role::Decode, b.decode_engine_num_gpu),
    ]);
    Ok(Settings {
        roles,
        signal,
        load_scaling: cfg.enable_load_scaling,
        down_after: cfg.scale_down_intervals,
        throughput,
        min: b.min_endpoint,
        max: b.max_endpoint,
        gpu_budget: b.max_gpu_budget,
        gpus,
        // A worker gets ten minutes to load and register before its decision is given up.
        patience: (600 / cfg.load_interval_secs).max(3),
    })
}

/// The actuator, checked usable now (spec, programs, engine socket, allocation).
async fn actuator(cfg: &PlannerConfig, roles: &[Role]) -> anyhow::Result<Box<dyn Actuator>> {
    let spec = || -> anyhow::Result<LocalSpec> {
        let path = cfg
            .local_workers_spec
            .as_deref()
            .context("this actuator needs --local-workers-spec")?;
        let spec = LocalSpec::load(path)?;
        spec.check(roles)?;
        Ok(spec)
    };
    Ok(match cfg.actuator {
        ActuatorKind::Virtual => Box::new(VirtualActuator::default()),
        ActuatorKind::Local => {
            let spec = spec()?;
            spec.check_local(roles)?;
            Box::new(LocalActuator::new(spec))
        }
        ActuatorKind::Slurm => Box::new(SlurmActuator::connect(spec()?).await?),
        ActuatorKind::Docker => {
            let services = RoleNames::parse("--compose-services", &cfg.compose_services)?;
            let project = cfg.compose_project.clone();
            Box::new(DockerActuator::connect(&cfg.docker_host, project, services, roles).await?)
        }
        ActuatorKind::Kubernetes => kubernetes(cfg, roles).await?,
    })
}

#[cfg(feature = "kubernetes")]
async fn kubernetes(cfg: &PlannerConfig, roles: &[Role]) -> anyhow::Result<Box<dyn Actuator>> {
    use tandem_planner::actuate::KubernetesActuator;
    let deployments = RoleNames::parse("--kubernetes-deployments", &cfg.kubernetes_deployments)?;
    let namespace = cfg.kubernetes_namespace.clone();
    Ok(Box::new(
        KubernetesActuator::connect(namespace, deployments, roles).await?,
    ))
}

#[cfg(not(feature = "kubernetes"))]
async fn kubernetes(_cfg: &PlannerConfig, _roles: &[Role]) -> anyhow::Result<Box<dyn Actuator>> {
    anyhow::bail!(
        "--actuator kubernetes: this tandem-planner was built without the `kubernetes` feature \
         (cargo build --release -p tandem-planner --features kubernetes; scripts/images does)"
    )
}

/// Discovery (checked reachable now) and the scraper.
async fn observer(cfg: &PlannerConfig) -> anyhow::Result<Observer> {
    let security = ChannelSecurity::from_dir(cfg.runtime.internal_tls()?)?;
    let options = DiscoveryOptions::from_config(&cfg.runtime).with_security(&security);
    let discovery = discovery::connect(&options)
        .await
        .context("connecting to discovery")?;
    let observer = Observer::new(
        discovery,
        cfg.runtime.namespace.clone(),
        cfg.router_metrics_url.clone(),
    );
    observer
        .workers()
        .await
        .context("listing the workers at start")?;
    Ok(observer)
}

/// Throughput scaling's clock and the router's counters at the last boundary.
struct ThroughputClock {
    every: Duration,
    since: Instant,
    totals: RouterTotals,
}

/// The router's counters now, when throughput scaling is on (an unreachable router is then
/// an error at start).
async fn throughput_start(
    cfg: &PlannerConfig,
    observer: &Observer,
) -> anyhow::Result<Option<ThroughputClock>> {
    if !cfg.enable_throughput_scaling {
        return Ok(None);
    }
    let totals = observer
        .router()
        .await
        .context("throughput scaling reads the router's metrics (--router-metrics-url)")?;
    Ok(Some(ThroughputClock {
        every: Duration::from_secs(cfg.throughput_interval_secs.into()),
        since: Instant::now(),
        totals,
    }))
}

impl ThroughputClock {
    /// At each boundary: the interval's traffic to the planner.
    async fn step(&mut self, observer: &Observer, planner: &mut Planner) {
        if self.since.elapsed() < self.every {
            return;
        }
        let now = match observer.router().await {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!("metrics gap: {e}; throughput floors unchanged");
                return;
            }
        };
        let secs = self.since.elapsed().as_secs_f64();
        if let Some(t) = traffic(&self.totals, &now, secs) {
            tracing::info!(
                "traffic over {secs:.0}s: {:.2} req/s, ISL {:?}, OSL {:?}, TTFT {:?} ms, ITL {:?} ms",
                t.rps,
                t.isl.map(|v| v.round()),
                t.osl.map(|v| v.round()),
                t.ttft_ms.map(|v| v.round()),
                t.itl_ms.map(|v| (v * 10.0).round() / 10.0)
            );
            t.ttft_ms
                .inspect(|v| metrics::gauge!(names::OBSERVED_TTFT).set(*v));
            t.itl_ms
                .inspect(|v| metrics::gauge!(names::OBSERVED_ITL).set(*v));
            planner.observe_traffic(&t);
        }
        self.totals = now;
        self.since = Instant::now();
    }
}

/// The router's queue, read every load interval: its prompt tokens are prefill work not yet
/// in any engine's queue.
#[derive(Default)]
struct RouterQueue {
    backlog: Backlog,
    /// The last read failed (warned once until it recovers).
    failing: bool,
}

impl RouterQueue {
    /// Gives the backlog to the role that prefills (prefill, else aggregated); none when the
    /// router cannot be read.
    async fn attach(&mut self, observer: &Observer, views: &mut BTreeMap<Role, RoleView>) {
        let totals = match observer.router().await {
            Ok(t) => t,
            Err(e) => {
                if !self.failing {
                    tracing::warn!("the router's queue is not counted: {e}");
                }
                self.failing = true;
                return;
            }
        };
        if std::mem::take(&mut self.failing) {
            tracing::info!("the router's metrics are readable again");
        }
        let tokens = self.backlog.tokens(totals);
        let prefills = [Role::Prefill, Role::Aggregated]
            .into_iter()
            .find(|r| views.contains_key(r));
        if let Some(view) = prefills.and_then(|r| views.get_mut(&r)) {
            view.backlog_tokens = tokens;
        }
        metrics::gauge!(names::ROUTER_BACKLOG).set(tokens);
    }
}

/// Every role's view, with the virtual actuator's replicas where it keeps them; `None` on a
/// metrics gap (logged; replicas held).
async fn read_views(
    observer: &Observer,
    actuator: &dyn Actuator,
    roles: &[Role],
    signal: &Signal,
) -> Option<BTreeMap<Role, RoleView>> {
    let mut views = match observer.roles().await {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!("metrics gap: {e}; holding the current replicas");
            metrics::gauge!(names::METRICS_GAP).set(1.0);
            return None;
        }
    };
    metrics::gauge!(names::METRICS_GAP).set(0.0);
    for role in roles {
        let view = views.entry(*role).or_default();
        if let Some(n) = actuator.replicas(*role) {
            view.replicas = n;
        }
        let label = [("role", role.name())];
        metrics::gauge!(names::ACTUAL, &label).set(f64::from(view.replicas));
        let highest = view
            .loads
            .iter()
            .map(|l| signal.load(*role, l))
            .fold(0.0, f64::max);
        metrics::gauge!(names::LOAD, &label).set(highest);
    }
    Some(views)
}

/// Logs, records and (unless a dry run) applies one decision.
async fn apply(
    d: &Decision,
    cfg: &PlannerConfig,
    actuator: &mut dyn Actuator,
    log: &mut DecisionLog,
    planner: &mut Planner,
) {
    let role = d.role.name();
    tracing::info!(
        "{role}: {} -> {} replicas: {}{}",
        d.current,
        d.desired,
        d.reason,
        if cfg.dry_run { " (dry run)" } else { "" }
    );
    let direction = if d.desired > d.current { "up" } else { "down" };
    let label = [("role", role)];
    metrics::gauge!(names::DESIRED, &label).set(f64::from(d.desired));
    metrics::gauge!(names::LOAD_DECISION, &label).set(if direction == "up" { 1.0 } else { -1.0 });
    metrics::counter!(names::DECISIONS, "role" => role, "direction" => direction).increment(1);
    log.write(d, !cfg.dry_run);
    if cfg.dry_run {
        // Nothing will show in discovery: the next interval decides afresh.
        planner.forget_pending(d.role);
        return;
    }
    match actuator.scale(d.role, d.desired).await {
        Ok(Applied::Changed) => {}
        Ok(Applied::Unchanged) => {
            tracing::info!(
                "{role}: the actuator already runs {} (some not in discovery yet: draining or \
                 starting); deciding afresh next interval",
                d.desired
            );
            planner.forget_pending(d.role);
        }
        Err(e) => {
            tracing::error!("{role}: scaling to {} failed: {e}", d.desired);
            planner.forget_pending(d.role);
        }
    }
}

fn report_forecast(planner: &Planner) {
    let f = planner.forecast();
    if let Some(d) = f.demand {
        metrics::gauge!(names::PREDICTED_RATE).set(d.rps);
        metrics::gauge!(names::PREDICTED_ISL).set(d.isl);
        metrics::gauge!(names::PREDICTED_OSL).set(d.osl);
        metrics::gauge!(names::ESTIMATED_TTFT).set(f.ttft_ms);
        metrics::gauge!(names::ESTIMATED_ITL).set(f.itl_ms);
    }
}

fn at_minimum(views: &BTreeMap<Role, RoleView>, roles: &[Role], cfg: &PlannerConfig) -> bool {
    roles
        .iter()
        .all(|r| views.get(r).map_or(0, |v| v.replicas) >= cfg.bounds.min_endpoint)
}

/// `--decisions-out`: one JSON object per line.
struct DecisionLog {
    file: Option<std::fs::File>,
}

impl DecisionLog {
    fn open(path: Option<&Path>) -> anyhow::Result<DecisionLog> {
        let file = path
            .map(|p| {
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .with_context(|| format!("opening --decisions-out {}", p.display()))
            })
            .transpose()?;
        Ok(DecisionLog { file })
    }

    fn write(&mut self, d: &Decision, applied: bool) {
        let Some(f) = self.file.as_mut() else { return };
        let time = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|t| t.as_secs_f64())
            .unwrap_or(0.0);
        let line = serde_json::json!({
            "time": time,
            "role": d.role.name(),
            "current": d.current,
            "desired": d.desired,
            "reason": d.reason,
            "applied": applied,
        });
        if let Err(e) = writeln!(f, "{line}").and_then(|_| f.flush()) {
            tracing::warn!("writing --decisions-out: {e}");
        }
    }
}
