//! The CUDA vision tower (`backend::cuda::vision`) against transformers, and its throughput.
//!
//! `cuda_vision_check [REF_DIR [MODEL_DIR]] [--bench]`
//!
//! REF_DIR holds a `manifest.json` whose `cases` name `pixel_values`, `vision_hidden` (the
//! selected hidden state, the projector's input) and `image_features` (the projector's
//! output) f32 files, as `scripts/goldens/llava.py` (the tiny LLaVA, the default: its goldens
//! in the checkout this was built from, the model written to a temporary folder) and
//! `scripts/goldens/clip_tower.py` (a llava-1.5-7b-shaped tower with random weights, MODEL_DIR
//! the folder it wrote) make. Each case runs on the GPU in f32 GEMMs (max |Δ| within 1e-4 of
//! the reference's std) and in TF32 (the encode worker's precision; within 2e-2), both with
//! cosine ≥ 0.999.
//!
//! With `--bench`: images/s of the tower and projector at batches of 1, 8 and 32 images in
//! TF32 and f32 (median of 5 timed runs after a warm-up), and on the CPU (rayon over this
//! machine's cores) at 4 images, and the GPU time per launch of one 32-image run. Prints a
//! JSON report; exits 1 on a failed check, 2 without a
//! GPU or on bad input.

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("cuda_vision_check needs the `cuda` feature: --features cuda");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
fn main() {
    match check::run() {
        Ok(pass) => std::process::exit(if pass { 0 } else { 1 }),
        Err(e) => {
            println!("{}", serde_json::json!({ "error": e }));
            std::process::exit(2);
        }
    }
}

#[cfg(feature = "cuda")]
#[path = "common/stats.rs"]
mod stats;

#[cfg(feature = "cuda")]
mod check {
    use std::path::{Path, PathBuf};
    use std::time::Instant;

    use serde_json::{json, Value};

    use crate::stats::{cosine, std_of};
    use tandem_engine::backend::cuda::vision::VisionPrecision;
    use tandem_engine::model::VisionEncoder;

    const MIN_COSINE: f64 = 0.999;
    const BATCHES: [usize; 3] = [1, 8, 32];
    const TIMED_RUNS: usize = 5;
    const CPU_IMAGES: usize = 4;

    /// The positional arguments (flags dropped).
    fn positional() -> Vec<String> {
        std::env::args()
            .skip(1)
            .filter(|a| !a.starts_with("--"))
            .collect()
    }

    fn read_f32(dir: &Path, v: &Value) -> Result<Vec<f32>, String> {
        let file = v["file"].as_str().ok_or("tensor without a file")?;
        let bytes = std::fs::read(dir.join(file)).map_err(|e| format!("{file}: {e}"))?;
        if bytes.len() % 4 != 0 {
            return Err(format!("{file}: {} bytes is not whole f32s", bytes.len()));
        }
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// `got` against `want`: max |Δ| / std(want) within `tol` and cosine ≥ [`MIN_COSINE`].
    fn compare(got: &[f32], want: &[f32], tol: f64) -> (Value, bool) {
        if got.len() != want.len() {
            let v = json!({ "error": format!("{} values, the reference has {}", got.len(), want.len()) });
            return (v, false);
        }
        let max = got
            .iter()
            .zip(want)
            .map(|(a, b)| (*a as f64 - *b as f64).abs())
            .fold(0.0, f64::max);
        let rel = max / std_of(want).max(1e-30);
        let cos = cosine(got, want);
        let ok = rel <= tol && cos >= MIN_COSINE && rel.is_finite();
        (
            json!({ "max_abs_over_std": rel, "cosine": cos, "pass": ok }),
            ok,
        )
    }

    /// The reference folder and the model folder (kept alive while the check runs).
    fn folders() -> Result<(PathBuf, PathBuf, Option<TempDir>), String> {
        let args = positional();
        let reference = args.first().map(PathBuf::from).unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../tiny-model/goldens/llava")
        });
        if let Some(model) = args.get(1) {
            return Ok((reference, PathBuf::from(model), None));
        }
        let tmp = TempDir::new()?;
        tandem_engine::tiny::write_tiny_vl_weights(&tmp.0).map_err(|e| e.to_string())?;
        Ok((reference, tmp.0.clone(), Some(tmp)))
    }

    /// A folder removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> Result<Self, String> {
            let p = std::env::temp_dir().join(format!("cuda-vision-check-{}", std::process::id()));
            std::fs::create_dir_all(&p).map_err(|e| format!("{}: {e}", p.display()))?;
            Ok(TempDir(p))
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    pub fn run() -> Result<bool, String> {
        tandem_engine::backend::cuda::check_libraries().map_err(|e| e.to_string())?;
        let (reference, model, _tmp) = folders()?;
        let text = std::fs::read_to_string(reference.join("manifest.json"))
            .map_err(|e| format!("{}: {e}", reference.join("manifest.json").display()))?;
        let m: Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
        let (cpu, _) = tandem_engine::model::load_vision(&model).map_err(|e| e.to_string())?;
        let mut pass = true;
        let mut precisions = Vec::new();
        for (name, precision, tol) in [
            ("f32", VisionPrecision::F32, 1e-4),
            ("tf32", VisionPrecision::Tf32, 2e-2),
        ] {
            let gpu = cpu.on_cuda(0, precision).map_err(|e| e.to_string())?;
            let (cases, ok) = check_cases(&gpu, &reference, &m, tol)?;
            pass &= ok;
            let (bench, profile) = match std::env::args().any(|a| a == "--bench") {
                true => (Some(bench(&gpu)?), Some(profile(&gpu)?)),
                false => (None, None),
            };
            precisions.push(json!({
                "precision": name, "tolerance": tol, "cases": cases, "bench": bench,
                "profile": profile,
            }));
        }
        let cpu_bench = match std::env::args().any(|a| a == "--bench") {
            true => Some(time_images(&cpu, CPU_IMAGES, 1)?),
            false => None,
        };
        let v = &cpu.config;
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "model": model.display().to_string(),
                "tower": {
                    "hidden": v.hidden_size, "layers_used": v.layers_used,
                    "heads": v.num_attention_heads, "image_size": v.image_size,
                    "patch_size": v.patch_size, "tokens_per_image": v.tokens_per_image(),
                    "text_hidden": v.text_hidden_size,
                },
                "reference": { "generator": m["generator"], "torch": m["torch"],
                    "transformers": m["transformers"], "pytorch_bench": m["pytorch_bench"] },
                "precisions": precisions,
                "cpu_bench": cpu_bench,
                "pass": pass,
            }))
            .map_err(|e| e.to_string())?
        );
        Ok(pass)
    }

    /// Every case's tower output and projector output against the reference's.
    fn check_cases(
        gpu: &VisionEncoder,
        dir: &Path,
        m: &Value,
        tol: f64,
    ) -> Result<(Vec<Value>, bool), String> {
        let mut out = Vec::new();
        let mut pass = true;
        for case in m["cases"].as_array().ok_or("manifest without cases")? {
            let pixels = read_f32(dir, &case["pixel_values"])?;
            let hidden = gpu.vision_features(&pixels).map_err(|e| e.to_string())?;
            let features = gpu.encode(&pixels).map_err(|e| e.to_string())?;
            let (h, h_ok) = compare(&hidden, &read_f32(dir, &case["vision_hidden"])?, tol);
            let (f, f_ok) = compare(&features, &read_f32(dir, &case["image_features"])?, tol);
            pass &= h_ok && f_ok;
            out.push(json!({ "case": case["case"], "vision_hidden": h, "image_features": f }));
        }
        Ok((out, pass))
    }

    /// Images/s at each batch size of [`BATCHES`].
    fn bench(gpu: &VisionEncoder) -> Result<Vec<Value>, String> {
        BATCHES
            .iter()
            .map(|&n| time_images(gpu, n, TIMED_RUNS))
            .collect()
    }

    /// The GPU time per launch of one run at the largest batch, the 12 longest.
    fn profile(gpu: &VisionEncoder) -> Result<Vec<Value>, String> {
        let n = BATCHES[BATCHES.len() - 1];
        let pixels = vec![0.5f32; n * gpu.config.pixels_per_image()];
        let times = gpu.profile_encode(&pixels).map_err(|e| e.to_string())?;
        Ok(times
            .iter()
            .take(12)
            .map(|t| json!({ "name": t.name, "launches": t.launches, "ms": t.ms }))
            .collect())
    }

    /// The median over `runs` timed runs (after one warm-up) of encoding `n` images.
    fn time_images(enc: &VisionEncoder, n: usize, runs: usize) -> Result<Value, String> {
        let per = enc.config.pixels_per_image();
        let mut rng = tandem_rng::SplitMix64::new(7);
        let pixels: Vec<f32> = (0..n * per)
            .map(|_| (tandem_rng::unit_f64(rng.next_u64()) * 4.0 - 2.0) as f32)
            .collect();
        enc.encode(&pixels).map_err(|e| e.to_string())?;
        let mut secs = Vec::with_capacity(runs);
        for _ in 0..runs {
            let start = Instant::now();
            enc.encode(&pixels).map_err(|e| e.to_string())?;
            secs.push(start.elapsed().as_secs_f64());
        }
        secs.sort_by(f64::total_cmp);
        let median = secs[secs.len() / 2];
        Ok(json!({
            "images": n, "median_ms": median * 1e3, "images_per_s": n as f64 / median,
        }))
    }
}
