//! A worker's own life: it holds only its layers, and SIGTERM drains it and exits 0.
#![cfg(feature = "real-model")]

mod common;
use common::*;

use dgr_driver::{DriveOptions, Flow, GenRequest, Route, Speculate};
use dgr_proto::{Sampling, SeamDtype};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn request(tokens: &[u32], max_tokens: usize) -> GenRequest {
    GenRequest {
        prompt_tokens: tokens.to_vec(),
        max_tokens,
        sampling: Sampling { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 },
        top_logprobs: 0,
        seam_dtype: SeamDtype::F32,
        ticket: None,
        hash_rows: false,
        constraint: None,
        stop_tokens: Vec::new(),
    }
}

fn generate(rt: &tokio::runtime::Runtime, addrs: &[String], tokens: &[u32], max_tokens: usize) {
    rt.block_on(async {
        let route = Route::discover(addrs, Duration::from_secs(5)).await.expect("route");
        dgr_driver::generate(&route, &request(tokens, max_tokens), &DriveOptions::default(), |_| Flow::Continue).await.expect("generate");
    });
}

#[test]
fn each_worker_is_resident_for_its_own_layers_only() {
    let _serial = serial();
    let rt = runtime();
    let p = prompt("capital");
    let mut halves = Workers::start(&[0, 15, 30], &[]);
    let mut whole = Workers::start(&[0, 30], &[]);
    generate(&rt, &halves.addrs, &p.tokens, 8);
    generate(&rt, &whole.addrs, &p.tokens, 8);
    let rss = |w: &mut Workers, i: usize| {
        let m = w.metrics(i);
        (m.get("dgr_worker_rss_bytes") / 1e6, m.get("dgr_worker_weight_bytes") / 1e6)
    };
    let (first, first_w) = rss(&mut halves, 0);
    let (last, last_w) = rss(&mut halves, 1);
    let (all, all_w) = rss(&mut whole, 0);
    println!(
        "RSS MB (weights MB): layers 0..15 {first:.1} ({first_w:.1}), 15..30 + head {last:.1} ({last_w:.1}), 0..30 {all:.1} ({all_w:.1})"
    );
    // A worker holds its own tensors (the embedding table only where rows were looked up), its
    // KV and a constant: the binary, the runtime and the parsed metadata.
    const CONSTANT_MB: f64 = 60.0;
    for (what, rss, weights) in [("0..15", first, first_w), ("15..30", last, last_w), ("0..30", all, all_w)] {
        assert!(rss <= weights + CONSTANT_MB, "layers {what}: RSS {rss:.1} MB for {weights:.1} MB of weights");
    }
    // The first half does not hold the second half's layers or the head.
    assert!(first + 40.0 < all, "layers 0..15 hold {first:.1} MB, the whole model {all:.1} MB");
    assert!(first < last, "the first half ({first:.1} MB) should be smaller than the second with the head ({last:.1} MB)");
}

/// SIGTERM to worker `i`.
fn terminate(w: &Workers, i: usize) {
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(w.children[i].id() as libc::pid_t, libc::SIGTERM) };
}

fn exit_within(w: &mut Workers, i: usize, limit: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(s) = w.children[i].try_wait().expect("try_wait") {
            return s;
        }
        assert!(start.elapsed() < limit, "worker {i} still running {limit:?} after SIGTERM");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn sigterm_lets_open_sessions_finish_then_exits_zero() {
    let _serial = serial();
    let rt = runtime();
    const LONG: usize = 1024;
    let p = prompt("once");
    // An idle worker exits at once, with status 0.
    let mut idle = Workers::start(&[0, 30], &[]);
    terminate(&idle, 0);
    let s = exit_within(&mut idle, 0, Duration::from_secs(3));
    assert!(s.success(), "idle worker exited with {s}");

    // A worker with a session in flight lets it finish (within the drain timeout), refuses new
    // sessions meanwhile, then exits 0.
    let mut w = Workers::start(&[0, 15, 30], &["--drain-timeout", "20"]);
    let route = rt.block_on(Route::discover(&w.addrs, Duration::from_secs(5))).expect("route");
    let tokens = Arc::new(AtomicUsize::new(0));
    let seen = tokens.clone();
    // Long enough that the workers are still computing it when SIGTERM arrives: the ring runs
    // ahead of a slow driver, so slowing the driver alone would not keep the session in flight.
    let req = request(&p.tokens, LONG);
    let running = rt.spawn(async move {
        dgr_driver::generate(&route, &req, &DriveOptions::default(), |_| {
            seen.fetch_add(1, SeqCst);
            Flow::Continue
        })
        .await
    });
    let start = Instant::now();
    while tokens.load(SeqCst) < 4 {
        assert!(start.elapsed() < Duration::from_secs(20), "the session never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    terminate(&w, 0);
    let start = Instant::now();
    while w.metrics(0).get("dgr_worker_draining") != 1.0 {
        assert!(start.elapsed() < Duration::from_secs(5), "the worker did not begin draining within 5 s of SIGTERM");
        std::thread::sleep(Duration::from_millis(5));
    }
    let refused = rt.block_on(async {
        let route = Route::discover(&w.addrs, Duration::from_secs(5)).await?;
        dgr_driver::generate(&route, &request(&p.tokens, 4), &DriveOptions::default(), |_| Flow::Continue).await
    });
    match refused {
        Err(e) => {
            println!("a new session on a draining worker: {e}");
            assert!(e.kind == "shutting_down" || e.kind == "connect_failed", "{e}");
        }
        Ok(_) => panic!("a draining worker accepted a new session"),
    }
    let done = rt.block_on(running).expect("join").expect("the open session should finish while its worker drains");
    assert_eq!(done.tokens.len(), LONG, "the session finished early: {}", done.finish_reason);
    let s = exit_within(&mut w, 0, Duration::from_secs(5));
    assert!(s.success(), "draining worker exited with {s}");
    println!("drained worker exited {s} after its session's {} tokens", done.tokens.len());
}

#[test]
fn sigterm_past_the_drain_timeout_cancels_what_is_left_and_exits_zero() {
    let _serial = serial();
    let rt = runtime();
    let p = prompt("once");
    let mut w = Workers::start(&[0, 30], &["--drain-timeout", "0.3"]);
    let route = rt.block_on(Route::discover(&w.addrs, Duration::from_secs(5))).expect("route");
    let started = Arc::new(AtomicUsize::new(0));
    let seen = started.clone();
    let req = request(&p.tokens, 4000);
    let running = rt.spawn(async move {
        dgr_driver::generate(&route, &req, &DriveOptions::default(), |_| {
            seen.fetch_add(1, SeqCst);
            Flow::Continue
        })
        .await
    });
    let t = Instant::now();
    while started.load(SeqCst) < 2 {
        assert!(t.elapsed() < Duration::from_secs(20), "the session never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    terminate(&w, 0);
    let s = exit_within(&mut w, 0, Duration::from_secs(5));
    assert!(s.success(), "worker exited with {s}");
    let e = rt.block_on(running).expect("join").expect_err("the session cannot finish 4000 tokens in 0.3 s");
    println!("the session past the drain timeout ended with: {e}");
    assert!(e.kind == "shutting_down" || e.kind == "connection_lost", "{e}");
}

#[test]
fn sessions_past_the_kv_budget_or_session_cap_are_refused_with_a_clear_error() {
    let _serial = serial();
    let rt = runtime();
    let p = prompt("once");
    // 64 KV positions in all: a session reserving prompt + 100 tokens does not fit.
    let w = Workers::start(&[0, 30], &["--kv-tokens", "64", "--max-sessions", "1"]);
    let e = rt
        .block_on(async {
            let route = Route::discover(&w.addrs, Duration::from_secs(5)).await?;
            dgr_driver::generate(&route, &request(&p.tokens, 100), &DriveOptions::default(), |_| Flow::Continue).await
        })
        .expect_err("a session larger than the KV budget");
    println!("over the KV budget: {e}");
    assert_eq!(e.kind, "overloaded", "{e}");
    assert!(e.message.contains("KV positions"), "{e}");
    // One session fits; a second one at the same time is refused, and the first is unharmed.
    // The second starts once the first has its first token (so it holds the one slot). The ring
    // decodes without waiting on its driver, so a slow driver would not keep the first open; it
    // is as long as the budget allows and decodes a token a step (no drafts), 55 steps more.
    let route = rt.block_on(Route::discover(&w.addrs, Duration::from_secs(5))).expect("route");
    let started = tokio::sync::Notify::new();
    let (first, second) = rt.block_on(async {
        let long = request(&p.tokens, 64 - p.tokens.len());
        let opts = DriveOptions { speculate: Speculate::Off, ..DriveOptions::default() };
        let one = dgr_driver::generate(&route, &long, &opts, |_| {
            started.notify_one();
            Flow::Continue
        });
        let two = async {
            started.notified().await;
            dgr_driver::generate(&route, &request(&p.tokens, 4), &DriveOptions::default(), |_| Flow::Continue).await
        };
        tokio::join!(one, two)
    });
    let e = second.expect_err("a second session past --max-sessions 1");
    println!("past the session cap: {e}");
    assert_eq!(e.kind, "overloaded", "{e}");
    assert_eq!(first.expect("the first session").tokens.len(), 64 - p.tokens.len());
}
