//! Per-launch GPU timing for the benchmarks' breakdown: while profiling, every launch records
//! an event before it (`count_launch` in mod.rs); the time between consecutive events is
//! the launch's, gaps included.

use std::collections::HashMap;

use super::{cuda_err, CudaDevice};
use crate::error::EngineError;

/// GPU time of one kind of launch over a profiled stretch.
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchTime {
    pub name: String,
    pub launches: usize,
    pub ms: f64,
}

impl CudaDevice {
    /// Starts timing every launch (see [`CudaDevice::finish_profile`]). Launches are then
    /// slower by an event each, and decode steps run eagerly (no graph).
    pub fn start_profile(&self) {
        if let Ok(mut guard) = self.profile.lock() {
            *guard = Some(Vec::new());
        }
    }

    /// Whether [`CudaDevice::start_profile`] is in effect.
    pub fn profiling(&self) -> bool {
        self.profile.lock().map(|g| g.is_some()).unwrap_or(false)
    }

    /// Stops profiling and sums the GPU time per launch name, longest first.
    pub fn finish_profile(&self) -> Result<Vec<LaunchTime>, EngineError> {
        let events = self
            .profile
            .lock()
            .map_err(|_| EngineError::Backend("CUDA profile lock poisoned".into()))?
            .take()
            .unwrap_or_default();
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let end = self
            .stream
            .record_event(flags)
            .map_err(cuda_err("recording the profile's end"))?;
        self.synchronize()?;
        let mut sums: HashMap<String, (usize, f64)> = HashMap::new();
        for (i, (name, ev)) in events.iter().enumerate() {
            let next = events.get(i + 1).map(|(_, e)| e).unwrap_or(&end);
            let ms = ev
                .elapsed_ms(next)
                .map_err(cuda_err("reading a profile event"))?;
            let entry = sums.entry(name.clone()).or_default();
            entry.0 += 1;
            entry.1 += ms as f64;
        }
        let mut out: Vec<LaunchTime> = sums
            .into_iter()
            .map(|(name, (launches, ms))| LaunchTime { name, launches, ms })
            .collect();
        out.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        Ok(out)
    }
}
