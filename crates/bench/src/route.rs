use super::{median, peer, record, spread};
use crate::error::{BenchError, Context, Result};
use crate::local::{self, Request};
use crate::model::{ModelArg, NumericsArg};
use crate::swarm::{check_split, even_split, LocalSwarm};
use dgr_driver::{DriveOptions, Flow, GenRequest, Route};
use dgr_engine::{open_engine, SamplingParams};
use dgr_proto::{Sampling, SeamDtype};
use serde_json::json;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArg,
    #[command(flatten)]
    numerics: NumericsArg,
    /// Compute threads of each process (each worker, the one process, each rpc-server)
    #[arg(long, short = 't', default_value_t = 2)]
    threads: usize,
    /// Tokens generated per repetition
    #[arg(long, default_value_t = 64)]
    gen_tokens: usize,
    /// Stages in the route
    #[arg(long, default_value_t = 2)]
    split: usize,
    /// Paired repetitions
    #[arg(long, short = 'r', default_value_t = 5)]
    reps: usize,
    /// The llama-bench binary [default: $DGR_REF_DIR/bin/llama-bench]
    #[arg(long)]
    llama_bench: Option<PathBuf>,
    /// The ggml-rpc-server binary [default: $DGR_REF_DIR/bin/ggml-rpc-server]
    #[arg(long)]
    rpc_server: Option<PathBuf>,
    /// Directory for the run's record
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
}

/// llama.cpp's RPC servers on loopback, killed on drop.
pub(crate) struct RpcServers {
    children: Vec<Child>,
    /// Where each listens.
    pub addrs: Vec<String>,
}

impl RpcServers {
    /// `n` ggml-rpc-servers of `threads` threads each, on free ports, each listening before this
    /// returns. (A fixed port may be held in TIME_WAIT by an earlier run's connections, and the
    /// server does not reuse it.)
    pub fn start(bin: &std::path::Path, n: usize, threads: usize) -> Result<RpcServers> {
        let mut s = RpcServers { children: Vec::new(), addrs: Vec::new() };
        for _ in 0..n {
            let p = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).context("finding a free port")?.port();
            let c = Command::new(bin)
                .args(["-p", &p.to_string(), "-t", &threads.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("starting ggml-rpc-server")?;
            s.children.push(c);
            wait_listening(p)?;
            s.addrs.push(format!("127.0.0.1:{p}"));
        }
        Ok(s)
    }
}

impl Drop for RpcServers {
    fn drop(&mut self) {
        for c in self.children.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn run(a: Args) -> Result<()> {
    let model = a.model.path()?;
    let bench = peer::tool("llama-bench", a.llama_bench.as_deref())?;
    let rpc = peer::tool("ggml-rpc-server", a.rpc_server.as_deref())?;
    let g = a.model.open()?;
    let n_layers = dgr_engine::ModelConfig::from_gguf(&g)?.n_layers;
    let stage = open_engine(g, 0..n_layers, a.numerics.spec(a.threads))?;
    check_split(n_layers, a.split)?;
    let swarm = LocalSwarm::start(&model, &even_split(n_layers, a.split), a.threads, &a.numerics.worker_flags()?)?;
    let servers = RpcServers::start(&rpc, a.split, a.threads)?;
    let on_rpc = peer::PeerDevice::Rpc(servers.addrs.join(","));

    // The same shape for every contender: one token in, `gen_tokens` out, greedy, EOS ignored.
    let req = Request {
        prompt_tokens: vec![1],
        max_tokens: a.gen_tokens,
        sampling: SamplingParams::default(),
        top_logprobs: 0,
        ignore_eos: true,
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting a runtime")?;
    let route = rt.block_on(Route::discover(&swarm.addrs, std::time::Duration::from_secs(5)))?;
    let greq = GenRequest {
        prompt_tokens: req.prompt_tokens.clone(),
        max_tokens: req.max_tokens,
        sampling: Sampling { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 },
        top_logprobs: 0,
        seam_dtype: SeamDtype::F32,
        ticket: None,
        hash_rows: false,
        constraint: None,
        stop_tokens: Vec::new(),
    };
    let routed = || rt.block_on(dgr_driver::generate(&route, &greq, &DriveOptions::default(), |_| Flow::Continue));
    local::generate(&stage, |_| false, &req, |_| {})?; // warm-up
    routed()?;
    let (mut one, mut split, mut llama) = (vec![], vec![], vec![]);
    let mut seam_p50: Vec<Vec<f64>> = vec![Vec::new(); a.split - 1];
    let mut seam_p99: Vec<Vec<f64>> = vec![Vec::new(); a.split - 1];
    let mut version = String::new();
    for rep in 0..a.reps {
        let o = local::generate(&stage, |_| false, &req, |_| {})?.timings.decode_tok_per_s;
        let r = routed()?;
        for s in &r.seams {
            seam_p50[s.from as usize].push(s.latency_ms_p50);
            seam_p99[s.from as usize].push(s.latency_ms_p99);
        }
        let l = peer::llama_bench(&bench, &model, a.threads, 0, a.gen_tokens, &on_rpc)?;
        eprintln!(
            "rep {rep}: dgr one process {o:.1}, dgr {}-stage route {:.1}, llama.cpp RPC {:.1} tok/s",
            a.split, r.timings.decode_tok_per_s, l.gen_tok_s
        );
        one.push(o);
        split.push(r.timings.decode_tok_per_s);
        llama.push(l.gen_tok_s);
        version = l.version;
    }
    drop(servers);
    let ratios = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x / y).collect::<Vec<_>>();
    let (vs_one, vs_llama) = (median(&ratios(&split, &one)), median(&ratios(&split, &llama)));
    let ((one_lo, one_hi), (llama_lo, llama_hi)) = (spread(&ratios(&split, &one)), spread(&ratios(&split, &llama)));
    let ranges: Vec<String> = even_split(n_layers, a.split).iter().map(|r| format!("{}..{}", r.start, r.end)).collect();
    println!("decode tg{}, threads {} per process, route {}", a.gen_tokens, a.threads, ranges.join(" + "));
    println!("{:<34} {:>10}", "contender", "tok/s");
    println!("{:<34} {:>10.1}", "dgr one process", median(&one));
    println!("{:<34} {:>10.1}", format!("dgr {}-process route", a.split), median(&split));
    println!("{:<34} {:>10.1}", format!("llama.cpp RPC, {} rpc-servers", a.split), median(&llama));
    println!(
        "route / one process: {vs_one:.3} (min–max {one_lo:.3}–{one_hi:.3})   route / llama.cpp RPC: {vs_llama:.3} (min–max {llama_lo:.3}–{llama_hi:.3})"
    );
    for (i, (p50, p99)) in seam_p50.iter().zip(&seam_p99).enumerate() {
        println!("seam {i}->{}: latency p50 {:.3} ms, p99 {:.3} ms (medians over reps)", i + 1, median(p50), median(p99));
    }
    let path = record::write(
        &a.out,
        "route",
        &model,
        json!({
            "split": ranges,
            "peer": { "tool": format!("llama-bench --rpc with {} ggml-rpc-server processes", a.split), "version": version },
            "threads": a.threads,
            "samples": { "dgr_one_process_decode_tok_s": one, "dgr_route_decode_tok_s": split, "llama_rpc_decode_tok_s": llama,
                         "seam_latency_ms_p50": seam_p50, "seam_latency_ms_p99": seam_p99 },
            "ratios": { "route_vs_one_process": vs_one, "route_vs_llama_rpc": vs_llama },
        }),
    )?;
    println!("record: {}", path.display());
    Ok(())
}

/// Waits until a ggml-rpc-server accepts connections on `port`, for at most 10 s.
fn wait_listening(port: u16) -> Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    while std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_millis(200)).is_err() {
        if std::time::Instant::now() > deadline {
            return Err(BenchError::Peer(format!("ggml-rpc-server is not listening on {addr} after 10 s")));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Ok(())
}
