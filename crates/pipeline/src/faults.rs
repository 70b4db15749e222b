//! Fault injection for drills and tests: `POST /admin/faults` makes a named backend fail, hang
//! before its first token, stall mid-stream, slow down, or fail a fraction of its calls, for a
//! while. Off unless `[faults] enabled = true`; admin-only; every fault injected and every call
//! it strikes is logged and counted, and a struck call says so in its record's attempts. This
//! is the only place that fakes failures: the chain, the breakers and the hand-off see them as
//! they would see real ones.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// What an injected fault does to the calls of its backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultMode {
    /// Every call fails at once.
    Fail,
    /// Calls produce nothing (no first token, no answer) until the fault ends.
    Hang,
    /// Generations stop after `after_tokens` tokens and produce nothing more until it ends.
    Stall,
    /// Calls take `factor` times as long (start and every gap between events).
    Slow,
    /// A `fraction` of the calls fail, drawn at random.
    FailFraction,
}

impl FaultMode {
    pub fn as_str(self) -> &'static str {
        match self {
            FaultMode::Fail => "fail",
            FaultMode::Hang => "hang",
            FaultMode::Stall => "stall",
            FaultMode::Slow => "slow",
            FaultMode::FailFraction => "fail_fraction",
        }
    }
}

/// Where a fault applies: this replica (the default), or every replica of its fleet (kept in
/// the fleet's database; each replica applies it at its next tick, a replica that joins later
/// too, until it ends or is cleared anywhere).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultScope {
    #[default]
    Replica,
    Fleet,
}

/// The body of `POST /admin/faults`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultRequest {
    /// A backend id (`name@version`, `name@version:tract`, `canned:name`), or a model name for
    /// every version of it.
    pub backend: String,
    pub mode: FaultMode,
    /// How long it lasts (seconds; default 60).
    #[serde(default = "default_duration_s")]
    pub duration_s: f64,
    /// `slow`: how many times slower (> 1).
    pub factor: Option<f64>,
    /// `fail_fraction`: the share of calls that fail (0-1).
    pub fraction: Option<f64>,
    /// `stall`: tokens that still come before the stall (default 2).
    pub after_tokens: Option<usize>,
    /// `replica` (default) or `fleet`.
    #[serde(default)]
    pub scope: FaultScope,
}

fn default_duration_s() -> f64 {
    60.0
}

/// An active fault, as `GET /admin/faults` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Fault {
    pub id: u64,
    pub backend: String,
    pub mode: FaultMode,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub factor: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fraction: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub after_tokens: Option<usize>,
    /// Who injected it.
    pub by: String,
    pub scope: FaultScope,
    /// A fleet's fault: its id in the fleet's database (the same on every replica).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fleet_id: Option<i64>,
    /// Milliseconds it has left.
    pub remaining_ms: u64,
    /// Calls it struck so far.
    pub struck: u64,
    #[serde(skip)]
    until: Instant,
}

/// What a fault does to one call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Strike {
    Fail,
    Hang { until: Instant },
    Stall { after_tokens: usize, until: Instant },
    Slow { factor: f64 },
}

impl Strike {
    pub fn describe(&self) -> String {
        match self {
            Strike::Fail => "injected fault: fail".into(),
            Strike::Hang { .. } => "injected fault: hang before the first token".into(),
            Strike::Stall { after_tokens, .. } => {
                format!("injected fault: stall after {after_tokens} tokens")
            }
            Strike::Slow { factor } => format!("injected fault: {factor}x slower"),
        }
    }
}

/// Why a fault was not injected.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct FaultError(pub String);

/// The active faults.
#[derive(Debug)]
pub struct Faults {
    config: FaultsConfig,
    /// Any fault active (the request path reads only this while there is none).
    any: AtomicBool,
    active: Mutex<Vec<Fault>>,
    next_id: AtomicU64,
    rng: Mutex<u64>,
}

/// Whether a fault named `target` covers the backend `id`: its exact id, or a model name for
/// the model's versions (not a tensor twin or a canned answer, which are named exactly).
pub fn covers(target: &str, id: &str) -> bool {
    target == id || (!id.contains(':') && id.split('@').next() == Some(target))
}

impl Faults {
    pub fn new(config: FaultsConfig) -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0x9e37_79b9_7f4a_7c15);
        Self {
            config,
            any: AtomicBool::new(false),
            active: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
            rng: Mutex::new(seed | 1),
        }
    }

    pub fn enabled(&self) -> bool {
        self.config.enabled
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Fault>> {
        self.active.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts a fault. `known` says whether a backend id exists.
    pub fn inject(
        &self,
        request: FaultRequest,
        by: &str,
        known: impl Fn(&str) -> bool,
    ) -> Result<Fault, FaultError> {
        if !self.config.enabled {
            return Err(FaultError(
                "fault injection is off: set [faults] enabled = true to use it".into(),
            ));
        }
        if !known(&request.backend) {
            return Err(FaultError(format!(
                "no backend {:?} (GET /admin/backends lists them)",
                request.backend
            )));
        }
        let max = self.config.max_duration_s as f64;
        if !(request.duration_s > 0.0 && request.duration_s <= max) {
            return Err(FaultError(format!(
                "duration_s must be in (0, {max}] (faults.max_duration_s)"
            )));
        }
        match request.mode {
            FaultMode::Slow if !request.factor.is_some_and(|f| f > 1.0 && f <= 1000.0) => {
                return Err(FaultError("mode slow needs a factor in (1, 1000]".into()))
            }
            FaultMode::FailFraction
                if !request.fraction.is_some_and(|f| (0.0..=1.0).contains(&f)) =>
            {
                return Err(FaultError(
                    "mode fail_fraction needs a fraction in [0, 1]".into(),
                ))
            }
            _ => {}
        }
        let fault = Fault {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            backend: request.backend,
            mode: request.mode,
            factor: request.factor.filter(|_| request.mode == FaultMode::Slow),
            fraction: request
                .fraction
                .filter(|_| request.mode == FaultMode::FailFraction),
            after_tokens: (request.mode == FaultMode::Stall)
                .then(|| request.after_tokens.unwrap_or(2)),
            by: by.to_string(),
            scope: request.scope,
            fleet_id: None,
            remaining_ms: (request.duration_s * 1e3) as u64,
            struck: 0,
            until: Instant::now() + Duration::from_secs_f64(request.duration_s),
        };
        tracing::warn!(
            fault = fault.id,
            backend = %fault.backend,
            mode = fault.mode.as_str(),
            factor = fault.factor,
            fraction = fault.fraction,
            after_tokens = fault.after_tokens,
            duration_s = request.duration_s,
            by = %fault.by,
            "fault injected"
        );
        metrics::counter!(
            "rampart_faults_injected_total",
            "backend" => fault.backend.clone(),
            "mode" => fault.mode.as_str()
        )
        .increment(1);
        let mut active = self.lock();
        active.push(fault.clone());
        self.any.store(true, Ordering::Release);
        Ok(fault)
    }

    /// Marks a fault as the fleet's fault `fleet_id`.
    pub fn set_fleet_id(&self, id: u64, fleet_id: i64) {
        if let Some(f) = self.lock().iter_mut().find(|f| f.id == id) {
            f.fleet_id = Some(fleet_id);
            f.scope = FaultScope::Fleet;
        }
    }

    /// Ends one fault (or all); returns how many ended.
    pub fn clear(&self, id: Option<u64>, by: &str) -> usize {
        let mut active = self.lock();
        let before = active.len();
        active.retain(|f| id.is_some_and(|id| f.id != id));
        let ended = before - active.len();
        self.any.store(!active.is_empty(), Ordering::Release);
        if ended > 0 {
            tracing::warn!(fault = id, ended, by, "fault cleared");
        }
        ended
    }

    /// The active faults.
    pub fn list(&self) -> Vec<Fault> {
        let now = Instant::now();
        let mut active = self.lock();
        active.retain(|f| f.until > now);
        self.any.store(!active.is_empty(), Ordering::Release);
        active
            .iter()
            .map(|f| Fault {
                remaining_ms: f.until.saturating_duration_since(now).as_millis() as u64,
                ..f.clone()
            })
            .collect()
    }

    /// What the active faults do to a call of backend `id` now (the newest fault first).
    pub fn strike(&self, id: &str) -> Option<Strike> {
        if !self.any.load(Ordering::Acquire) {
            return None;
        }
        let now = Instant::now();
        let mut active = self.lock();
        active.retain(|f| f.until > now);
        if active.is_empty() {
            self.any.store(false, Ordering::Release);
            return None;
        }
        let fault = active.iter_mut().rev().find(|f| covers(&f.backend, id))?;
        let strike = match fault.mode {
            FaultMode::Fail => Strike::Fail,
            FaultMode::Hang => Strike::Hang { until: fault.until },
            FaultMode::Stall => Strike::Stall {
                after_tokens: fault.after_tokens.unwrap_or(2),
                until: fault.until,
            },
            FaultMode::Slow => Strike::Slow {
                factor: fault.factor.unwrap_or(2.0),
            },
            FaultMode::FailFraction => {
                let draw = crate::breaker::unit_random(
                    &mut self.rng.lock().unwrap_or_else(|e| e.into_inner()),
                );
                if draw >= fault.fraction.unwrap_or(0.0) {
                    return None;
                }
                Strike::Fail
            }
        };
        fault.struck += 1;
        metrics::counter!(
            "rampart_faults_struck_total",
            "backend" => id.to_string(),
            "mode" => fault.mode.as_str()
        )
        .increment(1);
        Some(strike)
    }
}

/// Fault injection (`POST /admin/faults`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FaultsConfig {
    pub enabled: bool,
    /// Longest a fault may last.
    pub max_duration_s: u64,
}

impl Default for FaultsConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            max_duration_s: 3600,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on() -> Faults {
        Faults::new(FaultsConfig {
            enabled: true,
            max_duration_s: 60,
        })
    }

    fn request(backend: &str, mode: FaultMode) -> FaultRequest {
        FaultRequest {
            backend: backend.into(),
            mode,
            duration_s: 30.0,
            factor: None,
            fraction: None,
            after_tokens: None,
            scope: Default::default(),
        }
    }

    #[test]
    fn faults_strike_their_backend_until_cleared() {
        let faults = on();
        assert_eq!(faults.strike("m@1.0.0"), None, "nothing injected");
        faults
            .inject(request("m", FaultMode::Fail), "ops", |_| true)
            .unwrap();
        assert_eq!(
            faults.strike("m@1.0.0"),
            Some(Strike::Fail),
            "a name covers versions"
        );
        assert_eq!(faults.strike("m@2.0.0"), Some(Strike::Fail));
        assert_eq!(
            faults.strike("m@1.0.0:tract"),
            None,
            "twins are named exactly"
        );
        assert_eq!(faults.strike("other@1.0.0"), None);
        assert_eq!(faults.list()[0].struck, 2);
        assert_eq!(faults.clear(None, "ops"), 1);
        assert_eq!(faults.strike("m@1.0.0"), None);
    }

    #[test]
    fn bad_faults_are_refused_with_reasons() {
        let off = Faults::new(FaultsConfig::default());
        let err = off
            .inject(request("m", FaultMode::Fail), "ops", |_| true)
            .unwrap_err();
        assert!(err.0.contains("enabled"), "{err}");
        let faults = on();
        assert!(faults
            .inject(request("ghost", FaultMode::Fail), "ops", |_| false)
            .is_err());
        assert!(faults
            .inject(request("m", FaultMode::Slow), "ops", |_| true)
            .is_err());
        let mut long = request("m", FaultMode::Hang);
        long.duration_s = 3600.0;
        assert!(faults.inject(long, "ops", |_| true).is_err());
    }

    #[test]
    fn a_fraction_fails_about_that_share() {
        let faults = on();
        let mut r = request("m@1.0.0", FaultMode::FailFraction);
        r.fraction = Some(0.3);
        faults.inject(r, "ops", |_| true).unwrap();
        let struck = (0..10_000)
            .filter(|_| faults.strike("m@1.0.0").is_some())
            .count();
        assert!((2_500..3_500).contains(&struck), "{struck} of 10000");
    }
}
