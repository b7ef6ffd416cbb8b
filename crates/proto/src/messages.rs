//! The messages, as prost types (no .proto build step). `wire.proto` documents every message and
//! field of the crate; `tests/wire_schema.rs` fails when the two differ, so change both.

/// One frame on the wire.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Frame {
    #[prost(oneof = "Body", tags = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16")]
    pub body: Option<Body>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Body {
    /// The first frame each side sends on a connection.
    #[prost(message, tag = "1")]
    Hello(Hello),
    /// Driver → every stage: open a session on this stage.
    #[prost(message, tag = "2")]
    Open(OpenSession),
    /// Stage → driver: the session is open here.
    #[prost(message, tag = "3")]
    Opened(SessionRef),
    /// Driver → first stage (token ids), stage → next stage (hidden rows).
    #[prost(message, tag = "4")]
    Forward(Forward),
    /// Last stage → driver: a sampled token.
    #[prost(message, tag = "5")]
    Token(TokenOut),
    /// Driver → every stage: stop and free the session now.
    #[prost(message, tag = "6")]
    Cancel(SessionRef),
    /// Driver → every stage: the session is done; free it.
    #[prost(message, tag = "7")]
    Close(SessionRef),
    /// Either way: something about a session (or the connection) failed.
    #[prost(message, tag = "8")]
    Error(ErrorMsg),
    /// Stage → driver, when a session is closed or cancelled: what it computed there.
    #[prost(message, tag = "9")]
    Usage(Usage),
    /// Driver → stage: are you there? Answered at once by the connection, not the scheduler,
    /// so a busy stage answers and a stopped one does not.
    #[prost(message, tag = "10")]
    Ping(Ping),
    #[prost(message, tag = "11")]
    Pong(Ping),
    /// A worker fetching its slice → a worker holding the tensors (behind the join token): the
    /// model's manifest, or a run of one tensor's bytes.
    #[prost(message, tag = "12")]
    Fetch(FetchAsk),
    /// Holder → fetcher: the manifest, a GGUF file with no tensors holding the whole model's
    /// metadata and its table of tensor hashes (the model's identity).
    #[prost(message, tag = "13")]
    Manifest(Manifest),
    /// Holder → fetcher: bytes of one tensor.
    #[prost(message, tag = "14")]
    Chunk(TensorChunk),
    /// Last stage → driver: a chunk of a prompt has run through the whole route (no token yet),
    /// so a long prefill that is slow but moving is not taken for a dead route.
    #[prost(message, tag = "15")]
    Progress(Progress),
    /// Last stage → driver, for a session opened with `embed`: the prompt's pooled vector,
    /// instead of a token.
    #[prost(message, tag = "16")]
    Embedding(Embedding),
}

/// The most bytes one `Chunk` carries.
pub const MAX_CHUNK: u32 = 4 << 20;

#[derive(Clone, PartialEq, prost::Message)]
pub struct FetchAsk {
    #[prost(string, tag = "1")]
    pub join_token: String,
    #[prost(string, tag = "2")]
    pub model_id: String,
    /// Empty: the manifest.
    #[prost(string, tag = "3")]
    pub tensor: String,
    #[prost(uint64, tag = "4")]
    pub offset: u64,
    /// At most `MAX_CHUNK`.
    #[prost(uint32, tag = "5")]
    pub len: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Manifest {
    #[prost(bytes = "vec", tag = "1")]
    pub gguf: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorChunk {
    #[prost(string, tag = "1")]
    pub tensor: String,
    #[prost(uint64, tag = "2")]
    pub offset: u64,
    #[prost(bytes = "vec", tag = "3")]
    pub data: Vec<u8>,
}

#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct Ping {
    #[prost(uint64, tag = "1")]
    pub nonce: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, prost::Enumeration)]
#[repr(i32)]
pub enum Role {
    Driver = 0,
    /// A previous stage forwarding hidden rows.
    Upstream = 1,
    Worker = 2,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Hello {
    #[prost(uint32, tag = "1")]
    pub protocol_version: u32,
    #[prost(enumeration = "Role", tag = "2")]
    pub role: i32,
    /// Sent by workers: what they serve.
    #[prost(message, optional, tag = "3")]
    pub info: Option<StageInfo>,
}

/// What a worker serves, announced in its Hello.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StageInfo {
    #[prost(string, tag = "1")]
    pub model_id: String,
    #[prost(uint32, tag = "2")]
    pub layer_start: u32,
    #[prost(uint32, tag = "3")]
    pub layer_end: u32,
    #[prost(uint32, tag = "4")]
    pub n_layers: u32,
    #[prost(uint32, tag = "5")]
    pub hidden: u32,
    #[prost(uint32, tag = "6")]
    pub vocab: u32,
    /// Most positions one session may hold on this worker.
    #[prost(uint64, tag = "7")]
    pub max_positions: u64,
    #[prost(string, tag = "8")]
    pub version: String,
    /// The engine computing the stage (a compatibility key field): sessions never cross engines.
    #[prost(string, tag = "9")]
    pub engine: String,
}

/// What both sides of a seam must agree on before any hidden row crosses it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BoundarySchema {
    #[prost(uint32, tag = "1")]
    pub protocol_version: u32,
    /// The model's identity (hex): a hash over its metadata and its tensors' hashes, the same for
    /// the whole file and for every slice of it.
    #[prost(string, tag = "2")]
    pub model_id: String,
    #[prost(uint32, tag = "3")]
    pub layer_start: u32,
    #[prost(uint32, tag = "4")]
    pub layer_end: u32,
    #[prost(uint32, tag = "5")]
    pub hidden: u32,
    /// The dtype of hidden rows this stage receives and sends.
    #[prost(enumeration = "crate::SeamDtype", tag = "6")]
    pub seam_dtype: i32,
    /// The engine computing the stage: the same weights under another engine are another
    /// model's numbers. It carries the stage's KV layout (its KV dtype: `gguf-cpu-exact-q8_0`).
    #[prost(string, tag = "7")]
    pub engine: String,
}

#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct Sampling {
    #[prost(float, tag = "1")]
    pub temperature: f32,
    #[prost(uint32, tag = "2")]
    pub top_k: u32,
    #[prost(float, tag = "3")]
    pub top_p: f32,
    #[prost(uint64, tag = "4")]
    pub seed: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct OpenSession {
    /// 16 random bytes.
    #[prost(bytes = "vec", tag = "1")]
    pub session_id: Vec<u8>,
    #[prost(message, optional, tag = "2")]
    pub schema: Option<BoundarySchema>,
    #[prost(uint32, tag = "3")]
    pub stage_index: u32,
    #[prost(uint32, tag = "4")]
    pub n_stages: u32,
    /// The next stage's address; empty on the last stage.
    #[prost(string, tag = "5")]
    pub next: String,
    #[prost(message, optional, tag = "6")]
    pub sampling: Option<Sampling>,
    #[prost(uint32, tag = "7")]
    pub top_logprobs: u32,
    /// Positions the session will need at most (prompt + generated tokens).
    #[prost(uint64, tag = "8")]
    pub max_positions: u64,
    /// The tracker's signed route; required by a worker that joined a tracker.
    #[prost(message, optional, tag = "9")]
    pub ticket: Option<crate::SignedTicket>,
    /// Report a hash of each step's last output row in the trace (for spot checks).
    #[prost(bool, tag = "10")]
    pub hash_rows: bool,
    /// Present: the session embeds its prompt (no sampling, no head) and ends with `Embedding`.
    #[prost(message, optional, tag = "11")]
    pub embed: Option<Embed>,
    /// The prompt's prefix-cache chain hashes, one per full block (`prefix_chain`), 32 bytes each.
    #[prost(bytes = "vec", repeated, tag = "12")]
    pub prefix_blocks: Vec<Vec<u8>>,
    /// Present: the route runs as a ring (`Ring`); the first and last stages are told their part.
    #[prost(message, optional, tag = "13")]
    pub ring: Option<Ring>,
}

/// A session whose decode steps go round the route without its driver: the last stage sends
/// each step's last token straight to the first stage (and every token to the driver), and the
/// first stage drafts the next step itself. A step then waits on the route's own seams only.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Ring {
    /// To the last stage: the first stage's address, where each step's last token goes; empty
    /// when the last stage is the first too.
    #[prost(string, tag = "1")]
    pub to: String,
    /// To the last stage: tokens that end the generation (no step follows them).
    #[prost(uint32, repeated, tag = "2")]
    pub stop: Vec<u32>,
    /// To the first stage: the most drafts a step may carry (0: none).
    #[prost(uint32, tag = "3")]
    pub speculate: u32,
    /// To the first stage: the whole prompt, which drafts are looked up in (the session's first
    /// frame may start past a cached prefix).
    #[prost(uint32, repeated, tag = "4")]
    pub prompt: Vec<u32>,
}

/// The most stop tokens a ring session names.
pub const MAX_STOP_TOKENS: usize = 64;

/// How an embedding session pools its prompt's final-normed rows.
#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct Embed {
    #[prost(enumeration = "Pooling", tag = "1")]
    pub pooling: i32,
}

/// llama.cpp's numbers for mean, cls and last; 0 is whatever the model's metadata says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, prost::Enumeration)]
#[repr(i32)]
pub enum Pooling {
    Model = 0,
    Mean = 1,
    Cls = 2,
    Last = 3,
}

/// A prompt's embedding: the pooled, L2-normalised final hidden state.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Embedding {
    #[prost(bytes = "vec", tag = "1")]
    pub session_id: Vec<u8>,
    /// `hidden` f32 values, little-endian.
    #[prost(bytes = "vec", tag = "2")]
    pub values: Vec<u8>,
    /// Prompt positions pooled.
    #[prost(uint64, tag = "3")]
    pub n_tokens: u64,
    #[prost(message, repeated, tag = "4")]
    pub trace: Vec<Hop>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SessionRef {
    #[prost(bytes = "vec", tag = "1")]
    pub session_id: Vec<u8>,
    /// In `Opened`: how many leading prefix blocks the stage holds (pinned until the first forward).
    #[prost(uint32, tag = "2")]
    pub cached_blocks: u32,
    /// In `Close`: the chain hashes of the whole sequence, so its blocks are cached too.
    #[prost(bytes = "vec", repeated, tag = "3")]
    pub prefix_blocks: Vec<Vec<u8>>,
    /// In `Close` with `prefix_blocks`: the positions that hold the sequence (its length less
    /// its last token); a stage holding more (a speculative step's rejected drafts) drops them
    /// before caching.
    #[prost(uint64, tag = "4")]
    pub positions: u64,
}

/// Per-hop timing that travels with a step, so the driver can report each seam.
#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct Hop {
    #[prost(uint32, tag = "1")]
    pub stage: u32,
    /// Microseconds the step waited in the stage's queue.
    #[prost(uint64, tag = "2")]
    pub queue_us: u64,
    #[prost(uint64, tag = "3")]
    pub compute_us: u64,
    /// Bytes this stage sent onward for the step.
    #[prost(uint64, tag = "4")]
    pub bytes_out: u64,
    /// Unix microseconds when the stage received the step, and when it sent its result.
    #[prost(uint64, tag = "5")]
    pub recv_unix_us: u64,
    #[prost(uint64, tag = "6")]
    pub sent_unix_us: u64,
    /// For a session opened with `hash_rows`: a hash of this step's last output row (the hidden
    /// row sent on, or the logits sampled from on the last stage; 0 when there is none), and
    /// that row's position. Another replica of the same layers computes the same row bit for
    /// bit, so a spot check compares these.
    #[prost(uint64, tag = "7")]
    pub last_row_hash: u64,
    #[prost(uint64, tag = "8")]
    pub last_row_position: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Forward {
    #[prost(bytes = "vec", tag = "1")]
    pub session_id: Vec<u8>,
    /// Position of the first row.
    #[prost(uint64, tag = "2")]
    pub position: u64,
    /// Token ids (to the first stage) ...
    #[prost(uint32, repeated, tag = "3")]
    pub tokens: Vec<u32>,
    /// ... or hidden rows (between stages), `n_rows × hidden` values in `dtype`.
    #[prost(bytes = "vec", tag = "4")]
    pub hidden: Vec<u8>,
    #[prost(enumeration = "crate::SeamDtype", tag = "5")]
    pub dtype: i32,
    #[prost(uint32, tag = "6")]
    pub n_rows: u32,
    /// Whether the last stage samples a token after these rows.
    #[prost(bool, tag = "7")]
    pub sample: bool,
    #[prost(message, repeated, tag = "8")]
    pub trace: Vec<Hop>,
    /// With `sample`: the tokens the last stage may choose among, bit `i % 8` of byte `i / 8`
    /// for token `i` (ids past the mask excluded); empty: any token.
    #[prost(bytes = "vec", tag = "9")]
    pub allowed: Vec<u8>,
    /// A speculative step: the tokens of the frame's rows after its first, guessed by a ring's
    /// first stage (at most `MAX_DRAFT`, with `sample`, no mask, `1 + draft.len()` rows). The
    /// last stage samples every row and keeps the drafts up to the first it did not sample.
    #[prost(uint32, repeated, tag = "10")]
    pub draft: Vec<u32>,
    /// Sent by a ring session's last stage to its first: the step's last token, whose position
    /// says how many of the previous step's drafts were accepted.
    #[prost(bool, tag = "11")]
    pub ring: bool,
    /// With `ring`: what the step's stages computed for, in all (µs), so the first stage can
    /// tell a route that waits on its links from one that waits on its compute.
    #[prost(uint64, tag = "12")]
    pub step_compute_us: u64,
}

/// The most draft tokens one step verifies.
pub const MAX_DRAFT: usize = 16;

#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct TopEntry {
    #[prost(uint32, tag = "1")]
    pub id: u32,
    #[prost(float, tag = "2")]
    pub logprob: f32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TokenOut {
    #[prost(bytes = "vec", tag = "1")]
    pub session_id: Vec<u8>,
    /// The position the token will occupy.
    #[prost(uint64, tag = "2")]
    pub position: u64,
    #[prost(uint32, tag = "3")]
    pub token: u32,
    #[prost(float, tag = "4")]
    pub logprob: f32,
    #[prost(message, repeated, tag = "5")]
    pub top: Vec<TopEntry>,
    #[prost(message, repeated, tag = "6")]
    pub trace: Vec<Hop>,
    /// After a speculative step: the tokens after this one that it accepted, in order (each
    /// draft the last stage sampled too, then the one it sampled in place of the first it did
    /// not). Empty: the step gave one token.
    #[prost(message, repeated, tag = "7")]
    pub more: Vec<Sampled>,
    /// The drafts the step carried (`more` holds those accepted and one token more).
    #[prost(uint32, tag = "8")]
    pub drafted: u32,
}

/// One more token of a speculative step.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Sampled {
    #[prost(uint64, tag = "1")]
    pub position: u64,
    #[prost(uint32, tag = "2")]
    pub token: u32,
    #[prost(float, tag = "3")]
    pub logprob: f32,
    #[prost(message, repeated, tag = "4")]
    pub top: Vec<TopEntry>,
}

/// How far a session's prompt has run through the route.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Progress {
    #[prost(bytes = "vec", tag = "1")]
    pub session_id: Vec<u8>,
    /// Positions the last stage has computed (the next row's position).
    #[prost(uint64, tag = "2")]
    pub positions: u64,
}

/// What one stage computed for one session.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Usage {
    #[prost(bytes = "vec", tag = "1")]
    pub session_id: Vec<u8>,
    #[prost(uint32, tag = "2")]
    pub stage: u32,
    /// Prompt rows computed (rows of multi-row frames).
    #[prost(uint64, tag = "3")]
    pub tokens_prefilled: u64,
    /// Single-row decode steps computed.
    #[prost(uint64, tag = "4")]
    pub tokens_decoded: u64,
    /// Rows times this stage's layers.
    #[prost(uint64, tag = "5")]
    pub layer_tokens: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, prost::Enumeration)]
#[repr(i32)]
pub enum ErrorKind {
    Internal = 0,
    /// A frame or message that does not parse or breaks a rule of the protocol.
    BadFrame = 1,
    /// The boundary schema does not match what this stage serves.
    SchemaMismatch = 2,
    UnknownSession = 3,
    /// Well-formed but unusable input: wrong row size, dtype, positions, token ids.
    BadInput = 4,
    /// No room: KV capacity, session count or queue.
    Overloaded = 5,
    /// The next stage could not be reached or failed.
    NextStage = 6,
    ShuttingDown = 7,
    Cancelled = 8,
    /// The session's route ticket is missing, forged, expired, not for this worker or too small.
    Ticket = 9,
    /// A message on the link failed its authentication tag: altered or injected in flight.
    Integrity = 10,
    /// Well-formed, but asks for what this stage's model does not do (an embedding of a
    /// rank-pooled model).
    Unsupported = 11,
    /// The stage's GPU was lost (or failed) mid-step: its sessions are failed, and the worker
    /// leaves its trackers and exits; another worker may take the session over.
    DeviceLost = 12,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ErrorMsg {
    /// Empty when the error concerns the connection, not a session.
    #[prost(bytes = "vec", tag = "1")]
    pub session_id: Vec<u8>,
    #[prost(enumeration = "ErrorKind", tag = "2")]
    pub kind: i32,
    /// The stage (index in the route) the error is about.
    #[prost(uint32, tag = "3")]
    pub stage: u32,
    #[prost(string, tag = "4")]
    pub message: String,
}

impl Frame {
    pub fn new(body: Body) -> Frame {
        Frame { body: Some(body) }
    }
}

impl ErrorKind {
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::Internal => "internal",
            ErrorKind::BadFrame => "bad_frame",
            ErrorKind::SchemaMismatch => "schema_mismatch",
            ErrorKind::UnknownSession => "unknown_session",
            ErrorKind::BadInput => "bad_input",
            ErrorKind::Overloaded => "overloaded",
            ErrorKind::NextStage => "next_stage",
            ErrorKind::ShuttingDown => "shutting_down",
            ErrorKind::Cancelled => "cancelled",
            ErrorKind::Ticket => "ticket",
            ErrorKind::Integrity => "integrity",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::DeviceLost => "device_lost",
        }
    }
}

impl ErrorMsg {
    pub fn new(session_id: &[u8], kind: ErrorKind, stage: u32, message: impl Into<String>) -> ErrorMsg {
        ErrorMsg { session_id: session_id.to_vec(), kind: kind as i32, stage, message: message.into() }
    }

    pub fn error_kind(&self) -> ErrorKind {
        ErrorKind::try_from(self.kind).unwrap_or(ErrorKind::Internal)
    }
}
