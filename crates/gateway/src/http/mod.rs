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

pub use dashboard::swarm_json;
pub use service::{Gateway, GatewayConfig, GatewayError};

use std::sync::Arc;

/// Serves the API on `listener` until `shutdown` completes.
pub async fn serve(gw: Arc<Gateway>, listener: tokio::net::TcpListener, shutdown: impl std::future::Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
    axum::serve(listener, api::router(gw)).with_graceful_shutdown(shutdown).await
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
