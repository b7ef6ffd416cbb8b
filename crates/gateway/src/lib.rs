//! The OpenAI-compatible HTTP service over the swarm (axum): requests are checked, admitted,
//! routed by the tracker with a signed ticket, driven over warm connections by `dgr-driver`, and
//! streamed back.

mod admission;
mod api;
mod api_error;
mod dashboard;
mod history;
mod metrics;
mod openai;
mod respond;
mod service;
mod structured;
mod text;
mod tools;
mod verify;

pub use dashboard::swarm_json;
pub use service::{Gateway, GatewayConfig, GatewayError};

use std::sync::Arc;

/// A client has this long to send a request's head (slow clients cannot hold a connection).
const HEADER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// After shutdown, open connections get this long to finish their responses.
const DRAIN: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves the API on `listener` until `shutdown` completes: at most `cfg.max_connections`
/// connections at once (past it, new ones are closed at once and counted), a deadline on each
/// request's head, then a graceful drain.
pub async fn serve(
    gw: Arc<Gateway>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let app = api::router(gw.clone());
    let history = tokio::spawn(history::run(gw.clone()));
    let slots = Arc::new(tokio::sync::Semaphore::new(gw.cfg.max_connections.max(1)));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(HEADER_TIMEOUT);
    tokio::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                // Out of descriptors and the like: back off instead of spinning.
                Err(_) => { tokio::time::sleep(std::time::Duration::from_millis(50)).await; continue }
            },
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            gw.metrics.error("connection_cap");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            let _ = conn.await;
            drop(slot);
        });
    }
    history.abort();
    let _ = tokio::time::timeout(DRAIN, graceful.shutdown()).await;
    Ok(())
}

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
