//! `rampart serve`: the OpenAI-compatible server on the repository's models.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use server::config::{LogFormat, ServerConfig};

/// Serve the repository's models: LLMs over the OpenAI API, tensor and embedding models over
/// KServe v2 (HTTP, and gRPC on its own port) (docs/api.md, docs/configuration.md).
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// The model repository folder (over the config file's `repo`).
    #[arg(long, env = "RAMPART_REPO", value_name = "DIR")]
    pub repo: Option<PathBuf>,
    /// A configuration file (rampart.toml); every setting has a default.
    #[arg(long, short = 'c', value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Address to listen on (default 127.0.0.1:8080).
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// Address of the KServe v2 gRPC endpoint (default 127.0.0.1:8001).
    #[arg(long, value_name = "ADDR", conflicts_with = "no_grpc")]
    pub grpc_listen: Option<SocketAddr>,
    /// Serve no gRPC endpoint.
    #[arg(long)]
    pub no_grpc: bool,
    /// File of API keys (one per line, optionally `id:key`).
    #[arg(long, value_name = "FILE")]
    pub api_keys: Option<PathBuf>,
    /// Serve without keys on a non-loopback address.
    #[arg(long)]
    pub insecure_no_auth: bool,
    /// Serve HTTPS and gRPC over TLS with this certificate chain (PEM; over `[tls] cert_file`).
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The TLS certificate's private key (PEM; over `[tls] key_file`).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Compute threads (default: physical cores), shared by the models, one forward pass at a time.
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Log format: json (default) or text.
    #[arg(long, value_name = "FORMAT")]
    pub log_format: Option<String>,
    /// Read and validate the configuration (file, environment, flags), print it as the server
    /// would run it, and exit: 0 when valid, 2 otherwise. Binds nothing, loads no model and opens
    /// none of the files it names (keys, certificates).
    #[arg(long)]
    pub check: bool,
}

pub fn run(args: ServeArgs) -> Result<ExitCode> {
    let mut config = ServerConfig::load(args.config.as_deref())?;
    if let Some(repo) = args.repo {
        config.repo = repo;
    }
    if let Some(listen) = args.listen {
        config.listen = listen;
    }
    if let Some(grpc_listen) = args.grpc_listen {
        config.grpc.listen = grpc_listen;
        config.grpc.enabled = true;
    }
    if args.no_grpc {
        config.grpc.enabled = false;
    }
    if let Some(keys) = args.api_keys {
        config.api_keys_file = Some(keys);
    }
    if args.insecure_no_auth {
        config.insecure_no_auth = true;
    }
    if let (Some(cert), Some(key)) = (args.tls_cert, args.tls_key) {
        config.tls.cert_file = Some(cert);
        config.tls.key_file = Some(key);
    }
    if let Some(threads) = args.threads {
        config.threads = Some(threads);
    }
    if let Some(format) = args.log_format {
        config.log.format = match format.as_str() {
            "json" => LogFormat::Json,
            "text" => LogFormat::Text,
            other => anyhow::bail!("--log-format {other:?}: json or text"),
        };
    }
    if args.check {
        return Ok(match config.validate() {
            Ok(()) => {
                println!(
                    "configuration ok: listen {}, repository {}, {} model{} listed, gRPC {}, fleet {}",
                    config.listen,
                    config.repo.display(),
                    config.models.len(),
                    if config.models.len() == 1 { "" } else { "s" },
                    if config.grpc.enabled { "on" } else { "off" },
                    if config.in_fleet() { "on" } else { "off" },
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(2)
            }
        });
    }
    let replica = config.in_fleet().then(|| config.fleet.replica_id());
    server::log_metrics::init_logging(&config.log, replica.as_deref())
        .map_err(anyhow::Error::msg)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("rampart-http")
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(server::serve(config))?;
    // Engines hold OS threads; leave without waiting for stray blocking tasks.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    Ok(ExitCode::SUCCESS)
}
