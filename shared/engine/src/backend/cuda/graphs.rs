//! CUDA graphs of decode steps: one per (sequences, readout) key, captured on the key's second
//! occurrence and checked against the eager run of the same step, valid while the step's
//! buffers stay where they were (a buffer generation).

use std::collections::{HashMap, HashSet};

use super::step::{DeviceModel, Readout, StepRows, Workspace};
use super::DeviceElem;
use crate::backend::SeqInput;
use crate::error::EngineError;
use crate::sampler::SamplePlan;

/// A captured graph owned by the backend.
struct OwnedGraph(cudarc::driver::CudaGraph);

// SAFETY: CUDA graph objects are not internally synchronised but may be used from any thread
// when calls on one object are serialised; the graph is owned by the backend, which is used
// by one thread at a time (`&mut self` for every launch) and only moved between threads.
unsafe impl Send for OwnedGraph {}

/// Captured decode steps, keyed by (sequences, readout), valid for one buffer generation.
pub(super) struct GraphCache {
    pub(super) max_batch: usize,
    generation: u64,
    graphs: HashMap<(usize, Readout), OwnedGraph>,
    /// Keys run eagerly once (the warm-up that compiles kernels and sizes buffers).
    seen: HashSet<(usize, Readout)>,
    /// Keys whose capture failed or whose replay did not match the eager step.
    refused: HashSet<(usize, Readout)>,
    /// Steps run by replaying a graph.
    replays: u64,
    /// The last refusal's reason (benchmarks and checks report it).
    last_refusal: Option<String>,
}

/// What the decode-step graphs did so far.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GraphStats {
    pub captured: usize,
    pub refused: usize,
    pub replays: u64,
    pub last_refusal: Option<String>,
}

impl GraphCache {
    pub(super) fn new(max_batch: usize) -> Self {
        GraphCache {
            max_batch,
            generation: 0,
            graphs: HashMap::new(),
            seen: HashSet::new(),
            refused: HashSet::new(),
            replays: 0,
            last_refusal: None,
        }
    }

    pub(super) fn stats(&self) -> GraphStats {
        GraphStats {
            captured: self.graphs.len(),
            refused: self.refused.len(),
            replays: self.replays,
            last_refusal: self.last_refusal.clone(),
        }
    }
}

/// One step: prepare, then launch eagerly, or through the graph of its key (capturing it on
/// the key's second occurrence, checked against an eager run of the same step), then read
/// back. A capture that fails or disagrees leaves the key eager for good (logged).
pub(super) fn run_step<A: DeviceElem>(
    model: &mut DeviceModel,
    ws: &mut Workspace<A>,
    graphs: &mut GraphCache,
    batch: &[SeqInput<'_>],
    readout: Readout,
    plans: Option<&[Option<&SamplePlan>]>,
    graphable: bool,
) -> Result<(Vec<usize>, StepRows), EngineError> {
    let p = model.prepare(ws, batch, plans)?;
    let key = (p.t, readout);
    let generation = model.generation(ws);
    if generation != graphs.generation {
        // Buffers moved: every captured graph holds stale addresses.
        graphs.graphs.clear();
        graphs.generation = generation;
    }
    if !graphable || graphs.refused.contains(&key) {
        model.launch(ws, p.t, p.r, readout)?;
        return Ok((p.counts, model.read_back(ws, p.r, readout)?));
    }
    if let Some(g) = graphs.graphs.get(&key) {
        g.0.launch()
            .map_err(|e| EngineError::Backend(format!("CUDA graph launch: {e:?}")))?;
        graphs.replays += 1;
        return Ok((p.counts, model.read_back(ws, p.r, readout)?));
    }
    // Eager first (warm-up; on the second occurrence also the reference for the capture).
    model.launch(ws, p.t, p.r, readout)?;
    let eager = model.read_back(ws, p.r, readout)?;
    if !graphs.seen.insert(key) {
        match capture(model, ws, p.t, p.r, readout) {
            Ok(g) => {
                // The replay recomputes the same step (the same K/V values are rewritten).
                let replay = g
                    .launch()
                    .map_err(|e| EngineError::Backend(format!("CUDA graph launch: {e:?}")))
                    .and_then(|_| model.read_back(ws, p.r, readout));
                match replay {
                    Ok(rows) if same_rows(&rows, &eager) => {
                        tracing::debug!(batch = p.t, ?readout, "CUDA graph captured");
                        graphs.graphs.insert(key, OwnedGraph(g));
                    }
                    Ok(_) => {
                        tracing::warn!(batch = p.t, "CUDA graph replay differs from the eager step; this batch size stays eager");
                        graphs.refused.insert(key);
                        graphs.last_refusal = Some(format!("batch {}: replay differs", p.t));
                    }
                    Err(e) => {
                        tracing::warn!(batch = p.t, error = %e, "CUDA graph replay failed; this batch size stays eager");
                        graphs.refused.insert(key);
                        graphs.last_refusal = Some(format!("batch {}: replay: {e}", p.t));
                    }
                }
            }
            Err(e) => {
                tracing::warn!(batch = p.t, error = %e, "CUDA graph capture failed; this batch size stays eager");
                graphs.refused.insert(key);
                graphs.last_refusal = Some(format!("batch {}: capture: {e}", p.t));
            }
        }
    }
    Ok((p.counts, eager))
}

/// Captures the launches of a prepared step into a graph.
fn capture<A: DeviceElem>(
    model: &mut DeviceModel,
    ws: &mut Workspace<A>,
    t: usize,
    r: usize,
    readout: Readout,
) -> Result<cudarc::driver::CudaGraph, EngineError> {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let stream = model.dev.stream().clone();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| EngineError::Backend(format!("CUDA graph capture: {e:?}")))?;
    let launched = model.launch(ws, t, r, readout);
    // Always end the capture, also after a failed launch, so the stream is usable again.
    let ended = stream.end_capture(CUgraphInstantiate_flags(0));
    launched?;
    ended
        .map_err(|e| EngineError::Backend(format!("CUDA graph capture: {e:?}")))?
        .ok_or_else(|| EngineError::Backend("CUDA graph capture produced no graph".into()))
}

/// Whether a replay produced what the eager step did: the same argmax ids, or logits within
/// 1e-4 of the row's largest magnitude (cuBLAS may pick another algorithm under capture).
fn same_rows(a: &StepRows, b: &StepRows) -> bool {
    match (a, b) {
        (StepRows::Ids(x), StepRows::Ids(y)) => x == y,
        (StepRows::Logits(x), StepRows::Logits(y)) => {
            let scale = y.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| (p - q).abs() <= 1e-4 * scale)
        }
        _ => false,
    }
}
