//! The secure channel every stage-protocol connection runs in: Noise XX (X25519, ChaCha20-Poly1305,
//! BLAKE2s, via `snow`), each side's Noise static key signed by its Ed25519 identity, so a peer
//! is known by the same key a tracker admitted and a ticket names (a worker's id is its key).
//!
//! The dialler writes a 4-byte preamble first: `DGR1` for Noise, `DGRP` for plaintext, which a
//! process only offers or takes under `--insecure-plaintext` (`set_insecure_plaintext`); an end
//! that did not ask refuses the other mode, so plaintext needs both ends to ask. Every message
//! (handshake and transport) is a 2-byte big-endian length and at most 65535 bytes of Noise.
//! A transport message that fails its tag is an `Integrity` error: the connection is over,
//! never a frame of altered bytes. A recorded handshake cannot be replayed: each side's
//! ephemeral key is fresh, so the replayer cannot derive the keys the recording was under.

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use std::io::{Error, ErrorKind};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::OnceLock;
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

const NOISE_PARAMS: &str = "Noise_XX_25519_ChaChaPoly_BLAKE2s";
/// Bound into every handshake: the two ends must mean the same protocol and version.
const PROLOGUE: &[u8] = b"dgr stage link v1";
/// What an identity signs: this context and its Noise static public key.
const PROOF_CONTEXT: &[u8] = b"dgr noise static key v1";
pub const PREAMBLE_NOISE: &[u8; 4] = b"DGR1";
pub const PREAMBLE_PLAIN: &[u8; 4] = b"DGRP";
const MAX_MESSAGE: usize = 65535;
const TAG: usize = 16;
const MAX_PLAIN: usize = MAX_MESSAGE - TAG;
/// Encrypted bytes queued before a write waits for the socket.
const WRITE_HIGH: usize = 4 * MAX_MESSAGE;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecureError {
    #[error("integrity: a message failed its authentication tag (altered or injected in flight)")]
    Integrity,
    #[error("handshake: {0}")]
    Handshake(String),
    #[error("the peer's identity proof is not valid: {0}")]
    Identity(String),
    #[error("plaintext refused: {0}")]
    Plaintext(String),
}

impl SecureError {
    /// The error as I/O error, to travel through codecs and sockets; `of` gets it back.
    pub fn io(self) -> Error {
        let kind = if self == SecureError::Integrity { ErrorKind::InvalidData } else { ErrorKind::PermissionDenied };
        Error::new(kind, self)
    }

    /// The secure channel's error inside `e`, if that is what it is.
    pub fn of(e: &Error) -> Option<&SecureError> {
        e.get_ref().and_then(|inner| inner.downcast_ref::<SecureError>())
    }
}

/// An identity on links: an Ed25519 key (a worker's admitted one, a tracker's signing key, or a
/// random one for a driver), the Noise static key it signs, and that signature.
pub struct Identity {
    key: SigningKey,
    noise_private: Vec<u8>,
    proof: Vec<u8>,
}

static IDENTITY: OnceLock<Identity> = OnceLock::new();
static PLAINTEXT: AtomicBool = AtomicBool::new(false);

impl Identity {
    /// The identity `key` proves on the links it answers (`respond_as`).
    pub fn new(key: &SigningKey) -> Result<Identity, SecureError> {
        make_identity(key.clone())
    }

    pub fn public(&self) -> VerifyingKey {
        self.key.verifying_key()
    }
}

fn make_identity(key: SigningKey) -> Result<Identity, SecureError> {
    let builder = snow::Builder::new(NOISE_PARAMS.parse().map_err(|e| SecureError::Handshake(format!("{e}")))?);
    let kp = builder.generate_keypair().map_err(|e| SecureError::Handshake(e.to_string()))?;
    let mut signed = PROOF_CONTEXT.to_vec();
    signed.extend_from_slice(&kp.public);
    let mut proof = key.verifying_key().to_bytes().to_vec();
    proof.extend_from_slice(&key.sign(&signed).to_bytes());
    Ok(Identity { key, noise_private: kp.private, proof })
}

/// Makes `key` this process's identity on every link from now on (a worker's admitted key, so
/// that drivers and previous stages can check it against their tickets). Only the first call
/// counts; false if an identity was set or used already.
pub fn set_identity(key: &SigningKey) -> Result<bool, SecureError> {
    let id = make_identity(key.clone())?;
    Ok(IDENTITY.set(id).is_ok())
}

fn identity() -> Result<&'static Identity, SecureError> {
    if let Some(id) = IDENTITY.get() {
        return Ok(id);
    }
    let key = crate::new_signing_key().map_err(|e| SecureError::Handshake(format!("randomness: {e}")))?;
    let id = make_identity(key)?;
    Ok(IDENTITY.get_or_init(|| id))
}

/// This process's public identity on its links.
pub fn local_key() -> Result<VerifyingKey, SecureError> {
    Ok(identity()?.key.verifying_key())
}

/// Plaintext links, offered and accepted only: `--insecure-plaintext`.
pub fn set_insecure_plaintext(on: bool) {
    PLAINTEXT.store(on, Relaxed);
}

pub fn insecure_plaintext() -> bool {
    PLAINTEXT.load(Relaxed)
}

/// A connection after its handshake: Noise transport messages over TCP, or (both ends asked)
/// plain bytes. It reads and writes the bytes of the stage protocol's framing.
pub struct SecureStream {
    io: TcpStream,
    noise: Option<Box<snow::TransportState>>,
    peer: Option<VerifyingKey>,
    /// Bytes read from the socket, not yet a whole message.
    raw: Vec<u8>,
    /// The last message's decrypted bytes, `plain[plain_at..plain_len]` not yet read; sized for
    /// the largest message once, so no message pays for clearing it.
    plain: Vec<u8>,
    plain_at: usize,
    plain_len: usize,
    /// Encrypted bytes not yet written, from `out_at` on.
    out: Vec<u8>,
    out_at: usize,
    scratch: Vec<u8>,
}

impl SecureStream {
    /// The peer's Ed25519 identity, proven in the handshake (None on a plaintext link).
    pub fn peer(&self) -> Option<&VerifyingKey> {
        self.peer.as_ref()
    }

    fn wrap(io: TcpStream, noise: Option<snow::TransportState>, peer: Option<VerifyingKey>) -> SecureStream {
        SecureStream {
            io,
            noise: noise.map(Box::new),
            peer,
            raw: Vec::new(),
            plain: vec![0; MAX_MESSAGE],
            plain_at: 0,
            plain_len: 0,
            out: Vec::new(),
            out_at: 0,
            scratch: vec![0; MAX_MESSAGE],
        }
    }

    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        while self.out_at < self.out.len() {
            let n = ready!(Pin::new(&mut self.io).poll_write(cx, &self.out[self.out_at..]))?;
            if n == 0 {
                return Poll::Ready(Err(ErrorKind::WriteZero.into()));
            }
            self.out_at += n;
        }
        self.out.clear();
        self.out_at = 0;
        Poll::Ready(Ok(()))
    }
}

/// Dials the secure channel over `io` (a fresh connection, or a relayed one past its relay
/// handshake): Noise, or plaintext when this process was told `--insecure-plaintext`.
pub async fn initiate(mut io: TcpStream, timeout: Duration) -> std::io::Result<SecureStream> {
    let _ = io.set_nodelay(true);
    if insecure_plaintext() {
        io.write_all(PREAMBLE_PLAIN).await?;
        return Ok(SecureStream::wrap(io, None, None));
    }
    let id = identity().map_err(SecureError::io)?;
    let run = async {
        let mut hs = builder(id)?.build_initiator().map_err(handshake)?;
        let mut buf = vec![0u8; MAX_MESSAGE];
        let n = hs.write_message(&[], &mut buf).map_err(handshake)?;
        io.write_all(&framed(PREAMBLE_NOISE, &buf[..n])).await?;
        let msg = read_message(&mut io).await?;
        let mut payload = vec![0u8; MAX_MESSAGE];
        let p = hs.read_message(&msg, &mut payload).map_err(handshake)?;
        let peer = check_proof(&hs, &payload[..p])?;
        let n = hs.write_message(&id.proof, &mut buf).map_err(handshake)?;
        write_message(&mut io, &buf[..n]).await?;
        let transport = hs.into_transport_mode().map_err(handshake)?;
        Ok::<_, Error>(SecureStream::wrap(io, Some(transport), Some(peer)))
    };
    tokio::time::timeout(timeout, run).await.map_err(|_| SecureError::Handshake("timed out".into()).io())?
}

/// Answers the secure channel on an accepted connection whose first 4 bytes (the preamble) are
/// still unread.
pub async fn respond(mut io: TcpStream, timeout: Duration) -> std::io::Result<SecureStream> {
    let run = async {
        let mut preamble = [0u8; 4];
        io.read_exact(&mut preamble).await?;
        answer(io, preamble, identity().map_err(SecureError::io)?).await
    };
    tokio::time::timeout(timeout, run).await.map_err(|_| SecureError::Handshake("timed out".into()).io())?
}

/// Answers the secure channel as `id` (not this process's identity) on a connection whose
/// preamble was read already: a tracker proves its signing key on its links.
pub async fn respond_as(id: &Identity, preamble: [u8; 4], io: TcpStream, timeout: Duration) -> std::io::Result<SecureStream> {
    tokio::time::timeout(timeout, answer(io, preamble, id)).await.map_err(|_| SecureError::Handshake("timed out".into()).io())?
}

/// Whether `head`, a connection's first 4 bytes, opens a secure channel (or a plaintext one).
pub fn is_preamble(head: &[u8; 4]) -> bool {
    head == PREAMBLE_NOISE || head == PREAMBLE_PLAIN
}

async fn answer(mut io: TcpStream, preamble: [u8; 4], id: &Identity) -> std::io::Result<SecureStream> {
    match (&preamble, insecure_plaintext()) {
        (PREAMBLE_PLAIN, true) => return Ok(SecureStream::wrap(io, None, None)),
        (PREAMBLE_PLAIN, false) => return Err(SecureError::Plaintext("this end was not started with --insecure-plaintext".into()).io()),
        (PREAMBLE_NOISE, true) => {
            return Err(SecureError::Plaintext("this end runs --insecure-plaintext and takes only plaintext".into()).io())
        }
        (PREAMBLE_NOISE, false) => {}
        _ => return Err(SecureError::Handshake("not a dgr link (no preamble)".into()).io()),
    }
    let mut hs = builder(id)?.build_responder().map_err(handshake)?;
    let mut payload = vec![0u8; MAX_MESSAGE];
    let msg = read_message(&mut io).await?;
    hs.read_message(&msg, &mut payload).map_err(handshake)?;
    let mut buf = vec![0u8; MAX_MESSAGE];
    let n = hs.write_message(&id.proof, &mut buf).map_err(handshake)?;
    write_message(&mut io, &buf[..n]).await?;
    let msg = read_message(&mut io).await?;
    let p = hs.read_message(&msg, &mut payload).map_err(handshake)?;
    let peer = check_proof(&hs, &payload[..p])?;
    let transport = hs.into_transport_mode().map_err(handshake)?;
    Ok(SecureStream::wrap(io, Some(transport), Some(peer)))
}

fn builder(id: &Identity) -> std::io::Result<snow::Builder<'_>> {
    let params = NOISE_PARAMS.parse().map_err(|e| SecureError::Handshake(format!("{e}")).io())?;
    snow::Builder::new(params).local_private_key(&id.noise_private).and_then(|b| b.prologue(PROLOGUE)).map_err(handshake)
}

fn handshake(e: snow::Error) -> Error {
    SecureError::Handshake(e.to_string()).io()
}

/// The Ed25519 key whose signature over the peer's Noise static key the payload carries.
fn check_proof(hs: &snow::HandshakeState, payload: &[u8]) -> std::io::Result<VerifyingKey> {
    let bad = |m: &str| SecureError::Identity(m.into()).io();
    let remote = hs.get_remote_static().ok_or_else(|| bad("no static key"))?;
    if payload.len() != 96 {
        return Err(bad("a proof is a 32-byte key and a 64-byte signature"));
    }
    let key = crate::verifying_key(&payload[..32]).ok_or_else(|| bad("not an Ed25519 key"))?;
    let sig = Signature::from_slice(&payload[32..]).map_err(|_| bad("malformed signature"))?;
    let mut signed = PROOF_CONTEXT.to_vec();
    signed.extend_from_slice(remote);
    key.verify_strict(&signed, &sig).map_err(|_| bad("the signature is not of this link's static key"))?;
    Ok(key)
}

async fn read_message(io: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 2];
    io.read_exact(&mut len).await?;
    let mut msg = vec![0u8; u16::from_be_bytes(len) as usize];
    io.read_exact(&mut msg).await?;
    Ok(msg)
}

async fn write_message(io: &mut TcpStream, msg: &[u8]) -> std::io::Result<()> {
    io.write_all(&framed(&[], msg)).await
}

/// `prefix`, then `msg` behind its 2-byte length (a handshake message is at most MAX_MESSAGE).
fn framed(prefix: &[u8], msg: &[u8]) -> Vec<u8> {
    let mut buf = prefix.to_vec();
    buf.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    buf.extend_from_slice(msg);
    buf
}

impl AsyncRead for SecureStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let Some(noise) = this.noise.as_mut() else {
            return Pin::new(&mut this.io).poll_read(cx, buf);
        };
        loop {
            if this.plain_at < this.plain_len {
                let n = buf.remaining().min(this.plain_len - this.plain_at);
                buf.put_slice(&this.plain[this.plain_at..this.plain_at + n]);
                this.plain_at += n;
                return Poll::Ready(Ok(()));
            }
            if this.raw.len() >= 2 {
                let len = u16::from_be_bytes([this.raw[0], this.raw[1]]) as usize;
                if this.raw.len() >= 2 + len {
                    this.plain_len = noise.read_message(&this.raw[2..2 + len], &mut this.plain).map_err(|_| SecureError::Integrity.io())?;
                    this.plain_at = 0;
                    this.raw.drain(..2 + len);
                    continue;
                }
            }
            let mut rb = ReadBuf::new(&mut this.scratch);
            ready!(Pin::new(&mut this.io).poll_read(cx, &mut rb))?;
            if rb.filled().is_empty() {
                if this.raw.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                return Poll::Ready(Err(Error::new(ErrorKind::UnexpectedEof, "the link closed inside a message")));
            }
            this.raw.extend_from_slice(rb.filled());
        }
    }
}

impl AsyncWrite for SecureStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        while this.out.len() - this.out_at >= WRITE_HIGH {
            ready!(this.poll_drain(cx))?;
        }
        let n = buf.len().min(MAX_PLAIN);
        let len = match this.noise.as_mut() {
            Some(noise) => {
                noise.write_message(&buf[..n], &mut this.scratch).map_err(|e| Error::other(SecureError::Handshake(e.to_string())))?
            }
            None => return Pin::new(&mut this.io).poll_write(cx, buf),
        };
        this.out.extend_from_slice(&(len as u16).to_be_bytes());
        this.out.extend_from_slice(&this.scratch[..len]);
        // Start the bytes on their way; the rest goes at the next write or the flush.
        if let Poll::Ready(Err(e)) = this.poll_drain(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
