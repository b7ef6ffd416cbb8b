//! The 2-worker route over a slow network: every hop behind a delaying proxy (`delay`), one
//! and many concurrent sessions, against llama.cpp RPC (two ggml-rpc-server processes driven
//! by llama-batched-bench) behind the same proxies, at each delay asked for.

use super::{median, peer, record};
use crate::batch::{routed, token_prompts};
use crate::delay::DelayProxies;
use crate::error::{BenchError, Context, Result};
use crate::model::{ModelArg, NumericsArg};
use crate::route::RpcServers;
use crate::swarm::{balanced_split, LocalSwarm};
use dgr_driver::Route;
use serde_json::json;
use std::path::PathBuf;
use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArg,
    #[command(flatten)]
    numerics: NumericsArg,
    /// Milliseconds each direction of every hop is delayed, comma-separated (0 measures loopback)
    #[arg(long, default_value = "0,20")]
    delay_ms: String,
    /// Concurrent sessions to measure, comma-separated
    #[arg(long, default_value = "1,16")]
    sessions: String,
    /// Compute threads of each process (each worker, each rpc-server)
    #[arg(long, short = 't', default_value_t = 1)]
    threads: usize,
    /// Prompt tokens of each session for the `tokens` prompts (prefilled before decode is timed)
    #[arg(long, default_value_t = 32)]
    prompt_tokens: usize,
    /// The prompts dgr's sessions decode from, comma-separated: `tokens` (--prompt-tokens
    /// deterministic token ids, as llama.cpp's are), `copy` (a text asking for a paragraph
    /// back: copy-heavy, what speculation drafts well), `free` (a text to continue freely)
    #[arg(long, value_enum, value_delimiter = ',', default_value = "tokens,copy,free")]
    prompts: Vec<PromptKind>,
    /// Tokens each session generates
    #[arg(long, default_value_t = 64)]
    gen_tokens: usize,
    /// Repetitions (each measures every contender at every delay and session count)
    #[arg(long, short = 'r', default_value_t = 1)]
    reps: usize,
    /// The llama-batched-bench binary [default: $DGR_REF_DIR/bin/llama-batched-bench]
    #[arg(long)]
    llama_batched_bench: Option<PathBuf>,
    /// The ggml-rpc-server binary [default: $DGR_REF_DIR/bin/ggml-rpc-server]
    #[arg(long)]
    rpc_server: Option<PathBuf>,
    /// Directory for the run's record
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
}

/// What a session's prompt is.
#[derive(clap::ValueEnum, Clone, Copy, PartialEq, Eq, Debug, serde::Serialize)]
#[serde(rename_all = "lowercase")]
enum PromptKind {
    Tokens,
    Copy,
    Free,
}

/// A copy-heavy prompt: the answer repeats the paragraph it was given.
const COPY: &str = "Copy the text exactly.\nText: The committee met on Tuesday to review the budget for the new library. \
After a long discussion, the members agreed to fund the reading room, the children's corner and the new computers, \
and to ask the city for the rest of the money before the end of the year.\nCopy: The committee met on Tuesday";
/// A free-form prompt: a story to continue.
const FREE: &str = "The history of the lighthouse keeper's family began in a small fishing village on the northern coast, where";

impl PromptKind {
    /// `b` sessions' prompts: distinct token ids, or each session the same text.
    fn prompts(self, tok: &dgr_tokenizer::Tokenizer, vocab: u32, b: usize, p: usize) -> Result<Vec<Vec<u32>>> {
        let text = match self {
            PromptKind::Tokens => return Ok(token_prompts(vocab, b, p)),
            PromptKind::Copy => COPY,
            PromptKind::Free => FREE,
        };
        let tokens = tok.encode_prompt(text).map_err(|e| BenchError::Measure(format!("tokenizing the {self:?} prompt: {e}")))?;
        Ok(vec![tokens; b])
    }
}

fn counts(flag: &str, s: &str) -> Result<Vec<u64>> {
    let v: Vec<u64> = s
        .split(',')
        .map(|x| x.trim().parse().map_err(|_| BenchError::Usage(format!("{flag}: {x:?} is not a count"))))
        .collect::<Result<_>>()?;
    if v.is_empty() {
        return Err(BenchError::Usage(format!("{flag} lists nothing")));
    }
    Ok(v)
}

pub fn run(a: Args) -> Result<()> {
    let delays = counts("--delay-ms", &a.delay_ms)?;
    let sessions: Vec<usize> = counts("--sessions", &a.sessions)?.into_iter().map(|b| b as usize).collect();
    if sessions.contains(&0) || a.gen_tokens < 2 {
        return Err(BenchError::Usage("--sessions must be positive and --gen-tokens at least 2".into()));
    }
    let model = a.model.path()?;
    let batched = peer::tool("llama-batched-bench", a.llama_batched_bench.as_deref())?;
    let rpc = peer::tool("ggml-rpc-server", a.rpc_server.as_deref())?;
    let g = a.model.open()?;
    let cfg = dgr_engine::ModelConfig::from_gguf(&g)?;
    // The workers as `dgr up` splits them, with the defaults `dgr worker` has.
    let ranges = balanced_split(&g, cfg.n_layers, 2);
    let swarm = LocalSwarm::start(&model, &ranges, a.threads, &a.numerics.worker_flags()?)?;
    let servers = RpcServers::start(&rpc, 2, a.threads)?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting a runtime")?;
    let vocab = cfg.vocab as u32;
    let tok = a.model.tokenizer(&g)?;
    let kinds = &a.prompts;
    let (nd, ns, nk) = (delays.len(), sessions.len(), kinds.len());
    // dgr: [prompt][delay][sessions] -> samples; llama.cpp: [delay][sessions]
    let (mut dgr, mut llama) = (vec![vec![vec![vec![]; ns]; nd]; nk], vec![vec![vec![]; ns]; nd]);
    let mut version = String::new();
    for rep in 0..a.reps {
        for (d, &ms) in delays.iter().enumerate() {
            let delay = Duration::from_millis(ms);
            // Every connection to a worker goes through its proxy: the driver's to each stage and
            // stage 0's to stage 1, so a token crosses three delayed hops, as across three hosts.
            let proxies = DelayProxies::start(&swarm.addrs, delay)?;
            let route = rt.block_on(Route::discover(&proxies.addrs, Duration::from_secs(30)))?;
            routed(&rt, &route, token_prompts(vocab, 1, a.prompt_tokens), 4)?; // warm-up: links open
            for (k, kind) in kinds.iter().enumerate() {
                for (i, &b) in sessions.iter().enumerate() {
                    dgr[k][d][i].push(routed(&rt, &route, kind.prompts(&tok, vocab, b, a.prompt_tokens)?, a.gen_tokens)?);
                }
            }
            let rpc_proxies = DelayProxies::start(&servers.addrs, delay)?;
            let rpc = peer::PeerDevice::Rpc(rpc_proxies.addrs.join(","));
            let (l, v) = peer::llama_batched(&batched, &model, a.threads, &sessions, a.prompt_tokens, a.gen_tokens, &rpc)?;
            for (i, s) in l.into_iter().enumerate() {
                llama[d][i].push(s);
            }
            version = v;
            let show =
                |x: &[Vec<f64>]| x.iter().map(|s| format!("{:.1}", s.last().copied().unwrap_or(f64::NAN))).collect::<Vec<_>>().join(" / ");
            let dgr_now: Vec<String> = kinds.iter().zip(&dgr).map(|(k, x)| format!("{k:?} {}", show(&x[d]))).collect();
            eprintln!(
                "rep {rep}, {ms} ms: dgr {} tok/s, llama.cpp RPC {} tok/s ({:?} sessions)",
                dgr_now.join(", "),
                show(&llama[d]),
                sessions
            );
        }
    }
    drop(servers);
    let split: Vec<String> = ranges.iter().map(|r| format!("{}..{}", r.start, r.end)).collect();
    println!(
        "aggregate decode tok/s through a 2-worker route ({}), every hop delayed each way; {}-token prompts, {} generated, {} threads per process",
        split.join(" + "),
        a.prompt_tokens,
        a.gen_tokens,
        a.threads
    );
    println!(
        "{:>8} {:>9} {:>8} {:>10} {:>10} {:>11} {:>16}",
        "delay ms", "sessions", "prompt", "dgr", "llama.cpp", "dgr/llama", "dgr vs 0 ms"
    );
    let zero = delays.iter().position(|&d| d == 0);
    let mut rows = Vec::new();
    for (d, &ms) in delays.iter().enumerate() {
        for (i, &b) in sessions.iter().enumerate() {
            for (k, kind) in kinds.iter().enumerate() {
                let (x, l) = (median(&dgr[k][d][i]), median(&llama[d][i]));
                let kept = zero.map(|z| x / median(&dgr[k][z][i]));
                let kept_s = kept.map(|r| format!("{r:.3}")).unwrap_or_else(|| "-".into());
                let name = format!("{kind:?}").to_lowercase();
                println!("{ms:>8} {b:>9} {name:>8} {x:>10.1} {l:>10.1} {:>11.3} {kept_s:>16}", x / l);
                rows.push(json!({
                    "delay_ms": ms, "sessions": b, "prompt": kind, "dgr": x, "llama_rpc": l,
                    "dgr_vs_llama": x / l, "dgr_vs_zero_delay": kept,
                }));
            }
        }
    }
    let path = record::write(
        &a.out,
        "wan",
        &model,
        json!({
            "split": split,
            "proxy": "every hop behind a delaying TCP proxy on loopback (crates/bench/src/delay.rs): each direction delayed, no bandwidth cap",
            "peer": { "tool": "llama-batched-bench --rpc (-ngl 99) with 2 ggml-rpc-server processes, each behind the same proxy", "version": version },
            "threads": a.threads,
            "prompt_tokens": a.prompt_tokens,
            "prompts": { "kinds": kinds, "copy": COPY, "free": FREE, "llama_rpc": "llama-batched-bench's own, --prompt-tokens long" },
            "gen_tokens": a.gen_tokens,
            "samples": { "delay_ms": delays, "sessions": sessions, "prompts": kinds, "dgr_route": dgr, "llama_rpc": llama },
            "table": rows,
        }),
    )?;
    println!("record: {}", path.display());
    Ok(())
}
