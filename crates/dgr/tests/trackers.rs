//! Several trackers, one swarm, on the real default model with real processes on loopback:
//! trackers sharing one ledger sign with one key set and workers joined to all of them accept
//! tickets from any (and no other key); drivers given the list (`dgr generate`, the gateway)
//! fail over when one is SIGKILLed, under load, without losing or double-billing a request (on
//! a shared SQLite file and, with the `postgres-tests` feature, on PostgreSQL); a
//! restarted tracker lists every worker again within one heartbeat interval.
#![cfg(feature = "real-model")]

mod common;

use common::swarm::{Gateway, Tracker, Worker};
use common::{dgr_json, serial};
use dgr_proto::{RouteRequest, TrackerBody, TrackerClient};
use serde_json::Value;
use std::time::{Duration, Instant};

const PROMPT: &str = "The quick brown fox";
const HEARTBEAT_MS: u64 = 1000;

/// `dgr generate --tracker LIST` on the default model; the parsed JSON.
fn generate(trackers: &[&Tracker], args: &[&str]) -> Value {
    let list = trackers.iter().map(|t| t.addr.as_str()).collect::<Vec<_>>().join(",");
    let mut all = vec!["generate", "--tracker", &list, "--format", "json", "--threads", "1", "--prompt", PROMPT];
    all.extend_from_slice(args);
    let out = common::dgr().args(&all).arg("--model").arg(common::model()).output().unwrap();
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("generate {args:?}: no JSON ({e}): {} {}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    })
}

fn assert_tokens(got: &Value, want: &Value, what: &str) {
    assert!(got.get("error").is_none(), "{what}: {got}");
    assert_eq!(got["tokens"], want["tokens"], "{what}: tokens");
    assert_eq!(got["logprobs"], want["logprobs"], "{what}: logprobs");
}

/// The route reply of tracker `t` for the default model.
fn route_from(rt: &tokio::runtime::Runtime, t: &Tracker, model_id: &str, request_id: &str) -> dgr_proto::RouteReply {
    rt.block_on(async {
        let mut c = TrackerClient::connect(&t.addr, Duration::from_secs(5)).await.unwrap();
        let ask = RouteRequest { model_id: model_id.into(), budget_tokens: 64, request_id: request_id.into(), ..Default::default() };
        match c.call(TrackerBody::RouteRequest(ask)).await.unwrap() {
            TrackerBody::RouteReply(r) => r,
            other => panic!("{other:?}"),
        }
    })
}

/// Two trackers on one database sign with one key: workers joined to both take tickets from
/// either, and refuse one signed by a key outside the set; a quarantine reaches both.
#[test]
fn trackers_on_one_ledger_share_a_key_set() {
    let _g = serial();
    let a = Tracker::start("keyset", &[]);
    let b = Tracker::start_in(&a.dir, "127.0.0.1:0", &[]);
    let w0 = Worker::start_joined(&[&a, &b], (0, 15), "w0", &[], &[], Some(&common::model()));
    let w1 = Worker::start_joined(&[&a, &b], (15, 30), "w1", &["--relay"], &[], Some(&common::model()));
    for t in [&a, &b] {
        t.wait_live(&[&w0.id, &w1.id], Duration::from_secs(10), "joined to both");
    }
    let want = dgr_json(&["generate", "--prompt", PROMPT, "--format", "json", "--threads", "1", "--max-tokens", "8"]);
    assert_tokens(&generate(&[&a], &["--max-tokens", "8"]), &want, "routed by A");
    assert_tokens(&generate(&[&b], &["--max-tokens", "8"]), &want, "routed by B (its relay)");

    let model_id = dgr_gguf::model_identity(&common::model()).unwrap().id;
    let rt = common::runtime();
    let (ra, rb) = (route_from(&rt, &a, &model_id, "ka"), route_from(&rt, &b, &model_id, "kb"));
    let key_id = |r: &dgr_proto::RouteReply| r.route.as_ref().unwrap().key_id;
    assert_eq!(key_id(&ra), key_id(&rb), "one key set: both sign with its current key");

    // A ticket signed by a key outside the set, naming that key and naming the set's key.
    let outsider = dgr_proto::new_signing_key().unwrap();
    for claim in [dgr_proto::key_id(&outsider.verifying_key()), key_id(&ra)] {
        let route = dgr_driver::Route::from_tracker(&ra).unwrap();
        let t = dgr_proto::Ticket { key_id: claim, ..ra.route.clone().unwrap() };
        let forged = dgr_proto::sign_ticket(&t, &outsider);
        let session: [u8; 16] = t.session_id.as_slice().try_into().unwrap();
        let req = dgr_driver::GenRequest {
            prompt_tokens: vec![504, 2365, 6354, 16438],
            max_tokens: 4,
            sampling: Default::default(),
            top_logprobs: 0,
            seam_dtype: dgr_proto::SeamDtype::F32,
            ticket: Some((forged, session)),
            hash_rows: false,
            constraint: None,
            stop_tokens: Vec::new(),
        };
        let got = rt.block_on(dgr_driver::generate(&route, &req, &Default::default(), |_| dgr_driver::Flow::Continue));
        let e = got.err().unwrap_or_else(|| panic!("a ticket of an outside key (naming {claim:016x}) was accepted"));
        assert_eq!(e.kind, "ticket", "{e:?}");
    }
    let m = common::metrics(w0.addr.as_ref().unwrap());
    assert_eq!(m.get("dgr_worker_ticket_refusals_total{reason=\"forged\"}"), 2.0);

    // A quarantine (a spot check's verdict) goes to every tracker: neither routes to w1 again.
    let token = std::fs::read_to_string(&a.token_file).unwrap().trim().to_string();
    let q = dgr_proto::Suspect { join_token: token, worker_id: w1.id.clone(), evidence: "test".into() };
    let list = format!("{},{}", a.addr, b.addr);
    rt.block_on(dgr_driver::Trackers::new(&list, Duration::from_secs(5)).broadcast(TrackerBody::Suspect(q))).unwrap();
    for t in [&a, &b] {
        let w = t.workers().into_iter().find(|w| w["worker_id"] == w1.id.as_str()).unwrap();
        assert_eq!(w["quarantined"], true, "{w}");
        let refused = generate(&[t], &["--max-tokens", "2"]);
        assert_eq!(refused["error"]["kind"], "no_route", "{refused}");
    }
}

/// A tracker restarted on its database lists every worker (direct and relayed) again within one
/// heartbeat interval of its start, plus a little slack for the checks themselves.
#[test]
fn a_restarted_tracker_lists_every_worker_within_one_heartbeat() {
    let _g = serial();
    let hb = HEARTBEAT_MS.to_string();
    let mut t = Tracker::start("rejoin", &["--heartbeat-ms", &hb]);
    let ws =
        [Worker::start(&t, (0, 15), "w0", &[]), Worker::start(&t, (15, 30), "w1", &[]), Worker::start(&t, (0, 30), "w2", &["--relay"])];
    let ids: Vec<&str> = ws.iter().map(|w| w.id.as_str()).collect();
    t.wait_live(&ids, Duration::from_secs(10), "joined");
    let (dir, addr) = (t.dir.clone(), t.addr.clone());
    t.kill();
    // Down for more than an interval: every worker has lost it and backed off to its cap.
    let down = Instant::now();
    for w in &ws {
        while !w.log().contains("lost the tracker") {
            assert!(down.elapsed() < Duration::from_secs(5), "worker did not notice the tracker's death: {}", w.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    while down.elapsed() < Duration::from_millis(2 * HEARTBEAT_MS) {
        assert!(std::net::TcpStream::connect(&addr).is_err(), "the tracker is down");
        std::thread::sleep(Duration::from_millis(50));
    }
    let t2 = Tracker::start_in(&dir, &addr, &["--heartbeat-ms", &hb]);
    let slack = Duration::from_millis(300);
    let took = t2.wait_live(&ids, Duration::from_millis(HEARTBEAT_MS) + slack, "after the restart");
    println!("a restarted tracker listed all {} workers {took:?} after its start (heartbeat {HEARTBEAT_MS} ms)", ids.len());
}

/// POST /v1/completions on the gateway with `stream: true` and log-probabilities (so every token
/// makes a chunk; without an end of sequence, so each stream runs `max_tokens`): the tokens received, and the usage chunk's (prompt, completion) tokens.
/// Panics on anything but a complete stream.
fn stream_completion(gateway: &str, model: &str, max_tokens: usize, seed: u64) -> (usize, (u64, u64)) {
    use std::io::{Read, Write};
    let body = serde_json::json!({
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed,
        "stream": true, "logprobs": 1, "ignore_eos": true,
    })
    .to_string();
    let mut s = std::net::TcpStream::connect(gateway).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let (mut tokens, mut usage, mut finished, mut done) = (0, None, false, false);
    for line in resp.lines() {
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data}"));
        assert!(v.get("error").is_none(), "the stream failed: {data}");
        if let Some(c) = v["choices"].as_array().and_then(|c| c.first()) {
            tokens += c["logprobs"]["tokens"].as_array().map_or(0, |t| t.len());
            finished |= c["finish_reason"].is_string();
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            usage = Some((u["prompt_tokens"].as_u64().unwrap(), u["completion_tokens"].as_u64().unwrap()));
        }
    }
    assert!(finished && done, "the stream did not finish: {resp}");
    (tokens, usage.unwrap_or_else(|| panic!("no usage chunk: {resp}")))
}

fn totals(rows: &Value, field: &str) -> u64 {
    rows["rows"].as_array().unwrap().iter().map(|r| r[field].as_u64().unwrap()).sum()
}

/// Waits until the ledger holds `n` requests (reports are sent in the background); the rows.
fn wait_requests(t: &Tracker, n: u64, within: Duration) -> Value {
    let start = Instant::now();
    loop {
        let by_key = t.usage("key");
        if totals(&by_key, "requests") >= n {
            return by_key;
        }
        assert!(start.elapsed() < within, "the ledger holds {by_key} after {within:?}; want {n} requests");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `dgr generate --tracker A,B` keeps working when A is SIGKILLed: the next route comes from B
/// within 2 s, and every request is in the shared ledger once.
#[test]
fn generate_fails_over_to_the_surviving_tracker() {
    let _g = serial();
    let mut a = Tracker::start("failover", &[]);
    let b = Tracker::start_in(&a.dir, "127.0.0.1:0", &[]);
    let w0 = Worker::start_joined(&[&a, &b], (0, 15), "w0", &[], &[], Some(&common::model()));
    let w1 = Worker::start_joined(&[&a, &b], (15, 30), "w1", &[], &[], Some(&common::model()));
    for t in [&a, &b] {
        t.wait_live(&[&w0.id, &w1.id], Duration::from_secs(10), "joined to both");
    }
    let want = dgr_json(&["generate", "--prompt", PROMPT, "--format", "json", "--threads", "1", "--max-tokens", "8"]);
    let first = generate(&[&a, &b], &["--max-tokens", "8"]);
    assert_tokens(&first, &want, "both up");
    assert_eq!(first["ledger"], "recorded", "{first}");

    a.kill();
    let killed = Instant::now();
    let model_id = dgr_gguf::model_identity(&common::model()).unwrap().id;
    let list = format!("{},{}", a.addr, b.addr);
    let rt = common::runtime();
    let routed = rt.block_on(dgr_driver::tracker::route(&list, &model_id, "", 64, "", "after-kill", &[], &[]));
    let took = killed.elapsed();
    assert!(routed.is_ok(), "no route from the survivor: {:?}", routed.err());
    assert!(took < Duration::from_secs(2), "the survivor routed {took:?} after the kill");
    println!("a route from the survivor {took:?} after the other tracker was killed");

    let after = generate(&[&a, &b], &["--max-tokens", "8"]);
    assert_tokens(&after, &want, "A killed");
    assert_eq!(after["ledger"], "recorded", "{after}");
    let by_key = b.usage("key");
    assert_eq!(totals(&by_key, "requests"), 2, "each request once: {by_key}");
    assert_eq!(totals(&by_key, "completion_tokens"), 16, "{by_key}");
}

/// The acceptance test: two trackers on one ledger, 32 streaming sessions through a gateway that
/// knows both, and one tracker SIGKILLed while they stream. Every session completes, the ledger
/// holds every request exactly once with the tokens the clients received, and a new request is
/// routed by the survivor within 2 s.
#[test]
fn a_tracker_killed_under_32_streaming_sessions_loses_and_double_bills_nothing() {
    let _g = serial();
    let a = Tracker::start("killload", &[]);
    let b = Tracker::start_in(&a.dir, "127.0.0.1:0", &[]);
    kill_one_under_load(a, b);
}

/// The acceptance test on PostgreSQL, the ledger several trackers are meant to share.
#[cfg(feature = "postgres-tests")]
#[test]
fn two_trackers_on_postgres_one_killed_under_32_streaming_sessions_lose_and_double_bill_nothing() {
    let _g = serial();
    let (a, b) = Tracker::pair_on_postgres("killload_pg");
    kill_one_under_load(a, b);
}

/// The acceptance test's body: `a` and `b` share one ledger; `a` is killed.
fn kill_one_under_load(mut a: Tracker, b: Tracker) {
    const SESSIONS: usize = 32;
    const MAX_TOKENS: usize = 48;
    let w0 = Worker::start_joined(&[&a, &b], (0, 15), "w0", &[], &[], Some(&common::model()));
    let w1 = Worker::start_joined(&[&a, &b], (15, 30), "w1", &[], &[], Some(&common::model()));
    for t in [&a, &b] {
        t.wait_live(&[&w0.id, &w1.id], Duration::from_secs(10), "joined to both");
    }
    let gw = Gateway::start(&[&a, &b], &[]);
    let model_id = dgr_gguf::model_identity(&common::model()).unwrap().id;
    let clients: Vec<_> = (0..SESSIONS)
        .map(|i| {
            let (addr, model) = (gw.addr.clone(), model_id.clone());
            std::thread::spawn(move || stream_completion(&addr, &model, MAX_TOKENS, i as u64))
        })
        .collect();
    // Kill A once half the sessions are open on the last stage (the rest still asking routes).
    let start = Instant::now();
    let w1_addr = w1.addr.clone().unwrap();
    while common::metrics(&w1_addr).get("dgr_worker_sessions_opened_total") < (SESSIONS / 2) as f64 {
        assert!(start.elapsed() < Duration::from_secs(60), "sessions did not open: {}", gw.log());
        std::thread::sleep(Duration::from_millis(10));
    }
    a.kill();
    let killed = Instant::now();
    assert!(common::metrics(&w1_addr).get("dgr_worker_sessions_open") > 0.0, "killed under load: sessions were streaming");
    let (tokens, _) = stream_completion(&gw.addr, &model_id, 4, 1000);
    let took = killed.elapsed();
    assert_eq!(tokens, 4);
    println!("a new request through the gateway completed {took:?} after the kill");
    assert!(took < Duration::from_secs(2), "the survivor routed a new request {took:?} after the kill");

    let (mut prompt, mut completion) = (0, 0);
    for c in clients {
        let (got, (p, n)) = c.join().expect("a session failed");
        assert_eq!((got, n), (MAX_TOKENS, MAX_TOKENS as u64), "the tokens received are the tokens reported");
        prompt += p;
        completion += n;
    }
    let (p, n) = (prompt / SESSIONS as u64, 4u64);
    let by_key = wait_requests(&b, SESSIONS as u64 + 1, Duration::from_secs(30));
    println!("ledger after the kill: {by_key}");
    assert_eq!(totals(&by_key, "requests"), SESSIONS as u64 + 1, "each request exactly once: {by_key}");
    assert_eq!(totals(&by_key, "completion_tokens"), completion + n, "billed what the clients received: {by_key}");
    assert_eq!(totals(&by_key, "prompt_tokens"), prompt + p, "{by_key}");
    let m = common::metrics(&gw.addr);
    assert_eq!(m.get("dgr_gateway_usage_reports_pending"), 0.0);
    assert_eq!(m.get("dgr_gateway_usage_reports_recorded_total"), (SESSIONS + 1) as f64);
}

/// Usage reports queued while no tracker answers are retried, across the list, until one is up:
/// each is stored once, and a full queue makes the submitter wait (counted), never drops one.
#[test]
fn usage_reports_wait_for_a_tracker_and_are_never_dropped() {
    const REPORTS: u64 = 6;
    let _g = serial();
    let free = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let (dead, later) = (free(), free());
    // A database and join token for the tracker that comes up later.
    let mut first = Tracker::start("reports", &[]);
    let dir = first.dir.clone();
    first.kill();
    let rt = common::runtime();
    let _in_rt = rt.enter();
    let trackers = std::sync::Arc::new(dgr_driver::Trackers::new(&format!("{dead},{later}"), Duration::from_millis(500)));
    let reporter = std::sync::Arc::new(dgr_driver::UsageReporter::start(trackers, 2));
    let usage = |i: u64| dgr_proto::RequestUsage {
        request_id: format!("queued-{i}"),
        model_id: "m".into(),
        prompt_tokens: 3,
        completion_tokens: i,
        status: dgr_proto::UsageStatus::Completed.as_str().into(),
        ..Default::default()
    };
    let submits: Vec<_> = (0..REPORTS)
        .map(|i| {
            let r = reporter.clone();
            rt.spawn(async move { r.submit(usage(i)).await })
        })
        .chain([{
            // The same request again: stored once.
            let r = reporter.clone();
            rt.spawn(async move { r.submit(usage(0)).await })
        }])
        .collect();
    let stats = reporter.stats.clone();
    let start = Instant::now();
    let count = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    while count(&stats.queue_full) == 0 || count(&stats.retries) < 2 {
        assert!(start.elapsed() < Duration::from_secs(10), "no retries or full queue seen");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(count(&stats.recorded), 0, "no tracker is up yet");
    let t = Tracker::start_in(&dir, &later, &[]);
    while count(&stats.recorded) < REPORTS + 1 {
        assert!(start.elapsed() < Duration::from_secs(30), "reports not stored: {} of {}", count(&stats.recorded), REPORTS + 1);
        std::thread::sleep(Duration::from_millis(20));
    }
    for s in submits {
        rt.block_on(s).unwrap();
    }
    assert_eq!((count(&stats.pending), count(&stats.refused)), (0, 0));
    println!("{} retries, the queue full {} times, before the tracker came up", count(&stats.retries), count(&stats.queue_full));
    let by_key = t.usage("key");
    assert_eq!(totals(&by_key, "requests"), REPORTS, "each stored once: {by_key}");
    assert_eq!(totals(&by_key, "completion_tokens"), (0..REPORTS).sum::<u64>(), "{by_key}");
}
