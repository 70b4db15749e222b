//! What every response says about itself, whatever its protocol's encoder: the audit entry that
//! keeps it, and the fallback that answered when the model asked for did not.

use axum::http::HeaderValue;
use axum::response::Response;
use pipeline::chain::{Fallback, FALLBACK_HEADER};

/// The response header that names the request's audit entry.
pub const AUDIT_ID_HEADER: &str = "x-rampart-audit-id";

/// Names the request's audit entry on the response.
pub fn mark_audit(response: &mut Response, audit_id: &str) {
    if let Ok(v) = HeaderValue::from_str(audit_id) {
        response.headers_mut().insert(AUDIT_ID_HEADER, v);
    }
}

/// Marks a degraded response: `x-rampart-fallback: level=N; backend=…; reason=…`.
pub fn mark_fallback(response: &mut Response, fallback: Option<&Fallback>) {
    if let Some(value) = fallback.and_then(|f| HeaderValue::from_str(&f.header()).ok()) {
        response.headers_mut().insert(FALLBACK_HEADER, value);
    }
}
