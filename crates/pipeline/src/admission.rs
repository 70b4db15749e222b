//! Admission and load shedding for one model: a bounded number of requests in flight, a bounded
//! queue of requests waiting for a slot, and a bounded wait.
//!
//! The queue is served in weighted fair order across tenants (start-time fair queueing, one
//! unit per request over the tenant's weight, `[admission.weights]`): a tenant that keeps the
//! queue full only lines up behind its own requests, and when the queue is full a request of a
//! tenant earlier in the fair order takes the place of the latest-ordered waiter (which gets
//! 429 `queue_full`, saying it was displaced). Requests of one tenant are served in arrival
//! order. A request that does not say who it is counts as one anonymous tenant.
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

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::error::ApiError;

/// Completions remembered for the drain-rate estimate.
const RATE_WINDOW: usize = 64;

/// The admission state of one model.
#[derive(Debug)]
pub struct Admission {
    config: AdmissionConfig,
    queue: Mutex<Queue>,
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

/// Who waits for a slot, for the fair order: a tenant (hashed) and its weight.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Who {
    pub tenant: u64,
    pub weight: f64,
}

impl Who {
    /// A request that does not say who it is.
    pub const ANONYMOUS: Who = Who {
        tenant: 0,
        weight: 1.0,
    };
}

/// Tenants' finish tags kept before those behind the virtual clock are forgotten.
const MAX_TENANTS: usize = 4_096;

/// The places and the waiters, under one lock.
#[derive(Debug)]
struct Queue {
    /// Places free (of `max_in_flight`).
    free: usize,
    waiters: Vec<Waiter>,
    /// Waiters handed a place they have not taken yet (they take it when they wake; one that
    /// went away meanwhile hands it on).
    granted: HashSet<u64>,
    /// Waiters displaced by an earlier place in the fair order.
    displaced: HashSet<u64>,
    /// Tenants' latest finish tags, and the start tag of the latest request let in.
    finish: HashMap<u64, f64>,
    virtual_now: f64,
    next_id: u64,
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    tag: f64,
    start: f64,
    wake: Arc<Notify>,
}

impl Queue {
    /// The start and finish tags of the next request of `who`.
    fn tags(&self, who: Who) -> (f64, f64) {
        let weight = if who.weight.is_finite() && who.weight > 0.0 {
            who.weight
        } else {
            1.0
        };
        let start = self
            .virtual_now
            .max(self.finish.get(&who.tenant).copied().unwrap_or(0.0));
        (start, start + 1.0 / weight)
    }

    fn charge(&mut self, tenant: u64, tag: f64) {
        if self.finish.len() >= MAX_TENANTS && !self.finish.contains_key(&tenant) {
            let now = self.virtual_now;
            self.finish.retain(|_, f| *f > now);
        }
        self.finish.insert(tenant, tag);
    }

    /// The waiter first in the fair order (ties: the earliest).
    fn first(&self) -> Option<usize> {
        (0..self.waiters.len()).min_by(|&a, &b| {
            let (a, b) = (&self.waiters[a], &self.waiters[b]);
            a.tag.total_cmp(&b.tag).then(a.id.cmp(&b.id))
        })
    }

    /// The waiter last in the fair order.
    fn last(&self) -> Option<usize> {
        (0..self.waiters.len()).max_by(|&a, &b| {
            let (a, b) = (&self.waiters[a], &self.waiters[b]);
            a.tag.total_cmp(&b.tag).then(a.id.cmp(&b.id))
        })
    }

    /// A place came free: to the first waiter, else kept.
    fn release(&mut self) {
        match self.first() {
            Some(i) => {
                let w = self.waiters.swap_remove(i);
                self.virtual_now = self.virtual_now.max(w.start);
                self.granted.insert(w.id);
                w.wake.notify_one();
            }
            None => self.free += 1,
        }
    }
}

/// A waiter's hold on its entry: whatever ends its wait (a slot, a refusal, a timeout, the
/// client going away) leaves the queue as it found it.
struct WaitGuard<'a> {
    admission: &'a Admission,
    id: u64,
    taken: bool,
}

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        let mut q = self.admission.queue();
        if let Some(i) = q.waiters.iter().position(|w| w.id == self.id) {
            q.waiters.swap_remove(i);
        }
        q.displaced.remove(&self.id);
        // Handed a place and gone without it: the place goes on.
        if q.granted.remove(&self.id) && !self.taken {
            q.release();
        }
        self.admission
            .waiting
            .store(q.waiters.len(), Ordering::Relaxed);
    }
}

/// A request's place in flight; dropping it frees the place.
#[derive(Debug)]
pub struct Slot {
    admission: Arc<Admission>,
    /// How long the request waited for it.
    pub queued: Duration,
    /// When it was granted.
    pub admitted: Instant,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.admission.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.admission.queue().release();
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
            queue: Mutex::new(Queue {
                free: config.max_in_flight,
                waiters: Vec::new(),
                granted: HashSet::new(),
                displaced: HashSet::new(),
                finish: HashMap::new(),
                virtual_now: 0.0,
                next_id: 0,
            }),
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
        self.acquire_as(Who::ANONYMOUS).await
    }

    /// Takes a slot for `who`, waiting in the fair order if all are taken.
    pub async fn acquire_as(self: &Arc<Self>, who: Who) -> Result<Slot, ApiError> {
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
        let (id, wake) = {
            let mut q = self.queue();
            let (start_tag, tag) = q.tags(who);
            if q.free > 0 && q.waiters.is_empty() {
                q.free -= 1;
                q.charge(who.tenant, tag);
                q.virtual_now = q.virtual_now.max(start_tag);
                drop(q);
                return Ok(self.slot(start));
            }
            if q.waiters.len() >= self.config.max_waiting {
                // Full: the waiter last in the fair order gives its place to this request when
                // this one comes before it (a tenant that filled the queue does not shut others
                // out).
                let last = q.last().filter(|&i| q.waiters[i].tag > tag);
                let Some(last) = last else {
                    drop(q);
                    return Err(self.queue_full());
                };
                let w = q.waiters.swap_remove(last);
                q.displaced.insert(w.id);
                w.wake.notify_one();
            }
            let id = q.next_id;
            q.next_id += 1;
            let wake = Arc::new(Notify::new());
            q.waiters.push(Waiter {
                id,
                tag,
                start: start_tag,
                wake: Arc::clone(&wake),
            });
            q.charge(who.tenant, tag);
            self.waiting.store(q.waiters.len(), Ordering::Relaxed);
            (id, wake)
        };
        let mut guard = WaitGuard {
            admission: self,
            id,
            taken: false,
        };
        let deadline =
            tokio::time::Instant::now() + Duration::from_millis(self.config.queue_timeout_ms);
        loop {
            let woke = tokio::time::timeout_at(deadline, wake.notified()).await;
            let (granted, displaced) = {
                let mut q = self.queue();
                (q.granted.remove(&id), q.displaced.contains(&id))
            };
            if granted {
                guard.taken = true;
                drop(guard);
                return Ok(self.slot(start));
            }
            if displaced {
                drop(guard);
                let mut e = self.queue_full();
                if let ApiError::Overloaded { message, .. } = &mut e {
                    message.push_str(
                        " (this request waited and gave its place to one earlier in the fair order across tenants)",
                    );
                }
                return Err(e);
            }
            if woke.is_err() {
                drop(guard);
                return Err(ApiError::Unavailable {
                    message: format!(
                        "no slot became free within the queue timeout of {} ms; retry later",
                        self.config.queue_timeout_ms
                    ),
                    retry_after_s: self.retry_after_s(),
                });
            }
        }
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn queue_full(&self) -> ApiError {
        ApiError::Overloaded {
            message: format!(
                "the model is at capacity ({} requests in flight, {} waiting); retry later",
                self.config.max_in_flight, self.config.max_waiting
            ),
            retry_after_s: self.retry_after_s(),
            code: "queue_full",
            booking: None,
        }
    }

    /// The slot of a request that asked at `start`.
    fn slot(self: &Arc<Self>, start: Instant) -> Slot {
        let now = self.in_flight.fetch_add(1, Ordering::Relaxed) + 1 + self.waiting();
        self.peak.fetch_max(now, Ordering::Relaxed);
        let admitted = Instant::now();
        Slot {
            admission: Arc::clone(self),
            queued: admitted.saturating_duration_since(start),
            admitted,
        }
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

    fn who(tenant: u64, weight: f64) -> Who {
        Who { tenant, weight }
    }

    /// Waits until `n` requests wait.
    async fn until_waiting(admission: &Admission, n: usize) {
        while admission.waiting() != n {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    #[tokio::test]
    async fn the_queue_serves_tenants_in_weighted_fair_order() {
        let admission = Admission::new(AdmissionConfig {
            max_in_flight: 1,
            max_waiting: 16,
            queue_timeout_ms: 5_000,
            ..AdmissionConfig::default()
        });
        let held = admission.acquire().await.unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        // Tenant 1 queues three, then tenant 2 one: tenant 2 need not wait for all three.
        let mut tasks = Vec::new();
        for (name, tenant) in [("a1", 1), ("a2", 1), ("a3", 1), ("b1", 2)] {
            let (a, tx) = (Arc::clone(&admission), tx.clone());
            tasks.push(tokio::spawn(async move {
                let slot = a.acquire_as(who(tenant, 1.0)).await.unwrap();
                tx.send(name).unwrap();
                tokio::time::sleep(Duration::from_millis(5)).await;
                drop(slot);
            }));
            until_waiting(&admission, tasks.len()).await;
        }
        drop(held);
        for t in tasks {
            t.await.unwrap();
        }
        let mut order = Vec::new();
        while let Ok(name) = rx.try_recv() {
            order.push(name);
        }
        assert_eq!(order, ["a1", "b1", "a2", "a3"]);
        assert_eq!((admission.in_flight(), admission.waiting()), (0, 0));
        // Weights 3 : 1, both always waiting: three of one for each of the other.
        let held = admission.acquire().await.unwrap();
        let mut tasks = Vec::new();
        for i in 0..8u64 {
            for (tenant, weight) in [(3u64, 3.0), (4, 1.0)] {
                let (a, tx) = (Arc::clone(&admission), tx.clone());
                tasks.push(tokio::spawn(async move {
                    let slot = a.acquire_as(who(tenant, weight)).await.unwrap();
                    tx.send(if tenant == 3 { "heavy" } else { "light" })
                        .unwrap();
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    drop(slot);
                }));
                until_waiting(&admission, 2 * i as usize + tenant as usize - 2).await;
            }
        }
        drop(held);
        for t in tasks {
            t.await.unwrap();
        }
        let mut first_eight = Vec::new();
        while let Ok(name) = rx.try_recv() {
            first_eight.push(name);
        }
        first_eight.truncate(8);
        let heavy = first_eight.iter().filter(|n| **n == "heavy").count();
        assert_eq!(heavy, 6, "{first_eight:?}");
    }

    #[tokio::test]
    async fn a_full_queue_gives_the_latest_place_in_the_fair_order_to_an_earlier_one() {
        let admission = Admission::new(AdmissionConfig {
            max_in_flight: 1,
            max_waiting: 3,
            queue_timeout_ms: 5_000,
            ..AdmissionConfig::default()
        });
        let held = admission.acquire().await.unwrap();
        let mut heavy = Vec::new();
        for _ in 0..3 {
            let a = Arc::clone(&admission);
            // Each takes its slot and frees it at once.
            heavy.push(tokio::spawn(async move {
                a.acquire_as(who(1, 1.0)).await.map(drop)
            }));
            until_waiting(&admission, heavy.len()).await;
        }
        // The heavy tenant's fourth is refused: nothing of its own comes after it.
        let refused = admission.acquire_as(who(1, 1.0)).await.unwrap_err();
        assert_eq!(refused.code(), Some("queue_full"));
        // Another tenant's first takes the place of the heavy tenant's latest.
        let a = Arc::clone(&admission);
        let light = tokio::spawn(async move { a.acquire_as(who(2, 1.0)).await.map(drop) });
        let displaced = heavy.pop().unwrap().await.unwrap().unwrap_err();
        assert_eq!(displaced.code(), Some("queue_full"));
        assert!(
            displaced.to_string().contains("gave its place"),
            "{displaced}"
        );
        until_waiting(&admission, 3).await;
        drop(held);
        for h in heavy {
            h.await.unwrap().unwrap();
        }
        light.await.unwrap().unwrap();
        assert_eq!((admission.in_flight(), admission.waiting()), (0, 0));
        // A waiter that goes away (the client left) leaves no trace and loses no place.
        let held = admission.acquire().await.unwrap();
        let a = Arc::clone(&admission);
        let gone = tokio::spawn(async move { a.acquire_as(who(5, 1.0)).await });
        until_waiting(&admission, 1).await;
        gone.abort();
        let _ = gone.await;
        assert_eq!(admission.waiting(), 0);
        drop(held);
        let again = admission.acquire().await.unwrap();
        assert_eq!(admission.in_flight(), 1);
        drop(again);
    }
}
