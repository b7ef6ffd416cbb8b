//! The relay: a client asks for a worker that opened no port; the worker is told (on its
//! control connection) to dial back, and the two sockets are spliced, carrying the stage
//! protocol unchanged.

use crate::server::{lock, random, refused, Shared};
use dgr_proto::{write_frame, Ack, RefusalKind, RelayConnect, RelayDial, TrackerBody, TrackerFrame};
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::oneshot;

/// How long a relay client waits for the worker to dial back.
const RELAY_DIAL: Duration = Duration::from_secs(5);

/// The tracker address a relayed worker's address names: the advertised one, unless that is an
/// unspecified address (a tracker listening on all interfaces without `--advertise`), which
/// would send every client to its own host; then the address the worker's connection reached,
/// one its network routes to.
pub(crate) fn relay_host(advertise: &str, reached: Option<SocketAddr>) -> String {
    match (advertise.parse::<SocketAddr>(), reached) {
        (Ok(a), Some(r)) if a.ip().is_unspecified() => match r {
            // A dual-stack listener sees IPv4 clients at mapped addresses.
            SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
                Some(v4) => SocketAddr::from((v4, v6.port())).to_string(),
                None => r.to_string(),
            },
            SocketAddr::V4(_) => r.to_string(),
        },
        _ => advertise.to_string(),
    }
}

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

#[cfg(test)]
mod tests {
    use super::relay_host;

    /// One table: an advertised address stands; an unspecified one gives way to the address the
    /// worker reached (IPv4-mapped ones written as IPv4); a name is kept as given.
    #[test]
    fn relay_host_names_a_reachable_address() {
        let cases = [
            ("10.0.0.1:7400", Some("10.0.0.9:7400"), "10.0.0.1:7400"),
            ("tracker.example:7400", Some("10.0.0.9:7400"), "tracker.example:7400"),
            ("0.0.0.0:7400", Some("10.77.0.1:7400"), "10.77.0.1:7400"),
            ("[::]:7400", Some("[::ffff:10.77.0.1]:7400"), "10.77.0.1:7400"),
            ("[::]:7400", Some("[fd00::1]:7400"), "[fd00::1]:7400"),
            ("0.0.0.0:7400", None, "0.0.0.0:7400"),
        ];
        for (advertise, reached, want) in cases {
            let got = relay_host(advertise, reached.map(|r| r.parse().unwrap()));
            assert_eq!(got, want, "advertise {advertise}, reached {reached:?}");
        }
    }
}
