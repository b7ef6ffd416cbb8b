//! `dgr up`: one command to a running local swarm — a tracker, R replicas of an N-worker route
//! and the OpenAI gateway, all on loopback, until Ctrl-C stops everything.

use crate::gateway::{register_keys, scheme, KeysArgs, LimitArgs, TlsArgs};
use anyhow::{bail, Context, Result};
use dgr_bench::swarm::{balanced_split, LocalSwarm, LocalTracker};
use dgr_bench::NumericsArg;
use dgr_engine::Device;
use dgr_gateway::Gateway;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model, or a Transformers checkpoint directory [default: the SmolLM2-135M-Instruct Q4_1 default model, fetched if missing]
    #[arg(long, short = 'm', env = "DGR_MODEL")]
    model: Option<PathBuf>,
    /// Workers per route (stages), layer ranges balanced by compute with the head counted
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Replicas of the route (each a full set of workers)
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// Address the gateway serves the API on (host:port, [v6]:port, or dgr://, tcp://, http://
    /// before either); HTTPS with --tls-cert and --tls-key, plain HTTP without
    #[arg(long, default_value = "127.0.0.1:8000", value_parser = crate::addr::one)]
    listen: String,
    /// Address the swarm's tracker serves on (host:port, [v6]:port, or dgr://, tcp://, http://
    /// before either); a worker on another host joins through it, so give a reachable one
    /// (e.g. 0.0.0.0:7400) to grow the swarm beyond this host
    #[arg(long, default_value = "127.0.0.1:0", value_parser = crate::addr::one)]
    tracker_listen: String,
    #[command(flatten)]
    numerics: dgr_bench::NumericsArg,
    #[command(flatten)]
    tls: TlsArgs,
    #[command(flatten)]
    keys: KeysArgs,
    #[command(flatten)]
    limits: LimitArgs,
    #[command(flatten)]
    plaintext: crate::links::PlaintextArg,
    /// Most MiB of the GPU's memory the swarm may use (with --device gpu, or auto on a GPU): the
    /// last layers that fit there (their weights in three quarters of it, the rest for the KV
    /// cache) run on the GPU and the others on the CPU [default: what the GPU has free]
    #[arg(long)]
    gpu_memory_mb: Option<u64>,
    /// Each worker's prefix cache in MiB (0: off) [default: the worker's, a quarter of its KV budget]
    #[arg(long)]
    prefix_cache_mb: Option<usize>,
}

pub fn run(a: Args) -> Result<()> {
    if a.workers == 0 || a.replicas == 0 {
        bail!("--workers and --replicas must be at least 1");
    }
    let tls = a.tls.load()?;
    let model = match &a.model {
        Some(m) => m.clone(),
        None => crate::fetch::default_model()?,
    };
    let g = Arc::new(dgr_hf::open_any(&model).with_context(|| format!("opening {}", model.display()))?);
    let n_layers = dgr_engine::ModelConfig::from_gguf(&g)?.n_layers;
    dgr_bench::swarm::check_split(n_layers, a.workers)?;
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    // The host's cores divided among the workers; the stages of a route then compute different
    // micro-batches at once (one per stage), as `dgr bench batch` measures best.
    let threads = (cores / (a.workers * a.replicas)).max(1);
    let parts = place(&Model { path: &model, g: &g, n_layers }, a.workers, threads, a.numerics, a.gpu_memory_mb)?;
    drop(g);
    let micro_batches = a.workers.max(1);
    let started = Instant::now();
    eprint!("dgr up: tracker … ");
    a.plaintext.apply("up");
    let tracker_flags: &[&str] =
        if a.plaintext.insecure_plaintext { &["--heartbeat-ms", "1000", "--insecure-plaintext"] } else { &["--heartbeat-ms", "1000"] };
    let tracker = LocalTracker::start_in(&crate::state::state_dir().join("up"), &a.tracker_listen, tracker_flags)?;
    eprintln!("{}", tracker.addr);
    // The gateway runs in this process: its tracker links accept this tracker's key alone.
    dgr_proto::pin_tracker_keys(vec![dgr_proto::parse_tracker_key(&tracker.link_key).map_err(anyhow::Error::msg)?]);
    let mut flags = tracker.join_flags();
    flags.extend(["--micro-batches".to_string(), micro_batches.to_string()]);
    if let Some(mb) = a.prefix_cache_mb {
        flags.extend(["--prefix-cache-mb".to_string(), mb.to_string()]);
    }
    if a.plaintext.insecure_plaintext {
        flags.push("--insecure-plaintext".into());
    }
    let mut swarms = Vec::new();
    let workers: usize = parts.iter().map(|p| p.ranges.len()).sum();
    let desc: Vec<String> = parts.iter().flat_map(|p| p.ranges.iter().map(|x| format!("{}..{} ({})", x.start, x.end, p.on))).collect();
    for r in 0..a.replicas {
        eprint!("dgr up: replica {}/{}: {workers} worker(s), layers {}, {threads} thread(s) each … ", r + 1, a.replicas, desc.join(" + "));
        let t0 = Instant::now();
        for p in &parts {
            swarms.push(LocalSwarm::start(&model, &p.ranges, threads, &[&flags[..], &p.flags].concat())?);
        }
        eprintln!("ready ({:.1} s)", t0.elapsed().as_secs_f64());
    }
    let mut cfg = a.limits.config(tracker.addr.clone(), vec![model.clone()])?;
    cfg.join_token = Some(crate::state::read_secret(&tracker.token_file)?);
    let gw = Arc::new(Gateway::open(cfg)?);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let result = rt.block_on(async {
        let shutdown = crate::worker::shutdown_signal()?;
        // Keys are registered with this swarm's own tracker, with its join token.
        let keys =
            KeysArgs { join_token_file: Some(a.keys.join_token_file.clone().unwrap_or(tracker.token_file.clone())), ..a.keys.clone() };
        register_keys(&gw, &keys).await?;
        // Serve once the swarm covers the model: every worker has joined.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let swarm = gw.swarm().await;
            if swarm.as_ref().is_some_and(|s| Gateway::covered(s, &gw.models[0].model_id)) {
                break;
            }
            if Instant::now() > deadline {
                bail!("the workers did not join the tracker within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let listener = tokio::net::TcpListener::bind(&a.listen).await.with_context(|| format!("binding {}", a.listen))?;
        let addr = listener.local_addr()?;
        let name = gw.models[0].name.clone();
        let url = format!("{}://{addr}", scheme(&tls));
        println!("{}", serde_json::json!({ "base_url": format!("{url}/v1"), "model": name, "tracker": tracker.addr }));
        eprintln!("dgr up: ready in {:.1} s", started.elapsed().as_secs_f64());
        eprintln!("  OpenAI API:  {url}/v1   (model \"{name}\")");
        eprintln!("  dashboard:   {url}/");
        let auth = if a.keys.api_keys.is_some() { " -H 'Authorization: Bearer YOUR_KEY'" } else { "" };
        eprintln!(
            "  try:         curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \
             -d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], \"max_tokens\": 32}}'"
        );
        eprintln!("  join token:  {}", tracker.token_file.display());
        eprintln!("  tracker key: {} (clients and workers pin it with --tracker-key)", tracker.link_key);
        eprintln!("  add a worker from another host (copy the join token file and the model there first):");
        eprintln!("    {}", add_worker_command(&tracker, &model));
        if tracker.addr.starts_with("127.") || tracker.addr.starts_with("[::1]") || tracker.addr.starts_with("localhost:") {
            eprintln!(
                "    (the tracker listens on loopback only: restart with --tracker-listen 0.0.0.0:7400 to take workers from other hosts)"
            );
        }
        eprintln!("  Ctrl-C stops everything.");
        dgr_gateway::serve(gw.clone(), listener, tls, shutdown).await?;
        Ok(())
    });
    eprintln!("dgr up: stopping");
    drop(swarms);
    drop(tracker);
    result
}

/// Workers of one device: their layer ranges and the flags that put them there.
struct Part {
    ranges: Vec<Range<usize>>,
    flags: Vec<String>,
    on: &'static str,
}

/// The model `dgr up` places.
struct Model<'a> {
    path: &'a std::path::Path,
    g: &'a Arc<dgr_gguf::Gguf>,
    n_layers: usize,
}

/// Where a route's layers run: all on the device `numerics` names, balanced by compute over
/// `workers` workers; or, on a GPU whose memory (as it reports it, or `gpu_memory_mb`) cannot
/// hold them all, some of the last layers that fit (the head with them: it is the largest matrix
/// in a small model) on one GPU worker and the others over the rest of the workers on the CPU,
/// `threads` each. How many of those layers the GPU takes is what keeps the route's slowest
/// stage fastest, by the decode step each device is measured to take per layer (`gpu_share`).
/// Each GPU worker may hold its weights' share of that memory (`--gpu-memory-mb`), so workers
/// that share a GPU share its room for KV fairly.
fn place(m: &Model, workers: usize, threads: usize, numerics: NumericsArg, gpu_memory_mb: Option<u64>) -> Result<Vec<Part>> {
    let (g, n_layers) = (m.g, m.n_layers);
    let flags = numerics.worker_flags()?.to_vec();
    let balanced = || balanced_split(g, n_layers, workers);
    let Device::Gpu(index) = numerics.device() else { return Ok(vec![Part { ranges: balanced(), flags, on: "CPU" }]) };
    // Where the GPU does not say, every layer goes there: its workers refuse at start what does not fit.
    let Some(room) = dgr_bench::gpu_room(index, gpu_memory_mb) else {
        return Ok(vec![Part { ranges: balanced(), flags, on: "GPU" }]);
    };
    let (bytes, head) = g.per_layer(n_layers, |t| t.n_bytes);
    let weights = |r: &Range<usize>| bytes[r.clone()].iter().sum::<u64>() + if r.end == n_layers { head } else { 0 };
    let on_gpu = |ranges: &[Range<usize>]| {
        let total = ranges.iter().map(weights).sum::<u64>().max(1);
        let share = |r: &Range<usize>| (u128::from(room) * u128::from(weights(r)) / u128::from(total)) as u64 >> 20;
        let part = |r: Range<usize>| {
            let cap = ["--gpu-memory-mb".to_string(), share(&r).max(1).to_string()];
            Part { flags: [&flags[..], &cap].concat(), ranges: vec![r], on: "GPU" }
        };
        ranges.iter().cloned().map(part).collect::<Vec<Part>>()
    };
    let fit = gpu_layers(&bytes, head, room);
    if fit == n_layers {
        return Ok(on_gpu(&balanced()));
    }
    let cpu_numerics = NumericsArg { device: Device::Cpu, ..numerics };
    let cpu = cpu_numerics.worker_flags()?.to_vec();
    let mib = |b: u64| b >> 20;
    let needed = weights(&(0..n_layers));
    if fit == 0 || workers < 2 {
        let why = if fit == 0 { "not even the head fits" } else { "--workers 1 cannot split it between the GPU and the CPU" };
        eprintln!(
            "dgr up: the model's weights take {} MiB and the GPU has {} MiB for them: {why}; running on the CPU",
            mib(needed),
            mib(room)
        );
        return Ok(vec![Part { ranges: balanced(), flags: cpu, on: "CPU" }]);
    }
    let (cost, head_cost) = g.per_layer(n_layers, dgr_gguf::TensorInfo::n_elements);
    let head_layers = head_cost as f64 * n_layers as f64 / cost.iter().sum::<u64>().max(1) as f64;
    let measured = dgr_bench::probe::step_us_per_layer(g, n_layers, cpu_numerics.spec(threads))
        .and_then(|c| Ok((c, dgr_bench::probe::gpu_step_us_per_layer(m.path, index)?)));
    let on = match measured {
        Ok((c, gpu)) => {
            let k = gpu_share(Share { n_layers, fit, cpu_workers: workers - 1, head_layers, cpu_us: c, gpu_us: gpu });
            eprintln!("dgr up: a decode step takes {c:.0} µs a layer on the CPU ({threads} thread(s)) and {gpu:.0} µs on the GPU");
            k
        }
        Err(e) => {
            eprintln!("dgr up: could not time the devices ({e}); the GPU takes every layer that fits");
            fit
        }
    };
    let cut = n_layers - on;
    eprintln!(
        "dgr up: the model's weights take {} MiB and the GPU has {} MiB (room for {fit} layers): layers {cut}..{n_layers} on the GPU, the rest on the CPU",
        mib(needed),
        mib(room)
    );
    let mut parts = vec![Part { ranges: dgr_bench::swarm::balance(&cost[..cut], 0, (workers - 1).min(cut)), flags: cpu, on: "CPU" }];
    parts.extend(on_gpu(std::slice::from_ref(&(cut..n_layers))));
    Ok(parts)
}

/// A split between the CPU and one GPU: how many layers the GPU has room for, the CPU workers
/// that share the rest, the head's compute in layers, and each device's measured decode step
/// per layer.
struct Share {
    n_layers: usize,
    fit: usize,
    cpu_workers: usize,
    head_layers: f64,
    cpu_us: f64,
    gpu_us: f64,
}

/// How many of the last layers (1 to `fit`, with the head) the GPU takes: where the slowest
/// stage's step (the GPU's, or a CPU worker's even share of the rest) is shortest, the most
/// layers of those, as the GPU frees the CPU.
fn gpu_share(s: Share) -> usize {
    let slowest = |k: usize| {
        let rest = s.n_layers - k;
        let cpu = if rest == 0 { 0.0 } else { s.cpu_us * rest as f64 / s.cpu_workers.clamp(1, rest) as f64 };
        cpu.max(s.gpu_us * (k as f64 + s.head_layers))
    };
    (1..=s.fit.min(s.n_layers)).rev().min_by(|&a, &b| slowest(a).total_cmp(&slowest(b))).unwrap_or(1)
}

/// How many of the last layers fit, with the head, in `room` bytes of GPU memory, their weights
/// (`bytes` a layer) taking at most `dgr_worker::WEIGHT_SHARE` of it.
fn gpu_layers(bytes: &[u64], head: u64, room: u64) -> usize {
    let limit = (room as f64 * dgr_worker::WEIGHT_SHARE) as u64;
    let mut used = head;
    if used > limit {
        return 0;
    }
    bytes
        .iter()
        .rev()
        .take_while(|&&b| {
            used += b;
            used <= limit
        })
        .count()
}

/// The command that adds a worker on another host to this swarm: the tracker assigns it as many
/// layers as fit there, where they add most (any range would do: routes compose from whatever
/// joins).
fn add_worker_command(tracker: &LocalTracker, model: &std::path::Path) -> String {
    let port = tracker.addr.rsplit_once(':').map_or("7400", |(_, p)| p);
    let addr = if tracker.addr.starts_with("0.0.0.0:") || tracker.addr.starts_with("[::]:") {
        format!("THIS_HOST:{port}")
    } else {
        tracker.addr.clone()
    };
    format!(
        "dgr worker --tracker {addr} --tracker-key {} --join-token-file {} --model {} --listen 0.0.0.0:7401 --advertise THAT_HOST:7401",
        tracker.link_key,
        tracker.token_file.display(),
        model.display()
    )
}

#[cfg(test)]
mod tests {
    use super::{gpu_layers, gpu_share, Share};

    #[test]
    fn the_gpu_takes_the_last_layers_that_fit_with_the_head() {
        // Three quarters of 100 bytes hold the head (30) and three layers of 15.
        assert_eq!(gpu_layers(&[15; 6], 30, 100), 3);
        assert_eq!(gpu_layers(&[15; 6], 30, 1000), 6);
        assert_eq!(gpu_layers(&[15; 6], 80, 100), 0, "no room for the head");
        assert_eq!(gpu_layers(&[40, 10, 10], 0, 40), 2, "from the last layer back, stopping at the first that does not fit");
    }

    #[test]
    fn the_gpu_takes_as_many_layers_as_keep_the_slowest_stage_fastest() {
        let share = |fit, cpu_us, gpu_us| gpu_share(Share { n_layers: 30, fit, cpu_workers: 1, head_layers: 2.0, cpu_us, gpu_us });
        assert_eq!(share(20, 100.0, 10.0), 20, "a fast GPU takes all it has room for");
        // Equal speeds: 16 layers on the CPU against 14 and the head on the GPU.
        assert_eq!(share(20, 100.0, 100.0), 14);
        // A GPU three times slower: 6 layers and the head (2400 µs) against 24 on the CPU (2400).
        assert_eq!(share(20, 100.0, 300.0), 6);
        assert_eq!(share(20, 100.0, 1000.0), 1, "at least one layer, as the GPU was asked for");
        // Two CPU workers share the rest: the GPU's stage matches one CPU worker's half.
        let two = gpu_share(Share { n_layers: 30, fit: 29, cpu_workers: 2, head_layers: 0.0, cpu_us: 100.0, gpu_us: 100.0 });
        assert_eq!(two, 10);
    }
}
