//! Faults and hostile input against real `dgr worker` processes: hidden rows holding NaN or
//! infinities fail only their own session, with a typed error, while a session beside them
//! keeps its solo output bit for bit; a worker serves at most `--max-connections` connections
//! and closes the rest at once; a connection that says nothing is closed at the handshake
//! timeout, one that holds no session and stays silent at the connection idle timeout, but
//! never one that sessions still use; a driver's warm connections closed that way are reopened
//! on next use; a next stage that never answers a dial delays only the opens that go there.
//! Every wait has a deadline.
#![cfg(feature = "real-model")]

mod common;
use common::secure::{ReadTimeout, SecureConn};
use common::*;

use dgr_driver::{Completion, DriveOptions, Flow, GenRequest, Links, Route};
use dgr_proto::{
    Body, BoundarySchema, ErrorKind, Forward, Frame, Hello, OpenSession, Role, Sampling, SeamDtype, SessionRef, StageInfo, PROTOCOL_VERSION,
};
use prost::Message;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn request(tokens: &[u32], max_tokens: usize) -> GenRequest {
    GenRequest {
        prompt_tokens: tokens.to_vec(),
        max_tokens,
        sampling: Sampling { temperature: 0.0, top_k: 40, top_p: 0.95, seed: 0 },
        top_logprobs: 3,
        seam_dtype: SeamDtype::F32,
        ticket: None,
        hash_rows: false,
        constraint: None,
        stop_tokens: Vec::new(),
    }
}

fn generate_on(rt: &tokio::runtime::Runtime, links: &Links, addrs: &[String], req: &GenRequest) -> Completion {
    rt.block_on(async {
        let route = Route::discover(addrs, Duration::from_secs(5)).await.expect("route");
        dgr_driver::generate_on(links, &route, req, &DriveOptions::default(), |_| Flow::Continue).await.expect("generate")
    })
}

// ---------------------------------------------------------------------------------------------
// A raw protocol client (blocking, every read with a deadline)

struct Raw {
    s: SecureConn,
    info: StageInfo,
}

fn random_id() -> Vec<u8> {
    use std::hash::{BuildHasher, Hasher};
    let mut id = Vec::new();
    for _ in 0..2 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos());
        id.extend_from_slice(&h.finish().to_le_bytes());
    }
    id
}

/// A frame as it goes on the wire: a 4-byte big-endian length, then the message.
fn frame_bytes(body: Body) -> Vec<u8> {
    let payload = Frame::new(body).encode_to_vec();
    let mut buf = (payload.len() as u32).to_be_bytes().to_vec();
    buf.extend_from_slice(&payload);
    buf
}

fn hello() -> Body {
    Body::Hello(Hello { protocol_version: PROTOCOL_VERSION, role: Role::Driver as i32, info: None })
}

fn connect_tcp(addr: &str) -> TcpStream {
    let s =
        TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(5)).unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.set_nodelay(true).unwrap();
    s
}

impl Raw {
    /// Connects as a driver: Hello, and the worker's Hello with what it serves.
    fn connect(addr: &str) -> Raw {
        let mut r = Raw { s: SecureConn::connect(addr), info: StageInfo::default() };
        r.send(hello());
        match r.recv() {
            Frame { body: Some(Body::Hello(Hello { info: Some(info), .. })) } => r.info = info,
            f => panic!("{addr} answered Hello with {f:?}"),
        }
        r
    }

    fn send(&mut self, body: Body) {
        self.s.write_all(&frame_bytes(body)).expect("writing to a worker");
    }

    fn recv(&mut self) -> Frame {
        let mut len = [0u8; 4];
        self.s.read_exact(&mut len).unwrap_or_else(|e| panic!("no frame from the worker within the deadline: {e}"));
        let mut payload = vec![0u8; u32::from_be_bytes(len) as usize];
        self.s.read_exact(&mut payload).expect("a frame's payload");
        Frame::decode(payload.as_slice()).expect("a frame")
    }

    /// Opens a session over all of this stage's layers, at `stage_index` of `n_stages`.
    fn open(&mut self, stage_index: u32, n_stages: u32, dtype: SeamDtype) -> Vec<u8> {
        let id = self.send_open(stage_index, n_stages, dtype, "");
        self.expect_opened(&id);
        id
    }

    /// Sends an Open as `open` does, with `next` as the next stage's address, and returns its
    /// session id without waiting for the answer.
    fn send_open(&mut self, stage_index: u32, n_stages: u32, dtype: SeamDtype, next: &str) -> Vec<u8> {
        let id = random_id();
        let schema = BoundarySchema {
            protocol_version: PROTOCOL_VERSION,
            model_id: self.info.model_id.clone(),
            layer_start: self.info.layer_start,
            layer_end: self.info.layer_end,
            hidden: self.info.hidden,
            seam_dtype: dtype as i32,
            engine: self.info.engine.clone(),
        };
        let open = OpenSession {
            session_id: id.clone(),
            schema: Some(schema),
            stage_index,
            n_stages,
            sampling: Some(Sampling { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 }),
            max_positions: 64,
            next: next.into(),
            ..Default::default()
        };
        self.send(Body::Open(open));
        id
    }

    fn expect_opened(&mut self, id: &[u8]) {
        match self.recv() {
            Frame { body: Some(Body::Opened(SessionRef { session_id, .. })) } => assert_eq!(session_id, id),
            f => panic!("a correct Open was answered with {f:?}"),
        }
    }
}

/// Waits up to `within` for the peer to close `s`; returns how long that took, or None if it
/// is still open.
fn closed_within(s: &mut impl ReadTimeout, within: Duration) -> Option<Duration> {
    let start = Instant::now();
    s.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 64];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Some(start.elapsed()),
            // Frames the worker sent before closing (a Pong, a Hello) are read past.
            Ok(_) if start.elapsed() < within => continue,
            Ok(_) => return None,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => return None,
            Err(_) => return Some(start.elapsed()),
        }
    }
}

/// Polls worker `i`'s /metrics until `ok` holds; fails past `within`.
fn metrics_until(w: &mut Workers, i: usize, within: Duration, what: &str, ok: impl Fn(&Metrics) -> bool) -> Metrics {
    let start = Instant::now();
    loop {
        let m = w.metrics(i);
        if ok(&m) {
            return m;
        }
        let seen: Vec<String> = m.0.iter().filter(|(k, _)| k.contains("connections")).map(|(k, v)| format!("{k} {v}")).collect();
        assert!(start.elapsed() < within, "{what}: not within {within:?}; {seen:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Non-finite activations

#[test]
fn non_finite_rows_fail_only_their_session_and_a_session_beside_them_is_unchanged() {
    let _serial = serial();
    let rt = runtime();
    let p = prompt("capital");
    let mut w = Workers::start(&[0, 15, 30], &[]);
    let req = request(&p.tokens, 24);
    let solo = generate_on(&rt, &Links::new(), &w.addrs, &req);

    // A session decodes (slowed a little, so that the bad rows arrive while it runs).
    let route = rt.block_on(Route::discover(&w.addrs, Duration::from_secs(5))).expect("route");
    let tokens = Arc::new(AtomicUsize::new(0));
    let seen = tokens.clone();
    let running = rt.spawn(async move {
        dgr_driver::generate(&route, &req, &DriveOptions::default(), |_| {
            seen.fetch_add(1, SeqCst);
            std::thread::sleep(Duration::from_millis(15));
            Flow::Continue
        })
        .await
    });
    let start = Instant::now();
    while tokens.load(SeqCst) < 3 {
        assert!(start.elapsed() < Duration::from_secs(20), "the session beside the bad rows never started");
        std::thread::sleep(Duration::from_millis(2));
    }

    // Stage 1 gets rows with a NaN (f32 seam) and an infinity (f16 seam) from a hostile "previous stage".
    let mut r = Raw::connect(&w.addrs[1]);
    let hidden = r.info.hidden as usize;
    for (dtype, bad, row) in [(SeamDtype::F32, f32::NAN, 2usize), (SeamDtype::F16, f32::INFINITY, 0)] {
        let id = r.open(1, 2, dtype);
        let mut rows = vec![0.125f32; 3 * hidden];
        rows[row * hidden + 100] = bad;
        let f = Forward {
            session_id: id.clone(),
            position: 0,
            hidden: dgr_proto::encode_rows(&rows, dtype),
            dtype: dtype as i32,
            n_rows: 3,
            sample: true,
            ..Default::default()
        };
        r.send(Body::Forward(f));
        match r.recv() {
            Frame { body: Some(Body::Error(e)) } => {
                println!("{} rows with {bad} in row {row}: {} {:?}", dtype.name(), e.error_kind().name(), e.message);
                assert_eq!((e.error_kind(), e.session_id.as_slice(), e.stage), (ErrorKind::BadInput, id.as_slice(), 1));
                assert!(e.message.contains(&format!("non-finite activations at row {row}")), "{}", e.message);
            }
            f => panic!("{} rows with {bad}: expected a BadInput error, got {f:?}", dtype.name()),
        }
        // The session is gone: more rows for it are an unknown session.
        r.send(Body::Forward(Forward {
            session_id: id.clone(),
            hidden: vec![0; hidden * dtype.size()],
            dtype: dtype as i32,
            n_rows: 1,
            ..Default::default()
        }));
        match r.recv() {
            Frame { body: Some(Body::Error(e)) } => assert_eq!(e.error_kind(), ErrorKind::UnknownSession, "{e:?}"),
            f => panic!("rows for the failed session: {f:?}"),
        }
    }

    let got = rt.block_on(running).expect("join").expect("the session beside the bad rows");
    assert_same_completion(&got, &solo, "a session decoding while another gets non-finite rows");
    let after = generate_on(&rt, &Links::new(), &w.addrs, &request(&p.tokens, 24));
    assert_same_completion(&after, &solo, "a session after the non-finite rows");
    drop(r);
    w.wait_all_free(&[0, 1], Duration::from_secs(3), "after the non-finite rows");
    let m = w.metrics(1);
    assert_eq!(m.get("dgr_worker_nonfinite_frames_total"), 2.0);
    assert_eq!(m.get("dgr_worker_failures_total{kind=\"bad_input\"}"), 2.0);
    println!("stage 1 refused 2 frames of non-finite rows; the session beside them equals its solo run");
}

// ---------------------------------------------------------------------------------------------
// 2. Connection caps and silent clients

#[test]
fn connections_past_the_cap_are_closed_at_once_and_counted() {
    let _serial = serial();
    let rt = runtime();
    let p = prompt("once");
    const CAP: usize = 32;
    let mut w = Workers::start(&[0, 30], &["--max-connections", &CAP.to_string()]);
    let addr = w.addrs[0].clone();
    // Idle connections that never say Hello (the handshake timeout is 10 s: longer than this test needs).
    let mut conns: Vec<TcpStream> = (0..CAP + 8).map(|_| connect_tcp(&addr)).collect();
    // Last first: those past the cap must close by the deadline, and since the worker accepts in
    // order, once they have it has taken every earlier one, which must then stay open.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut closed: Vec<usize> = (0..conns.len())
        .rev()
        .filter(|&i| {
            let wait = if i >= CAP { deadline.saturating_duration_since(Instant::now()) } else { Duration::from_millis(40) };
            closed_within(&mut conns[i], wait).is_some()
        })
        .collect();
    closed.reverse();
    println!("{} idle connections to a worker capped at {CAP}: closed {closed:?}", conns.len());
    assert_eq!(closed, (CAP..CAP + 8).collect::<Vec<_>>(), "the connections past the cap, and only those, are closed");
    // Still full: one more is closed at once, even one that would speak.
    let mut late = connect_tcp(&addr);
    let _ = late.write_all(&[0, 0, 0, 4]);
    assert!(closed_within(&mut late, Duration::from_secs(2)).is_some(), "a connection past the cap stays open");
    drop(late);
    // Freed slots are served again.
    drop(conns);
    // Until the worker has seen the 32 closes, a probe is itself refused (and counted): count those.
    let start = Instant::now();
    let mut probes_refused = 0;
    let m = loop {
        w.assert_alive(0, "while the idle connections close");
        match try_metrics(&addr) {
            Ok(m) if m.get("dgr_worker_connections_open") == 1.0 => break m,
            Ok(_) => {}
            Err(_) => probes_refused += 1,
        }
        assert!(start.elapsed() < Duration::from_secs(5), "the idle connections were not closed within 5 s");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(m.get("dgr_worker_connections_refused_total"), (9 + probes_refused) as f64);
    let c = generate_on(&rt, &Links::new(), &w.addrs, &request(&p.tokens, 8));
    assert_eq!(c.tokens.len(), 8);
    println!(
        "9 connections refused past the cap (and {probes_refused} metrics probes while it drained); a generation afterwards runs normally"
    );
}

#[test]
fn silent_and_idle_connections_are_closed_but_never_under_a_session() {
    let _serial = serial();
    let rt = runtime();
    let p = prompt("capital");
    let mut w = Workers::start(&[0, 15, 30], &["--handshake-timeout", "0.5", "--conn-idle-timeout", "1"]);
    let addr = w.addrs[0].clone();

    // (a) Silent, a slow loris that sends part of a preamble, or one that sends the first half
    // of its secure channel's opening message in time and the rest too late: closed at the
    // handshake timeout.
    let connected = Instant::now();
    let mut silent = connect_tcp(&addr);
    let mut loris = connect_tcp(&addr);
    loris.write_all(&[0, 0]).unwrap();
    let mut split = connect_tcp(&addr);
    let whole = [b"DGR1".as_slice(), &[0, 32], &[7u8; 32]].concat();
    split.write_all(&whole[..10]).unwrap();
    assert!(closed_within(&mut silent, Duration::from_millis(300)).is_none(), "closed before the handshake timeout");
    std::thread::sleep(Duration::from_millis(700).saturating_sub(connected.elapsed()));
    let _ = split.write_all(&whole[10..]);
    for (what, s) in [("a silent connection", &mut silent), ("half a preamble", &mut loris), ("a handshake finished late", &mut split)] {
        assert!(closed_within(s, Duration::from_secs(3)).is_some(), "{what} still open 3 s after a 0.5 s handshake timeout");
        println!("(a) {what}: closed (open at 0.3 s, closed by {:?})", connected.elapsed());
    }

    // (b) Hello, then silence and no session: closed after the idle timeout.
    let mut idle = Raw::connect(&addr);
    let t = closed_within(&mut idle.s, Duration::from_secs(4)).expect("an idle connection with no session is still open after 4 s");
    println!("(b) Hello then silence: closed after {t:?}");
    assert!(t >= Duration::from_millis(800), "closed after {t:?}, before the 1 s idle timeout");

    // (c) A connection with an open session is kept however quiet; closed once it holds none.
    let mut held = Raw::connect(&w.addrs[1]);
    let id = held.open(1, 2, SeamDtype::F32);
    assert!(closed_within(&mut held.s, Duration::from_millis(2500)).is_none(), "a connection holding a session was closed for idleness");
    let hidden = held.info.hidden as usize;
    let rows = dgr_proto::encode_rows(&vec![0.01f32; hidden], SeamDtype::F32);
    held.s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    held.send(Body::Forward(Forward { session_id: id.clone(), hidden: rows, n_rows: 1, sample: true, ..Default::default() }));
    match held.recv() {
        Frame { body: Some(Body::Token(t)) } => assert_eq!(t.session_id, id),
        f => panic!("(c) the quiet session's rows: expected a token, got {f:?}"),
    }
    held.send(Body::Close(SessionRef { session_id: id, ..Default::default() }));
    assert!(matches!(held.recv().body, Some(Body::Usage(_))), "(c) Close is answered with Usage");
    let t = closed_within(&mut held.s, Duration::from_secs(4)).expect("(c) still open 4 s after its session closed");
    println!("(c) a connection quiet for 2.5 s under a session stayed open; after Close it closed in {t:?}");

    // (d) A session whose driver goes quiet (longer than the idle timeout) between two tokens,
    // with every connection on its route silent meanwhile, finishes and equals its solo run.
    let links = Links::new();
    let req = request(&p.tokens, 12);
    let solo = generate_on(&rt, &links, &w.addrs, &req);
    let route = rt.block_on(Route::discover(&w.addrs, Duration::from_secs(5))).expect("route");
    let quiet = rt
        .block_on(dgr_driver::generate_on(&links, &route, &req, &DriveOptions::default(), |t| {
            if t.position as usize == p.tokens.len() + 3 {
                std::thread::sleep(Duration::from_millis(1800));
            }
            Flow::Continue
        }))
        .expect("a session quiet for longer than the connection idle timeout");
    assert_same_completion(&quiet, &solo, "(d) a session with a 1.8 s pause");

    // (e) Once its sessions end, the driver's warm connections (and stage 0's to stage 1) are
    // closed for idleness; the next request opens fresh ones and runs normally.
    const IDLE: &str = "dgr_worker_connections_closed_total{reason=\"idle\"}";
    let before: Vec<f64> = (0..2).map(|i| w.metrics(i).get(IDLE)).collect();
    let limit = Duration::from_secs(5);
    // Stage 0: the driver's connection; stage 1: the driver's and stage 0's.
    let after: Vec<f64> = [1.0, 2.0]
        .iter()
        .enumerate()
        .map(|(i, n)| metrics_until(&mut w, i, limit, &format!("stage {i}'s idle closes"), |m| m.get(IDLE) >= before[i] + n).get(IDLE))
        .collect();
    println!("(e) idle closes on each stage: {before:?} -> {after:?}");
    let again = generate_on(&rt, &links, &w.addrs, &req);
    assert_same_completion(&again, &solo, "(e) a request over the reopened warm connections");
    let m = w.metrics(0);
    assert!(m.get("dgr_worker_connections_closed_total{reason=\"handshake_timeout\"}") >= 3.0);
    w.wait_all_free(&[0, 1], Duration::from_secs(3), "after the idle checks");
}

// ---------------------------------------------------------------------------------------------
// 3. A next stage that never answers

/// An address whose SYNs go unanswered: a listener with a backlog of 0 whose accept queue is
/// filled with connections it never accepts (Linux drops a SYN to a full queue). Returns the
/// listener and the fillers, which must stay open, and the address. Needs a runtime entered.
fn blackhole() -> (tokio::net::TcpListener, Vec<TcpStream>, String) {
    let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
    socket.bind("127.0.0.1:0".parse().unwrap()).expect("bind");
    let listener = socket.listen(0).expect("listen");
    let addr = listener.local_addr().unwrap();
    let mut fillers = Vec::new();
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
            Ok(s) => fillers.push(s),
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => break,
            Err(e) => panic!("filling the blackhole's accept queue: {e}"),
        }
        assert!(fillers.len() < 8, "{} connections to a listener with backlog 0 and its SYNs are still answered", fillers.len());
    }
    (listener, fillers, addr.to_string())
}

/// Reads frames on `conn` until an Error came for each session of `ids` (skipping other
/// sessions' Usage), within `within`; returns them in the order of `ids`.
fn errors_for(conn: &mut Raw, ids: &[&[u8]], within: Duration) -> Vec<dgr_proto::ErrorMsg> {
    conn.s.set_read_timeout(Some(within)).unwrap();
    let mut errors: Vec<Option<dgr_proto::ErrorMsg>> = vec![None; ids.len()];
    while errors.iter().any(Option::is_none) {
        match conn.recv().body {
            Some(Body::Error(e)) if ids.contains(&e.session_id.as_slice()) => {
                let i = ids.iter().position(|id| *id == e.session_id.as_slice()).unwrap();
                errors[i] = Some(e);
            }
            Some(Body::Usage(_)) => {}
            f => panic!("waiting for the stuck opens' errors, got {f:?}"),
        }
    }
    errors.into_iter().flatten().collect()
}

#[test]
fn a_next_stage_that_blackholes_its_syns_delays_only_the_opens_that_go_there() {
    let _serial = serial();
    let rt = runtime();
    let (_listener, _fillers, dead) = {
        let _rt = rt.enter();
        blackhole()
    };
    let w = Workers::start(&[0, 15, 30], &[]);
    let live = w.addrs[1].clone();
    // Two connections to stage 0 (a gateway's sessions all share one), each with an open whose
    // next stage never answers: the worker dials it (for up to its 10 s dial deadline) meanwhile.
    let mut conns = [Raw::connect(&w.addrs[0]), Raw::connect(&w.addrs[0])];
    let stuck: Vec<Vec<u8>> = conns.iter_mut().map(|c| c.send_open(0, 2, SeamDtype::F32, &dead)).collect();
    // And one each to a next stage that accepts but never says Hello, never accepted here: the
    // kernel queues every connection the worker makes to it, so they can be counted at the end.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let quiet_addr = silent.local_addr().unwrap().to_string();
    let quiet: Vec<Vec<u8>> = conns.iter_mut().map(|c| c.send_open(0, 2, SeamDtype::F32, &quiet_addr)).collect();
    // Opens to the live next stage, beside the stuck ones on both connections, in normal time.
    for (i, c) in conns.iter_mut().enumerate() {
        let t = Instant::now();
        let id = c.send_open(0, 2, SeamDtype::F32, &live);
        c.expect_opened(&id);
        let took = t.elapsed();
        println!("connection {i}: an open to the live next stage was answered in {took:?} beside ones to a blackholed and a silent one");
        assert!(took < Duration::from_secs(2), "connection {i}: an open to a live next stage waited {took:?} on a stuck one");
        c.send(Body::Close(SessionRef { session_id: id, ..Default::default() }));
    }
    // Every stuck open is refused, naming the next stage, at its dial's deadline.
    for (i, c) in conns.iter_mut().enumerate() {
        for e in errors_for(c, &[&stuck[i], &quiet[i]], Duration::from_secs(20)) {
            assert_eq!((e.error_kind(), e.stage), (ErrorKind::NextStage, 1), "{e:?}");
        }
    }
    // The two concurrent opens to the silent next stage shared one dial: one connection to it.
    silent.set_nonblocking(true).unwrap();
    let dialled = std::iter::from_fn(|| silent.accept().ok()).count();
    assert_eq!(dialled, 1, "two concurrent opens to one next stage dialled it {dialled} times: not one dial");
    let [a, _] = &mut conns;
    // A failed dial is not remembered: the next open to that address dials again, so it is not
    // refused at once.
    let again = a.send_open(0, 2, SeamDtype::F32, &dead);
    a.s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let mut byte = [0u8; 1];
    match a.s.read(&mut byte) {
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
        r => panic!("an open to the address whose dial just failed was answered at once ({r:?}): the failure was cached"),
    }
    a.send(Body::Cancel(SessionRef { session_id: again, ..Default::default() }));
}
