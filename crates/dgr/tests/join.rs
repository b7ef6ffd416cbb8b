//! One address form, and a worker's join said out loud: `dgr worker --tracker http://…` joins
//! and prints one line naming the tracker and its id; a wrong port or a bad join token is
//! logged with its reason within 2 s and ends the worker non-zero after `--join-timeout`; an
//! address of a scheme dgr does not speak is refused at the command line.
#![cfg(feature = "real-model")]

mod common;

use common::swarm::{spawn_ready, Tracker};
use common::{dgr, model, serial};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A worker of every layer joining `tracker` with the token in `token_file`, giving up after
/// `join_timeout` seconds: the child, and its stderr as it grows.
fn worker(tracker: &str, token_file: &std::path::Path, join_timeout: &str) -> (std::process::Child, Arc<Mutex<Vec<u8>>>) {
    let mut cmd = dgr();
    cmd.args(["worker", "--threads", "1", "--layers", "0..30", "--listen", "127.0.0.1:0", "--tracker", tracker])
        .args(["--join-timeout", join_timeout, "--join-token-file"])
        .arg(token_file)
        .arg("--model")
        .arg(model());
    let (child, _, log) = spawn_ready(cmd, "worker");
    (child, log)
}

fn text(log: &Arc<Mutex<Vec<u8>>>) -> String {
    String::from_utf8_lossy(&log.lock().unwrap()).into_owned()
}

/// Waits until the log holds `needle`, failing past `within`; how long that took.
fn wait_log(log: &Arc<Mutex<Vec<u8>>>, needle: &str, within: Duration) -> Duration {
    let start = Instant::now();
    while !text(log).contains(needle) {
        assert!(start.elapsed() < within, "no {needle:?} within {within:?}; log:\n{}", text(log));
        std::thread::sleep(Duration::from_millis(10));
    }
    start.elapsed()
}

/// Waits for the exit, failing past `within`.
fn exit_within(child: &mut std::process::Child, within: Duration, log: &Arc<Mutex<Vec<u8>>>) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(start.elapsed() < within, "still running after {within:?}; log:\n{}", text(log));
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_worker_joins_through_a_url_and_generate_takes_one_too() {
    let _g = serial();
    let t = Tracker::start("join-url", &[]);
    let url = format!("http://{}/", t.addr);
    let (mut child, log) = worker(&url, &t.token_file, "60");
    let took = wait_log(&log, &format!("joined the tracker at {} as ", t.addr), Duration::from_secs(10));
    println!("joined {took:?} after the ready line");
    let line = text(&log).lines().find(|l| l.contains("joined the tracker")).unwrap().to_string();
    let id = line.rsplit(' ').next().unwrap().to_string();
    t.wait_live(&[&id], Duration::from_secs(5), "the worker joined through an http:// address");

    let out = dgr()
        .args(["generate", "--tracker", &format!("dgr://{}", t.addr), "--format", "json", "--threads", "1"])
        .args(["--prompt", "The quick brown fox", "--max-tokens", "2", "--model"])
        .arg(model())
        .output()
        .unwrap();
    assert!(out.status.success(), "generate through dgr://: {}", String::from_utf8_lossy(&out.stderr));
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn a_wrong_port_is_said_at_once_and_ends_the_worker_after_the_join_timeout() {
    let _g = serial();
    let dir = std::env::temp_dir().join(format!("dgr-test-join-port-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let token = dir.join("join-token");
    std::fs::write(&token, "whatever\n").unwrap();
    // A port nothing listens on: bound, then let go.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let (mut child, log) = worker(&format!("tcp://{addr}"), &token, "3");
    let ready = Instant::now();
    let took = wait_log(&log, &format!("could not join the tracker at {addr} (attempt 1): "), Duration::from_secs(2));
    assert!(text(&log).contains("connection refused"), "the reason is named: {}", text(&log));
    println!("first failed attempt logged {took:?} after the ready line");
    let status = exit_within(&mut child, Duration::from_secs(10), &log);
    let after = ready.elapsed();
    assert!(!status.success(), "a worker that never joined exits non-zero: {status}");
    assert!(after >= Duration::from_secs(3), "not before the join timeout: {after:?}");
    assert!(text(&log).contains("joined none of the trackers"), "{}", text(&log));
    let attempts = text(&log).matches("could not join the tracker").count();
    assert!((2..=10).contains(&attempts), "each attempt logged, with backoff: {attempts}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_bad_join_token_is_said_at_once_and_ends_the_worker_after_the_join_timeout() {
    let _g = serial();
    let t = Tracker::start("join-token", &[]);
    let bad = t.dir.join("bad-token");
    std::fs::write(&bad, "wrong\n").unwrap();
    let (mut child, log) = worker(&t.addr, &bad, "2");
    wait_log(&log, "bad join token", Duration::from_secs(2));
    assert!(text(&log).contains("--join-token-file"), "says what to fix: {}", text(&log));
    let status = exit_within(&mut child, Duration::from_secs(10), &log);
    assert!(!status.success(), "{status}");
    assert!(t.live_ids().is_empty());
}

#[test]
fn addresses_of_other_schemes_or_without_a_port_are_refused_at_the_command_line() {
    for (flag, bad, says) in
        [("--tracker", "https://127.0.0.1:1", "https://"), ("--tracker", "127.0.0.1", "no port"), ("--listen", "ftp://h:1", "ftp://")]
    {
        let out = dgr().args(["worker", "--layers", "0..30", flag, bad]).arg("--model").arg(model()).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag} {bad}: a usage error: {err}");
        assert!(err.contains(says), "{flag} {bad}: {err}");
    }
}
