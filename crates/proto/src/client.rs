//! A client's connection to a tracker: the secure channel (the tracker proves a key the client
//! accepts, `trust`), Hello and the tracker's challenge, then one request and its answer at a
//! time.

use crate::{codec, Challenge, Join, Joined, Refused, Registration, SecureStream, SigningKey, TrackerBody, TrackerFrame};
use bytes::Bytes;
use ed25519_dalek::Signer;
use futures::{SinkExt, StreamExt};
use prost::Message;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio_util::codec::{Framed, LengthDelimitedCodec};

/// What a call's error says when the tracker closed the link.
const CLOSED: &str = "connection closed";

/// Tracker frames are small; this caps what a client will buffer.
pub const TRACKER_MAX_FRAME: usize = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum TrackerCallError {
    #[error("tracker {addr}: {why}")]
    Io { addr: String, why: String },
    #[error("tracker refused ({}): {}", .0.refusal_kind().name(), .0.message)]
    Refused(Refused),
    #[error("tracker {addr}: unexpected answer")]
    Protocol { addr: String },
    #[error("tracker {addr}: {why}")]
    Key { addr: String, why: String },
}

pub struct TrackerClient {
    addr: String,
    framed: Framed<SecureStream, LengthDelimitedCodec>,
    timeout: Duration,
    pub challenge: Challenge,
}

impl TrackerClient {
    pub async fn connect(addr: &str, timeout: Duration) -> Result<TrackerClient, TrackerCallError> {
        let io = |why: String| TrackerCallError::Io { addr: addr.into(), why };
        let s = tokio::time::timeout(timeout, TcpStream::connect(addr)).await.map_err(|_| io("connect timed out".into()))?;
        let s = s.map_err(|e| match e.kind() {
            std::io::ErrorKind::ConnectionRefused => io("connection refused: nothing listens there (check the address and port)".into()),
            _ => io(e.to_string()),
        })?;
        // The process's own identity: a worker proves the key it joins with, a driver a random one.
        let s = crate::initiate(s, timeout).await.map_err(|e| io(format!("secure link: {e}")))?;
        if let Some(peer) = s.peer() {
            crate::trust::check(addr, peer).map_err(|why| TrackerCallError::Key { addr: addr.into(), why })?;
        }
        let mut c =
            TrackerClient { addr: addr.into(), framed: Framed::new(s, codec(TRACKER_MAX_FRAME)), timeout, challenge: Challenge::default() };
        match c.call(crate::TrackerHello::body()).await {
            Ok(TrackerBody::Challenge(ch)) => c.challenge = ch,
            Ok(_) => return Err(TrackerCallError::Protocol { addr: addr.into() }),
            // A tracker that refuses the link's mode closes it before its challenge.
            Err(TrackerCallError::Io { why, .. }) if why == CLOSED => {
                return Err(io(
                    "the tracker closed the link before its challenge (encrypted on one end and --insecure-plaintext on the other? both must ask)".into(),
                ))
            }
            Err(e) => return Err(e),
        }
        Ok(c)
    }

    pub async fn send(&mut self, body: TrackerBody) -> Result<(), TrackerCallError> {
        let bytes = Bytes::from(TrackerFrame::new(body).encode_to_vec());
        let sent = tokio::time::timeout(self.timeout, self.framed.send(bytes)).await;
        sent.map_err(|_| self.io("send timed out"))?.map_err(|e| self.io(&e.to_string()))
    }

    /// The next frame; a `Refused` becomes an error.
    pub async fn recv(&mut self) -> Result<TrackerBody, TrackerCallError> {
        let next = tokio::time::timeout(self.timeout, self.framed.next()).await.map_err(|_| self.io("no answer in time"))?;
        let bytes = next.ok_or_else(|| self.io(CLOSED))?.map_err(|e| self.io(&e.to_string()))?;
        match TrackerFrame::decode(bytes).map(|f| f.body) {
            Ok(Some(TrackerBody::Refused(r))) => Err(TrackerCallError::Refused(r)),
            Ok(Some(b)) => Ok(b),
            _ => Err(TrackerCallError::Protocol { addr: self.addr.clone() }),
        }
    }

    pub async fn call(&mut self, body: TrackerBody) -> Result<TrackerBody, TrackerCallError> {
        self.send(body).await?;
        self.recv().await
    }

    /// Joins as a worker: the identity `key` signs this connection's challenge. What follows on
    /// the connection (heartbeats, usage reports) is the caller's, through `into_framed`.
    pub async fn join(&mut self, key: &SigningKey, join_token: &str, reg: Registration) -> Result<Joined, TrackerCallError> {
        let join = Join {
            join_token: join_token.into(),
            identity: key.verifying_key().to_bytes().to_vec(),
            signature: key.sign(&self.challenge.nonce).to_bytes().to_vec(),
            registration: Some(reg),
        };
        match self.call(TrackerBody::Join(join)).await? {
            TrackerBody::Joined(j) => Ok(j),
            _ => Err(TrackerCallError::Protocol { addr: self.addr.clone() }),
        }
    }

    /// The framed connection, for a long-lived exchange (a worker's control connection).
    pub fn into_framed(self) -> Framed<SecureStream, LengthDelimitedCodec> {
        self.framed
    }

    fn io(&self, why: &str) -> TrackerCallError {
        TrackerCallError::Io { addr: self.addr.clone(), why: why.into() }
    }
}
