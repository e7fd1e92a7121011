//! `tandem-router`: the OpenAI-compatible HTTP router. A thin main over the router library.

use tandem_config::entry;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tandem_config::entry::init_logging();
    let Some(cfg) = entry::router_config_or_exit() else {
        return Ok(());
    };
    tandem_router::app::run(cfg).await
}
