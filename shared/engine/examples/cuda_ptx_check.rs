//! Compiles every CUDA kernel to PTX with NVRTC, without a GPU: only libnvrtc is needed (the
//! PyPI wheel `nvidia-cuda-nvrtc` 13.0.x provides it; put its `lib` folder on
//! LD_LIBRARY_PATH). A kernel that does not compile fails this program. Arguments: the
//! architectures (default `sm_90a`, what the engine compiles for Hopper: with the warpgroup
//! prefill kernels), and `--write FILE` to save the PTX of the last one (the
//! torch kernel harness, `scripts/gpu/torch_kernels.py`, loads it: the bf16 program). Both
//! flavours of the program are compiled (bf16, and IEEE half for the f16 compute mode), and the
//! half-KV attention program. Prints one JSON line per architecture and program.
//!
//! `cargo run -p tandem-engine --features cuda --example cuda_ptx_check -- sm_90a`

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("cuda_ptx_check needs the `cuda` feature: --features cuda");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
fn main() {
    use tandem_engine::backend::cuda::kernels;
    // SAFETY: only tries to dlopen libnvrtc.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        eprintln!("libnvrtc not found (LD_LIBRARY_PATH); nothing compiled");
        std::process::exit(2);
    }
    let mut archs: Vec<String> = Vec::new();
    let mut write: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--write" {
            let Some(path) = args.next() else {
                eprintln!("--write needs a file name");
                std::process::exit(2);
            };
            write = Some(path);
        } else {
            archs.push(a);
        }
    }
    if archs.is_empty() {
        archs.push(kernels::arch_for(9, 0));
    }
    let mut ok = true;
    for arch in &archs {
        // Both flavours of the program (bf16, and IEEE half for the f16 compute mode) and the
        // half-KV program, each compiled on a thread of its own: NVRTC compiles one program
        // on one core, and the two big ones take about a minute each.
        let write = write.as_deref();
        ok &= std::thread::scope(|s| {
            let flavours = [kernels::Float16::Bf16, kernels::Float16::F16].map(|e16| {
                let write = write.filter(|_| e16 == kernels::Float16::Bf16);
                s.spawn(move || check_program(arch, e16, write))
            });
            use tandem_engine::backend::cuda::kernels::KvProgram;
            let kv_programs = check_kv_program(arch, KvProgram::HalfKv)
                & check_kv_program(arch, KvProgram::Fp8Kv);
            flavours
                .into_iter()
                .map(|t| t.join().unwrap_or(false))
                .fold(kv_programs, |all, one| all & one)
        });
    }
    std::process::exit(if ok { 0 } else { 1 });
}

/// Compiles a KV attention program (the attention files as the f16 program, outputs in bf16:
/// the bf16x2 precision's f16 cache, or an FP8 cache) for `arch`; prints a JSON line. True
/// when it compiled with every entry point the engine loads from it.
#[cfg(feature = "cuda")]
fn check_kv_program(arch: &str, program: tandem_engine::backend::cuda::kernels::KvProgram) -> bool {
    use tandem_engine::backend::cuda::kernels;
    let t0 = std::time::Instant::now();
    match kernels::kv_program_ptx(arch, program) {
        Ok(ptx) => {
            let wg: &[&str] = if program == kernels::KvProgram::HalfKv && kernels::has_wgmma(arch) {
                kernels::HALF_KV_WG_KERNEL_NAMES
            } else {
                &[]
            };
            let missing: Vec<&&str> = kernels::HALF_KV_KERNEL_NAMES
                .iter()
                .chain(wg)
                .filter(|n| !ptx.contains(&format!(".entry {n}(")))
                .collect();
            println!(
                "{}",
                serde_json::json!({
                    "arch": arch, "program": program.name(), "ptx_bytes": ptx.len(),
                    "kernels": kernels::HALF_KV_KERNEL_NAMES.len() + wg.len(), "missing": missing,
                    "ms": t0.elapsed().as_secs_f64() * 1e3,
                })
            );
            missing.is_empty()
        }
        Err(e) => {
            println!(
                "{}",
                serde_json::json!({ "arch": arch, "program": program.name(), "error": e.to_string() })
            );
            false
        }
    }
}

/// Compiles the program for `arch` and `e16` with every attention instance, then the
/// instances the engine compiles alone; prints a JSON line each. Writes the program's PTX to
/// `write` when given. True when everything compiled with every entry point present.
#[cfg(feature = "cuda")]
fn check_program(
    arch: &str,
    e16: tandem_engine::backend::cuda::kernels::Float16,
    write: Option<&str>,
) -> bool {
    use tandem_engine::backend::cuda::kernels;
    let mut ok = true;
    let t0 = std::time::Instant::now();
    // The program with every attention instance the engine may compile on demand.
    let instances = kernels::AttentionInstance::all();
    match kernels::ptx_with_instances(arch, e16, &instances) {
        Ok(ptx) => {
            let wg: &[&str] = if kernels::has_wgmma(arch) {
                kernels::WG_KERNEL_NAMES
            } else {
                &[]
            };
            let mut names: Vec<String> = kernels::KERNEL_NAMES
                .iter()
                .chain(wg)
                .map(|s| s.to_string())
                .collect();
            names.extend(instances.iter().map(|i| i.name()));
            let missing: Vec<&String> = names
                .iter()
                .filter(|n| !ptx.contains(&format!(".entry {n}(")))
                .collect();
            ok &= missing.is_empty();
            if let Some(path) = write {
                if let Err(e) = std::fs::write(path, &ptx) {
                    eprintln!("writing {path}: {e}");
                    ok = false;
                }
            }
            println!(
                "{}",
                serde_json::json!({
                    "arch": arch, "float16": e16.name(), "ptx_bytes": ptx.len(),
                    "kernels": names.len(), "missing": missing,
                    "ms": t0.elapsed().as_secs_f64() * 1e3,
                })
            );
        }
        Err(e) => {
            ok = false;
            println!(
                "{}",
                serde_json::json!({ "arch": arch, "float16": e16.name(), "error": e.to_string() })
            );
        }
    }
    // The programs the engine compiles on demand: one attention instance alone with the
    // prelude (one per pool and output type).
    for inst in kernels::AttentionInstance::all()
        .into_iter()
        .filter(|i| i.e == 4 && i.g == 2)
    {
        let t1 = std::time::Instant::now();
        let name = inst.name();
        let found = match kernels::instance_ptx(arch, e16, inst) {
            Ok(ptx) => ptx.contains(&format!(".entry {name}(")),
            Err(e) => {
                eprintln!("{name}: {e}");
                false
            }
        };
        ok &= found;
        println!(
            "{}",
            serde_json::json!({
                "arch": arch, "float16": e16.name(), "instance_alone": name,
                "compiled": found, "ms": t1.elapsed().as_secs_f64() * 1e3,
            })
        );
    }
    ok
}
