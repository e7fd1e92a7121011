//! `tandem-decode`: the decode worker — `--disaggregation-mode decode` (KV from prefill
//! workers), `pd` (may also prefill itself: conditional disaggregation) or `agg`.
//! A thin main over the shared worker crate.

use tandem_config::{entry, Role};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tandem_config::entry::init_logging();
    let Some(cfg) = entry::worker_config_or_exit(Role::Decode) else {
        return Ok(());
    };
    tandem_worker::run(cfg).await
}
