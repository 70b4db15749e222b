//! The contract every sink passes, and sinks for tests.
//!
//! [`check_sink`] drives a sink through the bus as the server does: records written in full, a
//! lane held full while the sink is stuck (lossy lanes drop and count, lossless lanes lose
//! nothing), publishing after shutdown (counted, no panic), and a shutdown that drains. A sink
//! crate calls it from its own tests with a factory for its sink.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use crate::action::ActionRecord;
use crate::bus::{Bus, Delivery, DropReason, Sink, SinkEnd, SinkError, SinkFuture};
use crate::inference::{Envelope, InferenceRecord, Payload};

/// A record such as a finished chat request leaves, numbered `n`.
pub fn sample_envelope(n: usize) -> Envelope {
    let mut record = InferenceRecord::new(format!("req-{n}"), "tester".into(), "chat.completions");
    record.model = "m".into();
    record.version = "1.0.0".into();
    record.version_digest = "sha256:00".into();
    record.prompt_tokens = 5;
    record.completion_tokens = 3;
    record.finish_reason = Some("stop".into());
    record.total_ms = 12.5;
    record.ttft_ms = 4.0;
    record.entropy_mean = Some(1.25);
    Envelope {
        record,
        token_gaps_s: vec![0.01, 0.02],
        token_entropies: vec![1.0, 1.5, 1.25],
        observations: Vec::new(),
        timeline: None,
        payload: Some(Payload {
            input: Some(serde_json::json!({"prompt": format!("input {n}")})),
            output: Some(serde_json::json!({"text": "output"})),
        }),
    }
}

/// What a [`CollectingSink`] received.
#[derive(Debug, Clone, Default)]
pub struct Collected(Arc<Mutex<Vec<Envelope>>>, Arc<Mutex<Vec<Written>>>);

/// One thing a [`CollectingSink`] wrote, in the order it wrote them.
#[derive(Debug, Clone, PartialEq)]
pub enum Written {
    /// A record, by request id.
    Record(String),
    Action(Box<ActionRecord>),
}

impl Collected {
    pub fn envelopes(&self) -> Vec<Envelope> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Records and actions in the order the sink wrote them.
    pub fn written(&self) -> Vec<Written> {
        self.1.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The actions it was given.
    pub fn actions(&self) -> Vec<ActionRecord> {
        self.written()
            .into_iter()
            .filter_map(|w| match w {
                Written::Action(a) => Some(*a),
                Written::Record(_) => None,
            })
            .collect()
    }

    pub fn records(&self) -> Vec<InferenceRecord> {
        self.envelopes().into_iter().map(|e| e.record).collect()
    }

    pub fn len(&self) -> usize {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Keeps every record it is given (and actions, when asked to take them).
#[derive(Debug)]
pub struct CollectingSink {
    name: &'static str,
    delivery: Delivery,
    wants_payload: bool,
    takes_actions: bool,
    max_batch: usize,
    into: Collected,
}

impl CollectingSink {
    pub fn new(name: &'static str, delivery: Delivery) -> (Self, Collected) {
        let into = Collected::default();
        (
            Self {
                name,
                delivery,
                wants_payload: false,
                takes_actions: false,
                max_batch: 1,
                into: into.clone(),
            },
            into,
        )
    }

    /// Asks for the payload, as the audit sink does.
    pub fn with_payload(mut self) -> Self {
        self.wants_payload = true;
        self
    }

    /// Takes actions, as the log, the metrics and the audit log do.
    pub fn with_actions(mut self) -> Self {
        self.takes_actions = true;
        self
    }

    /// Takes records `n` at a time, as the audit log does (group commits).
    pub fn with_batches(mut self, n: usize) -> Self {
        self.max_batch = n;
        self
    }
}

impl Sink for CollectingSink {
    fn name(&self) -> &'static str {
        self.name
    }
    fn delivery(&self) -> Delivery {
        self.delivery
    }
    fn wants_payload(&self) -> bool {
        self.wants_payload
    }
    fn write<'a>(&'a mut self, envelope: &'a Envelope) -> SinkFuture<'a> {
        self.into
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(envelope.clone());
        self.into
            .1
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Written::Record(envelope.record.request_id.clone()));
        Box::pin(std::future::ready(Ok(())))
    }
    fn takes_actions(&self) -> bool {
        self.takes_actions
    }
    fn write_action<'a>(&'a mut self, action: &'a ActionRecord) -> SinkFuture<'a> {
        self.into
            .1
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Written::Action(Box::new(action.clone())));
        Box::pin(std::future::ready(Ok(())))
    }
    fn max_batch(&self) -> usize {
        self.max_batch
    }
}

/// Holds a [`GatedSink`]'s writes until opened.
#[derive(Debug, Clone)]
pub struct Gate(
    Arc<watch::Sender<bool>>,
    Arc<std::sync::atomic::AtomicUsize>,
);

impl Gate {
    pub fn closed() -> Self {
        Self(
            Arc::new(watch::channel(false).0),
            Arc::new(std::sync::atomic::AtomicUsize::new(0)),
        )
    }

    pub fn open(&self) {
        self.0.send_replace(true);
    }

    /// Writes that reached the gate so far (a test waits for the sink to hold a record).
    pub fn reached(&self) -> usize {
        self.1.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A sink whose writes wait until its gate opens: a stuck disk, a slow network.
pub struct GatedSink<S> {
    inner: S,
    gate: watch::Receiver<bool>,
    reached: Arc<std::sync::atomic::AtomicUsize>,
}

impl<S: Sink> GatedSink<S> {
    pub fn new(inner: S, gate: &Gate) -> Self {
        Self {
            inner,
            gate: gate.0.subscribe(),
            reached: Arc::clone(&gate.1),
        }
    }
}

impl<S: Sink> Sink for GatedSink<S> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn delivery(&self) -> Delivery {
        self.inner.delivery()
    }
    fn wants_payload(&self) -> bool {
        self.inner.wants_payload()
    }

    fn wants_timeline(&self) -> bool {
        self.inner.wants_timeline()
    }
    fn write<'a>(&'a mut self, envelope: &'a Envelope) -> SinkFuture<'a> {
        self.reached
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Box::pin(async move {
            if self.gate.wait_for(|open| *open).await.is_err() {
                return Err(SinkError("the gate was dropped".into()));
            }
            self.inner.write(envelope).await
        })
    }
    fn flush(&mut self) -> SinkFuture<'_> {
        self.inner.flush()
    }
}

/// Records the payloads a sink was handed, then passes them on.
struct Watched<S> {
    inner: S,
    saw_payload: Arc<Mutex<(usize, usize)>>,
}

impl<S: Sink> Sink for Watched<S> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn delivery(&self) -> Delivery {
        self.inner.delivery()
    }
    fn wants_payload(&self) -> bool {
        self.inner.wants_payload()
    }

    fn wants_timeline(&self) -> bool {
        self.inner.wants_timeline()
    }
    fn write<'a>(&'a mut self, envelope: &'a Envelope) -> SinkFuture<'a> {
        {
            let mut seen = self.saw_payload.lock().unwrap_or_else(|e| e.into_inner());
            if envelope.payload.is_some() {
                seen.0 += 1;
            } else {
                seen.1 += 1;
            }
        }
        self.inner.write(envelope)
    }
    fn max_batch(&self) -> usize {
        self.inner.max_batch()
    }
    fn write_batch<'a>(&'a mut self, envelopes: &'a [Arc<Envelope>]) -> SinkFuture<'a> {
        {
            let mut seen = self.saw_payload.lock().unwrap_or_else(|e| e.into_inner());
            for envelope in envelopes {
                if envelope.payload.is_some() {
                    seen.0 += 1;
                } else {
                    seen.1 += 1;
                }
            }
        }
        self.inner.write_batch(envelopes)
    }
    fn flush(&mut self) -> SinkFuture<'_> {
        self.inner.flush()
    }
}

/// The contract: panics, naming the broken promise, when the sink breaks one. Runs on the
/// current tokio runtime (a multi-threaded one: lossless lanes wait on other tasks).
pub async fn check_sink<S: Sink>(make: impl Fn() -> S) {
    let name = make().name();
    let delivery = make().delivery();
    let capacity = delivery.capacity();
    let shutdown = Duration::from_secs(30);

    // 1. Every record published reaches the sink; the payload only if it asks.
    let seen = Arc::new(Mutex::new((0, 0)));
    let wants_payload = make().wants_payload();
    let bus = Bus::start(vec![Box::new(Watched {
        inner: make(),
        saw_payload: Arc::clone(&seen),
    })])
    .expect("a runtime runs the contract");
    let n = capacity.min(256);
    for i in 0..n {
        let receipt = bus.publish(sample_envelope(i));
        if receipt.is_pending() {
            receipt
                .wait()
                .await
                .unwrap_or_else(|e| panic!("sink {name}: record {i} not acknowledged: {e}"));
        }
    }
    let report = bus.shutdown(shutdown).await;
    assert!(report.all_drained(), "sink {name}: shutdown {report:?}");
    let counters = &report.sinks[0].2;
    assert_eq!(
        counters.written, n as u64,
        "sink {name}: wrote {} of {n} records ({counters:?})",
        counters.written
    );
    assert_eq!(counters.dropped_total(), 0, "sink {name}: {counters:?}");
    let (with, without) = *seen.lock().unwrap_or_else(|e| e.into_inner());
    if wants_payload {
        assert_eq!(
            with, n,
            "sink {name} asked for payloads and got {with} of {n}"
        );
    } else {
        assert_eq!(
            with, 0,
            "sink {name} did not ask for payloads yet got {with}"
        );
        assert_eq!(without, n);
    }

    // 2. A stuck sink: a lossy lane drops beyond its capacity (counted) and never blocks the
    //    publisher; a lossless lane loses nothing while fewer than its capacity wait for room.
    let gate = Gate::closed();
    let bus = Bus::start(vec![Box::new(GatedSink::new(make(), &gate))])
        .expect("a runtime runs the contract");
    let extra = 8.min(capacity);
    let total = capacity + extra;
    let mut receipts = Vec::new();
    for i in 0..total {
        receipts.push(bus.publish(sample_envelope(i)));
    }
    // Let the sink's task take its first record (it then waits at the gate).
    tokio::time::sleep(Duration::from_millis(20)).await;
    let counters = bus.counters().remove(0);
    if delivery.is_lossless() {
        assert_eq!(counters.dropped_total(), 0, "sink {name}: {counters:?}");
    } else {
        let dropped = counters.dropped(DropReason::LaneFull);
        assert!(
            (extra as u64 - 1..=extra as u64).contains(&dropped),
            "sink {name}: a full lossy lane of {capacity} given {total} records dropped {dropped}"
        );
    }
    gate.open();
    for receipt in receipts {
        if receipt.is_pending() {
            receipt
                .wait()
                .await
                .unwrap_or_else(|e| panic!("sink {name}: {e}"));
        }
    }
    let report = bus.shutdown(shutdown).await;
    assert!(report.all_drained(), "sink {name}: shutdown {report:?}");
    let counters = &report.sinks[0].2;
    assert_eq!(
        counters.written + counters.dropped_total(),
        total as u64,
        "sink {name}: every record is written or counted ({counters:?})"
    );
    if delivery.is_lossless() {
        assert_eq!(counters.written, total as u64, "sink {name}: {counters:?}");
    }

    // 3. After shutdown: counted as closed, receipts report the loss, nothing panics.
    let receipt = bus.publish(sample_envelope(0));
    let counters = bus.counters().remove(0);
    assert_eq!(
        counters.dropped(DropReason::Closed),
        1,
        "sink {name}: {counters:?}"
    );
    if receipt.is_pending() {
        assert!(
            receipt.wait().await.is_err(),
            "sink {name}: a lost record acknowledged"
        );
    }

    // 4. An idle sink shuts down at once.
    let bus = Bus::start(vec![Box::new(make())]).expect("a runtime runs the contract");
    let report = bus.shutdown(shutdown).await;
    assert_eq!(
        report.sinks[0].1,
        SinkEnd::Drained,
        "sink {name}: {report:?}"
    );
}
