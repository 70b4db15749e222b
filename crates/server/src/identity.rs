//! Who is asking and what they sent, written once for HTTP and gRPC: request ids, API keys
//! (a refusal leaves a record), and the body-size limit.

use axum::body::{Body, Bytes};
use record::RecordBuilder;

use crate::auth;
use crate::error::ApiError;
use crate::state::AppState;

/// The request's id (`X-Request-Id` from the client, or a fresh UUIDv4).
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

/// Who is asking: the API key's id, or `anonymous` when the server runs without keys.
#[derive(Debug, Clone)]
pub struct Principal(pub String);

/// What the asking key may do (every scope when the server runs without keys).
#[derive(Debug, Clone, Copy)]
pub struct Granted(pub auth::Scopes);

pub use pipeline::origin::{origin, with_origin, Origin};

/// A request's origin from its header values (insane ones are ignored).
pub fn origin_from_headers(
    operator: Option<&str>,
    traceparent: Option<&str>,
    tracestate: Option<&str>,
) -> Origin {
    let parent = traceparent.and_then(crate::traces::TraceParent::parse);
    Origin {
        operator: operator
            .map(str::trim)
            .filter(|v| {
                !v.is_empty()
                    && v.len() <= 128
                    && v.bytes().all(|b| b.is_ascii_graphic() || b == b' ')
            })
            .map(str::to_string),
        tracestate: parent
            .as_ref()
            .and(tracestate)
            .and_then(crate::traces::sane_tracestate),
        trace_id: parent.as_ref().map(|p| p.trace_id.clone()),
        parent_span_id: parent.as_ref().map(|p| p.parent_span_id.clone()),
        sampled: parent.as_ref().map(|p| p.sampled),
        routing_user: None,
        routing_group: None,
    }
}

/// The client's request id when it is sane (1-128 visible ASCII characters), else a fresh
/// UUIDv4.
pub fn request_id(given: Option<&str>) -> String {
    given
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(|| uuid::Uuid::new_v4().to_string(), str::to_string)
}

pub use crate::unauthenticated::Transport;

/// The principal and scopes of an `authorization` value (`anonymous` with every scope when the
/// server has no keys), which must hold `needed` (none: any valid key). A refusal is recorded
/// (who tried what) and returned as `Unauthorized` or `Forbidden`.
pub fn authenticate(
    state: &AppState,
    authorization: Option<&str>,
    transport: Transport,
    request_id: &str,
    endpoint: &'static str,
    needed: Option<auth::Scope>,
) -> Result<(String, auth::Scopes), ApiError> {
    let Some(keys) = &state.keys else {
        return Ok(("anonymous".into(), auth::Scopes::ALL));
    };
    let presented = authorization.and_then(auth::bearer);
    if let Some((id, scopes)) = presented.and_then(|key| keys.lookup(key)) {
        if let Some(scope) = needed.filter(|s| !scopes.has(*s)) {
            let error = ApiError::Forbidden(format!(
                "the key {id:?} lacks the {:?} scope this route needs (it has: {})",
                scope.as_str(),
                scopes.names().join(", ")
            ));
            let mut record = state
                .front
                .record(request_id.to_string(), id.to_string(), endpoint);
            record.refuse("insufficient_scope");
            error.record(&mut record);
            let _ = record.finish();
            return Err(error);
        }
        return Ok((id.to_string(), scopes));
    }
    let message = match (presented, transport) {
        (None, Transport::Http) => "missing API key: send it as 'Authorization: Bearer <key>'",
        (None, Transport::Grpc) => {
            "missing API key: send it as metadata 'authorization: Bearer <key>'"
        }
        (Some(_), _) => "invalid API key",
    };
    let error = ApiError::Unauthorized(message.into());
    // Counted for the interval's summary; the first few of each interval are also logged one
    // by one (crate::unauthenticated), so a misconfigured client shows in the log at once.
    if state
        .unauthenticated
        .note(endpoint, transport, presented.is_some(), request_id)
    {
        tracing::warn!(
            target: "rampart::auth",
            request_id,
            endpoint,
            status = 401,
            key_sent = presented.is_some(),
            "request refused before authentication: {message}"
        );
    }
    let mut record = state
        .front
        .record(request_id.to_string(), "unauthenticated".into(), endpoint);
    record.refuse("unauthorized");
    error.record(&mut record);
    let _ = record.finish();
    Err(error)
}

/// Holds back a 401 for `unauthenticated_delay_ms` (other errors pass at once): the refusal
/// costs the server a timer, and a client looping on a missing or guessed key waits for each.
pub async fn pause_refusal(state: &AppState, error: &ApiError) {
    let delay = state.config.unauthenticated_delay_ms;
    if delay > 0 && matches!(error, ApiError::Unauthorized(_)) {
        tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
    }
}

/// The request body, up to `limit` bytes; beyond it the request is refused (and recorded so).
pub async fn read_body(
    body: Body,
    limit: usize,
    record: &mut RecordBuilder,
) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        let error = body_error(&e, limit);
        record.refuse(match error {
            ApiError::RequestTimeout(_) => "body_timeout",
            _ => "body_too_large",
        });
        error
    })
}

/// Why a body could not be read whole: its deadline passed (408), or it is over `limit` (413).
pub fn body_error(e: &axum::Error, limit: usize) -> ApiError {
    if crate::connections::timed_out(e) {
        return ApiError::RequestTimeout(e.to_string());
    }
    ApiError::BodyTooLarge(format!(
        "the request body exceeds the limit of {limit} bytes"
    ))
}

/// [`read_body`] for bodies near their limit (KServe tensors): refused at once when the
/// declared `Content-Length` exceeds `limit`, and read into one buffer sized from that length,
/// so the bytes are held once (collecting the chunks and joining them holds them twice).
pub async fn read_sized_body(
    body: Body,
    content_length: Option<u64>,
    limit: usize,
    record: &mut RecordBuilder,
) -> Result<Bytes, ApiError> {
    let too_large = |record: &mut RecordBuilder| {
        record.refuse("body_too_large");
        ApiError::BodyTooLarge(format!(
            "the request body exceeds the limit of {limit} bytes"
        ))
    };
    let declared = match content_length.map(usize::try_from) {
        Some(Ok(n)) if n <= limit => n,
        Some(_) => return Err(too_large(record)),
        None => 0,
    };
    let mut buffer = Vec::with_capacity(declared);
    let mut chunks = body.into_data_stream();
    while let Some(chunk) = futures_util::StreamExt::next(&mut chunks).await {
        let chunk = chunk
            .map_err(|e| ApiError::invalid(format!("the request body could not be read: {e}")))?;
        if buffer.len() + chunk.len() > limit {
            return Err(too_large(record));
        }
        buffer.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(buffer))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_take_sane_headers_only() {
        let o = origin_from_headers(
            Some("dr. ada"),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            Some("rojo=00f067aa0ba902b7"),
        );
        assert_eq!(o.operator.as_deref(), Some("dr. ada"));
        assert_eq!(
            o.trace_id.as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        assert_eq!(o.parent_span_id.as_deref(), Some("00f067aa0ba902b7"));
        assert_eq!(o.sampled, Some(true));
        assert_eq!(o.tracestate.as_deref(), Some("rojo=00f067aa0ba902b7"));
        let bad = origin_from_headers(
            Some("a\nb"),
            Some("00-00000000000000000000000000000000-00f067aa0ba902b7-01"),
            Some("rojo=1"),
        );
        assert_eq!(
            bad,
            Origin::default(),
            "no tracestate without a valid traceparent"
        );
        assert_eq!(
            origin_from_headers(None, Some("garbage"), None).trace_id,
            None
        );
        let insane = origin_from_headers(
            None,
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"),
            Some("no equals"),
        );
        assert_eq!(insane.sampled, Some(false));
        assert_eq!(insane.tracestate, None);
    }
}
