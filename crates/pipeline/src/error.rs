//! The one error type of the pipeline and the APIs: its stable type, code and status (the HTTP
//! status number every protocol's record keeps), its body in the shape OpenAI clients expect
//! (`{"error": {"message", "type", "param", "code"}}`); and the maps from the engine's, the
//! tensor runtime's and the backends' errors. The wire conversions (an HTTP response, a gRPC
//! status) are the protocols' (the server crate's `error` module).
use classic::ClassicError;
use engine::EngineError;
use record::RecordBuilder;

use crate::backend::BackendError;
use crate::lane::LaneError;

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
        /// The first-token gate's precise wait and the request's booking, when it was
        /// booked (`retry-after-ms`, `x-rampart-reservation`).
        booking: Option<Booking>,
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

/// A refused request's booking at the first-token gate (`engine::reservations`): come back
/// after `retry_after_ms` with the same identity (the `x-rampart-reservation` token, the
/// `Idempotency-Key` or `X-Request-Id`, or the same body) to be let in ahead of newcomers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Booking {
    pub retry_after_ms: u64,
    /// The reservation token (none when the refusal made no booking).
    pub token: Option<String>,
}

/// The reservation token of a booking's identity (what `x-rampart-reservation` carries).
pub fn reservation_token(identity: u64) -> String {
    format!("{identity:016x}")
}

/// The identity a reservation token names (none when it is not one).
pub fn parse_reservation_token(token: &str) -> Option<u64> {
    (token.len() == 16)
        .then(|| u64::from_str_radix(token, 16).ok())
        .flatten()
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

    /// The HTTP status number (the records keep it whatever the protocol).
    pub fn status_code(&self) -> u16 {
        match self {
            ApiError::InvalidRequest { .. }
            | ApiError::ContextLengthExceeded(_)
            | ApiError::UnsafeInput { .. }
            | ApiError::GuardBudget(_) => 400,
            ApiError::BodyTooLarge(_) => 413,
            ApiError::RequestTimeout(_) => 408,
            ApiError::Unauthorized(_) => 401,
            ApiError::Forbidden(_) => 403,
            ApiError::HumanHandoff { .. } => 503,
            ApiError::ModelNotFound(_) | ApiError::RouteNotFound(_) => 404,
            ApiError::Overloaded { .. } => 429,
            ApiError::Unavailable { .. } | ApiError::AuditUnavailable(_) => 503,
            ApiError::AuditEntryNotFound(_) | ApiError::ResponseNotFound(_) => 404,
            ApiError::OtherTenant(_) => 403,
            ApiError::FeedbackToken { .. } => 401,
            ApiError::Conflict(_) => 409,
            ApiError::Internal(_) | ApiError::InvalidOutput(_) => 500,
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

    /// The seconds a client should wait before asking again, when there is a time to say.
    pub fn retry_after_s(&self) -> Option<u64> {
        match self {
            ApiError::Overloaded { retry_after_s, .. }
            | ApiError::Unavailable { retry_after_s, .. }
            | ApiError::HumanHandoff { retry_after_s, .. } => Some(*retry_after_s),
            ApiError::AuditUnavailable(_) => Some(5),
            _ => None,
        }
    }

    /// The request field at fault, when there is one.
    pub fn param(&self) -> Option<String> {
        match self {
            ApiError::InvalidRequest { param, .. } => param.clone(),
            ApiError::ModelNotFound(_) => Some("model".into()),
            ApiError::ContextLengthExceeded(_) => Some("messages".into()),
            _ => None,
        }
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
                booking: None,
            },
            // The first-token gate's refusal and the saturation's: both the degradation
            // controller shedding load before any compute.
            // A gate refusal says to the millisecond when to come back, with the
            // request's booking when it named itself.
            e @ EngineError::Shedding {
                retry_after_s,
                retry_after_ms,
                booked,
                ..
            } => {
                let token = booked.map(reservation_token);
                let mut message = e.to_string();
                if let Some(token) = &token {
                    message.push_str(&format!(
                        "; booked: the same request sent again in {retry_after_ms} ms (or with x-rampart-reservation: {token}) is let in ahead of newcomers"
                    ));
                }
                BackendError::Overloaded {
                    message,
                    retry_after_s,
                    code: "shedding",
                    booking: Some(Booking {
                        retry_after_ms,
                        token,
                    }),
                }
            }
            e @ (EngineError::Warming { retry_after_s, .. }
            | EngineError::Saturated { retry_after_s, .. }) => BackendError::Overloaded {
                message: e.to_string(),
                retry_after_s,
                code: "shedding",
                booking: None,
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
                booking: None,
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
                booking,
            } => ApiError::Overloaded {
                message,
                retry_after_s,
                code,
                booking,
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
        record.fail(self.status_code(), self.kind(), self.code());
    }
}

impl From<LaneError> for ApiError {
    fn from(e: LaneError) -> Self {
        ApiError::Internal(e.to_string())
    }
}

/// Why a model could not be loaded (kept as a reason readiness gives).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{model}: {message}")]
pub struct LoadError {
    pub model: String,
    pub message: String,
}

impl LoadError {
    pub fn new(model: &str, message: impl std::fmt::Display) -> Self {
        Self {
            model: model.to_string(),
            message: message.to_string(),
        }
    }
}
