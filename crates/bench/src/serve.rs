//! `dgr bench serve`: a load generator for any OpenAI-compatible endpoint. It keeps
//! `--concurrency` streamed completion requests in flight until `--requests` complete and
//! reports output tok/s, request/s, time to first token and inter-token latency; with
//! `--peer-url` it alternates rounds between two endpoints and reports their ratios.

use super::record;
use super::serve_client::{self as client, Endpoint, RequestSpec, Sample};
use crate::error::{BenchError, Context, Result};
use crate::plot::{self, Chart};
use plotters::chart::SeriesLabelPosition;
use serde::Serialize;
use serde_json::{json, Map, Value};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::ops::Range;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    /// Base URL of the endpoint to measure (http only), e.g. http://127.0.0.1:8000; requests go
    /// to URL/v1/completions (or URL/v1/chat/completions with --chat)
    #[arg(long)]
    url: String,
    /// What the endpoint is, for the table and the record (e.g. "dgr up --workers 2") [default: the URL]
    #[arg(long)]
    label: Option<String>,
    /// The model name sent in each request [default: the first id of GET URL/v1/models]
    #[arg(long)]
    model: Option<String>,
    /// Sent as `Authorization: Bearer KEY`; it is left out of the record
    #[arg(long, env = "DGR_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// A second endpoint measured in the same run: rounds alternate between the two (URL, peer,
    /// URL, peer, ...) and the report adds the ratios URL / peer
    #[arg(long)]
    peer_url: Option<String>,
    /// What the peer endpoint is (e.g. "llama-server -np 8") [default: its URL]
    #[arg(long)]
    peer_label: Option<String>,
    /// The model name sent to the peer [default: the first id of GET PEER_URL/v1/models]
    #[arg(long)]
    peer_model: Option<String>,
    /// The peer's bearer token [default: --api-key]
    #[arg(long)]
    peer_api_key: Option<String>,
    /// A JSON object whose fields are added to every request to URL (e.g. a response_format),
    /// so a run against the same URL as --peer-url measures what those fields cost
    #[arg(long)]
    extra_body: Option<String>,
    /// The same for the peer's requests
    #[arg(long)]
    peer_extra_body: Option<String>,
    /// Requests kept in flight at once
    #[arg(long, short = 'c', default_value_t = 8)]
    concurrency: usize,
    /// Measured requests per round
    #[arg(long, short = 'n', default_value_t = 32)]
    requests: usize,
    /// Measured rounds per endpoint [default: 3 with --peer-url, else 1]
    #[arg(long)]
    rounds: Option<usize>,
    /// Prompt length in tokens, roughly: the client does not know the server's tokenizer, so the
    /// prompt is a number and then common words (about one token each in BPE vocabularies); the
    /// report gives the server's own count
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Tokens generated per request; requests set ignore_eos, so a server that honours it
    /// (llama-server, vLLM, dgr) generates exactly this many
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Send the prompt as one user message to /v1/chat/completions instead of /v1/completions
    #[arg(long)]
    chat: bool,
    /// Unmeasured requests sent to each endpoint before its first round; the run stops early if
    /// all of them fail
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Seconds one request may take, from sending it to the end of its stream
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// The GGUF file the endpoints serve, hashed into the record [default: the default model, if
    /// it is cached; else the record's model is null]
    #[arg(long)]
    model_file: Option<PathBuf>,
    /// Directory for the run's record and plot
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
}

/// One round of measured requests against one endpoint.
#[derive(Serialize)]
pub struct Round {
    pub round: usize,
    /// From the first request sent to the last one finished.
    pub wall_s: f64,
    pub samples: Vec<Sample>,
}

impl Round {
    fn ok(&self) -> impl Iterator<Item = &Sample> {
        self.samples.iter().filter(|s| s.error.is_none())
    }

    fn tok_s(&self) -> f64 {
        self.ok().map(|s| s.completion_tokens).sum::<u64>() as f64 / self.wall_s
    }

    fn req_s(&self) -> f64 {
        self.ok().count() as f64 / self.wall_s
    }
}

/// One endpoint's numbers over all its rounds. Throughput is the median over rounds; latency
/// percentiles pool every successful request of every round.
#[derive(Serialize, Debug)]
pub struct Summary {
    pub requests: usize,
    pub ok: usize,
    pub errors: BTreeMap<String, usize>,
    /// Completion tokens of the round's successful requests over the round's wall time.
    pub tok_s_rounds: Vec<f64>,
    pub tok_s: f64,
    pub req_s_rounds: Vec<f64>,
    pub req_s: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    /// Gaps between content chunks (one token each unless `tokens_per_chunk` says otherwise).
    pub itl_p50_ms: f64,
    pub itl_p99_ms: f64,
    /// Per request: from its first chunk to its last, over the tokens after the first.
    pub tpot_p50_ms: f64,
    pub tokens_per_chunk: f64,
    /// The server's own counts (NaN, written null, when its stream has no usage).
    pub prompt_tokens_p50: f64,
    pub completion_tokens_p50: f64,
    /// Successful requests with fewer than --max-tokens tokens (the server ignored ignore_eos).
    pub short: usize,
    /// Successful requests whose token count came from counting chunks, without usage.
    pub without_usage: usize,
}

/// The p-th percentile (0 to 100) of sorted samples, interpolating between closest ranks.
fn quantile_sorted(s: &[f64], p: f64) -> f64 {
    if s.is_empty() {
        return f64::NAN;
    }
    let rank = p.clamp(0.0, 100.0) / 100.0 * (s.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    s[lo] + (s[hi] - s[lo]) * (rank - lo as f64)
}

fn sorted(v: impl IntoIterator<Item = f64>) -> Vec<f64> {
    let mut s: Vec<f64> = v.into_iter().filter(|x| !x.is_nan()).collect();
    s.sort_by(f64::total_cmp);
    s
}

/// The p-th percentile (0 to 100) of samples, NaNs ignored; NaN when there are none.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    quantile_sorted(&sorted(v.iter().copied()), p)
}

pub fn summarize(rounds: &[Round], max_tokens: usize) -> Summary {
    let all = || rounds.iter().flat_map(|r| &r.samples);
    let ok: Vec<&Sample> = rounds.iter().flat_map(Round::ok).collect();
    let mut errors = BTreeMap::new();
    for e in all().filter_map(|s| s.error.as_ref()) {
        *errors.entry(e.kind.clone()).or_insert(0) += 1;
    }
    let ttft: Vec<f64> = ok.iter().filter_map(|s| s.ttft_ms).collect();
    let itl: Vec<f64> = ok.iter().flat_map(|s| s.itl_ms.iter().copied()).collect();
    let tpot: Vec<f64> = ok
        .iter()
        .filter(|s| s.completion_tokens >= 2 && !s.itl_ms.is_empty())
        .map(|s| s.itl_ms.iter().sum::<f64>() / (s.completion_tokens - 1) as f64)
        .collect();
    let tokens: u64 = ok.iter().map(|s| s.completion_tokens).sum();
    let chunks: usize = ok.iter().map(|s| s.chunks).sum();
    let tok_s_rounds: Vec<f64> = rounds.iter().map(Round::tok_s).collect();
    let req_s_rounds: Vec<f64> = rounds.iter().map(Round::req_s).collect();
    let prompt: Vec<f64> = ok.iter().filter_map(|s| s.prompt_tokens.map(|p| p as f64)).collect();
    let completion: Vec<f64> = ok.iter().map(|s| s.completion_tokens as f64).collect();
    Summary {
        requests: all().count(),
        ok: ok.len(),
        errors,
        tok_s: percentile(&tok_s_rounds, 50.0),
        tok_s_rounds,
        req_s: percentile(&req_s_rounds, 50.0),
        req_s_rounds,
        ttft_p50_ms: percentile(&ttft, 50.0),
        ttft_p99_ms: percentile(&ttft, 99.0),
        itl_p50_ms: percentile(&itl, 50.0),
        itl_p99_ms: percentile(&itl, 99.0),
        tpot_p50_ms: percentile(&tpot, 50.0),
        tokens_per_chunk: tokens as f64 / chunks as f64,
        prompt_tokens_p50: percentile(&prompt, 50.0),
        completion_tokens_p50: percentile(&completion, 50.0),
        short: ok.iter().filter(|s| (s.completion_tokens as usize) < max_tokens).count(),
        without_usage: ok.iter().filter(|s| !s.tokens_from_usage).count(),
    }
}

/// How endpoint `a` compares to endpoint `b`, each as a / b.
#[derive(Serialize, Debug)]
pub struct Comparison {
    /// The median of per-round ratios, rounds paired in the order they ran (back to back).
    pub tok_s: f64,
    pub req_s: f64,
    /// Ratios of the pooled percentiles.
    pub ttft_p50: f64,
    pub itl_p50: f64,
    pub tpot_p50: f64,
}

pub fn compare(a: &Summary, b: &Summary) -> Comparison {
    let paired = |x: &[f64], y: &[f64]| percentile(&x.iter().zip(y).map(|(p, q)| p / q).collect::<Vec<_>>(), 50.0);
    Comparison {
        tok_s: paired(&a.tok_s_rounds, &b.tok_s_rounds),
        req_s: paired(&a.req_s_rounds, &b.req_s_rounds),
        ttft_p50: a.ttft_p50_ms / b.ttft_p50_ms,
        itl_p50: a.itl_p50_ms / b.itl_p50_ms,
        tpot_p50: a.tpot_p50_ms / b.tpot_p50_ms,
    }
}

/// Words that are about one token each in BPE vocabularies.
const WORDS: &[&str] = &[
    "the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "and", "then", "runs", "back", "to", "the", "old", "red",
    "barn", "on", "a", "cold", "day",
];

/// A prompt of about `tokens` tokens that starts with the digits of `id`, least significant
/// first, so that prompts differ within their first tokens and no prefix cache serves one
/// request from another. The id has a fixed width so that every prompt has the same length,
/// whichever endpoint it goes to.
pub fn prompt_text(id: usize, tokens: usize) -> String {
    let mut s: String = format!("{id:08}").chars().rev().collect();
    s.push(':');
    let words = tokens.saturating_sub(s.len()).max(1);
    // Words drawn by a hash of (id, index), so that no two prompts share a run of tokens a
    // server's prompt cache could reuse: every request costs its whole prefill.
    let mut x = id as u64 ^ 0x9e37_79b9_7f4a_7c15;
    for _ in 0..words {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        s.push(' ');
        s.push_str(WORDS[((z ^ (z >> 31)) % WORDS.len() as u64) as usize]);
    }
    s
}

fn json_object(s: &str) -> std::result::Result<Map<String, Value>, String> {
    match serde_json::from_str(s) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err("not a JSON object".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// The fields of a streamed, greedy request of `max_tokens` new tokens (exactly that many
/// with `ignore_eos`, on a server that honours it), usage included.
pub(crate) fn stream_body(model: Option<&str>, max_tokens: usize, ignore_eos: bool) -> Value {
    let mut b = json!({
        "stream": true,
        "stream_options": { "include_usage": true },
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
    });
    if let Some(m) = model {
        b["model"] = json!(m);
    }
    b
}

fn request_body(model: Option<&str>, chat: bool, prompt: &str, max_tokens: usize, extra: &Map<String, Value>) -> Vec<u8> {
    let mut b = stream_body(model, max_tokens, true);
    if chat {
        b["messages"] = json!([{ "role": "user", "content": prompt }]);
    } else {
        b["prompt"] = json!(prompt);
    }
    for (k, v) in extra {
        b[k] = v.clone();
    }
    b.to_string().into_bytes()
}

/// What every request of a run shares.
struct Load {
    chat: bool,
    prompt_tokens: usize,
    max_tokens: usize,
    timeout: Duration,
}

impl Load {
    fn path(&self) -> &'static str {
        if self.chat {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        }
    }

    fn spec(&self, model: Option<&str>, extra: &Map<String, Value>, id: usize) -> RequestSpec {
        let body = request_body(model, self.chat, &prompt_text(id, self.prompt_tokens), self.max_tokens, extra);
        RequestSpec { path: self.path(), body, chat: self.chat, timeout: self.timeout }
    }
}

/// Sends requests `ids` to `ep`, `concurrency` at a time, each the request `spec` makes of
/// its id; returns the wall time and the samples in id order.
pub(crate) async fn phase(ep: &Endpoint, ids: Range<usize>, concurrency: usize, spec: impl Fn(usize) -> RequestSpec) -> (f64, Vec<Sample>) {
    let (next, end, spec) = (&Cell::new(ids.start), ids.end, &spec);
    let start = Instant::now();
    let workers = (0..concurrency.min(ids.len())).map(|_| async move {
        let mut out = Vec::new();
        loop {
            let id = next.get();
            if id >= end {
                return out;
            }
            next.set(id + 1);
            out.push(client::measure(ep, &spec(id), id, start).await);
        }
    });
    let mut samples: Vec<Sample> = futures::future::join_all(workers).await.into_iter().flatten().collect();
    let wall = start.elapsed().as_secs_f64();
    samples.sort_by_key(|s| s.id);
    (wall, samples)
}

/// Request ids of one endpoint: below this, so that ids keep their width (see `prompt_text`).
const ID_SPAN: usize = 10_000_000;

/// A random start for this run's request ids (below half an endpoint's span), so that a server
/// that outlives one run cannot answer the next run's prompts from its prompt cache.
fn run_offset() -> usize {
    let mut b = [0u8; 8];
    let _ = getrandom::fill(&mut b);
    (u64::from_le_bytes(b) % (ID_SPAN as u64 / 2)) as usize
}

/// One endpoint under measurement.
struct Contender {
    label: String,
    url: String,
    ep: Endpoint,
    model: Option<String>,
    /// What GET /v1/models said (or why it failed), for the record.
    models: Value,
    /// Request ids start here, so two contenders never send the same prompt.
    id_base: usize,
    /// Fields added to each of its requests (--extra-body, --peer-extra-body).
    extra: Map<String, Value>,
    rounds: Vec<Round>,
}

impl Contender {
    fn new(url: &str, label: Option<String>, model: Option<String>, api_key: Option<String>, index: usize) -> Result<Contender> {
        Ok(Contender {
            label: label.unwrap_or_else(|| url.to_string()),
            url: url.to_string(),
            ep: Endpoint::parse(url, api_key)?,
            model,
            models: Value::Null,
            id_base: index * ID_SPAN + run_offset(),
            extra: Map::new(),
            rounds: Vec::new(),
        })
    }

    /// Asks for the model list; takes the first id when no --model was given.
    async fn discover(&mut self) {
        match client::get_json(&self.ep, "/v1/models", Duration::from_secs(10)).await {
            Ok(v) => {
                if self.model.is_none() {
                    self.model = v["data"][0]["id"].as_str().map(str::to_string);
                }
                self.models = v;
            }
            Err(f) => {
                if self.model.is_none() {
                    eprintln!("{}: GET /v1/models failed ({}); sending requests without a model name", self.label, f.message());
                }
                self.models = json!({ "error": f.message() });
            }
        }
    }

    fn spec(&self, load: &Load, id: usize) -> RequestSpec {
        load.spec(self.model.as_deref(), &self.extra, id)
    }

    async fn warm_up(&self, load: &Load, n: usize, concurrency: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let (_, samples) = phase(&self.ep, self.id_base..self.id_base + n, concurrency, |id| self.spec(load, id)).await;
        if let Some(e) = samples.iter().map(|s| s.error.as_ref()).collect::<Option<Vec<_>>>().and_then(|e| e.first().copied()) {
            return Err(BenchError::Endpoint(format!(
                "every warm-up request to {} failed; the first: {}: {}",
                self.url, e.kind, e.message
            )));
        }
        Ok(())
    }

    async fn measure_round(&mut self, load: &Load, round: usize, requests: usize, warmup: usize, concurrency: usize) {
        let first = self.id_base + warmup + round * requests;
        let (wall_s, samples) = phase(&self.ep, first..first + requests, concurrency, |id| self.spec(load, id)).await;
        self.rounds.push(Round { round, wall_s, samples });
    }
}

/// The command line, with API keys replaced.
fn redacted_command() -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for a in std::env::args() {
        let secret_flag = |f: &str| f == "--api-key" || f == "--peer-api-key";
        if out.last().is_some_and(|p| secret_flag(p)) {
            out.push("<redacted>".into());
        } else if let Some((f, _)) = a.split_once('=').filter(|(f, _)| secret_flag(f)) {
            out.push(format!("{f}=<redacted>"));
        } else {
            out.push(a);
        }
    }
    out
}

pub fn run(a: Args) -> Result<()> {
    let rounds = a.rounds.unwrap_or(if a.peer_url.is_some() { 3 } else { 1 });
    if a.concurrency == 0 || a.requests == 0 || a.max_tokens == 0 || rounds == 0 {
        return Err(BenchError::Usage("--concurrency, --requests, --max-tokens and --rounds must be positive".into()));
    }
    if a.warmup + rounds * a.requests >= ID_SPAN {
        return Err(BenchError::Usage(format!("at most {ID_SPAN} requests per endpoint")));
    }
    let load = Load { chat: a.chat, prompt_tokens: a.prompt_tokens, max_tokens: a.max_tokens, timeout: Duration::from_secs(a.timeout) };
    let mut cs = vec![Contender::new(&a.url, a.label.clone(), a.model.clone(), a.api_key.clone(), 0)?];
    let extra = |flag: &str, v: &Option<String>| match v {
        None => Ok(Map::new()),
        Some(s) => json_object(s).map_err(|e| BenchError::Usage(format!("{flag}: {e}"))),
    };
    cs[0].extra = extra("--extra-body", &a.extra_body)?;
    if let Some(p) = &a.peer_url {
        let mut peer = Contender::new(p, a.peer_label.clone(), a.peer_model.clone(), a.peer_api_key.clone().or(a.api_key.clone()), 1)?;
        peer.extra = extra("--peer-extra-body", &a.peer_extra_body)?;
        cs.push(peer);
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting a runtime")?;
    rt.block_on(async {
        for c in &mut cs {
            c.discover().await;
            c.warm_up(&load, a.warmup, a.concurrency.min(a.warmup.max(1))).await?;
        }
        for r in 0..rounds {
            for c in &mut cs {
                c.measure_round(&load, r, a.requests, a.warmup, a.concurrency).await;
                let last = c.rounds.last().map(|x| (x.tok_s(), x.ok().count())).unwrap_or_default();
                eprintln!("round {r} {}: {:.1} tok/s, {}/{} ok", c.label, last.0, last.1, a.requests);
            }
        }
        Ok::<_, BenchError>(())
    })?;

    let summaries: Vec<Summary> = cs.iter().map(|c| summarize(&c.rounds, a.max_tokens)).collect();
    let comparison = (summaries.len() == 2).then(|| compare(&summaries[0], &summaries[1]));
    print!("{}", table(&a, rounds, &load, &cs, &summaries, comparison.as_ref()));

    let model_file = a.model_file.clone().or_else(|| Some(dgr_gguf::default_model_path()).filter(|p| p.exists()));
    let contenders: Vec<Value> = cs
        .iter()
        .zip(&summaries)
        .map(
            |(c, s)| json!({ "label": c.label, "url": c.url, "model_name": c.model, "models": c.models, "summary": s, "rounds": c.rounds }),
        )
        .collect();
    let path = record::write_maybe_model(
        &a.out,
        "serve",
        model_file.as_deref(),
        json!({
            "command": redacted_command(),
            "url": a.url,
            "label": cs[0].label,
            "peer_url": a.peer_url,
            "peer_label": cs.get(1).map(|c| &c.label),
            "extra_body": cs[0].extra,
            "peer_extra_body": cs.get(1).map(|c| &c.extra),
            "endpoint": load.path(),
            "concurrency": a.concurrency,
            "requests": a.requests,
            "rounds": rounds,
            "warmup": a.warmup,
            "prompt_tokens": a.prompt_tokens,
            "max_tokens": a.max_tokens,
            "timeout_s": a.timeout,
            "example_request": serde_json::from_slice::<Value>(&load.spec(cs[0].model.as_deref(), &cs[0].extra, cs[0].id_base).body).unwrap_or_default(),
            "contenders": contenders,
            "comparison": comparison,
            "plot": "the .svg of the same name beside this record",
        }),
    )?;
    let svg_path = path.with_extension("svg");
    let series: Vec<(&str, Vec<f64>, Vec<f64>)> = cs
        .iter()
        .map(|c| {
            let ok = || c.rounds.iter().flat_map(Round::ok);
            (c.label.as_str(), sorted(ok().filter_map(|s| s.ttft_ms)), sorted(ok().flat_map(|s| s.itl_ms.iter().copied())))
        })
        .collect();
    std::fs::write(&svg_path, plot(&series)?).with_context(|| format!("writing {}", svg_path.display()))?;
    println!("record: {}\nplot: {}", path.display(), svg_path.display());
    Ok(())
}

fn table(a: &Args, rounds: usize, load: &Load, cs: &[Contender], ss: &[Summary], cmp: Option<&Comparison>) -> String {
    let mut t = String::new();
    let server_prompt = ss.iter().map(|s| format!("{:.0}", s.prompt_tokens_p50)).collect::<Vec<_>>().join(" / ");
    let _ = writeln!(
        t,
        "{} x {} requests per endpoint, {} in flight, ~{}-token prompts (server count p50: {server_prompt}), {} new tokens each, {}",
        rounds,
        a.requests,
        a.concurrency,
        a.prompt_tokens,
        a.max_tokens,
        load.path()
    );
    let w = cs.iter().map(|c| c.label.len()).max().unwrap_or(0).max(8);
    let _ = writeln!(
        t,
        "{:<w$} {:>5} {:>4} {:>9} {:>6} {:>9} {:>9} {:>8} {:>8} {:>8}",
        "endpoint", "ok", "err", "out tok/s", "req/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "TPOT p50"
    );
    for (c, s) in cs.iter().zip(ss) {
        let _ = writeln!(
            t,
            "{:<w$} {:>5} {:>4} {:>9.1} {:>6.2} {:>9.1} {:>9.1} {:>8.1} {:>8.1} {:>8.1}",
            c.label,
            s.ok,
            s.requests - s.ok,
            s.tok_s,
            s.req_s,
            s.ttft_p50_ms,
            s.ttft_p99_ms,
            s.itl_p50_ms,
            s.itl_p99_ms,
            s.tpot_p50_ms
        );
    }
    let _ = writeln!(t, "(latencies in ms; throughput is the median over rounds)");
    if let Some(r) = cmp {
        let _ = writeln!(
            t,
            "{} / {}: out tok/s {:.3}, req/s {:.3}, TTFT p50 {:.3}, ITL p50 {:.3}, TPOT p50 {:.3}",
            cs[0].label, cs[1].label, r.tok_s, r.req_s, r.ttft_p50, r.itl_p50, r.tpot_p50
        );
    }
    for (c, s) in cs.iter().zip(ss) {
        if !s.errors.is_empty() {
            let kinds: Vec<String> = s.errors.iter().map(|(k, n)| format!("{k} {n}")).collect();
            let first = c.rounds.iter().flat_map(|r| &r.samples).find_map(|x| x.error.as_ref()).map(|e| e.message.as_str());
            let _ = writeln!(t, "errors, {}: {} (first: {})", c.label, kinds.join(", "), first.unwrap_or_default());
        }
        if s.short > 0 {
            let _ = writeln!(t, "warning, {}: {} requests stopped before --max-tokens (ignore_eos not honoured?)", c.label, s.short);
        }
        if s.without_usage > 0 {
            let _ = writeln!(t, "warning, {}: {} streams carried no usage; their tokens are counted as chunks", c.label, s.without_usage);
        }
        if s.tokens_per_chunk > 1.05 {
            let _ = writeln!(t, "note, {}: {:.2} tokens per chunk, so ITL is per chunk; TPOT is per token", c.label, s.tokens_per_chunk);
        }
    }
    t
}

/// Two charts, the distributions (CDFs) of TTFT and of ITL, one line per endpoint. Each
/// series is sorted.
fn plot(series: &[(&str, Vec<f64>, Vec<f64>)]) -> Result<String> {
    let titles = ["time to first token: share of requests within x", "inter-token latency: share of gaps within x"];
    let ms_label = |v: &f64| if v.fract() == 0.0 { format!("{v:.0}") } else { format!("{v:.1}") };
    let charts: Vec<Chart> = titles
        .into_iter()
        .enumerate()
        .map(|(panel, title)| {
            let data: Vec<(&str, &Vec<f64>)> = series.iter().map(|s| (s.0, if panel == 0 { &s.1 } else { &s.2 })).collect();
            let xmax = data.iter().filter_map(|(_, v)| v.last().copied()).fold(0.0, f64::max).max(1e-3) * 1.05;
            // 201 quantiles draw the curve at any sample count.
            let cdf = |v: &Vec<f64>| (0..=200).map(|k| k as f64 / 2.0).map(|p| (quantile_sorted(v, p), p / 100.0)).collect();
            Chart {
                title,
                x_desc: "x (ms)",
                y_desc: "share",
                x: 0.0..xmax,
                y: 0.0..1.0,
                x_ticks: 5,
                x_label: &ms_label,
                legend: SeriesLabelPosition::LowerRight,
                lines: data.iter().map(|(label, v)| (*label, if v.is_empty() { vec![] } else { cdf(v) })).collect(),
            }
        })
        .collect();
    plot::svg(&charts, (400, 340))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    #[test]
    fn percentiles_interpolate() {
        assert!(percentile(&[], 50.0).is_nan());
        assert!(percentile(&[f64::NAN], 50.0).is_nan());
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
        assert_eq!(percentile(&[3.0, 1.0, 2.0, f64::NAN], 50.0), 2.0);
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 50.0), 2.5);
        let v: Vec<f64> = (1..=101).map(f64::from).collect();
        assert_eq!((percentile(&v, 0.0), percentile(&v, 99.0), percentile(&v, 100.0), percentile(&v, 250.0)), (1.0, 100.0, 101.0, 101.0));
    }

    #[test]
    fn prompts_differ_from_the_first_token() {
        let (a, b) = (prompt_text(3, 128), prompt_text(4, 128));
        assert!(a.starts_with("30000000: ") && b.starts_with("40000000: "));
        assert_ne!(a[10..60], b[10..60], "prompts share no run of words");
        assert_eq!(a.split(' ').count(), 1 + 128 - 9);
        assert_eq!(prompt_text(10_000_123, 128).split(' ').count(), a.split(' ').count());
        assert_eq!(prompt_text(123456, 2).split(' ').count(), 2);
        let body: Value =
            serde_json::from_slice(&request_body(Some("m"), true, "hi", 5, &json_object(r#"{"grammar": "g"}"#).unwrap())).unwrap();
        assert_eq!(
            (body["messages"][0]["content"].as_str(), body["max_tokens"].as_u64(), body["ignore_eos"].as_bool()),
            (Some("hi"), Some(5), Some(true))
        );
        assert_eq!(body["grammar"], "g");
        assert!(json_object("[1]").is_err());
    }

    #[test]
    fn commands_are_redacted() {
        // The test binary's own arguments hold no key; the function must keep them as they are.
        assert_eq!(redacted_command(), std::env::args().collect::<Vec<_>>());
    }

    /// A fake OpenAI server: each request gets `chunks` content events 5 ms apart, then usage
    /// saying `tokens` (so tokens must come from usage), then `[DONE]`, chunked; requests whose
    /// body has `"model":"busy"` get a 503 with an OpenAI error body, and `"model":"cut"` a
    /// stream that breaks off.
    async fn fake_server(chunks: usize, tokens: usize) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut req = Vec::new();
                    let mut buf = [0u8; 4096];
                    // Read the head and a body of Content-Length bytes.
                    loop {
                        let n = s.read(&mut buf).await.unwrap_or(0);
                        if n == 0 {
                            return;
                        }
                        req.extend_from_slice(&buf[..n]);
                        let text = String::from_utf8_lossy(&req).to_string();
                        if let Some(h) = text.find("\r\n\r\n") {
                            let len = text[..h]
                                .lines()
                                .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse().unwrap_or(0)))
                                .unwrap_or(0);
                            if req.len() >= h + 4 + len {
                                break;
                            }
                        }
                    }
                    let text = String::from_utf8_lossy(&req).to_string();
                    if text.starts_with("GET /v1/models") {
                        let body = r#"{"object":"list","data":[{"id":"fake-model"}]}"#;
                        let _ = s.write_all(format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}", body.len()).as_bytes()).await;
                        return;
                    }
                    if text.contains(r#""model":"busy""#) {
                        let body = r#"{"error":{"message":"too many requests","type":"server_busy"}}"#;
                        let head = format!("HTTP/1.1 503 Service Unavailable\r\ncontent-length: {}\r\n\r\n", body.len());
                        let _ = s.write_all((head + body).as_bytes()).await;
                        return;
                    }
                    let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n").await;
                    let mut events: Vec<String> = (0..chunks).map(|i| format!(r#"{{"choices":[{{"text":"t{i}"}}]}}"#)).collect();
                    events.push(format!(
                        r#"{{"choices":[{{"text":"","finish_reason":"length"}}],"usage":{{"prompt_tokens":9,"completion_tokens":{tokens}}}}}"#
                    ));
                    events.push("[DONE]".into());
                    if text.contains(r#""model":"cut""#) {
                        events.truncate(2);
                    }
                    for e in events {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        let sse = format!("data: {e}\n\n");
                        // Split each event over two chunks to exercise reassembly.
                        let (x, y) = sse.split_at(sse.len() / 2);
                        let _ = s.write_all(format!("{:x}\r\n{x}\r\n{:x}\r\n{y}\r\n", x.len(), y.len()).as_bytes()).await;
                    }
                    if !text.contains(r#""model":"cut""#) {
                        let _ = s.write_all(b"0\r\n\r\n").await;
                    }
                });
            }
        });
        format!("http://{addr}")
    }

    fn load() -> Load {
        Load { chat: false, prompt_tokens: 16, max_tokens: 8, timeout: Duration::from_secs(10) }
    }

    #[tokio::test]
    async fn measures_a_fake_server() {
        let url = fake_server(4, 8).await;
        let mut c = Contender::new(&url, None, None, Some("k".into()), 0).unwrap();
        c.discover().await;
        assert_eq!(c.model.as_deref(), Some("fake-model"));
        c.warm_up(&load(), 1, 1).await.unwrap();
        c.measure_round(&load(), 0, 6, 1, 3).await;
        let r = &c.rounds[0];
        let first = c.id_base + 1; // after the one warm-up request
        assert_eq!(r.samples.iter().map(|s| s.id).collect::<Vec<_>>(), (first..first + 6).collect::<Vec<_>>());
        for s in &r.samples {
            assert!(s.error.is_none(), "{:?}", s.error);
            assert!(s.ttft_ms.unwrap() > 0.0 && s.total_ms >= s.ttft_ms.unwrap());
            assert_eq!((s.chunks, s.itl_ms.len(), s.completion_tokens, s.prompt_tokens, s.tokens_from_usage), (4, 3, 8, Some(9), true));
            assert!(s.itl_ms.iter().all(|&g| g > 1.0), "events are 5 ms apart: {:?}", s.itl_ms);
        }
        let sum = summarize(&c.rounds, 8);
        assert_eq!((sum.ok, sum.short, sum.without_usage, sum.tokens_per_chunk), (6, 0, 0, 2.0));
        // 6 requests of 8 tokens, 3 at a time, each taking at least 30 ms.
        assert!(sum.tok_s > 0.0 && sum.tok_s < 48.0 / 0.06, "{}", sum.tok_s);
        assert!(sum.tpot_p50_ms > 0.0 && sum.tpot_p50_ms < sum.itl_p50_ms);
        let svg =
            plot(&[("a<b", sorted(r.samples.iter().filter_map(|s| s.ttft_ms)), sorted(r.samples.iter().flat_map(|s| s.itl_ms.clone())))])
                .unwrap();
        assert!(svg.contains("a&lt;b") && svg.contains("polyline"));
    }

    #[tokio::test]
    async fn counts_errors_by_kind() {
        let url = fake_server(4, 8).await;
        let mut rounds = Vec::new();
        for (i, model) in ["busy", "cut"].iter().enumerate() {
            let ep = Endpoint::parse(&url, None).unwrap();
            let (wall_s, samples) = phase(&ep, 0..2, 2, |id| load().spec(Some(model), &Map::new(), id)).await;
            rounds.push(Round { round: i, wall_s, samples });
        }
        let e = rounds[0].samples[0].error.as_ref().unwrap();
        assert_eq!((e.kind.as_str(), e.message.as_str()), ("http_503", "too many requests"));
        assert_eq!(rounds[1].samples[0].error.as_ref().unwrap().kind, "broken_stream");
        // Nothing listens on a port just released.
        let free = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
        let ep = Endpoint::parse(&format!("http://{free}"), None).unwrap();
        let (wall_s, samples) = phase(&ep, 0..1, 1, |id| load().spec(None, &Map::new(), id)).await;
        rounds.push(Round { round: 2, wall_s, samples });
        let s = summarize(&rounds, 8);
        assert_eq!(s.errors, BTreeMap::from([("broken_stream".into(), 2), ("connect".into(), 1), ("http_503".into(), 2)]));
        assert_eq!((s.ok, s.requests, s.tok_s), (0, 5, 0.0));
        let other = Contender::new(&format!("http://{free}"), None, Some("m".into()), None, 0).unwrap();
        assert!(other.warm_up(&load(), 1, 1).await.is_err());
    }

    #[test]
    fn comparisons_pair_rounds() {
        let s = |tok: Vec<f64>, ttft: f64| Summary {
            requests: 1,
            ok: 1,
            errors: BTreeMap::new(),
            tok_s: percentile(&tok, 50.0),
            req_s_rounds: tok.clone(),
            tok_s_rounds: tok,
            req_s: 1.0,
            ttft_p50_ms: ttft,
            ttft_p99_ms: ttft,
            itl_p50_ms: 2.0,
            itl_p99_ms: 2.0,
            tpot_p50_ms: 2.0,
            tokens_per_chunk: 1.0,
            prompt_tokens_p50: 1.0,
            completion_tokens_p50: 1.0,
            short: 0,
            without_usage: 0,
        };
        let c = compare(&s(vec![10.0, 20.0, 40.0], 50.0), &s(vec![5.0, 40.0, 20.0], 100.0));
        assert_eq!((c.tok_s, c.ttft_p50, c.itl_p50), (2.0, 0.5, 1.0));
    }
}
