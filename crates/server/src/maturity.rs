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
    fn add(
        &mut self,
        id: &str,
        section: Section,
        required_from: Level,
        title: &str,
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
        "lineage.digests",
        Section::Lineage,
        Level::Experimental,
        "every file matches the version's DIGESTS",
        pass_if(verified.is_ok()),
        match &verified {
            Ok(()) => format!("verified, version digest {digest}"),
            Err(why) => format!("does not verify: {why}"),
        },
        format!("the version changed after its import: `rampart model verify {name}@{v}` lists what differs; import it again under a new version"),
    );
    let lineage = repository.lineage(version).ok();
    c.add(
        "lineage.record",
        Section::Lineage,
        Level::Experimental,
        "LINEAGE.json records the source, its digest and the build that imported it",
        pass_if(lineage.as_ref().is_some_and(|l| !l.source.sha256.is_empty())),
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
        "lineage.commit",
        Section::Lineage,
        Level::Staging,
        "the commit of the code that produced the model is recorded",
        pass_if(commit.is_some()),
        commit.map_or_else(|| "no git_commit in LINEAGE.json".into(), |x| format!("git_commit {x}")),
        "import it again under a new version with --git-commit COMMIT (lineage is immutable)",
    );
    let dataset = lineage.as_ref().and_then(|l| l.dataset_version.clone());
    c.add(
        "lineage.dataset",
        Section::Lineage,
        Level::Staging,
        "the version of the data it was trained and evaluated on is recorded",
        pass_if(dataset.is_some()),
        dataset.map_or_else(|| "no dataset_version in LINEAGE.json".into(), |x| format!("dataset_version {x}")),
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
                    format!("{}: intended use, limits, evaluation data, licence", card.file)
                } else {
                    format!("{} lacks: {}", card.file, missing.join(", "))
                },
            )
        }
        Ok(None) => (false, false, "no MODEL_CARD.md or README.md in the version".into()),
        Err(e) => (false, false, format!("unreadable card: {e}")),
    };
    c.add(
        "lineage.card",
        Section::Lineage,
        Level::Staging,
        "a model card says what the model is for and where it fails",
        pass_if(card_basic),
        card_evidence.clone(),
        "import a new version with --card MODEL_CARD.md (## Intended use, ## Limitations)",
    );
    c.add(
        "lineage.card_complete",
        Section::Lineage,
        Level::Production,
        "the model card also names its evaluation data and licence",
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
        "evaluation.golden_set",
        Section::Evaluation,
        Level::Staging,
        "a golden set of evaluation cases is kept with the model",
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
        format!("write cases to {}/*.jsonl (docs/releases.md#gates)", golden_dir.display()),
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
        "evaluation.gates_passed",
        Section::Evaluation,
        Level::Production,
        "this version passed the release gates on the current golden set",
        pass_if(gates_passed && on_current_set),
        match &gates {
            None => format!("no gate results for {v} ({})", gates_file.display()),
            Some(_) => format!(
                "{}: {} on golden set {}{}",
                gates_file.display(),
                if gates_passed { "passed" } else { "refused" },
                gates_digest.as_deref().unwrap_or("?"),
                if on_current_set { "" } else { " (not the current set)" }
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
        "evaluation.gates_declared",
        Section::Evaluation,
        Level::Production,
        "the release plan declares gates, so the next candidate is evaluated before any traffic",
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
        format!("add [gates] (golden = …, min_accuracy = …) to {}/{name}/release.toml", repository.root().display()),
    );

    // Release safety.
    let chosen = repository.chosen(name);
    let pinned = model.version.clone();
    let (explicit, chosen_evidence) = match (&pinned, plan_ok, &chosen) {
        (Some(p), _, _) => (true, format!("pinned by the configuration ([[models]] version = {p:?})")),
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
        (None, _, Ok((s, repo::Choice::OnlyVersion))) => {
            (false, format!("{} is served as the only version, with no stable alias", s.version))
        }
        (None, _, Err(e)) => (false, e.to_string()),
    };
    c.add(
        "release.explicit_stable",
        Section::ReleaseSafety,
        Level::Staging,
        "what users get is chosen explicitly (stable alias, pin or release), never by what was imported last",
        pass_if(explicit),
        chosen_evidence,
        format!("`rampart model promote {name}@VERSION --reason …`"),
    );
    c.add(
        "release.plan",
        Section::ReleaseSafety,
        Level::Staging,
        "new versions reach users through a release (canary or A/B, judged, reversible)",
        pass_if(plan_ok.is_some() && config.releases.enabled),
        match (&plan, config.releases.enabled) {
            (Some(Ok(p)), true) => format!(
                "release plan: stable {}, mode {:?}, phase {:?}",
                p.stable, p.mode, p.state.phase
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
        "release.rollback",
        Section::ReleaseSafety,
        Level::Production,
        "an earlier version is at hand to roll back to",
        rollback,
        rollback_evidence,
        "keep the previous stable version in the repository",
    );

    // Monitoring.
    c.add(
        "monitoring.monitors",
        Section::Monitoring,
        Level::Staging,
        "input drift and output monitors run",
        pass_if(config.monitor.enabled),
        if config.monitor.enabled { "[monitor] enabled" } else { "[monitor] enabled = false" },
        "set [monitor] enabled = true",
    );
    let baseline = crate::monitors::baseline_path(&config.monitor, repository.root(), name, &v).ok();
    let has_baseline = baseline.as_deref().is_some_and(Path::is_file);
    c.add(
        "monitoring.baseline",
        Section::Monitoring,
        Level::Staging,
        "a drift baseline for this version",
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
        "monitoring.output_band",
        Section::Monitoring,
        Level::Production,
        "the output entropy has a band its alarm watches",
        if is_llm {
            pass_if(model.entropy_band.is_some())
        } else {
            Outcome::NotApplicable
        },
        match (is_llm, model.entropy_band) {
            (false, _) => "not a language model (its confidence is monitored without a band)".to_string(),
            (true, Some([lo, hi])) => format!("entropy_band = [{lo}, {hi}]"),
            (true, None) => "no entropy_band".into(),
        },
        format!("set entropy_band = [LOW, HIGH] in [[models]] name = {name:?} (docs/monitoring.md)"),
    );
    let alerts = alert_rules_evidence(config.maturity.alert_rules.as_deref(), live.alerts_loaded.as_ref());
    c.add(
        "monitoring.alerts",
        Section::Monitoring,
        Level::Production,
        "Rampart's alert rules are deployed (and loaded by Prometheus when one is named)",
        pass_if(alerts.0),
        alerts.1,
        "deploy deploy/monitoring/rules/rampart-alerts.yml and name it in [maturity] alert_rules (and prometheus_url)",
    );

    // Resilience.
    let objective = model.slo.ttft_p99_ms.or(model.latency_objective_ms);
    c.add(
        "resilience.objective",
        Section::Resilience,
        Level::Staging,
        "a latency objective the admission and the breaker hold",
        pass_if(objective.is_some()),
        match (model.slo.ttft_p99_ms, model.latency_objective_ms) {
            (Some(t), _) => format!("[models.slo] ttft_p99_ms = {t}"),
            (None, Some(l)) => format!("latency_objective_ms = {l}"),
            (None, None) => "no objective".into(),
        },
        format!("set [models.slo] ttft_p99_ms (or latency_objective_ms) for {name}"),
    );
    c.add(
        "resilience.fallback",
        Section::Resilience,
        Level::Production,
        "a fallback chain answers when the model cannot",
        pass_if(!model.fallback.is_empty()),
        if model.fallback.is_empty() {
            "no fallback steps".to_string()
        } else {
            format!("{} fallback steps", model.fallback.len())
        },
        format!("add [[models.fallback]] steps to {name} (docs/resilience.md)"),
    );
    c.add(
        "resilience.degradation",
        Section::Resilience,
        Level::Production,
        "the degradation controllers adapt batches and admission under pressure",
        pass_if(config.degradation.enabled),
        if config.degradation.enabled { "[degradation] enabled" } else { "[degradation] enabled = false" },
        "set [degradation] enabled = true",
    );

    // Audit and security.
    let keys = !config.insecure_no_auth && config.api_keys_file.is_some();
    c.add(
        "security.api_keys",
        Section::AuditSecurity,
        Level::Experimental,
        "every route needs an API key",
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
        "audit.enabled",
        Section::AuditSecurity,
        Level::Staging,
        "every request and action is in the tamper-evident audit log",
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
        "security.guard",
        Section::AuditSecurity,
        Level::Staging,
        "the prompt-injection guard judges its inputs",
        if is_llm { pass_if(guard_on) } else { Outcome::NotApplicable },
        if is_llm {
            format!("guard {}, mode {guard_mode:?}", if guard_on { "on" } else { "off" })
        } else {
            "not a language model".into()
        },
        format!("remove guard.enabled = false for {name}"),
    );
    c.add(
        "security.guard_blocks",
        Section::AuditSecurity,
        Level::Production,
        "the guard refuses what it catches (mode block)",
        if is_llm {
            pass_if(guard_on && guard_mode == guard::Mode::Block)
        } else {
            Outcome::NotApplicable
        },
        if is_llm { format!("mode {guard_mode:?}") } else { "not a language model".into() },
        "set the guard's mode = \"block\" once its shadow measurements are good (docs/guard.md)",
    );
    let required = config.audit.enabled && config.audit.mode() == audit::Mode::FailClosed;
    c.add(
        "audit.required",
        Section::AuditSecurity,
        Level::Production,
        "nothing is served that the audit log did not keep (fail closed)",
        pass_if(required),
        format!("[audit] mode {:?}", config.audit.mode()),
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
        "security.doctor",
        Section::AuditSecurity,
        Level::Production,
        "the host passes the doctor's preflight (no error)",
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
            format!("{} holds {ALERT_GROUP}, loaded by Prometheus", file.display()),
        ),
        Some(Ok(false)) => (
            false,
            format!("{} holds {ALERT_GROUP}, but Prometheus has not loaded it", file.display()),
        ),
        Some(Err(e)) => (false, format!("Prometheus could not be asked: {e}")),
    }
}

/// Asks Prometheus (`GET /api/v1/rules`) whether it has loaded Rampart's alert group.
pub async fn alerts_loaded(prometheus_url: &str) -> Result<bool, String> {
    let url = format!("{}/api/v1/rules?type=alert", prometheus_url.trim_end_matches('/'));
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
pub fn version_of(repository: &Repository, reference: &str) -> Result<ModelVersion, repo::RepoError> {
    repository.resolve(&reference.parse::<repo::ModelRef>()?)
}
