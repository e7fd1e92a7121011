//! Writes the tiny model of each family beside Qwen3 (`tiny::FAMILY_MODELS`) into
//! `OUT/<name>/`, without tokenizer files, for `scripts/goldens/make_family_goldens.py` on the
//! GPU machine: `cargo run -p tandem-engine --example write_family_models -- .carry/families`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::env::args()
        .nth(1)
        .ok_or("usage: write_family_models OUT_DIR")?;
    for name in tandem_engine::tiny::FAMILY_MODELS {
        let dir = std::path::Path::new(&out).join(name);
        tandem_engine::tiny::write_named_model(name, &dir, false)?;
        println!("{name}: {}", dir.display());
    }
    Ok(())
}
