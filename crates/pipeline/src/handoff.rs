//! Hand-off to people (level 3 of the defence lines): when a model's requests keep falling
//! back (more than `threshold` in `window_s`), its new requests get a 503 with the error code
//! `human_handoff`, a configured message and link, until the cool-down is over (or an admin
//! resumes it). An admin can also pause a model by hand; it then stays handed off until
//! resumed.
//!
//! [`HandoffState`] is the pure state machine over the time it is given; [`Handoff`] wraps it
//! for the request path and records every change (log line, `rampart_handoff_active{model}`,
//! `rampart_handoff_transitions_total{model,to}`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::decisions::Decisions;

/// Why the model is handed off.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Why {
    /// Too many fallbacks in the window.
    Fallbacks { fallbacks: u64, window_s: u64 },
    /// An admin paused it.
    Paused { by: String },
    /// Another replica of the fleet handed it off (its cause in words); this replica follows.
    Fleet { replica: String, cause: String },
}

impl std::fmt::Display for Why {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Why::Fallbacks {
                fallbacks,
                window_s,
            } => write!(f, "{fallbacks} fallbacks in {window_s} s"),
            Why::Paused { by } => write!(f, "paused by {by}"),
            Why::Fleet { replica, cause } => write!(f, "handed off by replica {replica}: {cause}"),
        }
    }
}

/// A change of the hand-off, for the record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    HandedOff(Why),
    /// Resumed: the cool-down is over, or `by` an admin.
    Resumed {
        by: Option<String>,
    },
}

#[derive(Debug, Clone)]
struct Active {
    why: Why,
    since: Instant,
    /// None: until an admin resumes it.
    until: Option<Instant>,
}

/// The pure state of one model's hand-off.
#[derive(Debug, Clone)]
pub struct HandoffState {
    config: HandoffConfig,
    epoch: Instant,
    /// Fallbacks per second of the window: `(second since epoch, count)`.
    buckets: Vec<(u64, u64)>,
    active: Option<Active>,
}

impl HandoffState {
    pub fn new(config: HandoffConfig, now: Instant) -> Self {
        Self {
            buckets: vec![(u64::MAX, 0); config.window_s.max(1) as usize],
            config,
            epoch: now,
            active: None,
        }
    }

    fn second(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_secs()
    }

    /// Fallbacks in the window ending at `now`.
    pub fn fallbacks(&self, now: Instant) -> u64 {
        let second = self.second(now);
        let n = self.buckets.len() as u64;
        self.buckets
            .iter()
            .filter(|(s, _)| *s != u64::MAX && *s <= second && s + n > second)
            .map(|(_, c)| c)
            .sum()
    }

    /// A request of the model fell back (or failed after trying its chain).
    pub fn note_fallback(&mut self, now: Instant) -> Option<Change> {
        if !self.config.enabled || self.active.is_some() {
            return None;
        }
        let second = self.second(now);
        let n = self.buckets.len() as u64;
        let slot = &mut self.buckets[(second % n) as usize];
        if slot.0 != second {
            *slot = (second, 0);
        }
        slot.1 += 1;
        let fallbacks = self.fallbacks(now);
        if fallbacks <= self.config.threshold {
            return None;
        }
        let why = Why::Fallbacks {
            fallbacks,
            window_s: self.config.window_s,
        };
        self.active = Some(Active {
            why: why.clone(),
            since: now,
            until: Some(now + Duration::from_secs(self.config.cooldown_s)),
        });
        Some(Change::HandedOff(why))
    }

    /// Whether new requests are handed off at `now`; a cool-down that is over resumes first.
    pub fn check(&mut self, now: Instant) -> (bool, Option<Change>) {
        match &self.active {
            Some(a) if a.until.is_some_and(|u| now >= u) => {
                self.resume();
                (false, Some(Change::Resumed { by: None }))
            }
            Some(_) => (true, None),
            None => (false, None),
        }
    }

    pub fn pause(&mut self, by: &str, now: Instant) -> Option<Change> {
        let why = Why::Paused { by: by.to_string() };
        let changed = self.active.as_ref().map(|a| &a.why) != Some(&why);
        self.active = Some(Active {
            why: why.clone(),
            since: now,
            until: None,
        });
        changed.then_some(Change::HandedOff(why))
    }

    /// Hands off for a cause from elsewhere (another replica of the fleet), until `until`
    /// (`None`: until resumed).
    pub fn follow(&mut self, why: Why, now: Instant, until: Option<Instant>) -> Option<Change> {
        let changed = self.active.as_ref().map(|a| &a.why) != Some(&why);
        self.active = Some(Active {
            why: why.clone(),
            since: now,
            until,
        });
        changed.then_some(Change::HandedOff(why))
    }

    pub fn resume_by(&mut self, by: &str) -> Option<Change> {
        let was = self.active.is_some();
        self.resume();
        was.then(|| Change::Resumed {
            by: Some(by.to_string()),
        })
    }

    fn resume(&mut self) {
        self.active = None;
        for b in &mut self.buckets {
            *b = (u64::MAX, 0);
        }
    }

    /// Seconds until it resumes by itself (none while not handed off or paused by hand).
    pub fn retry_after_s(&self, now: Instant) -> Option<u64> {
        self.active
            .as_ref()
            .and_then(|a| a.until)
            .map(|u| u.saturating_duration_since(now).as_secs().max(1))
    }
}

/// What `GET /admin/backends` and the hand-off admin route show.
#[derive(Debug, Clone, Serialize)]
pub struct HandoffView {
    pub model: String,
    pub enabled: bool,
    pub active: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub why: Option<Why>,
    /// Seconds since it was handed off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub active_for_s: Option<u64>,
    /// Seconds until it resumes by itself.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resumes_in_s: Option<u64>,
    pub fallbacks_in_window: u64,
    pub threshold: u64,
    pub window_s: u64,
    pub cooldown_s: u64,
}

/// What a handed-off model tells its clients.
#[derive(Debug, Clone)]
pub struct Refusal {
    pub message: String,
    pub url: Option<String>,
    pub retry_after_s: u64,
}

/// One model's hand-off.
#[derive(Debug)]
pub struct Handoff {
    model: String,
    state: Mutex<HandoffState>,
    decisions: Decisions,
}

impl Handoff {
    pub fn new(model: String, config: HandoffConfig, decisions: Decisions) -> Self {
        metrics::gauge!("rampart_handoff_active", "model" => model.clone()).set(0.0);
        Self {
            model,
            state: Mutex::new(HandoffState::new(config, Instant::now())),
            decisions,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HandoffState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A request fell back.
    pub fn note_fallback(&self) {
        let change = self.lock().note_fallback(Instant::now());
        if let Some(c) = change {
            self.note(&c);
        }
    }

    /// The refusal new requests get while handed off.
    pub fn refusal(&self) -> Option<Refusal> {
        let now = Instant::now();
        let mut state = self.lock();
        let (active, change) = state.check(now);
        let refusal = active.then(|| Refusal {
            message: state.config.message.clone(),
            url: state.config.url.clone(),
            retry_after_s: state.retry_after_s(now).unwrap_or(60),
        });
        drop(state);
        if let Some(c) = change {
            self.note(&c);
        }
        refusal
    }

    pub fn pause(&self, by: &str) -> HandoffView {
        let change = self.lock().pause(by, Instant::now());
        if let Some(c) = change {
            self.note(&c);
        }
        self.view()
    }

    /// Follows another replica's hand-off for `for_s` seconds (`None`: until resumed).
    pub fn follow(&self, why: Why, for_s: Option<u64>) -> HandoffView {
        let now = Instant::now();
        let until = for_s.map(|s| now + Duration::from_secs(s.max(1)));
        let change = self.lock().follow(why, now, until);
        if let Some(c) = change {
            self.note(&c);
        }
        self.view()
    }

    pub fn resume(&self, by: &str) -> HandoffView {
        let change = self.lock().resume_by(by);
        if let Some(c) = change {
            self.note(&c);
        }
        self.view()
    }

    pub fn view(&self) -> HandoffView {
        let now = Instant::now();
        let mut state = self.lock();
        let (active, change) = state.check(now);
        let view = HandoffView {
            model: self.model.clone(),
            enabled: state.config.enabled,
            active,
            why: state.active.as_ref().map(|a| a.why.clone()),
            active_for_s: state
                .active
                .as_ref()
                .map(|a| now.saturating_duration_since(a.since).as_secs()),
            resumes_in_s: state.retry_after_s(now),
            fallbacks_in_window: state.fallbacks(now),
            threshold: state.config.threshold,
            window_s: state.config.window_s,
            cooldown_s: state.config.cooldown_s,
        };
        drop(state);
        if let Some(c) = change {
            self.note(&c);
        }
        view
    }

    fn note(&self, change: &Change) {
        let (active, to, cause) = match change {
            Change::HandedOff(why) => {
                tracing::error!(model = %self.model, cause = %why, "model handed off to people: new requests get 503 human_handoff");
                (1.0, "handed_off", why.to_string())
            }
            Change::Resumed { by } => {
                let cause = if by.is_some() {
                    "an admin resumed it"
                } else {
                    "the cool-down is over"
                };
                tracing::warn!(model = %self.model, by = by.as_deref(), cause, "model resumed after hand-off");
                (0.0, "resumed", cause.to_string())
            }
        };
        self.decisions.note(
            &format!("handoff.{to}"),
            Some(&self.model),
            &self.model,
            &cause,
            serde_json::Value::Null,
        );
        metrics::gauge!("rampart_handoff_active", "model" => self.model.clone()).set(active);
        metrics::counter!(
            "rampart_handoff_transitions_total",
            "model" => self.model.clone(),
            "to" => to
        )
        .increment(1);
    }
}

/// Every model's hand-off, made on first use from the model's `[models.handoff]` or the
/// server's `[handoff]`.
#[derive(Debug)]
pub struct Handoffs {
    default: HandoffConfig,
    per_model: HashMap<String, HandoffConfig>,
    by_model: RwLock<HashMap<String, Arc<Handoff>>>,
    decisions: Decisions,
}

impl Handoffs {
    /// The server's `[handoff]`, and the models' own (`[models.handoff]`) by name; each
    /// hand-off and resumption is published on `decisions`.
    pub fn new(
        default: HandoffConfig,
        per_model: HashMap<String, HandoffConfig>,
        decisions: Decisions,
    ) -> Self {
        Self {
            default,
            per_model,
            by_model: RwLock::new(HashMap::new()),
            decisions,
        }
    }

    pub fn get(&self, model: &str) -> Arc<Handoff> {
        if let Some(h) = self
            .by_model
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(model)
        {
            return Arc::clone(h);
        }
        let mut map = self.by_model.write().unwrap_or_else(|e| e.into_inner());
        Arc::clone(map.entry(model.to_string()).or_insert_with(|| {
            let config = self
                .per_model
                .get(model)
                .cloned()
                .unwrap_or_else(|| self.default.clone());
            Arc::new(Handoff::new(
                model.to_string(),
                config,
                self.decisions.clone(),
            ))
        }))
    }

    /// The hand-offs made so far.
    pub fn all(&self) -> Vec<Arc<Handoff>> {
        let mut v: Vec<Arc<Handoff>> = self
            .by_model
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        v.sort_by(|a, b| a.model.cmp(&b.model));
        v
    }
}

/// Hand-off to people: when a model's requests keep falling back, new ones get a 503 with
/// `human_handoff`, this message and link, until the cool-down is over.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HandoffConfig {
    pub enabled: bool,
    /// More than this many fallbacks ...
    pub threshold: u64,
    /// ... within this many seconds hand the model off.
    pub window_s: u64,
    /// Seconds until it resumes by itself.
    pub cooldown_s: u64,
    /// What clients are told.
    pub message: String,
    /// Where people can be reached (sent as `handoff_url`).
    pub url: Option<String>,
}

impl Default for HandoffConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            threshold: 1000,
            window_s: 300,
            cooldown_s: 600,
            message:
                "This service is handed over to our staff for now; please contact us directly."
                    .into(),
            url: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(threshold: u64) -> HandoffConfig {
        HandoffConfig {
            threshold,
            window_s: 10,
            cooldown_s: 30,
            ..HandoffConfig::default()
        }
    }

    #[test]
    fn more_than_the_threshold_in_the_window_hands_off_then_cools_down() {
        let t0 = Instant::now();
        let mut s = HandoffState::new(config(3), t0);
        for i in 0..3 {
            assert_eq!(s.note_fallback(t0 + Duration::from_secs(i)), None);
        }
        assert_eq!(s.check(t0 + Duration::from_secs(3)), (false, None));
        let change = s.note_fallback(t0 + Duration::from_secs(3));
        assert!(
            matches!(
                change,
                Some(Change::HandedOff(Why::Fallbacks { fallbacks: 4, .. }))
            ),
            "{change:?}"
        );
        assert_eq!(s.check(t0 + Duration::from_secs(20)), (true, None));
        assert_eq!(s.retry_after_s(t0 + Duration::from_secs(20)), Some(13));
        let (active, change) = s.check(t0 + Duration::from_secs(33));
        assert!(!active);
        assert_eq!(change, Some(Change::Resumed { by: None }));
        assert_eq!(
            s.fallbacks(t0 + Duration::from_secs(33)),
            0,
            "the window starts afresh"
        );
    }

    #[test]
    fn fallbacks_outside_the_window_do_not_count() {
        let t0 = Instant::now();
        let mut s = HandoffState::new(config(3), t0);
        for i in 0..20 {
            // One every 4 s: never more than 3 in 10 s.
            assert_eq!(
                s.note_fallback(t0 + Duration::from_secs(4 * i)),
                None,
                "at {i}"
            );
        }
    }

    #[test]
    fn a_pause_holds_until_an_admin_resumes() {
        let t0 = Instant::now();
        let mut s = HandoffState::new(config(1000), t0);
        assert!(matches!(
            s.pause("ops", t0),
            Some(Change::HandedOff(Why::Paused { .. }))
        ));
        assert_eq!(s.check(t0 + Duration::from_secs(3600)), (true, None));
        assert_eq!(s.retry_after_s(t0), None);
        assert_eq!(
            s.resume_by("ops"),
            Some(Change::Resumed {
                by: Some("ops".into())
            })
        );
        assert_eq!(s.check(t0 + Duration::from_secs(3602)), (false, None));
        assert_eq!(
            s.resume_by("ops"),
            None,
            "resuming a running model changes nothing"
        );
    }

    #[test]
    fn another_replicas_hand_off_is_followed_until_its_end() {
        let t0 = Instant::now();
        let mut s = HandoffState::new(config(1000), t0);
        let why = Why::Fleet {
            replica: "r2".into(),
            cause: "12 fallbacks in 60 s".into(),
        };
        let until = t0 + Duration::from_secs(30);
        assert_eq!(
            s.follow(why.clone(), t0, Some(until)),
            Some(Change::HandedOff(why.clone()))
        );
        assert_eq!(s.follow(why, t0, Some(until)), None, "followed once");
        assert_eq!(s.check(t0 + Duration::from_secs(29)), (true, None));
        assert_eq!(s.retry_after_s(t0 + Duration::from_secs(20)), Some(10));
        assert_eq!(
            s.check(until),
            (false, Some(Change::Resumed { by: None })),
            "its cool-down ends here too"
        );
    }

    #[test]
    fn a_disabled_handoff_never_engages() {
        let t0 = Instant::now();
        let mut s = HandoffState::new(
            HandoffConfig {
                enabled: false,
                ..config(0)
            },
            t0,
        );
        for _ in 0..100 {
            assert_eq!(s.note_fallback(t0), None);
        }
    }
}
