//! Warm connections to workers, shared by every session a driver runs: one per worker address,
//! opened (with its handshake) on first use and kept. Frames go out through a bounded outbox;
//! incoming frames go to the session they name, so sessions on one connection never see each
//! other's frames. A connection that breaks tells each of its sessions, and the next use opens
//! a fresh one.

use crate::conn::{self, Sink, Source};
use crate::DriveError;
use crate::FailKind;
use bytes::Bytes;
use dgr_proto::{Body, Frame, StageInfo};
use futures::{SinkExt, StreamExt};
use prost::Message;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// Frames waiting to be written on one connection.
const OUTBOX: usize = 1024;

// Nearly every event is a frame: boxing it would allocate once per frame to shrink the rare `Lost`.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Event {
    /// A frame for the session, from its stage `.0`.
    Frame(u32, Body),
    /// The connection to stage `.0` broke: `.1` says how (an integrity failure, or lost).
    Lost(u32, FailKind, String),
}

/// Per session on the connection: its stage index in the route, and where its events go.
type SubscriberMap = HashMap<[u8; 16], (u32, mpsc::UnboundedSender<Event>)>;
type Subscribers = Mutex<SubscriberMap>;

#[derive(Default)]
struct LinkState {
    subs: Subscribers,
    dead: AtomicBool,
}

/// One connection to a worker.
pub(crate) struct Link {
    /// What the worker said it serves in its Hello.
    pub info: StageInfo,
    /// The worker id it proved in the secure channel's handshake (None: a plaintext link).
    pub peer: Option<String>,
    out: mpsc::Sender<Bytes>,
    state: Arc<LinkState>,
}

/// The connections of one driver (a gateway, or a single `generate`).
#[derive(Default)]
pub struct Links {
    map: tokio::sync::Mutex<HashMap<String, Arc<Link>>>,
}

fn lock(s: &Subscribers) -> std::sync::MutexGuard<'_, SubscriberMap> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

impl Links {
    pub fn new() -> Links {
        Links::default()
    }

    /// The live connection to `addr`, opened if there is none. `stage` names it in errors.
    pub(crate) async fn get(&self, addr: &str, stage: u32, timeout: Duration, max_frame: usize) -> Result<Arc<Link>, DriveError> {
        if let Some(l) = self.map.lock().await.get(addr).filter(|l| !l.state.dead.load(Ordering::Acquire)) {
            return Ok(l.clone());
        }
        let (sink, source, info, peer) = conn::connect(addr, stage, timeout, max_frame).await?;
        let (out, rx) = mpsc::channel(OUTBOX);
        let state = Arc::new(LinkState::default());
        spawn_writer(sink, rx);
        spawn_reader(source, state.clone());
        let link = Arc::new(Link { info, peer, out, state });
        let mut map = self.map.lock().await;
        match map.get(addr).filter(|l| !l.state.dead.load(Ordering::Acquire)) {
            // Another session opened one meanwhile: use that; this one closes as it drops.
            Some(existing) => Ok(existing.clone()),
            None => {
                map.insert(addr.to_string(), link.clone());
                Ok(link)
            }
        }
    }
}

impl Link {
    /// Routes frames about session `id` to `tx`, tagged with `stage`.
    pub fn subscribe(&self, id: [u8; 16], stage: u32, tx: mpsc::UnboundedSender<Event>) {
        if self.state.dead.load(Ordering::Acquire) {
            let _ = tx.send(Event::Lost(stage, FailKind::ConnectionLost, "connection closed".into()));
        }
        lock(&self.state.subs).insert(id, (stage, tx));
    }

    pub fn unsubscribe(&self, id: &[u8; 16]) {
        lock(&self.state.subs).remove(id);
    }

    pub async fn send(&self, f: &Frame) -> Result<(), String> {
        self.out.send(Bytes::from(f.encode_to_vec())).await.map_err(|_| "connection closed".to_string())
    }
}

/// A warm connection pings this often while nothing else goes out, so a worker's idle timeout
/// (minutes) never closes it under a session about to open.
const KEEPALIVE: Duration = Duration::from_secs(60);

fn spawn_writer(mut sink: Sink, mut rx: mpsc::Receiver<Bytes>) {
    tokio::spawn(async move {
        let ping = Bytes::from(Frame::new(Body::Ping(dgr_proto::Ping { nonce: 0 })).encode_to_vec());
        loop {
            let b = match tokio::time::timeout(KEEPALIVE, rx.recv()).await {
                Ok(Some(b)) => b,
                Ok(None) => break,
                Err(_) => ping.clone(),
            };
            if sink.send(b).await.is_err() {
                return;
            }
        }
        // Every user is gone: close our half, so the worker closes the connection too.
        let _ = sink.close().await;
    });
}

/// The session a frame is about; empty for a frame about the connection.
fn session_of(b: &Body) -> &[u8] {
    match b {
        Body::Opened(r) | Body::Cancel(r) | Body::Close(r) => &r.session_id,
        Body::Token(t) => &t.session_id,
        Body::Error(e) => &e.session_id,
        Body::Usage(u) => &u.session_id,
        Body::Progress(p) => &p.session_id,
        Body::Embedding(e) => &e.session_id,
        Body::Forward(f) => &f.session_id,
        Body::Open(o) => &o.session_id,
        Body::Hello(_) | Body::Ping(_) | Body::Pong(_) | Body::Fetch(_) | Body::Manifest(_) | Body::Chunk(_) => &[],
    }
}

fn spawn_reader(mut source: Source, state: Arc<LinkState>) {
    tokio::spawn(async move {
        let (kind, why) = loop {
            let body = match source.next().await {
                Some(Ok(b)) => match Frame::decode(b) {
                    Ok(Frame { body: Some(body) }) => body,
                    _ => break (FailKind::ConnectionLost, "undecodable frame from the worker".to_string()),
                },
                Some(Err(e)) if dgr_proto::SecureError::of(&e) == Some(&dgr_proto::SecureError::Integrity) => {
                    break (FailKind::Integrity, e.to_string())
                }
                Some(Err(e)) => break (FailKind::ConnectionLost, e.to_string()),
                None => break (FailKind::ConnectionLost, "connection closed".to_string()),
            };
            let subs = lock(&state.subs);
            match <[u8; 16]>::try_from(session_of(&body)) {
                Ok(id) => {
                    if let Some((stage, tx)) = subs.get(&id) {
                        let _ = tx.send(Event::Frame(*stage, body));
                    }
                }
                // About the connection: every session on it hears it.
                Err(_) => {
                    for (stage, tx) in subs.values() {
                        let _ = tx.send(Event::Frame(*stage, body.clone()));
                    }
                }
            }
        };
        state.dead.store(true, Ordering::Release);
        for (stage, tx) in lock(&state.subs).values() {
            let _ = tx.send(Event::Lost(*stage, kind, why.clone()));
        }
    });
}
