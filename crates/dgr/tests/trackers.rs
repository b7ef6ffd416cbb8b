//! Several trackers, one swarm, on the real default model with real processes on loopback:
//! trackers sharing one ledger sign with one key set and workers joined to all of them accept
//! tickets from any (and no other key); a restarted tracker lists every worker again within one
//! heartbeat interval.
#![cfg(feature = "real-model")]

mod common;

use common::swarm::{Tracker, Worker};
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
/// either, and refuse one signed by a key outside the set.
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
        };
        let got = rt.block_on(dgr_driver::generate(&route, &req, &Default::default(), |_| dgr_driver::Flow::Continue));
        let e = got.err().unwrap_or_else(|| panic!("a ticket of an outside key (naming {claim:016x}) was accepted"));
        assert_eq!(e.kind, "ticket", "{e:?}");
    }
    let m = common::metrics(w0.addr.as_ref().unwrap());
    assert_eq!(m.get("dgr_worker_ticket_refusals_total{reason=\"forged\"}"), 2.0);
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
