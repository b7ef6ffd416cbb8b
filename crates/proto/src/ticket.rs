//! Route tickets: the tracker signs each route (Ed25519) and every worker checks, before it opens
//! a session or connects onward, that the ticket is genuine, current, names it at its place in
//! the chain with the sub-range and next hop the open asks for, and covers the session's budget.

use crate::{OpenSession, RouteStage};
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use prost::Message;

/// What the tracker vouches for: one session along one chain of workers.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Ticket {
    #[prost(bytes = "vec", tag = "1")]
    pub session_id: Vec<u8>,
    #[prost(string, tag = "2")]
    pub request_id: String,
    #[prost(string, tag = "3")]
    pub model_id: String,
    #[prost(string, tag = "4")]
    pub engine: String,
    #[prost(message, repeated, tag = "5")]
    pub stages: Vec<RouteStage>,
    /// Most positions the session may hold (prompt + generated).
    #[prost(uint64, tag = "6")]
    pub budget_tokens: u64,
    #[prost(uint64, tag = "7")]
    pub expires_unix_ms: u64,
    /// `key_id` of the key of the trackers' set that signs it: a verifier looks the key up by it.
    #[prost(fixed64, tag = "8")]
    pub key_id: u64,
    /// The API key's name (the tenant): a worker's prefix cache keeps each tenant's blocks apart.
    #[prost(string, tag = "9")]
    pub key_name: String,
}

/// A ticket's encoded bytes and the signature of exactly those bytes by the key of the
/// trackers' set that the ticket names.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SignedTicket {
    #[prost(bytes = "vec", tag = "1")]
    pub body: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub signature: Vec<u8>,
}

/// Why a worker refused a ticket. Each is counted separately in a worker's /metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum TicketError {
    #[error("no route ticket (this worker serves only sessions routed by its tracker)")]
    Missing,
    #[error("the ticket does not decode")]
    Malformed,
    #[error("the ticket is not signed by a key of the trackers' set")]
    Forged,
    #[error("the ticket has expired")]
    Expired,
    #[error("the ticket does not name this worker at this stage")]
    NotNamed,
    #[error("the session open differs from its ticket (session, model, stages, range or next hop)")]
    Mismatch,
    #[error("the session asks for more positions than its ticket's budget")]
    OverBudget,
}

impl TicketError {
    pub const ALL: [TicketError; 7] = [
        TicketError::Missing,
        TicketError::Malformed,
        TicketError::Forged,
        TicketError::Expired,
        TicketError::NotNamed,
        TicketError::Mismatch,
        TicketError::OverBudget,
    ];

    pub fn name(self) -> &'static str {
        match self {
            TicketError::Missing => "missing",
            TicketError::Malformed => "malformed",
            TicketError::Forged => "forged",
            TicketError::Expired => "expired",
            TicketError::NotNamed => "not_named",
            TicketError::Mismatch => "mismatch",
            TicketError::OverBudget => "over_budget",
        }
    }
}

/// Signs `t`, whose `key_id` names `key`.
pub fn sign_ticket(t: &Ticket, key: &SigningKey) -> SignedTicket {
    let body = t.encode_to_vec();
    let signature = key.sign(&body).to_bytes().to_vec();
    SignedTicket { body, signature }
}

/// Checks the signature (by the key `key_of` finds under the key id the ticket names) and the
/// expiry, and returns the ticket's content. The body is decoded before its signature is
/// checked (to find the key), and nothing of it is used unless the signature holds.
pub fn verify_ticket(s: &SignedTicket, key_of: impl FnOnce(u64) -> Option<VerifyingKey>, now_unix_ms: u64) -> Result<Ticket, TicketError> {
    let t = Ticket::decode(s.body.as_slice()).map_err(|_| TicketError::Malformed)?;
    let key = key_of(t.key_id).ok_or(TicketError::Forged)?;
    let sig = Signature::from_slice(&s.signature).map_err(|_| TicketError::Forged)?;
    key.verify_strict(&s.body, &sig).map_err(|_| TicketError::Forged)?;
    if t.expires_unix_ms < now_unix_ms {
        return Err(TicketError::Expired);
    }
    Ok(t)
}

/// Checks a session open against a verified ticket, for the worker `worker_id`.
pub fn check_ticket_open(t: &Ticket, open: &OpenSession, worker_id: &str) -> Result<(), TicketError> {
    let i = open.stage_index as usize;
    let me = t.stages.get(i).ok_or(TicketError::Mismatch)?;
    if me.worker_id != worker_id {
        return Err(TicketError::NotNamed);
    }
    let schema = open.schema.as_ref().ok_or(TicketError::Mismatch)?;
    let next = t.stages.get(i + 1).map_or("", |n| n.addr.as_str());
    // A ring's last stage sends its tokens to the route's first stage and nowhere else.
    let ring_to = open.ring.as_ref().map_or("", |r| r.to.as_str());
    if !ring_to.is_empty() && t.stages.first().is_none_or(|f| f.addr != ring_to) {
        return Err(TicketError::Mismatch);
    }
    if t.session_id != open.session_id
        || t.model_id != schema.model_id
        || t.stages.len() != open.n_stages as usize
        || (me.layer_start, me.layer_end) != (schema.layer_start, schema.layer_end)
        || next != open.next
    {
        return Err(TicketError::Mismatch);
    }
    if open.max_positions > t.budget_tokens {
        return Err(TicketError::OverBudget);
    }
    Ok(())
}

/// An Ed25519 key from 32 random bytes.
pub fn new_signing_key() -> Result<SigningKey, getrandom::Error> {
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed)?;
    Ok(SigningKey::from_bytes(&seed))
}

/// A public key from the wire.
pub fn verifying_key(bytes: &[u8]) -> Option<VerifyingKey> {
    VerifyingKey::from_bytes(bytes.try_into().ok()?).ok()
}

/// A worker's id: the hex of its identity key.
pub fn worker_id(key: &VerifyingKey) -> String {
    hex::encode(key.to_bytes())
}

/// A signing key's id in tickets and key sets: its public key's first 8 bytes (the keys of a
/// set are random, so ids do not collide; a wrong key still fails the signature).
pub fn key_id(key: &VerifyingKey) -> u64 {
    let b = key.to_bytes();
    u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BoundarySchema, PROTOCOL_VERSION};

    fn stage(w: &str, a: u32, b: u32, addr: &str) -> RouteStage {
        RouteStage { worker_id: w.into(), addr: addr.into(), layer_start: a, layer_end: b, engine: String::new() }
    }

    fn ticket() -> Ticket {
        Ticket {
            session_id: vec![1; 16],
            request_id: "r".into(),
            model_id: "m".into(),
            engine: "e".into(),
            stages: vec![stage("w0", 0, 10, "a:1"), stage("w1", 10, 30, "b:2")],
            budget_tokens: 100,
            expires_unix_ms: 2_000,
            key_id: 0,
            key_name: String::new(),
        }
    }

    fn open(stage_index: u32, next: &str, range: (u32, u32), max_positions: u64) -> OpenSession {
        OpenSession {
            session_id: vec![1; 16],
            schema: Some(BoundarySchema {
                protocol_version: PROTOCOL_VERSION,
                model_id: "m".into(),
                layer_start: range.0,
                layer_end: range.1,
                hidden: 8,
                seam_dtype: 0,
                engine: "e".into(),
            }),
            stage_index,
            n_stages: 2,
            next: next.into(),
            max_positions,
            ..Default::default()
        }
    }

    #[test]
    fn genuine_tickets_pass_and_every_forgery_is_named() {
        let key = new_signing_key().unwrap();
        let pk = key.verifying_key();
        let genuine = Ticket { key_id: key_id(&pk), ..ticket() };
        let s = sign_ticket(&genuine, &key);
        // The set holds this key under its id (and another key under another id).
        let spare = new_signing_key().unwrap().verifying_key();
        let set = |id: u64| [(key_id(&pk), pk), (key_id(&spare), spare)].into_iter().find(|(k, _)| *k == id).map(|(_, v)| v);
        let t = verify_ticket(&s, set, 1_000).unwrap();
        assert_eq!(check_ticket_open(&t, &open(0, "b:2", (0, 10), 100), "w0"), Ok(()));
        assert_eq!(check_ticket_open(&t, &open(1, "", (10, 30), 50), "w1"), Ok(()));

        assert_eq!(verify_ticket(&s, set, 3_000), Err(TicketError::Expired));
        // A key outside the set, under its own id or claiming a key id of the set.
        let other = new_signing_key().unwrap();
        let own = Ticket { key_id: key_id(&other.verifying_key()), ..ticket() };
        assert_eq!(verify_ticket(&sign_ticket(&own, &other), set, 1_000), Err(TicketError::Forged));
        assert_eq!(verify_ticket(&sign_ticket(&genuine, &other), set, 1_000), Err(TicketError::Forged));
        // Signed by this key but naming the set's other one.
        let swapped = Ticket { key_id: key_id(&spare), ..ticket() };
        assert_eq!(verify_ticket(&sign_ticket(&swapped, &key), set, 1_000), Err(TicketError::Forged));
        assert_eq!(
            verify_ticket(&SignedTicket { body: vec![0xff; 7], signature: s.signature.clone() }, set, 1_000),
            Err(TicketError::Malformed)
        );
        let mut altered = s.clone();
        altered.body[3] ^= 1;
        assert_eq!(verify_ticket(&altered, set, 1_000), Err(TicketError::Forged));
        let mut bad_sig = s.clone();
        bad_sig.signature.truncate(10);
        assert_eq!(verify_ticket(&bad_sig, set, 1_000), Err(TicketError::Forged));

        assert_eq!(check_ticket_open(&t, &open(0, "b:2", (0, 10), 100), "w1"), Err(TicketError::NotNamed));
        assert_eq!(check_ticket_open(&t, &open(0, "evil:9", (0, 10), 100), "w0"), Err(TicketError::Mismatch));
        assert_eq!(check_ticket_open(&t, &open(0, "b:2", (0, 12), 100), "w0"), Err(TicketError::Mismatch));
        assert_eq!(check_ticket_open(&t, &open(0, "b:2", (0, 10), 101), "w0"), Err(TicketError::OverBudget));
        assert_eq!(check_ticket_open(&t, &open(5, "", (0, 10), 1), "w0"), Err(TicketError::Mismatch));
        let mut other_session = open(0, "b:2", (0, 10), 100);
        other_session.session_id = vec![2; 16];
        assert_eq!(check_ticket_open(&t, &other_session, "w0"), Err(TicketError::Mismatch));
        // A ring's last stage sends only to the route's first stage.
        let ring = |to: &str| OpenSession { ring: Some(crate::Ring { to: to.into(), ..Default::default() }), ..open(1, "", (10, 30), 50) };
        assert_eq!(check_ticket_open(&t, &ring("a:1"), "w1"), Ok(()));
        assert_eq!(check_ticket_open(&t, &ring("evil:9"), "w1"), Err(TicketError::Mismatch));
    }
}
