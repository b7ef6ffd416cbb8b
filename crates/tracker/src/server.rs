//! The tracker's network side. Every connection hears a `Challenge` first; its first frame then
//! says what it is: a worker joining (`Join`: a control connection for heartbeats, usage reports
//! and relay dials), a relay leg (`RelayConnect` from a client, `RelayAccept` from a worker
//! dialing back), or a client's first request. A connection that starts with "GET " is HTTP
//! (/metrics, /health).

use crate::metrics::Metrics;
use crate::registry::{LiveWorker, Registry};
use crate::store::{key_hash, Store, StoreError};
use bytes::Bytes;
use dgr_proto::{
    codec, read_frame, relay_addr, sign_ticket, verifying_key, worker_id, write_frame, Ack, Challenge, Join, Joined, KeyAdd, KeyAdded,
    Load, RefusalKind, Refused, Registration, RelayConnect, RelayDial, RequestUsage, RouteReply, RouteRequest, SigningKey, Suspect,
    SwarmReply, Ticket, TrackerBody, TrackerFrame, UsageQuery, UsageReply, WorkerStatus, PROTOCOL_VERSION, TRACKER_MAX_FRAME,
};
use ed25519_dalek::Signature;
use futures::{SinkExt, StreamExt};
use prost::Message;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio_util::codec::Framed;

const HANDSHAKE: Duration = Duration::from_secs(10);
/// The first frame of a connection is read exactly, before framing; it is small.
const FIRST_FRAME: usize = 64 << 10;
/// A client connection with no request for this long is closed.
const CLIENT_IDLE: Duration = Duration::from_secs(120);
/// How long a relay client waits for the worker to dial back.
const RELAY_DIAL: Duration = Duration::from_secs(5);

#[derive(Clone, Debug)]
pub struct TrackerConfig {
    pub db: PathBuf,
    pub join_token: String,
    /// Workers heartbeat this often; three missed ones take a worker out of new routes.
    pub heartbeat: Duration,
    /// How long a route ticket may wait before its session is opened.
    pub ticket_ttl: Duration,
    pub max_connections: usize,
}

impl TrackerConfig {
    pub fn new(db: PathBuf, join_token: String) -> TrackerConfig {
        TrackerConfig { db, join_token, heartbeat: Duration::from_millis(1000), ticket_ttl: Duration::from_secs(60), max_connections: 4096 }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TrackerError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

pub struct Tracker {
    shared: Arc<Shared>,
}

struct Shared {
    cfg: TrackerConfig,
    store: Mutex<Store>,
    registry: Mutex<Registry>,
    key: SigningKey,
    metrics: Metrics,
    /// Where clients reach this tracker (relayed workers' addresses point here).
    advertise: Mutex<String>,
    relays: Mutex<HashMap<Vec<u8>, oneshot::Sender<TcpStream>>>,
    next_conn: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

fn random<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    // getrandom fails only without an OS source of randomness; zeros would then be caught by
    // every use (a nonce or a session id that repeats is refused by its receiver).
    let _ = getrandom::fill(&mut b);
    b
}

fn refused(kind: RefusalKind, msg: impl Into<String>) -> TrackerBody {
    TrackerBody::Refused(Refused::new(kind, msg))
}

impl Tracker {
    pub fn open(cfg: TrackerConfig) -> Result<Tracker, TrackerError> {
        if let Some(dir) = cfg.db.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let store = Store::open(&cfg.db)?;
        let key = store.signing_key()?;
        let mut registry = Registry::new(cfg.heartbeat);
        registry.quarantined = store.quarantined()?.into_iter().collect();
        let shared = Shared {
            registry: Mutex::new(registry),
            cfg,
            store: Mutex::new(store),
            key,
            metrics: Metrics::default(),
            advertise: Mutex::new(String::new()),
            relays: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
        };
        Ok(Tracker { shared: Arc::new(shared) })
    }

    pub fn public_key_hex(&self) -> String {
        worker_id(&self.shared.key.verifying_key())
    }

    /// Whether API keys are required (any key was ever added).
    pub fn requires_keys(&self) -> Result<bool, TrackerError> {
        Ok(lock(&self.shared.store).has_keys()?)
    }

    /// Serves until `shutdown` completes. `advertise` is the address clients reach it on.
    pub async fn serve(
        self,
        listener: TcpListener,
        advertise: String,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), TrackerError> {
        *lock(&self.shared.advertise) = advertise;
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => return Ok(()),
                accepted = listener.accept() => {
                    let Ok((stream, _)) = accepted else { continue };
                    let sh = self.shared.clone();
                    if sh.metrics.connections_open.load(Relaxed) as usize >= sh.cfg.max_connections {
                        sh.metrics.connections_refused.fetch_add(1, Relaxed);
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    sh.metrics.connections_open.fetch_add(1, Relaxed);
                    tokio::spawn(async move {
                        connection(stream, &sh).await;
                        sh.metrics.connections_open.fetch_sub(1, Relaxed);
                    });
                }
            }
        }
    }
}

async fn connection(mut stream: TcpStream, sh: &Arc<Shared>) {
    // Every client speaks first: HTTP with "GET ", the tracker protocol with a Hello frame.
    let mut head = [0u8; 4];
    if !matches!(tokio::time::timeout(HANDSHAKE, stream.read_exact(&mut head)).await, Ok(Ok(_))) {
        return;
    }
    if &head == b"GET " {
        return http(stream, head.to_vec(), sh).await;
    }
    let hello = tokio::time::timeout(HANDSHAKE, read_body(&mut stream, u32::from_be_bytes(head) as usize)).await;
    match hello {
        Ok(Ok(TrackerFrame { body: Some(TrackerBody::Hello(h)) })) if h.protocol_version == PROTOCOL_VERSION => {}
        Ok(Ok(TrackerFrame { body: Some(TrackerBody::Hello(h)) })) => {
            let msg = format!("protocol version {} (this tracker speaks {PROTOCOL_VERSION})", h.protocol_version);
            let _ = write_frame(&mut stream, &TrackerFrame::new(refused(RefusalKind::BadRequest, msg))).await;
            return;
        }
        Ok(_) => {
            sh.metrics.refused("bad_frame");
            let _ = write_frame(&mut stream, &TrackerFrame::new(refused(RefusalKind::BadRequest, "expected Hello first"))).await;
            return;
        }
        Err(_) => return,
    }
    let nonce = random::<32>().to_vec();
    let challenge =
        Challenge { protocol_version: PROTOCOL_VERSION, nonce: nonce.clone(), tracker_key: sh.key.verifying_key().to_bytes().to_vec() };
    if write_frame(&mut stream, &TrackerFrame::new(TrackerBody::Challenge(challenge))).await.is_err() {
        return;
    }
    let first = match tokio::time::timeout(HANDSHAKE, read_frame(&mut stream, FIRST_FRAME)).await {
        Ok(Ok(TrackerFrame { body: Some(b) })) => b,
        Ok(Ok(_)) | Ok(Err(_)) => {
            sh.metrics.refused("bad_frame");
            let _ = write_frame(&mut stream, &TrackerFrame::new(refused(RefusalKind::BadRequest, "unreadable first frame"))).await;
            return;
        }
        Err(_) => return,
    };
    match first {
        TrackerBody::RelayConnect(rc) => relay_client(stream, rc, sh).await,
        TrackerBody::RelayAccept(d) => {
            if let Some(tx) = lock(&sh.relays).remove(&d.token) {
                let _ = tx.send(stream);
            }
        }
        TrackerBody::Join(j) => worker_session(stream, j, &nonce, sh).await,
        other => client_session(stream, other, sh).await,
    }
}

type Conn = Framed<TcpStream, tokio_util::codec::LengthDelimitedCodec>;

async fn send(conn: &mut Conn, body: TrackerBody) -> bool {
    conn.send(Bytes::from(TrackerFrame::new(body).encode_to_vec())).await.is_ok()
}

/// One request and its answer at a time, until the client goes or idles out.
async fn client_session(stream: TcpStream, first: TrackerBody, sh: &Arc<Shared>) {
    let mut conn = Framed::new(stream, codec(TRACKER_MAX_FRAME));
    let mut next = Some(first);
    loop {
        let body = match next.take() {
            Some(b) => b,
            None => match tokio::time::timeout(CLIENT_IDLE, conn.next()).await {
                Ok(Some(Ok(bytes))) => match TrackerFrame::decode(bytes) {
                    Ok(TrackerFrame { body: Some(b) }) => b,
                    _ => refused(RefusalKind::BadRequest, "undecodable frame"),
                },
                _ => return,
            },
        };
        let answer = match body {
            TrackerBody::Refused(r) => TrackerBody::Refused(r),
            b => answer(b, sh),
        };
        if let TrackerBody::Refused(r) = &answer {
            sh.metrics.refused(r.refusal_kind().name());
        }
        if !send(&mut conn, answer).await {
            return;
        }
    }
}

fn answer(body: TrackerBody, sh: &Arc<Shared>) -> TrackerBody {
    let result = match body {
        TrackerBody::RouteRequest(r) => route(r, sh),
        TrackerBody::RequestUsage(u) => request_usage(u, sh),
        TrackerBody::SwarmQuery(_) => Ok(swarm(sh)),
        TrackerBody::UsageQuery(q) => usage(q, sh),
        TrackerBody::KeyAdd(k) => key_add(k, sh),
        TrackerBody::Suspect(q) => suspect(q, sh),
        _ => Err(Refused::new(RefusalKind::BadRequest, "not a request a client may send")),
    };
    result.unwrap_or_else(TrackerBody::Refused)
}

fn store_err(e: StoreError) -> Refused {
    Refused::new(RefusalKind::Internal, e.to_string())
}

/// The key's name for the ledger: API keys are required once any exists; without any, every
/// request is "anonymous".
fn authorize(sh: &Shared, api_key: &str, check_quota: bool) -> Result<String, Refused> {
    let store = lock(&sh.store);
    if !store.has_keys().map_err(store_err)? {
        return Ok("anonymous".into());
    }
    let key = store.find_key(api_key).map_err(store_err)?.ok_or_else(|| Refused::new(RefusalKind::BadApiKey, "unknown API key"))?;
    if check_quota && key.quota_tokens > 0 {
        let used = store.key_used(&key.name).map_err(store_err)?;
        if used >= key.quota_tokens {
            let msg = format!("key {} has used {used} of its {} tokens", key.name, key.quota_tokens);
            return Err(Refused::new(RefusalKind::QuotaExceeded, msg));
        }
    }
    Ok(key.name)
}

fn route(r: RouteRequest, sh: &Shared) -> Result<TrackerBody, Refused> {
    let key_name = authorize(sh, &r.api_key, true)?;
    if r.budget_tokens == 0 || r.model_id.is_empty() {
        return Err(Refused::new(RefusalKind::BadRequest, "a route needs a model id and a token budget"));
    }
    let started = Instant::now();
    let planned = if r.fixed.is_empty() {
        lock(&sh.registry).plan_route(&r.model_id, &r.engine, &r.exclude)
    } else if r.fixed.len() > 1024 {
        return Err(Refused::new(RefusalKind::BadRequest, "at most 1024 fixed stages"));
    } else {
        lock(&sh.registry).plan_fixed(&r.model_id, &r.fixed, &r.exclude)
    };
    sh.metrics.planned(started.elapsed().as_micros() as u64);
    let p = planned.ok_or_else(|| Refused::new(RefusalKind::NoRoute, format!("no chain of live workers covers model {}", r.model_id)))?;
    let engine = {
        let reg = lock(&sh.registry);
        p.stages.first().and_then(|s| reg.workers.get(&s.worker_id)).map(|w| w.reg.engine.clone()).unwrap_or_default()
    };
    let ticket = Ticket {
        session_id: random::<16>().to_vec(),
        request_id: r.request_id,
        model_id: r.model_id,
        engine,
        stages: p.stages,
        budget_tokens: r.budget_tokens,
        expires_unix_ms: unix_ms() + sh.cfg.ticket_ttl.as_millis() as u64,
    };
    sh.metrics.routes_issued.fetch_add(1, Relaxed);
    Ok(TrackerBody::RouteReply(RouteReply {
        ticket: Some(sign_ticket(&ticket, &sh.key)),
        route: Some(ticket),
        hidden: p.hidden,
        n_layers: p.n_layers,
        vocab: p.vocab,
        key_name,
    }))
}

fn request_usage(u: RequestUsage, sh: &Shared) -> Result<TrackerBody, Refused> {
    let name = authorize(sh, &u.api_key, false)?;
    if u.request_id.is_empty() || u.request_id.len() > 256 || u.stages.len() > 1024 {
        return Err(Refused::new(RefusalKind::BadRequest, "a usage report needs a request id (≤ 256 bytes) and ≤ 1024 stages"));
    }
    let added = lock(&sh.store).record_request(&name, &u, unix_ms()).map_err(store_err)?;
    let counter = if added { &sh.metrics.usage_reports } else { &sh.metrics.usage_duplicates };
    counter.fetch_add(1, Relaxed);
    Ok(TrackerBody::Ack(Ack { duplicate: !added }))
}

fn swarm(sh: &Shared) -> TrackerBody {
    let reg = lock(&sh.registry);
    let now = Instant::now();
    let mut workers: Vec<WorkerStatus> = reg
        .workers
        .values()
        .map(|w| WorkerStatus {
            worker_id: w.id.clone(),
            registration: Some(Registration { addr: w.addr.clone(), ..w.reg.clone() }),
            load: Some(w.load),
            last_seen_ms: now.duration_since(w.last_heartbeat).as_millis() as u64,
            relayed: w.relayed,
            recent_routes: w.unseen_routes() as u32,
            routes_total: w.routes_total,
            quarantined: reg.quarantined.get(&w.id).cloned().unwrap_or_default(),
        })
        .collect();
    workers.sort_by(|a, b| {
        let key = |w: &WorkerStatus| w.registration.as_ref().map(|r| (r.model_id.clone(), r.layer_start, r.layer_end));
        key(a).cmp(&key(b)).then(a.worker_id.cmp(&b.worker_id))
    });
    TrackerBody::SwarmReply(SwarmReply { workers, heartbeat_ms: reg.heartbeat.as_millis() as u32 })
}

fn usage(q: UsageQuery, sh: &Shared) -> Result<TrackerBody, Refused> {
    let by_worker = match q.by.as_str() {
        "key" | "" => false,
        "worker" => true,
        other => return Err(Refused::new(RefusalKind::BadRequest, format!("usage by {other:?}: use key or worker"))),
    };
    let rows = lock(&sh.store).usage(by_worker).map_err(store_err)?;
    Ok(TrackerBody::UsageReply(UsageReply { rows }))
}

fn key_add(k: KeyAdd, sh: &Shared) -> Result<TrackerBody, Refused> {
    if !token_ok(&k.join_token, &sh.cfg.join_token) {
        return Err(Refused::new(RefusalKind::BadJoinToken, "adding a key needs the join token"));
    }
    if k.name.is_empty() || k.name.len() > 128 {
        return Err(Refused::new(RefusalKind::BadRequest, "a key needs a name of 1 to 128 bytes"));
    }
    if !k.key.is_empty() {
        if k.key.len() < 16 || k.key.len() > 256 {
            return Err(Refused::new(RefusalKind::BadRequest, "a chosen key must be 16 to 256 bytes"));
        }
        lock(&sh.store).put_key(&k.name, &k.key, k.quota_tokens, unix_ms()).map_err(store_err)?;
        return Ok(TrackerBody::KeyAdded(KeyAdded { key: k.key }));
    }
    let key = format!("dgr-{}", random::<24>().iter().map(|b| format!("{b:02x}")).collect::<String>());
    lock(&sh.store).add_key(&k.name, &key, k.quota_tokens, unix_ms()).map_err(|e| match e {
        StoreError::Sql(rusqlite::Error::SqliteFailure(f, _)) if f.code == rusqlite::ErrorCode::ConstraintViolation => {
            Refused::new(RefusalKind::BadRequest, format!("a key named {:?} exists", k.name))
        }
        e => store_err(e),
    })?;
    Ok(TrackerBody::KeyAdded(KeyAdded { key }))
}

/// A spot check caught a worker: it is out of every route from now on, also after a restart.
fn suspect(q: Suspect, sh: &Shared) -> Result<TrackerBody, Refused> {
    if !token_ok(&q.join_token, &sh.cfg.join_token) {
        return Err(Refused::new(RefusalKind::BadJoinToken, "a quarantine needs the join token"));
    }
    if q.worker_id.is_empty() || q.worker_id.len() > 128 || q.evidence.len() > 4096 {
        return Err(Refused::new(RefusalKind::BadRequest, "a worker id and at most 4 KiB of evidence"));
    }
    lock(&sh.store).quarantine(&q.worker_id, &q.evidence, unix_ms()).map_err(store_err)?;
    eprintln!("dgr tracker: quarantined worker {}: {}", q.worker_id, q.evidence);
    lock(&sh.registry).quarantined.insert(q.worker_id, q.evidence);
    Ok(TrackerBody::Ack(Ack::default()))
}

/// Compares secrets by their hashes, so the time taken says nothing about the token.
fn token_ok(given: &str, want: &str) -> bool {
    key_hash(given) == key_hash(want)
}

/// A worker's control connection: checks its join, then keeps its record live until it leaves,
/// the connection drops, or it re-joins on another connection.
async fn worker_session(mut stream: TcpStream, j: Join, nonce: &[u8], sh: &Arc<Shared>) {
    let reg = match check_join(&j, nonce, sh) {
        Ok(reg) => reg,
        Err((kind, msg)) => {
            sh.metrics.refused(kind.name());
            eprintln!("dgr tracker: refused a worker join: {msg}");
            let _ = write_frame(&mut stream, &TrackerFrame::new(refused(kind, msg))).await;
            return;
        }
    };
    let Some(key) = verifying_key(&j.identity) else { return };
    let id = worker_id(&key);
    let relayed = reg.addr.is_empty();
    let addr = if relayed { relay_addr(&lock(&sh.advertise), &id) } else { reg.addr.clone() };
    let joined = lock(&sh.store).worker_joined(&id, &reg, &addr, unix_ms());
    if let Err(e) = joined {
        let _ = write_frame(&mut stream, &TrackerFrame::new(TrackerBody::Refused(store_err(e)))).await;
        return;
    }
    let conn_id = sh.next_conn.fetch_add(1, Relaxed);
    let (control, mut control_rx) = mpsc::channel::<TrackerFrame>(256);
    let heartbeat = sh.cfg.heartbeat;
    {
        let live = LiveWorker {
            id: id.clone(),
            reg: reg.clone(),
            addr,
            relayed,
            conn: conn_id,
            last_heartbeat: Instant::now(),
            load: Load::default(),
            issued: Default::default(),
            routes_total: 0,
            control,
        };
        // A re-join under the same identity replaces the old record: never listed twice.
        lock(&sh.registry).workers.insert(id.clone(), live);
    }
    sh.metrics.joins.fetch_add(1, Relaxed);
    let mut conn = Framed::new(stream, codec(TRACKER_MAX_FRAME));
    let joined = Joined { worker_id: id.clone(), heartbeat_ms: heartbeat.as_millis() as u32 };
    if send(&mut conn, TrackerBody::Joined(joined)).await {
        worker_loop(&mut conn, &mut control_rx, &id, &reg, sh).await;
    }
    let mut registry = lock(&sh.registry);
    if registry.workers.get(&id).is_some_and(|w| w.conn == conn_id) {
        registry.workers.remove(&id);
    }
}

async fn worker_loop(conn: &mut Conn, control: &mut mpsc::Receiver<TrackerFrame>, id: &str, reg: &Registration, sh: &Arc<Shared>) {
    // A connection silent for this long is dead, even if TCP has not noticed.
    let silent = 30 * sh.cfg.heartbeat;
    loop {
        tokio::select! {
            f = control.recv() => {
                let Some(f) = f else { return };
                if conn.send(Bytes::from(f.encode_to_vec())).await.is_err() {
                    return;
                }
            }
            next = tokio::time::timeout(silent, conn.next()) => {
                let body = match next {
                    Ok(Some(Ok(bytes))) => match TrackerFrame::decode(bytes) {
                        Ok(TrackerFrame { body: Some(b) }) => b,
                        _ => return,
                    },
                    _ => return,
                };
                match body {
                    TrackerBody::Heartbeat(h) => {
                        if let Some(w) = lock(&sh.registry).workers.get_mut(id) {
                            w.last_heartbeat = Instant::now();
                            w.load = h.load.unwrap_or_default();
                        }
                    }
                    TrackerBody::WorkerUsage(u) => {
                        let stored = lock(&sh.store).record_worker_usage(id, &reg.engine, &reg.model_id, &u, unix_ms());
                        let reply = match stored {
                            Ok(added) => TrackerBody::Ack(Ack { duplicate: !added }),
                            Err(e) => TrackerBody::Refused(store_err(e)),
                        };
                        if !send(conn, reply).await {
                            return;
                        }
                    }
                    TrackerBody::Leave(_) => return,
                    _ => return,
                }
            }
        }
    }
}

fn check_join(j: &Join, nonce: &[u8], sh: &Shared) -> Result<Registration, (RefusalKind, String)> {
    if !token_ok(&j.join_token, &sh.cfg.join_token) {
        return Err((RefusalKind::BadJoinToken, "wrong join token".into()));
    }
    let key = verifying_key(&j.identity).ok_or((RefusalKind::BadSignature, "not an Ed25519 identity key".to_string()))?;
    let sig = Signature::from_slice(&j.signature).map_err(|_| (RefusalKind::BadSignature, "malformed signature".to_string()))?;
    key.verify_strict(nonce, &sig).map_err(|_| (RefusalKind::BadSignature, "the signature is not of this challenge".to_string()))?;
    let reg = j.registration.clone().ok_or((RefusalKind::BadRequest, "a join without a registration".to_string()))?;
    let bad = |m: String| Err((RefusalKind::BadRequest, m));
    if reg.n_layers == 0 || reg.layer_start >= reg.layer_end || reg.layer_end > reg.n_layers {
        return bad(format!("layers {}..{} of {}", reg.layer_start, reg.layer_end, reg.n_layers));
    }
    if reg.model_id.is_empty() || reg.model_id.len() > 256 || reg.engine.is_empty() || reg.engine.len() > 64 || reg.addr.len() > 512 {
        return bad("a registration needs a model id, an engine and an address of sane lengths".into());
    }
    if !reg.step_us_per_layer.is_finite() || reg.step_us_per_layer < 0.0 {
        return bad("a step time must be a finite non-negative number".into());
    }
    Ok(reg)
}

/// A client asks for a relayed worker: the worker is told to dial back, and the two sockets are
/// spliced.
async fn relay_client(mut client: TcpStream, rc: RelayConnect, sh: &Arc<Shared>) {
    let token = random::<16>().to_vec();
    let (tx, rx) = oneshot::channel();
    let control = {
        let reg = lock(&sh.registry);
        reg.workers.get(&rc.worker_id).filter(|w| w.relayed).map(|w| w.control.clone())
    };
    let dialed = match control {
        Some(c) => {
            lock(&sh.relays).insert(token.clone(), tx);
            c.try_send(TrackerFrame::new(TrackerBody::RelayDial(RelayDial { token: token.clone() }))).is_ok()
        }
        None => false,
    };
    let worker = if dialed { tokio::time::timeout(RELAY_DIAL, rx).await.ok().and_then(|r| r.ok()) } else { None };
    lock(&sh.relays).remove(&token);
    let Some(mut worker) = worker else {
        sh.metrics.refused(RefusalKind::NotConnected.name());
        let msg = format!("worker {} is not connected to this relay", rc.worker_id);
        let _ = write_frame(&mut client, &TrackerFrame::new(refused(RefusalKind::NotConnected, msg))).await;
        return;
    };
    if write_frame(&mut client, &TrackerFrame::new(TrackerBody::RelayReady(Ack::default()))).await.is_err() {
        return;
    }
    sh.metrics.relay_sessions.fetch_add(1, Relaxed);
    let _ = tokio::io::copy_bidirectional(&mut client, &mut worker).await;
}

/// The body of a frame whose length prefix was read already, `len` ≤ FIRST_FRAME bytes.
async fn read_body(s: &mut TcpStream, len: usize) -> std::io::Result<TrackerFrame> {
    if len > FIRST_FRAME {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "first frame too long"));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).await?;
    TrackerFrame::decode(body.as_slice()).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// GET /metrics and /health; anything else is 404. One request per connection; `head` holds
/// what was read of it already.
async fn http(mut stream: TcpStream, mut head: Vec<u8>, sh: &Shared) {
    let mut buf = [0u8; 1024];
    let read = tokio::time::timeout(Duration::from_secs(5), async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        true
    })
    .await;
    if read != Ok(true) {
        return;
    }
    let path = head.split(|b| *b == b' ').nth(1).unwrap_or_default();
    let (status, body) = match path {
        b"/metrics" => {
            let live = {
                let reg = lock(&sh.registry);
                let now = Instant::now();
                reg.workers.values().filter(|w| w.alive(reg.heartbeat, now)).count()
            };
            sh.metrics.workers_live.store(live as u64, Relaxed);
            sh.metrics.quarantined.store(lock(&sh.registry).quarantined.len() as u64, Relaxed);
            ("200 OK", sh.metrics.render())
        }
        b"/health" => ("200 OK", "ok\n".to_string()),
        _ => ("404 Not Found", "not found\n".to_string()),
    };
    let resp = format!(
        "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(resp.as_bytes()).await;
    let _ = stream.shutdown().await;
}
