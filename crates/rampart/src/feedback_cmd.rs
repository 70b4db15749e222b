//! `rampart feedback …`: the feedback store read offline (beside a running server: the store is
//! opened read-only): per-class quality and dataset exports.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use feedback::export::{self, Format};
use feedback::store::{Filter, Store};

#[derive(Debug, clap::Args)]
pub struct FeedbackArgs {
    /// The server's feedback directory (`[feedback] dir`; the store is `feedback.db` there).
    #[arg(
        long,
        global = true,
        env = "RAMPART_FEEDBACK_DIR",
        default_value = "feedback",
        value_name = "DIR"
    )]
    pub dir: PathBuf,
    /// Read the servers' shared PostgreSQL store instead (`postgresql://user:password@host/db`).
    #[arg(
        long,
        global = true,
        env = "RAMPART_FEEDBACK_POSTGRES_URL",
        value_name = "URL"
    )]
    pub postgres: Option<String>,
    /// Print JSON.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: FeedbackCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum FeedbackCommand {
    /// Write a dataset of corrected examples with their original inputs (and a manifest beside
    /// it naming the dataset version).
    Export {
        /// The model whose feedback to export.
        #[arg(long)]
        model: String,
        /// Only this version's responses.
        #[arg(long)]
        version: Option<String>,
        /// Only the responses the model gave this class.
        #[arg(long)]
        class: Option<String>,
        /// Feedback from this time on: ms since the epoch, RFC 3339, or an age (`24h`, `7d`).
        #[arg(long)]
        since: Option<String>,
        /// Feedback before this time (same forms).
        #[arg(long)]
        until: Option<String>,
        /// openai-chat-jsonl, preference-jsonl, csv or parquet.
        #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(Format::NAMES))]
        format: String,
        /// The file to write (its manifest goes to FILE.manifest.json).
        #[arg(long, short)]
        out: PathBuf,
        /// Replace e-mail addresses, phone and card numbers, IBANs and IP addresses.
        #[arg(long)]
        scrub_pii: bool,
        /// Chat JSONL: also answers rated helpful, as they were.
        #[arg(long)]
        include_helpful: bool,
    },
    /// Close the loop: export the corrected examples, run the team's training command on them,
    /// import its output as a new version (its lineage names the dataset), and release it as
    /// an A/B test whose first step is 20 % and whose judge watches the helpful rate.
    Retrain {
        /// The model to retrain.
        #[arg(long)]
        model: String,
        /// The training command, run by `sh -c` with RAMPART_DATASET (the file),
        /// RAMPART_DATASET_VERSION, RAMPART_DATASET_FORMAT, RAMPART_MODEL, RAMPART_BASE_VERSION,
        /// RAMPART_BASE_DIR (the stable version's folder) and RAMPART_OUTPUT (an empty folder:
        /// the trained model goes there, as `rampart model import` takes it).
        #[arg(long, value_name = "COMMAND")]
        train: String,
        /// Only the answers the model gave this class.
        #[arg(long)]
        class: Option<String>,
        /// Feedback from this time on (ms, RFC 3339, or an age: 7d).
        #[arg(long)]
        since: Option<String>,
        /// The dataset's format.
        #[arg(long, default_value = "openai-chat-jsonl", value_parser = clap::builder::PossibleValuesParser::new(Format::NAMES))]
        format: String,
        #[arg(long)]
        scrub_pii: bool,
        #[arg(long)]
        include_helpful: bool,
        /// The new version (default: the next minor version after the newest).
        #[arg(long)]
        version: Option<String>,
        /// The model repository.
        #[arg(
            long,
            env = "RAMPART_REPO",
            default_value = "models",
            value_name = "DIR"
        )]
        repo: PathBuf,
        /// A running server to release on (admin key in --key); without it the release is
        /// written into the plan file, which the servers adopt at their next tick.
        #[arg(long, env = "RAMPART_URL", value_name = "URL")]
        url: Option<String>,
        #[arg(
            long,
            env = "RAMPART_API_KEY",
            value_name = "KEY",
            hide_env_values = true
        )]
        key: Option<String>,
        /// The first step's share of users, in percent.
        #[arg(long, default_value_t = 20.0)]
        first_step: f64,
        /// The judge's bound on the drop of the helpful rate, in points.
        #[arg(long, default_value_t = 5.0)]
        helpful_rate_points: f64,
    },
    /// Per-class error rates (Wilson 95 % bounds) and helpful rates over a window.
    Classes {
        #[arg(long)]
        model: Option<String>,
        /// The window (`1h`, `7d`).
        #[arg(long, default_value = "1h")]
        window: String,
        /// Feedback rows a class needs before its rate is judged.
        #[arg(long, default_value_t = 20)]
        min_samples: u64,
    },
}

/// ms since the epoch, RFC 3339, or an age before now.
fn time(text: &Option<String>) -> anyhow::Result<Option<u64>> {
    let Some(t) = text.as_deref() else {
        return Ok(None);
    };
    if let Ok(ms) = t.parse::<u64>() {
        return Ok(Some(ms));
    }
    if let Some(at) = audit::s3::parse_rfc3339(t)
        .ok()
        .and_then(|s| s.duration_since(std::time::UNIX_EPOCH).ok())
    {
        return Ok(Some(at.as_millis() as u64));
    }
    let age = age(t).with_context(|| {
        format!("{t:?} is neither ms since the epoch, an RFC 3339 time nor an age (24h, 7d)")
    })?;
    Ok(Some(
        feedback::now_ms().saturating_sub(age.as_millis() as u64),
    ))
}

/// `90s`, `30m`, `24h`, `7d`.
fn age(t: &str) -> Option<Duration> {
    let (n, unit) = t.split_at(t.find(|c: char| !c.is_ascii_digit())?);
    let n: u64 = n.parse().ok()?;
    let s = match unit {
        "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        "d" => n * 86_400,
        _ => return None,
    };
    Some(Duration::from_secs(s))
}

/// `rampart feedback retrain`.
struct Retrain<'a> {
    store: &'a Store,
    dir: &'a std::path::Path,
    json: bool,
}

impl Retrain<'_> {
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        model: &str,
        train: &str,
        filter: Filter,
        format: Format,
        (scrub_pii, include_helpful): (bool, bool),
        version: Option<String>,
        repo_dir: &std::path::Path,
        server: (Option<&str>, Option<&str>),
        (first_step, helpful_rate_points): (f64, f64),
    ) -> anyhow::Result<ExitCode> {
        let say = |line: String| {
            if !self.json {
                eprintln!("{line}");
            }
        };
        // 1. The dataset.
        let options = export::Options {
            filter,
            format,
            scrub_pii,
            include_helpful,
        };
        let (bytes, summary) = export::export(self.store, &options)?;
        if summary.rows == 0 {
            bail!(
                "nothing to train on: {} feedback rows read, {} without their input, {} with \
                 nothing {} takes",
                summary.read,
                summary.without_content,
                summary.not_applicable,
                format.as_str()
            );
        }
        let run_dir = self.dir.join("retrain").join(format!(
            "{}-{}",
            summary.dataset_version,
            feedback::now_ms()
        ));
        let output = run_dir.join("output");
        std::fs::create_dir_all(&output).with_context(|| format!("{}", output.display()))?;
        let extension = match format {
            Format::OpenAiChatJsonl | Format::PreferenceJsonl => "jsonl",
            Format::Csv => "csv",
            Format::Parquet => "parquet",
        };
        let dataset = run_dir.join(format!("{model}.{extension}"));
        std::fs::write(&dataset, &bytes)?;
        std::fs::write(
            run_dir.join(format!("{model}.{extension}.manifest.json")),
            serde_json::to_vec_pretty(&summary)?,
        )?;
        say(format!(
            "dataset {} ({} rows) → {}",
            summary.dataset_version,
            summary.rows,
            dataset.display()
        ));
        // 2. The base: the newest version in the repository.
        let repository = repo::Repository::open(repo_dir);
        let base = repository
            .resolve(&repo::ModelRef {
                name: model.to_string(),
                version: None,
            })
            .with_context(|| format!("{model} in {}", repo_dir.display()))?;
        let new_version = match version {
            Some(v) => v,
            None => {
                let mut v = base.version.clone();
                v.minor += 1;
                v.patch = 0;
                v.pre = semver::Prerelease::EMPTY;
                let taken: Vec<semver::Version> = repository
                    .versions(model)?
                    .into_iter()
                    .map(|m| m.version)
                    .collect();
                while taken.contains(&v) {
                    v.minor += 1;
                }
                v.to_string()
            }
        };
        // 3. The team's training.
        say(format!("training: {train}"));
        let status = std::process::Command::new("sh")
            .args(["-c", train])
            .env("RAMPART_DATASET", &dataset)
            .env("RAMPART_DATASET_VERSION", &summary.dataset_version)
            .env("RAMPART_DATASET_FORMAT", format.as_str())
            .env("RAMPART_MODEL", model)
            .env("RAMPART_BASE_VERSION", base.version.to_string())
            .env("RAMPART_BASE_DIR", &base.dir)
            .env("RAMPART_OUTPUT", &output)
            .stdout(if self.json {
                std::process::Stdio::from(std::io::stderr())
            } else {
                std::process::Stdio::inherit()
            })
            .status()
            .context("running the training command")?;
        if !status.success() {
            bail!("the training command failed ({status}); nothing was imported");
        }
        // The output: a folder as `model import` takes it, or the one file inside it.
        let entries: Vec<PathBuf> = std::fs::read_dir(&output)?
            .flatten()
            .map(|e| e.path())
            .collect();
        let source = match entries.as_slice() {
            [] => bail!(
                "the training command wrote nothing into RAMPART_OUTPUT ({})",
                output.display()
            ),
            [one] if one.is_file() => one.clone(),
            _ => output.clone(),
        };
        // 4. The new version, its lineage naming the dataset.
        let me = std::env::current_exe().context("the rampart binary")?;
        let imported = std::process::Command::new(&me)
            .args(["model", "import"])
            .arg(&source)
            .args(["--name", model, "--version", &new_version])
            .args(["--dataset-version", &summary.dataset_version, "--repo"])
            .arg(repo_dir)
            .stdout(std::process::Stdio::null())
            .status()?;
        if !imported.success() {
            bail!(
                "importing {} as {model}@{new_version} failed",
                source.display()
            );
        }
        say(format!(
            "imported {model}@{new_version} (dataset {}, from {model}@{})",
            summary.dataset_version, base.version
        ));
        // 5. The release: A/B, the first step at `first_step` %, the helpful rate judged.
        let path = release::plan::plan_path(repo_dir, model)?;
        let mut plan = if path.is_file() {
            release::plan::ReleasePlan::load(&path)?
        } else {
            release::plan::ReleasePlan::new(base.version.to_string())
        };
        if plan.state.phase.is_active() {
            bail!(
                "{model} has a release under way ({:?}); {model}@{new_version} is imported, start \
                 it when that one ends",
                plan.state.phase
            );
        }
        plan.mode = release::plan::Mode::Ab;
        let mut steps: Vec<f64> = vec![first_step];
        steps.extend(
            plan.schedule
                .steps
                .iter()
                .copied()
                .filter(|s| *s > first_step),
        );
        if steps.last() != Some(&100.0) {
            steps.push(100.0);
        }
        plan.schedule.steps = steps;
        if plan.judge.helpful_rate_points.is_none() {
            plan.judge.helpful_rate_points = Some(helpful_rate_points);
        }
        plan.save_atomic(&path)?;
        let gated = !plan.gates.is_empty();
        // A running server adopts the plan file at its next tick; the gates are read from it.
        if let Some(url) = server.0 {
            let api = crate::release_cmd::Api::new(url, server.1.map(str::to_string))?;
            let want = serde_json::json!(plan.schedule.steps);
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            loop {
                let (status, release) =
                    api.call("GET", &format!("/admin/releases/{model}"), None)?;
                if status == 200
                    && release["plan"]["mode"] == "ab"
                    && release["plan"]["schedule"]["steps"] == want
                {
                    break;
                }
                if std::time::Instant::now() > deadline {
                    bail!(
                        "{model}@{new_version} is imported and {} written, but the server at {url} \
                         did not adopt the plan in 30 s (GET /admin/releases/{model}: {status})",
                        path.display()
                    );
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        let mut release = std::process::Command::new(&me);
        release.arg("release");
        match server {
            (Some(url), key) => {
                release.args(["--url", url]);
                if let Some(k) = key {
                    release.args(["--key", k]);
                }
            }
            (None, _) => {
                release.arg("--repo").arg(repo_dir);
            }
        }
        if gated && server.0.is_some() {
            release.args(["gate", model, "--candidate", &new_version, "--start"]);
        } else {
            release.args(["start", model, "--candidate", &new_version, "--mode", "ab"]);
        }
        if self.json {
            // Keep stdout for the one JSON document.
            release.stdout(std::io::stderr());
        }
        let started = release.status()?;
        if !started.success() {
            bail!("{model}@{new_version} is imported, but its release did not start");
        }
        if self.json {
            println!(
                "{}",
                serde_json::json!({
                    "model": model,
                    "dataset_version": summary.dataset_version,
                    "dataset": dataset,
                    "rows": summary.rows,
                    "base_version": base.version.to_string(),
                    "version": new_version,
                    "gates": gated,
                    "steps": plan.schedule.steps,
                    "helpful_rate_points": plan.judge.helpful_rate_points,
                })
            );
        } else {
            println!(
                "{model}@{new_version} trained on {} and released: A/B, steps {:?} %, helpful \
                 rate judged{}",
                summary.dataset_version,
                plan.schedule.steps,
                if gated { ", gates first" } else { "" }
            );
        }
        Ok(ExitCode::SUCCESS)
    }
}

pub fn run(args: FeedbackArgs) -> anyhow::Result<ExitCode> {
    let store = match &args.postgres {
        Some(url) if !url.is_empty() => Store::connect(url)?,
        _ => Store::open_read_only(&args.dir.join("feedback.db"))?,
    };
    match args.command {
        FeedbackCommand::Export {
            model,
            version,
            class,
            since,
            until,
            format,
            out,
            scrub_pii,
            include_helpful,
        } => {
            let options = export::Options {
                filter: Filter {
                    model: Some(model),
                    version,
                    class,
                    since_ms: time(&since)?,
                    until_ms: time(&until)?,
                },
                format: Format::parse(&format).context("format")?,
                scrub_pii,
                include_helpful,
            };
            let (bytes, summary) = export::export(&store, &options)?;
            if summary.rows == 0 {
                bail!(
                    "nothing to export: {} feedback rows read, {} without their input, {} with \
                     nothing this format takes",
                    summary.read,
                    summary.without_content,
                    summary.not_applicable
                );
            }
            std::fs::write(&out, &bytes).with_context(|| format!("{}", out.display()))?;
            let manifest = PathBuf::from(format!("{}.manifest.json", out.display()));
            let mut m = serde_json::to_value(&summary)?;
            m["file"] = serde_json::json!(out.file_name().map(|n| n.to_string_lossy()));
            std::fs::write(&manifest, serde_json::to_vec_pretty(&m)?)
                .with_context(|| format!("{}", manifest.display()))?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&m)?);
            } else {
                println!(
                    "{} rows ({} read; {} without input, {} not for {}, {} duplicates) → {}\n\
                     dataset version {} (sha256 {}), manifest {}",
                    summary.rows,
                    summary.read,
                    summary.without_content,
                    summary.not_applicable,
                    summary.format,
                    summary.duplicates,
                    out.display(),
                    summary.dataset_version,
                    summary.sha256,
                    manifest.display()
                );
            }
        }
        FeedbackCommand::Retrain {
            model,
            train,
            class,
            since,
            format,
            scrub_pii,
            include_helpful,
            version,
            repo,
            url,
            key,
            first_step,
            helpful_rate_points,
        } => {
            if !(first_step > 0.0 && first_step < 100.0) {
                bail!("--first-step must be between 0 and 100 (percent)");
            }
            let filter = Filter {
                model: Some(model.clone()),
                class,
                since_ms: time(&since)?,
                ..Filter::default()
            };
            return Retrain {
                store: &store,
                dir: &args.dir,
                json: args.json,
            }
            .run(
                &model,
                &train,
                filter,
                Format::parse(&format).context("format")?,
                (scrub_pii, include_helpful),
                version,
                &repo,
                (url.as_deref(), key.as_deref()),
                (first_step, helpful_rate_points),
            );
        }
        FeedbackCommand::Classes {
            model,
            window,
            min_samples,
        } => {
            let window = age(&window).context("--window: an age like 1h or 7d")?;
            let filter = Filter {
                model,
                since_ms: Some(feedback::now_ms().saturating_sub(window.as_millis() as u64)),
                ..Filter::default()
            };
            let table = feedback::quality::classes(&store, &filter, min_samples)?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&table)?);
            } else {
                println!(
                    "{:<16} {:<10} {:<16} {:>8} {:>7} {:>16} {:>8}",
                    "model",
                    "version",
                    "class",
                    "feedback",
                    "errors",
                    "error rate (95%)",
                    "helpful"
                );
                for q in &table {
                    println!(
                        "{:<16} {:<10} {:<16} {:>8} {:>7} {:>5.1}% [{:>4.1}-{:>4.1}]{} {:>8}",
                        q.model,
                        q.version,
                        q.class,
                        q.feedback,
                        q.errors,
                        q.error_rate * 100.0,
                        q.error_rate_lower * 100.0,
                        q.error_rate_upper * 100.0,
                        if q.enough { " " } else { "*" },
                        q.helpful_rate
                            .map_or("-".to_string(), |h| format!("{:.0}%", h * 100.0))
                    );
                }
                if table.iter().any(|q| !q.enough) {
                    println!("* fewer than {min_samples} feedback rows: not judged");
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_and_times_parse() {
        assert_eq!(age("24h"), Some(Duration::from_secs(86_400)));
        assert_eq!(age("7d"), Some(Duration::from_secs(604_800)));
        assert_eq!(age("h"), None);
        assert_eq!(age("5w"), None);
        assert_eq!(time(&Some("1000".into())).unwrap(), Some(1000));
        assert!(time(&Some("yesterday".into())).is_err());
        assert!(time(&Some("1h".into())).unwrap().unwrap() > 1_000_000);
    }
}
