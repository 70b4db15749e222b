//! The front: the one pipeline every protocol calls once it has decoded its wire format.
//!
//! drain check → rate limit → locate (on-demand load, route) → guard → hand-off → backend
//! chain (each step: breaker, admission, backend; see [`crate::chain`]) → the protocol's encoder
//! drives the answer through [`crate::finish`]. The key's rate limit comes before anything that
//! costs (an on-demand load at the route, the guard's rules and classifier, a tensor decode), so
//! a key past its limit burns no CPU. Each protocol's handler is decode → [`serve`] → finish →
//! encode; the KServe bindings, whose decode is the costly part, [`locate`] from the URL (or the
//! message) first, [`reserve`] (drain, hand-off, rate limit, the model's admission slot), then
//! decode in that slot and go on with [`serve_tensors`]. Nothing below this line knows the
//! protocol, nothing above it knows the model. The record of the request is filled on the way
//! (model, version, digest, queue time, the refusal and its reason, the attempts and the
//! fallback that answered) and settled once by [`settle`].
//!
//! The guard ([`crate::guard_service`]: injection rules and classifier) judges every generation
//! after the route (its policy and the model's control tokens are the model's) and before
//! anything else; the release plans' routing (canary, A/B, shadow) happens at the route through
//! [`Releases`], which the server implements over its plans.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use record::{Bus, Receipt, RecordBuilder};
use tracing::Instrument;

use crate::backend::{Answer, Work, WorkKind};
use crate::chain::{self, Fallback};
use crate::decisions::Decisions;
use crate::error::ApiError;
use crate::faults::{Faults, FaultsConfig};
pub use crate::finish::Ticket;
use crate::guard_service::{self as screen, GuardService, GuardSetup, Screened};
use crate::handoff::Handoffs;
use crate::rate_limit::{RateLimit, RateLimitedTally, RateLimiter};
use crate::registry::{Entry, ModelName, Registry};

/// A release plan's choice of version for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routed {
    pub version: String,
    pub variant: release::plan::Variant,
    pub why: &'static str,
    /// Shadow mode: the candidate version the request is mirrored to.
    pub shadow: Option<String>,
}

/// Where a shadowed request is mirrored: the candidate version, and the control (the stable's
/// second copy) when the plan compares with it.
#[derive(Debug, Clone)]
pub struct Mirror {
    pub candidate: String,
    pub control: Option<Arc<Entry>>,
}

/// The release plans' part in the pipeline: the route of a model named without a version, the
/// control entry, the shadow mirror, and what the mirrors agreed on (the server's releases
/// implement it over their plans and judges).
pub trait Releases: Send + Sync {
    /// The plan's choice for `model` (none: no plan under way).
    fn route(&self, model: &str, key: &release::router::RoutingKey<'_>) -> Option<Routed>;
    /// Whether `model` has a release plan.
    fn has_plan(&self, model: &str) -> bool;
    /// The control of `model`'s release, once loaded.
    fn control(&self, model: &str) -> Option<Arc<Entry>>;
    /// Where request `request_id` to `model` is mirrored, if its plan mirrors it.
    fn mirror(&self, model: &str, request_id: &str) -> Option<Mirror>;
    /// Whether the candidate's answer to a mirrored request agreed with the control's (none:
    /// one of them failed).
    fn agreement(&self, model: &str, agreed: Option<bool>);
}

/// What [`OnDemand::before_route`] returns.
pub type LoadFuture<'a> = Pin<Box<dyn Future<Output = Result<(), ApiError>> + Send + 'a>>;

/// Models loaded on their first request (`residency = "cold"`): the server's residency
/// implements it.
pub trait OnDemand: Send + Sync {
    /// Loads `model` before its route when it is not loaded and loads on request.
    fn before_route<'a>(
        &'a self,
        model: &'a ModelName,
        record: &'a mut RecordBuilder,
    ) -> LoadFuture<'a>;
}

/// The audit log's say on the path: in `fail_closed`, nothing is served while it cannot
/// persist.
pub trait AuditGate: Send + Sync {
    /// The refusal while the audit log cannot persist.
    fn refusal(&self) -> Option<ApiError>;
}

/// What the front is built from.
#[derive(Debug, Clone, Default)]
pub struct FrontSetup {
    /// `[rate_limit]`.
    pub rate_limit: RateLimit,
    /// `[handoff]`, and the models' own by name.
    pub handoff: crate::handoff::HandoffConfig,
    pub model_handoffs: std::collections::HashMap<String, crate::handoff::HandoffConfig>,
    /// `[faults]`.
    pub faults: FaultsConfig,
    /// What the guard service is made from (the seed rules until one is loaded).
    pub guard: GuardSetup,
    /// `[tracing] token_events`: the share of tokens a traced request's timeline notes.
    pub token_events: f64,
}

/// The pipeline's shared parts: everything a request meets between its protocol's decode and
/// its encode. One per process; the protocols hold it.
pub struct Front {
    /// Every served model, whatever its kind.
    pub registry: Registry,
    pub rate_limiter: Arc<RateLimiter>,
    /// Requests of valid keys refused past their rate limit, summarised per interval.
    pub rate_limited: Arc<RateLimitedTally>,
    /// Each model's hand-off to people (level 3).
    pub handoffs: Handoffs,
    /// Faults injected for drills.
    pub faults: Faults,
    /// Where every request's record and every decision goes.
    pub bus: Arc<Bus>,
    /// The controllers' decisions, on [`Front::bus`].
    pub decisions: Decisions,
    draining: AtomicBool,
    guard: OnceLock<Arc<GuardService>>,
    guard_setup: GuardSetup,
    releases: OnceLock<Arc<dyn Releases>>,
    on_demand: OnceLock<Arc<dyn OnDemand>>,
    audit: Option<Arc<dyn AuditGate>>,
    /// The GPUs' mean utilization at the last telemetry reading, as f32 bits (NaN: none).
    gpu_utilization_bits: AtomicU32,
    token_events: f64,
    started: Instant,
}

impl std::fmt::Debug for Front {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Front").finish_non_exhaustive()
    }
}

impl Front {
    pub fn new(setup: FrontSetup, bus: Arc<Bus>, audit: Option<Arc<dyn AuditGate>>) -> Self {
        let decisions = Decisions::on(&bus);
        Self {
            registry: Registry::new(decisions.clone()),
            rate_limiter: Arc::new(RateLimiter::new(setup.rate_limit)),
            rate_limited: Arc::default(),
            handoffs: Handoffs::new(setup.handoff, setup.model_handoffs, decisions.clone()),
            faults: Faults::new(setup.faults),
            bus,
            decisions,
            draining: AtomicBool::new(false),
            guard: OnceLock::new(),
            guard_setup: setup.guard,
            releases: OnceLock::new(),
            on_demand: OnceLock::new(),
            audit,
            gpu_utilization_bits: AtomicU32::new(f32::NAN.to_bits()),
            token_events: setup.token_events,
            started: Instant::now(),
        }
    }

    /// What the backend chain reads of it.
    pub fn chain_parts(&self) -> chain::Parts<'_> {
        chain::Parts {
            registry: &self.registry,
            handoffs: &self.handoffs,
            faults: &self.faults,
        }
    }

    /// The input guard (the seed rules when none was loaded).
    pub fn guard(&self) -> &Arc<GuardService> {
        self.guard
            .get_or_init(|| Arc::new(GuardService::seed(&self.guard_setup)))
    }

    /// Serves with `guard` from now on (once: the first guard set stays).
    pub fn set_guard(&self, guard: Arc<GuardService>) -> Result<(), Arc<GuardService>> {
        self.guard.set(guard)
    }

    /// Routes by the release plans from now on (once).
    pub fn set_releases(&self, releases: Arc<dyn Releases>) {
        let _ = self.releases.set(releases);
    }

    /// Loads models on their first request from now on (once).
    pub fn set_on_demand(&self, on_demand: Arc<dyn OnDemand>) {
        let _ = self.on_demand.set(on_demand);
    }

    /// The release plans, when releases are on.
    pub fn releases(&self) -> Option<&Arc<dyn Releases>> {
        self.releases.get()
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// New requests are refused from now on (the server is shutting down).
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// `fail_closed`: the refusal while the audit log cannot persist.
    pub fn audit_refusal(&self) -> Option<ApiError> {
        self.audit.as_ref()?.refusal()
    }

    /// Milliseconds since the process started (the models' last use is kept in these).
    pub fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// The GPUs' mean utilization (0–1) at the last telemetry reading, for the records.
    pub fn gpu_utilization(&self) -> Option<f32> {
        let value = f32::from_bits(self.gpu_utilization_bits.load(Ordering::Relaxed));
        (!value.is_nan()).then_some(value)
    }

    /// Remembers the GPUs' mean utilization of a telemetry reading.
    pub fn set_gpu_utilization(&self, value: Option<f64>) {
        let bits = value.map_or(f32::NAN, |v| v as f32).to_bits();
        self.gpu_utilization_bits.store(bits, Ordering::Relaxed);
    }

    /// A fresh record for a request that just arrived, with its origin (the operator, the
    /// caller's trace).
    pub fn record(
        &self,
        request_id: String,
        principal: String,
        endpoint: &'static str,
    ) -> RecordBuilder {
        let mut record = RecordBuilder::new(Arc::clone(&self.bus), request_id, principal, endpoint);
        let origin = crate::origin::origin();
        record.record.operator = origin.operator;
        // With tracing on, a request that came without a trace starts one here, so its record,
        // its log line and its spans share the id.
        let traced = record.traced();
        record.record.trace_id = origin
            .trace_id
            .or_else(|| traced.then(crate::origin::new_trace_id));
        if let Some(t) = record.timeline_mut() {
            t.parent_span_id = origin.parent_span_id;
            t.parent_sampled = origin.sampled;
            t.tracestate = origin.tracestate;
            t.token_fraction = self.token_events;
        }
        record
    }
}

/// A request that passed the front: the backend that answers, its answer, its place in flight,
/// and the fallback that answered when it was not the model asked for.
#[derive(Debug)]
pub struct Admitted {
    pub entry: Arc<Entry>,
    pub answer: Answer,
    pub ticket: Ticket,
    pub fallback: Option<Fallback>,
}

/// The whole pipeline for a request that names its model.
pub async fn serve(
    front: &Arc<Front>,
    principal: &str,
    model: &ModelName,
    work: Work,
    record: &mut RecordBuilder,
) -> Result<Admitted, ApiError> {
    if front.is_draining() {
        return Err(ApiError::draining());
    }
    // (A refusal before the route is counted without a model: the name asked for is the
    // client's text, and must not become a metric label.)
    rate_limit(front, principal, record)?;
    let entry = locate(front, model, work.kind(), record).await?;
    serve_from(front, principal, entry, work, None, record).await
}

/// The entry that answers `work` for `model`: the model loaded first when it loads on request
/// (`residency = "cold"`), then [`route`]d. Protocols that decode after the route (KServe)
/// call it before they read their input.
pub async fn locate(
    front: &Arc<Front>,
    model: &ModelName,
    work: WorkKind,
    record: &mut RecordBuilder,
) -> Result<Arc<Entry>, ApiError> {
    if let Some(on_demand) = front.on_demand.get() {
        on_demand.before_route(model, record).await?;
    }
    route(front, model, work, record)
}

/// The tensors of a [`reserve`]d request through the rest of the pipeline, their input and
/// output kept for the audit (`with_bytes`: the input's raw bytes too); the answer and the
/// fallback that gave it.
pub async fn serve_tensors(
    front: &Arc<Front>,
    principal: &str,
    reserved: Reserved,
    request: crate::backend::InferRequest,
    with_bytes: bool,
    record: &mut RecordBuilder,
) -> Result<(crate::backend::InferResponse, Option<Fallback>), ApiError> {
    record.record.input_sha256 = request.input_sha256();
    record.payload_input(|| request.audit_input(with_bytes));
    let admitted =
        serve_reserved(front, principal, reserved, Work::Tensors(request), record).await?;
    let Answer::Tensors(response) = admitted.answer else {
        return Err(ApiError::Internal(
            "the backend answered tensors with something else".into(),
        ));
    };
    record.payload_output(|| response.audit_output());
    Ok((response, admitted.fallback))
}

/// The key's request bucket and token budget (`[rate_limit]`): the first costly step's gate.
fn rate_limit(front: &Front, principal: &str, record: &mut RecordBuilder) -> Result<(), ApiError> {
    front.rate_limiter.admit(principal).map_err(|wait| {
        record.refuse("rate_limited");
        // Summarised per interval, not audited one by one (crate::unauthenticated); the first
        // few of each interval are logged here.
        let (endpoint, id) = (record.record.endpoint, &record.record.request_id);
        if front.rate_limited.note(principal, endpoint, id) {
            tracing::warn!(
                target: "rampart::rate_limit",
                request_id = %id,
                principal,
                endpoint,
                status = 429,
                retry_after_s = wait,
                "request refused past its key's rate limit"
            );
        }
        ApiError::Overloaded {
            message: format!("rate limit of key {principal:?} reached; retry in {wait} s"),
            retry_after_s: wait,
            code: "rate_limited",
            booking: None,
        }
    })
}

/// The route: the entry that answers `work` for `model`. A model named without a version
/// whose release plan is under way goes to the stable or the candidate by the plan (sticky by
/// user: the request's `user`, else the `[releases] user_header`, else the key's id); the record
/// says which and why. Protocols that need the model to decode (a raw image body) call it
/// first.
pub fn route(
    front: &Front,
    model: &ModelName,
    work: WorkKind,
    record: &mut RecordBuilder,
) -> Result<Arc<Entry>, ApiError> {
    let began = std::time::Instant::now();
    let routed = release_route(front, model, record);
    let resolved = match &routed {
        // The control: the release's second copy of the stable. Until it is loaded (or when
        // it cannot be), its users are served by the stable, as stable requests (the judge,
        // comparing with the control, leaves them out).
        Some(r) if r.variant == release::plan::Variant::Control => {
            let control = front
                .releases
                .get()
                .and_then(|releases| releases.control(&model.name));
            match control.filter(|e| e.backend.accepts(work)) {
                Some(entry) => {
                    record.record.variant = Some(r.variant.as_str());
                    record.record.route_reason = Some(r.why);
                    Ok(entry)
                }
                None => {
                    let chosen = ModelName::versioned(&model.name, Some(&r.version));
                    record.record.variant = Some(release::plan::Variant::Stable.as_str());
                    record.record.route_reason = Some("control_not_loaded");
                    front.registry.resolve(&chosen, work)
                }
            }
        }
        Some(r) => {
            let chosen = ModelName::versioned(&model.name, Some(&r.version));
            match front.registry.resolve(&chosen, work) {
                Ok(entry) => {
                    record.record.variant = Some(r.variant.as_str());
                    record.record.route_reason = Some(r.why);
                    Ok(entry)
                }
                // The plan names a version that is not loaded (it failed to load, or the plan
                // file names a version this server was not started with): the newest loaded
                // version answers, outside the release's statistics.
                Err(_) => {
                    record.record.route_reason = Some("version_not_loaded");
                    front.registry.resolve(model, work)
                }
            }
        }
        None => front.registry.resolve(model, work),
    };
    record.stage_since("route", began);
    let entry = resolved?;
    // Least recently used is what the models' budget evicts first (crate::residency).
    entry.touch(front.now_ms());
    record.record.model = entry.name.clone();
    record.record.version = entry.version.clone();
    record.record.version_digest = entry.digest.clone();
    record.record.lineage_commit = entry.lineage_commit.clone();
    record.record.dataset_version = entry.dataset_version.clone();
    record.record.gpu_utilization = front.gpu_utilization();
    record.set_entropy_band(entry.backend.entropy_band());
    Ok(entry)
}

/// The release plan's choice for a model named without a version (none: no plan, releases
/// off, or a version named; the record then says `named_version` when a plan exists).
fn release_route(front: &Front, model: &ModelName, record: &mut RecordBuilder) -> Option<Routed> {
    let releases = front.releases.get()?;
    if model.version.is_some() {
        if releases.has_plan(&model.name) {
            record.record.route_reason = Some("named_version");
        }
        return None;
    }
    let origin = crate::origin::origin();
    let r = &record.record;
    let key_id = (r.principal != "anonymous").then_some(r.principal.as_str());
    let key = release::router::RoutingKey {
        user: r.user.as_deref(),
        header_user: origin.routing_user.as_deref(),
        key_id,
        group: origin.routing_group.as_deref(),
        request_id: &r.request_id,
    };
    releases.route(&model.name, &key)
}

/// A request's place on its routed model, taken before its decode by [`reserve`].
#[derive(Debug)]
pub struct Reserved {
    entry: Arc<Entry>,
    reservation: chain::Reservation,
}

/// For protocols whose decode is the costly part (KServe tensors, read into typed buffers as
/// large as the body): the steps of [`serve`] after the route that need no input (drain check, audit,
/// hand-off, rate limit), then the routed model's admission slot ([`chain::reserve`]). The
/// request decodes in its place in flight, as a generation tokenizes in its own, and a request
/// refused here costs no decode. Go on with [`serve_reserved`].
pub async fn reserve(
    front: &Arc<Front>,
    principal: &str,
    entry: Arc<Entry>,
    record: &mut RecordBuilder,
) -> Result<Reserved, ApiError> {
    before_work(front, record)?;
    rate_limit(front, principal, record)?;
    handoff(front, &entry, record)?;
    let reservation = chain::reserve(&entry, record).await?;
    Ok(Reserved { entry, reservation })
}

/// The pipeline after [`reserve`]: the backend chain, its primary's attempt in the slot taken.
pub async fn serve_reserved(
    front: &Arc<Front>,
    principal: &str,
    reserved: Reserved,
    work: Work,
    record: &mut RecordBuilder,
) -> Result<Admitted, ApiError> {
    serve_from(
        front,
        principal,
        reserved.entry,
        work,
        Some(reserved.reservation),
        record,
    )
    .await
}

/// The drain check and the audit's refusal.
fn before_work(front: &Front, record: &mut RecordBuilder) -> Result<(), ApiError> {
    if front.is_draining() {
        return Err(ApiError::draining());
    }
    if let Some(refusal) = front.audit_refusal() {
        record.refuse("audit_unavailable");
        return Err(refusal);
    }
    Ok(())
}

/// The model's hand-off to people.
fn handoff(front: &Front, entry: &Entry, record: &mut RecordBuilder) -> Result<(), ApiError> {
    if let Some(refusal) = front.handoffs.get(&entry.name).refusal() {
        record.refuse("human_handoff");
        record.record.fallback_level = 3;
        record.record.fallback_reason = Some("human_handoff");
        return Err(ApiError::HumanHandoff {
            message: refusal.message,
            url: refusal.url,
            retry_after_s: refusal.retry_after_s,
        });
    }
    Ok(())
}

/// After the rate limit and the route ([`serve`]) or [`reserve`]: drain
/// check, guard, hand-off, the backend chain; with a reservation, the checks [`reserve`] made
/// are not made again.
async fn serve_from(
    front: &Arc<Front>,
    principal: &str,
    entry: Arc<Entry>,
    work: Work,
    reservation: Option<chain::Reservation>,
    record: &mut RecordBuilder,
) -> Result<Admitted, ApiError> {
    if reservation.is_none() {
        before_work(front, record)?;
    }
    let span = tracing::info_span!(
        "front",
        model = %entry.name,
        version = %entry.version,
        work = work.kind().as_str()
    );
    async move {
        // The guard: after the rate limit, before hand-off and the chain, so no fallback
        // bypasses it.
        let mut work = work;
        let mut watch = None;
        if let Work::Generate(plan) = &mut work {
            let service = Arc::clone(front.guard());
            let began = std::time::Instant::now();
            let screened = screen::screen(
                &service,
                &entry.name,
                &entry.backend,
                principal,
                plan,
                record,
            )
            .instrument(tracing::debug_span!("guard"))
            .await;
            record.stage_since("guard", began);
            let (screened, w) = screened?;
            if let Screened::RefuseWithCompletion = screened {
                return refusal_completion(front, principal, entry, work, record).await;
            }
            watch = w.map(Arc::new);
        }
        let reservation = match reservation {
            Some(reservation) => reservation,
            None => {
                handoff(front, &entry, record)?;
                chain::Reservation::default()
            }
        };
        // Shadow releases: a share of what the stable answers is also answered, on its own
        // task, by the candidate and the control (the input as the guard passed it).
        crate::shadow::maybe_mirror(front, &entry, principal, &work, record);
        let answered = chain::run_reserved(front.chain_parts(), entry, reservation, work, record)
            .instrument(tracing::debug_span!("chain"))
            .await?;
        let answer = match answered.answer {
            Answer::Tensors(mut response) => {
                response.model_name = answered.entry.name.clone();
                response.model_version = answered.entry.version.clone();
                Answer::Tensors(response)
            }
            Answer::Generation(mut g) => {
                g.watch = watch;
                Answer::Generation(g)
            }
            other => other,
        };
        Ok(Admitted {
            entry: answered.entry,
            answer,
            ticket: Ticket::new(Some(answered.slot), &front.rate_limiter, principal),
            fallback: answered.fallback,
        })
    }
    .instrument(span)
    .await
}

/// The guard's refusal as a completion (`refusal = "completion"`): every choice's content is
/// exactly `{"error":"unsafe_input"}`; no backend runs.
async fn refusal_completion(
    front: &Arc<Front>,
    principal: &str,
    entry: Arc<Entry>,
    work: Work,
    record: &mut RecordBuilder,
) -> Result<Admitted, ApiError> {
    let canned = crate::backend::canned::CannedBackend::new(
        screen::REFUSAL_COMPLETION.to_string(),
        Default::default(),
    );
    let answer = crate::backend::InferenceBackend::start(&canned, work, record)
        .await
        .map_err(ApiError::from)?;
    Ok(Admitted {
        entry,
        answer,
        ticket: Ticket::new(None, &front.rate_limiter, principal),
        fallback: None,
    })
}

/// Ends a request's record with its outcome: a success finished by itself (`stop` unless the
/// encoder said otherwise), or the error the client got. Returns once every acknowledging sink
/// (the audit log in `fail_closed`) made the record durable, or why it could not.
pub fn settle<T>(
    record: &mut RecordBuilder,
    result: Result<&T, &ApiError>,
) -> impl std::future::Future<Output = Result<(), ApiError>> + Send + 'static {
    match result {
        Ok(_) => {
            if record.record.finish_reason.is_none() {
                record.record.finish_reason = Some("stop".into());
            }
        }
        Err(e) => e.record(record),
    }
    durable(record.finish())
}

/// [`settle`]s the record and returns the result, a success turned into `audit_unavailable`
/// when its entry could not be made durable (nothing is served unaudited).
pub async fn conclude<T>(
    record: &mut RecordBuilder,
    result: Result<T, ApiError>,
) -> Result<T, ApiError> {
    let durable = settle(record, result.as_ref()).await;
    match (result, durable) {
        (Ok(_), Err(e)) => Err(e),
        (result, _) => result,
    }
}

/// How long a response waits for its audit entry before it is refused.
const DURABLE_TIMEOUT: Duration = Duration::from_secs(15);

/// Waits for a published record's acknowledgements.
pub async fn durable(receipt: Receipt) -> Result<(), ApiError> {
    if !receipt.is_pending() {
        return Ok(());
    }
    match tokio::time::timeout(DURABLE_TIMEOUT, receipt.wait()).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(ApiError::AuditUnavailable(format!(
            "the request's audit entry could not be made durable ({e}); the answer is withheld"
        ))),
        Err(_) => Err(ApiError::AuditUnavailable(format!(
            "the request's audit entry was not durable within {} s; the answer is withheld",
            DURABLE_TIMEOUT.as_secs()
        ))),
    }
}
