//! Joining the trackers: register what this worker serves with every tracker it was given,
//! prove its identity, heartbeat its load to each, report each session's usage (to whichever
//! tracker is joined, until one acknowledges it), and dial back for relayed sessions. A lost
//! tracker is re-joined with backoff capped below its heartbeat interval, so a restarted one
//! lists this worker again within one interval; running sessions never notice (the data path
//! does not touch a tracker). A heartbeat carries the prefix blocks held when they changed since
//! the last one on that connection (a re-joined tracker hears them at once). On shutdown the worker leaves them all at once. Every failed
//! attempt is said with its reason (refused connection, bad join token, bad key, version), so a
//! wrong address or token is visible at once; `serve` gives up after the join timeout when no
//! tracker was ever joined.
//!
//! A tracker connection holds at most `IN_FLIGHT` unacknowledged usage reports, and one whose
//! oldest waits `ACK_HEARTBEATS` heartbeats for its Ack is given up, so a tracker that hangs
//! never keeps the reports from another. A report the tracker refuses (its ledger is down) goes
//! back to the outbox and this connection sends no more for a heartbeat; it stays joined.

use crate::{Metrics, TrackerLink};
use bytes::Bytes;
use dgr_proto::{
    Heartbeat, Join, Leave, Load, PrefixHeld, RefusalKind, Registration, TrackerBody, TrackerCallError, TrackerClient, TrackerFrame,
    TrackerKey, VerifyingKey, WorkerUsage,
};
use ed25519_dalek::Signer;
use futures::{SinkExt, StreamExt};
use prost::Message;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch, Notify};
use tokio::time::Instant;

const CONNECT: Duration = Duration::from_secs(3);
const BACKOFF_MIN: Duration = Duration::from_millis(50);
/// The longest wait between attempts while no tracker has been joined yet.
const UNJOINED_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// A tracker's heartbeat interval until it says (the tracker's default).
const HEARTBEAT_DEFAULT: Duration = Duration::from_millis(1000);
/// Usage reports waiting for a tracker; past this, the oldest are dropped (and counted).
pub(crate) const USAGE_QUEUE: usize = 1 << 16;
/// Usage reports one tracker connection may have sent without an Ack; while that many wait, it
/// takes no more from the outbox.
pub(crate) const IN_FLIGHT: usize = 256;
/// Heartbeat intervals the oldest unacknowledged report may wait before its connection is given up.
const ACK_HEARTBEATS: u32 = 3;

/// A connection's reports sent without an Ack yet, oldest first, each with when it was sent (the
/// tracker answers them in order).
type Unacked = VecDeque<(Instant, WorkerUsage)>;

/// What a worker needs to check route tickets: the key sets of the trackers it joined (learned
/// at each join, kept while a tracker restarts) and its own id.
pub(crate) struct TicketGate {
    keys: RwLock<HashMap<String, Vec<(u64, VerifyingKey)>>>,
    pub worker_id: String,
}

impl TicketGate {
    pub fn new(worker_id: String) -> TicketGate {
        TicketGate { keys: RwLock::new(HashMap::new()), worker_id }
    }

    /// The key `key_id` names, from the set of any tracker this worker joined.
    pub fn key(&self, key_id: u64) -> Option<VerifyingKey> {
        let keys = self.keys.read().unwrap_or_else(|p| p.into_inner());
        keys.values().flatten().find(|(id, _)| *id == key_id).map(|(_, k)| *k)
    }

    fn learn(&self, tracker: &str, set: Vec<(u64, VerifyingKey)>) {
        self.keys.write().unwrap_or_else(|p| p.into_inner()).insert(tracker.to_string(), set);
    }
}

/// Usage reports no tracker has acknowledged yet, shared by the join loops: a joined loop
/// takes the next one, and gives back what it sent but saw no `Ack` for when its connection
/// ends, so another tracker (or the same one, re-joined) gets it. Reports are idempotent under
/// (session, worker) in the shared ledger, so a resend is safe.
pub(crate) struct UsageOutbox {
    queue: Mutex<VecDeque<WorkerUsage>>,
    ready: Notify,
    metrics: Arc<Metrics>,
}

impl UsageOutbox {
    pub fn new(metrics: Arc<Metrics>) -> Arc<UsageOutbox> {
        Arc::new(UsageOutbox { queue: Mutex::new(VecDeque::new()), ready: Notify::new(), metrics })
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, VecDeque<WorkerUsage>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Moves the scheduler's reports in until it stops.
    pub async fn fill(self: Arc<Self>, mut from: mpsc::Receiver<WorkerUsage>) {
        while let Some(u) = from.recv().await {
            let mut q = self.queue();
            if q.len() >= USAGE_QUEUE {
                q.pop_front();
                self.metrics.failure(dgr_proto::ErrorKind::Overloaded);
            }
            q.push_back(u);
            drop(q);
            self.ready.notify_one();
        }
    }

    /// The next report to send. Cancel-safe: a report is taken only when this returns it.
    async fn next(&self) -> WorkerUsage {
        loop {
            let notified = self.ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(u) = self.queue().pop_front() {
                return u;
            }
            notified.await;
        }
    }

    /// Reports sent but not stored (their connection ended, or the tracker refused them), to go
    /// first. The queue keeps its cap: past it, the oldest are dropped, counted and said.
    fn give_back(&self, reports: impl DoubleEndedIterator<Item = WorkerUsage>) {
        let mut q = self.queue();
        for u in reports.rev() {
            q.push_front(u);
        }
        let over = q.len().saturating_sub(USAGE_QUEUE);
        q.drain(..over);
        drop(q);
        if over > 0 {
            for _ in 0..over {
                self.metrics.failure(dgr_proto::ErrorKind::Overloaded);
            }
            eprintln!("dgr worker: the usage report queue is full ({USAGE_QUEUE}): dropped the {over} oldest reports");
        }
        self.ready.notify_one();
    }
}

/// Keeps this worker joined to one tracker until shutdown.
pub(crate) struct Joiner {
    pub tracker: String,
    pub link: TrackerLink,
    pub reg: Registration,
    pub gate: Arc<TicketGate>,
    pub metrics: Arc<Metrics>,
    pub outbox: Arc<UsageOutbox>,
    /// Becomes true on shutdown: leave the tracker now.
    pub leave: watch::Receiver<bool>,
    /// Set true at this worker's first join to any of its trackers.
    pub joined: Arc<watch::Sender<bool>>,
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
        let mut backoff = BACKOFF_MIN;
        let mut heartbeat = HEARTBEAT_DEFAULT;
        let mut announced = false;
        let mut attempt = 0u64;
        loop {
            attempt += 1;
            let mut unacked = Unacked::new();
            let mut joined_at = None;
            let ended = self.session(&mut unacked, &on_relay, &mut announced, &mut joined_at, &mut heartbeat).await;
            self.outbox.give_back(unacked.into_iter().map(|(_, u)| u));
            match ended {
                Ended::Left => return,
                Ended::Retry(why) => {
                    if announced {
                        eprintln!("dgr worker: lost the tracker at {}: {why}; re-joining", self.tracker);
                        announced = false;
                        attempt = 0;
                    } else if joined_at.is_none() {
                        eprintln!(
                            "dgr worker: could not join the tracker at {} (attempt {attempt}): {why}; retrying in {} ms",
                            self.tracker,
                            backoff.as_millis()
                        );
                    }
                    // Only after a session that lasted: one that takes the join and fails at once
                    // is not re-joined in a tight loop.
                    if joined_at.is_some_and(|t: Instant| t.elapsed() >= heartbeat) {
                        backoff = BACKOFF_MIN;
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = self.leave.changed() => return,
            }
            // Below half an interval: a restarted tracker hears from this worker within one. A
            // tracker never joined yet is tried once a second at most, each failure said.
            let cap = if *self.joined.borrow() { heartbeat / 2 } else { UNJOINED_BACKOFF_MAX };
            backoff = (backoff * 2).min(cap);
        }
    }

    async fn session(
        &mut self,
        unacked: &mut Unacked,
        on_relay: &(impl Fn(TcpStream) + Send + Sync),
        announced: &mut bool,
        joined_at: &mut Option<Instant>,
        heartbeat: &mut Duration,
    ) -> Ended {
        let mut client = match TrackerClient::connect(&self.tracker, CONNECT).await {
            Ok(c) => c,
            Err(TrackerCallError::Refused(r)) => return Ended::Retry(refusal(&r)),
            Err(e) => return Ended::Retry(e.to_string()),
        };
        let Some(keys) = key_set(&client.challenge.keys) else {
            return Ended::Retry("the tracker's key set holds no Ed25519 key, or a malformed one".into());
        };
        let join = Join {
            join_token: self.link.join_token.clone(),
            identity: self.link.identity.verifying_key().to_bytes().to_vec(),
            signature: self.link.identity.sign(&client.challenge.nonce).to_bytes().to_vec(),
            registration: Some(self.reg.clone()),
        };
        *heartbeat = match client.call(TrackerBody::Join(join)).await {
            Ok(TrackerBody::Joined(j)) => Duration::from_millis(j.heartbeat_ms.clamp(50, 60_000) as u64),
            Ok(_) => return Ended::Retry("unexpected answer to a join".into()),
            Err(TrackerCallError::Refused(r)) => return Ended::Retry(refusal(&r)),
            Err(e) => return Ended::Retry(e.to_string()),
        };
        self.gate.learn(&self.tracker, keys);
        *joined_at = Some(Instant::now());
        self.joined.send_replace(true);
        if !*announced {
            eprintln!("dgr worker: joined the tracker at {} as {}", self.tracker, self.gate.worker_id);
            *announced = true;
        }
        let mut conn = client.into_framed();
        let send = |f: TrackerBody| Bytes::from(TrackerFrame::new(f).encode_to_vec());
        let mut tick = tokio::time::interval(*heartbeat);
        let mut last = (self.metrics.steps.load(Relaxed), self.metrics.step_micros.load(Relaxed));
        let outbox = self.outbox.clone();
        // No report is taken before this (a refused one waits a heartbeat before it is retried).
        let mut resume = Instant::now();
        // The version of the held prefix digests this tracker has (0: none sent on this connection).
        let mut held_sent = 0;
        loop {
            let (at, ob) = (resume, &outbox);
            tokio::select! {
                _ = tick.tick() => {
                    if unacked.front().is_some_and(|(sent, _)| sent.elapsed() > ACK_HEARTBEATS * *heartbeat) {
                        return Ended::Retry(format!("no Ack for a usage report within {ACK_HEARTBEATS} heartbeats"));
                    }
                    // The sessions named before the load is read: each one's reservation is in it.
                    let opened = self.metrics.opened_lately(std::time::Instant::now());
                    let load = self.load(&mut last);
                    let (version, held) = self.metrics.held();
                    let prefix = (version != held_sent).then(|| PrefixHeld { digests: held.to_vec() });
                    held_sent = version;
                    if conn.send(send(TrackerBody::Heartbeat(Heartbeat { load: Some(load), prefix, opened }))).await.is_err() {
                        return Ended::Retry("connection lost".into());
                    }
                }
                u = async move { tokio::time::sleep_until(at).await; ob.next().await }, if unacked.len() < IN_FLIGHT => {
                    unacked.push_back((Instant::now(), u.clone()));
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
                            match dgr_proto::relay_accept(&self.tracker, d.token, CONNECT).await {
                                Ok(s) => on_relay(s),
                                Err(e) => eprintln!("dgr worker: relay dial-back to {} failed: {e}", self.tracker),
                            }
                        }
                        // The tracker could not store the oldest report: another tracker may
                        // take it now, this one a heartbeat later; the connection stays.
                        Some(TrackerBody::Refused(r)) => {
                            let Some((_, u)) = unacked.pop_front() else {
                                return Ended::Retry(r.message);
                            };
                            if resume <= Instant::now() {
                                eprintln!("dgr worker: the tracker at {} refused a usage report: {}; retrying", self.tracker, r.message);
                            }
                            self.outbox.give_back(std::iter::once(u));
                            resume = Instant::now() + *heartbeat;
                        }
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
        let memory = *m.device_memory.lock().unwrap_or_else(|p| p.into_inner());
        Load {
            sessions: m.sessions_open.load(Relaxed) as u32,
            queue_depth: m.queue_depth.load(Relaxed) as u32,
            kv_used_tokens: m.kv_tokens_used.load(Relaxed),
            recent_step_us: recent,
            device_memory_total: memory.map_or(0, |m| m.total),
            device_memory_free: memory.map_or(0, |m| m.free),
            kv_reserved_tokens: m.kv_tokens_reserved.load(Relaxed),
        }
    }
}

/// Why the tracker refused a join, in the words an operator fixes it with.
fn refusal(r: &dgr_proto::Refused) -> String {
    match r.refusal_kind() {
        RefusalKind::BadJoinToken => format!("bad join token: {} (check --join-token-file)", r.message),
        RefusalKind::BadSignature => format!("bad key: {} (check --key-file)", r.message),
        RefusalKind::BadRequest if r.message.contains("protocol version") => format!("version: {}", r.message),
        k => format!("refused ({}): {}", k.name(), r.message),
    }
}

/// A challenge's key set, if it holds at least one key and every key is a valid one (at most
/// 64: a set is a handful of keys).
fn key_set(keys: &[TrackerKey]) -> Option<Vec<(u64, VerifyingKey)>> {
    if keys.is_empty() || keys.len() > 64 {
        return None;
    }
    keys.iter().map(|k| Some((k.key_id, dgr_proto::verifying_key(&k.public_key)?))).collect()
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

#[cfg(test)]
mod tests;
