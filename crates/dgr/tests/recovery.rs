//! Recovery by replay on the real default model: a worker killed (SIGKILL) or stopped (SIGSTOP)
//! mid-generation is replaced by a replica, the session's tokens replay as a prefill, and the
//! output equals a fault-free run token for token (greedy and seeded, with speculative decoding
//! off and on: a replay after speculative steps holds no rejected draft); without a replica the
//! request fails with an error naming the failed stage, before its deadline.
#![cfg(feature = "real-model")]

mod common;

use common::swarm::{Tracker, Worker};
use common::{dgr_json, serial};
use dgr_driver::{generate_recovering, tracker, DriveOptions, Flow, GenRequest, Links, Recovered, Speculate};
use dgr_proto::{Sampling, SeamDtype};
use serde_json::Value;
use std::time::{Duration, Instant};

const PROMPT: &str = "The quick brown fox";
const TOKENS: usize = 96;

fn one_process(extra: &[&str]) -> Value {
    let n = TOKENS.to_string();
    let mut args = vec!["generate", "--prompt", PROMPT, "--format", "json", "--threads", "1", "--ignore-eos", "--max-tokens", &n];
    args.extend_from_slice(extra);
    dgr_json(&args)
}

fn ids(v: &Value) -> Vec<u32> {
    common::ids(v).into_iter().map(|t| t as u32).collect()
}

/// Generates through the tracker's routes; after `at` tokens, `fault` is applied to the worker
/// serving stage `stage` of the first route.
#[allow(clippy::too_many_arguments)]
fn run_with_fault(
    t: &Tracker,
    workers: &[Worker],
    prompt: &[u32],
    sampling: Sampling,
    stage: usize,
    at: usize,
    fault: &str,
    speculate: Speculate,
) -> (Recovered, Vec<u32>) {
    let model_id = dgr_gguf::model_identity(&common::model()).unwrap().id;
    let rt = common::runtime();
    rt.block_on(async {
        let request_id = tracker::new_request_id();
        let budget = (prompt.len() + TOKENS) as u64;
        let (route, ticket) = tracker::route(&t.addr, &model_id, "", budget, "", &request_id, &[], &[]).await.unwrap();
        let victim = workers.iter().find(|w| w.id == route.stages[stage].worker_id).expect("the route's worker");
        let req = GenRequest {
            prompt_tokens: prompt.to_vec(),
            max_tokens: TOKENS,
            sampling,
            top_logprobs: 0,
            seam_dtype: SeamDtype::F32,
            ticket: None,
            hash_rows: false,
            constraint: None,
            stop_tokens: Vec::new(),
        };
        let mut streamed = Vec::new();
        let on_token = |tok: &dgr_proto::TokenOut| {
            streamed.push(tok.token);
            if streamed.len() == at {
                victim.signal(fault);
            }
            Flow::Continue
        };
        let addr = t.addr.clone();
        let replan = |exclude: Vec<String>, budget: u64, engine: String| {
            let (addr, model_id, request_id) = (addr.clone(), model_id.clone(), request_id.clone());
            async move { tracker::route(&addr, &model_id, &engine, budget, "", &request_id, &exclude, &[]).await.map(|(r, t)| (r, Some(t))) }
        };
        let opts = DriveOptions { step_timeout: Duration::from_secs(10), speculate, ..DriveOptions::default() };
        let rec = generate_recovering(&Links::new(), (route, Some(ticket)), &req, &opts, on_token, replan, 3).await;
        (rec, streamed)
    })
}

#[test]
fn a_killed_or_stopped_worker_is_replaced_without_changing_a_token() {
    let _g = serial();
    let greedy = one_process(&[]);
    let seeded = one_process(&["--temperature", "0.9", "--seed", "11"]);
    let prompt = ids(&greedy["prompt_tokens"]);
    let greedy_s = Sampling { temperature: 0.0, top_k: 40, top_p: 0.95, seed: 0 };
    let seeded_s = Sampling { temperature: 0.9, top_k: 40, top_p: 0.95, seed: 11 };
    let on = Speculate::DEFAULT;
    let cases = [
        ("SIGKILL of stage 0, greedy", 0, "KILL", greedy_s, &greedy, Speculate::Off),
        ("SIGKILL of stage 0, greedy, speculative", 0, "KILL", greedy_s, &greedy, on),
        ("SIGKILL of stage 1, seeded, speculative", 1, "KILL", seeded_s, &seeded, on),
        ("SIGSTOP of stage 1, greedy, speculative", 1, "STOP", greedy_s, &greedy, on),
        ("SIGSTOP of stage 0, seeded", 0, "STOP", seeded_s, &seeded, Speculate::Off),
    ];
    for (what, stage, fault, sampling, want, speculate) in cases {
        let t = Tracker::start("recovery", &[]);
        let workers: Vec<Worker> =
            [(0, 15), (0, 15), (15, 30), (15, 30)].iter().enumerate().map(|(i, r)| Worker::start(&t, *r, &format!("w{i}"), &[])).collect();
        let ids_: Vec<&str> = workers.iter().map(|w| w.id.as_str()).collect();
        t.wait_live(&ids_, Duration::from_secs(5), "joined");
        let (rec, streamed) = run_with_fault(&t, &workers, &prompt, sampling, stage, 30, fault, speculate);
        let out = rec.result.unwrap_or_else(|e| panic!("{what}: {e}"));
        if speculate != Speculate::Off {
            assert!(out.drafts.steps > 0, "{what}: the replay speculated: {:?}", out.drafts);
        }
        assert_eq!(out.tokens, ids(&want["tokens"]), "{what}: the tokens");
        assert_eq!(streamed, out.tokens, "{what}: the stream has no token twice or missing");
        let logprobs: Vec<f32> = want["logprobs"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        assert_eq!(out.logprobs, logprobs, "{what}: the logprobs");
        assert_eq!(rec.recoveries.len(), 1, "{what}: {:?}", rec.recoveries);
        let r = &rec.recoveries[0];
        // The ring runs ahead of the driver: the stage may have computed a step or two more by
        // the time the fault lands (one more with speculation off was seen); a speculative step
        // may have delivered the tokens after the 30th with it.
        let steps = if speculate == Speculate::Off { 30..=32 } else { 30..=32 + dgr_proto::MAX_DRAFT };
        assert!(r.stage == Some(stage as u32) && steps.contains(&r.at_token), "{what}: {r:?}");
        let stall = r.stall_ms.unwrap_or_else(|| panic!("{what}: the replacement delivered no token: {r:?}"));
        println!("{what}: recovered from {} after {} tokens, stall {stall:.0} ms", r.kind, r.at_token);
        assert!(
            (0.0..2000.0 + 1000.0).contains(&stall),
            "{what}: stall {stall:.0} ms (detection + replaying {} tokens)",
            prompt.len() + 30
        );
        // The replayed session's stages computed the replay; the failed one's work counts too.
        assert_eq!(rec.attempts.len(), 2);
        for w in &workers {
            w.signal("CONT");
        }
    }
}

#[test]
fn without_a_replica_the_error_names_the_failed_stage_in_time() {
    let _g = serial();
    let greedy = one_process(&[]);
    let prompt = ids(&greedy["prompt_tokens"]);
    // A killed stage is seen by the driver's connection or by the stage before it, whichever
    // notices first; a stopped one only by the driver's ping.
    for (fault, kinds) in [("KILL", &["connection_lost", "next_stage"][..]), ("STOP", &["silent"][..])] {
        let t = Tracker::start("norecovery", &[]);
        let workers = vec![Worker::start(&t, (0, 15), "a", &[]), Worker::start(&t, (15, 30), "b", &[])];
        t.wait_live(&[&workers[0].id, &workers[1].id], Duration::from_secs(5), "joined");
        let started = Instant::now();
        let (rec, _) = run_with_fault(&t, &workers, &prompt, Sampling::default(), 1, 10, fault, Speculate::DEFAULT);
        let e = rec.result.expect_err("no replica: the request must fail");
        println!("{fault}: {} after {:?}: {}", e.kind, started.elapsed(), e.message);
        assert!(kinds.contains(&e.kind.as_str()) && e.stage == Some(1), "{e:?}");
        assert_eq!(e.addr.as_deref(), workers[1].addr.as_deref());
        assert!(e.message.contains("no replacement route"), "{}", e.message);
        assert!(started.elapsed() < Duration::from_secs(10), "failed after {:?}", started.elapsed());
        workers[1].signal("CONT");
    }
}
