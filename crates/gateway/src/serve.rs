//! The connection loop: at most `max_connections` connections at once (past it, new ones are
//! closed at once and counted), TLS when configured, a deadline on each request's head, then a
//! graceful drain on shutdown.

use crate::service::Gateway;
use crate::tls::Tls;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::sync::Arc;
use std::time::Duration;

/// A client has this long to send a request's head (slow clients cannot hold a connection), and
/// as long again before that to finish its TLS handshake.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// After shutdown, open connections get this long to finish their responses.
const DRAIN: Duration = Duration::from_secs(10);

/// Serves the API on `listener` until `shutdown` completes, over TLS when `tls` is given. The
/// handshake runs in the connection's own task, so a client that stalls it holds one slot for
/// at most the header deadline and never delays accepting others.
pub async fn serve(
    gw: Arc<Gateway>,
    listener: tokio::net::TcpListener,
    tls: Option<Tls>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = crate::api::router(gw.clone());
    let history = tokio::spawn(crate::history::run(gw.clone()));
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
                Err(_) => { tokio::time::sleep(Duration::from_millis(50)).await; continue }
            },
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            gw.metrics.error("connection_cap");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        match &tls {
            None => {
                let conn = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
                tokio::spawn(async move {
                    let _ = conn.await;
                    drop(slot);
                });
            }
            Some(tls) => {
                let (acceptor, http, watcher, gw) = (tls.acceptor.clone(), http.clone(), graceful.watcher(), gw.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HEADER_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(stream)) => {
                            let _ = watcher.watch(http.serve_connection(TokioIo::new(stream), service)).await;
                        }
                        // Not TLS, a certificate the client refused, or too slow: nothing to answer.
                        Ok(Err(_)) => gw.metrics.error("tls_handshake"),
                        Err(_) => gw.metrics.error("tls_handshake_timeout"),
                    }
                    drop(slot);
                });
            }
        }
    }
    history.abort();
    let _ = tokio::time::timeout(DRAIN, graceful.shutdown()).await;
    Ok(())
}
