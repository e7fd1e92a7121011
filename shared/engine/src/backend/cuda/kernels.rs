//! The kernel sources and their compilation: the `.cu` files of `kernels/` are embedded in the
//! binary, concatenated (prelude first) into one NVRTC program, compiled for the device's own
//! architecture at start-up and cached per process, keyed by architecture.
//!
//! The program comes in two flavours of its 16-bit element ([`Float16`]): bf16, or IEEE half
//! (compiled with `TANDEM_F16`, for the f16 compute mode); the entry points are the same. A
//! third and fourth, smaller programs ([`KvProgram`]) hold the tensor-core attention over an
//! f16 KV cache beside bf16 weights (the bf16x2 precision's default cache) and over an FP8
//! cache (bf16x2 or bf16 with `kv_cache_config.dtype: fp8`).
//!
//! Development mode: with `TANDEM_CUDA_KERNEL_DIR` set to a folder holding the same file
//! names, the sources are read from there instead, so a kernel edit needs no Rust rebuild.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use crate::error::EngineError;

/// The environment variable of the development mode.
pub const KERNEL_DIR_ENV: &str = "TANDEM_CUDA_KERNEL_DIR";

/// The kernel files, in the order they are concatenated.
pub const SOURCES: &[(&str, &str)] = &[
    ("prelude.cu", include_str!("kernels/prelude.cu")),
    ("embedding.cu", include_str!("kernels/embedding.cu")),
    ("rms_norm.cu", include_str!("kernels/rms_norm.cu")),
    ("qk_norm_rope.cu", include_str!("kernels/qk_norm_rope.cu")),
    ("silu_mul.cu", include_str!("kernels/silu_mul.cu")),
    ("kv_write.cu", include_str!("kernels/kv_write.cu")),
    (
        "attention_fast.cu",
        include_str!("kernels/attention_fast.cu"),
    ),
    (
        "attention_prefill.cu",
        include_str!("kernels/attention_prefill.cu"),
    ),
    (
        "attention_prefill_wg.cu",
        include_str!("kernels/attention_prefill_wg.cu"),
    ),
    (
        "attention_cluster.cu",
        include_str!("kernels/attention_cluster.cu"),
    ),
    (
        "attention_decode.cu",
        include_str!("kernels/attention_decode.cu"),
    ),
    ("sampling.cu", include_str!("kernels/sampling.cu")),
    ("gemv.cu", include_str!("kernels/gemv.cu")),
    ("gemm_skinny.cu", include_str!("kernels/gemm_skinny.cu")),
    ("vision.cu", include_str!("kernels/vision.cu")),
];

/// Every `extern "C"` kernel of the program; each is loaded at start-up, so a missing one is
/// an error then rather than at its first launch.
pub const KERNEL_NAMES: &[&str] = &[
    "embedding_f32",
    "embedding_bf16",
    "gather_rows_f32",
    "gather_rows_bf16",
    "bias_add_f32",
    "rms_norm_f32",
    "rms_norm_bf16",
    "rms_norm_rows_f32",
    "rms_norm_rows_bf16",
    "qk_norm_rope_f32",
    "qk_norm_rope_kv_f32",
    "qk_norm_rope_kv_bf16",
    "qk_norm_rope_kv_h16",
    "qk_norm_rope_kv_fp8",
    "qk_norm_rope_tokens_f32",
    "qk_norm_rope_kv_tokens_f32",
    "qk_norm_rope_kv_tokens_bf16",
    "qk_norm_rope_kv_tokens_h16",
    "qk_norm_rope_kv_tokens_in16_bf16",
    "qk_norm_rope_kv_tokens_q16_bf16",
    "silu_mul_f32",
    "silu_mul_bf16",
    "silu_mul_in16_f32",
    "silu_mul_in16_bf16",
    "kv_write_f32",
    "kv_write_bf16",
    "kv_write_h16",
    "kv_write_fp8",
    "argmax_f32",
    "sample_rows_f32",
    "row_logprobs",
    "fold_rows_f32",
    "attention_prefill_f32_hd64",
    "attention_prefill_bf16_hd64",
    "attention_prefill_f32_hd128",
    "attention_prefill_bf16_hd128",
    "attention_decode_f32_n8_hd64",
    "attention_decode_bf16_n8_hd64",
    "attention_decode_f32_n8_hd128",
    "attention_decode_bf16_n8_hd128",
    "attention_decode_f32_n16_hd64",
    "attention_decode_bf16_n16_hd64",
    "attention_decode_f32_n16_hd128",
    "attention_decode_bf16_n16_hd128",
    "attention_decode_cluster_bf16_n8_hd64",
    "attention_decode_cluster_bf16_n8_hd128",
    "attention_decode_cluster_bf16_n16_hd64",
    "attention_decode_cluster_bf16_n16_hd128",
    "gemv_bf16_m2",
    "gemv_norm_bf16_m2",
    "gemv_norm_silu_bf16_m2",
    "gemv_early_bf16_m1",
    "gemv_norm_early_bf16_m1",
    "gemv_norm_silu_early_bf16_m1",
    "gemv_xf32_m2",
    "gemv_early_xf32_m1",
    "gemv_norm_xf32_m2",
    "gemv_norm_silu_xf32_m2",
    "gemv_norm_early_xf32_m1",
    "gemv_norm_silu_early_xf32_m1",
    "gemm_skinny_n8",
    "gemm_skinny_n16",
    "vision_patches_f32",
    "vision_embed_f32",
    "layer_norm_f32",
    "bias_act_f32",
    "softmax_rows_f32",
];

/// The files of the KV attention programs ([`KvProgram`]).
const HALF_KV_SOURCES: &[&str] = &[
    "prelude.cu",
    "attention_fast.cu",
    "attention_prefill.cu",
    "attention_prefill_wg.cu",
    "attention_cluster.cu",
    "attention_decode.cu",
];

/// The entry points the engine takes from each KV attention program ([`KvProgram`]): the
/// tensor-core prefill and decode attention (plain and cluster) over an IEEE half pool, or
/// an FP8 pool dequantised into half as it is staged (Q and P in half), writing f32 (for the
/// GEMVs that read f32 rows) or split bf16 (`b16`, for the bf16x2 GEMMs; plain bf16 with no
/// split offset, for the bf16 precision).
pub const HALF_KV_KERNEL_NAMES: &[&str] = &[
    "attention_prefill_f32_hd64",
    "attention_prefill_f32_hd128",
    "attention_prefill_b16_hd64",
    "attention_prefill_b16_hd128",
    "attention_decode_f32_n8_hd64",
    "attention_decode_f32_n8_hd128",
    "attention_decode_f32_n16_hd64",
    "attention_decode_f32_n16_hd128",
    "attention_decode_b16_n8_hd64",
    "attention_decode_b16_n8_hd128",
    "attention_decode_b16_n16_hd64",
    "attention_decode_b16_n16_hd128",
    "attention_decode_cluster_f32_n8_hd64",
    "attention_decode_cluster_f32_n8_hd128",
    "attention_decode_cluster_f32_n16_hd64",
    "attention_decode_cluster_f32_n16_hd128",
    "attention_decode_cluster_b16_n8_hd64",
    "attention_decode_cluster_b16_n8_hd128",
    "attention_decode_cluster_b16_n16_hd64",
    "attention_decode_cluster_b16_n16_hd128",
];

/// The warpgroup (wgmma) prefill attention of the main program (`attention_prefill_wg.cu`,
/// head_dim 128), compiled only for an architecture with Hopper's arch-specific features
/// ([`has_wgmma`]).
pub const WG_KERNEL_NAMES: &[&str] = &[
    "attention_prefill_wg_f32_hd128",
    "attention_prefill_wg_bf16_hd128",
    "attention_prefill_wg_q16_bf16_hd128",
];

/// The same in the half-KV program ([`KvProgram::HalfKv`]; the FP8 program has none).
pub const HALF_KV_WG_KERNEL_NAMES: &[&str] = &[
    "attention_prefill_wg_f32_hd128",
    "attention_prefill_wg_b16_hd128",
];

/// A program of the attention files alone, compiled as the f16 program (`TANDEM_F16`: Q, P
/// and the staged keys and values in IEEE half) plus `TANDEM_HALF_KV` (outputs in f32 or
/// split bf16 for bf16 weights), for a pool the main program does not read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvProgram {
    /// An IEEE half pool beside bf16 weights (bf16x2's default cache).
    HalfKv,
    /// An FP8 e4m3 pool with per-(token, head) scales (`TANDEM_FP8_KV`).
    Fp8Kv,
}

impl KvProgram {
    /// The prefix under which a device keeps the program's kernels beside the main
    /// program's (their entry point names overlap).
    pub fn prefix(self) -> &'static str {
        match self {
            KvProgram::HalfKv => "half_kv:",
            KvProgram::Fp8Kv => "fp8_kv:",
        }
    }

    /// Its name in messages and logs.
    pub fn name(self) -> &'static str {
        match self {
            KvProgram::HalfKv => "half-KV attention",
            KvProgram::Fp8Kv => "FP8-KV attention",
        }
    }

    fn defines(self) -> Vec<String> {
        let mut d = vec!["-DTANDEM_F16".to_string(), "-DTANDEM_HALF_KV".to_string()];
        if self == KvProgram::Fp8Kv {
            d.push("-DTANDEM_FP8_KV".into());
        }
        d
    }
}

/// What the program's 16-bit element (`e16_t`: weights, GEMM inputs, a 16-bit KV pool) is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Float16 {
    /// bfloat16: 8 exponent bits, 7 mantissa bits (the default).
    #[default]
    Bf16,
    /// IEEE half: 5 exponent bits (±65,504), 10 mantissa bits; compiled with `TANDEM_F16`.
    F16,
}

impl Float16 {
    /// Its name in messages and cache keys.
    pub fn name(self) -> &'static str {
        match self {
            Float16::Bf16 => "bf16",
            Float16::F16 => "f16",
        }
    }

    /// cuBLAS's name for the type.
    pub fn cuda_type(self) -> cudarc::cublas::sys::cudaDataType {
        match self {
            Float16::Bf16 => cudarc::cublas::sys::cudaDataType::CUDA_R_16BF,
            Float16::F16 => cudarc::cublas::sys::cudaDataType::CUDA_R_16F,
        }
    }

    /// The NVRTC options that select it.
    fn defines(self) -> Vec<String> {
        match self {
            Float16::Bf16 => Vec::new(),
            Float16::F16 => vec!["-DTANDEM_F16".into()],
        }
    }
}

/// One instance of `attention_fast.cu`'s template: pool element type, output element type
/// (`f32` / `bf16`), elements per lane `e` and q heads per KV head `g`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttentionInstance {
    pub pool: &'static str,
    pub out: &'static str,
    pub e: usize,
    pub g: usize,
}

impl AttentionInstance {
    pub fn name(&self) -> String {
        format!(
            "attention_fast_{}_{}_e{}_g{}",
            self.pool, self.out, self.e, self.g
        )
    }

    /// The macro line that instantiates it.
    pub fn source_line(&self) -> String {
        let ty = |t: &str| match t {
            "bf16" => "e16_t",
            "h16" => "h16_t",
            _ => "float",
        };
        format!(
            "ATTENTION_FAST({}, {}, {}, {}, {})\n",
            self.name(),
            ty(self.pool),
            ty(self.out),
            self.e,
            self.g
        )
    }

    /// Every instance the launch wrapper may ask for.
    pub fn all() -> Vec<AttentionInstance> {
        let mut v = Vec::new();
        // h16: an f16 pool beside bf16 weights (the bf16x2 precision's f16 cache).
        for pool in ["f32", "bf16", "h16"] {
            for out in ["f32", "bf16"] {
                for e in [1, 4, 8] {
                    for g in 1..=8 {
                        v.push(AttentionInstance { pool, out, e, g });
                    }
                }
            }
        }
        v
    }
}

/// The program's source: the embedded files, or those of [`KERNEL_DIR_ENV`] when it is set.
pub fn program_source() -> Result<String, EngineError> {
    source_of(|_| true)
}

/// The concatenation of the source files `keep` selects, in program order.
fn source_of(keep: impl Fn(&str) -> bool) -> Result<String, EngineError> {
    let dir = std::env::var_os(KERNEL_DIR_ENV);
    let mut src = String::new();
    for (name, embedded) in SOURCES.iter().filter(|(n, _)| keep(n)) {
        match &dir {
            Some(dir) => {
                let path = std::path::Path::new(dir).join(name);
                let text = std::fs::read_to_string(&path).map_err(|e| EngineError::io(&path, e))?;
                src.push_str(&text);
            }
            None => src.push_str(embedded),
        }
        src.push('\n');
    }
    Ok(src)
}

/// The NVRTC architecture for compute capability (X, Y): `sm_XY`, and `sm_90a` for 9.0 (Hopper's
/// arch-specific features: the warpgroup MMA of `attention_prefill_wg.cu`; PTX for `sm_90a`
/// runs on compute capability 9.0 only, which is what it is compiled for).
pub fn arch_for(major: i32, minor: i32) -> String {
    if (major, minor) == (9, 0) {
        "sm_90a".to_string()
    } else {
        format!("sm_{major}{minor}")
    }
}

/// Whether a program compiled for `arch` holds the warpgroup kernels ([`WG_KERNEL_NAMES`]).
pub fn has_wgmma(arch: &str) -> bool {
    arch == "sm_90a"
}

fn cache() -> &'static Mutex<HashMap<String, String>> {
    static CACHE: OnceLock<Mutex<HashMap<String, String>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// PTX of the program for `arch` (e.g. `sm_90a`) and 16-bit element `e16`, compiled by NVRTC
/// on first use in this process and cached. The caller must have checked that NVRTC is
/// present ([`super::check_libraries`]): cudarc panics on a missing library.
pub fn ptx_for(arch: &str, e16: Float16) -> Result<String, EngineError> {
    ptx_with_instances(arch, e16, &[])
}

/// PTX of the program plus the given attention instances (cached per arch, element and list).
pub fn ptx_with_instances(
    arch: &str,
    e16: Float16,
    instances: &[AttentionInstance],
) -> Result<String, EngineError> {
    let key = instances
        .iter()
        .fold(format!("{arch}/{}", e16.name()), |k, i| k + "/" + &i.name());
    let mut src = program_source()?;
    for i in instances {
        src.push_str(&i.source_line());
    }
    compile_cached(arch, &e16.defines(), e16.name(), key, &src)
}

/// PTX of a KV attention program for `arch` ([`KvProgram`]). The bf16x2 precision with an
/// f16 cache, and bf16x2 or bf16 with an FP8 cache, take their attention from one of these,
/// the rest from the bf16 program. Cached like [`ptx_for`].
pub fn kv_program_ptx(arch: &str, program: KvProgram) -> Result<String, EngineError> {
    let src = source_of(|n| HALF_KV_SOURCES.contains(&n))?;
    compile_cached(
        arch,
        &program.defines(),
        program.name(),
        format!("{arch}/{}", program.prefix()),
        &src,
    )
}

/// PTX of one attention instance alone (the prelude and `attention_fast.cu`): what the engine
/// compiles on demand. The whole program took the H200's NVRTC and driver 7.5 s; this part
/// is a fraction of it.
pub fn instance_ptx(
    arch: &str,
    e16: Float16,
    inst: AttentionInstance,
) -> Result<String, EngineError> {
    let key = format!("{arch}/{}/only/{}", e16.name(), inst.name());
    let mut src = source_of(|n| n == "prelude.cu" || n == "attention_fast.cu")?;
    src.push_str(&inst.source_line());
    compile_cached(arch, &e16.defines(), e16.name(), key, &src)
}

/// `src` compiled for `arch` with `defines` (`what` names the program in errors), cached by
/// `key`.
fn compile_cached(
    arch: &str,
    defines: &[String],
    what: &str,
    key: String,
    src: &str,
) -> Result<String, EngineError> {
    let mut cache = cache()
        .lock()
        .map_err(|_| EngineError::Backend("CUDA kernel cache lock poisoned".into()))?;
    if let Some(ptx) = cache.get(&key) {
        return Ok(ptx.clone());
    }
    let opts = cudarc::nvrtc::CompileOptions {
        // Exact division and square root, no flush-to-zero: the f32 mode is compared with the
        // CPU backend.
        ftz: Some(false),
        prec_sqrt: Some(true),
        prec_div: Some(true),
        options: [format!("--gpu-architecture={arch}"), "--std=c++17".into()]
            .into_iter()
            .chain(defines.iter().cloned())
            .collect(),
        name: Some("tandem_kernels.cu".into()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(src, opts).map_err(|e| {
        let detail = match &e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                log.to_string_lossy().into_owned()
            }
            other => format!("{other:?}"),
        };
        EngineError::Backend(format!(
            "NVRTC could not compile the {what} kernels for {arch}: {detail}"
        ))
    })?;
    let text = ptx.to_src();
    cache.insert(key, text.clone());
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_name_is_defined_in_the_sources() {
        let src: String = SOURCES.iter().map(|(_, s)| *s).collect();
        for name in KERNEL_NAMES.iter().chain(WG_KERNEL_NAMES) {
            // Defined directly (possibly with launch bounds), or by a macro instantiation
            // `MACRO(name, ...)`.
            assert!(
                src.contains(&format!(" {name}(")) || src.contains(&format!("({name},")),
                "kernel {name} not found in the sources"
            );
        }
    }

    #[test]
    fn every_half_kv_kernel_is_defined_in_its_sources() {
        let src: String = SOURCES
            .iter()
            .filter(|(n, _)| HALF_KV_SOURCES.contains(n))
            .map(|(_, s)| *s)
            .collect();
        assert_eq!(HALF_KV_SOURCES.len(), 6);
        for name in HALF_KV_KERNEL_NAMES.iter().chain(HALF_KV_WG_KERNEL_NAMES) {
            assert!(src.contains(&format!("({name},")), "{name} not found");
        }
    }

    #[test]
    fn arch_names_follow_nvrtc() {
        assert_eq!(arch_for(9, 0), "sm_90a");
        assert_eq!(arch_for(8, 6), "sm_86");
        assert_eq!(arch_for(10, 0), "sm_100");
        assert!(has_wgmma(&arch_for(9, 0)));
        assert!(!has_wgmma(&arch_for(8, 9)) && !has_wgmma(&arch_for(10, 0)));
    }
}
