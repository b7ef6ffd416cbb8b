//! Encrypted, authenticated stage links on a real two-worker route, every hop behind a
//! recording proxy: the same session run in plaintext (both ends asked) shows what would leak —
//! the prompt's token ids and the hidden rows — and none of it is in the encrypted capture; a
//! byte flipped in flight fails the session with a typed integrity error, either way; a
//! recorded handshake replayed to a worker opens nothing; a worker whose key the ticket does not
//! name is refused by the driver and, as a next hop, by the previous stage; on a ticketless route,
//! by the key first seen at its address or pinned with `--peer-key`.
#![cfg(feature = "real-model")]

mod common;

use common::swarm::{Tracker, Worker};
use common::tap::{Dir, Tap};
use common::*;
use dgr_proto::{Body, Frame};
use prost::Message;
use serde_json::Value;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

const CUTS: [usize; 3] = [0, 15, 30];

/// `dgr generate --route` through `route` (comma-separated), greedy, with `extra` flags.
fn generate(route: &str, prompt: &str, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["--format", "json", "--threads", "1", "--prompt", prompt, "--route", route, "--max-tokens", "24", "--ignore-eos"];
    args.extend_from_slice(extra);
    Proc::spawn(generate_cmd(&args)).wait_within(Duration::from_secs(60))
}

fn ok_json(out: &std::process::Output, what: &str) -> Value {
    assert!(out.status.success(), "{what}: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn error_kind(out: &std::process::Output, what: &str) -> String {
    assert_eq!(out.status.code(), Some(2), "{what}: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["error"]["kind"].as_str().unwrap_or_default().to_string()
}

/// The protobuf encoding of `ids` as a packed repeated field's contents (varints).
fn varints(ids: &[u32]) -> Vec<u8> {
    let mut out = Vec::new();
    for &id in ids {
        prost::encoding::encode_varint(u64::from(id), &mut out);
    }
    out
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

/// Every `Forward`'s hidden rows in a plaintext connection's bytes from its dialler.
fn hidden_rows(conn: &[u8]) -> Vec<Vec<u8>> {
    let mut rows = Vec::new();
    let mut at = 4; // the "DGRP" preamble
    while at + 4 <= conn.len() {
        let len = u32::from_be_bytes(conn[at..at + 4].try_into().unwrap()) as usize;
        if at + 4 + len > conn.len() {
            break;
        }
        if let Ok(Frame { body: Some(Body::Forward(f)) }) = Frame::decode(&conn[at + 4..at + 4 + len]) {
            if !f.hidden.is_empty() {
                rows.push(f.hidden);
            }
        }
        at += 4 + len;
    }
    rows
}

/// Two workers each behind a tap; the route through the taps.
struct Hops {
    _workers: Workers,
    taps: Vec<Tap>,
}

impl Hops {
    fn start(extra: &[&str], flip: [Option<(Dir, usize)>; 2]) -> Hops {
        let workers = Workers::start(&CUTS, extra);
        let taps = workers.addrs.iter().zip(flip).map(|(a, f)| Tap::start(a, f)).collect();
        Hops { _workers: workers, taps }
    }

    fn route(&self) -> String {
        self.taps.iter().map(|t| t.addr.clone()).collect::<Vec<_>>().join(",")
    }
}

#[test]
fn a_recorded_route_holds_no_prompt_ids_or_hidden_rows_in_clear() {
    let _g = serial();
    let p = prompt("capital");
    let ids = varints(&p.tokens);

    let plain = Hops::start(&["--insecure-plaintext"], [None, None]);
    let clear = ok_json(&generate(&plain.route(), &p.text, &["--insecure-plaintext"]), "plaintext route");
    let clear_bytes: Vec<u8> = plain.taps.iter().flat_map(Tap::captured).collect();
    assert!(contains(&clear_bytes, &ids), "the plaintext capture shows the prompt's ids (the search can find them)");
    let rows: Vec<Vec<u8>> = plain.taps[1].conns_up.lock().unwrap().iter().flat_map(|c| hidden_rows(&c.lock().unwrap())).collect();
    assert!(rows.len() >= 2, "the plaintext capture of stage 1's hop holds the hidden rows: {}", rows.len());

    let secure = Hops::start(&[], [None, None]);
    let sealed = ok_json(&generate(&secure.route(), &p.text, &[]), "encrypted route");
    assert_eq!(sealed["tokens"], clear["tokens"], "the same session either way");
    let sealed_bytes: Vec<u8> = secure.taps.iter().flat_map(Tap::captured).collect();
    assert!(sealed_bytes.len() > 1000, "bytes passed: {}", sealed_bytes.len());
    assert!(!contains(&sealed_bytes, &ids), "the prompt's token ids are in clear");
    assert!(!contains(&sealed_bytes, p.text.as_bytes()), "the prompt's text is in clear");
    // 32-byte runs of every hidden row (8 floats) the plaintext route carried.
    let mut checked = 0;
    for row in &rows {
        for w in row.chunks_exact(32).step_by(16) {
            assert!(!contains(&sealed_bytes, w), "hidden floats in clear");
            checked += 1;
        }
    }
    println!("capture: {} bytes encrypted vs {} plaintext; {checked} hidden-row windows absent", sealed_bytes.len(), clear_bytes.len());
}

#[test]
fn a_byte_flipped_in_flight_fails_the_session_as_an_integrity_error() {
    let _g = serial();
    let p = prompt("capital");
    // Toward stage 0 (the driver's frames), and from the last stage back (the tokens): past the
    // route probe's few hundred bytes, inside the session's traffic.
    for (flip, what) in [([Some((Dir::Up, 1200)), None], "driver -> stage 0"), ([None, Some((Dir::Down, 1500))], "stage 1 -> driver")] {
        let hops = Hops::start(&[], flip);
        let started = Instant::now();
        let kind = error_kind(&generate(&hops.route(), &p.text, &[]), what);
        assert_eq!(kind, "integrity", "{what}");
        println!("{what}: a flipped byte failed the session as {kind} in {:?}", started.elapsed());
    }
}

#[test]
fn plaintext_needs_both_ends_to_ask() {
    let _g = serial();
    let p = prompt("capital");
    let secure = Workers::start(&CUTS, &[]);
    let out = generate(&secure.route(), &p.text, &["--insecure-plaintext"]);
    assert_eq!(out.status.code(), Some(2), "a plaintext driver against encrypted workers");
    drop(secure);
    let plain = Workers::start(&CUTS, &["--insecure-plaintext"]);
    let out = generate(&plain.route(), &p.text, &[]);
    assert_eq!(out.status.code(), Some(2), "an encrypted driver against plaintext workers");
    assert!(plain.log(0).contains("WARNING: --insecure-plaintext"), "said loudly: {}", plain.log(0));
}

#[test]
fn a_replayed_handshake_opens_nothing() {
    let _g = serial();
    let p = prompt("capital");
    let hops = Hops::start(&[], [None, None]);
    ok_json(&generate(&hops.route(), &p.text, &[]), "the recorded session");
    let recorded: Vec<Vec<u8>> = hops.taps[0].conns_up.lock().unwrap().iter().map(|c| c.lock().unwrap().clone()).collect();
    let session = recorded.iter().max_by_key(|c| c.len()).unwrap().clone();
    let before = metrics(&hops._workers.addrs[0]).get("dgr_worker_sessions_opened_total");
    let mut s = std::net::TcpStream::connect(&hops._workers.addrs[0]).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.write_all(&session);
    let mut back = Vec::new();
    let _ = s.read_to_end(&mut back);
    // The worker's fresh handshake message, then nothing: the replayed third message does not
    // decrypt under its new ephemeral key.
    assert!(back.len() < 300, "the worker answered the replay with {} bytes", back.len());
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(metrics(&hops._workers.addrs[0]).get("dgr_worker_sessions_opened_total"), before, "a replay opened a session");
}

/// Two greedy tokens of a short prompt along `route`, driven in this process without recovery.
async fn drive(
    route: &dgr_driver::Route,
    ticket: Option<(dgr_proto::SignedTicket, [u8; 16])>,
) -> Result<dgr_driver::Completion, dgr_driver::DriveError> {
    let req = dgr_driver::GenRequest {
        prompt_tokens: prompt("capital").tokens,
        max_tokens: 2,
        sampling: dgr_proto::Sampling { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 },
        top_logprobs: 0,
        seam_dtype: dgr_proto::SeamDtype::F32,
        ticket,
        hash_rows: false,
        constraint: None,
        stop_tokens: Vec::new(),
    };
    dgr_driver::generate_on(&dgr_driver::Links::new(), route, &req, &dgr_driver::DriveOptions::default(), |_| dgr_driver::Flow::Continue)
        .await
}

/// A session on a fresh route from `t`.
fn drive_ticketed(t: &Tracker, what: &str) -> Result<dgr_driver::Completion, dgr_driver::DriveError> {
    let model_id = dgr_gguf::model_identity(&model()).unwrap().id;
    runtime().block_on(async {
        let (route, ticket) = dgr_driver::tracker::route(&t.addr, &model_id, "", 64, "", what, &[], &[]).await.expect("a route");
        drive(&route, Some(ticket)).await
    })
}

#[test]
fn a_worker_the_ticket_does_not_name_is_refused_by_the_driver() {
    let _g = serial();
    let t = Tracker::start("secure-impostor", &[]);
    let a = Worker::start(&t, (0, 15), "a", &[]);
    // Stage 1 is reached through a tap it advertises; an impostor of the same layers, with a key
    // of its own that no tracker admitted, then takes the address over.
    let tap_b = Tap::start("127.0.0.1:1", None);
    let b = Worker::start(&t, (15, 30), "b", &["--advertise", &tap_b.addr]);
    tap_b.switch(b.addr.as_deref().unwrap());
    t.wait_live(&[&a.id, &b.id], Duration::from_secs(10), "both joined");
    drive_ticketed(&t, "through-b").expect("through the real stage 1");
    let impostor = Workers::start(&[15, 30], &[]);
    tap_b.switch(&impostor.addrs[0]);
    let e = drive_ticketed(&t, "through-impostor").expect_err("the impostor was driven");
    assert_eq!(e.kind, dgr_driver::FailKind::WrongPeer, "{e}");
    assert_eq!(e.stage, Some(1), "{e}");
    println!("impostor refused: {e}");
}

#[test]
fn a_next_hop_the_ticket_does_not_name_is_refused_by_the_previous_stage() {
    let _g = serial();
    let t = Tracker::start("secure-next-hop", &[]);
    let a = Worker::start(&t, (0, 15), "a", &[]);
    let tap_b = Tap::start("127.0.0.1:1", None);
    let b = Worker::start(&t, (15, 30), "b", &["--advertise", &tap_b.addr]);
    tap_b.switch(b.addr.as_deref().unwrap());
    t.wait_live(&[&a.id, &b.id], Duration::from_secs(10), "both joined");
    // The driver's own connection to stage 1 reaches the real worker (its key checks out); the
    // one stage 0 dials next, to the same address, reaches an impostor with a key of its own.
    let impostor = Workers::start(&[15, 30], &[]);
    tap_b.switch_after_next(&impostor.addrs[0]);
    let e = drive_ticketed(&t, "next-hop-impostor").expect_err("stage 0 forwarded to the impostor");
    assert_eq!(e.kind, dgr_driver::FailKind::Worker(dgr_proto::ErrorKind::NextStage), "{e}");
    assert!(e.to_string().contains("the ticket names"), "{e}");
    println!("next hop refused: {e}");
}

#[test]
fn a_ticketless_route_knows_its_workers_by_the_keys_first_seen_or_pinned() {
    let _g = serial();
    let a = Workers::start(&[0, 15], &[]);
    let b = Workers::start(&[15, 30], &[]);
    let tap_b = Tap::start(&b.addrs[0], None);
    let route = [a.addrs[0].clone(), tap_b.addr.clone()];
    // Finding the route learns stage 1's key; its first session teaches stage 0 its next hop's.
    let rt = runtime();
    let found = rt.block_on(dgr_driver::Route::discover(&route, Duration::from_secs(5))).expect("the route");
    rt.block_on(drive(&found, None)).expect("the first session");
    // An impostor of the same layers, with a key of its own, takes stage 1's address over; the
    // real one stops, so stage 0's next dial there reaches the impostor too.
    let impostor = Workers::start(&[15, 30], &[]);
    tap_b.switch(&impostor.addrs[0]);
    drop(b);
    let e = rt.block_on(drive(&found, None)).expect_err("the driver took a changed key");
    assert_eq!(e.kind, dgr_driver::FailKind::WrongPeer, "{e}");
    assert!(e.to_string().contains("the route names"), "{e}");
    // A new driver process learns the impostor's key on its own first use, but stage 0 saw
    // the real one first.
    let joined = route.join(",");
    let out = generate(&joined, "Hello", &[]);
    assert_eq!(error_kind(&out, "stage 0 dialling the impostor"), "next_stage");
    assert!(String::from_utf8_lossy(&out.stdout).contains("first link"), "{}", String::from_utf8_lossy(&out.stdout));
    // Pinned: stage 1 must prove the pinned key, and the impostor's pinned there is taken.
    let other = hex::encode(dgr_proto::new_signing_key().unwrap().verifying_key().as_bytes());
    let out = generate(&joined, "Hello", &["--peer-key", &format!("{}={other}", tap_b.addr)]);
    assert_eq!(error_kind(&out, "a key not pinned"), "wrong_peer");
    let fresh = Workers::start(&[0, 15], &[]);
    let pinned = format!("{},{}", fresh.addrs[0], tap_b.addr);
    ok_json(&generate(&pinned, "Hello", &["--peer-key", &format!("{}={}", tap_b.addr, impostor.ids[0])]), "the pinned key");
}

/// A worker of every layer joined to the tracker at `addr` (a tap in front of `t`, say), with
/// `extra` flags; it does not wait for the join.
fn worker_via(t: &Tracker, addr: &str, key: &str, extra: &[&str]) -> Proc {
    let mut cmd = dgr();
    cmd.args(["worker", "--threads", "1", "--layers", "0..30", "--listen", "127.0.0.1:0", "--tracker", addr, "--join-token-file"])
        .arg(&t.token_file)
        .arg("--key-file")
        .arg(t.dir.join(format!("{key}.key")))
        .arg("--model")
        .arg(model())
        .args(extra);
    Proc::spawn(cmd)
}

/// `dgr generate --tracker addr` with `extra` flags, four greedy tokens.
fn generate_via(addr: &str, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["--format", "json", "--threads", "1", "--prompt", "Hello", "--tracker", addr, "--max-tokens", "4", "--ignore-eos"];
    args.extend_from_slice(extra);
    Proc::spawn(generate_cmd(&args)).wait_within(Duration::from_secs(60))
}

/// `dgr key add` at `t` through `addr`: the new key's secret.
fn add_key_via(t: &Tracker, addr: &str, extra: &[&str]) -> String {
    let out = dgr()
        .args(["key", "add", "--tracker", addr, "--name", "tenant", "--join-token-file"])
        .arg(&t.token_file)
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "key add: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice::<Value>(&out.stdout).unwrap()["key"].as_str().unwrap().to_string()
}

/// Waits until `t` lists a live worker, asking with `flags`.
fn wait_joined(t: &Tracker, flags: &[&str], what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let live = || {
        let out = dgr().args(["swarm", "--format", "json", "--tracker", &t.addr]).args(flags).output().unwrap();
        assert!(out.status.success(), "{what}: dgr swarm: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).contains("\"live\":true")
    };
    while !live() {
        assert!(Instant::now() < deadline, "{what}: no worker joined within 30 s: {}", t.log());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The tracker's links: a recording proxy in front of a tracker, with a worker joining and a
/// client adding an API key, routing and reporting usage through it, captures neither the join
/// token nor the API key — while the same run against a tracker and clients that all asked for
/// `--insecure-plaintext` shows both, so the search can find them. A client or worker pinning
/// another tracker's key is refused with a line saying so, and a client in the other link mode
/// than the tracker's is refused.
#[test]
fn tracker_links_are_encrypted_and_the_tracker_proves_its_key() {
    let _g = serial();
    for plain in [false, true] {
        let flags: &[&str] = if plain { &["--insecure-plaintext"] } else { &[] };
        let t = Tracker::start(if plain { "tracker-link-plain" } else { "tracker-link" }, flags);
        let tap = Tap::start(&t.addr, None);
        let api_key = add_key_via(&t, &tap.addr, flags);
        let w = worker_via(&t, &tap.addr, "w", flags);
        wait_joined(&t, flags, "through the tap");
        let out = generate_via(&tap.addr, &[flags, &["--api-key", &api_key]].concat());
        let v = ok_json(&out, "a ticketed generation through the tap");
        assert_eq!(v["tokens"].as_array().map(Vec::len), Some(4));
        let capture = tap.captured();
        let token = std::fs::read_to_string(&t.token_file).unwrap();
        let seen = (contains(&capture, token.trim().as_bytes()), contains(&capture, api_key.as_bytes()));
        assert_eq!(seen, (plain, plain), "(join token, API key) in the capture of {} bytes, plaintext {plain}", capture.len());
        println!("tracker links, plaintext {plain}: {} bytes captured; join token and API key seen: {seen:?}", capture.len());
        drop(w);
    }

    let t = Tracker::start("tracker-link-pins", &[]);
    let other = Tracker::start("tracker-link-other", &[]);
    let out = generate_via(&t.addr, &["--tracker-key", &other.link_key]);
    let said = String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success() && said.contains("not a pinned one"), "a client pinning another key: {said}");
    let out = generate_via(&t.addr, &["--insecure-plaintext"]);
    let said = String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success() && said.contains("--insecure-plaintext"), "a plaintext client, encrypted tracker: {said}");
    let out = generate_via(&other.addr, &["--tracker-key", &other.link_key]);
    let said = String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(!said.contains("not a pinned one") && !said.contains("secure link"), "the right pin is accepted: {said}");

    let w = worker_via(&t, &t.addr, "pinned-wrong", &["--tracker-key", &other.link_key, "--join-timeout", "2"]);
    let out = w.wait_within(Duration::from_secs(30));
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && log.contains("not a pinned one"), "a worker pinning another key: {log}");
    assert!(t.live_ids().is_empty(), "it never joined");
}
