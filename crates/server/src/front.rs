//! The front: the one pipeline every protocol calls once it has decoded its wire format.
//!
//! drain check → guard → route → admission → backend. Each protocol's handler is decode →
//! [`serve`] → encode; nothing below this line knows the protocol, nothing above it knows the
//! model. The record of the request is filled on the way (model, version, digest, queue time,
//! the refusal and its reason) and settled once by [`settle`].
//!
//! The guard (injection rules and classifier) and the release plan's routing (canary, A/B) plug
//! in here: today the route is the model asked for (newest version unless one is named) and the
//! guard passes everything.

use std::sync::Arc;

use axum::http::StatusCode;
use record::RecordBuilder;
use tracing::Instrument;

use crate::admission::Slot;
use crate::backend::{Answer, Work, WorkKind};
use crate::error::ApiError;
use crate::registry::{Entry, ModelName};
use crate::state::AppState;

/// A request that passed the front: the model that answers, its answer, and its place in flight.
#[derive(Debug)]
pub struct Admitted {
    pub entry: Arc<Entry>,
    pub answer: Answer,
    pub ticket: Ticket,
}

/// Held until the response ends: the admission slot, and the principal whose token budget the
/// response is charged to.
pub struct Ticket {
    _slot: Slot,
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
    let entry = route(state, model, work.kind(), record)?;
    admit_and_start(state, principal, entry, work, record).await
}

/// The route: the entry that answers `work` for `model` (the release plan will choose among
/// variants here). Protocols that need the model to decode (a raw image body) call it first.
pub fn route(
    state: &AppState,
    model: &ModelName,
    work: WorkKind,
    record: &mut RecordBuilder,
) -> Result<Arc<Entry>, ApiError> {
    let entry = state.registry.resolve(model, work)?;
    record.record.model = entry.name.clone();
    record.record.version = entry.version.clone();
    record.record.version_digest = entry.digest.clone();
    record.set_entropy_band(entry.backend.entropy_band());
    Ok(entry)
}

/// The pipeline after the route (for protocols that route first): drain check, admission,
/// then the backend.
pub async fn serve_routed(
    state: &Arc<AppState>,
    principal: &str,
    entry: Arc<Entry>,
    work: Work,
    record: &mut RecordBuilder,
) -> Result<Admitted, ApiError> {
    if state.is_draining() {
        return Err(ApiError::draining());
    }
    admit_and_start(state, principal, entry, work, record).await
}

async fn admit_and_start(
    state: &Arc<AppState>,
    principal: &str,
    entry: Arc<Entry>,
    work: Work,
    record: &mut RecordBuilder,
) -> Result<Admitted, ApiError> {
    let span = tracing::info_span!(
        "front",
        model = %entry.name,
        version = %entry.version,
        work = work.kind().as_str()
    );
    async move {
        let slot = admit(state, principal, &entry, record)
            .instrument(tracing::debug_span!("admission"))
            .await?;
        let answer = entry
            .backend
            .start(work, record)
            .instrument(tracing::debug_span!("backend"))
            .await?;
        let answer = match answer {
            Answer::Tensors(mut response) => {
                response.model_name = entry.name.clone();
                response.model_version = entry.version.clone();
                Answer::Tensors(response)
            }
            other => other,
        };
        Ok(Admitted {
            entry,
            answer,
            ticket: Ticket {
                _slot: slot,
                state: Arc::clone(state),
                principal: principal.to_string(),
            },
        })
    }
    .instrument(span)
    .await
}

/// The key's rate limit, then a slot of the model's admission; a refusal says why in the record.
async fn admit(
    state: &AppState,
    principal: &str,
    entry: &Entry,
    record: &mut RecordBuilder,
) -> Result<Slot, ApiError> {
    if let Err(wait) = state.rate_limiter.admit(principal) {
        record.refuse("rate_limited");
        return Err(ApiError::Overloaded {
            message: format!("rate limit of key {principal:?} reached; retry in {wait} s"),
            retry_after_s: wait,
            code: "rate_limited",
        });
    }
    let slot = entry.admission.acquire().await.inspect_err(|e| {
        record.refuse(if e.status() == StatusCode::TOO_MANY_REQUESTS {
            "queue_full"
        } else {
            "queue_timeout"
        });
    })?;
    record.record.queue_ms = slot.queued.as_secs_f64() * 1e3;
    Ok(slot)
}

/// Ends a request's record with its outcome: a success finished by itself (`stop` unless the
/// encoder said otherwise), or the error the client got.
pub fn settle<T>(record: &mut RecordBuilder, result: Result<&T, &ApiError>) {
    match result {
        Ok(_) => {
            if record.record.finish_reason.is_none() {
                record.record.finish_reason = Some("stop".into());
            }
        }
        Err(e) => e.record(record),
    }
    let _ = record.finish();
}
