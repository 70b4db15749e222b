//! The front: the one pipeline every protocol calls once it has decoded its wire format.
//!
//! drain check → rate limit → route → guard → hand-off → backend chain (each step: breaker,
//! admission, backend; see [`crate::chain`]). The key's rate limit comes before anything that
//! costs (an on-demand load at the route, the guard's rules and classifier, a tensor decode),
//! so a key past its limit burns no CPU. Each protocol's handler is decode → [`serve`] →
//! encode; the KServe bindings, whose decode is the costly part, route from the URL (or the
//! message) first, [`reserve`] (drain, hand-off, rate limit, the model's admission slot), then
//! decode in that slot and go on with [`serve_reserved`]. Nothing below this line knows the
//! protocol, nothing above it knows the model. The record of the request is filled on the way (model, version, digest, queue time, the refusal
//! and its reason, the attempts and the fallback that answered) and settled once by [`settle`].
//!
//! The guard ([`crate::screen`]: injection rules and classifier) judges every generation after
//! the route (its policy and the model's control tokens are the model's) and before anything
//! else; the release plan's routing (canary, A/B) happens at the route ([`crate::releases`]).

use std::sync::Arc;

use std::time::Duration;

use record::{Receipt, RecordBuilder};
use tracing::Instrument;

use crate::admission::Slot;
use crate::backend::{Answer, Work, WorkKind};
use crate::chain::{self, Fallback};
use crate::error::ApiError;
use crate::registry::{Entry, ModelName};
use crate::screen::{self, Screened};
use crate::state::AppState;

/// A request that passed the front: the backend that answers, its answer, its place in flight,
/// and the fallback that answered when it was not the model asked for.
#[derive(Debug)]
pub struct Admitted {
    pub entry: Arc<Entry>,
    pub answer: Answer,
    pub ticket: Ticket,
    pub fallback: Option<Fallback>,
}

/// Held until the response ends: the admission slot, and the principal whose token budget the
/// response is charged to.
pub struct Ticket {
    /// None for answers the front gives itself (the guard's refusal completion).
    _slot: Option<Slot>,
    state: Arc<AppState>,
    principal: String,
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("principal", &self.principal)
            .finish_non_exhaustive()
    }
}

impl Ticket {
    /// Charges the key's token budget for what the request used.
    pub fn charge(&self, tokens: usize) {
        self.state.rate_limiter.charge(&self.principal, tokens);
    }
}

/// The whole pipeline for a request that names its model.
pub async fn serve(
    state: &Arc<AppState>,
    principal: &str,
    model: &ModelName,
    work: Work,
    record: &mut RecordBuilder,
) -> Result<Admitted, ApiError> {
    if state.is_draining() {
        return Err(ApiError::draining());
    }
    // (A refusal before the route is counted without a model: the name asked for is the
    // client's text, and must not become a metric label.)
    rate_limit(state, principal, record)?;
    crate::residency::before_route(state, model, record).await?;
    let entry = route(state, model, work.kind(), record)?;
    serve_from(state, principal, entry, work, None, record).await
}

/// The key's request bucket and token budget (`[rate_limit]`): the first costly step's gate.
fn rate_limit(
    state: &AppState,
    principal: &str,
    record: &mut RecordBuilder,
) -> Result<(), ApiError> {
    state.rate_limiter.admit(principal).map_err(|wait| {
        record.refuse("rate_limited");
        // Summarised per interval, not audited one by one (crate::unauthenticated); the first
        // few of each interval are logged here.
        let (endpoint, id) = (record.record.endpoint, &record.record.request_id);
        if state.rate_limited.note(principal, endpoint, id) {
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
        }
    })
}

/// The route: the entry that answers `work` for `model`. A model named without a version
/// whose release plan is under way goes to the stable or the candidate by the plan (sticky by
/// user: the request's `user`, else the `[releases] user_header`, else the key's id); the record
/// says which and why. Protocols that need the model to decode (a raw image body) call it
/// first.
pub fn route(
    state: &AppState,
    model: &ModelName,
    work: WorkKind,
    record: &mut RecordBuilder,
) -> Result<Arc<Entry>, ApiError> {
    let began = std::time::Instant::now();
    let routed = release_route(state, model, record);
    let resolved = match &routed {
        // The control: the release's second copy of the stable. Until it is loaded (or when
        // it cannot be), its users are served by the stable, as stable requests (the judge,
        // comparing with the control, leaves them out).
        Some(r) if r.variant == release::plan::Variant::Control => {
            let control = state
                .releases
                .get()
                .and_then(|rel| rel.control(&model.name));
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
                    state.registry.resolve(&chosen, work)
                }
            }
        }
        Some(r) => {
            let chosen = ModelName::versioned(&model.name, Some(&r.version));
            match state.registry.resolve(&chosen, work) {
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
                    state.registry.resolve(model, work)
                }
            }
        }
        None => state.registry.resolve(model, work),
    };
    record.stage_since("route", began);
    let entry = resolved?;
    // Least recently used is what the models' budget evicts first (crate::residency).
    entry.touch(crate::residency::now_ms(state));
    record.record.model = entry.name.clone();
    record.record.version = entry.version.clone();
    record.record.version_digest = entry.digest.clone();
    record.record.lineage_commit = entry.lineage_commit.clone();
    record.record.dataset_version = entry.dataset_version.clone();
    record.record.gpu_utilization = state.gpu_utilization();
    record.set_entropy_band(entry.backend.entropy_band());
    Ok(entry)
}

/// The release plan's choice for a model named without a version (none: no plan, releases
/// off, or a version named; the record then says `named_version` when a plan exists).
fn release_route(
    state: &AppState,
    model: &ModelName,
    record: &mut RecordBuilder,
) -> Option<crate::releases::Routed> {
    let releases = state.releases.get()?;
    if model.version.is_some() {
        if releases.get(&model.name).is_some() {
            record.record.route_reason = Some("named_version");
        }
        return None;
    }
    let origin = crate::identity::origin();
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
/// large as the body): the steps of [`serve_routed`] that need no input (drain check, audit,
/// hand-off, rate limit), then the routed model's admission slot ([`chain::reserve`]). The
/// request decodes in its place in flight, as a generation tokenizes in its own, and a request
/// refused here costs no decode. Go on with [`serve_reserved`].
pub async fn reserve(
    state: &Arc<AppState>,
    principal: &str,
    entry: Arc<Entry>,
    record: &mut RecordBuilder,
) -> Result<Reserved, ApiError> {
    before_work(state, record)?;
    rate_limit(state, principal, record)?;
    handoff(state, &entry, record)?;
    let reservation = chain::reserve(&entry, record).await?;
    Ok(Reserved { entry, reservation })
}

/// The pipeline after [`reserve`]: the backend chain, its primary's attempt in the slot taken.
pub async fn serve_reserved(
    state: &Arc<AppState>,
    principal: &str,
    reserved: Reserved,
    work: Work,
    record: &mut RecordBuilder,
) -> Result<Admitted, ApiError> {
    serve_from(
        state,
        principal,
        reserved.entry,
        work,
        Some(reserved.reservation),
        record,
    )
    .await
}

/// The drain check and the audit's refusal.
fn before_work(state: &AppState, record: &mut RecordBuilder) -> Result<(), ApiError> {
    if state.is_draining() {
        return Err(ApiError::draining());
    }
    if let Some(refusal) = state.audit_refusal() {
        record.refuse("audit_unavailable");
        return Err(refusal);
    }
    Ok(())
}

/// The model's hand-off to people.
fn handoff(state: &AppState, entry: &Entry, record: &mut RecordBuilder) -> Result<(), ApiError> {
    if let Some(refusal) = state.handoffs.get(&entry.name).refusal() {
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

/// The pipeline after the route (for protocols that route first): rate limit, drain check,
/// guard, hand-off, then the backend chain.
pub async fn serve_routed(
    state: &Arc<AppState>,
    principal: &str,
    entry: Arc<Entry>,
    work: Work,
    record: &mut RecordBuilder,
) -> Result<Admitted, ApiError> {
    rate_limit(state, principal, record)?;
    serve_from(state, principal, entry, work, None, record).await
}

/// After the rate limit and the route ([`serve`], [`serve_routed`]) or [`reserve`]: drain
/// check, guard, hand-off, the backend chain; with a reservation, the checks [`reserve`] made
/// are not made again.
async fn serve_from(
    state: &Arc<AppState>,
    principal: &str,
    entry: Arc<Entry>,
    work: Work,
    reservation: Option<chain::Reservation>,
    record: &mut RecordBuilder,
) -> Result<Admitted, ApiError> {
    if reservation.is_none() {
        before_work(state, record)?;
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
            let service = Arc::clone(state.guard());
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
                return refusal_completion(state, principal, entry, work, record).await;
            }
            watch = w.map(Arc::new);
        }
        let reservation = match reservation {
            Some(reservation) => reservation,
            None => {
                handoff(state, &entry, record)?;
                chain::Reservation::default()
            }
        };
        // Shadow releases: a share of what the stable answers is also answered, on its own
        // task, by the candidate and the control (the input as the guard passed it).
        crate::shadow::maybe_mirror(state, &entry, principal, &work, record);
        let answered = chain::run_reserved(state, entry, reservation, work, record)
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
            ticket: Ticket {
                _slot: Some(answered.slot),
                state: Arc::clone(state),
                principal: principal.to_string(),
            },
            fallback: answered.fallback,
        })
    }
    .instrument(span)
    .await
}

/// The guard's refusal as a completion (`refusal = "completion"`): every choice's content is
/// exactly `{"error":"unsafe_input"}`; no backend runs.
async fn refusal_completion(
    state: &Arc<AppState>,
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
        ticket: Ticket {
            _slot: None,
            state: Arc::clone(state),
            principal: principal.to_string(),
        },
        fallback: None,
    })
}

/// The response header that names the request's audit entry.
pub const AUDIT_ID_HEADER: &str = "x-rampart-audit-id";

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

/// Names the request's audit entry on the response.
pub fn mark_audit(response: &mut axum::response::Response, audit_id: &str) {
    if let Ok(v) = axum::http::HeaderValue::from_str(audit_id) {
        response.headers_mut().insert(AUDIT_ID_HEADER, v);
    }
}
