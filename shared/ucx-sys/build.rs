//! Links libucp/libucs dynamically. The bindings themselves are pre-generated
//! (src/bindings.rs, see gen-bindings.sh), so building needs only the UCX shared
//! libraries (Debian `libucx-dev`), not libclang.
//!
//! Library search path: `TANDEM_UCX_LIB_DIR` if set, else `pkg-config --libs-only-L ucx`,
//! else the linker's default paths. Linking is always dynamic (`libucp.so.0`) so the
//! binary can run against another UCX 1.x (e.g. the CUDA-enabled one of PyPI
//! `libucx-cu13`) through `LD_LIBRARY_PATH`.
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=TANDEM_UCX_LIB_DIR");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    if let Ok(dir) = std::env::var("TANDEM_UCX_LIB_DIR") {
        println!("cargo:rustc-link-search=native={dir}");
    } else if let Ok(out) = Command::new("pkg-config")
        .args(["--libs-only-L", "ucx"])
        .output()
    {
        if out.status.success() {
            for flag in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                if let Some(dir) = flag.strip_prefix("-L") {
                    println!("cargo:rustc-link-search=native={dir}");
                }
            }
        } else {
            println!(
                "cargo:warning=pkg-config does not know `ucx`; install libucx-dev or set TANDEM_UCX_LIB_DIR"
            );
        }
    }
    println!("cargo:rustc-link-lib=dylib=ucp");
    println!("cargo:rustc-link-lib=dylib=ucs");
}
