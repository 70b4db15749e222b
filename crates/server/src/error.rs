//! The APIs' error on the wire: [`ApiError`] (the pipeline's one error type) as an HTTP response
//! (status, the OpenAI-shaped JSON body, `Retry-After`, `WWW-Authenticate`) and as a gRPC status.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use serde::Serialize;

pub use pipeline::error::ApiError;

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

/// An [`ApiError`] as what an axum handler or extractor returns (`?` converts).
#[derive(Debug)]
pub struct HttpError(pub ApiError);

impl From<ApiError> for HttpError {
    fn from(e: ApiError) -> Self {
        Self(e)
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        WireError::into_response(self.0)
    }
}

/// [`ApiError`] on the wire of each protocol.
pub trait WireError {
    /// The HTTP status.
    fn status(&self) -> StatusCode;
    /// The HTTP response: the status, the JSON body, `Retry-After` when the error has a time,
    /// `WWW-Authenticate` on a missing or bad key.
    fn into_response(self) -> Response;
    /// The gRPC status of the error, with its message (and `retry-after` when there is one).
    fn grpc_status(&self) -> tonic::Status;
    /// The JSON body: `{"error": {"message", "type", "param", "code"}}`.
    fn body(&self) -> ErrorBody;
}

impl WireError for ApiError {
    fn body(&self) -> ErrorBody {
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

    fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.status_code()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    fn into_response(self) -> Response {
        let mut response = (WireError::status(&self), axum::Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after_s() {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                HeaderValue::from(seconds.max(1)),
            );
        }
        // The first-token gate's wait to the millisecond (what the official OpenAI clients
        // read first) and the request's booking.
        if let ApiError::Overloaded {
            booking: Some(booking),
            ..
        } = &self
        {
            let headers = response.headers_mut();
            headers.insert("retry-after-ms", HeaderValue::from(booking.retry_after_ms));
            if let Some(token) = booking
                .token
                .as_deref()
                .and_then(|t| HeaderValue::from_str(t).ok())
            {
                headers.insert(crate::claims::RESERVATION_HEADER, token);
            }
        }
        if matches!(self, ApiError::Unauthorized(_)) {
            response.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer"),
            );
        }
        response
    }

    /// The gRPC status of the error, with its message (and `retry-after` when there is one).
    fn grpc_status(&self) -> tonic::Status {
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
