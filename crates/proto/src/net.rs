//! Reaching a worker: a plain address (host:port), or `relay://TRACKER/WORKER_ID` for a worker
//! that opened no port and is reached through its tracker's relay. Either way the caller gets the
//! secure channel (`secure`) to the worker itself, end to end through a relay, that carries the
//! stage protocol from its first byte.

use crate::{RelayConnect, RelayDial, TrackerBody, TrackerFrame};
use prost::Message;
use std::io::{Error, ErrorKind};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// The largest frame exchanged before a relayed socket is spliced.
const RELAY_FRAME: usize = 4096;

/// A relayed worker's address: `relay://TRACKER/WORKER_ID`.
pub fn relay_addr(tracker: &str, worker_id: &str) -> String {
    format!("relay://{tracker}/{worker_id}")
}

/// Connects to `addr` and opens the secure channel to it, within `timeout`.
pub async fn dial(addr: &str, timeout: Duration) -> std::io::Result<crate::SecureStream> {
    let start = tokio::time::Instant::now();
    let s = tcp(addr, timeout).await?;
    crate::initiate(s, timeout.saturating_sub(start.elapsed())).await
}

/// The TCP connection to `addr` (through the relay, past its handshake) within `timeout`.
async fn tcp(addr: &str, timeout: Duration) -> std::io::Result<TcpStream> {
    tokio::time::timeout(timeout, async {
        match addr.strip_prefix("relay://") {
            None => connect(addr).await,
            Some(rest) => {
                let (tracker, worker_id) =
                    rest.split_once('/').ok_or_else(|| Error::new(ErrorKind::InvalidInput, format!("bad relay address {addr:?}")))?;
                let mut s = connect(tracker).await?;
                challenge(&mut s).await?;
                let ask = TrackerBody::RelayConnect(RelayConnect { worker_id: worker_id.into() });
                write_frame(&mut s, &TrackerFrame::new(ask)).await?;
                match read_frame(&mut s, RELAY_FRAME).await?.body {
                    Some(TrackerBody::RelayReady(_)) => Ok(s),
                    Some(TrackerBody::Refused(r)) => Err(Error::new(ErrorKind::ConnectionRefused, format!("relay: {}", r.message))),
                    _ => Err(Error::new(ErrorKind::InvalidData, "relay: unexpected answer")),
                }
            }
        }
    })
    .await
    .map_err(|_| Error::new(ErrorKind::TimedOut, format!("connecting to {addr} timed out")))?
}

/// Opens the dialed-back connection a relayed worker serves a session on: the tracker pairs it
/// with the waiting client by `token`.
pub async fn relay_accept(tracker: &str, token: Vec<u8>, timeout: Duration) -> std::io::Result<TcpStream> {
    tokio::time::timeout(timeout, async {
        let mut s = connect(tracker).await?;
        challenge(&mut s).await?;
        write_frame(&mut s, &TrackerFrame::new(TrackerBody::RelayAccept(RelayDial { token }))).await?;
        Ok(s)
    })
    .await
    .map_err(|_| Error::new(ErrorKind::TimedOut, "relay dial-back timed out"))?
}

/// Every tracker connection opens with Hello and the tracker's Challenge; a relay connection
/// has no use for the challenge.
async fn challenge(s: &mut TcpStream) -> std::io::Result<()> {
    write_frame(s, &TrackerFrame::new(crate::TrackerHello::body())).await?;
    match read_frame(s, RELAY_FRAME).await?.body {
        Some(TrackerBody::Challenge(_)) => Ok(()),
        _ => Err(Error::new(ErrorKind::InvalidData, "the tracker did not open with its challenge")),
    }
}

async fn connect(addr: &str) -> std::io::Result<TcpStream> {
    let s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    Ok(s)
}

/// Writes one length-prefixed frame.
pub async fn write_frame<S: AsyncWrite + Unpin>(s: &mut S, f: &TrackerFrame) -> std::io::Result<()> {
    let body = f.encode_to_vec();
    let mut buf = (body.len() as u32).to_be_bytes().to_vec();
    buf.extend_from_slice(&body);
    s.write_all(&buf).await?;
    s.flush().await
}

/// Reads exactly one length-prefixed frame of at most `max` bytes and not a byte more, so that
/// the socket can be handed on (spliced, or framed anew) with nothing left in a buffer.
pub async fn read_frame<S: AsyncRead + Unpin>(s: &mut S, max: usize) -> std::io::Result<TrackerFrame> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > max {
        return Err(Error::new(ErrorKind::InvalidData, format!("a {len}-byte frame where at most {max} fit")));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).await?;
    TrackerFrame::decode(body.as_slice()).map_err(|e| Error::new(ErrorKind::InvalidData, e))
}
