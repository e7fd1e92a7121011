//! The official `openai` Python client (PyPI) against a real topology.

mod common;

use common::Topology;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_python_client_works() {
    let probe = std::process::Command::new("python3")
        .args(["-c", "import openai"])
        .output();
    match probe {
        Ok(o) if o.status.success() => {}
        _ => panic!("python3 with the `openai` package is required: python3 -m pip install openai (scripts/test does this)"),
    }
    let t = Topology::start_healthy(1, &[], &[]).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let out = tokio::process::Command::new("python3")
        .args([script, &t.base, "tandem-tiny"])
        .output()
        .await
        .expect("run python3");
    assert!(
        out.status.success(),
        "openai client script failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
