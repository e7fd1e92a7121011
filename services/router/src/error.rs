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
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>, param: Option<&str>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param: param.map(str::to_string),
        }
    }
    pub fn not_found_model(model: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "model_not_found",
            message: format!("the model `{model}` does not exist or no worker serves it"),
            param: Some("model".into()),
        }
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "service_unavailable",
            message: message.into(),
            param: None,
        }
    }
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "internal_error",
            message: message.into(),
            param: None,
        }
    }
    pub fn timeout(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::GATEWAY_TIMEOUT,
            kind: "timeout",
            message: message.into(),
            param: None,
        }
    }
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status.as_u16(),
            }
        })
    }
    /// Label for the error metrics.
    pub fn metric_label(&self) -> &'static str {
        match self.status.as_u16() {
            400 | 413 | 422 => "validation",
            404 => "not_found",
            503 => "overload",
            504 => "response_timeout",
            _ => "internal",
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

/// Maps a gRPC status from a worker to the client's error.
pub fn from_status(status: &tonic::Status) -> ApiError {
    match status.code() {
        tonic::Code::InvalidArgument => ApiError::bad_request(status.message().to_string(), None),
        tonic::Code::Unavailable | tonic::Code::ResourceExhausted => {
            ApiError::unavailable(format!("worker unavailable: {}", status.message()))
        }
        tonic::Code::DeadlineExceeded => ApiError::timeout(status.message().to_string()),
        _ => ApiError::internal(format!("worker error: {}", status.message())),
    }
}
