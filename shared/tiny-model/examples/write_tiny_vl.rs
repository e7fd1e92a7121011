//! Writes the tiny LLaVA folder (`tandem_tiny_model::write_tiny_vl_model`) into OUT_DIR, for
//! `scripts/goldens/llava.py` on the GPU machine:
//! `cargo run -p tandem-tiny-model --example write_tiny_vl -- .carry/tiny-vl`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::env::args()
        .nth(1)
        .ok_or("usage: write_tiny_vl OUT_DIR")?;
    tandem_tiny_model::write_tiny_vl_model(std::path::Path::new(&out))?;
    println!("tiny LLaVA: {out}");
    Ok(())
}
