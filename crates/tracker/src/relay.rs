//! The relay: a client asks for a worker that opened no port; the worker is told (on its
//! control connection) to dial back, and the two sockets are spliced, carrying the stage
//! protocol unchanged.

use crate::server::{lock, random, refused, Shared};
use dgr_proto::{write_frame, Ack, RefusalKind, RelayConnect, RelayDial, TrackerBody, TrackerFrame};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::oneshot;

/// How long a relay client waits for the worker to dial back.
const RELAY_DIAL: Duration = Duration::from_secs(5);

/// A client asks for a relayed worker: the worker is told to dial back, and the two sockets are
/// spliced.
pub(crate) async fn relay_client(mut client: TcpStream, rc: RelayConnect, sh: &Arc<Shared>) {
    let token = random::<16>().to_vec();
    let (tx, rx) = oneshot::channel();
    let control = {
        let reg = lock(&sh.registry);
        reg.worker(&rc.worker_id).filter(|w| w.relayed).map(|w| w.control.clone())
    };
    let dialed = match control {
        Some(c) => {
            lock(&sh.relays).insert(token.clone(), tx);
            c.try_send(TrackerFrame::new(TrackerBody::RelayDial(RelayDial { token: token.clone() }))).is_ok()
        }
        None => false,
    };
    let worker = if dialed { tokio::time::timeout(RELAY_DIAL, rx).await.ok().and_then(|r| r.ok()) } else { None };
    lock(&sh.relays).remove(&token);
    let Some(mut worker) = worker else {
        sh.metrics.refused(RefusalKind::NotConnected.name());
        let msg = format!("worker {} is not connected to this relay", rc.worker_id);
        let _ = write_frame(&mut client, &TrackerFrame::new(refused(RefusalKind::NotConnected, msg))).await;
        return;
    };
    if write_frame(&mut client, &TrackerFrame::new(TrackerBody::RelayReady(Ack::default()))).await.is_err() {
        return;
    }
    sh.metrics.relay_sessions.fetch_add(1, Relaxed);
    let _ = tokio::io::copy_bidirectional(&mut client, &mut worker).await;
}
