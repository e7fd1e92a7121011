//! Writes the shape-check model (`tiny::SHAPE_CHECK`: Qwen3-0.6B layer shapes, one layer, bf16)
//! without tokenizer files, for `scripts/goldens/make_shape_goldens.py` on the GPU machine:
//!
//!     cargo run -p tandem-engine --example write_shape_check -- .carry/shape

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::env::args_os()
        .nth(1)
        .ok_or("usage: write_shape_check OUT_DIR")?;
    tandem_engine::tiny::write_shape_check_model(std::path::Path::new(&out), false)?;
    println!("shape-check model written to {}", out.to_string_lossy());
    Ok(())
}
