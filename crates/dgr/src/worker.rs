use crate::model::{ModelArg, NumericsArg, ThreadsArg};
use anyhow::{bail, Context, Result};
use dgr_engine::KvDtype;
use dgr_worker::{Worker, WorkerConfig};
use std::time::Duration;

/// `--kv-tokens` without the flag, in f32 KV; other KV dtypes hold as many as fit in its memory.
const DEFAULT_KV_TOKENS: usize = 1 << 16;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArg,
    #[command(flatten)]
    threads: ThreadsArg,
    #[command(flatten)]
    numerics: NumericsArg,
    #[command(flatten)]
    plaintext: crate::links::PlaintextArg,
    #[command(flatten)]
    tracker_key: crate::links::TrackerKeyArg,
    #[command(flatten)]
    peer_key: crate::links::PeerKeyArg,
    /// The layer range to serve, A..B (layers A to B-1; the first stage starts at 0, the last ends at the model's layer count)
    /// [default with --tracker: as many layers as fit in the device's memory, where a tracker
    /// says they add most to the swarm]
    #[arg(long)]
    layers: Option<String>,
    /// Without --layers: take at most this many layers [default: as many as fit]
    #[arg(long, conflicts_with = "layers", value_parser = clap::value_parser!(u32).range(1..))]
    max_layers: Option<u32>,
    /// Address to serve the stage protocol (and GET /metrics) on (host:port, [v6]:port, or dgr://, tcp://, http:// before either); port 0 picks a free port
    #[arg(long, default_value = "127.0.0.1:0", value_parser = crate::addr::one)]
    listen: String,
    /// Most sessions open at once
    #[arg(long, default_value_t = 64)]
    max_sessions: usize,
    /// KV positions held across all sessions (each session reserves prompt + max tokens)
    /// [default: the memory 65536 positions take in f32 KV: 65536 in f32, 131072 in f16,
    /// 246723 in q8_0]
    #[arg(long)]
    kv_tokens: Option<usize>,
    /// Most MiB of the GPU's memory this stage may hold (weights, KV cache and each step's
    /// scratch), for a GPU shared with other programs: a stage whose weights take more is
    /// refused at start, and the default KV budget shrinks to fit [default: what the GPU has free]
    #[arg(long)]
    gpu_memory_mb: Option<u64>,
    /// MiB of KV blocks the prefix cache keeps for later prompts that start alike (0: off)
    /// [default: a quarter of the bytes --kv-tokens positions take on this stage: sessions
    /// reserve their whole context but touch only what they use, so this rarely meets their
    /// memory, and it still holds a long system prompt many times over]
    #[arg(long)]
    prefix_cache_mb: Option<usize>,
    /// Seconds without traffic after which a session is freed
    #[arg(long, default_value_t = 120.0)]
    idle_timeout: f64,
    /// Seconds open sessions get to finish after SIGTERM before they are cancelled
    #[arg(long, default_value_t = 10.0)]
    drain_timeout: f64,
    /// Most connections served at once (drivers, previous stages, /metrics); past it a new
    /// connection is closed at once
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Seconds a connection that holds no session may stay silent before it is closed (a
    /// driver's warm connection with sessions on it is kept however quiet)
    #[arg(long, default_value_t = 300.0)]
    conn_idle_timeout: f64,
    /// Seconds a new connection has to say Hello (or send its HTTP request)
    #[arg(long, default_value_t = 10.0, hide = true)]
    handshake_timeout: f64,
    /// Most rows computed in one scheduler step (the token budget)
    #[arg(long, default_value_t = 8192)]
    step_tokens: usize,
    /// Largest prompt chunk in a step when no session is decoding (prompts waiting together
    /// share it, oldest first; the others run --busy-chunk rows)
    #[arg(long, default_value_t = 512)]
    prefill_chunk: usize,
    /// Milliseconds of compute a prompt chunk aims at: a long prompt's chunks shrink as its
    /// attention grows, so its progress reaches the driver at least about this often
    #[arg(long, default_value_t = 1000.0)]
    chunk_ms: f64,
    /// Largest prompt chunk in a step that also decodes (bounds the added inter-token latency)...
    #[arg(long, default_value_t = 4)]
    busy_chunk: usize,
    /// ...except that a prompt of at most this many tokens runs whole, for a fast first token
    #[arg(long, default_value_t = 256)]
    whole_prompt: usize,
    /// Spread decoding sessions over this many consecutive steps, so that the stages of a
    /// route compute different micro-batches at the same time
    #[arg(long, default_value_t = 1)]
    micro_batches: usize,
    /// Milliseconds a step may wait for more decoding sessions to arrive and join its batch
    #[arg(long, default_value_t = 2.0)]
    batch_wait_ms: f64,
    /// Join these trackers (each (host:port, [v6]:port, or dgr://, tcp://, http:// before either); comma-separated: the trackers of one swarm):
    /// register and heartbeat with each, report usage, and serve only sessions with a route
    /// ticket signed by their key set. Without it the worker runs ticketless, for local use.
    #[arg(long, env = "DGR_TRACKER", value_delimiter = ',', value_parser = crate::addr::one)]
    tracker: Vec<String>,
    /// Seconds to keep trying to join before giving up with a non-zero exit, when no tracker
    /// has been joined yet (each failed attempt is logged with its reason)
    #[arg(long, default_value_t = 60.0, requires = "tracker")]
    join_timeout: f64,
    /// File holding the tracker's join token (needed with --tracker)
    #[arg(long, requires = "tracker")]
    join_token_file: Option<std::path::PathBuf>,
    /// The address routes should dial this worker on [default: the bound --listen address]
    #[arg(long, requires = "tracker", conflicts_with = "relay", value_parser = crate::addr::one)]
    advertise: Option<String>,
    /// Open no listening port: keep a connection to the tracker and take sessions through its relay
    #[arg(long, requires = "tracker")]
    relay: bool,
    /// This worker's identity key (32 bytes; created if missing), the key it proves on its links:
    /// a restart with the same file is the same worker to the tracker, and to drivers that
    /// learned or pinned its key on a ticketless route [default: a new identity each start]
    #[arg(long)]
    key_file: Option<std::path::PathBuf>,
    /// Serve this model (its identity, as `dgr inspect` or `dgr swarm` shows it). Without --model,
    /// the slice for --layers (or for the range a tracker assigns) is fetched from the swarm's
    /// workers that hold it (every tensor checked against the identity; an interrupted fetch
    /// resumes) and kept in --slice-dir
    #[arg(long, requires = "tracker")]
    model_id: Option<String>,
    /// Where fetched slices are kept [default: $DGR_MODEL_DIR/slices]
    #[arg(long)]
    slice_dir: Option<std::path::PathBuf>,
}

/// Parses "A..B".
pub fn parse_layers(s: &str) -> Result<std::ops::Range<usize>> {
    let (a, b) = s.split_once("..").with_context(|| format!("--layers {s:?} is not A..B"))?;
    let (a, b): (usize, usize) = (a.trim().parse().context("--layers start")?, b.trim().parse().context("--layers end")?);
    if a >= b {
        bail!("--layers {a}..{b} is empty");
    }
    Ok(a..b)
}

fn secs(v: f64, name: &str) -> Result<Duration> {
    Duration::try_from_secs_f64(v).map_err(|_| anyhow::anyhow!("--{name} must be a non-negative number of seconds"))
}

fn positive(v: f64, name: &str) -> Result<Duration> {
    let d = secs(v, name)?;
    if d.is_zero() {
        bail!("--{name} must be more than 0 seconds");
    }
    Ok(d)
}

pub fn run(a: Args) -> Result<()> {
    a.plaintext.apply("worker");
    a.tracker_key.apply();
    a.peer_key.apply();
    let identity = match (&a.key_file, a.tracker.is_empty()) {
        (Some(f), _) => Some(dgr_worker::load_or_create_identity(f).with_context(|| format!("identity key {}", f.display()))?),
        (None, false) => Some(dgr_proto::new_signing_key().map_err(|e| anyhow::anyhow!("randomness: {e}"))?),
        (None, true) => None,
    };
    // The key the trackers admit is the one this worker proves on every stage link (a slice
    // fetch's too), so drivers and previous stages can hold it to the ticket's worker id.
    // Ticketless, without a key file, it proves the process's random one.
    if let Some(key) = &identity {
        if !dgr_proto::set_identity(key)? {
            bail!("the link identity was set before the worker's own");
        }
    }
    let layers = match &a.layers {
        Some(l) => parse_layers(l)?,
        None => placed_layers(&a)?,
    };
    let model = match (&a.model.model, &a.model_id) {
        (None, Some(id)) => fetch_slice(&a, id, &layers)?,
        _ => a.model.path()?,
    };
    let mut cfg = WorkerConfig::new(model, layers);
    cfg.threads = a.threads.get();
    cfg.device = a.numerics.device();
    cfg.numerics = a.numerics.numerics();
    cfg.kv_dtype = a.numerics.kv_dtype;
    cfg.max_sessions = a.max_sessions.max(1);
    cfg.kv_budget_tokens = a.kv_tokens.unwrap_or_else(|| a.numerics.kv_dtype.positions_in(DEFAULT_KV_TOKENS, KvDtype::F32)).max(1);
    cfg.kv_budget_default = a.kv_tokens.is_none();
    cfg.gpu_memory_cap = a.gpu_memory_mb.map(|mb| mb.saturating_mul(1 << 20));
    cfg.prefix_cache_bytes = a.prefix_cache_mb.map(|mb| mb << 20);
    cfg.idle_timeout = secs(a.idle_timeout, "idle-timeout")?;
    cfg.drain_timeout = secs(a.drain_timeout, "drain-timeout")?;
    cfg.max_connections = a.max_connections.max(1);
    cfg.conn_idle_timeout = positive(a.conn_idle_timeout, "conn-idle-timeout")?;
    cfg.handshake_timeout = positive(a.handshake_timeout, "handshake-timeout")?;
    cfg.policy = dgr_worker::Policy {
        step_tokens: a.step_tokens.max(1),
        prefill_chunk: a.prefill_chunk.max(1),
        chunk_time: positive(a.chunk_ms / 1e3, "chunk-ms")?,
        busy_chunk: a.busy_chunk.max(1),
        whole_prompt: a.whole_prompt,
        micro_batches: a.micro_batches.max(1),
        batch_wait: secs(a.batch_wait_ms / 1e3, "batch-wait-ms")?,
    };
    let layers = cfg.layers.clone();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    rt.block_on(async move {
        // Handlers first: a SIGTERM that arrives right after the ready line must drain, not kill.
        let shutdown = shutdown_signal()?;
        let bound = if a.relay { None } else { Some(dgr_worker::bind(&a.listen).await.with_context(|| format!("binding {}", a.listen))?) };
        let addr = bound.as_ref().map(|(_, addr)| addr.to_string());
        if !a.tracker.is_empty() {
            let identity = identity.clone().context("an identity with --tracker")?;
            let advertise = match (&a.advertise, &addr) {
                (_, None) => None,
                (Some(adv), _) => Some(adv.clone()),
                (None, Some(addr)) if addr.starts_with("0.0.0.0") || addr.starts_with("[::]") => {
                    bail!("listening on {addr}: say which address routes should dial with --advertise")
                }
                (None, Some(addr)) => Some(addr.clone()),
            };
            cfg.tracker = Some(dgr_worker::TrackerLink {
                addrs: a.tracker.clone(),
                join_token: read_token(&a)?,
                identity,
                advertise,
                join_timeout: positive(a.join_timeout, "join-timeout")?,
            });
        }
        let worker = Worker::open(cfg)?;
        if let Some(id) = a.model_id.as_ref().filter(|id| **id != worker.info().model_id) {
            bail!("--model-id is {id} but the model file is model {}", worker.info().model_id);
        }
        let m = worker.metrics();
        println!(
            "{}",
            serde_json::json!({
                "listening": addr,
                "layers": [layers.start, layers.end],
                "device": worker.device(),
                "model_id": worker.info().model_id,
                "weight_bytes": m.weight_bytes.load(std::sync::atomic::Ordering::Relaxed),
                "rss_bytes": dgr_worker::rss_bytes(),
                "step_us_per_layer": worker.step_us_per_layer(),
                // The key it proves on its links: what `--peer-key` pins on a ticketless route.
                "worker_id": dgr_proto::local_key().ok().map(|k| dgr_proto::worker_id(&k)),
                "trackers": a.tracker,
                "relayed": a.relay,
            })
        );
        let range = format!("layers {}..{}", layers.start, layers.end);
        let trackers = a.tracker.join(", ");
        match (a.tracker.is_empty(), &addr) {
            (false, Some(addr)) => {
                eprintln!("dgr worker: serving {range} on {addr} for the trackers at {trackers}; sessions need their tickets")
            }
            (false, None) => {
                eprintln!("dgr worker: serving {range} through the relays of the trackers at {trackers}; sessions need their tickets")
            }
            (true, addr) => eprintln!(
                "dgr worker: serving {range} on {} in ticketless mode (no --tracker: any driver that reaches this port may open sessions)",
                addr.as_deref().unwrap_or("?")
            ),
        }
        worker.serve(bound.map(|(l, _)| l), shutdown).await?;
        eprintln!("dgr worker: stopped");
        Ok(())
    })
}

/// The range a tracker assigns this worker: at most `--max-layers`, and no more than fit in the
/// memory of the device it computes on (a slice to fetch is sized by the swarm's manifest).
fn placed_layers(a: &Args) -> Result<std::ops::Range<usize>> {
    anyhow::ensure!(!a.tracker.is_empty(), "--layers A..B is needed without --tracker (with one, a tracker assigns the range)");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (model_id, sizes) = match (&a.model.model, &a.model_id) {
        (None, Some(id)) => (id.clone(), rt.block_on(fetch_spec(a, id, 0..0)?.sizes()).with_context(|| format!("sizing model {id}"))?),
        _ => dgr_worker::ModelSizes::of_file(&a.model.path()?)?,
    };
    let room = match a.numerics.device() {
        dgr_engine::Device::Gpu(i) => dgr_bench::gpu_room(i, a.gpu_memory_mb),
        _ => dgr_worker::available_memory(),
    };
    let fit = sizes.fit(room)?;
    let spec = dgr_worker::PlaceSpec {
        trackers: a.tracker.clone(),
        join_token: read_token(a)?,
        model_id,
        n_layers: sizes.n_layers,
        max_layers: a.max_layers.map_or(fit, |m| m.min(fit)),
        timeout: positive(a.join_timeout, "join-timeout")?,
    };
    let (layers, addr) = rt.block_on(spec.run())?;
    let (start, end, max) = (layers.start, layers.end, spec.max_layers);
    eprintln!("dgr worker: the tracker at {addr} placed this worker at layers {start}..{end} (it may hold {max} of {})", sizes.n_layers);
    Ok(layers)
}

fn read_token(a: &Args) -> Result<String> {
    crate::state::read_secret(a.join_token_file.as_ref().context("--tracker needs --join-token-file")?)
}

/// Fetching layers `layers` of model `id` from the swarm.
fn fetch_spec(a: &Args, id: &str, layers: std::ops::Range<usize>) -> Result<dgr_worker::FetchSpec> {
    let dir = match &a.slice_dir {
        Some(d) => d.clone(),
        None => dgr_gguf::default_model_path().parent().map(|p| p.join("slices")).context("no model directory")?,
    };
    Ok(dgr_worker::FetchSpec {
        trackers: a.tracker.clone(),
        join_token: read_token(a)?,
        model_id: id.to_string(),
        layers: u32::try_from(layers.start)?..u32::try_from(layers.end)?,
        dir,
    })
}

/// Fetches the slice of model `id` for `layers` from the swarm (or finds it fetched already).
fn fetch_slice(a: &Args, id: &str, layers: &std::ops::Range<usize>) -> Result<std::path::PathBuf> {
    anyhow::ensure!(!a.tracker.is_empty(), "--model-id needs --tracker");
    let spec = fetch_spec(a, id, layers.clone())?;
    let started = std::time::Instant::now();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let fetched = rt.block_on(spec.run()).with_context(|| format!("fetching layers {}..{} of model {id}", layers.start, layers.end))?;
    eprintln!("dgr worker: {}", dgr_worker::describe_fetch(&fetched, started));
    Ok(fetched.path)
}

/// Installs handlers for SIGTERM and SIGINT; the future completes on either.
pub fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    Ok(async move {
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
    })
}
