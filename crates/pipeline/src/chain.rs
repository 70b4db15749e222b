//! The backend chain: the model asked for, then its declared fallbacks (another model or
//! version, the same tensor model on the other runtime, a rules model, a canned answer), each
//! behind its circuit breaker, each step taking only the triggers it lists.
//!
//! One attempt is: readiness → breaker (refuses at once when open) → injected faults → the
//! backend's admission → `start` under the first-token deadline → for a generation, the events
//! up to the **commit point**: the first content token of a stream, the whole answer of a
//! non-streaming request. Until that point a failure moves to the next step and the client
//! sees nothing of it; after it (a stream that already sent text) a failure or a stall ends
//! the stream with a typed error event. Every attempt reports its outcome to its own breaker
//! (a failure inside the chain counts, a client error or a cancelled request does not), and is
//! written into the record's `attempts`. A KServe request [`reserve`]s its primary's slot before
//! it decodes its tensors; its primary attempt then runs in that slot.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures_util::stream::{self, BoxStream, Stream, StreamExt};
use record::{Attempt, RecordBuilder};
use tokio::time::Sleep;
use tracing::Instrument;

use crate::admission::Slot;
use crate::backend::{Answer, BackendError, FailureClass, Generated, Generation, Work};
use crate::breaker::{Outcome, Pass};
use crate::error::ApiError;
use crate::faults::Faults;
use crate::faults::Strike;
use crate::handoff::Handoffs;
use crate::registry::Entry;
use crate::registry::Registry;

pub use crate::policy::{FallbackStep, Policy, Step, Target, Trigger};

/// How a degraded answer was reached: what the `x-rampart-fallback` header and the record say.
#[derive(Debug, Clone, PartialEq)]
pub struct Fallback {
    /// 1: another backend; 2: a canned answer.
    pub level: u8,
    pub backend: String,
    pub reason: Trigger,
}

impl Fallback {
    /// The header's value: `level=N; backend=…; reason=…`.
    pub fn header(&self) -> String {
        format!(
            "level={}; backend={}; reason={}",
            self.level,
            self.backend,
            self.reason.as_str()
        )
    }
}

/// The header that marks a degraded response.
pub const FALLBACK_HEADER: &str = "x-rampart-fallback";

/// What the chain reads of the server's pipeline: the registry (for the steps that name
/// another model), the hand-offs (every fallback counts toward its model's), and the faults
/// injected for drills.
#[derive(Debug, Clone, Copy)]
pub struct Parts<'a> {
    pub registry: &'a Registry,
    pub handoffs: &'a Handoffs,
    pub faults: &'a Faults,
}

/// What the chain answered with.
pub struct Answered {
    pub entry: Arc<Entry>,
    pub answer: Answer,
    pub slot: Slot,
    pub fallback: Option<Fallback>,
}

/// Why an attempt did not answer.
enum Miss {
    /// The request is wrong: no other backend would do better.
    Client(ApiError),
    /// A trigger: the next step that takes it is tried.
    Trigger {
        trigger: Trigger,
        error: ApiError,
        detail: String,
    },
}

fn miss(trigger: Trigger, error: ApiError) -> Miss {
    Miss::Trigger {
        detail: error.to_string(),
        trigger,
        error,
    }
}

/// The fallback level of an answering backend.
fn level_of(entry: &Entry) -> u8 {
    if entry.kind() == crate::backend::Kind::Canned {
        2
    } else {
        1
    }
}

/// The primary's admission, taken before the request's costly decode ([`reserve`]), and when
/// the taking began: the primary's attempt counts from there, its decode run in its place.
#[derive(Debug, Default)]
pub struct Reservation(Option<(Instant, Result<Slot, ApiError>)>);

/// Takes `primary`'s admission slot ahead of the chain, for a request whose decode is the
/// costly part (a KServe tensor body): it then decodes in its place in flight, as a generation
/// tokenizes in its own. Nothing is taken when the primary would not be tried (not ready,
/// circuit open): the chain then runs as usual. A full queue refuses here, before the decode,
/// with the attempt written as the chain writes it; only a model whose chain has steps gets
/// the refusal carried to the chain instead, so that its steps still answer (that request then
/// decodes without a slot of its own, as before).
pub async fn reserve(
    primary: &Arc<Entry>,
    record: &mut RecordBuilder,
) -> Result<Reservation, ApiError> {
    if !primary.is_ready() || primary.breaker.state() == crate::breaker::State::Open {
        return Ok(Reservation(None));
    }
    let began = Instant::now();
    match primary.admission.acquire().await {
        Ok(slot) => Ok(Reservation(Some((began, Ok(slot))))),
        Err(e) if !primary.policy.steps.is_empty() => Ok(Reservation(Some((began, Err(e))))),
        Err(e) => {
            record.refuse(admission_refusal(&e));
            note_attempt(
                record,
                primary.id.clone(),
                Trigger::Overloaded.as_str(),
                Some(e.to_string()),
                began,
            );
            Err(e)
        }
    }
}

/// The record's refusal reason for an admission error.
fn admission_refusal(e: &ApiError) -> &'static str {
    match e {
        ApiError::Overloaded { code, .. } => code,
        _ => "queue_timeout",
    }
}

/// Runs `work` through `primary` and, when it fails, its chain.
pub async fn run(
    parts: Parts<'_>,
    primary: Arc<Entry>,
    work: Work,
    record: &mut RecordBuilder,
) -> Result<Answered, ApiError> {
    run_reserved(parts, primary, Reservation::default(), work, record).await
}

/// [`run`], the primary's attempt in the slot [`reserve`] took.
pub async fn run_reserved(
    parts: Parts<'_>,
    primary: Arc<Entry>,
    reservation: Reservation,
    work: Work,
    record: &mut RecordBuilder,
) -> Result<Answered, ApiError> {
    let streaming = matches!(&work, Work::Generate(plan) if plan.stream);
    let chain_of = Arc::clone(&primary);
    let steps = &chain_of.policy.steps;
    // The work is cloned for the primary only when a step may need it after.
    let (first, rest) = if steps.is_empty() {
        (work, None)
    } else {
        (work.clone(), Some(work))
    };
    let (left_because, primary_error) =
        match attempt(parts, &primary, first, streaming, reservation, record).await {
            Ok((answer, slot)) => {
                return Ok(Answered {
                    entry: primary,
                    answer,
                    slot,
                    fallback: None,
                })
            }
            Err(Miss::Client(e)) => return Err(e),
            Err(Miss::Trigger { trigger, error, .. }) => (trigger, error),
        };
    // No chain: the primary's error is the answer.
    let Some(work) = rest else {
        return Err(primary_error);
    };
    parts.handoffs.get(&primary.name).note_fallback();
    // `left_because` (why the request left the model asked for) is what the header, the record
    // and the metric say; `trigger` is what the next step must take. When every step fails, the
    // client hears the primary's error (each later step's failure is in the record's attempts).
    let mut trigger = left_because;
    for step in steps {
        let began = Instant::now();
        if !step.on.contains(&trigger) {
            note_attempt(
                record,
                step.target.describe(),
                "skipped",
                Some(format!("the step does not take {}", trigger.as_str())),
                began,
            );
            continue;
        }
        let entry = match &step.target {
            Target::Own(e) => Some(Arc::clone(e)),
            Target::Model(m) => parts.registry.find(m),
        };
        let Some(entry) = entry else {
            note_attempt(
                record,
                step.target.describe(),
                "not_ready",
                Some("not loaded".into()),
                began,
            );
            trigger = Trigger::NotReady;
            continue;
        };
        if !entry.backend.accepts(work.kind()) {
            note_attempt(
                record,
                entry.id.clone(),
                "skipped",
                Some(format!("it does not take {} work", work.kind().as_str())),
                began,
            );
            continue;
        }
        let level = level_of(&entry);
        let step_work = set_fallback_level(work.clone(), level);
        match attempt(
            parts,
            &entry,
            step_work,
            streaming,
            Reservation::default(),
            record,
        )
        .await
        {
            Ok((answer, slot)) => {
                let fallback = Fallback {
                    level,
                    backend: entry.id.clone(),
                    reason: left_because,
                };
                let r = &mut record.record;
                r.fallback_level = fallback.level;
                r.fallback_backend = Some(fallback.backend.clone());
                r.fallback_reason = Some(left_because.as_str());
                record.set_entropy_band(entry.backend.entropy_band());
                tracing::warn!(
                    model = %primary.id,
                    to = %entry.id,
                    level = fallback.level,
                    reason = left_because.as_str(),
                    step_trigger = trigger.as_str(),
                    "request fell back"
                );
                return Ok(Answered {
                    entry,
                    answer,
                    slot,
                    fallback: Some(fallback),
                });
            }
            Err(Miss::Client(e)) => return Err(e),
            Err(Miss::Trigger { trigger: next, .. }) => trigger = next,
        }
    }
    tracing::error!(
        model = %primary.id,
        reason = left_because.as_str(),
        error = %primary_error,
        "every step of the fallback chain failed"
    );
    Err(primary_error)
}

/// Who the work is for, in the admission queue's fair order: a generation's claim (its
/// tenant and weight, `engine::Claim`); other work is anonymous.
fn who_of(work: &Work) -> crate::admission::Who {
    match work {
        Work::Generate(plan) => plan
            .request
            .claim
            .map_or(crate::admission::Who::ANONYMOUS, |c| {
                crate::admission::Who {
                    tenant: c.tenant,
                    weight: c.weight,
                }
            }),
        _ => crate::admission::Who::ANONYMOUS,
    }
}

/// Tells the work it runs as a fallback (a rules model then answers only when a rule matched).
fn set_fallback_level(mut work: Work, level: u8) -> Work {
    match &mut work {
        Work::Generate(plan) => plan.fallback_level = level,
        Work::Tensors(request) => request.fallback_level = level,
        Work::Embed(_) => {}
    }
    work
}

fn note_attempt(
    record: &mut RecordBuilder,
    backend: String,
    outcome: &'static str,
    detail: Option<String>,
    began: Instant,
) {
    let ended = Instant::now();
    record.record.attempts.push(Attempt {
        backend,
        outcome,
        detail,
        ms: ended.duration_since(began).as_secs_f64() * 1e3,
    });
    // The trace's `attempt` span: the i-th such stage is the i-th attempt.
    record.stage("attempt", began, ended);
}

/// A call that passed the breaker: reports its outcome exactly once (a call dropped without an
/// outcome — the client went away — says nothing about the backend).
struct Call {
    entry: Arc<Entry>,
    pass: Option<Pass>,
    started: Instant,
}

impl Call {
    fn report(&mut self, outcome: Outcome) {
        if let Some(pass) = self.pass.take() {
            self.entry.breaker.finish(pass, outcome);
        }
    }

    fn failed(&mut self) {
        self.report(Outcome::Failure);
    }

    fn succeeded(&mut self, took: Duration) {
        self.report(Outcome::Success { took });
    }

    fn neutral(&mut self) {
        self.report(Outcome::Cancelled);
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        self.report(Outcome::Cancelled);
    }
}

/// One backend's try at the work.
async fn attempt(
    parts: Parts<'_>,
    entry: &Arc<Entry>,
    work: Work,
    streaming: bool,
    reservation: Reservation,
    record: &mut RecordBuilder,
) -> Result<(Answer, Slot), Miss> {
    let began = reservation
        .0
        .as_ref()
        .map_or_else(Instant::now, |(began, _)| *began);
    let result = try_backend(parts, entry, work, streaming, reservation, record)
        .instrument(tracing::debug_span!("attempt", backend = %entry.id))
        .await;
    let (outcome, detail) = match &result {
        Ok(_) => ("answered", None),
        Err(Miss::Client(e)) => ("client_error", Some(e.to_string())),
        Err(Miss::Trigger {
            trigger, detail, ..
        }) => (trigger.as_str(), Some(detail.clone())),
    };
    note_attempt(record, entry.id.clone(), outcome, detail, began);
    result
}

async fn try_backend(
    parts: Parts<'_>,
    entry: &Arc<Entry>,
    work: Work,
    streaming: bool,
    reservation: Reservation,
    record: &mut RecordBuilder,
) -> Result<(Answer, Slot), Miss> {
    if !entry.is_ready() {
        return Err(miss(
            Trigger::NotReady,
            ApiError::Unavailable {
                message: format!("{} is not ready", entry.id),
                retry_after_s: 5,
            },
        ));
    }
    let pass = entry.breaker.try_pass().map_err(|refused| {
        miss(
            Trigger::CircuitOpen,
            ApiError::Unavailable {
                message: format!(
                    "the circuit of {} is open after repeated failures",
                    entry.id
                ),
                retry_after_s: refused.retry_in.as_secs().max(1),
            },
        )
    })?;
    let mut call = Call {
        entry: Arc::clone(entry),
        pass: Some(pass),
        started: Instant::now(),
    };
    let strike = parts.faults.strike(&entry.id);
    if let Some(s @ Strike::Fail) = strike {
        call.failed();
        return Err(Miss::Trigger {
            trigger: Trigger::Error,
            error: ApiError::Internal(format!("{} failed ({})", entry.id, s.describe())),
            detail: s.describe(),
        });
    }
    let admitted = match reservation.0 {
        Some((_, reserved)) => reserved,
        None => entry.admission.acquire_as(who_of(&work)).await,
    };
    let slot = match admitted {
        Ok(slot) => slot,
        Err(e) => {
            // A full queue says nothing about the backend's health.
            call.neutral();
            record.refuse(admission_refusal(&e));
            return Err(miss(Trigger::Overloaded, e));
        }
    };
    // What an earlier attempt's backend wrote of its own (tokens, its constraint, confidences)
    // is not this backend's.
    // The slot's own times: a reserved one was granted before this attempt's decode.
    record.stage(
        "admission",
        slot.admitted
            .checked_sub(slot.queued)
            .unwrap_or(slot.admitted),
        slot.admitted,
    );
    let r = &mut record.record;
    r.refusal = None;
    r.queue_ms = slot.queued.as_secs_f64() * 1e3;
    if !r.attempts.is_empty() {
        r.prompt_tokens = 0;
        r.structured = None;
        r.confidence = None;
        r.confidence_min = None;
        r.items = 0;
        r.compute_ms = 0.0;
    }
    let policy = &entry.policy;
    let deadline = tokio::time::Instant::now() + policy.first_token_timeout;
    let start = async {
        if let Some(Strike::Hang { until }) = strike {
            tokio::time::sleep_until(until.into()).await;
        }
        let began = Instant::now();
        let answer = entry.backend.start(work, record).await;
        if let Some(Strike::Slow { factor }) = strike {
            tokio::time::sleep(began.elapsed().mul_f64(factor - 1.0)).await;
        }
        answer
    };
    let answer = match tokio::time::timeout_at(deadline, start).await {
        Err(_) => {
            call.failed();
            return Err(first_token_miss(entry, "answer"));
        }
        Ok(Err(e)) => {
            if let BackendError::Overloaded { code, .. } = &e {
                // The backend's own queue or its first-token gate refused it before any
                // compute: a refusal like the admission's, counted by its reason.
                record.refuse(code);
            }
            return Err(backend_miss(&mut call, e));
        }
        Ok(Ok(answer)) => answer,
    };
    let Answer::Generation(g) = answer else {
        call.succeeded(call.started.elapsed());
        return Ok((answer, slot));
    };
    let g = with_fault(g, strike);
    match commit(g, deadline, streaming, entry, record).await {
        Ok((g, first_token, complete)) => {
            let g = if complete {
                call.succeeded(first_token);
                g
            } else {
                Generation {
                    events: Watched::new(
                        g.events,
                        g.choices,
                        policy.stall_timeout,
                        call,
                        first_token,
                    )
                    .boxed(),
                    ..g
                }
            };
            Ok((Answer::Generation(g), slot))
        }
        Err(m) => {
            match &m {
                // Refused before its first token and before any compute of its own (the
                // engine shed it at saturation): the backend is not at fault.
                Miss::Trigger {
                    trigger: Trigger::Overloaded,
                    ..
                } => call.neutral(),
                _ => call.failed(),
            }
            Err(m)
        }
    }
}

/// The miss of a backend that gave no first token (or answer) by its deadline.
fn first_token_miss(entry: &Entry, what: &str) -> Miss {
    miss(
        Trigger::FirstTokenTimeout,
        ApiError::Unavailable {
            message: format!(
                "{} gave no {what} within {} ms",
                entry.id,
                entry.policy.first_token_timeout.as_millis()
            ),
            retry_after_s: 1,
        },
    )
}

/// A backend's refusal or failure, as a miss (reported to its breaker by its class).
fn backend_miss(call: &mut Call, e: BackendError) -> Miss {
    match e.class() {
        FailureClass::Client => {
            call.neutral();
            match e {
                BackendError::ContextLength(_) => miss(Trigger::ContextLength, e.into()),
                e => Miss::Client(e.into()),
            }
        }
        FailureClass::Overload | FailureClass::Timeout => {
            call.neutral();
            miss(Trigger::Overloaded, e.into())
        }
        FailureClass::Unavailable => {
            call.failed();
            miss(Trigger::NotReady, e.into())
        }
        FailureClass::Failure => {
            call.failed();
            miss(Trigger::Error, e.into())
        }
        FailureClass::NoMatch => {
            call.succeeded(call.started.elapsed());
            miss(Trigger::Error, e.into())
        }
    }
}

/// Holds a generation's events until its commit point. Returns the generation with the held
/// events first, the time to the first content token, and whether it already finished.
async fn commit(
    mut g: Generation,
    deadline: tokio::time::Instant,
    streaming: bool,
    entry: &Entry,
    record: &mut RecordBuilder,
) -> Result<(Generation, Duration, bool), Miss> {
    let (stall, backend) = (entry.policy.stall_timeout, &entry.id);
    let began = Instant::now();
    let mut held: Vec<(usize, Generated)> = Vec::new();
    let mut finished = 0;
    let mut first_token: Option<Duration> = None;
    loop {
        let until = match first_token {
            None => deadline,
            Some(_) => tokio::time::Instant::now() + stall,
        };
        let event = match tokio::time::timeout_at(until, g.events.next()).await {
            Err(_) if first_token.is_none() => return Err(first_token_miss(entry, "first token")),
            Err(_) => {
                return Err(miss(
                    Trigger::StallTimeout,
                    ApiError::Unavailable {
                        message: format!(
                            "{backend} stalled: no token for {} ms",
                            stall.as_millis()
                        ),
                        retry_after_s: 1,
                    },
                ))
            }
            Ok(None) => {
                return Err(miss(
                    Trigger::Error,
                    ApiError::Unavailable {
                        message: format!("{backend} stopped before the answer was complete"),
                        retry_after_s: 5,
                    },
                ))
            }
            Ok(Some(event)) => event,
        };
        match &event.1 {
            Generated::Failed(e) => {
                if let BackendError::Overloaded { code, .. } = e {
                    // Shed before it started (memory saturated): a refusal like the
                    // admission's, counted by its reason.
                    record.refuse(code);
                }
                let error: ApiError = e.clone().into();
                let trigger = match e.class() {
                    FailureClass::Timeout => Trigger::StallTimeout,
                    FailureClass::Overload => Trigger::Overloaded,
                    _ => Trigger::Error,
                };
                return Err(miss(trigger, error));
            }
            Generated::Token(t) if !t.text.is_empty() => {
                first_token.get_or_insert_with(|| began.elapsed());
            }
            Generated::Finished(_) => {
                first_token.get_or_insert_with(|| began.elapsed());
                finished += 1;
            }
            Generated::Token(_) => {}
        }
        held.push(event);
        let complete = finished >= g.choices;
        if complete || (streaming && first_token.is_some()) {
            let first_token = first_token.unwrap_or_default();
            let rest = if complete {
                stream::empty().boxed()
            } else {
                std::mem::replace(&mut g.events, stream::empty().boxed())
            };
            g.events = stream::iter(held).chain(rest).boxed();
            return Ok((g, first_token, complete));
        }
    }
}

/// An injected stall or slow-down applied to a generation's events.
fn with_fault(g: Generation, strike: Option<Strike>) -> Generation {
    match strike {
        Some(Strike::Stall {
            after_tokens,
            until,
        }) => {
            let mut tokens = 0;
            let events = g
                .events
                .then(move |event| {
                    if matches!(event.1, Generated::Token(_)) {
                        tokens += 1;
                    }
                    let stall = tokens > after_tokens;
                    async move {
                        if stall {
                            tokio::time::sleep_until(until.into()).await;
                        }
                        event
                    }
                })
                .boxed();
            Generation { events, ..g }
        }
        Some(Strike::Slow { factor }) => {
            // Each event is released at `factor` times its real time since the start. The
            // real times are taken by a task that reads the backend's stream as fast as it
            // produces (an engine runs ahead of a slow reader, so timing the events as they are
            // read would slow only the first one); dropping the stream ends the task and the
            // backend's stream with it.
            let started = Instant::now();
            let (tx, rx) = tokio::sync::mpsc::channel(4096);
            let mut inner = g.events;
            tokio::spawn(async move {
                while let Some(event) = inner.next().await {
                    if tx.send((Instant::now(), event)).await.is_err() {
                        break;
                    }
                }
            });
            let events = tokio_stream::wrappers::ReceiverStream::new(rx)
                .then(move |(arrived, mut event)| {
                    let due = started + arrived.duration_since(started).mul_f64(factor);
                    // The engine's own account reads as slow as the client sees it, as a
                    // slower model's would (the judge's TPOT comes from it).
                    if let Generated::Finished(f) = &mut event.1 {
                        f.queue_seconds *= factor;
                        f.prefill_seconds *= factor;
                        f.decode_seconds *= factor;
                    }
                    async move {
                        tokio::time::sleep_until(due.into()).await;
                        event
                    }
                })
                .boxed();
            Generation { events, ..g }
        }
        _ => g,
    }
}

/// A committed generation's events, watched: a gap longer than the stall timeout ends it with
/// a typed error, and its end reports the call's outcome to the breaker.
struct Watched {
    inner: BoxStream<'static, (usize, Generated)>,
    stall: Duration,
    timer: Pin<Box<Sleep>>,
    call: Call,
    choices: usize,
    finished: usize,
    first_token: Duration,
    done: bool,
}

impl Watched {
    fn new(
        inner: BoxStream<'static, (usize, Generated)>,
        choices: usize,
        stall: Duration,
        call: Call,
        first_token: Duration,
    ) -> Self {
        Self {
            inner,
            stall,
            timer: Box::pin(tokio::time::sleep(stall)),
            call,
            choices,
            finished: 0,
            first_token,
            done: false,
        }
    }
}

impl Stream for Watched {
    type Item = (usize, Generated);

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        match this.inner.poll_next_unpin(cx) {
            Poll::Ready(Some((i, event))) => {
                let deadline = tokio::time::Instant::now() + this.stall;
                this.timer.as_mut().reset(deadline);
                match &event {
                    Generated::Finished(_) => {
                        this.finished += 1;
                        if this.finished >= this.choices {
                            this.call.succeeded(this.first_token);
                        }
                    }
                    Generated::Failed(_) => {
                        this.call.failed();
                        this.done = true;
                    }
                    Generated::Token(_) => {}
                }
                Poll::Ready(Some((i, event)))
            }
            Poll::Ready(None) => {
                if this.finished < this.choices {
                    this.call.failed();
                }
                this.done = true;
                Poll::Ready(None)
            }
            Poll::Pending => {
                if std::future::Future::poll(this.timer.as_mut(), cx).is_ready() {
                    this.call.failed();
                    this.done = true;
                    let backend = this.call.entry.id.clone();
                    return Poll::Ready(Some((
                        0,
                        Generated::Failed(BackendError::Timeout {
                            message: format!(
                                "{backend} stalled: no token for {} ms; the answer is incomplete",
                                this.stall.as_millis()
                            ),
                            retry_after_s: 1,
                        }),
                    )));
                }
                Poll::Pending
            }
        }
    }
}
