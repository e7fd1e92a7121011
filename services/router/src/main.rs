//! `tandem-router`: the OpenAI-compatible HTTP router. A thin main over the router library.

use tandem_config::entry;

/// mimalloc: the router allocates per request and per token (tokenizing, JSON); malloc and
/// free were about a third of its CPU in a profile of text prompts (docs/benchmarks.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tandem_config::entry::init_logging();
    let Some(cfg) = entry::router_config_or_exit() else {
        return Ok(());
    };
    tandem_router::app::run(cfg).await
}
