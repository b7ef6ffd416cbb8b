//! Joining a tracker: register what this worker serves, prove its identity, heartbeat its load,
//! report each session's usage until the tracker acknowledges it, and dial back for relayed
//! sessions. A lost tracker is re-joined with backoff; running sessions never notice (the data
//! path does not touch the tracker). On shutdown the worker leaves at once.

use crate::{Metrics, TrackerLink};
use bytes::Bytes;
use dgr_proto::{
    Heartbeat, Join, Leave, Load, RefusalKind, Registration, TrackerBody, TrackerCallError, TrackerClient, TrackerFrame, VerifyingKey,
    WorkerUsage,
};
use ed25519_dalek::Signer;
use futures::{SinkExt, StreamExt};
use prost::Message;
use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};

const CONNECT: Duration = Duration::from_secs(3);
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// Usage reports waiting for the tracker; past this, the oldest are dropped (and counted).
pub(crate) const USAGE_QUEUE: usize = 1 << 16;

/// What a worker needs to check route tickets: the tracker's key (learned at join; it survives a
/// tracker restart) and its own id.
pub(crate) struct TicketGate {
    pub tracker_key: RwLock<Option<VerifyingKey>>,
    pub worker_id: String,
}

pub(crate) struct Joiner {
    pub link: TrackerLink,
    pub reg: Registration,
    pub gate: Arc<TicketGate>,
    pub metrics: Arc<Metrics>,
    pub usage: mpsc::Receiver<WorkerUsage>,
    /// Becomes true on shutdown: leave the tracker now.
    pub leave: watch::Receiver<bool>,
}

enum Ended {
    /// The connection was lost or refused; try again.
    Retry(String),
    /// The worker is shutting down and has left.
    Left,
}

impl Joiner {
    /// Keeps this worker joined until shutdown. `on_relay` serves a dialed-back relay connection.
    pub async fn run(mut self, on_relay: impl Fn(TcpStream) + Send + Sync + 'static) {
        let mut unacked: VecDeque<WorkerUsage> = VecDeque::new();
        let mut backoff = BACKOFF_MIN;
        let mut announced = false;
        loop {
            match self.session(&mut unacked, &on_relay, &mut announced).await {
                Ended::Left => return,
                Ended::Retry(why) => {
                    if announced {
                        eprintln!("dgr worker: lost the tracker at {}: {why}; re-joining", self.link.addr);
                        announced = false;
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = self.leave.changed() => return,
            }
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }

    async fn session(
        &mut self,
        unacked: &mut VecDeque<WorkerUsage>,
        on_relay: &(impl Fn(TcpStream) + Send + Sync),
        announced: &mut bool,
    ) -> Ended {
        let mut client = match TrackerClient::connect(&self.link.addr, CONNECT).await {
            Ok(c) => c,
            Err(e) => return Ended::Retry(e.to_string()),
        };
        let Some(key) = dgr_proto::verifying_key(&client.challenge.tracker_key) else {
            return Ended::Retry("the tracker's key is not an Ed25519 key".into());
        };
        let join = Join {
            join_token: self.link.join_token.clone(),
            identity: self.link.identity.verifying_key().to_bytes().to_vec(),
            signature: self.link.identity.sign(&client.challenge.nonce).to_bytes().to_vec(),
            registration: Some(self.reg.clone()),
        };
        let heartbeat = match client.call(TrackerBody::Join(join)).await {
            Ok(TrackerBody::Joined(j)) => Duration::from_millis(j.heartbeat_ms.clamp(50, 60_000) as u64),
            Ok(_) => return Ended::Retry("unexpected answer to a join".into()),
            Err(TrackerCallError::Refused(r)) => {
                if r.refusal_kind() == RefusalKind::BadJoinToken {
                    eprintln!("dgr worker: the tracker refused the join token; check --join-token-file");
                }
                return Ended::Retry(r.message);
            }
            Err(e) => return Ended::Retry(e.to_string()),
        };
        *self.gate.tracker_key.write().unwrap_or_else(|p| p.into_inner()) = Some(key);
        if !*announced {
            eprintln!("dgr worker: joined the tracker at {} as {}", self.link.addr, self.gate.worker_id);
            *announced = true;
        }
        let mut conn = client.into_framed();
        let send = |f: TrackerBody| Bytes::from(TrackerFrame::new(f).encode_to_vec());
        // Reports not acknowledged before a lost connection go again (the ledger stores each once).
        for u in unacked.iter() {
            if conn.send(send(TrackerBody::WorkerUsage(u.clone()))).await.is_err() {
                return Ended::Retry("connection lost".into());
            }
        }
        let mut tick = tokio::time::interval(heartbeat);
        let mut last = (self.metrics.steps.load(Relaxed), self.metrics.step_micros.load(Relaxed));
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    let load = self.load(&mut last);
                    if conn.send(send(TrackerBody::Heartbeat(Heartbeat { load: Some(load) }))).await.is_err() {
                        return Ended::Retry("connection lost".into());
                    }
                }
                u = self.usage.recv() => {
                    let Some(u) = u else { return Ended::Left };
                    if unacked.len() >= USAGE_QUEUE {
                        unacked.pop_front();
                        self.metrics.failure(dgr_proto::ErrorKind::Overloaded);
                    }
                    unacked.push_back(u.clone());
                    if conn.send(send(TrackerBody::WorkerUsage(u))).await.is_err() {
                        return Ended::Retry("connection lost".into());
                    }
                }
                _ = self.leave.changed() => {
                    let _ = conn.send(send(TrackerBody::Leave(Leave {}))).await;
                    return Ended::Left;
                }
                next = conn.next() => {
                    let body = match next {
                        Some(Ok(b)) => TrackerFrame::decode(b).ok().and_then(|f| f.body),
                        Some(Err(e)) => return Ended::Retry(e.to_string()),
                        None => return Ended::Retry("the tracker closed the connection".into()),
                    };
                    match body {
                        Some(TrackerBody::Ack(_)) => {
                            unacked.pop_front();
                        }
                        Some(TrackerBody::RelayDial(d)) => {
                            match dgr_proto::relay_accept(&self.link.addr, d.token, CONNECT).await {
                                Ok(s) => on_relay(s),
                                Err(e) => eprintln!("dgr worker: relay dial-back failed: {e}"),
                            }
                        }
                        Some(TrackerBody::Refused(r)) => return Ended::Retry(r.message),
                        _ => return Ended::Retry("unexpected frame from the tracker".into()),
                    }
                }
            }
        }
    }

    /// Live load for a heartbeat; `last` holds the step counters at the previous one.
    fn load(&self, last: &mut (u64, u64)) -> Load {
        let m = &self.metrics;
        let (steps, micros) = (m.steps.load(Relaxed), m.step_micros.load(Relaxed));
        let recent = if steps > last.0 { (micros - last.1) as f64 / (steps - last.0) as f64 } else { 0.0 };
        *last = (steps, micros);
        Load {
            sessions: m.sessions_open.load(Relaxed) as u32,
            queue_depth: m.queue_depth.load(Relaxed) as u32,
            kv_used_tokens: m.kv_tokens_used.load(Relaxed),
            recent_step_us: recent,
        }
    }
}

/// A worker's identity key: read from `path`, or made and written there (mode 0600) when the
/// file does not exist yet, so that a restarted worker keeps its identity.
pub fn load_or_create_identity(path: &std::path::Path) -> std::io::Result<dgr_proto::SigningKey> {
    use std::io::{Error, ErrorKind};
    match std::fs::read(path) {
        Ok(bytes) => {
            let seed: [u8; 32] = bytes
                .as_slice()
                .try_into()
                .map_err(|_| Error::new(ErrorKind::InvalidData, format!("{}: an identity key file holds 32 bytes", path.display())))?;
            Ok(dgr_proto::SigningKey::from_bytes(&seed))
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {
            let key = dgr_proto::new_signing_key().map_err(|e| Error::other(e.to_string()))?;
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)?;
            }
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
            std::io::Write::write_all(&mut f, &key.to_bytes())?;
            Ok(key)
        }
        Err(e) => Err(e),
    }
}
