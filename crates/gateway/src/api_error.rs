//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP
//! status that says what went wrong, and Retry-After where waiting helps.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's error type: invalid_request_error, authentication_error, ...
    pub kind: &'static str,
    pub code: Option<&'static str>,
    pub param: Option<String>,
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), kind, code: None, param: None, retry_after: None }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn param(mut self, p: &str) -> ApiError {
        self.param = Some(p.into());
        self
    }

    pub fn code(mut self, c: &'static str) -> ApiError {
        self.code = Some(c);
        self
    }

    pub fn retry_after(mut self, secs: u64) -> ApiError {
        self.retry_after = Some(secs);
        self
    }

    /// A short stable name for metrics.
    pub fn metric_kind(&self) -> &'static str {
        self.code.unwrap_or(self.kind)
    }

    pub fn body(&self) -> serde_json::Value {
        json!({ "error": { "message": self.message, "type": self.kind, "param": self.param, "code": self.code } })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after.and_then(|s| HeaderValue::from_str(&s.to_string()).ok()) {
            r.headers_mut().insert(header::RETRY_AFTER, s);
        }
        r
    }
}
