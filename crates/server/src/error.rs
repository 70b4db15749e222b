//! The one error type of the APIs, mapped in one place to HTTP status codes (bodies in the shape
//! OpenAI clients expect: `{"error": {"message", "type", "param", "code"}}`) and to gRPC
//! statuses; and the maps from the engine's, the tensor runtime's and the backends' errors.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use classic::ClassicError;
use engine::EngineError;
use record::RecordBuilder;

use crate::backend::BackendError;
use serde::Serialize;

/// Everything a request can fail with.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    /// Malformed JSON, wrong types, values out of range.
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<String>,
    },
    /// The prompt plus max_tokens does not fit the model.
    #[error("{0}")]
    ContextLengthExceeded(String),
    #[error("{0}")]
    BodyTooLarge(String),
    /// The request body did not arrive within `[limits] body_read_timeout_ms`.
    #[error("{0}")]
    RequestTimeout(String),
    /// The request brings the guard more texts or bytes than its per-request budget.
    #[error("{0}")]
    GuardBudget(String),
    #[error("{0}")]
    Unauthorized(String),
    /// The key lacks the scope the route needs.
    #[error("{0}")]
    Forbidden(String),
    /// The model is handed off to people (level 3): the configured message and link.
    #[error("{message}")]
    HumanHandoff {
        message: String,
        url: Option<String>,
        retry_after_s: u64,
    },
    #[error("{0}")]
    ModelNotFound(String),
    #[error("{0}")]
    RouteNotFound(String),
    /// Admission refused: the queue is full or the key's rate limit is spent.
    #[error("{message}")]
    Overloaded {
        message: String,
        retry_after_s: u64,
        /// `queue_full`, `rate_limited` or `shedding` (the degradation controller).
        code: &'static str,
    },
    /// Waited too long for a slot, the server is draining, or the model is not ready.
    #[error("{message}")]
    Unavailable { message: String, retry_after_s: u64 },
    /// The audit log cannot persist (`fail_closed`): nothing is served unaudited.
    #[error("{0}")]
    AuditUnavailable(String),
    /// An exact-key audit lookup found nothing.
    #[error("{0}")]
    AuditEntryNotFound(String),
    /// Feedback named a response the feedback index does not have.
    #[error("{0}")]
    ResponseNotFound(String),
    /// Feedback on a response another tenant's key asked for.
    #[error("{0}")]
    OtherTenant(String),
    /// A signed feedback link that is malformed, forged or expired.
    #[error("{message}")]
    FeedbackToken { message: String, code: &'static str },
    /// The command does not fit the state it would change (a release already under way).
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Internal(String),
    /// A structured-output request ended with an output that fails its schema or grammar.
    #[error("{0}")]
    InvalidOutput(String),
    /// The guard refused the input (prompt injection and kin): its reason codes.
    #[error("{message}")]
    UnsafeInput {
        message: String,
        reasons: Vec<String>,
    },
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    pub message: String,
    /// Stable error type: `invalid_request_error`, `authentication_error`, `not_found_error`,
    /// `conflict_error`, `rate_limit_error`, `service_unavailable`, `server_error`,
    /// `unsafe_input`.
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: Option<String>,
    /// `human_handoff`: where people can be reached.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub handoff_url: Option<String>,
    /// `unsafe_input`: the guard's reason codes, strongest first.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasons: Option<Vec<String>>,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError::InvalidRequest {
            message: message.into(),
            param: None,
        }
    }

    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        ApiError::InvalidRequest {
            message: message.into(),
            param: Some(param.to_string()),
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest { .. }
            | ApiError::ContextLengthExceeded(_)
            | ApiError::UnsafeInput { .. }
            | ApiError::GuardBudget(_) => StatusCode::BAD_REQUEST,
            ApiError::BodyTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::HumanHandoff { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::ModelNotFound(_) | ApiError::RouteNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Unavailable { .. } | ApiError::AuditUnavailable(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ApiError::AuditEntryNotFound(_) | ApiError::ResponseNotFound(_) => {
                StatusCode::NOT_FOUND
            }
            ApiError::OtherTenant(_) => StatusCode::FORBIDDEN,
            ApiError::FeedbackToken { .. } => StatusCode::UNAUTHORIZED,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::Internal(_) | ApiError::InvalidOutput(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The stable error type (also the record's `error_type`).
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::InvalidRequest { .. }
            | ApiError::ContextLengthExceeded(_)
            | ApiError::BodyTooLarge(_)
            | ApiError::RequestTimeout(_)
            | ApiError::GuardBudget(_) => "invalid_request_error",
            ApiError::Unauthorized(_) => "authentication_error",
            ApiError::Forbidden(_) => "permission_error",
            ApiError::HumanHandoff { .. } => "service_unavailable",
            ApiError::ModelNotFound(_) | ApiError::RouteNotFound(_) => "not_found_error",
            ApiError::Overloaded { .. } => "rate_limit_error",
            ApiError::Unavailable { .. } | ApiError::AuditUnavailable(_) => "service_unavailable",
            ApiError::AuditEntryNotFound(_) | ApiError::ResponseNotFound(_) => "not_found_error",
            ApiError::OtherTenant(_) => "permission_error",
            ApiError::FeedbackToken { .. } => "authentication_error",
            ApiError::Conflict(_) => "conflict_error",
            ApiError::UnsafeInput { .. } => "unsafe_input",
            ApiError::Internal(_) | ApiError::InvalidOutput(_) => "server_error",
        }
    }

    pub fn code(&self) -> Option<&'static str> {
        match self {
            ApiError::ContextLengthExceeded(_) => Some("context_length_exceeded"),
            ApiError::BodyTooLarge(_) => Some("request_too_large"),
            ApiError::GuardBudget(_) => Some("guard_budget_exceeded"),
            ApiError::RequestTimeout(_) => Some("request_timeout"),
            ApiError::Unauthorized(_) => Some("invalid_api_key"),
            ApiError::Forbidden(_) => Some("insufficient_scope"),
            ApiError::HumanHandoff { .. } => Some("human_handoff"),
            ApiError::ModelNotFound(_) => Some("model_not_found"),
            ApiError::Overloaded { code, .. } => Some(code),
            ApiError::InvalidOutput(_) => Some("structured_output_invalid"),
            ApiError::AuditUnavailable(_) => Some("audit_unavailable"),
            ApiError::AuditEntryNotFound(_) => Some("audit_entry_not_found"),
            ApiError::ResponseNotFound(_) => Some("response_not_found"),
            ApiError::OtherTenant(_) => Some("other_tenant"),
            ApiError::FeedbackToken { code, .. } => Some(code),
            ApiError::Conflict(_) => Some("conflict"),
            ApiError::UnsafeInput { .. } => Some("unsafe_input"),
            _ => None,
        }
    }

    fn param(&self) -> Option<String> {
        match self {
            ApiError::InvalidRequest { param, .. } => param.clone(),
            ApiError::ModelNotFound(_) => Some("model".into()),
            ApiError::ContextLengthExceeded(_) => Some("messages".into()),
            _ => None,
        }
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                message: self.to_string(),
                kind: self.kind().to_string(),
                param: self.param(),
                code: self.code().map(str::to_string),
                handoff_url: match self {
                    ApiError::HumanHandoff { url, .. } => url.clone(),
                    _ => None,
                },
                reasons: match self {
                    ApiError::UnsafeInput { reasons, .. } => Some(reasons.clone()),
                    _ => None,
                },
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let retry_after = match &self {
            ApiError::Overloaded { retry_after_s, .. }
            | ApiError::Unavailable { retry_after_s, .. }
            | ApiError::HumanHandoff { retry_after_s, .. } => Some(*retry_after_s),
            ApiError::AuditUnavailable(_) => Some(5),
            _ => None,
        };
        let mut response = (self.status(), axum::Json(self.body())).into_response();
        if let Some(seconds) = retry_after {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                HeaderValue::from(seconds.max(1)),
            );
        }
        if matches!(self, ApiError::Unauthorized(_)) {
            response.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer"),
            );
        }
        response
    }
}

impl From<EngineError> for BackendError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::InvalidRequest(message) => BackendError::invalid(message),
            EngineError::ChatTemplate(message) => {
                BackendError::invalid(format!("chat template: {message}"))
            }
            EngineError::Tokenizer(message) => {
                BackendError::invalid(format!("tokenizer: {message}"))
            }
            EngineError::ContextExceeded {
                prompt_tokens,
                max_tokens,
                context,
            } => BackendError::ContextLength(format!(
                "This model's maximum context length is {context} tokens. However, you requested {} tokens ({prompt_tokens} in the prompt, {max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                prompt_tokens + max_tokens
            )),
            e @ EngineError::InputTooLong { .. } => {
                BackendError::invalid_param("input", e.to_string())
            }
            e @ EngineError::PoolTooSmall { .. } => BackendError::ContextLength(e.to_string()),
            EngineError::QueueFull { limit } => BackendError::Overloaded {
                message: format!("the engine's queue is full ({limit} requests); retry later"),
                retry_after_s: 1,
                code: "queue_full",
            },
            // The first-token gate's refusal and the saturation's: both the degradation
            // controller shedding load before any compute.
            e @ (EngineError::Shedding { retry_after_s, .. }
            | EngineError::Warming { retry_after_s, .. }
            | EngineError::Saturated { retry_after_s, .. }) => BackendError::Overloaded {
                message: e.to_string(),
                retry_after_s,
                code: "shedding",
            },
            EngineError::Stopped => BackendError::Unavailable {
                message: "the engine has stopped (the server is shutting down)".into(),
                retry_after_s: 5,
            },
            other => BackendError::Failed(other.to_string()),
        }
    }
}

impl From<ClassicError> for BackendError {
    fn from(e: ClassicError) -> Self {
        match e {
            ClassicError::BadInput(m) | ClassicError::TooLarge(m) => BackendError::invalid(m),
            e @ ClassicError::QueueFull { .. } => BackendError::Overloaded {
                message: e.to_string(),
                retry_after_s: 1,
                code: "queue_full",
            },
            e @ ClassicError::QueueTimeout { .. } => BackendError::Timeout {
                message: e.to_string(),
                retry_after_s: 1,
            },
            e @ ClassicError::ShuttingDown(_) => BackendError::Unavailable {
                message: e.to_string(),
                retry_after_s: 1,
            },
            e @ (ClassicError::Load(_) | ClassicError::Backend(_)) => {
                BackendError::Failed(e.to_string())
            }
        }
    }
}

/// Bad tensors found while decoding a request (before any backend) are the client's error.
impl From<ClassicError> for ApiError {
    fn from(e: ClassicError) -> Self {
        match e {
            ClassicError::TooLarge(m) => ApiError::BodyTooLarge(m),
            e => BackendError::from(e).into(),
        }
    }
}

impl From<BackendError> for ApiError {
    fn from(e: BackendError) -> Self {
        match e {
            BackendError::Invalid { message, param } => ApiError::InvalidRequest { message, param },
            BackendError::ContextLength(m) => ApiError::ContextLengthExceeded(m),
            BackendError::Overloaded {
                message,
                retry_after_s,
                code,
            } => ApiError::Overloaded {
                message,
                retry_after_s,
                code,
            },
            // A backend that timed out is unavailable to the client (503 with Retry-After).
            BackendError::Unavailable {
                message,
                retry_after_s,
            }
            | BackendError::Timeout {
                message,
                retry_after_s,
            } => ApiError::Unavailable {
                message,
                retry_after_s,
            },
            BackendError::Failed(m) => ApiError::Internal(m),
            BackendError::InvalidOutput(m) => ApiError::InvalidOutput(m),
            BackendError::NoMatch(message) => ApiError::Unavailable {
                message,
                retry_after_s: 1,
            },
        }
    }
}

impl ApiError {
    /// The server is draining: new requests are refused at once.
    pub fn draining() -> Self {
        ApiError::Unavailable {
            message: "the server is shutting down".into(),
            retry_after_s: 5,
        }
    }

    /// Writes the failure into the request's record.
    pub fn record(&self, record: &mut RecordBuilder) {
        record.fail(self.status().as_u16(), self.kind(), self.code());
    }

    /// The gRPC status of the error, with its message (and `retry-after` when there is one).
    pub fn grpc_status(&self) -> tonic::Status {
        use tonic::Status;
        let message = self.to_string();
        let (mut status, retry_after) = match self {
            ApiError::InvalidRequest { .. }
            | ApiError::ContextLengthExceeded(_)
            | ApiError::GuardBudget(_) => (Status::invalid_argument(message), None),
            ApiError::UnsafeInput { reasons, .. } => (
                Status::invalid_argument(format!(
                    "{message} [unsafe_input: {}]",
                    reasons.join(", ")
                )),
                None,
            ),
            ApiError::BodyTooLarge(_) => (Status::resource_exhausted(message), None),
            ApiError::RequestTimeout(_) => (Status::deadline_exceeded(message), None),
            ApiError::Unauthorized(_) => (Status::unauthenticated(message), None),
            ApiError::Forbidden(_) | ApiError::OtherTenant(_) => {
                (Status::permission_denied(message), None)
            }
            ApiError::FeedbackToken { .. } => (Status::unauthenticated(message), None),
            ApiError::HumanHandoff {
                retry_after_s, url, ..
            } => {
                let message = match url {
                    Some(url) => format!("{message} ({url}) [human_handoff]"),
                    None => format!("{message} [human_handoff]"),
                };
                (Status::unavailable(message), Some(*retry_after_s))
            }
            ApiError::ModelNotFound(_)
            | ApiError::RouteNotFound(_)
            | ApiError::AuditEntryNotFound(_)
            | ApiError::ResponseNotFound(_) => (Status::not_found(message), None),
            ApiError::Conflict(_) => (Status::failed_precondition(message), None),
            ApiError::AuditUnavailable(_) => (
                Status::unavailable(format!("{message} [audit_unavailable]")),
                Some(5),
            ),
            ApiError::Overloaded { retry_after_s, .. } => {
                (Status::resource_exhausted(message), Some(*retry_after_s))
            }
            ApiError::Unavailable { retry_after_s, .. } => {
                (Status::unavailable(message), Some(*retry_after_s))
            }
            ApiError::Internal(_) | ApiError::InvalidOutput(_) => (Status::internal(message), None),
        };
        if let Some(seconds) = retry_after {
            if let Ok(v) = tonic::metadata::MetadataValue::try_from(seconds.max(1).to_string()) {
                status.metadata_mut().insert("retry-after", v);
            }
        }
        status
    }
}
