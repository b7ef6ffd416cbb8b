use crate::model::{ModelArg, ThreadsArg};
use anyhow::{bail, Context, Result};
use dgr_worker::{Worker, WorkerConfig};
use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArg,
    #[command(flatten)]
    threads: ThreadsArg,
    /// The layer range to serve, A..B (layers A to B-1; the first stage starts at 0, the last ends at the model's layer count)
    #[arg(long)]
    layers: String,
    /// Address to serve the stage protocol (and GET /metrics) on; port 0 picks a free port
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// Most sessions open at once
    #[arg(long, default_value_t = 64)]
    max_sessions: usize,
    /// KV positions held across all sessions (each session reserves prompt + max tokens)
    #[arg(long, default_value_t = 1 << 16)]
    kv_tokens: usize,
    /// Seconds without traffic after which a session is freed
    #[arg(long, default_value_t = 120.0)]
    idle_timeout: f64,
    /// Seconds open sessions get to finish after SIGTERM before they are cancelled
    #[arg(long, default_value_t = 10.0)]
    drain_timeout: f64,
    /// Most rows computed in one scheduler step (the token budget)
    #[arg(long, default_value_t = 8192)]
    step_tokens: usize,
    /// Largest prompt chunk in a step when no session is decoding
    #[arg(long, default_value_t = 512)]
    prefill_chunk: usize,
    /// Largest prompt chunk in a step that also decodes (bounds the added inter-token latency)
    #[arg(long, default_value_t = 4)]
    busy_chunk: usize,
    /// Spread decoding sessions over this many consecutive steps, so that the stages of a
    /// route compute different micro-batches at the same time
    #[arg(long, default_value_t = 1)]
    micro_batches: usize,
    /// Milliseconds a step may wait for more decoding sessions to arrive and join its batch
    #[arg(long, default_value_t = 2.0)]
    batch_wait_ms: f64,
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

pub fn run(a: Args) -> Result<()> {
    let mut cfg = WorkerConfig::new(a.model.path()?, parse_layers(&a.layers)?);
    cfg.threads = a.threads.get();
    cfg.max_sessions = a.max_sessions.max(1);
    cfg.kv_budget_tokens = a.kv_tokens.max(1);
    cfg.idle_timeout = secs(a.idle_timeout, "idle-timeout")?;
    cfg.drain_timeout = secs(a.drain_timeout, "drain-timeout")?;
    cfg.policy = dgr_worker::Policy {
        step_tokens: a.step_tokens.max(1),
        prefill_chunk: a.prefill_chunk.max(1),
        busy_chunk: a.busy_chunk.max(1),
        micro_batches: a.micro_batches.max(1),
        batch_wait: secs(a.batch_wait_ms / 1e3, "batch-wait-ms")?,
    };
    let layers = cfg.layers.clone();
    let worker = Worker::open(cfg)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    rt.block_on(async move {
        // Handlers first: a SIGTERM that arrives right after the ready line must drain, not kill.
        let shutdown = shutdown_signal()?;
        let (listener, addr) = dgr_worker::bind(&a.listen).await.with_context(|| format!("binding {}", a.listen))?;
        let m = worker.metrics();
        println!(
            "{}",
            serde_json::json!({
                "listening": addr.to_string(),
                "layers": [layers.start, layers.end],
                "model_id": worker.info().model_id,
                "weight_bytes": m.weight_bytes.load(std::sync::atomic::Ordering::Relaxed),
                "rss_bytes": dgr_worker::rss_bytes(),
            })
        );
        eprintln!("dgr worker: serving layers {}..{} on {addr} (GET http://{addr}/metrics)", layers.start, layers.end);
        worker.serve(listener, shutdown).await?;
        eprintln!("dgr worker: stopped");
        Ok(())
    })
}

/// Installs handlers for SIGTERM and SIGINT; the future completes on either.
fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    Ok(async move {
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
    })
}
