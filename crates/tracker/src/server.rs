//! The tracker's network side: accepting connections (capped), the secure channel (the tracker
//! proves its signing key; `--insecure-plaintext` on both ends for clear), the opening (the
//! client's Hello, the tracker's `Challenge`), and the dispatch on the first frame: a worker
//! joining (`control`) or a client's first request (`answers`). A relay leg (`relay`) opens
//! with a Hello in clear instead, since its socket is spliced to a worker's and carries that
//! link's own end-to-end channel. A connection that starts with "GET " is HTTP (/metrics,
//! /health).

use crate::keys::KeySet;
use crate::metrics::Metrics;
use crate::registry::Registry;
use crate::store::{Ledger, LedgerSpec, StoreError};
use bytes::Bytes;
use dgr_proto::{
    is_preamble, read_frame, respond_as, write_frame, Challenge, Identity, RefusalKind, Refused, SecureError, SecureStream, SigningKey,
    TrackerBody, TrackerFrame, PROTOCOL_VERSION,
};
use futures::SinkExt;
use prost::Message;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio_util::codec::Framed;

const HANDSHAKE: Duration = Duration::from_secs(10);
/// The first frame of a connection is read exactly, before framing; it is small.
const FIRST_FRAME: usize = 64 << 10;

#[derive(Clone, Debug)]
pub struct TrackerConfig {
    pub ledger: LedgerSpec,
    /// Store threads (database connections); see `LedgerSpec::default_threads`.
    pub ledger_threads: usize,
    pub join_token: String,
    /// Workers heartbeat this often; three missed ones take a worker out of new routes.
    pub heartbeat: Duration,
    /// How long a route ticket may wait before its session is opened.
    pub ticket_ttl: Duration,
    pub max_connections: usize,
    /// How long a route's reservation of its budget holds if its usage is never recorded.
    pub reservation_ttl: Duration,
}

impl TrackerConfig {
    pub fn new(ledger: LedgerSpec, join_token: String) -> TrackerConfig {
        TrackerConfig {
            ledger_threads: ledger.default_threads(),
            ledger,
            join_token,
            heartbeat: Duration::from_millis(1000),
            ticket_ttl: Duration::from_secs(60),
            max_connections: 4096,
            reservation_ttl: Duration::from_secs(300),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TrackerError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("the link identity: {0}")]
    Link(#[from] SecureError),
}

pub struct Tracker {
    shared: Arc<Shared>,
}

pub(crate) struct Shared {
    pub(crate) cfg: TrackerConfig,
    pub(crate) store: Ledger,
    pub(crate) registry: Mutex<Registry>,
    pub(crate) keys: KeySet,
    /// What the tracker proves on its links: the key it signs tickets with.
    pub(crate) link: Identity,
    pub(crate) metrics: Metrics,
    /// Where clients reach this tracker (relayed workers' addresses point here).
    pub(crate) advertise: Mutex<String>,
    pub(crate) relays: Mutex<HashMap<Vec<u8>, oneshot::Sender<TcpStream>>>,
    pub(crate) next_conn: AtomicU64,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) use dgr_telemetry::unix_ms;

pub(crate) fn random<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    // getrandom fails only without an OS source of randomness; zeros would then be caught by
    // every use (a nonce or a session id that repeats is refused by its receiver).
    let _ = getrandom::fill(&mut b);
    b
}

pub(crate) fn refused(kind: RefusalKind, msg: impl Into<String>) -> TrackerBody {
    TrackerBody::Refused(Refused::new(kind, msg))
}

impl Tracker {
    pub fn open(cfg: TrackerConfig) -> Result<Tracker, TrackerError> {
        if let LedgerSpec::Sqlite(path) = &cfg.ledger {
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)?;
            }
        }
        let store = Ledger::start(&cfg.ledger, cfg.ledger_threads)?;
        let stored = store.call_blocking(|s| s.signing_keys())?;
        let (current, others) = stored.split_first().ok_or_else(|| StoreError::Decode("no signing key".into()))?;
        let others: Vec<SigningKey> = others.iter().map(|k| k.key.clone()).collect();
        let keys = KeySet::new(current.key.clone(), &others);
        let link = Identity::new(&current.key)?;
        let mut registry = Registry::new(cfg.heartbeat);
        registry.quarantined = store.call_blocking(|s| s.quarantined())?.into_iter().collect();
        let shared = Shared {
            registry: Mutex::new(registry),
            cfg,
            store,
            keys,
            link,
            metrics: Metrics::default(),
            advertise: Mutex::new(String::new()),
            relays: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
        };
        Ok(Tracker { shared: Arc::new(shared) })
    }

    /// The id of the key this tracker signs tickets with, in hex.
    pub fn key_id(&self) -> String {
        format!("{:016x}", self.shared.keys.current_id())
    }

    /// The key this tracker proves on its links (its signing key's public half), in hex: what
    /// clients pin with `--tracker-key`.
    pub fn link_key(&self) -> String {
        hex::encode(self.shared.link.public().as_bytes())
    }

    /// Whether API keys are required (any key was ever added).
    pub fn requires_keys(&self) -> Result<bool, TrackerError> {
        Ok(self.shared.store.call_blocking(|s| s.has_keys())?)
    }

    /// Serves until `shutdown` completes. `advertise` is the address clients reach it on.
    pub async fn serve(
        self,
        listener: TcpListener,
        advertise: String,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), TrackerError> {
        *lock(&self.shared.advertise) = advertise;
        let sweeper = tokio::spawn(expire_reservations(self.shared.clone()));
        let _stop_sweeper = AbortOnDrop(sweeper);
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

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Gives back the room of reservations whose requests never reported (a driver that died),
/// a few times per TTL, so an expired reservation lingers at most a quarter TTL more.
async fn expire_reservations(sh: Arc<Shared>) {
    let every = (sh.cfg.reservation_ttl / 4).clamp(Duration::from_millis(100), Duration::from_secs(30));
    let mut tick = tokio::time::interval(every);
    loop {
        tick.tick().await;
        match sh.store.call(|s| s.expire_reservations(unix_ms())).await {
            Ok(0) => {}
            Ok(n) => {
                sh.metrics.reservations_expired.fetch_add(n as u64, Relaxed);
            }
            Err(e) => eprintln!("dgr tracker: expiring reservations: {e}"),
        }
    }
}

async fn connection(mut stream: TcpStream, sh: &Arc<Shared>) {
    // Every client speaks first: HTTP with "GET ", the secure channel with its preamble, a relay
    // leg with a Hello frame in clear.
    let mut head = [0u8; 4];
    if !matches!(tokio::time::timeout(HANDSHAKE, stream.read_exact(&mut head)).await, Ok(Ok(_))) {
        return;
    }
    if &head == b"GET " {
        return http(stream, head.to_vec(), sh).await;
    }
    if !is_preamble(&head) {
        return relay_leg(stream, head, sh).await;
    }
    // The address this client reached: what a relayed worker's address names when this tracker
    // listens on all interfaces and was not told which one to advertise.
    let reached = stream.local_addr().ok();
    let mut link = match respond_as(&sh.link, head, stream, HANDSHAKE).await {
        Ok(link) => link,
        Err(e) => {
            sh.metrics.refused("link");
            eprintln!("dgr tracker: refused a link: {e}");
            return;
        }
    };
    let mut len = [0u8; 4];
    if !matches!(tokio::time::timeout(HANDSHAKE, link.read_exact(&mut len)).await, Ok(Ok(_))) {
        return;
    }
    let Some((nonce, first)) = opening(&mut link, len, sh).await else { return };
    match first {
        // The join's signature of this connection's nonce proves its key, whatever key the link
        // proved (a load generator joins many workers over links of its own one key).
        TrackerBody::Join(j) => crate::control::worker_session(link, j, &nonce, reached, sh).await,
        TrackerBody::RelayConnect(_) | TrackerBody::RelayAccept(_) => {
            sh.metrics.refused("bad_frame");
            let msg = "a relay leg opens with a Hello in clear: its socket is spliced as it is";
            let _ = write_frame(&mut link, &TrackerFrame::new(refused(RefusalKind::BadRequest, msg))).await;
        }
        other => crate::answers::client_session(link, other, sh).await,
    }
}

/// A relay leg: a Hello in clear (its length prefix in `head`), then RelayConnect or
/// RelayAccept; its socket is then spliced to a worker's as it is, carrying that link's own
/// end-to-end channel. Anything else needs the secure channel.
async fn relay_leg(mut stream: TcpStream, head: [u8; 4], sh: &Arc<Shared>) {
    let Some((_, first)) = opening(&mut stream, head, sh).await else { return };
    match first {
        TrackerBody::RelayConnect(rc) => crate::relay::relay_client(stream, rc, sh).await,
        TrackerBody::RelayAccept(d) => {
            if let Some(tx) = lock(&sh.relays).remove(&d.token) {
                let _ = tx.send(stream);
            }
        }
        _ => {
            sh.metrics.refused("plaintext");
            let msg = "this tracker takes requests on encrypted links only (both ends need --insecure-plaintext for clear)";
            let _ = write_frame(&mut stream, &TrackerFrame::new(refused(RefusalKind::BadRequest, msg))).await;
        }
    }
}

/// The opening after the Hello's length prefix `len`: the Hello, the tracker's challenge, and
/// the client's first frame (read exactly, so a relay leg's socket holds nothing more), with
/// the challenge's nonce; None once the connection is refused or gone.
async fn opening<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, len: [u8; 4], sh: &Arc<Shared>) -> Option<(Vec<u8>, TrackerBody)> {
    let hello = tokio::time::timeout(HANDSHAKE, read_body(s, u32::from_be_bytes(len) as usize)).await;
    match hello {
        Ok(Ok(TrackerFrame { body: Some(TrackerBody::Hello(h)) })) if h.protocol_version == PROTOCOL_VERSION => {}
        Ok(Ok(TrackerFrame { body: Some(TrackerBody::Hello(h)) })) => {
            let msg = format!("protocol version {} (this tracker speaks {PROTOCOL_VERSION})", h.protocol_version);
            let _ = write_frame(s, &TrackerFrame::new(refused(RefusalKind::BadRequest, msg))).await;
            return None;
        }
        Ok(_) => {
            sh.metrics.refused("bad_frame");
            let _ = write_frame(s, &TrackerFrame::new(refused(RefusalKind::BadRequest, "expected Hello first"))).await;
            return None;
        }
        Err(_) => return None,
    }
    let nonce = random::<32>().to_vec();
    let challenge = Challenge { protocol_version: PROTOCOL_VERSION, nonce: nonce.clone(), keys: sh.keys.public().to_vec() };
    write_frame(s, &TrackerFrame::new(TrackerBody::Challenge(challenge))).await.ok()?;
    match tokio::time::timeout(HANDSHAKE, read_frame(s, FIRST_FRAME)).await {
        Ok(Ok(TrackerFrame { body: Some(b) })) => Some((nonce, b)),
        Ok(Ok(_)) | Ok(Err(_)) => {
            sh.metrics.refused("bad_frame");
            let _ = write_frame(s, &TrackerFrame::new(refused(RefusalKind::BadRequest, "unreadable first frame"))).await;
            None
        }
        Err(_) => None,
    }
}

pub(crate) type Conn = Framed<SecureStream, tokio_util::codec::LengthDelimitedCodec>;

pub(crate) async fn send(conn: &mut Conn, body: TrackerBody) -> bool {
    conn.send(Bytes::from(TrackerFrame::new(body).encode_to_vec())).await.is_ok()
}

/// The body of a frame whose length prefix was read already, `len` ≤ FIRST_FRAME bytes.
async fn read_body<S: AsyncRead + Unpin>(s: &mut S, len: usize) -> std::io::Result<TrackerFrame> {
    if len > FIRST_FRAME {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "first frame too long"));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).await?;
    TrackerFrame::decode(body.as_slice()).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// GET /metrics and /health; anything else is 404.
async fn http(stream: TcpStream, head: Vec<u8>, sh: &Shared) {
    dgr_telemetry::http::serve_get(stream, head, |path| match path {
        b"/metrics" => {
            let live = {
                let reg = lock(&sh.registry);
                let now = Instant::now();
                reg.workers().filter(|w| w.alive(reg.heartbeat, now)).count()
            };
            sh.metrics.workers_live.store(live as u64, Relaxed);
            sh.metrics.quarantined.store(lock(&sh.registry).quarantined.len() as u64, Relaxed);
            ("200 OK", sh.metrics.render())
        }
        b"/health" => ("200 OK", "ok\n".to_string()),
        _ => ("404 Not Found", "not found\n".to_string()),
    })
    .await
}
