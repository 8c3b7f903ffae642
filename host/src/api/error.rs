//! The API's one error type: an HTTP status, a stable machine code and a
//! sentence, answered as `{"error": {"code": …, "message": …}}`. Every
//! failure a handler meets is mapped here, once, so bad input is always a
//! 4xx with a code and only the server's own failures are a 5xx.

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

use crate::enqueue::EnqueueError;
use crate::queue::QueueError;

/// What a request gets instead of its answer.
#[derive(Debug, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// Stable, for programs: `unauthorized`, `forbidden`, `not_found`, …
    pub code: &'static str,
    /// For people.
    pub message: String,
}

impl ApiError {
    /// Any error, by its parts.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }

    /// 400 `invalid_request`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }

    /// 404 `not_found`.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    /// 401 `unauthorized`.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }

    /// 403 `forbidden`.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::error!(code = self.code, error = %self.message, "API request failed.");
        }
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code.to_owned(),
                message: self.message,
            },
        };
        let mut response = (self.status, Json(body)).into_response();
        // Every 503 is worth retrying, soon: say when.
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        response
    }
}

/// The document every refusal answers, `{"error": {"code", "message"}}`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// What went wrong.
    pub error: ErrorDetail,
}

/// An error's code and sentence.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    /// Stable, for programs (`invalid_request`, `forbidden`, `not_found`, …).
    pub code: String,
    /// For people.
    pub message: String,
}

/// The refusals every keyed route may answer, for the OpenAPI document.
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
pub(super) enum Refusals {
    /// `invalid_request`, `invalid_json`, `invalid_query` or `invalid_path`:
    /// the request does not fit; nothing changed.
    #[response(status = 400)]
    BadRequest(ErrorBody),
    /// `unauthorized`: no key, or an unknown or revoked one.
    #[response(status = 401)]
    Unauthorized(ErrorBody),
    /// `forbidden`: the key lacks the operation's scope.
    #[response(status = 403)]
    Forbidden(ErrorBody),
    /// `database_unavailable`, `database_busy` (a producer's open
    /// transaction held a lock past `[database] lock_timeout_ms`) or
    /// `schema_mismatch`; with `Retry-After`.
    #[response(status = 503)]
    Unavailable(ErrorBody),
}

/// What a route with a JSON body may also answer.
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
pub(super) enum BodyRefusals {
    /// `body_too_large`: over `[api] max_body_bytes`; nothing changed.
    #[response(status = 413)]
    TooLarge(ErrorBody),
    /// `unsupported_media_type`: not `Content-Type: application/json`.
    #[response(status = 415)]
    UnsupportedMediaType(ErrorBody),
}

impl From<QueueError> for ApiError {
    fn from(e: QueueError) -> Self {
        let message = e.to_string();
        match e {
            QueueError::InvalidOp(_) => Self::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_op", message),
            QueueError::IdempotencyConflict(_) => Self::new(StatusCode::CONFLICT, "idempotency_conflict", message),
            QueueError::NotFound(_) => Self::not_found(message),
            QueueError::BadCursor(_) => Self::invalid(message),
            QueueError::Illegal { .. } => Self::new(StatusCode::CONFLICT, "illegal_transition", message),
            QueueError::InDoubt(_) => Self::new(StatusCode::CONFLICT, "in_doubt", message),
            QueueError::Conflict { .. } | QueueError::KeyNameTaken(_) => {
                Self::new(StatusCode::CONFLICT, "conflict", message)
            }
            QueueError::Busy(_) => Self::new(StatusCode::SERVICE_UNAVAILABLE, "database_busy", message),
            QueueError::Unreachable { .. } | QueueError::Database(_) => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, "database_unavailable", message)
            }
            QueueError::SchemaBehind { .. } | QueueError::SchemaTooNew { .. } => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, "schema_mismatch", message)
            }
            _ => Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message),
        }
    }
}

impl From<EnqueueError> for ApiError {
    fn from(e: EnqueueError) -> Self {
        let code = match e {
            EnqueueError::UnknownKind(_) => "unknown_kind",
            EnqueueError::InternalKind(_) => "internal_kind",
            EnqueueError::LanesNotOwned { .. } | EnqueueError::NoPluginLanes { .. } => "lanes_not_owned",
            EnqueueError::LanesRequired { .. } => "lanes_required",
        };
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, code, e.to_string())
    }
}

impl From<JsonRejection> for ApiError {
    fn from(e: JsonRejection) -> Self {
        // axum answers a body of the wrong shape (a missing or unknown
        // field, a wrong type) with 422; here that is a 400 like any request
        // that does not fit, so one code means one thing.
        let (status, code) = match e.status() {
            StatusCode::PAYLOAD_TOO_LARGE => (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"),
            StatusCode::UNSUPPORTED_MEDIA_TYPE => (StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type"),
            StatusCode::UNPROCESSABLE_ENTITY => (StatusCode::BAD_REQUEST, "invalid_request"),
            _ => (StatusCode::BAD_REQUEST, "invalid_json"),
        };
        Self::new(status, code, e.body_text())
    }
}

impl From<QueryRejection> for ApiError {
    fn from(e: QueryRejection) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_query", e.body_text())
    }
}

impl From<PathRejection> for ApiError {
    fn from(e: PathRejection) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_path", e.body_text())
    }
}
