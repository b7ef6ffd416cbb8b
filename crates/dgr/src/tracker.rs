//! `dgr tracker`: the registry, route planner, ticket signer, ledger and relay of a swarm.

use crate::state::{read_or_create_secret, read_secret, state_dir};
use anyhow::{Context, Result};
use dgr_tracker::{LedgerSpec, Tracker, TrackerConfig};
use std::path::PathBuf;
use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    /// Address to serve on (workers, clients, the relay, and GET /metrics, /health) (host:port, [v6]:port, or dgr://, tcp://, http:// before either);
    /// port 0 picks a free port
    #[arg(long, default_value = "127.0.0.1:7400", value_parser = crate::addr::one)]
    listen: String,
    /// The address clients reach this tracker on, used in relayed workers' addresses [default: the bound address; when
    /// that is 0.0.0.0 or [::], the address each relayed worker's connection reached]
    #[arg(long, value_parser = crate::addr::one)]
    advertise: Option<String>,
    /// Where what survives a restart lives (the ledger, API keys and their running totals,
    /// reservations, worker identities, the signing keys): `postgres://user@host:port/db` for a
    /// PostgreSQL database that several trackers may share, `sqlite:PATH` or a plain PATH for an
    /// SQLite file [default: $DGR_STATE_DIR/tracker.db]. The schema is migrated at start; a
    /// database written by a newer dgr is refused
    #[arg(long, conflicts_with = "db")]
    ledger: Option<String>,
    /// SQLite database file (the same as `--ledger PATH`)
    #[arg(long)]
    db: Option<PathBuf>,
    /// File holding the join token workers must present (and that `dgr key add` needs)
    /// [default: $DGR_STATE_DIR/join-token, created with a random token if missing]
    #[arg(long)]
    join_token_file: Option<PathBuf>,
    /// Milliseconds between worker heartbeats; a worker silent for three is out of new routes
    #[arg(long, default_value_t = 1000)]
    heartbeat_ms: u64,
    /// Milliseconds a route ticket stays valid for opening its session
    #[arg(long, default_value_t = 60_000)]
    ticket_ttl_ms: u64,
    /// Most connections open at once
    #[arg(long, default_value_t = 4096)]
    max_connections: usize,
    /// Seconds a route holds its reservation of the key's quota (its token budget) when its
    /// usage is never reported (a driver that died); a reported request settles it at once
    /// and is billed the tokens it actually used
    #[arg(long, default_value_t = 300)]
    reservation_ttl_s: u64,
    #[command(flatten)]
    plaintext: crate::links::PlaintextArg,
}

pub fn run(a: Args) -> Result<()> {
    a.plaintext.apply("tracker");
    let ledger = match (a.ledger, a.db) {
        (Some(l), _) => LedgerSpec::parse(&l),
        (None, Some(path)) => LedgerSpec::Sqlite(path),
        (None, None) => LedgerSpec::Sqlite(state_dir().join("tracker.db")),
    };
    let token_file = a.join_token_file.clone().unwrap_or_else(|| state_dir().join("join-token"));
    let token = if a.join_token_file.is_some() { read_secret(&token_file)? } else { read_or_create_secret(&token_file)? };
    let mut cfg = TrackerConfig::new(ledger.clone(), token);
    anyhow::ensure!((50..=60_000).contains(&a.heartbeat_ms), "--heartbeat-ms must be 50..=60000");
    cfg.heartbeat = Duration::from_millis(a.heartbeat_ms);
    cfg.max_connections = a.max_connections.max(1);
    cfg.ticket_ttl = Duration::from_millis(a.ticket_ttl_ms.max(1));
    cfg.reservation_ttl = Duration::from_secs(a.reservation_ttl_s.max(1));
    let tracker = Tracker::open(cfg).with_context(|| format!("opening the ledger {ledger}"))?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let shutdown = crate::worker::shutdown_signal()?;
        let listener = tokio::net::TcpListener::bind(&a.listen).await.with_context(|| format!("binding {}", a.listen))?;
        let addr = listener.local_addr()?.to_string();
        let advertise = a.advertise.unwrap_or_else(|| addr.clone());
        println!(
            "{}",
            serde_json::json!({
                "listening": addr,
                "advertise": advertise,
                "ledger": ledger.to_string(),
                "join_token_file": token_file,
                "key_id": tracker.key_id(),
                "link_key": tracker.link_key(),
                "api_keys_required": tracker.requires_keys()?,
            })
        );
        eprintln!(
            "dgr tracker: serving on {addr} (GET http://{addr}/metrics); workers join with the token in {}; clients pin this tracker with --tracker-key {}",
            token_file.display(),
            tracker.link_key()
        );
        tracker.serve(listener, advertise, shutdown).await?;
        eprintln!("dgr tracker: stopped");
        Ok(())
    })
}
