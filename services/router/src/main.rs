//! `tandem-router`: the OpenAI-compatible HTTP router. A thin main over the router library.

use tandem_config::entry;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let Some(cfg) = entry::router_config_or_exit() else {
        return Ok(());
    };
    tandem_router::app::run(cfg).await
}
