//! `dgr bench tracker --workers N --ledger-rows M`: a real `dgr tracker` process under load.
//! Its ledger is seeded with M usage rows billed to one API key with a quota; N protocol-level
//! workers (real Join and heartbeats, serving nothing) register a swarm of two models with
//! overlapping ranges and varied speeds; then many client connections send routed requests for a
//! fixed time. Each request is a `RouteRequest` (plan, quota check, signed ticket) followed by its
//! `RequestUsage` report (recorded once in the ledger). The same run measures an empty ledger
//! first, so the cost of the rows shows as a ratio.

use super::record;
use crate::error::{BenchError, Context, Result};
use crate::swarm::LocalTracker;
use dgr_proto::{
    Heartbeat, Load, Registration, RequestUsage, RouteRequest, SigningKey, StageUsage, TrackerBody, TrackerClient, UsageStatus,
};
use dgr_tracker::splitmix::SplitMix64 as Rng;
use dgr_tracker::LedgerSpec;
use futures::StreamExt;
use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// The load mode's flags; `--workers` selects it.
#[derive(clap::Args)]
pub struct Args {
    /// Load mode: register this many protocol-level workers and measure routed requests/s and
    /// route latency (instead of the per-token cost of a tracker-planned route)
    #[arg(long)]
    pub workers: Option<usize>,
    /// Load mode: usage rows seeded into the ledger before the run (an empty ledger is measured too)
    #[arg(long, default_value_t = 1_000_000)]
    ledger_rows: u64,
    /// Load mode: the tracker's ledger, `sqlite` (a file in a temporary directory) or a
    /// `postgres://` URL of a server on which each run creates a database of its own
    #[arg(long, default_value = "sqlite")]
    ledger: String,
    /// Load mode: client connections, each sending one request after another
    #[arg(long, default_value_t = 16)]
    connections: usize,
    /// Load mode: seconds measured per ledger, after a 2-second warm-up
    #[arg(long, default_value_t = 10)]
    seconds: u64,
}

const CALL: Duration = Duration::from_secs(10);
const WARMUP: Duration = Duration::from_secs(2);
const HEARTBEAT_MS: u64 = 1000;
const ENGINE: &str = "gguf-cpu-exact";
const KEY: &str = "dgr-bench-tracker-load-key";
const KEY_NAME: &str = "bench";
/// Far above what a run bills, so no request is refused, yet checked on every route.
const QUOTA: u64 = 1 << 50;
/// Tokens each request reports: 16 prompt + 48 completion.
const PROMPT: u64 = 16;
const COMPLETION: u64 = 48;

/// A model of the bench swarm: its id, layers, and share of the workers and of the requests.
struct Model {
    id: &'static str,
    n_layers: u32,
    share: f64,
}

const MODELS: [Model; 2] =
    [Model { id: "bench-model-32-layers", n_layers: 32, share: 0.6 }, Model { id: "bench-model-80-layers", n_layers: 80, share: 0.4 }];

/// The model a worker or a request is for, by the models' shares.
fn pick_model(rng: &mut Rng) -> &'static Model {
    let u = rng.unit();
    let mut acc = 0.0;
    MODELS
        .iter()
        .find(|m| {
            acc += m.share;
            u < acc
        })
        .unwrap_or(&MODELS[MODELS.len() - 1])
}

/// Worker `i`'s registration: layers as `SplitMix64::layer_range` draws them, 100 to 1,000 µs
/// per layer.
fn registration(i: usize, rng: &mut Rng) -> Registration {
    let m = pick_model(rng);
    let n = m.n_layers;
    let (start, end) = rng.layer_range(n);
    Registration {
        engine: ENGINE.into(),
        model_id: m.id.into(),
        n_layers: n,
        layer_start: start,
        layer_end: end,
        hidden: 4096,
        vocab: 32_000,
        // Never dialed: the tracker only hands it out.
        addr: format!("10.{}.{}.{}:7000", i >> 16 & 255, i >> 8 & 255, i & 255),
        kv_tokens: 1 << 16,
        max_sessions: 1 << 20,
        threads: 8,
        step_us_per_layer: 100.0 + 900.0 * rng.unit(),
        max_positions: 8192,
        version: env!("CARGO_PKG_VERSION").into(),
    }
}

/// Joins one worker and keeps it heartbeating (with a steady load of 0 to 3 sessions) until
/// the returned task is aborted.
async fn join_worker(addr: &str, token: &str, reg: Registration, sessions: u32) -> Result<tokio::task::JoinHandle<()>> {
    let key: SigningKey = dgr_proto::new_signing_key().map_err(|e| BenchError::Local(format!("randomness: {e}")))?;
    let mut c = TrackerClient::connect(addr, CALL).await?;
    c.join(&key, token, reg).await?;
    Ok(tokio::spawn(async move {
        // Heartbeats spread over the interval, as independent workers' are.
        tokio::time::sleep(Duration::from_millis(u64::from(sessions * 277) % HEARTBEAT_MS)).await;
        let mut tick = tokio::time::interval(Duration::from_millis(HEARTBEAT_MS));
        loop {
            tick.tick().await;
            let beat = Heartbeat { load: Some(Load { sessions: sessions % 4, ..Default::default() }), prefix: None, opened: Vec::new() };
            if c.send(TrackerBody::Heartbeat(beat)).await.is_err() {
                return;
            }
        }
    }))
}

/// What one connection measured: route and usage-report latencies in µs.
#[derive(Default)]
struct Samples {
    route_us: Vec<u32>,
    usage_us: Vec<u32>,
}

/// One client connection: routed requests one after another until `end`; samples those that
/// started after `measure_from`.
async fn client(addr: String, conn: usize, measure_from: Instant, end: Instant) -> Result<Samples> {
    let mut c = TrackerClient::connect(&addr, CALL).await?;
    let mut rng = Rng(0xbe7c_0000 + conn as u64);
    let mut out = Samples::default();
    let mut n = 0u64;
    while Instant::now() < end {
        let m = pick_model(&mut rng);
        let request_id = format!("load-{conn}-{n}");
        n += 1;
        let req = RouteRequest {
            model_id: m.id.into(),
            budget_tokens: PROMPT + COMPLETION,
            api_key: KEY.into(),
            request_id: request_id.clone(),
            ..Default::default()
        };
        let t0 = Instant::now();
        let reply = match c.call(TrackerBody::RouteRequest(req)).await? {
            TrackerBody::RouteReply(r) => r,
            other => return Err(BenchError::Measure(format!("a route request was answered with {other:?}"))),
        };
        let t1 = Instant::now();
        let route = reply.route.ok_or_else(|| BenchError::Measure("a route reply without its ticket".into()))?;
        let stages = route
            .stages
            .iter()
            .map(|s| StageUsage {
                worker_id: s.worker_id.clone(),
                session_id: route.session_id.clone(),
                tokens_prefilled: PROMPT,
                tokens_decoded: COMPLETION,
                layer_tokens: (PROMPT + COMPLETION) * u64::from(s.layer_end - s.layer_start),
            })
            .collect();
        let usage = RequestUsage {
            request_id,
            api_key: KEY.into(),
            model_id: m.id.into(),
            engine: route.engine,
            prompt_tokens: PROMPT,
            completion_tokens: COMPLETION,
            status: UsageStatus::Completed.as_str().into(),
            stages,
        };
        match c.call(TrackerBody::RequestUsage(usage)).await? {
            TrackerBody::Ack(a) if !a.duplicate => {}
            other => return Err(BenchError::Measure(format!("a usage report was answered with {other:?}"))),
        }
        let t2 = Instant::now();
        if t0 >= measure_from {
            out.route_us.push(t1.duration_since(t0).as_micros().min(u32::MAX as u128) as u32);
            out.usage_us.push(t2.duration_since(t1).as_micros().min(u32::MAX as u128) as u32);
        }
    }
    Ok(out)
}

/// A fresh ledger for one run: a file in the run's directory, or a new database on the server.
fn fresh_ledger(a: &Args, dir: &Path, tag: u64) -> Result<LedgerSpec> {
    if a.ledger == "sqlite" {
        return Ok(LedgerSpec::Sqlite(dir.join("tracker.db")));
    }
    match LedgerSpec::parse(&a.ledger) {
        LedgerSpec::Postgres(url) => {
            Ok(LedgerSpec::Postgres(dgr_tracker::store::fresh_postgres_database(&url, &format!("dgr_bench_{tag:016x}"))?))
        }
        LedgerSpec::Sqlite(_) => Err(BenchError::Usage(format!("--ledger {}: use sqlite or a postgres:// URL", a.ledger))),
    }
}

/// Seeds `ledger` with the bench key and `rows` usage rows billed to it.
fn seed(ledger: &LedgerSpec, rows: u64) -> Result<Duration> {
    let started = Instant::now();
    let mut store = dgr_tracker::Store::open(ledger)?;
    store.add_key(KEY_NAME, KEY, QUOTA, 0)?;
    let mut rng = Rng(rows);
    let mut at = 0;
    while at < rows {
        // One transaction per chunk keeps the batch's memory bounded.
        let chunk: Vec<RequestUsage> = (at..rows.min(at + 50_000))
            .map(|i| {
                let m = pick_model(&mut rng);
                RequestUsage {
                    request_id: format!("seed-{i}"),
                    api_key: String::new(),
                    model_id: m.id.into(),
                    engine: ENGINE.into(),
                    prompt_tokens: PROMPT,
                    completion_tokens: COMPLETION,
                    status: UsageStatus::Completed.as_str().into(),
                    stages: vec![StageUsage {
                        worker_id: format!("seed-worker-{}", i % 10_000),
                        session_id: i.to_le_bytes().to_vec(),
                        tokens_prefilled: PROMPT,
                        tokens_decoded: COMPLETION,
                        layer_tokens: (PROMPT + COMPLETION) * u64::from(m.n_layers),
                    }],
                }
            })
            .collect();
        at += chunk.len() as u64;
        store.record_requests(KEY_NAME, &chunk, 0)?;
    }
    Ok(started.elapsed())
}

/// User + system CPU seconds a process has used so far.
fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).context("reading the tracker's /proc stat")?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let unreadable = || BenchError::Measure(format!("an unreadable /proc/{pid}/stat"));
    let rest = stat.rsplit_once(')').ok_or_else(unreadable)?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).ok_or_else(unreadable);
    // SAFETY: sysconf only reads a system constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok((ticks(11)? + ticks(12)?) / hz)
}

/// One ledger's run: what it measured.
struct Run {
    rows: u64,
    seed_s: f64,
    join_s: f64,
    requests: usize,
    per_s: f64,
    route_us: Vec<u32>,
    usage_us: Vec<u32>,
    tracker_cpu_us_per_request: f64,
    /// This process's: the clients and the heartbeating workers, on the same cores.
    load_cpu_us_per_request: f64,
}

fn run_one(a: &Args, workers: usize, rows: u64) -> Result<Run> {
    let mut tag = [0u8; 8];
    getrandom::fill(&mut tag).map_err(|e| BenchError::Local(format!("randomness: {e}")))?;
    let dir = std::env::temp_dir().join(format!("dgr-bench-tracker-{}-{:016x}", std::process::id(), u64::from_le_bytes(tag)));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let result = fresh_ledger(a, &dir, u64::from_le_bytes(tag)).and_then(|ledger| run_in(a, workers, rows, &dir, &ledger));
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn run_in(a: &Args, workers: usize, rows: u64, dir: &Path, ledger: &LedgerSpec) -> Result<Run> {
    let seed_took = seed(ledger, rows)?;
    eprintln!("ledger: {rows} rows seeded in {:.1} s", seed_took.as_secs_f64());
    let max_conns = (workers + a.connections + 64).to_string();
    let hb = HEARTBEAT_MS.to_string();
    let mut flags = vec!["--max-connections", &max_conns, "--heartbeat-ms", &hb];
    if let LedgerSpec::Postgres(url) = ledger {
        flags.extend(["--ledger", url.as_str()]);
    }
    let t = LocalTracker::start_in(dir, "127.0.0.1:0", &flags)?;
    let token = std::fs::read_to_string(&t.token_file).with_context(|| format!("reading {}", t.token_file.display()))?.trim().to_string();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().context("starting a runtime")?;
    rt.block_on(async {
        let started = Instant::now();
        let mut rng = Rng(7);
        let regs: Vec<(Registration, u32)> = (0..workers).map(|i| (registration(i, &mut rng), rng.below(1 << 16))).collect();
        let beating: Vec<tokio::task::JoinHandle<()>> = futures::stream::iter(regs)
            .map(|(reg, sessions)| join_worker(&t.addr, &token, reg, sessions))
            .buffer_unordered(64)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_>>()?;
        let join_s = started.elapsed().as_secs_f64();
        eprintln!("{workers} workers joined in {join_s:.1} s");

        let measure_from = Instant::now() + WARMUP;
        let end = measure_from + Duration::from_secs(a.seconds);
        let clients: Vec<_> = (0..a.connections).map(|i| tokio::spawn(client(t.addr.clone(), i, measure_from, end))).collect();
        tokio::time::sleep_until(measure_from.into()).await;
        let (cpu_from, load_from) = (cpu_seconds(t.pid())?, cpu_seconds(std::process::id())?);
        let mut all = Samples::default();
        for c in clients {
            let s = c.await.map_err(|e| BenchError::Measure(format!("a client task: {e}")))??;
            all.route_us.extend(s.route_us);
            all.usage_us.extend(s.usage_us);
        }
        let (cpu, load) = (cpu_seconds(t.pid())? - cpu_from, cpu_seconds(std::process::id())? - load_from);
        for b in &beating {
            b.abort();
        }
        let requests = all.route_us.len();
        Ok(Run {
            rows,
            seed_s: seed_took.as_secs_f64(),
            join_s,
            requests,
            per_s: requests as f64 / a.seconds as f64,
            route_us: all.route_us,
            usage_us: all.usage_us,
            tracker_cpu_us_per_request: cpu * 1e6 / requests.max(1) as f64,
            load_cpu_us_per_request: load * 1e6 / requests.max(1) as f64,
        })
    })
}

/// The q-quantile of samples, in ms.
fn quantile_ms(v: &[u32], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_unstable();
    match s.len() {
        0 => f64::NAN,
        n => f64::from(s[((n - 1) as f64 * q).round() as usize]) / 1e3,
    }
}

/// Samples as a histogram: µs rounded down to two significant digits, and how many.
fn histogram(v: &[u32]) -> BTreeMap<u32, u32> {
    let mut h = BTreeMap::new();
    for &x in v {
        let scale = 10u32.pow((x.max(1).ilog10()).saturating_sub(1));
        *h.entry(x / scale * scale).or_default() += 1;
    }
    h
}

pub fn run(a: Args, out: &Path) -> Result<()> {
    let workers = a.workers.ok_or_else(|| BenchError::Usage("the load mode needs --workers".into()))?;
    if workers == 0 || a.connections == 0 || a.seconds == 0 {
        return Err(BenchError::Usage("--workers, --connections and --seconds must be positive".into()));
    }
    let runs = [run_one(&a, workers, 0)?, run_one(&a, workers, a.ledger_rows)?];
    println!(
        "tracker under load: {workers} workers ({}), ledger {} , {} connections, {} s each after {} s warm-up",
        MODELS.iter().map(|m| format!("{} layers", m.n_layers)).collect::<Vec<_>>().join(" and "),
        a.ledger,
        a.connections,
        a.seconds,
        WARMUP.as_secs()
    );
    println!("each request: RouteRequest (plan + quota check + signed ticket), then its RequestUsage (recorded in the ledger)");
    println!(
        "{:>12} {:>10} {:>14} {:>14} {:>14} {:>14} {:>16} {:>16}",
        "ledger rows", "req/s", "route p50 ms", "route p99 ms", "usage p50 ms", "usage p99 ms", "tracker CPU/req", "load gen CPU/req"
    );
    for r in &runs {
        println!(
            "{:>12} {:>10.0} {:>14.3} {:>14.3} {:>14.3} {:>14.3} {:>13.0} µs {:>13.0} µs",
            r.rows,
            r.per_s,
            quantile_ms(&r.route_us, 0.5),
            quantile_ms(&r.route_us, 0.99),
            quantile_ms(&r.usage_us, 0.5),
            quantile_ms(&r.usage_us, 0.99),
            r.tracker_cpu_us_per_request,
            r.load_cpu_us_per_request
        );
    }
    let ratio = |q: f64| quantile_ms(&runs[1].route_us, q) / quantile_ms(&runs[0].route_us, q);
    println!("route latency with {} rows / empty ledger: p50 {:.3}, p99 {:.3} (target ≤ 1.2)", a.ledger_rows, ratio(0.5), ratio(0.99));
    let field = |r: &Run| {
        json!({
            "ledger_rows": r.rows,
            "seed_s": r.seed_s,
            "join_s": r.join_s,
            "requests": r.requests,
            "requests_per_s": r.per_s,
            "route_ms": { "p50": quantile_ms(&r.route_us, 0.5), "p99": quantile_ms(&r.route_us, 0.99), "max": quantile_ms(&r.route_us, 1.0) },
            "usage_ms": { "p50": quantile_ms(&r.usage_us, 0.5), "p99": quantile_ms(&r.usage_us, 0.99), "max": quantile_ms(&r.usage_us, 1.0) },
            "tracker_cpu_us_per_request": r.tracker_cpu_us_per_request,
            "load_generator_cpu_us_per_request": r.load_cpu_us_per_request,
            "route_us_histogram": histogram(&r.route_us),
            "usage_us_histogram": histogram(&r.usage_us),
        })
    };
    let path = record::write_maybe_model(
        out,
        "tracker-load",
        None,
        json!({
            "request": "RouteRequest (plan + quota check + signed ticket), then its RequestUsage (recorded in the ledger)",
            "workers": workers,
            "models": MODELS.iter().map(|m| json!({ "id": m.id, "n_layers": m.n_layers, "share": m.share })).collect::<Vec<_>>(),
            "ledger": a.ledger,
            "connections": a.connections,
            "seconds": a.seconds,
            "warmup_s": WARMUP.as_secs(),
            "heartbeat_ms": HEARTBEAT_MS,
            "threads": { "tracker": 2, "load_generator": 2 },
            "peer": null,
            "runs": runs.iter().map(field).collect::<Vec<_>>(),
            "route_seeded_vs_empty": { "p50": ratio(0.5), "p99": ratio(0.99) },
        }),
    )?;
    println!("record: {}", path.display());
    Ok(())
}
