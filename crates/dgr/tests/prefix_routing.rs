//! Cache-aware routing with real `dgr tracker` and `dgr worker` processes on a synthetic model:
//! two workers for each of two stages. A request whose prompt one replica holds in its prefix
//! caches goes to those workers and attaches the cached blocks, also when they are more loaded
//! than the others; once their load is twice the others', the request goes to the others, which
//! compute the whole prompt.
//!
//! Load is the planner's: 1 + the sessions a worker's heartbeat reports (+ routes issued since),
//! times the worker's time per layer as it measured it at start (equal replicas, within noise:
//! each step's expected route is worked out from the measured times).
//! Sessions are held open on a chosen replica through routes with fixed stages, and each step
//! waits (with a deadline) until the tracker's view shows them and no route is still unseen.

mod common;
use common::swarm::{Tracker, Worker};
use common::{dgr, metrics, runtime};

use dgr_driver::{tracker, DriveOptions, Flow, GenRequest};
use dgr_proto::{RouteRequest, RouteStage, SeamDtype, SwarmQuery, SwarmReply, TrackerBody, TrackerClient};
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(20);

/// A six-layer synthetic model in the tracker's directory.
fn synth(t: &Tracker) -> PathBuf {
    let path = t.dir.join("synth.gguf");
    let out = dgr().args(["synth", "--layers", "6", "--type", "q8_0", "--out"]).arg(&path).output().expect("dgr synth");
    assert!(out.status.success(), "dgr synth: {}", String::from_utf8_lossy(&out.stderr));
    path
}

fn swarm(addr: &str) -> SwarmReply {
    runtime().block_on(async {
        let mut c = TrackerClient::connect(addr, Duration::from_secs(5)).await.expect("the tracker");
        match c.call(TrackerBody::SwarmQuery(SwarmQuery {})).await {
            Ok(TrackerBody::SwarmReply(r)) => r,
            other => panic!("swarm query answered with {other:?}"),
        }
    })
}

/// Waits until every worker in `sessions` reports that many sessions, every one in `holding`
/// reports held prefix blocks, and no route is still unseen in a heartbeat.
fn settle(t: &Tracker, sessions: &[(&Vec<String>, u32)], holding: &[String], what: &str) {
    let start = Instant::now();
    loop {
        let r = swarm(&t.addr);
        let of = |id: &String| r.workers.iter().find(|w| w.worker_id == *id).unwrap_or_else(|| panic!("{id} not listed"));
        let loads = sessions.iter().all(|(ids, n)| ids.iter().all(|id| of(id).load.unwrap_or_default().sessions == *n));
        let held = holding.iter().all(|id| of(id).prefix_blocks > 0);
        if loads && held && r.workers.iter().all(|w| w.recent_routes == 0) {
            return;
        }
        assert!(start.elapsed() < WAIT, "{what}: the tracker never showed it: {:?}", r.workers);
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn request(prompt: &[u32], max_tokens: usize, ticket: Option<(dgr_proto::SignedTicket, [u8; 16])>) -> GenRequest {
    GenRequest {
        prompt_tokens: prompt.to_vec(),
        max_tokens,
        sampling: Default::default(),
        top_logprobs: 0,
        seam_dtype: SeamDtype::F32,
        ticket,
        hash_rows: false,
        constraint: None,
    }
}

/// One request through the tracker: the workers of its route and the prompt tokens it attached.
fn generate(t: &Tracker, model_id: &str, prompt: &[u32]) -> (Vec<String>, usize) {
    runtime().block_on(async {
        let id = tracker::new_request_id();
        let (route, ticket) = tracker::route(&t.addr, model_id, "", 256, "", &id, &[], prompt).await.expect("a route");
        let ids = route.stages.iter().map(|s| s.worker_id.clone()).collect();
        let done = dgr_driver::generate(&route, &request(prompt, 4, Some(ticket)), &DriveOptions::default(), |_| Flow::Continue).await;
        (ids, done.expect("the generation").cached_tokens)
    })
}

/// A session open on exactly the workers `ids` (stages of 3 layers) until dropped.
struct Held {
    release: mpsc::Sender<()>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Held {
    fn open(t: &Tracker, model_id: &str, ids: &[String]) -> Held {
        let fixed: Vec<RouteStage> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| RouteStage {
                worker_id: id.clone(),
                addr: String::new(),
                layer_start: 3 * i as u32,
                layer_end: 3 * i as u32 + 3,
            })
            .collect();
        let ask = RouteRequest {
            model_id: model_id.into(),
            budget_tokens: 256,
            request_id: tracker::new_request_id(),
            fixed,
            ..Default::default()
        };
        let addr = t.addr.clone();
        let (release, released) = mpsc::channel();
        let (opened_tx, opened) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            runtime().block_on(async {
                let mut c = TrackerClient::connect(&addr, Duration::from_secs(5)).await.expect("the tracker");
                let (route, ticket) = tracker::routed(c.call(TrackerBody::RouteRequest(ask)).await.expect("a fixed route")).unwrap();
                let prompt: Vec<u32> = (0..20).map(|i| 200 + i).collect();
                // The first token arrives with the session open on every stage: it stays open
                // while this thread waits, and is cancelled once released.
                let _ = dgr_driver::generate(&route, &request(&prompt, 64, Some(ticket)), &DriveOptions::default(), |_| {
                    let _ = opened_tx.send(());
                    let _ = released.recv();
                    Flow::Cancel
                })
                .await;
            })
        });
        opened.recv_timeout(WAIT).expect("the held session opened");
        Held { release, thread: Some(thread) }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let _ = self.release.send(());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[test]
fn requests_go_to_the_replica_holding_their_prefix_unless_it_is_twice_as_loaded() {
    let t = Tracker::start("prefix-routing", &["--heartbeat-ms", "100"]);
    let model = synth(&t);
    let model_id = dgr_gguf::model_identity(&model).unwrap().id;
    let start = |layers, key: &str| Worker::start_on(&t, layers, key, &[], &[], Some(&model));
    // Two workers per stage; a route takes either of each.
    let workers = [start((0, 3), "a0"), start((0, 3), "b0"), start((3, 6), "a1"), start((3, 6), "b1")];
    let ids: Vec<&str> = workers.iter().map(|w| w.id.as_str()).collect();
    t.wait_live(&ids, WAIT, "four workers");
    let hits = |id: &str| {
        let w = workers.iter().find(|w| w.id == id).unwrap();
        metrics(w.addr.as_ref().unwrap()).get("dgr_worker_prefix_cache_hit_blocks_total")
    };

    // Five full blocks, and a few tokens past them in each later request.
    let prompt: Vec<u32> = (0..80).map(|i| (i * 7 + 3) % 256).collect();
    let with = |tail: &[u32]| [&prompt[..], tail].concat();
    let (x, cached) = generate(&t, &model_id, &prompt);
    assert_eq!(cached, 0, "a cold cache");
    // The holders x, one per stage, and the other replica y of each stage.
    let other = |stage: usize| ids[2 * stage..2 * stage + 2].iter().find(|id| **id != x[stage]).unwrap().to_string();
    let y = vec![other(0), other(1)];
    settle(&t, &[(&x, 0)], &x, "the first route's cached prefix reported");

    // The planner's rule, stage by stage: a holder's expected time (its measured time per layer
    // × its load) counts half, and at a tie the holder loses. The workers measured their own
    // speed at start, so equal replicas may differ a little: the expectation reads it.
    let r = swarm(&t.addr);
    let step = |id: &String| {
        let w = r.workers.iter().find(|w| w.worker_id == *id).unwrap();
        w.registration.as_ref().unwrap().step_us_per_layer.max(1.0)
    };
    let expect = |lx: f64, ly: f64| -> (Vec<String>, usize) {
        let pick = |s: usize| if step(&x[s]) * lx / (2.0 * (1.0 - 1e-6)) < step(&y[s]) * ly { &x[s] } else { &y[s] };
        let stages: Vec<String> = (0..2).map(|s| pick(s).clone()).collect();
        let cached = if stages == x { 80 } else { 0 };
        (stages, cached)
    };
    println!("µs per layer: holders {:?}, others {:?}", x.iter().map(step).collect::<Vec<_>>(), y.iter().map(step).collect::<Vec<_>>());

    // Idle, the holders serve, attaching the five blocks on both stages.
    let second = generate(&t, &model_id, &with(&[1, 2, 3]));
    assert_eq!(second, expect(1.0, 1.0), "the idle holders");
    assert_eq!(second, (x.clone(), 80), "equal replicas measure within 2× of each other");
    assert_eq!((hits(&x[0]), hits(&x[1])), (5.0, 5.0));
    assert_eq!(metrics(&t.addr).get("dgr_tracker_routes_prefix_total"), 1.0);

    // Holders at 1 + 2 sessions, the others at 1 + 1: under twice the load.
    let held = [Held::open(&t, &model_id, &x), Held::open(&t, &model_id, &x), Held::open(&t, &model_id, &y)];
    settle(&t, &[(&x, 2), (&y, 1)], &x, "two sessions on the holders, one on the others");
    let third = generate(&t, &model_id, &with(&[4, 5, 6]));
    assert_eq!(third, expect(3.0, 2.0), "the holders at 1.5 times the others' load");

    // Holders at 1 + 4: past twice the others' load (exactly twice is the unit tests' boundary:
    // here the replicas' measured speeds, equal within noise, would settle it).
    let more = [Held::open(&t, &model_id, &x), Held::open(&t, &model_id, &x)];
    settle(&t, &[(&x, 4), (&y, 1)], &x, "four sessions on the holders, one on the others");
    let fourth = generate(&t, &model_id, &with(&[7, 8, 9]));
    assert_eq!(fourth, expect(5.0, 2.0), "the holders at 2.5 times the others' load");
    assert_eq!(fourth, (y.clone(), 0), "equal replicas measure within 25% of each other");
    for (s, id) in fourth.0.iter().enumerate() {
        // A stage the other replica served attached nothing: it never held the prompt.
        assert_eq!(hits(id) == 0.0, *id == y[s], "stage {s} on {id}");
    }
    let prefix_routes = [&second.0, &third.0, &fourth.0].iter().filter(|r| r.iter().any(|id| x.contains(id))).count();
    assert_eq!(metrics(&t.addr).get("dgr_tracker_routes_prefix_total"), prefix_routes as f64);
    drop((held, more));
}
