//! Writes the tiny model of each family (`tiny::family_dims`) into `OUT/<family>/`, without
//! tokenizer files, for `scripts/goldens/make_family_goldens.py` on the GPU machine:
//! `cargo run -p tandem-engine --example write_family_models -- .carry/families`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::env::args()
        .nth(1)
        .ok_or("usage: write_family_models OUT_DIR")?;
    for family in tandem_engine::model::Family::ALL {
        if family == tandem_engine::model::Family::Qwen3 {
            continue; // the tiny Qwen3 has its own goldens (make_goldens.py)
        }
        let name = tandem_engine::tiny::family_name(family);
        let dir = std::path::Path::new(&out).join(name);
        tandem_engine::tiny::write_family_model(family, &dir, false)?;
        println!("{name}: {}", dir.display());
    }
    Ok(())
}
