//! Fixtures for the crate's tests, its PostgreSQL test and benches: an indexed answer.

use serde_json::json;

use crate::store::Response;

/// A chat answer of model `tickets` 1.0.0 with one class and its confidence, findable by
/// `audit`, `req-<audit>` and `chatcmpl-<audit>`.
pub fn response(audit: &str, class: &str, confidence: f32, time_ms: u64) -> Response {
    Response {
        audit_id: audit.into(),
        request_id: format!("req-{audit}"),
        response_id: Some(format!("chatcmpl-{audit}")),
        time_ms,
        principal: "app".into(),
        user: Some("u1".into()),
        model: "tickets".into(),
        version: "1.0.0".into(),
        endpoint: "chat.completions".into(),
        classes: vec![Some(class.into())],
        confidences: vec![Some(confidence)],
        input_sha256: "i".into(),
        output_sha256: "o".into(),
        input: Some(json!({"messages": [{"role": "user", "content": format!("ticket {audit}")}]})),
        output: Some(json!({"choices": [format!("{{\"category\": \"{class}\"}}")]})),
    }
}
