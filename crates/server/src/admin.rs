//! The admin API under `/admin/…` (keys with the `admin` scope): the backends with their chains,
//! breakers and hand-offs; pausing and resuming a model's hand-off; fault injection for drills;
//! the doctor's report on the host (`GET /admin/doctor`, itself an audited action); the
//! monitors' state and baselines (`/admin/monitors`); a model version's maturity report
//! (`GET /admin/models/{name}/maturity`, docs/maturity.md).
//! Every call that changes something is logged with who made it (the key and `X-Operator-Id`),
//! counted in `rampart_admin_actions_total{action}` and kept in the audit log; in `fail_closed`
//! a change the audit log cannot keep is refused before it is made.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::{Extension, Json, Router};
use serde::{Deserialize, Serialize};

use crate::breaker::BreakerView;
use crate::doctor::{self, DoctorView};
use crate::error::ApiError;
use crate::error::WireError;
use crate::faults::{self, Fault, FaultRequest};
use crate::handoff::HandoffView;
use crate::identity::Principal;
use crate::model_path::ModelPath;
use crate::paths;
use crate::registry::Entry;
use crate::state::AppState;

/// The admin routes (the caller adds the `admin` scope check).
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route(paths::ADMIN_BACKENDS, get(backends))
        .route(paths::ADMIN_HANDOFF, post(handoff))
        .route(
            paths::ADMIN_FAULTS,
            get(list_faults).post(inject_fault).delete(clear_faults),
        )
        .route(paths::ADMIN_FAULT, delete(clear_fault))
        .route(paths::ADMIN_DOCTOR, get(doctor_report))
        .route(paths::ADMIN_MATURITY, get(maturity_report))
        .route(paths::ADMIN_MONITORS, get(monitors))
        .route(paths::ADMIN_DEGRADATION, get(degradation))
        .route(
            paths::ADMIN_MONITOR_BASELINE,
            put(replace_baseline).delete(recapture_baseline),
        )
}

fn monitors_of(state: &AppState) -> Result<&Arc<crate::monitors::Monitors>, ApiError> {
    state
        .monitors
        .get()
        .ok_or_else(|| ApiError::invalid("the monitors are off ([monitor] enabled = false)"))
}

/// The monitors, for a change: refused in `fail_closed` while the audit log cannot keep it, or
/// when the monitors are off.
fn changing_monitors(state: &AppState) -> Result<&Arc<crate::monitors::Monitors>, ApiError> {
    match state.front.audit_refusal() {
        Some(e) => Err(e),
        None => monitors_of(state),
    }
}

/// `GET /admin/monitors`: every model version's drift detector (phase, baseline, window, each
/// feature's last statistic, p-value and effect, recent alarms) and output monitors. A read,
/// audited like the doctor's.
async fn monitors(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
) -> Response {
    let m = match monitors_of(&state) {
        Ok(m) => m,
        Err(e) => return e.into_response(),
    };
    let views = m.views();
    let detail = serde_json::json!({ "versions": views.len() });
    if let Err(e) = note(
        &state,
        &principal.0,
        "monitors.read",
        "monitors",
        None,
        detail,
    )
    .await
    {
        return e.into_response();
    }
    Json(serde_json::json!({ "monitors": views })).into_response()
}

/// `PUT /admin/monitors/{name}/versions/{version}/baseline`: replaces the version's baseline
/// with the body (a baseline as `GET` shows it kept on disk: columns, rows, categorical
/// counts); kept on disk first, then the windows start over (and the calibrated mode
/// calibrates it).
async fn replace_baseline(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    model: ModelPath,
    body: axum::body::Bytes,
) -> Response {
    let (name, version) = (
        model.name().to_string(),
        model.version().unwrap_or_default(),
    );
    let m = match changing_monitors(&state) {
        Ok(m) => m,
        Err(e) => return e.into_response(),
    };
    let baseline: monitor::Baseline = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => {
            return ApiError::invalid(format!("the body is not a baseline: {e}")).into_response()
        }
    };
    let detail = serde_json::json!({
        "source": baseline.source,
        "rows": baseline.rows.len(),
        "columns": baseline.columns,
        "categorical": baseline.categorical.keys().collect::<Vec<_>>(),
    });
    // The baseline is written to disk: off the async workers.
    let replaced = {
        let (m, name, version) = (Arc::clone(m), name.clone(), version.clone());
        tokio::task::spawn_blocking(move || m.replace_baseline(&name, &version, baseline)).await
    };
    match replaced {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return ApiError::invalid(format!("baseline refused: {e}")).into_response(),
        Err(e) => {
            return ApiError::Internal(format!("the baseline task stopped: {e}")).into_response()
        }
    }
    let target = format!("{name}@{version}");
    if let Err(e) = note(
        &state,
        &principal.0,
        "monitors.baseline_replaced",
        &target,
        Some(&name),
        detail,
    )
    .await
    {
        return e.into_response();
    }
    tracing::info!(target: "rampart::monitor", model = %name, version = %version, by = %principal.0, "monitor baseline replaced");
    Json(serde_json::json!({ "replaced": true, "model": name, "version": version })).into_response()
}

/// `DELETE /admin/monitors/{name}/versions/{version}/baseline`: forgets the baseline; the next
/// `baseline_requests` requests become the new one.
async fn recapture_baseline(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    model: ModelPath,
) -> Response {
    let (name, version) = (
        model.name().to_string(),
        model.version().unwrap_or_default(),
    );
    let m = match changing_monitors(&state) {
        Ok(m) => m,
        Err(e) => return e.into_response(),
    };
    let recaptured = {
        let (m, name, version) = (Arc::clone(m), name.clone(), version.clone());
        tokio::task::spawn_blocking(move || m.recapture(&name, &version)).await
    };
    let found = match recaptured {
        Ok(Ok(found)) => found,
        Ok(Err(e)) => return ApiError::Internal(e.to_string()).into_response(),
        Err(e) => {
            return ApiError::Internal(format!("the baseline task stopped: {e}")).into_response()
        }
    };
    let target = format!("{name}@{version}");
    let detail = serde_json::json!({ "found": found });
    if let Err(e) = note(
        &state,
        &principal.0,
        "monitors.baseline_reset",
        &target,
        Some(&name),
        detail,
    )
    .await
    {
        return e.into_response();
    }
    tracing::info!(target: "rampart::monitor", model = %name, version = %version, by = %principal.0, "monitor baseline reset: capturing anew");
    Json(serde_json::json!({ "reset": found, "model": name, "version": version })).into_response()
}

/// One admin action: logged, counted and audited (see [`AppState::act`]).
async fn note(
    state: &AppState,
    by: &str,
    action: &str,
    target: &str,
    model: Option<&str>,
    detail: serde_json::Value,
) -> Result<(), ApiError> {
    state
        .act(
            by,
            model,
            audit::Action {
                name: action.to_string(),
                target: Some(target.to_string()),
                cause: None,
                outcome: "ok".into(),
                detail,
            },
        )
        .await
}

/// `fail_closed`: no change is made while the audit log cannot keep it.
fn refused(state: &AppState) -> Option<Response> {
    state.front.audit_refusal().map(WireError::into_response)
}

#[derive(Serialize)]
struct BackendView {
    id: String,
    model: String,
    version: String,
    kind: String,
    platform: String,
    ready: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    problem: Option<String>,
    breaker: BreakerView,
}

fn backend_view(e: &Entry) -> BackendView {
    BackendView {
        id: e.id.clone(),
        model: e.name.clone(),
        version: e.version.clone(),
        kind: format!("{:?}", e.kind()).to_ascii_lowercase(),
        platform: e.backend.describe().platform,
        ready: e.is_ready(),
        problem: e.backend.health().problem,
        breaker: e.breaker.view(),
    }
}

#[derive(Serialize)]
struct StepView {
    /// 1 for the first fallback.
    step: usize,
    target: String,
    on: Vec<&'static str>,
    /// The step's own backend (canned answers, tensor twins); served models are listed in
    /// `backends` themselves.
    #[serde(skip_serializing_if = "Option::is_none")]
    backend: Option<BackendView>,
}

#[derive(Serialize)]
struct ModelView {
    #[serde(flatten)]
    backend: BackendView,
    first_token_timeout_ms: u64,
    stall_timeout_ms: u64,
    chain: Vec<StepView>,
    handoff: HandoffView,
    /// The degradation controller's state (language models).
    #[serde(skip_serializing_if = "Option::is_none")]
    degradation: Option<crate::degradation::ModelView>,
}

#[derive(Serialize)]
struct BackendsView {
    backends: Vec<ModelView>,
    faults: Vec<Fault>,
}

/// `GET /admin/backends`: every served backend, its chain, breaker and hand-off.
async fn backends(State(state): State<Arc<AppState>>) -> Json<BackendsView> {
    let mut entries = state.front.registry.all();
    entries.sort_by(|a, b| a.id.cmp(&b.id));
    let backends = entries
        .iter()
        .map(|e| ModelView {
            backend: backend_view(e),
            first_token_timeout_ms: e.policy.first_token_timeout.as_millis() as u64,
            stall_timeout_ms: e.policy.stall_timeout.as_millis() as u64,
            chain: e
                .policy
                .steps
                .iter()
                .enumerate()
                .map(|(i, s)| StepView {
                    step: i + 1,
                    target: s.target.describe(),
                    on: s.on.iter().map(|t| t.as_str()).collect(),
                    backend: match &s.target {
                        crate::chain::Target::Own(own) => Some(backend_view(own)),
                        crate::chain::Target::Model(_) => None,
                    },
                })
                .collect(),
            handoff: state.front.handoffs.get(&e.name).view(),
            degradation: state.degradation.model(&e.id),
        })
        .collect();
    Json(BackendsView {
        backends,
        faults: state.front.faults.list(),
    })
}

/// `GET /admin/degradation`: each language model's degradation controller: its level,
/// limits and ceilings, objectives, the signals of the last window and the latest changes.
async fn degradation(
    State(state): State<Arc<AppState>>,
) -> Json<crate::degradation::DegradationView> {
    Json(state.degradation.view(&state.config))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HandoffAction {
    /// `pause` (hand off now, until resumed) or `resume`.
    action: String,
}

/// `POST /admin/models/{name}/handoff` with `{"action": "pause" | "resume"}`.
async fn handoff(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    model: ModelPath,
    body: axum::body::Bytes,
) -> Response {
    let name = model.name().to_string();
    let action: HandoffAction = match serde_json::from_slice(&body) {
        Ok(a) => a,
        Err(e) => {
            return ApiError::invalid(format!(
                "the body must be {{\"action\": \"pause\" | \"resume\"}}: {e}"
            ))
            .into_response()
        }
    };
    if !state.front.registry.all().iter().any(|e| e.name == name) {
        return ApiError::ModelNotFound(format!("no served model {name:?}")).into_response();
    }
    if let Some(r) = refused(&state) {
        return r;
    }
    let (what, effect) = match action.action.as_str() {
        "pause" => ("handoff_pause", "new requests get 503 human_handoff"),
        "resume" => ("handoff_resume", "requests are served again"),
        other => {
            return ApiError::invalid_param(
                "action",
                format!("unknown action {other:?}: pause or resume"),
            )
            .into_response()
        }
    };
    // Kept first, then done: a change the audit log could not keep is not made.
    let detail = serde_json::json!({ "effect": effect });
    if let Err(e) = note(&state, &principal.0, what, &name, Some(&name), detail).await {
        return e.into_response();
    }
    let h = state.front.handoffs.get(&name);
    let view = if what == "handoff_pause" {
        h.pause(&principal.0)
    } else {
        h.resume(&principal.0)
    };
    // In a fleet an admin's pause or resume is the fleet's: every replica follows at its next
    // tick.
    if let Some(fleet) = state.releases.get().and_then(|r| r.fleet()).cloned() {
        let (model, active) = (name.clone(), what == "handoff_pause");
        let why = if active {
            format!("paused by {}", principal.0)
        } else {
            format!("resumed by {}", principal.0)
        };
        let seq = fleet
            .call("handoff", move |s| {
                s.set_handoff(&model, active, &why, None)
            })
            .await;
        if seq.is_none() {
            return ApiError::Unavailable {
                message:
                    "the fleet's database cannot be reached: the change holds on this replica only"
                        .into(),
                retry_after_s: 5,
            }
            .into_response();
        }
    }
    Json(view).into_response()
}

async fn list_faults(State(state): State<Arc<AppState>>) -> Json<Vec<Fault>> {
    Json(state.front.faults.list())
}

/// `POST /admin/faults`: inject a fault (see [`FaultRequest`]).
async fn inject_fault(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    body: axum::body::Bytes,
) -> Response {
    let request: FaultRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return ApiError::invalid(format!("invalid fault: {e}")).into_response(),
    };
    let known = |backend: &str| {
        state
            .front
            .registry
            .all()
            .iter()
            .any(|e| e.backends().iter().any(|b| faults::covers(backend, &b.id)))
    };
    if let Some(r) = refused(&state) {
        return r;
    }
    let detail = serde_json::json!({
        "mode": format!("{:?}", request.mode),
        "duration_s": request.duration_s,
    });
    let target = request.backend.clone();
    let fleet = state.releases.get().and_then(|r| r.fleet()).cloned();
    let scope = request.scope;
    if scope == faults::FaultScope::Fleet && fleet.is_none() {
        return ApiError::invalid_param(
            "scope",
            "scope fleet needs a fleet ([fleet]); this server is alone: use scope replica",
        )
        .into_response();
    }
    let shared = serde_json::to_string(&request).unwrap_or_default();
    let duration_ms = (request.duration_s * 1e3) as u64;
    match state.front.faults.inject(request, &principal.0, known) {
        Ok(mut fault) => {
            if let Err(e) = note(&state, &principal.0, "fault_inject", &target, None, detail).await
            {
                // Not kept, so not made: the fault is taken back.
                state.front.faults.clear(Some(fault.id), &principal.0);
                return e.into_response();
            }
            if let (faults::FaultScope::Fleet, Some(fleet)) = (scope, fleet) {
                let by = principal.0.clone();
                let added = fleet
                    .call("fault", move |s| s.add_fault(&shared, &by, duration_ms))
                    .await;
                let Some(fleet_id) = added else {
                    state.front.faults.clear(Some(fault.id), &principal.0);
                    return ApiError::Unavailable {
                        message: "the fleet's database cannot be reached: a fleet fault cannot be given to every replica".into(),
                        retry_after_s: 5,
                    }
                    .into_response();
                };
                state.front.faults.set_fleet_id(fault.id, fleet_id);
                fault.fleet_id = Some(fleet_id);
                tracing::warn!(target: "rampart::fleet", fault = fault.id, fleet_fault = fleet_id, backend = %fault.backend, "fault given to every replica of the fleet");
            }
            (StatusCode::CREATED, Json(fault)).into_response()
        }
        Err(e) if !state.front.faults.enabled() => ApiError::Forbidden(e.0).into_response(),
        Err(e) => ApiError::invalid(e.0).into_response(),
    }
}

#[derive(Serialize)]
struct Cleared {
    cleared: usize,
}

async fn clear_faults(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
) -> Response {
    if let Some(r) = refused(&state) {
        return r;
    }
    // Kept first, then done.
    let active: Vec<u64> = state.front.faults.list().iter().map(|f| f.id).collect();
    let detail = serde_json::json!({ "faults": active });
    if let Err(e) = note(&state, &principal.0, "fault_clear", "*", None, detail).await {
        return e.into_response();
    }
    let shared: Vec<i64> = state
        .front
        .faults
        .list()
        .iter()
        .filter_map(|f| f.fleet_id)
        .collect();
    clear_in_fleet(&state, shared).await;
    let cleared = state.front.faults.clear(None, &principal.0);
    Json(Cleared { cleared }).into_response()
}

/// Clears fleet faults everywhere (each replica drops them at its next tick).
async fn clear_in_fleet(state: &Arc<AppState>, ids: Vec<i64>) {
    if ids.is_empty() {
        return;
    }
    if let Some(fleet) = state.releases.get().and_then(|r| r.fleet()).cloned() {
        fleet.call("fault", move |s| s.clear_faults(&ids)).await;
    }
}

async fn clear_fault(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<u64>,
) -> Response {
    if let Some(r) = refused(&state) {
        return r;
    }
    if !state.front.faults.list().iter().any(|f| f.id == id) {
        return ApiError::RouteNotFound(format!("no active fault {id}")).into_response();
    }
    let detail = serde_json::json!({ "faults": [id] });
    if let Err(e) = note(
        &state,
        &principal.0,
        "fault_clear",
        &id.to_string(),
        None,
        detail,
    )
    .await
    {
        return e.into_response();
    }
    let shared: Vec<i64> = state
        .front
        .faults
        .list()
        .iter()
        .filter(|f| f.id == id)
        .filter_map(|f| f.fleet_id)
        .collect();
    clear_in_fleet(&state, shared).await;
    let cleared = state.front.faults.clear(Some(id), &principal.0);
    Json(Cleared { cleared }).into_response()
}

/// `GET /admin/doctor`: the doctor's report on this host with the server's own configuration
/// (its ports are not bound again: the server holds them; the repository is not re-verified:
/// loading verifies each version) and the hardware fingerprint, computed now on a blocking
/// thread. The read is an action of its own: logged, counted and audited, and in
/// `fail_closed` not answered when the audit log cannot keep it.
async fn doctor_report(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
) -> Response {
    if let Some(r) = refused(&state) {
        return r;
    }
    let config = state.config.clone();
    let view: DoctorView = match tokio::task::spawn_blocking(move || doctor::examine(&config)).await
    {
        Ok(view) => view,
        Err(e) => return ApiError::Internal(format!("the doctor failed: {e}")).into_response(),
    };
    let counts = view.report.counts;
    let detail = serde_json::json!({
        "ok": counts.ok,
        "warn": counts.warn,
        "error": counts.error,
        "unknown": counts.unknown,
    });
    if let Err(e) = note(&state, &principal.0, "doctor", "host", None, detail).await {
        return e.into_response();
    }
    Json(view).into_response()
}

/// `?version=` of `GET /admin/models/{name}/maturity`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MaturityQuery {
    version: Option<String>,
}

/// `GET /admin/models/{name}/maturity[?version=V]`: the maturity report of a version (the one
/// the name serves when none is given) with the evidence of this server: its configuration,
/// the doctor on this host, the Prometheus it names. A read, audited like the doctor's. One
/// report is made at a time (a version that is not loaded is hashed): a second caller gets
/// 429 with Retry-After.
async fn maturity_report(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(name): Path<String>,
    query: Result<axum::extract::Query<MaturityQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let query = match query {
        Ok(axum::extract::Query(q)) => q,
        Err(e) => {
            return ApiError::invalid(format!("the query: {}", e.body_text())).into_response()
        }
    };
    let reference = match &query.version {
        Some(v) => format!("{name}@{v}"),
        None => name.clone(),
    };
    let repository = repo::Repository::open(&state.config.repo);
    let version = match crate::maturity::version_of(&repository, &reference) {
        Ok(v) => v,
        Err(
            e @ (repo::RepoError::InvalidName { .. }
            | repo::RepoError::InvalidVersion { .. }
            | repo::RepoError::InvalidRef(_)),
        ) => return ApiError::invalid_param("model", e.to_string()).into_response(),
        Err(e) => return ApiError::ModelNotFound(e.to_string()).into_response(),
    };
    // After the name is checked: a bad name never takes the one permit.
    static ONE_AT_A_TIME: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);
    let Ok(_permit) = ONE_AT_A_TIME.try_acquire() else {
        return ApiError::Overloaded {
            code: "maturity_busy",
            booking: None,
            message: "a maturity report is being made; retry shortly".into(),
            retry_after_s: 2,
        }
        .into_response();
    };
    let report = match crate::maturity::report_served(&state, repository, version).await {
        Ok(r) => r,
        Err(e) => return ApiError::Internal(e).into_response(),
    };
    let detail = serde_json::json!({
        "version": report.version,
        "level": report.level,
    });
    if let Err(e) = note(
        &state,
        &principal.0,
        "maturity",
        &format!("{}@{}", report.model, report.version),
        Some(&report.model),
        detail,
    )
    .await
    {
        return e.into_response();
    }
    Json(report).into_response()
}
