//! What link encryption costs decode: one session through a local multi-process route whose
//! links are encrypted (Noise, the default), and through the same route started with
//! `--insecure-plaintext`, in alternating rounds (each round's order swapped) so that both see
//! the same machine. The driver's own link mode is process-wide, so it is switched between
//! rounds; each round dials its route afresh.

use super::{median, record, spread};
use crate::error::{Context, Result};
use crate::model::{ModelArg, NumericsArg};
use crate::swarm::{check_split, even_split, LocalSwarm};
use dgr_driver::{DriveOptions, Flow, GenRequest, Route};
use dgr_proto::{Sampling, SeamDtype};
use serde_json::json;
use std::path::PathBuf;
use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArg,
    #[command(flatten)]
    numerics: NumericsArg,
    /// Compute threads of each worker
    #[arg(long, short = 't', default_value_t = 2)]
    threads: usize,
    /// Tokens generated per round
    #[arg(long, default_value_t = 64)]
    gen_tokens: usize,
    /// Stages in the route
    #[arg(long, default_value_t = 2)]
    split: usize,
    /// Paired rounds
    #[arg(long, short = 'r', default_value_t = 10)]
    reps: usize,
    /// Directory for the run's record
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
}

pub fn run(a: Args) -> Result<()> {
    let model = a.model.path()?;
    let g = a.model.open()?;
    let n_layers = dgr_engine::ModelConfig::from_gguf(&g)?.n_layers;
    check_split(n_layers, a.split)?;
    let ranges = even_split(n_layers, a.split);
    let flags = a.numerics.worker_flags()?.to_vec();
    let sealed = LocalSwarm::start(&model, &ranges, a.threads, &flags)?;
    let mut plain_flags = flags.clone();
    plain_flags.push("--insecure-plaintext".into());
    let plain = LocalSwarm::start(&model, &ranges, a.threads, &plain_flags)?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting a runtime")?;
    let discover = |s: &LocalSwarm, clear: bool| {
        dgr_proto::set_insecure_plaintext(clear);
        rt.block_on(Route::discover(&s.addrs, Duration::from_secs(5)))
    };
    let routes = [(discover(&sealed, false)?, false), (discover(&plain, true)?, true)];
    let req = GenRequest {
        prompt_tokens: vec![1],
        max_tokens: a.gen_tokens,
        sampling: Sampling { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 },
        top_logprobs: 0,
        seam_dtype: SeamDtype::F32,
        ticket: None,
        hash_rows: false,
        constraint: None,
        stop_tokens: Vec::new(),
    };
    let decode = |(route, clear): &(Route, bool)| -> Result<f64> {
        dgr_proto::set_insecure_plaintext(*clear);
        Ok(rt.block_on(dgr_driver::generate(route, &req, &DriveOptions::default(), |_| Flow::Continue))?.timings.decode_tok_per_s)
    };
    for r in &routes {
        decode(r)?; // warm-up
    }
    let (mut enc, mut clear) = (Vec::new(), Vec::new());
    for rep in 0..a.reps {
        let (e, c) = if rep % 2 == 0 {
            let e = decode(&routes[0])?;
            (e, decode(&routes[1])?)
        } else {
            let c = decode(&routes[1])?;
            (decode(&routes[0])?, c)
        };
        eprintln!("round {rep}: encrypted {e:.1}, plaintext {c:.1} tok/s ({:.3})", e / c);
        enc.push(e);
        clear.push(c);
    }
    dgr_proto::set_insecure_plaintext(false);
    let ratios: Vec<f64> = enc.iter().zip(&clear).map(|(e, c)| e / c).collect();
    let (lo, hi) = spread(&ratios);
    let desc: Vec<String> = ranges.iter().map(|r| format!("{}..{}", r.start, r.end)).collect();
    println!("decode tg{}, threads {} per worker, route {}, {} paired rounds", a.gen_tokens, a.threads, desc.join(" + "), a.reps);
    println!("{:<24} {:>10}", "links", "tok/s");
    println!("{:<24} {:>10.1}", "encrypted (Noise)", median(&enc));
    println!("{:<24} {:>10.1}", "--insecure-plaintext", median(&clear));
    println!("encrypted / plaintext: {:.3} (min–max {lo:.3}–{hi:.3})", median(&ratios));
    let path = record::write(
        &a.out,
        "links",
        &model,
        json!({
            "split": desc,
            "threads": a.threads,
            "gen_tokens": a.gen_tokens,
            "samples": { "encrypted_decode_tok_s": enc, "plaintext_decode_tok_s": clear },
            "ratios": { "encrypted_vs_plaintext": median(&ratios), "min": lo, "max": hi },
        }),
    )?;
    println!("record: {}", path.display());
    Ok(())
}
