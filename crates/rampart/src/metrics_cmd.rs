//! `rampart metrics list`: the metrics the server can emit (name, type, labels, help), the
//! registry the shipped alert rules and dashboards are checked against.

use anyhow::Result;
use std::process::ExitCode;

#[derive(Debug, clap::Args)]
pub struct MetricsArgs {
    #[command(subcommand)]
    pub command: MetricsCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum MetricsCommand {
    /// List every metric the server can emit.
    List {
        /// Print a JSON array of {name, type, labels, help, source}.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(args: MetricsArgs) -> Result<ExitCode> {
    match args.command {
        MetricsCommand::List { json } => {
            let metrics: Vec<_> = server::log_metrics::all_metrics().collect();
            if json {
                println!("{}", serde_json::to_string_pretty(&metrics)?);
            } else {
                for m in metrics {
                    let kind = serde_json::to_value(m.kind)?;
                    println!(
                        "{:<48} {:<9} {}",
                        m.name,
                        kind.as_str().unwrap_or_default(),
                        m.help
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}
