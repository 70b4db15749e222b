//! The release plan file, `models/<name>/release.toml`: which version is stable, which one is the
//! candidate, how traffic moves to it (mode, schedule), how it is judged (thresholds), the gates
//! and approvals, the controller's state and the history of its decisions.
//!
//! The file is the release's single source of truth and a GitOps surface: a human (or a Git
//! commit) may edit it, the controller rewrites it atomically (`save_atomic`) whenever it decides
//! something. Its layout is meant for humans: settings first (`stable`, `candidate`, `mode`,
//! `[schedule]`, `[judge]`, `[gates]`, `[approval]`, `[routing]`), then `[state]`, then the
//! `[[history]]` of decisions (the last `HISTORY_MAX`).
//!
//! Units: `schedule.steps` are percentages of traffic (5, 20, 50, 100); `state.weight` is the
//! candidate's share as a fraction in [0, 1] (0.05 at the 5% step). Times are milliseconds since
//! the Unix epoch (`*_ms`), durations in the schedule are seconds (`*_secs`).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::controller::Decision;

/// The plan's file name, beside the model's versions in the repository.
pub const PLAN_FILE: &str = "release.toml";

/// Where `model`'s plan lives in the repository `repo`. The name must be one folder name (no
/// separator, NUL, `.` or `..`, at most 64 bytes): a name from a route or a command can never
/// place the plan outside the repository.
pub fn plan_path(repo: &Path, model: &str) -> Result<std::path::PathBuf, ReleaseError> {
    let plain = !model.is_empty()
        && model.len() <= 64
        && model != "."
        && model != ".."
        && !model.contains(['/', '\\', '\0']);
    if !plain {
        return Err(ReleaseError::invalid(
            "model",
            format!("{model:?} is not a model name"),
        ));
    }
    Ok(repo.join(model).join(PLAN_FILE))
}

/// How many decisions the plan file keeps (the oldest are dropped first).
pub const HISTORY_MAX: usize = 200;

/// Errors of the release crate. Each says which field or command is at fault.
#[derive(Debug, thiserror::Error)]
pub enum ReleaseError {
    #[error("release plan {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("release plan {path}: not valid TOML for a plan: {message}")]
    Parse { path: String, message: String },
    #[error("release plan: cannot write TOML: {0}")]
    Serialize(String),
    #[error("release plan: `{field}` {problem}")]
    Invalid {
        field: &'static str,
        problem: String,
    },
    #[error("release command `{command}` refused: {reason}")]
    Refused {
        command: &'static str,
        reason: String,
    },
}

impl ReleaseError {
    fn invalid(field: &'static str, problem: impl Into<String>) -> Self {
        ReleaseError::Invalid {
            field,
            problem: problem.into(),
        }
    }
}

/// Which side of a release a request (or a sample) belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Variant {
    Stable,
    Candidate,
    /// A second copy of the stable version, loaded for the release, that serves as many users as
    /// the candidate (`[routing] control`): the latency tests' reference, under the same load as
    /// the candidate.
    Control,
}

impl Variant {
    pub fn as_str(self) -> &'static str {
        match self {
            Variant::Stable => "stable",
            Variant::Candidate => "candidate",
            Variant::Control => "control",
        }
    }
}

/// How the candidate receives traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// A sticky share of users (the current step's weight) is served by the candidate.
    #[default]
    Canary,
    /// Explicit groups (named in a request header) pick their variant; requests without a known
    /// group are split by weight as in `canary`.
    Ab,
    /// Everyone is served by the stable; a share of requests (`routing.shadow_share`) is
    /// mirrored to the candidate (and to the control), whose answers are discarded after being
    /// compared. The schedule's steps are successive judged windows; after the last one the
    /// promotion always waits for an approval (no user has been served by the candidate).
    Shadow,
}

/// The traffic schedule: the candidate's share at each step and what a step needs to conclude.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Schedule {
    /// The candidate's share at each step, in percent, increasing, the last one 100.
    pub steps: Vec<f64>,
    /// A step lasts at least this long before it may pass.
    pub min_step_secs: u64,
    /// A step needs at least this many candidate samples before it may pass.
    pub min_samples: u64,
    /// Without a conclusion after this long (too few samples), the release holds and alerts.
    pub max_step_secs: u64,
    /// After `min_step_secs`, no request of either variant for this long means traffic stopped: hold.
    pub stall_secs: u64,
}

impl Default for Schedule {
    fn default() -> Self {
        Self {
            steps: vec![5.0, 20.0, 50.0, 100.0],
            min_step_secs: 60,
            min_samples: 100,
            max_step_secs: 1800,
            stall_secs: 60,
        }
    }
}

/// The judge's thresholds: how much worse than the stable the candidate may be.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JudgeConfig {
    /// The bound on the probability that a candidate no worse than the thresholds is rolled back
    /// during a step (split over the tests, see `judge`).
    pub alpha: f64,
    /// Latency (TTFT, time per output token, or E2E for tensor models): the candidate's p95 may be
    /// at most this multiple of the stable's.
    pub latency_ratio: f64,
    /// Error rate: the candidate's may exceed the stable's by at most this many percentage points.
    pub error_rate_points: f64,
    /// Output entropy: the spread (std, nats) of the candidate's per-request mean entropy may move
    /// by at most this much from the stable's.
    pub entropy_std_max: f64,
    /// Output entropy: the mean (nats) may move by at most this much (off when absent).
    pub entropy_mean_shift: Option<f64>,
    /// Confidence (classifiers, detectors): the mean may drop by at most this much (off when absent).
    pub confidence_drop: Option<f64>,
    /// Feedback: the helpful rate may drop by at most this many points (off when absent).
    pub helpful_rate_points: Option<f64>,
    /// With `helpful_rate_points`: ratings (helpful or not) of each variant's answers a step
    /// needs before it can pass (ratings come after the requests they rate).
    pub min_ratings: u64,
    /// Shadow mode: the candidate's answers must agree with the control's on at least this share
    /// of the mirrored requests (off when absent: the agreement rate is reported either way). For
    /// a candidate meant to answer as the stable does (a re-quantization, a runtime upgrade).
    pub agreement_min: Option<f64>,
    /// A drift alarm of the candidate's monitors (and not the stable's) rolls back.
    pub drift: bool,
}

impl Default for JudgeConfig {
    fn default() -> Self {
        Self {
            alpha: 0.01,
            latency_ratio: 1.10,
            error_rate_points: 0.5,
            entropy_std_max: 0.05,
            entropy_mean_shift: None,
            confidence_drop: None,
            helpful_rate_points: None,
            min_ratings: 200,
            agreement_min: None,
            drift: true,
        }
    }
}

/// Manual hooks: when set, the controller waits in `awaiting_approval` for an `approve` command.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Approval {
    /// Wait for approval before the first step.
    pub start: bool,
    /// Wait for approval before promoting (after the last step passed).
    pub promote: bool,
    /// The candidate's tokenizer differs from the stable's and a human said that is intended.
    /// Without it, a release whose tokenizer changed refuses to start.
    pub tokenizer_change_approved: bool,
}

/// How a request is assigned to a variant. The headers that name a request's user and group
/// are the server's (`[releases] user_header`, `group_header`), the same for every model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Routing {
    /// A/B mode: group name → the variant that serves it.
    pub groups: BTreeMap<String, Variant>,
    /// Shadow mode: the share (0..=1) of requests mirrored to the candidate.
    pub shadow_share: f64,
    /// Canary and A/B: a second copy of the stable version (the control) serves as many users as
    /// the candidate (shadow: it answers the same mirrored requests as the candidate, and the
    /// answers are compared), and the judge compares the candidate's latency with it rather than
    /// with the stable, which batches the rest of the traffic (on one machine engines under different
    /// loads answer at different speeds, whichever version they run); errors, entropy and
    /// confidence are still compared with every stable sample. Costs one more copy of the stable
    /// in memory while the release runs; `false` judges latency against the stable itself.
    pub control: bool,
}

impl Default for Routing {
    fn default() -> Self {
        Self {
            groups: BTreeMap::new(),
            shadow_share: 0.1,
            control: true,
        }
    }
}

impl Routing {
    /// The share of users the control serves at the candidate's weight `w`: as many as the
    /// candidate, at most what the stable has left, none outside (0, 1) or when off.
    pub fn control_share(&self, w: f64) -> f64 {
        if !self.control || w <= 0.0 || w >= 1.0 {
            return 0.0;
        }
        w.min(1.0 - w)
    }

    /// The variant the judge compares the candidate with.
    pub fn reference(&self) -> Variant {
        if self.control {
            Variant::Control
        } else {
            Variant::Stable
        }
    }
}

/// Where a release stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// No release: the stable serves everything.
    #[default]
    Idle,
    /// A candidate is named; the gates run before any traffic.
    Gating,
    /// Waiting for an `approve` command (before the first step, or before promoting).
    AwaitingApproval,
    /// The candidate serves the current step's weight and is judged.
    Running,
    /// Frozen by a command: the weight stays, the schedule does not move.
    Paused,
    /// Frozen by the controller for lack of data (alerting): the weight stays.
    Holding,
    /// The last release ended with the candidate becoming the stable.
    Promoted,
    /// The last release ended with the candidate rejected.
    RolledBack,
}

impl Phase {
    /// Whether a release is under way (a new one cannot start).
    pub fn is_active(self) -> bool {
        matches!(
            self,
            Phase::Gating
                | Phase::AwaitingApproval
                | Phase::Running
                | Phase::Paused
                | Phase::Holding
        )
    }
}

/// The controller's state, written back into the plan at each decision.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReleaseState {
    pub phase: Phase,
    /// Index into `schedule.steps`.
    pub step: usize,
    /// The candidate's share of traffic, a fraction in [0, 1].
    pub weight: f64,
    /// The salt of the sticky hash, fixed for a release: `<stable>→<candidate>@<started_ms>`.
    pub release_id: String,
    pub started_ms: u64,
    pub step_started_ms: u64,
    /// Why the state is what it is (the last decision's reason).
    pub reason: Option<String>,
}

/// The release plan: settings, state and history (see the module doc for the file layout).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleasePlan {
    /// The version that serves by default.
    pub stable: String,
    /// The version being released, if any.
    #[serde(default)]
    pub candidate: Option<String>,
    #[serde(default)]
    pub mode: Mode,
    #[serde(default)]
    pub schedule: Schedule,
    #[serde(default)]
    pub judge: JudgeConfig,
    /// Gate settings, interpreted by `gates` (kept verbatim here).
    #[serde(default, skip_serializing_if = "toml::Table::is_empty")]
    pub gates: toml::Table,
    #[serde(default)]
    pub approval: Approval,
    #[serde(default)]
    pub routing: Routing,
    #[serde(default)]
    pub state: ReleaseState,
    /// The controller's decisions, oldest first, at most `HISTORY_MAX`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<Decision>,
}

impl ReleasePlan {
    /// A plan with only a stable version and the defaults.
    pub fn new(stable: impl Into<String>) -> Self {
        Self {
            stable: stable.into(),
            candidate: None,
            mode: Mode::default(),
            schedule: Schedule::default(),
            judge: JudgeConfig::default(),
            gates: toml::Table::new(),
            approval: Approval::default(),
            routing: Routing::default(),
            state: ReleaseState::default(),
            history: Vec::new(),
        }
    }

    /// Parses and validates a plan from TOML text.
    pub fn from_toml_str(text: &str) -> Result<Self, ReleaseError> {
        let plan: ReleasePlan = toml::from_str(text).map_err(|e| ReleaseError::Parse {
            path: "<text>".to_string(),
            message: e.to_string(),
        })?;
        plan.validate()?;
        Ok(plan)
    }

    /// Reads and validates `release.toml`.
    pub fn load(path: &Path) -> Result<Self, ReleaseError> {
        let text = std::fs::read_to_string(path).map_err(|source| ReleaseError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_toml_str(&text).map_err(|e| match e {
            ReleaseError::Parse { message, .. } => ReleaseError::Parse {
                path: path.display().to_string(),
                message,
            },
            other => other,
        })
    }

    /// The plan as TOML (settings, then state, then history).
    pub fn to_toml_string(&self) -> Result<String, ReleaseError> {
        toml::to_string(self).map_err(|e| ReleaseError::Serialize(e.to_string()))
    }

    /// Writes the plan atomically: a temporary file in the same directory, fsync, rename over
    /// `path`, fsync of the directory. A reader sees the old file or the new one, never a part.
    pub fn save_atomic(&self, path: &Path) -> Result<(), ReleaseError> {
        self.validate()?;
        let text = self.to_toml_string()?;
        let io_err = |source| ReleaseError::Io {
            path: path.display().to_string(),
            source,
        };
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => std::path::PathBuf::from("."),
        };
        let file_name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "release.toml".to_string());
        let tmp = dir.join(format!(".{file_name}.tmp.{}", std::process::id()));
        let result = (|| {
            let mut file = std::fs::File::create(&tmp)?;
            file.write_all(text.as_bytes())?;
            file.sync_all()?;
            drop(file);
            std::fs::rename(&tmp, path)?;
            // The rename is durable once the directory entry is.
            if let Ok(d) = std::fs::File::open(&dir) {
                d.sync_all()?;
            }
            Ok(())
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result.map_err(io_err)
    }

    /// Checks the settings; the error names the field.
    pub fn validate(&self) -> Result<(), ReleaseError> {
        if self.stable.trim().is_empty() {
            return Err(ReleaseError::invalid("stable", "must name a version"));
        }
        if let Some(c) = &self.candidate {
            if c.trim().is_empty() {
                return Err(ReleaseError::invalid(
                    "candidate",
                    "must name a version when present",
                ));
            }
            if *c == self.stable {
                return Err(ReleaseError::invalid(
                    "candidate",
                    format!("is the stable version ({c})"),
                ));
            }
        }
        let steps = &self.schedule.steps;
        if steps.is_empty() {
            return Err(ReleaseError::invalid(
                "schedule.steps",
                "needs at least one step",
            ));
        }
        let mut previous = 0.0;
        for &s in steps {
            if !(s > previous && s <= 100.0) {
                return Err(ReleaseError::invalid(
                    "schedule.steps",
                    format!("must increase within (0, 100]; {s} after {previous}"),
                ));
            }
            previous = s;
        }
        if previous != 100.0 {
            return Err(ReleaseError::invalid(
                "schedule.steps",
                format!("must end at 100, ends at {previous}"),
            ));
        }
        if steps.len() < 2 {
            return Err(ReleaseError::invalid(
                "schedule.steps",
                "needs a step below 100 (the candidate is judged against the concurrent stable there)",
            ));
        }
        if self.schedule.max_step_secs < self.schedule.min_step_secs {
            return Err(ReleaseError::invalid(
                "schedule.max_step_secs",
                "must be at least schedule.min_step_secs",
            ));
        }
        if self.schedule.stall_secs == 0 {
            return Err(ReleaseError::invalid(
                "schedule.stall_secs",
                "must be positive",
            ));
        }
        let j = &self.judge;
        if !(j.alpha > 0.0 && j.alpha < 0.5) {
            return Err(ReleaseError::invalid("judge.alpha", "must be in (0, 0.5)"));
        }
        if !(j.latency_ratio >= 1.0 && j.latency_ratio.is_finite()) {
            return Err(ReleaseError::invalid(
                "judge.latency_ratio",
                "must be a finite number ≥ 1",
            ));
        }
        let positive = [
            ("judge.error_rate_points", Some(j.error_rate_points)),
            ("judge.entropy_std_max", Some(j.entropy_std_max)),
            ("judge.entropy_mean_shift", j.entropy_mean_shift),
            ("judge.confidence_drop", j.confidence_drop),
            ("judge.helpful_rate_points", j.helpful_rate_points),
        ];
        for (field, value) in positive {
            if let Some(v) = value {
                if !(v > 0.0 && v.is_finite()) {
                    return Err(ReleaseError::invalid(
                        field,
                        format!("must be positive, is {v}"),
                    ));
                }
            }
        }
        if let Some((group, _)) = self
            .routing
            .groups
            .iter()
            .find(|(_, v)| **v == Variant::Control)
        {
            return Err(ReleaseError::invalid(
                "routing.groups",
                format!("group {group:?}: a group is served by `stable` or `candidate`"),
            ));
        }
        if j.min_ratings < 10 {
            return Err(ReleaseError::invalid(
                "judge.min_ratings",
                format!("must be at least 10, is {}", j.min_ratings),
            ));
        }
        if let Some(a) = j.agreement_min {
            if !(a > 0.0 && a <= 1.0) {
                return Err(ReleaseError::invalid(
                    "judge.agreement_min",
                    format!("must be in (0, 1], is {a}"),
                ));
            }
        }
        if !(0.0..=1.0).contains(&self.routing.shadow_share) {
            return Err(ReleaseError::invalid(
                "routing.shadow_share",
                "must be in [0, 1]",
            ));
        }
        if !(0.0..=1.0).contains(&self.state.weight) {
            return Err(ReleaseError::invalid("state.weight", "must be in [0, 1]"));
        }
        if self.state.step >= steps.len() {
            return Err(ReleaseError::invalid(
                "state.step",
                format!(
                    "is {} but the schedule has {} steps",
                    self.state.step,
                    steps.len()
                ),
            ));
        }
        if self.state.phase.is_active() && self.candidate.is_none() {
            return Err(ReleaseError::invalid(
                "candidate",
                "is required while a release is under way",
            ));
        }
        Ok(())
    }

    /// Appends a decision, keeping the last `HISTORY_MAX`.
    pub fn push_history(&mut self, decision: Decision) {
        self.history.push(decision);
        if self.history.len() > HISTORY_MAX {
            let excess = self.history.len() - HISTORY_MAX;
            self.history.drain(..excess);
        }
    }

    /// The weight (fraction) of a step of the schedule.
    pub fn step_weight(&self, step: usize) -> f64 {
        self.schedule
            .steps
            .get(step)
            .map(|p| (p / 100.0).clamp(0.0, 1.0))
            .unwrap_or(1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"
stable = "v3"
candidate = "v4"
mode = "canary"

[schedule]
steps = [10.0, 50.0, 100.0]
min_step_secs = 30

[judge]
latency_ratio = 1.2
entropy_mean_shift = 0.3

[gates]
golden = "golden/v1.jsonl"
min_accuracy = 0.9

[approval]
promote = true

[routing]
groups = { beta = "candidate", control = "stable" }

[state]
phase = "running"
step = 1
weight = 0.5
release_id = "v3→v4@1000"
"#;

    #[test]
    fn parses_a_hand_written_plan_and_keeps_defaults() {
        let plan = ReleasePlan::from_toml_str(EXAMPLE).unwrap();
        assert_eq!(plan.candidate.as_deref(), Some("v4"));
        assert_eq!(plan.schedule.steps, vec![10.0, 50.0, 100.0]);
        assert_eq!(plan.schedule.min_samples, 100);
        assert_eq!(plan.judge.latency_ratio, 1.2);
        assert_eq!(plan.judge.alpha, 0.01);
        assert_eq!(plan.judge.entropy_mean_shift, Some(0.3));
        assert_eq!(
            plan.gates.get("min_accuracy").unwrap().as_float(),
            Some(0.9)
        );
        assert!(plan.approval.promote && !plan.approval.start);
        assert_eq!(plan.routing.groups.get("beta"), Some(&Variant::Candidate));
        assert_eq!(plan.state.phase, Phase::Running);
        assert_eq!(plan.state.weight, 0.5);
        assert_eq!(plan.step_weight(0), 0.1);
    }

    #[test]
    fn round_trips_through_the_file_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("release.toml");
        let mut plan = ReleasePlan::from_toml_str(EXAMPLE).unwrap();
        plan.push_history(crate::controller::Decision::test_example());
        plan.save_atomic(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        // Settings first, then state, then history: pleasant to read and to diff.
        let settings = text.find("[schedule]").unwrap();
        let state = text.find("[state]").unwrap();
        let history = text.find("[[history]]").unwrap();
        assert!(text.starts_with("stable = "), "{text}");
        assert!(settings < state && state < history, "{text}");
        let back = ReleasePlan::load(&path).unwrap();
        assert_eq!(back, plan);
        // No temporary file is left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn validation_names_the_field() {
        let cases = [
            ("stable = \"v1\"\ncandidate = \"v1\"", "candidate"),
            (
                "stable = \"v1\"\n[schedule]\nsteps = [5.0, 50.0]",
                "schedule.steps",
            ),
            (
                "stable = \"v1\"\n[schedule]\nsteps = [50.0, 20.0, 100.0]",
                "schedule.steps",
            ),
            (
                "stable = \"v1\"\n[judge]\nlatency_ratio = 0.5",
                "judge.latency_ratio",
            ),
            (
                "stable = \"v1\"\n[judge]\nerror_rate_points = -1.0",
                "judge.error_rate_points",
            ),
            ("stable = \"v1\"\n[judge]\nalpha = 0.0", "judge.alpha"),
            ("stable = \"v1\"\n[state]\nphase = \"running\"", "candidate"),
            (
                "stable = \"v1\"\n[routing]\ngroups = { qa = \"control\" }",
                "routing.groups",
            ),
        ];
        for (text, field) in cases {
            match ReleasePlan::from_toml_str(text) {
                Err(ReleaseError::Invalid { field: f, .. }) => assert_eq!(f, field, "{text}"),
                other => panic!("{text}: expected an invalid {field}, got {other:?}"),
            }
        }
    }

    #[test]
    fn unknown_fields_are_refused() {
        let err =
            ReleasePlan::from_toml_str("stable = \"v1\"\n[judge]\nlatency = 1.2").unwrap_err();
        assert!(err.to_string().contains("latency"), "{err}");
        let err = ReleasePlan::from_toml_str("stable = \"v1\"\nweights = [1]").unwrap_err();
        assert!(matches!(err, ReleaseError::Parse { .. }), "{err}");
    }

    #[test]
    fn history_is_bounded() {
        let mut plan = ReleasePlan::new("v1");
        for i in 0..(HISTORY_MAX + 7) {
            let mut d = crate::controller::Decision::test_example();
            d.time_ms = i as u64;
            plan.push_history(d);
        }
        assert_eq!(plan.history.len(), HISTORY_MAX);
        assert_eq!(plan.history[0].time_ms, 7);
    }
}
