//! The fan-out of records to sinks: one task and one bounded lane per sink.
//!
//! Publishing never waits. A **lossy** lane takes the record if it has room and otherwise drops
//! it, counted (`lane_full`). A **lossless** lane that is full hands the record to a waiter task
//! that waits up to the lane's timeout for room; the waiters of a lane are bounded too (as many
//! as the lane's capacity), so a storm of records cannot grow memory without limit: beyond that
//! the record is dropped, counted (`overflow`). A lossless lane may **acknowledge**: the
//! publisher's [`Receipt`] resolves only once the sink has written the record (fail-closed
//! audit), and reports an error when the record was lost or the write failed.
//!
//! Actions (controller decisions, admin actions: [`crate::ActionRecord`]) ride the same lanes,
//! in order with the records, to the sinks that take them ([`Sink::takes_actions`]).
//!
//! Shutdown closes every lane and waits, up to a deadline, for each sink to write what its lane
//! holds and to flush.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::task::JoinHandle;

use crate::action::ActionRecord;
use crate::inference::Envelope;

/// How a sink's lane behaves when the sink falls behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// Drop the newest record when the lane is full, counted as `lane_full`.
    Lossy { capacity: usize },
    /// Wait for room, up to `timeout`, off the request path. With `acknowledge`, each
    /// record's receipt resolves only once the sink wrote it.
    Lossless {
        capacity: usize,
        timeout: Duration,
        acknowledge: bool,
    },
}

impl Delivery {
    pub fn capacity(&self) -> usize {
        match *self {
            Delivery::Lossy { capacity } | Delivery::Lossless { capacity, .. } => capacity.max(1),
        }
    }

    pub fn is_lossless(&self) -> bool {
        matches!(self, Delivery::Lossless { .. })
    }

    fn acknowledges(&self) -> bool {
        matches!(
            self,
            Delivery::Lossless {
                acknowledge: true,
                ..
            }
        )
    }
}

/// A sink could not write a record.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct SinkError(pub String);

/// What a sink's `write` and `flush` return.
pub type SinkFuture<'a> = Pin<Box<dyn Future<Output = Result<(), SinkError>> + Send + 'a>>;

/// A consumer of records. The bus runs each sink on its own task and feeds it from its own lane;
/// a sink only writes.
pub trait Sink: Send + 'static {
    /// The `sink` label of its counters.
    fn name(&self) -> &'static str;
    fn delivery(&self) -> Delivery;
    /// Whether the sink receives the full input and output (the audit log does).
    fn wants_payload(&self) -> bool {
        false
    }
    /// Whether the sink needs each request's [`crate::Timeline`] (the trace sink does); records
    /// carry one only when a sink asks.
    fn wants_timeline(&self) -> bool {
        false
    }
    /// Whether the sink receives records of the refusals a sender can repeat at any rate: before
    /// authentication (a missing or invalid key) and past a key's rate limit
    /// ([`crate::InferenceRecord::summarised_refusal`]). A sink whose per-record cost is real
    /// (an fsync'd audit entry, a log line, a span) says no and the server summarises them per
    /// interval instead, so a flood cannot crowd out the records of the requests served.
    fn takes_summarised_refusals(&self) -> bool {
        true
    }
    fn write<'a>(&'a mut self, envelope: &'a Envelope) -> SinkFuture<'a>;
    /// Whether the sink keeps actions (controller decisions, admin actions); those that do
    /// get them through [`Sink::write_action`], in order with the records.
    fn takes_actions(&self) -> bool {
        false
    }
    /// Keeps one action. Called only when [`Sink::takes_actions`].
    fn write_action<'a>(&'a mut self, action: &'a ActionRecord) -> SinkFuture<'a> {
        let _ = action;
        Box::pin(std::future::ready(Ok(())))
    }
    /// The most records the bus hands to [`Sink::write_batch`] at once (1: one at a time).
    fn max_batch(&self) -> usize {
        1
    }
    /// Writes several records as one (a group commit: one fsync for all). It succeeds or fails
    /// as a whole. Called only when [`Sink::max_batch`] is above 1.
    fn write_batch<'a>(&'a mut self, envelopes: &'a [Arc<Envelope>]) -> SinkFuture<'a> {
        Box::pin(async move {
            for e in envelopes {
                self.write(e).await?;
            }
            Ok(())
        })
    }
    /// Called once when the bus shuts down, after the last record.
    fn flush(&mut self) -> SinkFuture<'_> {
        Box::pin(std::future::ready(Ok(())))
    }
}

/// Why a lane lost a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// A lossy lane was full.
    LaneFull,
    /// A lossless lane was full and so many records already waited for room.
    Overflow,
    /// A lossless lane stayed full for its whole timeout.
    Timeout,
    /// The bus was shut down (or the sink's task ended).
    Closed,
    /// The sink's write failed.
    WriteFailed,
}

impl DropReason {
    pub const ALL: [DropReason; 5] = [
        DropReason::LaneFull,
        DropReason::Overflow,
        DropReason::Timeout,
        DropReason::Closed,
        DropReason::WriteFailed,
    ];

    /// The `reason` label.
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::LaneFull => "lane_full",
            DropReason::Overflow => "overflow",
            DropReason::Timeout => "timeout",
            DropReason::Closed => "closed",
            DropReason::WriteFailed => "write_failed",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// An acknowledging sink did not make a record durable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AckError {
    #[error("sink {sink}: the record was lost before it was written")]
    Lost { sink: &'static str },
    #[error("sink {sink}: {message}")]
    Failed { sink: &'static str, message: String },
}

/// The bus could not start.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BusError {
    #[error("the record bus needs a tokio runtime to run its sinks")]
    NoRuntime,
    #[error("two sinks are named {0:?}")]
    DuplicateSink(&'static str),
}

type AckSender = oneshot::Sender<Result<(), AckError>>;

struct Item {
    what: What,
    ack: Option<AckSender>,
}

enum What {
    Record(Arc<Envelope>),
    Action(Arc<ActionRecord>),
    /// Only asks to be acknowledged once everything before it is written.
    Marker,
}

/// What one lane counted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneCounters {
    pub sink: &'static str,
    pub lossless: bool,
    /// Records the sink wrote.
    pub written: u64,
    /// Records lost, by reason (every reason, zeros included).
    pub dropped: Vec<(DropReason, u64)>,
}

impl LaneCounters {
    pub fn dropped(&self, reason: DropReason) -> u64 {
        self.dropped
            .iter()
            .find(|(r, _)| *r == reason)
            .map_or(0, |(_, n)| *n)
    }

    pub fn dropped_total(&self) -> u64 {
        self.dropped.iter().map(|(_, n)| n).sum()
    }
}

struct Lane {
    name: &'static str,
    delivery: Delivery,
    wants_payload: bool,
    takes_summarised_refusals: bool,
    takes_actions: bool,
    /// `None` once the bus shut down.
    sender: RwLock<Option<mpsc::Sender<Item>>>,
    /// Lossless lanes: the waiter tasks allowed at once.
    waiters: Arc<Semaphore>,
    written: AtomicU64,
    dropped: [AtomicU64; 5],
}

impl Lane {
    fn count(&self, reason: DropReason) {
        self.dropped[reason.index()].fetch_add(1, Ordering::Relaxed);
    }

    fn counters(&self) -> LaneCounters {
        LaneCounters {
            sink: self.name,
            lossless: self.delivery.is_lossless(),
            written: self.written.load(Ordering::Relaxed),
            dropped: DropReason::ALL
                .iter()
                .map(|r| (*r, self.dropped[r.index()].load(Ordering::Relaxed)))
                .collect(),
        }
    }
}

/// Resolves when every acknowledging sink has written the record (at once when none asks).
#[derive(Debug, Default)]
#[must_use = "a receipt says whether the record became durable; drop it when nobody waits"]
pub struct Receipt {
    acks: Vec<(&'static str, oneshot::Receiver<Result<(), AckError>>)>,
}

impl Receipt {
    pub fn empty() -> Self {
        Self::default()
    }

    /// Whether some sink will acknowledge.
    pub fn is_pending(&self) -> bool {
        !self.acks.is_empty()
    }

    /// Waits for every acknowledgement; the first failure wins.
    pub async fn wait(self) -> Result<(), AckError> {
        for (sink, ack) in self.acks {
            match ack.await {
                Ok(result) => result?,
                Err(_) => return Err(AckError::Lost { sink }),
            }
        }
        Ok(())
    }
}

/// How one sink ended at shutdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SinkEnd {
    /// Wrote what its lane held and flushed.
    Drained,
    /// Still busy at the deadline; its task was stopped.
    TimedOut,
    /// Its task panicked.
    Panicked,
}

/// The bus's account of a shutdown, one entry per sink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShutdownReport {
    pub sinks: Vec<(&'static str, SinkEnd, LaneCounters)>,
}

impl ShutdownReport {
    pub fn all_drained(&self) -> bool {
        self.sinks
            .iter()
            .all(|(_, end, _)| *end == SinkEnd::Drained)
    }
}

/// The fan-out: records in, one bounded lane per sink out.
pub struct Bus {
    lanes: Vec<Arc<Lane>>,
    tasks: Mutex<Vec<(&'static str, JoinHandle<()>)>>,
    runtime: Option<Handle>,
    wants_payload: bool,
    wants_timeline: bool,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bus")
            .field(
                "sinks",
                &self.lanes.iter().map(|l| l.name).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Bus {
    /// A bus with no sinks: records go nowhere (tools and tests that need no output).
    pub fn disconnected() -> Arc<Self> {
        Arc::new(Self {
            lanes: Vec::new(),
            tasks: Mutex::new(Vec::new()),
            runtime: None,
            wants_payload: false,
            wants_timeline: false,
        })
    }

    /// Starts one task per sink on the current tokio runtime.
    pub fn start(sinks: Vec<Box<dyn Sink>>) -> Result<Arc<Self>, BusError> {
        let runtime = Handle::try_current().map_err(|_| BusError::NoRuntime)?;
        let mut lanes = Vec::with_capacity(sinks.len());
        let mut tasks = Vec::with_capacity(sinks.len());
        let wants_timeline = sinks.iter().any(|s| s.wants_timeline());
        for sink in sinks {
            let name = sink.name();
            if lanes.iter().any(|l: &Arc<Lane>| l.name == name) {
                return Err(BusError::DuplicateSink(name));
            }
            let delivery = sink.delivery();
            let (sender, receiver) = mpsc::channel(delivery.capacity());
            let lane = Arc::new(Lane {
                name,
                delivery,
                wants_payload: sink.wants_payload(),
                takes_summarised_refusals: sink.takes_summarised_refusals(),
                takes_actions: sink.takes_actions(),
                sender: RwLock::new(Some(sender)),
                waiters: Arc::new(Semaphore::new(delivery.capacity())),
                written: AtomicU64::new(0),
                dropped: Default::default(),
            });
            let task = runtime.spawn(run_sink(sink, receiver, Arc::clone(&lane)));
            tasks.push((name, task));
            lanes.push(lane);
        }
        let wants_payload = lanes.iter().any(|l| l.wants_payload);
        Ok(Arc::new(Self {
            lanes,
            tasks: Mutex::new(tasks),
            runtime: Some(runtime),
            wants_payload,
            wants_timeline,
        }))
    }

    /// Whether any sink takes the full input and output.
    pub fn wants_payload(&self) -> bool {
        self.wants_payload
    }

    /// Whether any sink takes each request's timeline.
    pub fn wants_timeline(&self) -> bool {
        self.wants_timeline
    }

    /// Hands the record to every lane without waiting (callable from `Drop` and from threads
    /// outside the runtime). The payload goes only to the lanes that want it.
    pub fn publish(&self, mut envelope: Envelope) -> Receipt {
        let mut receipt = Receipt::empty();
        if self.lanes.is_empty() {
            return receipt;
        }
        let payload = envelope.payload.take().filter(|_| self.wants_payload);
        let summarised = envelope.record.summarised_refusal();
        let bare = Arc::new(envelope);
        let full = payload.map(|p| {
            let mut with = (*bare).clone();
            with.payload = Some(p);
            Arc::new(with)
        });
        for lane in &self.lanes {
            if summarised && !lane.takes_summarised_refusals {
                continue;
            }
            let envelope = match (&full, lane.wants_payload) {
                (Some(full), true) => Arc::clone(full),
                _ => Arc::clone(&bare),
            };
            self.deliver(lane, What::Record(envelope), &mut receipt);
        }
        receipt
    }

    /// Hands an action to every lane whose sink keeps actions, without waiting; the receipt
    /// resolves once the acknowledging sinks (the fail-closed audit log) wrote it.
    pub fn publish_action(&self, action: ActionRecord) -> Receipt {
        let mut receipt = Receipt::empty();
        let action = Arc::new(action);
        for lane in self.lanes.iter().filter(|l| l.takes_actions) {
            self.deliver(lane, What::Action(Arc::clone(&action)), &mut receipt);
        }
        receipt
    }

    /// Offers `what` to `lane`, with an acknowledgement on `receipt` when the lane gives them.
    fn deliver(&self, lane: &Arc<Lane>, what: What, receipt: &mut Receipt) {
        let ack = if lane.delivery.acknowledges() {
            let (tx, rx) = oneshot::channel();
            receipt.acks.push((lane.name, rx));
            Some(tx)
        } else {
            None
        };
        self.offer(lane, Item { what, ack });
    }

    fn offer(&self, lane: &Arc<Lane>, item: Item) {
        let guard = lane.sender.read().unwrap_or_else(|e| e.into_inner());
        let Some(sender) = guard.as_ref() else {
            lane.count(DropReason::Closed);
            return;
        };
        match sender.try_send(item) {
            Ok(()) => {}
            Err(TrySendError::Closed(_)) => lane.count(DropReason::Closed),
            Err(TrySendError::Full(item)) => {
                let Delivery::Lossless { timeout, .. } = lane.delivery else {
                    lane.count(DropReason::LaneFull);
                    return;
                };
                let (Some(runtime), Ok(permit)) = (
                    self.runtime.as_ref(),
                    Arc::clone(&lane.waiters).try_acquire_owned(),
                ) else {
                    lane.count(DropReason::Overflow);
                    return;
                };
                let sender = sender.clone();
                let lane = Arc::clone(lane);
                runtime.spawn(async move {
                    match tokio::time::timeout(timeout, sender.send(item)).await {
                        Ok(Ok(())) => {}
                        Ok(Err(_)) => lane.count(DropReason::Closed),
                        Err(_) => lane.count(DropReason::Timeout),
                    }
                    drop(permit);
                });
            }
        }
    }

    /// Waits until `sink` has written every record published before this call, up to
    /// `timeout` (read-your-writes for a scrape of the metrics). Returns whether it caught up; a
    /// full lossy lane, a closed bus or an unknown sink return `false` at once.
    pub async fn caught_up(&self, sink: &str, timeout: Duration) -> bool {
        let Some(lane) = self.lanes.iter().find(|l| l.name == sink) else {
            return false;
        };
        let (tx, rx) = oneshot::channel();
        let sent = {
            let guard = lane.sender.read().unwrap_or_else(|e| e.into_inner());
            guard.as_ref().is_some_and(|sender| {
                sender
                    .try_send(Item {
                        what: What::Marker,
                        ack: Some(tx),
                    })
                    .is_ok()
            })
        };
        sent && matches!(tokio::time::timeout(timeout, rx).await, Ok(Ok(Ok(()))))
    }

    /// Records waiting in `sink`'s lane now (0 for an unknown or closed sink).
    pub fn depth(&self, sink: &str) -> usize {
        let Some(lane) = self.lanes.iter().find(|l| l.name == sink) else {
            return 0;
        };
        let guard = lane.sender.read().unwrap_or_else(|e| e.into_inner());
        guard
            .as_ref()
            .map_or(0, |s| s.max_capacity().saturating_sub(s.capacity()))
    }

    /// What every lane counted so far.
    pub fn counters(&self) -> Vec<LaneCounters> {
        self.lanes.iter().map(|l| l.counters()).collect()
    }

    /// Closes every lane and waits until `deadline` for each sink to write what its lane holds
    /// and flush; a sink still busy then is stopped. Records published afterwards are counted
    /// as `closed`.
    pub async fn shutdown(&self, timeout: Duration) -> ShutdownReport {
        for lane in &self.lanes {
            lane.sender
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .take();
        }
        let tasks = std::mem::take(&mut *self.tasks.lock().unwrap_or_else(|e| e.into_inner()));
        let deadline = tokio::time::Instant::now() + timeout;
        let mut ends = Vec::with_capacity(tasks.len());
        for (name, mut task) in tasks {
            let end = match tokio::time::timeout_at(deadline, &mut task).await {
                Ok(Ok(())) => SinkEnd::Drained,
                Ok(Err(_)) => SinkEnd::Panicked,
                Err(_) => {
                    task.abort();
                    SinkEnd::TimedOut
                }
            };
            ends.push((name, end));
        }
        ShutdownReport {
            sinks: ends
                .into_iter()
                .map(|(name, end)| {
                    let counters = self
                        .lanes
                        .iter()
                        .find(|l| l.name == name)
                        .map(|l| l.counters())
                        .unwrap_or(LaneCounters {
                            sink: name,
                            lossless: false,
                            written: 0,
                            dropped: Vec::new(),
                        });
                    (name, end, counters)
                })
                .collect(),
        }
    }
}

/// A sink's task: write each record of its lane (in batches when the sink takes them),
/// acknowledge, flush when the lane closes.
async fn run_sink(mut sink: Box<dyn Sink>, mut lane_rx: mpsc::Receiver<Item>, lane: Arc<Lane>) {
    let max_batch = sink.max_batch().max(1);
    let mut items: Vec<Item> = Vec::new();
    while let Some(first) = lane_rx.recv().await {
        items.push(first);
        while items.len() < max_batch {
            match lane_rx.try_recv() {
                Ok(item) => items.push(item),
                Err(_) => break,
            }
        }
        if max_batch == 1 {
            for item in items.drain(..) {
                write_one(sink.as_mut(), item, &lane).await;
            }
        } else {
            write_many(sink.as_mut(), &mut items, &lane).await;
        }
    }
    if let Err(e) = sink.flush().await {
        tracing::warn!(sink = lane.name, error = %e, "record sink failed to flush");
    }
}

async fn write_one(sink: &mut dyn Sink, item: Item, lane: &Lane) {
    match &item.what {
        What::Record(envelope) => {
            let result = sink.write(envelope).await;
            settle_item(lane, item.ack, &item.what, result.as_ref().err(), true);
        }
        What::Action(action) => {
            let result = sink.write_action(action).await;
            settle_item(lane, item.ack, &item.what, result.as_ref().err(), true);
        }
        What::Marker => {
            if let Some(ack) = item.ack {
                let _ = ack.send(Ok(()));
            }
        }
    }
}

/// Writes the records of `items` in batches, then answers every item in order; an action
/// between them is written on its own, after the records before it.
async fn write_many(sink: &mut dyn Sink, items: &mut Vec<Item>, lane: &Lane) {
    while !items.is_empty() {
        let run = items
            .iter()
            .take_while(|i| matches!(i.what, What::Record(_) | What::Marker))
            .count();
        if run == 0 {
            let action = items.remove(0);
            write_one(sink, action, lane).await;
        } else {
            let batch: Vec<Item> = items.drain(..run).collect();
            write_records(sink, batch, lane).await;
        }
    }
}

/// Writes a run of records (and markers) as one batch, then answers each in order.
async fn write_records(sink: &mut dyn Sink, items: Vec<Item>, lane: &Lane) {
    let envelopes: Vec<Arc<Envelope>> = items
        .iter()
        .filter_map(|i| match &i.what {
            What::Record(e) => Some(Arc::clone(e)),
            _ => None,
        })
        .collect();
    let result = if envelopes.is_empty() {
        Ok(())
    } else {
        sink.write_batch(&envelopes).await
    };
    if let Err(e) = &result {
        tracing::warn!(sink = lane.name, error = %e, records = envelopes.len(), "record sink failed to write a batch");
    }
    for item in items {
        match item.what {
            What::Marker => {
                if let Some(ack) = item.ack {
                    let _ = ack.send(Ok(()));
                }
            }
            _ => settle_item(lane, item.ack, &item.what, result.as_ref().err(), false),
        }
    }
}

/// Counts one record's outcome and answers its acknowledgement; `log_each` logs a failure per
/// record (batches log once).
fn settle_item(
    lane: &Lane,
    ack: Option<AckSender>,
    what: &What,
    error: Option<&SinkError>,
    log_each: bool,
) {
    match error {
        None => {
            lane.written.fetch_add(1, Ordering::Relaxed);
            if let Some(ack) = ack {
                let _ = ack.send(Ok(()));
            }
        }
        Some(e) => {
            lane.count(DropReason::WriteFailed);
            if log_each {
                match what {
                    What::Record(envelope) => {
                        tracing::warn!(sink = lane.name, error = %e, request_id = %envelope.record.request_id, "record sink failed to write a record")
                    }
                    What::Action(action) => {
                        tracing::warn!(sink = lane.name, error = %e, action = %action.action.name, "record sink failed to write an action")
                    }
                    What::Marker => {}
                }
            }
            if let Some(ack) = ack {
                let _ = ack.send(Err(AckError::Failed {
                    sink: lane.name,
                    message: e.0.clone(),
                }));
            }
        }
    }
}
