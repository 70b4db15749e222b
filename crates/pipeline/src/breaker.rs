//! A circuit breaker per backend: a state machine that owns its state, pure over the time it is
//! given, so it is tested on virtual time. The request path asks [`Breaker::try_pass`] (which
//! never waits: an open breaker refuses at once so a chain can move on) and reports each call's
//! [`Outcome`]; readiness checks report through [`Breaker::readiness`]. Every change of state
//! comes back as a [`Transition`] with its cause, for the caller to record.
//!
//! - **Closed**: calls pass. It opens after `consecutive_failures` failures in a row, or when at
//!   least `min_calls` calls in the last `window` failed at `failure_rate` or more (a call slower
//!   than the latency objective counts as failed), or after `readiness_failures` failed
//!   readiness checks in a row.
//! - **Open**: calls are refused until the open time ends. The open time starts at `open_base`,
//!   doubles each time the breaker opens again without having closed, up to `open_max`, and is
//!   jittered by ±`jitter` so that replicas do not probe in step.
//! - **Half-open**: at most `probes` calls pass at once; `probes` successes close it, any
//!   failure opens it again (for longer).

use std::time::{Duration, Instant};

use serde::Deserialize;

use crate::decisions::Decisions;

/// The breaker's settings (defaults from the defence research: 5 in a row, or 50% of at least 20
/// calls in 30 s; 3 probes; open 5 s doubling to 300 s, ±20%).
#[derive(Debug, Clone, PartialEq)]
pub struct BreakerConfig {
    pub consecutive_failures: u32,
    pub failure_rate: f64,
    pub min_calls: u32,
    pub window: Duration,
    /// A call slower than this counts as failed (none: latency is not judged).
    pub slow_call: Option<Duration>,
    pub readiness_failures: u32,
    pub probes: u32,
    pub open_base: Duration,
    pub open_max: Duration,
    /// Fraction of the open time added or taken at random.
    pub jitter: f64,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            consecutive_failures: 5,
            failure_rate: 0.5,
            min_calls: 20,
            window: Duration::from_secs(30),
            slow_call: None,
            readiness_failures: 3,
            probes: 3,
            open_base: Duration::from_secs(5),
            open_max: Duration::from_secs(300),
            jitter: 0.2,
        }
    }
}

/// Where the breaker stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Closed,
    Open,
    HalfOpen,
}

impl State {
    /// The value of `rampart_breaker_state`: 0 closed, 1 half-open, 2 open.
    pub fn gauge(self) -> u8 {
        match self {
            State::Closed => 0,
            State::HalfOpen => 1,
            State::Open => 2,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            State::Closed => "closed",
            State::Open => "open",
            State::HalfOpen => "half_open",
        }
    }
}

/// How a call that passed ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Success {
        took: Duration,
    },
    Failure,
    /// The client went away: says nothing about the backend.
    Cancelled,
}

/// Why the breaker changed state.
#[derive(Debug, Clone, PartialEq)]
pub enum Cause {
    ConsecutiveFailures(u32),
    FailureRate { failed: u32, calls: u32 },
    ReadinessFailures(u32),
    OpenTimeOver,
    ProbeFailed,
    ProbesSucceeded(u32),
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cause::ConsecutiveFailures(n) => write!(f, "{n} failures in a row"),
            Cause::FailureRate { failed, calls } => {
                write!(f, "{failed} of the last {calls} calls failed")
            }
            Cause::ReadinessFailures(n) => write!(f, "{n} readiness checks failed in a row"),
            Cause::OpenTimeOver => f.write_str("the open time is over; probing"),
            Cause::ProbeFailed => f.write_str("a probe failed"),
            Cause::ProbesSucceeded(n) => write!(f, "{n} probes succeeded"),
        }
    }
}

/// A change of state, for the record.
#[derive(Debug, Clone, PartialEq)]
pub struct Transition {
    pub from: State,
    pub to: State,
    pub cause: Cause,
    /// How long it stays open (transitions to `Open`).
    pub open_for: Option<Duration>,
}

/// Permission for one call; report its outcome with [`Breaker::finish`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    /// The call is one of the half-open breaker's probes.
    pub probe: bool,
}

/// The breaker refused the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    /// Until the next probe may pass (zero while probes are out).
    pub retry_in: Duration,
}

/// One-second buckets of the last `window` of calls: constant memory whatever the traffic.
#[derive(Debug, Clone)]
struct Window {
    /// (second since the breaker's epoch, calls, failures)
    buckets: Vec<(u64, u32, u32)>,
}

impl Window {
    fn new(window: Duration) -> Self {
        Self {
            buckets: vec![(u64::MAX, 0, 0); window.as_secs().max(1) as usize],
        }
    }

    fn add(&mut self, second: u64, failed: bool) {
        let n = self.buckets.len() as u64;
        let slot = &mut self.buckets[(second % n) as usize];
        if slot.0 != second {
            *slot = (second, 0, 0);
        }
        slot.1 += 1;
        slot.2 += u32::from(failed);
    }

    fn totals(&self, second: u64) -> (u32, u32) {
        let n = self.buckets.len() as u64;
        self.buckets
            .iter()
            .filter(|b| b.0 != u64::MAX && b.0 + n > second && b.0 <= second)
            .fold((0, 0), |(c, f), b| (c + b.1, f + b.2))
    }

    fn clear(&mut self) {
        for b in &mut self.buckets {
            *b = (u64::MAX, 0, 0);
        }
    }
}

/// The breaker of one backend.
#[derive(Debug, Clone)]
pub struct Breaker {
    config: BreakerConfig,
    epoch: Instant,
    state: State,
    open_until: Instant,
    /// Times it opened since it last closed (the backoff's exponent).
    reopened: u32,
    consecutive: u32,
    readiness_failed: u32,
    window: Window,
    probes_out: u32,
    probes_ok: u32,
    /// xorshift state for the jitter (seeded per breaker).
    rng: u64,
}

impl Breaker {
    pub fn new(config: BreakerConfig, now: Instant, seed: u64) -> Self {
        Self {
            window: Window::new(config.window),
            config,
            epoch: now,
            state: State::Closed,
            open_until: now,
            reopened: 0,
            consecutive: 0,
            readiness_failed: 0,
            probes_out: 0,
            probes_ok: 0,
            rng: seed | 1,
        }
    }

    /// The state at `now` (an open breaker whose time is over reads half-open).
    pub fn state(&self, now: Instant) -> State {
        match self.state {
            State::Open if now >= self.open_until => State::HalfOpen,
            s => s,
        }
    }

    /// Lets a call through, or refuses it at once.
    pub fn try_pass(&mut self, now: Instant) -> (Result<Pass, Refused>, Option<Transition>) {
        let mut transition = None;
        if self.state == State::Open {
            if now < self.open_until {
                return (
                    Err(Refused {
                        retry_in: self.open_until - now,
                    }),
                    None,
                );
            }
            transition = Some(self.to(State::HalfOpen, Cause::OpenTimeOver));
        }
        match self.state {
            State::Closed => (Ok(Pass { probe: false }), transition),
            State::HalfOpen if self.probes_out < self.config.probes => {
                self.probes_out += 1;
                (Ok(Pass { probe: true }), transition)
            }
            _ => (
                Err(Refused {
                    retry_in: Duration::ZERO,
                }),
                transition,
            ),
        }
    }

    /// Reports how a call that passed ended.
    pub fn finish(&mut self, pass: Pass, outcome: Outcome, now: Instant) -> Option<Transition> {
        let failed = match outcome {
            Outcome::Cancelled => {
                if pass.probe {
                    self.probes_out = self.probes_out.saturating_sub(1);
                }
                return None;
            }
            Outcome::Failure => true,
            Outcome::Success { took } => self.config.slow_call.is_some_and(|slow| took > slow),
        };
        if pass.probe {
            self.probes_out = self.probes_out.saturating_sub(1);
            if self.state != State::HalfOpen {
                return None;
            }
            if failed {
                return Some(self.open(Cause::ProbeFailed, now));
            }
            self.probes_ok += 1;
            if self.probes_ok >= self.config.probes {
                let t = self.to(State::Closed, Cause::ProbesSucceeded(self.probes_ok));
                self.reopened = 0;
                return Some(t);
            }
            return None;
        }
        if self.state != State::Closed {
            return None;
        }
        let second = now.saturating_duration_since(self.epoch).as_secs();
        self.window.add(second, failed);
        if !failed {
            self.consecutive = 0;
            return None;
        }
        self.consecutive += 1;
        if self.consecutive >= self.config.consecutive_failures {
            return Some(self.open(Cause::ConsecutiveFailures(self.consecutive), now));
        }
        let (calls, failures) = self.window.totals(second);
        if calls >= self.config.min_calls
            && f64::from(failures) >= self.config.failure_rate * f64::from(calls)
        {
            return Some(self.open(
                Cause::FailureRate {
                    failed: failures,
                    calls,
                },
                now,
            ));
        }
        None
    }

    /// Reports a readiness check of the backend.
    pub fn readiness(&mut self, ready: bool, now: Instant) -> Option<Transition> {
        if ready {
            self.readiness_failed = 0;
            return None;
        }
        self.readiness_failed += 1;
        if self.state == State::Closed && self.readiness_failed >= self.config.readiness_failures {
            return Some(self.open(Cause::ReadinessFailures(self.readiness_failed), now));
        }
        None
    }

    fn open(&mut self, cause: Cause, now: Instant) -> Transition {
        let base = self.config.open_base.as_secs_f64() * 2f64.powi(self.reopened.min(30) as i32);
        let capped = base.min(self.config.open_max.as_secs_f64());
        let jitter = (self.next_unit() * 2.0 - 1.0) * self.config.jitter;
        let open_for = Duration::from_secs_f64((capped * (1.0 + jitter)).max(0.0));
        self.reopened += 1;
        self.open_until = now + open_for;
        let mut t = self.to(State::Open, cause);
        t.open_for = Some(open_for);
        t
    }

    fn to(&mut self, to: State, cause: Cause) -> Transition {
        let from = self.state;
        self.state = to;
        self.consecutive = 0;
        self.probes_out = 0;
        self.probes_ok = 0;
        if to != State::HalfOpen {
            self.window.clear();
        }
        Transition {
            from,
            to,
            cause,
            open_for: None,
        }
    }

    /// A uniform number in [0, 1).
    fn next_unit(&mut self) -> f64 {
        unit_random(&mut self.rng)
    }
}

/// A uniform number in [0, 1) from a xorshift state (non-zero): jitter and fault draws, where
/// speed matters and quality hardly does.
pub(crate) fn unit_random(state: &mut u64) -> f64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    (*state >> 11) as f64 / (1u64 << 53) as f64
}

/// The breaker of one served backend, shared by its requests: the state machine behind a lock,
/// every transition logged (with its cause) and counted, and the counters `GET /admin/backends`
/// shows.
#[derive(Debug)]
pub struct BackendBreaker {
    /// The backend's id (`name@version`, `name@version:tract`, `canned:name`).
    backend: String,
    inner: std::sync::Mutex<Breaker>,
    calls: std::sync::atomic::AtomicU64,
    failures: std::sync::atomic::AtomicU64,
    refused: std::sync::atomic::AtomicU64,
    /// Where its transitions are published: set once, by the registry that serves it.
    decisions: std::sync::OnceLock<Decisions>,
}

/// What `GET /admin/backends` shows of a breaker.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BreakerView {
    pub state: &'static str,
    /// Milliseconds until the next probe may pass (open breakers).
    pub open_for_ms: Option<u64>,
    pub calls: u64,
    pub failures: u64,
    /// Calls refused while open (or beyond the probe budget).
    pub refused: u64,
}

impl BackendBreaker {
    pub fn new(backend: String, config: BreakerConfig) -> Self {
        // Seeded by the name, so replicas of the same backend jitter apart only by time.
        let seed = backend.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        Self {
            inner: std::sync::Mutex::new(Breaker::new(config, Instant::now(), seed)),
            backend,
            calls: Default::default(),
            failures: Default::default(),
            refused: Default::default(),
            decisions: std::sync::OnceLock::new(),
        }
    }

    /// Publishes its transitions on `decisions` from now on (the first call decides).
    pub fn report_to(&self, decisions: &Decisions) {
        let _ = self.decisions.set(decisions.clone());
    }

    pub fn backend(&self) -> &str {
        &self.backend
    }

    /// A fresh breaker with these settings for another backend id.
    pub fn renamed(&self, backend: String) -> Self {
        Self::new(backend, self.lock().config.clone())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Breaker> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lets a call through or refuses it at once.
    pub fn try_pass(&self) -> Result<Pass, Refused> {
        let (result, transition) = self.lock().try_pass(Instant::now());
        if let Some(t) = transition {
            self.note(&t);
        }
        match result {
            Ok(pass) => {
                self.calls
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Ok(pass)
            }
            Err(refused) => {
                self.refused
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Err(refused)
            }
        }
    }

    /// Reports how a call that passed ended.
    pub fn finish(&self, pass: Pass, outcome: Outcome) {
        if outcome == Outcome::Failure {
            self.failures
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let transition = self.lock().finish(pass, outcome, Instant::now());
        if let Some(t) = transition {
            self.note(&t);
        }
    }

    /// Reports a readiness check.
    pub fn readiness(&self, ready: bool) {
        let transition = self.lock().readiness(ready, Instant::now());
        if let Some(t) = transition {
            self.note(&t);
        }
    }

    pub fn state(&self) -> State {
        self.lock().state(Instant::now())
    }

    pub fn view(&self) -> BreakerView {
        let now = Instant::now();
        let b = self.lock();
        let state = b.state(now);
        BreakerView {
            state: state.as_str(),
            open_for_ms: (state == State::Open)
                .then(|| b.open_until.saturating_duration_since(now).as_millis() as u64),
            calls: self.calls.load(std::sync::atomic::Ordering::Relaxed),
            failures: self.failures.load(std::sync::atomic::Ordering::Relaxed),
            refused: self.refused.load(std::sync::atomic::Ordering::Relaxed),
        }
    }

    fn note(&self, t: &Transition) {
        let open_for_ms = t.open_for.map(|d| d.as_millis() as u64);
        if t.to == State::Open {
            tracing::warn!(
                backend = %self.backend,
                from = t.from.as_str(),
                to = t.to.as_str(),
                cause = %t.cause,
                open_for_ms,
                "circuit breaker opened"
            );
        } else {
            tracing::info!(
                backend = %self.backend,
                from = t.from.as_str(),
                to = t.to.as_str(),
                cause = %t.cause,
                "circuit breaker changed state"
            );
        }
        if let Some(decisions) = self.decisions.get() {
            decisions.note(
                &format!("breaker.{}", t.to.as_str()),
                self.backend.split(['@', ':']).next(),
                &self.backend,
                &t.cause.to_string(),
                serde_json::json!({ "from": t.from.as_str(), "open_for_ms": open_for_ms }),
            );
        }
        metrics::counter!(
            "rampart_breaker_transitions_total",
            "backend" => self.backend.clone(),
            "to" => t.to.as_str()
        )
        .increment(1);
        metrics::gauge!("rampart_breaker_state", "backend" => self.backend.clone())
            .set(f64::from(t.to.gauge()));
    }
}

impl From<&BreakerSettings> for BreakerConfig {
    fn from(s: &BreakerSettings) -> Self {
        Self {
            consecutive_failures: s.consecutive_failures,
            failure_rate: s.failure_rate,
            min_calls: s.min_calls,
            window: Duration::from_secs(s.window_s),
            slow_call: None,
            readiness_failures: s.readiness_failures,
            probes: s.probes,
            open_base: Duration::from_millis(s.open_base_ms),
            open_max: Duration::from_secs(s.open_max_s),
            jitter: s.jitter,
        }
    }
}

/// The circuit breaker of every backend (docs/resilience.md).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerSettings {
    /// Opens after this many failures in a row.
    pub consecutive_failures: u32,
    /// ... or when this fraction of the calls in the window failed ...
    pub failure_rate: f64,
    /// ... and the window holds at least this many calls.
    pub min_calls: u32,
    pub window_s: u64,
    /// Opens after this many failed readiness checks in a row.
    pub readiness_failures: u32,
    /// Seconds between readiness checks of every backend.
    pub readiness_interval_ms: u64,
    /// Calls let through at once while half-open; this many successes close it.
    pub probes: u32,
    /// The first open time; it doubles each time it opens again without closing ...
    pub open_base_ms: u64,
    /// ... up to this.
    pub open_max_s: u64,
    /// Fraction of the open time added or taken at random.
    pub jitter: f64,
}

impl Default for BreakerSettings {
    fn default() -> Self {
        Self {
            consecutive_failures: 5,
            failure_rate: 0.5,
            min_calls: 20,
            window_s: 30,
            readiness_failures: 3,
            readiness_interval_ms: 1000,
            probes: 3,
            open_base_ms: 5000,
            open_max_s: 300,
            jitter: 0.2,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    fn ok() -> Outcome {
        Outcome::Success {
            took: Duration::from_millis(10),
        }
    }

    /// Passes one call at `t` and reports `outcome`.
    fn call(b: &mut Breaker, t: Instant, outcome: Outcome) -> (bool, Option<Transition>) {
        match b.try_pass(t) {
            (Ok(pass), opened) => {
                let finished = b.finish(pass, outcome, t);
                (true, finished.or(opened))
            }
            (Err(_), t) => (false, t),
        }
    }

    #[test]
    fn five_failures_in_a_row_open_it_and_only_probes_pass_until_it_closes() {
        let t0 = Instant::now();
        let config = BreakerConfig {
            jitter: 0.0,
            ..BreakerConfig::default()
        };
        let mut b = Breaker::new(config, t0, 7);
        for i in 0..4 {
            assert_eq!(
                call(&mut b, t0 + secs(i as f64), Outcome::Failure),
                (true, None)
            );
        }
        let (passed, t) = call(&mut b, t0 + secs(4.0), Outcome::Failure);
        assert!(passed);
        let t = t.unwrap();
        assert_eq!((t.from, t.to), (State::Closed, State::Open));
        assert_eq!(t.cause, Cause::ConsecutiveFailures(5));
        assert_eq!(t.open_for, Some(secs(5.0)));
        // Open: refused at once, with the time left.
        let (r, _) = b.try_pass(t0 + secs(6.0));
        assert_eq!(
            r,
            Err(Refused {
                retry_in: secs(3.0)
            })
        );
        assert_eq!(b.state(t0 + secs(6.0)), State::Open);
        // After 5 s: three probes at once, a fourth is refused.
        let at = t0 + secs(9.5);
        assert_eq!(b.state(at), State::HalfOpen);
        let (p1, t) = b.try_pass(at);
        assert_eq!(t.unwrap().to, State::HalfOpen);
        let (p2, _) = b.try_pass(at);
        let (p3, _) = b.try_pass(at);
        assert!(p1.unwrap().probe && p2.is_ok() && p3.is_ok());
        assert!(b.try_pass(at).0.is_err(), "no call beyond the probe budget");
        assert_eq!(b.finish(p1.unwrap(), ok(), at), None);
        assert_eq!(b.finish(p2.unwrap(), ok(), at), None);
        let t = b.finish(p3.unwrap(), ok(), at).unwrap();
        assert_eq!((t.from, t.to), (State::HalfOpen, State::Closed));
        assert_eq!(t.cause, Cause::ProbesSucceeded(3));
        assert_eq!(call(&mut b, at, ok()), (true, None));
    }

    #[test]
    fn a_failed_probe_reopens_for_twice_as_long_up_to_the_cap() {
        let t0 = Instant::now();
        let config = BreakerConfig {
            jitter: 0.0,
            consecutive_failures: 1,
            open_max: Duration::from_secs(300),
            ..BreakerConfig::default()
        };
        let mut b = Breaker::new(config, t0, 1);
        let mut t = t0;
        let (_, tr) = call(&mut b, t, Outcome::Failure);
        let mut open_for = tr.unwrap().open_for.unwrap();
        let mut seen = vec![open_for.as_secs()];
        for _ in 0..8 {
            t += open_for;
            let (pass, _) = b.try_pass(t);
            let tr = b.finish(pass.unwrap(), Outcome::Failure, t).unwrap();
            assert_eq!(tr.cause, Cause::ProbeFailed);
            open_for = tr.open_for.unwrap();
            seen.push(open_for.as_secs());
        }
        assert_eq!(seen, [5, 10, 20, 40, 80, 160, 300, 300, 300]);
    }

    #[test]
    fn a_high_failure_rate_opens_it_even_without_a_run_of_failures() {
        let t0 = Instant::now();
        let mut b = Breaker::new(BreakerConfig::default(), t0, 3);
        // Alternating success and failure: never 5 in a row, but 50% of 20 calls.
        let mut opened = None;
        for i in 0..20 {
            let outcome = if i % 2 == 0 { ok() } else { Outcome::Failure };
            let (_, t) = call(&mut b, t0 + secs(i as f64), outcome);
            if let Some(t) = t {
                opened = Some((i, t));
                break;
            }
        }
        let (i, t) = opened.expect("the rate opens it");
        assert_eq!(i, 19);
        assert_eq!(
            t.cause,
            Cause::FailureRate {
                failed: 10,
                calls: 20
            }
        );
        // Old calls leave the window: failures spread over more than 30 s never add up.
        let mut b = Breaker::new(BreakerConfig::default(), t0, 3);
        for i in 0..40 {
            let outcome = if i % 2 == 0 { ok() } else { Outcome::Failure };
            let (_, t) = call(&mut b, t0 + secs(i as f64 * 2.0), outcome);
            assert!(t.is_none(), "call {i}: {t:?}");
        }
    }

    #[test]
    fn slow_calls_count_as_failures_and_cancellations_count_as_nothing() {
        let t0 = Instant::now();
        let config = BreakerConfig {
            slow_call: Some(Duration::from_millis(500)),
            ..BreakerConfig::default()
        };
        let mut b = Breaker::new(config, t0, 5);
        for i in 0..4 {
            let slow = Outcome::Success {
                took: Duration::from_secs(2),
            };
            assert_eq!(call(&mut b, t0 + secs(i as f64), slow).1, None);
            assert_eq!(
                call(&mut b, t0 + secs(i as f64), Outcome::Cancelled).1,
                None
            );
        }
        let (_, t) = call(
            &mut b,
            t0 + secs(5.0),
            Outcome::Success {
                took: Duration::from_secs(2),
            },
        );
        assert_eq!(t.unwrap().cause, Cause::ConsecutiveFailures(5));
    }

    #[test]
    fn three_failed_readiness_checks_open_it_and_jitter_stays_in_its_band() {
        let t0 = Instant::now();
        let mut b = Breaker::new(BreakerConfig::default(), t0, 11);
        assert_eq!(b.readiness(false, t0), None);
        assert_eq!(b.readiness(true, t0), None);
        assert_eq!(b.readiness(false, t0), None);
        assert_eq!(b.readiness(false, t0), None);
        let t = b.readiness(false, t0).unwrap();
        assert_eq!(t.cause, Cause::ReadinessFailures(3));
        let open_for = t.open_for.unwrap().as_secs_f64();
        assert!((4.0..=6.0).contains(&open_for), "{open_for}");
        for seed in 0..200 {
            let mut b = Breaker::new(
                BreakerConfig {
                    consecutive_failures: 1,
                    ..BreakerConfig::default()
                },
                t0,
                seed,
            );
            let s = call(&mut b, t0, Outcome::Failure)
                .1
                .unwrap()
                .open_for
                .unwrap();
            assert!((4.0..=6.0).contains(&s.as_secs_f64()), "seed {seed}: {s:?}");
        }
    }
}
