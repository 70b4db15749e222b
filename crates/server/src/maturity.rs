//! The maturity report of a model version (`rampart model maturity`, `GET
//! /admin/models/{name}/maturity`) and the gate that uses it (docs/maturity.md).
//!
//! Each check reads its evidence from where it lives: the version's files (digests, lineage,
//! model card), the model's folder (stable alias, golden set, gate results, release plan,
//! drift baseline), the server's configuration (objective, fallback chain, entropy band,
//! guard, audit, keys, alert rules) and, when asked, the host (the doctor) and Prometheus (the
//! alert rules loaded). The levels and the verdict are `release::maturity`'s.

use std::path::Path;
use std::time::Duration;

use release::maturity::{Check, Level, Outcome, Report, Section};
use repo::{ModelVersion, Repository};

use crate::config::{ModelConfig, ServerConfig};

/// Rampart's alert group in the shipped rules (deploy/monitoring/rules/rampart-alerts.yml).
pub const ALERT_GROUP: &str = "rampart-alerts";

/// Why a report could not be made.
#[derive(Debug, thiserror::Error)]
pub enum MaturityError {
    #[error(transparent)]
    Repo(#[from] repo::RepoError),
}

/// What the report is asked to look at beyond the files and the configuration.
#[derive(Debug, Clone, Default)]
pub struct Live {
    /// The version's files were verified against its `DIGESTS` by whoever asks (a server that
    /// loaded it): they are not hashed again. `None`: hash them now.
    pub verified: Option<Result<(), String>>,
    /// The doctor's report of this host, when it ran.
    pub doctor: Option<host::Report>,
    /// Whether Prometheus has loaded Rampart's alert group (`[maturity] prometheus_url`):
    /// `Err` says why it could not be asked.
    pub alerts_loaded: Option<Result<bool, String>>,
}

struct Checks(Vec<Check>);

impl Checks {
    /// `(id, section, required from, title)`, what came out, its evidence and fix.
    fn add(
        &mut self,
        (id, section, required_from, title): (&str, Section, Level, &str),
        outcome: Outcome,
        evidence: impl Into<String>,
        fix: impl Into<String>,
    ) {
        let fix = if outcome == Outcome::Fail {
            fix.into()
        } else {
            String::new()
        };
        self.0.push(Check {
            id: id.to_string(),
            section,
            required_from,
            title: title.to_string(),
            outcome,
            evidence: evidence.into(),
            fix,
        });
    }
}

fn pass_if(ok: bool) -> Outcome {
    if ok {
        Outcome::Pass
    } else {
        Outcome::Fail
    }
}

/// The model's settings as the server would serve it (its `[[models]]` entry, or the defaults).
pub fn model_config(config: &ServerConfig, name: &str) -> ModelConfig {
    config
        .model(name)
        .cloned()
        .unwrap_or_else(|| ModelConfig::named(name))
}

/// The report of `version` under `config` (blocking: reads files, may hash the version).
pub fn report(
    config: &ServerConfig,
    repository: &Repository,
    version: &ModelVersion,
    live: &Live,
) -> Result<Report, MaturityError> {
    let name = version.name.as_str();
    let v = version.version.to_string();
    let model = model_config(config, name);
    let manifest = repository.manifest(version)?;
    let is_llm = manifest.model.kind == repo::Kind::Llm;
    let digest = repository.version_digest(version)?;
    let model_dir = repository.root().join(name);
    let mut c = Checks(Vec::new());

    // Lineage and reproducibility.
    let verified = match &live.verified {
        Some(r) => r.clone(),
        None => match repository.verify(version, &repo::NoProgress) {
            Ok(r) if r.ok() => Ok(()),
            Ok(r) => Err(r.summary()),
            Err(e) => Err(e.to_string()),
        },
    };
    c.add(
        ("lineage.digests", Section::Lineage, Level::Experimental, "every file matches the version's DIGESTS"),
        pass_if(verified.is_ok()),
        match &verified {
            Ok(()) => format!("verified, version digest {digest}"),
            Err(why) => format!("does not verify: {why}"),
        },
        format!("the version changed after its import: `rampart model verify {name}@{v}` lists what differs; import it again under a new version"),
    );
    let lineage = repository.lineage(version).ok();
    c.add(
        (
            "lineage.record",
            Section::Lineage,
            Level::Experimental,
            "LINEAGE.json records the source, its digest and the build that imported it",
        ),
        pass_if(
            lineage
                .as_ref()
                .is_some_and(|l| !l.source.sha256.is_empty()),
        ),
        lineage.as_ref().map_or_else(
            || "no readable LINEAGE.json".to_string(),
            |l| {
                format!(
                    "source {} (sha256:{}), imported {} by {}, rampart {}",
                    l.source.path,
                    l.source.sha256,
                    l.imported_at,
                    l.imported_by.as_deref().unwrap_or("unknown"),
                    l.rampart.version
                )
            },
        ),
        "import the version with `rampart model import` (it writes the lineage)",
    );
    let commit = lineage.as_ref().and_then(|l| l.git_commit.clone());
    c.add(
        (
            "lineage.commit",
            Section::Lineage,
            Level::Staging,
            "the commit of the code that produced the model is recorded",
        ),
        pass_if(commit.is_some()),
        commit.map_or_else(
            || "no git_commit in LINEAGE.json".into(),
            |x| format!("git_commit {x}"),
        ),
        "import it again under a new version with --git-commit COMMIT (lineage is immutable)",
    );
    let dataset = lineage.as_ref().and_then(|l| l.dataset_version.clone());
    c.add(
        (
            "lineage.dataset",
            Section::Lineage,
            Level::Staging,
            "the version of the data it was trained and evaluated on is recorded",
        ),
        pass_if(dataset.is_some()),
        dataset.map_or_else(
            || "no dataset_version in LINEAGE.json".into(),
            |x| format!("dataset_version {x}"),
        ),
        "import it again under a new version with --dataset-version VERSION",
    );
    let card = repository.card(version);
    let (card_basic, card_full, card_evidence) = match &card {
        Ok(Some(card)) => {
            let missing = card.missing();
            let basic = card.intended_use.is_some() && card.limits.is_some();
            (
                basic,
                missing.is_empty(),
                if missing.is_empty() {
                    format!(
                        "{}: intended use, limits, evaluation data, licence",
                        card.file
                    )
                } else {
                    format!("{} lacks: {}", card.file, missing.join(", "))
                },
            )
        }
        Ok(None) => (
            false,
            false,
            "no MODEL_CARD.md or README.md in the version".into(),
        ),
        Err(e) => (false, false, format!("unreadable card: {e}")),
    };
    c.add(
        (
            "lineage.card",
            Section::Lineage,
            Level::Staging,
            "a model card says what the model is for and where it fails",
        ),
        pass_if(card_basic),
        card_evidence.clone(),
        "import a new version with --card MODEL_CARD.md (## Intended use, ## Limitations)",
    );
    c.add(
        ("lineage.card_complete", Section::Lineage, Level::Production, "the model card also names its evaluation data and licence"),
        pass_if(card_full),
        card_evidence,
        "add ## Evaluation data and ## Licence (or `license:` front matter) to the card of a new version",
    );

    // Evaluation.
    let golden_dir = model_dir.join("golden");
    let golden = golden_dir
        .is_dir()
        .then(|| release::golden::GoldenSet::load_dir(&golden_dir));
    let golden_digest = match &golden {
        Some(Ok(set)) if !set.is_empty() => Some(set.digest()),
        _ => None,
    };
    c.add(
        (
            "evaluation.golden_set",
            Section::Evaluation,
            Level::Staging,
            "a golden set of evaluation cases is kept with the model",
        ),
        pass_if(golden_digest.is_some()),
        match &golden {
            Some(Ok(set)) if !set.is_empty() => format!(
                "{} cases in {} ({})",
                set.len(),
                golden_dir.display(),
                golden_digest.as_deref().unwrap_or_default()
            ),
            Some(Ok(_)) => format!("{} has no case", golden_dir.display()),
            Some(Err(e)) => format!("{} does not read: {e}", golden_dir.display()),
            None => format!("no {}", golden_dir.display()),
        },
        format!(
            "write cases to {}/*.jsonl (docs/releases.md#gates)",
            golden_dir.display()
        ),
    );
    let gates_file = model_dir.join("gates").join(format!("{v}.json"));
    let gates: Option<serde_json::Value> = std::fs::read(&gates_file)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    let gates_passed = gates
        .as_ref()
        .is_some_and(|g| g["gates"]["passed"].as_bool() == Some(true));
    let gates_digest = gates
        .as_ref()
        .and_then(|g| g["gates"]["golden_digest"].as_str().map(str::to_string));
    let on_current_set = golden_digest.is_some() && gates_digest == golden_digest;
    c.add(
        (
            "evaluation.gates_passed",
            Section::Evaluation,
            Level::Production,
            "this version passed the release gates on the current golden set",
        ),
        pass_if(gates_passed && on_current_set),
        match &gates {
            None => format!("no gate results for {v} ({})", gates_file.display()),
            Some(_) => format!(
                "{}: {} on golden set {}{}",
                gates_file.display(),
                if gates_passed { "passed" } else { "refused" },
                gates_digest.as_deref().unwrap_or("?"),
                if on_current_set {
                    ""
                } else {
                    " (not the current set)"
                }
            ),
        }
        .replace('\n', " "),
        format!("run `rampart release gate {name} --candidate {v}` against a server"),
    );
    let plan_path = release::plan::plan_path(repository.root(), name).ok();
    let plan = plan_path
        .as_deref()
        .filter(|p| p.is_file())
        .map(release::plan::ReleasePlan::load);
    let plan_ok = match &plan {
        Some(Ok(p)) => Some(p),
        _ => None,
    };
    c.add(
        ("evaluation.gates_declared", Section::Evaluation, Level::Production, "the release plan declares gates, so the next candidate is evaluated before any traffic"),
        pass_if(plan_ok.is_some_and(|p| !p.gates.is_empty())),
        match &plan {
            Some(Ok(p)) if !p.gates.is_empty() => format!(
                "[gates] {}",
                p.gates.keys().cloned().collect::<Vec<_>>().join(", ")
            ),
            Some(Ok(_)) => "the release plan has no [gates]".into(),
            Some(Err(e)) => format!("the release plan does not read: {e}"),
            None => "no release plan".into(),
        },
        format!(
            "add [gates] (golden = …, min_accuracy = …) to {}/{name}/release.toml",
            repository.root().display()
        ),
    );

    // Release safety.
    let chosen = repository.chosen(name);
    let pinned = model.version.clone();
    let (explicit, chosen_evidence) = match (&pinned, plan_ok, &chosen) {
        (Some(p), _, _) => (
            true,
            format!("pinned by the configuration ([[models]] version = {p:?})"),
        ),
        (None, Some(p), _) if config.releases.enabled => {
            (true, format!("the release plan's stable, {}", p.stable))
        }
        (None, _, Ok((s, repo::Choice::Stable { setting }))) => (
            true,
            format!(
                "stable alias {} (set {} by {}: {})",
                s.version, setting.set_at, setting.set_by, setting.cause
            ),
        ),
        (None, _, Ok((s, repo::Choice::OnlyVersion))) => (
            false,
            format!(
                "{} is served as the only version, with no stable alias",
                s.version
            ),
        ),
        (None, _, Err(e)) => (false, e.to_string()),
    };
    c.add(
        ("release.explicit_stable", Section::ReleaseSafety, Level::Staging, "what users get is chosen explicitly (stable alias, pin or release), never by what was imported last"),
        pass_if(explicit),
        chosen_evidence,
        format!("`rampart model promote {name}@VERSION --reason …`"),
    );
    c.add(
        ("release.plan", Section::ReleaseSafety, Level::Staging, "new versions reach users through a release (canary or A/B, judged, reversible)"),
        pass_if(plan_ok.is_some() && config.releases.enabled),
        match (&plan, config.releases.enabled) {
            (Some(Ok(p)), true) => format!(
                "release plan: stable {}, mode {}, phase {}",
                p.stable,
                format!("{:?}", p.mode).to_lowercase(),
                format!("{:?}", p.state.phase).to_lowercase()
            ),
            (Some(Ok(_)), false) => "a release plan, but [releases] enabled = false".into(),
            (Some(Err(e)), _) => format!("the release plan does not read: {e}"),
            (None, _) => "no release plan".into(),
        },
        format!(
            "write {}/{name}/release.toml (stable = \"…\", docs/releases.md) with [releases] enabled",
            repository.root().display()
        ),
    );
    let versions = repository.versions(name)?;
    let earlier: Vec<&ModelVersion> = versions
        .iter()
        .filter(|o| o.version < version.version)
        .collect();
    let previous = repository
        .aliases(name)
        .ok()
        .and_then(|a| a.history.last().cloned());
    let (rollback, rollback_evidence) = match (&previous, earlier.last()) {
        (Some(p), _) if p.version != v => {
            let present = versions.iter().any(|o| o.version.to_string() == p.version);
            (
                pass_if(present),
                if present {
                    format!("the previous stable {} is in the repository", p.version)
                } else {
                    format!("the previous stable {} was removed", p.version)
                },
            )
        }
        (_, Some(e)) => (Outcome::Pass, format!("{} is in the repository", e.version)),
        (_, None) => (
            Outcome::NotApplicable,
            "the model's first version: nothing earlier to go back to".into(),
        ),
    };
    c.add(
        (
            "release.rollback",
            Section::ReleaseSafety,
            Level::Production,
            "an earlier version is at hand to roll back to",
        ),
        rollback,
        rollback_evidence,
        "keep the previous stable version in the repository",
    );

    // Monitoring.
    c.add(
        (
            "monitoring.monitors",
            Section::Monitoring,
            Level::Staging,
            "input drift and output monitors run",
        ),
        pass_if(config.monitor.enabled),
        if config.monitor.enabled {
            "[monitor] enabled"
        } else {
            "[monitor] enabled = false"
        },
        "set [monitor] enabled = true",
    );
    let baseline =
        crate::monitors::baseline_path(&config.monitor, repository.root(), name, &v).ok();
    let has_baseline = baseline.as_deref().is_some_and(Path::is_file);
    c.add(
        ("monitoring.baseline", Section::Monitoring, Level::Staging, "a drift baseline for this version"),
        pass_if(has_baseline),
        baseline.map_or_else(
            || "no baseline path".to_string(),
            |p| {
                if has_baseline {
                    p.display().to_string()
                } else {
                    format!("no {}", p.display())
                }
            },
        ),
        format!("`rampart monitor baseline {name}@{v} --inputs DIR` (or serve it: the first requests make one)"),
    );
    c.add(
        (
            "monitoring.output_band",
            Section::Monitoring,
            Level::Production,
            "the output entropy has a band its alarm watches",
        ),
        if is_llm {
            pass_if(model.entropy_band.is_some())
        } else {
            Outcome::NotApplicable
        },
        match (is_llm, model.entropy_band) {
            (false, _) => {
                "not a language model (its confidence is monitored without a band)".to_string()
            }
            (true, Some([lo, hi])) => format!("entropy_band = [{lo}, {hi}]"),
            (true, None) => "no entropy_band".into(),
        },
        format!(
            "set entropy_band = [LOW, HIGH] in [[models]] name = {name:?} (docs/monitoring.md)"
        ),
    );
    let alerts = alert_rules_evidence(
        config.maturity.alert_rules.as_deref(),
        live.alerts_loaded.as_ref(),
    );
    c.add(
        ("monitoring.alerts", Section::Monitoring, Level::Production, "Rampart's alert rules are deployed (and loaded by Prometheus when one is named)"),
        pass_if(alerts.0),
        alerts.1,
        "deploy deploy/monitoring/rules/rampart-alerts.yml and name it in [maturity] alert_rules (and prometheus_url)",
    );

    // Resilience.
    let objective = model.slo.ttft_p99_ms.or(model.latency_objective_ms);
    c.add(
        (
            "resilience.objective",
            Section::Resilience,
            Level::Staging,
            "a latency objective the admission and the breaker hold",
        ),
        pass_if(objective.is_some()),
        match (model.slo.ttft_p99_ms, model.latency_objective_ms) {
            (Some(t), _) => format!("[models.slo] ttft_p99_ms = {t}"),
            (None, Some(l)) => format!("latency_objective_ms = {l}"),
            (None, None) => "no objective".into(),
        },
        format!("set [models.slo] ttft_p99_ms (or latency_objective_ms) for {name}"),
    );
    c.add(
        (
            "resilience.fallback",
            Section::Resilience,
            Level::Production,
            "a fallback chain answers when the model cannot",
        ),
        pass_if(!model.fallback.is_empty()),
        if model.fallback.is_empty() {
            "no fallback steps".to_string()
        } else {
            format!("{} fallback steps", model.fallback.len())
        },
        format!("add [[models.fallback]] steps to {name} (docs/resilience.md)"),
    );
    c.add(
        (
            "resilience.degradation",
            Section::Resilience,
            Level::Production,
            "the degradation controllers adapt batches and admission under pressure",
        ),
        pass_if(config.degradation.enabled),
        if config.degradation.enabled {
            "[degradation] enabled"
        } else {
            "[degradation] enabled = false"
        },
        "set [degradation] enabled = true",
    );

    // Audit and security.
    let keys = !config.insecure_no_auth && config.api_keys_file.is_some();
    c.add(
        (
            "security.api_keys",
            Section::AuditSecurity,
            Level::Experimental,
            "every route needs an API key",
        ),
        pass_if(keys),
        if config.insecure_no_auth {
            "insecure_no_auth = true".to_string()
        } else if let Some(f) = &config.api_keys_file {
            format!("api_keys_file {}", f.display())
        } else {
            "no api_keys_file".into()
        },
        "set api_keys_file (docs/security.md); never insecure_no_auth",
    );
    c.add(
        (
            "audit.enabled",
            Section::AuditSecurity,
            Level::Staging,
            "every request and action is in the tamper-evident audit log",
        ),
        pass_if(config.audit.enabled),
        if config.audit.enabled {
            format!("[audit] enabled, {}", config.audit.dir.display())
        } else {
            "[audit] enabled = false".into()
        },
        "set [audit] enabled = true",
    );
    let guard = model.guard.over(&config.guard.policy());
    let guard_on = guard.enabled.unwrap_or(true);
    let guard_mode = guard.mode.unwrap_or_default();
    c.add(
        (
            "security.guard",
            Section::AuditSecurity,
            Level::Staging,
            "the prompt-injection guard judges its inputs",
        ),
        if is_llm {
            pass_if(guard_on)
        } else {
            Outcome::NotApplicable
        },
        if is_llm {
            format!(
                "guard {}, mode {}",
                if guard_on { "on" } else { "off" },
                format!("{guard_mode:?}").to_lowercase()
            )
        } else {
            "not a language model".into()
        },
        format!("remove guard.enabled = false for {name}"),
    );
    c.add(
        (
            "security.guard_blocks",
            Section::AuditSecurity,
            Level::Production,
            "the guard refuses what it catches (mode block)",
        ),
        if is_llm {
            pass_if(guard_on && guard_mode == guard::Mode::Block)
        } else {
            Outcome::NotApplicable
        },
        if is_llm {
            format!("mode {}", format!("{guard_mode:?}").to_lowercase())
        } else {
            "not a language model".into()
        },
        "set the guard's mode = \"block\" once its shadow measurements are good (docs/guard.md)",
    );
    let required = config.audit.enabled && config.audit.mode() == audit::Mode::FailClosed;
    c.add(
        (
            "audit.required",
            Section::AuditSecurity,
            Level::Production,
            "nothing is served that the audit log did not keep (fail closed)",
        ),
        pass_if(required),
        match config.audit.mode() {
            audit::Mode::FailClosed => "[audit] fail closed",
            audit::Mode::BestEffort => "[audit] best effort",
        },
        "set [audit] required = true",
    );
    let (doctor_outcome, doctor_evidence) = match &live.doctor {
        Some(r) => {
            let errors: Vec<&str> = r
                .checks
                .iter()
                .filter(|c| c.status == host::Status::Error)
                .map(|c| c.id.as_str())
                .collect();
            (
                pass_if(errors.is_empty()),
                if errors.is_empty() {
                    format!("{} ok, {} warnings, no error", r.counts.ok, r.counts.warn)
                } else {
                    format!("errors: {}", errors.join(", "))
                },
            )
        }
        None => (Outcome::Fail, "the doctor did not run".to_string()),
    };
    c.add(
        (
            "security.doctor",
            Section::AuditSecurity,
            Level::Production,
            "the host passes the doctor's preflight (no error)",
        ),
        doctor_outcome,
        doctor_evidence,
        "`rampart doctor --fix` shows each error's fix",
    );

    Ok(Report::new(
        name,
        &v,
        &digest,
        c.0,
        humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
    ))
}

/// The report of `version` with what this server sees: a loaded version counts as verified
/// (it was, as it loaded; any other is hashed), the doctor on this host now, and the
/// Prometheus `[maturity] prometheus_url` names.
pub async fn report_served(
    state: &crate::state::AppState,
    repository: Repository,
    version: ModelVersion,
) -> Result<Report, String> {
    let loaded = state
        .front
        .registry
        .find(&crate::registry::ModelName::versioned(
            &version.name,
            Some(&version.version.to_string()),
        ))
        .is_some();
    let alerts_loaded = match &state.config.maturity.prometheus_url {
        Some(url) => Some(alerts_loaded(url).await),
        None => None,
    };
    let config = state.config.clone();
    tokio::task::spawn_blocking(move || {
        let live = Live {
            verified: loaded.then_some(Ok(())),
            doctor: Some(crate::doctor::examine(&config).report),
            alerts_loaded,
        };
        report(&config, &repository, &version, &live).map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| format!("the report failed: {e}"))?
}

/// Whether the alert rules are deployed (a rules file that holds Rampart's group) and, when a
/// Prometheus was asked, loaded there.
fn alert_rules_evidence(
    file: Option<&Path>,
    loaded: Option<&Result<bool, String>>,
) -> (bool, String) {
    let Some(file) = file else {
        return (false, "no [maturity] alert_rules".into());
    };
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) => return (false, format!("{}: {e}", file.display())),
    };
    if !text.contains(&format!("name: {ALERT_GROUP}")) {
        return (
            false,
            format!("{} has no {ALERT_GROUP} group", file.display()),
        );
    }
    match loaded {
        None => (true, format!("{} holds {ALERT_GROUP}", file.display())),
        Some(Ok(true)) => (
            true,
            format!(
                "{} holds {ALERT_GROUP}, loaded by Prometheus",
                file.display()
            ),
        ),
        Some(Ok(false)) => (
            false,
            format!(
                "{} holds {ALERT_GROUP}, but Prometheus has not loaded it",
                file.display()
            ),
        ),
        Some(Err(e)) => (false, format!("Prometheus could not be asked: {e}")),
    }
}

/// Asks Prometheus (`GET /api/v1/rules`) whether it has loaded Rampart's alert group.
pub async fn alerts_loaded(prometheus_url: &str) -> Result<bool, String> {
    let url = format!(
        "{}/api/v1/rules?type=alert",
        prometheus_url.trim_end_matches('/')
    );
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .map_err(|e| e.to_string())?;
    let body: serde_json::Value = client
        .get(&url)
        .send()
        .await
        .map_err(|e| format!("{url}: {e}"))?
        .error_for_status()
        .map_err(|e| format!("{url}: {e}"))?
        .json()
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    Ok(body["data"]["groups"]
        .as_array()
        .is_some_and(|groups| groups.iter().any(|g| g["name"] == ALERT_GROUP)))
}

/// The version a report is about: `NAME@VERSION`, or the one the name serves.
pub fn version_of(
    repository: &Repository,
    reference: &str,
) -> Result<ModelVersion, repo::RepoError> {
    repository.resolve(&reference.parse::<repo::ModelRef>()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use formats::tiny::TinyLlama;
    use repo::ImportOptions;

    const CARD: &str = "# triage\n\n## Intended use\nRoutes support tickets.\n\n## Limitations\nEnglish only.\n\n## Evaluation data\nTickets of 2026-Q3.\n\n## Licence\nApache-2.0\n";

    fn import(repo: &Repository, dir: &Path, version: &str, full: bool) -> ModelVersion {
        let model = dir.join("tiny.gguf");
        if !model.exists() {
            std::fs::write(&model, TinyLlama::default().to_gguf().unwrap()).unwrap();
        }
        let card = dir.join("card.md");
        std::fs::write(&card, CARD).unwrap();
        let options = ImportOptions {
            name: "triage".into(),
            version: version.into(),
            kind: None,
            link: false,
            git_commit: full.then(|| "4f1c2e9".into()),
            dataset_version: full.then(|| "tickets-2026q3".into()),
            derived_from: None,
            pipeline: None,
            build: repo::BuildInfo {
                version: "test".into(),
                git_commit: None,
                rustc: None,
            },
            progress: &repo::NoProgress,
            rules_check: None,
            host_fingerprint: None,
            card: full.then_some(card),
            stable: false,
        };
        repo.import(&model, &options).unwrap().version
    }

    fn doctor(error: bool) -> host::Report {
        let checks = error
            .then(|| host::Check {
                id: "memory.swap".into(),
                area: host::Area::Memory,
                subject: None,
                status: host::Status::Error,
                observed: "on".into(),
                expected: "off".into(),
                why: String::new(),
                fix: String::new(),
            })
            .into_iter()
            .collect();
        host::Report {
            schema_version: host::SCHEMA_VERSION,
            host: host::HostSummary::default(),
            only: None,
            gpu_load_sample: false,
            elapsed_ms: 0,
            counts: host::Counts::default(),
            checks,
        }
    }

    fn outcomes(r: &Report) -> std::collections::BTreeMap<String, Outcome> {
        r.sections
            .iter()
            .flat_map(|s| &s.checks)
            .map(|c| (c.id.clone(), c.outcome))
            .collect()
    }

    /// Everything a production version has: 1.0.0 (the stable) and 1.1.0 (the candidate, gated).
    fn production(dir: &Path) -> (ServerConfig, Repository, ModelVersion) {
        let repo = Repository::open(dir.join("models"));
        import(&repo, dir, "1.0.0", true);
        let v = import(&repo, dir, "1.1.0", true);
        let model_dir = dir.join("models/triage");
        std::fs::create_dir_all(model_dir.join("golden")).unwrap();
        std::fs::write(
            model_dir.join("golden/cases.jsonl"),
            "{\"id\": \"t1\", \"prompt\": \"2+2=\", \"expected\": {\"exact\": \"4\"}}\n",
        )
        .unwrap();
        let digest = release::golden::GoldenSet::load_dir(&model_dir.join("golden"))
            .unwrap()
            .digest();
        std::fs::create_dir_all(model_dir.join("gates")).unwrap();
        std::fs::write(
            model_dir.join("gates/1.1.0.json"),
            serde_json::json!({"gates": {"passed": true, "summary": "eval: passed", "golden_digest": digest}}).to_string(),
        )
        .unwrap();
        std::fs::write(
            model_dir.join("release.toml"),
            "stable = \"1.0.0\"\n[gates]\ngolden = \"golden\"\nmin_accuracy = 0.9\n",
        )
        .unwrap();
        std::fs::create_dir_all(model_dir.join("monitors")).unwrap();
        std::fs::write(model_dir.join("monitors/1.1.0.json"), "{}").unwrap();
        let rules = dir.join("rampart-alerts.yml");
        std::fs::write(&rules, "groups:\n  - name: rampart-alerts\n    rules: []\n").unwrap();
        let keys = dir.join("keys.txt");
        std::fs::write(&keys, "ops:sk-ops-0000000000000001 admin\n").unwrap();
        let config: ServerConfig = toml::from_str(&format!(
            r#"
repo = "{repo}"
api_keys_file = "{keys}"
[audit]
required = true
[maturity]
alert_rules = "{rules}"
[[models]]
name = "triage"
entropy_band = [0.5, 3.0]
latency_objective_ms = 800
[[models.fallback]]
canned = "Sorry, try again later."
"#,
            repo = dir.join("models").display(),
            keys = keys.display(),
            rules = rules.display(),
        ))
        .unwrap();
        (config, repo, v)
    }

    fn live(doctor_error: bool) -> Live {
        Live {
            verified: None,
            doctor: Some(doctor(doctor_error)),
            alerts_loaded: None,
        }
    }

    #[test]
    fn a_version_with_everything_is_production_and_each_check_passes() {
        let dir = tempfile::tempdir().unwrap();
        let (config, repo, v) = production(dir.path());
        let r = report(&config, &repo, &v, &live(false)).unwrap();
        let failing: Vec<_> = r.missing_for(Level::Production);
        assert!(failing.is_empty(), "{failing:#?}");
        assert_eq!(r.level, Level::Production);
        assert_eq!(outcomes(&r).len(), 25);
        assert!(outcomes(&r).values().all(|o| *o == Outcome::Pass), "{r:#?}");
    }

    /// Each check fails on its own when its evidence goes, and the level drops to the one
    /// below the check's.
    #[test]
    fn each_check_fails_when_its_evidence_goes() {
        type Break = fn(&Path, &mut ServerConfig, &mut Live);
        let cases: Vec<(&str, Break)> = vec![
            ("lineage.digests", |d, _, _| {
                let f = d.join("models/triage/1.1.0/tiny.gguf");
                std::fs::set_permissions(&f, std::os::unix::fs::PermissionsExt::from_mode(0o644))
                    .unwrap();
                let mut bytes = std::fs::read(&f).unwrap();
                let last = bytes.len() - 1;
                bytes[last] ^= 1;
                std::fs::write(&f, bytes).unwrap();
            }),
            ("evaluation.golden_set", |d, _, _| {
                std::fs::remove_dir_all(d.join("models/triage/golden")).unwrap();
            }),
            ("evaluation.gates_passed", |d, _, _| {
                // A new case: the results were measured on another golden set.
                std::fs::write(
                    d.join("models/triage/golden/more.jsonl"),
                    "{\"id\": \"t2\", \"prompt\": \"3+3=\", \"expected\": {\"exact\": \"6\"}}\n",
                )
                .unwrap();
            }),
            ("evaluation.gates_declared", |d, _, _| {
                std::fs::write(d.join("models/triage/release.toml"), "stable = \"1.0.0\"\n")
                    .unwrap();
            }),
            ("release.plan", |_, c, _| c.releases.enabled = false),
            ("monitoring.monitors", |_, c, _| c.monitor.enabled = false),
            ("monitoring.baseline", |d, _, _| {
                std::fs::remove_file(d.join("models/triage/monitors/1.1.0.json")).unwrap();
            }),
            ("monitoring.output_band", |_, c, _| {
                c.models[0].entropy_band = None
            }),
            ("monitoring.alerts", |_, _, l| {
                l.alerts_loaded = Some(Ok(false))
            }),
            ("resilience.objective", |_, c, _| {
                c.models[0].latency_objective_ms = None
            }),
            ("resilience.fallback", |_, c, _| {
                c.models[0].fallback.clear()
            }),
            ("resilience.degradation", |_, c, _| {
                c.degradation.enabled = false
            }),
            ("security.api_keys", |_, c, _| c.api_keys_file = None),
            ("audit.enabled", |_, c, _| c.audit.enabled = false),
            ("security.guard", |_, c, _| {
                c.models[0].guard.enabled = Some(false)
            }),
            ("security.guard_blocks", |_, c, _| {
                c.models[0].guard.mode = Some(guard::Mode::Flag)
            }),
            ("audit.required", |_, c, _| c.audit.required = false),
            ("security.doctor", |_, _, l| l.doctor = Some(doctor(true))),
        ];
        for (id, breaks) in cases {
            let dir = tempfile::tempdir().unwrap();
            let (mut config, repo, v) = production(dir.path());
            let mut l = live(false);
            breaks(dir.path(), &mut config, &mut l);
            let r = report(&config, &repo, &v, &l).unwrap();
            let failing: Vec<&str> = r
                .sections
                .iter()
                .flat_map(|s| &s.checks)
                .filter(|c| !c.passed())
                .map(|c| c.id.as_str())
                .collect();
            // Disabling the audit log also makes it not required.
            let expected: Vec<&str> = match id {
                "audit.enabled" => vec!["audit.enabled", "audit.required"],
                "security.guard" => vec!["security.guard", "security.guard_blocks"],
                "evaluation.golden_set" => vec!["evaluation.golden_set", "evaluation.gates_passed"],
                other => vec![other],
            };
            assert_eq!(failing, expected, "breaking {id}");
            let check = r
                .sections
                .iter()
                .flat_map(|s| &s.checks)
                .find(|c| c.id == id)
                .unwrap();
            assert!(!check.fix.is_empty(), "{id} says how to pass it");
            let below = match check.required_from {
                Level::Experimental => Level::None,
                Level::Staging => Level::Experimental,
                _ => Level::Staging,
            };
            assert_eq!(r.level, below, "breaking {id}");
        }
    }

    #[test]
    fn lineage_card_and_stable_checks_fail_on_a_bare_import() {
        let dir = tempfile::tempdir().unwrap();
        let repo = Repository::open(dir.path().join("models"));
        let v = import(&repo, dir.path(), "1.0.0", false);
        // A repository from before aliases, with one version: served as the only one.
        std::fs::remove_file(dir.path().join("models/triage/ALIASES.json")).unwrap();
        let config = ServerConfig {
            repo: dir.path().join("models"),
            ..ServerConfig::default()
        };
        let r = report(&config, &repo, &v, &live(false)).unwrap();
        let o = outcomes(&r);
        for id in [
            "lineage.commit",
            "lineage.dataset",
            "lineage.card",
            "lineage.card_complete",
            "release.explicit_stable",
            "release.plan",
            "security.api_keys",
        ] {
            assert_eq!(o[id], Outcome::Fail, "{id}");
        }
        assert_eq!(o["lineage.digests"], Outcome::Pass);
        assert_eq!(o["lineage.record"], Outcome::Pass);
        // The model's first version has nothing to roll back to.
        assert_eq!(o["release.rollback"], Outcome::NotApplicable);
        assert_eq!(r.level, Level::None);
        // Promoted explicitly, the stable check passes.
        repo.set_stable(&v, "ops", "promote: reviewed").unwrap();
        let r = report(&config, &repo, &v, &live(false)).unwrap();
        assert_eq!(outcomes(&r)["release.explicit_stable"], Outcome::Pass);
        // A removed previous stable leaves nothing to roll back to.
        let v2 = import(&repo, dir.path(), "1.1.0", false);
        repo.set_stable(&v2, "ops", "promote").unwrap();
        let v3 = import(&repo, dir.path(), "1.2.0", false);
        repo.set_stable(&v3, "ops", "promote").unwrap();
        repo.remove(&v2).unwrap();
        let r = report(&config, &repo, &v3, &live(false)).unwrap();
        assert_eq!(outcomes(&r)["release.rollback"], Outcome::Fail);
    }

    #[test]
    fn the_alert_rules_must_hold_rampart_s_group_and_be_loaded_when_asked() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("rules.yml");
        assert!(!alert_rules_evidence(None, None).0);
        assert!(!alert_rules_evidence(Some(&f), None).0);
        std::fs::write(&f, "groups:\n  - name: other\n").unwrap();
        assert!(!alert_rules_evidence(Some(&f), None).0);
        std::fs::write(&f, "groups:\n  - name: rampart-alerts\n").unwrap();
        assert!(alert_rules_evidence(Some(&f), None).0);
        assert!(alert_rules_evidence(Some(&f), Some(&Ok(true))).0);
        assert!(!alert_rules_evidence(Some(&f), Some(&Ok(false))).0);
        let (ok, why) = alert_rules_evidence(Some(&f), Some(&Err("refused".into())));
        assert!(!ok && why.contains("refused"));
    }
}
