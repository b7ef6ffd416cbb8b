//! Split routes on the real model, with real `dgr worker` processes on loopback: a route gives
//! bitwise the whole model's output; concurrent sessions do not see each other; a cancelled,
//! closed, abandoned or idle session is freed on every worker; a killed worker fails the request
//! with a structured error naming the stage, in bounded time; and bad input at a seam is refused
//! with the right error kind while the route keeps serving; and a prompt prefilled in chunks
//! gives the same output and a seam report that counts every row.
//!
//! Every check runs over both splits, [0,15)+[15,30) and [0,10)+[10,20)+[20,30). Every spawned
//! process is killed when its guard drops (so a failing test leaves nothing running) and every
//! wait has a deadline (so no test can hang). Run with --nocapture to see the figures.
#![cfg(feature = "real-model")]
#![allow(clippy::needless_range_loop)] // workers, their metrics and their logs share one index

mod common;
use common::*;

use dgr_driver::{Completion, DriveOptions, Flow, GenRequest, Route};
use dgr_proto::{
    Body, BoundarySchema, ErrorKind, ErrorMsg, Forward, Frame, Hello, OpenSession, Role, Sampling, SeamDtype, StageInfo, TokenOut,
    PROTOCOL_VERSION, STAGE_UNKNOWN,
};
use prost::Message;
use serde_json::Value;
use std::io::{Read, Write};
use std::process::Output;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// The two splits every check runs over, as layer cut points.
const SPLITS: [&[usize]; 2] = [&[0, 15, 30], &[0, 10, 20, 30]];

// ---------------------------------------------------------------------------------------------
// A raw protocol client (blocking, every read with a deadline)

struct Raw {
    s: common::secure::SecureConn,
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

impl Raw {
    /// Connects to a worker (over its secure channel) without saying Hello.
    fn connect_bare(addr: &str) -> Raw {
        Raw { s: common::secure::SecureConn::connect(addr), info: StageInfo::default() }
    }

    /// Connects as a driver: Hello, and the worker's Hello with what it serves.
    fn connect(addr: &str) -> Raw {
        let mut r = Raw::connect_bare(addr);
        r.send(Body::Hello(Hello { protocol_version: PROTOCOL_VERSION, role: Role::Driver as i32, info: None }));
        match r.recv() {
            Frame { body: Some(Body::Hello(Hello { info: Some(info), .. })) } => r.info = info,
            f => panic!("{addr} answered Hello with {f:?}"),
        }
        r
    }

    fn send_payload(&mut self, payload: &[u8]) {
        let mut buf = (payload.len() as u32).to_be_bytes().to_vec();
        buf.extend_from_slice(payload);
        self.s.write_all(&buf).expect("writing to a worker");
    }

    fn send(&mut self, body: Body) {
        self.send_payload(&Frame::new(body).encode_to_vec());
    }

    /// The next frame; Err on EOF, a broken connection or the read deadline.
    fn try_recv(&mut self) -> std::io::Result<Frame> {
        let mut len = [0u8; 4];
        self.s.read_exact(&mut len)?;
        let mut payload = vec![0u8; u32::from_be_bytes(len) as usize];
        self.s.read_exact(&mut payload)?;
        Frame::decode(payload.as_slice()).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
    }

    fn recv(&mut self) -> Frame {
        self.try_recv().unwrap_or_else(|e| panic!("no frame from the worker within the deadline: {e}"))
    }

    /// This stage's schema, as a correct OpenSession carries it.
    fn schema(&self) -> BoundarySchema {
        BoundarySchema {
            protocol_version: PROTOCOL_VERSION,
            model_id: self.info.model_id.clone(),
            layer_start: self.info.layer_start,
            layer_end: self.info.layer_end,
            hidden: self.info.hidden,
            seam_dtype: SeamDtype::F32 as i32,
            engine: self.info.engine.clone(),
        }
    }

    /// A correct OpenSession for this stage at `stage_index` of `n_stages`.
    fn open_msg(&self, stage_index: u32, n_stages: u32, next: &str) -> OpenSession {
        OpenSession {
            session_id: random_id(),
            schema: Some(self.schema()),
            stage_index,
            n_stages,
            next: next.to_string(),
            sampling: Some(Sampling { temperature: 0.0, top_k: 40, top_p: 0.95, seed: 0 }),
            top_logprobs: 0,
            max_positions: 64,
            ticket: None,
            hash_rows: false,
            embed: None,
            prefix_blocks: Vec::new(),
            ring: None,
        }
    }

    /// Sends an Open and expects Opened for it.
    fn open_ok(&mut self, open: OpenSession) {
        let id = open.session_id.clone();
        self.send(Body::Open(open));
        match self.recv() {
            Frame { body: Some(Body::Opened(r)) } => assert_eq!(r.session_id, id, "Opened for another session"),
            f => panic!("a correct Open was answered with {f:?}"),
        }
    }
}

/// Expects `f` to be an Error of `kind`; returns it.
fn expect_error(f: Frame, kind: ErrorKind, what: &str) -> ErrorMsg {
    match f {
        Frame { body: Some(Body::Error(e)) } => {
            println!("    {what}: {} (stage {}) {:?}", e.error_kind().name(), e.stage, e.message);
            assert_eq!(e.error_kind(), kind, "{what}: expected {}, got {e:?}", kind.name());
            e
        }
        f => panic!("{what}: expected an Error {}, got {f:?}", kind.name()),
    }
}

/// Opens one session on every stage of `w` by hand, as a driver does, one connection per
/// stage; with `prompt`, also prefills it and reads the token the last stage samples.
fn open_by_hand(w: &Workers, prompt: Option<&[u32]>) -> (Vec<u8>, Vec<Raw>) {
    let n = w.n() as u32;
    let mut raws: Vec<Raw> = w.addrs.iter().map(|a| Raw::connect(a)).collect();
    let id = random_id();
    for i in 0..w.n() {
        let next = w.addrs.get(i + 1).cloned().unwrap_or_default();
        let mut open = raws[i].open_msg(i as u32, n, &next);
        open.session_id = id.clone();
        raws[i].open_ok(open);
    }
    if let Some(p) = prompt {
        let f = Forward { session_id: id.clone(), position: 0, tokens: p.to_vec(), sample: true, ..Default::default() };
        raws[0].send(Body::Forward(f));
        match raws.last_mut().unwrap().recv() {
            Frame { body: Some(Body::Token(t)) } => assert_eq!(t.session_id, id),
            f => panic!("expected the prefill's token from the last stage, got {f:?}"),
        }
    }
    (id, raws)
}

// ---------------------------------------------------------------------------------------------
// 1. Whole-model parity

#[test]
fn a_route_reproduces_the_whole_model_bitwise_on_every_reference_prompt() {
    let _serial = serial();
    let ps = prompts();
    let common = ["--max-tokens", "8", "--ignore-eos", "--top-logprobs", "5"];
    let whole: Vec<Value> = ps
        .iter()
        .map(|p| {
            let mut a = vec!["--prompt", &p.text, "--threads", "1"];
            a.extend(common);
            generate_json(&a)
        })
        .collect();
    for cuts in SPLITS {
        let w = Workers::start(cuts, &[]);
        let route = w.route();
        for (p, want) in ps.iter().zip(&whole) {
            let mut a = vec!["--prompt", &p.text, "--route", &route];
            a.extend(common);
            let got = generate_json(&a);
            assert_same_generation(&got, want, &format!("{} over {}", p.name, layers_of(cuts)));
            assert_eq!(got["route"], serde_json::json!(w.addrs), "the reported route");
            assert_eq!(got["stages"].as_array().map(Vec::len), Some(w.n()), "one stage report per stage: {got}");
            let seams = got["seams"].as_array().expect("seams");
            assert_eq!(seams.len(), w.n() - 1, "one seam report per seam: {got}");
            // f32 rows of hidden size 576: every position crosses every seam once, and so does
            // each rejected draft.
            let positions = p.tokens.len() + 8 - 1 + rejected_drafts(&got) as usize;
            for s in seams {
                assert_eq!(s["bytes"].as_u64(), Some((positions * 576 * 4) as u64), "seam bytes for {} positions: {s}", positions);
            }
            println!(
                "{} {:>8}: {} prompt tokens, tokens {} identical to the whole model; seam bytes {:?}",
                layers_of(cuts),
                p.name,
                p.tokens.len(),
                got["tokens"],
                seams.iter().map(|s| s["bytes"].as_u64().unwrap()).collect::<Vec<_>>()
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 2. A longer greedy decode

#[test]
fn a_32_token_greedy_decode_over_a_route_equals_the_unsplit_model() {
    let _serial = serial();
    let p = prompt("once");
    for engine in common::engines() {
        let mut args = vec!["--prompt", &p.text, "--max-tokens", "32", "--ignore-eos"];
        args.extend(engine.flags());
        let mut a = args.clone();
        a.extend(["--threads", "1"]);
        let whole = generate_json(&a);
        assert_eq!(whole["tokens"].as_array().unwrap().len(), 32);
        let id = engine.id();
        for cuts in SPLITS {
            // generate --route checks that the route's engine is the one --numerics and
            // --kv-dtype name.
            let w = Workers::start(cuts, &engine.flags());
            let route = w.route();
            let mut a = args.clone();
            a.extend(["--route", &route]);
            let got = generate_json(&a);
            assert_same_generation(&got, &whole, &format!("{id}: 32 greedy tokens over {}", layers_of(cuts)));
            println!("{id} {}: 32 greedy tokens identical to the unsplit model: {:?}", layers_of(cuts), got["text"]);
        }
    }
}

/// A decode goes round the route by itself: after the prompt, every step is started by the last
/// stage's token arriving at the first stage (`dgr_worker_ring_steps_total`), none by the driver,
/// and each stage computes exactly the rows of the tokens delivered — on one, two and three
/// stages, and the same tokens as with the driver-driven steps a spot check still takes.
#[test]
fn a_decode_goes_round_the_ring_without_its_driver() {
    let _serial = serial();
    let p = prompt("once");
    let args = ["--prompt", &p.text, "--max-tokens", "16", "--ignore-eos", "--speculate", "off"];
    let whole = generate_json(&[&args[..], &["--threads", "1"]].concat());
    for cuts in [&[0, 30][..], SPLITS[0], SPLITS[1]] {
        let mut w = Workers::start(cuts, &[]);
        let route = w.route();
        let got = generate_json(&[&args[..], &["--route", &route]].concat());
        assert_same_generation(&got, &whole, &format!("16 tokens round a ring over {}", layers_of(cuts)));
        let ring_steps: Vec<f64> = (0..w.n()).map(|i| w.metrics(i).get("dgr_worker_ring_steps_total")).collect();
        let decoded: Vec<f64> = (0..w.n()).map(|i| w.metrics(i).get("dgr_worker_tokens_decoded_total")).collect();
        let mut want = vec![0.0; w.n()];
        want[0] = 15.0;
        assert_eq!(ring_steps, want, "{}: steps started round the ring, per stage", layers_of(cuts));
        assert_eq!(decoded, vec![15.0; w.n()], "{}: decode rows per stage (no step past the last token)", layers_of(cuts));
    }
}

/// A worker's KV dtype: its /metrics count the bytes it stores (q8_0 34/128 of f32's per
/// position), its default budget holds as many bytes in any dtype, and a route of it serves only
/// runs that ask for its engine.
#[test]
fn a_kv_dtype_sets_a_workers_kv_bytes_and_its_routes_engine() {
    let _serial = serial();
    let capacity = |extra: &[&str]| {
        let mut w = Workers::start(&[0, 30], extra);
        (w.metrics(0).get("dgr_worker_kv_bytes_capacity"), w)
    };
    let (f32_1000, _) = capacity(&["--kv-tokens", "1000"]);
    let (q8_1000, _) = capacity(&["--kv-tokens", "1000", "--kv-dtype", "q8_0"]);
    let (f16_1000, _) = capacity(&["--kv-tokens", "1000", "--kv-dtype", "f16"]);
    assert_eq!((f16_1000 * 2.0, q8_1000 * 128.0), (f32_1000, f32_1000 * 34.0), "f16 is 1/2, q8_0 34/128 of f32's bytes a position");
    // 30 layers of keys and values of 192 floats a position.
    assert_eq!(f32_1000, 1000.0 * 30.0 * 2.0 * 192.0 * 4.0);
    let (f32_default, _) = capacity(&[]);
    let (q8_default, q8) = capacity(&["--kv-dtype", "q8_0"]);
    let per_position = q8_1000 / 1000.0;
    assert!((f32_default - q8_default).abs() < per_position, "the default budget's bytes: f32 {f32_default}, q8_0 {q8_default}");
    // A q8_0 route computes q8_0 bits: a run that asks for f32 KV is refused, one that asks for
    // q8_0 gets the one-process q8_0 tokens.
    let route = q8.route();
    let args = ["--prompt", "Once upon a time", "--max-tokens", "8", "--ignore-eos", "--format", "json"];
    let out = Proc::spawn(generate_cmd(&[&args[..], &["--route", &route]].concat())).wait_within(Duration::from_secs(60));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success() && stdout.contains("gguf-cpu-fast-q8_0") && stdout.contains("asks for gguf-cpu-fast"), "{stdout}");
    let whole = generate_json(&[&args[..5], &["--kv-dtype", "q8_0"]].concat());
    let routed = generate_json(&[&args[..5], &["--kv-dtype", "q8_0", "--route", &route]].concat());
    assert_same_generation(&routed, &whole, "q8_0 KV over a one-worker route");
}

// ---------------------------------------------------------------------------------------------
// 3. Isolation

#[test]
fn concurrent_sessions_on_the_same_workers_each_get_their_solo_output() {
    let _serial = serial();
    let names = ["once", "capital", "code", "list"];
    for cuts in SPLITS {
        let mut w = Workers::start(cuts, &[]);
        let route = w.route();
        let ps: Vec<Prompt> = names.iter().map(|n| prompt(n)).collect();
        let args = |p: &Prompt| -> Vec<String> {
            ["--format", "json", "--prompt", &p.text, "--route", &route, "--max-tokens", "24", "--ignore-eos", "--top-logprobs", "5"]
                .iter()
                .map(|s| s.to_string())
                .collect()
        };
        let solo: Vec<Value> = ps.iter().map(|p| generate_json(&args(p)[2..].iter().map(String::as_str).collect::<Vec<_>>())).collect();
        let before: Vec<Metrics> = (0..w.n()).map(|i| w.metrics(i)).collect();
        let procs: Vec<Proc> =
            ps.iter().map(|p| Proc::spawn(generate_cmd(&args(p).iter().map(String::as_str).collect::<Vec<_>>()))).collect();
        for ((proc, p), want) in procs.into_iter().zip(&ps).zip(&solo) {
            let out = proc.wait_within(Duration::from_secs(60));
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "concurrent {}: {stdout}{}", p.name, String::from_utf8_lossy(&out.stderr));
            let got: Value = serde_json::from_str(&stdout).unwrap();
            assert_same_generation(&got, want, &format!("{} run concurrently with three others over {}", p.name, layers_of(cuts)));
        }
        for i in 0..w.n() {
            let (b, a) = (&before[i], w.metrics(i));
            let steps = a.get("dgr_worker_steps_total") - b.get("dgr_worker_steps_total");
            let rows = a.get("dgr_worker_step_rows_total") - b.get("dgr_worker_step_rows_total");
            println!(
                "{} worker {i}: 4 concurrent sessions in {steps} steps of {rows} rows ({:.2} rows/step; 1.00 would mean no batching)",
                layers_of(cuts),
                rows / steps
            );
        }
        w.wait_all_free(&(0..w.n()).collect::<Vec<_>>(), Duration::from_secs(2), "after the concurrent sessions");
        println!("{}: 4 concurrent sessions each equal their solo run", layers_of(cuts));
    }
}

// ---------------------------------------------------------------------------------------------
// 4. Cancellation

fn gen_request(tokens: &[u32], max_tokens: usize) -> GenRequest {
    GenRequest {
        prompt_tokens: tokens.to_vec(),
        max_tokens,
        sampling: Sampling { temperature: 0.0, top_k: 40, top_p: 0.95, seed: 0 },
        top_logprobs: 5,
        seam_dtype: SeamDtype::F32,
        ticket: None,
        hash_rows: false,
        constraint: None,
        stop_tokens: Vec::new(),
    }
}

/// What the observer saw on one worker once the cancel had taken effect there.
struct Freed {
    after: Duration,
    open_before: f64,
    kv_before: f64,
    open_after: f64,
    kv_after: f64,
    kv_positions_bounds: (usize, usize),
}

#[test]
fn a_cancelled_session_is_freed_at_once_and_the_others_finish_unchanged() {
    let _serial = serial();
    const OTHERS_TOKENS: usize = 96;
    let others = ["once", "capital", "code"].map(prompt);
    // The cancelled session has the long prompt, so its KV is far larger than the others'.
    let victim = prompt("long");
    for cuts in SPLITS {
        let mut w = Workers::start(cuts, &["--kv-tokens", "65536"]);
        let n = w.n();
        let rt = runtime();
        let opts = DriveOptions::default();
        let route = rt.block_on(Route::discover(&w.addrs, Duration::from_secs(10))).expect("discovering the route");
        // Bytes one KV position takes on each worker.
        let per_position: Vec<f64> = (0..n).map(|i| w.metrics(i).get("dgr_worker_kv_bytes_capacity") / 65536.0).collect();

        let solo: Vec<Completion> = others
            .iter()
            .map(|p| {
                let req = gen_request(&p.tokens, OTHERS_TOKENS);
                let fut = dgr_driver::generate(&route, &req, &opts, |_| Flow::Continue);
                rt.block_on(async { tokio::time::timeout(Duration::from_secs(60), fut).await })
                    .expect("a solo run took over 60 s")
                    .unwrap_or_else(|e| panic!("solo {}: {e}", p.name))
            })
            .collect();

        // Sessions 0..3 are the others, 3 is the victim.
        let received: Arc<Vec<AtomicUsize>> = Arc::new((0..4).map(|_| AtomicUsize::new(0)).collect());
        let started = Arc::new(AtomicUsize::new(0));
        let (cancel_tx, cancel_rx) = mpsc::channel::<(Instant, Vec<Metrics>, Vec<usize>)>();
        let observer = {
            let addrs = w.addrs.clone();
            let received = received.clone();
            let per_position = per_position.clone();
            let prompt_lens: Vec<usize> = others.iter().map(|p| p.tokens.len()).collect();
            std::thread::spawn(move || -> Result<Vec<Freed>, String> {
                let (t0, before, _) =
                    cancel_rx.recv_timeout(Duration::from_secs(120)).map_err(|_| "the victim never cancelled".to_string())?;
                let mut freed = Vec::new();
                for (i, addr) in addrs.iter().enumerate() {
                    let b = &before[i];
                    if b.get("dgr_worker_sessions_open") != 4.0 {
                        return Err(format!(
                            "worker {i}: {} sessions open when the victim cancelled, not 4",
                            b.get("dgr_worker_sessions_open")
                        ));
                    }
                    loop {
                        let r_before: Vec<usize> = (0..3).map(|k| received[k].load(SeqCst)).collect();
                        let m = metrics(addr);
                        let r_after: Vec<usize> = (0..3).map(|k| received[k].load(SeqCst)).collect();
                        let open = m.get("dgr_worker_sessions_open");
                        let kv = m.get("dgr_worker_kv_bytes_used");
                        // The three live sessions hold between prompt + received − 1 and prompt +
                        // received positions each on every stage; the victim holds none.
                        let lo: usize = (0..3).map(|k| prompt_lens[k] + r_before[k] - 1).sum();
                        let hi: usize = (0..3).map(|k| prompt_lens[k] + r_after[k]).sum();
                        let positions = kv / per_position[i];
                        if open == 3.0 && positions >= lo as f64 && positions <= hi as f64 {
                            freed.push(Freed {
                                after: t0.elapsed(),
                                open_before: b.get("dgr_worker_sessions_open"),
                                kv_before: b.get("dgr_worker_kv_bytes_used"),
                                open_after: open,
                                kv_after: kv,
                                kv_positions_bounds: (lo, hi),
                            });
                            break;
                        }
                        if r_after.iter().any(|&r| r >= OTHERS_TOKENS) {
                            return Err(format!("worker {i}: another session finished before the cancel showed (open {open}, kv {kv})"));
                        }
                        if t0.elapsed() > Duration::from_secs(1) {
                            return Err(format!(
                                "worker {i}: 1 s after the cancel, sessions_open {open} (want 3) and kv_bytes_used {kv} = {positions} positions \
                                 (want the three live sessions' {lo}..={hi}; before the cancel: {} sessions, {} bytes)",
                                b.get("dgr_worker_sessions_open"),
                                b.get("dgr_worker_kv_bytes_used")
                            ));
                        }
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
                Ok(freed)
            })
        };

        let on_token = |k: usize| {
            let received = received.clone();
            let started = started.clone();
            move |_: &TokenOut| {
                if received[k].fetch_add(1, SeqCst) == 0 {
                    started.fetch_add(1, SeqCst);
                }
                Flow::Continue
            }
        };
        let victim_cb = {
            let received = received.clone();
            let started = started.clone();
            let addrs = w.addrs.clone();
            let cancelled = AtomicBool::new(false);
            move |_: &TokenOut| {
                let got = received[3].fetch_add(1, SeqCst) + 1;
                if got == 1 {
                    started.fetch_add(1, SeqCst);
                }
                if got >= 3 && started.load(SeqCst) == 4 && !cancelled.swap(true, SeqCst) {
                    let r: Vec<usize> = (0..3).map(|k| received[k].load(SeqCst)).collect();
                    let before: Vec<Metrics> = addrs.iter().map(|a| metrics(a)).collect();
                    let _ = cancel_tx.send((Instant::now(), before, r));
                    return Flow::Cancel;
                }
                Flow::Continue
            }
        };
        let reqs: Vec<GenRequest> = others.iter().map(|p| gen_request(&p.tokens, OTHERS_TOKENS)).collect();
        let victim_req = gen_request(&victim.tokens, 400);
        let (r0, r1, r2, rv) = rt
            .block_on(async {
                tokio::time::timeout(Duration::from_secs(120), async {
                    tokio::join!(
                        dgr_driver::generate(&route, &reqs[0], &opts, on_token(0)),
                        dgr_driver::generate(&route, &reqs[1], &opts, on_token(1)),
                        dgr_driver::generate(&route, &reqs[2], &opts, on_token(2)),
                        dgr_driver::generate(&route, &victim_req, &opts, victim_cb),
                    )
                })
                .await
            })
            .expect("the four sessions took over 120 s");
        let rv = rv.expect("the cancelled session");
        assert_eq!(rv.finish_reason, "cancelled", "the victim's finish");
        assert!(rv.tokens.len() >= 3 && rv.tokens.len() < 400, "the victim got {} tokens", rv.tokens.len());
        let freed = observer.join().expect("observer thread").unwrap_or_else(|e| panic!("{}: {e}", layers_of(cuts)));
        for (i, f) in freed.iter().enumerate() {
            println!(
                "{} worker {i}: cancel took effect within {:.0} ms: sessions_open {} -> {}, kv_bytes_used {} -> {} \
                 ({} -> {} positions; the live sessions hold {}..={})",
                layers_of(cuts),
                f.after.as_secs_f64() * 1e3,
                f.open_before,
                f.open_after,
                f.kv_before,
                f.kv_after,
                f.kv_before / per_position[i],
                f.kv_after / per_position[i],
                f.kv_positions_bounds.0,
                f.kv_positions_bounds.1
            );
        }
        for ((got, want), p) in [r0, r1, r2].into_iter().zip(&solo).zip(&others) {
            let got = got.unwrap_or_else(|e| panic!("{} alongside the cancelled session: {e}", p.name));
            assert_same_completion(&got, want, &format!("{} alongside a cancelled session over {}", p.name, layers_of(cuts)));
        }
        let took = w.wait_all_free(&(0..n).collect::<Vec<_>>(), Duration::from_secs(2), "after every session ended");
        println!(
            "{}: victim cancelled after {} tokens; the other three equal their solo runs; all workers free {:.0} ms after",
            layers_of(cuts),
            rv.tokens.len(),
            took.as_secs_f64() * 1e3
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 5. Cleanup

#[test]
fn workers_free_closed_abandoned_and_idle_sessions() {
    let _serial = serial();
    let p = prompt("capital");
    for cuts in SPLITS {
        let all: Vec<usize> = (0..cuts.len() - 1).collect();
        let mut w = Workers::start(cuts, &["--idle-timeout", "60"]);

        // Closed: after a normal generation, nothing is held anywhere.
        let route = w.route();
        generate_json(&["--prompt", &p.text, "--route", &route, "--max-tokens", "8", "--ignore-eos"]);
        let took = w.wait_all_free(&all, Duration::from_secs(1), "after a completed generation");
        println!("{}: closed session freed on every worker ({:.0} ms)", layers_of(cuts), took.as_secs_f64() * 1e3);

        // Abandoned: a session opened and prefilled by hand, then the driver's connections drop.
        let (_, raws) = open_by_hand(&w, Some(&p.tokens));
        for i in 0..w.n() {
            // The gauges are published once the scheduler's step is over, just after the token
            // went out: allow them a moment.
            let deadline = Instant::now() + Duration::from_secs(1);
            loop {
                let m = w.metrics(i);
                let (open, kv) = (m.get("dgr_worker_sessions_open"), m.get("dgr_worker_kv_bytes_used"));
                if open == 1.0 && kv > 0.0 {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "worker {i} with a hand-opened, prefilled session: sessions_open {open}, kv_bytes_used {kv}"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        drop(raws);
        let took = w.wait_all_free(&all, Duration::from_secs(3), "after the driver disappeared");
        println!(
            "{}: abandoned session freed on every worker {:.0} ms after its driver vanished",
            layers_of(cuts),
            took.as_secs_f64() * 1e3
        );

        // Abandoned mid-decode: a driver process killed while tokens are streaming. Every worker
        // must stay up (a write to the vanished driver is an error to handle, not a reason to
        // die) and free the session.
        let mut driver = Proc::spawn(generate_cmd(&[
            "--format",
            "json",
            "--prompt",
            &p.text,
            "--route",
            &route,
            "--max-tokens",
            "2000",
            "--ignore-eos",
        ]));
        let started = Instant::now();
        while w.metrics(w.n() - 1).get("dgr_worker_tokens_decoded_total") < 20.0 {
            assert!(driver.running(), "the driver exited before it was killed");
            assert!(started.elapsed() < Duration::from_secs(30), "no decode under way after 30 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        driver.child.kill().unwrap();
        let _ = driver.child.wait();
        // Freeing the session takes the write that finds the driver gone; then every worker is
        // still up.
        let took = w.wait_all_free(&all, Duration::from_secs(3), "after the driver was killed mid-decode");
        for i in 0..w.n() {
            w.assert_alive(i, "after a driver was killed mid-decode");
        }
        println!("{}: driver killed mid-decode: every worker up, session freed within {:.0} ms", layers_of(cuts), took.as_secs_f64() * 1e3);
        drop(w);

        // Idle: a session opened by hand whose driver stays connected but sends nothing.
        let mut w = Workers::start(cuts, &["--idle-timeout", "1"]);
        let (id, mut raws) = open_by_hand(&w, None);
        let opened = Instant::now();
        for i in 0..w.n() {
            assert_eq!(w.metrics(i).get("dgr_worker_sessions_open"), 1.0, "worker {i} with the hand-opened session");
        }
        w.wait_all_free(&all, Duration::from_secs(5), "an idle session (--idle-timeout 1)");
        let took = opened.elapsed();
        assert!(took >= Duration::from_millis(900), "the idle session was freed after {took:?}, before its 1 s timeout");
        for (i, r) in raws.iter_mut().enumerate() {
            let e = expect_error(r.recv(), ErrorKind::Cancelled, &format!("worker {i} tells the idle session's driver"));
            assert_eq!(e.session_id, id);
        }
        println!("{}: idle session freed on every worker {:.2} s after it opened (--idle-timeout 1)", layers_of(cuts), took.as_secs_f64());
    }
}

// ---------------------------------------------------------------------------------------------
// 6. Failure

/// An address on loopback where nothing listens.
fn dead_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let a = l.local_addr().unwrap().to_string();
    drop(l);
    a
}

fn error_of(out: &Output, what: &str) -> Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{what}: the driver ended with {}, want exit 2; stdout {stdout:?}; stderr {:?}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{what}: stdout is not one JSON error ({e}): {stdout}"));
    let e = v["error"].clone();
    assert!(e.is_object(), "{what}: no error object in {v}");
    for k in ["kind", "message"] {
        assert!(e[k].as_str().is_some_and(|s| !s.is_empty()), "{what}: error without {k}: {v}");
    }
    e
}

#[test]
fn a_killed_worker_fails_the_request_cleanly_and_the_survivors_free_it() {
    let _serial = serial();
    let p = prompt("once");
    let mut failures = Vec::new();
    for cuts in SPLITS {
        let n = cuts.len() - 1;
        let mut positions = vec![0, n / 2, n - 1];
        positions.dedup();
        for k in positions {
            // Each position runs on its own workers; all are tried, and every failure reported.
            let r = std::panic::catch_unwind(|| {
                let mut w = Workers::start(cuts, &[]);
                let route = w.route();
                let started = Instant::now();
                let mut driver = Proc::spawn(generate_cmd(&[
                    "--format",
                    "json",
                    "--prompt",
                    &p.text,
                    "--route",
                    &route,
                    "--max-tokens",
                    "2000",
                    "--ignore-eos",
                    "--step-timeout",
                    "5",
                ]));
                // Kill once decoding is under way, about half a second in.
                loop {
                    assert!(driver.running(), "the driver exited before any worker was killed");
                    if w.metrics(n - 1).get("dgr_worker_tokens_decoded_total") > 0.0 && started.elapsed() >= Duration::from_millis(500) {
                        break;
                    }
                    assert!(started.elapsed() < Duration::from_secs(30), "no decode under way after 30 s");
                    std::thread::sleep(Duration::from_millis(20));
                }
                let decoded = w.metrics(n - 1).get("dgr_worker_tokens_decoded_total");
                w.kill(k);
                let killed = Instant::now();
                let out = driver.wait_within(Duration::from_secs(30));
                let took = killed.elapsed();
                let what = format!("{}: worker {k} killed after {decoded} decoded tokens", layers_of(cuts));
                let e = error_of(&out, &what);
                println!("{what}: driver exited {:?} {:.0} ms later with {e}", out.status.code(), took.as_secs_f64() * 1e3);
                assert!(took < Duration::from_secs(10), "{what}: the driver took {took:?} to fail");
                let stage = e["stage"].as_u64().unwrap_or_else(|| panic!("{what}: the error names no stage: {e}")) as usize;
                assert!(stage == k || stage + 1 == k, "{what}: the error names stage {stage}, not the killed {k} or its predecessor");
                assert_eq!(e["addr"].as_str(), Some(w.addrs[stage].as_str()), "{what}: the error's address is not stage {stage}'s");
                let survivors: Vec<usize> = (0..n).filter(|&i| i != k).collect();
                let took = w.wait_all_free(&survivors, Duration::from_secs(3), &what);
                println!("{what}: survivors {survivors:?} freed the session within {:.0} ms", took.as_secs_f64() * 1e3);
            });
            if let Err(e) = r {
                let msg =
                    e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
                failures.push(format!("{}, worker {k} killed: {msg}", layers_of(cuts)));
            }
        }

        // A route through an address where nothing listens, at each position.
        let w = Workers::start(cuts, &[]);
        for k in 0..n {
            let mut addrs = w.addrs.clone();
            addrs[k] = dead_addr();
            let route = addrs.join(",");
            let out = Proc::spawn(generate_cmd(&["--format", "json", "--prompt", &p.text, "--route", &route, "--max-tokens", "4"]))
                .wait_within(Duration::from_secs(20));
            let what = format!("{}: nothing listening at stage {k} ({})", layers_of(cuts), addrs[k]);
            let e = error_of(&out, &what);
            println!("{what}: {e}");
            assert_eq!(e["kind"], "connect_failed", "{what}");
            assert_eq!(e["stage"], k, "{what}");
            assert_eq!(e["addr"].as_str(), Some(addrs[k].as_str()), "{what}");
        }
    }
    assert!(failures.is_empty(), "{} of the kill checks failed:\n{}", failures.len(), failures.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// 7. Bad input at a seam

#[test]
fn bad_input_at_a_seam_is_refused_and_the_route_keeps_serving() {
    let _serial = serial();
    let p = prompt("list");
    for cuts in SPLITS {
        let mut w = Workers::start(cuts, &[]);
        let n = w.n() as u32;
        let route = w.route();
        let args =
            ["--format", "json", "--prompt", &p.text, "--route", &route, "--max-tokens", "32", "--ignore-eos", "--top-logprobs", "5"];
        let solo = generate_json(&args[2..]);
        // A normal generation runs through the same workers while the bad input arrives.
        let meanwhile = Proc::spawn(generate_cmd(&args));

        let addr = &w.addrs[1];
        let next = w.addrs.get(2).cloned().unwrap_or_default();
        println!("{}: bad input at stage 1 ({addr})", layers_of(cuts));
        let mut r = Raw::connect(addr);
        let hidden = r.info.hidden as usize;
        assert_eq!(hidden, 576);
        let refused_open = |r: &mut Raw, open: OpenSession, kind: ErrorKind, what: &str| {
            let id = open.session_id.clone();
            r.send(Body::Open(open));
            let e = expect_error(r.recv(), kind, what);
            assert_eq!(e.session_id, id, "{what}: the error names another session");
            assert_eq!(e.stage, 1, "{what}: the error names stage {}", e.stage);
        };

        // (a) wrong model identity
        let mut o = r.open_msg(1, n, &next);
        o.schema.as_mut().unwrap().model_id = "0".repeat(64);
        refused_open(&mut r, o, ErrorKind::SchemaMismatch, "(a) Open with another model's id");
        // (b) wrong hidden size
        let mut o = r.open_msg(1, n, &next);
        o.schema.as_mut().unwrap().hidden += 1;
        refused_open(&mut r, o, ErrorKind::SchemaMismatch, "(b) Open with hidden size 577");
        // (c) wrong layer range, and a seam dtype that does not exist
        let mut o = r.open_msg(1, n, &next);
        o.schema.as_mut().unwrap().layer_start -= 1;
        refused_open(&mut r, o, ErrorKind::SchemaMismatch, "(c) Open with another layer range");
        let mut o = r.open_msg(1, n, &next);
        o.schema.as_mut().unwrap().seam_dtype = 77;
        refused_open(&mut r, o, ErrorKind::SchemaMismatch, "(c') Open with seam dtype 77");

        // (d) a correct Open, then hidden rows of the wrong byte count
        let o = r.open_msg(1, n, &next);
        let id = o.session_id.clone();
        r.open_ok(o);
        let rows = |id: &[u8], bytes: usize, dtype: SeamDtype| Forward {
            session_id: id.to_vec(),
            position: 0,
            hidden: vec![0; bytes],
            dtype: dtype as i32,
            n_rows: 1,
            sample: true,
            ..Default::default()
        };
        r.send(Body::Forward(rows(&id, hidden * 4 - 4, SeamDtype::F32)));
        let e = expect_error(r.recv(), ErrorKind::BadInput, "(d) Forward of 2300 bytes as one f32 row of 576");
        assert_eq!(e.session_id, id);
        // (e) a correct Open, then f16 rows on the f32 session
        let o = r.open_msg(1, n, &next);
        let id = o.session_id.clone();
        r.open_ok(o);
        r.send(Body::Forward(rows(&id, hidden * 2, SeamDtype::F16)));
        let e = expect_error(r.recv(), ErrorKind::BadInput, "(e) Forward of f16 rows on an f32 session");
        assert_eq!(e.session_id, id);
        // (f) a session nobody opened
        let id = random_id();
        r.send(Body::Forward(rows(&id, hidden * 4, SeamDtype::F32)));
        let e = expect_error(r.recv(), ErrorKind::UnknownSession, "(f) Forward for an unknown session");
        assert_eq!(e.session_id, id);
        // (g) garbage as a frame: refused, and this connection still answers
        r.send_payload(&[0xff; 16]);
        let e = expect_error(r.recv(), ErrorKind::BadFrame, "(g) a frame of 16 bytes of 0xff");
        assert_eq!(e.stage, STAGE_UNKNOWN);
        r.send(Body::Forward(rows(&random_id(), hidden * 4, SeamDtype::F32)));
        expect_error(r.recv(), ErrorKind::UnknownSession, "(g) the same connection, after the garbage");
        // (h) a frame over the size cap: refused, then the connection closes
        let mut big = Raw::connect(addr);
        big.s.write_all(&0x7fff_fff0u32.to_be_bytes()).unwrap();
        expect_error(big.recv(), ErrorKind::BadFrame, "(h) a 2 GiB frame length");
        assert!(big.try_recv().is_err(), "(h) the connection stays open after an oversized frame");
        // (i) garbage instead of Hello on a fresh connection
        let mut bare = Raw::connect_bare(addr);
        bare.send_payload(b"abc");
        expect_error(bare.recv(), ErrorKind::BadFrame, "(i) garbage instead of Hello");
        // Other connections are still served: a fresh handshake works.
        let again = Raw::connect(addr);
        assert_eq!((again.info.layer_start, again.info.layer_end), (cuts[1] as u32, cuts[2] as u32));

        let out = meanwhile.wait_within(Duration::from_secs(60));
        assert!(out.status.success(), "the generation alongside the bad input failed: {}", String::from_utf8_lossy(&out.stdout));
        let got: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_same_generation(&got, &solo, &format!("a generation alongside bad input over {}", layers_of(cuts)));
        let after = generate_json(&args[2..]);
        assert_same_generation(&after, &solo, &format!("a generation after bad input over {}", layers_of(cuts)));
        drop((r, big, bare, again));
        w.wait_all_free(&(0..w.n()).collect::<Vec<_>>(), Duration::from_secs(2), "after the bad input");
        let m = w.metrics(1);
        let failures: Vec<String> =
            m.0.iter().filter(|(k, _)| k.starts_with("dgr_worker_failures_total")).map(|(k, v)| format!("{k} {v}")).collect();
        println!("{}: the route's output is unchanged alongside and after; stage 1 counts {failures:?}", layers_of(cuts));
    }
}

// ---------------------------------------------------------------------------------------------
// 8. A prompt prefilled in chunks

#[test]
fn a_prompt_prefilled_in_chunks_gives_the_same_output_and_a_full_seam_report() {
    let _serial = serial();
    let long = prompt("long");
    let args = ["--prompt", long.text.as_str(), "--max-tokens", "4", "--ignore-eos", "--top-logprobs", "5"];
    let mut a = args.to_vec();
    a.extend(["--threads", "1"]);
    let whole = generate_json(&a);
    let mut wrong = Vec::new();
    for cuts in SPLITS {
        // Workers that prefill at most 64 prompt rows per step: the 292-row prompt crosses each
        // seam in five frames.
        let w = Workers::start(cuts, &["--prefill-chunk", "64"]);
        let route = w.route();
        let mut a = args.to_vec();
        a.extend(["--route", &route]);
        let got = generate_json(&a);
        assert_same_generation(&got, &whole, &format!("the long prompt prefilled in chunks of 64 over {}", layers_of(cuts)));
        // Every prompt row, each decoded row but the last and each rejected draft crossed every
        // seam, as f32 rows of 576.
        let want = ((long.tokens.len() + 4 - 1 + rejected_drafts(&got) as usize) * 576 * 4) as u64;
        let bytes: Vec<u64> = got["seams"].as_array().expect("seams").iter().map(|s| s["bytes"].as_u64().unwrap()).collect();
        println!(
            "{}: {} prompt rows in chunks of 64 + 3 decoded rows: output identical to the whole model; seam bytes reported {bytes:?}, \
             {want} crossed each seam; usage {}",
            layers_of(cuts),
            long.tokens.len(),
            got["usage"]
        );
        if bytes != vec![want; w.n() - 1] {
            wrong.push(format!("{}: seam bytes reported {bytes:?}, but {want} crossed each seam", layers_of(cuts)));
        }
    }
    assert!(wrong.is_empty(), "the seam report misses rows that crossed the seams:\n{}", wrong.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// 9. The prefix cache

#[test]
fn a_second_request_sharing_a_long_prefix_attaches_it_and_equals_the_cold_run() {
    let _serial = serial();
    let long = prompt("long");
    let second = format!("{} So, in short,", long.text);
    let args = |text: &str| {
        vec![
            "--prompt".to_string(),
            text.to_string(),
            "--max-tokens".into(),
            "4".into(),
            "--ignore-eos".into(),
            "--top-logprobs".into(),
            "5".into(),
        ]
    };
    let run = |text: &str, extra: &[&str]| {
        let mut a = args(text);
        a.extend(extra.iter().map(|s| s.to_string()));
        generate_json(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let cold = run(&second, &["--threads", "1"]);
    let w = Workers::start(SPLITS[0], &[]);
    let route = w.route();
    let first = run(&long.text, &["--route", &route]);
    assert_eq!(first["cached_tokens"], 0, "a cold cache: {first}");
    let hit = run(&second, &["--route", &route]);
    let cached = hit["cached_tokens"].as_u64().expect("cached_tokens");
    // The long prompt's full blocks, but for a block its last tokens may tokenize into with the
    // text after them.
    let blocks = long.tokens.len() as u64 / 16 * 16;
    println!(
        "the second request attached {cached} of its {} prompt tokens ({} in the first prompt)",
        hit["prompt_tokens"].as_array().map_or(0, Vec::len),
        long.tokens.len()
    );
    assert!(cached + 16 >= blocks && cached > 0, "only {cached} tokens cached of the first prompt's {blocks} in full blocks");
    assert_same_generation(&hit, &cold, "a request attaching a cached prefix");
    // The cache off (--prefix-cache-mb 0) computes it all, the same.
    let off = Workers::start(SPLITS[0], &["--prefix-cache-mb", "0"]);
    let route = off.route();
    run(&long.text, &["--route", &route]);
    let miss = run(&second, &["--route", &route]);
    assert_eq!(miss["cached_tokens"], 0);
    assert_same_generation(&miss, &cold, "the same request with the cache off");
}
