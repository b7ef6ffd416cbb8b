//! The stage protocol: the messages that cross process boundaries, the boundary schema a session
//! is opened with, and their framing. Nothing else lives here.
//!
//! Every frame is a protobuf `Frame` (prost) behind a 4-byte big-endian length prefix
//! (tokio-util's length-delimited codec) with a size cap. Nothing in a frame is trusted: the
//! `check_*` functions validate what a receiver is about to use.

mod addr;
mod check;
mod client;
mod codec;
mod draft;
mod messages;
mod net;
mod prefix;
mod route_engine;
mod seam;
mod secure;
mod ticket;
mod tracker;
mod trust;

pub use addr::{parse_addr, parse_addrs, AddrError, SCHEMES};
pub use check::{check_forward, check_open, session_id, ProtoError, SessionId};
pub use client::{TrackerCallError, TrackerClient, TRACKER_MAX_FRAME};
pub use codec::{codec, DEFAULT_MAX_FRAME};
pub use draft::{propose, Drafter};
pub use ed25519_dalek::{SigningKey, VerifyingKey};
pub use messages::*;
pub use net::{dial, read_frame, relay_accept, relay_addr, write_frame};
pub use prefix::{
    check_prefix_blocks, check_prefix_probes, prefix_chain, prefix_chain_bytes, prefix_probes, route_digest, tenant_mask, MAX_HELD_DIGESTS,
    MAX_PREFIX_PROBES, PREFIX_BLOCK,
};
pub use route_engine::{is_engine_id, parse_route_engine, route_engine, EngineSpan, MAX_ENGINE_ID, MAX_ENGINE_SPANS, MAX_ROUTE_ENGINE};
pub use seam::{decode_rows, encode_rows, SeamDtype};
pub use secure::{
    initiate, insecure_plaintext, is_preamble, local_key, respond, respond_as, set_identity, set_insecure_plaintext, Identity, SecureError,
    SecureStream,
};
pub use ticket::{
    check_ticket_open, key_id, new_signing_key, sign_ticket, verify_ticket, verifying_key, worker_id, SignedTicket, Ticket, TicketError,
};
pub use tracker::*;
pub use trust::{check_peer, check_route_peer, parse_peer_key, parse_tracker_key, pin_peer_keys, pin_tracker_keys};

/// Bumped on any incompatible change to the messages or their meaning.
pub const PROTOCOL_VERSION: u32 = 14;

/// `ErrorMsg.stage` when the sender does not know its place in the route (no session to ask).
pub const STAGE_UNKNOWN: u32 = u32::MAX;
