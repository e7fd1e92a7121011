//! The official `openai` Python client (PyPI) against a real topology: the basic surface,
//! and the agent API (structured outputs, tool calls, reasoning, logit bias) on workers with
//! `--dyn-tool-call-parser hermes --dyn-reasoning-parser qwen3`.

mod common;

use common::Topology;

fn need_openai() {
    let probe = std::process::Command::new("python3")
        .args(["-c", "import openai"])
        .output();
    match probe {
        Ok(o) if o.status.success() => {}
        _ => panic!("python3 with the `openai` package is required: python3 -m pip install openai (scripts/test does this)"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_python_client_works() {
    need_openai();
    let t = Topology::start_healthy(1, &[], &[]).await;
    run_script(&t, "openai_client.py").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_api_works_through_the_openai_client() {
    need_openai();
    let parsers = [
        "--dyn-tool-call-parser",
        "hermes",
        "--dyn-reasoning-parser",
        "qwen3",
    ];
    let t = Topology::start_healthy(1, &parsers, &[]).await;
    run_script(&t, "openai_agents.py").await;
}

async fn run_script(t: &Topology, name: &str) {
    let script = format!("{}/tests/{name}", env!("CARGO_MANIFEST_DIR"));
    let out = tokio::process::Command::new("python3")
        .args([script.as_str(), &t.base, "tandem-tiny"])
        .output()
        .await
        .expect("run python3");
    assert!(
        out.status.success(),
        "{name} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
