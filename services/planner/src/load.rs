//! Reactive (load) scaling: each short interval, one step up or down per role from the
//! engines' own load reports, with hysteresis and a guard against acting while the previous
//! decision is still being applied (Dynamo's easy modes, `dynamo-notes.md` §6.3).
//!
//! - Thresholds (Dynamo's): prefill by its queued prefill tokens over the context length,
//!   decode and aggregated by KV utilisation, (scheduled + queued KV tokens) over capacity.
//! - SLA: each engine's estimated TTFT (its queue prefilled by the profile's prefill model)
//!   over `--ttft`, and estimated ITL (a step of its batch at its mean context, by the decode
//!   model) over `--itl`; aggregated engines by the larger of the two. Up over 1.0, down
//!   under 0.6.
//! - Up when ANY engine is above the target's upper threshold, down when ALL are below its
//!   lower one and would stay so with the load of one engine spread over the others
//!   (hysteresis: a step down never triggers the next step up), otherwise hold; no reports
//!   at all (a metrics gap) holds and says so.

use crate::perf::{DecodeModel, PrefillModel};

/// One engine's load over the last interval.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineLoad {
    /// Prompt tokens waiting to be prefilled.
    pub queued_prefill_tokens: f64,
    /// The model's context length.
    pub context_length: f64,
    /// KV tokens of running and queued sequences.
    pub kv_tokens: f64,
    /// KV tokens the engine's pool holds.
    pub kv_capacity: f64,
    /// Sequences running and waiting.
    pub sequences: f64,
}

impl EngineLoad {
    /// The load of `engines` carried by `n` of them (what one engine fewer would see).
    fn spread(engines: &[EngineLoad], n: usize) -> EngineLoad {
        let n = n.max(1) as f64;
        let sum = |f: fn(&EngineLoad) -> f64| engines.iter().map(f).sum::<f64>() / n;
        EngineLoad {
            queued_prefill_tokens: sum(|e| e.queued_prefill_tokens),
            context_length: engines.first().map_or(1.0, |e| e.context_length),
            kv_tokens: sum(|e| e.kv_tokens),
            kv_capacity: engines.first().map_or(1.0, |e| e.kv_capacity),
            sequences: sum(|e| e.sequences),
        }
    }
}

/// `engines` with `tokens` more prompt tokens queued, shared evenly: the router's backlog,
/// which any of them may be given.
pub fn with_backlog(engines: &[EngineLoad], tokens: f64) -> Vec<EngineLoad> {
    let share = tokens.max(0.0) / engines.len().max(1) as f64;
    engines
        .iter()
        .map(|e| EngineLoad {
            queued_prefill_tokens: e.queued_prefill_tokens + share,
            ..*e
        })
        .collect()
}

/// Latency estimates from the profile's time models, against the SLA.
#[derive(Clone, Debug)]
pub struct SlaEstimate {
    pub prefill: PrefillModel,
    pub decode: DecodeModel,
    pub ttft_ms: f64,
    pub itl_ms: f64,
}

impl SlaEstimate {
    /// What a request arriving now waits for its first token beyond its own prefill: the
    /// engine's queue, prefilled in chunks.
    pub fn ttft_ms(&self, e: &EngineLoad) -> f64 {
        self.prefill.time_ms(e.queued_prefill_tokens)
    }

    /// One decode step of every sequence the engine holds, at their mean context.
    pub fn itl_ms(&self, e: &EngineLoad) -> f64 {
        if e.sequences < 1.0 {
            return 0.0;
        }
        self.decode.step_ms(e.sequences, e.kv_tokens / e.sequences)
    }
}

/// What load scaling measures an engine by.
#[derive(Clone, Debug)]
pub enum Signal {
    /// The queue and KV thresholds of a target (Dynamo's).
    Thresholds(Target),
    /// Estimated TTFT and ITL over the SLA.
    Sla(SlaEstimate),
}

/// Up over this estimate / SLA ratio; down when one engine fewer stays under [`SLA_DOWN`].
const SLA_UP: f64 = 1.0;
const SLA_DOWN: f64 = 0.6;

impl Signal {
    /// The load an engine shows for `role`.
    pub fn load(&self, role: Role, e: &EngineLoad) -> f64 {
        match self {
            Signal::Thresholds(_) => load_of(role, e),
            Signal::Sla(s) => match role {
                Role::Prefill => s.ttft_ms(e) / s.ttft_ms,
                Role::Decode => s.itl_ms(e) / s.itl_ms,
                Role::Aggregated => (s.ttft_ms(e) / s.ttft_ms).max(s.itl_ms(e) / s.itl_ms),
            },
        }
    }

    /// `(up, down)` of `role`'s load.
    pub fn thresholds(&self, role: Role) -> (f64, f64) {
        match self {
            Signal::Thresholds(target) => thresholds(role, *target),
            Signal::Sla(_) => (SLA_UP, SLA_DOWN),
        }
    }

    /// What the load of `role` measures, for reasons.
    pub fn load_name(&self, role: Role) -> &'static str {
        match (self, role) {
            (Signal::Thresholds(_), _) => role.load_name(),
            (Signal::Sla(_), Role::Prefill) => "estimated TTFT / SLA",
            (Signal::Sla(_), Role::Decode) => "estimated ITL / SLA",
            (Signal::Sla(_), Role::Aggregated) => "estimated TTFT or ITL / SLA",
        }
    }
}

/// What the thresholds favour.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Full engines before adding one (fewer GPUs).
    Throughput,
    /// Headroom before queues form (lower latency).
    Latency,
}

/// The role a decision is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    Prefill,
    Decode,
    Aggregated,
}

impl Role {
    /// The name in flags, files and metric labels: `prefill`, `decode`, `agg`.
    pub fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Aggregated => "agg",
        }
    }

    /// The role of a discovered worker (`pd` decode workers count as decode; encode workers
    /// are not scaled).
    pub fn of_worker(role: &str) -> Option<Role> {
        match role {
            "prefill" => Some(Role::Prefill),
            "decode" | "pd" => Some(Role::Decode),
            "agg" => Some(Role::Aggregated),
            _ => None,
        }
    }

    /// What the load of this role measures, for reasons.
    pub fn load_name(self) -> &'static str {
        match self {
            Role::Prefill => "queued prefill (contexts)",
            Role::Decode | Role::Aggregated => "KV load",
        }
    }
}

/// A decision of one interval, with why.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Step {
    Up {
        load: f64,
    },
    Down {
        load: f64,
    },
    Hold {
        load: f64,
    },
    /// No engine reported: replicas stay as they are.
    NoReports,
}

/// `(up, down)`: scale up when a load is at or above `up` (prefill) / above `up` (KV), down
/// when every load is below `down` (or at zero for the latency prefill rule).
pub fn thresholds(role: Role, target: Target) -> (f64, f64) {
    match (role, target) {
        (Role::Prefill, Target::Throughput) => (1.0, 0.1),
        (Role::Prefill, Target::Latency) => (0.1, 0.0),
        (_, Target::Throughput) => (1.0, 0.6),
        (_, Target::Latency) => (0.4, 0.1),
    }
}

/// The load an engine shows for `role`.
pub fn load_of(role: Role, e: &EngineLoad) -> f64 {
    match role {
        Role::Prefill => e.queued_prefill_tokens / e.context_length.max(1.0),
        Role::Decode | Role::Aggregated => e.kv_tokens / e.kv_capacity.max(1.0),
    }
}

/// This interval's step for `role` from its engines' loads.
pub fn decide(role: Role, signal: &Signal, engines: &[EngineLoad]) -> Step {
    let loads: Vec<f64> = engines.iter().map(|e| signal.load(role, e)).collect();
    let Some(max) = loads.iter().copied().reduce(f64::max) else {
        return Step::NoReports;
    };
    let (up, down) = signal.thresholds(role);
    let above = match (role, signal) {
        (Role::Prefill, Signal::Thresholds(_)) => max >= up,
        _ => max > up,
    };
    let below = |load: f64| match (role, signal) {
        (Role::Prefill, Signal::Thresholds(Target::Latency)) => load <= down,
        _ => load < down,
    };
    // Hysteresis: one engine fewer must still be under the lower threshold with the whole
    // load on the rest, or the step down would undo itself (Dynamo's rule alone flaps: two
    // engines at 0.5 of a 0.6 threshold go down to one at 1.0, which goes up again).
    // A lone engine (a minimum of zero) steps down only when idle.
    let after = match loads.len() {
        1 if max > 0.0 => f64::INFINITY,
        1 => 0.0,
        n => signal.load(role, &EngineLoad::spread(engines, n - 1)),
    };
    let all_below = below(max) && below(after);
    if above {
        Step::Up { load: max }
    } else if all_below {
        Step::Down { load: max }
    } else {
        Step::Hold { load: max }
    }
}

/// One role's replicas under reactive scaling: ±1 a step, within bounds, and no new
/// decision until the last one shows in the actual replicas (or has waited too long: a
/// worker that died while starting never shows).
#[derive(Debug)]
pub struct Stepper {
    min: u32,
    max: u32,
    /// The last decision not yet seen applied.
    pending: Option<Pending>,
    /// Intervals a decision may take to show before it is given up.
    patience: u32,
}

#[derive(Clone, Copy, Debug)]
struct Pending {
    from: u32,
    to: u32,
    waited: u32,
}

impl Pending {
    /// Landed: the replicas reached the target from the side they left (a count that moved
    /// past it, say a crash during a scale-down, counts too).
    fn landed(&self, actual: u32) -> bool {
        if self.to >= self.from {
            actual >= self.to
        } else {
            actual <= self.to
        }
    }
}

/// What a [`Stepper`] did with a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Scale to this many replicas.
    Scale(u32),
    /// Nothing to do (hold, or already at a bound).
    Stay,
    /// The previous decision (to this many) is still being applied.
    Waiting(u32),
}

impl Stepper {
    /// Gives up waiting for the last decision (its actuator failed to apply it, or it was
    /// not applied: a dry run).
    pub fn forget_pending(&mut self) {
        self.pending = None;
    }

    /// The replicas the last decision not yet applied asked for.
    pub fn pending(&self) -> Option<u32> {
        self.pending.map(|p| p.to)
    }

    /// Bounds `[min, max]`; a decision not showing after `patience` intervals is given up.
    pub fn new(min: u32, max: u32, patience: u32) -> Self {
        Stepper {
            min,
            max: max.max(min),
            pending: None,
            patience: patience.max(1),
        }
    }

    /// The outcome of `step` when `actual` replicas are running now.
    pub fn next(&mut self, step: Step, actual: u32) -> Outcome {
        self.to(Self::want(step, actual), actual)
    }

    /// The replicas `step` asks for from `actual` (before bounds).
    pub fn want(step: Step, actual: u32) -> u32 {
        match step {
            Step::Up { .. } => actual.saturating_add(1),
            Step::Down { .. } => actual.saturating_sub(1),
            Step::Hold { .. } | Step::NoReports => actual,
        }
    }

    /// The outcome of asking for `want` replicas when `actual` are running now.
    pub fn to(&mut self, want: u32, actual: u32) -> Outcome {
        if let Some(p) = self.pending.as_mut() {
            if !p.landed(actual) {
                p.waited += 1;
                if p.waited <= self.patience {
                    return Outcome::Waiting(p.to);
                }
                tracing::warn!(
                    "{actual} replicas, not the {} decided {} intervals ago; deciding afresh",
                    p.to,
                    p.waited
                );
            }
            self.pending = None;
        }
        let want = want.clamp(self.min, self.max);
        if want == actual {
            return Outcome::Stay;
        }
        self.pending = Some(Pending {
            from: actual,
            to: want,
            waited: 0,
        });
        Outcome::Scale(want)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(queued: f64, kv: f64) -> EngineLoad {
        EngineLoad {
            queued_prefill_tokens: queued,
            context_length: 4096.0,
            kv_tokens: kv,
            kv_capacity: 10_000.0,
            sequences: 0.0,
        }
    }

    fn decide(role: Role, target: Target, engines: &[EngineLoad]) -> Step {
        super::decide(role, &Signal::Thresholds(target), engines)
    }

    /// Prefill: 0.1 ms a token up to a 1,000-token chunk. Decode: a step is 10 ms plus 1 ms
    /// per sequence at 1,000 tokens of context, and 2 ms per sequence at 3,000.
    fn sla() -> Signal {
        Signal::Sla(SlaEstimate {
            prefill: PrefillModel::new(vec![(0.0, 0.0), (1000.0, 100.0)], 1000).unwrap(),
            decode: DecodeModel::new(
                &[1000.0, 3000.0],
                &[0.0, 100.0],
                &[vec![10.0, 110.0], vec![10.0, 210.0]],
            )
            .unwrap(),
            ttft_ms: 200.0,
            itl_ms: 50.0,
        })
    }

    #[test]
    fn sla_estimates_by_hand() {
        use Role::*;
        let s = sla();
        // 3,000 queued tokens: three 100 ms chunks, 300 ms over a 200 ms TTFT: 1.5, up.
        assert_eq!(
            super::decide(Prefill, &s, &[engine(3000.0, 0.0)]),
            Step::Up { load: 1.5 }
        );
        // 500 and 400 queued: 50 and 40 ms (0.25, 0.2); on one engine 900 tokens, 90 ms
        // (0.45 < 0.6): down.
        let light = [engine(500.0, 0.0), engine(400.0, 0.0)];
        assert_eq!(
            super::decide(Prefill, &s, &light),
            Step::Down { load: 0.25 }
        );
        // 1,000 and 400: 0.5 and 0.2, but 140 ms (0.7) on one engine: hold.
        let mid = [engine(1000.0, 0.0), engine(400.0, 0.0)];
        assert_eq!(super::decide(Prefill, &s, &mid), Step::Hold { load: 0.5 });
        // Decode: 20 sequences of 2,000 tokens: 10 + 1.5 × 20 = 40 ms, 0.8 of a 50 ms ITL.
        let d = |seqs: f64, ctx: f64| EngineLoad {
            sequences: seqs,
            ..engine(0.0, seqs * ctx)
        };
        assert_eq!(
            super::decide(Decode, &s, &[d(20.0, 2000.0)]),
            Step::Hold { load: 0.8 }
        );
        // 30 sequences at 2,000: 55 ms, 1.1: up.
        let load = s.load(Decode, &d(30.0, 2000.0));
        assert!((load - 1.1).abs() < 1e-9, "{load}");
        // 5 + 5 sequences at 1,000: 15 ms each (0.3); one engine with 10 at 1,000: 20 ms
        // (0.4): down. Idle engines estimate 0.
        let two = [d(5.0, 1000.0), d(5.0, 1000.0)];
        assert_eq!(super::decide(Decode, &s, &two), Step::Down { load: 0.3 });
        assert_eq!(s.load(Decode, &d(0.0, 0.0)), 0.0);
        // Aggregated: the larger of the two ratios.
        let agg = EngineLoad {
            queued_prefill_tokens: 3000.0,
            ..d(5.0, 1000.0)
        };
        assert_eq!(s.load(Aggregated, &agg), 1.5);
    }

    #[test]
    fn up_on_any_engine_down_on_all() {
        use Role::*;
        use Target::*;
        // KV 11,000 / 10,000 on one engine is over 1.0: up.
        let busy = [engine(0.0, 11_000.0), engine(0.0, 1_000.0)];
        assert_eq!(decide(Decode, Throughput, &busy), Step::Up { load: 1.1 });
        // 0.3 and 0.2: none over 1.0, all below 0.6, and 0.5 on one engine still is: down.
        let quiet = [engine(0.0, 3_000.0), engine(0.0, 2_000.0)];
        assert_eq!(decide(Decode, Throughput, &quiet), Step::Down { load: 0.3 });
        // 0.5 and 0.1 are below 0.6, but 0.6 on one engine is not: hold (no flapping).
        let half = [engine(0.0, 5_000.0), engine(0.0, 1_000.0)];
        assert_eq!(decide(Decode, Throughput, &half), Step::Hold { load: 0.5 });
        // In latency mode 0.5 is over 0.4: up.
        assert_eq!(decide(Aggregated, Latency, &half), Step::Up { load: 0.5 });
        // One engine goes down (to a minimum of zero) only when idle.
        assert_eq!(
            decide(Decode, Throughput, &[engine(0.0, 1_000.0)]),
            Step::Hold { load: 0.1 }
        );
        assert_eq!(
            decide(Decode, Throughput, &[engine(0.0, 0.0)]),
            Step::Down { load: 0.0 }
        );
        // 0.7: between 0.6 and 1.0, hold.
        assert_eq!(
            decide(Decode, Throughput, &[engine(0.0, 7_000.0)]),
            Step::Hold { load: 0.7 }
        );
        // Prefill: 4,096 queued tokens is one context: up at ≥ 1.0.
        assert_eq!(
            decide(Prefill, Throughput, &[engine(4096.0, 0.0)]),
            Step::Up { load: 1.0 }
        );
        // Latency prefill scales down only on empty queues.
        assert_eq!(
            decide(Prefill, Latency, &[engine(0.0, 0.0), engine(0.0, 0.0)]),
            Step::Down { load: 0.0 }
        );
        assert_eq!(
            decide(Prefill, Latency, &[engine(1.0, 0.0)]),
            Step::Hold { load: 1.0 / 4096.0 }
        );
        assert_eq!(decide(Prefill, Throughput, &[]), Step::NoReports);
    }

    #[test]
    fn one_step_at_a_time_within_bounds_after_the_last_one_landed() {
        let up = Step::Up { load: 2.0 };
        let down = Step::Down { load: 0.0 };
        let mut s = Stepper::new(1, 3, 2);
        assert_eq!(s.next(up, 1), Outcome::Scale(2));
        // Still 1 running: the decision to 2 is being applied, nothing new.
        assert_eq!(s.next(up, 1), Outcome::Waiting(2));
        assert_eq!(s.next(up, 2), Outcome::Scale(3));
        assert_eq!(s.next(up, 3), Outcome::Stay, "at the maximum");
        assert_eq!(s.next(Step::NoReports, 3), Outcome::Stay);
        assert_eq!(s.next(down, 3), Outcome::Scale(2));
        assert_eq!(s.next(down, 2), Outcome::Scale(1));
        assert_eq!(s.next(down, 1), Outcome::Stay, "at the minimum");
        // A scale-up whose worker never shows is given up after 2 intervals.
        assert_eq!(s.next(up, 1), Outcome::Scale(2));
        assert_eq!(s.next(up, 1), Outcome::Waiting(2));
        assert_eq!(s.next(up, 1), Outcome::Waiting(2));
        assert_eq!(s.next(up, 1), Outcome::Scale(2), "decided afresh");
        // A scale-down overtaken by a crash (3 -> 2 decided, 1 left) has landed.
        assert_eq!(s.next(up, 2), Outcome::Scale(3));
        assert_eq!(s.next(down, 3), Outcome::Scale(2));
        assert_eq!(s.next(Step::NoReports, 1), Outcome::Stay);
        assert_eq!(s.pending(), None);
    }
}
