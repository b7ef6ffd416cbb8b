//! `dgr bench prefix`: what the prefix caches buy, through `dgr up` with its defaults, against
//! the same with `--prefix-cache-mb 0` and against llama-server with its prompt cache, all
//! started by the bench on the same model and cores.
//! Part A: the second turn of chats whose first user message is long (its TTFT over the first
//! turn's). Part B: rounds of requests sharing one long system message, N in flight
//! (aggregate throughput), the contenders in turn within each round.

use super::{median, record, spread};
use crate::error::{BenchError, Context, Result};
use crate::model::ModelArg;
use crate::peer;
use crate::serve::{self, phase, prompt_text, stream_body, Round, Summary};
use crate::serve_client::{self as client, Endpoint, RequestSpec, Sample};
use crate::servers::{self, Server};
use serde::Serialize;
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArg,
    /// Part A: chats, each with a distinct first user message (so its first turn is cold)
    #[arg(long, default_value_t = 5)]
    chats: usize,
    /// Length in tokens, roughly (common words, about one token each), of each chat's first
    /// user message (part A) and of the system message part B's requests share
    #[arg(long, default_value_t = 1000)]
    prefix_tokens: usize,
    /// Part B: requests per round, each the round's system message and a distinct short user
    /// message
    #[arg(long, short = 'n', default_value_t = 64)]
    requests: usize,
    /// Part B: requests in flight at once (also llama-server's -np)
    #[arg(long, short = 'c', default_value_t = 8)]
    concurrency: usize,
    /// Part B: rounds, each measuring every contender once, in turn (a fresh system message per
    /// round and contender, so each round starts cold)
    #[arg(long, short = 'r', default_value_t = 5)]
    rounds: usize,
    /// Tokens generated per request: exactly this many in part B (ignore_eos); part A's answers
    /// end at this or at the model's end of turn
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// llama-server's threads [default: this machine's cores, the budget dgr up divides among
    /// its workers]
    #[arg(long, short = 't')]
    threads: Option<usize>,
    /// The llama-server binary [default: $DGR_REF_DIR/bin/llama-server]
    #[arg(long)]
    llama_server: Option<PathBuf>,
    /// Seconds one request may take
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
}

/// Part A's second user message.
const FOLLOW_UP: &str = "Thanks. Now say that again in one short sentence.";

/// The messages of a chat's second turn: the first turn's, the answer it got, a new question.
pub fn second_turn(first: &str, answer: &str, follow_up: &str) -> Value {
    json!([
        { "role": "user", "content": first },
        { "role": "assistant", "content": answer },
        { "role": "user", "content": follow_up },
    ])
}

/// Part B's request `id` of a round: the round's system message and a short user message
/// distinct from its first tokens.
pub fn shared_system(system: &str, id: usize) -> Value {
    json!([{ "role": "system", "content": system }, { "role": "user", "content": prompt_text(id, 16) }])
}

/// One server under measurement.
struct Contender {
    label: String,
    server: Server,
    ep: Endpoint,
    model: Option<String>,
    chats: Vec<Chat>,
    rounds: Vec<Round>,
}

impl Contender {
    async fn new(label: &str, mut server: Server) -> Result<Contender> {
        server.healthy().await?;
        let ep = server.endpoint()?;
        let models = client::get_json(&ep, "/v1/models", Duration::from_secs(10)).await;
        let model = models.ok().and_then(|v| v["data"][0]["id"].as_str().map(str::to_string));
        Ok(Contender { label: label.into(), server, ep, model, chats: Vec::new(), rounds: Vec::new() })
    }

    fn spec(&self, messages: Value, max_tokens: usize, ignore_eos: bool, timeout: Duration) -> RequestSpec {
        let mut b = stream_body(self.model.as_deref(), max_tokens, ignore_eos);
        b["messages"] = messages;
        RequestSpec { path: "/v1/chat/completions", body: b.to_string().into_bytes(), chat: true, timeout }
    }

    /// One request, failing the run if it fails: the server is not working.
    async fn send(&self, id: usize, messages: Value, max_tokens: usize, ignore_eos: bool, timeout: Duration) -> Result<Sample> {
        let s = client::measure(&self.ep, &self.spec(messages, max_tokens, ignore_eos, timeout), id, Instant::now()).await;
        match &s.error {
            Some(e) => Err(BenchError::Endpoint(format!("{}: request {id} failed: {}: {}", self.label, e.kind, e.message))),
            None => Ok(s),
        }
    }
}

/// Part A's measure of one chat.
#[derive(Serialize)]
struct Chat {
    chat: usize,
    first: Sample,
    second: Sample,
    /// The first turn's answer, sent back in the second.
    answer: String,
}

impl Chat {
    fn ratio(&self) -> f64 {
        match (self.first.ttft_ms, self.second.ttft_ms) {
            (Some(a), Some(b)) => b / a,
            _ => f64::NAN,
        }
    }
}

/// The median of samples with their smallest and largest.
#[derive(Serialize, Debug, PartialEq)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(v: &[f64]) -> Spread {
        let v: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
        let (min, max) = spread(&v);
        Spread { median: median(&v), min, max }
    }
}

impl std::fmt::Display for Spread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.3} ({:.3}..{:.3})", self.median, self.min, self.max)
    }
}

/// Part A's numbers for one contender.
#[derive(Serialize, Debug)]
pub struct ChatSummary {
    pub first_ttft_ms: Spread,
    pub second_ttft_ms: Spread,
    /// Second-turn TTFT over first-turn TTFT, per chat.
    pub ratio: Spread,
    pub first_prompt_tokens_p50: f64,
    pub second_prompt_tokens_p50: f64,
    pub second_cached_tokens_p50: f64,
}

fn chat_summary(chats: &[Chat]) -> ChatSummary {
    let col = |f: &dyn Fn(&Chat) -> Option<f64>| chats.iter().map(|c| f(c).unwrap_or(f64::NAN)).collect::<Vec<f64>>();
    let p50 = |v: Vec<f64>| serve::percentile(&v, 50.0);
    ChatSummary {
        first_ttft_ms: Spread::of(&col(&|c| c.first.ttft_ms)),
        second_ttft_ms: Spread::of(&col(&|c| c.second.ttft_ms)),
        ratio: Spread::of(&col(&|c| Some(c.ratio()))),
        first_prompt_tokens_p50: p50(col(&|c| c.first.prompt_tokens.map(|t| t as f64))),
        second_prompt_tokens_p50: p50(col(&|c| c.second.prompt_tokens.map(|t| t as f64))),
        second_cached_tokens_p50: p50(col(&|c| c.second.cached_tokens.map(|t| t as f64))),
    }
}

/// Part B's numbers for one contender beyond `serve`'s summary: prompt throughput and how much
/// of the prompts the server's cache answered.
#[derive(Serialize, Debug)]
pub struct CacheSummary {
    /// Prompt tokens of the round's successful requests over its wall time, per round.
    pub prompt_tok_s_rounds: Vec<f64>,
    /// Cached prompt tokens over all prompt tokens, per round (NaN where the server gave no counts).
    pub cached_share_rounds: Vec<f64>,
    /// Requests per round whose cache answered less than half their prompt.
    pub cold_rounds: Vec<usize>,
}

fn ok(r: &Round) -> Vec<&Sample> {
    r.samples.iter().filter(|s| s.error.is_none()).collect()
}

fn cache_summary(rounds: &[Round]) -> CacheSummary {
    let prompt = |r: &Round| ok(r).iter().filter_map(|s| s.prompt_tokens).sum::<u64>() as f64;
    CacheSummary {
        prompt_tok_s_rounds: rounds.iter().map(|r| prompt(r) / r.wall_s).collect(),
        cached_share_rounds: rounds
            .iter()
            .map(|r| {
                let cached: Option<u64> = ok(r).iter().map(|s| s.cached_tokens).sum();
                cached.map_or(f64::NAN, |c| c as f64 / prompt(r))
            })
            .collect(),
        cold_rounds: rounds
            .iter()
            .map(|r| ok(r).iter().filter(|s| s.cached_tokens.unwrap_or(0) * 2 < s.prompt_tokens.unwrap_or(0)).count())
            .collect(),
    }
}

/// Per-round ratios of `a` over `b`, rounds paired in the order they ran.
fn paired(a: &[f64], b: &[f64]) -> Spread {
    Spread::of(&a.iter().zip(b).map(|(x, y)| x / y).collect::<Vec<_>>())
}

/// The contenders' labels: dgr up with its defaults, the same with the cache off, llama-server.
fn labels(np: usize) -> [String; 3] {
    ["dgr up".into(), "dgr up --prefix-cache-mb 0".into(), format!("llama-server -np {np}")]
}

pub fn run(a: Args) -> Result<()> {
    if a.chats == 0 || a.requests == 0 || a.concurrency == 0 || a.rounds == 0 || a.max_tokens == 0 || a.prefix_tokens == 0 {
        return Err(BenchError::Usage(
            "--chats, --requests, --concurrency, --rounds, --max-tokens and --prefix-tokens must be positive".into(),
        ));
    }
    let model = a.model.path()?;
    let bin = peer::tool("llama-server", a.llama_server.as_deref())?;
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let threads = a.threads.unwrap_or(cores);
    // Each slot holds a whole request: the long message, the answer and the new message.
    let slot_ctx = (a.prefix_tokens * 3 / 2 + 2 * a.max_tokens + 256).next_power_of_two();
    let llama_flags: Vec<String> =
        ["-np", &a.concurrency.to_string(), "-c", &(slot_ctx * a.concurrency).to_string(), "-t", &threads.to_string()]
            .map(String::from)
            .to_vec();
    let timeout = Duration::from_secs(a.timeout);
    let names = labels(a.concurrency);
    eprintln!("starting {}, {} and {} …", names[0], names[1], names[2]);
    let servers = [
        Server::dgr_up(&model, &[])?,
        Server::dgr_up(&model, &["--prefix-cache-mb".into(), "0".into()])?,
        Server::llama_server(&bin, &model, &llama_flags)?,
    ];
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting a runtime")?;
    let mut cs = rt.block_on(async {
        let mut cs = Vec::new();
        for (label, server) in names.iter().zip(servers) {
            cs.push(Contender::new(label, server).await?);
        }
        // One short request each, so no first measured request pays for a cold start.
        for (i, c) in cs.iter().enumerate() {
            c.send(i, json!([{ "role": "user", "content": prompt_text(9_000_000 + i, 8) }]), 4, true, timeout).await?;
        }
        Ok::<_, BenchError>(cs)
    })?;
    let n = cs.len();
    rt.block_on(async {
        // Part A: each chat on every contender in turn, its first turn's text distinct per
        // contender so that no server has seen it.
        for chat in 0..a.chats {
            for (i, c) in cs.iter_mut().enumerate() {
                let id = 1_000_000 + chat * n + i;
                let first_msg = prompt_text(id, a.prefix_tokens);
                let first = c.send(id, json!([{ "role": "user", "content": first_msg }]), a.max_tokens, false, timeout).await?;
                let answer = first.text.clone();
                let second = c.send(id, second_turn(&first_msg, &answer, FOLLOW_UP), a.max_tokens, false, timeout).await?;
                let chat = Chat { chat, first, second, answer };
                eprintln!(
                    "chat {} {}: TTFT {:.0} ms then {:.0} ms ({:.3}), {:?} of {:?} prompt tokens cached",
                    chat.chat,
                    c.label,
                    chat.first.ttft_ms.unwrap_or(f64::NAN),
                    chat.second.ttft_ms.unwrap_or(f64::NAN),
                    chat.ratio(),
                    chat.second.cached_tokens,
                    chat.second.prompt_tokens
                );
                c.chats.push(chat);
            }
        }
        // Part B: in each round every contender once, the order rotating, each with a system
        // message of its own.
        for round in 0..a.rounds {
            for k in 0..n {
                let i = (round + k) % n;
                let c = &mut cs[i];
                let system = prompt_text(2_000_000 + round * n + i, a.prefix_tokens);
                let spec = |id| c.spec(shared_system(&system, id), a.max_tokens, true, timeout);
                let (wall_s, samples) = phase(&c.ep, 0..a.requests, a.concurrency, spec).await;
                let r = Round { round, wall_s, samples };
                let ok = r.samples.iter().filter(|s| s.error.is_none()).count();
                eprintln!("round {round} {}: {:.2} req/s, {ok}/{} ok", c.label, ok as f64 / wall_s, a.requests);
                c.rounds.push(r);
            }
        }
        Ok::<_, BenchError>(())
    })?;

    let chats: Vec<ChatSummary> = cs.iter().map(|c| chat_summary(&c.chats)).collect();
    let loads: Vec<Summary> = cs.iter().map(|c| serve::summarize(&c.rounds, a.max_tokens)).collect();
    let caches: Vec<CacheSummary> = cs.iter().map(|c| cache_summary(&c.rounds)).collect();
    let vs = |x: usize, y: usize| {
        json!({
            "a": cs[x].label, "b": cs[y].label,
            "req_s": paired(&loads[x].req_s_rounds, &loads[y].req_s_rounds),
            "out_tok_s": paired(&loads[x].tok_s_rounds, &loads[y].tok_s_rounds),
            "prompt_tok_s": paired(&caches[x].prompt_tok_s_rounds, &caches[y].prompt_tok_s_rounds),
        })
    };
    let ratios = [vs(0, 1), vs(0, 2)];
    let text = table(&a, &cs, &chats, &loads, &caches);
    print!("{text}");
    // `dgr up` says its split as "… layers 0..19 + 19..30, 1 thread(s) each …".
    let split: Option<Vec<String>> = cs[0].server.log().lines().find_map(|l| {
        let (_, ranges) = l.split_once(" layers ")?;
        Some(ranges.split(',').next()?.split(" + ").map(|r| r.trim().to_string()).collect())
    });
    let contenders: Vec<Value> = cs
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({
                "label": c.label, "command": c.server.command, "model_name": c.model,
                "part_a": { "summary": chats[i], "chats": c.chats },
                "part_b": { "summary": loads[i], "cache": caches[i], "rounds": c.rounds },
            })
        })
        .collect();
    let path = record::write(
        &a.out,
        "prefix",
        &model,
        json!({
            "split": split,
            "llama_server": { "version": servers::llama_version(&bin), "flags": llama_flags, "threads": threads },
            "threads": { "machine_cores": cores, "dgr_up": "the cores divided among its workers (see split)", "llama_server": threads },
            "chats": a.chats,
            "prefix_tokens": a.prefix_tokens,
            "follow_up": FOLLOW_UP,
            "requests": a.requests,
            "concurrency": a.concurrency,
            "rounds": a.rounds,
            "max_tokens": a.max_tokens,
            "timeout_s": a.timeout,
            "example_requests": {
                "part_a_first": serde_json::from_slice::<Value>(&cs[0].spec(json!([{ "role": "user", "content": "FIRST" }]), a.max_tokens, false, timeout).body).unwrap_or_default(),
                "part_b": serde_json::from_slice::<Value>(&cs[0].spec(shared_system("SYSTEM", 0), a.max_tokens, true, timeout).body).unwrap_or_default(),
            },
            "ratios": ratios,
            "table": text,
            "contenders": contenders,
        }),
    )?;
    println!("record: {}", path.display());
    Ok(())
}

fn table(a: &Args, cs: &[Contender], chats: &[ChatSummary], loads: &[Summary], caches: &[CacheSummary]) -> String {
    let mut t = String::new();
    let w = cs.iter().map(|c| c.label.len()).max().unwrap_or(0).max(9);
    let _ = writeln!(
        t,
        "part A: {} chats, the first user message ~{} tokens (server count p50: {}), the second turn +{} tokens (p50: {}), streamed",
        a.chats,
        a.prefix_tokens,
        chats.iter().map(|s| format!("{:.0}", s.first_prompt_tokens_p50)).collect::<Vec<_>>().join(" / "),
        a.max_tokens,
        chats.iter().map(|s| format!("{:.0}", s.second_prompt_tokens_p50)).collect::<Vec<_>>().join(" / "),
    );
    let _ = writeln!(
        t,
        "{:<w$} {:>12} {:>12} {:>26} {:>14}",
        "contender", "TTFT 1 p50", "TTFT 2 p50", "turn 2 / turn 1 (min..max)", "cached 2 p50"
    );
    for (c, s) in cs.iter().zip(chats) {
        let _ = writeln!(
            t,
            "{:<w$} {:>12.1} {:>12.1} {:>26} {:>14.0}",
            c.label,
            s.first_ttft_ms.median,
            s.second_ttft_ms.median,
            s.ratio.to_string(),
            s.second_cached_tokens_p50
        );
    }
    let _ = writeln!(t, "target: {} turn 2 / turn 1 <= 0.15: {}", cs[0].label, verdict(chats[0].ratio.median <= 0.15));
    let _ = writeln!(
        t,
        "\npart B: {} rounds x {} requests, {} in flight, each a ~{}-token system message (one per round and contender) + a short user message (server count p50: {}), {} tokens each (ignore_eos)",
        a.rounds,
        a.requests,
        a.concurrency,
        a.prefix_tokens,
        loads.iter().map(|s| format!("{:.0}", s.prompt_tokens_p50)).collect::<Vec<_>>().join(" / "),
        a.max_tokens
    );
    let _ = writeln!(
        t,
        "{:<w$} {:>5} {:>4} {:>7} {:>10} {:>13} {:>9} {:>13} {:>11}",
        "contender", "ok", "err", "req/s", "out tok/s", "prompt tok/s", "TTFT p50", "cached share", "cold/round"
    );
    for ((c, s), k) in cs.iter().zip(loads).zip(caches) {
        let _ = writeln!(
            t,
            "{:<w$} {:>5} {:>4} {:>7.3} {:>10.1} {:>13.1} {:>9.1} {:>13.3} {:>11}",
            c.label,
            s.ok,
            s.requests - s.ok,
            s.req_s,
            s.tok_s,
            median(&k.prompt_tok_s_rounds),
            s.ttft_p50_ms,
            median(&k.cached_share_rounds),
            k.cold_rounds.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(",")
        );
    }
    let _ = writeln!(t, "(throughput: the median over rounds; TTFT in ms, pooled)");
    for (x, y, target) in [(0, 1, 2.0), (0, 2, 1.0)] {
        let r = paired(&loads[x].req_s_rounds, &loads[y].req_s_rounds);
        let _ =
            writeln!(t, "{} / {}: req/s {r} per round; target >= {target:.1}: {}", cs[x].label, cs[y].label, verdict(r.median >= target));
    }
    for (c, s) in cs.iter().zip(loads) {
        if !s.errors.is_empty() {
            let _ = writeln!(t, "errors, {}: {:?}", c.label, s.errors);
        }
        if s.short > 0 {
            let _ = writeln!(t, "warning, {}: {} requests stopped before --max-tokens (ignore_eos not honoured?)", c.label, s.short);
        }
    }
    t
}

fn verdict(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "missed"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_second_turn_carries_the_first_and_its_answer() {
        for (first, answer) in [("a long question", "an answer"), ("q", ""), ("\"quoted\"\n", "multi\nline")] {
            let m = second_turn(first, answer, FOLLOW_UP);
            let roles: Vec<&str> = m.as_array().unwrap().iter().map(|x| x["role"].as_str().unwrap()).collect();
            assert_eq!(roles, ["user", "assistant", "user"]);
            assert_eq!(
                (m[0]["content"].as_str(), m[1]["content"].as_str(), m[2]["content"].as_str()),
                (Some(first), Some(answer), Some(FOLLOW_UP))
            );
        }
    }

    #[test]
    fn shared_system_requests_differ_only_after_the_system_message() {
        let system = prompt_text(7, 1000);
        let (a, b) = (shared_system(&system, 1), shared_system(&system, 2));
        assert_eq!(a[0], b[0]);
        assert_eq!(a[0]["role"], "system");
        let (ua, ub) = (a[1]["content"].as_str().unwrap(), b[1]["content"].as_str().unwrap());
        assert_ne!(ua.split(' ').next(), ub.split(' ').next(), "distinct from their first token");
        assert!(ua.split(' ').count() < 20 && system.split(' ').count() > 900);
    }

    fn sample(ttft: Option<f64>, prompt: u64, cached: Option<u64>, error: bool) -> Sample {
        Sample {
            id: 0,
            start_ms: 0.0,
            ttft_ms: ttft,
            total_ms: 10.0,
            itl_ms: vec![],
            chunks: 1,
            prompt_tokens: Some(prompt),
            cached_tokens: cached,
            completion_tokens: 4,
            text: String::new(),
            tokens_from_usage: true,
            error: error.then(|| client::SampleError { kind: "timeout".into(), message: String::new() }),
        }
    }

    #[test]
    fn chats_summarise_by_ratio() {
        let chat = |i, t1, t2| Chat {
            chat: i,
            first: sample(Some(t1), 1000, Some(0), false),
            second: sample(t2, 1050, Some(1024), false),
            answer: String::new(),
        };
        let cs = [chat(0, 4000.0, Some(400.0)), chat(1, 2000.0, Some(100.0)), chat(2, 1000.0, None), chat(3, 1000.0, Some(300.0))];
        let s = chat_summary(&cs);
        assert_eq!(s.ratio, Spread { median: 0.1, min: 0.05, max: 0.3 });
        assert_eq!((s.first_ttft_ms.median, s.second_ttft_ms.median, s.second_cached_tokens_p50), (1500.0, 300.0, 1024.0));
        assert_eq!(format!("{}", s.ratio), "0.100 (0.050..0.300)");
    }

    #[test]
    fn rounds_count_cache_shares_and_cold_requests() {
        let round = |samples: Vec<Sample>| Round { round: 0, wall_s: 2.0, samples };
        let rounds = [
            round(vec![sample(Some(1.0), 1000, Some(0), false), sample(Some(1.0), 1000, Some(992), false), sample(None, 1000, None, true)]),
            round(vec![sample(Some(1.0), 1000, None, false)]),
        ];
        let c = cache_summary(&rounds);
        assert_eq!(c.prompt_tok_s_rounds, [1000.0, 500.0]);
        assert_eq!(c.cached_share_rounds[0], 0.496);
        assert!(c.cached_share_rounds[1].is_nan(), "no counts, no share");
        assert_eq!(c.cold_rounds, [1, 1]);
        assert_eq!(paired(&[4.0, 3.0, 10.0], &[2.0, 1.0, 10.0]), Spread { median: 2.0, min: 1.0, max: 3.0 });
    }
}
