//! The gates a candidate passes before it gets any traffic, as pure functions over results the
//! server computes (it runs each golden input through stable and candidate, times them, computes
//! pre-processing outputs; nothing here runs a model).
//!
//! - [`eval_gate`]: accuracy, per-class precision/recall, recall floors, a weighted error cost
//!   (declared unacceptable confusions weigh ×10), mAP@0.5 for detectors; the candidate must meet
//!   the floors and not regress against stable by more than the margin (or beat it by the margin
//!   when the plan says `must_improve`).
//! - [`latency_gate`]: candidate p95 ≤ 1.1 × stable p95, measured on the same machine in the
//!   same run.
//! - [`data_quality_gate`]: a dataset version's missing-value share, its label distribution
//!   against the previous version (KL divergence) and its image size consistency.
//! - [`feature_consistency_gate`]: stable and candidate pre-processing (or embeddings) on the
//!   same samples must agree (cosine similarity ≥ 0.999 for ≥ 95% of them); this is what catches
//!   a resize that changed from bilinear to lanczos.
//!
//! Every gate returns a [`GateReport`]: a verdict, every reason for a refusal (which floor, which
//! class, the numbers), structured metrics, and [`GateReport::table`] for the CLI. Gates fail
//! closed: input that cannot be judged (mismatched lengths, too few samples, a floor on a class the
//! golden set never shows) refuses with a reason rather than passing.
//!
//! Settings live in the release plan under `[gates]`:
//!
//! ```toml
//! [gates]
//! eval = true
//! latency = true
//! must_improve = false          # true: accuracy (and mAP) must beat stable by the margin
//! accuracy_margin_points = 0.5  # allowed regression, or required gain with must_improve
//! unacceptable = [["refund", "logistics"]]   # (expected, predicted) pairs weighing ×10
//! unacceptable_weight = 10.0
//! latency_ratio = 1.1
//! map_iou = 0.5
//! min_map = 0.6                 # optional absolute floor
//!
//! [gates.recall_floors]
//! refund = 0.95
//!
//! [gates.data_quality]
//! max_missing = 0.05
//! max_label_kl = 0.3
//! min_size_consistency = 0.99
//!
//! [gates.feature_consistency]
//! min_cosine = 0.999
//! min_share = 0.95
//! samples = 1000
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::golden::{
    DetectedBox, GoldenSet, GroundTruthBox, Prediction, FAILED_CLASS, MISMATCH_CLASS,
    NO_LABEL_CLASS, WRONG_KIND_CLASS,
};

/// Slack for comparisons of fractions computed from counts (0.905 vs 0.9 + 0.005).
const EPSILON: f64 = 1e-9;

/// Why gate settings or a dataset could not be read.
#[derive(Debug, thiserror::Error)]
pub enum GateError {
    #[error("gate settings: {0}")]
    Settings(String),
    #[error("gate settings: `{key}` {message}")]
    Invalid { key: String, message: String },
    #[error("reading dataset {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}:{line}: {message}")]
    Dataset {
        file: String,
        line: usize,
        message: String,
    },
    #[error("dataset {0} has no .jsonl or .csv file")]
    NoDataset(String),
}

/// The gate settings of a release plan (`[gates]`). Defaults follow the issue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GateSettings {
    /// Run the eval gate on the golden set.
    pub eval: bool,
    /// Run the latency gate.
    pub latency: bool,
    /// The candidate must beat stable by `accuracy_margin_points` (accuracy and mAP).
    pub must_improve: bool,
    /// Allowed regression in points (or the required gain with `must_improve`).
    pub accuracy_margin_points: f64,
    /// Optional absolute accuracy floor (a fraction).
    pub min_accuracy: Option<f64>,
    /// Per-class recall floors (fractions), e.g. `refund = 0.95`.
    pub recall_floors: BTreeMap<String, f64>,
    /// Declared unacceptable confusions, `(expected, predicted)`.
    pub unacceptable: Vec<[String; 2]>,
    /// The error cost of an unacceptable confusion (others cost 1).
    pub unacceptable_weight: f64,
    /// Allowed rise of the mean error cost per case; unset: the accuracy margin as a fraction,
    /// or 0 with `must_improve`.
    pub cost_margin: Option<f64>,
    /// IoU at which a detection matches a ground-truth box.
    pub map_iou: f64,
    /// Optional absolute mAP floor.
    pub min_map: Option<f64>,
    /// Detections at or above this score count for detector precision/recall (mAP uses all).
    pub box_score_threshold: f64,
    /// Candidate p95 must be ≤ this × stable p95.
    pub latency_ratio: f64,
    /// Fewer latency samples than this per variant refuses.
    pub latency_min_samples: usize,
    pub data_quality: DataQualitySettings,
    pub feature_consistency: FeatureConsistencySettings,
}

impl Default for GateSettings {
    fn default() -> Self {
        GateSettings {
            eval: true,
            latency: true,
            must_improve: false,
            accuracy_margin_points: 0.5,
            min_accuracy: None,
            recall_floors: BTreeMap::new(),
            unacceptable: Vec::new(),
            unacceptable_weight: 10.0,
            cost_margin: None,
            map_iou: 0.5,
            min_map: None,
            box_score_threshold: 0.5,
            latency_ratio: 1.1,
            latency_min_samples: 20,
            data_quality: DataQualitySettings::default(),
            feature_consistency: FeatureConsistencySettings::default(),
        }
    }
}

/// `[gates.data_quality]`: thresholds for a dataset version and the columns they read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataQualitySettings {
    pub enabled: bool,
    /// Largest share of missing cells (absent, null or empty).
    pub max_missing: f64,
    /// Largest KL(current ‖ previous) of the label distribution, in nats.
    pub max_label_kl: f64,
    /// Smallest share of images with the most common (width, height).
    pub min_size_consistency: f64,
    /// Additive smoothing of label counts, so a label unseen in one version has a finite KL.
    pub kl_smoothing: f64,
    pub label_column: String,
    pub width_column: String,
    pub height_column: String,
}

impl Default for DataQualitySettings {
    fn default() -> Self {
        DataQualitySettings {
            enabled: true,
            max_missing: 0.05,
            max_label_kl: 0.3,
            min_size_consistency: 0.99,
            kl_smoothing: 0.5,
            label_column: "label".into(),
            width_column: "width".into(),
            height_column: "height".into(),
        }
    }
}

/// `[gates.feature_consistency]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FeatureConsistencySettings {
    pub enabled: bool,
    /// A sample agrees when the cosine of its two feature vectors is at least this.
    pub min_cosine: f64,
    /// Share of samples that must agree.
    pub min_share: f64,
    /// How many samples the server should compare; fewer refuses.
    pub samples: usize,
}

impl Default for FeatureConsistencySettings {
    fn default() -> Self {
        FeatureConsistencySettings {
            enabled: true,
            min_cosine: 0.999,
            min_share: 0.95,
            samples: 1000,
        }
    }
}

impl GateSettings {
    /// Reads the `[gates]` table of a release plan and validates it.
    pub fn from_table(table: &toml::Table) -> Result<GateSettings, GateError> {
        let settings: GateSettings = table
            .clone()
            .try_into()
            .map_err(|e: toml::de::Error| GateError::Settings(e.message().to_owned()))?;
        settings.validate()?;
        Ok(settings)
    }

    /// Checks ranges: fractions in [0, 1], ratios and weights positive.
    pub fn validate(&self) -> Result<(), GateError> {
        let invalid = |key: &str, message: &str| {
            Err(GateError::Invalid {
                key: key.to_owned(),
                message: message.to_owned(),
            })
        };
        let fraction = |v: f64| (0.0..=1.0).contains(&v);
        if !(self.accuracy_margin_points.is_finite()
            && (0.0..=100.0).contains(&self.accuracy_margin_points))
        {
            return invalid("accuracy_margin_points", "must be in [0, 100] (points)");
        }
        for (class, floor) in &self.recall_floors {
            if !fraction(*floor) {
                return invalid(
                    &format!("recall_floors.{class}"),
                    "must be a fraction in [0, 1] (0.95, not 95)",
                );
            }
        }
        let optional_fractions = [
            ("min_accuracy", self.min_accuracy),
            ("min_map", self.min_map),
        ];
        for (key, value) in optional_fractions {
            if value.is_some_and(|v| !fraction(v)) {
                return invalid(key, "must be a fraction in [0, 1]");
            }
        }
        if self
            .cost_margin
            .is_some_and(|m| !(m.is_finite() && m >= 0.0))
        {
            return invalid("cost_margin", "must be non-negative");
        }
        if !(self.map_iou > 0.0 && self.map_iou <= 1.0) {
            return invalid("map_iou", "must be in (0, 1]");
        }
        if !fraction(self.box_score_threshold) {
            return invalid("box_score_threshold", "must be in [0, 1]");
        }
        if !(self.unacceptable_weight.is_finite() && self.unacceptable_weight >= 1.0) {
            return invalid("unacceptable_weight", "must be at least 1");
        }
        if !(self.latency_ratio.is_finite() && self.latency_ratio > 0.0) {
            return invalid("latency_ratio", "must be positive");
        }
        if self.latency_min_samples == 0 {
            return invalid("latency_min_samples", "must be at least 1");
        }
        let dq = &self.data_quality;
        if !fraction(dq.max_missing) {
            return invalid("data_quality.max_missing", "must be in [0, 1]");
        }
        if !(dq.max_label_kl.is_finite() && dq.max_label_kl >= 0.0) {
            return invalid("data_quality.max_label_kl", "must be non-negative");
        }
        if !fraction(dq.min_size_consistency) {
            return invalid("data_quality.min_size_consistency", "must be in [0, 1]");
        }
        if !(dq.kl_smoothing.is_finite() && dq.kl_smoothing > 0.0) {
            return invalid("data_quality.kl_smoothing", "must be positive");
        }
        let fc = &self.feature_consistency;
        if !(-1.0..=1.0).contains(&fc.min_cosine) {
            return invalid("feature_consistency.min_cosine", "must be in [-1, 1]");
        }
        if !fraction(fc.min_share) {
            return invalid("feature_consistency.min_share", "must be in [0, 1]");
        }
        if fc.samples == 0 {
            return invalid("feature_consistency.samples", "must be at least 1");
        }
        Ok(())
    }

    fn margin(&self) -> f64 {
        self.accuracy_margin_points / 100.0
    }
}

// ---------------------------------------------------------------------------------------------
// Reports
// ---------------------------------------------------------------------------------------------

/// How a number in a check is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ValueFormat {
    Percent,
    Millis,
    Plain,
    /// Six decimals, for cosines near 1.
    Fine,
}

/// One compared number: stable, candidate, what was required, and whether it held.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Check {
    pub metric: String,
    pub stable: Option<f64>,
    pub candidate: Option<f64>,
    pub required: String,
    pub passed: bool,
    pub format: ValueFormat,
}

/// The result of one gate, kept with the release.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GateReport {
    /// `eval`, `latency`, `data_quality` or `feature_consistency`.
    pub gate: String,
    pub passed: bool,
    /// Every reason for a refusal; empty when passed.
    pub reasons: Vec<String>,
    /// Remarks that do not refuse (a check skipped for want of a stable, failed model calls…).
    pub notes: Vec<String>,
    pub checks: Vec<Check>,
    pub metrics: GateMetrics,
}

/// A gate's structured numbers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GateMetrics {
    Eval(Box<EvalMetrics>),
    Latency(LatencyMetrics),
    DataQuality(DataQualityMetrics),
    FeatureConsistency(FeatureMetrics),
    /// The gate was disabled, or its input could not be judged at all.
    Unavailable,
}

impl GateReport {
    fn new(gate: &str, metrics: GateMetrics) -> GateReport {
        GateReport {
            gate: gate.to_owned(),
            passed: true,
            reasons: Vec::new(),
            notes: Vec::new(),
            checks: Vec::new(),
            metrics,
        }
    }

    /// A gate that refuses for a reason found before it could measure anything (its input is
    /// missing or unreadable).
    pub fn refused(gate: &str, reason: String) -> GateReport {
        let mut report = GateReport::new(gate, GateMetrics::Unavailable);
        report.refuse(reason);
        report
    }

    fn disabled(gate: &str) -> GateReport {
        let mut report = GateReport::new(gate, GateMetrics::Unavailable);
        report
            .notes
            .push(format!("the {gate} gate is disabled in the release plan"));
        report
    }

    fn refuse(&mut self, reason: String) {
        self.passed = false;
        self.reasons.push(reason);
    }

    fn check(&mut self, check: Check, reason: impl FnOnce() -> String) {
        if !check.passed {
            self.refuse(reason());
        }
        self.checks.push(check);
    }

    /// A human-readable table: per class (eval), each check with stable, candidate, what was
    /// required and ✓/✗, then the reasons and notes.
    pub fn table(&self) -> String {
        let mut out = format!(
            "{} gate: {}",
            self.gate,
            if self.passed { "PASSED" } else { "REFUSED" }
        );
        if let GateMetrics::Eval(eval) = &self.metrics {
            out.push_str(&format!(
                " (golden set {}, {} cases)\n\n",
                eval.golden_digest, eval.cases
            ));
            out.push_str(&eval.class_table());
        } else {
            out.push('\n');
        }
        if !self.checks.is_empty() {
            out.push('\n');
            let rows: Vec<Vec<String>> = self
                .checks
                .iter()
                .map(|c| {
                    vec![
                        c.metric.clone(),
                        format_value(c.stable, c.format),
                        format_value(c.candidate, c.format),
                        c.required.clone(),
                        mark(Some(c.passed)).to_owned(),
                    ]
                })
                .collect();
            out.push_str(&render_table(
                &["check", "stable", "candidate", "required", ""],
                &rows,
            ));
        }
        if !self.reasons.is_empty() {
            out.push_str("\nrefused because:\n");
            for reason in &self.reasons {
                out.push_str(&format!("  - {reason}\n"));
            }
        }
        if !self.notes.is_empty() {
            out.push_str("\nnotes:\n");
            for note in &self.notes {
                out.push_str(&format!("  - {note}\n"));
            }
        }
        out
    }
}

/// Whether every gate passed.
pub fn all_passed(reports: &[GateReport]) -> bool {
    reports.iter().all(|r| r.passed)
}

/// The tables of several reports, refused ones first.
pub fn render_reports(reports: &[GateReport]) -> String {
    let mut ordered: Vec<&GateReport> = reports.iter().collect();
    ordered.sort_by_key(|r| r.passed);
    ordered
        .iter()
        .map(|r| r.table())
        .collect::<Vec<_>>()
        .join("\n")
}

fn mark(passed: Option<bool>) -> &'static str {
    match passed {
        Some(true) => "✓",
        Some(false) => "✗",
        None => "",
    }
}

fn format_value(value: Option<f64>, format: ValueFormat) -> String {
    match value {
        None => "-".to_owned(),
        Some(v) => match format {
            ValueFormat::Percent => format!("{:.1}%", v * 100.0),
            ValueFormat::Millis => format!("{v:.1} ms"),
            ValueFormat::Plain => format!("{v:.3}"),
            ValueFormat::Fine => format!("{v:.6}"),
        },
    }
}

fn percent(v: f64) -> String {
    format!("{:.1}%", v * 100.0)
}

/// First column left-aligned, the others right-aligned; widths in characters.
fn render_table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (i, cell) in cells.enumerate() {
            let pad = widths[i].saturating_sub(cell.chars().count());
            if i == 0 {
                text.push_str(cell);
                text.push_str(&" ".repeat(pad));
            } else {
                text.push_str("  ");
                text.push_str(&" ".repeat(pad));
                text.push_str(cell);
            }
        }
        text.trim_end().to_owned() + "\n"
    };
    let mut out = line(&mut header.iter().copied());
    for row in rows {
        out.push_str(&line(&mut row.iter().map(String::as_str)));
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Eval gate
// ---------------------------------------------------------------------------------------------

/// Per-class numbers of one variant. For detector classes, `support` counts ground-truth boxes,
/// `predicted` and `true_positive` count detections at or above the score threshold.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ClassStats {
    pub support: u64,
    pub predicted: u64,
    pub true_positive: u64,
    pub precision: Option<f64>,
    pub recall: Option<f64>,
    /// Detector classes with ground truth: all-point interpolated AP at `map_iou`.
    pub average_precision: Option<f64>,
}

/// One non-zero cell of the confusion matrix (diagonal included).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfusionCell {
    pub expected: String,
    pub predicted: String,
    pub count: u64,
}

/// The eval numbers of one variant on the golden set.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VariantEval {
    /// Cases judged by one answer (label, exact, regex).
    pub answer_cases: usize,
    pub correct: usize,
    pub accuracy: Option<f64>,
    /// Mean error cost per answer case: 1 per error, `unacceptable_weight` per declared
    /// unacceptable confusion.
    pub error_cost: Option<f64>,
    pub unacceptable_confusions: u64,
    /// Cases where the model call failed (counted as wrong).
    pub failed: usize,
    /// Cases whose prediction was of the wrong kind (boxes for a label case…).
    pub wrong_kind: usize,
    pub detection_cases: usize,
    /// Mean AP over detector classes with ground truth.
    pub map: Option<f64>,
    pub classes: BTreeMap<String, ClassStats>,
    pub confusion: Vec<ConfusionCell>,
}

/// A recall floor and how each variant did against it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FloorCheck {
    pub class: String,
    pub floor: f64,
    pub support: u64,
    pub stable_recall: Option<f64>,
    pub candidate_recall: Option<f64>,
    pub passed: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalMetrics {
    pub golden_digest: String,
    pub cases: usize,
    pub stable: Option<VariantEval>,
    pub candidate: VariantEval,
    pub floors: Vec<FloorCheck>,
}

impl EvalMetrics {
    fn class_table(&self) -> String {
        let mut classes: BTreeSet<&str> =
            self.candidate.classes.keys().map(String::as_str).collect();
        if let Some(stable) = &self.stable {
            classes.extend(stable.classes.keys().map(String::as_str));
        }
        // Classes only ever predicted (support 0 in both) stay in the metrics, not the table.
        let supported =
            |v: &VariantEval, class: &str| v.classes.get(class).is_some_and(|c| c.support > 0);
        classes.retain(|class| {
            supported(&self.candidate, class)
                || self.stable.as_ref().is_some_and(|s| supported(s, class))
        });
        classes.extend(self.floors.iter().map(|f| f.class.as_str()));
        let rows: Vec<Vec<String>> = classes
            .into_iter()
            .map(|class| {
                let floor = self.floors.iter().find(|f| f.class == class);
                let recall = |v: Option<&VariantEval>| {
                    v.and_then(|v| v.classes.get(class)).and_then(|c| c.recall)
                };
                let support = self.candidate.classes.get(class).map_or(0, |c| c.support);
                vec![
                    class.to_owned(),
                    support.to_string(),
                    format_value(recall(self.stable.as_ref()), ValueFormat::Percent),
                    format_value(recall(Some(&self.candidate)), ValueFormat::Percent),
                    floor.map_or("-".to_owned(), |f| format!("≥ {}", percent(f.floor))),
                    mark(floor.map(|f| f.passed)).to_owned(),
                ]
            })
            .collect();
        render_table(
            &[
                "class",
                "support",
                "stable recall",
                "candidate recall",
                "floor",
                "",
            ],
            &rows,
        )
    }
}

/// Judges the candidate's predictions (and stable's, when there is a stable) on the golden set.
/// Predictions are in the order of [`GoldenSet::cases`].
pub fn eval_gate(
    settings: &GateSettings,
    golden: &GoldenSet,
    stable: Option<&[Prediction]>,
    candidate: &[Prediction],
) -> GateReport {
    const GATE: &str = "eval";
    if !settings.eval {
        return GateReport::disabled(GATE);
    }
    for (variant, predictions) in [("candidate", Some(candidate)), ("stable", stable)] {
        if let Some(predictions) = predictions {
            if predictions.len() != golden.len() {
                return GateReport::refused(
                    GATE,
                    format!(
                        "{} predictions from {variant} for {} golden cases",
                        predictions.len(),
                        golden.len()
                    ),
                );
            }
        }
    }
    let stable_eval = stable.map(|p| evaluate_variant(settings, golden, p));
    let candidate_eval = evaluate_variant(settings, golden, candidate);

    let floors: Vec<FloorCheck> = settings
        .recall_floors
        .iter()
        .map(|(class, floor)| {
            let stats = candidate_eval.classes.get(class);
            let candidate_recall = stats.and_then(|s| s.recall);
            FloorCheck {
                class: class.clone(),
                floor: *floor,
                support: stats.map_or(0, |s| s.support),
                stable_recall: stable_eval
                    .as_ref()
                    .and_then(|s| s.classes.get(class))
                    .and_then(|s| s.recall),
                candidate_recall,
                passed: candidate_recall.is_some_and(|r| r + EPSILON >= *floor),
            }
        })
        .collect();

    let mut report = GateReport::new(GATE, GateMetrics::Unavailable);
    for floor in &floors {
        if floor.passed {
            continue;
        }
        match floor.candidate_recall {
            None => report.refuse(format!(
                "recall floor on `{}` ({}) cannot be checked: the golden set has no case of that class",
                floor.class,
                percent(floor.floor)
            )),
            Some(recall) => report.refuse(format!(
                "class `{}`: candidate recall {} is below the floor {} ({} cases{})",
                floor.class,
                percent(recall),
                percent(floor.floor),
                floor.support,
                floor
                    .stable_recall
                    .map(|r| format!(", stable {}", percent(r)))
                    .unwrap_or_default()
            )),
        }
    }

    let margin = settings.margin();
    let stable_accuracy = stable_eval.as_ref().and_then(|s| s.accuracy);
    if let Some(accuracy) = candidate_eval.accuracy {
        if let Some(min) = settings.min_accuracy {
            report.check(
                Check {
                    metric: "accuracy (floor)".into(),
                    stable: stable_accuracy,
                    candidate: Some(accuracy),
                    required: format!("≥ {}", percent(min)),
                    passed: accuracy + EPSILON >= min,
                    format: ValueFormat::Percent,
                },
                || {
                    format!(
                        "candidate accuracy {} is below the floor {}",
                        percent(accuracy),
                        percent(min)
                    )
                },
            );
        }
        compare_to_stable(
            &mut report,
            settings,
            "accuracy",
            stable_accuracy,
            accuracy,
            margin,
            ValueFormat::Percent,
        );
        if let Some(cost) = candidate_eval.error_cost {
            let stable_cost = stable_eval.as_ref().and_then(|s| s.error_cost);
            let allowed =
                settings
                    .cost_margin
                    .unwrap_or(if settings.must_improve { 0.0 } else { margin });
            match stable_cost {
                Some(stable_cost) => {
                    let limit = stable_cost + allowed;
                    report.check(
                        Check {
                            metric: "error cost / case".into(),
                            stable: Some(stable_cost),
                            candidate: Some(cost),
                            required: format!("≤ {limit:.3}"),
                            passed: cost <= limit + EPSILON,
                            format: ValueFormat::Plain,
                        },
                        || {
                            format!(
                                "candidate error cost {cost:.3} per case exceeds stable {stable_cost:.3} + {allowed:.3} ({} unacceptable confusions, stable {})",
                                candidate_eval.unacceptable_confusions,
                                stable_eval.as_ref().map_or(0, |s| s.unacceptable_confusions)
                            )
                        },
                    );
                }
                None => report.checks.push(Check {
                    metric: "error cost / case".into(),
                    stable: None,
                    candidate: Some(cost),
                    required: "-".into(),
                    passed: true,
                    format: ValueFormat::Plain,
                }),
            }
        }
    }
    if let Some(map) = candidate_eval.map {
        let stable_map = stable_eval.as_ref().and_then(|s| s.map);
        let metric = format!("mAP@{}", settings.map_iou);
        if let Some(min) = settings.min_map {
            report.check(
                Check {
                    metric: format!("{metric} (floor)"),
                    stable: stable_map,
                    candidate: Some(map),
                    required: format!("≥ {min:.3}"),
                    passed: map + EPSILON >= min,
                    format: ValueFormat::Plain,
                },
                || format!("candidate {metric} {map:.3} is below the floor {min:.3}"),
            );
        }
        compare_to_stable(
            &mut report,
            settings,
            &metric,
            stable_map,
            map,
            margin,
            ValueFormat::Plain,
        );
    }
    if candidate_eval.accuracy.is_none() && candidate_eval.map.is_none() {
        report.refuse("the golden set gave neither an accuracy nor an mAP to judge".into());
    }
    if stable_eval.is_none() {
        report
            .notes
            .push("no stable variant: only the absolute floors were checked".into());
    }
    for (variant, eval) in [
        ("candidate", Some(&candidate_eval)),
        ("stable", stable_eval.as_ref()),
    ] {
        let Some(eval) = eval else { continue };
        if eval.failed > 0 {
            report.notes.push(format!(
                "{variant}: {} cases failed (counted as wrong)",
                eval.failed
            ));
        }
        if eval.wrong_kind > 0 {
            report.notes.push(format!(
                "{variant}: {} predictions of the wrong kind for their case (counted as wrong)",
                eval.wrong_kind
            ));
        }
    }
    report.metrics = GateMetrics::Eval(Box::new(EvalMetrics {
        golden_digest: golden.digest(),
        cases: golden.len(),
        stable: stable_eval,
        candidate: candidate_eval,
        floors,
    }));
    report
}

/// Candidate ≥ stable − margin, or ≥ stable + margin with `must_improve`.
fn compare_to_stable(
    report: &mut GateReport,
    settings: &GateSettings,
    metric: &str,
    stable: Option<f64>,
    candidate: f64,
    margin: f64,
    format: ValueFormat,
) {
    let show = |v: f64| format_value(Some(v), format);
    let Some(stable) = stable else {
        report.checks.push(Check {
            metric: metric.to_owned(),
            stable: None,
            candidate: Some(candidate),
            required: "-".into(),
            passed: true,
            format,
        });
        return;
    };
    let required = if settings.must_improve {
        stable + margin
    } else {
        stable - margin
    };
    let points = settings.accuracy_margin_points;
    report.check(
        Check {
            metric: metric.to_owned(),
            stable: Some(stable),
            candidate: Some(candidate),
            required: format!("≥ {}", show(required)),
            passed: candidate + EPSILON >= required,
            format,
        },
        || {
            if settings.must_improve {
                format!(
                    "candidate {metric} {} does not improve on stable {} by {points} points (must_improve)",
                    show(candidate),
                    show(stable)
                )
            } else {
                format!(
                    "candidate {metric} {} regresses from stable {} by more than {points} points",
                    show(candidate),
                    show(stable)
                )
            }
        },
    );
}

fn is_sentinel(class: &str) -> bool {
    [
        FAILED_CLASS,
        NO_LABEL_CLASS,
        MISMATCH_CLASS,
        WRONG_KIND_CLASS,
    ]
    .contains(&class)
}

/// Scores one variant's predictions on every case.
pub fn evaluate_variant(
    settings: &GateSettings,
    golden: &GoldenSet,
    predictions: &[Prediction],
) -> VariantEval {
    let unacceptable: BTreeSet<(&str, &str)> = settings
        .unacceptable
        .iter()
        .map(|[expected, predicted]| (expected.as_str(), predicted.as_str()))
        .collect();
    let mut eval = VariantEval::default();
    let mut confusion: BTreeMap<(String, String), u64> = BTreeMap::new();
    let mut cost = 0.0;
    let mut detections: Vec<(&[GroundTruthBox], &[DetectedBox])> = Vec::new();
    for (case, prediction) in golden.cases().iter().zip(predictions) {
        if let Prediction::Failed(_) = prediction {
            eval.failed += 1;
        }
        if let crate::golden::Expected::Boxes(truth) = &case.expected {
            eval.detection_cases += 1;
            let found: &[DetectedBox] = match prediction {
                Prediction::Boxes(found) => found,
                Prediction::Failed(_) => &[],
                _ => {
                    eval.wrong_kind += 1;
                    &[]
                }
            };
            detections.push((truth, found));
            continue;
        }
        let scored = case.score(prediction);
        if scored.predicted_class == WRONG_KIND_CLASS {
            eval.wrong_kind += 1;
        }
        eval.answer_cases += 1;
        if scored.correct {
            eval.correct += 1;
        } else {
            let pair = (
                scored.expected_class.as_deref().unwrap_or(""),
                scored.predicted_class.as_str(),
            );
            if scored.expected_class.is_some() && unacceptable.contains(&pair) {
                eval.unacceptable_confusions += 1;
                cost += settings.unacceptable_weight;
            } else {
                cost += 1.0;
            }
        }
        if let Some(expected) = &scored.expected_class {
            let stats = eval.classes.entry(expected.clone()).or_default();
            stats.support += 1;
            if scored.correct {
                stats.true_positive += 1;
            }
            *confusion
                .entry((expected.clone(), scored.predicted_class.clone()))
                .or_default() += 1;
        }
        let predicted_class = if scored.correct {
            scored.expected_class.clone()
        } else {
            Some(scored.predicted_class.clone()).filter(|c| !is_sentinel(c))
        };
        if let Some(predicted) = predicted_class {
            eval.classes.entry(predicted).or_default().predicted += 1;
        }
    }
    if eval.answer_cases > 0 {
        let n = eval.answer_cases as f64;
        eval.accuracy = Some(eval.correct as f64 / n);
        eval.error_cost = Some(cost / n);
    }
    if !detections.is_empty() {
        let per_class =
            match_detections(&detections, settings.map_iou, settings.box_score_threshold);
        let mut aps = Vec::new();
        for (class, det) in per_class {
            let stats = eval.classes.entry(class).or_default();
            stats.support += det.ground_truth;
            stats.predicted += det.detections_above;
            stats.true_positive += det.true_positives_above;
            stats.average_precision = det.average_precision;
            aps.extend(det.average_precision);
        }
        if !aps.is_empty() {
            eval.map = Some(aps.iter().sum::<f64>() / aps.len() as f64);
        }
    }
    for stats in eval.classes.values_mut() {
        stats.recall =
            (stats.support > 0).then(|| stats.true_positive as f64 / stats.support as f64);
        stats.precision =
            (stats.predicted > 0).then(|| stats.true_positive as f64 / stats.predicted as f64);
    }
    eval.confusion = confusion
        .into_iter()
        .map(|((expected, predicted), count)| ConfusionCell {
            expected,
            predicted,
            count,
        })
        .collect();
    eval
}

/// The detector numbers of one class.
#[derive(Debug, Clone, PartialEq)]
pub struct DetectionClass {
    pub ground_truth: u64,
    pub detections_above: u64,
    pub true_positives_above: u64,
    /// None when the class has no ground truth (it then stays out of the mean).
    pub average_precision: Option<f64>,
}

/// Intersection over union of two `[x1, y1, x2, y2]` boxes.
pub fn iou(a: [f32; 4], b: [f32; 4]) -> f64 {
    let [ax1, ay1, ax2, ay2] = a.map(f64::from);
    let [bx1, by1, bx2, by2] = b.map(f64::from);
    let width = (ax2.min(bx2) - ax1.max(bx1)).max(0.0);
    let height = (ay2.min(by2) - ay1.max(by1)).max(0.0);
    let intersection = width * height;
    let union = (ax2 - ax1).max(0.0) * (ay2 - ay1).max(0.0)
        + (bx2 - bx1).max(0.0) * (by2 - by1).max(0.0)
        - intersection;
    if union <= 0.0 {
        0.0
    } else {
        intersection / union
    }
}

/// Per class over all images: detections ranked by score, each matched greedily to the
/// unmatched ground-truth box of its image with the highest IoU ≥ `iou_threshold` (COCO-style);
/// AP is the all-point interpolated area under the precision/recall curve (VOC 2010+).
pub fn match_detections(
    images: &[(&[GroundTruthBox], &[DetectedBox])],
    iou_threshold: f64,
    score_threshold: f64,
) -> BTreeMap<String, DetectionClass> {
    let mut classes: BTreeSet<&str> = BTreeSet::new();
    for (truth, found) in images {
        classes.extend(truth.iter().map(|b| b.label.as_str()));
        classes.extend(found.iter().map(|b| b.label.as_str()));
    }
    let mut out = BTreeMap::new();
    for class in classes {
        let truth: Vec<Vec<[f32; 4]>> = images
            .iter()
            .map(|(t, _)| {
                t.iter()
                    .filter(|b| b.label == class)
                    .map(|b| b.bbox)
                    .collect()
            })
            .collect();
        let ground_truth: usize = truth.iter().map(Vec::len).sum();
        let mut ranked: Vec<(usize, &DetectedBox)> = images
            .iter()
            .enumerate()
            .flat_map(|(i, (_, found))| {
                found
                    .iter()
                    .filter(|b| b.label == class)
                    .map(move |b| (i, b))
            })
            .collect();
        // Stable sort: ties keep image order. NaN scores rank last.
        ranked.sort_by(|a, b| {
            let score = |d: &DetectedBox| {
                if d.score.is_nan() {
                    f32::NEG_INFINITY
                } else {
                    d.score
                }
            };
            score(b.1).total_cmp(&score(a.1))
        });
        let mut matched: Vec<Vec<bool>> = truth.iter().map(|t| vec![false; t.len()]).collect();
        let mut hits = Vec::with_capacity(ranked.len());
        let (mut detections_above, mut true_positives_above) = (0, 0);
        for (image, detection) in &ranked {
            let best = truth[*image]
                .iter()
                .enumerate()
                .filter(|(j, _)| !matched[*image][*j])
                .map(|(j, gt)| (j, iou(*gt, detection.bbox)))
                .filter(|(_, overlap)| *overlap + EPSILON >= iou_threshold)
                .max_by(|a, b| a.1.total_cmp(&b.1));
            let hit = best.is_some();
            if let Some((j, _)) = best {
                matched[*image][j] = true;
            }
            hits.push(hit);
            if f64::from(detection.score) >= score_threshold {
                detections_above += 1;
                true_positives_above += u64::from(hit);
            }
        }
        out.insert(
            class.to_owned(),
            DetectionClass {
                ground_truth: ground_truth as u64,
                detections_above,
                true_positives_above,
                average_precision: (ground_truth > 0)
                    .then(|| average_precision(&hits, ground_truth)),
            },
        );
    }
    out
}

/// All-point interpolated AP of ranked hits against `ground_truth` boxes.
fn average_precision(hits: &[bool], ground_truth: usize) -> f64 {
    let mut precision = Vec::with_capacity(hits.len());
    let mut recall = Vec::with_capacity(hits.len());
    let mut true_positives = 0usize;
    for (rank, hit) in hits.iter().enumerate() {
        true_positives += usize::from(*hit);
        precision.push(true_positives as f64 / (rank + 1) as f64);
        recall.push(true_positives as f64 / ground_truth as f64);
    }
    // The precision envelope: the best precision at this recall or beyond.
    for i in (0..precision.len().saturating_sub(1)).rev() {
        precision[i] = precision[i].max(precision[i + 1]);
    }
    let mut ap = 0.0;
    let mut previous_recall = 0.0;
    for (p, r) in precision.iter().zip(&recall) {
        ap += (r - previous_recall) * p;
        previous_recall = *r;
    }
    ap
}

// ---------------------------------------------------------------------------------------------
// Latency gate
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LatencyMetrics {
    pub stable_samples: usize,
    pub candidate_samples: usize,
    pub stable_p50_ms: Option<f64>,
    pub stable_p95_ms: Option<f64>,
    pub candidate_p50_ms: Option<f64>,
    pub candidate_p95_ms: Option<f64>,
    /// candidate p95 / stable p95.
    pub p95_ratio: Option<f64>,
}

/// Nearest-rank percentile (`q` in (0, 1]) of finite samples.
pub fn percentile(samples: &[f64], q: f64) -> Option<f64> {
    let mut sorted: Vec<f64> = samples.iter().copied().filter(|v| v.is_finite()).collect();
    if sorted.is_empty() {
        return None;
    }
    sorted.sort_by(f64::total_cmp);
    let rank = (q * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// Candidate p95 ≤ `latency_ratio` × stable p95, both measured on the golden set on the same
/// machine in the same run.
pub fn latency_gate(
    settings: &GateSettings,
    stable_ms: &[f64],
    candidate_ms: &[f64],
) -> GateReport {
    const GATE: &str = "latency";
    if !settings.latency {
        return GateReport::disabled(GATE);
    }
    let metrics = LatencyMetrics {
        stable_samples: stable_ms.len(),
        candidate_samples: candidate_ms.len(),
        stable_p50_ms: percentile(stable_ms, 0.5),
        stable_p95_ms: percentile(stable_ms, 0.95),
        candidate_p50_ms: percentile(candidate_ms, 0.5),
        candidate_p95_ms: percentile(candidate_ms, 0.95),
        p95_ratio: None,
    };
    let mut report = GateReport::new(GATE, GateMetrics::Unavailable);
    for (variant, samples) in [("stable", stable_ms), ("candidate", candidate_ms)] {
        if samples.len() < settings.latency_min_samples {
            report.refuse(format!(
                "{variant}: {} latency samples, at least {} needed",
                samples.len(),
                settings.latency_min_samples
            ));
        }
        let invalid = samples
            .iter()
            .filter(|v| !v.is_finite() || **v < 0.0)
            .count();
        if invalid > 0 {
            report.refuse(format!(
                "{variant}: {invalid} latency samples are negative or not finite"
            ));
        }
    }
    let mut metrics = metrics;
    if let (Some(stable), Some(candidate)) = (metrics.stable_p95_ms, metrics.candidate_p95_ms) {
        let limit = stable * settings.latency_ratio;
        let ratio = if stable > 0.0 {
            Some(candidate / stable)
        } else {
            None
        };
        metrics.p95_ratio = ratio;
        let check = Check {
            metric: "p95".into(),
            stable: Some(stable),
            candidate: Some(candidate),
            required: format!("≤ {limit:.1} ms ({}×)", settings.latency_ratio),
            passed: candidate <= limit + EPSILON,
            format: ValueFormat::Millis,
        };
        report.check(check, || {
            format!(
                "candidate p95 {candidate:.1} ms is {} stable p95 {stable:.1} ms (limit {}×)",
                ratio.map_or("above".to_owned(), |r| format!("{r:.2}×")),
                settings.latency_ratio
            )
        });
        report.checks.push(Check {
            metric: "p50".into(),
            stable: metrics.stable_p50_ms,
            candidate: metrics.candidate_p50_ms,
            required: "-".into(),
            passed: true,
            format: ValueFormat::Millis,
        });
    }
    report.metrics = GateMetrics::Latency(metrics);
    report
}

// ---------------------------------------------------------------------------------------------
// Data-quality gate
// ---------------------------------------------------------------------------------------------

/// What the data-quality gate reads of a dataset version. Serializable so the server can keep
/// the previous version's stats instead of its rows.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DatasetStats {
    pub rows: u64,
    /// Every column seen in any row.
    pub columns: Vec<String>,
    /// Cells absent, null or blank, over rows × columns.
    pub missing_cells: u64,
    pub total_cells: u64,
    pub label_counts: BTreeMap<String, u64>,
    /// `"<width>x<height>"` → rows.
    pub size_counts: BTreeMap<String, u64>,
}

fn is_missing(value: Option<&serde_json::Value>) -> bool {
    match value {
        None | Some(serde_json::Value::Null) => true,
        Some(serde_json::Value::String(s)) => s.trim().is_empty(),
        Some(_) => false,
    }
}

fn as_dimension(value: Option<&serde_json::Value>) -> Option<u32> {
    let number = match value? {
        serde_json::Value::Number(n) => n.as_f64()?,
        serde_json::Value::String(s) => s.trim().parse::<f64>().ok()?,
        _ => return None,
    };
    (number >= 0.0 && number.fract() == 0.0 && number <= f64::from(u32::MAX))
        .then_some(number as u32)
}

/// The folder of a model's dataset versions in the repository: `<repo>/<model>/datasets`.
pub const DATASETS_DIR: &str = "datasets";

/// Where dataset version `version` of `model` lies in the repository: the folder
/// `<repo>/<model>/datasets/<version>` (of `.jsonl`/`.csv` files), or the file
/// `<version>.jsonl` or `<version>.csv` there. None when none exists, or the version is not a
/// plain name.
pub fn dataset_in_repository(repo: &Path, model: &str, version: &str) -> Option<PathBuf> {
    let plain = !version.is_empty()
        && !version.starts_with('.')
        && version
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '+'));
    let plain_model =
        !model.is_empty() && !model.starts_with('.') && !model.contains(['/', '\\', '\0']);
    if !plain || !plain_model {
        return None;
    }
    let dir = repo.join(model).join(DATASETS_DIR);
    [
        dir.join(version),
        dir.join(format!("{version}.jsonl")),
        dir.join(format!("{version}.csv")),
    ]
    .into_iter()
    .find(|p| p.exists())
}

impl DatasetStats {
    /// Stats of rows (JSON objects); the label, width and height columns are named in settings.
    /// A missing cell is an absent key (that other rows have), `null` or a blank string.
    pub fn from_rows(
        rows: &[serde_json::Map<String, serde_json::Value>],
        settings: &DataQualitySettings,
    ) -> DatasetStats {
        let columns: BTreeSet<&String> = rows.iter().flat_map(|r| r.keys()).collect();
        let mut stats = DatasetStats {
            rows: rows.len() as u64,
            columns: columns.iter().map(|c| (*c).clone()).collect(),
            total_cells: (rows.len() * columns.len()) as u64,
            ..DatasetStats::default()
        };
        for row in rows {
            stats.missing_cells +=
                columns.iter().filter(|c| is_missing(row.get(**c))).count() as u64;
            let label = row.get(&settings.label_column);
            if !is_missing(label) {
                let label = match label {
                    Some(serde_json::Value::String(s)) => s.trim().to_owned(),
                    Some(other) => other.to_string(),
                    None => continue,
                };
                *stats.label_counts.entry(label).or_default() += 1;
            }
            let width = as_dimension(row.get(&settings.width_column));
            let height = as_dimension(row.get(&settings.height_column));
            if let (Some(w), Some(h)) = (width, height) {
                *stats.size_counts.entry(format!("{w}x{h}")).or_default() += 1;
            }
        }
        stats
    }

    /// Reads a dataset version: a `.jsonl` file (one object per line), a `.csv` file (a header
    /// row, then rows; empty fields are missing), or a folder of them (not recursive, by name).
    pub fn load(path: &Path, settings: &DataQualitySettings) -> Result<DatasetStats, GateError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| GateError::Io { path, source }
        };
        let mut files = Vec::new();
        if path.is_dir() {
            for entry in std::fs::read_dir(path).map_err(io(path))? {
                let file = entry.map_err(io(path))?.path();
                if file.extension().is_some_and(|e| e == "jsonl" || e == "csv") {
                    files.push(file);
                }
            }
            files.sort();
        } else {
            files.push(path.to_path_buf());
        }
        if files.is_empty() {
            return Err(GateError::NoDataset(path.display().to_string()));
        }
        let mut rows = Vec::new();
        for file in &files {
            let text = std::fs::read_to_string(file).map_err(io(file))?;
            let name = file.display().to_string();
            match file.extension().and_then(|e| e.to_str()) {
                Some("jsonl") => rows.extend(parse_jsonl_rows(&name, &text)?),
                Some("csv") => rows.extend(parse_csv_rows(&name, &text)?),
                _ => return Err(GateError::NoDataset(name)),
            }
        }
        Ok(DatasetStats::from_rows(&rows, settings))
    }

    pub fn missing_share(&self) -> Option<f64> {
        (self.total_cells > 0).then(|| self.missing_cells as f64 / self.total_cells as f64)
    }

    /// Share of sized rows with the most common (width, height); None when no row has a size.
    pub fn size_consistency(&self) -> Option<f64> {
        let sized: u64 = self.size_counts.values().sum();
        let modal = self.size_counts.values().max().copied()?;
        (sized > 0).then(|| modal as f64 / sized as f64)
    }
}

/// KL(current ‖ previous) in nats over the union of labels, each count smoothed by `smoothing`
/// so a label seen in one version only has a finite (and large) divergence. None when either
/// version has no labels.
pub fn label_kl(current: &DatasetStats, previous: &DatasetStats, smoothing: f64) -> Option<f64> {
    let labels: BTreeSet<&String> = current
        .label_counts
        .keys()
        .chain(previous.label_counts.keys())
        .collect();
    let total = |s: &DatasetStats| s.label_counts.values().sum::<u64>() as f64;
    let (n_current, n_previous) = (total(current), total(previous));
    if n_current == 0.0 || n_previous == 0.0 {
        return None;
    }
    let k = labels.len() as f64;
    let share = |s: &DatasetStats, n: f64, label: &String| {
        (s.label_counts.get(label).copied().unwrap_or(0) as f64 + smoothing) / (n + smoothing * k)
    };
    Some(
        labels
            .iter()
            .map(|label| {
                let p = share(current, n_current, label);
                let q = share(previous, n_previous, label);
                p * (p / q).ln()
            })
            .sum(),
    )
}

fn parse_jsonl_rows(
    file: &str,
    text: &str,
) -> Result<Vec<serde_json::Map<String, serde_json::Value>>, GateError> {
    let mut rows = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let error = |message: String| GateError::Dataset {
            file: file.to_owned(),
            line: index + 1,
            message,
        };
        match serde_json::from_str(line).map_err(|e| error(e.to_string()))? {
            serde_json::Value::Object(row) => rows.push(row),
            _ => return Err(error("a row must be a JSON object".into())),
        }
    }
    Ok(rows)
}

/// RFC 4180 CSV: quoted fields may hold commas, quotes (doubled) and line breaks.
fn parse_csv_rows(
    file: &str,
    text: &str,
) -> Result<Vec<serde_json::Map<String, serde_json::Value>>, GateError> {
    let mut records: Vec<(usize, Vec<String>)> = Vec::new();
    let mut record = Vec::new();
    let mut field = String::new();
    let (mut line, mut record_line) = (1usize, 1usize);
    let mut in_quotes = false;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, in_quotes) {
            ('"', true) if chars.peek() == Some(&'"') => {
                chars.next();
                field.push('"');
            }
            ('"', true) => in_quotes = false,
            ('"', false) if field.is_empty() => in_quotes = true,
            (',', false) => record.push(std::mem::take(&mut field)),
            ('\r', false) if chars.peek() == Some(&'\n') => {}
            ('\n', false) => {
                record.push(std::mem::take(&mut field));
                let done = std::mem::take(&mut record);
                if !(done.len() == 1 && done[0].trim().is_empty()) {
                    records.push((record_line, done));
                }
                line += 1;
                record_line = line;
            }
            (c, _) => {
                if c == '\n' {
                    line += 1;
                }
                field.push(c);
            }
        }
    }
    if in_quotes {
        return Err(GateError::Dataset {
            file: file.to_owned(),
            line: record_line,
            message: "unterminated quoted field".into(),
        });
    }
    if !field.is_empty() || !record.is_empty() {
        record.push(field);
        records.push((record_line, record));
    }
    let mut records = records.into_iter();
    let Some((_, header)) = records.next() else {
        return Ok(Vec::new());
    };
    let header: Vec<String> = header.iter().map(|h| h.trim().to_owned()).collect();
    records
        .map(|(line, fields)| {
            if fields.len() != header.len() {
                return Err(GateError::Dataset {
                    file: file.to_owned(),
                    line,
                    message: format!("{} fields, the header has {}", fields.len(), header.len()),
                });
            }
            Ok(header
                .iter()
                .cloned()
                .zip(fields.into_iter().map(serde_json::Value::String))
                .collect())
        })
        .collect()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DataQualityMetrics {
    pub rows: u64,
    pub missing_share: Option<f64>,
    pub label_kl: Option<f64>,
    pub size_consistency: Option<f64>,
    pub labels: BTreeMap<String, u64>,
    pub previous_labels: Option<BTreeMap<String, u64>>,
}

/// A dataset version against the thresholds and, when given, the previous version.
pub fn data_quality_gate(
    settings: &GateSettings,
    current: &DatasetStats,
    previous: Option<&DatasetStats>,
) -> GateReport {
    const GATE: &str = "data_quality";
    let dq = &settings.data_quality;
    if !dq.enabled {
        return GateReport::disabled(GATE);
    }
    let metrics = DataQualityMetrics {
        rows: current.rows,
        missing_share: current.missing_share(),
        label_kl: previous.and_then(|p| label_kl(current, p, dq.kl_smoothing)),
        size_consistency: current.size_consistency(),
        labels: current.label_counts.clone(),
        previous_labels: previous.map(|p| p.label_counts.clone()),
    };
    let mut report = GateReport::new(GATE, GateMetrics::Unavailable);
    if current.rows == 0 {
        report.refuse("the dataset version has no rows".into());
    }
    if let Some(missing) = metrics.missing_share {
        report.check(
            Check {
                metric: "missing values".into(),
                stable: None,
                candidate: Some(missing),
                required: format!("≤ {}", percent(dq.max_missing)),
                passed: missing <= dq.max_missing + EPSILON,
                format: ValueFormat::Percent,
            },
            || {
                format!(
                    "{} of cells are missing ({} of {}), more than {}",
                    percent(missing),
                    current.missing_cells,
                    current.total_cells,
                    percent(dq.max_missing)
                )
            },
        );
    }
    match (previous, metrics.label_kl) {
        (None, _) => report
            .notes
            .push("no previous dataset version: the label distribution was not compared".into()),
        (Some(p), None) if current.label_counts.is_empty() && p.label_counts.is_empty() => {
            report.notes.push(format!(
                "neither version has `{}` values: the label distribution was not compared",
                dq.label_column
            ))
        }
        (Some(_), None) => report.refuse(format!(
            "the label distribution cannot be compared: one version has no `{}` values",
            dq.label_column
        )),
        (Some(_), Some(kl)) => report.check(
            Check {
                metric: "label KL vs previous".into(),
                stable: None,
                candidate: Some(kl),
                required: format!("≤ {:.3}", dq.max_label_kl),
                passed: kl <= dq.max_label_kl + EPSILON,
                format: ValueFormat::Plain,
            },
            || {
                format!(
                    "label distribution moved: KL(current ‖ previous) = {kl:.3} nats > {:.3}",
                    dq.max_label_kl
                )
            },
        ),
    }
    match metrics.size_consistency {
        None => report.notes.push(format!(
            "no `{}`/`{}` columns: image size consistency not checked",
            dq.width_column, dq.height_column
        )),
        Some(consistency) => report.check(
            Check {
                metric: "image size consistency".into(),
                stable: None,
                candidate: Some(consistency),
                required: format!("≥ {}", percent(dq.min_size_consistency)),
                passed: consistency + EPSILON >= dq.min_size_consistency,
                format: ValueFormat::Percent,
            },
            || {
                let modal = current
                    .size_counts
                    .iter()
                    .max_by_key(|(_, n)| **n)
                    .map(|(size, _)| size.as_str())
                    .unwrap_or("-");
                format!(
                    "only {} of images have the common size {modal} (at least {} required)",
                    percent(consistency),
                    percent(dq.min_size_consistency)
                )
            },
        ),
    }
    report.metrics = GateMetrics::DataQuality(metrics);
    report
}

// ---------------------------------------------------------------------------------------------
// Feature-consistency gate
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleCosine {
    pub index: usize,
    pub cosine: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FeatureMetrics {
    pub samples: usize,
    /// Share of samples with cosine ≥ `min_cosine`.
    pub share_consistent: f64,
    pub min_cosine: f64,
    pub median_cosine: f64,
    /// The least similar samples, worst first (at most 10).
    pub worst: Vec<SampleCosine>,
}

/// Cosine similarity in f64; two zero vectors agree (1), one zero vector does not (0). None when
/// the lengths differ.
pub fn cosine_similarity(a: &[f32], b: &[f32]) -> Option<f64> {
    if a.len() != b.len() {
        return None;
    }
    let (mut dot, mut norm_a, mut norm_b) = (0.0f64, 0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (f64::from(*x), f64::from(*y));
        dot += x * y;
        norm_a += x * x;
        norm_b += y * y;
    }
    Some(match (norm_a == 0.0, norm_b == 0.0) {
        (true, true) => 1.0,
        (true, false) | (false, true) => 0.0,
        (false, false) => dot / (norm_a.sqrt() * norm_b.sqrt()),
    })
}

/// Stable and candidate pre-processing (or embeddings) of the same samples, pair by pair.
pub fn feature_consistency_gate(
    settings: &GateSettings,
    stable: &[Vec<f32>],
    candidate: &[Vec<f32>],
) -> GateReport {
    const GATE: &str = "feature_consistency";
    let fc = &settings.feature_consistency;
    if !fc.enabled {
        return GateReport::disabled(GATE);
    }
    if stable.len() != candidate.len() {
        return GateReport::refused(
            GATE,
            format!(
                "{} stable feature vectors but {} candidate ones",
                stable.len(),
                candidate.len()
            ),
        );
    }
    if stable.is_empty() {
        return GateReport::refused(GATE, "no samples to compare".into());
    }
    let mut report = GateReport::new(GATE, GateMetrics::Unavailable);
    if stable.len() < fc.samples {
        report.refuse(format!(
            "{} samples compared, the plan asks for {}",
            stable.len(),
            fc.samples
        ));
    }
    let mut mismatched = Vec::new();
    let mut cosines: Vec<SampleCosine> = stable
        .iter()
        .zip(candidate)
        .enumerate()
        .map(|(index, (a, b))| {
            let cosine = cosine_similarity(a, b).unwrap_or_else(|| {
                mismatched.push(index);
                -1.0
            });
            // NaN (from NaN features) must not pass: it counts as the worst possible, -1.
            let cosine = if cosine.is_nan() { -1.0 } else { cosine };
            SampleCosine { index, cosine }
        })
        .collect();
    if !mismatched.is_empty() {
        report.refuse(format!(
            "{} samples have feature vectors of different lengths (first: sample {})",
            mismatched.len(),
            mismatched[0]
        ));
    }
    let consistent = cosines.iter().filter(|c| c.cosine >= fc.min_cosine).count();
    let share = consistent as f64 / cosines.len() as f64;
    cosines.sort_by(|a, b| a.cosine.total_cmp(&b.cosine));
    let median = cosines[cosines.len() / 2].cosine;
    let minimum = cosines[0].cosine;
    let worst: Vec<SampleCosine> = cosines.iter().take(10).cloned().collect();
    report.check(
        Check {
            metric: format!("share with cosine ≥ {}", fc.min_cosine),
            stable: None,
            candidate: Some(share),
            required: format!("≥ {}", percent(fc.min_share)),
            passed: share + EPSILON >= fc.min_share,
            format: ValueFormat::Percent,
        },
        || {
            let indices: Vec<String> = worst.iter().take(5).map(|w| w.index.to_string()).collect();
            format!(
                "pre-processing differs: only {} of {} samples have cosine ≥ {} (min {minimum:.6}, median {median:.6}; worst samples {})",
                percent(share),
                cosines.len(),
                fc.min_cosine,
                indices.join(", ")
            )
        },
    );
    report.checks.push(Check {
        metric: "min cosine".into(),
        stable: None,
        candidate: Some(minimum),
        required: "-".into(),
        passed: true,
        format: ValueFormat::Fine,
    });
    report.checks.push(Check {
        metric: "median cosine".into(),
        stable: None,
        candidate: Some(median),
        required: "-".into(),
        passed: true,
        format: ValueFormat::Fine,
    });
    report.metrics = GateMetrics::FeatureConsistency(FeatureMetrics {
        samples: cosines.len(),
        share_consistent: share,
        min_cosine: minimum,
        median_cosine: median,
        worst,
    });
    report
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::golden::GoldenSet;

    fn label_set(classes: &[&str]) -> GoldenSet {
        let text: Vec<String> = classes
            .iter()
            .enumerate()
            .map(|(i, c)| {
                format!(r#"{{"id": "c{i}", "prompt": "p{i}", "label_field": "category", "expected": {{"label": "{c}"}}}}"#)
            })
            .collect();
        GoldenSet::from_sources(&[("cases.jsonl".into(), text.join("\n"))]).unwrap()
    }

    fn answers(labels: &[&str]) -> Vec<Prediction> {
        labels
            .iter()
            .map(|l| Prediction::Text(format!(r#"{{"category": "{l}"}}"#)))
            .collect()
    }

    /// `n` cases of `class`, of which the first `wrong` are answered `instead`.
    fn with_errors(truth: &[&'static str], wrong: &[(usize, &'static str)]) -> Vec<&'static str> {
        let mut out = truth.to_vec();
        for (i, instead) in wrong {
            out[*i] = instead;
        }
        out
    }

    fn refunds_and_logistics() -> Vec<&'static str> {
        let mut truth = vec!["refund"; 20];
        truth.extend(vec!["logistics"; 20]);
        truth
    }

    #[test]
    fn a_recall_floor_failure_is_refused_with_a_table_naming_the_class() {
        let truth = refunds_and_logistics();
        let golden = label_set(&truth);
        let mut settings = GateSettings::default();
        settings.recall_floors.insert("refund".into(), 0.95);
        // Stable misses one refund (95%), candidate two (90%); overall accuracy within margin
        // is not the point: the floor refuses on its own.
        let stable = answers(&with_errors(&truth, &[(0, "logistics")]));
        let candidate = answers(&with_errors(&truth, &[(0, "logistics"), (1, "other")]));
        settings.accuracy_margin_points = 5.0;
        let report = eval_gate(&settings, &golden, Some(&stable), &candidate);
        assert!(!report.passed);
        assert_eq!(report.reasons.len(), 1, "{:?}", report.reasons);
        assert!(
            report.reasons[0].contains("`refund`"),
            "{}",
            report.reasons[0]
        );
        assert!(report.reasons[0].contains("90.0%"), "{}", report.reasons[0]);
        let table = report.table();
        assert!(table.starts_with("eval gate: REFUSED"), "{table}");
        let refund_row = table
            .lines()
            .find(|l| l.starts_with("refund"))
            .unwrap_or_else(|| panic!("no refund row in\n{table}"));
        for cell in ["20", "95.0%", "90.0%", "≥ 95.0%", "✗"] {
            assert!(refund_row.contains(cell), "{cell} not in {refund_row:?}");
        }
        assert!(!table.lines().any(|l| l.starts_with("other")), "{table}");
        let logistics_row = table.lines().find(|l| l.starts_with("logistics")).unwrap();
        assert!(!logistics_row.contains('✗'), "{logistics_row}");

        // The same candidate passes once the floor is met.
        let candidate = answers(&with_errors(&truth, &[(0, "logistics")]));
        let report = eval_gate(&settings, &golden, Some(&stable), &candidate);
        assert!(report.passed, "{}", report.table());

        // A floor on a class the golden set never shows refuses.
        settings.recall_floors.insert("fraud".into(), 0.9);
        let report = eval_gate(&settings, &golden, Some(&stable), &candidate);
        assert!(!report.passed);
        assert!(
            report.reasons[0].contains("`fraud`"),
            "{:?}",
            report.reasons
        );
    }

    #[test]
    fn must_improve_needs_the_margin_and_otherwise_the_margin_bounds_regression() {
        let truth = vec!["yes"; 200];
        let golden = label_set(&truth);
        let wrong = |n: usize| -> Vec<Prediction> {
            let wrong: Vec<(usize, &'static str)> = (0..n).map(|i| (i, "no")).collect();
            answers(&with_errors(&truth, &wrong))
        };
        let stable = wrong(20); // 90.0%
        let mut settings = GateSettings::default();
        let verdict = |settings: &GateSettings, errors: usize| {
            eval_gate(settings, &golden, Some(&stable), &wrong(errors)).passed
        };
        // Default: at most 0.5 points below stable.
        assert!(verdict(&settings, 21)); // 89.5%
        assert!(!verdict(&settings, 22)); // 89.0%
        settings.must_improve = true;
        assert!(verdict(&settings, 19)); // 90.5%
        assert!(!verdict(&settings, 20)); // equal is not better
        let report = eval_gate(&settings, &golden, Some(&stable), &wrong(20));
        assert!(
            report.reasons.iter().any(|r| r.contains("must_improve")),
            "{:?}",
            report.reasons
        );
        // Without a stable, only the absolute floors apply.
        settings.min_accuracy = Some(0.9);
        assert!(eval_gate(&settings, &golden, None, &wrong(20)).passed);
        assert!(!eval_gate(&settings, &golden, None, &wrong(21)).passed);
    }

    #[test]
    fn an_unacceptable_confusion_weighs_ten_errors() {
        let mut truth = vec!["refund"; 50];
        truth.extend(vec!["logistics"; 50]);
        let golden = label_set(&truth);
        // Stable: two harmless errors. Candidate: one error, but the unacceptable one.
        let stable = answers(&with_errors(&truth, &[(50, "refund"), (51, "refund")]));
        let candidate = answers(&with_errors(&truth, &[(0, "logistics")]));
        let mut settings = GateSettings::default();
        assert!(eval_gate(&settings, &golden, Some(&stable), &candidate).passed);

        settings.unacceptable = vec![["refund".into(), "logistics".into()]];
        let report = eval_gate(&settings, &golden, Some(&stable), &candidate);
        assert!(!report.passed, "{}", report.table());
        let GateMetrics::Eval(eval) = &report.metrics else {
            panic!("eval metrics expected")
        };
        assert_eq!(eval.candidate.unacceptable_confusions, 1);
        assert!((eval.candidate.error_cost.unwrap() - 0.10).abs() < 1e-12);
        assert!((eval.stable.as_ref().unwrap().error_cost.unwrap() - 0.02).abs() < 1e-12);
        assert!(eval.candidate.accuracy > eval.stable.as_ref().unwrap().accuracy);
        assert!(
            report.reasons[0].contains("error cost"),
            "{:?}",
            report.reasons
        );
        let cell = eval
            .candidate
            .confusion
            .iter()
            .find(|c| c.expected == "refund" && c.predicted == "logistics")
            .unwrap();
        assert_eq!(cell.count, 1);
        let refund = &eval.candidate.classes["refund"];
        assert_eq!((refund.support, refund.true_positive), (50, 49));
        assert_eq!(eval.candidate.classes["logistics"].predicted, 51);

        settings.unacceptable_weight = 2.0; // 0.02 + 0.005 ≥ 0.02: passes again
        assert!(eval_gate(&settings, &golden, Some(&stable), &candidate).passed);
    }

    #[test]
    fn failed_calls_count_as_wrong_and_mismatched_lengths_refuse() {
        let truth = vec!["a"; 10];
        let golden = label_set(&truth);
        let mut candidate = answers(&truth);
        candidate[3] = Prediction::Failed("timeout".into());
        let report = eval_gate(&GateSettings::default(), &golden, None, &candidate);
        let GateMetrics::Eval(eval) = &report.metrics else {
            panic!()
        };
        assert_eq!((eval.candidate.correct, eval.candidate.failed), (9, 1));
        assert!(report.notes.iter().any(|n| n.contains("1 cases failed")));

        let report = eval_gate(&GateSettings::default(), &golden, None, &candidate[..9]);
        assert!(!report.passed);
        assert!(
            report.reasons[0].contains("9 predictions"),
            "{:?}",
            report.reasons
        );
    }

    fn gt(label: &str, bbox: [f32; 4]) -> GroundTruthBox {
        GroundTruthBox {
            label: label.into(),
            bbox,
        }
    }

    fn det(label: &str, score: f32, bbox: [f32; 4]) -> DetectedBox {
        DetectedBox {
            label: label.into(),
            score,
            bbox,
        }
    }

    fn ap_of(images: &[(Vec<GroundTruthBox>, Vec<DetectedBox>)], class: &str) -> Option<f64> {
        let refs: Vec<(&[GroundTruthBox], &[DetectedBox])> = images
            .iter()
            .map(|(t, d)| (t.as_slice(), d.as_slice()))
            .collect();
        match_detections(&refs, 0.5, 0.5)[class].average_precision
    }

    #[test]
    fn average_precision_on_hand_computed_cases() {
        let a = [0.0, 0.0, 10.0, 10.0];
        let b = [20.0, 20.0, 30.0, 30.0];
        let far = [50.0, 50.0, 60.0, 60.0];
        // Perfect boxes.
        let perfect = vec![
            (vec![gt("p", a)], vec![det("p", 0.9, a)]),
            (vec![gt("p", b)], vec![det("p", 0.8, b)]),
        ];
        assert_eq!(ap_of(&perfect, "p"), Some(1.0));

        // Two ground-truth boxes, one false positive ranked second: precision 1, 1/2, 2/3 at
        // recall 1/2, 1/2, 1 → AP = 1/2 · 1 + 1/2 · 2/3 = 5/6.
        let middle = vec![(
            vec![gt("p", a), gt("p", b)],
            vec![det("p", 0.9, a), det("p", 0.8, far), det("p", 0.7, b)],
        )];
        assert!((ap_of(&middle, "p").unwrap() - 5.0 / 6.0).abs() < 1e-12);
        // Ranked first: the envelope is 2/3 everywhere → 2/3. Ranked last: 1.
        let first = vec![(
            vec![gt("p", a), gt("p", b)],
            vec![det("p", 0.95, far), det("p", 0.9, a), det("p", 0.7, b)],
        )];
        assert!((ap_of(&first, "p").unwrap() - 2.0 / 3.0).abs() < 1e-12);
        let last = vec![(
            vec![gt("p", a), gt("p", b)],
            vec![det("p", 0.9, a), det("p", 0.7, b), det("p", 0.1, far)],
        )];
        assert_eq!(ap_of(&last, "p"), Some(1.0));
        // A duplicate of a matched box is a false positive.
        let duplicate = [(vec![gt("p", a)], vec![det("p", 0.9, a), det("p", 0.8, a)])];
        let refs: Vec<(&[GroundTruthBox], &[DetectedBox])> = duplicate
            .iter()
            .map(|(t, d)| (t.as_slice(), d.as_slice()))
            .collect();
        let p = &match_detections(&refs, 0.5, 0.5)["p"];
        assert_eq!((p.detections_above, p.true_positives_above), (2, 1));
        assert_eq!(p.average_precision, Some(1.0));

        // IoU exactly 0.5 matches; just below does not; just above does.
        assert_eq!(iou(a, [0.0, 0.0, 10.0, 5.0]), 0.5);
        let at = vec![(vec![gt("p", a)], vec![det("p", 0.9, [0.0, 0.0, 10.0, 5.0])])];
        assert_eq!(ap_of(&at, "p"), Some(1.0));
        let below = vec![(vec![gt("p", a)], vec![det("p", 0.9, [0.0, 0.0, 10.0, 4.9])])];
        assert!(iou(a, [0.0, 0.0, 10.0, 4.9]) < 0.5);
        assert_eq!(ap_of(&below, "p"), Some(0.0));
        let above = vec![(vec![gt("p", a)], vec![det("p", 0.9, [0.0, 0.0, 10.0, 5.1])])];
        assert_eq!(ap_of(&above, "p"), Some(1.0));
        // A right box with the wrong label matches nothing; a class without ground truth has
        // no AP (it stays out of the mean).
        let wrong_label = vec![(vec![gt("p", a)], vec![det("car", 0.9, a)])];
        assert_eq!(ap_of(&wrong_label, "p"), Some(0.0));
        assert_eq!(ap_of(&wrong_label, "car"), None);
    }

    #[test]
    fn detector_gate_judges_map_and_box_recall() {
        let line = |i: usize| {
            format!(
                r#"{{"id": "d{i}", "input": {{"image": "{i}.png"}}, "expected": {{"boxes": [{{"label": "person", "box": [0, 0, 10, 10]}}, {{"label": "car", "box": [20, 20, 40, 30]}}]}}}}"#
            )
        };
        let text: Vec<String> = (0..4).map(line).collect();
        let golden = GoldenSet::from_sources(&[("det.jsonl".into(), text.join("\n"))]).unwrap();
        let perfect = || {
            Prediction::Boxes(vec![
                det("person", 0.9, [0.0, 0.0, 10.0, 10.0]),
                det("car", 0.8, [20.0, 20.0, 40.0, 30.0]),
            ])
        };
        let stable: Vec<Prediction> = (0..4).map(|_| perfect()).collect();
        let mut candidate = stable.clone();
        // Misses the person in two images.
        for prediction in candidate.iter_mut().take(2) {
            *prediction = Prediction::Boxes(vec![det("car", 0.8, [20.0, 20.0, 40.0, 30.0])]);
        }
        let mut settings = GateSettings::default();
        settings.recall_floors.insert("person".into(), 0.9);
        let report = eval_gate(&settings, &golden, Some(&stable), &candidate);
        assert!(!report.passed);
        let GateMetrics::Eval(eval) = &report.metrics else {
            panic!()
        };
        assert_eq!(eval.stable.as_ref().unwrap().map, Some(1.0));
        assert_eq!(eval.candidate.map, Some(0.75)); // person AP 0.5, car AP 1
        assert_eq!(eval.candidate.classes["person"].recall, Some(0.5));
        assert!(report.reasons.iter().any(|r| r.contains("`person`")));
        assert!(report.reasons.iter().any(|r| r.contains("mAP@0.5")));
        assert!(eval_gate(&settings, &golden, Some(&stable), &stable).passed);
    }

    #[test]
    fn latency_gate_compares_p95() {
        let settings = GateSettings::default();
        let stable: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&stable, 0.95), Some(95.0));
        assert_eq!(percentile(&stable, 0.5), Some(50.0));
        let slower = |factor: f64| -> Vec<f64> { stable.iter().map(|v| v * factor).collect() };
        assert!(latency_gate(&settings, &stable, &slower(1.1)).passed);
        let report = latency_gate(&settings, &stable, &slower(1.2));
        assert!(!report.passed);
        assert!(report.reasons[0].contains("1.20×"), "{:?}", report.reasons);
        let table = report.table();
        assert!(
            table.contains("95.0 ms") && table.contains("114.0 ms"),
            "{table}"
        );
        assert!(
            table
                .lines()
                .any(|l| l.starts_with("p95") && l.ends_with('✗')),
            "{table}"
        );

        let few = latency_gate(&settings, &stable[..5], &stable[..5]);
        assert!(!few.passed);
        assert!(
            few.reasons[0].contains("5 latency samples"),
            "{:?}",
            few.reasons
        );
        let mut broken = stable.clone();
        broken[0] = f64::NAN;
        assert!(!latency_gate(&settings, &stable, &broken).passed);
    }

    fn row(pairs: &[(&str, serde_json::Value)]) -> serde_json::Map<String, serde_json::Value> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect()
    }

    fn labelled(counts: &[(&str, usize)]) -> DatasetStats {
        let rows: Vec<_> = counts
            .iter()
            .flat_map(|(label, n)| (0..*n).map(move |_| row(&[("label", (*label).into())])))
            .collect();
        DatasetStats::from_rows(&rows, &DataQualitySettings::default())
    }

    #[test]
    fn kl_and_missing_values() {
        use serde_json::json;
        let balanced = labelled(&[("a", 50), ("b", 50)]);
        assert_eq!(label_kl(&balanced, &balanced, 0.5), Some(0.0));
        let skewed = labelled(&[("a", 90), ("b", 10)]);
        // p = (90.5, 10.5)/101, q = (1/2, 1/2).
        let kl = label_kl(&skewed, &balanced, 0.5).unwrap();
        assert!((kl - 0.359_448_462_620_653).abs() < 1e-9, "{kl}");
        // A label the previous version never had: finite, and large enough to refuse.
        let new_label = labelled(&[("a", 50), ("b", 20), ("c", 30)]);
        let kl = label_kl(&new_label, &balanced, 0.5).unwrap();
        assert!(kl.is_finite() && kl > 0.3, "{kl}");
        let settings = GateSettings::default();
        let report = data_quality_gate(&settings, &skewed, Some(&balanced));
        assert!(
            !report.passed && report.reasons[0].contains("KL"),
            "{:?}",
            report.reasons
        );
        assert!(
            data_quality_gate(
                &settings,
                &balanced,
                Some(&labelled(&[("a", 48), ("b", 52)]))
            )
            .passed
        );

        // 4 rows × 3 columns; missing: an absent key, a null, a blank string.
        let rows = vec![
            row(&[
                ("label", json!("a")),
                ("width", json!(32)),
                ("height", json!(32)),
            ]),
            row(&[("label", json!("a")), ("width", json!(32))]),
            row(&[
                ("label", json!(null)),
                ("width", json!(32)),
                ("height", json!(32)),
            ]),
            row(&[
                ("label", json!(" ")),
                ("width", json!(32)),
                ("height", json!(32)),
            ]),
        ];
        let stats = DatasetStats::from_rows(&rows, &DataQualitySettings::default());
        assert_eq!((stats.missing_cells, stats.total_cells), (3, 12));
        assert_eq!(stats.missing_share(), Some(0.25));
        assert_eq!(stats.label_counts["a"], 2);
        assert_eq!(stats.size_consistency(), Some(1.0));
        let report = data_quality_gate(&settings, &stats, None);
        assert!(!report.passed);
        assert!(report.reasons[0].contains("25.0%"), "{:?}", report.reasons);
        assert!(report.notes.iter().any(|n| n.contains("no previous")));
    }

    #[test]
    fn image_size_consistency() {
        use serde_json::json;
        let sized = |odd: usize| {
            let rows: Vec<_> = (0..100)
                .map(|i| {
                    let w = if i < odd { 31 } else { 32 };
                    row(&[
                        ("label", json!("x")),
                        ("width", json!(w)),
                        ("height", json!(32)),
                    ])
                })
                .collect();
            DatasetStats::from_rows(&rows, &DataQualitySettings::default())
        };
        let settings = GateSettings::default();
        assert!(data_quality_gate(&settings, &sized(1), None).passed);
        let report = data_quality_gate(&settings, &sized(2), None);
        assert!(!report.passed);
        assert!(report.reasons[0].contains("32x32"), "{:?}", report.reasons);
    }

    #[test]
    fn datasets_load_from_jsonl_and_csv() {
        let dir = tempfile::tempdir().unwrap();
        let csv = dir.path().join("v2.csv");
        std::fs::write(
            &csv,
            "path,label,width,height\r\nimg/1.png,\"cat, tabby\",32,32\nimg/2.png,dog,32,\n\"img/\"\"3\"\".png\",dog,32,32\n",
        )
        .unwrap();
        let settings = DataQualitySettings::default();
        let stats = DatasetStats::load(&csv, &settings).unwrap();
        assert_eq!(stats.rows, 3);
        assert_eq!(stats.label_counts["cat, tabby"], 1);
        assert_eq!(stats.label_counts["dog"], 2);
        assert_eq!((stats.missing_cells, stats.total_cells), (1, 12));
        assert_eq!(stats.size_counts["32x32"], 2);

        let jsonl = dir.path().join("v1.jsonl");
        std::fs::write(
            &jsonl,
            "{\"label\": \"cat\", \"width\": 32, \"height\": 32}\n\n[1]\n",
        )
        .unwrap();
        let err = DatasetStats::load(&jsonl, &settings).unwrap_err();
        assert!(
            err.to_string()
                .ends_with("v1.jsonl:3: a row must be a JSON object"),
            "{err}"
        );

        let bad_csv = dir.path().join("bad.csv");
        std::fs::write(&bad_csv, "label,width\ncat\n").unwrap();
        let err = DatasetStats::load(&bad_csv, &settings).unwrap_err();
        assert!(err.to_string().contains("bad.csv:2:"), "{err}");
    }

    #[test]
    fn dataset_versions_are_found_in_the_repository() {
        let repo = tempfile::tempdir().unwrap();
        let datasets = repo.path().join("clf").join(DATASETS_DIR);
        std::fs::create_dir_all(datasets.join("v3")).unwrap();
        std::fs::write(datasets.join("v1.csv"), "label\na\n").unwrap();
        std::fs::write(datasets.join("ds-0123.jsonl"), "{}\n").unwrap();
        let found = |v: &str| dataset_in_repository(repo.path(), "clf", v);
        assert_eq!(found("v1"), Some(datasets.join("v1.csv")));
        assert_eq!(found("ds-0123"), Some(datasets.join("ds-0123.jsonl")));
        assert_eq!(found("v3"), Some(datasets.join("v3")));
        for absent in ["v2", "", "../clf/datasets/v1.csv", ".hidden", "a/b"] {
            assert_eq!(found(absent), None, "{absent}");
        }
    }

    #[test]
    fn datasets_without_labels_are_not_refused_for_it() {
        let settings = GateSettings::default();
        let rows = |n: usize| -> Vec<serde_json::Map<String, serde_json::Value>> {
            (0..n)
                .map(|i| {
                    serde_json::json!({"messages": format!("chat {i}")})
                        .as_object()
                        .unwrap()
                        .clone()
                })
                .collect()
        };
        let dq = &settings.data_quality;
        let (current, previous) = (
            DatasetStats::from_rows(&rows(20), dq),
            DatasetStats::from_rows(&rows(10), dq),
        );
        let report = data_quality_gate(&settings, &current, Some(&previous));
        assert!(report.passed, "{:?}", report.reasons);
        assert!(
            report.notes.iter().any(|n| n.contains("neither version")),
            "{:?}",
            report.notes
        );
        // One version with labels, the other without: that cannot be judged.
        let labelled = DatasetStats::from_rows(
            &[serde_json::json!({"label": "a"})
                .as_object()
                .unwrap()
                .clone()],
            dq,
        );
        let report = data_quality_gate(&settings, &labelled, Some(&previous));
        assert!(!report.passed);
    }

    /// A tiny separable resizer with PIL-style antialiasing (the kernel widens by the scale when
    /// shrinking): enough to show what a change of filter does to features.
    fn resize(
        src: &[f32],
        size: usize,
        out: usize,
        kernel: fn(f64) -> f64,
        support: f64,
    ) -> Vec<f32> {
        let scale = size as f64 / out as f64;
        let filter_scale = scale.max(1.0);
        let weights: Vec<Vec<(usize, f64)>> = (0..out)
            .map(|o| {
                let center = (o as f64 + 0.5) * scale;
                let lo = ((center - support * filter_scale).floor().max(0.0)) as usize;
                let hi = ((center + support * filter_scale).ceil() as usize).min(size);
                let taps: Vec<(usize, f64)> = (lo..hi)
                    .map(|i| (i, kernel((i as f64 + 0.5 - center) / filter_scale)))
                    .collect();
                let total: f64 = taps.iter().map(|t| t.1).sum();
                taps.into_iter().map(|(i, w)| (i, w / total)).collect()
            })
            .collect();
        let mut rows = vec![0.0f32; size * out];
        for y in 0..size {
            for (x, taps) in weights.iter().enumerate() {
                rows[y * out + x] = taps
                    .iter()
                    .map(|(i, w)| f64::from(src[y * size + i]) * w)
                    .sum::<f64>() as f32;
            }
        }
        let mut dst = vec![0.0f32; out * out];
        for (y, taps) in weights.iter().enumerate() {
            for x in 0..out {
                dst[y * out + x] = taps
                    .iter()
                    .map(|(i, w)| f64::from(rows[i * out + x]) * w)
                    .sum::<f64>() as f32;
            }
        }
        dst
    }

    fn triangle(x: f64) -> f64 {
        (1.0 - x.abs()).max(0.0)
    }

    fn lanczos3(x: f64) -> f64 {
        let sinc = |v: f64| {
            if v == 0.0 {
                1.0
            } else {
                (std::f64::consts::PI * v).sin() / (std::f64::consts::PI * v)
            }
        };
        if x.abs() < 3.0 {
            sinc(x) * sinc(x / 3.0)
        } else {
            0.0
        }
    }

    /// A synthetic photo: a smooth gradient, a few sharp-edged objects and fine texture, from a
    /// seeded generator.
    fn synthetic_image(seed: u64, size: usize) -> Vec<f32> {
        let mut state = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64
        };
        let (fx, fy, phase) = (next() * 6.0, next() * 6.0, next() * std::f64::consts::TAU);
        let objects: Vec<[f64; 5]> = (0..4)
            .map(|_| {
                let (x, y) = (next(), next());
                [
                    x,
                    y,
                    x + 0.1 + next() * 0.3,
                    y + 0.1 + next() * 0.3,
                    next() - 0.5,
                ]
            })
            .collect();
        (0..size * size)
            .map(|i| {
                let (x, y) = (
                    (i % size) as f64 / size as f64,
                    (i / size) as f64 / size as f64,
                );
                let mut value = 0.5 + 0.2 * (fx * x + fy * y + phase).sin();
                for [x1, y1, x2, y2, shade] in &objects {
                    if (*x1..*x2).contains(&x) && (*y1..*y2).contains(&y) {
                        value += shade;
                    }
                }
                (value + 0.2 * (next() - 0.5)) as f32
            })
            .collect()
    }

    /// What a vision model's pre-processing ends with: resize, then normalise to mean 0.
    fn preprocess(image: &[f32], kernel: fn(f64) -> f64, support: f64) -> Vec<f32> {
        resize(image, 48, 20, kernel, support)
            .into_iter()
            .map(|v| (v - 0.485) / 0.229)
            .collect()
    }

    #[test]
    fn feature_consistency_catches_bilinear_versus_lanczos() {
        let images: Vec<Vec<f32>> = (0..1000).map(|seed| synthetic_image(seed, 48)).collect();
        let bilinear: Vec<Vec<f32>> = images
            .iter()
            .map(|i| preprocess(i, triangle, 1.0))
            .collect();
        let lanczos: Vec<Vec<f32>> = images
            .iter()
            .map(|i| preprocess(i, lanczos3, 3.0))
            .collect();
        let settings = GateSettings::default();

        let same = feature_consistency_gate(&settings, &bilinear, &bilinear.clone());
        assert!(same.passed, "{}", same.table());

        let changed = feature_consistency_gate(&settings, &bilinear, &lanczos);
        assert!(!changed.passed, "{}", changed.table());
        assert!(
            changed.reasons[0].contains("pre-processing differs"),
            "{:?}",
            changed.reasons
        );
        let GateMetrics::FeatureConsistency(metrics) = &changed.metrics else {
            panic!()
        };
        assert!(metrics.share_consistent < 0.95, "{metrics:?}");
        assert_eq!(metrics.worst[0].cosine, metrics.min_cosine);

        // Float noise far below a real change still passes.
        let jittered: Vec<Vec<f32>> = bilinear
            .iter()
            .map(|v| {
                v.iter()
                    .enumerate()
                    .map(|(i, x)| x + if i % 2 == 0 { 1e-5 } else { -1e-5 })
                    .collect()
            })
            .collect();
        assert!(feature_consistency_gate(&settings, &bilinear, &jittered).passed);

        // Too few samples, or vectors of different lengths, refuse.
        assert!(!feature_consistency_gate(&settings, &bilinear[..10], &bilinear[..10]).passed);
        let mut short = bilinear.clone();
        short[7].pop();
        let report = feature_consistency_gate(&settings, &bilinear, &short);
        assert!(
            !report.passed && report.reasons[0].contains("sample 7"),
            "{:?}",
            report.reasons
        );
    }

    #[test]
    fn settings_from_the_plan_table() {
        let table: toml::Table = toml::from_str(
            r#"
            eval = true
            must_improve = true
            accuracy_margin_points = 1
            unacceptable = [["refund", "logistics"]]
            [recall_floors]
            refund = 0.95
            [data_quality]
            max_label_kl = 0.2
            [feature_consistency]
            samples = 200
            "#,
        )
        .unwrap();
        let settings = GateSettings::from_table(&table).unwrap();
        assert!(settings.must_improve);
        assert_eq!(settings.accuracy_margin_points, 1.0);
        assert_eq!(settings.recall_floors["refund"], 0.95);
        assert_eq!(
            settings.unacceptable,
            vec![["refund".to_owned(), "logistics".to_owned()]]
        );
        assert_eq!(settings.data_quality.max_label_kl, 0.2);
        assert_eq!(settings.data_quality.max_missing, 0.05);
        assert_eq!(settings.feature_consistency.samples, 200);
        assert_eq!(settings.latency_ratio, 1.1);
        assert_eq!(
            GateSettings::from_table(&toml::Table::new()).unwrap(),
            GateSettings::default()
        );

        let typo: toml::Table = toml::from_str("latency_ration = 1.2").unwrap();
        let err = GateSettings::from_table(&typo).unwrap_err();
        assert!(err.to_string().contains("latency_ration"), "{err}");
        let percent: toml::Table = toml::from_str("[recall_floors]\nrefund = 95").unwrap();
        let err = GateSettings::from_table(&percent).unwrap_err();
        assert!(err.to_string().contains("recall_floors.refund"), "{err}");
    }

    #[test]
    fn reports_round_trip_through_json() {
        let truth = refunds_and_logistics();
        let golden = label_set(&truth);
        let stable = answers(&truth);
        let report = eval_gate(&GateSettings::default(), &golden, Some(&stable), &stable);
        let json = serde_json::to_string(&report).unwrap();
        let back: GateReport = serde_json::from_str(&json).unwrap();
        assert_eq!(back, report);
        let reports = [
            report,
            latency_gate(&GateSettings::default(), &[1.0; 3], &[1.0; 3]),
        ];
        assert!(!all_passed(&reports));
        assert!(render_reports(&reports).starts_with("latency gate: REFUSED"));
    }
}
