//! The OpenAI-compatible HTTP service over the swarm (axum): requests are checked, admitted,
//! routed by the tracker with a signed ticket, driven over warm connections by `dgr-driver`, and
//! streamed back.

mod admission;
mod api;
mod api_error;
mod dashboard;
mod embeddings;
mod history;
mod metrics;
mod openai;
mod respond;
mod serve;
mod service;
mod structured;
mod text;
mod tls;
mod tools;
mod verify;

pub use dashboard::swarm_json;
pub use serve::serve;
pub use service::{Gateway, GatewayConfig, GatewayError};
pub use tls::{Tls, TlsError};

/// Not API: for the fuzz target `openai_body` (fuzz/) and its replay test. Runs a request body
/// through the checks made before a model is consulted: parsing, the generation parameters and
/// each message's text. Returns the refusal as its JSON error body. Must not panic on any input.
#[doc(hidden)]
pub fn fuzz_request_body(bytes: &[u8], chat: bool) -> Result<(), String> {
    let check = || -> Result<(), api_error::ApiError> {
        let body = openai::Body::parse(bytes)?;
        body.params(chat)?;
        for m in body.messages.iter().flatten() {
            m.text()?;
        }
        Ok(())
    };
    check().map_err(|e| e.body().to_string())
}

impl Gateway {
    /// When the gateway started, in unix seconds (the models' `created`).
    pub fn created(&self) -> u64 {
        dgr_telemetry::unix_secs().saturating_sub(self.started.elapsed().as_secs())
    }

    pub fn created_now(&self) -> u64 {
        dgr_telemetry::unix_secs()
    }
}
