//! Exact speculative decoding on the real default model, through a 2-stage route of real `dgr
//! worker` processes: 100 requests (half copy-heavy — a passage then its start again, which the
//! model goes on copying — half free-form; half greedy, half seeded at temperature 0.8; some
//! stopped by the caller mid-way) run with speculation off and on, and every one has the same
//! tokens, logprobs, top logprobs and finish reason bit for bit. The drafts are verified by the
//! last stage: its /metrics counts exactly the drafts the driver reports accepted and rejected.
//! Prints accepted drafts per verification step (copy-heavy and free-form).
#![cfg(feature = "real-model")]

mod common;
use common::*;

use dgr_driver::{Completion, DriveOptions, Flow, GenRequest, Route, Speculate};
use dgr_proto::{Sampling, SeamDtype};
use futures::StreamExt;
use std::time::Duration;

const MAX_TOKENS: usize = 32;

struct Case {
    copy: bool,
    prompt: Vec<u32>,
    sampling: Sampling,
    /// The caller stops the generation after this many tokens.
    stop_after: Option<usize>,
}

/// 50 copy-heavy and 50 free-form requests over slices of the reference prompts.
fn cases() -> Vec<Case> {
    let texts: Vec<Vec<u32>> = prompts().into_iter().map(|p| p.tokens).filter(|t| t.len() >= 12).collect();
    let long = prompt("long").tokens;
    (0..100)
        .map(|i| {
            let copy = i % 2 == 0;
            let prompt = if copy {
                // A passage, then its first few tokens again.
                let start = (i * 7) % (long.len() - 48);
                let passage = &long[start..start + 24 + i % 20];
                passage.iter().chain(&passage[..3 + i % 5]).copied().collect()
            } else {
                let t = &texts[i % texts.len()];
                let end = t.len() - (i / texts.len()) % (t.len() / 2);
                t[..end].to_vec()
            };
            let sampling = if i % 4 < 2 {
                Sampling { temperature: 0.0, top_k: 40, top_p: 0.95, seed: 0 }
            } else {
                Sampling { temperature: 0.8, top_k: 40, top_p: 0.95, seed: i as u64 }
            };
            let stop_after = (i % 5 == 0).then_some(5 + i % 17);
            Case { copy, prompt, sampling, stop_after }
        })
        .collect()
}

fn run_all(route: &Route, cases: &[Case], speculate: Speculate) -> Vec<Completion> {
    let rt = runtime();
    let opts = DriveOptions { step_timeout: Duration::from_secs(30), speculate, ..DriveOptions::default() };
    rt.block_on(async {
        let runs = cases.iter().enumerate().map(|(i, c)| {
            let req = GenRequest {
                prompt_tokens: c.prompt.clone(),
                max_tokens: MAX_TOKENS,
                sampling: c.sampling,
                top_logprobs: 2,
                seam_dtype: SeamDtype::F32,
                ticket: None,
                hash_rows: false,
                constraint: None,
                stop_tokens: Vec::new(),
            };
            let (route, opts, stop_after) = (route.clone(), opts.clone(), c.stop_after);
            async move {
                let mut n = 0;
                let out = dgr_driver::generate(&route, &req, &opts, |_| {
                    n += 1;
                    if Some(n) == stop_after {
                        Flow::Stop
                    } else {
                        Flow::Continue
                    }
                })
                .await;
                (i, out.unwrap_or_else(|e| panic!("request {i} with --speculate {speculate}: {e}")))
            }
        });
        let mut done: Vec<(usize, Completion)> = futures::stream::iter(runs).buffer_unordered(8).collect().await;
        done.sort_by_key(|(i, _)| *i);
        done.into_iter().map(|(_, c)| c).collect()
    })
}

#[test]
fn speculation_changes_no_token_or_logprob() {
    let _g = serial();
    let mut w = Workers::start(&[0, 15, 30], &[]);
    let route = runtime().block_on(Route::discover(&w.addrs, Duration::from_secs(10))).expect("the route");
    let cases = cases();
    let off = run_all(&route, &cases, Speculate::Off);
    let before = w.metrics(1);
    let on = run_all(&route, &cases, Speculate::DEFAULT);
    let after = w.metrics(1);
    let mut totals = [dgr_driver::DraftStats::default(); 2];
    for (i, ((c, a), b)) in cases.iter().zip(&off).zip(&on).enumerate() {
        let what =
            format!("request {i} ({}, {:?}, stop after {:?})", if c.copy { "copy-heavy" } else { "free-form" }, c.sampling, c.stop_after);
        assert_same_completion(b, a, &what);
        assert_eq!(a.drafts, dgr_driver::DraftStats::default(), "{what}: drafts with speculation off");
        assert_eq!(b.tokens.len(), c.stop_after.unwrap_or(MAX_TOKENS).min(MAX_TOKENS), "{what}: the tokens asked for");
        totals[c.copy as usize].add(&b.drafts);
    }
    let delta = |name: &str| after.get(name) - before.get(name);
    let all = {
        let mut t = totals[0];
        t.add(&totals[1]);
        t
    };
    assert_eq!(delta("dgr_worker_verify_steps_total"), all.steps as f64, "the last stage verified every step the driver counts");
    assert_eq!(delta("dgr_worker_draft_tokens_total{outcome=\"accepted\"}"), all.accepted as f64);
    assert_eq!(delta("dgr_worker_draft_tokens_total{outcome=\"rejected\"}"), (all.drafted - all.accepted) as f64);
    for (name, t) in [("free-form", totals[0]), ("copy-heavy", totals[1])] {
        let per_step = t.accepted as f64 / t.steps.max(1) as f64;
        println!(
            "{name}: {} verification steps, {} drafts, {} accepted: {per_step:.2} accepted tokens per verification step",
            t.steps, t.drafted, t.accepted
        );
    }
    let (free, copy) = (totals[0], totals[1]);
    assert!(
        copy.accepted > 0 && copy.accepted * free.steps.max(1) > free.accepted * copy.steps,
        "copy-heavy text has drafts accepted, more per step than free-form text: {copy:?}, {free:?}"
    );
}
