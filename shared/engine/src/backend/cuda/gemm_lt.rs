//! cuBLASLt GEMMs on the algorithm that measured fastest for their shape.
//!
//! `cublasGemmEx` runs the first algorithm of cuBLAS's heuristic, which for the decode steps'
//! few rows over wide weights leaves much of the GPU idle. Here each GEMM shape class — rows
//! rounded up to a power of two, columns, depth, input and output types, and whether the
//! product is added to the output — is timed once, on its first eager call: `cublasGemmEx`
//! and up to [`CANDIDATES`] algorithms of cuBLASLt's heuristic on the same operands; the
//! fastest is kept for the class (`cublasGemmEx` where nothing beats it by
//! [`MIN_GAIN`]). Every exact shape then gets its descriptors once, the class's algorithm
//! checked for it (`cublasLtMatmulAlgoCheck`; `cublasGemmEx` where it does not apply).
//!
//! Tuning synchronises the stream, so it never runs while a CUDA graph is being captured:
//! graphs are captured on a batch's second step, after an eager first one has tuned its
//! shapes. The cuBLASLt calls use the cuBLAS handle's workspace (same stream, never at once).
//! Off by default until measured on a GPU: `TANDEM_CUDA_GEMM_TUNING=on` turns it on
//! ([`super::switches::GEMM_TUNING_ENV`]).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::cublaslt::sys as lt;
use cudarc::driver::CudaStream;

use crate::error::EngineError;

/// Algorithms of cuBLASLt's heuristic timed per shape class.
const CANDIDATES: usize = 16;
/// Timed calls per candidate (after one warm-up call).
const TIMED_CALLS: usize = 8;
/// A candidate replaces `cublasGemmEx` only when at least this much faster.
const MIN_GAIN: f64 = 1.03;
/// Output elements past which a GEMM that adds into its output is not tuned (the timing
/// writes into a scratch buffer of that size).
const MAX_SCRATCH_ELEMS: usize = 1 << 23;

/// One GEMM as the backend calls it (column-major, as `cublasGemmEx` sees it: D (n×m) =
/// Wᵀ · X with W k×n and X k×m).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(super) struct LtShape {
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub x_type: lt::cudaDataType,
    pub out_type: lt::cudaDataType,
    /// Adds the product to what the output holds (beta 1).
    pub accumulate: bool,
}

impl LtShape {
    fn class(&self) -> LtShape {
        LtShape {
            m: (self.m.max(1) as u32).next_power_of_two() as i32,
            ..*self
        }
    }

    fn out_bytes(&self) -> usize {
        let elem = if self.out_type == lt::cudaDataType::CUDA_R_32F {
            4
        } else {
            2
        };
        self.m as usize * self.n as usize * elem
    }
}

/// Raw device addresses of one call's operands.
#[derive(Clone, Copy)]
pub(super) struct LtOperands {
    pub w: u64,
    pub x: u64,
    pub out: u64,
    pub workspace: u64,
    pub workspace_bytes: usize,
}

/// What a GEMM runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LtChoice {
    GemmEx,
    Lt,
}

/// The descriptors of one exact shape (destroyed with it).
struct Descriptors {
    desc: lt::cublasLtMatmulDesc_t,
    a: lt::cublasLtMatrixLayout_t,
    b: lt::cublasLtMatrixLayout_t,
    d: lt::cublasLtMatrixLayout_t,
}

// SAFETY: opaque cuBLASLt descriptors, used only under the tuner's lock or by the one thread
// that drives the device's stream.
unsafe impl Send for Descriptors {}

impl Descriptors {
    fn new(s: &LtShape) -> Result<Self, EngineError> {
        let mut out = Descriptors {
            desc: std::ptr::null_mut(),
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
        };
        // SAFETY: out-pointers to live fields; each created handle is destroyed by Drop
        // (null ones are skipped).
        unsafe {
            lt::cublasLtMatmulDescCreate(
                &mut out.desc,
                lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                lt::cudaDataType::CUDA_R_32F,
            )
            .result()
            .map_err(lt_err("a matmul descriptor"))?;
            let op_t = cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T;
            lt::cublasLtMatmulDescSetAttribute(
                out.desc,
                lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&op_t) as *const _ as *const c_void,
                std::mem::size_of_val(&op_t),
            )
            .result()
            .map_err(lt_err("the transpose attribute"))?;
            let (m, n, k) = (s.m as u64, s.n as u64, s.k as u64);
            lt::cublasLtMatrixLayoutCreate(&mut out.a, s.x_type, k, n, k as i64)
                .result()
                .map_err(lt_err("the weights' layout"))?;
            lt::cublasLtMatrixLayoutCreate(&mut out.b, s.x_type, k, m, k as i64)
                .result()
                .map_err(lt_err("the rows' layout"))?;
            lt::cublasLtMatrixLayoutCreate(&mut out.d, s.out_type, n, m, n as i64)
                .result()
                .map_err(lt_err("the output's layout"))?;
        }
        Ok(out)
    }

    /// Up to `n` algorithms of cuBLASLt's heuristic within `workspace_bytes`.
    fn heuristic(
        &self,
        handle: lt::cublasLtHandle_t,
        n: usize,
        workspace_bytes: usize,
    ) -> Result<Vec<lt::cublasLtMatmulAlgo_t>, EngineError> {
        let mut pref: lt::cublasLtMatmulPreference_t = std::ptr::null_mut();
        // SAFETY: a preference handle created and destroyed here; `found` holds `n` results.
        unsafe {
            lt::cublasLtMatmulPreferenceCreate(&mut pref)
                .result()
                .map_err(lt_err("a preference"))?;
            let set = lt::cublasLtMatmulPreferenceSetAttribute(
                pref,
                lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&workspace_bytes) as *const usize as *const c_void,
                std::mem::size_of::<usize>(),
            )
            .result();
            let mut found: Vec<lt::cublasLtMatmulHeuristicResult_t> = vec![std::mem::zeroed(); n];
            let mut count = 0i32;
            let got = set.and_then(|_| {
                lt::cublasLtMatmulAlgoGetHeuristic(
                    handle,
                    self.desc,
                    self.a,
                    self.b,
                    self.d,
                    self.d,
                    pref,
                    n as i32,
                    found.as_mut_ptr(),
                    &mut count,
                )
                .result()
            });
            lt::cublasLtMatmulPreferenceDestroy(pref);
            got.map_err(lt_err("the heuristic"))?;
            Ok(found
                .into_iter()
                .take(count.max(0) as usize)
                .filter(|h| h.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
                .filter(|h| h.workspaceSize <= workspace_bytes)
                .map(|h| h.algo)
                .collect())
        }
    }

    /// Whether `algo` (picked for another shape of its class) runs this shape.
    fn accepts(
        &self,
        handle: lt::cublasLtHandle_t,
        algo: &lt::cublasLtMatmulAlgo_t,
        ws: usize,
    ) -> bool {
        // SAFETY: live descriptors; `result` is written by the call.
        unsafe {
            let mut result: lt::cublasLtMatmulHeuristicResult_t = std::mem::zeroed();
            lt::cublasLtMatmulAlgoCheck(
                handle,
                self.desc,
                self.a,
                self.b,
                self.d,
                self.d,
                algo,
                &mut result,
            ) == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                && result.workspaceSize <= ws
        }
    }

    /// # Safety
    /// The operands are live device buffers of the shape's sizes, on `stream`.
    unsafe fn run(
        &self,
        handle: lt::cublasLtHandle_t,
        algo: &lt::cublasLtMatmulAlgo_t,
        s: &LtShape,
        o: &LtOperands,
        out: u64,
        stream: lt::cudaStream_t,
    ) -> Result<(), EngineError> {
        let alpha = 1.0f32;
        let beta = if s.accumulate { 1.0f32 } else { 0.0 };
        lt::cublasLtMatmul(
            handle,
            self.desc,
            (&alpha) as *const f32 as *const c_void,
            o.w as *const c_void,
            self.a,
            o.x as *const c_void,
            self.b,
            (&beta) as *const f32 as *const c_void,
            out as *const c_void,
            self.d,
            out as *mut c_void,
            self.d,
            algo,
            o.workspace as *mut c_void,
            o.workspace_bytes,
            stream,
        )
        .result()
        .map_err(lt_err("matmul"))
    }
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: handles created by `new`, destroyed once (null ones were never created).
        unsafe {
            for l in [self.a, self.b, self.d] {
                if !l.is_null() {
                    lt::cublasLtMatrixLayoutDestroy(l);
                }
            }
            if !self.desc.is_null() {
                lt::cublasLtMatmulDescDestroy(self.desc);
            }
        }
    }
}

/// An exact shape's plan: its descriptors and algorithm, or `cublasGemmEx`.
type Plan = Option<(Descriptors, lt::cublasLtMatmulAlgo_t)>;

struct Tables {
    /// Per shape class: the algorithm that measured fastest, or None for `cublasGemmEx`.
    classes: HashMap<LtShape, Option<lt::cublasLtMatmulAlgo_t>>,
    plans: HashMap<LtShape, Plan>,
}

/// cuBLASLt's handle and what was measured.
pub(super) struct LtTuner {
    handle: lt::cublasLtHandle_t,
    tables: Mutex<Tables>,
}

// SAFETY: the handle is thread-safe per cuBLASLt's documentation; the tables are locked.
unsafe impl Send for LtTuner {}
unsafe impl Sync for LtTuner {}

impl LtTuner {
    pub fn new() -> Result<Self, EngineError> {
        let mut handle: lt::cublasLtHandle_t = std::ptr::null_mut();
        // SAFETY: an out-pointer; destroyed in Drop.
        unsafe { lt::cublasLtCreate(&mut handle) }
            .result()
            .map_err(lt_err("creating a handle"))?;
        Ok(Self {
            handle,
            tables: Mutex::new(Tables {
                classes: HashMap::new(),
                plans: HashMap::new(),
            }),
        })
    }

    /// Runs the GEMM on cuBLASLt where its shape's plan says so and returns `Lt`; returns
    /// `GemmEx` (having run nothing) where the caller's `cublasGemmEx` is the plan. A shape
    /// class seen for the first time is tuned first (`gemm_ex` runs `cublasGemmEx` on the
    /// same operands for the comparison), except while `stream` is being captured.
    pub fn gemm(
        &self,
        s: &LtShape,
        o: &LtOperands,
        stream: &Arc<CudaStream>,
        gemm_ex: &mut dyn FnMut() -> Result<(), EngineError>,
    ) -> Result<LtChoice, EngineError> {
        let mut guard = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        let t = &mut *guard;
        if !t.plans.contains_key(s) {
            let Some(best) = self.class_choice(&mut t.classes, s, o, stream, gemm_ex)? else {
                // Under capture, an untuned class runs cublasGemmEx (nothing recorded).
                return Ok(LtChoice::GemmEx);
            };
            let plan = match best {
                None => None,
                Some(algo) => {
                    let d = Descriptors::new(s)?;
                    d.accepts(self.handle, &algo, o.workspace_bytes)
                        .then_some((d, algo))
                }
            };
            t.plans.insert(*s, plan);
        }
        match &t.plans[s] {
            None => Ok(LtChoice::GemmEx),
            Some((d, algo)) => {
                // SAFETY: the caller's operands are live buffers of the shape, on `stream`.
                unsafe { d.run(self.handle, algo, s, o, o.out, stream.cu_stream() as _)? };
                Ok(LtChoice::Lt)
            }
        }
    }

    /// The algorithm of `s`'s class (None inside: `cublasGemmEx`), tuned now if the class is
    /// new; None when it is new and `stream` is being captured (tuning synchronises).
    fn class_choice(
        &self,
        classes: &mut HashMap<LtShape, Option<lt::cublasLtMatmulAlgo_t>>,
        s: &LtShape,
        o: &LtOperands,
        stream: &Arc<CudaStream>,
        gemm_ex: &mut dyn FnMut() -> Result<(), EngineError>,
    ) -> Result<Option<Option<lt::cublasLtMatmulAlgo_t>>, EngineError> {
        let class = s.class();
        if let Some(best) = classes.get(&class) {
            return Ok(Some(*best));
        }
        if capturing(stream) {
            return Ok(None);
        }
        // A tuning that fails (no memory for its scratch output, a heuristic error) leaves
        // the class on cublasGemmEx rather than failing the step.
        let best = self.tune(s, o, stream, gemm_ex).unwrap_or_else(|e| {
            tracing::warn!(m = s.m, n = s.n, k = s.k, error = %e, "GEMM tuning failed; cublasGemmEx it is");
            None
        });
        tracing::debug!(
            m = s.m,
            n = s.n,
            k = s.k,
            lt = best.is_some(),
            "GEMM shape tuned"
        );
        classes.insert(class, best);
        Ok(Some(best))
    }

    /// The fastest of `cublasGemmEx` and the heuristic's candidates on these operands (a
    /// GEMM that adds into its output is timed into a scratch buffer, so the output is
    /// untouched; one that overwrites it is timed in place: the caller's run rewrites it).
    fn tune(
        &self,
        s: &LtShape,
        o: &LtOperands,
        stream: &Arc<CudaStream>,
        gemm_ex: &mut dyn FnMut() -> Result<(), EngineError>,
    ) -> Result<Option<lt::cublasLtMatmulAlgo_t>, EngineError> {
        if s.accumulate && s.out_bytes() > MAX_SCRATCH_ELEMS * 4 {
            return Ok(None);
        }
        let d = Descriptors::new(s)?;
        let candidates = d.heuristic(self.handle, CANDIDATES, o.workspace_bytes)?;
        if candidates.is_empty() {
            return Ok(None);
        }
        let scratch = if s.accumulate {
            Some(
                stream
                    .alloc_zeros::<u8>(s.out_bytes())
                    .map_err(|e| EngineError::Backend(format!("GEMM tuning scratch: {e:?}")))?,
            )
        } else {
            None
        };
        let out = match &scratch {
            Some(buf) => {
                use cudarc::driver::DevicePtr;
                buf.device_ptr(stream).0
            }
            None => o.out,
        };
        let raw = stream.cu_stream() as lt::cudaStream_t;
        let time = |f: &mut dyn FnMut() -> Result<(), EngineError>| -> Result<f64, EngineError> {
            f()?;
            sync(stream)?;
            let t0 = Instant::now();
            for _ in 0..TIMED_CALLS {
                f()?;
            }
            sync(stream)?;
            Ok(t0.elapsed().as_secs_f64())
        };
        let mut best: Option<(f64, lt::cublasLtMatmulAlgo_t)> = None;
        let mut first = None;
        for algo in candidates {
            // SAFETY: live operands (the caller's, or the scratch output of the same size).
            let took = time(&mut || unsafe { d.run(self.handle, &algo, s, o, out, raw) });
            // A candidate that fails to launch is skipped.
            if let Ok(took) = took {
                first.get_or_insert(took);
                if best.is_none_or(|(b, _)| took < b) {
                    best = Some((took, algo));
                }
            }
        }
        drop(scratch);
        // cublasGemmEx itself where it overwrites its output; where it adds into it (the
        // real output may not be rewritten), the heuristic's first algorithm stands for it
        // (cublasGemmEx's own choice).
        let base = if s.accumulate {
            first
        } else {
            Some(time(gemm_ex)?)
        };
        Ok(match (best, base) {
            (Some((b, algo)), Some(base)) if base > b * MIN_GAIN => Some(algo),
            _ => None,
        })
    }
}

impl Drop for LtTuner {
    fn drop(&mut self) {
        self.tables
            .get_mut()
            .map(|t| {
                t.plans.clear();
            })
            .ok();
        // SAFETY: created in `new`, destroyed once, after the descriptors.
        unsafe {
            lt::cublasLtDestroy(self.handle);
        }
    }
}

fn capturing(stream: &CudaStream) -> bool {
    !matches!(
        stream.capture_status(),
        Ok(cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    )
}

fn sync(stream: &CudaStream) -> Result<(), EngineError> {
    stream
        .synchronize()
        .map_err(|e| EngineError::Backend(format!("GEMM tuning: {e:?}")))
}

fn lt_err(what: &'static str) -> impl Fn(cudarc::cublaslt::result::CublasError) -> EngineError {
    move |e| EngineError::Backend(format!("cuBLASLt {what}: {e:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(m: i32) -> LtShape {
        LtShape {
            m,
            n: 1024,
            k: 3072,
            x_type: lt::cudaDataType::CUDA_R_16BF,
            out_type: lt::cudaDataType::CUDA_R_32F,
            accumulate: true,
        }
    }

    #[test]
    fn shapes_share_a_class_up_to_the_next_power_of_two_of_rows() {
        assert_eq!(shape(33).class(), shape(64));
        assert_eq!(shape(64).class(), shape(64));
        assert_eq!(shape(65).class(), shape(128));
        assert_eq!(shape(1).class(), shape(1));
        assert_ne!(
            shape(48).class(),
            LtShape {
                accumulate: false,
                ..shape(64)
            }
        );
        assert_eq!(shape(300).out_bytes(), 300 * 1024 * 4);
    }
}
