//! `tandem-encode`: the encode worker. A thin main over the shared crates.

use tandem_config::{entry, Role};

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let Some(cfg) = entry::worker_config_or_exit(Role::Encode) else {
        return;
    };
    eprintln!(
        "tandem-encode: configuration is valid ({} mode, endpoint {}), but encode workers are not \
         implemented yet: multimodal (encode) serving is not built",
        cfg.disaggregation.disaggregation_mode.name(),
        cfg.endpoint()
    );
    std::process::exit(1);
}
