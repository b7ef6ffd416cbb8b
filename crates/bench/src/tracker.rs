//! `dgr bench tracker`: what a tracker costs on the data path. One session at a time decodes
//! through three local 2-worker routes, interleaved per repetition: the same route given by
//! `--route` (ticketless), a tracker-planned route with a signed ticket, and a tracker-planned
//! route whose second worker is relayed through the tracker. With `--workers`, the tracker under
//! load instead (`tracker_load`).

use super::{median, record};
use crate::error::{BenchError, Context, Result};
use crate::model::ModelArg;
use crate::swarm::{balanced_split, LocalSwarm, LocalTracker};
use dgr_driver::{tracker, Completion, DriveOptions, Flow, GenRequest, Route};
use dgr_proto::{Sampling, SeamDtype};
use serde_json::json;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArg,
    /// Compute threads of each worker
    #[arg(long, short = 't', default_value_t = 1)]
    threads: usize,
    /// Tokens generated per repetition
    #[arg(long, default_value_t = 64)]
    gen_tokens: usize,
    /// Paired repetitions
    #[arg(long, short = 'r', default_value_t = 5)]
    reps: usize,
    /// Directory for the run's record
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
    #[command(flatten)]
    load: super::tracker_load::Args,
}

struct Sample {
    decode_tok_s: f64,
    seam_p50_ms: f64,
    /// Asking the tracker for the route and its ticket (0 for `--route`).
    route_ms: f64,
}

pub fn run(a: Args) -> Result<()> {
    if a.load.workers.is_some() {
        return super::tracker_load::run(a.load, &a.out);
    }
    let model = a.model.path()?;
    let g = a.model.open()?;
    let n_layers = dgr_engine::ModelConfig::from_gguf(&g)?.n_layers;
    let ranges = balanced_split(&g, n_layers, 2);
    let model_id = dgr_gguf::model_identity(&model)?.id;
    let direct = LocalSwarm::start(&model, &ranges, a.threads, &[])?;
    let t = LocalTracker::start(&[])?;
    let joined = LocalSwarm::start(&model, &ranges, a.threads, &t.join_flags())?;
    let mut relay_flags = t.join_flags();
    relay_flags.push("--relay".into());
    let relayed = LocalSwarm::start(&model, &ranges[1..], a.threads, &relay_flags)?;
    let (direct_tail, relayed_tail) = (joined.ids[1].clone(), relayed.ids[0].clone());

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting a runtime")?;
    let listed = rt.block_on(Route::discover(&direct.addrs, Duration::from_secs(5)))?;
    let req = |ticket| GenRequest {
        prompt_tokens: vec![1],
        max_tokens: a.gen_tokens,
        sampling: Sampling { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 },
        top_logprobs: 0,
        seam_dtype: SeamDtype::F32,
        ticket,
        hash_rows: false,
        constraint: None,
        stop_tokens: Vec::new(),
    };
    let sample = |c: Completion, route_ms: f64| Sample {
        decode_tok_s: c.timings.decode_tok_per_s,
        seam_p50_ms: c.seams.first().map_or(0.0, |s| s.latency_ms_p50),
        route_ms,
    };
    let opts = DriveOptions::default();
    let by_route = || -> Result<Sample> {
        let c = rt.block_on(dgr_driver::generate(&listed, &req(None), &opts, |_| Flow::Continue))?;
        Ok(sample(c, 0.0))
    };
    // Each tracker-planned session avoids the other variant's last worker.
    let planned = |avoid: &str| -> Result<(Sample, Vec<String>)> {
        rt.block_on(async {
            let started = Instant::now();
            let budget = 1 + a.gen_tokens as u64;
            let (route, ticket) =
                tracker::route(&t.addr, &model_id, "", budget, "", &tracker::new_request_id(), &[avoid.into()], &[]).await?;
            let route_ms = started.elapsed().as_secs_f64() * 1e3;
            let c = dgr_driver::generate(&route, &req(Some(ticket)), &opts, |_| Flow::Continue).await?;
            Ok((sample(c, route_ms), route.addrs()))
        })
    };
    // Warm-up, and a check that each variant takes the route it should.
    let wait_joined = Instant::now();
    let (_, direct_addrs) = loop {
        match planned(&relayed_tail) {
            Ok(v) => break v,
            Err(e) if wait_joined.elapsed() < Duration::from_secs(10) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(BenchError::Local(format!("the workers did not join the tracker: {e}"))),
        }
    };
    let (_, relay_addrs) = planned(&direct_tail)?;
    if !relay_addrs[1].starts_with("relay://") || direct_addrs[1].starts_with("relay://") {
        return Err(BenchError::Local(format!("unexpected routes: {direct_addrs:?} and {relay_addrs:?}")));
    }
    by_route()?;

    let (mut listed_s, mut planned_s, mut relay_s) = (Vec::new(), Vec::new(), Vec::new());
    for rep in 0..a.reps {
        let l = by_route()?;
        let (p, _) = planned(&relayed_tail)?;
        let (r, _) = planned(&direct_tail)?;
        eprintln!(
            "rep {rep}: --route {:.1}, tracker-planned {:.1}, relayed {:.1} tok/s; seam p50 {:.3} / {:.3} / {:.3} ms",
            l.decode_tok_s, p.decode_tok_s, r.decode_tok_s, l.seam_p50_ms, p.seam_p50_ms, r.seam_p50_ms
        );
        listed_s.push(l);
        planned_s.push(p);
        relay_s.push(r);
    }
    let field = |v: &[Sample], f: fn(&Sample) -> f64| v.iter().map(f).collect::<Vec<f64>>();
    let ratio = |x: &[Sample], y: &[Sample]| median(&x.iter().zip(y).map(|(x, y)| x.decode_tok_s / y.decode_tok_s).collect::<Vec<_>>());
    let (planned_vs_listed, relay_vs_direct) = (ratio(&planned_s, &listed_s), ratio(&relay_s, &planned_s));
    let added = median(&relay_s.iter().zip(&planned_s).map(|(r, p)| r.seam_p50_ms - p.seam_p50_ms).collect::<Vec<_>>());
    let split: Vec<String> = ranges.iter().map(|r| format!("{}..{}", r.start, r.end)).collect();
    println!("decode tg{}, {} thread(s) per worker, route {}", a.gen_tokens, a.threads, split.join(" + "));
    println!("{:<34} {:>10} {:>14}", "route", "tok/s", "seam p50 ms");
    for (name, v) in
        [("--route (ticketless)", &listed_s), ("tracker-planned, ticketed", &planned_s), ("tracker-planned, relayed hop", &relay_s)]
    {
        println!("{name:<34} {:>10.1} {:>14.3}", median(&field(v, |s| s.decode_tok_s)), median(&field(v, |s| s.seam_p50_ms)));
    }
    println!("tracker-planned / --route: {planned_vs_listed:.3}   relayed / direct: {relay_vs_direct:.3}");
    println!(
        "relay adds {added:.3} ms per step at its hop (p50); a route and ticket take {:.2} ms",
        median(&field(&planned_s, |s| s.route_ms))
    );
    let path = record::write(
        &a.out,
        "tracker",
        &model,
        json!({
            "split": split,
            "peer": { "tool": "dgr's own ticketless --route over the same worker configuration", "version": env!("CARGO_PKG_VERSION") },
            "threads": a.threads,
            "samples": {
                "route_decode_tok_s": field(&listed_s, |s| s.decode_tok_s),
                "planned_decode_tok_s": field(&planned_s, |s| s.decode_tok_s),
                "relayed_decode_tok_s": field(&relay_s, |s| s.decode_tok_s),
                "route_seam_p50_ms": field(&listed_s, |s| s.seam_p50_ms),
                "planned_seam_p50_ms": field(&planned_s, |s| s.seam_p50_ms),
                "relayed_seam_p50_ms": field(&relay_s, |s| s.seam_p50_ms),
                "planned_route_ms": field(&planned_s, |s| s.route_ms),
            },
            "ratios": { "planned_vs_route": planned_vs_listed, "relayed_vs_direct": relay_vs_direct },
            "relay_added_ms_p50": added,
        }),
    )?;
    println!("record: {}", path.display());
    Ok(())
}
