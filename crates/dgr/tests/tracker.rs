//! Acceptance of the tracker on the real default model, with real processes on loopback:
//! registration and liveness, routes over overlapping ranges (bitwise equal to one process,
//! direct and relayed), ticket forgeries, the ledger across a restart, quotas, and sessions that
//! outlive a tracker restart.
#![cfg(feature = "real-model")]

mod common;

use bytes::Bytes;
use common::swarm::{Tracker, Worker};
use common::{dgr_json, metrics, rejected_drafts, serial};
use dgr_proto::{
    codec, sign_ticket, Body, BoundarySchema, ErrorKind, Frame, Hello, OpenSession, Role, RouteRequest, SignedTicket, Ticket, TrackerBody,
    TrackerClient, PROTOCOL_VERSION,
};
use futures::{SinkExt, StreamExt};
use prost::Message;
use serde_json::Value;
use std::time::{Duration, Instant};

const PROMPT: &str = "The quick brown fox";

fn one_process(args: &[&str]) -> Value {
    let mut all = vec!["generate", "--prompt", PROMPT, "--format", "json", "--threads", "1"];
    all.extend_from_slice(args);
    dgr_json(&all)
}

fn assert_same_output(got: &Value, want: &Value, what: &str) {
    assert!(got.get("error").is_none(), "{what}: {got}");
    assert_eq!(got["tokens"], want["tokens"], "{what}: tokens");
    assert_eq!(got["logprobs"], want["logprobs"], "{what}: logprobs");
    assert_eq!(got["top_logprobs"], want["top_logprobs"], "{what}: top logprobs");
}

#[test]
fn workers_register_expire_and_never_appear_twice() {
    let _g = serial();
    let t = Tracker::start("liveness", &[]);
    let mut a = Worker::start(&t, (0, 15), "a", &[]);
    let mut b = Worker::start(&t, (15, 30), "b", &[]);
    t.wait_live(&[&a.id, &b.id], Duration::from_secs(5), "both joined");
    let listed = t.workers();
    let b_rec = listed.iter().find(|w| w["worker_id"] == b.id.as_str()).unwrap();
    assert_eq!(b_rec["layers"], serde_json::json!([15, 30]));
    assert!(b_rec["step_us_per_layer"].as_f64().unwrap() > 0.0, "a measured step time: {b_rec}");

    // A dropped connection (SIGKILL): out of new routes within 1 s.
    b.kill();
    let took = t.wait_live(&[&a.id], Duration::from_secs(1), "killed worker");
    println!("killed worker out of routes after {took:?}");

    // Restarted under the same identity: listed once, under the same id.
    let b2 = Worker::start(&t, (15, 30), "b", &[]);
    assert_eq!(b2.id, b.id, "the key file keeps the identity");
    t.wait_live(&[&a.id, &b.id], Duration::from_secs(5), "restarted worker");
    assert_eq!(t.workers().iter().filter(|w| w["worker_id"] == b.id.as_str()).count(), 1, "listed twice");

    // Silent (SIGSTOP): out within three heartbeats (3 s by default); back once it speaks again.
    a.signal("STOP");
    let took = t.wait_live(&[&b2.id], Duration::from_millis(3500), "stopped worker");
    println!("silent worker out of routes after {took:?}");
    let refused = t.generate(&["--prompt", PROMPT, "--max-tokens", "2"]);
    assert_eq!(refused["error"]["kind"], "no_route", "{refused}");
    a.signal("CONT");
    t.wait_live(&[&a.id, &b2.id], Duration::from_secs(3), "continued worker");

    // SIGTERM: deregisters at once.
    a.signal("TERM");
    let took = t.wait_live(&[&b2.id], Duration::from_millis(500), "terminated worker");
    println!("terminated worker out of routes after {took:?}");
    let _ = a.child.wait();
}

#[test]
fn a_wrong_join_token_is_refused_and_counted() {
    let _g = serial();
    let t = Tracker::start("badtoken", &[]);
    let bad = t.dir.join("bad-token");
    std::fs::write(&bad, "wrong\n").unwrap();
    let mut cmd = common::dgr();
    cmd.args(["worker", "--layers", "0..30", "--threads", "1", "--tracker", &t.addr, "--join-token-file"])
        .arg(&bad)
        .arg("--model")
        .arg(common::model());
    let mut w = common::Proc::spawn(cmd);
    let start = Instant::now();
    while !metrics(&t.addr).0.contains_key("dgr_tracker_refusals_total{kind=\"bad_join_token\"}") {
        assert!(start.elapsed() < Duration::from_secs(20), "no refusal counted: {}", t.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(w.running(), "a refused worker keeps retrying rather than dying");
    assert!(t.live_ids().is_empty());
    assert!(t.log().contains("wrong join token"), "logged: {}", t.log());
}

/// Overlapping and mismatched ranges compose into 2- and 3-stage routes, direct and relayed;
/// greedy and seeded output equals one process bit for bit.
#[test]
fn routes_over_overlapping_ranges_equal_one_process() {
    let _g = serial();
    let greedy = ["--prompt", PROMPT, "--max-tokens", "24", "--top-logprobs", "3"];
    let seeded = ["--prompt", PROMPT, "--max-tokens", "24", "--temperature", "0.9", "--seed", "7"];
    let want_greedy = one_process(&greedy[2..]);
    let want_seeded = one_process(&seeded[2..]);
    // (what, [(held layers, relayed)])
    type Shape<'a> = (&'a str, &'a [((usize, usize), bool)]);
    let shapes: [Shape; 3] = [
        ("[0,20) and [16,30)", &[((0, 20), false), ((16, 30), false)]),
        ("[0,12), [8,22) and [20,30), the middle one relayed", &[((0, 12), false), ((8, 22), true), ((20, 30), false)]),
        ("[0,10) relayed and [5,30)", &[((0, 10), true), ((5, 30), false)]),
    ];
    for (name, workers) in shapes {
        let t = Tracker::start("shapes", &[]);
        let ws: Vec<Worker> = workers
            .iter()
            .enumerate()
            .map(|(i, (r, relay))| Worker::start(&t, *r, &format!("w{i}"), if *relay { &["--relay"] } else { &[] }))
            .collect();
        let ids: Vec<&str> = ws.iter().map(|w| w.id.as_str()).collect();
        t.wait_live(&ids, Duration::from_secs(5), name);
        let g = t.generate(&greedy);
        assert_same_output(&g, &want_greedy, &format!("{name}, greedy"));
        assert_same_output(&t.generate(&seeded), &want_seeded, &format!("{name}, seeded"));
        let layers: Vec<(u64, u64)> =
            g["layers"].as_array().unwrap().iter().map(|l| (l[0].as_u64().unwrap(), l[1].as_u64().unwrap())).collect();
        assert_eq!(layers.len(), workers.len(), "{name}: every worker serves a stage: {layers:?}");
        assert!(layers.windows(2).all(|w| w[0].1 == w[1].0) && layers[0].0 == 0 && layers.last().unwrap().1 == 30, "{layers:?}");
        let relayed = workers.iter().any(|(_, r)| *r);
        assert_eq!(g["route"].as_array().unwrap().iter().any(|a| a.as_str().unwrap().starts_with("relay://")), relayed, "{g}");
        println!("{name}: route {layers:?} equals one process");
    }
}

/// Workers started without --layers serve what the tracker assigns: an empty swarm is tiled from
/// layer 0, a later worker goes where layers are missing, and one whose memory holds the model
/// takes all of it, even without the file (sized by the swarm's manifest, then fetched); the
/// routes they make equal one process bit for bit.
#[test]
fn workers_without_layers_serve_the_ranges_the_tracker_assigns() {
    let _g = serial();
    let args = ["--prompt", PROMPT, "--max-tokens", "16", "--top-logprobs", "3"];
    let want = one_process(&args[2..]);
    let t = Tracker::start("placed", &[]);
    let model = common::model();
    let ws: Vec<Worker> = ["a", "b", "c"].iter().map(|k| Worker::start_placed(&t, k, &["--max-layers", "12"], Some(&model))).collect();
    let ranges: Vec<(usize, usize)> = ws.iter().map(|w| w.layers).collect();
    assert_eq!(ranges, [(0, 12), (12, 24), (18, 30)], "the third covers what the first two left");
    let ids: Vec<&str> = ws.iter().map(|w| w.id.as_str()).collect();
    t.wait_live(&ids, Duration::from_secs(5), "placed workers");
    assert_same_output(&t.generate(&args), &want, "a route over placed workers");
    for w in &ws {
        assert!(w.log().contains(&format!("placed this worker at layers {}..{}", w.layers.0, w.layers.1)), "{}", w.log());
    }
    // Without the file or --max-layers: the default model fits this host's memory whole.
    let id = dgr_gguf::model_identity(&model).unwrap().id;
    let slices = t.dir.join("slices");
    let whole = Worker::start_placed(&t, "d", &["--model-id", &id, "--slice-dir", slices.to_str().unwrap()], None);
    assert_eq!(whole.layers, (0, 30), "{}", whole.log());
    assert!(whole.log().contains("fetched"), "{}", whole.log());
    drop(ws);
    t.wait_live(&[&whole.id], Duration::from_secs(5), "the fetched replica alone");
    assert_same_output(&t.generate(&args), &want, "the fetched replica");
    assert_eq!(t.log().matches("a starting worker of model").count(), 4, "{}", t.log());
    println!("placed: {ranges:?}, then {:?} for a worker fetching its slice", whole.layers);
}

/// The tracker routes a session only to workers with KV room for it: while one session holds
/// most of a worker's positions, a second as large is refused as `full` (room frees as sessions
/// end) without reaching the worker, and a small one is routed beside it.
#[test]
fn a_session_goes_only_where_its_kv_positions_fit() {
    let _g = serial();
    // Heartbeats often, so the reservation shows soon; a session long enough (~10 s) to outlast
    // the checks on a slow machine.
    let t = Tracker::start("kv-room", &["--heartbeat-ms", "100"]);
    let w = Worker::start(&t, (0, 30), "w", &["--kv-tokens", "2000"]);
    t.wait_live(&[&w.id], Duration::from_secs(5), "joined");
    let mut long = common::dgr();
    long.args(["generate", "--tracker", &t.addr, "--format", "json", "--threads", "1", "--prompt", PROMPT])
        .args(["--max-tokens", "1500", "--ignore-eos", "--model"])
        .arg(common::model());
    let mut long = common::Proc::spawn(long);
    let start = Instant::now();
    let reserved = || t.workers()[0]["kv_reserved_tokens"].as_u64().unwrap();
    while reserved() == 0 {
        assert!(long.running(), "the long session ended before its reservation was seen");
        assert!(start.elapsed() < Duration::from_secs(10), "no reservation reported");
        std::thread::sleep(Duration::from_millis(20));
    }
    let held = reserved();
    assert!(held > 1500 && held <= 2000, "the long session reserved {held} positions");
    let big = t.generate(&["--prompt", PROMPT, "--max-tokens", "1500"]);
    assert_eq!(big["error"]["kind"], "full", "{big}");
    let small = t.generate(&["--prompt", PROMPT, "--max-tokens", "8"]);
    assert!(small.get("error").is_none(), "{small}");
    assert!(long.running(), "the long session ended before the checks: they proved nothing");
    let failures = metrics(w.addr.as_deref().unwrap()).0;
    assert!(!failures.contains_key("dgr_worker_failures_total{kind=\"overloaded\"}"), "a session reached a full worker: {failures:?}");
    println!("a worker of 2000 KV positions holding {held}: a second large session refused as full, a small one served");
}

/// A raw driver connection to a worker (over its secure channel): Hello, then frames.
struct Raw {
    conn: tokio_util::codec::Framed<dgr_proto::SecureStream, tokio_util::codec::LengthDelimitedCodec>,
}

impl Raw {
    async fn connect(addr: &str) -> Raw {
        let s = dgr_proto::dial(addr, Duration::from_secs(5)).await.unwrap();
        let mut r = Raw { conn: tokio_util::codec::Framed::new(s, codec(1 << 20)) };
        r.send(Body::Hello(Hello { protocol_version: PROTOCOL_VERSION, role: Role::Driver as i32, info: None })).await;
        assert!(matches!(r.recv().await, Body::Hello(_)));
        r
    }

    async fn send(&mut self, b: Body) {
        self.conn.send(Bytes::from(Frame::new(b).encode_to_vec())).await.unwrap();
    }

    async fn recv(&mut self) -> Body {
        let f = tokio::time::timeout(Duration::from_secs(5), self.conn.next()).await.unwrap().unwrap().unwrap();
        Frame::decode(f).unwrap().body.unwrap()
    }
}

fn open_for(t: &Ticket, stage: usize, ticket: Option<SignedTicket>) -> OpenSession {
    let s = &t.stages[stage];
    OpenSession {
        session_id: t.session_id.clone(),
        schema: Some(BoundarySchema {
            protocol_version: PROTOCOL_VERSION,
            model_id: t.model_id.clone(),
            layer_start: s.layer_start,
            layer_end: s.layer_end,
            hidden: 576,
            seam_dtype: 0,
            engine: t.engine.clone(),
        }),
        stage_index: stage as u32,
        n_stages: t.stages.len() as u32,
        next: t.stages.get(stage + 1).map(|n| n.addr.clone()).unwrap_or_default(),
        max_positions: 16,
        ticket,
        ..Default::default()
    }
}

/// Every kind of bad ticket is refused with its reason, counted, and leaves a concurrent
/// session's output unchanged.
#[test]
fn forged_tickets_are_refused_and_others_are_unaffected() {
    let _g = serial();
    let t = Tracker::start("tickets", &["--ticket-ttl-ms", "1500"]);
    let w0 = Worker::start(&t, (0, 15), "w0", &[]);
    let w1 = Worker::start(&t, (15, 30), "w1", &[]);
    t.wait_live(&[&w0.id, &w1.id], Duration::from_secs(5), "joined");
    let model_id = dgr_gguf::model_identity(&common::model()).unwrap().id;
    let want = one_process(&["--max-tokens", "48"]);

    // A legitimate generation runs while the forgeries arrive.
    let tracker = t.addr.clone();
    let legit = std::thread::spawn(move || {
        let out = common::dgr()
            .args(["generate", "--tracker", &tracker, "--format", "json", "--threads", "1", "--prompt", PROMPT, "--max-tokens", "48"])
            .arg("--model")
            .arg(common::model())
            .output()
            .unwrap();
        serde_json::from_slice::<Value>(&out.stdout).unwrap()
    });
    let rt = common::runtime();
    let reasons = rt.block_on(async {
        let mut c = TrackerClient::connect(&t.addr, Duration::from_secs(5)).await.unwrap();
        let ask = RouteRequest { model_id: model_id.clone(), budget_tokens: 16, request_id: "forge".into(), ..Default::default() };
        let TrackerBody::RouteReply(reply) = c.call(TrackerBody::RouteRequest(ask)).await.unwrap() else { panic!() };
        let (real, signed) = (reply.route.unwrap(), reply.ticket.unwrap());
        assert_eq!(real.stages[0].worker_id, w0.id);
        // A route request excluding more workers than a route could ever have met is refused.
        let exclude: Vec<String> = (0..1025).map(|i| format!("w{i}")).collect();
        let ask =
            RouteRequest { model_id: model_id.clone(), budget_tokens: 16, request_id: "exclude".into(), exclude, ..Default::default() };
        match c.call(TrackerBody::RouteRequest(ask)).await {
            Err(dgr_proto::TrackerCallError::Refused(r)) => {
                assert_eq!(r.kind(), dgr_proto::RefusalKind::BadRequest, "{}", r.message);
                assert!(r.message.contains("excluded"), "refused for another reason: {}", r.message);
            }
            other => panic!("a route request excluding 1025 workers was answered {other:?}"),
        }
        let addr0 = w0.addr.clone().unwrap();
        let mut attempts: Vec<(&str, usize, OpenSession)> = Vec::new();
        attempts.push(("missing", 0, open_for(&real, 0, None)));
        let other_key = dgr_proto::new_signing_key().unwrap();
        attempts.push(("forged", 0, open_for(&real, 0, Some(sign_ticket(&real, &other_key)))));
        let mut altered = signed.clone();
        let mut richer = real.clone();
        richer.budget_tokens = 1 << 20;
        altered.body = richer.encode_to_vec();
        attempts.push(("forged", 0, open_for(&real, 0, Some(altered))));
        // Presented to a worker it does not name: w1 in stage 0's place.
        attempts.push(("not_named", 1, open_for(&real, 0, Some(signed.clone()))));
        let mut redirected = open_for(&real, 0, Some(signed.clone()));
        redirected.next = "127.0.0.1:9".into();
        attempts.push(("mismatch", 0, redirected));
        let mut greedy = open_for(&real, 0, Some(signed.clone()));
        greedy.max_positions = 17;
        attempts.push(("over_budget", 0, greedy));
        let mut seen = Vec::new();
        for (reason, worker, open) in attempts {
            let addr = if worker == 0 { addr0.clone() } else { w1.addr.clone().unwrap() };
            let mut raw = Raw::connect(&addr).await;
            raw.send(Body::Open(open)).await;
            match raw.recv().await {
                Body::Error(e) => {
                    assert_eq!(e.error_kind(), ErrorKind::Ticket, "{reason}: {}", e.message);
                    seen.push((reason, e.message));
                }
                other => panic!("{reason}: accepted: {other:?}"),
            }
        }
        // Expired: the genuine ticket, once the clock is past the expiry it names.
        let expires = Ticket::decode(&signed.body[..]).unwrap().expires_unix_ms;
        let deadline = Instant::now() + Duration::from_secs(10);
        while unix_ms() <= expires {
            assert!(Instant::now() < deadline, "the ticket's expiry {expires} is not reached");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut raw = Raw::connect(&addr0).await;
        raw.send(Body::Open(open_for(&real, 0, Some(signed)))).await;
        match raw.recv().await {
            Body::Error(e) => seen.push(("expired", e.message)),
            other => panic!("expired ticket accepted: {other:?}"),
        }
        seen
    });
    for (reason, msg) in &reasons {
        println!("{reason}: {msg}");
    }
    let m0 = metrics(w0.addr.as_ref().unwrap());
    for (reason, n) in [("missing", 1.0), ("forged", 2.0), ("mismatch", 1.0), ("over_budget", 1.0), ("expired", 1.0)] {
        assert_eq!(m0.get(&format!("dgr_worker_ticket_refusals_total{{reason=\"{reason}\"}}")), n, "{reason}");
    }
    let m1 = metrics(w1.addr.as_ref().unwrap());
    assert_eq!(m1.get("dgr_worker_ticket_refusals_total{reason=\"not_named\"}"), 1.0);
    assert_same_output(&legit.join().unwrap(), &want, "the concurrent session");
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}

fn totals(rows: &Value, field: &str) -> u64 {
    rows["rows"].as_array().unwrap().iter().map(|r| r[field].as_u64().unwrap()).sum()
}

/// Completed, cancelled and failed requests are each recorded once; the ledger's totals equal
/// the sum of the requests' own usage, and survive a tracker restart. A key over its quota is
/// refused before any worker is touched.
#[test]
fn the_ledger_is_exact_durable_and_enforces_quotas() {
    let _g = serial();
    let mut t = Tracker::start("ledger", &[]);
    let mut w0 = Worker::start(&t, (0, 15), "w0", &[]);
    let w1 = Worker::start(&t, (15, 30), "w1", &[]);
    t.wait_live(&[&w0.id, &w1.id], Duration::from_secs(5), "joined");
    let alice = t.add_key("alice", 0);

    let mut prompt_len = 0;
    let mut expect_prompt = 0;
    let mut expect_completion = 0;
    let mut expect_layer_tokens = 0;
    let mut account = |v: &Value| {
        assert_eq!(v["ledger"], "recorded", "{v}");
        prompt_len = v["prompt_tokens"].as_array().unwrap().len() as u64;
        expect_prompt += prompt_len;
        expect_completion += v["tokens"].as_array().unwrap().len() as u64;
        expect_layer_tokens += v["usage"].as_array().unwrap().iter().map(|u| u["layer_tokens"].as_u64().unwrap()).sum::<u64>();
    };
    for n in ["5", "9"] {
        let v = t.generate(&["--prompt", PROMPT, "--max-tokens", n, "--api-key", &alice]);
        account(&v);
    }
    // A cancelled request, driven through the library (the CLI has no cancel).
    let model_id = dgr_gguf::model_identity(&common::model()).unwrap().id;
    let rt = common::runtime();
    let cancelled = rt.block_on(async {
        use dgr_driver::{tracker, DriveOptions, Flow, GenRequest};
        let request_id = tracker::new_request_id();
        let prompt: Vec<u32> = vec![504, 2365, 6354, 16438];
        let (route, ticket) = tracker::route(&t.addr, &model_id, "", 64, &alice, &request_id, &[], &[]).await.unwrap();
        let session = ticket.1;
        let req = GenRequest {
            prompt_tokens: prompt.clone(),
            max_tokens: 40,
            sampling: Default::default(),
            top_logprobs: 0,
            seam_dtype: dgr_proto::SeamDtype::F32,
            ticket: Some(ticket),
            hash_rows: false,
            constraint: None,
            stop_tokens: Vec::new(),
        };
        let mut n = 0;
        let result = dgr_driver::generate(&route, &req, &DriveOptions::default(), |_| {
            n += 1;
            if n == 3 {
                Flow::Cancel
            } else {
                Flow::Continue
            }
        })
        .await;
        let attempts = [dgr_driver::Attempt { route, session, usage: result.as_ref().map(|c| c.usage.clone()).unwrap_or_default() }];
        let usage = tracker::request_usage(&request_id, &alice, &model_id, prompt.len(), &result, &attempts);
        assert_eq!(tracker::report(&t.addr, usage.clone()).await, "recorded");
        // Sent again: acknowledged, not counted twice.
        assert_eq!(tracker::report(&t.addr, usage.clone()).await, "recorded");
        usage
    });
    assert_eq!(cancelled.status, "cancelled");
    expect_prompt += cancelled.prompt_tokens;
    expect_completion += cancelled.completion_tokens;
    expect_layer_tokens += cancelled.stages.iter().map(|s| s.layer_tokens).sum::<u64>();

    // A failed request: the first stage dies mid-generation.
    let tracker_addr = t.addr.clone();
    let alice2 = alice.clone();
    let failing = std::thread::spawn(move || {
        let out = common::dgr()
            .args(["generate", "--tracker", &tracker_addr, "--format", "json", "--threads", "1", "--prompt", PROMPT])
            .args(["--max-tokens", "400", "--ignore-eos", "--api-key", &alice2, "--step-timeout", "2"])
            .arg("--model")
            .arg(common::model())
            .output()
            .unwrap();
        serde_json::from_slice::<Value>(&out.stdout).unwrap()
    });
    // Killed once it decodes for this request, so some tokens were delivered.
    let decoded = |w: &Worker| metrics(w.addr.as_ref().unwrap()).get("dgr_worker_tokens_decoded_total");
    let (before, deadline) = (decoded(&w0), Instant::now() + Duration::from_secs(30));
    while decoded(&w0) == before {
        assert!(Instant::now() < deadline, "the failing request never decoded on w0");
        std::thread::sleep(Duration::from_millis(10));
    }
    w0.kill();
    let failed = failing.join().unwrap();
    assert!(failed["error"].is_object(), "{failed}");

    let by_key = t.usage("key");
    let alice_rows: Vec<&Value> = by_key["rows"].as_array().unwrap().iter().filter(|r| r["key"] == "alice").collect();
    assert_eq!(alice_rows.len(), 1, "{by_key}");
    let a = alice_rows[0];
    assert_eq!(a["requests"], 4, "two completed, one cancelled, one failed: {a}");
    let failed_completion = a["completion_tokens"].as_u64().unwrap() - expect_completion;
    assert!(failed_completion > 0, "the failed request's delivered tokens are billed: {a}");
    assert_eq!(a["prompt_tokens"].as_u64().unwrap(), expect_prompt + prompt_len, "{a}");
    assert!(a["layer_tokens"].as_u64().unwrap() >= expect_layer_tokens, "{a}");
    let by_worker = t.usage("worker");
    println!("ledger by key: {by_key}\nby worker: {by_worker}");
    assert_eq!(totals(&by_worker, "disagreements"), 0, "driver and workers agree: {by_worker}");

    // Restart on the same database: the same totals.
    let dir = t.dir.clone();
    let addr = t.addr.clone();
    t.kill();
    let t2 = Tracker::start_in(&dir, &addr, &[]);
    assert_eq!(t2.usage("key"), by_key, "the ledger after a restart");
    assert_eq!(t2.usage("worker"), by_worker);
    t2.wait_live(&[&w1.id], Duration::from_secs(5), "w1 re-joined by itself");

    // Quota: a route reserves its whole budget (prompt + max tokens). "small" may use the
    // prompt and 30 tokens: one request of 30 new tokens fits exactly and uses them; the next is
    // refused before any worker is touched (w1's opened-session count does not move).
    let small = t2.add_key("small", prompt_len + 30);
    let w0b = Worker::start(&t2, (0, 15), "w0", &[]);
    t2.wait_live(&[&w0b.id, &w1.id], Duration::from_secs(5), "w0 back");
    let v = t2.generate(&["--prompt", PROMPT, "--max-tokens", "30", "--ignore-eos", "--api-key", &small]);
    assert_eq!(v["ledger"], "recorded", "{v}");
    let opened = metrics(w1.addr.as_ref().unwrap()).get("dgr_worker_sessions_opened_total");
    let refused = t2.generate(&["--prompt", PROMPT, "--max-tokens", "2", "--api-key", &small]);
    assert_eq!(refused["error"]["kind"], "quota_exceeded", "{refused}");
    let bad = t2.generate(&["--prompt", PROMPT, "--max-tokens", "2", "--api-key", "dgr-not-a-key"]);
    assert_eq!(bad["error"]["kind"], "bad_api_key", "{bad}");
    assert_eq!(metrics(w1.addr.as_ref().unwrap()).get("dgr_worker_sessions_opened_total"), opened, "a worker was touched");
}

/// The data path never touches the tracker: a session running while the tracker is killed and
/// restarted finishes unchanged, its usage arrives after the restart and is counted once, and
/// the workers re-join by themselves.
#[test]
fn running_sessions_survive_a_tracker_restart() {
    let _g = serial();
    let mut t = Tracker::start("restart", &[]);
    let w0 = Worker::start(&t, (0, 15), "w0", &[]);
    let w1 = Worker::start(&t, (15, 30), "w1", &[]);
    t.wait_live(&[&w0.id, &w1.id], Duration::from_secs(5), "joined");
    let want = one_process(&["--max-tokens", "160", "--ignore-eos"]);
    let addr = t.addr.clone();
    let running = std::thread::spawn(move || {
        let out = common::dgr()
            .args(["generate", "--tracker", &addr, "--format", "json", "--threads", "1", "--prompt", PROMPT])
            .args(["--max-tokens", "160", "--ignore-eos"])
            .arg("--model")
            .arg(common::model())
            .output()
            .unwrap();
        serde_json::from_slice::<Value>(&out.stdout).unwrap()
    });
    // Kill the tracker once the session has its route and decodes on both workers.
    let start = Instant::now();
    while metrics(w1.addr.as_ref().unwrap()).get("dgr_worker_tokens_decoded_total") < 1.0 {
        assert!(start.elapsed() < Duration::from_secs(30), "the session never started decoding");
        std::thread::sleep(Duration::from_millis(10));
    }
    let dir = t.dir.clone();
    let addr = t.addr.clone();
    // kill() waits for the process to be gone, and with it its listening socket.
    t.kill();
    assert_eq!(metrics(w0.addr.as_ref().unwrap()).get("dgr_worker_sessions_open"), 1.0, "the session ended before the kill");
    let t2 = Tracker::start_in(&dir, &addr, &[]);
    let got = running.join().unwrap();
    assert_same_output(&got, &want, "the session across the restart");
    assert_eq!(got["ledger"], "recorded", "{got}");
    let took = t2.wait_live(&[&w0.id, &w1.id], Duration::from_secs(5), "re-joined");
    println!("workers re-joined {took:?} after the check began");
    let by_key = t2.usage("key");
    assert_eq!(totals(&by_key, "requests"), 1, "{by_key}");
    assert_eq!(totals(&by_key, "completion_tokens"), 160, "{by_key}");
    // The workers' own reports arrive once they re-join, each counted once.
    let start = Instant::now();
    loop {
        let by_worker = t2.usage("worker");
        if totals(&by_worker, "requests") == 2 {
            // One row a decode step, and a speculative step's rejected drafts besides.
            assert_eq!(totals(&by_worker, "tokens_decoded"), 2 * (159 + rejected_drafts(&got)), "{by_worker}");
            assert_eq!(totals(&by_worker, "disagreements"), 0, "{by_worker}");
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "workers' reports missing: {by_worker}");
        std::thread::sleep(Duration::from_millis(100));
    }
}
