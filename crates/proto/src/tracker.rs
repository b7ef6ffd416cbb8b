//! The tracker protocol: workers joining and reporting, clients asking for routes, the ledger,
//! and the relay. Same framing as the stage protocol (a length-prefixed protobuf frame).
//!
//! Every connection opens with the client's `Hello` and the tracker's `Challenge` (a nonce and
//! the public keys of the trackers' signing key set). A worker's control connection then goes on with `Join` (join token, its identity key, a signature of the nonce, what
//! it serves); then `Heartbeat`s and `WorkerUsage` reports flow up and `RelayDial`s come down,
//! until `Leave` or the connection drops. A client connection: one request and its answer at a
//! time. A relay connection's first frame is `RelayConnect`
//! (a client wanting a relayed worker) or `RelayAccept` (the worker dialing back); after the
//! tracker's `RelayReady` the two sockets are spliced and carry the stage protocol unchanged.

use crate::SignedTicket;

#[derive(Clone, PartialEq, prost::Message)]
pub struct TrackerFrame {
    #[prost(oneof = "TrackerBody", tags = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25")]
    pub body: Option<TrackerBody>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum TrackerBody {
    /// Tracker → anyone, in answer to `Hello`.
    #[prost(message, tag = "1")]
    Challenge(Challenge),
    /// Worker → tracker.
    #[prost(message, tag = "2")]
    Join(Join),
    #[prost(message, tag = "3")]
    Joined(Joined),
    #[prost(message, tag = "4")]
    Heartbeat(Heartbeat),
    /// Worker → tracker: stop routing to me (SIGTERM).
    #[prost(message, tag = "5")]
    Leave(Leave),
    #[prost(message, tag = "6")]
    WorkerUsage(WorkerUsage),
    /// Client → tracker.
    #[prost(message, tag = "7")]
    RouteRequest(RouteRequest),
    #[prost(message, tag = "8")]
    RouteReply(RouteReply),
    /// Driver → tracker: what a request used, once it ended.
    #[prost(message, tag = "9")]
    RequestUsage(RequestUsage),
    /// Tracker → client or worker: a report was stored (or was already).
    #[prost(message, tag = "10")]
    Ack(Ack),
    #[prost(message, tag = "11")]
    SwarmQuery(SwarmQuery),
    #[prost(message, tag = "12")]
    SwarmReply(SwarmReply),
    #[prost(message, tag = "13")]
    UsageQuery(UsageQuery),
    #[prost(message, tag = "14")]
    UsageReply(UsageReply),
    /// Operator → tracker (with the join token): create an API key.
    #[prost(message, tag = "15")]
    KeyAdd(KeyAdd),
    #[prost(message, tag = "16")]
    KeyAdded(KeyAdded),
    #[prost(message, tag = "17")]
    Refused(Refused),
    /// Client → tracker: connect me to this relayed worker.
    #[prost(message, tag = "18")]
    RelayConnect(RelayConnect),
    /// Tracker → relayed worker (on its control connection): dial back with this token.
    #[prost(message, tag = "19")]
    RelayDial(RelayDial),
    /// Relayed worker → tracker, first frame of the dialed-back connection.
    #[prost(message, tag = "20")]
    RelayAccept(RelayDial),
    /// Tracker → client: from the next byte on, this connection reaches the worker.
    #[prost(message, tag = "21")]
    RelayReady(Ack),
    /// Anyone → tracker, the first frame of every connection (HTTP clients say "GET " instead).
    #[prost(message, tag = "22")]
    Hello(TrackerHello),
    /// Gateway → tracker (with the join token): a spot check caught this worker; quarantine it.
    #[prost(message, tag = "23")]
    Suspect(Suspect),
    /// Worker → tracker (with the join token), before it loads anything: which layers to serve.
    #[prost(message, tag = "24")]
    PlaceRequest(PlaceRequest),
    #[prost(message, tag = "25")]
    Placed(Placed),
}

/// Most layers a model may have to be placed (a placement costs a sort of the layers for each
/// window); no model comes near it.
pub const MAX_PLACE_LAYERS: u32 = 1024;

/// A starting worker asks where it adds most to the swarm's capacity for a model.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PlaceRequest {
    #[prost(string, tag = "1")]
    pub join_token: String,
    #[prost(string, tag = "2")]
    pub model_id: String,
    /// The model's layer count, 1 to `MAX_PLACE_LAYERS`.
    #[prost(uint32, tag = "3")]
    pub n_layers: u32,
    /// Most layers it can hold.
    #[prost(uint32, tag = "4")]
    pub max_layers: u32,
}

/// The range a worker is to serve: `layer_start..layer_end`.
#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct Placed {
    #[prost(uint32, tag = "1")]
    pub layer_start: u32,
    #[prost(uint32, tag = "2")]
    pub layer_end: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Suspect {
    #[prost(string, tag = "1")]
    pub join_token: String,
    #[prost(string, tag = "2")]
    pub worker_id: String,
    /// What the check found, for the operator.
    #[prost(string, tag = "3")]
    pub evidence: String,
}

#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct TrackerHello {
    #[prost(uint32, tag = "1")]
    pub protocol_version: u32,
}

impl TrackerHello {
    pub fn body() -> TrackerBody {
        TrackerBody::Hello(TrackerHello { protocol_version: crate::PROTOCOL_VERSION })
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Challenge {
    #[prost(uint32, tag = "1")]
    pub protocol_version: u32,
    /// 32 random bytes the worker signs with its identity key.
    #[prost(bytes = "vec", tag = "2")]
    pub nonce: Vec<u8>,
    // Tag 3 held a single tracker key until protocol version 3.
    /// Every key of the signing key set the trackers of this swarm share: a route ticket from
    /// any of them is signed by one of these.
    #[prost(message, repeated, tag = "4")]
    pub keys: Vec<TrackerKey>,
}

/// One Ed25519 public key of the trackers' signing key set.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TrackerKey {
    /// `key_id` of the key: what a ticket signed by it names.
    #[prost(fixed64, tag = "1")]
    pub key_id: u64,
    #[prost(bytes = "vec", tag = "2")]
    pub public_key: Vec<u8>,
}

/// What a worker serves and can take: the registry's record of it. Nothing here is specific to
/// one engine or file format.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Registration {
    /// The compute engine (a compatibility key field): sessions never cross engines.
    #[prost(string, tag = "1")]
    pub engine: String,
    #[prost(string, tag = "2")]
    pub model_id: String,
    #[prost(uint32, tag = "3")]
    pub n_layers: u32,
    #[prost(uint32, tag = "4")]
    pub layer_start: u32,
    #[prost(uint32, tag = "5")]
    pub layer_end: u32,
    #[prost(uint32, tag = "6")]
    pub hidden: u32,
    #[prost(uint32, tag = "7")]
    pub vocab: u32,
    /// Where the stage protocol reaches it; empty for a relayed worker.
    #[prost(string, tag = "8")]
    pub addr: String,
    #[prost(uint64, tag = "9")]
    pub kv_tokens: u64,
    #[prost(uint32, tag = "10")]
    pub max_sessions: u32,
    #[prost(uint32, tag = "11")]
    pub threads: u32,
    /// Microseconds per layer for one decode row, measured on its own layers at start-up.
    #[prost(double, tag = "12")]
    pub step_us_per_layer: f64,
    #[prost(uint64, tag = "13")]
    pub max_positions: u64,
    #[prost(string, tag = "14")]
    pub version: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Join {
    #[prost(string, tag = "1")]
    pub join_token: String,
    /// The worker's Ed25519 public key: its identity.
    #[prost(bytes = "vec", tag = "2")]
    pub identity: Vec<u8>,
    /// The identity key's signature of the challenge's nonce.
    #[prost(bytes = "vec", tag = "3")]
    pub signature: Vec<u8>,
    #[prost(message, optional, tag = "4")]
    pub registration: Option<Registration>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Joined {
    /// The worker's id in routes and tickets (hex of its identity key).
    #[prost(string, tag = "1")]
    pub worker_id: String,
    #[prost(uint32, tag = "2")]
    pub heartbeat_ms: u32,
}

#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct Load {
    #[prost(uint32, tag = "1")]
    pub sessions: u32,
    #[prost(uint32, tag = "2")]
    pub queue_depth: u32,
    #[prost(uint64, tag = "3")]
    pub kv_used_tokens: u64,
    /// Mean compute microseconds per step since the last heartbeat (0: no steps).
    #[prost(double, tag = "4")]
    pub recent_step_us: f64,
    /// Its GPU's device-local memory in bytes (0: it computes on the CPU, or its GPU does not
    /// say).
    #[prost(uint64, tag = "5")]
    pub device_memory_total: u64,
    /// What of that memory is free to the worker, in bytes.
    #[prost(uint64, tag = "6")]
    pub device_memory_free: u64,
    /// KV positions its open sessions reserved (each its prompt and most tokens), counted over
    /// all its layers: of its registration's `kv_tokens`, what no new session can have.
    #[prost(uint64, tag = "7")]
    pub kv_reserved_tokens: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Heartbeat {
    #[prost(message, optional, tag = "1")]
    pub load: Option<Load>,
    /// The prefix blocks it holds, when that changed since its last heartbeat to this tracker
    /// (absent: unchanged). At most `MAX_HELD_DIGESTS`.
    #[prost(message, optional, tag = "2")]
    pub prefix: Option<PrefixHeld>,
    /// The tags (`session_tag`) of the sessions it opened in the last `OPENED_WINDOW`, newest
    /// first, at most `MAX_OPENED_TAGS`: the tracker counts a route it issued just before as in
    /// `load` once its session is named here, and not twice.
    #[prost(fixed64, repeated, tag = "3")]
    pub opened: Vec<u64>,
}

/// How long a worker names a session it opened in its heartbeats: longer than a route takes from
/// being issued to opening its session (the tracker's grace for that is 250 ms).
pub const OPENED_WINDOW: std::time::Duration = std::time::Duration::from_secs(1);
/// Most session tags one heartbeat may name.
pub const MAX_OPENED_TAGS: usize = 1024;

/// A session's tag in heartbeats: the first 8 bytes of its id, little-endian (0 for a shorter
/// id).
pub fn session_tag(id: &[u8]) -> u64 {
    id.get(..8).map_or(0, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
}

/// The route digests (`prefix::route_digest`) of the prefix-cache blocks a worker holds, most
/// recently used first: what it had, replaced whole.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PrefixHeld {
    #[prost(fixed64, repeated, tag = "1")]
    pub digests: Vec<u64>,
}

/// One block of a request's prompt, for routing it to where its prefix is cached.
#[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
pub struct PrefixProbe {
    /// Full blocks of the prompt up to and including this one (1 for the first).
    #[prost(uint32, tag = "1")]
    pub blocks: u32,
    /// The first 8 bytes (little-endian) of the block's chain hash; the tracker mixes in the
    /// tenant it bills the request under.
    #[prost(fixed64, tag = "2")]
    pub chain: u64,
}

#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct Leave {}

/// What one worker computed for one session, reported when the session ended there.
#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkerUsage {
    #[prost(bytes = "vec", tag = "1")]
    pub session_id: Vec<u8>,
    #[prost(string, tag = "2")]
    pub request_id: String,
    #[prost(uint32, tag = "3")]
    pub layer_start: u32,
    #[prost(uint32, tag = "4")]
    pub layer_end: u32,
    #[prost(uint64, tag = "5")]
    pub tokens_prefilled: u64,
    #[prost(uint64, tag = "6")]
    pub tokens_decoded: u64,
    #[prost(uint64, tag = "7")]
    pub layer_tokens: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RouteRequest {
    #[prost(string, tag = "1")]
    pub model_id: String,
    /// Empty: any engine, or any mix of engines along the route; an engine id: stages of that
    /// engine only; a route engine of several (`route_engine`): the same engine at every layer.
    #[prost(string, tag = "2")]
    pub engine: String,
    /// Positions the session may use (prompt + max tokens): the ticket's budget.
    #[prost(uint64, tag = "3")]
    pub budget_tokens: u64,
    #[prost(string, tag = "4")]
    pub api_key: String,
    /// The client's idempotent id for the request the session belongs to.
    #[prost(string, tag = "5")]
    pub request_id: String,
    /// Workers not to use (a failed stage).
    #[prost(string, repeated, tag = "6")]
    pub exclude: Vec<String>,
    /// When given, the route's stages exactly: each segment's layers, served by the named worker
    /// or, where the id is empty, by the cheapest live one holding them (a spot check's route).
    #[prost(message, repeated, tag = "7")]
    pub fixed: Vec<RouteStage>,
    /// Some of the prompt's full blocks (`prefix::prefix_probes`), blocks ascending, at most
    /// `MAX_PREFIX_PROBES`: the planner prefers workers that hold them cached.
    #[prost(message, repeated, tag = "8")]
    pub prefix: Vec<PrefixProbe>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RouteStage {
    #[prost(string, tag = "1")]
    pub worker_id: String,
    /// Where to dial it: host:port, or relay://TRACKER/WORKER_ID.
    #[prost(string, tag = "2")]
    pub addr: String,
    #[prost(uint32, tag = "3")]
    pub layer_start: u32,
    #[prost(uint32, tag = "4")]
    pub layer_end: u32,
    /// The engine this stage computes with (its registration's); in a route request's `fixed`
    /// stages, the engine a swapped-in worker must run (empty: the named workers').
    #[prost(string, tag = "5")]
    pub engine: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RouteReply {
    #[prost(message, optional, tag = "1")]
    pub ticket: Option<SignedTicket>,
    /// The ticket's content, for the driver (the same as in the signed body).
    #[prost(message, optional, tag = "2")]
    pub route: Option<crate::Ticket>,
    #[prost(uint32, tag = "3")]
    pub hidden: u32,
    #[prost(uint32, tag = "4")]
    pub n_layers: u32,
    #[prost(uint32, tag = "5")]
    pub vocab: u32,
    /// The name the request's API key is billed under ("anonymous" without keys).
    #[prost(string, tag = "6")]
    pub key_name: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct StageUsage {
    #[prost(string, tag = "1")]
    pub worker_id: String,
    #[prost(bytes = "vec", tag = "2")]
    pub session_id: Vec<u8>,
    #[prost(uint64, tag = "3")]
    pub tokens_prefilled: u64,
    #[prost(uint64, tag = "4")]
    pub tokens_decoded: u64,
    #[prost(uint64, tag = "5")]
    pub layer_tokens: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RequestUsage {
    #[prost(string, tag = "1")]
    pub request_id: String,
    #[prost(string, tag = "2")]
    pub api_key: String,
    #[prost(string, tag = "3")]
    pub model_id: String,
    #[prost(string, tag = "4")]
    pub engine: String,
    #[prost(uint64, tag = "5")]
    pub prompt_tokens: u64,
    #[prost(uint64, tag = "6")]
    pub completion_tokens: u64,
    /// A [`UsageStatus`] by name; read it with [`RequestUsage::usage_status`].
    #[prost(string, tag = "7")]
    pub status: String,
    /// The driver's view of what each stage computed (from the stages' Usage frames).
    #[prost(message, repeated, tag = "8")]
    pub stages: Vec<StageUsage>,
}

impl RequestUsage {
    /// The status field, checked: a name the protocol does not know is an error.
    pub fn usage_status(&self) -> Result<UsageStatus, UnknownStatus> {
        self.status.parse()
    }
}

/// How a request ended, as a usage report says. A string on the wire (and in the ledger), so
/// that the ledger stays readable; code uses this.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UsageStatus {
    Completed,
    Cancelled,
    Failed,
}

impl UsageStatus {
    pub const ALL: [UsageStatus; 3] = [UsageStatus::Completed, UsageStatus::Cancelled, UsageStatus::Failed];

    pub fn as_str(self) -> &'static str {
        match self {
            UsageStatus::Completed => "completed",
            UsageStatus::Cancelled => "cancelled",
            UsageStatus::Failed => "failed",
        }
    }
}

impl std::str::FromStr for UsageStatus {
    type Err = UnknownStatus;

    fn from_str(s: &str) -> Result<UsageStatus, UnknownStatus> {
        UsageStatus::ALL.into_iter().find(|u| u.as_str() == s).ok_or_else(|| UnknownStatus(s.chars().take(64).collect()))
    }
}

/// A usage status the protocol does not know (its first 64 chars).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown request status {0:?} (completed, cancelled or failed)")]
pub struct UnknownStatus(pub String);

#[derive(Clone, PartialEq, prost::Message)]
pub struct Ack {
    /// True when this report was already stored (a retry).
    #[prost(bool, tag = "1")]
    pub duplicate: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SwarmQuery {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkerStatus {
    #[prost(string, tag = "1")]
    pub worker_id: String,
    #[prost(message, optional, tag = "2")]
    pub registration: Option<Registration>,
    #[prost(message, optional, tag = "3")]
    pub load: Option<Load>,
    /// Milliseconds since its last heartbeat.
    #[prost(uint64, tag = "4")]
    pub last_seen_ms: u64,
    #[prost(bool, tag = "5")]
    pub relayed: bool,
    /// Routes issued to it in the last moments, not yet visible in its heartbeats.
    #[prost(uint32, tag = "6")]
    pub recent_routes: u32,
    #[prost(uint64, tag = "7")]
    pub routes_total: u64,
    /// Caught by a spot check: never routed to again.
    #[prost(string, tag = "8")]
    pub quarantined: String,
    /// Prefix blocks it said it holds in its last report of them.
    #[prost(uint32, tag = "9")]
    pub prefix_blocks: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SwarmReply {
    #[prost(message, repeated, tag = "1")]
    pub workers: Vec<WorkerStatus>,
    /// A worker silent for three of these is out of new routes.
    #[prost(uint32, tag = "2")]
    pub heartbeat_ms: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct UsageQuery {
    /// key or worker.
    #[prost(string, tag = "1")]
    pub by: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct UsageRow {
    /// The key's name, or the worker's id.
    #[prost(string, tag = "1")]
    pub who: String,
    #[prost(string, tag = "2")]
    pub model_id: String,
    #[prost(string, tag = "3")]
    pub engine: String,
    #[prost(uint64, tag = "4")]
    pub requests: u64,
    #[prost(uint64, tag = "5")]
    pub prompt_tokens: u64,
    #[prost(uint64, tag = "6")]
    pub completion_tokens: u64,
    #[prost(uint64, tag = "7")]
    pub tokens_prefilled: u64,
    #[prost(uint64, tag = "8")]
    pub tokens_decoded: u64,
    #[prost(uint64, tag = "9")]
    pub layer_tokens: u64,
    /// Sessions where the driver's and the worker's reports disagree.
    #[prost(uint64, tag = "10")]
    pub disagreements: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct UsageReply {
    #[prost(message, repeated, tag = "1")]
    pub rows: Vec<UsageRow>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct KeyAdd {
    #[prost(string, tag = "1")]
    pub join_token: String,
    #[prost(string, tag = "2")]
    pub name: String,
    /// Most prompt + completion tokens the key may use; 0: no limit.
    #[prost(uint64, tag = "3")]
    pub quota_tokens: u64,
    /// The key itself, when the operator chose it (then a key of that name is replaced);
    /// empty: the tracker makes one.
    #[prost(string, tag = "4")]
    pub key: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct KeyAdded {
    /// The secret, shown once; the tracker keeps only its hash.
    #[prost(string, tag = "1")]
    pub key: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, prost::Enumeration)]
#[repr(i32)]
pub enum RefusalKind {
    Internal = 0,
    BadRequest = 1,
    BadJoinToken = 2,
    BadSignature = 3,
    /// No chain of live workers covers the model.
    NoRoute = 4,
    BadApiKey = 5,
    QuotaExceeded = 6,
    /// A relayed worker that is not connected.
    NotConnected = 7,
    Overloaded = 8,
    /// The tracker's ledger (its database) cannot be reached: nothing is routed unbilled and
    /// no report is lost; ask again shortly.
    Unavailable = 9,
    /// Live workers cover the model but none has room for another session now; room frees as
    /// sessions end.
    Full = 10,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Refused {
    #[prost(enumeration = "RefusalKind", tag = "1")]
    pub kind: i32,
    #[prost(string, tag = "2")]
    pub message: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RelayConnect {
    #[prost(string, tag = "1")]
    pub worker_id: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RelayDial {
    #[prost(bytes = "vec", tag = "1")]
    pub token: Vec<u8>,
}

impl TrackerFrame {
    pub fn new(body: TrackerBody) -> TrackerFrame {
        TrackerFrame { body: Some(body) }
    }
}

impl RefusalKind {
    pub fn name(self) -> &'static str {
        match self {
            RefusalKind::Internal => "internal",
            RefusalKind::BadRequest => "bad_request",
            RefusalKind::BadJoinToken => "bad_join_token",
            RefusalKind::BadSignature => "bad_signature",
            RefusalKind::NoRoute => "no_route",
            RefusalKind::BadApiKey => "bad_api_key",
            RefusalKind::QuotaExceeded => "quota_exceeded",
            RefusalKind::NotConnected => "not_connected",
            RefusalKind::Overloaded => "overloaded",
            RefusalKind::Unavailable => "unavailable",
            RefusalKind::Full => "full",
        }
    }
}

impl Refused {
    pub fn new(kind: RefusalKind, message: impl Into<String>) -> Refused {
        Refused { kind: kind as i32, message: message.into() }
    }

    pub fn refusal_kind(&self) -> RefusalKind {
        RefusalKind::try_from(self.kind).unwrap_or(RefusalKind::Internal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_statuses_keep_their_wire_names_and_others_are_refused() {
        let names: Vec<&str> = UsageStatus::ALL.iter().map(|s| s.as_str()).collect();
        assert_eq!(names, ["completed", "cancelled", "failed"]);
        for s in UsageStatus::ALL {
            let u = RequestUsage { status: s.as_str().into(), ..Default::default() };
            assert_eq!(u.usage_status(), Ok(s));
        }
        for bad in ["", "Completed", "done", "completed "] {
            let u = RequestUsage { status: bad.into(), ..Default::default() };
            assert_eq!(u.usage_status(), Err(UnknownStatus(bad.into())));
        }
        let long = RequestUsage { status: "x".repeat(10_000), ..Default::default() };
        assert_eq!(long.usage_status().unwrap_err().0.len(), 64);
    }
}
