//! The canary judge: at each tick, the candidate against the concurrent stable on the same step
//! window, with tests that stay valid however often they look.
//!
//! # Why sequential tests
//!
//! The controller looks every second. A fixed-sample test checked at every look would reject an
//! identical candidate far more often than its nominal level. Every test here is instead an
//! *e-process*: a statistic `E_n ≥ 0` that, under the null ("the candidate is no worse than the
//! threshold"), is (close to) a nonnegative supermartingale with `E_0 = 1`, so by Ville's
//! inequality `P(∃n: E_n ≥ 1/α) ≤ α`. A test rejects when `E_n ≥ 1/α_test`; `1/E_n` is reported
//! as the always-valid p-value of that look. The step's α (`judge.alpha`, 1%) is split by
//! Bonferroni over the tests that can run: two slots for latency (TTFT and time per output token,
//! or E2E twice for models without tokens), one for the error rate, one for the entropy spread, and
//! one per optional test that is configured (entropy mean, confidence, helpful rate, agreement). Inside a
//! latency slot, half goes to the tail test and half to the location test.
//!
//! # The tests
//!
//! - **Latency, tail** (`*_p95`): H0 "the candidate's p95 ≤ ratio × the stable's p95", i.e. a
//!   candidate request exceeds `ratio × q95(stable)` with probability ≤ 5%. The reference is an
//!   upper confidence bound of the stable's p95 (the order statistic two binomial standard errors
//!   above the 95th, so the test waits for ~60 stable samples), and the indicator of exceeding
//!   `ratio ×` it is tested against 5% with a betting e-process, a mixture over a grid of bet sizes
//!   of `Π (1 + λ (X_i − p0))`. It depends only on (count, exceedances), so it is recomputed from
//!   the window at each look.
//! - **Latency, location** (same metric name): the p95 test alone needs ~15 candidate samples for a
//!   1.5× slower candidate, too many at a 5% step with a few requests per second. A candidate that
//!   is slower on every request is seen much sooner in the mean of log-latency: H0 "mean log
//!   latency of the candidate ≤ the stable's + ln(ratio)" (for a scale change that is the same
//!   statement as the p95 one), tested with a one-sided normal-mixture e-process (Robbins' mixture,
//!   τ = σ) on the standardised difference, with the variance of both means. It fails a 1.5×
//!   slower candidate (σ = 0.2) after ~6–10 candidate samples, and waits for
//!   `MIN_LOCATION_SAMPLES` (5): a fresh engine's first answers are its slowest.
//! - **Error rate**: H0 "p_c ≤ p_s + points/100": the candidate's errors as a Bernoulli betting
//!   e-process against `p0 = Wilson upper bound (z = 1) of p_s + points/100`.
//! - **Entropy spread** (`entropy_std`): the issue's rule, "entropy std ≥ 0.05 within a step → roll
//!   back", read as a *comparison*: the std of the candidate's per-request mean entropy moved away
//!   from the stable's by at least `entropy_std_max` nats (a healthy LLM's per-request entropy has
//!   a std of tenths of a nat, so an absolute reading would roll back every candidate). Tested on
//!   the log of the std ratio (whose noise does not depend on the std), two one-sided normal
//!   mixtures averaged, from `MIN_SPREAD_SAMPLES` candidate samples. A collapse (the spread falls
//!   to ~0) fails as soon as that many samples are in.
//! - **Entropy mean** (optional, nats), **confidence** (optional drop), **helpful rate** (optional
//!   points): the same normal mixture on the difference of means (rates) beyond the threshold.
//!   The helpful rate's samples are answers, not ratings: each rated answer counts once, with
//!   its latest rating ([`StepWindow::rate`]), so rating one answer again and again moves it by
//!   at most one sample.
//! - **Agreement** (optional, shadow mode): the candidate's and the control's answers to the same
//!   mirrored request (same input, same seed) are compared; H0 "they disagree on at most
//!   `1 − agreement_min` of the requests", a Bernoulli betting e-process on the disagreements,
//!   from `MIN_CANDIDATE_SAMPLES` comparisons. The rate is reported in the summary either way.
//! - **Drift**: a monitor's drift alarm active on the candidate and not on the stable fails at
//!   once (no statistics: the monitor already did its own).
//!
//! # The control
//!
//! With a control (`[routing] control`, `Judge::control`), "the stable" of the latency tests is
//! the control alone, a copy of the stable at the candidate's share (its engine under the same
//! load), from `MIN_CONTROL_SAMPLES`; the other tests keep every sample of the stable version.
//!
//! # What is approximate
//!
//! The stable's side is a plug-in (its p95, mean, std, error rate as estimated so far), not a
//! time-uniform bound; the margins above (and that the stable gets most traffic at the early
//! steps) keep its noise small, and at least `MIN_REFERENCE_SAMPLES` stable samples are needed
//! before any comparative test runs. The normal mixtures assume the standardised difference is
//! near-Gaussian (log-latency is; entropy and confidence means are after a few samples). The A/A
//! simulation in the controller's tests measures the resulting false-rollback rate.
//!
//! # Verdicts
//!
//! `Fail` as soon as a test rejects (any time: that is the point of a sequential test).
//! `Pass` when the step lasted `min_step_secs`, the candidate has `min_samples` samples, the stable
//! reference exists and nothing failed. `Inconclusive` (hold, alert; never promote or roll back on
//! no data) when `max_step_secs` passed without enough samples, or after `min_step_secs` no
//! request of either variant came for `stall_secs` (traffic stopped). `Continue` otherwise.
//!
//! # Memory
//!
//! Counts, errors and moments are exact over the whole step. The latency values kept for quantiles
//! are a log-bucketed histogram per variant and metric (each value is kept as its bucket's
//! representative, within `SKETCH_ACCURACY` (0.5 %) of it, as in DDSketch): its size depends on
//! the spread of the latencies, not on their count (about 230 buckets for a factor of ten).
//!
//! # Several replicas
//!
//! Every part of a window is a sufficient statistic that merges exactly: counts add, moments
//! merge with Chan's formulas, histograms add bucket by bucket. A replica of a fleet publishes
//! its window ([`StepWindow`] serializes), and the judge decides on [`StepWindow::pooled`], the
//! merge of every replica's window of the step: the same verdict as one process that served all
//! of their traffic (up to the floating point of the merged moments).

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use crate::plan::{JudgeConfig, Schedule, Variant};

/// The latency histograms' relative accuracy: a value is kept as its bucket's representative,
/// within this share of it.
pub const SKETCH_ACCURACY: f64 = 0.005;
/// Stable samples needed before any comparative test runs or a step may pass.
pub const MIN_REFERENCE_SAMPLES: u64 = 30;
/// The same for a control (a copy of the stable at the candidate's share), which gets about as
/// many samples as the candidate: the tests standardise with both sides' variances.
pub const MIN_CONTROL_SAMPLES: u64 = 10;
/// Candidate samples the mean tests need.
pub const MIN_CANDIDATE_SAMPLES: u64 = 10;
/// Candidate samples the latency location test waits for.
pub const MIN_LOCATION_SAMPLES: u64 = 5;
/// Candidate samples the spread test needs (the log of a sample std is skewed at small counts).
pub const MIN_SPREAD_SAMPLES: u64 = 20;
/// The tail the latency test is about.
const TAIL_LEVEL: f64 = 0.95;
/// How many binomial standard errors above the tail level the stable's reference order statistic
/// sits (the tail test waits until the stable has enough samples for that order statistic).
const TAIL_REFERENCE_Z: f64 = 2.0;
/// Bet sizes of the Bernoulli betting mixture, as fractions of the largest allowed bet.
const BET_FRACTIONS: [f64; 4] = [0.1, 0.25, 0.45, 0.65];

/// What the server derives from one record of the model for the judge.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub variant: Variant,
    pub time_ms: u64,
    /// A server-side failure of this version (5xx, or a fallback away from it). Client errors
    /// (4xx) are not errors of the version and should not be sent as errors.
    pub error: bool,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2e_ms: f64,
    pub entropy_mean: Option<f32>,
    pub confidence: Option<f32>,
    pub helpful: Option<bool>,
}

/// Running mean, variance and kurtosis (Welford's update, extended to the third and fourth
/// central moments), mergeable (Chan et al.).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct Moments {
    n: u64,
    mean: f64,
    m2: f64,
    m3: f64,
    m4: f64,
}

impl Moments {
    fn push(&mut self, x: f64) {
        if !x.is_finite() {
            return;
        }
        let n1 = self.n as f64;
        self.n += 1;
        let n = self.n as f64;
        let delta = x - self.mean;
        let delta_n = delta / n;
        let delta_n2 = delta_n * delta_n;
        let term1 = delta * delta_n * n1;
        self.mean += delta_n;
        self.m4 += term1 * delta_n2 * (n * n - 3.0 * n + 3.0) + 6.0 * delta_n2 * self.m2
            - 4.0 * delta_n * self.m3;
        self.m3 += term1 * delta_n * (n - 2.0) - 3.0 * delta_n * self.m2;
        self.m2 += term1;
    }

    /// Adds the moments of other values (Chan, Golub and LeVeque's pairwise update, to the
    /// fourth moment): the same as pushing them one by one, up to rounding.
    fn merge(&mut self, other: &Moments) {
        if other.n == 0 {
            return;
        }
        if self.n == 0 {
            *self = other.clone();
            return;
        }
        let (na, nb) = (self.n as f64, other.n as f64);
        let n = na + nb;
        let delta = other.mean - self.mean;
        let (d2, d3, d4) = (delta * delta, delta.powi(3), delta.powi(4));
        let m2 = self.m2 + other.m2 + d2 * na * nb / n;
        let m3 = self.m3
            + other.m3
            + d3 * na * nb * (na - nb) / (n * n)
            + 3.0 * delta * (na * other.m2 - nb * self.m2) / n;
        let m4 = self.m4
            + other.m4
            + d4 * na * nb * (na * na - na * nb + nb * nb) / (n * n * n)
            + 6.0 * d2 * (na * na * other.m2 + nb * nb * self.m2) / (n * n)
            + 4.0 * delta * (na * other.m3 - nb * self.m3) / n;
        self.mean += delta * nb / n;
        self.n += other.n;
        self.m2 = m2;
        self.m3 = m3;
        self.m4 = m4;
    }

    /// The (non-excess) kurtosis, 3 for a normal distribution; 3 until there are enough
    /// samples to say more.
    fn kurtosis(&self) -> f64 {
        if self.n < 8 || self.m2 <= 0.0 {
            return 3.0;
        }
        self.n as f64 * self.m4 / (self.m2 * self.m2)
    }

    fn variance(&self) -> f64 {
        if self.n < 2 {
            0.0
        } else {
            self.m2 / (self.n - 1) as f64
        }
    }

    fn std(&self) -> f64 {
        self.variance().sqrt()
    }
}

/// A log-bucketed histogram of positive values (DDSketch's mapping): value `x` lands in bucket
/// `ceil(ln x / ln γ)` with `γ = (1 + a) / (1 − a)`, and stands for `2 γ^i / (1 + γ)`, within `a`
/// of it. Two histograms merge by adding their buckets.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct Sketch {
    /// Bucket index → count; sparse (a step's latencies span a few hundred buckets).
    buckets: BTreeMap<i32, u64>,
    count: u64,
}

impl Sketch {
    fn gamma() -> f64 {
        (1.0 + SKETCH_ACCURACY) / (1.0 - SKETCH_ACCURACY)
    }

    fn index(x: f64) -> i32 {
        (x.ln() / Self::gamma().ln()).ceil() as i32
    }

    fn value(index: i32) -> f64 {
        let g = Self::gamma();
        2.0 * g.powi(index) / (1.0 + g)
    }

    fn push(&mut self, x: f64) {
        *self.buckets.entry(Self::index(x)).or_insert(0) += 1;
        self.count += 1;
    }

    fn merge(&mut self, other: &Sketch) {
        for (&i, &c) in &other.buckets {
            *self.buckets.entry(i).or_insert(0) += c;
        }
        self.count += other.count;
    }

    /// The `rank`-th smallest value (1-based), as its bucket's representative.
    fn nth(&self, rank: u64) -> Option<f64> {
        let mut seen = 0;
        for (&i, &c) in &self.buckets {
            seen += c;
            if seen >= rank {
                return Some(Self::value(i));
            }
        }
        None
    }

    /// How many values are above `threshold`.
    fn count_above(&self, threshold: f64) -> u64 {
        self.buckets
            .iter()
            .rev()
            .take_while(|(&i, _)| Self::value(i) > threshold)
            .map(|(_, &c)| c)
            .sum()
    }
}

/// One latency metric of one variant: a histogram of the values and the moments of their logs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct Series {
    sketch: Sketch,
    seen: u64,
    log: Moments,
}

impl Series {
    fn push(&mut self, x: f64) {
        if !(x.is_finite() && x > 0.0) {
            return;
        }
        self.seen += 1;
        self.log.push(x.ln());
        self.sketch.push(x);
    }

    fn merge(&mut self, other: &Series) {
        self.seen += other.seen;
        self.log.merge(&other.log);
        self.sketch.merge(&other.sketch);
    }

    /// An upper confidence bound of the `level` quantile: the order statistic `z` binomial
    /// standard errors above `level × n`; `None` while there are too few values for it.
    fn upper_quantile(&self, level: f64, z: f64) -> Option<f64> {
        let n = self.sketch.count as f64;
        let rank = (level * n + z * (n * level * (1.0 - level)).sqrt()).ceil() + 1.0;
        if rank > n {
            return None;
        }
        self.sketch.nth(rank as u64)
    }

    fn quantile(&self, level: f64) -> Option<f64> {
        let n = self.sketch.count;
        if n == 0 {
            return None;
        }
        let rank = ((level * n as f64).ceil() as u64).clamp(1, n);
        self.sketch.nth(rank)
    }
}

/// What one variant showed during the step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct Side {
    samples: u64,
    errors: u64,
    ttft: Series,
    tpot: Series,
    e2e: Series,
    entropy: Moments,
    confidence: Moments,
    helpful: u64,
    helpful_answers: u64,
    last_ms: Option<u64>,
    drift: Option<String>,
}

impl Side {
    /// Adds one sample. Latencies, entropy and confidence count only for successful requests.
    fn push(&mut self, sample: &Sample) {
        self.samples += 1;
        self.last_ms = Some(
            self.last_ms
                .map_or(sample.time_ms, |t| t.max(sample.time_ms)),
        );
        if let Some(h) = sample.helpful {
            self.helpful_answers += 1;
            self.helpful += u64::from(h);
        }
        if sample.error {
            self.errors += 1;
            return;
        }
        if let Some(t) = sample.ttft_ms {
            self.ttft.push(t);
        }
        if let Some(t) = sample.tpot_ms {
            self.tpot.push(t);
        }
        self.e2e.push(sample.e2e_ms);
        if let Some(h) = sample.entropy_mean {
            self.entropy.push(f64::from(h));
        }
        if let Some(c) = sample.confidence {
            self.confidence.push(f64::from(c));
        }
    }

    /// Adds another replica's view of the same variant in the same step. A drift alarm on
    /// either is an alarm of the pooled side.
    fn merge(&mut self, other: &Side) {
        self.samples += other.samples;
        self.errors += other.errors;
        self.ttft.merge(&other.ttft);
        self.tpot.merge(&other.tpot);
        self.e2e.merge(&other.e2e);
        self.entropy.merge(&other.entropy);
        self.confidence.merge(&other.confidence);
        self.helpful += other.helpful;
        self.helpful_answers += other.helpful_answers;
        self.last_ms = match (self.last_ms, other.last_ms) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        if self.drift.is_none() {
            self.drift.clone_from(&other.drift);
        }
    }
}

/// The samples of both variants since the step started, and the monitors' drift alarms. The
/// stable's side holds every sample of the stable version (its main copy's and the control's);
/// the control's are also kept apart, as the latency tests' reference when the release has one.
///
/// It serializes (without the per-answer ratings, which a fleet pools in its database): what a
/// replica of a fleet publishes for the judge, who merges them with [`StepWindow::pooled`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepWindow {
    started_ms: u64,
    stable: Side,
    control: Side,
    candidate: Side,
    /// Shadow mode: mirrored requests both the candidate and the control answered, and how many
    /// of those answers agreed.
    compared: u64,
    agreed: u64,
    /// The rating each rated answer (by audit id) counts with in the helpful-rate test, and on
    /// which side: an answer counts once, with its latest rating, however often it is rated.
    #[serde(skip)]
    ratings: HashMap<String, (Variant, bool)>,
}

impl StepWindow {
    pub fn new(started_ms: u64) -> Self {
        Self {
            started_ms,
            stable: Side::default(),
            control: Side::default(),
            candidate: Side::default(),
            compared: 0,
            agreed: 0,
            ratings: HashMap::new(),
        }
    }

    /// A new step's window that keeps only the drift alarms of the previous one.
    pub fn next(started_ms: u64, previous: &StepWindow) -> Self {
        let mut w = Self::new(started_ms);
        w.stable.drift = previous.stable.drift.clone();
        w.candidate.drift = previous.candidate.drift.clone();
        w
    }

    pub fn started_ms(&self) -> u64 {
        self.started_ms
    }

    /// The window of a step as one process would have seen it, from the windows of the same
    /// step that several replicas saw (each one's samples once). The start is the earliest.
    pub fn pooled<'a>(windows: impl IntoIterator<Item = &'a StepWindow>) -> Option<StepWindow> {
        let mut windows = windows.into_iter();
        let mut pooled = windows.next()?.clone();
        for w in windows {
            pooled.started_ms = pooled.started_ms.min(w.started_ms);
            pooled.stable.merge(&w.stable);
            pooled.control.merge(&w.control);
            pooled.candidate.merge(&w.candidate);
            pooled.compared += w.compared;
            pooled.agreed += w.agreed;
            for (answer, rating) in &w.ratings {
                pooled.ratings.insert(answer.clone(), *rating);
            }
        }
        Some(pooled)
    }

    /// The helpful-rate test's samples of a variant counted elsewhere (a fleet's ratings table,
    /// one row per answer): `helpful` of `answers` rated answers, replacing this window's.
    pub fn set_ratings(&mut self, variant: Variant, helpful: u64, answers: u64) {
        let side = self.rated_side(variant);
        side.helpful = helpful;
        side.helpful_answers = answers;
    }

    /// Keeps only the window's statistics and drops the samples' count of ratings: a fleet's
    /// replicas publish this, and the judge counts ratings from the shared table.
    pub fn without_ratings(&self) -> StepWindow {
        let mut w = self.clone();
        w.ratings.clear();
        for side in [&mut w.stable, &mut w.control, &mut w.candidate] {
            side.helpful = 0;
            side.helpful_answers = 0;
        }
        w
    }

    fn side(&self, variant: Variant) -> &Side {
        match variant {
            Variant::Stable => &self.stable,
            Variant::Control => &self.control,
            Variant::Candidate => &self.candidate,
        }
    }

    /// Adds one sample (a control's counts for the stable version too).
    pub fn push(&mut self, sample: &Sample) {
        match sample.variant {
            Variant::Stable => self.stable.push(sample),
            Variant::Control => {
                self.control.push(sample);
                self.stable.push(sample);
            }
            Variant::Candidate => self.candidate.push(sample),
        }
    }

    /// Shadow mode: the candidate's and the control's answers to one mirrored request agreed
    /// or not.
    pub fn push_agreement(&mut self, agreed: bool) {
        self.compared += 1;
        self.agreed += u64::from(agreed);
    }

    /// Mirrored requests compared in this step, and how many agreed.
    pub fn agreement(&self) -> (u64, u64) {
        (self.compared, self.agreed)
    }

    /// The feedback loop's rating of `answer` (its audit id), an answer a variant gave during
    /// this step: helpful or not, or `None` when it no longer rates it either way (the
    /// helpful-rate test's samples; they come later than the requests'). An answer is one
    /// sample: rated again, its new rating replaces its old one (it does not add a second).
    pub fn rate(&mut self, variant: Variant, answer: &str, helpful: Option<bool>) {
        if let Some((was, old)) = self.ratings.remove(answer) {
            let side = self.rated_side(was);
            side.helpful_answers = side.helpful_answers.saturating_sub(1);
            side.helpful = side.helpful.saturating_sub(u64::from(old));
        }
        if let Some(helpful) = helpful {
            let side = self.rated_side(variant);
            side.helpful_answers += 1;
            side.helpful += u64::from(helpful);
            self.ratings.insert(answer.to_string(), (variant, helpful));
        }
    }

    fn rated_side(&mut self, variant: Variant) -> &mut Side {
        match variant {
            Variant::Stable | Variant::Control => &mut self.stable,
            Variant::Candidate => &mut self.candidate,
        }
    }

    /// A monitor's drift alarm on a variant was raised (`active`) or cleared.
    pub fn set_drift(&mut self, variant: Variant, active: bool, detail: &str) {
        let drift = active.then(|| detail.to_string());
        match variant {
            Variant::Stable | Variant::Control => self.stable.drift = drift,
            Variant::Candidate => self.candidate.drift = drift,
        }
    }

    /// Ratings of a variant's answers in this step: (helpful, rated).
    pub fn helpful(&self, variant: Variant) -> (u64, u64) {
        let side = self.side(variant);
        (side.helpful, side.helpful_answers)
    }

    /// Samples of a variant in this step.
    pub fn samples(&self, variant: Variant) -> u64 {
        self.side(variant).samples
    }

    pub fn errors(&self, variant: Variant) -> u64 {
        self.side(variant).errors
    }

    /// The time of the latest sample of a variant.
    pub fn last_sample_ms(&self, variant: Variant) -> Option<u64> {
        self.side(variant).last_ms
    }
}

/// One test's numbers at this look.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MetricStat {
    /// `ttft_p95`, `tpot_p95`, `e2e_p95`, `error_rate`, `entropy_std`, `entropy_mean`,
    /// `confidence`, `helpful_rate`, `agreement`, `drift`.
    pub metric: &'static str,
    /// `tail`, `location`, `rate`, `spread`, `mean`, `alarm`.
    pub test: &'static str,
    /// The stable's and the candidate's value of the metric (p95 in ms, rate, std, mean).
    pub stable: Option<f64>,
    pub candidate: Option<f64>,
    /// What is compared with `threshold` (a ratio for latency, points for rates, nats...).
    pub statistic: f64,
    pub threshold: f64,
    pub e_value: f64,
    /// The level this test rejects at (its share of `judge.alpha`).
    pub alpha: f64,
}

/// What the judge saw at this look.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// Every sample of the stable version (its main copy's and the control's).
    pub samples_stable: u64,
    /// The control's alone (0 without one): the latency tests' reference when present.
    pub samples_control: u64,
    pub samples_candidate: u64,
    /// Shadow mode: mirrored requests whose candidate and control answers were compared, and
    /// the share that agreed (`None` before the first comparison).
    pub compared: u64,
    pub agreement: Option<f64>,
    pub elapsed_ms: u64,
    pub metrics: Vec<MetricStat>,
}

/// The judge's answer for a step at one look.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum Verdict {
    /// The step is done and the candidate was not found worse.
    Pass { summary: Summary },
    /// Still collecting, nothing wrong so far.
    Continue { summary: Summary },
    /// Not enough data to conclude: hold, alert, never decide.
    Inconclusive { reason: String, summary: Summary },
    /// The candidate is worse: roll back.
    Fail {
        metric: &'static str,
        reason: String,
        statistic: f64,
        threshold: f64,
        e_value: Option<f64>,
        p_value: Option<f64>,
        samples_stable: u64,
        samples_candidate: u64,
        summary: Summary,
    },
}

impl Verdict {
    pub fn summary(&self) -> &Summary {
        match self {
            Verdict::Pass { summary }
            | Verdict::Continue { summary }
            | Verdict::Inconclusive { summary, .. }
            | Verdict::Fail { summary, .. } => summary,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Verdict::Pass { .. } => "pass",
            Verdict::Continue { .. } => "continue",
            Verdict::Inconclusive { .. } => "inconclusive",
            Verdict::Fail { .. } => "fail",
        }
    }
}

/// The betting e-process for "a Bernoulli rate ≤ p0" after `hits` of `n`, as a mixture over
/// `BET_FRACTIONS` of `(1 + λ(1 − p0))^hits (1 − λ p0)^(n − hits)` with `λ = f / p0`.
pub fn bernoulli_e_value(hits: u64, n: u64, p0: f64) -> f64 {
    if n == 0 || p0 >= 1.0 {
        return 1.0;
    }
    let p0 = p0.max(1e-6);
    let (hits, misses) = (hits as f64, (n - hits.min(n)) as f64);
    let sum: f64 = BET_FRACTIONS
        .iter()
        .map(|&f| {
            let win = (f * (1.0 - p0) / p0).ln_1p();
            let loss = (-f).ln_1p();
            (hits * win + misses * loss).exp()
        })
        .sum();
    sum / BET_FRACTIONS.len() as f64
}

/// Robbins' normal-mixture e-process (mixing variance equal to the noise variance) for a
/// standardised statistic `z = S_n / √n` after `n` observations: `(1+n)^(-1/2) exp(n z² / (2(1+n)))`.
/// One-sided: a negative `z` is no evidence (e ≤ 1).
pub fn normal_mixture_e_value(z: f64, n: u64) -> f64 {
    let n = n as f64;
    if n <= 0.0 || !z.is_finite() {
        return 1.0;
    }
    let e = (-(0.5) * n.ln_1p() + n * z * z / (2.0 * (1.0 + n))).exp();
    if z > 0.0 {
        e
    } else {
        e.min(1.0)
    }
}

/// The Wilson upper confidence bound of a rate.
fn wilson_upper(hits: u64, n: u64, z: f64) -> f64 {
    if n == 0 {
        return 1.0;
    }
    let n = n as f64;
    let p = hits as f64 / n;
    let z2 = z * z;
    let centre = p + z2 / (2.0 * n);
    let spread = z * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt();
    ((centre + spread) / (1.0 + z2 / n)).min(1.0)
}

/// The judge: the schedule's limits on a step, applied to a window.
#[derive(Debug, Clone, PartialEq)]
pub struct Judge {
    pub min_samples: u64,
    pub min_step_ms: u64,
    pub max_step_ms: u64,
    pub stall_ms: u64,
    /// The latency tests compare with the control (`[routing] control`), not the stable's
    /// main copy; the other tests compare with every sample of the stable version.
    pub control: bool,
}

impl Judge {
    /// The judge of a schedule against the stable itself.
    pub fn from_schedule(schedule: &Schedule) -> Self {
        Self {
            min_samples: schedule.min_samples,
            min_step_ms: schedule.min_step_secs.saturating_mul(1000),
            max_step_ms: schedule.max_step_secs.saturating_mul(1000),
            stall_ms: schedule.stall_secs.saturating_mul(1000),
            control: false,
        }
    }

    /// The judge of a plan: its schedule, against its reference (the control or the stable).
    pub fn for_plan(plan: &crate::plan::ReleasePlan) -> Self {
        let mut judge = Self::from_schedule(&plan.schedule);
        judge.control = plan.routing.reference() == Variant::Control;
        judge
    }

    /// Judges the window at `now_ms`.
    pub fn evaluate(&self, cfg: &JudgeConfig, window: &StepWindow, now_ms: u64) -> Verdict {
        let s = &window.stable;
        let c = &window.candidate;
        let elapsed_ms = now_ms.saturating_sub(window.started_ms);
        let mut metrics = Vec::new();
        let summary = |metrics: Vec<MetricStat>| Summary {
            samples_stable: s.samples,
            samples_control: window.control.samples,
            samples_candidate: c.samples,
            compared: window.compared,
            agreement: (window.compared > 0).then(|| window.agreed as f64 / window.compared as f64),
            elapsed_ms,
            metrics,
        };

        // Bonferroni slots (fixed by configuration and by which signals exist, not by outcomes).
        let optional = [
            cfg.entropy_mean_shift.is_some(),
            cfg.confidence_drop.is_some(),
            cfg.helpful_rate_points.is_some(),
            cfg.agreement_min.is_some(),
        ];
        let slots = 4 + optional.iter().filter(|&&on| on).count();
        let alpha_slot = cfg.alpha / slots as f64;

        if cfg.drift {
            if let (Some(detail), None) = (&c.drift, &s.drift) {
                metrics.push(MetricStat {
                    metric: "drift",
                    test: "alarm",
                    stable: Some(0.0),
                    candidate: Some(1.0),
                    statistic: 1.0,
                    threshold: 0.0,
                    e_value: f64::INFINITY,
                    alpha: 0.0,
                });
                return Verdict::Fail {
                    metric: "drift",
                    reason: format!("the candidate's monitors raised a drift alarm: {detail}"),
                    statistic: 1.0,
                    threshold: 0.0,
                    e_value: None,
                    p_value: None,
                    samples_stable: s.samples,
                    samples_candidate: c.samples,
                    summary: summary(metrics),
                };
            }
        }

        // Latency depends on load, so with a control it is compared with the control alone
        // (same share of the traffic as the candidate); errors, entropy and confidence do
        // not, and are compared with every sample of the stable version.
        let (latency_ref, latency_min) = if self.control {
            (&window.control, MIN_CONTROL_SAMPLES)
        } else {
            (s, MIN_REFERENCE_SAMPLES)
        };
        // The latency tests wait for their own reference (`latency_tests` checks it); errors,
        // entropy and confidence run as soon as the stable version has its samples.
        let stable_ready = s.samples >= MIN_REFERENCE_SAMPLES;
        let reference_ready = stable_ready && latency_ref.samples >= latency_min;
        if stable_ready {
            // Latency: TTFT and TPOT for token models, E2E (with both slots) otherwise.
            let token_model = s.ttft.seen > 0 || c.ttft.seen > 0;
            let l = latency_ref;
            let latency: Vec<(&'static str, &Series, &Series, f64)> = if token_model {
                vec![
                    ("ttft_p95", &l.ttft, &c.ttft, alpha_slot),
                    ("tpot_p95", &l.tpot, &c.tpot, alpha_slot),
                ]
            } else {
                vec![("e2e_p95", &l.e2e, &c.e2e, 2.0 * alpha_slot)]
            };
            for (metric, stable, candidate, alpha) in latency {
                latency_tests(
                    cfg,
                    metric,
                    (stable, candidate),
                    (latency_min, alpha),
                    &mut metrics,
                );
            }
            error_test(cfg, s, c, alpha_slot, &mut metrics);
            let entropy_ready =
                s.entropy.n >= MIN_REFERENCE_SAMPLES && c.entropy.n >= MIN_CANDIDATE_SAMPLES;
            if entropy_ready && c.entropy.n >= MIN_SPREAD_SAMPLES {
                metrics.push(spread_stat(
                    &s.entropy,
                    &c.entropy,
                    cfg.entropy_std_max,
                    alpha_slot,
                ));
            }
            if entropy_ready {
                if let Some(shift) = cfg.entropy_mean_shift {
                    let diff = (c.entropy.mean - s.entropy.mean).abs();
                    metrics.push(mean_stat(
                        "entropy_mean",
                        &s.entropy,
                        &c.entropy,
                        diff,
                        shift,
                        alpha_slot,
                    ));
                }
            }
            if let Some(drop) = cfg.confidence_drop {
                if s.confidence.n >= MIN_REFERENCE_SAMPLES
                    && c.confidence.n >= MIN_CANDIDATE_SAMPLES
                {
                    let diff = s.confidence.mean - c.confidence.mean;
                    metrics.push(mean_stat(
                        "confidence",
                        &s.confidence,
                        &c.confidence,
                        diff,
                        drop,
                        alpha_slot,
                    ));
                }
            }
            if let Some(points) = cfg.helpful_rate_points {
                if s.helpful_answers >= MIN_REFERENCE_SAMPLES
                    && c.helpful_answers >= MIN_CANDIDATE_SAMPLES
                {
                    let rate = |side: &Side| side.helpful as f64 / side.helpful_answers as f64;
                    let (ps, pc) = (rate(s), rate(c));
                    let var = |p: f64, n: u64| {
                        p.clamp(0.01, 0.99) * (1.0 - p.clamp(0.01, 0.99)) / n as f64
                    };
                    let se = (var(ps, s.helpful_answers) + var(pc, c.helpful_answers)).sqrt();
                    let drop_points = 100.0 * (ps - pc);
                    metrics.push(MetricStat {
                        metric: "helpful_rate",
                        test: "rate",
                        stable: Some(ps),
                        candidate: Some(pc),
                        statistic: drop_points,
                        threshold: points,
                        e_value: normal_mixture_e_value(
                            (ps - pc - points / 100.0) / se,
                            c.helpful_answers,
                        ),
                        alpha: alpha_slot,
                    });
                }
            }
        }

        // Agreement (shadow mode, when configured): H0 "the candidate disagrees with the control
        // on at most 1 − agreement_min of the mirrored requests", a Bernoulli betting e-process
        // on the disagreements. It needs no stable samples: both answers are to the same request.
        if let Some(min) = cfg.agreement_min {
            if window.compared >= MIN_CANDIDATE_SAMPLES {
                let disagreed = window.compared - window.agreed;
                let rate = window.agreed as f64 / window.compared as f64;
                metrics.push(MetricStat {
                    metric: "agreement",
                    test: "rate",
                    stable: None,
                    candidate: Some(rate),
                    statistic: rate,
                    threshold: min,
                    e_value: bernoulli_e_value(disagreed, window.compared, 1.0 - min),
                    alpha: alpha_slot,
                });
            }
        }

        if let Some(failed) = metrics.iter().find(|m| m.e_value >= 1.0 / m.alpha) {
            let reason = format!(
                "{} ({} test): {} {:.4} against a threshold of {:.4}, e-value {:.1} ≥ 1/α = {:.0} \
                 ({} stable, {} candidate samples)",
                failed.metric,
                failed.test,
                statistic_name(failed.metric),
                failed.statistic,
                failed.threshold,
                failed.e_value,
                1.0 / failed.alpha,
                s.samples,
                c.samples
            );
            let (metric, statistic, threshold, e) = (
                failed.metric,
                failed.statistic,
                failed.threshold,
                failed.e_value,
            );
            return Verdict::Fail {
                metric,
                reason,
                statistic,
                threshold,
                e_value: Some(e),
                p_value: Some((1.0 / e).min(1.0)),
                samples_stable: s.samples,
                samples_candidate: c.samples,
                summary: summary(metrics),
            };
        }

        let long_enough = elapsed_ms >= self.min_step_ms;
        // With the helpful-rate test on, a step also waits for ratings of both variants'
        // answers: they come later than the requests, and a step passed on requests alone
        // would never be judged on them.
        let ratings_ready = cfg.helpful_rate_points.is_none()
            || (c.helpful_answers >= cfg.min_ratings && s.helpful_answers >= cfg.min_ratings);
        if long_enough && reference_ready && c.samples >= self.min_samples && ratings_ready {
            return Verdict::Pass {
                summary: summary(metrics),
            };
        }
        // Traffic stopped: no request of either variant for a while. A candidate that gets
        // too few samples while the stable's flow (a small weight on little traffic) is not a
        // stop: it waits for `max_step_secs`.
        let quiet_since = c
            .last_ms
            .max(s.last_ms)
            .unwrap_or(window.started_ms)
            .max(window.started_ms);
        if long_enough && now_ms.saturating_sub(quiet_since) >= self.stall_ms {
            return Verdict::Inconclusive {
                reason: format!(
                    "no request for {} s (traffic stopped): {} stable, {} candidate samples",
                    now_ms.saturating_sub(quiet_since) / 1000,
                    s.samples,
                    c.samples
                ),
                summary: summary(metrics),
            };
        }
        if elapsed_ms >= self.max_step_ms {
            return Verdict::Inconclusive {
                reason: format!(
                    "too few samples after {} s: {} candidate (need {}), {} stable (need {}){}{}",
                    elapsed_ms / 1000,
                    c.samples,
                    self.min_samples,
                    s.samples,
                    MIN_REFERENCE_SAMPLES,
                    if self.control {
                        format!(
                            ", {} control (need {MIN_CONTROL_SAMPLES})",
                            window.control.samples
                        )
                    } else {
                        String::new()
                    },
                    if cfg.helpful_rate_points.is_some() {
                        format!(
                            "; ratings: {} candidate, {} stable (need {} each)",
                            c.helpful_answers, s.helpful_answers, cfg.min_ratings
                        )
                    } else {
                        String::new()
                    }
                ),
                summary: summary(metrics),
            };
        }
        Verdict::Continue {
            summary: summary(metrics),
        }
    }
}

fn statistic_name(metric: &str) -> &'static str {
    match metric {
        "ttft_p95" | "tpot_p95" | "e2e_p95" => "candidate/stable",
        "error_rate" | "helpful_rate" => "difference in points",
        "entropy_std" => "|Δ std| in nats",
        "entropy_mean" => "|Δ mean| in nats",
        "confidence" => "mean drop",
        "agreement" => "share of mirrored answers agreeing with the control's",
        _ => "statistic",
    }
}

/// The two latency tests of one metric (tail and location), each at half of `alpha`.
fn latency_tests(
    cfg: &JudgeConfig,
    metric: &'static str,
    (stable, candidate): (&Series, &Series),
    (min_reference, alpha): (u64, f64),
    out: &mut Vec<MetricStat>,
) {
    if stable.seen < min_reference || candidate.seen == 0 {
        return;
    }
    let (Some(q_s), Some(q_c)) = (stable.quantile(TAIL_LEVEL), candidate.quantile(TAIL_LEVEL))
    else {
        return;
    };
    let ratio = cfg.latency_ratio;
    // Tail: exceedances of ratio × an upper confidence bound of the stable's p95 (the order
    // statistic `TAIL_REFERENCE_Z` binomial standard errors above the 95th), against 5%. A plug-in
    // p95 from a few dozen stable samples is often low, which made an at-threshold candidate fail
    // 2% of the time (the boundary simulation); with the bound it is within α.
    let Some(reference) = stable.upper_quantile(TAIL_LEVEL, TAIL_REFERENCE_Z) else {
        return location_test(cfg, metric, stable, candidate, alpha, out);
    };
    let threshold_ms = ratio * reference;
    let p0 = 1.0 - TAIL_LEVEL;
    let hits = candidate.sketch.count_above(threshold_ms);
    out.push(MetricStat {
        metric,
        test: "tail",
        stable: Some(q_s),
        candidate: Some(q_c),
        statistic: q_c / q_s,
        threshold: ratio,
        e_value: bernoulli_e_value(hits, candidate.sketch.count, p0),
        alpha: alpha / 2.0,
    });
    location_test(cfg, metric, stable, candidate, alpha, out);
}

/// The location half of a latency metric (see the module doc).
fn location_test(
    cfg: &JudgeConfig,
    metric: &'static str,
    stable: &Series,
    candidate: &Series,
    alpha: f64,
    out: &mut Vec<MetricStat>,
) {
    // A first request or two prove little about a location: a freshly loaded engine's first
    // answers are its slowest (caches, lazy initialisation), and with one sample the spread is
    // the stable's by assumption.
    if candidate.log.n < MIN_LOCATION_SAMPLES {
        return;
    }
    let ratio = cfg.latency_ratio;
    // Location: mean log-latency difference beyond ln(ratio), standardised with both variances.
    let (ls, lc) = (&stable.log, &candidate.log);
    let sd_s = ls.std().max(1e-6);
    let sd_c = if lc.n >= MIN_CANDIDATE_SAMPLES {
        lc.std().max(sd_s)
    } else {
        sd_s
    };
    let se = (sd_c * sd_c / lc.n as f64 + sd_s * sd_s / ls.n as f64).sqrt();
    let z = (lc.mean - ls.mean - ratio.ln()) / se;
    out.push(MetricStat {
        metric,
        test: "location",
        stable: Some(ls.mean.exp()),
        candidate: Some(lc.mean.exp()),
        statistic: (lc.mean - ls.mean).exp(),
        threshold: ratio,
        e_value: normal_mixture_e_value(z, lc.n),
        alpha: alpha / 2.0,
    });
}

fn error_test(cfg: &JudgeConfig, s: &Side, c: &Side, alpha: f64, out: &mut Vec<MetricStat>) {
    if c.samples == 0 {
        return;
    }
    let points = cfg.error_rate_points / 100.0;
    let p0 = (wilson_upper(s.errors, s.samples, 1.0) + points).min(0.999);
    let rate_s = s.errors as f64 / s.samples as f64;
    let rate_c = c.errors as f64 / c.samples as f64;
    out.push(MetricStat {
        metric: "error_rate",
        test: "rate",
        stable: Some(rate_s),
        candidate: Some(rate_c),
        statistic: 100.0 * (rate_c - rate_s),
        threshold: cfg.error_rate_points,
        e_value: bernoulli_e_value(c.errors, c.samples, p0),
        alpha,
    });
}

/// The spread test: is the candidate's std outside `[σ_s − max, σ_s + max]`? On the log scale,
/// where the sample std's noise, `(κ − 1)/(4(n−1))` in variance, does not depend on the std
/// itself (a test standardised by the candidate's own small std would reject an identical
/// candidate whenever its first few samples happen to be close together). κ is the kurtosis
/// (3 for normal data): per-request mean entropies are skewed and heavy-tailed (a few requests
/// far from the rest), and with the normal value an identical candidate's 20-sample std was
/// rolled back end to end; the larger of the two variants' estimates is used (at least 3). The
/// average of the two one-sided normal-mixture e-values (below, above) is the e-value.
fn spread_stat(s: &Moments, c: &Moments, max: f64, alpha: f64) -> MetricStat {
    let (sd_s, sd_c) = (s.std(), c.std());
    let kurtosis = s.kurtosis().max(c.kurtosis()).clamp(3.0, 100.0);
    let per_sample = (kurtosis - 1.0) / 4.0;
    let se_log = (per_sample / (c.n - 1) as f64 + per_sample / (s.n - 1) as f64).sqrt();
    let log_c = sd_c.max(1e-9).ln();
    let e_below = if sd_s - max > 0.0 {
        normal_mixture_e_value(((sd_s - max).ln() - log_c) / se_log, c.n)
    } else {
        0.0
    };
    let e_above = normal_mixture_e_value((log_c - (sd_s + max).max(1e-9).ln()) / se_log, c.n);
    MetricStat {
        metric: "entropy_std",
        test: "spread",
        stable: Some(sd_s),
        candidate: Some(sd_c),
        statistic: (sd_c - sd_s).abs(),
        threshold: max,
        e_value: (e_below + e_above) / 2.0,
        alpha,
    }
}

/// A difference of means beyond `threshold`, as a normal mixture over the candidate's count.
fn mean_stat(
    metric: &'static str,
    s: &Moments,
    c: &Moments,
    diff: f64,
    threshold: f64,
    alpha: f64,
) -> MetricStat {
    let se = (c.variance() / c.n as f64 + s.variance() / s.n as f64)
        .sqrt()
        .max(1e-9);
    MetricStat {
        metric,
        test: "mean",
        stable: Some(s.mean),
        candidate: Some(c.mean),
        statistic: diff,
        threshold,
        e_value: normal_mixture_e_value((diff - threshold) / se, c.n),
        alpha,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn splitmix64(mut z: u64) -> u64 {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A small deterministic generator for the tests (splitmix64).
    struct Rng(u64);

    impl Rng {
        fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            splitmix64(self.0.wrapping_sub(0x9e37_79b9_7f4a_7c15))
        }
        fn uniform(&mut self) -> f64 {
            ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        }
        fn normal(&mut self) -> f64 {
            let (u, v) = (self.uniform(), self.uniform());
            (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
        }
    }

    fn sample(rng: &mut Rng, variant: Variant, time_ms: u64, slow: f64, entropy: f64) -> Sample {
        let ttft = 200.0 * (0.2 * rng.normal()).exp() * slow;
        let tpot = 30.0 * (0.2 * rng.normal()).exp() * slow;
        Sample {
            variant,
            time_ms,
            error: false,
            ttft_ms: Some(ttft),
            tpot_ms: Some(tpot),
            e2e_ms: ttft + 100.0 * tpot,
            entropy_mean: Some((entropy + 0.3 * rng.normal()).max(0.0) as f32),
            confidence: None,
            helpful: None,
        }
    }

    fn judge() -> Judge {
        Judge::from_schedule(&Schedule {
            min_samples: 30,
            min_step_secs: 30,
            ..Schedule::default()
        })
    }

    #[test]
    fn e_values_behave() {
        // No hits: no evidence. Many hits: strong evidence.
        assert!(bernoulli_e_value(0, 100, 0.05) < 1.0);
        assert!(bernoulli_e_value(10, 12, 0.05) > 1e4);
        assert!(normal_mixture_e_value(-3.0, 50) <= 1.0);
        assert!(normal_mixture_e_value(5.0, 50) > 1e3);
        assert!(wilson_upper(0, 100, 1.0) > 0.0 && wilson_upper(0, 100, 1.0) < 0.02);
    }

    /// With a control, latency is compared with the control alone (a busy stable 2× slower does
    /// not excuse a 1.5× slower candidate, nor condemn an identical one), errors with every
    /// sample of the stable version.
    #[test]
    fn with_a_control_latency_is_judged_against_it_and_errors_against_every_stable_sample() {
        let with_control = Judge {
            control: true,
            ..judge()
        };
        let cfg = JudgeConfig::default();
        let window = |candidate_slow: f64, seed: u64| {
            let mut rng = Rng(seed);
            let mut w = StepWindow::new(0);
            for i in 0..400 {
                w.push(&sample(&mut rng, Variant::Stable, i * 100, 2.0, 2.0));
            }
            for i in 0..40 {
                w.push(&sample(&mut rng, Variant::Control, i * 1000, 1.0, 2.0));
                w.push(&sample(
                    &mut rng,
                    Variant::Candidate,
                    i * 1000,
                    candidate_slow,
                    2.0,
                ));
            }
            w
        };
        let identical = with_control.evaluate(&cfg, &window(1.0, 3), 60_000);
        assert!(matches!(identical, Verdict::Pass { .. }), "{identical:?}");
        let s = identical.summary();
        assert_eq!((s.samples_stable, s.samples_control), (440, 40));
        let slower = with_control.evaluate(&cfg, &window(1.5, 4), 60_000);
        match &slower {
            Verdict::Fail { metric, .. } => assert!(metric.ends_with("_p95"), "{slower:?}"),
            other => panic!("{other:?}"),
        }
        // Without the control the same busy stable hides the slower candidate.
        let blind = judge().evaluate(&cfg, &window(1.5, 4), 60_000);
        assert!(!matches!(blind, Verdict::Fail { .. }), "{blind:?}");
        // Too few control samples: no latency test yet, whatever the stable has.
        let mut rng = Rng(5);
        let mut w = StepWindow::new(0);
        for i in 0..400 {
            w.push(&sample(&mut rng, Variant::Stable, i * 100, 1.0, 2.0));
        }
        for i in 0..5 {
            w.push(&sample(&mut rng, Variant::Control, i * 1000, 1.0, 2.0));
        }
        for i in 0..40 {
            w.push(&sample(&mut rng, Variant::Candidate, i * 1000, 3.0, 2.0));
        }
        match with_control.evaluate(&cfg, &w, 60_000) {
            Verdict::Continue { summary } => assert!(
                summary.metrics.iter().all(|m| !m.metric.ends_with("_p95")),
                "{summary:?}"
            ),
            other => panic!("{other:?}"),
        }
        // ... while an erroring candidate is judged on the stable's samples already.
        for i in 40..60 {
            let mut c = sample(&mut rng, Variant::Candidate, i * 1000, 1.0, 2.0);
            c.error = true;
            w.push(&c);
        }
        match with_control.evaluate(&cfg, &w, 60_000) {
            Verdict::Fail { metric, .. } => assert_eq!(metric, "error_rate"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_slower_candidate_fails_on_latency_with_few_samples() {
        let mut rng = Rng(7);
        let mut w = StepWindow::new(0);
        for i in 0..200 {
            w.push(&sample(&mut rng, Variant::Stable, i * 100, 1.0, 2.0));
        }
        let mut failed_at = None;
        for i in 0..40u64 {
            w.push(&sample(&mut rng, Variant::Candidate, 20_000 + i, 1.5, 2.0));
            if let Verdict::Fail { metric, .. } =
                judge().evaluate(&JudgeConfig::default(), &w, 20_000 + i)
            {
                assert!(metric == "ttft_p95" || metric == "tpot_p95", "{metric}");
                failed_at = Some(i + 1);
                break;
            }
        }
        let n = failed_at.expect("a 1.5× slower candidate must fail");
        assert!(n <= 15, "failed after {n} candidate samples");
    }

    #[test]
    fn an_identical_candidate_passes_after_the_step() {
        let mut rng = Rng(11);
        let mut w = StepWindow::new(0);
        for i in 0..300u64 {
            let v = if i % 3 == 0 {
                Variant::Candidate
            } else {
                Variant::Stable
            };
            w.push(&sample(&mut rng, v, i * 100, 1.0, 2.0));
        }
        match judge().evaluate(&JudgeConfig::default(), &w, 30_000) {
            Verdict::Pass { summary } => {
                assert_eq!(summary.samples_candidate, 100);
                assert!(summary.metrics.iter().any(|m| m.metric == "entropy_std"));
            }
            other => panic!("{other:?}"),
        }
        // Too early: continue.
        assert_eq!(
            judge().evaluate(&JudgeConfig::default(), &w, 29_000).name(),
            "continue"
        );
    }

    #[test]
    fn errors_entropy_collapse_and_drift_fail() {
        let cfg = JudgeConfig::default();
        // Errors: 20% against 0%.
        let mut rng = Rng(3);
        let mut w = StepWindow::new(0);
        for i in 0..200 {
            w.push(&sample(&mut rng, Variant::Stable, i, 1.0, 2.0));
        }
        let mut n = 0;
        while judge().evaluate(&cfg, &w, 1000).name() != "fail" {
            let mut s = sample(&mut rng, Variant::Candidate, 1000, 1.0, 2.0);
            s.error = rng.uniform() < 0.2 || n % 5 == 4;
            w.push(&s);
            n += 1;
            assert!(n < 100, "20% errors not failed after 100 samples");
        }
        match judge().evaluate(&cfg, &w, 1000) {
            Verdict::Fail { metric, .. } => assert_eq!(metric, "error_rate"),
            other => panic!("{other:?}"),
        }
        // Entropy collapse: ~0 nats with no spread.
        let mut w = StepWindow::new(0);
        for i in 0..200 {
            w.push(&sample(&mut rng, Variant::Stable, i, 1.0, 2.0));
        }
        for _ in 0..MIN_SPREAD_SAMPLES {
            let mut s = sample(&mut rng, Variant::Candidate, 1000, 1.0, 2.0);
            s.entropy_mean = Some((0.02 * rng.uniform()) as f32);
            w.push(&s);
        }
        match judge().evaluate(&cfg, &w, 1000) {
            Verdict::Fail { metric, .. } => assert_eq!(metric, "entropy_std"),
            other => panic!("{other:?}"),
        }
        // Drift on the candidate only.
        let mut w = StepWindow::new(0);
        w.set_drift(Variant::Candidate, true, "input.length psi 0.4");
        assert_eq!(judge().evaluate(&cfg, &w, 0).name(), "fail");
        w.set_drift(Variant::Stable, true, "input.length psi 0.4");
        assert_eq!(judge().evaluate(&cfg, &w, 0).name(), "continue");
    }

    #[test]
    fn moments_give_the_kurtosis_of_known_distributions() {
        let mut normal = Moments::default();
        let mut rng = Rng(17);
        for _ in 0..20_000 {
            normal.push(rng.normal());
        }
        assert!(
            (normal.kurtosis() - 3.0).abs() < 0.15,
            "{}",
            normal.kurtosis()
        );
        assert!(normal.std() > 0.97 && normal.std() < 1.03);
        // A two-point distribution (±1) has kurtosis 1; a rare outlier raises it a lot.
        let mut two = Moments::default();
        for i in 0..1000 {
            two.push(if i % 2 == 0 { 1.0 } else { -1.0 });
        }
        assert!((two.kurtosis() - 1.0).abs() < 1e-6, "{}", two.kurtosis());
        let mut tailed = Moments::default();
        for i in 0..1000 {
            tailed.push(if i % 100 == 0 { 10.0 } else { 0.0 });
        }
        assert!(tailed.kurtosis() > 50.0, "{}", tailed.kurtosis());
    }

    #[test]
    fn no_traffic_is_inconclusive_never_pass_or_fail() {
        let cfg = JudgeConfig::default();
        let j = judge();
        let w = StepWindow::new(0);
        assert_eq!(j.evaluate(&cfg, &w, 10_000).name(), "continue");
        match j.evaluate(&cfg, &w, 90_000) {
            Verdict::Inconclusive { reason, .. } => {
                assert!(reason.contains("no request"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        // Stable traffic but too few candidates until the step's maximum.
        let mut rng = Rng(5);
        let mut w = StepWindow::new(0);
        for i in 0..100u64 {
            w.push(&sample(&mut rng, Variant::Stable, i * 1000, 1.0, 2.0));
            if i % 20 == 0 {
                w.push(&sample(&mut rng, Variant::Candidate, i * 1000, 1.0, 2.0));
            }
        }
        let late = j.max_step_ms + 1;
        let mut w2 = w.clone();
        w2.push(&sample(&mut rng, Variant::Candidate, late - 1, 1.0, 2.0));
        match j.evaluate(&cfg, &w2, late) {
            Verdict::Inconclusive { reason, .. } => assert!(reason.contains("too few"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn optional_tests_run_when_configured() {
        let cfg = JudgeConfig {
            confidence_drop: Some(0.05),
            helpful_rate_points: Some(5.0),
            entropy_mean_shift: Some(0.3),
            ..JudgeConfig::default()
        };
        let mut rng = Rng(9);
        let mut w = StepWindow::new(0);
        for i in 0..300u64 {
            let variant = if i % 2 == 0 {
                Variant::Candidate
            } else {
                Variant::Stable
            };
            let mut s = sample(&mut rng, variant, i, 1.0, 2.0);
            let bad = variant == Variant::Candidate;
            s.confidence = Some(if bad { 0.6 } else { 0.9 } + 0.05 * rng.normal() as f32);
            s.helpful = Some(rng.uniform() < if bad { 0.5 } else { 0.8 });
            w.push(&s);
        }
        let v = judge().evaluate(&cfg, &w, 1000);
        let names: Vec<_> = v.summary().metrics.iter().map(|m| m.metric).collect();
        for m in ["entropy_mean", "confidence", "helpful_rate"] {
            assert!(names.contains(&m), "{names:?}");
        }
        match v {
            Verdict::Fail { metric, .. } => {
                assert!(metric == "confidence" || metric == "helpful_rate")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_histogram_keeps_memory_bounded_and_quantiles_within_its_accuracy() {
        let mut s = Series::default();
        for i in 0..40_000u64 {
            s.push(1.0 + i as f64 / 10.0);
        }
        assert_eq!(s.seen, 40_000);
        // 1 to 4000 ms: ln(4000) / ln(γ) ≈ 830 buckets, whatever the count.
        assert!(s.sketch.buckets.len() < 900, "{}", s.sketch.buckets.len());
        for (level, exact) in [(0.5, 2000.9), (0.95, 3800.9), (0.99, 3960.9)] {
            let q = s.quantile(level).unwrap();
            assert!(
                (q - exact).abs() <= exact * SKETCH_ACCURACY * 1.01,
                "{level}: {q} vs {exact}"
            );
        }
        assert_eq!(s.sketch.count_above(5000.0), 0);
        let above = s.sketch.count_above(2000.0) as f64;
        assert!((above - 20_000.0).abs() < 20_000.0 * 0.02, "{above}");
    }

    #[test]
    fn moments_merge_as_if_pushed_one_by_one() {
        let mut rng = Rng(7);
        let xs: Vec<f64> = (0..500)
            .map(|_| rng.normal() * 3.0 + 10.0 + rng.uniform())
            .collect();
        let mut whole = Moments::default();
        xs.iter().for_each(|&x| whole.push(x));
        for cut in [0, 1, 17, 250, 499, 500] {
            let (mut a, mut b) = (Moments::default(), Moments::default());
            xs[..cut].iter().for_each(|&x| a.push(x));
            xs[cut..].iter().for_each(|&x| b.push(x));
            a.merge(&b);
            assert_eq!(a.n, whole.n);
            for (got, want) in [
                (a.mean, whole.mean),
                (a.m2, whole.m2),
                (a.m3, whole.m3),
                (a.m4, whole.m4),
            ] {
                assert!(
                    (got - want).abs() <= 1e-9 * want.abs().max(1.0),
                    "{cut}: {got} vs {want}"
                );
            }
        }
    }

    /// Three replicas' windows, each a third of the traffic, pooled and serialized through
    /// JSON on the way (as a fleet's database carries them): the judge's verdict is the one
    /// process's that saw it all.
    #[test]
    fn three_replicas_pooled_judge_as_one_process() {
        let cfg = JudgeConfig::default();
        let mut rng = Rng(11);
        let mut whole = StepWindow::new(0);
        let mut parts = [StepWindow::new(0), StepWindow::new(0), StepWindow::new(5)];
        for i in 0..900u64 {
            let candidate = i % 10 == 0;
            let slow = if candidate { 1.6 } else { 1.0 };
            let s = Sample {
                variant: if candidate {
                    Variant::Candidate
                } else {
                    Variant::Stable
                },
                time_ms: i,
                error: rng.uniform() < 0.01,
                ttft_ms: Some(100.0 * slow * (0.2 * rng.normal()).exp()),
                tpot_ms: Some(20.0 * slow * (0.2 * rng.normal()).exp()),
                e2e_ms: 300.0 * slow * (0.2 * rng.normal()).exp(),
                entropy_mean: Some(1.0 + 0.3 * rng.normal() as f32),
                confidence: Some(0.8),
                helpful: None,
            };
            whole.push(&s);
            parts[(i % 3) as usize].push(&s);
        }
        let carried: Vec<StepWindow> = parts
            .iter()
            .map(|w| serde_json::from_str(&serde_json::to_string(w).unwrap()).unwrap())
            .collect();
        let pooled = StepWindow::pooled(&carried).unwrap();
        assert_eq!(pooled.started_ms(), 0);
        assert_eq!(
            pooled.samples(Variant::Candidate),
            whole.samples(Variant::Candidate)
        );
        assert_eq!(pooled.stable.e2e.sketch, whole.stable.e2e.sketch);
        let one = judge().evaluate(&cfg, &whole, 60_000);
        let fleet = judge().evaluate(&cfg, &pooled, 60_000);
        let (a, b) = (one.summary(), fleet.summary());
        assert_eq!(a.metrics.len(), b.metrics.len());
        for (x, y) in a.metrics.iter().zip(&b.metrics) {
            assert_eq!((x.metric, x.test), (y.metric, y.test));
            assert!((x.statistic - y.statistic).abs() < 1e-6, "{x:?} vs {y:?}");
            assert!(
                (x.e_value - y.e_value).abs() <= 1e-6 * x.e_value.abs().max(1.0),
                "{x:?} vs {y:?}"
            );
        }
        assert!(matches!(fleet, Verdict::Fail { .. }), "{fleet:?}");
        assert_eq!(std::mem::discriminant(&one), std::mem::discriminant(&fleet));
    }
}
