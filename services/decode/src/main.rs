//! `tandem-decode`: the decode worker (also aggregated with `--disaggregation-mode agg|pd`).
//! A thin main over the shared worker crate.

use tandem_config::{entry, DisaggregationMode, Role};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tandem_config::entry::init_logging();
    let Some(cfg) = entry::worker_config_or_exit(Role::Decode) else {
        return Ok(());
    };
    if cfg.disaggregation.disaggregation_mode == DisaggregationMode::Decode {
        // A decode-only worker needs prefill workers pushing KV into it; that handoff is not
        // built yet, so refuse rather than serve something else.
        eprintln!(
            "tandem-decode: --disaggregation-mode decode needs the prefill→decode KV handoff, which is \
             not implemented yet; run with --disaggregation-mode agg (aggregated serving)"
        );
        std::process::exit(2);
    }
    tandem_worker::run(cfg).await
}
