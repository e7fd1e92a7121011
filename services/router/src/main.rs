//! `tandem-router`: the OpenAI-compatible HTTP router. A thin main over the shared crates.

use tandem_config::entry;

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let Some(cfg) = entry::router_config_or_exit() else {
        return;
    };
    eprintln!(
        "tandem-router: configuration is valid (would listen on {}:{}), but the HTTP API is not \
         implemented yet: it lands with the serving issue",
        cfg.http_host, cfg.http_port
    );
    std::process::exit(1);
}
