//! Requests refused before authentication (a missing or invalid key), and past a key's rate
//! limit, counted and summarised.
//!
//! Anyone who can reach the port can send them, at any rate. Their records still reach the
//! metrics (`rampart_rejected_requests_total{reason="unauthorized"}`), but the sinks whose cost
//! is per record — the audit log (an fsync'd entry, an index row kept in memory), the log (a
//! line) and traces (a span) — leave them out ([`record::Sink::takes_summarised_refusals`]).
//! Instead this tally counts them, by endpoint and transport, with the first few request ids as
//! a sample, and every `unauthenticated_summary_s` seconds that saw any, one `auth.refused`
//! action goes to the audit log and one warning line to the log. The sample's requests (the
//! first few of each interval) are also logged one by one, so a misconfigured client shows up
//! in the log at once. A flood therefore costs one
//! entry per interval, and never takes a place in the audit lane from an authenticated request.
//!
//! Refusals of a valid key past its rate limit (`rate_limited`) are summarised the same way, in
//! a [`RateLimitedTally`] by key and endpoint: one `rate_limit.refused` action per interval.
//! The key may keep asking at any rate after its limit, and each refusal is work the server did
//! not do. Not here: refusals of a valid key that lacks a scope (`insufficient_scope`) or sends
//! a bad request: each is audited like any request.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;

pub use pipeline::rate_limit::{
    Interval, KeyRefusals, RateLimitedSummary, RateLimitedTally, SAMPLE,
};

/// Where the key travels, for the message that tells a client how to send it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Http,
    Grpc,
}

/// The refusals before authentication since the last summary.
#[derive(Debug, Default, Clone, Serialize, PartialEq, Eq)]
pub struct Summary {
    #[serde(flatten)]
    pub interval: Interval,
    /// By the record's endpoint (`chat.completions`, `kserve_infer`, `admin`, ...).
    pub by_endpoint: BTreeMap<&'static str, u64>,
    /// `http` or `grpc`.
    pub by_transport: BTreeMap<&'static str, u64>,
    /// Requests that sent a key no one has (the rest sent none).
    pub invalid_key: u64,
}

/// The tally the front door adds to; a task drains it every interval.
#[derive(Debug, Default)]
pub struct Tally {
    current: Mutex<Summary>,
}

impl Tally {
    /// Counts one refusal: constant work and memory whatever the rate. True for the first
    /// few of the interval (the sample), which the caller also logs one by one.
    pub fn note(
        &self,
        endpoint: &'static str,
        transport: Transport,
        key_sent: bool,
        id: &str,
    ) -> bool {
        let mut s = self.current.lock().unwrap_or_else(|e| e.into_inner());
        let sampled = s.interval.count(id);
        *s.by_endpoint.entry(endpoint).or_default() += 1;
        let transport = match transport {
            Transport::Http => "http",
            Transport::Grpc => "grpc",
        };
        *s.by_transport.entry(transport).or_default() += 1;
        if key_sent {
            s.invalid_key += 1;
        }
        sampled
    }

    /// What was counted since the last call (`None`: nothing), and a fresh count.
    pub fn take(&self) -> Option<Summary> {
        let mut s = self.current.lock().unwrap_or_else(|e| e.into_inner());
        (s.interval.refused > 0).then(|| std::mem::take(&mut *s))
    }
}

/// Every `interval`, the refusals since the last one become one log line and, with the audit
/// log on, one action each kind: `auth.refused` before authentication, `rate_limit.refused`
/// past a key's rate limit. Runs until the runtime stops.
pub fn spawn_summaries(
    tally: Arc<Tally>,
    limited: Arc<RateLimitedTally>,
    audit: Option<Arc<audit::AuditLog>>,
    interval: Duration,
) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            if let Some(summary) = tally.take() {
                keep(&summary, audit.as_ref(), interval).await;
            }
            if let Some(summary) = limited.take() {
                keep_rate_limited(&summary, audit.as_ref(), interval).await;
            }
        }
    });
}

/// Logs and audits one summary of rate-limit refusals.
pub async fn keep_rate_limited(
    summary: &RateLimitedSummary,
    audit: Option<&Arc<audit::AuditLog>>,
    interval: Duration,
) {
    let by_key: BTreeMap<&str, u64> = summary
        .by_key
        .iter()
        .map(|(k, v)| (k.as_str(), v.refused))
        .collect();
    tracing::warn!(
        target: "rampart::rate_limit",
        refused = summary.interval.refused,
        by_key = ?by_key,
        interval_s = interval.as_secs(),
        "requests refused past their key's rate limit"
    );
    let cause = format!(
        "{} requests of {} keys refused past their rate limit in {} s",
        summary.interval.refused,
        summary.by_key.len(),
        interval.as_secs()
    );
    audit_summary(audit, "rate_limit.refused", cause, summary).await;
}

/// Keeps one summary as an audit action `name` (when the audit log is on).
async fn audit_summary(
    audit: Option<&Arc<audit::AuditLog>>,
    name: &str,
    cause: String,
    summary: &impl Serialize,
) {
    let Some(log) = audit else {
        return;
    };
    let action = audit::Action {
        name: name.into(),
        target: None,
        cause: Some(cause),
        outcome: "refused".into(),
        detail: serde_json::to_value(summary).unwrap_or_default(),
    };
    if let Err(e) =
        audit::sink::append_action(log, Some("rampart".into()), None, None, action).await
    {
        tracing::error!(target: "rampart::auth", error = %e, action = name, "a summary of refused requests could not be kept in the audit log");
    }
}

/// Logs and audits one summary.
pub async fn keep(summary: &Summary, audit: Option<&Arc<audit::AuditLog>>, interval: Duration) {
    tracing::warn!(
        target: "rampart::auth",
        refused = summary.interval.refused,
        invalid_key = summary.invalid_key,
        by_endpoint = ?summary.by_endpoint,
        by_transport = ?summary.by_transport,
        interval_s = interval.as_secs(),
        "requests refused before authentication (missing or invalid API key)"
    );
    let cause = format!(
        "{} requests refused before authentication in {} s (missing or invalid API key)",
        summary.interval.refused,
        interval.as_secs()
    );
    audit_summary(audit, "auth.refused", cause, summary).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_is_one_summary_of_constant_size() {
        let tally = Tally::default();
        for i in 0..100_000 {
            let endpoint = if i % 2 == 0 {
                "chat.completions"
            } else {
                "admin"
            };
            let sampled = tally.note(endpoint, Transport::Http, i % 4 == 0, &format!("req-{i}"));
            assert_eq!(sampled, i < SAMPLE, "{i}");
        }
        assert!(!tally.note("kserve_infer", Transport::Grpc, false, "last"));
        let s = tally.take().unwrap();
        assert_eq!(s.interval.refused, 100_001);
        assert_eq!(s.invalid_key, 25_000);
        assert_eq!(s.by_endpoint["chat.completions"], 50_000);
        assert_eq!(s.by_endpoint["admin"], 50_000);
        assert_eq!(s.by_transport["grpc"], 1);
        assert_eq!(s.interval.sample_request_ids.len(), SAMPLE);
        assert_eq!(s.interval.sample_request_ids[0], "req-0");
        assert!(s.interval.first_ms <= s.interval.last_ms);
        assert_eq!(tally.take(), None, "the tally starts over");
    }

    #[test]
    fn rate_limit_refusals_are_counted_by_key_in_constant_space() {
        let tally = RateLimitedTally::default();
        for i in 0..50_000 {
            let key = if i % 5 == 0 { "other" } else { "app" };
            let sampled = tally.note(key, "chat.completions", &format!("req-{i}"));
            assert_eq!(sampled, i < SAMPLE, "{i}");
        }
        tally.note("app", "kserve_infer", "last");
        let s = tally.take().unwrap();
        assert_eq!(s.interval.refused, 50_001);
        assert_eq!(s.by_key.len(), 2);
        assert_eq!(s.by_key["other"].refused, 10_000);
        assert_eq!(s.by_key["app"].by_endpoint["chat.completions"], 40_000);
        assert_eq!(s.by_key["app"].by_endpoint["kserve_infer"], 1);
        assert_eq!(s.interval.sample_request_ids.len(), SAMPLE);
        assert_eq!(tally.take(), None);
    }
}
