//! `tandem up` end to end: starts, serves, keeps serving when a worker is killed (it is
//! restarted), stops every child on SIGTERM, and stops with a failure when the router dies.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Bound on every wait of these tests.
const BOUND: Duration = Duration::from_secs(180);

#[test]
fn tandem_up_agg_serves_and_stops_cleanly() {
    let up = Up::start(&["--topology", "agg", "--workers", "2"]);
    up.chat();
    up.stop_cleanly(3);
}

#[test]
fn tandem_up_disagg_is_the_default_and_serves_through_a_prefill_worker() {
    // --enforce-disagg: the short request goes through the prefill worker, not the
    // decode worker's own prefill.
    let up = Up::start(&["--router-arg=--enforce-disagg"]);
    up.chat();
    up.stop_cleanly(3);
}

#[test]
fn tandem_up_with_the_planner_serves_on_the_workers_it_starts() {
    // The planner starts one prefill and one decode worker; at SIGTERM it drains them and
    // exits, so the children tandem up reports are the planner and the router.
    let up = Up::start(&["--planner", "--router-arg=--enforce-disagg"]);
    up.chat();
    up.stop_cleanly(2);
}

#[test]
fn tandem_up_restarts_a_killed_worker_and_stops_when_the_router_dies() {
    let mut up = Up::start(&["--topology", "agg", "--workers", "2"]);
    let worker = up.child_pid("tandem-decode");
    kill("-KILL", worker);
    up.wait_line(|l| l.contains("exited unexpectedly") && l.contains("restarting it in 1s"));
    // The other worker serves meanwhile (a call to the dead one is re-dispatched).
    up.chat();
    up.wait_line(|l| l.contains("restarted: TANDEM_WORKER_READY"));
    assert_ne!(up.child_pid("tandem-decode"), worker, "a new process");
    up.chat();
    // Without the router nothing is served: tandem up stops everything and fails.
    kill("-KILL", up.child_pid("tandem-router"));
    let status = up.wait_exit();
    assert!(!status.success(), "tandem up exit: {status}");
    assert!(
        up.lines
            .iter()
            .any(|l| l.contains("router exited unexpectedly")),
        "{:#?}",
        up.lines
    );
}

#[test]
fn tandem_up_serves_a_tensor_parallel_model_as_it_serves_a_whole_one() {
    // Each topology's greedy text, after checking the ranks its workers run with.
    let greedy = |args: &[&str], prefill_tp: &str, decode_tp: &str| {
        let up = Up::start(args);
        let tp = |program: &str| {
            let args = up.child_args(program);
            let at = args.iter().rposition(|a| a == "--tensor-parallel-size");
            at.map_or("1".to_string(), |i| args[i + 1].clone())
        };
        assert_eq!(
            (tp("tandem-prefill"), tp("tandem-decode")),
            (prefill_tp.to_string(), decode_tp.to_string())
        );
        let text = up.greedy_text();
        up.stop_cleanly(3);
        text
    };
    let whole = greedy(&["--router-arg=--enforce-disagg"], "1", "1");
    // Every worker split over two ranks; then only the prefill worker, writing its KV into a
    // whole decode worker's pool (the layout is the same for any tensor-parallel size).
    let tp = ["--worker-arg=--tensor-parallel-size", "--worker-arg=2"];
    let split = greedy(
        &[
            &tp[..],
            &["--router-arg=--enforce-disagg", "--devices", "cpu"],
        ]
        .concat(),
        "2",
        "2",
    );
    assert_eq!(split, whole, "greedy text at tensor parallel 2");
    let mixed = greedy(
        &[
            "--prefill-arg=--tensor-parallel-size",
            "--prefill-arg=2",
            "--router-arg=--enforce-disagg",
        ],
        "2",
        "1",
    );
    assert_eq!(
        mixed, whole,
        "greedy text with a tensor-parallel prefill worker"
    );
}

/// A running `tandem up`, its stdout lines as they come and its API's chat URL.
struct Up {
    child: Option<Child>,
    rx: mpsc::Receiver<String>,
    lines: Vec<String>,
    url: String,
}

impl Up {
    fn start(args: &[&str]) -> Up {
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
        let mut up = Up {
            child: Some(child),
            rx,
            lines: Vec::new(),
            url: String::new(),
        };
        up.wait_line(|l| l.contains("Press Ctrl-C"));
        up.url = up
            .lines
            .iter()
            .find_map(|l| l.trim().strip_prefix("curl -s ")?.split_whitespace().next())
            .unwrap_or_else(|| panic!("no curl line in tandem up's output: {:#?}", up.lines))
            .to_string();
        up
    }

    /// Reads lines until one satisfies `want` (panics after [`BOUND`]).
    fn wait_line(&mut self, want: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + BOUND;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok(line) = self.rx.recv_timeout(left) else {
                panic!("no such line in tandem up's output: {:#?}", self.lines);
            };
            let done = want(&line);
            self.lines.push(line);
            if done {
                return;
            }
        }
    }

    /// A 4-token chat completion through the API.
    fn chat(&self) {
        self.complete(r#"{"model": "tandem-tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4}"#, 4);
    }

    /// The text of a 12-token greedy chat completion.
    fn greedy_text(&self) -> String {
        let body = self.complete(r#"{"model": "tandem-tiny", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12, "temperature": 0}"#, 12);
        body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_else(|| panic!("no content: {body}"))
            .to_string()
    }

    /// The response to a chat completion `request`, which must have produced `tokens` tokens.
    fn complete(&self, request: &str, tokens: u64) -> serde_json::Value {
        let out = Command::new("curl")
            .args([
                "-s",
                "-m",
                "60",
                &self.url,
                "-H",
                "Content-Type: application/json",
                "-d",
                request,
            ])
            .output()
            .expect("curl");
        let body: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON response");
        assert_eq!(body["usage"]["completion_tokens"], tokens, "{body}");
        body
    }

    /// The command line of the child process running `program`.
    fn child_args(&self, program: &str) -> Vec<String> {
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", self.child_pid(program)))
            .expect("/proc cmdline");
        cmdline
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect()
    }

    /// The pid of the child process running `program`.
    fn child_pid(&self, program: &str) -> u32 {
        let pid = self.child.as_ref().expect("running").id();
        let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .expect("/proc children");
        children
            .split_whitespace()
            .filter_map(|c| c.parse::<u32>().ok())
            .find(|c| {
                std::fs::read(format!("/proc/{c}/cmdline"))
                    .is_ok_and(|cmd| String::from_utf8_lossy(&cmd).contains(program))
            })
            .unwrap_or_else(|| panic!("no {program} child of tandem up ({children})"))
    }

    /// Waits (bounded) for tandem up to exit, then collects its last lines.
    fn wait_exit(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        let (done_tx, done_rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = done_tx.send(child.wait());
        });
        let status = done_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("tandem up did not stop within 60 s")
            .expect("wait");
        while let Ok(line) = self.rx.recv_timeout(Duration::from_secs(5)) {
            self.lines.push(line);
        }
        status
    }

    /// SIGTERM: tandem up exits 0 after each of its `children` exited cleanly.
    fn stop_cleanly(mut self, children: usize) {
        kill("-TERM", self.child.as_ref().expect("running").id());
        let before = self.lines.len();
        let status = self.wait_exit();
        assert!(status.success(), "tandem up exit: {status}");
        let exits = &self.lines[before..];
        let stopped = exits
            .iter()
            .filter(|l| l.contains("exited (exit status: 0)"))
            .count();
        assert_eq!(
            stopped, children,
            "every child should exit cleanly: {exits:#?}"
        );
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            kill("-TERM", c.id());
            let _ = c.wait();
        }
    }
}

fn kill(signal: &str, pid: u32) {
    assert!(Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("kill")
        .success());
}
