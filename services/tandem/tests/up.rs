//! `tandem up` end to end: starts, serves, and stops every child on SIGTERM.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

#[test]
fn tandem_up_agg_serves_and_stops_cleanly() {
    up_serves_and_stops_cleanly(&["--topology", "agg", "--workers", "2"], 3);
}

#[test]
fn tandem_up_disagg_is_the_default_and_serves_through_a_prefill_worker() {
    // --enforce-disagg: the short request goes through the prefill worker, not the
    // decode worker's own prefill.
    up_serves_and_stops_cleanly(&["--router-arg=--enforce-disagg"], 3);
}

#[test]
fn tandem_up_with_the_planner_serves_on_the_workers_it_starts() {
    // The planner starts one prefill and one decode worker; at SIGTERM it drains them and
    // exits, so the children tandem up reports are the planner and the router.
    up_serves_and_stops_cleanly(&["--planner", "--router-arg=--enforce-disagg"], 2);
}

fn up_serves_and_stops_cleanly(args: &[&str], children: usize) {
    let exe = env!("CARGO_BIN_EXE_tandem");
    for sibling in [
        "tandem-router",
        "tandem-decode",
        "tandem-prefill",
        "tandem-planner",
    ] {
        let p = std::path::Path::new(exe).with_file_name(sibling);
        assert!(
            p.is_file(),
            "{} missing: build the workspace first (cargo test --workspace does)",
            p.display()
        );
    }
    let mut child = Command::new(exe)
        .args(["up", "--http-port", "0"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn tandem up");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut url = None;
    let mut lines = Vec::new();
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(180)) {
        if let Some(rest) = line.trim().strip_prefix("curl -s ") {
            url = rest.split_whitespace().next().map(str::to_string);
        }
        let done = line.contains("Press Ctrl-C");
        lines.push(line);
        if done {
            break;
        }
    }
    let Some(url) = url else {
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let _ = child.wait();
        panic!("no curl line in tandem up's output: {lines:#?}");
    };
    let out = Command::new("curl")
        .args(["-s", "-m", "60", &url, "-H", "Content-Type: application/json", "-d",
               r#"{"model": "tandem-tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4}"#])
        .output()
        .expect("curl");
    let body: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON response");
    assert_eq!(body["usage"]["completion_tokens"], 4, "{body}");

    assert!(Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let (done_tx, done_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done_tx.send(child.wait());
    });
    let status = done_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("tandem up did not stop within 60 s")
        .unwrap();
    assert!(status.success(), "tandem up exit: {status}");
    let mut exits = Vec::new();
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(5)) {
        exits.push(line);
    }
    let stopped = exits
        .iter()
        .filter(|l| l.contains("exited (exit status: 0)"))
        .count();
    assert_eq!(
        stopped, children,
        "every child should exit cleanly: {exits:#?}"
    );
}
