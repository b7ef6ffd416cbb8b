use super::{median, peer, prompt, record, spread};
use crate::bandwidth::{self, Reader};
use crate::error::{BenchError, Result};
use crate::model::{ModelArg, NumericsArg};
use dgr_engine::{open_engine, Engine, Input, LogitRows, SeqInput};
use dgr_gguf::Gguf;
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArg,
    #[command(flatten)]
    numerics: NumericsArg,
    /// Compute threads, for dgr and llama.cpp alike
    #[arg(long, short = 't', default_value_t = 2)]
    threads: usize,
    /// Prompt length of the prefill test (llama-bench's pp512)
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Tokens generated in the decode test (llama-bench's tg128)
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// MiB of the buffer this machine's streaming read bandwidth is measured on with the same
    /// threads, each repetition, to set decode's rate beside (0: not measured; never on a GPU)
    #[arg(long, default_value_t = bandwidth::DEFAULT_MIB)]
    bandwidth_mib: usize,
    /// Paired repetitions (dgr, then llama-bench, each time)
    #[arg(long, short = 'r', default_value_t = 5)]
    reps: usize,
    /// The llama-bench binary [default: $DGR_REF_DIR/bin/llama-bench]
    #[arg(long)]
    llama_bench: Option<PathBuf>,
    /// The GGUF file llama-bench runs [default: the model; needed when the model is a
    /// Transformers checkpoint: its conversion by llama.cpp's convert_hf_to_gguf.py]
    #[arg(long)]
    peer_model: Option<PathBuf>,
    /// Also time Transformers' own CPU generation on the checkpoint, with this Python (one
    /// that has torch and transformers, e.g. target/hf-venv/bin/python from scripts/hf-ref.sh)
    #[arg(long)]
    transformers: Option<PathBuf>,
    /// Directory for the run's record
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
}

/// dgr's prefill and decode rates (tokens/s) for one repetition, shaped like llama-bench's tests:
/// a prompt of `p` tokens into an empty cache, and `n` single-token steps from an empty cache.
fn dgr_rep(stage: &impl Engine, p: usize, n: usize) -> Result<(f64, f64)> {
    let vocab = stage.config().vocab as u32;
    let prompt = prompt(vocab, 0, p);
    let mut kv = stage.new_state(p, stage.layers())?;
    let t = Instant::now();
    stage.forward(&mut [SeqInput { kv: &mut kv, input: Input::Tokens(&prompt), logits: LogitRows::Last }])?;
    let prefill = p as f64 / t.elapsed().as_secs_f64();
    let mut kv = stage.new_state(n, stage.layers())?;
    let mut token = 1u32;
    let t = Instant::now();
    for _ in 0..n {
        let out = stage.forward(&mut [SeqInput { kv: &mut kv, input: Input::Tokens(&[token]), logits: LogitRows::Last }])?;
        token = dgr_engine::argmax(&out[0].logits);
    }
    Ok((prefill, n as f64 / t.elapsed().as_secs_f64()))
}

/// The weight bytes one decode step reads: every tensor, but only one row of the embedding when
/// a head of its own stands in for it.
fn weight_bytes_per_token(g: &Gguf) -> u64 {
    let untied = g.tensor("output.weight").is_some();
    g.tensors().iter().filter(|t| !(untied && t.name == "token_embd.weight")).map(|t| t.n_bytes).sum()
}

pub fn run(a: Args) -> Result<()> {
    let model = a.model.path()?;
    let bench = peer::tool("llama-bench", a.llama_bench.as_deref())?;
    let peer_model = match &a.peer_model {
        Some(p) => p.clone(),
        None if model.is_dir() => {
            let why = format!("{} is a Transformers checkpoint: give llama-bench its GGUF with --peer-model", model.display());
            return Err(BenchError::Usage(why));
        }
        None => model.clone(),
    };
    if a.transformers.is_some() && !model.is_dir() {
        return Err(BenchError::Usage(format!("--transformers times a Transformers checkpoint; {} is not one", model.display())));
    }
    let g = a.model.open()?;
    let n_layers = dgr_engine::ModelConfig::from_gguf(&g)?.n_layers;
    let per_token = weight_bytes_per_token(&g);
    let spec = a.numerics.spec(a.threads);
    let device = peer::PeerDevice::of(spec.backend);
    // Host memory's read rate says nothing of a GPU's decode: measured for the CPU only.
    let reader = if a.bandwidth_mib > 0 && device == peer::PeerDevice::Cpu { Some(Reader::new(a.bandwidth_mib, a.threads)?) } else { None };
    let stage = open_engine(g, 0..n_layers, spec)?;
    dgr_rep(&stage, a.prompt_tokens, a.gen_tokens)?; // warm-up: page in the weights
    let (mut dp, mut dd, mut lp, mut ld, mut tp, mut td) = (vec![], vec![], vec![], vec![], vec![], vec![]);
    let mut bw = vec![];
    let (mut version, mut hf_version, mut peer_on) = (String::new(), String::new(), (String::new(), String::new()));
    for rep in 0..a.reps {
        let (p, d) = dgr_rep(&stage, a.prompt_tokens, a.gen_tokens)?;
        let l = peer::llama_bench(&bench, &peer_model, a.threads, a.prompt_tokens, a.gen_tokens, &device)?;
        eprintln!("rep {rep}: dgr pp {p:.1} tg {d:.1} tok/s | llama.cpp pp {:.1} tg {:.1} tok/s", l.prompt_tok_s, l.gen_tok_s);
        if let Some(r) = &reader {
            bw.push(r.median_gb_s(3));
        }
        if let Some(py) = &a.transformers {
            let t = peer::transformers(py, &model, a.threads, a.prompt_tokens, a.gen_tokens)?;
            eprintln!("        transformers pp {:.1} tg {:.1} tok/s", t.prompt_tok_s, t.gen_tok_s);
            tp.push(t.prompt_tok_s);
            td.push(t.gen_tok_s);
            hf_version = t.version;
        }
        dp.push(p);
        dd.push(d);
        lp.push(l.prompt_tok_s);
        ld.push(l.gen_tok_s);
        version = l.version;
        peer_on = (l.backends, l.gpu_info);
    }
    let ratios = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x / y).collect::<Vec<_>>();
    let ratio = |a: &[f64], b: &[f64]| median(&ratios(a, b));
    let (rp, rd) = (ratio(&dp, &lp), ratio(&dd, &ld));
    println!("threads {}  isa {}  reps {}  engine {}", a.threads, stage.isa().map_or("-", |i| i.name()), a.reps, stage.engine());
    println!("{:<28} {:>12} {:>12} {:>8} {:>15}", "test", "dgr tok/s", "llama tok/s", "ratio", "ratio min–max");
    let row = |test: String, d: &[f64], l: &[f64]| {
        let (lo, hi) = spread(&ratios(d, l));
        println!("{test:<28} {:>12.1} {:>12.1} {:>8.3} {:>15}", median(d), median(l), ratio(d, l), format!("{lo:.3}–{hi:.3}"));
    };
    row(format!("prefill pp{}", a.prompt_tokens), &dp, &lp);
    row(format!("decode tg{}", a.gen_tokens), &dd, &ld);
    println!("llama.cpp computed on {}{}", peer_on.0, if peer_on.1.is_empty() { String::new() } else { format!(" ({})", peer_on.1) });
    let memory = stage.device_memory();
    if let Some(m) = memory {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        println!("device memory: this process holds {:.0} MiB of {:.0} MiB, {:.0} MiB free", mib(m.used), mib(m.total), mib(m.free));
    }
    let decode_gb_s: Vec<f64> = dd.iter().map(|d| d * per_token as f64 / 1e9).collect();
    let mut bandwidth = json!({ "weight_bytes_per_token": per_token, "dgr_decode_gb_s": decode_gb_s });
    if !bw.is_empty() {
        let fraction = ratios(&decode_gb_s, &bw);
        let (lo, hi) = spread(&fraction);
        println!(
            "decode reads {:.3} GB of weights a token: {:.1} GB/s, {:.1}% (min–max {:.1}–{:.1}%) of this machine's streaming read, {:.1} GB/s on {} threads",
            per_token as f64 / 1e9,
            median(&decode_gb_s),
            100.0 * median(&fraction),
            100.0 * lo,
            100.0 * hi,
            median(&bw),
            a.threads
        );
        bandwidth["read_gb_s"] = json!(bw);
        bandwidth["buffer_mib"] = json!(a.bandwidth_mib);
        bandwidth["decode_fraction"] = json!(median(&fraction));
    }
    let mut hf_ratios = serde_json::Value::Null;
    if a.transformers.is_some() {
        let (tp_r, td_r) = (ratio(&dp, &tp), ratio(&dd, &td));
        println!("{:<28} {:>12} {:>12} {:>8}", "against transformers", "dgr tok/s", "hf tok/s", "ratio");
        println!("{:<28} {:>12.1} {:>12.1} {:>8.3}", format!("prefill pp{}", a.prompt_tokens), median(&dp), median(&tp), tp_r);
        println!("{:<28} {:>12.1} {:>12.1} {:>8.3}", format!("decode tg{}", a.gen_tokens), median(&dd), median(&td), td_r);
        hf_ratios = json!({ "prefill": tp_r, "decode": td_r, "version": hf_version, "prefill_tok_s": tp, "decode_tok_s": td });
    }
    let path = record::write(
        &a.out,
        "engine",
        &model,
        json!({
            "split": format!("one process, layers 0..{n_layers}"),
            "engine": stage.engine().to_string(),
            "adapter": a.numerics.adapter_json(),
            "peer": { "tool": "llama-bench", "version": version, "model": record::model_field(&peer_model)?,
                      "backends": peer_on.0, "gpu_info": peer_on.1, "offload": device.args() },
            "device_memory": memory.map(|m| json!({ "total": m.total, "used": m.used, "free": m.free })),
            "threads": a.threads,
            "isa": stage.isa().map(|i| i.name()),
            "samples": { "dgr_prefill_tok_s": dp, "dgr_decode_tok_s": dd, "llama_prefill_tok_s": lp, "llama_decode_tok_s": ld },
            "ratios": { "prefill": rp, "decode": rd },
            "prompt_tokens": a.prompt_tokens,
            "gen_tokens": a.gen_tokens,
            "bandwidth": bandwidth,
            "transformers": hf_ratios,
        }),
    )?;
    println!("record: {}", path.display());
    Ok(())
}
