//! The feedback loop's routes and upkeep (docs/feedback.md).
//!
//! - `POST /v1/feedback`: a rating, label or text correction on a served response, named by its
//!   `response_id`, `request_id` or `audit_id`; with a key that has the `feedback` scope, or
//!   with the response's signed `X-Rampart-Feedback-Token` (no key). 201 when new, 200 when
//!   the rater's earlier feedback on that item was replaced. A link is one rater (`link`),
//!   whatever `rater` or `X-Operator-Id` its client sends: it rates its answer once per item,
//!   a later rating replacing the earlier. Submissions are limited per link and per key
//!   (`[feedback] submissions_per_minute_per_link` / `_per_principal`) before the body is
//!   read; a refused one is counted (`rampart_feedback_refused_total{reason="rate_limited"}`),
//!   not stored, not audited.
//! - `GET /admin/feedback/classes`: per (model, version, class) error rates over the window,
//!   with Wilson bounds (scope `admin`).
//! - `GET /admin/feedback/calibration`: helpful rate and accuracy per confidence bucket.
//!
//! Every answer carries its signed feedback token; the index sink (crate `feedback`) keeps the
//! responses; a task refreshes the per-class gauges and prunes the index.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use feedback::link::LinkError;
use feedback::store::Filter;
use feedback::{Rater, Submission, Submitted, Target};
use serde::Deserialize;
use serde_json::json;

use crate::auth::{Scope, SubmissionLimiter};
use crate::error::ApiError;
use crate::error::WireError;
use crate::identity::{self, RequestId, Transport};
use crate::state::AppState;

/// The response header with the answer's signed feedback link.
pub const TOKEN_HEADER: &str = "x-rampart-feedback-token";
/// The record bus sink's name (the index).
pub const SINK: &str = "feedback";

pub mod paths {
    pub const FEEDBACK: &str = "/v1/feedback";
    pub const ADMIN_CLASSES: &str = "/admin/feedback/classes";
    pub const ADMIN_CALIBRATION: &str = "/admin/feedback/calibration";
    pub const ADMIN_RETRAIN: &str = "/admin/feedback/retrain";
}

pub use crate::feedback_service::FeedbackService;

/// Puts the answer's signed feedback link on its response (when links are on).
pub fn stamp(state: &AppState, response: &mut Response, audit_id: &str) {
    let Some(service) = state.feedback.get() else {
        return;
    };
    if !service.config.links || audit_id.is_empty() || !response.status().is_success() {
        return;
    }
    if let Ok(v) = axum::http::HeaderValue::from_str(&service.token(audit_id)) {
        response.headers_mut().insert(TOKEN_HEADER, v);
    }
}

fn service(state: &AppState) -> Result<&Arc<FeedbackService>, ApiError> {
    state.feedback.get().ok_or_else(|| ApiError::Unavailable {
        message: "feedback is off on this server ([feedback] enabled = false)".into(),
        retry_after_s: 0,
    })
}

/// The public route: its own authentication (a key with `feedback`, or a signed link).
pub fn routes() -> Router<Arc<AppState>> {
    Router::new().route(paths::FEEDBACK, post(submit))
}

/// The admin tables (mounted under the `admin` scope).
pub fn admin_routes() -> Router<Arc<AppState>> {
    Router::new()
        .route(paths::ADMIN_CLASSES, get(classes))
        .route(paths::ADMIN_CALIBRATION, get(calibration))
        .route(paths::ADMIN_RETRAIN, post(retrain))
}

fn refused(error: ApiError, request_id: &str, why: &str) -> Response {
    // A flood is counted, not written out line by line.
    if why == "rate_limited" {
        tracing::debug!(target: "rampart::feedback", request_id, error = %error, "feedback refused");
    } else {
        tracing::warn!(
            target: "rampart::feedback",
            request_id,
            reason = why,
            error = %error,
            "feedback refused"
        );
    }
    metrics::counter!("rampart_feedback_refused_total", "reason" => why.to_string()).increment(1);
    error.into_response()
}

/// `POST /v1/feedback`.
async fn submit(
    State(state): State<Arc<AppState>>,
    Extension(RequestId(request_id)): Extension<RequestId>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match submit_inner(&state, &request_id, &headers, &body).await {
        Ok(r) => r,
        Err((e, why)) => refused(e, &request_id, why),
    }
}

type Refusal = (ApiError, &'static str);

async fn submit_inner(
    state: &Arc<AppState>,
    request_id: &str,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, Refusal> {
    let service = service(state).map_err(|e| (e, "off"))?;
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    // Who: a signed link names its response; otherwise a key with the `feedback` scope.
    let (linked, principal, scopes) = match header(TOKEN_HEADER) {
        Some(token) => {
            let audit_id = service
                .key
                .verify(token, feedback::now_ms() / 1000)
                .map_err(|e| {
                    let code = match e {
                        LinkError::Expired(_) => "feedback_token_expired",
                        LinkError::Forged => "feedback_token_forged",
                        LinkError::Malformed => "feedback_token_malformed",
                    };
                    (
                        ApiError::FeedbackToken {
                            message: e.to_string(),
                            code,
                        },
                        code,
                    )
                })?;
            admit(&service.per_link, &audit_id, "this feedback link")?;
            (
                Some(audit_id),
                feedback::store::LINK_RATER.to_string(),
                None,
            )
        }
        None => {
            let (principal, scopes) = match identity::authenticate(
                state,
                header("authorization"),
                Transport::Http,
                request_id,
                "feedback",
                Some(Scope::Feedback),
            ) {
                Ok(found) => found,
                Err(e) => {
                    identity::pause_refusal(state, &e).await;
                    return Err((e, "unauthorized"));
                }
            };
            admit(
                &service.per_principal,
                &principal,
                &format!("key {principal:?}"),
            )?;
            (None, principal, Some(scopes))
        }
    };
    let value: serde_json::Value = serde_json::from_slice(body).map_err(|e| {
        (
            ApiError::invalid_param("body", format!("the body is not JSON: {e}")),
            "malformed",
        )
    })?;
    let submission = Submission::parse(&value, linked.is_some())
        .map_err(|e| (ApiError::invalid_param(e.field, e.to_string()), "malformed"))?;
    let target = match (&linked, &submission.target) {
        (Some(audit_id), _) => Target::Audit(audit_id.clone()),
        (None, Some(t)) => t.clone(),
        (None, None) => {
            return Err((
                ApiError::invalid_param(
                    "response_id",
                    "name the response: response_id, request_id or audit_id",
                ),
                "malformed",
            ))
        }
    };
    let found = find(state, service, &target)
        .await
        .map_err(|e| (e, "store"))?;
    let Some(response) = found else {
        return Err((
            ApiError::ResponseNotFound(format!(
                "no served response {} (responses are kept {} h; feedback names a response \
                 this server, or a replica sharing its store, answered)",
                describe(&target),
                service.config.retention_hours
            )),
            "not_found",
        ));
    };
    // A link rates its own response only; a key rates its tenant's (admin keys: any).
    if let (Some(_), Some(named)) = (&linked, &submission.target) {
        let named = find(state, service, named)
            .await
            .map_err(|e| (e, "store"))?;
        if named.map(|r| r.audit_id) != Some(response.audit_id.clone()) {
            return Err((
                ApiError::OtherTenant(
                    "a feedback link rates the response it came with, not another one".into(),
                ),
                "other_response",
            ));
        }
    }
    if let (Some(scopes), Some(keys)) = (scopes, &state.keys) {
        if !scopes.has(Scope::Admin) && keys.tenant(&principal) != keys.tenant(&response.principal)
        {
            return Err((
                ApiError::OtherTenant(format!(
                    "the response {} was served to another tenant's key; feedback comes from \
                     the same tenant (keys' `tenant=`) or an admin key",
                    describe(&target)
                )),
                "other_tenant",
            ));
        }
    }
    let count = response.classes.len().max(1);
    if submission.item >= count {
        return Err((
            ApiError::invalid_param(
                "item",
                format!(
                    "item {} is past the response's {count} item(s)",
                    submission.item
                ),
            ),
            "malformed",
        ));
    }
    // Who rated: a link is one rater, its answer's end user, whatever its client claims (the
    // body's `rater` and `X-Operator-Id` are a key's to give); a key's rater is the body's
    // `rater`, else `X-Operator-Id`, else the key's id, and may not be a link's name.
    let (by, operator) = if linked.is_some() {
        (Rater::Link, None)
    } else {
        let operator = header("x-operator-id").map(str::to_string);
        let rater = submission
            .rater
            .clone()
            .or_else(|| operator.clone())
            .unwrap_or_else(|| principal.clone());
        if Rater::reserved(&rater) {
            return Err((
                ApiError::invalid_param(
                    "rater",
                    format!(
                        "the rater name {rater:?} is reserved for signed feedback links; name \
                         the rater (`rater`, or X-Operator-Id)"
                    ),
                ),
                "malformed",
            ));
        }
        (Rater::key(rater, principal.clone()), operator)
    };
    let via = if linked.is_some() { "link" } else { "key" };
    let store = Arc::clone(&service.store);
    let (resp, sub) = (response.clone(), submission.clone());
    // The row, then what the answer's latest rating now says (the release judge counts that,
    // once per answer).
    let (submitted, rating) = tokio::task::spawn_blocking(move || {
        let submitted = store.submit(&resp, &sub, &by, feedback::now_ms())?;
        let rating = store.answer_rating(&resp.audit_id)?;
        Ok::<_, feedback::FeedbackError>((submitted, rating))
    })
    .await
    .map_err(|e| (ApiError::Internal(format!("feedback task: {e}")), "store"))?
    .map_err(|e| (ApiError::Internal(e.to_string()), "store"))?;
    let f = submitted.feedback();
    let class = feedback::quality::class_label(f.class.as_deref().unwrap_or("")).to_string();
    metrics::counter!(
        "rampart_feedback_total",
        "model" => f.model.clone(),
        "version" => f.version.clone(),
        "class" => class.clone(),
        "rating" => f.rating.map_or("none", feedback::Rating::as_str)
    )
    .increment(1);
    if f.label.is_some() || f.correction.is_some() {
        let kind = if f.correction.is_some() {
            "text"
        } else {
            "label"
        };
        metrics::counter!(
            "rampart_feedback_corrections_total",
            "model" => f.model.clone(),
            "version" => f.version.clone(),
            "kind" => kind
        )
        .increment(1);
    }
    let status = match submitted {
        Submitted::Created(_) => "created",
        Submitted::Updated(_) => "updated",
    };
    // The answer is one sample of the release judge's helpful-rate test, with its latest
    // rating: a replaced rating replaces its sample, and a row without a rating (a comment, a
    // label) replacing one takes it away unless another rater's rating is later.
    if let Some(releases) = state.releases.get() {
        releases.feedback(
            &f.model,
            &f.version,
            response.time_ms,
            &response.audit_id,
            rating,
        );
    }
    tracing::info!(
        target: "rampart::feedback",
        request_id,
        feedback_id = %f.id,
        audit_id = %f.audit_id,
        model = %f.model,
        version = %f.version,
        class = %class,
        rating = f.rating.map_or("none", feedback::Rating::as_str),
        label = f.label.as_deref().unwrap_or(""),
        corrected = f.correction.is_some(),
        error = f.error,
        rater = %f.rater,
        via,
        status,
        "feedback"
    );
    let line = json!({
        "feedback_id": f.id, "status": status, "time_ms": f.time_ms, "audit_id": f.audit_id,
        "request_id": response.request_id, "response_id": response.response_id,
        "model": f.model, "version": f.version, "item": f.item, "class": f.class,
        "confidence": f.confidence, "rating": f.rating, "label": f.label,
        "correction": f.correction.as_ref().map(feedback::Correction::to_json),
        "comment": f.comment, "error": f.error, "rater": f.rater, "via": via,
    });
    // The correction log is a file: written off the async workers.
    let writer = Arc::clone(service);
    if let Err(e) = tokio::task::spawn_blocking(move || writer.log_correction(&line)).await {
        tracing::error!(target: "rampart::feedback", error = %e, "the correction log's writer stopped");
    }
    // The audit log keeps who judged which response (the correction itself by its hash).
    if let Some(log) = &state.audit {
        let detail = json!({
            "feedback_id": f.id, "item": f.item, "rating": f.rating, "label": f.label,
            "class": f.class, "error": f.error, "rater": f.rater, "via": via,
            "correction_sha256": f.correction.as_ref()
                .map(|c| record::sha256_hex(&c.to_json().to_string())),
        });
        let kept = audit::sink::append_action(
            log,
            Some(principal.clone()),
            operator,
            Some(f.model.clone()),
            audit::Action {
                name: "feedback.submit".into(),
                target: Some(f.audit_id.clone()),
                cause: None,
                outcome: status.into(),
                detail,
            },
        )
        .await;
        if let Err(e) = kept {
            tracing::error!(error = %e, feedback_id = %f.id, "feedback could not be kept in the audit log");
        }
    }
    let code = match status {
        "created" => StatusCode::CREATED,
        _ => StatusCode::OK,
    };
    Ok((
        code,
        Json(json!({
            "id": f.id,
            "object": "feedback",
            "status": status,
            "audit_id": f.audit_id,
            "request_id": response.request_id,
            "response_id": response.response_id,
            "model": f.model,
            "version": f.version,
            "item": f.item,
            "class": f.class,
            "rating": f.rating,
            "label": f.label,
            "error": f.error,
            "rater": f.rater,
            "via": via,
        })),
    )
        .into_response())
}

/// One submission from `key`'s bucket, or `429 rate_limited` with `Retry-After`.
fn admit(limiter: &SubmissionLimiter, key: &str, who: &str) -> Result<(), Refusal> {
    limiter.admit(key).map_err(|wait| {
        (
            ApiError::Overloaded {
                message: format!(
                    "feedback rate limit of {who} reached; retry in {wait} s \
                     ([feedback] submissions_per_minute_per_link / _per_principal)"
                ),
                retry_after_s: wait,
                code: "rate_limited",
                booking: None,
            },
            "rate_limited",
        )
    })
}

fn describe(t: &Target) -> String {
    match t {
        Target::Audit(id) => format!("with audit id {id:?}"),
        Target::Request(id) => format!("with request id {id:?}"),
        Target::Response(id) => format!("{id:?}"),
    }
}

/// The response a reference names; a miss waits once for the index to catch up (a client can
/// rate faster than the sink indexes).
async fn find(
    state: &AppState,
    service: &FeedbackService,
    target: &Target,
) -> Result<Option<feedback::Response>, ApiError> {
    let lookup = |t: Target| {
        let store = Arc::clone(&service.store);
        async move {
            tokio::task::spawn_blocking(move || store.find(&t))
                .await
                .map_err(|e| ApiError::Internal(format!("feedback task: {e}")))?
                .map_err(|e| ApiError::Internal(e.to_string()))
        }
    };
    if let Some(r) = lookup(target.clone()).await? {
        return Ok(Some(r));
    }
    if state.front.bus.depth(SINK) > 0 {
        state
            .front
            .bus
            .caught_up(SINK, Duration::from_secs(2))
            .await;
        if let Some(r) = lookup(target.clone()).await? {
            return Ok(Some(r));
        }
    }
    // A shared store: the replica that answered may still be writing the response (its record
    // sink writes after the answer). Look again for up to REPLICA_GRACE before a 404, so that
    // feedback sent to another replica right after the answer is not refused.
    if service.store.kind() == "postgres" {
        let deadline = tokio::time::Instant::now() + REPLICA_GRACE;
        let mut pause = Duration::from_millis(50);
        while tokio::time::Instant::now() + pause <= deadline {
            tokio::time::sleep(pause).await;
            if let Some(r) = lookup(target.clone()).await? {
                return Ok(Some(r));
            }
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }
    Ok(None)
}

/// How long feedback on a response not (yet) in a shared store waits for another replica to
/// write it before the answer is 404.
const REPLICA_GRACE: Duration = Duration::from_secs(2);

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TableQuery {
    model: Option<String>,
    version: Option<String>,
    class: Option<String>,
    /// The window, in seconds (default `[feedback] window_s`).
    window_s: Option<u64>,
    /// Calibration buckets (default 10).
    buckets: Option<usize>,
}

fn filter(service: &FeedbackService, q: &TableQuery) -> (Filter, u64) {
    let window = q.window_s.unwrap_or(service.config.window_s).max(1);
    (
        Filter {
            model: q.model.clone(),
            version: q.version.clone(),
            class: q.class.clone(),
            since_ms: Some(feedback::now_ms().saturating_sub(window * 1000)),
            until_ms: None,
        },
        window,
    )
}

/// `GET /admin/feedback/classes`.
async fn classes(
    State(state): State<Arc<AppState>>,
    Query(q): Query<TableQuery>,
) -> Result<Json<serde_json::Value>, crate::error::HttpError> {
    let service = Arc::clone(service(&state)?);
    let (filter, window) = filter(&service, &q);
    let min = service.config.min_samples;
    let store = Arc::clone(&service.store);
    let table =
        tokio::task::spawn_blocking(move || feedback::quality::classes(&store, &filter, min))
            .await
            .map_err(|e| ApiError::Internal(e.to_string()))?
            .map_err(|e| ApiError::Internal(e.to_string()))?;
    Ok(Json(json!({
        "window_s": window,
        "min_samples": min,
        "classes": table,
    })))
}

/// `GET /admin/feedback/calibration`.
async fn calibration(
    State(state): State<Arc<AppState>>,
    Query(q): Query<TableQuery>,
) -> Result<Json<serde_json::Value>, crate::error::HttpError> {
    let service = Arc::clone(service(&state)?);
    let (filter, window) = filter(&service, &q);
    let buckets = q.buckets.unwrap_or(10);
    if !(1..=100).contains(&buckets) {
        return Err(ApiError::invalid_param("buckets", "buckets must be 1 to 100").into());
    }
    let store = Arc::clone(&service.store);
    let rows = tokio::task::spawn_blocking(move || store.confidences(&filter))
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    Ok(Json(json!({
        "window_s": window,
        "model": q.model,
        "version": q.version,
        "feedback": rows.len(),
        "buckets": feedback::quality::calibration(&rows, buckets),
    })))
}

/// Refreshes the per-class gauges every `refresh_s` and prunes the index hourly; streams the
/// correction log to NATS when `[feedback.nats]` has a URL.
pub fn spawn(state: Arc<AppState>) {
    let Some(service) = state.feedback.get().cloned() else {
        return;
    };
    if let Some(url) = service.config.nats.effective_url() {
        crate::correction_stream::spawn(
            service.config.nats.clone(),
            url,
            service.config.dir.join("corrections.jsonl"),
            Arc::clone(&service.appended),
        );
    }
    tokio::spawn(async move {
        let mut shown: BTreeSet<(String, String, String)> = BTreeSet::new();
        let mut pruned_at = std::time::Instant::now();
        let mut tick = tokio::time::interval(Duration::from_secs(service.config.refresh_s));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let config = service.config.clone();
            let store = Arc::clone(&service.store);
            let prune = pruned_at.elapsed() >= Duration::from_secs(3600);
            let result = tokio::task::spawn_blocking(move || {
                let now = feedback::now_ms();
                let pruned = if prune {
                    Some(store.prune(now.saturating_sub(config.retention_hours * 3_600_000)))
                } else {
                    None
                };
                let filter = Filter {
                    since_ms: Some(now.saturating_sub(config.window_s * 1000)),
                    ..Filter::default()
                };
                (
                    feedback::quality::classes(&store, &filter, config.min_samples),
                    pruned,
                )
            })
            .await;
            let Ok((table, pruned)) = result else {
                continue;
            };
            if let Some(p) = pruned {
                pruned_at = std::time::Instant::now();
                match p {
                    Ok(n) => {
                        tracing::info!(target: "rampart::feedback", pruned = n, "feedback index pruned")
                    }
                    Err(e) => tracing::error!(error = %e, "feedback index could not be pruned"),
                }
            }
            match table {
                Ok(table) => {
                    let threshold = service.config.retrain.error_rate;
                    for q in table
                        .iter()
                        .filter(|q| q.enough && q.error_rate_lower > threshold)
                    {
                        let why = Trigger {
                            model: q.model.clone(),
                            version: Some(q.version.clone()),
                            class: Some(q.class.clone()),
                            error_rate_lower: Some(q.error_rate_lower),
                            by: "alert",
                        };
                        // In a fleet every replica sees the same shared store's rates: the
                        // hook runs once per cool-down for the fleet, by whoever claims it.
                        if !claimed_for_fleet(&state, &service, &why.model).await {
                            continue;
                        }
                        let _ = run_hook(&state, &service, why, "rampart").await;
                    }
                    shown = publish(&table, shown);
                }
                Err(e) => tracing::error!(error = %e, "feedback gauges could not be read"),
            }
        }
    });
}

/// Whether this replica runs the alert's retrain hook for `model`: outside a fleet always (its
/// own cool-down applies); in a fleet when it claims the hook in the fleet's database (once per
/// cool-down for the fleet), never while the database is down (the next look retries).
async fn claimed_for_fleet(
    state: &Arc<AppState>,
    service: &Arc<FeedbackService>,
    model: &str,
) -> bool {
    let Some(fleet) = state.releases.get().and_then(|r| r.fleet()).cloned() else {
        return true;
    };
    if service.config.retrain.command.is_none() {
        return false;
    }
    let cooldown_ms = service.config.retrain.cooldown_s.saturating_mul(1000);
    let key = model.to_string();
    let claimed = fleet
        .call("claim", move |s| s.claim("retrain", &key, cooldown_ms))
        .await;
    match claimed {
        Some(true) => true,
        Some(false) => {
            tracing::debug!(target: "rampart::feedback", model, "another replica ran the retrain hook within its cool-down");
            false
        }
        None => false,
    }
}

/// Why the retrain hook runs.
struct Trigger {
    model: String,
    version: Option<String>,
    class: Option<String>,
    error_rate_lower: Option<f64>,
    /// `alert` (a class crossed `[feedback.retrain] error_rate`) or `admin`.
    by: &'static str,
}

/// Runs the retrain hook for a model (once per `cooldown_s`), in the background: its output
/// goes to `<dir>/retrain/hook-<ms>-<model>.log`; the start and the end are logged, counted and
/// audited. Returns the log's path, or why it did not run.
async fn run_hook(
    state: &Arc<AppState>,
    service: &Arc<FeedbackService>,
    why: Trigger,
    principal: &str,
) -> Result<std::path::PathBuf, String> {
    let Some(command) = service.config.retrain.command.clone() else {
        return Err("no retrain hook is configured ([feedback.retrain] command)".into());
    };
    {
        let mut last = service
            .retrained
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let cooldown = Duration::from_secs(service.config.retrain.cooldown_s);
        if let Some(at) = last.get(&why.model) {
            if at.elapsed() < cooldown && why.by == "alert" {
                return Err(format!(
                    "the hook ran for {} {} s ago (cool-down {} s)",
                    why.model,
                    at.elapsed().as_secs(),
                    cooldown.as_secs()
                ));
            }
        }
        last.insert(why.model.clone(), std::time::Instant::now());
    }
    let dir = service.config.dir.join("retrain");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let safe: String = why
        .model
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let log_path = dir.join(format!("hook-{}-{safe}.log", feedback::now_ms()));
    let log =
        std::fs::File::create(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
    let err = log.try_clone().map_err(|e| e.to_string())?;
    let listen = state.config.listen;
    let url = format!("http://{listen}");
    let mut child = tokio::process::Command::new("sh");
    child
        .args(["-c", &command])
        .env("RAMPART_FEEDBACK_MODEL", &why.model)
        .env(
            "RAMPART_FEEDBACK_VERSION",
            why.version.as_deref().unwrap_or(""),
        )
        .env("RAMPART_FEEDBACK_CLASS", why.class.as_deref().unwrap_or(""))
        .env(
            "RAMPART_FEEDBACK_ERROR_RATE_LOWER",
            why.error_rate_lower
                .map(|r| format!("{r:.4}"))
                .unwrap_or_default(),
        )
        .env("RAMPART_FEEDBACK_TRIGGER", why.by)
        .env("RAMPART_FEEDBACK_DIR", &service.config.dir)
        .env("RAMPART_REPO", &state.config.repo)
        .env("RAMPART_URL", &url)
        .stdin(std::process::Stdio::null())
        .stdout(log)
        .stderr(err)
        .kill_on_drop(false);
    let mut running = child
        .spawn()
        .map_err(|e| format!("the retrain hook could not start: {e}"))?;
    tracing::warn!(
        target: "rampart::feedback",
        model = %why.model,
        version = why.version.as_deref().unwrap_or(""),
        class = why.class.as_deref().unwrap_or(""),
        error_rate_lower = why.error_rate_lower.unwrap_or(f64::NAN),
        trigger = why.by,
        log = %log_path.display(),
        "retrain hook started"
    );
    metrics::counter!("rampart_feedback_retrains_total", "model" => why.model.clone(), "trigger" => why.by, "outcome" => "started").increment(1);
    let _ = state
        .act(
            principal,
            Some(&why.model),
            audit::Action {
                name: "feedback.retrain".into(),
                target: Some(why.model.clone()),
                cause: Some(match (&why.class, why.error_rate_lower) {
                    (Some(c), Some(r)) => {
                        format!("class {c}: error rate ≥ {r:.3} (Wilson lower bound)")
                    }
                    _ => why.by.to_string(),
                }),
                outcome: "started".into(),
                detail: json!({ "command": command, "log": log_path, "trigger": why.by }),
            },
        )
        .await;
    let model = why.model.clone();
    let by = why.by;
    let shown = log_path.clone();
    tokio::spawn(async move {
        let outcome = match running.wait().await {
            Ok(s) if s.success() => "succeeded",
            Ok(_) | Err(_) => "failed",
        };
        let level_ok = outcome == "succeeded";
        if level_ok {
            tracing::info!(target: "rampart::feedback", model = %model, log = %shown.display(), "retrain hook succeeded");
        } else {
            tracing::error!(target: "rampart::feedback", model = %model, log = %shown.display(), "retrain hook failed");
        }
        metrics::counter!("rampart_feedback_retrains_total", "model" => model, "trigger" => by, "outcome" => outcome).increment(1);
    });
    Ok(log_path)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RetrainBody {
    model: String,
    class: Option<String>,
}

/// `POST /admin/feedback/retrain`: runs the hook now (no cool-down).
async fn retrain(
    State(state): State<Arc<AppState>>,
    Extension(identity::Principal(principal)): Extension<identity::Principal>,
    body: Bytes,
) -> Result<(StatusCode, Json<serde_json::Value>), crate::error::HttpError> {
    let service = Arc::clone(service(&state)?);
    let body: RetrainBody = serde_json::from_slice(&body).map_err(|e| {
        ApiError::invalid_param(
            "body",
            format!("{{\"model\": \"…\", \"class\": \"…\"}}: {e}"),
        )
    })?;
    if service.config.retrain.command.is_none() {
        return Err(ApiError::Conflict(
            "no retrain hook is configured ([feedback.retrain] command)".into(),
        )
        .into());
    }
    let why = Trigger {
        model: body.model.clone(),
        version: None,
        class: body.class.clone(),
        error_rate_lower: None,
        by: "admin",
    };
    let log = run_hook(&state, &service, why, &principal)
        .await
        .map_err(ApiError::Internal)?;
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({ "model": body.model, "status": "started", "log": log })),
    ))
}

/// Sets the per-class gauges; classes that left the window drop to no feedback.
fn publish(
    table: &[feedback::quality::ClassQuality],
    before: BTreeSet<(String, String, String)>,
) -> BTreeSet<(String, String, String)> {
    let mut now = BTreeSet::new();
    for q in table {
        let labels = [
            ("model", q.model.clone()),
            ("version", q.version.clone()),
            ("class", q.class.clone()),
        ];
        metrics::gauge!("rampart_class_error_rate", &labels).set(q.error_rate);
        metrics::gauge!("rampart_class_error_rate_lower", &labels).set(q.error_rate_lower);
        metrics::gauge!("rampart_class_feedback", &labels).set(q.feedback as f64);
        now.insert((q.model.clone(), q.version.clone(), q.class.clone()));
    }
    for (model, version, class) in before.difference(&now) {
        let labels = [
            ("model", model.clone()),
            ("version", version.clone()),
            ("class", class.clone()),
        ];
        metrics::gauge!("rampart_class_error_rate", &labels).set(0.0);
        metrics::gauge!("rampart_class_error_rate_lower", &labels).set(0.0);
        metrics::gauge!("rampart_class_feedback", &labels).set(0.0);
    }
    now
}
