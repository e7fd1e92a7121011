//! CUDA graphs of decode steps: one per (sequences, readout) key, captured on the key's second
//! occurrence and checked against the eager run of the same step, valid while the step's
//! buffers stay where they were (a buffer generation).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use cudarc::driver::{sys, CudaStream};

use super::step::{DeviceModel, Readout, StepRows, Workspace};
use super::DeviceElem;
use crate::backend::SeqInput;
use crate::error::EngineError;
use crate::sampler::SamplePlan;

/// A captured graph and its instantiation, owned by the backend (ended and instantiated here
/// rather than by cudarc, so that its edges can be changed in between).
struct OwnedGraph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    stream: Arc<CudaStream>,
}

// SAFETY: CUDA graph objects are not internally synchronised but may be used from any thread
// when calls on one object are serialised; the graph is owned by the backend, which is used
// by one thread at a time (`&mut self` for every launch) and only moved between threads.
unsafe impl Send for OwnedGraph {}

impl OwnedGraph {
    fn launch(&self) -> Result<(), EngineError> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| EngineError::Backend(format!("CUDA context: {e:?}")))?;
        // SAFETY: a live instantiated graph, launched on the stream it was captured from.
        unsafe { sys::cuGraphLaunch(self.exec, self.stream.cu_stream()) }
            .result()
            .map_err(|e| EngineError::Backend(format!("CUDA graph launch: {e:?}")))
    }
}

impl Drop for OwnedGraph {
    fn drop(&mut self) {
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: both handles were created by `capture` and are destroyed once, here.
        unsafe {
            if !self.exec.is_null() {
                let _ = sys::cuGraphExecDestroy(self.exec);
            }
            if !self.graph.is_null() {
                let _ = sys::cuGraphDestroy(self.graph);
            }
        }
    }
}

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
    /// Make the edges between the program's own kernels programmatic
    /// ([`super::switches::PDL_ENV`]).
    pdl: bool,
    /// Programmatic edges of the graphs captured so far.
    programmatic_edges: usize,
}

/// What the decode-step graphs did so far.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GraphStats {
    pub captured: usize,
    pub refused: usize,
    pub replays: u64,
    pub last_refusal: Option<String>,
    /// Kernel-to-kernel edges of the captured graphs made programmatic (PDL).
    pub programmatic_edges: usize,
}

impl GraphCache {
    pub(super) fn new(max_batch: usize, pdl: bool) -> Self {
        GraphCache {
            max_batch,
            generation: 0,
            graphs: HashMap::new(),
            seen: HashSet::new(),
            refused: HashSet::new(),
            replays: 0,
            last_refusal: None,
            pdl,
            programmatic_edges: 0,
        }
    }

    pub(super) fn stats(&self) -> GraphStats {
        GraphStats {
            captured: self.graphs.len(),
            refused: self.refused.len(),
            replays: self.replays,
            last_refusal: self.last_refusal.clone(),
            programmatic_edges: self.programmatic_edges,
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
    // A step with media rows copies them in: never captured.
    if !graphable || !p.media.is_empty() || graphs.refused.contains(&key) {
        model.launch(ws, p.t, p.r, readout, &p.media)?;
        return Ok((p.counts, model.read_back(ws, p.r, readout)?));
    }
    if let Some(g) = graphs.graphs.get(&key) {
        g.launch()?;
        graphs.replays += 1;
        return Ok((p.counts, model.read_back(ws, p.r, readout)?));
    }
    // Eager first (warm-up; on the second occurrence also the reference for the capture).
    model.launch(ws, p.t, p.r, readout, &[])?;
    let eager = model.read_back(ws, p.r, readout)?;
    if !graphs.seen.insert(key) {
        match capture(model, ws, p.t, p.r, readout, graphs.pdl) {
            Ok((g, edges)) => {
                // The replay recomputes the same step (the same K/V values are rewritten).
                let replay = g.launch().and_then(|_| model.read_back(ws, p.r, readout));
                match replay {
                    Ok(rows) if same_rows(&rows, &eager) => {
                        tracing::debug!(batch = p.t, ?readout, edges, "CUDA graph captured");
                        graphs.graphs.insert(key, g);
                        graphs.programmatic_edges += edges;
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

/// Benchmarks: prepares `batch` as a greedy decode step and replays its captured graph `n`
/// times back to back, one synchronisation at the end; the seconds per replay are the GPU's
/// time for the step without the host's share (preparation, copies, read-back). `None` when
/// the step has no graph yet.
pub(super) fn replay_seconds<A: DeviceElem>(
    model: &mut DeviceModel,
    ws: &mut Workspace<A>,
    graphs: &GraphCache,
    batch: &[SeqInput<'_>],
    n: usize,
) -> Result<Option<f64>, EngineError> {
    let p = model.prepare(ws, batch, None)?;
    if model.generation(ws) != graphs.generation {
        return Ok(None);
    }
    let Some(g) = graphs.graphs.get(&(p.t, Readout::Argmax)) else {
        return Ok(None);
    };
    model.dev.synchronize()?;
    let start = std::time::Instant::now();
    for _ in 0..n {
        g.launch()?;
    }
    model.dev.synchronize()?;
    Ok(Some(start.elapsed().as_secs_f64() / n.max(1) as f64))
}

/// Captures the launches of a prepared step into a graph (with `pdl`, the edges between the
/// program's own kernels made programmatic first); also returns how many edges changed.
fn capture<A: DeviceElem>(
    model: &mut DeviceModel,
    ws: &mut Workspace<A>,
    t: usize,
    r: usize,
    readout: Readout,
    pdl: bool,
) -> Result<(OwnedGraph, usize), EngineError> {
    use cudarc::driver::sys::CUstreamCaptureMode;
    let err =
        |what: &str, e: sys::CUresult| EngineError::Backend(format!("CUDA graph {what}: {e:?}"));
    let stream = model.dev.stream().clone();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| EngineError::Backend(format!("CUDA graph capture: {e:?}")))?;
    let launched = model.launch(ws, t, r, readout, &[]);
    // Always end the capture, also after a failed launch, so the stream is usable again.
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: the stream is capturing (begun above, on this thread); `graph` receives the result.
    let ended = unsafe { sys::cuStreamEndCapture(stream.cu_stream(), &mut graph) };
    let mut owned = OwnedGraph {
        graph,
        exec: std::ptr::null_mut(),
        stream,
    };
    launched?;
    if ended != sys::CUresult::CUDA_SUCCESS {
        return Err(err("capture", ended));
    }
    if owned.graph.is_null() {
        return Err(EngineError::Backend(
            "CUDA graph capture produced no graph".into(),
        ));
    }
    let edges = if pdl {
        // SAFETY: a live graph, not yet instantiated; the function handles belong to loaded
        // modules of this device.
        unsafe { programmatic_edges(owned.graph, &model.dev.own_functions()) }?
    } else {
        0
    };
    // SAFETY: a live graph; `exec` receives its instantiation (destroyed by OwnedGraph).
    let status = unsafe { sys::cuGraphInstantiateWithFlags(&mut owned.exec, owned.graph, 0) };
    if status != sys::CUresult::CUDA_SUCCESS {
        return Err(err("instantiation", status));
    }
    Ok((owned, edges))
}

/// Turns every plain edge between two kernel nodes of `ours` (the program's kernels, each of
/// which starts with `griddepcontrol.wait`, see prelude.cu) into a programmatic one, so the
/// dependent kernel is launched while its predecessor runs and waits in its first
/// instruction: the launch latency between dependent kernels is hidden. Edges from or to
/// other nodes (cuBLAS kernels, copies) stay as they are. Returns the number changed.
///
/// # Safety
/// `graph` must be a live graph that is not being launched or changed elsewhere.
unsafe fn programmatic_edges(
    graph: sys::CUgraph,
    ours: &HashSet<usize>,
) -> Result<usize, EngineError> {
    let err =
        |what: &str, e: sys::CUresult| EngineError::Backend(format!("CUDA graph {what}: {e:?}"));
    let mut n = 0usize;
    let status = sys::cuGraphGetEdges_v2(
        graph,
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        &mut n,
    );
    if status != sys::CUresult::CUDA_SUCCESS {
        return Err(err("edges", status));
    }
    let mut from = vec![std::ptr::null_mut(); n];
    let mut to = vec![std::ptr::null_mut(); n];
    let mut data = vec![
        sys::CUgraphEdgeData {
            from_port: 0,
            to_port: 0,
            type_: 0,
            reserved: [0; 5],
        };
        n
    ];
    let status = sys::cuGraphGetEdges_v2(
        graph,
        from.as_mut_ptr(),
        to.as_mut_ptr(),
        data.as_mut_ptr(),
        &mut n,
    );
    if status != sys::CUresult::CUDA_SUCCESS {
        return Err(err("edges", status));
    }
    let is_ours = |node: sys::CUgraphNode| -> bool {
        let mut ty = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        if sys::cuGraphNodeGetType(node, &mut ty) != sys::CUresult::CUDA_SUCCESS
            || ty != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL
        {
            return false;
        }
        let mut params: sys::CUDA_KERNEL_NODE_PARAMS = std::mem::zeroed();
        sys::cuGraphKernelNodeGetParams_v2(node, &mut params) == sys::CUresult::CUDA_SUCCESS
            && ours.contains(&(params.func as usize))
    };
    let programmatic = sys::CUgraphEdgeData {
        from_port: sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8,
        to_port: 0,
        type_: sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8,
        reserved: [0; 5],
    };
    let mut changed = 0;
    for i in 0..n.min(from.len()) {
        if data[i].type_ != sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_DEFAULT as u8
            || !is_ours(from[i])
            || !is_ours(to[i])
        {
            continue;
        }
        let status = sys::cuGraphRemoveDependencies_v2(graph, &from[i], &to[i], &data[i], 1);
        if status != sys::CUresult::CUDA_SUCCESS {
            return Err(err("edge removal", status));
        }
        let status = sys::cuGraphAddDependencies_v2(graph, &from[i], &to[i], &programmatic, 1);
        if status != sys::CUresult::CUDA_SUCCESS {
            return Err(err("programmatic edge", status));
        }
        changed += 1;
    }
    Ok(changed)
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
