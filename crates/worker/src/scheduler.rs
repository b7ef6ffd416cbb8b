//! The scheduler: one thread that owns the stage and every session's state. Each step it plans
//! which rows run (decode first, then capped prompt chunks, within a token budget; see `plan`)
//! and runs one batched forward per compatibility key.

use crate::compat::{CompatKey, Phase};
use crate::load::Load;
use crate::plan::{plan, Batch, Policy, Ready};
use crate::prefix::{self, Key, PrefixCache};
use crate::ring::{RingIn, RingOut};
use crate::{Metrics, WorkerConfig};
use dgr_engine::{Engine, EngineError, Input, LogitRows, Pooler, Pooling, SamplingParams, SeqInput, SeqState};
use dgr_proto::{
    check_forward, check_open, check_prefix_blocks, session_id, Body, BoundarySchema, Embedding, ErrorKind, ErrorMsg, Forward, Frame, Hop,
    OpenSession, Progress, ProtoError, Sampled, SeamDtype, SessionId, SessionRef, TokenOut, TopEntry, Usage, WorkerUsage, MAX_HELD_DIGESTS,
    PREFIX_BLOCK, STAGE_UNKNOWN,
};
use dgr_telemetry::unix_us;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::Sender;

pub(crate) type Outbox = Sender<Frame>;
pub(crate) type ConnId = u64;

/// Frames a session may have waiting before it is refused more.
const MAX_PENDING: usize = 64;

/// How many sessions keep a connection in use: the server closes a connection for idleness
/// only while none does. A session holds its driver's connection and the one its rows last
/// arrived on (a previous stage's), so neither is closed under it however quiet it is.
#[derive(Clone, Default)]
pub(crate) struct ConnUse(Arc<AtomicUsize>);

impl ConnUse {
    pub fn in_use(&self) -> bool {
        self.0.load(Relaxed) > 0
    }

    fn hold(&self) -> Hold {
        self.0.fetch_add(1, Relaxed);
        Hold(self.0.clone())
    }
}

/// One session's hold on a connection, released when the session is dropped.
struct Hold(Arc<AtomicUsize>);

impl Drop for Hold {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

pub(crate) enum Cmd {
    Open {
        conn: ConnId,
        uses: ConnUse,
        open: Box<OpenSession>,
        reply: Outbox,
        next: Option<(String, Outbox)>,
        /// From the session's route ticket (empty when ticketless): the ledger's key.
        request_id: String,
        /// The ticket's API key name (empty when ticketless): the prefix cache's tenant.
        tenant: String,
    },
    Forward {
        f: Forward,
        recv_us: u64,
        at: Instant,
        reply: Outbox,
        /// The connection the frame arrived on.
        conn: ConnId,
        uses: ConnUse,
    },
    Cancel {
        id: Vec<u8>,
    },
    Close {
        id: Vec<u8>,
        /// The whole sequence's prefix chain hashes, whose blocks are cached before it is freed.
        prefix_blocks: Vec<Vec<u8>>,
        /// The positions that hold the sequence: any past them (rejected drafts) are not cached.
        positions: u64,
    },
    /// A driver's connection ended: its sessions end with it.
    ConnClosed {
        conn: ConnId,
    },
    /// The connection to a next stage broke: `conn` is its outbox, so only the sessions on that
    /// connection fail, not those already on a fresh one to the same address.
    PeerLost {
        addr: String,
        conn: Outbox,
        why: String,
        /// `Integrity` when a frame on it was altered in flight, else `NextStage`.
        kind: ErrorKind,
    },
    /// The next stage reported an error about one of our sessions.
    PeerError {
        err: ErrorMsg,
    },
    /// Stop taking sessions; exit once none are left or at `deadline`.
    Drain {
        deadline: Instant,
    },
}

/// A frame's rows waiting to run; prompts run in chunks, `done` rows at a time.
struct Pending {
    f: Forward,
    rows: usize,
    done: usize,
    recv_us: u64,
    at: Instant,
}

struct Session<K> {
    id: SessionId,
    driver: ConnId,
    /// Keeps the driver's connection from being closed for idleness.
    _driver_hold: Hold,
    /// The connection the session's rows last arrived on, kept likewise.
    feed: Option<(ConnId, Hold)>,
    reply: Outbox,
    next: Option<(String, Outbox)>,
    /// Over the layers the session runs here: a part of the stage's, named at open.
    kv: K,
    /// The session's layers start at 0 (it takes token ids) / end at the model's last (it samples).
    first: bool,
    last: bool,
    dtype: SeamDtype,
    stage_index: u32,
    sampling: SamplingParams,
    top_logprobs: usize,
    /// KV reserved, in layer-positions: positions times the session's layers.
    reserved: usize,
    pending: VecDeque<Pending>,
    last_active: Instant,
    usage: Usage,
    request_id: String,
    /// Report a hash of each step's last output row (a spot-checked session).
    hash_rows: bool,
    /// On the last stage: hops of prompt chunks run since the last token, sent with the next one.
    carry: Vec<Hop>,
    /// Compute time a row of the session's last prompt chunk took (its next chunk is sized by it).
    row_time: Option<Duration>,
    /// Past the prompt: a frame that asked for a token has run. Before, every row is prefill
    /// (however the previous stage chunked the prompt); after, every row is decode.
    decoding: bool,
    /// Opened to embed its prompt: it takes no rows past the prompt.
    embedding: bool,
    /// On the last stage of an embedding session: the prompt's rows pooled so far.
    pooler: Option<Pooler>,
    /// The prefix cache's keys of the session's blocks (empty: it is not cached).
    prefix: Vec<Key>,
    /// Their route digests, one per key.
    routes: Vec<u64>,
    /// The stage salt and tenant its keys are made with (None: it is not cached).
    namer: Option<(Key, String)>,
    /// Leading blocks of `prefix` pinned for it until its first forward.
    pinned: usize,
    /// Blocks of `prefix` already held by the cache or given up on.
    remembered: usize,
    /// No forward has arrived yet: the first may start past a cached prefix.
    fresh: bool,
    /// After a speculative step on a stage before the last: its first draft's position. The
    /// session's next frame may start anywhere from there to the end of the step, dropping the
    /// rejected drafts' positions past its start.
    floor: Option<usize>,
    /// A ring session's ends: on the last stage where its tokens go, on the first its drafting.
    ring_out: Option<RingOut>,
    ring_in: Option<RingIn>,
}

impl<K> Session<K> {
    fn phase(&self) -> Phase {
        if self.decoding {
            Phase::Decode
        } else {
            Phase::Prefill
        }
    }
}

pub(crate) struct Scheduler<E: Engine> {
    pub stage: E,
    pub cfg: WorkerConfig,
    pub schema: BoundarySchema,
    pub metrics: Arc<Metrics>,
    sessions: HashMap<SessionId, Session<E::State>>,
    /// When the device's memory was last read for /metrics.
    memory_read: Option<Instant>,
    /// Why the stage's device was lost, once it was: `run` then ends.
    lost: Option<String>,
    /// KV reserved by the open sessions, in layer-positions.
    reserved: usize,
    drain: Option<Instant>,
    policy: Policy,
    /// The share of recent time the stage computed.
    load: Load,
    model_id: Arc<str>,
    /// When the last frame arrived: a burst of arrivals still coming is worth waiting for.
    last_arrival: Instant,
    /// When the last step ended: rows that arrived during it count as arriving then.
    last_step_end: Instant,
    /// Where each ended session's usage goes for the tracker's ledger (None when ticketless).
    ledger: Option<LedgerTx>,
    prefix: PrefixCache,
    /// The cache's `changes` when its digests were last handed to the heartbeats, and when.
    held: (u64, Instant),
}

pub(crate) type LedgerTx = tokio::sync::mpsc::Sender<WorkerUsage>;

/// 64 bits of the SHA-256 of a row's f32 bytes.
fn row_hash(row: &[f32]) -> u64 {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for x in row {
        h.update(x.to_le_bytes());
    }
    u64::from_le_bytes(h.finalize()[..8].try_into().unwrap_or_default())
}

fn send(to: &Outbox, body: Body) -> bool {
    to.try_send(Frame::new(body)).is_ok()
}

impl<E: Engine> Scheduler<E> {
    pub fn new(stage: E, cfg: WorkerConfig, schema: BoundarySchema, metrics: Arc<Metrics>, ledger: Option<LedgerTx>) -> Scheduler<E> {
        let per_position = stage.kv_position_bytes();
        metrics.kv_bytes_capacity.store((cfg.kv_budget_tokens * per_position) as u64, Relaxed);
        let prefix_budget = cfg.prefix_cache_bytes.unwrap_or_else(|| cfg.prefix_cache_default(per_position));
        metrics.prefix_bytes_capacity.store(prefix_budget as u64, Relaxed);
        metrics.weight_bytes.store(stage.weight_bytes() as u64, Relaxed);
        *metrics.device_memory.lock().unwrap_or_else(|p| p.into_inner()) = stage.device_memory();
        let policy = cfg.policy.clone();
        let model_id = schema.model_id.as_str().into();
        Scheduler {
            stage,
            cfg,
            schema,
            metrics,
            sessions: HashMap::new(),
            reserved: 0,
            drain: None,
            policy,
            load: Load::default(),
            model_id,
            last_arrival: Instant::now(),
            last_step_end: Instant::now(),
            ledger,
            prefix: PrefixCache::new(prefix_budget),
            held: (0, Instant::now()),
            memory_read: Some(Instant::now()),
            lost: None,
        }
    }

    /// Runs until every command sender is gone or a drain completes, or until the stage's device
    /// is lost: then every session is failed, and why is returned.
    pub fn run(mut self, rx: Receiver<Cmd>) -> Option<String> {
        let tick = Duration::from_millis(100);
        loop {
            let busy = self.sessions.values().any(|s| !s.pending.is_empty());
            let hold = self.hold();
            if !busy || hold.is_some() {
                match rx.recv_timeout(hold.unwrap_or(tick)) {
                    Ok(c) => self.handle(c),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return None,
                }
            }
            while let Ok(c) = rx.try_recv() {
                self.handle(c);
            }
            if self.hold().is_none() {
                self.step();
            }
            if let Some(why) = self.lost.take() {
                let ids: Vec<SessionId> = self.sessions.keys().copied().collect();
                for id in ids {
                    self.fail(&id, ErrorKind::DeviceLost, &why);
                }
                return Some(why);
            }
            self.sweep();
            if let Some(deadline) = self.drain {
                if self.sessions.is_empty() || Instant::now() >= deadline {
                    let ids: Vec<SessionId> = self.sessions.keys().copied().collect();
                    for id in ids {
                        self.fail(&id, ErrorKind::ShuttingDown, "the worker is shutting down");
                    }
                    return None;
                }
            }
            self.publish();
        }
    }

    fn error_to(&self, to: &Outbox, id: &[u8], kind: ErrorKind, stage: u32, msg: impl Into<String>) {
        self.metrics.failure(kind);
        send(to, Body::Error(ErrorMsg::new(id, kind, stage, msg)));
    }

    /// Ends a session with an error sent to its driver.
    fn fail(&mut self, id: &SessionId, kind: ErrorKind, msg: &str) {
        if let Some(s) = self.sessions.remove(id) {
            self.end(s, Some((kind, msg.to_string())));
        }
    }

    /// Frees a session (already out of the map) and tells its driver why, if it failed.
    fn end(&mut self, s: Session<E::State>, err: Option<(ErrorKind, String)>) {
        self.release(&s);
        if let Some((kind, msg)) = err {
            self.error_to(&s.reply, &s.id, kind, s.stage_index, msg);
        }
    }

    /// Takes a session out of the map and frees it.
    fn remove(&mut self, id: &SessionId) -> Option<Session<E::State>> {
        let s = self.sessions.remove(id)?;
        self.release(&s);
        Some(s)
    }

    fn release(&mut self, s: &Session<E::State>) {
        if let Some(tx) = &self.ledger {
            let layers = s.kv.layers();
            let u = WorkerUsage {
                session_id: s.id.to_vec(),
                request_id: s.request_id.clone(),
                layer_start: layers.start as u32,
                layer_end: layers.end as u32,
                tokens_prefilled: s.usage.tokens_prefilled,
                tokens_decoded: s.usage.tokens_decoded,
                layer_tokens: s.usage.layer_tokens,
            };
            if tx.try_send(u).is_err() {
                self.metrics.failure(ErrorKind::Overloaded);
            }
        }
        self.reserved -= s.reserved;
        self.prefix.unpin(&s.prefix[..s.pinned]);
        self.metrics.sessions_closed.fetch_add(1, Relaxed);
    }

    fn handle(&mut self, c: Cmd) {
        match c {
            Cmd::Open { conn, uses, open, reply, next, request_id, tenant } => {
                self.open(conn, uses, *open, reply, next, (request_id, tenant))
            }
            Cmd::Forward { f, recv_us, at, reply, conn, uses } => {
                self.last_arrival = at;
                self.forward(f, recv_us, at, reply, (conn, uses))
            }
            Cmd::Close { id, prefix_blocks, positions } if !prefix_blocks.is_empty() => {
                if let Some(s) = session_id(&id).ok().and_then(|id| self.sessions.get_mut(&id)) {
                    // Positions past the sequence (a last speculative step's rejected drafts)
                    // hold other tokens' keys: they never reach the cache.
                    let held = (positions as usize) < s.kv.positions() && s.kv.blockable();
                    if !held || s.kv.truncate(positions as usize).is_ok() {
                        Self::rename(&mut self.prefix, s, &prefix_blocks);
                        Self::remember(&mut self.prefix, s);
                    }
                }
                self.handle(Cmd::Close { id, prefix_blocks: Vec::new(), positions: 0 });
            }
            Cmd::Cancel { id } | Cmd::Close { id, .. } => {
                if let Some(s) = session_id(&id).ok().and_then(|id| self.remove(&id)) {
                    send(&s.reply, Body::Usage(s.usage));
                }
            }
            Cmd::ConnClosed { conn } => {
                let ids: Vec<SessionId> = self.sessions.values().filter(|s| s.driver == conn).map(|s| s.id).collect();
                for id in ids {
                    self.remove(&id);
                }
            }
            Cmd::PeerLost { addr, conn, why, kind } => {
                let on = |tx: &Outbox| tx.same_channel(&conn);
                let on_it = self.sessions.values().filter(|s| {
                    s.next.as_ref().is_some_and(|(_, tx)| on(tx)) || s.ring_out.as_ref().and_then(|r| r.to.as_ref()).is_some_and(on)
                });
                let ids: Vec<SessionId> = on_it.map(|s| s.id).collect();
                for id in ids {
                    if let Some(s) = self.remove(&id) {
                        // A ring's last stage sends to the first.
                        let to = if s.ring_out.is_some() { 0 } else { s.stage_index + 1 };
                        self.error_to(&s.reply, &id, kind, to, format!("lost the link to the stage at {addr}: {why}"));
                    }
                }
            }
            Cmd::PeerError { err } => {
                if let Ok(id) = session_id(&err.session_id) {
                    if let Some(s) = self.remove(&id) {
                        self.metrics.failure(err.error_kind());
                        send(&s.reply, Body::Error(err));
                    }
                }
            }
            Cmd::Drain { deadline } => {
                self.drain = Some(deadline);
                self.metrics.draining.store(1, Relaxed);
            }
        }
    }

    fn open(
        &mut self,
        conn: ConnId,
        uses: ConnUse,
        open: OpenSession,
        reply: Outbox,
        next: Option<(String, Outbox)>,
        (request_id, tenant): (String, String),
    ) {
        let stage_index = open.stage_index;
        let refuse = |me: &Self, kind, msg: String| me.error_to(&reply, &open.session_id, kind, stage_index, msg);
        if self.drain.is_some() {
            return refuse(self, ErrorKind::ShuttingDown, "the worker is shutting down".into());
        }
        let (id, dtype) = match check_open(&open, &self.schema, &self.cfg.seam_dtypes) {
            Ok(v) => v,
            Err(e) => return refuse(self, e.kind(), e.to_string()),
        };
        if self.sessions.contains_key(&id) {
            return refuse(self, ErrorKind::BadFrame, "a session with this id is already open".into());
        }
        // The part of our layers the session runs (check_open found it inside them).
        let layers = open.schema.as_ref().map_or(0..0, |s| s.layer_start as usize..s.layer_end as usize);
        let (first, last) = (layers.start == 0, layers.end == self.stage.config().n_layers);
        if open.next.is_empty() != last || (open.ring.is_some() && !first && !last) {
            return refuse(self, ErrorKind::BadFrame, "the route's next hop does not fit this stage's place".into());
        }
        // A ring's last stage sends to the first stage's connection (`next`), or to itself.
        let (next, ring_out) = match (&open.ring, last) {
            (Some(r), true) if first == r.to.is_empty() && first == next.is_none() => {
                (None, Some(RingOut::new(r, next.map(|(_, tx)| tx), open.max_positions)))
            }
            (Some(_), true) => return refuse(self, ErrorKind::BadFrame, "a ring's last stage without its first stage's connection".into()),
            _ => (next, None),
        };
        let ring_in = open.ring.as_ref().filter(|_| first).map(|r| RingIn::new(r, open.max_positions));
        let want = open.max_positions as usize;
        if want == 0 || want > self.stage.config().context {
            return refuse(self, ErrorKind::BadInput, format!("{want} positions (the model holds 1..={})", self.stage.config().context));
        }
        // The budget is in positions over all our layers; a session over fewer layers costs less.
        let (cost, budget) = (want * layers.len(), self.cfg.kv_budget_tokens * self.stage.layers().len());
        if self.sessions.len() >= self.cfg.max_sessions || self.reserved + cost > budget {
            let msg = format!(
                "no room: the session wants {want} KV positions × {} layers; {} of {budget} are reserved by {} sessions (at most {})",
                layers.len(),
                self.reserved,
                self.sessions.len(),
                self.cfg.max_sessions
            );
            return refuse(self, ErrorKind::Overloaded, msg);
        }
        // An embedding pools on the last stage, as the session asks or the model's metadata says.
        let pooler = match open.embed.map(|e| e.pooling()) {
            Some(asked) if last => {
                let pooling = match asked {
                    dgr_proto::Pooling::Model => self.stage.config().pooling,
                    dgr_proto::Pooling::Mean => Pooling::Mean,
                    dgr_proto::Pooling::Cls => Pooling::Cls,
                    dgr_proto::Pooling::Last => Pooling::Last,
                };
                match Pooler::new(pooling, self.stage.config().hidden) {
                    Ok(p) => Some(p),
                    Err(e @ EngineError::Unsupported(_)) => return refuse(self, ErrorKind::Unsupported, e.to_string()),
                    Err(e) => return refuse(self, ErrorKind::Internal, e.to_string()),
                }
            }
            _ => None,
        };
        let chain = match check_prefix_blocks(&open.prefix_blocks, open.max_positions) {
            Ok(c) => c,
            Err(e) => return refuse(self, e.kind(), e.to_string()),
        };
        let kv = match self.stage.new_state(want, layers.clone()) {
            Ok(kv) => kv,
            Err(e) => return refuse(self, ErrorKind::SchemaMismatch, e.to_string()),
        };
        // Sliding-window layers keep too little to copy a prefix out of: such a stage caches nothing.
        // An embedding pools every prompt row on the last stage, so it attaches nothing.
        let namer = (self.prefix.enabled() && kv.blockable() && open.embed.is_none()).then(|| {
            let engine = self.stage.id().to_string();
            let span = (layers.start as u32, layers.end as u32);
            (prefix::stage_salt(&self.model_id, span, &engine, dtype.name()), tenant)
        });
        let keys = namer.as_ref().map_or_else(Vec::new, |(salt, tenant)| prefix::keys(salt, tenant, &chain));
        let routes = namer.as_ref().map_or_else(Vec::new, |(_, tenant)| prefix::route_digests(tenant, &chain));
        let pinned = self.prefix.pin(&keys);
        let sampling = open.sampling.unwrap_or_default();
        let session = Session {
            id,
            driver: conn,
            _driver_hold: uses.hold(),
            feed: None,
            reply: reply.clone(),
            next,
            kv,
            first,
            last,
            dtype,
            stage_index,
            sampling: SamplingParams {
                temperature: sampling.temperature,
                top_k: sampling.top_k as usize,
                top_p: if sampling.top_p > 0.0 { sampling.top_p } else { 1.0 },
                seed: sampling.seed,
            },
            top_logprobs: (open.top_logprobs as usize).min(64),
            reserved: cost,
            pending: VecDeque::new(),
            last_active: Instant::now(),
            usage: Usage { session_id: id.to_vec(), stage: stage_index, ..Default::default() },
            request_id,
            hash_rows: open.hash_rows,
            carry: Vec::new(),
            row_time: None,
            decoding: false,
            embedding: open.embed.is_some(),
            pooler,
            prefix: keys,
            routes,
            namer,
            pinned,
            remembered: 0,
            fresh: true,
            floor: None,
            ring_out,
            ring_in,
        };
        self.reserved += cost;
        self.sessions.insert(id, session);
        self.metrics.sessions_opened.fetch_add(1, Relaxed);
        // Published before the reply, so whoever reads /metrics after Opened counts this session,
        // and before the session is named to the trackers as opened: a heartbeat that names it
        // holds its reservation (`Metrics::opened` orders the stores before the naming).
        self.publish_reserved();
        self.metrics.opened(&id, Instant::now());
        send(&reply, Body::Opened(SessionRef { session_id: id.to_vec(), cached_blocks: pinned as u32, ..Default::default() }));
    }

    fn forward(&mut self, mut f: Forward, recv_us: u64, at: Instant, reply: Outbox, (conn, uses): (ConnId, ConnUse)) {
        let me = STAGE_UNKNOWN;
        let id = match session_id(&f.session_id) {
            Ok(id) => id,
            Err(e) => return self.error_to(&reply, &f.session_id, ErrorKind::BadFrame, me, e.to_string()),
        };
        let hidden = self.stage.config().hidden;
        let max_rows = self.stage.config().context;
        let Some(s) = self.sessions.get_mut(&id) else {
            // A ring's token may go round once more while its driver closes the session.
            if f.ring {
                return;
            }
            return self.error_to(&reply, &id, ErrorKind::UnknownSession, me, "no such session on this stage");
        };
        let stage_index = s.stage_index;
        let nonfinite = &self.metrics.nonfinite_frames;
        // A ring's token comes back to its first stage, which makes it the next step.
        let ringed = match (f.ring, s.ring_in.as_mut()) {
            (false, _) => Ok(()),
            (true, Some(r)) => r.step(&mut f, at, self.load.share(at)).map_err(|m| (ErrorKind::BadInput, m)),
            (true, None) => Err((ErrorKind::BadFrame, "a ring's token for a session this stage does not start".into())),
        };
        // A session's first rows may start past the prefix it was told is cached here.
        let attached = ringed.and_then(|()| if s.fresh { Self::attach(&mut self.prefix, &self.metrics, s, f.position) } else { Ok(()) });
        let checked = attached
            .and_then(|()| {
                check_forward(&f, s.first, hidden, s.dtype, max_rows).map_err(|e| {
                    if matches!(e, ProtoError::NonFinite { .. }) {
                        nonfinite.fetch_add(1, Relaxed);
                    }
                    (e.kind(), e.to_string())
                })
            })
            .and_then(|rows| {
                let waiting = s.pending.iter().map(|p| p.rows - p.done).sum::<usize>();
                let expected = s.kv.positions() + waiting;
                let position = f.position as usize;
                // The session's next frame after a speculative step starts past the drafts
                // accepted: the others' positions are dropped here as the last stage dropped them.
                let rollback = waiting == 0 && position < expected && s.floor.is_some_and(|floor| position >= floor);
                let past_prompt = s.decoding || s.pending.back().is_some_and(|p| p.f.sample);
                if rollback {
                    s.kv.truncate(position).map_err(|e| (ErrorKind::BadInput, e.to_string()))?;
                }
                if position != s.kv.positions() + waiting {
                    Err((ErrorKind::BadInput, format!("rows at position {} but the session is at {expected}", f.position)))
                } else if s.embedding && past_prompt {
                    Err((ErrorKind::BadInput, "an embedding session takes rows only up to the end of its prompt".into()))
                } else if (past_prompt && rows != f.draft.len() + 1) || (!past_prompt && !f.draft.is_empty()) {
                    Err((ErrorKind::BadInput, "past its prompt a frame holds one token and its drafts; before, no drafts".into()))
                } else if s.pending.len() >= MAX_PENDING {
                    Err((ErrorKind::Overloaded, format!("more than {MAX_PENDING} frames waiting")))
                } else {
                    Ok(rows)
                }
            });
        match checked {
            Ok(rows) => {
                if f.ring {
                    self.metrics.ring_steps.fetch_add(1, Relaxed);
                }
                s.floor = None;
                s.last_active = Instant::now();
                if s.feed.as_ref().map(|(c, _)| *c) != Some(conn) {
                    s.feed = Some((conn, uses.hold()));
                }
                s.pending.push_back(Pending { f, rows, done: 0, recv_us, at });
            }
            Err((kind, msg)) => {
                // The frame's sender hears why; the session cannot go on with a gap in it.
                self.error_to(&reply, &id, kind, stage_index, msg.clone());
                if let Some(s) = self.remove(&id) {
                    if !s.reply.same_channel(&reply) {
                        // Counted once, above.
                        send(&s.reply, Body::Error(ErrorMsg::new(&id, kind, stage_index, msg)));
                    }
                }
            }
        }
    }

    /// A session's first forward, at `position`: copies the `position / PREFIX_BLOCK` cached
    /// blocks it starts past into its KV (they were pinned for it at open), and unpins them all.
    fn attach(cache: &mut PrefixCache, metrics: &Metrics, s: &mut Session<E::State>, position: u64) -> Result<(), (ErrorKind, String)> {
        s.fresh = false;
        let pinned = std::mem::take(&mut s.pinned);
        let p = position as usize;
        let blocks = p / PREFIX_BLOCK;
        let result = if !p.is_multiple_of(PREFIX_BLOCK) || blocks > pinned {
            Err((
                ErrorKind::BadInput,
                format!("a first forward at position {position}: not a multiple of {PREFIX_BLOCK} within the {pinned} blocks cached here"),
            ))
        } else {
            s.prefix[..blocks].iter().try_for_each(|k| {
                let block = cache.get(k).ok_or((ErrorKind::Internal, "a pinned prefix block is gone".to_string()))?;
                s.kv.write_block(PREFIX_BLOCK, block).map_err(|e| (ErrorKind::BadInput, e.to_string()))
            })
        };
        cache.unpin(&s.prefix[..pinned]);
        if result.is_ok() {
            metrics.prefix_hit_blocks.fetch_add(blocks as u64, Relaxed);
            metrics.prefix_miss_blocks.fetch_add((s.prefix.len() - blocks) as u64, Relaxed);
        }
        result
    }

    /// Copies each block of the session's prefix that its KV now holds and the cache lacks into
    /// the cache, in order: one it cannot take ends the chain there.
    fn remember(cache: &mut PrefixCache, s: &mut Session<E::State>) {
        while s.remembered < s.prefix.len() && (s.remembered + 1) * PREFIX_BLOCK <= s.kv.positions() {
            let i = s.remembered;
            if !cache.contains(&s.prefix[i]) {
                let parent = i.checked_sub(1).map(|j| s.prefix[j]);
                let taken =
                    s.kv.read_block(i * PREFIX_BLOCK, PREFIX_BLOCK).is_some_and(|kv| cache.insert(s.prefix[i], s.routes[i], parent, kv));
                if !taken {
                    s.remembered = s.prefix.len();
                    return;
                }
            }
            s.remembered += 1;
        }
    }

    /// Names the session's blocks by the chain of its whole sequence (sent with its close),
    /// when the chain is well formed and the session is cached at all.
    fn rename(cache: &mut PrefixCache, s: &mut Session<E::State>, blocks: &[Vec<u8>]) {
        let (Some((salt, tenant)), Ok(chain)) = (&s.namer, check_prefix_blocks(blocks, s.kv.capacity() as u64)) else { return };
        cache.unpin(&s.prefix[..std::mem::take(&mut s.pinned)]);
        s.prefix = prefix::keys(salt, tenant, &chain);
        s.routes = prefix::route_digests(tenant, &chain);
        s.remembered = 0;
    }

    fn key(&self, s: &Session<E::State>, phase: Phase) -> CompatKey {
        CompatKey {
            engine: self.stage.id(),
            model_id: self.model_id.clone(),
            layers: (s.kv.layers().start as u32, s.kv.layers().end as u32),
            phase,
            hidden: self.schema.hidden,
            seam_dtype: s.dtype,
        }
    }

    /// Sessions past their prompts.
    fn decoding(&self) -> usize {
        self.sessions.values().filter(|s| s.decoding).count()
    }

    /// How much longer to wait before stepping: while fewer decode rows wait than a micro-batch
    /// should hold, frames are still arriving (the last came less than `ARRIVAL_GAP` ago), and
    /// the oldest has waited less than `batch_wait`. None: step now. Sessions that are busy on
    /// another stage are not waited for: their frames do not arrive in the gap. Times count
    /// from the end of the last step at the earliest: rows that arrived during a step could not
    /// have joined it.
    fn hold(&self) -> Option<Duration> {
        const ARRIVAL_GAP: Duration = Duration::from_micros(300);
        let waiting: Vec<&Session<E::State>> = self.sessions.values().filter(|s| !s.pending.is_empty()).collect();
        if waiting.iter().any(|s| s.phase() == Phase::Prefill) {
            return None;
        }
        let since = |t: Instant| t.max(self.last_step_end).elapsed();
        let oldest = waiting.iter().filter_map(|s| s.pending.front()).map(|p| p.at).min()?;
        if waiting.len() >= self.policy.decode_target(self.decoding()) {
            return None;
        }
        let budget = self.policy.batch_wait.checked_sub(since(oldest))?;
        let gap = ARRIVAL_GAP.checked_sub(since(self.last_arrival))?;
        Some(budget.min(gap)).filter(|d| !d.is_zero())
    }

    /// One scheduler step: plan it, then one forward per batch.
    fn step(&mut self) {
        let ready: Vec<Ready> = self
            .sessions
            .values()
            .filter_map(|s| {
                let p = s.pending.front()?;
                let fit = self.policy.fit(s.row_time);
                Some(Ready { id: s.id, key: self.key(s, s.phase()), rows: p.rows, rows_left: p.rows - p.done, fit, since: p.at })
            })
            .collect();
        if ready.is_empty() {
            return;
        }
        let batches = plan(ready, self.decoding(), &self.policy);
        self.note_busy_chunk(&batches);
        for batch in batches {
            self.run_batch(batch);
        }
        self.last_step_end = Instant::now();
    }

    /// Counts the largest chunk of a long prompt in a step that also decodes.
    fn note_busy_chunk(&self, batches: &[Batch]) {
        if !batches.iter().any(|b| b.key.phase == Phase::Decode) {
            return;
        }
        let long =
            |id: &SessionId| self.sessions.get(id).and_then(|s| s.pending.front()).is_some_and(|p| p.rows > self.policy.whole_prompt);
        let prefill = batches.iter().filter(|b| b.key.phase == Phase::Prefill).flat_map(|b| &b.items);
        if let Some(n) = prefill.filter(|(id, _)| long(id)).map(|&(_, n)| n).max() {
            self.metrics.busy_chunk_rows_max.fetch_max(n as u64, Relaxed);
        }
    }

    /// Runs `rows` of the first waiting frame of each session in `batch` as one forward, and
    /// passes each result on: hidden rows to the next stage, or a sampled token to the driver.
    fn run_batch(&mut self, batch: Batch) {
        let mut chosen: Vec<(Session<E::State>, usize)> =
            batch.items.iter().filter_map(|&(id, n)| self.sessions.remove(&id).map(|s| (s, n))).collect();
        let started = Instant::now();
        let h = self.stage.config().hidden;
        // This chunk's rows of each session's first waiting frame, as the stage takes them.
        let hidden: Vec<Vec<f32>> = chosen
            .iter()
            .map(|(s, n)| {
                let p = &s.pending[0];
                if s.first {
                    Vec::new()
                } else {
                    let row = h * s.dtype.size();
                    dgr_proto::decode_rows(&p.f.hidden[p.done * row..(p.done + n) * row], s.dtype)
                }
            })
            .collect();
        let tokens: Vec<Vec<u32>> = chosen
            .iter()
            .map(|(s, n)| if s.first { s.pending[0].f.tokens[s.pending[0].done..s.pending[0].done + n].to_vec() } else { Vec::new() })
            .collect();
        let wants: Vec<bool> = chosen.iter().map(|(s, n)| s.pending[0].done + n == s.pending[0].rows && s.pending[0].f.sample).collect();
        let mut seqs: Vec<SeqInput<E::State>> = Vec::with_capacity(chosen.len());
        let mut bad: Vec<(usize, String)> = Vec::new();
        // The sequences borrow each session's KV mutably, nothing else.
        for (i, (s, _)) in chosen.iter_mut().enumerate() {
            let input = if s.first { Input::Tokens(&tokens[i]) } else { Input::Hidden(&hidden[i]) };
            let logits = match (s.last, s.pooler.is_some(), wants[i]) {
                (true, true, _) => LogitRows::Normed,
                // A speculative step samples every row (it runs whole: one row and its drafts).
                (true, false, true) if !s.pending[0].f.draft.is_empty() => LogitRows::All,
                (true, false, true) => LogitRows::Last,
                _ => LogitRows::None,
            };
            let seq = SeqInput { kv: &mut s.kv, input, logits };
            match self.stage.check(&seq) {
                Ok(_) => seqs.push(seq),
                Err(e) => bad.push((i, e.to_string())),
            }
        }
        #[cfg(feature = "fault-injection")]
        if crate::fault::lose_device_at() == Some(self.metrics.steps.load(Relaxed)) {
            self.stage.lose_device();
        }
        let result = self.stage.forward(&mut seqs);
        drop(seqs);
        let compute_us = started.elapsed().as_micros() as u64;
        let is_bad = |i: usize| bad.iter().find(|(b, _)| *b == i).map(|(_, m)| m.clone());
        let rows: usize = chosen.iter().enumerate().filter(|(i, _)| is_bad(*i).is_none()).map(|(_, (_, n))| n).sum();
        let m = &self.metrics;
        m.steps.fetch_add(1, Relaxed);
        m.step_rows.fetch_add(rows as u64, Relaxed);
        m.step_micros.fetch_add(compute_us, Relaxed);
        self.load.step(Duration::from_micros(compute_us), Instant::now());
        m.last_batch_sessions.store((chosen.len() - bad.len()) as u64, Relaxed);
        m.batch(batch.key.phase, batch.key.seam_dtype, chosen.len() - bad.len());
        let mut outputs = match result {
            Ok(o) => o.into_iter(),
            Err(EngineError::Device(why)) => {
                // The GPU is gone (or failed): this stage computes nothing more. Every session
                // ends (`run` ends them all), so their drivers replay them elsewhere.
                for (s, _) in chosen {
                    self.end(s, Some((ErrorKind::DeviceLost, why.clone())));
                }
                self.lost = Some(why);
                return;
            }
            Err(e) => {
                // Checked per sequence above, so this is a bug; fail the batch rather than guess.
                for (s, _) in chosen {
                    self.end(s, Some((ErrorKind::Internal, e.to_string())));
                }
                return;
            }
        };
        let mut rounds = Vec::new();
        for (i, (mut s, n)) in chosen.into_iter().enumerate() {
            if let Some(msg) = is_bad(i) {
                self.end(s, Some((ErrorKind::BadInput, msg)));
                continue;
            }
            #[allow(unused_mut)]
            let mut out = outputs.next().unwrap_or_default();
            #[cfg(feature = "fault-injection")]
            crate::fault::corrupt(&mut out.hidden);
            let h = self.stage.config().hidden;
            let last_row_hash = match (s.hash_rows, s.next.is_some(), wants[i]) {
                (false, _, _) => 0,
                (true, true, _) => row_hash(&out.hidden[(n - 1) * h..n * h]),
                (true, false, true) => row_hash(&out.logits),
                (true, false, false) => 0,
            };
            let prefill = batch.key.phase == Phase::Prefill;
            let counter = if prefill { &self.metrics.tokens_prefilled } else { &self.metrics.tokens_decoded };
            counter.fetch_add(n as u64, Relaxed);
            if prefill {
                s.row_time = Some(Duration::from_micros(compute_us) / rows.max(1) as u32);
                s.usage.tokens_prefilled += n as u64;
            } else {
                s.usage.tokens_decoded += n as u64;
            }
            s.usage.layer_tokens += (n * s.kv.layers().len()) as u64;
            let p = &mut s.pending[0];
            let chunk_start = p.f.position + p.done as u64;
            // The frame's trace travels on with its first chunk only, so no hop is counted twice.
            let mut trace = if p.done == 0 { std::mem::take(&mut p.f.trace) } else { Vec::new() };
            p.done += n;
            let finished = p.done == p.rows;
            let prompt_done = finished && p.f.sample;
            let hop = Hop {
                stage: s.stage_index,
                queue_us: started.duration_since(p.at).as_micros() as u64,
                compute_us,
                bytes_out: 0,
                recv_unix_us: p.recv_us,
                sent_unix_us: 0,
                last_row_hash,
                last_row_position: chunk_start + n as u64 - 1,
            };
            // The grammar's mask and the drafts travel with the chunk that samples.
            let allowed = if wants[i] { std::mem::take(&mut p.f.allowed) } else { Vec::new() };
            let draft = if wants[i] { std::mem::take(&mut p.f.draft) } else { Vec::new() };
            if let Some(pooler) = s.pooler.as_mut() {
                pooler.push(&out.hidden);
            }
            // The end of an embedding's prompt: its vector instead of a token.
            let pooled = if wants[i] { s.pooler.take() } else { None };
            let delivered = if let Some(pooler) = pooled {
                s.carry.append(&mut trace);
                s.carry.push(Hop { sent_unix_us: unix_us(), ..hop });
                let n_tokens = pooler.rows() as u64;
                let values = pooler.finish().iter().flat_map(|v| v.to_le_bytes()).collect();
                let e = Embedding { session_id: s.id.to_vec(), values, n_tokens, trace: std::mem::take(&mut s.carry) };
                self.metrics.embeddings.fetch_add(1, Relaxed);
                send(&s.reply, Body::Embedding(e))
            } else {
                match &s.next {
                    Some((_, next)) => {
                        let bytes = dgr_proto::encode_rows(&out.hidden, s.dtype);
                        trace.push(Hop { bytes_out: bytes.len() as u64, sent_unix_us: unix_us(), ..hop });
                        // Until its next frame says how many drafts the last stage accepted.
                        s.floor = (!draft.is_empty()).then(|| s.kv.positions() - draft.len());
                        let f = Forward {
                            session_id: s.id.to_vec(),
                            position: chunk_start,
                            tokens: Vec::new(),
                            hidden: bytes,
                            dtype: s.dtype as i32,
                            n_rows: n as u32,
                            sample: wants[i],
                            trace,
                            allowed,
                            draft,
                            ..Default::default()
                        };
                        send(next, Body::Forward(f))
                    }
                    None if wants[i] => {
                        let drawn = match self.draw(&mut s, &mut out.logits, &allowed, &draft) {
                            Ok(d) => d,
                            Err(e) => {
                                self.end(s, Some(e));
                                continue;
                            }
                        };
                        s.carry.append(&mut trace);
                        s.carry.push(Hop { sent_unix_us: unix_us(), ..hop });
                        let trace = std::mem::take(&mut s.carry);
                        let round = s.ring_out.as_ref().and_then(|r| {
                            let compute_us = trace.iter().map(|h| h.compute_us).sum();
                            Some((r.to.clone(), r.next(&s.id, &drawn, compute_us)?))
                        });
                        let mut drawn = drawn.into_iter();
                        let first = drawn.next().unwrap_or_default();
                        let t = TokenOut {
                            session_id: s.id.to_vec(),
                            position: first.position,
                            token: first.token,
                            logprob: first.logprob,
                            top: first.top,
                            trace,
                            more: drawn.collect(),
                            drafted: draft.len() as u32,
                        };
                        send(&s.reply, Body::Token(t))
                            && match round {
                                None => true,
                                Some((Some(to), f)) => send(&to, Body::Forward(f)),
                                // Stage 0 too: the step is queued here once the session is back.
                                Some((None, f)) => {
                                    rounds.push(f);
                                    true
                                }
                            }
                    }
                    // A prompt chunk through the whole route: the driver's step deadline restarts.
                    None => {
                        s.carry.append(&mut trace);
                        s.carry.push(Hop { sent_unix_us: unix_us(), ..hop });
                        send(&s.reply, Body::Progress(Progress { session_id: s.id.to_vec(), positions: s.kv.positions() as u64 }))
                    }
                }
            };
            if finished {
                s.decoding |= prompt_done;
                s.pending.pop_front();
            }
            Self::remember(&mut self.prefix, &mut s);
            if delivered {
                s.last_active = Instant::now();
                self.sessions.insert(s.id, s);
            } else {
                let kind = if s.next.is_some() || s.ring_out.as_ref().is_some_and(|r| r.to.is_some()) {
                    ErrorKind::NextStage
                } else {
                    ErrorKind::Overloaded
                };
                self.end(s, Some((kind, "could not pass the step on: the receiver is gone or not reading".into())));
            }
        }
        // A one-stage ring's next steps, as if they had arrived from its driver.
        for f in rounds {
            let Some((reply, conn)) =
                session_id(&f.session_id).ok().and_then(|id| self.sessions.get(&id)).map(|s| (s.reply.clone(), s.driver))
            else {
                continue;
            };
            self.forward(f, unix_us(), Instant::now(), reply, (conn, ConnUse::default()));
        }
    }

    /// The tokens a step that asked for one gives, from its rows' logits (`logits`: the last
    /// row's, or with drafts every row's): the one token sampled under the step's mask, or the
    /// accepted drafts and the token after them, each with its log-probabilities. The rejected
    /// drafts' positions leave the session's KV at once.
    fn draw(
        &self,
        s: &mut Session<E::State>,
        logits: &mut [f32],
        allowed: &[u8],
        draft: &[u32],
    ) -> Result<Vec<Sampled>, (ErrorKind, String)> {
        let vocab = self.stage.config().vocab;
        if logits.len() != (draft.len() + 1) * vocab {
            return Err((ErrorKind::Internal, format!("{} logits for a step of {} drafts", logits.len(), draft.len())));
        }
        dgr_engine::mask_logits(logits, allowed).map_err(|e| (ErrorKind::BadInput, e.to_string()))?;
        // The token sampled from the first row takes the position after that row's.
        let first = (s.kv.positions() - draft.len()) as u64;
        let tokens = dgr_engine::accept(logits, vocab, draft, &s.sampling, first);
        if !draft.is_empty() {
            let accepted = tokens.len() - 1;
            s.kv.truncate(first as usize + accepted).map_err(|e| (ErrorKind::Internal, e.to_string()))?;
            self.metrics.verify_steps.fetch_add(1, Relaxed);
            self.metrics.drafts_accepted.fetch_add(accepted as u64, Relaxed);
            self.metrics.drafts_rejected.fetch_add((draft.len() - accepted) as u64, Relaxed);
        }
        Ok(tokens
            .iter()
            .enumerate()
            .map(|(r, &token)| {
                let (logprob, top) = dgr_engine::logprobs(&logits[r * vocab..(r + 1) * vocab], token, s.top_logprobs);
                let top = top.into_iter().map(|(id, logprob)| TopEntry { id, logprob }).collect();
                Sampled { position: first + r as u64, token, logprob, top }
            })
            .collect())
    }

    /// Frees sessions idle past the timeout.
    fn sweep(&mut self) {
        let timeout = self.cfg.idle_timeout;
        let idle: Vec<SessionId> = self.sessions.values().filter(|s| s.last_active.elapsed() > timeout).map(|s| s.id).collect();
        for id in idle {
            self.fail(&id, ErrorKind::Cancelled, "idle past the session timeout");
        }
    }

    /// The open sessions and what they reserved.
    fn publish_reserved(&self) {
        let m = &self.metrics;
        m.sessions_open.store(self.sessions.len() as u64, Relaxed);
        // `reserved` counts positions × layers; a session over fewer layers reserves less.
        m.kv_tokens_reserved.store(self.reserved.div_ceil(self.stage.layers().len().max(1)) as u64, Relaxed);
    }

    fn publish(&mut self) {
        self.publish_reserved();
        let m = &self.metrics;
        m.kv_tokens_used.store(self.sessions.values().map(|s| s.kv.positions() as u64).sum(), Relaxed);
        m.kv_bytes_used.store(self.sessions.values().map(|s| s.kv.bytes() as u64).sum(), Relaxed);
        m.queue_depth.store(self.sessions.values().map(|s| s.pending.len() as u64).sum(), Relaxed);
        m.prefix_blocks.store(self.prefix.blocks() as u64, Relaxed);
        m.prefix_bytes.store(self.prefix.bytes() as u64, Relaxed);
        self.publish_held();
        self.publish_device_memory();
    }

    /// The device's memory, for /metrics: read at most once a second (the allocator's report
    /// lists every allocation).
    fn publish_device_memory(&mut self) {
        if self.memory_read.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            return;
        }
        self.memory_read = Some(Instant::now());
        if let Some(m) = self.stage.device_memory() {
            *self.metrics.device_memory.lock().unwrap_or_else(|p| p.into_inner()) = Some(m);
        }
    }

    /// Hands the heartbeats the route digests of the blocks held, when they changed and at most
    /// every `HELD_EVERY` (listing them is a pass over the cache).
    fn publish_held(&mut self) {
        const HELD_EVERY: Duration = Duration::from_millis(100);
        let changes = self.prefix.changes();
        if changes == self.held.0 || self.held.1.elapsed() < HELD_EVERY {
            return;
        }
        self.held = (changes, Instant::now());
        self.metrics.set_held(self.prefix.recent(MAX_HELD_DIGESTS));
    }
}

#[cfg(test)]
mod prefix_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use dgr_engine::synth::SynthSpec;
    use dgr_engine::{open_engine, EngineSpec, Stage};
    use std::ops::Range;
    use tokio::sync::mpsc::{channel, Receiver as Inbox};

    /// The tests' scheduler: over the CPU engine `open_engine` gives.
    type Scheduler = super::Scheduler<Stage>;

    /// A scheduler over layers `held` of a six-layer synthetic model, with KV for `budget`
    /// positions over all of them.
    fn scheduler(held: Range<usize>, budget: usize) -> Scheduler {
        scheduler_on(SynthSpec { layers: 6, ..SynthSpec::default() }.to_gguf().unwrap(), held, budget)
    }

    /// As `scheduler`, over the model in `file`.
    fn scheduler_on(file: Vec<u8>, held: Range<usize>, budget: usize) -> Scheduler {
        scheduler_with(file, held, |cfg| cfg.kv_budget_tokens = budget)
    }

    /// A scheduler over layers `held` of the model in `file`, its config set by `set`.
    pub(super) fn scheduler_with(file: Vec<u8>, held: Range<usize>, set: impl FnOnce(&mut WorkerConfig)) -> Scheduler {
        let gguf = Arc::new(dgr_gguf::Gguf::from_bytes(file).unwrap());
        let mut cfg = WorkerConfig::new("m.gguf".into(), held.clone());
        set(&mut cfg);
        let stage =
            open_engine(gguf, held.clone(), EngineSpec { numerics: cfg.numerics, kv: cfg.kv_dtype, ..EngineSpec::threads(1) }).unwrap();
        let schema = BoundarySchema {
            protocol_version: dgr_proto::PROTOCOL_VERSION,
            model_id: "m".into(),
            layer_start: held.start as u32,
            layer_end: held.end as u32,
            hidden: stage.config().hidden as u32,
            seam_dtype: SeamDtype::F32 as i32,
            engine: stage.engine().to_string(),
        };
        Scheduler::new(stage, cfg, schema, Arc::new(Metrics::default()), None)
    }

    /// Opens session `id` over `layers`, passing its rows to `next` if given; returns the reply
    /// and the driver's inbox.
    fn open(s: &mut Scheduler, id: u8, layers: Range<u32>, positions: u64, next: Option<&Outbox>) -> (Body, Inbox<Frame>) {
        open_as(s, id, layers, positions, next, None)
    }

    /// As `open`, an embedding session when `embed` is given.
    fn open_as(
        s: &mut Scheduler,
        id: u8,
        layers: Range<u32>,
        positions: u64,
        next: Option<&Outbox>,
        embed: Option<dgr_proto::Embed>,
    ) -> (Body, Inbox<Frame>) {
        let (reply, mut inbox) = channel(8);
        let schema = BoundarySchema { layer_start: layers.start, layer_end: layers.end, ..s.schema.clone() };
        let open = OpenSession {
            session_id: vec![id; 16],
            schema: Some(schema),
            n_stages: 2,
            next: if next.is_some() { "next".into() } else { String::new() },
            max_positions: positions,
            embed,
            ..Default::default()
        };
        let next = next.map(|n| ("next".to_string(), n.clone()));
        s.handle(Cmd::Open {
            conn: 1,
            uses: ConnUse::default(),
            open: Box::new(open),
            reply,
            next,
            request_id: String::new(),
            tenant: String::new(),
        });
        (inbox.try_recv().unwrap().body.unwrap(), inbox)
    }

    fn refused(b: Body) -> ErrorKind {
        match b {
            Body::Error(e) => e.error_kind(),
            other => panic!("expected an error, got {other:?}"),
        }
    }

    fn forward(s: &mut Scheduler, f: Forward) {
        let (reply, _) = channel(1);
        s.handle(Cmd::Forward { f, recv_us: 0, at: Instant::now(), reply, conn: 1, uses: ConnUse::default() });
        s.step();
    }

    fn token(inbox: &mut Inbox<Frame>) -> TokenOut {
        match inbox.try_recv().unwrap().body.unwrap() {
            Body::Token(t) => t,
            other => panic!("expected a token, got {other:?}"),
        }
    }

    #[test]
    fn sessions_run_any_part_of_the_held_layers() {
        // 32 positions over 6 layers: room for [0,3) and [3,6) of 16 positions each, and [0,6) of 16.
        let mut s = scheduler(0..6, 32);
        let (hop, mut hop_inbox) = channel(8);
        assert_eq!(refused(open(&mut s, 9, 2..7, 16, Some(&hop)).0), ErrorKind::SchemaMismatch);
        assert_eq!(refused(open(&mut s, 9, 4..4, 16, Some(&hop)).0), ErrorKind::SchemaMismatch);
        assert_eq!(refused(open(&mut s, 9, 0..3, 16, None).0), ErrorKind::BadFrame);
        assert_eq!(refused(open(&mut s, 9, 3..6, 16, Some(&hop)).0), ErrorKind::BadFrame);
        let (front, _front_inbox) = open(&mut s, 1, 0..3, 16, Some(&hop));
        let (back, mut back_inbox) = open(&mut s, 2, 3..6, 16, None);
        let (whole, mut whole_inbox) = open(&mut s, 3, 0..6, 16, None);
        assert!([front, back, whole].iter().all(|b| matches!(b, Body::Opened(_))));
        assert_eq!(refused(open(&mut s, 9, 5..6, 1, None).0), ErrorKind::Overloaded);
        let key = |s: &Scheduler, id: u8| s.key(&s.sessions[&[id; 16]], Phase::Prefill).layers;
        assert_eq!((key(&s, 1), key(&s, 2), key(&s, 3)), ((0, 3), (3, 6), (0, 6)));

        // The prompt through [0,3) then [3,6) samples what [0,6) does, bit for bit.
        let prompt = |id: u8| Forward { session_id: vec![id; 16], tokens: vec![5, 6, 7], sample: true, ..Default::default() };
        forward(&mut s, prompt(1));
        forward(&mut s, prompt(3));
        let Body::Forward(rows) = hop_inbox.try_recv().unwrap().body.unwrap() else { panic!("expected hidden rows") };
        assert_eq!((rows.n_rows, rows.sample), (3, true));
        forward(&mut s, Forward { session_id: vec![2; 16], ..rows });
        let (split, one) = (token(&mut back_inbox), token(&mut whole_inbox));
        assert_eq!((split.position, split.token, split.logprob.to_bits()), (one.position, one.token, one.logprob.to_bits()));

        // Usage counts the session's layers; closing frees its reservation.
        let mut layer_tokens = |id: u8, inbox: &mut Inbox<Frame>| {
            s.handle(Cmd::Close { id: vec![id; 16], prefix_blocks: Vec::new(), positions: 0 });
            let Body::Usage(u) = inbox.try_recv().unwrap().body.unwrap() else { panic!("expected usage") };
            u.layer_tokens
        };
        assert_eq!((layer_tokens(2, &mut back_inbox), layer_tokens(3, &mut whole_inbox)), (9, 18));
        s.handle(Cmd::Close { id: vec![1; 16], prefix_blocks: Vec::new(), positions: 0 });
        assert_eq!(s.reserved, 0);
    }

    /// Drives session 1 through `front` [0,3) and `back` [3,6) of the synthetic model for
    /// `tokens` greedy tokens; `meddle(back, t)` runs after the rows of token `t` reach `back`,
    /// before its step. Returns each token with its logprob's bits.
    fn drive_split(tokens: usize, mut meddle: impl FnMut(&mut Scheduler, usize)) -> Vec<(u32, u32)> {
        let (mut front, mut back) = (scheduler(0..3, 64), scheduler(3..6, 64));
        let (hop, mut hop_inbox) = channel(8);
        assert!(matches!(open(&mut front, 1, 0..3, 32, Some(&hop)).0, Body::Opened(_)));
        let (opened, mut inbox) = open(&mut back, 1, 3..6, 32, None);
        assert!(matches!(opened, Body::Opened(_)));
        let mut f = Forward { session_id: vec![1; 16], tokens: vec![5, 6, 7], sample: true, ..Default::default() };
        let mut out = Vec::new();
        for t in 0..tokens {
            forward(&mut front, f);
            let Body::Forward(rows) = hop_inbox.try_recv().unwrap().body.unwrap() else { panic!("expected hidden rows") };
            let (reply, _) = channel(1);
            back.handle(Cmd::Forward { f: rows, recv_us: 0, at: Instant::now(), reply, conn: 2, uses: ConnUse::default() });
            meddle(&mut back, t);
            back.step();
            let tok = token(&mut inbox);
            out.push((tok.token, tok.logprob.to_bits()));
            f = Forward { session_id: vec![1; 16], position: tok.position, tokens: vec![tok.token], sample: true, ..Default::default() };
        }
        out
    }

    /// One step of session 1 through `front` then `back`: every token it gives, with its
    /// position and logprob's bits.
    fn split_step(
        (front, back): (&mut Scheduler, &mut Scheduler),
        hop_inbox: &mut Inbox<Frame>,
        inbox: &mut Inbox<Frame>,
        f: Forward,
    ) -> Vec<(u64, u32, u32)> {
        forward(front, f);
        let Body::Forward(rows) = hop_inbox.try_recv().unwrap().body.unwrap() else { panic!("expected hidden rows") };
        forward(back, rows);
        let t = token(inbox);
        let mut out = vec![(t.position, t.token, t.logprob.to_bits())];
        out.extend(t.more.iter().map(|m| (m.position, m.token, m.logprob.to_bits())));
        out
    }

    #[test]
    fn speculative_steps_give_the_tokens_single_steps_give_and_drop_rejected_drafts_everywhere() {
        let bits = drive_split(8, |_, _| {});
        let truth: Vec<u32> = bits.iter().map(|&(t, _)| t).collect();
        let (mut front, mut back) = (scheduler(0..3, 64), scheduler(3..6, 64));
        let (hop, mut hop_inbox) = channel(8);
        open(&mut front, 1, 0..3, 32, Some(&hop));
        let (_, mut inbox) = open(&mut back, 1, 3..6, 32, None);
        let step = |position: u64, tokens: Vec<u32>, draft: Vec<u32>| Forward {
            session_id: vec![1; 16],
            position,
            tokens,
            sample: true,
            draft,
            ..Default::default()
        };
        let mut got = split_step((&mut front, &mut back), &mut hop_inbox, &mut inbox, step(0, vec![5, 6, 7], Vec::new()));
        // Drafts of which the second is wrong: the first is kept, then the token sampled in
        // place of the second; the back stage keeps 3 + 2 positions, the front still 3 + 4.
        let wrong = truth[2] + 1;
        let draft = vec![truth[1], wrong, truth[3]];
        let tokens = [vec![truth[0]], draft.clone()].concat();
        got.extend(split_step((&mut front, &mut back), &mut hop_inbox, &mut inbox, step(3, tokens, draft)));
        assert_eq!(got.len(), 3);
        assert_eq!((back.sessions[&[1; 16]].kv.positions(), front.sessions[&[1; 16]].kv.positions()), (5, 7));
        // The next step starts at 5: the front drops the rejected draft's positions too. Every
        // draft right: three drafts and the token after them.
        let draft = truth[3..6].to_vec();
        let tokens = [vec![truth[2]], draft.clone()].concat();
        got.extend(split_step((&mut front, &mut back), &mut hop_inbox, &mut inbox, step(5, tokens, draft)));
        let want: Vec<(u64, u32, u32)> = bits[..7].iter().enumerate().map(|(i, &(t, lp))| (3 + i as u64, t, lp)).collect();
        assert_eq!(got, want, "the tokens, positions and logprobs of one-at-a-time steps");
        assert_eq!(back.metrics.verify_steps.load(Relaxed), 2);
        assert_eq!((back.metrics.drafts_accepted.load(Relaxed), back.metrics.drafts_rejected.load(Relaxed)), (4, 2));
        // Nothing below the last step's first draft is dropped: such a frame is refused.
        let (reply, mut replies) = channel(2);
        let f = step(5, vec![truth[2]], Vec::new());
        front.handle(Cmd::Forward { f, recv_us: 0, at: Instant::now(), reply, conn: 1, uses: ConnUse::default() });
        assert_eq!(refused(replies.try_recv().unwrap().body.unwrap()), ErrorKind::BadInput);
    }

    fn embed(pooling: dgr_proto::Pooling) -> Option<dgr_proto::Embed> {
        Some(dgr_proto::Embed { pooling: pooling as i32 })
    }

    /// The vector's bits, from the `Embedding` the inbox holds next (after any `Progress`).
    fn embedding(inbox: &mut Inbox<Frame>) -> Vec<u32> {
        loop {
            match inbox.try_recv().unwrap().body.unwrap() {
                Body::Progress(_) => continue,
                Body::Embedding(e) => return e.values.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
                other => panic!("expected an embedding, got {other:?}"),
            }
        }
    }

    #[test]
    fn an_embedding_has_the_same_bits_split_chunked_and_batched() {
        use dgr_proto::Pooling::{Last, Mean, Model};
        let mut s = scheduler(0..6, 128);
        let prompt = [5, 6, 7, 8, 9];
        let f = |id: u8, position: u64, tokens: &[u32], sample: bool| Forward {
            session_id: vec![id; 16],
            position,
            tokens: tokens.to_vec(),
            sample,
            ..Default::default()
        };
        let (_, mut whole) = open_as(&mut s, 1, 0..6, 5, None, embed(Model));
        forward(&mut s, f(1, 0, &prompt, true));
        let want = embedding(&mut whole);
        assert_eq!(want.len(), s.stage.config().hidden);
        let norm: f64 = want.iter().map(|&b| (f32::from_bits(b) as f64).powi(2)).sum();
        assert!((norm - 1.0).abs() < 1e-5, "|v|² = {norm}");
        // Mean is the synthetic model's own pooling (it names none); last differs.
        let (_, mut mean) = open_as(&mut s, 2, 0..6, 5, None, embed(Mean));
        forward(&mut s, f(2, 0, &prompt, true));
        assert_eq!(embedding(&mut mean), want);
        let (_, mut last) = open_as(&mut s, 3, 0..6, 5, None, embed(Last));
        forward(&mut s, f(3, 0, &prompt, true));
        assert_ne!(embedding(&mut last), want);

        // In two chunks: a Progress, then the same vector.
        let (_, mut chunked) = open_as(&mut s, 4, 0..6, 5, None, embed(Model));
        forward(&mut s, f(4, 0, &prompt[..2], false));
        assert!(matches!(chunked.try_recv().unwrap().body.unwrap(), Body::Progress(_)));
        forward(&mut s, f(4, 2, &prompt[2..], true));
        assert_eq!(embedding(&mut chunked), want);

        // Through [0,3) then [3,6).
        let (hop, mut hop_inbox) = channel(8);
        open_as(&mut s, 5, 0..3, 5, Some(&hop), embed(Model));
        let (_, mut back) = open_as(&mut s, 6, 3..6, 5, None, embed(Model));
        forward(&mut s, f(5, 0, &prompt, true));
        let Body::Forward(rows) = hop_inbox.try_recv().unwrap().body.unwrap() else { panic!("expected hidden rows") };
        forward(&mut s, Forward { session_id: vec![6; 16], ..rows });
        assert_eq!(embedding(&mut back), want);

        // In one forward with a generation's prompt: each gets what it gets alone.
        let (_, mut solo) = open(&mut s, 7, 0..6, 8, None);
        forward(&mut s, f(7, 0, &[9, 3, 4], true));
        let alone = token(&mut solo);
        let (_, mut generating) = open(&mut s, 8, 0..6, 8, None);
        let (_, mut embedding_beside) = open_as(&mut s, 9, 0..6, 5, None, embed(Model));
        let (reply, _) = channel(4);
        for frame in [f(8, 0, &[9, 3, 4], true), f(9, 0, &prompt, true)] {
            s.handle(Cmd::Forward { f: frame, recv_us: 0, at: Instant::now(), reply: reply.clone(), conn: 1, uses: ConnUse::default() });
        }
        s.step();
        assert_eq!(s.metrics.last_batch_sessions.load(Relaxed), 2, "both prompts ran in one forward");
        let beside = token(&mut generating);
        assert_eq!((beside.token, beside.logprob.to_bits()), (alone.token, alone.logprob.to_bits()));
        assert_eq!(embedding(&mut embedding_beside), want);
        assert_eq!(s.metrics.embeddings.load(Relaxed), 6);

        // An embedding takes nothing past its prompt.
        let (reply, mut replies) = channel(4);
        let more = f(1, 5, &[1], true);
        s.handle(Cmd::Forward { f: more, recv_us: 0, at: Instant::now(), reply, conn: 1, uses: ConnUse::default() });
        assert_eq!(refused(replies.try_recv().unwrap().body.unwrap()), ErrorKind::BadInput);
    }

    #[test]
    fn embedding_opens_refuse_unknown_poolings_and_rank_models() {
        let mut s = scheduler(0..6, 64);
        for (layers, next) in [(0..6, None), (0..3, Some(&channel(1).0))] {
            let bad = Some(dgr_proto::Embed { pooling: 9 });
            assert_eq!(refused(open_as(&mut s, 1, layers, 8, next, bad).0), ErrorKind::BadInput);
        }
        // A rank-pooled model (a classifier) generates, but does not embed.
        let mut w = SynthSpec { layers: 6, ..SynthSpec::default() }.writer().unwrap();
        w.add_metadata("llama.pooling_type", dgr_gguf::Value::U32(4)).unwrap();
        let mut rank = scheduler_on(w.to_bytes(), 0..6, 64);
        assert_eq!(refused(open_as(&mut rank, 1, 0..6, 8, None, embed(dgr_proto::Pooling::Model)).0), ErrorKind::Unsupported);
        assert!(matches!(open_as(&mut rank, 2, 0..6, 8, None, embed(dgr_proto::Pooling::Last)).0, Body::Opened(_)));
        assert!(matches!(open(&mut rank, 3, 0..6, 8, None).0, Body::Opened(_)));
    }

    #[test]
    fn non_finite_rows_fail_only_their_session() {
        let solo = drive_split(4, |_, _| {});
        let mut heard = Vec::new();
        let alongside = drive_split(4, |back, t| {
            if t != 1 {
                return;
            }
            // Session 9 opens beside session 1 and sends a NaN at column 7 of its second row, in
            // the step where session 1 decodes.
            let (opened, mut driver) = open(back, 9, 3..6, 16, None);
            assert!(matches!(opened, Body::Opened(_)));
            let hidden = back.stage.config().hidden;
            let mut rows = vec![0.25f32; 2 * hidden];
            rows[hidden + 7] = f32::NAN;
            let f = Forward {
                session_id: vec![9; 16],
                hidden: dgr_proto::encode_rows(&rows, SeamDtype::F32),
                dtype: SeamDtype::F32 as i32,
                n_rows: 2,
                sample: true,
                ..Default::default()
            };
            let (reply, mut sender) = channel(4);
            let uses = ConnUse::default();
            back.handle(Cmd::Forward { f, recv_us: 0, at: Instant::now(), reply, conn: 3, uses: uses.clone() });
            for inbox in [&mut sender, &mut driver] {
                match inbox.try_recv().unwrap().body.unwrap() {
                    Body::Error(e) => {
                        assert_eq!((e.error_kind(), e.session_id.as_slice()), (ErrorKind::BadInput, &[9u8; 16][..]));
                        assert!(e.message.contains("non-finite activations at row 1"), "{}", e.message);
                        heard.push(e.message);
                    }
                    other => panic!("expected an error, got {other:?}"),
                }
            }
            assert!(!back.sessions.contains_key(&[9; 16]) && !uses.in_use(), "the failed session is freed");
            let m = back.metrics.render();
            assert!(m.contains("dgr_worker_nonfinite_frames_total 1\n"), "{m}");
            assert!(m.contains("dgr_worker_failures_total{kind=\"bad_input\"} 1\n"), "{m}");
        });
        assert_eq!(heard.len(), 2, "the sender and the driver each hear the error once");
        assert_eq!(alongside, solo, "session 1 beside the bad rows differs from its solo run");
    }

    #[test]
    fn sessions_hold_the_connections_they_use() {
        let mut s = scheduler(3..6, 64);
        let (driver, feeder, other) = (ConnUse::default(), ConnUse::default(), ConnUse::default());
        let (reply, _inbox) = channel(8);
        let schema = BoundarySchema { layer_start: 3, layer_end: 6, ..s.schema.clone() };
        let open = OpenSession {
            session_id: vec![1; 16],
            schema: Some(schema),
            n_stages: 2,
            stage_index: 1,
            max_positions: 8,
            ..Default::default()
        };
        s.handle(Cmd::Open {
            conn: 1,
            uses: driver.clone(),
            open: Box::new(open),
            reply: reply.clone(),
            next: None,
            request_id: String::new(),
            tenant: String::new(),
        });
        assert!(driver.in_use() && !feeder.in_use());
        let h = s.stage.config().hidden;
        let rows = |position: u64| Forward {
            session_id: vec![1; 16],
            position,
            hidden: dgr_proto::encode_rows(&vec![0.5; h], SeamDtype::F32),
            n_rows: 1,
            ..Default::default()
        };
        s.handle(Cmd::Forward { f: rows(0), recv_us: 0, at: Instant::now(), reply: reply.clone(), conn: 2, uses: feeder.clone() });
        assert!(driver.in_use() && feeder.in_use());
        // Rows from another connection move the hold there.
        s.handle(Cmd::Forward { f: rows(1), recv_us: 0, at: Instant::now(), reply: reply.clone(), conn: 3, uses: other.clone() });
        assert!(!feeder.in_use() && other.in_use());
        s.handle(Cmd::Close { id: vec![1; 16], prefix_blocks: Vec::new(), positions: 0 });
        assert!(!driver.in_use() && !feeder.in_use() && !other.in_use());
    }

    #[test]
    fn a_lost_next_stage_connection_fails_only_the_sessions_on_it() {
        // Two connections to one next-stage address: an old one, lost, and a fresh one dialled
        // after the old one's writer closed, whose loss report may come after sessions on the fresh one.
        let mut s = scheduler(0..6, 64);
        let (old, _old_inbox) = channel(8);
        let (fresh, _fresh_inbox) = channel(8);
        let (opened, mut on_old) = open(&mut s, 1, 0..3, 16, Some(&old));
        assert!(matches!(opened, Body::Opened(_)));
        let (opened, mut on_fresh) = open(&mut s, 2, 0..3, 16, Some(&fresh));
        assert!(matches!(opened, Body::Opened(_)));
        s.handle(Cmd::PeerLost { addr: "next".into(), conn: old.clone(), why: "reset".into(), kind: ErrorKind::NextStage });
        assert_eq!(refused(on_old.try_recv().unwrap().body.unwrap()), ErrorKind::NextStage);
        assert!(!s.sessions.contains_key(&[1; 16]), "the session on the lost connection is freed");
        assert!(s.sessions.contains_key(&[2; 16]), "the session on the fresh connection lives on");
        assert!(on_fresh.try_recv().is_err(), "its driver hears nothing");
    }

    #[test]
    fn admission_holds_to_the_session_cap_and_the_kv_budget() {
        // 16 positions over all 6 layers; at most 2 sessions.
        let mut s = scheduler(0..6, 16);
        s.cfg.max_sessions = 2;
        assert!(matches!(open(&mut s, 1, 0..6, 8, None).0, Body::Opened(_)));
        assert_eq!(refused(open(&mut s, 2, 0..6, 9, None).0), ErrorKind::Overloaded, "past the KV budget");
        assert!(matches!(open(&mut s, 2, 0..6, 8, None).0, Body::Opened(_)));
        assert_eq!(refused(open(&mut s, 3, 0..6, 1, None).0), ErrorKind::Overloaded, "past the session cap");
        assert_eq!(refused(open(&mut s, 1, 0..6, 1, None).0), ErrorKind::BadFrame, "an id already open");
        s.handle(Cmd::Close { id: vec![1; 16], prefix_blocks: Vec::new(), positions: 0 });
        assert!(matches!(open(&mut s, 3, 0..6, 8, None).0, Body::Opened(_)), "a freed reservation is reusable");
    }

    #[test]
    fn the_last_stage_samples_only_what_the_mask_allows() {
        let mut s = scheduler(0..6, 64);
        let prompt = |id: u8, allowed: Vec<u8>| Forward {
            session_id: vec![id; 16],
            tokens: vec![5, 6, 7],
            sample: true,
            allowed,
            ..Default::default()
        };
        let (_, mut free) = open(&mut s, 1, 0..6, 8, None);
        forward(&mut s, prompt(1, Vec::new()));
        let best = token(&mut free).token;
        // Only the token after the unconstrained choice is allowed.
        let other = (best + 1) as usize;
        let mut mask = vec![0u8; other / 8 + 1];
        mask[other / 8] = 1 << (other % 8);
        let (_, mut masked) = open(&mut s, 2, 0..6, 8, None);
        forward(&mut s, prompt(2, mask.clone()));
        let t = token(&mut masked);
        assert_eq!((t.token, t.logprob), (other as u32, 0.0));
        // A split route carries the mask to its last stage.
        let (hop, mut hop_inbox) = channel(8);
        let (_, _front) = open(&mut s, 3, 0..3, 8, Some(&hop));
        forward(&mut s, prompt(3, mask.clone()));
        let Body::Forward(rows) = hop_inbox.try_recv().unwrap().body.unwrap() else { panic!("expected rows") };
        assert_eq!(rows.allowed, mask);
        // A mask that allows nothing fails the session.
        let (_, mut none) = open(&mut s, 4, 0..6, 8, None);
        forward(&mut s, prompt(4, vec![0; 2]));
        assert_eq!(refused(none.try_recv().unwrap().body.unwrap()), ErrorKind::BadInput);
    }

    #[test]
    fn kv_bytes_in_the_metrics_are_the_kv_dtypes_own() {
        // Heads of 64: q8_0 in blocks of 32, 34 bytes per 32 values.
        let file = || SynthSpec { layers: 6, hidden: 128, ffn: 256, heads: 2, kv_heads: 1, ..SynthSpec::default() }.to_gguf().unwrap();
        let mut per_position = Vec::new();
        for &kv in dgr_engine::KvDtype::ALL {
            let mut s = scheduler_with(file(), 0..6, |cfg| {
                cfg.kv_budget_tokens = 1000;
                cfg.kv_dtype = kv;
            });
            assert_eq!(
                s.schema.engine,
                format!(
                    "gguf-cpu-{}{}",
                    dgr_engine::Numerics::default().name(),
                    if kv == dgr_engine::KvDtype::F32 { String::new() } else { format!("-{kv}") }
                )
            );
            let (_, mut inbox) = open(&mut s, 1, 0..6, 16, None);
            forward(&mut s, Forward { session_id: vec![1; 16], tokens: vec![5, 6, 7], sample: true, ..Default::default() });
            token(&mut inbox);
            s.publish();
            let (used, capacity) = (s.metrics.kv_bytes_used.load(Relaxed), s.metrics.kv_bytes_capacity.load(Relaxed));
            assert_eq!(capacity, 1000 * used / 3, "{kv}: the capacity is the budget's positions at the bytes one takes");
            assert!(s.metrics.render().contains(&format!("dgr_worker_kv_bytes_used {used}\n")));
            per_position.push(used / 3);
        }
        // Six layers of keys and values of 64 floats a position.
        assert_eq!(per_position, [6 * 2 * 64 * 4, 6 * 2 * 64 * 2, 6 * 2 * (64 + 2 * 2)]);
        assert_eq!(per_position[2] * 128, per_position[0] * 34, "q8_0 is 34/128 of f32");
    }

    #[test]
    fn cancel_frees_the_session_and_reports_what_it_computed() {
        let mut s = scheduler(0..6, 64);
        let (_, mut inbox) = open(&mut s, 1, 0..6, 16, None);
        forward(&mut s, Forward { session_id: vec![1; 16], tokens: vec![5, 6, 7], sample: true, ..Default::default() });
        let t = token(&mut inbox);
        forward(&mut s, Forward { session_id: vec![1; 16], position: 3, tokens: vec![t.token], sample: true, ..Default::default() });
        token(&mut inbox);
        s.handle(Cmd::Cancel { id: vec![1; 16] });
        let Body::Usage(u) = inbox.try_recv().unwrap().body.unwrap() else { panic!("expected usage") };
        assert_eq!((u.tokens_prefilled, u.tokens_decoded, u.layer_tokens), (3, 1, 24));
        s.publish();
        assert_eq!((s.sessions.len(), s.reserved, s.metrics.kv_bytes_used.load(Relaxed)), (0, 0, 0));
        // Rows for a freed session are refused, not computed.
        let (reply, mut replies) = channel(1);
        s.handle(Cmd::Forward {
            f: Forward { session_id: vec![1; 16], position: 4, tokens: vec![1], sample: true, ..Default::default() },
            recv_us: 0,
            at: Instant::now(),
            reply,
            conn: 1,
            uses: ConnUse::default(),
        });
        assert_eq!(refused(replies.try_recv().unwrap().body.unwrap()), ErrorKind::UnknownSession);
    }

    #[test]
    fn idle_sessions_are_freed_and_their_driver_told() {
        let mut s = scheduler(0..6, 64);
        s.cfg.idle_timeout = Duration::from_millis(20);
        let (_, mut inbox) = open(&mut s, 1, 0..6, 16, None);
        s.sweep();
        assert_eq!(s.sessions.len(), 1, "not idle yet");
        std::thread::sleep(Duration::from_millis(40));
        s.sweep();
        assert!(s.sessions.is_empty());
        assert_eq!(refused(inbox.try_recv().unwrap().body.unwrap()), ErrorKind::Cancelled);
    }

    #[test]
    fn a_drain_refuses_new_sessions_and_ends_open_ones_at_its_deadline() {
        let mut s = scheduler(0..6, 64);
        let (_, mut inbox) = open(&mut s, 1, 0..6, 16, None);
        s.handle(Cmd::Drain { deadline: Instant::now() });
        assert_eq!(refused(open(&mut s, 2, 0..6, 16, None).0), ErrorKind::ShuttingDown);
        // The loop returns once the deadline has passed, failing what is still open.
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let done = std::thread::spawn(move || s.run(rx));
        done.join().unwrap();
        drop(tx);
        assert_eq!(refused(inbox.try_recv().unwrap().body.unwrap()), ErrorKind::ShuttingDown);
    }

    #[test]
    fn sessions_decoding_together_share_one_batch() {
        let mut s = scheduler(0..6, 64);
        let (_, mut a) = open(&mut s, 1, 0..6, 16, None);
        let (_, mut b) = open(&mut s, 2, 0..6, 16, None);
        let prompt = |id: u8| Forward { session_id: vec![id; 16], tokens: vec![5, 6, 7], sample: true, ..Default::default() };
        forward(&mut s, prompt(1));
        forward(&mut s, prompt(2));
        let (ta, tb) = (token(&mut a), token(&mut b));
        let (reply, _) = channel(1);
        for (id, t) in [(1u8, ta.token), (2, tb.token)] {
            let f = Forward { session_id: vec![id; 16], position: 3, tokens: vec![t], sample: true, ..Default::default() };
            s.handle(Cmd::Forward { f, recv_us: 0, at: Instant::now(), reply: reply.clone(), conn: 1, uses: ConnUse::default() });
        }
        s.step();
        assert_eq!(s.metrics.last_batch_sessions.load(Relaxed), 2, "both decode rows ran in one forward");
        token(&mut a);
        token(&mut b);
    }
}
