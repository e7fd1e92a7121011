//! Replicas per role for a predicted demand (Dynamo's throughput planner, `dynamo-notes.md`
//! §6.2): prefill from the time of one request's effective prefill, decode from the largest
//! batch whose step meets the ITL target (Little's law), both within per-role bounds and a GPU
//! budget.

use crate::perf::{DecodeModel, PrefillModel};
use crate::PlanError;

/// The predicted load of the next interval.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Demand {
    /// Requests per second.
    pub rps: f64,
    /// Mean input tokens.
    pub isl: f64,
    /// Mean output tokens.
    pub osl: f64,
    /// Share of input tokens found in the prefix cache, 0 to 1.
    pub kv_hit_rate: f64,
}

impl Demand {
    fn check(&self) -> Result<(), PlanError> {
        let bad = |what, value, range| Err(PlanError::OutOfRange { what, value, range });
        if !(self.rps.is_finite() && self.rps >= 0.0) {
            return bad("request rate", self.rps, "finite, ≥ 0");
        }
        if !(self.isl.is_finite() && self.isl >= 0.0) {
            return bad("ISL", self.isl, "finite, ≥ 0");
        }
        if !(self.osl.is_finite() && self.osl >= 1.0) {
            return bad("OSL", self.osl, "finite, ≥ 1");
        }
        if !(0.0..=1.0).contains(&self.kv_hit_rate) {
            return bad("KV hit rate", self.kv_hit_rate, "0 to 1");
        }
        Ok(())
    }
}

/// A role's replicas and what one replica sustains.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RoleSize {
    pub replicas: u32,
    /// Requests per second one replica sustains at the demand's shape.
    pub replica_rps: f64,
    /// Decode only: the batch whose step meets the ITL target (0 for prefill).
    pub batch: usize,
    /// Whether one replica meets the target at all (decode: batch 1 within the ITL).
    pub feasible: bool,
}

/// Replicas needed for `rps` at `replica_rps` each, within `[min, max]`.
fn replicas_for(rps: f64, replica_rps: f64, min: u32, max: u32) -> u32 {
    let need = if replica_rps > 0.0 {
        (rps / replica_rps).ceil()
    } else {
        f64::from(max)
    };
    (need.min(f64::from(u32::MAX)) as u32).clamp(min, max.max(min))
}

/// Prefill replicas: one replica prefills `1000 / time(isl · (1 − hit rate))` requests a second.
pub fn prefill(
    d: &Demand,
    model: &PrefillModel,
    min: u32,
    max: u32,
) -> Result<RoleSize, PlanError> {
    d.check()?;
    let ms = model.time_ms(d.isl * (1.0 - d.kv_hit_rate));
    let replica_rps = if ms > 0.0 { 1000.0 / ms } else { f64::INFINITY };
    Ok(RoleSize {
        replicas: replicas_for(d.rps, replica_rps, min, max),
        replica_rps,
        batch: 0,
        feasible: true,
    })
}

/// Decode replicas: at context `isl + osl / 2` the largest batch `B ≤ max_batch` whose step
/// takes at most `itl_ms`; one replica then finishes `B / (osl · step)` requests a second.
pub fn decode(
    d: &Demand,
    model: &DecodeModel,
    itl_ms: f64,
    max_batch: usize,
    bounds: (u32, u32),
) -> Result<RoleSize, PlanError> {
    d.check()?;
    if !(itl_ms.is_finite() && itl_ms > 0.0) {
        return Err(PlanError::OutOfRange {
            what: "ITL target",
            value: itl_ms,
            range: "finite, > 0 ms",
        });
    }
    let context = d.isl + d.osl / 2.0;
    let fits = |b: usize| model.step_ms(b as f64, context) <= itl_ms;
    // Step time grows with the batch: binary search the last batch that fits.
    let (mut lo, mut hi) = (0usize, max_batch.max(1));
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let feasible = lo >= 1;
    let batch = lo.max(1);
    let step_s = model.step_ms(batch as f64, context) / 1000.0;
    let replica_rps = batch as f64 / (d.osl * step_s.max(1e-9));
    Ok(RoleSize {
        replicas: replicas_for(d.rps, replica_rps, bounds.0, bounds.1),
        replica_rps,
        batch,
        feasible,
    })
}

/// Fits prefill and decode replicas (`gpus` GPUs each) into `budget` GPUs: over budget, both
/// shrink in proportion, never below their minimums, then the role further above its minimum
/// gives up replicas until it fits. An error when the minimums alone exceed the budget.
pub fn fit_budget(
    replicas: [u32; 2],
    mins: [u32; 2],
    gpus: [u32; 2],
    budget: u32,
) -> Result<[u32; 2], PlanError> {
    let cost = |r: [u32; 2]| u64::from(r[0] * gpus[0]) + u64::from(r[1] * gpus[1]);
    if cost(mins) > u64::from(budget) {
        return Err(PlanError::OutOfRange {
            what: "GPU budget",
            value: f64::from(budget),
            range: "at least the GPUs of every role's minimum replicas",
        });
    }
    if cost(replicas) <= u64::from(budget) {
        return Ok(replicas);
    }
    let scale = f64::from(budget) / cost(replicas) as f64;
    let mut out = [0, 1].map(|i| ((f64::from(replicas[i]) * scale).floor() as u32).max(mins[i]));
    while cost(out) > u64::from(budget) {
        let spare = [0, 1].map(|i| out[i] - mins[i]);
        let i = if spare[0] >= spare[1] { 0 } else { 1 };
        out[i] -= 1;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demand(rps: f64, isl: f64, osl: f64, hit: f64) -> Demand {
        Demand {
            rps,
            isl,
            osl,
            kv_hit_rate: hit,
        }
    }

    #[test]
    fn prefill_by_hand() {
        // 10 ms + 0.02 ms a token, chunks of 8,192.
        let m = PrefillModel::new(vec![(0.0, 10.0), (8192.0, 173.84)], 8192).unwrap();
        // ISL 2,000 with half cached: 1,000 tokens, 30 ms: 33.3 requests/s a replica; 100
        // requests/s need ceil(3.0) = 3 replicas.
        let s = prefill(&demand(100.0, 2000.0, 100.0, 0.5), &m, 1, 16).unwrap();
        assert!((s.replica_rps - 1000.0 / 30.0).abs() < 1e-9);
        assert_eq!(s.replicas, 3);
        // Bounds hold both ways.
        assert_eq!(
            prefill(&demand(1000.0, 2000.0, 100.0, 0.5), &m, 1, 16)
                .unwrap()
                .replicas,
            16
        );
        assert_eq!(
            prefill(&demand(0.0, 2000.0, 100.0, 0.5), &m, 2, 16)
                .unwrap()
                .replicas,
            2
        );
        assert!(prefill(&demand(1.0, 2000.0, 100.0, 1.5), &m, 1, 4).is_err());
        assert!(prefill(&demand(f64::NAN, 2000.0, 100.0, 0.0), &m, 1, 4).is_err());
    }

    #[test]
    fn decode_by_hand() {
        // Step = 10 ms + 0.5 ms a sequence, whatever the context.
        let m = DecodeModel::new(&[1000.0], &[1.0, 101.0], &[vec![10.5, 60.5]]).unwrap();
        // ITL 30 ms: 10 + 0.5 B ≤ 30 → B = 40, a 30 ms step; OSL 100: 40 / (100 × 0.03) =
        // 13.33 requests/s a replica; 50 requests/s need 4.
        let s = decode(&demand(50.0, 500.0, 100.0, 0.0), &m, 30.0, 256, (1, 8)).unwrap();
        assert_eq!(s.batch, 40);
        assert!((s.replica_rps - 40.0 / 3.0).abs() < 1e-9);
        assert_eq!(s.replicas, 4);
        assert!(s.feasible);
        // max_num_seqs caps the batch.
        let capped = decode(&demand(50.0, 500.0, 100.0, 0.0), &m, 30.0, 16, (1, 8)).unwrap();
        assert_eq!(capped.batch, 16);
        // An ITL below one sequence's step is infeasible: batch 1, flagged.
        let tight = decode(&demand(1.0, 500.0, 100.0, 0.0), &m, 5.0, 256, (1, 8)).unwrap();
        assert_eq!((tight.batch, tight.feasible), (1, false));
        assert!(decode(&demand(1.0, 500.0, 100.0, 0.0), &m, 0.0, 256, (1, 8)).is_err());
    }

    #[test]
    fn budget_shrinks_both_roles_in_proportion() {
        // 6 prefill + 10 decode at 1 GPU each in 8: × 0.5 → 3 + 5.
        assert_eq!(fit_budget([6, 10], [1, 1], [1, 1], 8), Ok([3, 5]));
        // Within budget: unchanged.
        assert_eq!(fit_budget([2, 3], [1, 1], [1, 1], 8), Ok([2, 3]));
        // Decode takes 2 GPUs: 4 + 2·6 = 16 in 10, × 0.625 → floor(2.5) = 2 prefill and
        // floor(3.75) = 3 decode: 2 + 2·3 = 8 GPUs.
        assert_eq!(fit_budget([4, 6], [1, 1], [1, 2], 10), Ok([2, 3]));
        // Minimums hold; the role with more spare gives up the rest.
        assert_eq!(fit_budget([1, 9], [1, 2], [1, 1], 4), Ok([1, 3]));
        assert!(fit_budget([1, 1], [3, 3], [1, 1], 4).is_err());
    }
}
