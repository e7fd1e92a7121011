fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=../../proto/worker.proto");
    tonic_prost_build::configure()
        .compile_protos(&["../../proto/worker.proto"], &["../../proto"])?;
    Ok(())
}
