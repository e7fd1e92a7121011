//! Checks every CUDA kernel (compiled by NVRTC for the GPU it runs on) and the cuBLAS GEMM
//! against the CPU implementation (`cpu_ops`, the decoder's attention, the KV layout's address
//! function) on random inputs, and prints a JSON report of max |Δ| per check. Exits 1 when a
//! check fails, 2 when there is no usable GPU.
//!
//! Build here (no CUDA needed), run on the GPU machine:
//! `cargo build --release -p tandem-engine --features cuda --example cuda_kernels_check`

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("cuda_kernels_check needs the `cuda` feature: --features cuda");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
mod attention;
#[cfg(feature = "cuda")]
mod common;
#[cfg(feature = "cuda")]
mod elementwise;
#[cfg(feature = "cuda")]
mod fp8;
#[cfg(feature = "cuda")]
mod gemm;
#[cfg(feature = "cuda")]
mod sampling;
#[cfg(feature = "cuda")]
mod split_inputs;

#[cfg(feature = "cuda")]
fn main() {
    match run() {
        Ok(pass) => std::process::exit(if pass { 0 } else { 1 }),
        Err(e) => {
            println!("{}", serde_json::json!({ "error": e.to_string() }));
            std::process::exit(2);
        }
    }
}

#[cfg(feature = "cuda")]
fn run() -> Result<bool, tandem_engine::error::EngineError> {
    use common::{Ctx, Report, Rng};
    use serde_json::json;
    use std::time::Instant;
    use tandem_engine::backend::cuda::{check_libraries, CudaDevice};

    check_libraries()?;
    let t0 = Instant::now();
    let dev = CudaDevice::new(0)?;
    let init_ms = t0.elapsed().as_secs_f64() * 1e3;
    let mut cx = Ctx {
        dev,
        rep: Report {
            checks: Vec::new(),
            pass: true,
        },
        rng: Rng(0x9E37_79B9_7F4A_7C15),
    };
    elementwise::norms_and_embedding(&mut cx)?;
    elementwise::rope_and_silu(&mut cx)?;
    attention::kv_and_attention(&mut cx)?;
    attention::prefill_pieces(&mut cx)?;
    fp8::fp8_kv_and_attention(&mut cx)?;
    gemm::gemms(&mut cx)?;
    gemm::gemvs_without_skinny(&mut cx)?;
    gemm::gemms_tuned(&mut cx)?;
    split_inputs::split_inputs(&mut cx)?;
    elementwise::gather_and_bias(&mut cx)?;
    sampling::argmax_and_sampling(&mut cx)?;
    sampling::f16_overflow_rows(&mut cx)?;
    let Ctx { dev, rep, .. } = cx;
    dev.synchronize()?;
    let (free, total) = dev.mem_info()?;
    let report = json!({
        "device": dev.name(),
        "arch": dev.arch(),
        "init_and_nvrtc_compile_ms": init_ms,
        "total_ms": t0.elapsed().as_secs_f64() * 1e3,
        "mem_free_total_bytes": [free, total],
        "checks": rep.checks,
        "all_pass": rep.pass,
    });
    println!(
        "{}",
        serde_json::to_string_pretty(&report).unwrap_or_default()
    );
    Ok(rep.pass)
}
