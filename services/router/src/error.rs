//! OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status.
//! A client mistake is never a 500.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
    /// Seconds for the `Retry-After` header of a 429 or 503.
    pub retry_after_secs: Option<u64>,
    /// OpenAI's string `code`; without one the body's code is the status.
    pub code: Option<ErrorCode>,
}

/// OpenAI's string error codes that Tandem answers with (one byte, so `ApiError` stays small).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    /// A missing or wrong API key.
    InvalidApiKey,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidApiKey => "invalid_api_key",
        }
    }
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            message: message.into(),
            param: None,
            retry_after_secs: None,
            code: None,
        }
    }
    pub fn with_param(mut self, param: Option<&str>) -> Self {
        self.param = param.map(str::to_string);
        self
    }
    pub fn with_retry_after(mut self, secs: u64) -> Self {
        self.retry_after_secs = Some(secs.max(1));
        self
    }
    pub fn bad_request(message: impl Into<String>, param: Option<&str>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message).with_param(param)
    }
    pub fn not_found_model(model: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "model_not_found",
            format!("the model `{model}` does not exist or no worker serves it"),
        )
        .with_param(Some("model"))
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            message,
        )
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", message)
    }
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, "timeout", message)
    }
    pub fn rate_limited(message: impl Into<String>, retry_after_secs: u64) -> Self {
        Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_exceeded",
            message,
        )
        .with_retry_after(retry_after_secs)
    }
    /// A missing or wrong API key (see `auth`), as OpenAI answers it.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        ApiError {
            code: Some(ErrorCode::InvalidApiKey),
            ..Self::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message)
        }
    }
    pub fn body(&self) -> serde_json::Value {
        let code = match self.code {
            Some(c) => serde_json::Value::from(c.as_str()),
            None => serde_json::Value::from(self.status.as_u16()),
        };
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": code,
            }
        })
    }
    /// Label for the error metrics.
    pub fn metric_label(&self) -> &'static str {
        match self.status.as_u16() {
            400 | 408 | 413 | 415 | 422 => "validation",
            401 | 403 => "unauthorized",
            404 => "not_found",
            429 | 503 => "overload",
            504 => "response_timeout",
            _ => "internal",
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let retry_after = self.retry_after_secs;
        let mut resp = (self.status, Json(self.body())).into_response();
        if let Some(secs) = retry_after {
            resp.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        resp
    }
}

/// Maps a gRPC status from a worker to the client's error.
pub fn from_status(status: &tonic::Status) -> ApiError {
    match status.code() {
        tonic::Code::InvalidArgument => ApiError::bad_request(status.message().to_string(), None),
        // Cancelled: the worker's server shut down under the call (a drained worker exiting).
        tonic::Code::Unavailable | tonic::Code::ResourceExhausted | tonic::Code::Cancelled => {
            ApiError::unavailable(format!("worker unavailable: {}", status.message()))
                .with_retry_after(1)
        }
        tonic::Code::DeadlineExceeded => ApiError::timeout(status.message().to_string()),
        _ => ApiError::internal(format!("worker error: {}", status.message())),
    }
}
