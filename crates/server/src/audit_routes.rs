//! The audit log's routes under `/admin/audit` (keys with the `audit` scope). Lookups are by
//! exact key only — an audit id, or a user id with a time range — never free text, prefixes
//! or fuzzy matches; and every read is itself an entry of the log (who read which entries).
//!
//! - `GET /admin/audit/{audit_id}`: one entry;
//! - `GET /admin/audit?user_id=U[&from=T][&to=T][&limit=N][&after=I]`: a user's entries,
//!   oldest first, paginated (`next` is the `after` of the next page);
//! - `GET /admin/audit/{audit_id}/proof`: its inclusion proof against a signed checkpoint;
//! - `GET /admin/audit/consistency?first=N[&second=M]`: the consistency proof between two
//!   checkpoints (sizes);
//! - `GET /admin/audit/checkpoint`: the newest signed checkpoint and the public key;
//! - `GET /admin/audit/status`: the log's state (size, root, health, sealing).

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Json, Router};
use serde_json::json;

use crate::error::ApiError;
use crate::error::WireError;
use crate::identity::Principal;
use crate::paths;
use crate::state::AppState;

/// Most entries one page returns.
pub const MAX_PAGE: usize = 1000;

pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route(paths::ADMIN_AUDIT, get(list))
        .route(paths::ADMIN_AUDIT_CHECKPOINT, get(checkpoint))
        .route(paths::ADMIN_AUDIT_CONSISTENCY, get(consistency))
        .route(paths::ADMIN_AUDIT_STATUS, get(status))
        .route(paths::ADMIN_AUDIT_ENTRY, get(entry))
        .route(paths::ADMIN_AUDIT_PROOF, get(proof))
}

fn log(state: &AppState) -> Result<&Arc<audit::AuditLog>, ApiError> {
    state.audit.as_ref().ok_or_else(|| {
        ApiError::AuditUnavailable(
            "the audit log is off on this server ([audit] enabled = false)".into(),
        )
    })
}

/// Who read what: an entry of its own (in `fail_closed`, a read that cannot be kept is refused).
async fn read_noted(
    state: &AppState,
    by: &str,
    what: &str,
    ids: &[&str],
    query: serde_json::Value,
) -> Result<(), ApiError> {
    const SHOWN: usize = 100;
    let target = ids
        .iter()
        .take(SHOWN)
        .copied()
        .collect::<Vec<_>>()
        .join(",");
    state
        .act(
            by,
            None,
            audit::Action {
                name: format!("audit.{what}"),
                target: Some(target),
                cause: None,
                outcome: "ok".into(),
                detail: json!({ "query": query, "entries": ids.len() }),
            },
        )
        .await
}

fn internal(e: audit::AuditError) -> ApiError {
    match e {
        audit::AuditError::NotFound(m) => ApiError::AuditEntryNotFound(m),
        audit::AuditError::Config(m) => ApiError::invalid_param("user_id", m),
        other => ApiError::AuditUnavailable(other.to_string()),
    }
}

/// Runs `f` on the log off the async threads (it reads files).
async fn on_log<T: Send + 'static>(
    state: &AppState,
    f: impl FnOnce(&audit::AuditLog) -> Result<T, audit::AuditError> + Send + 'static,
) -> Result<T, ApiError> {
    let log = Arc::clone(log(state)?);
    tokio::task::spawn_blocking(move || f(&log))
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?
        .map_err(internal)
}

fn respond<T: serde::Serialize>(result: Result<T, ApiError>) -> Response {
    match result {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// One entry looked up by its audit id (`what`: `read` or `prove`), the read noted.
async fn by_id<T: serde::Serialize + Send + 'static>(
    state: &AppState,
    principal: &str,
    audit_id: String,
    what: &str,
    lookup: fn(&audit::AuditLog, &str) -> Result<Option<T>, audit::AuditError>,
) -> Response {
    let result = async {
        let id = audit_id.clone();
        let found = on_log(state, move |log| lookup(log, &id)).await?;
        let ids: Vec<&str> = found.iter().map(|_| audit_id.as_str()).collect();
        read_noted(
            state,
            principal,
            what,
            &ids,
            json!({ "audit_id": audit_id }),
        )
        .await?;
        found.ok_or_else(|| ApiError::AuditEntryNotFound(format!("no audit entry {audit_id:?}")))
    }
    .await;
    respond(result)
}

async fn entry(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(audit_id): Path<String>,
) -> Response {
    by_id(&state, &principal.0, audit_id, "read", |log, id| {
        log.get(id)
    })
    .await
}

async fn proof(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(audit_id): Path<String>,
) -> Response {
    by_id(&state, &principal.0, audit_id, "prove", |log, id| {
        log.prove(id)
    })
    .await
}

/// A time given as ms since the epoch or RFC 3339.
fn parse_time(name: &str, value: &str) -> Result<u64, ApiError> {
    if let Ok(ms) = value.parse::<u64>() {
        return Ok(ms);
    }
    audit::s3::parse_rfc3339(value)
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as u64)
        .ok_or_else(|| {
            ApiError::invalid_param(
                name,
                format!("{name}={value:?} is neither ms since the epoch nor an RFC 3339 time"),
            )
        })
}

async fn list(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let result = async {
        log(&state)?;
        if let Some(other) = query
            .keys()
            .find(|k| !matches!(k.as_str(), "user_id" | "from" | "to" | "limit" | "after"))
        {
            return Err(ApiError::invalid_param(
                other,
                format!(
                    "unknown parameter {other:?}: the audit log is queried by exact audit id \
                     (/admin/audit/{{audit_id}}) or by exact user_id with from, to, limit, after"
                ),
            ));
        }
        let Some(user) = query.get("user_id").filter(|u| !u.is_empty()) else {
            return Err(ApiError::invalid_param(
                "user_id",
                "the audit log is queried by exact audit id (/admin/audit/{audit_id}) or by exact user_id; no listing, prefix or text search",
            ));
        };
        let time = |k: &str| query.get(k).map(|v| parse_time(k, v)).transpose();
        let (from, to) = (time("from")?, time("to")?);
        let limit = match query.get("limit") {
            Some(v) => v
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=MAX_PAGE).contains(n))
                .ok_or_else(|| ApiError::invalid_param("limit", format!("limit must be 1..={MAX_PAGE}")))?,
            None => 100,
        };
        let after = match query.get("after") {
            Some(v) => Some(
                v.parse::<u64>()
                    .map_err(|_| ApiError::invalid_param("after", "after must be an entry index (the page's `next`)"))?,
            ),
            None => None,
        };
        let who = user.clone();
        let page = on_log(&state, move |log| log.by_user(&who, from, to, after, limit)).await?;
        let ids: Vec<&str> = page.entries.iter().map(|e| e.audit_id.as_str()).collect();
        read_noted(
            &state,
            &principal.0,
            "list",
            &ids,
            // The user id as the log stores it (the redaction policy applies to reads too).
            json!({
                "user_id": audit::entry::redact_string(user, state.config.audit.redact.user),
                "from": from, "to": to, "limit": limit, "after": after,
            }),
        )
        .await?;
        Ok(page)
    }
    .await;
    respond(result)
}

async fn consistency(
    State(state): State<Arc<AppState>>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let result = async {
        let size = |k: &str| {
            query
                .get(k)
                .map(|v| {
                    v.parse::<u64>()
                        .map_err(|_| ApiError::invalid_param(k, format!("{k} must be a tree size")))
                })
                .transpose()
        };
        let first = size("first")?.ok_or_else(|| {
            ApiError::invalid_param("first", "first (a checkpoint's size) is required")
        })?;
        let second = size("second")?;
        on_log(&state, move |log| log.consistency(first, second)).await
    }
    .await;
    respond(result)
}

async fn checkpoint(State(state): State<Arc<AppState>>) -> Response {
    match log(&state) {
        Ok(log) => Json(json!({
            "checkpoint": log.checkpoints().last(),
            "public_key": log.public_key_hex(),
        }))
        .into_response(),
        Err(e) => e.into_response(),
    }
}

async fn status(State(state): State<Arc<AppState>>) -> Response {
    match log(&state) {
        Ok(log) => Json(json!({
            "mode": state.config.audit.mode().as_str(),
            "log": log.status(),
        }))
        .into_response(),
        Err(e) => e.into_response(),
    }
}
