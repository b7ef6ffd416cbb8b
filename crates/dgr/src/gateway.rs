//! `dgr gateway`: the OpenAI-compatible HTTP API over a tracker's swarm.

use crate::state::read_secret;
use anyhow::{bail, Context, Result};
use dgr_gateway::{Gateway, GatewayConfig};
use dgr_proto::{KeyAdd, TrackerBody};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    /// The tracker's address (host:port, [v6]:port, or dgr://, tcp://, http:// before either), or the swarm's trackers, comma-separated: routes and
    /// usage reports go to the one that answered last, and to the next when it cannot answer
    #[arg(long, env = "DGR_TRACKER", value_parser = crate::addr::list)]
    pub tracker: String,
    /// Address to serve the API on (host:port, [v6]:port, or dgr://, tcp://, http:// before
    /// either); HTTPS with --tls-cert and --tls-key, plain HTTP without
    #[arg(long, default_value = "127.0.0.1:8000", value_parser = crate::addr::one)]
    pub listen: String,
    /// GGUF files whose tokenizers and chat templates the gateway uses, one per served model;
    /// a model is named by its file stem [default: the cached default model]
    #[arg(long, short = 'm', env = "DGR_MODEL")]
    pub model: Vec<PathBuf>,
    #[command(flatten)]
    pub tls: TlsArgs,
    #[command(flatten)]
    pub keys: KeysArgs,
    #[command(flatten)]
    pub limits: LimitArgs,
    #[command(flatten)]
    pub plaintext: crate::links::PlaintextArg,
    #[command(flatten)]
    pub tracker_key: crate::links::TrackerKeyArg,
    #[command(flatten)]
    pub peer_key: crate::links::PeerKeyArg,
}

#[derive(clap::Args, Clone)]
pub struct TlsArgs {
    /// Serve the API (and /metrics and the dashboard) over HTTPS with this certificate: a PEM
    /// file, the server's certificate first, then any intermediates. Needs --tls-key. Without
    /// both, the API is plain HTTP: keep it on loopback or put it behind a TLS proxy
    #[arg(long, requires = "tls_key", value_name = "PEM")]
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM: PKCS#8, PKCS#1 or SEC1). Needs --tls-cert
    #[arg(long, requires = "tls_cert", value_name = "PEM")]
    pub tls_key: Option<PathBuf>,
}

impl TlsArgs {
    /// The TLS configuration, checked now (before any model is loaded), if both files were given.
    pub fn load(&self) -> Result<Option<dgr_gateway::Tls>> {
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else { return Ok(None) };
        let tls = dgr_gateway::Tls::load(cert, key).context("loading --tls-cert/--tls-key")?;
        Ok(Some(tls))
    }
}

/// The URL scheme the API is served with.
pub fn scheme(tls: &Option<dgr_gateway::Tls>) -> &'static str {
    if tls.is_some() {
        "https"
    } else {
        "http"
    }
}

#[derive(clap::Args, Clone)]
pub struct KeysArgs {
    /// API keys, one per line: NAME KEY [QUOTA_TOKENS]. They are registered (hashed) with the
    /// tracker, which then requires a key for every request and bills and limits each
    #[arg(long)]
    pub api_keys: Option<PathBuf>,
    /// The tracker's join token: registers --api-keys, and lets spot checks quarantine a worker
    #[arg(long)]
    pub join_token_file: Option<PathBuf>,
}

impl KeysArgs {
    /// The join token, if a file was given.
    pub fn join_token(&self) -> Result<Option<String>> {
        self.join_token_file.as_deref().map(read_secret).transpose()
    }
}

#[derive(clap::Args, Clone)]
pub struct LimitArgs {
    /// Largest request body, bytes (past it: 413)
    #[arg(long, default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// Most prompt tokens a request may have (past it: 400)
    #[arg(long, default_value_t = 8192)]
    pub max_prompt_tokens: usize,
    /// Largest max_tokens a request may ask for (past it: 400)
    #[arg(long, default_value_t = 4096)]
    pub max_tokens_limit: usize,
    /// Generations running at once
    #[arg(long, default_value_t = 64)]
    pub max_running: usize,
    /// Requests that may wait for a free slot (past it: 429)
    #[arg(long, default_value_t = 256)]
    pub queue: usize,
    /// Seconds a request may wait in the queue, and then for a worker with room when every one
    /// serving its model is full (past it: 503)
    #[arg(long, default_value_t = 30.0)]
    pub queue_timeout: f64,
    /// Seconds to wait for any one step of a generation before failing it
    #[arg(long, default_value_t = 10.0)]
    pub step_timeout: f64,
    /// Most HTTP connections open at once (past it, new ones are closed and counted)
    #[arg(long, default_value_t = 4096)]
    pub max_connections: usize,
    /// Seconds a request may run in all (past it, its session is cancelled: 504)
    #[arg(long, default_value_t = 600.0)]
    pub request_timeout: f64,
    /// Fraction of sessions spot-checked: one step recomputed per stage on another replica and
    /// compared bit for bit; a worker caught lying is quarantined (needs the join token)
    #[arg(long, default_value_t = 0.02)]
    pub verify_fraction: f64,
    /// Speculative decoding: off, or at most N draft tokens a decode step (up to 16), guessed
    /// from the session's own text and verified by the route in one step; the tokens and
    /// logprobs are bitwise those of off. Requests under a grammar run one token a step
    #[arg(long, default_value_t = dgr_driver::Speculate::DEFAULT, value_parser = dgr_driver::Speculate::parse)]
    pub speculate: dgr_driver::Speculate,
}

impl LimitArgs {
    pub fn config(&self, tracker: String, models: Vec<PathBuf>) -> Result<GatewayConfig> {
        let secs = |v: f64, name: &str| {
            Duration::try_from_secs_f64(v).ok().filter(|d| !d.is_zero()).with_context(|| format!("--{name} must be positive"))
        };
        let mut cfg = GatewayConfig::new(tracker, models);
        cfg.max_body_bytes = self.max_body_bytes.max(1024);
        cfg.max_prompt_tokens = self.max_prompt_tokens.max(1);
        cfg.max_tokens_limit = self.max_tokens_limit.max(1);
        cfg.max_running = self.max_running.max(1);
        cfg.queue = self.queue;
        cfg.queue_timeout = secs(self.queue_timeout, "queue-timeout")?;
        cfg.drive.step_timeout = secs(self.step_timeout, "step-timeout")?;
        cfg.max_connections = self.max_connections.max(1);
        cfg.request_timeout = secs(self.request_timeout, "request-timeout")?;
        if !(0.0..=1.0).contains(&self.verify_fraction) {
            bail!("--verify-fraction must be in [0, 1]");
        }
        cfg.verify_fraction = self.verify_fraction;
        cfg.drive.speculate = self.speculate;
        Ok(cfg)
    }
}

/// Reads NAME KEY [QUOTA] lines ('#' starts a comment).
fn read_keys(path: &Path) -> Result<Vec<(String, String, u64)>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut keys = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        let quota = match f.get(2) {
            Some(q) => q.parse().with_context(|| format!("{}:{}: quota {q:?}", path.display(), i + 1))?,
            None => 0,
        };
        if f.len() < 2 || f.len() > 3 || f[1].len() < 16 {
            bail!("{}:{}: expected NAME KEY [QUOTA_TOKENS] with a key of at least 16 characters", path.display(), i + 1);
        }
        keys.push((f[0].to_string(), f[1].to_string(), quota));
    }
    Ok(keys)
}

/// Registers the file's keys with the tracker (replacing keys of the same names).
pub async fn register_keys(gw: &Gateway, keys: &KeysArgs) -> Result<usize> {
    let Some(path) = &keys.api_keys else { return Ok(0) };
    let token_file = keys.join_token_file.clone().unwrap_or_else(|| crate::state::state_dir().join("join-token"));
    let join_token = read_secret(&token_file).context("registering --api-keys needs the tracker's join token (--join-token-file)")?;
    let list = read_keys(path)?;
    for (name, key, quota_tokens) in &list {
        let add = KeyAdd { join_token: join_token.clone(), name: name.clone(), quota_tokens: *quota_tokens, key: key.clone() };
        match gw.tracker_call(TrackerBody::KeyAdd(add)).await {
            Ok(TrackerBody::KeyAdded(_)) => {}
            Ok(_) => bail!("the tracker answered something else"),
            Err(e) => return Err(e).with_context(|| format!("registering the key {name:?}")),
        }
    }
    Ok(list.len())
}

pub fn run(a: Args) -> Result<()> {
    a.plaintext.apply("gateway");
    a.tracker_key.apply();
    a.peer_key.apply();
    let tls = a.tls.load()?;
    let models = if a.model.is_empty() { vec![crate::model::ModelArg { model: None }.path()?] } else { a.model.clone() };
    let mut cfg = a.limits.config(a.tracker.clone(), models)?;
    cfg.join_token = a.keys.join_token()?;
    if cfg.join_token.is_none() && cfg.verify_fraction > 0.0 {
        eprintln!("dgr gateway: without --join-token-file, spot checks report a lying worker but cannot quarantine it");
    }
    let gw = Arc::new(Gateway::open(cfg)?);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let shutdown = crate::worker::shutdown_signal()?;
        let n = register_keys(&gw, &a.keys).await?;
        let listener = tokio::net::TcpListener::bind(&a.listen).await.with_context(|| format!("binding {}", a.listen))?;
        let addr = listener.local_addr()?;
        let names: Vec<&str> = gw.models.iter().map(|m| m.name.as_str()).collect();
        let url = format!("{}://{addr}", scheme(&tls));
        println!(
            "{}",
            serde_json::json!({ "listening": addr.to_string(), "url": url, "models": names, "tracker": a.tracker, "api_keys": n })
        );
        eprintln!("dgr gateway: serving the OpenAI API on {url}/v1 (dashboard: {url}/)");
        dgr_gateway::serve(gw, listener, tls, shutdown).await?;
        Ok(())
    })
}
