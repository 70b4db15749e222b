//! The output monitors of a model version: the sliding mean and spread of one per-request
//! output value (the mean token entropy of an LLM's answers, the confidence of a classifier or
//! detector) against its baseline. A collapse (the model answers with full certainty, e.g. a
//! broken template or a runaway logit bias) or a jump (it babbles) raises an alarm; so does a
//! spread that collapses or explodes. The record's `abnormal` flag stays per request.

use serde::{Deserialize, Serialize};

use crate::stats::mean_std;

/// Settings of the output monitors (`[monitor.output]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OutputConfig {
    /// Requests per window, and a test every this many.
    pub window: usize,
    pub test_every: usize,
    /// How many standard errors of the window mean away from the baseline mean raise an alarm.
    pub z: f64,
    /// The smallest shift of the mean, in baseline standard deviations, an alarm needs.
    pub min_effect: f64,
    /// The window's std below `baseline std × spread_ratio` or above its inverse is an alarm.
    pub spread_ratio: f64,
}

impl Default for OutputConfig {
    fn default() -> Self {
        Self {
            window: 100,
            test_every: 10,
            z: 5.0,
            min_effect: 0.5,
            spread_ratio: 0.25,
        }
    }
}

/// What `GET /admin/monitors` shows of an output monitor.
#[derive(Debug, Clone, Serialize)]
pub struct OutputView {
    pub feature: String,
    pub baseline_mean: Option<f64>,
    pub baseline_std: Option<f64>,
    pub window_mean: Option<f64>,
    pub window_std: Option<f64>,
    pub window: usize,
    /// `collapse`, `jump`, `spread_collapse`, `spread_jump`, or none.
    pub alarm: Option<&'static str>,
    pub alarms: u64,
    pub tests: u64,
}

/// A change of the output monitor's alarm.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OutputAlarm {
    pub feature: String,
    /// `raised` or `cleared`.
    pub event: &'static str,
    /// What was seen (`collapse`, `jump`, `spread_collapse`, `spread_jump`), or the cleared one.
    pub kind: &'static str,
    pub window_mean: f64,
    pub window_std: f64,
    pub baseline_mean: f64,
    pub baseline_std: f64,
    /// The window mean's distance from the baseline mean in standard errors.
    pub z: f64,
    pub window: usize,
}

/// One output value's monitor.
#[derive(Debug, Clone)]
pub struct OutputMonitor {
    feature: String,
    cfg: OutputConfig,
    capture_len: usize,
    captured: Vec<f64>,
    baseline: Option<(f64, f64)>,
    ring: Vec<f64>,
    next: usize,
    since_test: usize,
    last: Option<(f64, f64)>,
    alarm: Option<&'static str>,
    alarms: u64,
    tests: u64,
}

impl OutputMonitor {
    /// A monitor of `feature` whose baseline is `baseline` (mean, std), or else the first
    /// `capture` values it sees.
    pub fn new(
        feature: &str,
        cfg: OutputConfig,
        baseline: Option<(f64, f64)>,
        capture: usize,
    ) -> Self {
        Self {
            feature: feature.to_string(),
            capture_len: capture.max(cfg.window),
            cfg,
            captured: Vec::new(),
            baseline,
            ring: Vec::new(),
            next: 0,
            since_test: 0,
            last: None,
            alarm: None,
            alarms: 0,
            tests: 0,
        }
    }

    pub fn feature(&self) -> &str {
        &self.feature
    }

    pub fn baseline(&self) -> Option<(f64, f64)> {
        self.baseline
    }

    pub fn set_baseline(&mut self, mean: f64, std: f64) {
        self.baseline = Some((mean, std));
        self.captured = Vec::new();
    }

    pub fn active(&self) -> bool {
        self.alarm.is_some()
    }

    /// The window's mean and std at the last test.
    pub fn window_stats(&self) -> Option<(f64, f64)> {
        self.last
    }

    /// Takes one request's value; returns an alarm change when a test made one.
    pub fn observe(&mut self, v: f64) -> Option<OutputAlarm> {
        if !v.is_finite() {
            return None;
        }
        if self.baseline.is_none() {
            self.captured.push(v);
            if self.captured.len() >= self.capture_len {
                let (m, s) = mean_std(&self.captured);
                self.set_baseline(m, s);
            }
            return None;
        }
        if self.ring.len() < self.cfg.window {
            self.ring.push(v);
        } else {
            self.ring[self.next] = v;
            self.next = (self.next + 1) % self.cfg.window;
        }
        self.since_test += 1;
        if self.ring.len() < self.cfg.window || self.since_test < self.cfg.test_every {
            return None;
        }
        self.since_test = 0;
        self.test()
    }

    fn test(&mut self) -> Option<OutputAlarm> {
        let (bm, bs) = self.baseline?;
        self.tests += 1;
        let (m, s) = mean_std(&self.ring);
        self.last = Some((m, s));
        let n = self.ring.len() as f64;
        let floor = bs.max(1e-6);
        let z = (m - bm) / (floor / n.sqrt());
        let shift = (m - bm).abs() / floor;
        let kind = if z.abs() > self.cfg.z && shift >= self.cfg.min_effect {
            Some(if m < bm { "collapse" } else { "jump" })
        } else if bs > 1e-6 && s < bs * self.cfg.spread_ratio {
            Some("spread_collapse")
        } else if bs > 1e-6 && s > bs / self.cfg.spread_ratio {
            Some("spread_jump")
        } else {
            None
        };
        if kind == self.alarm {
            return None;
        }
        let (event, shown) = match (kind, self.alarm) {
            (Some(k), _) => ("raised", k),
            (None, Some(old)) => ("cleared", old),
            (None, None) => return None,
        };
        if kind.is_some() && self.alarm.is_none() {
            self.alarms += 1;
        }
        self.alarm = kind;
        Some(OutputAlarm {
            feature: self.feature.clone(),
            event,
            kind: shown,
            window_mean: m,
            window_std: s,
            baseline_mean: bm,
            baseline_std: bs,
            z,
            window: self.ring.len(),
        })
    }

    pub fn view(&self) -> OutputView {
        OutputView {
            feature: self.feature.clone(),
            baseline_mean: self.baseline.map(|b| b.0),
            baseline_std: self.baseline.map(|b| b.1),
            window_mean: self.last.map(|l| l.0),
            window_std: self.last.map(|l| l.1),
            window: self.ring.len(),
            alarm: self.alarm,
            alarms: self.alarms,
            tests: self.tests,
        }
    }
}
