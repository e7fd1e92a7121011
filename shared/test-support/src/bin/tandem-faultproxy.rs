//! `tandem-faultproxy --forward LISTEN=TARGET [--forward ...] [--fault SPEC | --fault-file PATH]`
//!
//! Relays TCP connections from each LISTEN address to its TARGET, both directions under the
//! fault in force: `--fault` fixes it; with `--fault-file` the fault is the file's content
//! (`latency_ms=50 loss=0.02 rto_ms=200 blackhole=1`, any subset) while the file exists, none
//! while it does not (checked every 100 ms). Prints `TANDEM_FAULTPROXY_READY` once every
//! listener is bound. A fault-drill tool (scripts/chaos.py); never part of a deployment.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use tandem_test_support::faultproxy::{serve, Fault, FaultSwitch};

struct Args {
    forwards: Vec<(SocketAddr, SocketAddr)>,
    fault: Option<Fault>,
    fault_file: Option<PathBuf>,
}

fn parse(args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut a = Args {
        forwards: Vec::new(),
        fault: None,
        fault_file: None,
    };
    let mut args = args.skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--forward" => {
                let v = value()?;
                let (l, t) = v
                    .split_once('=')
                    .ok_or(format!("--forward {v:?}: expected LISTEN=TARGET"))?;
                let addr = |s: &str| {
                    s.parse::<SocketAddr>()
                        .map_err(|e| format!("--forward {v:?}: {s:?} is not host:port ({e})"))
                };
                a.forwards.push((addr(l)?, addr(t)?));
            }
            "--fault" => a.fault = Some(Fault::parse(&value()?).map_err(|e| e.to_string())?),
            "--fault-file" => a.fault_file = Some(value()?.into()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if a.forwards.is_empty() {
        return Err("at least one --forward LISTEN=TARGET is needed".into());
    }
    Ok(a)
}

/// Follows the fault file: its fault while it exists, none while it does not.
async fn follow(path: PathBuf, switch: FaultSwitch) {
    let mut last = None;
    loop {
        let fault = match std::fs::read_to_string(&path) {
            Ok(text) => Fault::parse(&text).unwrap_or_else(|e| {
                eprintln!("tandem-faultproxy: {}: {e}; no fault", path.display());
                Fault::default()
            }),
            Err(_) => Fault::default(),
        };
        if last != Some(fault) {
            eprintln!("tandem-faultproxy: fault now {fault:?}");
            switch.set(fault);
            last = Some(fault);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::main]
async fn main() {
    let a = match parse(std::env::args()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("tandem-faultproxy: {e}");
            std::process::exit(2);
        }
    };
    let switch = FaultSwitch::default();
    if let Some(f) = a.fault {
        switch.set(f);
    }
    let mut tasks = Vec::new();
    for (listen, target) in a.forwards {
        let listener = match tokio::net::TcpListener::bind(listen).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("tandem-faultproxy: cannot listen on {listen}: {e}");
                std::process::exit(1);
            }
        };
        tasks.push(tokio::spawn(serve(listener, target, switch.clone())));
    }
    if let Some(path) = a.fault_file {
        tasks.push(tokio::spawn(follow(path, switch)));
    }
    println!("TANDEM_FAULTPROXY_READY");
    for t in tasks {
        let _ = t.await;
    }
}
