//! Spot checks catch a worker that lies (test builds only: `--features fault-injection` compiles
//! in a worker that corrupts the rows it sends). Through a real gateway, with every session
//! checked: the liar is quarantined within a few sessions, and after that no client receives its
//! corrupted tokens.
#![cfg(all(feature = "real-model", feature = "fault-injection"))]

mod common;

use common::swarm::{Gateway, Tracker, Worker};
use common::{dgr_json, metrics, serial};
use std::time::Duration;

const PROMPT: &str = "The quick brown fox";

/// The most sessions before the liar is caught: a session it serves is checked against another
/// replica; one it does not serve swaps in the replica issued the fewest routes, and after the
/// first session's check that is the liar (whatever step times the planner prefers).
const CAUGHT_WITHIN: usize = 2;

/// POST /v1/completions, greedy; the completion's text.
fn complete(g: &Gateway, model: &str) -> String {
    let body = serde_json::json!({ "model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0 });
    let (status, _, v) = g.post("/v1/completions", None, &body);
    assert_eq!(status, 200, "{v}");
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

#[test]
fn a_lying_worker_is_caught_and_quarantined() {
    let _g = serial();
    let want = dgr_json(&["generate", "--prompt", PROMPT, "--max-tokens", "12", "--format", "json", "--threads", "1"]);
    let want = want["text"].as_str().unwrap().to_string();
    let t = Tracker::start("verify", &[]);
    let liar = Worker::start_with_env(&t, (0, 15), "liar", &[], &[("DGR_FAULT_CORRUPT_ROWS", "1")]);
    let honest = [Worker::start(&t, (0, 15), "h1", &[]), Worker::start(&t, (0, 15), "h2", &[]), Worker::start(&t, (15, 30), "tail", &[])];
    let mut ids: Vec<&str> = honest.iter().map(|w| w.id.as_str()).collect();
    ids.push(&liar.id);
    t.wait_live(&ids, Duration::from_secs(5), "joined");
    let token = t.token_file.to_str().unwrap();
    let g = Gateway::start(&[&t], &["--verify-fraction", "1", "--join-token-file", token]);
    let model = Gateway::model_name();

    let quarantined = || t.workers().iter().any(|w| w["worker_id"] == liar.id.as_str() && w["quarantined"] == true);
    let mut wrong = 0;
    let mut sessions = 0;
    loop {
        assert!(sessions < CAUGHT_WITHIN, "the liar was not caught within {CAUGHT_WITHIN} sessions");
        if complete(&g, &model) != want {
            wrong += 1;
        }
        sessions += 1;
        // The session's check runs after its response; give it a moment to land.
        let deadline = std::time::Instant::now() + Duration::from_secs(3);
        while !quarantined() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if quarantined() {
            break;
        }
    }
    println!("caught after {sessions} session(s); {wrong} of them carried its corrupted output");
    assert!(wrong <= sessions);

    let m = metrics(&t.addr);
    assert_eq!(m.get("dgr_tracker_workers_quarantined"), 1.0);
    assert!(metrics(&g.addr).get("dgr_gateway_spot_checks_total{result=\"quarantined\"}") >= 1.0);
    let routes_before = t.workers().iter().find(|w| w["worker_id"] == liar.id.as_str()).unwrap()["routes_total"].clone();
    for i in 0..8 {
        assert_eq!(complete(&g, &model), want, "session {i} after the quarantine");
    }
    let routes_after = t.workers().iter().find(|w| w["worker_id"] == liar.id.as_str()).unwrap()["routes_total"].clone();
    assert_eq!(routes_before, routes_after, "a quarantined worker got routes");
    // Honest workers are never blamed.
    for w in &honest {
        assert!(!t.workers().iter().any(|x| x["worker_id"] == w.id.as_str() && x["quarantined"] == true));
    }
}
