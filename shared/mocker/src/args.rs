//! Mocker-only flags (Dynamo's mocker names), split from the worker flags that the shared
//! config crate parses: everything not listed here goes to the worker parser unchanged.

use std::path::PathBuf;

use clap::Parser;

/// Flags of `tandem-mocker` on top of every `tandem-decode` flag.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "tandem-mocker",
    about = "The Tandem engine with a simulated backend. Also takes every tandem-decode flag \
             (discovery, ports, model, --kv-block-size, ...)."
)]
pub struct MockerArgs {
    /// Simulated workers in this process, each with its own instance id, gRPC and status port
    /// (a non-zero --rpc-port / --system-port is the first of N consecutive ports).
    #[arg(long, default_value_t = 1)]
    pub num_workers: usize,
    /// Divides every simulated step time.
    #[arg(long, default_value_t = 1.0)]
    pub speedup_ratio: f64,
    /// Further divides decode time.
    #[arg(long, default_value_t = 1.0)]
    pub decode_speedup_ratio: f64,
    /// JSON profile `{"prefill": [[tokens, ms]...], "decode": [[kv_usage, ms]...]}` instead of
    /// the polynomial model.
    #[arg(long)]
    pub planner_profile_data: Option<PathBuf>,
    /// KV blocks per simulated worker.
    #[arg(long, default_value_t = 16384)]
    pub num_gpu_blocks_override: usize,
    /// Tokens per KV block (overrides --kv-block-size).
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Sequences per step (overrides --max-batch-size).
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// New tokens per step (overrides --max-num-tokens).
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// Prefix caching (KV block reuse); `--no-enable-prefix-caching` turns it off.
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// Vocabulary that simulated tokens are drawn from (default: the model's).
    #[arg(long)]
    pub vocab_size: Option<usize>,
    /// Longest sequence (default 131072: simulated workers are not bounded by the model's).
    #[arg(long, default_value_t = 131072)]
    pub max_model_len: usize,
    /// Offline: replay this Mooncake trace (JSONL) on a virtual clock through --num-workers
    /// simulated engines and an in-process router, print a JSON report and exit. No sockets.
    #[arg(long)]
    pub replay: Option<PathBuf>,
    /// Router of the offline replay.
    #[arg(long, value_enum, default_value_t = crate::replay::ReplayRouter::Kv)]
    pub replay_router: crate::replay::ReplayRouter,
    /// Tokens per hash id in the trace (512 for the public Mooncake traces).
    #[arg(long, default_value_t = 512)]
    pub trace_block_size: usize,
    /// Replay only: prefill workers of a disaggregated fleet (then --num-workers counts the
    /// decode workers); 0 replays an aggregated fleet.
    #[arg(long, default_value_t = 0)]
    pub num_prefill_workers: usize,
    /// Simulated KV transfer bandwidth prefill → decode, GB/s (1e9 bytes/s), as Dynamo's
    /// mocker. Live (`--disaggregation-mode prefill`): each prefill worker has one link at
    /// this rate, divided by --speedup-ratio's inverse (the link is --speedup-ratio times
    /// faster, like the steps), shared FIFO by its concurrent writes; no bytes move.
    #[arg(long, default_value_t = 64.0)]
    pub kv_transfer_bandwidth: f64,
    /// KV bytes per token on the simulated wire (all layers, K+V). Replay default: Qwen3-0.6B
    /// in bf16 (28 layers × 8 KV heads × 128 dims × 2 × 2 = 114688). Live default: the served
    /// model's own KV layout (the tiny model's is small; pass e.g. 114688 to simulate
    /// Qwen3-0.6B-sized transfers).
    #[arg(long)]
    pub kv_bytes_per_token: Option<usize>,
    /// Replay only: goodput SLA on TTFT (virtual ms).
    #[arg(long)]
    pub sla_ttft_ms: Option<f64>,
    /// Replay only: goodput SLA on ITL (virtual ms).
    #[arg(long)]
    pub sla_itl_ms: Option<f64>,
    /// Also write the replay report to this file.
    #[arg(long)]
    pub replay_out: Option<PathBuf>,
}

/// Flags above and whether each takes a value.
const FLAGS: &[(&str, bool)] = &[
    ("--num-workers", true),
    ("--speedup-ratio", true),
    ("--decode-speedup-ratio", true),
    ("--planner-profile-data", true),
    ("--num-gpu-blocks-override", true),
    ("--block-size", true),
    ("--max-num-seqs", true),
    ("--max-num-batched-tokens", true),
    ("--enable-prefix-caching", false),
    ("--no-enable-prefix-caching", false),
    ("--vocab-size", true),
    ("--max-model-len", true),
    ("--replay", true),
    ("--replay-router", true),
    ("--trace-block-size", true),
    ("--replay-out", true),
    ("--num-prefill-workers", true),
    ("--kv-transfer-bandwidth", true),
    ("--kv-bytes-per-token", true),
    ("--sla-ttft-ms", true),
    ("--sla-itl-ms", true),
];

/// Splits `args` (with the program name first) into (mocker args, worker args), each keeping
/// the program name. `--help` goes to the mocker parser. The worker args get
/// `--disaggregation-mode agg` unless they name a mode: the worker parser's default role is
/// decode, and simulated workers are aggregated unless asked otherwise.
pub fn split(args: &[String]) -> (Vec<String>, Vec<String>) {
    let prog = args
        .first()
        .cloned()
        .unwrap_or_else(|| "tandem-mocker".into());
    let mut mine = vec![prog.clone()];
    let mut rest = vec![prog];
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        let name = a.split('=').next().unwrap_or(a);
        match FLAGS.iter().find(|(f, _)| *f == name) {
            Some((_, takes_value)) => {
                mine.push(a.clone());
                if *takes_value && !a.contains('=') {
                    if let Some(v) = it.next() {
                        mine.push(v.clone());
                    }
                }
            }
            None if a == "--help" || a == "-h" => mine.push(a.clone()),
            None => rest.push(a.clone()),
        }
    }
    if !rest.iter().any(|a| a.starts_with("--disaggregation-mode")) {
        rest.splice(
            1..1,
            ["--disaggregation-mode".to_string(), "agg".to_string()],
        );
    }
    (mine, rest)
}

impl MockerArgs {
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [
            ("--num-workers", Some(self.num_workers)),
            (
                "--num-gpu-blocks-override",
                Some(self.num_gpu_blocks_override),
            ),
            ("--block-size", self.block_size),
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--vocab-size", self.vocab_size),
            ("--max-model-len", Some(self.max_model_len)),
            ("--trace-block-size", Some(self.trace_block_size)),
            ("--kv-bytes-per-token", self.kv_bytes_per_token),
        ] {
            if v == Some(0) {
                return Err(format!("{name} must be > 0"));
            }
        }
        if !(self.kv_transfer_bandwidth.is_finite() && self.kv_transfer_bandwidth > 0.0) {
            return Err(format!(
                "--kv-transfer-bandwidth must be > 0 GB/s (got {})",
                self.kv_transfer_bandwidth
            ));
        }
        Ok(())
    }

    /// The live simulated link's rate in bytes per second: `--kv-transfer-bandwidth` GB/s,
    /// times `--speedup-ratio` (simulated time runs that much faster everywhere).
    pub fn live_link_bytes_per_sec(&self) -> f64 {
        self.kv_transfer_bandwidth * 1e9 * self.speedup_ratio
    }

    pub fn prefix_caching(&self) -> bool {
        !self.no_enable_prefix_caching
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn split_keeps_worker_flags_apart() {
        let (m, w) = split(&s(&[
            "mocker",
            "--num-workers",
            "3",
            "--discovery-backend",
            "file",
            "--speedup-ratio=5",
            "--no-enable-prefix-caching",
            "--rpc-port",
            "0",
        ]));
        assert_eq!(
            m,
            s(&[
                "mocker",
                "--num-workers",
                "3",
                "--speedup-ratio=5",
                "--no-enable-prefix-caching"
            ])
        );
        assert_eq!(
            w,
            s(&[
                "mocker",
                "--disaggregation-mode",
                "agg",
                "--discovery-backend",
                "file",
                "--rpc-port",
                "0"
            ])
        );
        let (_, w) = split(&s(&["m", "--disaggregation-mode=decode"]));
        assert_eq!(w, s(&["m", "--disaggregation-mode=decode"]));
        let a = MockerArgs::try_parse_from(&m).unwrap();
        assert_eq!(a.num_workers, 3);
        assert!(!a.prefix_caching());
        assert!(a.validate().is_ok());
    }

    #[test]
    fn bad_values_are_clear_errors() {
        let e = MockerArgs::try_parse_from(s(&["m", "--num-workers", "x"])).unwrap_err();
        assert!(e.to_string().contains("--num-workers"));
        let a = MockerArgs::try_parse_from(s(&["m", "--num-workers", "0"])).unwrap();
        assert_eq!(a.validate().unwrap_err(), "--num-workers must be > 0");
    }
}
