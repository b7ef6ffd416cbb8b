//! The stage protocol: the messages that cross process boundaries, the boundary schema a session
//! is opened with, and their framing. Nothing else lives here.
//!
//! Every frame is a protobuf `Frame` (prost) behind a 4-byte big-endian length prefix
//! (tokio-util's length-delimited codec) with a size cap. Nothing in a frame is trusted: the
//! `check_*` functions validate what a receiver is about to use.

mod check;
mod codec;
mod messages;
mod seam;

pub use check::{check_forward, check_open, session_id, ProtoError, SessionId};
pub use codec::{codec, DEFAULT_MAX_FRAME};
pub use messages::*;
pub use seam::{decode_rows, encode_rows, SeamDtype};

/// Bumped on any incompatible change to the messages or their meaning.
pub const PROTOCOL_VERSION: u32 = 1;

/// `ErrorMsg.stage` when the sender does not know its place in the route (no session to ask).
pub const STAGE_UNKNOWN: u32 = u32::MAX;
