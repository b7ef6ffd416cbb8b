//! A worker's control connection: its join (join token, identity, registration), then its
//! heartbeats and usage reports up and relay dial requests down, until it leaves or the
//! connection drops. A heartbeat naming more prefix blocks or opened sessions than the protocol
//! allows is refused and ends the connection (no worker of ours sends one).

use crate::answers::{store_err, token_ok};
use crate::registry::Joining;
use crate::relay::relay_host;
use crate::server::{lock, refused, send, unix_ms, Conn, Shared};
use bytes::Bytes;
use dgr_proto::{
    codec, relay_addr, verifying_key, worker_id, write_frame, Ack, Join, Joined, RefusalKind, Registration, SecureStream, TrackerBody,
    TrackerFrame, MAX_HELD_DIGESTS, MAX_OPENED_TAGS, TRACKER_MAX_FRAME,
};
use ed25519_dalek::Signature;
use futures::{SinkExt, StreamExt};
use prost::Message;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_util::codec::Framed;

/// A worker's control connection: checks its join, then keeps its record live until it leaves,
/// the connection drops, or it re-joins on another connection.
/// `reached` is the tracker's address the connection came in on.
pub(crate) async fn worker_session(mut stream: SecureStream, j: Join, nonce: &[u8], reached: Option<SocketAddr>, sh: &Arc<Shared>) {
    let reg = match check_join(&j, nonce, sh) {
        Ok(reg) => reg,
        Err((kind, msg)) => {
            sh.metrics.refused(kind.name());
            eprintln!("dgr tracker: refused a worker join: {msg}");
            let _ = write_frame(&mut stream, &TrackerFrame::new(refused(kind, msg))).await;
            return;
        }
    };
    let Some(key) = verifying_key(&j.identity) else { return };
    let id = worker_id(&key);
    let relayed = reg.addr.is_empty();
    let addr = if relayed { relay_addr(&relay_host(&lock(&sh.advertise), reached), &id) } else { reg.addr.clone() };
    let (wid, wreg, waddr) = (id.clone(), reg.clone(), addr.clone());
    let joined = sh.store.call(move |s| s.worker_joined(&wid, &wreg, &waddr, unix_ms())).await;
    if let Err(e) = joined {
        let _ = write_frame(&mut stream, &TrackerFrame::new(TrackerBody::Refused(store_err(e)))).await;
        return;
    }
    let conn_id = sh.next_conn.fetch_add(1, Relaxed);
    let (control, mut control_rx) = mpsc::channel::<TrackerFrame>(256);
    let heartbeat = sh.cfg.heartbeat;
    // A re-join under the same identity replaces the old record: never listed twice.
    lock(&sh.registry).join(Joining { id: id.clone(), reg: reg.clone(), addr, relayed, conn: conn_id, control });
    sh.metrics.joins.fetch_add(1, Relaxed);
    let mut conn = Framed::new(stream, codec(TRACKER_MAX_FRAME));
    let joined = Joined { worker_id: id.clone(), heartbeat_ms: heartbeat.as_millis() as u32 };
    if send(&mut conn, TrackerBody::Joined(joined)).await {
        worker_loop(&mut conn, &mut control_rx, &id, &reg, sh).await;
    }
    lock(&sh.registry).leave(&id, conn_id);
}

async fn worker_loop(conn: &mut Conn, control: &mut mpsc::Receiver<TrackerFrame>, id: &str, reg: &Registration, sh: &Arc<Shared>) {
    // A connection silent for this long is dead, even if TCP has not noticed.
    let silent = 30 * sh.cfg.heartbeat;
    loop {
        tokio::select! {
            f = control.recv() => {
                let Some(f) = f else { return };
                if conn.send(Bytes::from(f.encode_to_vec())).await.is_err() {
                    return;
                }
            }
            next = tokio::time::timeout(silent, conn.next()) => {
                let body = match next {
                    Ok(Some(Ok(bytes))) => match TrackerFrame::decode(bytes) {
                        Ok(TrackerFrame { body: Some(b) }) => b,
                        _ => return,
                    },
                    _ => return,
                };
                match body {
                    TrackerBody::Heartbeat(h) => {
                        let held = h.prefix.map(|p| p.digests);
                        let oversized = if held.as_ref().is_some_and(|d| d.len() > MAX_HELD_DIGESTS) {
                            Some(format!("{MAX_HELD_DIGESTS} prefix blocks"))
                        } else {
                            (h.opened.len() > MAX_OPENED_TAGS).then(|| format!("{MAX_OPENED_TAGS} opened sessions"))
                        };
                        if let Some(most) = oversized {
                            sh.metrics.refused(RefusalKind::BadRequest.name());
                            let _ = send(conn, refused(RefusalKind::BadRequest, format!("a heartbeat may name at most {most}"))).await;
                            return;
                        }
                        lock(&sh.registry).heartbeat(id, h.load.unwrap_or_default(), &h.opened, held);
                    }
                    TrackerBody::WorkerUsage(u) => {
                        let (wid, engine, model) = (id.to_string(), reg.engine.clone(), reg.model_id.clone());
                        let stored = sh.store.call(move |s| s.record_worker_usage(&wid, &engine, &model, &u, unix_ms())).await;
                        let reply = match stored {
                            Ok(added) => TrackerBody::Ack(Ack { duplicate: !added }),
                            Err(e) => TrackerBody::Refused(store_err(e)),
                        };
                        if !send(conn, reply).await {
                            return;
                        }
                    }
                    TrackerBody::Leave(_) => return,
                    _ => return,
                }
            }
        }
    }
}

fn check_join(j: &Join, nonce: &[u8], sh: &Shared) -> Result<Registration, (RefusalKind, String)> {
    if !token_ok(&j.join_token, &sh.cfg.join_token) {
        return Err((RefusalKind::BadJoinToken, "wrong join token".into()));
    }
    let key = verifying_key(&j.identity).ok_or((RefusalKind::BadSignature, "not an Ed25519 identity key".to_string()))?;
    let sig = Signature::from_slice(&j.signature).map_err(|_| (RefusalKind::BadSignature, "malformed signature".to_string()))?;
    key.verify_strict(nonce, &sig).map_err(|_| (RefusalKind::BadSignature, "the signature is not of this challenge".to_string()))?;
    let reg = j.registration.clone().ok_or((RefusalKind::BadRequest, "a join without a registration".to_string()))?;
    let bad = |m: String| Err((RefusalKind::BadRequest, m));
    if reg.n_layers == 0 || reg.layer_start >= reg.layer_end || reg.layer_end > reg.n_layers {
        return bad(format!("layers {}..{} of {}", reg.layer_start, reg.layer_end, reg.n_layers));
    }
    if reg.model_id.is_empty() || reg.model_id.len() > 256 || !dgr_proto::is_engine_id(&reg.engine) || reg.addr.len() > 512 {
        return bad("a registration needs a model id, an engine id (without @ or +) and an address of sane lengths".into());
    }
    if !reg.step_us_per_layer.is_finite() || reg.step_us_per_layer < 0.0 {
        return bad("a step time must be a finite non-negative number".into());
    }
    Ok(reg)
}
