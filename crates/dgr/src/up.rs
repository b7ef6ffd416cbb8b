//! `dgr up`: one command to a running local swarm — a tracker, R replicas of an N-worker route
//! and the OpenAI gateway, all on loopback, until Ctrl-C stops everything.

use crate::gateway::{register_keys, scheme, KeysArgs, LimitArgs, TlsArgs};
use anyhow::{bail, Context, Result};
use dgr_bench::swarm::{balanced_split, LocalSwarm, LocalTracker};
use dgr_gateway::Gateway;
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
    /// Each worker's prefix cache in MiB (0: off) [default: the worker's, a quarter of its KV budget]
    #[arg(long)]
    prefix_cache_mb: Option<usize>,
}

pub fn run(a: Args) -> Result<()> {
    if a.workers == 0 || a.replicas == 0 {
        bail!("--workers and --replicas must be at least 1");
    }
    let numerics = a.numerics.worker_flags()?;
    let tls = a.tls.load()?;
    let model = match &a.model {
        Some(m) => m.clone(),
        None => crate::fetch::default_model()?,
    };
    let g = dgr_hf::open_any(&model).with_context(|| format!("opening {}", model.display()))?;
    let n_layers = dgr_engine::ModelConfig::from_gguf(&g)?.n_layers;
    dgr_bench::swarm::check_split(n_layers, a.workers)?;
    let ranges = balanced_split(&g, n_layers, a.workers);
    drop(g);
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    // The host's cores divided among the workers; the stages of a route then compute different
    // micro-batches at once (one per stage), as `dgr bench batch` measures best.
    let threads = (cores / (a.workers * a.replicas)).max(1);
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
    flags.extend(numerics);
    flags.extend(["--micro-batches".to_string(), micro_batches.to_string()]);
    if let Some(mb) = a.prefix_cache_mb {
        flags.extend(["--prefix-cache-mb".to_string(), mb.to_string()]);
    }
    if a.plaintext.insecure_plaintext {
        flags.push("--insecure-plaintext".into());
    }
    let mut swarms = Vec::new();
    for r in 0..a.replicas {
        let desc: Vec<String> = ranges.iter().map(|x| format!("{}..{}", x.start, x.end)).collect();
        eprint!(
            "dgr up: replica {}/{}: {} worker(s), layers {}, {threads} thread(s) each … ",
            r + 1,
            a.replicas,
            a.workers,
            desc.join(" + ")
        );
        let t0 = Instant::now();
        swarms.push(LocalSwarm::start(&model, &ranges, threads, &flags)?);
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
        eprintln!("    {}", add_worker_command(&tracker, &model, n_layers));
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

/// The command that adds a whole replica of the model (every layer) on another host to this
/// swarm; any layer range would do, the tracker composes routes from whatever joins.
fn add_worker_command(tracker: &LocalTracker, model: &std::path::Path, n_layers: usize) -> String {
    let port = tracker.addr.rsplit_once(':').map_or("7400", |(_, p)| p);
    let addr = if tracker.addr.starts_with("0.0.0.0:") || tracker.addr.starts_with("[::]:") {
        format!("THIS_HOST:{port}")
    } else {
        tracker.addr.clone()
    };
    format!(
        "dgr worker --tracker {addr} --tracker-key {} --join-token-file {} --model {} --layers 0..{n_layers} --listen 0.0.0.0:7401 --advertise THAT_HOST:7401",
        tracker.link_key,
        tracker.token_file.display(),
        model.display()
    )
}
