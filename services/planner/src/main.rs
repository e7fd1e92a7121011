//! `tandem-planner`: scales the prefill, decode and aggregated workers to the load and the
//! latency targets (a thin main over the planner library and its interval loop), and
//! `tandem-planner profile` measures a worker for the time models.

mod daemon;
mod profile_cmd;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tandem_config::entry::init_logging();
    if std::env::args().nth(1).as_deref() == Some("profile") {
        return profile_cmd::run(std::env::args().skip(1)).await;
    }
    let Some(cfg) = tandem_config::entry::planner_config_or_exit() else {
        return Ok(());
    };
    daemon::run(cfg).await
}
