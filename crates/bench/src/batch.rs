use super::{median, peer, prompt, record, spread};
use crate::error::{BenchError, Context, Result};
use crate::model::{ModelArg, NumericsArg};
use crate::plot::{self, Chart};
use crate::swarm::{balanced_split, check_split, LocalSwarm};
use dgr_driver::{DriveOptions, Flow, GenRequest, Route};
use dgr_engine::{open_engine, Engine, Input, LogitRows, SeqInput};
use dgr_proto::{Sampling, SeamDtype};
use plotters::chart::SeriesLabelPosition;
use serde_json::json;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArg,
    #[command(flatten)]
    numerics: NumericsArg,
    /// Compute threads of each process
    #[arg(long, short = 't', default_value_t = 2)]
    threads: usize,
    /// Concurrent sessions to measure, comma-separated
    #[arg(long, default_value = "1,2,4,8")]
    sessions: String,
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 64)]
    gen_tokens: usize,
    /// Stages of the local route started for the run (layer ranges balanced by compute, the
    /// head counted on the last stage)
    #[arg(long, default_value_t = 2)]
    split: usize,
    /// Compute threads of each worker of the local route [default: --threads / --split, at
    /// least 1: the stages then run side by side on separate cores]
    #[arg(long)]
    worker_threads: Option<usize>,
    /// Micro-batches each worker of the local route spreads its decoding sessions over, so the
    /// stages compute different ones at the same time
    #[arg(long, default_value_t = 2)]
    micro_batches: usize,
    /// Measure through these running workers instead of starting a local route (comma-separated,
    /// each host:port, [v6]:port, or dgr://, tcp://, http:// before either)
    #[arg(long, value_parser = |s: &str| dgr_proto::parse_addrs(s).map(|v| v.join(",")))]
    route: Option<String>,
    /// Repetitions (each measures every contender at every session count)
    #[arg(long, short = 'r', default_value_t = 3)]
    reps: usize,
    /// The llama-batched-bench binary [default: $DGR_REF_DIR/bin/llama-batched-bench]
    #[arg(long)]
    llama_batched_bench: Option<PathBuf>,
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
}

/// Aggregate decode tok/s of `b` sequences in one process: prompts prefilled, then
/// `gen` steps of one batched forward over all `b` sequences.
fn one_process(stage: &impl Engine, b: usize, p: usize, gen: usize) -> Result<f64> {
    let vocab = stage.config().vocab as u32;
    let mut kvs = (0..b).map(|_| stage.new_state(p + gen, stage.layers())).collect::<Result<Vec<_>, _>>()?;
    let mut next: Vec<u32> = Vec::new();
    for (i, kv) in kvs.iter_mut().enumerate() {
        let out = stage.forward(&mut [SeqInput { kv, input: Input::Tokens(&prompt(vocab, i, p)), logits: LogitRows::Last }])?;
        next.push(dgr_engine::argmax(&out[0].logits));
    }
    let t = Instant::now();
    for _ in 1..gen {
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let mut batch: Vec<SeqInput<_>> =
            kvs.iter_mut().zip(&toks).map(|(kv, t)| SeqInput { kv, input: Input::Tokens(t), logits: LogitRows::Last }).collect();
        let out = stage.forward(&mut batch)?;
        next = out.iter().map(|o| dgr_engine::argmax(&o.logits)).collect();
    }
    Ok((b * (gen - 1)) as f64 / t.elapsed().as_secs_f64())
}

/// `b` sessions' prompts of `p` token ids each, distinct per session.
pub(crate) fn token_prompts(vocab: u32, b: usize, p: usize) -> Vec<Vec<u32>> {
    (0..b).map(|i| prompt(vocab, i, p)).collect()
}

/// Aggregate decode tok/s of concurrent sessions, one a prompt, driven through `route`, in steady state:
/// the tokens produced while every session is decoding (from the last session's first token to
/// the first session's last), over that window — as llama-batched-bench times generation only
/// after every prompt is in.
pub(crate) fn routed(rt: &tokio::runtime::Runtime, route: &Route, prompts: Vec<Vec<u32>>, gen: usize) -> Result<f64> {
    let reqs: Vec<GenRequest> = prompts
        .into_iter()
        .map(|prompt_tokens| GenRequest {
            prompt_tokens,
            max_tokens: gen,
            sampling: Sampling { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 },
            top_logprobs: 0,
            seam_dtype: SeamDtype::F32,
            ticket: None,
            hash_rows: false,
            constraint: None,
            stop_tokens: Vec::new(),
        })
        .collect();
    let opts = DriveOptions { step_timeout: Duration::from_secs(60), ..DriveOptions::default() };
    let times: Vec<Vec<Instant>> = rt.block_on(async {
        let runs = reqs.iter().map(|r| async {
            let mut at = Vec::new();
            dgr_driver::generate(route, r, &opts, |_| {
                at.push(Instant::now());
                Flow::Continue
            })
            .await
            .map(|_| at)
        });
        futures_join(runs).await
    })?;
    let none = || BenchError::Measure("a session produced no tokens".into());
    let start = times.iter().filter_map(|t| t.first()).max().ok_or_else(none)?;
    let end = times.iter().filter_map(|t| t.last()).min().ok_or_else(none)?;
    let inside = times.iter().flatten().filter(|t| *t > start && *t <= end).count();
    if inside == 0 || end <= start {
        return Err(BenchError::Measure("the sessions never decoded at the same time; use more --gen-tokens".into()));
    }
    Ok(inside as f64 / end.duration_since(*start).as_secs_f64())
}

async fn futures_join<F, T, E>(runs: impl Iterator<Item = F>) -> std::result::Result<Vec<T>, E>
where
    F: std::future::Future<Output = std::result::Result<T, E>>,
{
    futures::future::join_all(runs).await.into_iter().collect()
}

pub fn run(a: Args) -> Result<()> {
    let bad = |s: &str| BenchError::Usage(format!("--sessions: {s:?} is not a count"));
    let sessions: Vec<usize> = a.sessions.split(',').map(|s| s.trim().parse().map_err(|_| bad(s))).collect::<Result<_>>()?;
    if sessions.is_empty() || sessions.contains(&0) || a.gen_tokens < 2 {
        return Err(BenchError::Usage("--sessions must list positive counts and --gen-tokens be at least 2".into()));
    }
    let model = a.model.path()?;
    let bin = peer::tool("llama-batched-bench", a.llama_batched_bench.as_deref())?;
    let g = a.model.open()?;
    let cfg = dgr_engine::ModelConfig::from_gguf(&g)?;
    let spec = a.numerics.spec(a.threads);
    let device = peer::PeerDevice::of(spec.backend);
    let stage = open_engine(g, 0..cfg.n_layers, spec)?;
    let swarm;
    let addrs = match &a.route {
        Some(r) => r.split(',').map(|s| s.trim().to_string()).collect(),
        None => {
            check_split(cfg.n_layers, a.split)?;
            let ranges = balanced_split(stage.gguf(), cfg.n_layers, a.split);
            let threads = a.worker_threads.unwrap_or(a.threads / a.split).max(1);
            swarm = LocalSwarm::start(
                &model,
                &ranges,
                threads,
                &[&a.numerics.worker_flags()?[..], &["--micro-batches".into(), a.micro_batches.to_string()]].concat(),
            )?;
            swarm.addrs.clone()
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting a runtime")?;
    let route = rt.block_on(Route::discover(&addrs, Duration::from_secs(5)))?;
    let ranges: Vec<String> = route.stages.iter().map(|s| format!("{}..{}", s.info.layer_start, s.info.layer_end)).collect();
    let vocab = cfg.vocab as u32;
    one_process(&stage, 1, a.prompt_tokens, 4)?; // warm-up
    routed(&rt, &route, token_prompts(vocab, 1, a.prompt_tokens), 4)?;
    let n = sessions.len();
    let (mut one, mut split, mut peer_s) = (vec![vec![]; n], vec![vec![]; n], vec![vec![]; n]);
    let mut version = String::new();
    for rep in 0..a.reps {
        for (i, &b) in sessions.iter().enumerate() {
            one[i].push(one_process(&stage, b, a.prompt_tokens, a.gen_tokens)?);
            split[i].push(routed(&rt, &route, token_prompts(vocab, b, a.prompt_tokens), a.gen_tokens)?);
        }
        let (l, v) = peer::llama_batched(&bin, &model, a.threads, &sessions, a.prompt_tokens, a.gen_tokens, &device)?;
        for (i, s) in l.into_iter().enumerate() {
            peer_s[i].push(s);
        }
        version = v;
        eprintln!("rep {rep} done");
    }
    let ratio = |x: &[f64], y: &[f64]| median(&x.iter().zip(y).map(|(a, b)| a / b).collect::<Vec<_>>());
    println!("aggregate decode tok/s, {}-token prompts, {} generated, {} threads per process", a.prompt_tokens, a.gen_tokens, a.threads);
    println!(
        "{:>3} {:>12} {:>14} {:>12} {:>14} {:>16} {:>12} {:>15}",
        "B", "dgr 1-proc", "dgr route", "llama.cpp", "1-proc/llama", "route/1-proc", "route/llama", "min–max"
    );
    let mut rows = Vec::new();
    for (i, &b) in sessions.iter().enumerate() {
        let (o, s, l) = (median(&one[i]), median(&split[i]), median(&peer_s[i]));
        let (r1, r2, r3) = (ratio(&one[i], &peer_s[i]), ratio(&split[i], &one[i]), ratio(&split[i], &peer_s[i]));
        let (lo, hi) = spread(&split[i].iter().zip(&peer_s[i]).map(|(a, b)| a / b).collect::<Vec<_>>());
        println!("{b:>3} {o:>12.1} {s:>14.1} {l:>12.1} {r1:>14.3} {r2:>16.3} {r3:>12.3} {:>15}", format!("{lo:.3}–{hi:.3}"));
        rows.push(json!({ "sessions": b, "dgr_one_process": o, "dgr_route": s, "llama": l, "one_process_vs_llama": r1,
                          "route_vs_one_process": r2, "route_vs_llama": r3 }));
    }
    let series = [("dgr one process", &one), (&*format!("dgr route {}", ranges.join(" + ")), &split), ("llama.cpp batched", &peer_s)];
    let svg_path = a.out.join("batch.svg");
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    std::fs::write(&svg_path, plot(&sessions, &series)?).with_context(|| format!("writing {}", svg_path.display()))?;
    let path = record::write(
        &a.out,
        "batch",
        &model,
        json!({
            "split": ranges,
            "peer": { "tool": "llama-batched-bench", "version": version, "offload": device.args() },
            "engine": stage.engine().to_string(),
            "adapter": a.numerics.adapter_json(),
            "threads": a.threads,
            "route_workers": if a.route.is_some() { json!("given by --route") } else {
                json!({ "threads": a.worker_threads.unwrap_or(a.threads / a.split).max(1), "micro_batches": a.micro_batches })
            },
            "prompt_tokens": a.prompt_tokens,
            "gen_tokens": a.gen_tokens,
            "samples": { "sessions": sessions, "dgr_one_process": one, "dgr_route": split, "llama_batched": peer_s },
            "table": rows,
            "plot": svg_path.display().to_string(),
        }),
    )?;
    println!("record: {}\nplot: {}", path.display(), svg_path.display());
    Ok(())
}

/// A line chart: aggregate tok/s (median) against session count, one line per series.
fn plot(xs: &[usize], series: &[(&str, &Vec<Vec<f64>>)]) -> Result<String> {
    let ymax = series.iter().flat_map(|(_, s)| s.iter().map(|v| median(v))).filter(|v| v.is_finite()).fold(1.0, f64::max) * 1.1;
    // The session counts sit evenly spaced, at their index, whatever their values.
    let label = |v: &f64| match xs.get(v.round() as usize) {
        Some(b) if (v - v.round()).abs() < 1e-6 => b.to_string(),
        _ => String::new(),
    };
    let last = xs.len().max(2) as f64 - 1.0;
    let chart = Chart {
        title: "aggregate decode throughput",
        x_desc: "concurrent sessions",
        y_desc: "aggregate decode tok/s",
        x: -0.1..last + 0.1,
        y: 0.0..ymax,
        x_ticks: xs.len(),
        x_label: &label,
        legend: SeriesLabelPosition::UpperLeft,
        lines: series.iter().map(|(name, s)| (*name, s.iter().enumerate().map(|(i, v)| (i as f64, median(v))).collect())).collect(),
    };
    plot::svg(&[chart], (640, 360))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plots_a_line_per_series_over_the_session_counts() {
        let (a, b) = (vec![vec![10.0, 12.0], vec![20.0], vec![35.0]], vec![vec![5.0], vec![9.0], vec![f64::NAN]]);
        let svg = plot(&[1, 2, 4], &[("one <process>", &a), ("route", &b)]).unwrap();
        let line =
            |color: &str| svg.lines().filter(|l| l.starts_with("<polyline") && l.contains(color)).map(str::to_string).collect::<Vec<_>>();
        // Each series: its line and its legend mark; the route's line skips its missing point.
        let (first, second) = (line("#1F77B4"), line("#D62728"));
        assert_eq!((first.len(), second.len()), (2, 2), "{svg}");
        assert_eq!((first[0].matches(',').count(), second[0].matches(',').count()), (3, 2), "{svg}");
        assert!(svg.contains("one &lt;process&gt;") && svg.contains("concurrent sessions"));
        for b in ["1", "2", "4"] {
            assert!(svg.contains(&format!("\n{b}\n</text>")), "tick {b}: {svg}");
        }
    }
}
