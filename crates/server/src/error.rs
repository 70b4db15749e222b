//! The one error type of the HTTP API, mapped to status codes in one place. Bodies have the shape
//! OpenAI clients expect: `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use engine::EngineError;
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
    #[error("{0}")]
    Unauthorized(String),
    #[error("{0}")]
    ModelNotFound(String),
    #[error("{0}")]
    RouteNotFound(String),
    /// Admission refused: the queue is full or the key's rate limit is spent.
    #[error("{message}")]
    Overloaded {
        message: String,
        retry_after_s: u64,
        /// `queue_full` or `rate_limited`.
        code: &'static str,
    },
    /// Waited too long for a slot, the server is draining, or the model is not ready.
    #[error("{message}")]
    Unavailable { message: String, retry_after_s: u64 },
    #[error("{0}")]
    Internal(String),
    /// A structured-output request ended with an output that fails its schema or grammar.
    #[error("{0}")]
    InvalidOutput(String),
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    pub message: String,
    /// Stable error type: `invalid_request_error`, `authentication_error`, `not_found_error`,
    /// `rate_limit_error`, `service_unavailable`, `server_error`.
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: Option<String>,
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
            ApiError::InvalidRequest { .. } | ApiError::ContextLengthExceeded(_) => {
                StatusCode::BAD_REQUEST
            }
            ApiError::BodyTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::ModelNotFound(_) | ApiError::RouteNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) | ApiError::InvalidOutput(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The stable error type (also the record's `error_type`).
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::InvalidRequest { .. }
            | ApiError::ContextLengthExceeded(_)
            | ApiError::BodyTooLarge(_) => "invalid_request_error",
            ApiError::Unauthorized(_) => "authentication_error",
            ApiError::ModelNotFound(_) | ApiError::RouteNotFound(_) => "not_found_error",
            ApiError::Overloaded { .. } => "rate_limit_error",
            ApiError::Unavailable { .. } => "service_unavailable",
            ApiError::Internal(_) | ApiError::InvalidOutput(_) => "server_error",
        }
    }

    pub fn code(&self) -> Option<&'static str> {
        match self {
            ApiError::ContextLengthExceeded(_) => Some("context_length_exceeded"),
            ApiError::BodyTooLarge(_) => Some("request_too_large"),
            ApiError::Unauthorized(_) => Some("invalid_api_key"),
            ApiError::ModelNotFound(_) => Some("model_not_found"),
            ApiError::Overloaded { code, .. } => Some(code),
            ApiError::InvalidOutput(_) => Some("structured_output_invalid"),
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
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let retry_after = match &self {
            ApiError::Overloaded { retry_after_s, .. }
            | ApiError::Unavailable { retry_after_s, .. } => Some(*retry_after_s),
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

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::InvalidRequest(message) => ApiError::invalid(message),
            EngineError::ChatTemplate(message) => {
                ApiError::invalid(format!("chat template: {message}"))
            }
            EngineError::Tokenizer(message) => ApiError::invalid(format!("tokenizer: {message}")),
            EngineError::ContextExceeded {
                prompt_tokens,
                max_tokens,
                context,
            } => ApiError::ContextLengthExceeded(format!(
                "This model's maximum context length is {context} tokens. However, you requested {} tokens ({prompt_tokens} in the prompt, {max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                prompt_tokens + max_tokens
            )),
            e @ EngineError::InputTooLong { .. } => ApiError::invalid_param("input", e.to_string()),
            e @ EngineError::PoolTooSmall { .. } => ApiError::ContextLengthExceeded(e.to_string()),
            EngineError::QueueFull { limit } => ApiError::Overloaded {
                message: format!("the engine's queue is full ({limit} requests); retry later"),
                retry_after_s: 1,
                code: "queue_full",
            },
            EngineError::Stopped => ApiError::Unavailable {
                message: "the engine has stopped (the server is shutting down)".into(),
                retry_after_s: 5,
            },
            other => ApiError::Internal(other.to_string()),
        }
    }
}
