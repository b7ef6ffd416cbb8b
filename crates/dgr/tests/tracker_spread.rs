//! Acceptance: the tracker's load balancing, join refusal and liveness, against a real
//! `dgr tracker` process. The workers are fakes in this test: they speak the tracker protocol
//! (join, heartbeats carrying the sessions they count as open) and serve nothing, so the figures
//! measure the tracker's decisions alone. The last test checks the prefix reports and probes of
//! cache-aware routing the same way.

use dgr_proto::{
    tenant_mask, Heartbeat, Load, PrefixHeld, PrefixProbe, RefusalKind, Registration, RouteRequest, SigningKey, SwarmQuery, SwarmReply,
    TrackerBody, TrackerCallError, TrackerClient, TrackerFrame, MAX_HELD_DIGESTS, MAX_OPENED_TAGS,
};
use futures::{SinkExt, StreamExt};
use prost::bytes::Bytes;
use prost::Message;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TOKEN: &str = "tracker-spread-join-token";
const CALL: Duration = Duration::from_secs(10);

/// One test at a time: the timing checks (out of routes within 1 s, shares under sustained load)
/// must not share the few cores with another test's tracker and workers. An async lock, as it
/// is held across awaits; it works across the tests' separate runtimes.
async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

// ---------------------------------------------------------------------------------------------
// The tracker process

/// A `dgr tracker` in its own temporary directory; killed, and the directory removed, on drop.
struct TrackerProc {
    child: Child,
    addr: String,
    dir: PathBuf,
    log: Arc<Mutex<Vec<u8>>>,
}

impl TrackerProc {
    fn start(heartbeat_ms: u64) -> TrackerProc {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!("dgr-tracker-spread-{}-{}", std::process::id(), N.fetch_add(1, Relaxed)));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let token_file = dir.join("join-token");
        std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_dgr"))
            .args(["tracker", "--listen", "127.0.0.1:0", "--heartbeat-ms", &heartbeat_ms.to_string()])
            .arg("--db")
            .arg(dir.join("tracker.db"))
            .arg("--join-token-file")
            .arg(&token_file)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning dgr tracker");
        // Both pipes are drained on threads so the tracker never blocks writing to them.
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = stdout.read_line(&mut line);
            let _ = ready_tx.send(line);
            let _ = std::io::copy(&mut stdout, &mut std::io::sink());
        });
        let log = Arc::new(Mutex::new(Vec::new()));
        let (mut stderr, sink) = (child.stderr.take().unwrap(), log.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = stderr.read(&mut buf) {
                sink.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        let mut t = TrackerProc { child, addr: String::new(), dir, log };
        let line = ready_rx.recv_timeout(Duration::from_secs(30)).unwrap_or_default();
        let ready: serde_json::Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("dgr tracker printed no ready line ({e}): {line:?}\n{}", t.log()));
        t.addr = ready["listening"].as_str().unwrap_or_else(|| panic!("no \"listening\" in {line}")).to_string();
        t
    }

    fn log(&self) -> String {
        String::from_utf8_lossy(&self.log.lock().unwrap()).into_owned()
    }
}

impl Drop for TrackerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- dgr tracker stderr ---\n{}", self.log());
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// GET /metrics on the tracker's port, plain HTTP/1.1.
async fn metrics(addr: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let mut out = String::new();
    tokio::time::timeout(CALL, s.read_to_string(&mut out)).await.expect("/metrics in time").unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "GET /metrics: {out}");
    out
}

// ---------------------------------------------------------------------------------------------
// Fake workers and clients

/// A whole-model registration of model "m" (so each worker is one replica chain).
fn registration(n_layers: u32, step_us_per_layer: f64) -> Registration {
    Registration {
        engine: "test".into(),
        model_id: "m".into(),
        n_layers,
        layer_start: 0,
        layer_end: n_layers,
        hidden: 64,
        vocab: 1000,
        // Never dialed: the tracker only hands it out.
        addr: "127.0.0.1:9".into(),
        kv_tokens: 1 << 20,
        max_sessions: 1000,
        threads: 1,
        step_us_per_layer,
        max_positions: 4096,
        version: "test".into(),
    }
}

fn new_key() -> SigningKey {
    dgr_proto::new_signing_key().expect("randomness")
}

/// Connects and joins; `sign_wrong_nonce` signs 32 zero bytes instead of the challenge.
async fn try_join(
    addr: &str,
    key: &SigningKey,
    token: &str,
    reg: Registration,
    sign_wrong_nonce: bool,
) -> Result<(TrackerClient, String), TrackerCallError> {
    let mut c = TrackerClient::connect(addr, CALL).await?;
    if sign_wrong_nonce {
        c.challenge.nonce = vec![0u8; 32];
    }
    let joined = c.join(key, token, reg).await?;
    Ok((c, joined.worker_id))
}

/// A joined fake worker: heartbeats every `heartbeat` with the sessions the test counts as open
/// on it, until told to fall silent or until its connection is dropped.
struct FakeWorker {
    id: String,
    open: Arc<AtomicU32>,
    beating: Arc<AtomicBool>,
    last_beat: Arc<Mutex<Instant>>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeWorker {
    async fn join(addr: &str, key: &SigningKey, reg: Registration, heartbeat: Duration) -> FakeWorker {
        let (client, id) = try_join(addr, key, TOKEN, reg, false).await.unwrap_or_else(|e| panic!("join: {e}"));
        let open = Arc::new(AtomicU32::new(0));
        let beating = Arc::new(AtomicBool::new(true));
        let last_beat = Arc::new(Mutex::new(Instant::now()));
        let (o, b, l) = (open.clone(), beating.clone(), last_beat.clone());
        let task = tokio::spawn(async move {
            let mut conn = client.into_framed();
            let mut tick = tokio::time::interval(heartbeat);
            loop {
                tokio::select! {
                    _ = tick.tick() => {
                        if !b.load(Relaxed) {
                            continue;
                        }
                        let load = Load { sessions: o.load(Relaxed), ..Default::default() };
                        let frame = TrackerFrame::new(TrackerBody::Heartbeat(Heartbeat { load: Some(load), prefix: None, opened: Vec::new() }));
                        if conn.send(Bytes::from(frame.encode_to_vec())).await.is_err() {
                            return;
                        }
                        *l.lock().unwrap() = Instant::now();
                    }
                    // Nothing is sent to a worker with an address; reading notices a close.
                    next = conn.next() => {
                        if !matches!(next, Some(Ok(_))) {
                            return;
                        }
                    }
                }
            }
        });
        FakeWorker { id, open, beating, last_beat, task }
    }

    /// Closes its control connection (the task owning the socket is dropped).
    fn drop_connection(&self) {
        self.task.abort();
    }
}

impl Drop for FakeWorker {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn client(addr: &str) -> TrackerClient {
    TrackerClient::connect(addr, CALL).await.unwrap_or_else(|e| panic!("client connect: {e}"))
}

/// Asks for a route of model "m"; returns the worker id of each stage.
async fn route(c: &mut TrackerClient, request_id: String) -> Vec<String> {
    let req = RouteRequest { model_id: "m".into(), budget_tokens: 100, request_id, ..Default::default() };
    match c.call(TrackerBody::RouteRequest(req)).await {
        Ok(TrackerBody::RouteReply(r)) => r.route.expect("a route in the reply").stages.into_iter().map(|s| s.worker_id).collect(),
        other => panic!("route request answered with {other:?}"),
    }
}

/// The one worker of a whole-model route.
async fn route_one(c: &mut TrackerClient, request_id: String) -> String {
    let stages = route(c, request_id).await;
    assert_eq!(stages.len(), 1, "whole-model replicas make one-stage routes: {stages:?}");
    stages.into_iter().next().unwrap()
}

async fn swarm(c: &mut TrackerClient) -> Vec<String> {
    match c.call(TrackerBody::SwarmQuery(SwarmQuery {})).await {
        Ok(TrackerBody::SwarmReply(r)) => r.workers.into_iter().map(|w| w.worker_id).collect(),
        other => panic!("swarm query answered with {other:?}"),
    }
}

/// Routes asked every `every` for `span`: when each was asked, and its worker.
async fn sample_routes(c: &mut TrackerClient, span: Duration, every: Duration) -> Vec<(Instant, String)> {
    let (start, mut out) = (Instant::now(), Vec::new());
    while start.elapsed() < span {
        let asked = Instant::now();
        out.push((asked, route_one(c, format!("sample-{}", out.len())).await));
        tokio::time::sleep(every).await;
    }
    out
}

/// Sessions per worker, in the order of `workers`.
fn counts(workers: &[FakeWorker], chosen: &[String]) -> Vec<usize> {
    workers.iter().map(|w| chosen.iter().filter(|c| **c == w.id).count()).collect()
}

// ---------------------------------------------------------------------------------------------
// Spreading

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_routes_spread_evenly_over_equal_replicas() {
    let _serial = serial().await;
    let tracker = TrackerProc::start(100);
    let hb = Duration::from_millis(100);
    // Four whole-model workers: exactly four equal replica chains.
    let mut workers = Vec::new();
    for _ in 0..4 {
        workers.push(FakeWorker::join(&tracker.addr, &new_key(), registration(80, 300.0), hb).await);
    }
    let mut c = client(&tracker.addr).await;
    let started = Instant::now();
    let mut chosen = Vec::with_capacity(1000);
    for i in 0..1000 {
        chosen.push(route_one(&mut c, format!("seq-{i}")).await);
        // A sequential client runs each (short) session before asking again; the gap also makes
        // the run cross ~20 heartbeats of every worker, each of which resets its unseen routes.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let took = started.elapsed();
    let n = counts(&workers, &chosen);
    assert_eq!(n.iter().sum::<usize>(), 1000, "every route names one of the four replicas: {n:?}");
    let max_over_mean = *n.iter().max().unwrap() as f64 / 250.0;
    println!("1000 sequential routes in {took:?} over 4 replicas: {n:?}, max/mean {max_over_mean:.3} (limit 1.1)");
    assert!(max_over_mean <= 1.1, "sessions per replica {n:?}: max/mean {max_over_mean:.3} > 1.1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simultaneous_routes_spread_evenly_over_equal_replicas() {
    let _serial = serial().await;
    let tracker = TrackerProc::start(1000);
    let hb = Duration::from_millis(1000);
    let mut workers = Vec::new();
    for _ in 0..4 {
        workers.push(FakeWorker::join(&tracker.addr, &new_key(), registration(80, 300.0), hb).await);
    }
    // Each session opens as soon as its route arrives and stays open, so a heartbeat landing
    // during the burst reports what was routed to that worker so far.
    let open: Arc<HashMap<String, Arc<AtomicU32>>> = Arc::new(workers.iter().map(|w| (w.id.clone(), w.open.clone())).collect());
    // 64 connections made first, then released together so the requests arrive at once.
    let barrier = Arc::new(tokio::sync::Barrier::new(64));
    let mut tasks = Vec::new();
    for i in 0..64 {
        let mut c = client(&tracker.addr).await;
        let (barrier, open) = (barrier.clone(), open.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let w = route_one(&mut c, format!("burst-{i}")).await;
            open[&w].fetch_add(1, Relaxed);
            w
        }));
    }
    let mut chosen = Vec::new();
    for t in tasks {
        chosen.push(t.await.unwrap());
    }
    let n = counts(&workers, &chosen);
    assert_eq!(n.iter().sum::<usize>(), 64, "every route names one of the four replicas: {n:?}");
    let (max, min) = (*n.iter().max().unwrap(), *n.iter().min().unwrap());
    let ratio = max as f64 / min.max(1) as f64;
    println!("64 simultaneous routes over 4 replicas: {n:?}, max/min {ratio:.3} (limit 1.5)");
    assert!(min > 0 && ratio <= 1.5, "sessions per replica {n:?}: max/min {ratio:.3} > 1.5");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sustained_load_follows_measured_speed() {
    let _serial = serial().await;
    let hb_ms = 100;
    let tracker = TrackerProc::start(hb_ms);
    let hb = Duration::from_millis(hb_ms);
    // 200 µs vs 400 µs per layer: the fast replica should take twice the sessions.
    let fast = FakeWorker::join(&tracker.addr, &new_key(), registration(30, 200.0), hb).await;
    let slow = FakeWorker::join(&tracker.addr, &new_key(), registration(30, 400.0), hb).await;
    let open: HashMap<String, Arc<AtomicU32>> = [(fast.id.clone(), fast.open.clone()), (slow.id.clone(), slow.open.clone())].into();

    // 100 routes a second; each session stays open 1–2 s on the worker it was routed to, which
    // reports it in its heartbeats. About 150 sessions are open at once in the steady state.
    let (warmup, measure) = (Duration::from_millis(2500), Duration::from_secs(5));
    let mut c = client(&tracker.addr).await;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    let started = Instant::now();
    let (mut fast_n, mut slow_n, mut i) = (0u32, 0u32, 0u64);
    while started.elapsed() < warmup + measure {
        tick.tick().await;
        let w = route_one(&mut c, format!("load-{i}")).await;
        let counter = open[&w].clone();
        counter.fetch_add(1, Relaxed);
        let lasts = Duration::from_millis(1000 + (i * 389) % 1000);
        tokio::spawn(async move {
            tokio::time::sleep(lasts).await;
            counter.fetch_sub(1, Relaxed);
        });
        if started.elapsed() >= warmup {
            if w == fast.id {
                fast_n += 1;
            } else {
                slow_n += 1;
            }
        }
        i += 1;
    }
    let ratio = fast_n as f64 / slow_n.max(1) as f64;
    let (fo, so) = (fast.open.load(Relaxed), slow.open.load(Relaxed));
    println!(
        "sustained load: after {warmup:?} warm-up, {} routes in {measure:?}: fast {fast_n}, slow {slow_n}, \
         fast/slow {ratio:.3} (want 1.8..=2.2); open at the end: fast {fo}, slow {so}",
        fast_n + slow_n
    );
    assert!((1.8..=2.2).contains(&ratio), "fast/slow share {ratio:.3} ({fast_n} vs {slow_n}) is not within 10% of 2");
}

// ---------------------------------------------------------------------------------------------
// Refusals

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_join_token_and_bad_signature_are_refused_and_counted() {
    let _serial = serial().await;
    let tracker = TrackerProc::start(1000);
    let key = new_key();

    let refusal = |r: Result<(TrackerClient, String), TrackerCallError>| match r {
        Err(TrackerCallError::Refused(r)) => r.refusal_kind(),
        Ok((_, id)) => panic!("the join was admitted as {id}"),
        Err(e) => panic!("the join failed without a refusal: {e}"),
    };
    let wrong_token = try_join(&tracker.addr, &key, "not-the-token", registration(30, 300.0), false).await;
    assert_eq!(refusal(wrong_token), RefusalKind::BadJoinToken);
    let wrong_nonce = try_join(&tracker.addr, &key, TOKEN, registration(30, 300.0), true).await;
    assert_eq!(refusal(wrong_nonce), RefusalKind::BadSignature);

    let m = metrics(&tracker.addr).await;
    let lines: Vec<&str> = m.lines().filter(|l| l.starts_with("dgr_tracker_refusals_total{")).collect();
    println!("refusals at /metrics: {lines:?}");
    for want in ["dgr_tracker_refusals_total{kind=\"bad_join_token\"} 1", "dgr_tracker_refusals_total{kind=\"bad_signature\"} 1"] {
        assert!(m.lines().any(|l| l == want), "/metrics lacks {want:?}:\n{m}");
    }
    // Neither refused join left a record behind.
    assert!(swarm(&mut client(&tracker.addr).await).await.is_empty(), "a refused worker is listed");
}

// ---------------------------------------------------------------------------------------------
// Liveness

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_or_silent_workers_leave_routes_and_rejoins_are_listed_once() {
    let _serial = serial().await;
    let hb_ms = 200;
    let tracker = TrackerProc::start(hb_ms);
    let hb = Duration::from_millis(hb_ms);
    let every = Duration::from_millis(5);
    let mut c = client(&tracker.addr).await;
    let keep = FakeWorker::join(&tracker.addr, &new_key(), registration(30, 300.0), hb).await;

    // A dropped connection: out of new routes within 1 s.
    let dropped = FakeWorker::join(&tracker.addr, &new_key(), registration(30, 300.0), hb).await;
    let before = sample_routes(&mut c, Duration::from_millis(300), every).await;
    assert!(before.iter().any(|(_, w)| *w == dropped.id), "the worker got no routes while connected");
    let t0 = Instant::now();
    dropped.drop_connection();
    let after = sample_routes(&mut c, Duration::from_millis(1500), every).await;
    let last = after.iter().filter(|(_, w)| *w == dropped.id).map(|(t, _)| t.duration_since(t0)).max();
    println!("dropped connection: last named {last:?} after the drop (limit 1 s), {} routes sampled", after.len());
    let late: Vec<_> = after.iter().filter(|(t, w)| t.duration_since(t0) >= Duration::from_secs(1) && *w == dropped.id).collect();
    assert!(late.is_empty(), "{} routes named the dropped worker more than 1 s after its connection closed", late.len());
    assert!(after.iter().any(|(t, _)| t.duration_since(t0) >= Duration::from_secs(1)), "no routes sampled after 1 s");

    // Silent but connected: out within three heartbeat intervals of its last heartbeat. It is
    // 30× faster than the other, so its routes issued since its last heartbeat do not price it
    // out first: it stays the cheapest choice until it stops being live.
    let silent = FakeWorker::join(&tracker.addr, &new_key(), registration(30, 10.0), hb).await;
    let before = sample_routes(&mut c, Duration::from_millis(300), every).await;
    assert!(before.iter().any(|(_, w)| *w == silent.id), "the worker got no routes while heartbeating");
    silent.beating.store(false, Relaxed);
    // A heartbeat being sent as the flag drops is the last one; let it land first.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let beat = *silent.last_beat.lock().unwrap();
    let after = sample_routes(&mut c, 3 * hb + Duration::from_millis(500), every).await;
    let last = after.iter().filter(|(_, w)| *w == silent.id).map(|(t, _)| t.duration_since(beat)).max();
    println!("silent worker: last named {last:?} after its last heartbeat (limit 3 × {hb:?})");
    // The slack covers the heartbeat's own trip to the tracker.
    let limit = 3 * hb + Duration::from_millis(50);
    let late = after.iter().filter(|(t, w)| t.duration_since(beat) > limit && *w == silent.id).count();
    assert_eq!(late, 0, "{late} routes named the silent worker more than {limit:?} after its last heartbeat");
    assert!(after.iter().any(|(t, _)| t.duration_since(beat) > limit), "no routes sampled after the limit");

    // A re-join under the same identity on a new connection replaces the record: listed once,
    // and the old connection closing later does not remove it.
    let key = new_key();
    let first = FakeWorker::join(&tracker.addr, &key, registration(30, 300.0), hb).await;
    let second = FakeWorker::join(&tracker.addr, &key, registration(30, 300.0), hb).await;
    assert_eq!(first.id, second.id, "one identity key, one worker id");
    let listed = |ids: &[String]| ids.iter().filter(|w| **w == second.id).count();
    let ids = swarm(&mut c).await;
    assert_eq!(listed(&ids), 1, "re-joined worker listed {} times: {ids:?}", listed(&ids));
    first.drop_connection();
    tokio::time::sleep(2 * hb).await;
    let ids = swarm(&mut c).await;
    assert_eq!(listed(&ids), 1, "after its old connection closed, the re-joined worker is listed {} times", listed(&ids));
    let routed = sample_routes(&mut c, Duration::from_millis(200), every).await;
    assert!(routed.iter().any(|(_, w)| *w == second.id), "the re-joined worker gets no routes");
    println!("re-join: listed once among {} workers, still routed after the old connection closed", ids.len());
    drop(keep);
}

/// Live workers with no room left are refused as `Full` (the gateway waits for room), a model no
/// live worker covers as `NoRoute` (it answers at once); room comes back with the heartbeat that
/// counts the sessions ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_workers_and_uncovered_models_are_refused_apart() {
    let _serial = serial().await;
    let hb_ms = 200;
    let tracker = TrackerProc::start(hb_ms);
    let hb = Duration::from_millis(hb_ms);
    let mut c = client(&tracker.addr).await;
    let reg = Registration { max_sessions: 2, ..registration(30, 300.0) };
    let w = FakeWorker::join(&tracker.addr, &new_key(), reg, hb).await;
    let refused = |answer: Result<TrackerBody, TrackerCallError>| match answer {
        Err(TrackerCallError::Refused(r)) => r.refusal_kind(),
        other => panic!("expected a refusal, got {other:?}"),
    };
    let ask = |model: &str, id: &str| {
        TrackerBody::RouteRequest(RouteRequest { model_id: model.into(), budget_tokens: 10, request_id: id.into(), ..Default::default() })
    };
    w.open.store(2, Relaxed);
    tokio::time::sleep(2 * hb).await;
    assert_eq!(refused(c.call(ask("m", "full-1")).await), RefusalKind::Full, "both sessions of its 2 are open");
    assert_eq!(refused(c.call(ask("nobody-serves-this", "uncovered")).await), RefusalKind::NoRoute);
    w.open.store(0, Relaxed);
    tokio::time::sleep(2 * hb).await;
    assert_eq!(route_one(&mut c, "room-again".into()).await, w.id);
    // Two routes issued fill it until a heartbeat says otherwise.
    route_one(&mut c, "second".into()).await;
    assert_eq!(refused(c.call(ask("m", "full-2")).await), RefusalKind::Full);
    // Dead, it is no longer full but gone.
    w.beating.store(false, Relaxed);
    tokio::time::sleep(4 * hb).await;
    assert_eq!(refused(c.call(ask("m", "gone")).await), RefusalKind::NoRoute);
}

// ---------------------------------------------------------------------------------------------
// Prefix reports and probes

/// Requests for one prompt go to the replica that reported holding it (counted at /metrics);
/// a heartbeat naming more prefix blocks or opened sessions than the protocol allows, and a
/// route request with too many or disordered probes, are typed refusals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_holders_are_preferred_and_oversized_reports_are_refused() {
    let _serial = serial().await;
    // Heartbeats a second apart: the holder, beating once, stays live for the test.
    let tracker = TrackerProc::start(1000);
    let mut c = client(&tracker.addr).await;
    let probes: Vec<PrefixProbe> = (1..=8).map(|b| PrefixProbe { blocks: b, chain: 0xabc0 + u64::from(b) }).collect();
    // Without API keys routes are billed to (and cached under) "anonymous".
    let mask = tenant_mask("anonymous");
    let held: Vec<u64> = probes.iter().map(|p| p.chain ^ mask).collect();

    let (holder, holder_id) = try_join(&tracker.addr, &new_key(), TOKEN, registration(4, 100.0), false).await.unwrap();
    let other = FakeWorker::join(&tracker.addr, &new_key(), registration(4, 100.0), Duration::from_secs(1)).await;
    let beat = |digests: Vec<u64>| {
        let prefix = Some(PrefixHeld { digests });
        Bytes::from(
            TrackerFrame::new(TrackerBody::Heartbeat(Heartbeat { load: Some(Load::default()), prefix, opened: Vec::new() }))
                .encode_to_vec(),
        )
    };
    let mut conn = holder.into_framed();
    conn.send(beat(held.clone())).await.unwrap();
    let listed = |r: &SwarmReply| r.workers.iter().find(|w| w.worker_id == holder_id).map(|w| w.prefix_blocks);
    let deadline = Instant::now() + CALL;
    loop {
        let TrackerBody::SwarmReply(r) = c.call(TrackerBody::SwarmQuery(SwarmQuery {})).await.unwrap() else { panic!("no swarm") };
        if listed(&r) == Some(8) {
            break;
        }
        assert!(Instant::now() < deadline, "the holder's report never showed: {:?}", listed(&r));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let ask = |request_id: &str, prefix: Vec<PrefixProbe>| {
        TrackerBody::RouteRequest(RouteRequest {
            model_id: "m".into(),
            budget_tokens: 100,
            request_id: request_id.into(),
            prefix,
            ..Default::default()
        })
    };
    // One route at a time with the holder idle: each goes to the holder (one route in its load
    // is under twice the idle other's).
    let TrackerBody::RouteReply(r) = c.call(ask("hit", probes.clone())).await.unwrap() else { panic!("no route") };
    assert_eq!(r.route.unwrap().stages[0].worker_id, holder_id);
    let text = metrics(&tracker.addr).await;
    assert!(text.contains("dgr_tracker_routes_prefix_total 1"), "{text}");
    // A second one at once: the holder now counts the first, twice the other's load.
    let TrackerBody::RouteReply(r) = c.call(ask("spread", probes.clone())).await.unwrap() else { panic!("no route") };
    assert_eq!(r.route.unwrap().stages[0].worker_id, other.id);

    for (what, bad) in [
        ("too many", (1..=65).map(|b| PrefixProbe { blocks: b, chain: 0 }).collect::<Vec<_>>()),
        ("disordered", vec![PrefixProbe { blocks: 2, chain: 0 }, PrefixProbe { blocks: 1, chain: 0 }]),
    ] {
        match c.call(ask(what, bad)).await {
            Err(TrackerCallError::Refused(r)) => assert_eq!(r.refusal_kind(), RefusalKind::BadRequest, "{what}: {r:?}"),
            other => panic!("{what} probes answered with {other:?}"),
        }
    }

    // 1,025 digests, or 1,025 opened sessions: refused, and the connection ends (the worker is
    // out of the registry).
    let (third, third_id) = try_join(&tracker.addr, &new_key(), TOKEN, registration(4, 100.0), false).await.unwrap();
    let opened = Heartbeat { load: Some(Load::default()), prefix: None, opened: (0..MAX_OPENED_TAGS as u64 + 1).collect() };
    let oversized = [
        ("prefix blocks", conn, holder_id, beat((0..MAX_HELD_DIGESTS as u64 + 1).collect())),
        ("opened sessions", third.into_framed(), third_id, Bytes::from(TrackerFrame::new(TrackerBody::Heartbeat(opened)).encode_to_vec())),
    ];
    for (what, mut conn, id, frame) in oversized {
        conn.send(frame).await.unwrap();
        let answer = tokio::time::timeout(CALL, conn.next()).await.expect("an answer in time");
        let frame = TrackerFrame::decode(answer.expect("a refusal before the close").unwrap()).unwrap();
        match frame.body {
            Some(TrackerBody::Refused(r)) => assert_eq!(r.refusal_kind(), RefusalKind::BadRequest, "{what}: {r:?}"),
            other => panic!("a heartbeat naming too many {what} answered with {other:?}"),
        }
        assert!(tokio::time::timeout(CALL, conn.next()).await.expect("closed in time").is_none());
        let deadline = Instant::now() + CALL;
        while swarm(&mut c).await.contains(&id) {
            assert!(Instant::now() < deadline, "the worker that named too many {what} is still listed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    drop(other);
}
