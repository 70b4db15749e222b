//! The keys' rate limits: a request bucket and a token budget per principal
//! (`[rate_limit]`), taken by the front before anything that costs; and the tally of the
//! refusals past them, summarised per interval instead of audited one by one (a key past its
//! limit may keep asking at any rate).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Instant;

use serde::{Deserialize, Serialize};

/// Per-key rate limits (token buckets); 0 turns a limit off.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RateLimit {
    pub requests_per_second: f64,
    /// Prompt plus generated tokens per minute.
    pub tokens_per_minute: u64,
}

/// A token bucket: `capacity` tokens, refilled at `rate` per second.
#[derive(Debug, Clone, Copy)]
pub struct Bucket {
    pub level: f64,
    pub updated: Instant,
}

impl Bucket {
    pub fn refill(&mut self, rate: f64, capacity: f64, now: Instant) {
        let dt = now.saturating_duration_since(self.updated).as_secs_f64();
        self.level = (self.level + dt * rate).min(capacity);
        self.updated = now;
    }
}

/// Per-principal request and token buckets.
#[derive(Debug)]
pub struct RateLimiter {
    config: RateLimit,
    buckets: Mutex<HashMap<String, (Bucket, Bucket)>>,
}

impl RateLimiter {
    pub fn new(config: RateLimit) -> Self {
        Self {
            config,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    fn enabled(&self) -> bool {
        self.config.requests_per_second > 0.0 || self.config.tokens_per_minute > 0
    }

    /// Takes one request from the principal's bucket; the seconds to wait when there is none
    /// (or when the token budget is spent).
    pub fn admit(&self, principal: &str) -> Result<(), u64> {
        if !self.enabled() {
            return Ok(());
        }
        let now = Instant::now();
        let rps = self.config.requests_per_second;
        let tpm = self.config.tokens_per_minute as f64;
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        let fresh = Bucket {
            level: 0.0,
            updated: now,
        };
        let (requests, tokens) = buckets.entry(principal.to_string()).or_insert((
            Bucket {
                level: rps.max(1.0),
                ..fresh
            },
            Bucket {
                level: tpm,
                ..fresh
            },
        ));
        if rps > 0.0 {
            requests.refill(rps, rps.max(1.0), now);
            if requests.level < 1.0 {
                return Err(((1.0 - requests.level) / rps).ceil().max(1.0) as u64);
            }
        }
        if tpm > 0.0 {
            tokens.refill(tpm / 60.0, tpm, now);
            if tokens.level <= 0.0 {
                return Err((-tokens.level / (tpm / 60.0)).ceil().max(1.0) as u64);
            }
        }
        if rps > 0.0 {
            requests.level -= 1.0;
        }
        Ok(())
    }

    /// Charges tokens a request used (prompt + generated) to its principal.
    pub fn charge(&self, principal: &str, tokens: usize) {
        if self.config.tokens_per_minute == 0 {
            return;
        }
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, bucket)) = buckets.get_mut(principal) {
            let tpm = self.config.tokens_per_minute as f64;
            bucket.refill(tpm / 60.0, tpm, Instant::now());
            bucket.level -= tokens as f64;
        }
    }
}

/// Request ids kept per interval as a sample (to find the requests in a proxy's logs).
pub const SAMPLE: usize = 8;

/// What every summary holds: how many, when, and the first request ids as a sample.
#[derive(Debug, Default, Clone, Serialize, PartialEq, Eq)]
pub struct Interval {
    pub refused: u64,
    pub first_ms: u64,
    pub last_ms: u64,
    /// The first request ids of the interval.
    pub sample_request_ids: Vec<String>,
}

impl Interval {
    /// Counts one refusal now; true while the sample takes it.
    pub fn count(&mut self, id: &str) -> bool {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        if self.refused == 0 {
            self.first_ms = now;
        }
        self.refused += 1;
        self.last_ms = now;
        if self.sample_request_ids.len() < SAMPLE {
            self.sample_request_ids.push(id.chars().take(64).collect());
            return true;
        }
        false
    }
}

/// One key's refusals past its rate limit in an interval.
#[derive(Debug, Default, Clone, Serialize, PartialEq, Eq)]
pub struct KeyRefusals {
    pub refused: u64,
    pub by_endpoint: BTreeMap<&'static str, u64>,
}

/// Requests of valid keys refused past their rate limit since the last summary. Its size is
/// bounded by the keys the server has (the keys file), not by the request rate.
#[derive(Debug, Default, Clone, Serialize, PartialEq, Eq)]
pub struct RateLimitedSummary {
    #[serde(flatten)]
    pub interval: Interval,
    /// By key id.
    pub by_key: BTreeMap<String, KeyRefusals>,
}

/// The tally of rate-limit refusals: a key past its limit may keep asking at any rate, and each
/// refusal would otherwise cost an fsync'd audit entry, a log line and a span (8,900 audit
/// entries a minute from one key in `rampart bench abuse`). The key is known and accountable:
/// its summary names it, with its counts by endpoint.
#[derive(Debug, Default)]
pub struct RateLimitedTally {
    current: Mutex<RateLimitedSummary>,
}

impl RateLimitedTally {
    /// Counts one refusal; true for the first few of the interval (the caller logs them).
    pub fn note(&self, key: &str, endpoint: &'static str, id: &str) -> bool {
        let mut s = self.current.lock().unwrap_or_else(|e| e.into_inner());
        let sampled = s.interval.count(id);
        let of_key = match s.by_key.get_mut(key) {
            Some(k) => k,
            None => s.by_key.entry(key.to_string()).or_default(),
        };
        of_key.refused += 1;
        *of_key.by_endpoint.entry(endpoint).or_default() += 1;
        sampled
    }

    /// What was counted since the last call (`None`: nothing), and a fresh count.
    pub fn take(&self) -> Option<RateLimitedSummary> {
        let mut s = self.current.lock().unwrap_or_else(|e| e.into_inner());
        (s.interval.refused > 0).then(|| std::mem::take(&mut *s))
    }
}
