//! The drift detector of one model version: a sliding window per feature, tested against the
//! baseline every `test_every` observations.
//!
//! - **`ks` mode** (the rule operators use): a window of 1,000, a test every 100, two-sample
//!   Kolmogorov–Smirnov per numeric feature, alarm when `D > 0.15` and `p < 0.01 / F`
//!   (Bonferroni over the `F` features tested); chi-squared for categorical ones, alarm when
//!   `p < 0.01 / F` and Cramér's V ≥ 0.1.
//! - **`calibrated` mode**: the false-alarm rate is set as the expected number of requests
//!   between false alarms (`run_length`). The threshold on the largest KS statistic over the
//!   features is found by a bootstrap on the baseline (whole rows resampled, so the features'
//!   correlations are kept; the reference itself resampled too, so its own sampling error is in
//!   the null distribution), simulating exactly this detector: window, test cadence, reset after
//!   an alarm. Every alarm reports its effect (the Wasserstein-1 distance in units of the
//!   baseline's standard deviation, and the PSI); `min_effect` > 0 also requires a practical
//!   effect, so large samples do not flag trivia (at the price of a longer run length).
//!
//! Memory is constant: one ring per feature, one reference sample per feature.

use std::collections::{HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::baseline::{Baseline, BaselineBuilder, Reference};
use crate::features::{Observation, Value};
use crate::stats::{
    chi_squared, chi_squared_two_sample, ks_pvalue, ks_statistic, wasserstein1, SplitMix,
};

/// How the detector decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    Ks,
    Calibrated,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Ks => "ks",
            Mode::Calibrated => "calibrated",
        }
    }
}

/// The detector's settings (`[monitor]` in the server's configuration).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DriftConfig {
    pub mode: Mode,
    /// `ks` mode: observations per window, and a test every this many.
    pub window: usize,
    pub test_every: usize,
    /// `ks` mode: the KS statistic and the family-wise p-value an alarm needs.
    pub ks_threshold: f64,
    pub p_value: f64,
    /// Categorical features: Cramér's V an alarm needs besides its p-value.
    pub min_cramers_v: f64,
    /// `calibrated` mode: the expected number of observations between false alarms.
    pub run_length: u64,
    pub calibrated_window: usize,
    pub calibrated_test_every: usize,
    /// `calibrated` mode: the smallest effect (Wasserstein-1 / baseline std) an alarm needs;
    /// 0: every alarm the calibrated threshold raises. Above 0 it only removes alarms, so the run
    /// length between false alarms grows beyond `run_length`.
    pub min_effect: f64,
    /// Observations captured as the baseline when a version has none.
    pub baseline_requests: usize,
    /// Observations the calibration simulates, as a multiple of `run_length`.
    pub calibration_factor: u64,
}

impl Default for DriftConfig {
    fn default() -> Self {
        Self {
            mode: Mode::Ks,
            window: 1000,
            test_every: 100,
            ks_threshold: 0.15,
            p_value: 0.01,
            min_cramers_v: 0.1,
            run_length: 10_000,
            calibrated_window: 200,
            calibrated_test_every: 20,
            min_effect: 0.0,
            baseline_requests: 1000,
            // 100 left the threshold noisy enough to lengthen the run length by ~7% (a
            // bisection on ~100 simulated alarms); 1,000 is within the replay's own error.
            calibration_factor: 1000,
        }
    }
}

/// A [`DriftConfig`] setting out of its range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DriftConfigError {
    #[error("monitor windows must hold at least 10 observations")]
    Window,
    #[error("monitor test_every must be at least 1")]
    TestEvery,
    #[error("monitor ks_threshold must be in [0, 1] and p_value in [0, 1)")]
    Thresholds,
    #[error("monitor run_length must be at least 10 tests long")]
    RunLength,
    #[error("monitor baseline_requests must be at least 50")]
    BaselineRequests,
}

impl DriftConfig {
    pub fn validate(&self) -> Result<(), DriftConfigError> {
        if self.window < 10 || self.calibrated_window < 10 {
            return Err(DriftConfigError::Window);
        }
        if self.test_every == 0 || self.calibrated_test_every == 0 {
            return Err(DriftConfigError::TestEvery);
        }
        if !(0.0..=1.0).contains(&self.ks_threshold) || !(0.0..1.0).contains(&self.p_value) {
            return Err(DriftConfigError::Thresholds);
        }
        if self.run_length < 10 * self.calibrated_test_every as u64 {
            return Err(DriftConfigError::RunLength);
        }
        if self.baseline_requests < 50 {
            return Err(DriftConfigError::BaselineRequests);
        }
        Ok(())
    }
}

/// The calibrated mode's threshold and how it was found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    pub run_length: u64,
    pub window: usize,
    pub test_every: usize,
    pub min_effect: f64,
    /// Alarm when the largest KS statistic (over features with the practical effect) exceeds it.
    pub threshold: f64,
    pub simulated_observations: u64,
    pub simulated_alarms: u64,
    /// The run length the simulation measured at `threshold`.
    pub estimated_run_length: f64,
    pub seed: u64,
}

impl Calibration {
    /// Whether it was made for these settings.
    pub fn fits(&self, c: &DriftConfig) -> bool {
        self.run_length == c.run_length
            && self.window == c.calibrated_window
            && self.test_every == c.calibrated_test_every
            && (self.min_effect - c.min_effect).abs() < 1e-12
    }
}

/// One feature's last test.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FeatureState {
    pub feature: String,
    /// `numeric` or `categorical`.
    pub kind: &'static str,
    /// KS statistic (numeric) or Cramér's V (categorical).
    pub statistic: f64,
    pub p_value: f64,
    /// Wasserstein-1 / baseline std (numeric) or Cramér's V (categorical).
    pub effect: f64,
    /// Population stability index on the baseline's deciles (numeric).
    pub psi: Option<f64>,
    pub alarming: bool,
    pub alarms: u64,
}

/// A change of a feature's alarm: raised or cleared, with the evidence.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Alarm {
    pub feature: String,
    /// `raised` or `cleared`.
    pub event: &'static str,
    /// `ks` or `calibrated`.
    pub mode: &'static str,
    pub statistic: f64,
    pub p_value: f64,
    pub effect: f64,
    pub psi: Option<f64>,
    /// The threshold the statistic was held to (KS D, or the calibrated threshold).
    pub threshold: f64,
    /// The window's size and the observation count at the test.
    pub window: usize,
    pub observation: u64,
    pub test: u64,
}

/// A fixed-capacity ring of the newest values.
#[derive(Debug, Clone)]
struct Ring<T> {
    items: Vec<T>,
    next: usize,
    cap: usize,
}

impl<T: Copy> Ring<T> {
    fn new(cap: usize) -> Self {
        Self {
            items: Vec::with_capacity(cap),
            next: 0,
            cap,
        }
    }

    /// Pushes `v`; returns the value it pushed out.
    fn push(&mut self, v: T) -> Option<T> {
        if self.items.len() < self.cap {
            self.items.push(v);
            None
        } else {
            let old = std::mem::replace(&mut self.items[self.next], v);
            self.next = (self.next + 1) % self.cap;
            Some(old)
        }
    }

    fn full(&self) -> bool {
        self.items.len() == self.cap
    }

    fn clear(&mut self) {
        self.items.clear();
        self.next = 0;
    }
}

/// A numeric feature's window: the ring, and the same values kept sorted (the value that leaves
/// is replaced by the one that comes with a single shift of the values between them), so a test
/// reads them sorted.
#[derive(Debug, Clone)]
struct NumWindow {
    ring: Ring<f64>,
    sorted: Vec<f64>,
}

impl NumWindow {
    fn new(cap: usize) -> Self {
        Self {
            ring: Ring::new(cap),
            sorted: Vec::with_capacity(cap),
        }
    }

    fn push(&mut self, v: f64) {
        let into = self.sorted.partition_point(|x| x.total_cmp(&v).is_lt());
        let Some(old) = self.ring.push(v) else {
            self.sorted.insert(into, v);
            return;
        };
        // The old value's place; then one shift between it and the new value's place (an
        // insert and a remove would each move about half the window).
        let out = self.sorted.partition_point(|x| x.total_cmp(&old).is_lt());
        if into <= out {
            self.sorted.copy_within(into..out, into + 1);
            self.sorted[into] = v;
        } else {
            self.sorted.copy_within(out + 1..into, out);
            self.sorted[into - 1] = v;
        }
    }

    fn full(&self) -> bool {
        self.ring.full()
    }

    fn len(&self) -> usize {
        self.sorted.len()
    }

    fn clear(&mut self) {
        self.ring.clear();
        self.sorted.clear();
    }
}

/// A categorical feature's window: the baseline's categories plus `other`.
#[derive(Debug, Clone)]
struct CatWindow {
    name: String,
    categories: Vec<String>,
    /// Expected shares (the baseline's, smoothed by half a count), `other` last.
    shares: Vec<f64>,
    /// The baseline's counts, `other` (0) last.
    baseline: Vec<u64>,
    ring: Ring<u16>,
    counts: Vec<u64>,
}

impl CatWindow {
    fn new(name: &str, counts: &std::collections::BTreeMap<String, u64>, cap: usize) -> Self {
        let categories: Vec<String> = counts.keys().take(1000).cloned().collect();
        let total: f64 = counts.values().sum::<u64>() as f64 + 0.5 * (categories.len() + 1) as f64;
        let mut shares: Vec<f64> = categories
            .iter()
            .map(|c| (counts[c] as f64 + 0.5) / total)
            .collect();
        shares.push(0.5 / total);
        let mut baseline: Vec<u64> = categories.iter().map(|c| counts[c]).collect();
        baseline.push(0);
        Self {
            baseline,
            name: name.to_string(),
            counts: vec![0; categories.len() + 1],
            categories,
            shares,
            ring: Ring::new(cap),
        }
    }

    fn push(&mut self, v: &str) {
        let k = self
            .categories
            .iter()
            .position(|c| c == v)
            .unwrap_or(self.categories.len()) as u16;
        self.counts[k as usize] += 1;
        if let Some(old) = self.ring.push(k) {
            self.counts[old as usize] -= 1;
        }
    }

    fn resize(&mut self, cap: usize) {
        self.ring = Ring::new(cap);
        self.counts.iter_mut().for_each(|c| *c = 0);
    }
}

/// Alarm changes kept for `GET /admin/monitors`.
const RECENT_ALARMS: usize = 64;

/// The drift detector of one model version.
#[derive(Debug)]
pub struct DriftMonitor {
    cfg: DriftConfig,
    baseline: Option<Baseline>,
    capture: Option<BaselineBuilder>,
    /// Set when a captured baseline froze; taken by the owner to store and calibrate it.
    fresh: bool,
    refs: Vec<Reference>,
    index: HashMap<String, usize>,
    num: Vec<NumWindow>,
    cats: Vec<CatWindow>,
    states: Vec<FeatureState>,
    since_test: usize,
    seen: u64,
    tests: u64,
    /// Tests at which some feature was alarming.
    alarming_tests: u64,
    /// Monitor-level alarms (no feature alarming → some feature alarming; in the calibrated
    /// mode also a fresh window's first test in alarm).
    raises: u64,
    /// The calibrated mode started its windows over after an alarm: the next test is on a
    /// fresh window, and an alarm there is a new one (as the calibration counts it).
    restarted: bool,
    recent: VecDeque<Alarm>,
}

/// What `GET /admin/monitors` shows of a detector.
#[derive(Debug, Clone, Serialize)]
pub struct DriftView {
    pub mode: &'static str,
    /// `capturing` (the first requests become the baseline), `calibrating`, `watching`.
    pub phase: &'static str,
    pub baseline_source: Option<String>,
    pub baseline_observations: Option<u64>,
    pub captured: Option<u64>,
    pub calibration: Option<Calibration>,
    pub window: usize,
    pub test_every: usize,
    pub observations: u64,
    pub tests: u64,
    pub alarming_tests: u64,
    pub alarms: u64,
    pub active: bool,
    pub features: Vec<FeatureState>,
    pub recent: Vec<Alarm>,
}

impl DriftMonitor {
    /// A detector that captures its baseline from the first `baseline_requests` observations.
    pub fn capturing(cfg: DriftConfig) -> Self {
        let mut m = Self::empty(cfg);
        m.capture = Some(BaselineBuilder::new());
        m
    }

    /// A detector with a baseline.
    pub fn with_baseline(cfg: DriftConfig, baseline: Baseline) -> Self {
        let mut m = Self::empty(cfg);
        m.set_baseline(baseline);
        m
    }

    fn empty(cfg: DriftConfig) -> Self {
        Self {
            cfg,
            baseline: None,
            capture: None,
            fresh: false,
            refs: Vec::new(),
            index: HashMap::new(),
            num: Vec::new(),
            cats: Vec::new(),
            states: Vec::new(),
            since_test: 0,
            seen: 0,
            tests: 0,
            alarming_tests: 0,
            raises: 0,
            restarted: false,
            recent: VecDeque::new(),
        }
    }

    pub fn config(&self) -> &DriftConfig {
        &self.cfg
    }

    pub fn baseline(&self) -> Option<&Baseline> {
        self.baseline.as_ref()
    }

    /// Replaces the baseline; windows and states start over.
    pub fn set_baseline(&mut self, baseline: Baseline) {
        self.capture = None;
        self.refs = baseline.references();
        self.index = baseline
            .columns
            .iter()
            .enumerate()
            .map(|(i, c)| (c.clone(), i))
            .collect();
        let w = self.window_for(&baseline);
        self.num = (0..baseline.columns.len())
            .map(|_| NumWindow::new(w))
            .collect();
        self.cats = baseline
            .categorical
            .iter()
            .map(|(name, counts)| CatWindow::new(name, counts, w))
            .collect();
        self.states = baseline
            .columns
            .iter()
            .map(|c| (c.as_str(), "numeric"))
            .chain(self.cats.iter().map(|c| (c.name.as_str(), "categorical")))
            .map(|(feature, kind)| FeatureState {
                feature: feature.to_string(),
                kind,
                statistic: 0.0,
                p_value: 1.0,
                effect: 0.0,
                psi: None,
                alarming: false,
                alarms: 0,
            })
            .collect();
        self.since_test = 0;
        self.restarted = false;
        self.baseline = Some(baseline);
    }

    /// Starts capturing a new baseline from the next observations.
    pub fn recapture(&mut self) {
        let cfg = self.cfg.clone();
        *self = Self::capturing(cfg);
    }

    /// Sets the calibrated mode's threshold (found off the request path by [`calibrate`]).
    pub fn set_calibration(&mut self, c: Calibration) {
        if let Some(mut b) = self.baseline.take() {
            b.calibration = Some(c);
            self.set_baseline(b);
        }
    }

    /// The captured baseline, once, when it froze (for the owner to store and calibrate).
    pub fn take_fresh_baseline(&mut self) -> Option<Baseline> {
        if std::mem::take(&mut self.fresh) {
            self.baseline.clone()
        } else {
            None
        }
    }

    /// Whether the calibrated mode still waits for its calibration.
    pub fn needs_calibration(&self) -> bool {
        self.cfg.mode == Mode::Calibrated
            && self
                .baseline
                .as_ref()
                .is_some_and(|b| !b.calibration.as_ref().is_some_and(|c| c.fits(&self.cfg)))
    }

    fn calibration(&self) -> Option<&Calibration> {
        if self.cfg.mode != Mode::Calibrated {
            return None;
        }
        self.baseline
            .as_ref()?
            .calibration
            .as_ref()
            .filter(|c| c.fits(&self.cfg))
    }

    fn window_for(&self, b: &Baseline) -> usize {
        match (&self.cfg.mode, &b.calibration) {
            (Mode::Calibrated, Some(c)) if c.fits(&self.cfg) => c.window,
            _ => self.cfg.window,
        }
    }

    fn test_every(&self) -> usize {
        match self.calibration() {
            Some(c) => c.test_every,
            None => self.cfg.test_every,
        }
    }

    /// Whether any feature is in alarm.
    pub fn active(&self) -> bool {
        self.states.iter().any(|s| s.alarming)
    }

    pub fn states(&self) -> &[FeatureState] {
        &self.states
    }

    pub fn tests(&self) -> u64 {
        self.tests
    }

    pub fn alarming_tests(&self) -> u64 {
        self.alarming_tests
    }

    /// Monitor-level alarms raised so far.
    pub fn raises(&self) -> u64 {
        self.raises
    }

    pub fn observations(&self) -> u64 {
        self.seen
    }

    /// Observations in the current window (the fullest feature's).
    pub fn window_len(&self) -> usize {
        self.num
            .iter()
            .map(NumWindow::len)
            .chain(self.cats.iter().map(|c| c.ring.items.len()))
            .max()
            .unwrap_or(0)
    }

    /// Takes one observation; returns the alarms it raised or cleared (when it completed a test).
    pub fn observe(&mut self, o: &Observation) -> Vec<Alarm> {
        self.seen += 1;
        if let Some(b) = &mut self.capture {
            b.add(o);
            if b.observations() >= self.cfg.baseline_requests as u64 {
                let n = b.observations();
                let b = self
                    .capture
                    .take()
                    .expect("capturing")
                    .finish(format!("first {n} requests"));
                self.set_baseline(b);
                self.fresh = true;
            }
            return Vec::new();
        }
        if self.baseline.is_none() {
            return Vec::new();
        }
        for (name, v) in &o.values {
            match v {
                Value::Num(x) => {
                    if let Some(&c) = self.index.get(name.as_ref()) {
                        self.num[c].push(*x);
                    }
                }
                Value::Cat(s) => {
                    if let Some(w) = self.cats.iter_mut().find(|w| w.name == *name) {
                        w.push(s);
                    }
                }
            }
        }
        self.since_test += 1;
        if self.since_test < self.test_every() {
            return Vec::new();
        }
        self.since_test = 0;
        self.test()
    }

    fn test(&mut self) -> Vec<Alarm> {
        let full = self.num.iter().filter(|r| r.full()).count()
            + self.cats.iter().filter(|c| c.ring.full()).count();
        if full == 0 {
            return Vec::new();
        }
        self.tests += 1;
        let calibration = self.calibration().cloned();
        let alpha = self.cfg.p_value / full as f64;
        let mut events = Vec::new();
        let was_active = self.active();
        let restarted = std::mem::take(&mut self.restarted);
        for (c, window) in self.num.iter().enumerate() {
            if !window.full() {
                continue;
            }
            let r = &self.refs[c];
            let scratch = &window.sorted;
            let d = ks_statistic(scratch, &r.sorted);
            let p = ks_pvalue(d, r.sorted.len(), scratch.len());
            let effect = standardized(wasserstein1(scratch, &r.sorted), r.std);
            let (alarming, threshold) = match &calibration {
                Some(cal) => (d > cal.threshold && effect >= cal.min_effect, cal.threshold),
                None => (
                    d > self.cfg.ks_threshold && p < alpha,
                    self.cfg.ks_threshold,
                ),
            };
            let s = &mut self.states[c];
            s.statistic = d;
            s.p_value = p;
            s.effect = effect;
            s.psi = Some(r.psi(scratch));
            change(s, alarming, restarted, threshold, &mut events);
        }
        let numeric = self.num.len();
        for (k, w) in self.cats.iter().enumerate() {
            if !w.ring.full() {
                continue;
            }
            // The p-value: the two samples' homogeneity (the baseline has sampling error too);
            // the effect: Cramér's V of the window against the baseline's shares.
            let (_, df, p) = chi_squared_two_sample(&w.baseline, &w.counts);
            let (obs, exp): (Vec<u64>, Vec<f64>) = w
                .counts
                .iter()
                .zip(&w.shares)
                .enumerate()
                .filter(|&(i, (&n, _))| n > 0 || i < w.categories.len())
                .map(|(_, (&n, &p))| (n, p))
                .unzip();
            let total: f64 = exp.iter().sum();
            let exp: Vec<f64> = exp.iter().map(|p| p / total).collect();
            let (stat, one_df, _) = chi_squared(&obs, &exp);
            let v = if one_df == 0 {
                0.0
            } else {
                (stat / (w.ring.items.len() as f64 * one_df as f64)).sqrt()
            };
            let alarming = df > 0 && p < alpha && v >= self.cfg.min_cramers_v;
            let s = &mut self.states[numeric + k];
            s.statistic = v;
            s.p_value = p;
            s.effect = v;
            change(s, alarming, restarted, self.cfg.min_cramers_v, &mut events);
        }
        let active = self.active();
        self.alarming_tests += u64::from(active);
        if active && (!was_active || restarted) {
            self.raises += 1;
            // The calibrated mode starts its windows over after an alarm (its run length is
            // the time between such alarms, as calibrated: a fresh window that is in alarm
            // again is a new alarm, not the old one going on).
            if calibration.is_some() {
                self.num.iter_mut().for_each(NumWindow::clear);
                let w = self.cfg.calibrated_window;
                self.cats.iter_mut().for_each(|c| c.resize(w));
                self.restarted = true;
            }
        }
        let mode = if calibration.is_some() {
            Mode::Calibrated
        } else {
            Mode::Ks
        };
        let window = self.window_len_of(&calibration);
        for e in &mut events {
            e.mode = mode.as_str();
            e.window = window;
            e.observation = self.seen;
            e.test = self.tests;
            if self.recent.len() == RECENT_ALARMS {
                self.recent.pop_front();
            }
            self.recent.push_back(e.clone());
        }
        events
    }

    fn window_len_of(&self, c: &Option<Calibration>) -> usize {
        c.as_ref().map_or(self.cfg.window, |c| c.window)
    }

    pub fn view(&self) -> DriftView {
        let calibration = self.baseline.as_ref().and_then(|b| b.calibration.clone());
        DriftView {
            mode: self.cfg.mode.as_str(),
            phase: if self.capture.is_some() {
                "capturing"
            } else if self.needs_calibration() {
                "calibrating"
            } else if self.baseline.is_some() {
                "watching"
            } else {
                "no_baseline"
            },
            baseline_source: self.baseline.as_ref().map(|b| b.source.clone()),
            baseline_observations: self.baseline.as_ref().map(|b| b.observations),
            captured: self.capture.as_ref().map(BaselineBuilder::observations),
            calibration,
            window: self.window_len_of(&self.calibration().cloned()),
            test_every: self.test_every(),
            observations: self.seen,
            tests: self.tests,
            alarming_tests: self.alarming_tests,
            alarms: self.raises,
            active: self.active(),
            features: self.states.clone(),
            recent: self.recent.iter().cloned().collect(),
        }
    }
}

fn standardized(w1: f64, std: f64) -> f64 {
    if w1 == 0.0 {
        0.0
    } else {
        w1 / std.max(1e-9)
    }
}

/// Records a feature's new alarm state; `fresh`: the window started over since the last test,
/// so an alarm there is raised anew even if the feature was already in alarm.
fn change(
    s: &mut FeatureState,
    alarming: bool,
    fresh: bool,
    threshold: f64,
    events: &mut Vec<Alarm>,
) {
    if alarming == s.alarming && !(alarming && fresh) {
        return;
    }
    s.alarming = alarming;
    if alarming {
        s.alarms += 1;
    }
    events.push(Alarm {
        feature: s.feature.clone(),
        event: if alarming { "raised" } else { "cleared" },
        mode: "",
        statistic: s.statistic,
        p_value: s.p_value,
        effect: s.effect,
        psi: s.psi,
        threshold,
        window: 0,
        observation: 0,
        test: 0,
    });
}

/// Finds the calibrated mode's threshold for `baseline`: simulates the detector on requests
/// resampled from the baseline (against a resampled reference) and searches the threshold whose
/// measured run length between alarms is `run_length`. Takes seconds; run it off the request
/// path.
pub fn calibrate(baseline: &Baseline, cfg: &DriftConfig, seed: u64) -> Calibration {
    let w = cfg.calibrated_window;
    let s = cfg.calibrated_test_every;
    let n = baseline.rows.len();
    let columns = baseline.columns.len();
    let total = (cfg.run_length.saturating_mul(cfg.calibration_factor)).clamp(100_000, 3_000_000);
    const STREAMS: u64 = 8;
    let per = (total / STREAMS) as usize;
    let mut rng = SplitMix(seed);
    // Per stream, per test: the largest KS statistic over the features. The effect floor is not
    // simulated: it only removes alarms, so with it the run length is at least the calibrated
    // one (a floor that binds under no drift would leave no threshold to calibrate).
    let mut sequences: Vec<Vec<f64>> = Vec::new();
    for _ in 0..STREAMS {
        if n == 0 || columns == 0 {
            break;
        }
        let resampled = Baseline {
            rows: (0..n)
                .map(|_| baseline.rows[rng.below(n)].clone())
                .collect(),
            ..baseline.clone()
        };
        let refs = resampled.references();
        let mut rings: Vec<NumWindow> = (0..columns).map(|_| NumWindow::new(w)).collect();
        let mut seq = Vec::with_capacity(per / s + 1);
        for i in 0..per {
            let row = &baseline.rows[rng.below(n)];
            for (c, v) in row.iter().enumerate() {
                if let Some(v) = v {
                    rings[c].push(*v);
                }
            }
            if (i + 1) % s != 0 {
                continue;
            }
            let mut m: f64 = 0.0;
            let mut any = false;
            for (c, ring) in rings.iter().enumerate() {
                if !ring.full() {
                    continue;
                }
                any = true;
                m = m.max(ks_statistic(&ring.sorted, &refs[c].sorted));
            }
            if any {
                seq.push(m);
            }
        }
        sequences.push(seq);
    }
    let simulated = (STREAMS * per as u64).max(1);
    let refill = w.div_ceil(s).max(1);
    // Alarms at a threshold: a test above it is an alarm, then the windows start over (the
    // next test that can alarm is a full window later). Counting every such test, not only
    // the ones after a clear, keeps the count monotone in the threshold; where nothing drifts
    // a test above the calibrated threshold is rare, so the two counts agree.
    let alarms_at = |threshold: f64| -> u64 {
        let mut raises = 0;
        for seq in &sequences {
            let mut i = 0;
            while i < seq.len() {
                if seq[i] > threshold {
                    raises += 1;
                    i += refill;
                } else {
                    i += 1;
                }
            }
        }
        raises
    };
    let target = cfg.run_length as f64;
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    for _ in 0..40 {
        let mid = 0.5 * (lo + hi);
        let raises = alarms_at(mid);
        let arl = simulated as f64 / raises.max(1) as f64;
        if raises == 0 || arl >= target {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    let raises = alarms_at(hi);
    Calibration {
        run_length: cfg.run_length,
        window: w,
        test_every: s,
        min_effect: cfg.min_effect,
        threshold: hi,
        simulated_observations: simulated,
        simulated_alarms: raises,
        estimated_run_length: if raises == 0 {
            f64::INFINITY
        } else {
            simulated as f64 / raises as f64
        },
        seed,
    }
}

#[cfg(test)]
mod window_tests {
    use super::*;

    #[test]
    fn the_sorted_window_matches_a_sort_of_the_ring_after_every_update() {
        let mut w = NumWindow::new(50);
        let mut rng = crate::stats::SplitMix(3);
        for i in 0..2000u32 {
            // Repeated values and wide ones too.
            let v = match i % 7 {
                0 => 1.0,
                1 => f64::from(i % 5),
                _ => rng.normal() * 10.0,
            };
            w.push(v);
            let mut expected = w.ring.items.clone();
            expected.sort_by(f64::total_cmp);
            assert_eq!(w.sorted, expected, "after {i} updates");
        }
    }
}
