//! The OpenAI-compatible HTTP service over the swarm (axum): requests are checked, admitted,
//! routed by the tracker with a signed ticket, driven over warm connections, and streamed back.

mod admission;
mod api;
mod dashboard;
mod error;
mod metrics;
mod openai;
mod respond;
mod service;
mod text;
mod verify;

pub use dashboard::swarm_json;
pub use service::{Gateway, GatewayConfig, GatewayError};

use std::sync::Arc;

/// Serves the API on `listener` until `shutdown` completes.
pub async fn serve(
    gw: Arc<Gateway>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, api::router(gw)).with_graceful_shutdown(shutdown).await
}

/// Not API: for the fuzz target `openai_body` (fuzz/) and its replay test. Runs a request body
/// through the checks made before a model is consulted: parsing, the generation parameters and
/// each message's text. Returns the refusal as its JSON error body. Must not panic on any input.
#[doc(hidden)]
pub fn fuzz_request_body(bytes: &[u8], chat: bool) -> Result<(), String> {
    let check = || -> Result<(), error::ApiError> {
        let body = openai::Body::parse(bytes)?;
        body.params(chat)?;
        for m in body.messages.iter().flatten() {
            m.text()?;
        }
        Ok(())
    };
    check().map_err(|e| e.body().to_string())
}

fn unix_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

impl Gateway {
    /// When the gateway started, in unix seconds (the models' `created`).
    pub fn created(&self) -> u64 {
        unix_secs().saturating_sub(self.started.elapsed().as_secs())
    }

    pub fn created_now(&self) -> u64 {
        unix_secs()
    }
}
