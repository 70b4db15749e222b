//! Admission and load shedding for one model: a bounded number of requests in flight, a bounded
//! FIFO of requests waiting for a slot, and a bounded wait.
//!
//! The slot is taken before anything costly (tokenization, image decoding): a full queue answers
//! 429 at once with `Retry-After` estimated from the rate at which slots have been freeing up; a
//! request that waits longer than the queue timeout gets 503. Memory stays bounded: at most
//! `max_in_flight + max_waiting` requests per model hold anything beyond their socket.
//!
//! The degradation controller can lower the number let in at once below `max_in_flight`
//! (time to first token above its objective, or saturation): then a request beyond that limit
//! is refused at once (429 `shedding`, with `Retry-After`) instead of waiting in a queue that
//! would make it late anyway.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::ApiError;

/// Completions remembered for the drain-rate estimate.
const RATE_WINDOW: usize = 64;

/// The admission state of one model.
#[derive(Debug)]
pub struct Admission {
    config: AdmissionConfig,
    permits: Arc<Semaphore>,
    waiting: AtomicUsize,
    in_flight: AtomicUsize,
    completions: Mutex<VecDeque<Instant>>,
    /// The degradation controller's limit on requests let in at once (`max_in_flight`
    /// unless lowered).
    limit: AtomicUsize,
    /// Requests refused by that limit since the controller last looked.
    shed: AtomicU64,
    /// Most requests in flight or waiting since the controller last looked.
    peak: AtomicUsize,
}

/// A request's place in flight; dropping it frees the place.
#[derive(Debug)]
pub struct Slot {
    _permit: OwnedSemaphorePermit,
    admission: Arc<Admission>,
    /// How long the request waited for it.
    pub queued: Duration,
    /// When it was granted.
    pub admitted: Instant,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.admission.in_flight.fetch_sub(1, Ordering::Relaxed);
        let mut done = self
            .admission
            .completions
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if done.len() == RATE_WINDOW {
            done.pop_front();
        }
        done.push_back(Instant::now());
    }
}

impl Admission {
    pub fn new(config: AdmissionConfig) -> Arc<Self> {
        Arc::new(Self {
            permits: Arc::new(Semaphore::new(config.max_in_flight)),
            waiting: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            completions: Mutex::new(VecDeque::new()),
            limit: AtomicUsize::new(config.max_in_flight),
            shed: AtomicU64::new(0),
            peak: AtomicUsize::new(0),
            config,
        })
    }

    /// The configured most requests in flight.
    pub fn max_in_flight(&self) -> usize {
        self.config.max_in_flight
    }

    /// The degradation controller's limit on requests let in at once.
    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    /// Sets that limit (at most `max_in_flight`, at least 1); takes effect for the next
    /// request.
    pub fn set_limit(&self, limit: usize) {
        self.limit
            .store(limit.clamp(1, self.config.max_in_flight), Ordering::Relaxed);
    }

    /// The most requests in flight or waiting, and the requests refused by the limit, since
    /// the last call (one degradation window).
    pub fn take_window(&self) -> (usize, u64) {
        let now = self.in_flight() + self.waiting();
        let peak = self.peak.swap(now, Ordering::Relaxed).max(now);
        (peak, self.shed.swap(0, Ordering::Relaxed))
    }

    /// Requests waiting for a slot.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Requests holding a slot.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Slots freed per second recently (`None` before any completed).
    pub fn drain_rate(&self) -> Option<f64> {
        let done = self.completions.lock().unwrap_or_else(|e| e.into_inner());
        let first = *done.front()?;
        let span = Instant::now()
            .saturating_duration_since(first)
            .as_secs_f64();
        (done.len() >= 2 && span > 0.0).then(|| done.len() as f64 / span)
    }

    /// Seconds until a new request would likely get a slot.
    pub fn retry_after_s(&self) -> u64 {
        let ahead = (self.waiting() + 1) as f64;
        match self.drain_rate() {
            Some(rate) if rate > 0.0 => (ahead / rate).ceil().clamp(1.0, 600.0) as u64,
            _ => 1,
        }
    }

    /// Takes a slot, waiting in line if all are taken.
    pub async fn acquire(self: &Arc<Self>) -> Result<Slot, ApiError> {
        let start = Instant::now();
        let limit = self.limit();
        if limit < self.config.max_in_flight && self.in_flight() + self.waiting() >= limit {
            self.shed.fetch_add(1, Ordering::Relaxed);
            return Err(ApiError::Overloaded {
                message: format!(
                    "the model is shedding load: its degradation controller lets {limit} requests in at once (of {}); retry later",
                    self.config.max_in_flight
                ),
                retry_after_s: self.retry_after_s(),
                code: "shedding",
                booking: None,
            });
        }
        let permit = match Arc::clone(&self.permits).try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                let queued = self
                    .waiting
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                        (w < self.config.max_waiting).then_some(w + 1)
                    });
                if queued.is_err() {
                    return Err(ApiError::Overloaded {
                        message: format!(
                            "the model is at capacity ({} requests in flight, {} waiting); retry later",
                            self.config.max_in_flight, self.config.max_waiting
                        ),
                        retry_after_s: self.retry_after_s(),
                        code: "queue_full",
                        booking: None,
                    });
                }
                let timeout = Duration::from_millis(self.config.queue_timeout_ms);
                let got =
                    tokio::time::timeout(timeout, Arc::clone(&self.permits).acquire_owned()).await;
                self.waiting.fetch_sub(1, Ordering::AcqRel);
                match got {
                    Ok(Ok(permit)) => permit,
                    Ok(Err(_)) => {
                        return Err(ApiError::Unavailable {
                            message: "the server is shutting down".into(),
                            retry_after_s: 5,
                        })
                    }
                    Err(_) => {
                        return Err(ApiError::Unavailable {
                            message: format!(
                            "no slot became free within the queue timeout of {} ms; retry later",
                            self.config.queue_timeout_ms
                        ),
                            retry_after_s: self.retry_after_s(),
                        })
                    }
                }
            }
        };
        let now = self.in_flight.fetch_add(1, Ordering::Relaxed) + 1 + self.waiting();
        self.peak.fetch_max(now, Ordering::Relaxed);
        let admitted = Instant::now();
        Ok(Slot {
            _permit: permit,
            admission: Arc::clone(self),
            queued: admitted.saturating_duration_since(start),
            admitted,
        })
    }
}

/// Admission and load shedding, per model.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdmissionConfig {
    /// Requests handed to the engine at once.
    pub max_in_flight: usize,
    /// Requests waiting for one of those slots; beyond this, 429.
    pub max_waiting: usize,
    /// Longest wait for a slot; beyond this, 503.
    pub queue_timeout_ms: u64,
    /// Bookings a language model's first-token gate keeps for the requests it refuses (0:
    /// none; `engine::reservations`).
    pub reservations: usize,
    /// Tenants' weights in the first-token gate's fair order (a key's `tenant=`, or its id for
    /// a key of its own, to a weight; everyone else weighs 1).
    pub weights: std::collections::BTreeMap<String, f64>,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            max_in_flight: 64,
            max_waiting: 128,
            queue_timeout_ms: 30_000,
            reservations: engine::scheduler::DEFAULT_RESERVATIONS,
            weights: std::collections::BTreeMap::new(),
        }
    }
}

impl AdmissionConfig {
    /// A tenant's weight in the fair order.
    pub fn weight(&self, tenant: &str) -> f64 {
        self.weights.get(tenant).copied().unwrap_or(1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn full_queues_refuse_and_long_waits_time_out() {
        let admission = Admission::new(AdmissionConfig {
            max_in_flight: 1,
            max_waiting: 1,
            queue_timeout_ms: 50,
            ..AdmissionConfig::default()
        });
        let first = admission.acquire().await.unwrap();
        assert_eq!(admission.in_flight(), 1);
        // The second waits (and times out: 503); meanwhile a third finds the queue full (429).
        let a = Arc::clone(&admission);
        let waiter = tokio::spawn(async move { a.acquire().await });
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(admission.waiting(), 1);
        let refused = admission.acquire().await.unwrap_err();
        assert_eq!(refused.status_code(), 429);
        let timed_out = waiter.await.unwrap().unwrap_err();
        assert_eq!(timed_out.status_code(), 503);
        drop(first);
        let again = admission.acquire().await.unwrap();
        assert_eq!(admission.waiting(), 0);
        drop(again);
        assert_eq!(admission.in_flight(), 0);
    }

    #[tokio::test]
    async fn a_lowered_limit_refuses_at_once_and_counts_what_it_refused() {
        let admission = Admission::new(AdmissionConfig {
            max_in_flight: 4,
            max_waiting: 8,
            queue_timeout_ms: 1000,
            ..AdmissionConfig::default()
        });
        admission.set_limit(2);
        let a = admission.acquire().await.unwrap();
        let b = admission.acquire().await.unwrap();
        let refused = admission.acquire().await.unwrap_err();
        assert_eq!(refused.status_code(), 429);
        assert!(refused.to_string().contains("shedding"), "{refused}");
        assert_eq!(admission.take_window(), (2, 1));
        drop(a);
        let c = admission.acquire().await.unwrap();
        // Back at the configured limit: nobody is shed.
        admission.set_limit(100);
        assert_eq!(admission.limit(), 4);
        let d = admission.acquire().await.unwrap();
        assert_eq!(admission.take_window(), (3, 0));
        drop((b, c, d));
        // The window that just ended began with three in flight; the next one is empty.
        assert_eq!(admission.take_window(), (3, 0));
        assert_eq!(admission.take_window(), (0, 0));
    }
}
