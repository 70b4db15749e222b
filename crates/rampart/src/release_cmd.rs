//! `rampart release …`: a model's release (docs/releases.md). With `--url` (or `RAMPART_URL`)
//! the commands go to a running server's `/admin/releases/…` (a key with the `admin` scope);
//! without, they work on the plan file in the repository (`<repo>/<model>/release.toml`), which a
//! running server adopts at its next tick, as it would a Git commit of that file.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use release::controller::{Command, Controller};
use release::plan::{plan_path, Mode, ReleasePlan};

use crate::render;

#[derive(Debug, clap::Args)]
pub struct ReleaseArgs {
    /// A running server (`http://host:port`): the commands go to its admin API.
    #[arg(long, global = true, env = "RAMPART_URL", value_name = "URL")]
    pub url: Option<String>,
    /// The API key (scope `admin`) for `--url`.
    #[arg(
        long,
        global = true,
        env = "RAMPART_API_KEY",
        value_name = "KEY",
        hide_env_values = true
    )]
    pub key: Option<String>,
    /// The model repository folder (without `--url`: where the plan files are).
    #[arg(
        long,
        global = true,
        env = "RAMPART_REPO",
        default_value = "models",
        value_name = "DIR"
    )]
    pub repo: PathBuf,
    /// Print JSON.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: ReleaseCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum ReleaseCommand {
    /// Start releasing a candidate version: gates, then the schedule's steps (5/20/50/100 % by
    /// default), judged against the stable at each step.
    Start {
        model: String,
        /// The version to release.
        #[arg(long)]
        candidate: String,
        /// `canary` (default), `ab` or `shadow`.
        #[arg(long)]
        mode: Option<String>,
        /// Start although the candidate is below its maturity level (docs/maturity.md), for
        /// this reason (audited). With --url.
        #[arg(long, value_name = "REASON")]
        maturity_override: Option<String>,
    },
    /// Run the gates before any traffic: the model's golden set (`<repo>/<model>/golden/*.jsonl`)
    /// through the server's stable and the candidate (loaded for it), the eval gate (accuracy,
    /// per-class recall floors, weighted error cost) and the latency gate (p95), with the plan's
    /// `[gates]` settings. Exit 0 when they pass, 3 when a gate refuses. `--start` then starts
    /// the release with the results (a refused gate ends it before any traffic). Needs --url.
    Gate {
        model: String,
        /// The version to release.
        #[arg(long)]
        candidate: String,
        /// The golden set folder (default: <repo>/<model>/golden).
        #[arg(long, value_name = "DIR")]
        golden: Option<PathBuf>,
        /// LLMs: tokens generated per case (greedy).
        #[arg(long, default_value_t = 64)]
        max_tokens: u32,
        /// The candidate's training data for the data-quality gate: a .jsonl or .csv file, or a
        /// folder of them (default: the dataset version the candidate's lineage names, in
        /// <repo>/<model>/datasets/).
        #[arg(long, value_name = "PATH")]
        dataset: Option<PathBuf>,
        /// The dataset the stable was trained on, for the label distribution (default: the
        /// version the stable's lineage names).
        #[arg(long, value_name = "PATH")]
        previous_dataset: Option<PathBuf>,
        /// Start the release with the results.
        #[arg(long)]
        start: bool,
    },
    /// Where the release stands: phase, step, weight, samples, the judge's last look.
    Status {
        /// One model (default: every release).
        model: Option<String>,
    },
    /// The decisions of a model's release, oldest first.
    History { model: String },
    /// Let a release waiting for approval go on (start or promotion).
    Approve { model: String },
    /// Make the candidate the stable now.
    Promote {
        model: String,
        /// Promote although the candidate is below its maturity level, for this reason
        /// (audited). With --url.
        #[arg(long, value_name = "REASON")]
        maturity_override: Option<String>,
    },
    /// Freeze the weights and the schedule.
    Pause { model: String },
    /// Let a paused or holding release go on.
    Resume { model: String },
    /// Send every request back to the stable and mark the candidate rejected.
    Rollback {
        model: String,
        /// Why (kept in the history and the audit log).
        #[arg(long)]
        reason: Option<String>,
    },
}

pub fn run(args: ReleaseArgs) -> Result<ExitCode> {
    if let ReleaseCommand::Gate { .. } = &args.command {
        let Some(url) = &args.url else {
            bail!("`rampart release gate` runs the golden set through a running server: give --url (or RAMPART_URL)");
        };
        return gate(&args, url);
    }
    match &args.url {
        Some(url) => remote(&args, url),
        None => local(&args),
    }
}

/// A small client of the server's APIs (JSON in, JSON out).
pub(crate) struct Api {
    runtime: tokio::runtime::Runtime,
    client: reqwest::Client,
    base: String,
    key: Option<String>,
}

impl Api {
    pub(crate) fn new(url: &str, key: Option<String>) -> Result<Self> {
        Ok(Self {
            runtime: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?,
            client: reqwest::Client::new(),
            base: url.trim_end_matches('/').to_string(),
            key,
        })
    }

    /// A raw body (an image) posted with its content type; status and JSON body.
    fn post_bytes(
        &self,
        path: &str,
        body: Vec<u8>,
        content_type: &str,
    ) -> Result<(u16, serde_json::Value)> {
        self.send("POST", path, |r| {
            r.header(reqwest::header::CONTENT_TYPE, content_type)
                .body(body)
        })
    }

    /// Status and JSON body (`null` when the body is not JSON).
    pub(crate) fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<(u16, serde_json::Value)> {
        self.send(method, path, |r| match body {
            Some(body) => r.json(body),
            None => r,
        })
    }

    /// One request (GET, else POST) with the key, its body set by `with_body`.
    fn send(
        &self,
        method: &str,
        path: &str,
        with_body: impl FnOnce(reqwest::RequestBuilder) -> reqwest::RequestBuilder,
    ) -> Result<(u16, serde_json::Value)> {
        self.runtime.block_on(async {
            let url = format!("{}{path}", self.base);
            let mut request = match method {
                "GET" => self.client.get(&url),
                _ => self.client.post(&url),
            };
            if let Some(key) = &self.key {
                request = request.bearer_auth(key);
            }
            let response = with_body(request)
                .send()
                .await
                .with_context(|| format!("{method} {url}"))?;
            let status = response.status().as_u16();
            let value = response.json().await.unwrap_or(serde_json::Value::Null);
            Ok((status, value))
        })
    }
}

/// One golden case through one version: its prediction and latency. LLM cases go to the
/// OpenAI API (greedy); a tensor-model case names an image (`"input": {"image": "PATH"}`, a
/// JPEG or PNG relative to the golden folder), sent as a raw image to KServe, whose `results`
/// give the top class (classifiers) or the boxes (detectors).
fn ask(
    api: &Api,
    model: &str,
    version: &str,
    (case, golden_dir): (&release::golden::GoldenCase, &Path),
    max_tokens: u32,
) -> Result<(release::golden::Prediction, f64)> {
    use release::golden::{CaseInput, Prediction};
    let id = format!("{model}@{version}");
    let (path, body) = match &case.input {
        CaseInput::Messages(messages) => (
            "/v1/chat/completions",
            serde_json::json!({ "model": id, "messages": messages, "max_tokens": max_tokens, "temperature": 0 }),
        ),
        CaseInput::Prompt(prompt) => (
            "/v1/completions",
            serde_json::json!({ "model": id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0 }),
        ),
        CaseInput::Input(input) => return ask_image(api, model, version, case, input, golden_dir),
    };
    let began = std::time::Instant::now();
    let (status, value) = api.call("POST", path, Some(&body))?;
    let ms = began.elapsed().as_secs_f64() * 1e3;
    if status != 200 {
        let message = value["error"]["message"]
            .as_str()
            .unwrap_or("no JSON error");
        return Ok((Prediction::Failed(format!("{status}: {message}")), ms));
    }
    let choice = &value["choices"][0];
    let text = choice["message"]["content"]
        .as_str()
        .or_else(|| choice["text"].as_str())
        .unwrap_or("");
    Ok((Prediction::Text(text.to_string()), ms))
}

/// The image a tensor-model golden case names (`"input": {"image": "PATH"}`, relative to the
/// golden folder) and its bytes; `None` when the input names none.
fn case_image<'a>(
    case: &release::golden::GoldenCase,
    input: &'a serde_json::Value,
    golden_dir: &Path,
) -> Result<Option<(&'a str, Vec<u8>)>> {
    let Some(image) = input.get("image").and_then(|v| v.as_str()) else {
        return Ok(None);
    };
    let file = golden_dir.join(image);
    let bytes = std::fs::read(&file).with_context(|| {
        format!(
            "golden case {} ({}): reading {}",
            case.id,
            case.source,
            file.display()
        )
    })?;
    Ok(Some((image, bytes)))
}

/// A tensor-model golden case: its image through KServe's raw-image route.
fn ask_image(
    api: &Api,
    model: &str,
    version: &str,
    case: &release::golden::GoldenCase,
    input: &serde_json::Value,
    golden_dir: &Path,
) -> Result<(release::golden::Prediction, f64)> {
    use release::golden::{DetectedBox, Prediction};
    let Some((image, bytes)) = case_image(case, input, golden_dir)? else {
        bail!(
            "golden case {} ({}): a tensor-model case gives its input as {{\"image\": \"PATH\"}} (a JPEG or PNG, relative to {})",
            case.id,
            case.source,
            golden_dir.display()
        );
    };
    let lower = image.to_ascii_lowercase();
    let content_type = if lower.ends_with(".jpg") || lower.ends_with(".jpeg") {
        "image/jpeg"
    } else {
        "image/png"
    };
    let path = format!("/v2/models/{model}/versions/{version}/infer");
    let began = std::time::Instant::now();
    let (status, value) = api.post_bytes(&path, bytes, content_type)?;
    let ms = began.elapsed().as_secs_f64() * 1e3;
    if status != 200 {
        let message = value["error"]
            .as_str()
            .or_else(|| value["error"]["message"].as_str())
            .unwrap_or("no JSON error");
        return Ok((Prediction::Failed(format!("{status}: {message}")), ms));
    }
    let Some(results) = value["results"][0].as_array() else {
        return Ok((
            Prediction::Failed("the answer has no `results` (not a classifier or detector)".into()),
            ms,
        ));
    };
    let label = |r: &serde_json::Value| {
        r["label"].as_str().map(str::to_string).unwrap_or_else(|| {
            r["index"]
                .as_u64()
                .or(r["class"].as_u64())
                .unwrap_or(0)
                .to_string()
        })
    };
    let is_detector = results.iter().any(|r| r.get("box").is_some());
    let prediction = if is_detector {
        Prediction::Boxes(
            results
                .iter()
                .filter_map(|r| {
                    let b: Vec<f32> = r["box"]
                        .as_array()?
                        .iter()
                        .filter_map(|v| v.as_f64().map(|v| v as f32))
                        .collect();
                    Some(DetectedBox {
                        label: label(r),
                        score: r["score"].as_f64().unwrap_or(0.0) as f32,
                        bbox: b.try_into().ok()?,
                    })
                })
                .collect(),
        )
    } else {
        match results.first() {
            Some(top) => Prediction::Label {
                label: label(top),
                confidence: top["score"].as_f64().map(|v| v as f32),
            },
            None => Prediction::Failed("no class in the answer".into()),
        }
    };
    Ok((prediction, ms))
}

/// The feature-consistency gate: the golden set's images through the stable's and the
/// candidate's declared pre-processing (`[pipeline.preprocess]` of each version's manifest).
fn feature_consistency(
    repo_dir: &Path,
    model: &str,
    (stable, candidate): (&str, &str),
    set: &release::golden::GoldenSet,
    golden_dir: &Path,
    settings: &release::gates::GateSettings,
) -> Result<release::gates::GateReport> {
    let repository = repo::Repository::open(repo_dir);
    let spec = |version: &str| -> Result<repo::pipeline::Preprocess> {
        let found = repository.resolve(&repo::ModelRef {
            name: model.to_string(),
            version: Some(repo::model_ref::parse_version(version)?),
        })?;
        let manifest = repository.manifest(&found)?;
        manifest
            .pipeline
            .and_then(|p| p.preprocess)
            .with_context(|| {
                format!(
                    "{model}@{version} declares no image pre-processing: [gates.feature_consistency] compares two versions' pre-processing (in {})",
                    repo_dir.display()
                )
            })
    };
    let (old, new) = (spec(stable)?, spec(candidate)?);
    let mut vectors = (Vec::new(), Vec::new());
    for case in set.cases() {
        let release::golden::CaseInput::Input(input) = &case.input else {
            continue;
        };
        let Some((_, bytes)) = case_image(case, input, golden_dir)? else {
            continue;
        };
        for (spec, out) in [(&old, &mut vectors.0), (&new, &mut vectors.1)] {
            let prepared = classic::imageops::prepare(&bytes, spec, None)
                .map_err(|e| anyhow::anyhow!("golden case {} ({}): {e}", case.id, case.source))?;
            out.push(prepared.data);
        }
    }
    Ok(release::gates::feature_consistency_gate(
        settings, &vectors.0, &vectors.1,
    ))
}

/// The data-quality gate ([`release::gates::data_quality_gate`]) on the candidate's dataset
/// version (`dataset`, else the one its lineage names, found in `<repo>/<model>/datasets/`)
/// against the stable's (`previous`, else its lineage's). None when nothing asks for it: the
/// plan does not declare it (`declared`), no dataset is given and no dataset version the
/// candidate's lineage names is in the repository. Declared but not found, or unreadable: the
/// gate refuses, saying why.
fn data_quality(
    repo_dir: &Path,
    model: &str,
    (stable, candidate): (&str, &str),
    (dataset, previous): (Option<&Path>, Option<&Path>),
    settings: &release::gates::GateSettings,
    declared: bool,
) -> Result<Option<release::gates::GateReport>> {
    const GATE: &str = "data_quality";
    let repository = repo::Repository::open(repo_dir);
    // The dataset version a version's lineage names (None for a version imported without).
    let named = |version: &str| -> Option<String> {
        let found = repository
            .resolve(&repo::ModelRef {
                name: model.to_string(),
                version: Some(repo::model_ref::parse_version(version).ok()?),
            })
            .ok()?;
        repository.lineage(&found).ok()?.dataset_version
    };
    let datasets = repo_dir.join(model).join(release::gates::DATASETS_DIR);
    let refused = |reason: String| Ok(Some(release::gates::GateReport::refused(GATE, reason)));
    let current = match (dataset, named(candidate)) {
        (Some(path), _) => path.to_path_buf(),
        (None, Some(version)) => {
            match release::gates::dataset_in_repository(repo_dir, model, &version) {
                Some(path) => path,
                // Only a plan that asks for the gate makes the dataset's absence a refusal.
                None if !declared => return Ok(None),
                None => {
                    return refused(format!(
                        "{model}@{candidate} was trained on dataset version {version}, which is                          not in {} (as {version}/, {version}.jsonl or {version}.csv); give it                          with --dataset",
                        datasets.display()
                    ))
                }
            }
        }
        (None, None) if declared => {
            return refused(format!(
                "the plan declares [gates.data_quality] but {model}@{candidate}'s lineage names                  no dataset version (`rampart model import --dataset-version`) and --dataset                  was not given"
            ))
        }
        (None, None) => return Ok(None),
    };
    let mut notes = Vec::new();
    let previous = match (previous, named(stable)) {
        (Some(path), _) => Some(path.to_path_buf()),
        (None, Some(version)) => {
            let found = release::gates::dataset_in_repository(repo_dir, model, &version);
            if found.is_none() {
                notes.push(format!(
                    "the stable's dataset version {version} is not in {}",
                    datasets.display()
                ));
            }
            found
        }
        (None, None) => None,
    };
    let dq = &settings.data_quality;
    let load = |path: &Path| {
        release::gates::DatasetStats::load(path, dq)
            .map_err(|e| format!("reading the dataset {}: {e}", path.display()))
    };
    let current_stats = match load(&current) {
        Ok(stats) => stats,
        Err(reason) => return refused(reason),
    };
    let previous_stats = match previous.as_deref().map(load).transpose() {
        Ok(stats) => stats,
        Err(reason) => return refused(reason),
    };
    let mut report =
        release::gates::data_quality_gate(settings, &current_stats, previous_stats.as_ref());
    report.notes.push(format!(
        "dataset {}{}",
        current.display(),
        previous
            .as_ref()
            .map(|p| format!(" against {}", p.display()))
            .unwrap_or_default()
    ));
    report.notes.extend(notes);
    Ok(Some(report))
}

/// `rampart release gate`.
fn gate(args: &ReleaseArgs, url: &str) -> Result<ExitCode> {
    let ReleaseCommand::Gate {
        model,
        candidate,
        golden,
        max_tokens,
        dataset,
        previous_dataset,
        start,
    } = &args.command
    else {
        unreachable!("gate() is called for the gate command");
    };
    let api = Api::new(url, args.key.clone())?;
    let (status, release) = api.call("GET", &format!("/admin/releases/{model}"), None)?;
    let (stable, table) = match status {
        200 => (
            release["plan"]["stable"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            release["plan"]["gates"].clone(),
        ),
        404 => bail!("{model} has no release plan on the server: write {}/{model}/release.toml with `stable = \"VERSION\"` and its [gates]", args.repo.display()),
        other => bail!("GET /admin/releases/{model}: {other}: {}", release["error"]["message"]),
    };
    let table: toml::Table = serde_json::from_value(table).unwrap_or_default();
    let settings = release::gates::GateSettings::from_table(&table)?;
    let dir = golden
        .clone()
        .unwrap_or_else(|| args.repo.join(model).join("golden"));
    let set = release::golden::GoldenSet::load_dir(&dir)
        .with_context(|| format!("the golden set in {}", dir.display()))?;
    // The candidate must be served to be asked.
    let (status, prepared) = api.call(
        "POST",
        &format!("/admin/releases/{model}/prepare"),
        Some(&serde_json::json!({ "candidate": candidate })),
    )?;
    if status != 200 {
        bail!(
            "preparing {model}@{candidate}: {status}: {}",
            prepared["error"]["message"]
        );
    }
    let mut predictions = (Vec::new(), Vec::new());
    let mut latencies = (Vec::new(), Vec::new());
    for case in set.cases() {
        // Alternated, so that both versions see the same machine at the same time.
        let (p, ms) = ask(&api, model, &stable, (case, &dir), *max_tokens)?;
        predictions.0.push(p);
        latencies.0.push(ms);
        let (p, ms) = ask(&api, model, candidate, (case, &dir), *max_tokens)?;
        predictions.1.push(p);
        latencies.1.push(ms);
    }
    let mut reports = Vec::new();
    if settings.eval {
        reports.push(release::gates::eval_gate(
            &settings,
            &set,
            Some(&predictions.0),
            &predictions.1,
        ));
    }
    if settings.latency {
        reports.push(release::gates::latency_gate(
            &settings,
            &latencies.0,
            &latencies.1,
        ));
    }
    // Declared `[gates.feature_consistency]` on a model with image pre-processing: both
    // versions' declared pre-processing (read from the repository, run by the code the server
    // runs) on the golden set's images.
    if settings.feature_consistency.enabled && table.contains_key("feature_consistency") {
        reports.push(feature_consistency(
            &args.repo,
            model,
            (&stable, candidate),
            &set,
            &dir,
            &settings,
        )?);
    }
    // The data-quality gate, on the candidate's dataset version against the stable's: when the
    // plan declares `[gates.data_quality]`, a dataset is given, or the candidate's lineage names
    // one.
    if let Some(report) = data_quality(
        &args.repo,
        model,
        (&stable, candidate),
        (dataset.as_deref(), previous_dataset.as_deref()),
        &settings,
        table.contains_key("data_quality"),
    )? {
        reports.push(report);
    }
    let passed = release::gates::all_passed(&reports);
    let summary = reports
        .iter()
        .map(|r| {
            if r.passed {
                format!("{}: passed", r.gate)
            } else {
                format!("{}: refused: {}", r.gate, r.reasons.join("; "))
            }
        })
        .collect::<Vec<_>>()
        .join(" | ");
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "passed": passed,
                "golden_digest": set.digest(),
                "reports": reports,
            }))?
        );
    } else {
        println!(
            "{model}: {} golden cases ({}), stable {stable} against candidate {candidate}",
            set.len(),
            set.digest()
        );
        print!("{}", release::gates::render_reports(&reports));
        println!(
            "{}",
            if passed {
                "gates passed"
            } else {
                "gates refused the candidate"
            }
        );
    }
    if *start {
        let body = serde_json::json!({
            "candidate": candidate,
            "gates": {
                "passed": passed,
                "summary": summary,
                "golden_digest": set.digest(),
                "reports": reports,
            },
        });
        let (status, value) = api.call(
            "POST",
            &format!("/admin/releases/{model}/start"),
            Some(&body),
        )?;
        if status != 200 {
            bail!("start: {status}: {}", value["error"]["message"]);
        }
        if !args.json {
            print_decision(&value["decision"]);
        }
    }
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(3)
    })
}

fn mode(text: Option<&str>) -> Result<Option<Mode>> {
    text.map(|m| match m {
        "canary" => Ok(Mode::Canary),
        "ab" => Ok(Mode::Ab),
        "shadow" => Ok(Mode::Shadow),
        other => bail!("unknown mode {other:?}: use canary, ab or shadow"),
    })
    .transpose()
}

/// Against a running server.
fn remote(args: &ReleaseArgs, url: &str) -> Result<ExitCode> {
    let base = url.trim_end_matches('/');
    let (method, path, body) = match &args.command {
        ReleaseCommand::Start {
            model,
            candidate,
            mode: m,
            maturity_override,
        } => {
            mode(m.as_deref())?;
            let mut body = serde_json::json!({ "candidate": candidate, "mode": m });
            if let Some(reason) = maturity_override {
                body["maturity_override"] = serde_json::json!(reason);
            }
            ("POST", format!("/admin/releases/{model}/start"), Some(body))
        }
        ReleaseCommand::Status { model: None } => ("GET", "/admin/releases".to_string(), None),
        ReleaseCommand::Status { model: Some(m) } | ReleaseCommand::History { model: m } => {
            ("GET", format!("/admin/releases/{m}"), None)
        }
        ReleaseCommand::Approve { model } => {
            ("POST", format!("/admin/releases/{model}/approve"), None)
        }
        ReleaseCommand::Promote {
            model,
            maturity_override,
        } => (
            "POST",
            format!("/admin/releases/{model}/promote"),
            maturity_override
                .as_ref()
                .map(|reason| serde_json::json!({ "maturity_override": reason })),
        ),
        ReleaseCommand::Pause { model } => ("POST", format!("/admin/releases/{model}/pause"), None),
        ReleaseCommand::Resume { model } => {
            ("POST", format!("/admin/releases/{model}/resume"), None)
        }
        ReleaseCommand::Rollback { model, reason } => (
            "POST",
            format!("/admin/releases/{model}/rollback"),
            Some(serde_json::json!({ "reason": reason })),
        ),
        ReleaseCommand::Gate { .. } => unreachable!("gate() handles it"),
    };
    let (status, value) = Api::new(base, args.key.clone())?.call(method, &path, body.as_ref())?;
    if !(200..300).contains(&status) {
        let message = value["error"]["message"].as_str().unwrap_or("");
        if args.json {
            println!("{value:#}");
        }
        bail!("{method} {path}: {status}: {message}");
    }
    if args.json {
        println!("{value:#}");
        return Ok(ExitCode::SUCCESS);
    }
    match &args.command {
        ReleaseCommand::Status { model: None } => {
            let releases = value["releases"].as_array().cloned().unwrap_or_default();
            if releases.is_empty() {
                println!("no release plans");
            }
            for r in &releases {
                print_status(r["model"].as_str().unwrap_or("?"), &r["status"]);
            }
        }
        ReleaseCommand::Status { model: Some(m) } => print_status(m, &value["status"]),
        ReleaseCommand::History { .. } => {
            let plan: ReleasePlan = serde_json::from_value(value["plan"].clone())
                .context("the server's plan does not read as a release plan")?;
            print_history(&plan);
        }
        _ => print_decision(&value["decision"]),
    }
    Ok(ExitCode::SUCCESS)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// On the plan file (no server).
fn local(args: &ReleaseArgs) -> Result<ExitCode> {
    if let ReleaseCommand::Start {
        maturity_override: Some(_),
        ..
    }
    | ReleaseCommand::Promote {
        maturity_override: Some(_),
        ..
    } = &args.command
    {
        bail!("--maturity-override is for a running server's gate: give --url (or RAMPART_URL)");
    }
    let model = match &args.command {
        ReleaseCommand::Status { model: None } => {
            return local_status_all(args);
        }
        ReleaseCommand::Status { model: Some(m) }
        | ReleaseCommand::History { model: m }
        | ReleaseCommand::Approve { model: m }
        | ReleaseCommand::Promote { model: m, .. }
        | ReleaseCommand::Pause { model: m }
        | ReleaseCommand::Resume { model: m }
        | ReleaseCommand::Rollback { model: m, .. }
        | ReleaseCommand::Start { model: m, .. } => m.clone(),
        ReleaseCommand::Gate { .. } => unreachable!("gate needs a server"),
    };
    let path = plan_path(&args.repo, &model)?;
    let plan = if path.is_file() {
        ReleasePlan::load(&path)?
    } else if let ReleaseCommand::Start { candidate, .. } = &args.command {
        let stable = newest_other(&args.repo, &model, candidate)?;
        ReleasePlan::new(stable)
    } else {
        bail!(
            "{} has no release plan ({} does not exist); start one with `rampart release start {model} --candidate VERSION`",
            model,
            path.display()
        );
    };
    let command = match &args.command {
        ReleaseCommand::Status { .. } => {
            let c = Controller::new(plan);
            if args.json {
                println!("{}", serde_json::to_string_pretty(&c.status())?);
            } else {
                print_status(&model, &serde_json::to_value(c.status())?);
            }
            return Ok(ExitCode::SUCCESS);
        }
        ReleaseCommand::History { .. } => {
            if args.json {
                println!("{}", serde_json::to_string_pretty(&plan.history)?);
            } else {
                print_history(&plan);
            }
            return Ok(ExitCode::SUCCESS);
        }
        ReleaseCommand::Start {
            candidate, mode: m, ..
        } => {
            let repository = repo::Repository::open(&args.repo);
            let version = |v: &str| -> Result<repo::ModelVersion> {
                let parsed = semver::Version::parse(v).with_context(|| format!("version {v:?}"))?;
                repository
                    .resolve(&repo::ModelRef {
                        name: model.clone(),
                        version: Some(parsed),
                    })
                    .with_context(|| format!("{model}@{v} is not in {}", args.repo.display()))
            };
            let (stable, new) = (version(&plan.stable)?, version(candidate)?);
            // The same comparison as `rampart model diff` and the server's start: a changed
            // tokenizer needs the plan's approval.
            let tokenizer_change = repo::diff::tokenizer_change(&repository, &stable, &new)
                .with_context(|| format!("comparing {model}@{} with {candidate}", plan.stable))?;
            Command::Start {
                candidate: candidate.clone(),
                mode: mode(m.as_deref())?,
                tokenizer_change,
                gates_passed: Some(true),
            }
        }
        ReleaseCommand::Gate { .. } => unreachable!("gate needs a server"),
        ReleaseCommand::Approve { .. } => Command::Approve,
        ReleaseCommand::Promote { .. } => Command::Promote,
        ReleaseCommand::Pause { .. } => Command::Pause,
        ReleaseCommand::Resume { .. } => Command::Resume,
        ReleaseCommand::Rollback { reason, .. } => Command::Rollback {
            reason: reason
                .clone()
                .unwrap_or_else(|| "rolled back from the command line".into()),
        },
    };
    let mut controller = Controller::new(plan);
    let actor = std::env::var("USER").unwrap_or_else(|_| "cli".into());
    let decision = controller.command(command, now_ms(), &format!("cli:{actor}"))?;
    controller.plan().save_atomic(&path)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&decision)?);
    } else {
        print_decision(&serde_json::to_value(&decision)?);
        println!(
            "written to {} (a running server adopts it at its next tick)",
            path.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// A new plan's stable: the version the model's name serves (its stable alias, or its only
/// version) unless that is the candidate, else the newest other version.
fn newest_other(repo_dir: &Path, model: &str, candidate: &str) -> Result<String> {
    let repository = repo::Repository::open(repo_dir);
    if let Ok((served, _)) = repository.chosen(model) {
        if served.version.to_string() != candidate {
            return Ok(served.version.to_string());
        }
    }
    let mut versions: Vec<semver::Version> = repository
        .versions(model)
        .with_context(|| format!("{model} in {}", repo_dir.display()))?
        .into_iter()
        .map(|v| v.version)
        .filter(|v| v.to_string() != candidate)
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|v| v.to_string())
        .with_context(|| format!("{model} has no version besides {candidate} to be the stable"))
}

fn local_status_all(args: &ReleaseArgs) -> Result<ExitCode> {
    let repository = repo::Repository::open(&args.repo);
    let mut all = Vec::new();
    for name in repository.models().unwrap_or_default() {
        let path = plan_path(&args.repo, &name)?;
        if path.is_file() {
            let plan = ReleasePlan::load(&path)?;
            all.push((name, serde_json::to_value(Controller::new(plan).status())?));
        }
    }
    if args.json {
        let list: Vec<_> = all
            .iter()
            .map(|(m, s)| serde_json::json!({ "model": m, "status": s }))
            .collect();
        println!("{}", serde_json::to_string_pretty(&list)?);
    } else if all.is_empty() {
        println!("no release plans in {}", args.repo.display());
    } else {
        for (m, s) in &all {
            print_status(m, s);
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn text(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Null => "-".into(),
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Number(n) => n
            .as_f64()
            .map_or_else(|| n.to_string(), |f| format!("{}", (f * 1e4).round() / 1e4)),
        other => other.to_string(),
    }
}

fn print_status(model: &str, s: &serde_json::Value) {
    println!(
        "{model}: {} — stable {}, candidate {}, mode {}, step {}, weight {}%",
        text(&s["phase"]),
        text(&s["stable"]),
        text(&s["candidate"]),
        text(&s["mode"]),
        text(&s["step"]),
        s["weight"]
            .as_f64()
            .map_or("-".into(), |w| format!("{:.1}", w * 100.0)),
    );
    let control = if s["reference"] == "control" {
        format!(", of which control {}", text(&s["samples_control"]))
    } else {
        String::new()
    };
    println!(
        "  samples: stable {} ({} errors{control}), candidate {} ({} errors); {} s in this step",
        text(&s["samples_stable"]),
        text(&s["errors_stable"]),
        text(&s["samples_candidate"]),
        text(&s["errors_candidate"]),
        s["time_in_step_ms"].as_u64().map_or(0, |ms| ms / 1000),
    );
    if let Some(share) = s["mirrored_share"].as_f64() {
        let v = &s["last_verdict"]["summary"];
        let agreement = match v["agreement"].as_f64() {
            Some(a) => format!(
                "; candidate and control agreed on {:.1}% of {} compared",
                a * 100.0,
                text(&v["compared"])
            ),
            None => String::new(),
        };
        println!(
            "  shadow: every user is served by the stable; {:.1}% of requests are mirrored{agreement}",
            share * 100.0
        );
    }
    if s["reference"] == "control" {
        println!(
            "  latency judged against the control (a copy of the stable at the candidate's share)"
        );
    }
    if let Some(reason) = s["reason"].as_str() {
        println!("  reason: {reason}");
    }
    let v = &s["last_verdict"];
    if let Some(metrics) = v["summary"]["metrics"].as_array() {
        println!("  judge: {}", text(&v["verdict"]));
        let rows: Vec<Vec<String>> = metrics
            .iter()
            .map(|m| {
                vec![
                    text(&m["metric"]),
                    text(&m["stable"]),
                    text(&m["candidate"]),
                    text(&m["statistic"]),
                    text(&m["threshold"]),
                    text(&m["e_value"]),
                ]
            })
            .collect();
        let table = render::table(
            &[
                "metric",
                "stable",
                "candidate",
                "statistic",
                "threshold",
                "e-value",
            ],
            &rows,
        );
        for line in table.lines() {
            println!("    {line}");
        }
    }
}

fn print_decision(d: &serde_json::Value) {
    println!(
        "{}: weight {} → {} ({}){}",
        text(&d["action"]),
        text(&d["from_weight"]),
        text(&d["to_weight"]),
        text(&d["reason"]),
        d["metric"]
            .as_str()
            .map(|m| format!(
                "; {m} statistic {} threshold {} e-value {}",
                text(&d["statistic"]),
                text(&d["threshold"]),
                text(&d["e_value"])
            ))
            .unwrap_or_default()
    );
}

fn print_history(plan: &ReleasePlan) {
    if plan.history.is_empty() {
        println!("no decisions yet");
        return;
    }
    let rows: Vec<Vec<String>> = plan
        .history
        .iter()
        .map(|d| {
            vec![
                d.time_ms.to_string(),
                serde_json::to_value(d.action)
                    .map(|v| text(&v))
                    .unwrap_or_default(),
                format!("{:.3}", d.from_weight),
                format!("{:.3}", d.to_weight),
                d.metric.clone().unwrap_or_default(),
                d.actor.clone(),
                d.reason.clone(),
            ]
        })
        .collect();
    print!(
        "{}",
        render::table(
            &["time_ms", "action", "from", "to", "metric", "actor", "reason"],
            &rows
        )
    );
}
