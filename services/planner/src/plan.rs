//! The planner's decisions, interval by interval, without I/O: load scaling steps each role
//! ±1 on its engines' load reports; throughput scaling sizes each role for the predicted
//! demand and, with load scaling on, is its lower bound; the GPU budget caps scale-ups.

use std::collections::BTreeMap;

use crate::load::{decide, with_backlog, Outcome, Role, Signal, Step, Stepper};
use crate::observe::{RoleView, Traffic};
use crate::predict::{Predictor, PredictorKind, WithinObserved};
use crate::profile::TimeModels;
use crate::sizing::{self, Demand};

/// Throughput (SLA) scaling's settings.
#[derive(Clone, Debug)]
pub struct ThroughputSettings {
    pub models: TimeModels,
    pub ttft_ms: f64,
    pub itl_ms: f64,
    pub predictor: PredictorKind,
}

/// Everything the planner decides with.
#[derive(Clone, Debug)]
pub struct Settings {
    /// The roles scaled, in the order they are decided.
    pub roles: Vec<Role>,
    /// What load scaling measures engines by.
    pub signal: Signal,
    pub load_scaling: bool,
    /// Consecutive intervals a role must qualify for a step down before it is taken (the
    /// load gauges are instantaneous: one quiet sample is no trend).
    pub down_after: u32,
    pub throughput: Option<ThroughputSettings>,
    pub min: u32,
    pub max: u32,
    pub gpu_budget: u32,
    /// GPUs of one replica, per role.
    pub gpus: BTreeMap<Role, u32>,
    /// Intervals a decision may take to show in discovery before it is given up.
    pub patience: u32,
}

/// A change of one role's replicas, with why.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub role: Role,
    pub current: u32,
    pub desired: u32,
    pub reason: String,
}

/// What throughput scaling predicted last.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Forecast {
    pub demand: Option<Demand>,
    /// Model estimates at the sized replicas.
    pub ttft_ms: f64,
    pub itl_ms: f64,
}

/// The predicted series of throughput scaling.
struct Series {
    rate: Box<dyn Predictor>,
    isl: Box<dyn Predictor>,
    osl: Box<dyn Predictor>,
    hit: Box<dyn Predictor>,
}

/// One role's state.
struct RoleState {
    stepper: Stepper,
    /// Throughput scaling's replicas, with its reason.
    floor: Option<(u32, String)>,
    /// Consecutive intervals that qualified for a step down.
    quiet: u32,
}

pub struct Planner {
    settings: Settings,
    roles: BTreeMap<Role, RoleState>,
    series: Option<Series>,
    forecast: Forecast,
}

/// One role's load-scaling verdict: the replicas it asks for and why.
struct Wanted {
    replicas: u32,
    reason: String,
}

impl Planner {
    pub fn new(settings: Settings) -> Planner {
        let roles = settings
            .roles
            .iter()
            .map(|r| {
                let state = RoleState {
                    stepper: Stepper::new(settings.min, settings.max, settings.patience),
                    floor: None,
                    quiet: 0,
                };
                (*r, state)
            })
            .collect();
        // The request rate may trend past anything seen (a ramp); lengths and the hit rate
        // are forecast within what was observed.
        let bounded = |k: PredictorKind| Box::new(WithinObserved::new(k.build()));
        let series = settings.throughput.as_ref().map(|t| Series {
            rate: t.predictor.build(),
            isl: bounded(t.predictor),
            osl: bounded(t.predictor),
            hit: bounded(t.predictor),
        });
        Planner {
            settings,
            roles,
            series,
            forecast: Forecast::default(),
        }
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    pub fn forecast(&self) -> Forecast {
        self.forecast
    }

    /// What load scaling measures engines by.
    pub fn signal(&self) -> &Signal {
        &self.settings.signal
    }

    /// The actuator could not apply the last decision for `role`: decide afresh next time.
    pub fn forget_pending(&mut self, role: Role) {
        if let Some(s) = self.roles.get_mut(&role) {
            s.stepper.forget_pending();
        }
    }

    /// Throughput scaling: takes the traffic of the interval that ended, predicts the next
    /// and sizes each role for it (the floor of later decisions).
    pub fn observe_traffic(&mut self, t: &Traffic) {
        let (Some(series), Some(tp)) = (self.series.as_mut(), self.settings.throughput.as_ref())
        else {
            return;
        };
        series.rate.observe(t.rps);
        // Means need finished requests; an idle interval keeps the last shape.
        t.isl.inspect(|v| series.isl.observe(*v));
        t.osl.inspect(|v| series.osl.observe(*v));
        t.kv_hit_rate.inspect(|v| series.hit.observe(*v));
        let (Some(rps), Some(isl), Some(osl)) = (
            series.rate.predict(),
            series.isl.predict(),
            series.osl.predict(),
        ) else {
            return;
        };
        let demand = Demand {
            rps: rps.max(0.0),
            isl: isl.max(0.0),
            osl: osl.max(1.0),
            kv_hit_rate: series.hit.predict().unwrap_or(0.0).clamp(0.0, 1.0),
        };
        self.size_for(demand, tp.clone());
    }

    fn size_for(&mut self, d: Demand, tp: ThroughputSettings) {
        let (min, max) = (self.settings.min, self.settings.max);
        let prefill = sizing::prefill(&d, &tp.models.prefill, min, max);
        let decode = sizing::decode(
            &d,
            &tp.models.decode,
            tp.itl_ms,
            tp.models.max_batch,
            (min, max),
        );
        let (Ok(prefill), Ok(decode)) = (prefill, decode) else {
            tracing::warn!("throughput scaling: cannot size {d:?}; keeping the last floors");
            return;
        };
        let context = d.isl + d.osl / 2.0;
        self.forecast = Forecast {
            demand: Some(d),
            ttft_ms: tp.models.prefill.time_ms(d.isl * (1.0 - d.kv_hit_rate)),
            itl_ms: tp.models.decode.step_ms(decode.batch as f64, context),
        };
        if !decode.feasible {
            tracing::warn!(
                "throughput scaling: even one sequence per step misses the ITL target of {} ms \
                 at context {context:.0}",
                tp.itl_ms
            );
        }
        let shape = format!(
            "predicted {:.2} req/s, ISL {:.0}, OSL {:.0}, KV hit {:.2}",
            d.rps, d.isl, d.osl, d.kv_hit_rate
        );
        let [p, dec] = self.fit([prefill.replicas, decode.replicas]);
        for (role, state) in self.roles.iter_mut() {
            let floor = match role {
                Role::Prefill => (
                    p,
                    format!(
                        "{shape}: {:.2} req/s per prefill replica",
                        prefill.replica_rps
                    ),
                ),
                Role::Decode => (
                    dec,
                    format!(
                        "{shape}: batch {} meets ITL {} ms, {:.2} req/s per decode replica",
                        decode.batch, tp.itl_ms, decode.replica_rps
                    ),
                ),
                // One aggregated replica both prefills and decodes each request.
                Role::Aggregated => {
                    let both = 1.0 / (1.0 / prefill.replica_rps + 1.0 / decode.replica_rps);
                    let n =
                        ((d.rps / both).ceil() as u32).clamp(self.settings.min, self.settings.max);
                    (
                        n,
                        format!("{shape}: {both:.2} req/s per aggregated replica"),
                    )
                }
            };
            state.floor = Some(floor);
        }
    }

    /// Prefill and decode replicas within the GPU budget (only the roles scaled count).
    fn fit(&self, want: [u32; 2]) -> [u32; 2] {
        let scaled = |r| self.roles.contains_key(&r);
        let gpus = [Role::Prefill, Role::Decode].map(|r| if scaled(r) { self.gpus(r) } else { 0 });
        let mins = [self.settings.min; 2];
        sizing::fit_budget(want, mins, gpus, self.settings.gpu_budget).unwrap_or(mins)
    }

    fn gpus(&self, role: Role) -> u32 {
        self.settings.gpus.get(&role).copied().unwrap_or(1)
    }

    /// This interval's decisions from every role's view (roles absent from `views` have no
    /// replicas registered).
    pub fn decide(&mut self, views: &BTreeMap<Role, RoleView>) -> Vec<Decision> {
        let empty = RoleView::default();
        // GPUs held or about to be: a scale-up still starting counts at its target.
        let held = |p: &Planner, r: Role| {
            let actual = views.get(&r).unwrap_or(&empty).replicas;
            let pending = p.roles.get(&r).and_then(|s| s.stepper.pending());
            actual.max(pending.unwrap_or(0))
        };
        let mut used: u32 = self
            .settings
            .roles
            .iter()
            .map(|r| held(self, *r) * self.gpus(*r))
            .sum();
        let (min, max) = (self.settings.min, self.settings.max);
        let decode_over = self.over(Role::Decode, views.get(&Role::Decode));
        let mut out = Vec::new();
        for role in self.settings.roles.clone() {
            let view = views.get(&role).unwrap_or(&empty);
            let actual = view.replicas;
            let before = held(self, role);
            // The router queues while decode workers are full too: then the backlog waits
            // for decode, which scales on its own load, not for prefill.
            let backlog = if role == Role::Decode || decode_over {
                0.0
            } else {
                view.backlog_tokens
            };
            let mut want = self.wanted(role, view, backlog);
            want.replicas = want.replicas.clamp(min, max.max(min));
            let extra = want.replicas.saturating_sub(before) * self.gpus(role);
            if extra > 0 && used + extra > self.settings.gpu_budget {
                let room = (self.settings.gpu_budget.saturating_sub(used)) / self.gpus(role);
                want.reason = format!(
                    "{}; capped by the GPU budget of {} ({used} in use)",
                    want.reason, self.settings.gpu_budget
                );
                want.replicas = (before + room).max(min);
            }
            let Some(state) = self.roles.get_mut(&role) else {
                continue;
            };
            match state.stepper.to(want.replicas, actual) {
                Outcome::Scale(n) => {
                    used = used + n * self.gpus(role) - before.min(n) * self.gpus(role);
                    out.push(Decision {
                        role,
                        current: actual,
                        desired: n,
                        reason: want.reason,
                    });
                }
                Outcome::Stay => {}
                Outcome::Waiting(n) => {
                    tracing::debug!("{}: waiting for {n} replicas (now {actual})", role.name())
                }
            }
        }
        out
    }

    /// Whether an engine of `role` is over its upper load threshold.
    fn over(&self, role: Role, view: Option<&RoleView>) -> bool {
        let signal = &self.settings.signal;
        let (up, _) = signal.thresholds(role);
        view.is_some_and(|v| v.loads.iter().any(|l| signal.load(role, l) > up))
    }

    /// What load and throughput scaling ask of one role, `backlog` prompt tokens waiting in
    /// the router for its engines.
    fn wanted(&mut self, role: Role, view: &RoleView, backlog: f64) -> Wanted {
        let actual = view.replicas;
        let floor = self.roles.get(&role).and_then(|s| s.floor.clone());
        let mut want = if self.settings.load_scaling {
            self.load_verdict(role, view, backlog)
        } else {
            Wanted {
                replicas: actual,
                reason: "no load scaling".into(),
            }
        };
        if let Some((n, why)) = floor {
            if n > want.replicas || !self.settings.load_scaling {
                want = Wanted {
                    replicas: n,
                    reason: format!("throughput: {why}"),
                };
            }
        }
        if actual < self.settings.min && want.replicas <= actual {
            want.reason = format!("below the minimum of {}", self.settings.min);
        }
        want
    }

    fn load_verdict(&mut self, role: Role, view: &RoleView, backlog: f64) -> Wanted {
        let actual = view.replicas;
        let (up, down) = self.settings.signal.thresholds(role);
        let what = self.settings.signal.load_name(role);
        let loads = with_backlog(&view.loads, backlog);
        let mut step = decide(role, &self.settings.signal, &loads);
        if matches!(step, Step::Down { .. }) && view.missing > 0 {
            // Scaling down needs every engine's report.
            step = Step::NoReports;
        }
        let need = self.settings.down_after;
        let under = if down == 0.0 {
            "at 0".to_string()
        } else {
            format!("below {down}")
        };
        if let Some(state) = self.roles.get_mut(&role) {
            state.quiet = match step {
                Step::Down { .. } => state.quiet + 1,
                _ => 0,
            };
            if let Step::Down { load } = step {
                if state.quiet < need {
                    return Wanted {
                        replicas: actual,
                        reason: format!(
                            "load: {what} {under} on every engine ({load:.2}) for {} of {need} \
                             intervals",
                            state.quiet
                        ),
                    };
                }
                state.quiet = 0;
            }
        }
        let queued = if backlog > 0.0 {
            format!(" ({backlog:.0} prompt tokens queued in the router)")
        } else {
            String::new()
        };
        let reason = match step {
            Step::Up { load } => format!("load: {what} {load:.2} over {up} on an engine{queued}"),
            Step::Down { load } => format!(
                "load: {what} {under} on every engine for {need} intervals (highest {load:.2})"
            ),
            Step::Hold { load } => format!("load: {what} {load:.2} within [{down}, {up}]"),
            Step::NoReports => format!(
                "metrics gap: {} of {actual} engines reported; holding",
                view.loads.len()
            ),
        };
        if step == Step::NoReports && actual > 0 {
            tracing::warn!("{}: {reason}", role.name());
        }
        Wanted {
            replicas: Stepper::want(step, actual),
            reason,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::{EngineLoad, Target};
    use crate::profile::ProfileData;

    fn settings(roles: &[Role], load: bool, tp: Option<ThroughputSettings>) -> Settings {
        Settings {
            roles: roles.to_vec(),
            signal: Signal::Thresholds(Target::Latency),
            load_scaling: load,
            down_after: 1,
            throughput: tp,
            min: 1,
            max: 4,
            gpu_budget: 5,
            gpus: roles.iter().map(|r| (*r, 1)).collect(),
            patience: 10,
        }
    }

    fn view(replicas: u32, kv: &[f64]) -> RoleView {
        RoleView {
            replicas,
            loads: kv
                .iter()
                .map(|k| EngineLoad {
                    queued_prefill_tokens: 0.0,
                    context_length: 4096.0,
                    kv_tokens: k * 1000.0,
                    kv_capacity: 1000.0,
                    sequences: 1.0,
                })
                .collect(),
            missing: 0,
            backlog_tokens: 0.0,
        }
    }

    #[test]
    fn load_scaling_steps_and_respects_the_budget() {
        let mut p = Planner::new(settings(&[Role::Decode, Role::Aggregated], true, None));
        // Nothing registered: both roles go to their minimum.
        let d = p.decide(&BTreeMap::new());
        assert_eq!(d.iter().map(|d| d.desired).collect::<Vec<_>>(), vec![1, 1]);
        assert!(d[0].reason.contains("below the minimum"));
        // Decode busy (0.5 > 0.4): up by one.
        let views = BTreeMap::from([
            (Role::Decode, view(1, &[0.5])),
            (Role::Aggregated, view(1, &[0.2])),
        ]);
        let d = p.decide(&views);
        assert_eq!(d.len(), 1);
        assert_eq!((d[0].current, d[0].desired), (1, 2));
        assert!(
            d[0].reason.contains("KV load 0.50 over 0.4"),
            "{}",
            d[0].reason
        );
        // Budget 5 with 4 in use: the busy aggregated role gets the last GPU only.
        let views = BTreeMap::from([
            (Role::Decode, view(2, &[0.9, 0.9])),
            (Role::Aggregated, view(2, &[0.9, 0.9])),
        ]);
        let d = p.decide(&views);
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!(d[0].role, Role::Decode);
        let views = BTreeMap::from([
            (Role::Decode, view(3, &[0.9, 0.9, 0.9])),
            (Role::Aggregated, view(2, &[0.9, 0.9])),
        ]);
        assert!(p.decide(&views).is_empty(), "no GPU left");
        // A missing report blocks scaling down.
        let mut quiet = view(3, &[0.0, 0.0]);
        quiet.missing = 1;
        let views = BTreeMap::from([
            (Role::Decode, quiet),
            (Role::Aggregated, view(2, &[0.0, 0.0])),
        ]);
        let d = p.decide(&views);
        assert_eq!(d.len(), 1);
        assert_eq!((d[0].role, d[0].desired), (Role::Aggregated, 1));
    }

    #[test]
    fn the_routers_backlog_is_prefill_work_unless_decode_is_full() {
        let mut p = Planner::new(settings(&[Role::Prefill, Role::Decode], true, None));
        let prefill = |backlog: f64| {
            let mut v = view(1, &[0.0]);
            v.backlog_tokens = backlog;
            v
        };
        // Latency target: prefill goes up at 0.1 of a context (409.6 tokens) queued; its
        // engine's queue is empty, but 2,048 tokens wait in the router.
        let views = BTreeMap::from([
            (Role::Prefill, prefill(2048.0)),
            (Role::Decode, view(1, &[0.2])),
        ]);
        let d = p.decide(&views);
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!((d[0].role, d[0].desired), (Role::Prefill, 2));
        assert!(
            d[0].reason
                .contains("2048 prompt tokens queued in the router"),
            "{}",
            d[0].reason
        );
        // With decode over its threshold the queue waits for decode: decode goes up, prefill
        // holds.
        let mut p = Planner::new(settings(&[Role::Prefill, Role::Decode], true, None));
        let views = BTreeMap::from([
            (Role::Prefill, prefill(2048.0)),
            (Role::Decode, view(1, &[0.9])),
        ]);
        let d = p.decide(&views);
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!((d[0].role, d[0].desired), (Role::Decode, 2));
        // A backlog blocks a prefill step down: two idle engines with 400 tokens queued in
        // the router each see 200 (0.05 of a context: over 0, under 0.1, hold).
        let mut p = Planner::new(settings(&[Role::Prefill], true, None));
        let mut two = view(2, &[0.0, 0.0]);
        two.backlog_tokens = 400.0;
        assert!(p.decide(&BTreeMap::from([(Role::Prefill, two)])).is_empty());
    }

    #[test]
    fn a_step_down_waits_for_consecutive_quiet_intervals() {
        let mut s = settings(&[Role::Decode], true, None);
        s.down_after = 3;
        let mut p = Planner::new(s);
        let quiet = BTreeMap::from([(Role::Decode, view(2, &[0.0, 0.0]))]);
        let busy = BTreeMap::from([(Role::Decode, view(2, &[0.3, 0.0]))]);
        assert!(p.decide(&quiet).is_empty());
        assert!(p.decide(&quiet).is_empty());
        // A busier interval starts the count again.
        assert!(p.decide(&busy).is_empty());
        assert!(p.decide(&quiet).is_empty());
        assert!(p.decide(&quiet).is_empty());
        let d = p.decide(&quiet);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].desired, 1);
        assert!(d[0].reason.contains("for 3 intervals"), "{}", d[0].reason);
    }

    #[test]
    fn throughput_floor_sizes_roles_from_the_profile() {
        // Prefill: 1,000 tokens take 100 ms → 10 req/s a replica. Decode: step time 10 ms
        // flat up to the ITL of 20 ms → batch 64 (the maximum) / (100 tokens × 10 ms) =
        // 64 req/s a replica.
        let data: ProfileData = serde_json::from_str(
            r#"{"prefill": [[0, 0], [1000, 100]], "decode": [[0, 10], [1, 10]],
                "kv_capacity_tokens": 1e9, "max_num_batched_tokens": 8192,
                "max_num_seqs": 64}"#,
        )
        .unwrap();
        let tp = ThroughputSettings {
            models: data.models().unwrap(),
            ttft_ms: 500.0,
            itl_ms: 20.0,
            predictor: PredictorKind::Constant,
        };
        let mut p = Planner::new(settings(&[Role::Prefill, Role::Decode], false, Some(tp)));
        let t = Traffic {
            secs: 60.0,
            requests: 1800.0,
            rps: 30.0,
            isl: Some(1000.0),
            osl: Some(100.0),
            ttft_ms: None,
            itl_ms: None,
            kv_hit_rate: Some(0.0),
        };
        p.observe_traffic(&t);
        let f = p.forecast();
        assert_eq!(f.demand.unwrap().rps, 30.0);
        assert!((f.ttft_ms - 100.0).abs() < 1e-9);
        let views = BTreeMap::from([(Role::Prefill, view(1, &[])), (Role::Decode, view(1, &[]))]);
        let d = p.decide(&views);
        // 30 / 10 = 3 prefill replicas; 30 / 64 → 1 decode replica (no change).
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!((d[0].role, d[0].desired), (Role::Prefill, 3));
        assert!(d[0].reason.starts_with("throughput: predicted 30.00 req/s"));
        // Prefill 3 + decode 1 fit the budget of 5; at 60 req/s prefill wants 6: the budget
        // leaves it 4.
        let mut t2 = t;
        t2.rps = 60.0;
        p.observe_traffic(&t2);
        let views = BTreeMap::from([(Role::Prefill, view(3, &[])), (Role::Decode, view(1, &[]))]);
        let d = p.decide(&views);
        assert_eq!((d[0].role, d[0].desired), (Role::Prefill, 4), "{d:?}");
    }
}
