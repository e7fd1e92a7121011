//! `tandem`: the local launcher and utility command (`tandem up`, `tandem model tiny`,
//! `tandem model tiny-vl`).

mod supervise;
mod up;

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "tandem", version, about = "Tandem LLM serving")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start a local topology (router + workers) on this machine.
    Up(Box<up::UpArgs>),
    /// Make a deployment's mutual-TLS folder for the internal channels (ca.crt, node.crt,
    /// node.key), unless OUT already holds one. Give the same folder to every process of the
    /// deployment with --internal-tls-dir; the CA's key is not kept, so no one can add
    /// certificates to it later.
    Certs {
        /// Folder to write (created if absent).
        #[arg(long)]
        out: PathBuf,
        /// Extra DNS name or IP address for the node certificate (repeat), for clients that
        /// check a host name of their own, such as etcd's and NATS's.
        #[arg(long = "host")]
        hosts: Vec<String>,
    },
    /// Model tools.
    Model {
        #[command(subcommand)]
        command: ModelCommand,
    },
}

#[derive(Subcommand)]
enum ModelCommand {
    /// Write the built-in tiny Qwen3-architecture model (deterministic weights, the real Qwen3
    /// tokenizer) into OUT_DIR, or with --family the tiny model of another family.
    Tiny {
        /// Folder to write (created if absent).
        out_dir: PathBuf,
        /// qwen3, qwen2, llama3 or mistral.
        #[arg(long, default_value = "qwen3")]
        family: String,
    },
    /// Write the built-in tiny LLaVA model (a random CLIP vision tower, projector and tiny
    /// Llama in llava-hf's layout; the Qwen3 tokenizer with an `<image>` token) into OUT_DIR.
    TinyVl {
        /// Folder to write (created if absent).
        out_dir: PathBuf,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tandem_config::entry::init_logging();
    let cli = Cli::parse();
    match cli.command {
        Command::Up(args) => up::run(*args).await?,
        Command::Certs { out, hosts } => {
            let done = tandem_pki::generate(&out, &hosts)
                .with_context(|| format!("making the TLS folder {}", out.display()))?;
            match done {
                tandem_pki::Generated::Created => {
                    println!(
                        "deployment CA and node certificate written to {}",
                        out.display()
                    )
                }
                tandem_pki::Generated::Existing => {
                    println!(
                        "{} already holds a TLS folder; left as it is",
                        out.display()
                    )
                }
            }
        }
        Command::Model {
            command: ModelCommand::Tiny { out_dir, family },
        } => {
            let f = tandem_tiny_model::family_by_name(&family).with_context(|| {
                format!("unknown family {family:?} (qwen3, qwen2, llama3, mistral)")
            })?;
            tandem_tiny_model::write_family_model(f, &out_dir, true)
                .with_context(|| format!("writing the tiny model to {}", out_dir.display()))?;
            println!("tiny model written to {}", out_dir.display());
        }
        Command::Model {
            command: ModelCommand::TinyVl { out_dir },
        } => {
            tandem_tiny_model::write_tiny_vl_model(&out_dir).with_context(|| {
                format!("writing the tiny LLaVA model to {}", out_dir.display())
            })?;
            println!("tiny LLaVA model written to {}", out_dir.display());
        }
    }
    Ok(())
}
