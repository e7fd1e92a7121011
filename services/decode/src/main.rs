//! `tandem-decode`: the decode worker — `--disaggregation-mode decode` (KV from prefill
//! workers), `pd` (may also prefill itself: conditional disaggregation) or `agg`.
//! A thin main over the shared worker crate.

use tandem_config::{entry, Role};

/// mimalloc: the engine thread allocates per sequence per step (outputs, detokenized text,
/// step plans), and glibc's malloc spent a fifth of its time consolidating small freed
/// chunks before each larger allocation (docs/benchmarks.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tandem_config::entry::init_logging();
    let Some(cfg) = entry::worker_config_or_exit(Role::Decode) else {
        return Ok(());
    };
    tandem_worker::run(cfg).await
}
