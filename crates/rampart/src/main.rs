//! `rampart`: the command line. Parses arguments and calls the libraries; no logic of its own
//! beyond presenting results.

mod audit_cmd;
mod bench_cmd;
mod doctor_cmd;
mod engine_args;
mod explain_cmd;
mod feedback_cmd;
mod fleet_cmd;
mod generate_cmd;
mod guard_cmd;
mod maturity_cmd;
mod metrics_cmd;
mod model_cmd;
mod model_transfer;
mod monitor_cmd;
mod progress_bar;
mod quantize_cmd;
mod release_cmd;
mod render;
mod serve_cmd;
mod tensor_bench;
mod tokenize_cmd;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The build's identity, recorded in model lineage and printed by `--version`.
pub fn build_info() -> repo::BuildInfo {
    repo::BuildInfo {
        version: env!("CARGO_PKG_VERSION").to_string(),
        git_commit: option_env!("RAMPART_GIT_COMMIT").map(str::to_string),
        rustc: option_env!("RAMPART_RUSTC_VERSION").map(str::to_string),
    }
}

/// The host's hardware fingerprint as a version's lineage keeps it.
pub fn host_fingerprint() -> Option<serde_json::Value> {
    serde_json::to_value(host::fingerprint(&host::Context::default())).ok()
}

fn long_version() -> &'static str {
    let info = build_info();
    let text = format!(
        "{} (commit {}, {})",
        info.version,
        info.git_commit.as_deref().unwrap_or("unknown"),
        info.rustc.as_deref().unwrap_or("rustc unknown")
    );
    Box::leak(text.into_boxed_str())
}

/// Rampart: a self-hosted, governed AI model server.
///
/// Models live in a repository folder of immutable, digest-checked versions. Start with
/// `rampart model import`, then `rampart model list`.
#[derive(Debug, Parser)]
#[command(name = "rampart", version, long_version = long_version())]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Manage the model repository: import, list, inspect, verify, diff, promote, maturity,
    /// remove.
    Model(ModelArgs),
    /// Generate text with an LLM (streams to the terminal).
    Generate(generate_cmd::GenerateArgs),
    /// A language model's token ids for a text or a chat message (as `POST /tokenize`).
    Tokenize(tokenize_cmd::TokenizeArgs),
    /// Serve the repository's models: the OpenAI-compatible HTTP API, KServe v2 over HTTP and gRPC.
    Serve(serve_cmd::ServeArgs),
    /// Measure engine throughput and model perplexity.
    #[command(subcommand)]
    Bench(bench_cmd::BenchCommand),
    /// Read, verify and prove the WORM audit log (local directory or S3).
    Audit(audit_cmd::AuditArgs),
    /// Judge texts with the input guard, and measure it on a labelled set.
    Guard(guard_cmd::GuardArgs),
    /// Attention exports: replay one from its audit entry and compare digests.
    Explain(explain_cmd::ExplainArgs),
    /// Check the host and Rampart's settings for serving (exit 0 ok, 1 warnings, 2 errors);
    /// print the fixes or the hardware fingerprint.
    Doctor(doctor_cmd::DoctorArgs),
    /// List the metrics the server can emit (`--json` for the rule and dashboard checks).
    Metrics(metrics_cmd::MetricsArgs),
    /// The monitors' baselines: make one from a reference set, offline.
    Monitor(monitor_cmd::MonitorArgs),
    /// Releases: start, watch, approve, promote, pause, resume or roll back a model's canary or
    /// A/B release (on a running server with --url, else on the plan file).
    Release(release_cmd::ReleaseArgs),
    /// The feedback store: per-class error rates, and datasets of corrected examples for
    /// fine-tuning (chat JSONL, preference pairs, CSV, Parquet).
    Feedback(feedback_cmd::FeedbackArgs),
    /// A fleet of replicas sharing their releases: the replicas, the judge, the pooled
    /// statistics (`status`, against a replica or the load balancer).
    Fleet(fleet_cmd::FleetArgs),
}

#[derive(Debug, clap::Args)]
pub struct ModelArgs {
    /// The model repository folder.
    #[arg(
        long,
        global = true,
        env = "RAMPART_REPO",
        default_value = "models",
        value_name = "DIR"
    )]
    pub repo: PathBuf,
    #[command(subcommand)]
    pub command: model_cmd::ModelCommand,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Model(args) => model_cmd::run(args),
        Command::Generate(args) => generate_cmd::run(args),
        Command::Tokenize(args) => tokenize_cmd::run(args),
        Command::Serve(args) => serve_cmd::run(args),
        Command::Bench(command) => bench_cmd::run(command),
        Command::Audit(args) => audit_cmd::run(args),
        Command::Guard(args) => guard_cmd::run(args),
        Command::Explain(args) => explain_cmd::run(args),
        Command::Doctor(args) => doctor_cmd::run(args),
        Command::Metrics(args) => metrics_cmd::run(args),
        Command::Monitor(args) => monitor_cmd::run(args),
        Command::Release(args) => release_cmd::run(args),
        Command::Feedback(args) => feedback_cmd::run(args),
        Command::Fleet(args) => fleet_cmd::run(args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        super::Cli::command().debug_assert();
    }
}
