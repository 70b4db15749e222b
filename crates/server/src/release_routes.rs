//! The releases' admin API (`/admin/releases/…`, scope `admin`): read every release's state,
//! one release's plan, status and history, and steer it (`start`, `approve`, `promote`,
//! `pause`, `resume`, `rollback`). Each command is an audited admin action and a controller
//! decision written to the plan file before the answer.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use release::controller::Command;
use release::plan::Mode;
use serde::Deserialize;

use crate::error::ApiError;
use crate::error::WireError;
use crate::identity::Principal;
use crate::model_path::ModelPath;
use crate::paths;
use crate::release_plans::{CommandError, Releases};
use crate::state::AppState;

/// The release routes (the caller adds the `admin` scope check).
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route(paths::ADMIN_RELEASES, get(list))
        .route(paths::ADMIN_RELEASE, get(show))
        .route(paths::ADMIN_RELEASE_ACTION, post(act))
        .route(paths::ADMIN_FLEET, get(fleet_view))
}

/// `GET /admin/fleet`: the replicas (last heartbeat, readiness, load, versions), the judge's
/// holder and every release's pooled state; 404 without `[fleet]`. Read from the database at
/// most twice a second, however often it is asked.
async fn fleet_view(State(state): State<Arc<AppState>>) -> Response {
    let Some(releases) = state.releases.get() else {
        return ApiError::invalid("releases are off ([releases] enabled = false)").into_response();
    };
    let Some(fleet) = releases.fleet() else {
        return ApiError::RouteNotFound(
            "this server is not a replica of a fleet ([fleet] is off; docs/fleet.md)".into(),
        )
        .into_response();
    };
    Json(&*crate::fleet::cached_view(fleet, releases).await).into_response()
}

fn releases_of(state: &AppState) -> Result<&Arc<Releases>, ApiError> {
    state
        .releases
        .get()
        .ok_or_else(|| ApiError::invalid("releases are off ([releases] enabled = false)"))
}

/// `GET /admin/releases`: every release's status.
async fn list(State(state): State<Arc<AppState>>) -> Response {
    match releases_of(&state) {
        Ok(r) => Json(serde_json::json!({ "releases": r.views() })).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /admin/releases/{name}`: the plan (settings, state, history) and the judge's status.
async fn show(State(state): State<Arc<AppState>>, model: ModelPath) -> Response {
    let name = model.name();
    let r = match releases_of(&state) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let Some(m) = r.get(name) else {
        return ApiError::ModelNotFound(format!(
            "the model {name:?} has no release plan (start one with POST /admin/releases/{name}/start)"
        ))
        .into_response();
    };
    let plan = m.plan();
    Json(serde_json::json!({
        "model": name,
        "status": m.status(),
        "plan": &*plan,
    }))
    .into_response()
}

/// The body of a release command (every field optional; `start` needs `candidate`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct CommandBody {
    candidate: Option<String>,
    mode: Option<Mode>,
    reason: Option<String>,
    /// `start`: the gates' results (`rampart release gate … --start` runs them against this
    /// server's stable and candidate on the model's golden set).
    gates: Option<GateSubmission>,
    /// `start`, `promote`: go on although the candidate is below its maturity level, for this
    /// reason (audited with the failing checks).
    maturity_override: Option<String>,
}

/// The gates' results a `start` carries; kept beside the plan (`gates/<candidate>.json`).
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
struct GateSubmission {
    passed: bool,
    /// One line per gate (`eval: passed`, `latency: refused: p95 1.31x > 1.10x`).
    summary: String,
    /// The golden set's digest.
    golden_digest: Option<String>,
    /// The reports as the gates made them (`release::gates::GateReport`).
    #[serde(default)]
    reports: Vec<serde_json::Value>,
}

/// `POST /admin/releases/{name}/{action}`.
async fn act(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    model: ModelPath,
    Path(params): Path<std::collections::HashMap<String, String>>,
    body: axum::body::Bytes,
) -> Response {
    let action = params.get("action").map_or("", String::as_str);
    match act_inner(&state, &principal.0, model.name(), action, &body).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn act_inner(
    state: &Arc<AppState>,
    principal: &str,
    name: &str,
    action: &str,
    body: &[u8],
) -> Result<serde_json::Value, ApiError> {
    let releases = releases_of(state)?;
    if let Some(refusal) = state.front.audit_refusal() {
        return Err(refusal);
    }
    let body: CommandBody = if body.iter().all(u8::is_ascii_whitespace) {
        CommandBody::default()
    } else {
        serde_json::from_slice(body)
            .map_err(|e| ApiError::invalid(format!("the body is not a release command: {e}")))?
    };
    // The gates' results are evidence whatever follows: kept before the maturity check reads
    // them.
    if let (Some(gates), "start") = (&body.gates, action) {
        keep_gates(
            state,
            name,
            body.candidate.as_deref().unwrap_or(""),
            principal,
            gates,
        )
        .await;
    }
    let promoted = match action {
        "start" => body.candidate.clone(),
        "promote" => releases.get(name).and_then(|m| m.plan().candidate.clone()),
        _ => None,
    };
    if let Some(candidate) = promoted {
        check_maturity(state, principal, name, &candidate, action, &body).await?;
    }
    let command = match action {
        "prepare" => return prepare(state, releases, name, &body, principal).await,
        "start" => start_command(state, releases, name, &body).await?,
        "approve" => Command::Approve,
        "promote" => Command::Promote,
        "pause" => Command::Pause,
        "resume" => Command::Resume,
        "rollback" => Command::Rollback {
            reason: body
                .reason
                .clone()
                .unwrap_or_else(|| format!("rolled back by {principal}")),
        },
        other => {
            return Err(ApiError::invalid_param(
                "action",
                format!(
                    "unknown release action {other:?}: use prepare, start, approve, promote, pause, resume or rollback"
                ),
            ))
        }
    };
    let stable = served_stable(state, name, body.candidate.as_deref());
    let refused = |e: CommandError| match e {
        CommandError::Refused(m) => ApiError::Conflict(m),
        CommandError::NoPlan(..) => ApiError::ModelNotFound(e.to_string()),
        CommandError::Release(e) => ApiError::Internal(e.to_string()),
        CommandError::FleetUnavailable => ApiError::Unavailable {
            message: e.to_string(),
            retry_after_s: 5,
        },
    };
    let mut decision = releases
        .command(name, stable.as_deref(), command, principal)
        .await
        .map_err(refused)?;
    // A start with the gates' results: kept beside the plan, then judged (a refused gate ends
    // the release before any traffic, with the table in the history's reason).
    if let (Some(gates), "start") = (&body.gates, action) {
        decision = releases
            .command(
                name,
                None,
                Command::GateResult {
                    passed: gates.passed,
                    detail: gates.summary.clone(),
                },
                principal,
            )
            .await
            .map_err(refused)?;
    }
    let detail = serde_json::to_value(&decision).unwrap_or_default();
    state
        .act(
            principal,
            Some(name),
            audit::Action {
                name: format!("release.{action}"),
                target: Some(name.to_string()),
                cause: Some(decision.reason.clone()),
                outcome: "ok".into(),
                detail: detail.clone(),
            },
        )
        .await?;
    let status = releases.get(name).map(|m| m.status());
    Ok(serde_json::json!({ "decision": detail, "status": status }))
}

/// A candidate below its model's maturity level (`[[models]] min_maturity`, else `[maturity]
/// min_level`) does not start or get promoted: refused (409) with the failing checks named,
/// unless the command carries `maturity_override` with a reason. Either way an audited action.
async fn check_maturity(
    state: &Arc<AppState>,
    principal: &str,
    name: &str,
    candidate: &str,
    action: &str,
    body: &CommandBody,
) -> Result<(), ApiError> {
    let model = crate::maturity::model_config(&state.config, name);
    let Some(required) = state.config.maturity.required(&model) else {
        return Ok(());
    };
    let repository = repo::Repository::open(&state.config.repo);
    let version = crate::maturity::version_of(&repository, &format!("{name}@{candidate}"))
        .map_err(|e| ApiError::invalid_param("candidate", e.to_string()))?;
    let report = crate::maturity::report_served(state, repository, version)
        .await
        .map_err(ApiError::Internal)?;
    let Some(shortfall) = report.shortfall(required) else {
        return Ok(());
    };
    let missing: Vec<String> = report
        .missing_for(required)
        .iter()
        .map(|c| c.id.clone())
        .collect();
    let reason = body
        .maturity_override
        .as_deref()
        .map(str::trim)
        .filter(|r| !r.is_empty());
    state
        .act(
            principal,
            Some(name),
            audit::Action {
                name: format!("release.{action}.maturity"),
                target: Some(format!("{name}@{candidate}")),
                cause: Some(match reason {
                    Some(r) => format!("override: {r}; {shortfall}"),
                    None => shortfall.clone(),
                }),
                outcome: if reason.is_some() {
                    "overridden"
                } else {
                    "refused"
                }
                .into(),
                detail: serde_json::json!({
                    "level": report.level,
                    "required": required,
                    "missing": missing,
                    "override": reason,
                }),
            },
        )
        .await?;
    match reason {
        Some(r) => {
            tracing::warn!(target: "rampart::maturity", model = name, candidate, level = %report.level, required = %required, reason = r, "maturity override: the release goes on below the required level");
            Ok(())
        }
        None => Err(ApiError::Conflict(format!(
            "{shortfall}; `GET /admin/models/{name}/maturity?version={candidate}` shows each check's evidence and fix, and \"maturity_override\": \"why\" goes on anyway (audited)"
        ))),
    }
}

/// `prepare`: loads the candidate (for the gates to run against it before any traffic goes
/// to it); an audited admin action, no decision.
async fn prepare(
    state: &Arc<AppState>,
    releases: &Releases,
    name: &str,
    body: &CommandBody,
    principal: &str,
) -> Result<serde_json::Value, ApiError> {
    let Some(candidate) = body.candidate.as_deref() else {
        return Err(ApiError::invalid_param(
            "candidate",
            "prepare needs the candidate version: {\"candidate\": \"1.1.0\"}",
        ));
    };
    if releases.get(name).is_none() && served_stable(state, name, Some(candidate)).is_none() {
        return Err(ApiError::ModelNotFound(format!(
            "the model {name:?} is not served"
        )));
    }
    crate::release_control::ensure_loaded(state, name, candidate)
        .await
        .map_err(|e| ApiError::invalid_param("candidate", e.to_string()))?;
    state
        .act(
            principal,
            Some(name),
            audit::Action {
                name: "release.prepare".into(),
                target: Some(format!("{name}@{candidate}")),
                cause: None,
                outcome: "ok".into(),
                detail: serde_json::json!({ "candidate": candidate }),
            },
        )
        .await?;
    Ok(serde_json::json!({ "model": name, "candidate": candidate, "loaded": true }))
}

/// The version a new plan starts from: the one the model's name serves (its stable), or,
/// when none was set, the newest served version other than the candidate.
fn served_stable(state: &AppState, name: &str, candidate: Option<&str>) -> Option<String> {
    state
        .front
        .registry
        .stable_version(name)
        .or_else(|| state.front.registry.newest_version(name, candidate))
}

/// `start`: the candidate exists in the repository and is loaded (loaded now when it is not),
/// its tokenizer is compared with the stable's.
async fn start_command(
    state: &Arc<AppState>,
    releases: &Releases,
    name: &str,
    body: &CommandBody,
) -> Result<Command, ApiError> {
    let Some(candidate) = body.candidate.clone() else {
        return Err(ApiError::invalid_param(
            "candidate",
            "start needs the candidate version: {\"candidate\": \"1.1.0\"}",
        ));
    };
    let stable = match releases.get(name) {
        Some(m) => m.plan().stable.clone(),
        None => served_stable(state, name, Some(&candidate))
            .ok_or_else(|| ApiError::ModelNotFound(format!("the model {name:?} is not served")))?,
    };
    if stable == candidate {
        return Err(ApiError::invalid_param(
            "candidate",
            format!("{candidate} is already the stable version of {name}"),
        ));
    }
    let tokenizer = tokenizer_change(state, name, &stable, &candidate).await?;
    if let Some(why) = &tokenizer {
        tracing::warn!(target: "rampart::release", model = name, candidate, why, "the candidate's tokenizer differs from the stable's");
    }
    // A tokenizer change without the plan's approval is refused by the controller: the
    // candidate is not loaded for it.
    let approved = releases
        .get(name)
        .is_some_and(|m| m.plan().approval.tokenizer_change_approved);
    if tokenizer.is_none() || approved {
        crate::release_control::ensure_loaded(state, name, &candidate)
            .await
            .map_err(|e| ApiError::invalid_param("candidate", e.to_string()))?;
    }
    let declared = releases
        .get(name)
        .is_some_and(|m| !m.plan().gates.is_empty());
    if declared && body.gates.is_none() {
        return Err(ApiError::Conflict(format!(
            "the release plan of {name} declares gates ([gates]): run them with `rampart release gate {name} --candidate {candidate} --start`"
        )));
    }
    Ok(Command::Start {
        candidate,
        mode: body.mode,
        tokenizer_change: tokenizer,
        // With results, the start waits in `gating` for them (the next command).
        gates_passed: if body.gates.is_some() {
            None
        } else {
            Some(true)
        },
    })
}

/// Writes the gates' results beside the plan (`<repo>/<name>/gates/<candidate>.json`).
async fn keep_gates(
    state: &AppState,
    name: &str,
    candidate: &str,
    principal: &str,
    gates: &GateSubmission,
) {
    let dir = state.config.repo.join(name).join("gates");
    let path = dir.join(format!("{candidate}.json"));
    let body = serde_json::json!({
        "model": name,
        "candidate": candidate,
        "by": principal,
        "time_ms": std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        "gates": gates,
    });
    let written = tokio::task::spawn_blocking(move || {
        std::fs::create_dir_all(&dir)?;
        std::fs::write(&path, serde_json::to_vec_pretty(&body).unwrap_or_default())
    })
    .await;
    if !matches!(written, Ok(Ok(()))) {
        tracing::error!(target: "rampart::release", model = name, candidate, "the gates' results could not be kept beside the plan");
    }
}

/// Why the candidate's tokenizer differs from the stable's, if it does (`rampart model diff`).
async fn tokenizer_change(
    state: &AppState,
    name: &str,
    stable: &str,
    candidate: &str,
) -> Result<Option<String>, ApiError> {
    let repo_dir = state.config.repo.clone();
    let (name, stable, candidate) = (name.to_string(), stable.to_string(), candidate.to_string());
    tokio::task::spawn_blocking(move || {
        let repository = repo::Repository::open(&repo_dir);
        let version = |v: &str| -> Result<repo::ModelVersion, ApiError> {
            let parsed = semver::Version::parse(v)
                .map_err(|e| ApiError::invalid_param("candidate", format!("{v:?}: {e}")))?;
            repository
                .resolve(&repo::ModelRef {
                    name: name.clone(),
                    version: Some(parsed),
                })
                .map_err(|e| ApiError::ModelNotFound(e.to_string()))
        };
        let old = version(&stable)?;
        let new = version(&candidate).map_err(|e| match e {
            ApiError::ModelNotFound(why) => ApiError::invalid_param("candidate", why),
            e => e,
        })?;
        repo::diff::tokenizer_change(&repository, &old, &new)
            .map_err(|e| ApiError::Internal(e.to_string()))
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))?
}
