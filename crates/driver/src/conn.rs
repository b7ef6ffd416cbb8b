//! One framed connection to a worker, after the handshake.

use crate::{DriveError, FailKind};
use bytes::Bytes;
use dgr_proto::SecureStream;
use dgr_proto::{Body, Frame, Hello, Role, StageInfo, PROTOCOL_VERSION};
use futures::stream::{SplitSink, SplitStream};
use futures::{SinkExt, StreamExt};
use prost::Message;
use std::time::Duration;
use tokio_util::codec::{Framed, LengthDelimitedCodec};

pub(crate) type Sink = SplitSink<Framed<SecureStream, LengthDelimitedCodec>, Bytes>;
pub(crate) type Source = SplitStream<Framed<SecureStream, LengthDelimitedCodec>>;

/// A connected worker: the two halves of its connection, what it serves, and the id (its
/// Ed25519 key, hex) it proved in the secure channel's handshake (None on a plaintext link).
pub(crate) type Connected = (Sink, Source, StageInfo, Option<String>);

/// Connects to `addr` over the secure channel, says Hello as a driver and returns the worker's
/// StageInfo and proven id.
pub(crate) async fn connect(addr: &str, stage: u32, timeout: Duration, max_frame: usize) -> Result<Connected, DriveError> {
    let fail = |kind: FailKind, msg: String| DriveError::new(kind, Some(stage), Some(addr), msg);
    let stream = dgr_proto::dial(addr, timeout).await.map_err(|e| fail(FailKind::ConnectFailed, e.to_string()))?;
    let peer = stream.peer().map(dgr_proto::worker_id);
    let (mut sink, mut source) = Framed::new(stream, dgr_proto::codec(max_frame)).split();
    let hello = Frame::new(Body::Hello(Hello { protocol_version: PROTOCOL_VERSION, role: Role::Driver as i32, info: None }));
    send(&mut sink, &hello).await.map_err(|e| fail(FailKind::ConnectFailed, e))?;
    let reply =
        tokio::time::timeout(timeout, source.next()).await.map_err(|_| fail(FailKind::Timeout, "no Hello from the worker".into()))?;
    match reply.map(|r| r.map(Frame::decode)) {
        Some(Ok(Ok(Frame { body: Some(Body::Hello(Hello { info: Some(info), .. })) }))) => Ok((sink, source, info, peer)),
        Some(Ok(Ok(Frame { body: Some(Body::Error(e)) }))) => Err(fail(FailKind::Worker(e.error_kind()), e.message)),
        _ => Err(fail(FailKind::Protocol, "the peer did not answer with a worker's Hello".into())),
    }
}

pub(crate) async fn send(sink: &mut Sink, f: &Frame) -> Result<(), String> {
    sink.send(Bytes::from(f.encode_to_vec())).await.map_err(|e| e.to_string())
}
