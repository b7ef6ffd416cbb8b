//! Cache-aware routing with real `dgr tracker` and `dgr worker` processes on a synthetic model:
//! two workers for each of two stages. A request whose prompt one replica holds in its prefix
//! caches goes to those workers and attaches the cached blocks, also when they are more loaded
//! than the others; once their load is twice the others', the request goes to the others, which
//! compute the whole prompt.
//!
//! Load is the planner's: 1 + the sessions a worker's heartbeat reports (+ routes issued since),
//! times the worker's time per layer, which every worker here reports as the same figure
//! (`DGR_FAULT_STEP_US_PER_LAYER`), so the replicas are equal and the line falls exactly at twice
//! the load.
//! Sessions are held open on a chosen replica through routes with fixed stages, and each step
//! waits (with a deadline) until the tracker's view shows them and no route is still unseen.

#![cfg(feature = "fault-injection")]

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
        stop_tokens: Vec::new(),
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
                engine: String::new(),
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
    let start = |layers, key: &str| Worker::start_on(&t, layers, key, &[], &[("DGR_FAULT_STEP_US_PER_LAYER", "100")], Some(&model));
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

    // Idle, the holders serve, attaching the five blocks on both stages.
    let second = generate(&t, &model_id, &with(&[1, 2, 3]));
    assert_eq!(second, (x.clone(), 80), "the idle holders");
    assert_eq!((hits(&x[0]), hits(&x[1])), (5.0, 5.0));
    assert_eq!(metrics(&t.addr).get("dgr_tracker_routes_prefix_total"), 1.0);

    // Holders at 1 + 2 sessions, the others at 1 + 1: 1.5 times the load, the holders serve.
    let held = [Held::open(&t, &model_id, &x), Held::open(&t, &model_id, &x), Held::open(&t, &model_id, &y)];
    settle(&t, &[(&x, 2), (&y, 1)], &x, "two sessions on the holders, one on the others");
    let third = generate(&t, &model_id, &with(&[4, 5, 6]));
    assert_eq!(third, (x.clone(), 80), "the holders at 1.5 times the others' load");

    // Holders at 1 + 3: exactly twice the others' load, and the others serve.
    let more = Held::open(&t, &model_id, &x);
    settle(&t, &[(&x, 3), (&y, 1)], &x, "three sessions on the holders, one on the others");
    let fourth = generate(&t, &model_id, &with(&[7, 8, 9]));
    assert_eq!(fourth, (y.clone(), 0), "the holders at twice the others' load");
    for id in &y {
        // The others never held the prompt: they attached nothing.
        assert_eq!(hits(id), 0.0, "{id}");
    }
    assert_eq!(metrics(&t.addr).get("dgr_tracker_routes_prefix_total"), 2.0);
    drop((held, more));
}
