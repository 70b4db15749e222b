//! `rampart monitor …`: the monitors' baselines outside the server. `baseline` runs a reference
//! set through the model as `rampart serve` would (same configuration, in process) and keeps
//! the features' baseline where the server reads it (docs/monitoring.md).

use std::path::PathBuf;
use std::process::ExitCode;
use std::str::FromStr;

use anyhow::{bail, Context, Result};
use monitor::Baseline;
use repo::{ModelRef, Repository};
use serde::Serialize;
use server::baseline::{self, AskOptions};
use server::config::{ModelConfig, ServerConfig};

use crate::render;

#[derive(Debug, clap::Args)]
pub struct MonitorArgs {
    #[command(subcommand)]
    pub command: MonitorCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum MonitorCommand {
    /// Make a model version's baseline from a reference set: the inputs go through the served
    /// pipeline in process (guard, decoding, the model), and the features the monitors watch
    /// are kept beside the version, where `rampart serve` reads them at start.
    Baseline(BaselineArgs),
}

#[derive(Debug, clap::Args)]
pub struct BaselineArgs {
    /// The model: `NAME` (the version the configuration serves, else the stable one) or
    /// `NAME@VERSION`.
    pub model: String,
    /// The reference set: a folder (images; .txt/.md texts, one input each; .jsonl files, one
    /// input per line; .json request bodies) or one file (an image, a .jsonl file, or a text
    /// file with one input per line).
    #[arg(long, value_name = "DIR|FILE")]
    pub inputs: PathBuf,
    /// A configuration file (rampart.toml): the model's `[[models]]` settings, `[guard]`,
    /// `[monitor]` (the mode to calibrate for, where baselines are kept), limits.
    #[arg(long, short = 'c', value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The model repository folder (over the config file's `repo`).
    #[arg(long, env = "RAMPART_REPO", value_name = "DIR")]
    pub repo: Option<PathBuf>,
    /// Write the baseline here instead (for `PUT /admin/monitors/…/baseline` to a running
    /// server, or to carry with a release).
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Replace a baseline the version already has.
    #[arg(long)]
    pub force: bool,
    /// LLMs: tokens generated per input (the output monitors watch the generation's entropy;
    /// use what the service's clients ask for).
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u32,
    /// LLMs: sampling temperature for inputs that set none (default: the server's).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// Compute threads of the model (default: physical cores).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: MonitorArgs) -> Result<ExitCode> {
    match args.command {
        MonitorCommand::Baseline(args) => baseline(args),
    }
}

/// One feature of the baseline, summarised.
#[derive(Debug, Serialize)]
struct FeatureSummary {
    feature: String,
    kind: &'static str,
    values: usize,
    mean: Option<f64>,
    std: Option<f64>,
    categories: Option<std::collections::BTreeMap<String, u64>>,
}

#[derive(Debug, Serialize)]
struct Report<'a> {
    model: &'a str,
    version: &'a str,
    path: String,
    source: &'a str,
    inputs: usize,
    skipped_files: usize,
    answered: usize,
    observations: u64,
    failures: &'a [baseline::Failure],
    seconds: f64,
    calibration: Option<&'a monitor::Calibration>,
    features: Vec<FeatureSummary>,
}

fn baseline(args: BaselineArgs) -> Result<ExitCode> {
    let mut config = ServerConfig::load(args.config.as_deref())?;
    if let Some(repo) = args.repo {
        config.repo = repo;
    }
    if let Some(threads) = args.threads {
        config.threads = Some(threads);
    }
    let wanted = ModelRef::from_str(&args.model)?;
    let name = wanted.name.clone();
    // The configuration's entry for the model (or one with every default), pinned to the
    // version asked for.
    let mut entry = config
        .models
        .iter()
        .find(|m| m.name == name)
        .cloned()
        .unwrap_or_else(|| ModelConfig::named(&name));
    if let Some(v) = &wanted.version {
        entry.version = Some(v.to_string());
    }
    let repository = Repository::open(&config.repo);
    let kind = server::loading::model_kind(&repository, &entry).map_err(anyhow::Error::msg)?;
    config.models = vec![entry];
    let ask = AskOptions {
        max_tokens: args.max_tokens,
        temperature: args.temperature,
    };
    // The requests name the version asked for: by its name alone the model serves its stable
    // version (or its release plan's), which may be another one.
    let target = match &wanted.version {
        Some(v) => format!("{name}@{v}"),
        None => name.clone(),
    };
    let (requests, skipped) = baseline::reference_requests(kind, &target, &args.inputs, &ask)?;
    let source = format!(
        "reference set {} ({} inputs)",
        args.inputs.display(),
        requests.len()
    );
    let monitor_cfg = config.monitor.clone();
    let repo_dir = config.repo.clone();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("rampart-reference")
        .build()
        .context("starting the async runtime")?;
    if !args.json {
        eprintln!(
            "running {} reference inputs through {name} ({kind})…",
            requests.len()
        );
    }
    let run = runtime.block_on(baseline::run(
        config,
        &name,
        requests,
        args.concurrency,
        source,
    ));
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    let run = run?;
    let path = match &args.out {
        Some(p) => p.clone(),
        None => server::monitors::baseline_path(&monitor_cfg, &repo_dir, &name, &run.version)?,
    };
    if args.out.is_none() && path.exists() && !args.force {
        bail!(
            "{} already holds {name}@{}'s baseline: --force replaces it (a running server keeps \
             the one it read until it restarts; --out FILE and PUT /admin/monitors/{name}/versions/{}/baseline \
             replace it there)",
            path.display(),
            run.version,
            run.version
        );
    }
    let mut baseline = run.baseline.clone();
    if monitor_cfg.drift.mode == monitor::Mode::Calibrated {
        if !args.json {
            eprintln!(
                "calibrating the threshold for a run length of {} requests…",
                monitor_cfg.drift.run_length
            );
        }
        let seed = baseline.created_ms ^ 0x9E37_79B9;
        baseline.calibration = Some(monitor::calibrate(&baseline, &monitor_cfg.drift, seed));
    }
    server::monitors::write_baseline(&path, &baseline).map_err(anyhow::Error::msg)?;
    let report = Report {
        model: &name,
        version: &run.version,
        path: path.display().to_string(),
        source: &baseline.source,
        inputs: run.inputs,
        skipped_files: skipped,
        answered: run.answered,
        observations: run.observations,
        failures: &run.failures,
        seconds: run.seconds,
        calibration: baseline.calibration.as_ref(),
        features: summarise(&baseline),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report);
    }
    Ok(ExitCode::SUCCESS)
}

fn summarise(b: &Baseline) -> Vec<FeatureSummary> {
    let refs = b.references();
    let numeric = b.columns.iter().zip(&refs).map(|(c, r)| FeatureSummary {
        feature: c.clone(),
        kind: "numeric",
        values: r.sorted.len(),
        mean: Some(r.mean),
        std: Some(r.std),
        categories: None,
    });
    let categorical = b.categorical.iter().map(|(c, counts)| FeatureSummary {
        feature: c.clone(),
        kind: "categorical",
        values: counts.values().sum::<u64>() as usize,
        mean: None,
        std: None,
        categories: Some(counts.clone()),
    });
    numeric.chain(categorical).collect()
}

fn print_report(r: &Report) {
    let mut s = render::Section::new(format!("{}@{}: baseline kept", r.model, r.version));
    s.row("file", r.path.clone())
        .row("source", r.source.to_string())
        .row(
            "inputs",
            format!(
                "{} ({} answered, {} failed{})",
                r.inputs,
                r.answered,
                r.failures.len(),
                if r.skipped_files > 0 {
                    format!("; {} files of other types skipped", r.skipped_files)
                } else {
                    String::new()
                }
            ),
        )
        .row("observations", r.observations.to_string())
        .row("time", format!("{:.1} s", r.seconds));
    if let Some(c) = r.calibration {
        s.row(
            "calibration",
            format!(
                "largest KS statistic > {:.4} (run length {} requests, simulated {:.0} over {} \
                 observations)",
                c.threshold, c.run_length, c.estimated_run_length, c.simulated_observations
            ),
        );
    }
    print!("{}", s.render());
    let rows: Vec<Vec<String>> = r
        .features
        .iter()
        .map(|f| {
            let summary = match (&f.categories, f.mean, f.std) {
                (Some(c), _, _) => c
                    .iter()
                    .map(|(k, n)| format!("{k}: {n}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                (None, Some(m), Some(s)) => format!("{m:.4} ± {s:.4}"),
                _ => String::new(),
            };
            vec![f.feature.clone(), f.values.to_string(), summary]
        })
        .collect();
    println!();
    print!(
        "{}",
        render::table(&["feature", "values", "mean ± std / counts"], &rows)
    );
    for f in r.failures.iter().take(5) {
        println!("failed: {} ({}): {}", f.origin, f.status, f.error);
    }
    if r.failures.len() > 5 {
        println!("… and {} more failures", r.failures.len() - 5);
    }
}
