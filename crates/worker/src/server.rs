//! The network side: accepting connections, the handshake, reading frames into scheduler
//! commands, writing frames out, connections to the next stage, and /metrics over HTTP on the
//! same port (a connection that starts with "GET " is an HTTP request).

use crate::join::{Joiner, TicketGate, UsageOutbox};
use crate::scheduler::{Cmd, ConnId, ConnUse, Outbox, Scheduler};
use crate::share::Holdings;
use crate::{Metrics, TrackerLink, WorkerConfig};
use bytes::Bytes;
use dgr_engine::{open_engine, Engine, EngineSpec};
use dgr_gguf::{Gguf, ModelIdentity};
use dgr_proto::{
    Body, BoundarySchema, ErrorKind, ErrorMsg, Frame, Hello, OpenSession, Ping, Registration, Role, SeamDtype, StageInfo, TicketError,
    WorkerUsage, PROTOCOL_VERSION, STAGE_UNKNOWN,
};
use dgr_telemetry::unix_us;
use futures::future::{BoxFuture, FutureExt, Shared as SharedFuture};
use futures::{SinkExt, StreamExt};
use prost::Message;
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::codec::Framed;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Frames waiting to be written on one connection.
const OUTBOX: usize = 1024;
/// Commands waiting for the scheduler.
const COMMANDS: usize = 4096;
/// Dialing and greeting a next stage.
const HANDSHAKE: Duration = Duration::from_secs(10);
/// Longest one frame may take to write: a peer that stops reading for this long is cut off,
/// so a writer never waits on it forever.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest a stopping worker waits for the frames already queued (its sessions' last errors)
/// to be written before it exits.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("opening the model: {0}")]
    Model(#[from] dgr_gguf::GgufError),
    #[error(transparent)]
    Engine(#[from] dgr_engine::EngineError),
    #[error(transparent)]
    Checkpoint(#[from] dgr_hf::HfError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("the slice holds layers {}..{}, not all of {}..{}", .holds.start, .holds.end, .asked.start, .asked.end)]
    SliceRange { holds: std::ops::Range<u32>, asked: std::ops::Range<usize> },
    #[error("joined none of the trackers at {trackers} within {} s (every attempt's reason is logged above)", .after.as_secs_f64())]
    JoinTimeout { trackers: String, after: Duration },
    #[error(
        "--kv-tokens {positions} needs {needed} bytes of GPU memory ({per_position} a position over the stage's layers), \
         and {room} of the {free} bytes free on the GPU once the weights are there may hold KV ({total} in all, {used} \
         held by this worker): ask for fewer positions, or give this stage fewer layers"
    )]
    DeviceMemory { positions: u64, per_position: u64, needed: u64, room: u64, free: u64, total: u64, used: u64 },
    #[error("the stage's weights take {weights} bytes of GPU memory, over --gpu-memory-mb's {cap}: give this stage fewer layers")]
    GpuMemoryCap { weights: u64, cap: u64 },
    #[error("the GPU was lost mid-step ({0}): this worker's sessions were failed, for their drivers to replay elsewhere")]
    DeviceLost(String),
}

/// A worker ready to serve: its stage is open and its scheduler is waiting.
pub struct Worker {
    cfg: WorkerConfig,
    info: StageInfo,
    /// What the stage computes on, `--device auto` resolved: said in the worker's first line.
    device: String,
    metrics: Arc<Metrics>,
    cmds: SyncSender<Cmd>,
    /// Ends with why the stage's device was lost, if it was.
    scheduler: std::thread::JoinHandle<Option<String>>,
    step_us_per_layer: f64,
    gate: Option<Arc<TicketGate>>,
    usage: Option<tokio::sync::mpsc::Receiver<WorkerUsage>>,
    holdings: Option<Arc<Holdings>>,
}

struct Shared {
    cfg: WorkerConfig,
    info: StageInfo,
    metrics: Arc<Metrics>,
    cmds: SyncSender<Cmd>,
    next_conn: AtomicU64,
    /// Next-stage connections by address. Never held across a dial: a slow or dead next stage
    /// delays only the opens that go there.
    peers: tokio::sync::Mutex<HashMap<String, Peer>>,
    /// Set when the worker joined a tracker: every session open needs a valid ticket.
    gate: Option<Arc<TicketGate>>,
    /// In a swarm: the tensors this worker holds, served to workers fetching their slice.
    holdings: Option<Arc<Holdings>>,
    /// Every connection's writer, and the signal to write what is queued and stop: so a worker
    /// that stops delivers its sessions' last frames (`device_lost`, `shutting_down`) before it
    /// exits, rather than leaving its drivers a dropped connection.
    writers: TaskTracker,
    closing: CancellationToken,
}

impl Shared {
    /// Has every writer send what is queued and stop, waiting up to `FLUSH_TIMEOUT`.
    async fn flush(&self) {
        self.closing.cancel();
        self.writers.close();
        let _ = tokio::time::timeout(FLUSH_TIMEOUT, self.writers.wait()).await;
    }
}

/// A next-stage connection being dialled and greeted: every open to that address awaits the
/// same one, and its result, a failure too, reaches all of them.
type Dial = SharedFuture<BoxFuture<'static, Result<PeerLink, String>>>;

/// A next stage's connection and the worker id it proved (None: a plaintext link).
type PeerLink = (Outbox, Option<String>);

/// What a worker has towards one next-stage address.
enum Peer {
    Up(PeerLink),
    Dialing(Dial),
}

/// The sessions of one connection whose Open waits for its next stage's connection. A Cancel or
/// Close meanwhile withdraws the open, and none is queued once the connection has closed.
#[derive(Default)]
struct Opening {
    ids: HashSet<Vec<u8>>,
    closed: bool,
}

/// The share of a GPU's memory free once the weights are there that the KV budget may take:
/// the rest is for each step's activations, logits and read-backs.
const KV_SHARE_OF_FREE: f64 = 0.8;

/// On a GPU, the KV budget must fit in the device memory the weights left, so that no session
/// meets an out-of-memory failure mid-way (a session that needs more than the budget is refused
/// at open): a budget asked for (`--kv-tokens`) that does not fit is refused at start, naming
/// the bytes; the default shrinks to what fits, and says so. A cap on the GPU memory the stage
/// may take (`--gpu-memory-mb`) holds its weights, and what they leave of it is all that is free.
fn fit_kv_budget(cfg: &mut WorkerConfig, stage: &dgr_engine::Stage) -> Result<(), WorkerError> {
    let Some(mut mem) = stage.device_memory() else { return Ok(()) };
    if let Some(cap) = cfg.gpu_memory_cap {
        let weights = stage.weight_bytes() as u64;
        if weights > cap {
            return Err(WorkerError::GpuMemoryCap { weights, cap });
        }
        mem.free = mem.free.min(cap - weights);
    }
    let per_position = (stage.kv_position_bytes() as u64).max(1);
    let room = (mem.free as f64 * KV_SHARE_OF_FREE) as u64;
    let (asked, fits) = (cfg.kv_budget_tokens as u64, room / per_position);
    if asked <= fits {
        return Ok(());
    }
    if !cfg.kv_budget_default || fits == 0 {
        let needed = asked.saturating_mul(per_position);
        return Err(WorkerError::DeviceMemory {
            positions: asked,
            per_position,
            needed,
            room,
            free: mem.free,
            total: mem.total,
            used: mem.used,
        });
    }
    eprintln!(
        "dgr worker: the GPU has {} bytes free once the weights are there: the KV budget is {fits} positions, not the default {asked} ({per_position} bytes a position)",
        mem.free
    );
    cfg.kv_budget_tokens = fits as usize;
    Ok(())
}

fn encode(f: &Frame) -> Bytes {
    Bytes::from(f.encode_to_vec())
}

impl Worker {
    /// Opens the model's layers `cfg.layers` and starts the scheduler.
    pub fn open(mut cfg: WorkerConfig) -> Result<Worker, WorkerError> {
        let (gguf, identity) = open_model(&cfg.model, &cfg.layers)?;
        let model_id = identity.id.clone();
        let gguf = Arc::new(gguf);
        let holdings = match &cfg.tracker {
            // Slices are served from GGUF files only.
            Some(t) if !gguf.is_assembled() => {
                let layers = cfg.layers.start as u32..cfg.layers.end as u32;
                Some(Arc::new(crate::share::Holdings::new(gguf.clone(), &identity, layers, &t.join_token)?))
            }
            _ => None,
        };
        let spec = EngineSpec { kv: cfg.kv_dtype, ..EngineSpec::threads(cfg.threads) }.on(cfg.device, Some(cfg.numerics));
        let stage = open_engine(gguf, cfg.layers.clone(), spec)?;
        fit_kv_budget(&mut cfg, &stage)?;
        let device = match stage.adapter() {
            Some(a) => format!("gpu:{} ({a})", spec.adapter),
            None => format!("cpu ({} threads)", cfg.threads),
        };
        let c = stage.config();
        let info = StageInfo {
            model_id: model_id.clone(),
            layer_start: cfg.layers.start as u32,
            layer_end: cfg.layers.end as u32,
            n_layers: c.n_layers as u32,
            hidden: c.hidden as u32,
            vocab: c.vocab as u32,
            max_positions: c.context as u64,
            version: env!("CARGO_PKG_VERSION").into(),
            engine: stage.engine().to_string(),
        };
        let schema = BoundarySchema {
            protocol_version: PROTOCOL_VERSION,
            model_id,
            layer_start: info.layer_start,
            layer_end: info.layer_end,
            hidden: info.hidden,
            seam_dtype: SeamDtype::F32 as i32,
            engine: info.engine.clone(),
        };
        let step_us_per_layer = measure_step(&stage)?;
        #[cfg(feature = "fault-injection")]
        let step_us_per_layer = crate::fault::step_us_per_layer().unwrap_or(step_us_per_layer);
        let metrics = Arc::new(Metrics::default());
        let _ = metrics.engine.set(info.engine.clone());
        let (cmds, rx) = sync_channel(COMMANDS);
        let (usage_tx, usage) = match cfg.tracker {
            Some(_) => {
                let (tx, rx) = tokio::sync::mpsc::channel(crate::join::USAGE_QUEUE);
                (Some(tx), Some(rx))
            }
            None => (None, None),
        };
        let gate = cfg.tracker.as_ref().map(|t| Arc::new(TicketGate::new(dgr_proto::worker_id(&t.identity.verifying_key()))));
        let sched = Scheduler::new(stage, cfg.clone(), schema, metrics.clone(), usage_tx);
        let scheduler = std::thread::Builder::new().name("dgr-scheduler".into()).spawn(move || sched.run(rx))?;
        Ok(Worker { cfg, info, device, metrics, cmds, scheduler, step_us_per_layer, gate, usage, holdings })
    }

    /// Microseconds per layer of one decode row, measured at start-up.
    pub fn step_us_per_layer(&self) -> f64 {
        self.step_us_per_layer
    }

    pub fn info(&self) -> &StageInfo {
        &self.info
    }

    /// The device the stage computes on, in words.
    pub fn device(&self) -> &str {
        &self.device
    }

    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// Serves `listener` (None: a relayed worker, reached only through its tracker) until
    /// `shutdown` completes; then leaves the tracker, stops taking sessions, lets open ones
    /// finish for up to the drain timeout, cancels the rest and returns.
    pub async fn serve(
        mut self,
        listener: Option<TcpListener>,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), WorkerError> {
        let shared = Arc::new(Shared {
            cfg: self.cfg.clone(),
            info: self.info.clone(),
            metrics: self.metrics.clone(),
            cmds: self.cmds.clone(),
            next_conn: AtomicU64::new(1),
            peers: tokio::sync::Mutex::new(HashMap::new()),
            gate: self.gate.clone(),
            holdings: self.holdings.clone(),
            writers: TaskTracker::new(),
            closing: CancellationToken::new(),
        });
        let (leave, leave_rx) = tokio::sync::watch::channel(false);
        let (joined, joined_rx) = tokio::sync::watch::channel(false);
        let joined = Arc::new(joined);
        if let (Some(link), Some(gate), Some(usage)) = (self.cfg.tracker.clone(), self.gate.clone(), self.usage.take()) {
            let reg = self.registration(link.advertise.clone().unwrap_or_default());
            let outbox = UsageOutbox::new(self.metrics.clone());
            tokio::spawn(outbox.clone().fill(usage));
            for tracker in link.distinct_addrs() {
                let joiner = Joiner {
                    tracker: tracker.to_string(),
                    link: link.clone(),
                    reg: reg.clone(),
                    gate: gate.clone(),
                    metrics: self.metrics.clone(),
                    outbox: outbox.clone(),
                    leave: leave_rx.clone(),
                    joined: joined.clone(),
                };
                let relay_shared = shared.clone();
                tokio::spawn(joiner.run(move |stream| admit(stream, &relay_shared)));
            }
        }
        // The scheduler returns once a drain completes; waiting for it runs on a blocking thread.
        let handle = self.scheduler;
        let stopped = tokio::task::spawn_blocking(move || handle.join());
        let join_deadline = first_join(self.cfg.tracker.as_ref(), joined_rx);
        tokio::pin!(shutdown, stopped, join_deadline);
        let mut draining = false;
        loop {
            tokio::select! {
                _ = &mut shutdown, if !draining => {
                    // Leave the tracker first, so no new route names this worker. Keep
                    // accepting: drivers of open sessions may reconnect, and new ones should
                    // hear "shutting down" rather than wait on a silent port.
                    let _ = leave.send(true);
                    draining = true;
                    let _ = self.cmds.send(Cmd::Drain { deadline: Instant::now() + self.cfg.drain_timeout });
                }
                ended = &mut stopped => {
                    shared.flush().await;
                    if let Ok(Ok(Some(why))) = ended {
                        let _ = leave.send(true);
                        return Err(WorkerError::DeviceLost(why));
                    }
                    break;
                }
                err = &mut join_deadline, if !draining => {
                    let _ = leave.send(true);
                    return Err(err);
                }
                accepted = accept(listener.as_ref()) => {
                    if let Ok((stream, _)) = accepted {
                        admit(stream, &shared);
                    }
                }
            }
        }
        Ok(())
    }

    fn registration(&self, addr: String) -> Registration {
        let i = &self.info;
        Registration {
            engine: i.engine.clone(),
            model_id: i.model_id.clone(),
            n_layers: i.n_layers,
            layer_start: i.layer_start,
            layer_end: i.layer_end,
            hidden: i.hidden,
            vocab: i.vocab,
            addr,
            kv_tokens: self.cfg.kv_budget_tokens as u64,
            max_sessions: self.cfg.max_sessions as u32,
            threads: self.cfg.threads as u32,
            step_us_per_layer: self.step_us_per_layer,
            max_positions: i.max_positions,
            version: i.version.clone(),
        }
    }
}

/// Completes, with the error `serve` fails with, once the join timeout passes without a first
/// join to any tracker; never for a ticketless worker or one that joined.
async fn first_join(link: Option<&TrackerLink>, mut joined: tokio::sync::watch::Receiver<bool>) -> WorkerError {
    if let Some(link) = link {
        if tokio::time::timeout(link.join_timeout, joined.wait_for(|j| *j)).await.is_err() {
            return WorkerError::JoinTimeout { trackers: link.addrs.join(", "), after: link.join_timeout };
        }
    }
    std::future::pending().await
}

/// Serves a new connection, unless `max_connections` are open already: then it is closed at
/// once (and counted), so idle or hostile connections cannot take unbounded tasks and sockets.
fn admit(stream: TcpStream, shared: &Arc<Shared>) {
    let open = &shared.metrics.connections_open;
    let max = shared.cfg.max_connections as u64;
    if open.fetch_update(Relaxed, Relaxed, |n| (n < max).then_some(n + 1)).is_err() {
        shared.metrics.connections_refused.fetch_add(1, Relaxed);
        return;
    }
    let _ = stream.set_nodelay(true);
    let shared = shared.clone();
    tokio::spawn(async move {
        // Released however the connection ends, a panic included.
        struct Admitted(Arc<Metrics>);
        impl Drop for Admitted {
            fn drop(&mut self) {
                self.0.connections_open.fetch_sub(1, Relaxed);
            }
        }
        let _admitted = Admitted(shared.metrics.clone());
        connection(stream, shared).await;
    });
}

async fn accept(listener: Option<&TcpListener>) -> std::io::Result<(TcpStream, SocketAddr)> {
    match listener {
        Some(l) => l.accept().await,
        None => std::future::pending().await,
    }
}

/// Opens the model file for layers `range`: reads its header, maps only the tensors those
/// layers need, and establishes the model's identity (verifying a slice's tensors against it).
fn open_model(path: &std::path::Path, range: &std::ops::Range<usize>) -> Result<(Gguf, ModelIdentity), WorkerError> {
    if dgr_hf::is_checkpoint(path) {
        return Ok(dgr_hf::open_stage(path, range.clone())?);
    }
    let mut g = Gguf::read_header(path)?;
    let n_layers = dgr_engine::ModelConfig::from_gguf(&g)?.n_layers;
    if range.start >= range.end || range.end > n_layers {
        return Err(dgr_engine::EngineError::BadLayerRange { start: range.start, end: range.end, n_layers }.into());
    }
    if let Some(s) = g.slice() {
        if range.start < s.layer_start as usize || range.end > s.layer_end as usize {
            return Err(WorkerError::SliceRange { holds: s.layer_start..s.layer_end, asked: range.clone() });
        }
    }
    let tied = !g.model_has_tensor("output.weight");
    let (start, end) = (range.start as u32, range.end as u32);
    g.map_tensors(|t| dgr_gguf::needed_by_stage(&t.name, start, end, n_layers as u32, tied))?;
    let identity = dgr_gguf::identity(path, &g)?;
    Ok((g, identity))
}

/// Times one decode row through every layer this stage holds (the best of a few runs, after a
/// warm-up), per layer: the speed a tracker plans routes with.
fn measure_step(stage: &impl Engine) -> Result<f64, WorkerError> {
    let (c, layers) = (stage.config(), stage.layers());
    let hidden = vec![0.01f32; c.hidden];
    let mut best = f64::MAX;
    let mut kv = stage.new_state(8, layers.clone())?;
    for _ in 0..4 {
        let input = if layers.start == 0 { dgr_engine::Input::Tokens(&[1]) } else { dgr_engine::Input::Hidden(&hidden) };
        let logits = if layers.end == c.n_layers { dgr_engine::LogitRows::Last } else { dgr_engine::LogitRows::None };
        let started = Instant::now();
        stage.forward(&mut [dgr_engine::SeqInput { kv: &mut kv, input, logits }])?;
        best = best.min(started.elapsed().as_secs_f64() * 1e6);
    }
    Ok(best / stage.layers().len() as f64)
}

/// The writer half of a connection: a bounded outbox drained onto `sink`, until every sender
/// is gone, a write fails or times out, or the worker is closing and nothing is left queued.
fn spawn_writer<S>(mut sink: S, shared: &Shared) -> Outbox
where
    S: futures::Sink<Bytes> + Unpin + Send + 'static,
{
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Frame>(OUTBOX);
    let closing = shared.closing.clone();
    shared.writers.spawn(async move {
        loop {
            let f = tokio::select! {
                biased;
                f = rx.recv() => f,
                _ = closing.cancelled() => rx.try_recv().ok(),
            };
            let Some(f) = f else { break };
            if !matches!(tokio::time::timeout(WRITE_TIMEOUT, sink.send(encode(&f))).await, Ok(Ok(()))) {
                break;
            }
        }
    });
    tx
}

fn hello(info: Option<StageInfo>) -> Frame {
    let role = if info.is_some() { Role::Worker } else { Role::Upstream };
    Frame::new(Body::Hello(Hello { protocol_version: PROTOCOL_VERSION, role: role as i32, info }))
}

async fn connection(stream: TcpStream, shared: Arc<Shared>) {
    // One deadline for the whole handshake: the first bytes, then the Hello frame.
    let handshake = tokio::time::Instant::now() + shared.cfg.handshake_timeout;
    let timed_out = || {
        shared.metrics.handshake_timeouts.fetch_add(1, Relaxed);
    };
    let mut head = [0u8; 4];
    let peeked = tokio::time::timeout_at(handshake, async {
        loop {
            match stream.peek(&mut head).await {
                Ok(n) if n >= 4 => return true,
                Ok(0) | Err(_) => return false,
                Ok(_) => tokio::time::sleep(Duration::from_millis(2)).await,
            }
        }
    })
    .await;
    match peeked {
        Ok(true) => {}
        Ok(false) => return,
        Err(_) => return timed_out(),
    }
    if &head == b"GET " {
        return http(stream, &shared.metrics).await;
    }
    let from = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let stream = match dgr_proto::respond(stream, handshake.saturating_duration_since(tokio::time::Instant::now())).await {
        Ok(s) => s,
        Err(e) => {
            if let Some(dgr_proto::SecureError::Plaintext(why)) = dgr_proto::SecureError::of(&e) {
                eprintln!("dgr worker: REFUSED a link from {from}: {why}");
            }
            if e.kind() == std::io::ErrorKind::TimedOut
                || matches!(dgr_proto::SecureError::of(&e), Some(dgr_proto::SecureError::Handshake(m)) if m == "timed out")
            {
                timed_out();
            }
            return;
        }
    };
    let conn: ConnId = shared.next_conn.fetch_add(1, Relaxed);
    let uses = ConnUse::default();
    let (sink, mut frames) = Framed::new(stream, dgr_proto::codec(shared.cfg.max_frame)).split();
    let out = spawn_writer(sink, &shared);
    let refuse = |out: &Outbox, id: &[u8], kind, msg: String| send_refusal(&shared.metrics, out, id, kind, msg);
    let opening = Arc::new(Mutex::new(Opening::default()));
    // The handshake: the peer's Hello first, with our protocol version.
    match tokio::time::timeout_at(handshake, frames.next()).await {
        Ok(Some(Ok(bytes))) => match Frame::decode(bytes) {
            Ok(Frame { body: Some(Body::Hello(h)) }) if h.protocol_version == PROTOCOL_VERSION => {
                let _ = out.try_send(hello(Some(shared.info.clone())));
            }
            Ok(Frame { body: Some(Body::Hello(h)) }) => {
                let msg = format!("protocol version {} (this worker speaks {PROTOCOL_VERSION})", h.protocol_version);
                return refuse(&out, &[], ErrorKind::SchemaMismatch, msg);
            }
            _ => return refuse(&out, &[], ErrorKind::BadFrame, "expected Hello as the first frame".into()),
        },
        Ok(_) => return,
        Err(_) => return timed_out(),
    }
    // Past the handshake, a connection stays while any session holds it (its driver's, or the
    // one its rows arrive on); holding none, it is closed after `conn_idle_timeout` of silence.
    let idle = shared.cfg.conn_idle_timeout;
    let mut last_frame = Instant::now();
    let mut wait = idle;
    loop {
        let next = match tokio::time::timeout(wait, frames.next()).await {
            Ok(Some(next)) => {
                last_frame = Instant::now();
                wait = idle;
                next
            }
            Ok(None) => break,
            Err(_) => {
                let quiet = last_frame.elapsed();
                if uses.in_use() || !opening.lock().unwrap_or_else(PoisonError::into_inner).ids.is_empty() {
                    // Look again soon: the sessions may end at any time.
                    wait = idle.min(Duration::from_secs(1));
                    continue;
                }
                if quiet >= idle {
                    shared.metrics.idle_closed.fetch_add(1, Relaxed);
                    break;
                }
                wait = idle - quiet;
                continue;
            }
        };
        let bytes = match next {
            Ok(b) => b,
            Err(e) if dgr_proto::SecureError::of(&e) == Some(&dgr_proto::SecureError::Integrity) => {
                // The peer hears it on the other direction, which may still be intact.
                refuse(&out, &[], ErrorKind::Integrity, e.to_string());
                break;
            }
            Err(e) => {
                // A frame over the size cap or a broken stream: the framing is lost, so close.
                refuse(&out, &[], ErrorKind::BadFrame, format!("unreadable frame: {e}"));
                break;
            }
        };
        let body = match Frame::decode(bytes) {
            Ok(Frame { body: Some(b) }) => b,
            Ok(Frame { body: None }) => {
                refuse(&out, &[], ErrorKind::BadFrame, "empty frame".into());
                continue;
            }
            Err(e) => {
                refuse(&out, &[], ErrorKind::BadFrame, format!("undecodable frame: {e}"));
                continue;
            }
        };
        let cmd = match body {
            Body::Open(open) => {
                let (request_id, next_id, tenant) = match check_ticket(&shared, &open) {
                    Ok(r) => r,
                    Err(why) => {
                        shared.metrics.ticket_refused(why);
                        let e = ErrorMsg::new(&open.session_id, ErrorKind::Ticket, open.stage_index, why.to_string());
                        let _ = out.try_send(Frame::new(Body::Error(e)));
                        continue;
                    }
                };
                if hop(&open).0.is_empty() {
                    Cmd::Open { conn, uses: uses.clone(), open: Box::new(open), reply: out.clone(), next: None, request_id, tenant }
                } else {
                    // Off the read loop: the sessions beside it on this connection (a gateway's
                    // are all on one) go on while its next stage is dialled.
                    {
                        // At most as many as the worker takes sessions, so a flood of opens
                        // cannot pile up tasks.
                        let mut o = opening.lock().unwrap_or_else(PoisonError::into_inner);
                        if o.ids.len() >= shared.cfg.max_sessions || !o.ids.insert(open.session_id.clone()) {
                            let msg = "too many opens on this connection wait for their next stage, or this one already does";
                            refuse(&out, &open.session_id, ErrorKind::Overloaded, msg.into());
                            continue;
                        }
                    }
                    let pending = PendingOpen { conn, uses: uses.clone(), open, reply: out.clone(), request_id, next_id, tenant };
                    tokio::spawn(pending.open_after_dial(shared.clone(), opening.clone()));
                    continue;
                }
            }
            Body::Forward(f) => Cmd::Forward { f, recv_us: unix_us(), at: Instant::now(), reply: out.clone(), conn, uses: uses.clone() },
            Body::Ping(p) => {
                let _ = out.try_send(Frame::new(Body::Pong(p)));
                continue;
            }
            Body::Fetch(ask) => {
                let answer = match &shared.holdings {
                    Some(h) => h.answer(&ask),
                    None => {
                        let msg = "this worker is not in a swarm: it serves no tensors";
                        Frame::new(Body::Error(ErrorMsg::new(&[], ErrorKind::Ticket, STAGE_UNKNOWN, msg)))
                    }
                };
                // Awaited, not queued: a fetcher asks one chunk at a time, and waiting bounds
                // the memory its chunks take to the writer's queue.
                let _ = out.send(answer).await;
                continue;
            }
            Body::Cancel(r) => {
                opening.lock().unwrap_or_else(PoisonError::into_inner).ids.remove(&r.session_id);
                Cmd::Cancel { id: r.session_id }
            }
            Body::Close(r) => {
                opening.lock().unwrap_or_else(PoisonError::into_inner).ids.remove(&r.session_id);
                Cmd::Close { id: r.session_id, prefix_blocks: r.prefix_blocks, positions: r.positions }
            }
            Body::Hello(_)
            | Body::Opened(_)
            | Body::Token(_)
            | Body::Error(_)
            | Body::Usage(_)
            | Body::Progress(_)
            | Body::Embedding(_)
            | Body::Pong(_)
            | Body::Manifest(_)
            | Body::Chunk(_) => {
                refuse(&out, &[], ErrorKind::BadFrame, "a frame a worker does not accept".into());
                continue;
            }
        };
        if let Err(e) = shared.cmds.try_send(cmd) {
            let (kind, why) = unqueued(&e);
            refuse(&out, &[], kind, why.into());
        }
    }
    opening.lock().unwrap_or_else(PoisonError::into_inner).closed = true;
    let _ = shared.cmds.send(Cmd::ConnClosed { conn });
}

fn send_refusal(metrics: &Metrics, out: &Outbox, id: &[u8], kind: ErrorKind, msg: String) {
    metrics.failure(kind);
    let _ = out.try_send(Frame::new(Body::Error(ErrorMsg::new(id, kind, STAGE_UNKNOWN, msg))));
}

/// A session's Open, checked, waiting for the connection to its next stage.
struct PendingOpen {
    conn: ConnId,
    uses: ConnUse,
    open: OpenSession,
    reply: Outbox,
    request_id: String,
    /// The next stage's worker id as the ticket names it (None: ticketless).
    next_id: Option<String>,
    tenant: String,
}

impl PendingOpen {
    /// Queues the open once its next stage is connected, or refuses it if that fails; unless
    /// it was withdrawn meanwhile. Decided under the connection's `Opening` lock, so it is
    /// queued before the connection's `ConnClosed` or not at all.
    async fn open_after_dial(self, shared: Arc<Shared>, opening: Arc<Mutex<Opening>>) {
        let (to, stage) = hop(&self.open);
        let to = to.to_string();
        let next = peer(&shared, &to).await;
        let mut o = opening.lock().unwrap_or_else(PoisonError::into_inner);
        if o.closed || !o.ids.remove(&self.open.session_id) {
            return;
        }
        let PendingOpen { conn, uses, open, reply, request_id, next_id, tenant } = self;
        // The ticket names the next stage by its key: the worker at that address must have
        // proven it in the secure channel's handshake (a plaintext link proves none). Ticketless,
        // it is known by the key pinned or first seen at its address.
        let next = match (next, next_id) {
            (Ok((tx, Some(proved))), None) => dgr_proto::check_peer(&to, &proved).map(|()| tx),
            (Ok((_, Some(proved))), Some(named)) if named != proved => Err(format!("it proved key {proved}, the ticket names {named}")),
            (other, _) => other.map(|(tx, _)| tx),
        };
        match next {
            Ok(tx) => {
                let (id, next) = (open.session_id.clone(), Some((to, tx)));
                let cmd = Cmd::Open { conn, uses, open: Box::new(open), reply: reply.clone(), next, request_id, tenant };
                if let Err(e) = shared.cmds.try_send(cmd) {
                    let (kind, why) = unqueued(&e);
                    send_refusal(&shared.metrics, &reply, &id, kind, why.into());
                }
            }
            Err(why) => {
                let msg = format!("cannot reach the next stage at {to}: {why}");
                shared.metrics.failure(ErrorKind::NextStage);
                let e = ErrorMsg::new(&open.session_id, ErrorKind::NextStage, stage, msg);
                let _ = reply.try_send(Frame::new(Body::Error(e)));
            }
        }
    }
}

/// Where a stage sends what it computes, and that stage's index: its next stage, or a ring's last
/// stage the first (an empty address: the driver, or itself).
fn hop(open: &OpenSession) -> (&str, u32) {
    match (&open.ring, open.next.is_empty()) {
        (Some(r), true) => (&r.to, 0),
        _ => (&open.next, open.stage_index.saturating_add(1)),
    }
}

/// In tracker mode, checks the open's ticket and returns its request id, the worker id of the
/// stage it sends to (`hop`) and the API key's name; ticketless, "", None and "".
fn check_ticket(shared: &Shared, open: &OpenSession) -> Result<(String, Option<String>, String), TicketError> {
    let Some(gate) = &shared.gate else { return Ok((String::new(), None, String::new())) };
    let signed = open.ticket.as_ref().ok_or(TicketError::Missing)?;
    // Before the first join no key is known: nothing can be verified yet.
    let t = dgr_proto::verify_ticket(signed, |id| gate.key(id), unix_us() / 1000)?;
    dgr_proto::check_ticket_open(&t, open, &gate.worker_id)?;
    let (to, stage) = hop(open);
    let next = t.stages.get(stage as usize).filter(|_| !to.is_empty()).map(|s| s.worker_id.clone());
    Ok((t.request_id, next, t.key_name))
}

/// The connection to a next stage, shared by every session that goes there; opened on first use.
/// Opens to one address share one dial; opens to others never wait on it.
async fn peer(shared: &Arc<Shared>, addr: &str) -> Result<PeerLink, String> {
    let dial = {
        let mut peers = shared.peers.lock().await;
        match peers.get(addr) {
            Some(Peer::Up((tx, proved))) if !tx.is_closed() => {
                // A frame now restarts the next stage's idle clock for this connection, so it is
                // not closed for idleness before the new session's first rows travel on it.
                let _ = tx.try_send(Frame::new(Body::Ping(Ping { nonce: 0 })));
                return Ok((tx.clone(), proved.clone()));
            }
            Some(Peer::Dialing(dial)) => dial.clone(),
            _ => {
                // A task of its own, so the dial finishes and settles the map even if every
                // open waiting on it goes away.
                let task = tokio::spawn(dial_peer(shared.clone(), addr.to_string()));
                let dial = async move { task.await.unwrap_or_else(|e| Err(e.to_string())) }.boxed().shared();
                peers.insert(addr.to_string(), Peer::Dialing(dial.clone()));
                dial
            }
        }
    };
    dial.await
}

/// Dials and greets the next stage at `addr`, then records the result in `shared.peers`: the
/// connection, or nothing (a failed dial, a panicked one too, is not remembered; the next open
/// tries again).
async fn dial_peer(shared: Arc<Shared>, addr: String) -> Result<PeerLink, String> {
    // The greeting runs in a task of its own so that even its panic settles the map here.
    let greeting = tokio::spawn({
        let (shared, addr) = (shared.clone(), addr.clone());
        async move { greet_peer(&shared, &addr).await }
    });
    let greeted = greeting.await.unwrap_or_else(|e| Err(format!("the dial failed: {e}")));
    let mut peers = shared.peers.lock().await;
    let (tx, mut frames, proved) = match greeted {
        Ok(up) => up,
        Err(why) => {
            // Only this dial's entry can be there: a Dialing one is replaced by its own dial alone.
            peers.remove(&addr);
            return Err(why);
        }
    };
    peers.insert(addr.clone(), Peer::Up((tx.clone(), proved.clone())));
    let (cmds, mine) = (shared.cmds.clone(), tx.clone());
    let shared = shared.clone();
    tokio::spawn(async move {
        let (mut why, mut kind) = ("connection closed".to_string(), ErrorKind::NextStage);
        while let Some(next) = frames.next().await {
            match next.map(Frame::decode) {
                // The peer found a frame of ours altered in flight: every session on the link
                // fails as such, not as a lost stage.
                Ok(Ok(Frame { body: Some(Body::Error(err)) })) if err.session_id.is_empty() && err.error_kind() == ErrorKind::Integrity => {
                    (why, kind) = (err.message, ErrorKind::Integrity);
                }
                Ok(Ok(Frame { body: Some(Body::Error(err)) })) => {
                    let _ = cmds.try_send(Cmd::PeerError { err });
                }
                Ok(_) => {}
                Err(e) => {
                    if dgr_proto::SecureError::of(&e) == Some(&dgr_proto::SecureError::Integrity) {
                        kind = ErrorKind::Integrity;
                    }
                    why = e.to_string();
                    break;
                }
            }
        }
        // The next session to go there opens a fresh connection (this one may have been
        // closed by the next stage for idleness, with no session on it). A fresh one may be
        // up already (peer() redials once this writer has closed), so the loss names this
        // connection's outbox: only the sessions on it fail.
        {
            let mut peers = shared.peers.lock().await;
            if matches!(peers.get(&addr), Some(Peer::Up((tx, _))) if tx.same_channel(&mine)) {
                peers.remove(&addr);
            }
        }
        let _ = cmds.send(Cmd::PeerLost { addr, conn: mine, why, kind });
    });
    Ok((tx, proved))
}

type PeerFrames = futures::stream::SplitStream<Framed<dgr_proto::SecureStream, tokio_util::codec::LengthDelimitedCodec>>;

/// A connection to the next stage at `addr`, past its worker's Hello, and the worker id it
/// proved in the secure channel's handshake.
async fn greet_peer(shared: &Shared, addr: &str) -> Result<(Outbox, PeerFrames, Option<String>), String> {
    let stream = dgr_proto::dial(addr, HANDSHAKE).await.map_err(|e| e.to_string())?;
    let proved = stream.peer().map(dgr_proto::worker_id);
    let (mut sink, mut frames) = Framed::new(stream, dgr_proto::codec(shared.cfg.max_frame)).split();
    sink.send(encode(&hello(None))).await.map_err(|e| e.to_string())?;
    match tokio::time::timeout(HANDSHAKE, frames.next()).await {
        Ok(Some(Ok(b))) => match Frame::decode(b) {
            Ok(Frame { body: Some(Body::Hello(h)) }) if h.info.is_some() => {}
            Ok(Frame { body: Some(Body::Error(e)) }) => return Err(e.message),
            _ => return Err("the next stage did not answer with a worker's Hello".into()),
        },
        _ => return Err("no Hello from the next stage".into()),
    }
    Ok((spawn_writer(sink, shared), frames, proved))
}

/// GET /metrics; anything else is 404.
async fn http(stream: TcpStream, metrics: &Metrics) {
    dgr_telemetry::http::serve_get(stream, Vec::new(), |path| {
        if path == b"/metrics" {
            ("200 OK", metrics.render())
        } else {
            ("404 Not Found", "not found\n".to_string())
        }
    })
    .await
}

/// Binds `addr` (port 0 picks a free port) and reports the address it got.
pub async fn bind(addr: &str) -> std::io::Result<(TcpListener, SocketAddr)> {
    let l = TcpListener::bind(addr).await?;
    let a = l.local_addr()?;
    Ok((l, a))
}

/// Why a command did not reach the scheduler: its queue is full, or the scheduler has ended (a
/// drain finished while a connection was still open, or an open was still dialling its next
/// stage).
fn unqueued<T>(e: &std::sync::mpsc::TrySendError<T>) -> (ErrorKind, &'static str) {
    match e {
        std::sync::mpsc::TrySendError::Full(_) => (ErrorKind::Overloaded, "the worker's queue is full"),
        std::sync::mpsc::TrySendError::Disconnected(_) => (ErrorKind::ShuttingDown, "the worker is shutting down"),
    }
}
