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
