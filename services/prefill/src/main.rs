//! `tandem-prefill`: the prefill worker — computes prompts and writes their KV blocks into
//! decode workers' memory. A thin main over the shared worker crate.

use tandem_config::{entry, Role};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tandem_config::entry::init_logging();
    let Some(cfg) = entry::worker_config_or_exit(Role::Prefill) else {
        return Ok(());
    };
    tandem_worker::run(cfg).await
}
