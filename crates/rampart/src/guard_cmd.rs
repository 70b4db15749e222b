//! `rampart guard …`: the input guard outside the server. `check` judges one text as the front
//! would; `eval` measures it on a labelled JSONL set (TPR/FPR overall, per language, per
//! category, per channel; the threshold sweep; latency), the numbers docs/guard.md reports.
//!
//! The guard is the one `rampart serve` would build from the same `--config` (its `[guard]`),
//! unless `--rules` / `--classifier` name a file or folder (or a repository model) instead.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use guard::{Channel, Guard, Input, Verdict};
use repo::Repository;
use serde::Serialize;
use server::config::ServerConfig;
use server::guard_service::{self, GuardService};

#[derive(Debug, clap::Args)]
pub struct GuardArgs {
    /// A configuration file (rampart.toml): its `[guard]` is the guard judged.
    #[arg(long, short = 'c', global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The model repository folder (for rules and classifier models named by the config).
    #[arg(long, global = true, env = "RAMPART_REPO", value_name = "DIR")]
    pub repo: Option<PathBuf>,
    /// A rules file (`.toml`) or a rules model `NAME[@VERSION]` instead of the config's.
    #[arg(long, global = true, value_name = "FILE|MODEL")]
    pub rules: Option<String>,
    /// A classifier folder (sentence-transformers files plus the head) or an embedding model
    /// `NAME[@VERSION]` instead of the config's.
    #[arg(long, global = true, value_name = "DIR|MODEL")]
    pub classifier: Option<String>,
    /// The rules only.
    #[arg(long, global = true)]
    pub no_classifier: bool,
    /// Compute threads of the classifier's embedder.
    #[arg(long, short = 't', global = true)]
    pub threads: Option<usize>,
    /// Print JSON.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: GuardCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum GuardCommand {
    /// Judge one text: verdict, score and reasons (exit 1 when it would be refused).
    Check {
        text: String,
        /// The channel the text arrives on: user, assistant, system, tool or prompt.
        #[arg(long, default_value = "user")]
        channel: String,
        /// Judge it under this model's policy (`[models.guard]`).
        #[arg(long)]
        model: Option<String>,
    },
    /// Measure the guard on labelled rows `{"text", "label", "language"?, "category"?,
    /// "channel"?}` (label 1/true/"injection" for attacks).
    Eval {
        #[arg(long, value_name = "FILE")]
        data: PathBuf,
        /// Also write every row's verdict, score and reasons as JSON lines.
        #[arg(long, value_name = "FILE")]
        rows: Option<PathBuf>,
    },
}

fn build(args: &GuardArgs) -> Result<(GuardService, ServerConfig)> {
    let mut config = ServerConfig::load(args.config.as_deref())?;
    if let Some(repo) = &args.repo {
        config.repo = repo.clone();
    }
    if args.rules.is_none() && args.classifier.is_none() && !args.no_classifier {
        let repository = Repository::open(&config.repo);
        let (service, problem) = GuardService::load(&config.guard_setup(), &repository);
        if let Some(e) = problem {
            bail!("{e}");
        }
        return Ok((service, config));
    }
    let repository = Repository::open(&config.repo);
    let (mut guard, rules_source) = match args.rules.as_deref().or(config.guard.rules.as_deref()) {
        None => (Guard::seed(), "seed".to_string()),
        Some(r) if Path::new(r).is_file() => {
            let text = std::fs::read_to_string(r).with_context(|| format!("reading {r}"))?;
            (
                Guard::from_rules_toml(&text).with_context(|| format!("rules file {r}"))?,
                r.to_string(),
            )
        }
        Some(r) => guard_service::load_rules(&repository, r).map_err(anyhow::Error::msg)?,
    };
    let threads = args.threads.or(config.guard.threads).or(config.threads);
    let mut classifier_source = None;
    if !args.no_classifier {
        if let Some(c) = args
            .classifier
            .as_deref()
            .or(config.guard.classifier.as_deref())
        {
            let classifier = if Path::new(c).is_dir() {
                guard_service::classifier_from_dir(Path::new(c), &config.guard, threads)
                    .map_err(anyhow::Error::msg)?
            } else {
                guard_service::load_classifier(&repository, &config.guard, c, threads)
                    .map_err(anyhow::Error::msg)?
                    .0
            };
            guard = guard.with_classifier(classifier);
            classifier_source = Some(c.to_string());
        }
    }
    Ok((
        GuardService::from_parts(
            &config.guard_setup(),
            guard,
            rules_source,
            classifier_source,
        ),
        config,
    ))
}

pub fn run(args: GuardArgs) -> Result<ExitCode> {
    let (service, _config) = build(&args)?;
    match &args.command {
        GuardCommand::Check {
            text,
            channel,
            model,
        } => {
            let channel = Channel::parse(channel).with_context(|| {
                format!("unknown channel {channel:?} (user, assistant, system, tool, prompt)")
            })?;
            let effective = service.effective(model.as_deref().unwrap_or(""), "");
            let decision = service.check(&[Input { channel, text }], &effective.policy, &|_| {
                Vec::new()
            });
            if args.json {
                println!("{}", serde_json::to_string_pretty(&decision)?);
            } else {
                println!(
                    "verdict  {}  (score {:.3}, {} tier, {:.2} ms)",
                    decision.verdict.as_str(),
                    decision.score,
                    decision.tier,
                    decision.ms
                );
                for r in &decision.reasons {
                    println!(
                        "  {:<34} {:.3}  {} / {}  {:?}",
                        r.code,
                        r.score,
                        r.channel.as_str(),
                        r.view,
                        r.evidence
                    );
                }
                if let Some(e) = &decision.error {
                    println!("  error: {e}");
                }
                println!(
                    "guard    rules {}, classifier {}",
                    service.rules_source,
                    service.classifier_source.as_deref().unwrap_or("none")
                );
            }
            Ok(if decision.verdict.refuses() {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            })
        }
        GuardCommand::Eval { data, rows } => eval(&args, &service, data, rows.as_deref()),
    }
}

#[derive(Debug, Clone)]
struct Row {
    text: String,
    attack: bool,
    language: String,
    category: String,
    channel: Channel,
}

fn parse_rows(path: &Path) -> Result<Vec<Row>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not JSON", path.display(), n + 1))?;
        let Some(t) = v["text"].as_str() else {
            bail!("{}:{}: no \"text\"", path.display(), n + 1);
        };
        let attack = match &v["label"] {
            serde_json::Value::Bool(b) => *b,
            serde_json::Value::Number(x) => x.as_f64().unwrap_or(0.0) >= 0.5,
            serde_json::Value::String(s) => {
                matches!(
                    s.as_str(),
                    "1" | "injection" | "jailbreak" | "attack" | "malicious" | "unsafe"
                )
            }
            _ => bail!(
                "{}:{}: \"label\" must be 0/1, a boolean or a name",
                path.display(),
                n + 1
            ),
        };
        let channel = match v["channel"].as_str() {
            Some(c) => Channel::parse(c)
                .with_context(|| format!("{}:{}: unknown channel {c:?}", path.display(), n + 1))?,
            None => Channel::User,
        };
        out.push(Row {
            text: t.to_string(),
            attack,
            language: v["language"].as_str().unwrap_or("unknown").to_string(),
            category: v["category"].as_str().unwrap_or("none").to_string(),
            channel,
        });
    }
    Ok(out)
}

#[derive(Debug, Default, Clone, Serialize)]
struct Rates {
    attacks: usize,
    benign: usize,
    caught: usize,
    false_alarms: usize,
    tpr: Option<f64>,
    fpr: Option<f64>,
}

impl Rates {
    fn add(&mut self, attack: bool, hit: bool) {
        if attack {
            self.attacks += 1;
            self.caught += usize::from(hit);
        } else {
            self.benign += 1;
            self.false_alarms += usize::from(hit);
        }
    }

    fn close(mut self) -> Self {
        self.tpr = (self.attacks > 0).then(|| self.caught as f64 / self.attacks as f64);
        self.fpr = (self.benign > 0).then(|| self.false_alarms as f64 / self.benign as f64);
        self
    }
}

#[derive(Debug, Serialize)]
struct SweepPoint {
    threshold: f32,
    tpr: f64,
    fpr: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    data: String,
    rows: usize,
    rules: String,
    classifier: Option<String>,
    /// At the policy's own thresholds (a row is a hit when it would be refused in block mode).
    overall: Rates,
    non_english: Rates,
    by_language: BTreeMap<String, Rates>,
    by_category: BTreeMap<String, Rates>,
    by_channel: BTreeMap<String, Rates>,
    /// The score against one threshold for every channel.
    sweep: Vec<SweepPoint>,
    latency_ms_p50: f64,
    latency_ms_p99: f64,
    latency_ms_max: f64,
    /// Latency of rows of at most 256 embedder tokens (about 1,000 characters).
    latency_ms_p99_short: f64,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn eval(
    args: &GuardArgs,
    service: &GuardService,
    data: &Path,
    rows_out: Option<&Path>,
) -> Result<ExitCode> {
    let rows = parse_rows(data)?;
    if rows.is_empty() {
        bail!("{} holds no rows", data.display());
    }
    let mut policy = service.effective("", "").policy;
    policy.mode = guard::Mode::Block;
    // Warm-up (the embedder's first pass allocates).
    let _ = service.check(
        &[Input {
            channel: Channel::User,
            text: "warm up",
        }],
        &policy,
        &|_| Vec::new(),
    );
    let mut overall = Rates::default();
    let mut non_english = Rates::default();
    let mut by_language: BTreeMap<String, Rates> = BTreeMap::new();
    let mut by_category: BTreeMap<String, Rates> = BTreeMap::new();
    let mut by_channel: BTreeMap<String, Rates> = BTreeMap::new();
    let mut scored: Vec<(f32, bool)> = Vec::new();
    let mut latencies = Vec::new();
    let mut short_latencies = Vec::new();
    let mut out_rows = Vec::new();
    for row in &rows {
        let started = Instant::now();
        let d = service.check(
            &[Input {
                channel: row.channel,
                text: &row.text,
            }],
            &policy,
            &|_| Vec::new(),
        );
        let ms = started.elapsed().as_secs_f64() * 1e3;
        latencies.push(ms);
        if row.text.chars().count() <= 1000 {
            short_latencies.push(ms);
        }
        let hit = d.verdict == Verdict::Block || d.verdict == Verdict::Error;
        overall.add(row.attack, hit);
        if row.language != "en" {
            non_english.add(row.attack, hit);
        }
        by_language
            .entry(row.language.clone())
            .or_default()
            .add(row.attack, hit);
        by_category
            .entry(row.category.clone())
            .or_default()
            .add(row.attack, hit);
        by_channel
            .entry(row.channel.as_str().to_string())
            .or_default()
            .add(row.attack, hit);
        scored.push((d.score, row.attack));
        if rows_out.is_some() {
            out_rows.push(serde_json::json!({
                "text": row.text, "label": u8::from(row.attack), "category": row.category,
                "language": row.language, "verdict": d.verdict.as_str(), "score": d.score,
                "reasons": d.codes(), "ms": ms,
            }));
        }
    }
    if let Some(path) = rows_out {
        let text: String = out_rows.iter().map(|r| format!("{r}\n")).collect();
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    let attacks = scored.iter().filter(|s| s.1).count().max(1) as f64;
    let benign = scored.iter().filter(|s| !s.1).count().max(1) as f64;
    let sweep = (1..20)
        .map(|k| {
            let t = k as f32 * 0.05;
            let tp = scored.iter().filter(|(s, a)| *a && *s >= t).count() as f64;
            let fp = scored.iter().filter(|(s, a)| !*a && *s >= t).count() as f64;
            SweepPoint {
                threshold: t,
                tpr: tp / attacks,
                fpr: fp / benign,
            }
        })
        .collect();
    latencies.sort_by(f64::total_cmp);
    short_latencies.sort_by(f64::total_cmp);
    let report = Report {
        data: data.display().to_string(),
        rows: rows.len(),
        rules: service.rules_source.clone(),
        classifier: service.classifier_source.clone(),
        overall: overall.close(),
        non_english: non_english.close(),
        by_language: by_language
            .into_iter()
            .map(|(k, v)| (k, v.close()))
            .collect(),
        by_category: by_category
            .into_iter()
            .map(|(k, v)| (k, v.close()))
            .collect(),
        by_channel: by_channel
            .into_iter()
            .map(|(k, v)| (k, v.close()))
            .collect(),
        sweep,
        latency_ms_p50: percentile(&latencies, 0.5),
        latency_ms_p99: percentile(&latencies, 0.99),
        latency_ms_max: latencies.last().copied().unwrap_or(0.0),
        latency_ms_p99_short: percentile(&short_latencies, 0.99),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(ExitCode::SUCCESS);
    }
    let pct =
        |x: Option<f64>| x.map_or_else(|| "   -  ".to_string(), |v| format!("{:5.1}%", v * 100.0));
    let line = |name: &str, r: &Rates| {
        println!(
            "  {name:<22} TPR {} ({:>3}/{:<3})  FPR {} ({:>3}/{:<3})",
            pct(r.tpr),
            r.caught,
            r.attacks,
            pct(r.fpr),
            r.false_alarms,
            r.benign
        );
    };
    println!(
        "guard    rules {}, classifier {}",
        report.rules,
        report.classifier.as_deref().unwrap_or("none")
    );
    println!("data     {} ({} rows)", report.data, report.rows);
    line("overall", &report.overall);
    line("non-English", &report.non_english);
    println!("by language");
    for (k, r) in &report.by_language {
        line(k, r);
    }
    println!("by category");
    for (k, r) in &report.by_category {
        line(k, r);
    }
    println!("by channel");
    for (k, r) in &report.by_channel {
        line(k, r);
    }
    println!("threshold sweep (score ≥ t on every channel)");
    for p in &report.sweep {
        println!(
            "  t={:.2}  TPR {:5.1}%  FPR {:5.1}%",
            p.threshold,
            p.tpr * 100.0,
            p.fpr * 100.0
        );
    }
    println!(
        "latency  p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; p99 of rows ≤ 1,000 characters {:.2} ms",
        report.latency_ms_p50, report.latency_ms_p99, report.latency_ms_max, report.latency_ms_p99_short
    );
    Ok(ExitCode::SUCCESS)
}
