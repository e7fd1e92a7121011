//! `tandem up`: a whole local topology as child processes (router + workers) with file-backed
//! discovery in a private folder, started in order, health-checked, kept serving (a worker that
//! dies is restarted, see `supervise`), and shut down together on Ctrl-C / SIGTERM or when the
//! router exits.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::supervise::{Launch, OnExit, Topology};

#[derive(clap::Args, Debug)]
pub struct UpArgs {
    /// Topology to start: agg (router + aggregated workers), disagg (router + prefill
    /// workers + decode workers in `pd` mode, KV pushed from prefill to decode) or epd (disagg
    /// plus encode workers that turn images into embeddings and write them into the prefill
    /// workers' memory; serves the built-in `tiny-vl` model by default).
    #[arg(long, default_value = "disagg", value_parser = ["agg", "disagg", "epd"])]
    pub topology: String,
    /// Encode workers (epd topology).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub encode_workers: u32,
    /// Prefill workers (disagg topology).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub prefill_workers: u32,
    /// KV transport between prefill and decode workers, and from encode workers to prefill
    /// workers (disagg, epd topologies): ucx or tcp.
    #[arg(long, default_value = "ucx", value_parser = ["ucx", "tcp"])]
    pub kv_transport: String,
    /// Model folder; the built-in model (`--builtin-model`) when unset.
    #[arg(long, alias = "model")]
    pub model_path: Option<PathBuf>,
    /// The built-in model served without --model-path: `tiny` (text, `tandem-tiny`; the
    /// default of agg and disagg) or `tiny-vl` (a random LLaVA that takes images,
    /// `tandem-tiny-vl`; the default of epd).
    #[arg(long, value_parser = ["tiny", "tiny-vl"], conflicts_with = "model_path")]
    pub builtin_model: Option<String>,
    /// Number of workers (decode workers in the disagg topology).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub workers: u32,
    /// Port of the OpenAI API (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    pub http_port: u16,
    /// Address the OpenAI API binds to.
    #[arg(long, default_value = "127.0.0.1")]
    pub http_host: String,
    /// Seconds to wait for each process to become ready.
    #[arg(long, default_value_t = 300)]
    pub ready_timeout_secs: u64,
    /// Folder of the deployment's mutual-TLS material for the internal channels; created on
    /// first start (`<cache>/pki` when unset).
    #[arg(long)]
    pub internal_tls_dir: Option<PathBuf>,
    /// Run the internal channels in plaintext, unauthenticated (benchmarks only).
    #[arg(long, conflicts_with = "internal_tls_dir")]
    pub insecure_internal: bool,
    /// Extra flags for every worker (repeat, e.g. --worker-arg=--max-batch-size --worker-arg=8).
    #[arg(long = "worker-arg", allow_hyphen_values = true)]
    pub worker_args: Vec<String>,
    /// Extra flags for the prefill workers only, after --worker-arg (repeat, e.g.
    /// --prefill-arg=--device --prefill-arg=cuda:0).
    #[arg(long = "prefill-arg", allow_hyphen_values = true)]
    pub prefill_args: Vec<String>,
    /// Extra flags for the decode (or aggregated) workers only, after --worker-arg (repeat,
    /// e.g. --decode-arg=--device --decode-arg=cuda:1).
    #[arg(long = "decode-arg", allow_hyphen_values = true)]
    pub decode_args: Vec<String>,
    /// Devices of the workers started here, one each in start order (encode, prefill, then
    /// decode workers), cycling when there are fewer devices than workers: worker i gets
    /// `--device` the i-th, after every other flag. `--devices cuda:0,cuda:1` puts a disagg
    /// topology's prefill worker on GPU 0 and its decode worker on GPU 1, or two aggregated
    /// workers on one GPU each.
    #[arg(long, value_delimiter = ',', value_parser = parse_device, conflicts_with = "planner")]
    pub devices: Vec<String>,
    /// Extra flags for the router (repeat, e.g. --router-arg=--enforce-disagg).
    #[arg(long = "router-arg", allow_hyphen_values = true)]
    pub router_args: Vec<String>,
    /// Let `tandem-planner` (local actuator) start, add and drain the prefill and decode
    /// workers (agg: the workers) on the load, from one of each up to --planner-max-replicas;
    /// --workers and --prefill-workers are then ignored.
    #[arg(long)]
    pub planner: bool,
    /// Most replicas of each role the planner may run.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub planner_max_replicas: u32,
    /// Extra flags for the planner (repeat, e.g. --planner-arg=--optimization-target
    /// --planner-arg=latency).
    #[arg(long = "planner-arg", allow_hyphen_values = true)]
    pub planner_args: Vec<String>,
}

/// The model folder to hand the workers (none: their built-in tiny model) and the name it
/// is served under. The built-in models are built once here, not racing in every worker.
async fn served_model(args: &UpArgs) -> anyhow::Result<(Option<PathBuf>, String)> {
    if let Some(p) = &args.model_path {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        return Ok((Some(p.clone()), name));
    }
    if builtin_model(args) == "tiny-vl" {
        let dir = tokio::task::spawn_blocking(tandem_tiny_model::ensure_tiny_vl_model).await??;
        println!("tandem: built-in tiny LLaVA model at {}", dir.display());
        return Ok((Some(dir), "tandem-tiny-vl".into()));
    }
    let dir = tokio::task::spawn_blocking(tandem_tiny_model::ensure_tiny_model).await??;
    println!("tandem: built-in tiny model at {}", dir.display());
    Ok((None, "tandem-tiny".into()))
}

/// The built-in model asked for, else the topology's default.
fn builtin_model(args: &UpArgs) -> &str {
    match (&args.builtin_model, args.topology.as_str()) {
        (Some(m), _) => m,
        (None, "epd") => "tiny-vl",
        (None, _) => "tiny",
    }
}

/// Whether the workers serve images (`--enable-multimodal`): the epd topology, or the
/// built-in LLaVA.
fn multimodal(args: &UpArgs) -> bool {
    args.topology == "epd" || (args.model_path.is_none() && builtin_model(args) == "tiny-vl")
}

/// The endpoint encode workers register under (the default namespace's `encode` component).
const ENCODE_ENDPOINT: &str = "dyn://dynamo.encode.generate";

fn sibling(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot locate the tandem binary")?;
    let path = exe.with_file_name(name);
    if !path.is_file() {
        bail!(
            "{} not found next to {}: build it with `cargo build --release -p {name}`",
            path.display(),
            exe.display()
        );
    }
    Ok(path)
}

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|kv| kv.strip_prefix(key))
}

/// `GET path` over a plain TCP connection; returns the status code.
async fn http_status(addr: &str, path: &str) -> Option<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .ok()?;
    let mut buf = vec![0u8; 64];
    let n = s.read(&mut buf).await.ok()?;
    let head = String::from_utf8_lossy(&buf[..n]);
    head.split_whitespace().nth(1)?.parse().ok()
}

/// The internal channels' security flag every child gets: the TLS folder (made on first use),
/// or `--insecure-internal` when asked for.
fn internal_security(args: &UpArgs) -> anyhow::Result<Vec<String>> {
    if args.insecure_internal {
        println!(
            "tandem: WARNING: --insecure-internal: the topology's internal channels are \
             plaintext and unauthenticated"
        );
        return Ok(vec!["--insecure-internal".into()]);
    }
    let dir = args
        .internal_tls_dir
        .clone()
        .unwrap_or_else(|| tandem_config::paths::cache_dir().join("pki"));
    match tandem_pki::generate(&dir, &[])
        .with_context(|| format!("preparing the internal TLS folder {}", dir.display()))?
    {
        tandem_pki::Generated::Created => println!(
            "tandem: generated this deployment's CA and certificate in {}",
            dir.display()
        ),
        tandem_pki::Generated::Existing => {}
    }
    Ok(vec!["--internal-tls-dir".into(), dir.display().to_string()])
}

/// A worker's multimodal flags: every role takes images; in the epd topology encode workers
/// keep an embedding cache and the others have them encode every image.
fn multimodal_args(mode: &str, epd: bool) -> Vec<String> {
    let mut a = vec!["--enable-multimodal".to_string()];
    match (mode, epd) {
        ("encode", _) => a.extend([
            "--multimodal-embedding-cache-capacity-gb".into(),
            "1".into(),
        ]),
        (_, true) => a.extend(["--encode-endpoint".into(), ENCODE_ENDPOINT.into()]),
        (_, false) => {}
    }
    a
}

/// A `--devices` entry: anything `--device` takes but `auto`.
fn parse_device(s: &str) -> Result<String, String> {
    match s.parse::<tandem_config::worker::DeviceChoice>()? {
        tandem_config::worker::DeviceChoice::Auto => {
            Err("name a device (cpu, cuda or cuda:N), not auto".into())
        }
        _ => Ok(s.to_string()),
    }
}

/// The `--device` flag of the `i`-th worker started, from `--devices` (none when unset).
fn device_args(devices: &[String], i: usize) -> Vec<String> {
    match devices.len() {
        0 => Vec::new(),
        n => vec!["--device".into(), devices[i % n].clone()],
    }
}

/// The model the workers serve: a folder (none: their built-in tiny model) and its name.
struct Served<'a> {
    path: Option<&'a Path>,
    name: &'a str,
}

/// The flags of a worker in `mode` of this topology.
fn worker_args(args: &UpArgs, mode: &str, served: &Served<'_>, security: &[String]) -> Vec<String> {
    let mut wargs: Vec<String> = [
        "--disaggregation-mode",
        mode,
        "--publish-kv-events",
        "--rpc-host",
        "127.0.0.1",
        "--system-host",
        "127.0.0.1",
    ]
    .map(String::from)
    .to_vec();
    if args.topology != "agg" {
        wargs.push("--kv-transport".into());
        wargs.push(args.kv_transport.clone());
    }
    if multimodal(args) {
        wargs.extend(multimodal_args(mode, args.topology == "epd"));
    }
    if let Some(p) = served.path {
        wargs.push("--model-path".into());
        wargs.push(p.display().to_string());
        wargs.push("--served-model-name".into());
        wargs.push(served.name.to_string());
    }
    wargs.extend(security.iter().cloned());
    wargs.extend(args.worker_args.iter().cloned());
    match mode {
        "prefill" => wargs.extend(args.prefill_args.iter().cloned()),
        "decode" | "agg" => wargs.extend(args.decode_args.iter().cloned()),
        _ => {}
    }
    wargs
}

/// The worker commands the planner runs: decode (or aggregated) and, disaggregated, prefill.
struct PlannedWorkers<'a> {
    decode: (&'a Path, Vec<String>),
    prefill: Option<(&'a Path, Vec<String>)>,
}

/// Writes the planner's `--local-workers-spec` into the topology's folder; how to start it.
fn start_planner(
    args: &UpArgs,
    root: &Path,
    workers: &PlannedWorkers<'_>,
    security: &[String],
) -> anyhow::Result<Launch> {
    let command = |(program, wargs): &(&Path, Vec<String>)| {
        serde_json::json!({
            "program": program,
            "args": wargs,
            "env": {"DYN_FILE_KV": root, "DYN_DISCOVERY_BACKEND": "file"},
        })
    };
    let disagg = workers.prefill.is_some();
    let spec = if disagg {
        serde_json::json!({
            "decode": command(&workers.decode),
            "prefill": workers.prefill.as_ref().map(command),
        })
    } else {
        serde_json::json!({ "agg": command(&workers.decode) })
    };
    let spec_path = root.join("planner-workers.json");
    std::fs::write(&spec_path, spec.to_string())
        .with_context(|| format!("writing {}", spec_path.display()))?;
    let mut pargs: Vec<String> = vec![
        "--planner-mode".into(),
        if disagg { "disagg" } else { "agg" }.into(),
        "--actuator".into(),
        "local".into(),
        "--local-workers-spec".into(),
        spec_path.display().to_string(),
        "--max-endpoint".into(),
        args.planner_max_replicas.to_string(),
        "--max-gpu-budget".into(),
        (2 * args.planner_max_replicas).to_string(),
    ];
    if args.http_port != 0 {
        pargs.push("--router-metrics-url".into());
        pargs.push(format!("http://127.0.0.1:{}/metrics", args.http_port));
    }
    pargs.extend(security.iter().cloned());
    pargs.extend(args.planner_args.iter().cloned());
    Ok(Launch {
        bin: sibling("tandem-planner")?,
        args: pargs,
        marker: "TANDEM_PLANNER_READY",
    })
}

pub async fn run(args: UpArgs) -> anyhow::Result<()> {
    let epd = args.topology == "epd";
    let disagg = args.topology == "disagg" || epd;
    let router_bin = sibling("tandem-router")?;
    let worker_bin = sibling("tandem-decode")?;
    let prefill_bin = if disagg {
        Some(sibling("tandem-prefill")?)
    } else {
        None
    };
    let encode_bin = if epd {
        Some(sibling("tandem-encode")?)
    } else {
        None
    };
    let (model_path, model) = served_model(&args).await?;
    let root = std::env::temp_dir().join(format!("tandem-up-{}", std::process::id()));
    std::fs::create_dir_all(&root)?;
    let timeout = Duration::from_secs(args.ready_timeout_secs);
    let mut topo = Topology::new(root.clone(), timeout);
    let security = internal_security(&args)?;

    let result = async {
        // Prefill workers first: a `pd` decode worker serving before them would prefill
        // everything itself.
        let mut plan: Vec<(String, &Path, &str)> = Vec::new();
        // Encode workers before the prefill workers that call them.
        if let Some(e) = &encode_bin {
            for i in 0..args.encode_workers {
                plan.push((format!("encode worker {i}"), e.as_path(), "encode"));
            }
        }
        if let Some(p) = &prefill_bin {
            for i in 0..args.prefill_workers {
                plan.push((format!("prefill worker {i}"), p.as_path(), "prefill"));
            }
        }
        let mode = if disagg { "pd" } else { "agg" };
        for i in 0..args.workers {
            let name = if disagg {
                format!("decode worker {i}")
            } else {
                format!("worker {i}")
            };
            plan.push((name, worker_bin.as_path(), mode));
        }
        let served = Served {
            path: model_path.as_deref(),
            name: &model,
        };
        let worker_args = |mode: &str| worker_args(&args, mode, &served, &security);
        if args.planner {
            // Only the encode workers are started here; the planner starts the rest.
            plan.retain(|(_, _, mode)| *mode == "encode");
        }
        for (i, (name, bin, mode)) in plan.into_iter().enumerate() {
            let device = device_args(&args.devices, i);
            let launch = Launch {
                bin: bin.to_path_buf(),
                args: [worker_args(mode), device.clone()].concat(),
                marker: "TANDEM_WORKER_READY",
            };
            let line = topo.start(&name, launch, OnExit::Restart).await?;
            let on = device
                .last()
                .map(|d| format!(" on {d}"))
                .unwrap_or_default();
            println!(
                "tandem: {name}{on} ready at {} (/health, /metrics: http://{})",
                field(&line, "grpc=").unwrap_or("?"),
                field(&line, "http=").unwrap_or("?")
            );
        }
        if args.planner {
            let workers = PlannedWorkers {
                decode: (worker_bin.as_path(), worker_args(mode)),
                prefill: prefill_bin.as_deref().map(|p| (p, worker_args("prefill"))),
            };
            let launch = start_planner(&args, &root, &workers, &security)?;
            let line = topo.start("planner", launch, OnExit::Restart).await?;
            println!(
                "tandem: planner ready (/metrics: http://{})",
                field(&line, "http=").unwrap_or("?")
            );
        }
        let initial = if args.planner { 1 } else { args.workers };
        let rargs = vec![
            "--http-host".to_string(),
            args.http_host.clone(),
            "--http-port".to_string(),
            args.http_port.to_string(),
            "--router-min-initial-workers".to_string(),
            initial.to_string(),
        ];
        let rargs: Vec<String> = rargs
            .into_iter()
            .chain(security.iter().cloned())
            .chain(args.router_args.iter().cloned())
            .collect();
        let launch = Launch {
            bin: router_bin.clone(),
            args: rargs,
            marker: "TANDEM_ROUTER_READY",
        };
        let line = topo.start("router", launch, OnExit::Stop).await?;
        // The router reports the port it bound (which matters with --http-port 0).
        let bound = field(&line, "http=").context("router READY line without an address")?;
        let port = bound.rsplit(':').next().unwrap_or_default();
        let host = if args.http_host == "0.0.0.0" {
            "127.0.0.1"
        } else {
            args.http_host.as_str()
        };
        let addr = format!("{host}:{port}");
        let deadline = Instant::now() + timeout;
        while http_status(&addr, "/health").await != Some(200) {
            if Instant::now() > deadline {
                bail!(
                    "the router did not see all {} worker(s) within {}s",
                    args.workers,
                    timeout.as_secs()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok::<String, anyhow::Error>(addr)
    }
    .await;
    let addr = match result {
        Ok(a) => a,
        Err(e) => {
            topo.shutdown().await;
            return Err(e);
        }
    };
    println!();
    let shape = if args.planner {
        let roles = match (epd, disagg) {
            (true, _) => format!(
                "{} encode + prefill and decode workers",
                args.encode_workers
            ),
            (false, true) => "prefill and decode workers".to_string(),
            (false, false) => "workers".to_string(),
        };
        format!(
            "{roles} scaled by the planner, 1 to {} per role",
            args.planner_max_replicas
        )
    } else if epd {
        format!(
            "{} encode + {} prefill + {} decode worker(s), embeddings and KV over {}",
            args.encode_workers, args.prefill_workers, args.workers, args.kv_transport
        )
    } else if disagg {
        format!(
            "{} prefill + {} decode worker(s), KV over {}",
            args.prefill_workers, args.workers, args.kv_transport
        )
    } else {
        format!("{} worker(s)", args.workers)
    };
    println!("Tandem is serving `{model}` on http://{addr} ({shape}). Try:");
    println!(
        "  curl -s http://{addr}/v1/chat/completions -H 'Content-Type: application/json' \\\n    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], \"max_tokens\": 16}}'"
    );
    if model == "tandem-tiny-vl" {
        println!(
            "  or with an image (base64 of a PNG, JPEG or WebP file):\n  curl -s http://{addr}/v1/chat/completions -H 'Content-Type: application/json' \\\n    -d '{{\"model\": \"{model}\", \"max_tokens\": 16, \"messages\": [{{\"role\": \"user\", \"content\": [{{\"type\": \"image_url\", \"image_url\": {{\"url\": \"data:image/png;base64,'\"$(base64 -w0 cat.png)\"'\"}}}}, {{\"type\": \"text\", \"text\": \"What is this?\"}}]}}]}}'"
        );
    }
    println!("Press Ctrl-C to stop.");

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let reason = tokio::select! {
        _ = tokio::signal::ctrl_c() => Ok("Ctrl-C".to_string()),
        _ = term.recv() => Ok("SIGTERM".to_string()),
        why = topo.supervise() => Err(why),
    };
    let why = reason.as_ref().unwrap_or_else(|why| why);
    println!("tandem: {why}; stopping the topology");
    topo.shutdown().await;
    // The router's exit is a failure of the topology: say so in the exit status.
    reason.map(|_| ()).map_err(anyhow::Error::msg)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        up: UpArgs,
    }

    /// Per-role flags reach only their role, after the flags every worker gets, so that a
    /// prefill and a decode worker can each take a GPU of their own.
    #[test]
    fn role_flags_reach_their_role_only() {
        let cli = Cli::try_parse_from([
            "tandem",
            "--worker-arg=--device",
            "--worker-arg=cuda",
            "--prefill-arg=--device",
            "--prefill-arg=cuda:0",
            "--decode-arg=--device",
            "--decode-arg=cuda:1",
        ])
        .unwrap();
        let served = Served {
            path: None,
            name: "m",
        };
        let tail = |mode: &str| {
            let a = worker_args(&cli.up, mode, &served, &[]);
            a[a.len().saturating_sub(4)..].to_vec()
        };
        assert_eq!(tail("prefill"), ["--device", "cuda", "--device", "cuda:0"]);
        assert_eq!(tail("decode"), ["--device", "cuda", "--device", "cuda:1"]);
        assert_eq!(tail("agg"), ["--device", "cuda", "--device", "cuda:1"]);
        let encode = worker_args(&cli.up, "encode", &served, &[]);
        assert_eq!(encode[encode.len() - 2..], ["--device", "cuda"]);
    }

    #[test]
    fn devices_go_to_the_workers_in_start_order() {
        let cli = Cli::try_parse_from(["tandem", "--devices", "cuda:0,cuda:1"]).unwrap();
        let d = &cli.up.devices;
        assert_eq!(device_args(d, 0), ["--device", "cuda:0"]);
        assert_eq!(device_args(d, 1), ["--device", "cuda:1"]);
        assert_eq!(device_args(d, 2), ["--device", "cuda:0"]);
        assert!(device_args(&[], 0).is_empty());
        for bad in ["auto", "gpu1", "cuda:x"] {
            let e = Cli::try_parse_from(["tandem", "--devices", bad])
                .err()
                .unwrap();
            assert!(e.to_string().contains("--devices"), "{bad}: {e}");
        }
        assert!(Cli::try_parse_from(["tandem", "--devices", "cpu", "--planner"]).is_err());
    }
}
