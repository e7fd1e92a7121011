//! `tandem-encode`: the encode worker — runs a multimodal model's vision tower for prefill
//! and aggregated workers and writes image embeddings into their memory (E/P/D). A thin
//! main over the shared worker crate.

use tandem_config::{entry, Role};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tandem_config::entry::init_logging();
    let Some(cfg) = entry::worker_config_or_exit(Role::Encode) else {
        return Ok(());
    };
    tandem_worker::encode::serve::run(cfg).await
}
