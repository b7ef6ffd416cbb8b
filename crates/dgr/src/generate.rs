use crate::model::{ModelArg, NumericsArg, ThreadsArg};
use crate::routed;
use anyhow::{bail, Result};
use dgr_bench::local::{self, Request};
use dgr_engine::{open_engine, SamplingParams};
use dgr_tokenizer::ChatMessage;
use std::io::Write;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArg,
    #[command(flatten)]
    threads: ThreadsArg,
    #[command(flatten)]
    numerics: NumericsArg,
    /// The prompt (tokenized as llama.cpp tokenizes a completion prompt)
    #[arg(long, short = 'p')]
    prompt: String,
    /// Treat the prompt as one user message and render the model's chat template around it
    #[arg(long)]
    chat: bool,
    /// Most tokens to generate
    #[arg(long, short = 'n', default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Sample among the k most likely tokens only (0: all)
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Sample among the most likely tokens whose probabilities sum to p
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Seed of the sampler (with the position, it fixes every draw)
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Report the k most likely tokens and their log-probabilities at each step
    #[arg(long, default_value_t = 0)]
    top_logprobs: usize,
    /// Do not stop at end-of-generation tokens
    #[arg(long)]
    ignore_eos: bool,
    /// Output: text (streamed) or json
    #[arg(long, default_value = "text")]
    format: Format,
    #[command(flatten)]
    route: routed::RouteArgs,
}

#[derive(clap::ValueEnum, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Text,
    Json,
}

pub fn run(a: Args) -> Result<()> {
    if !(a.temperature >= 0.0 && a.temperature.is_finite() && a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--temperature must be ≥ 0 and --top-p in (0, 1]");
    }
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let g = a.model.open()?;
    let tok = a.model.tokenizer(&g)?;
    let prompt_tokens = if a.chat {
        tok.encode_chat(&tok.apply_chat_template(&[ChatMessage { role: "user".into(), content: a.prompt.clone() }], true)?)?
    } else {
        tok.encode_prompt(&a.prompt)?
    };
    let req = Request {
        prompt_tokens,
        max_tokens: a.max_tokens,
        sampling: SamplingParams { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p, seed: a.seed },
        top_logprobs: a.top_logprobs,
        ignore_eos: a.ignore_eos,
    };
    let mut stream = dgr_tokenizer::Utf8Stream::default();
    let text_format = a.format == Format::Text;
    let mut print = |t: u32| {
        if text_format {
            let mut o = std::io::stdout().lock();
            let _ = o.write_all(stream.push(&tok.token_bytes(t).unwrap_or_default()).as_bytes());
            let _ = o.flush();
        }
    };
    let n_layers = dgr_engine::ModelConfig::from_gguf(&g)?.n_layers;
    let (out, extra) = if a.route.route.is_some() || a.route.split.is_some() || a.route.tracker.is_some() {
        let engine = a.numerics.engine(dgr_engine::Format::of(&g));
        match routed::generate(&a.route, &a.model.path()?, n_layers, (a.threads.get(), engine), &req, &tok.eog_ids(), &mut print)? {
            Ok(v) => v,
            Err(e) => {
                println!("{}", serde_json::json!({ "error": e }));
                std::process::exit(2);
            }
        }
    } else {
        crate::die_on_broken_pipe();
        let stage = open_engine(g, 0..n_layers, a.numerics.spec(a.threads.get()))?;
        let out = local::generate(&stage, |t| tok.is_eog(t), &req, &mut print)?;
        (out, serde_json::json!({ "threads": stage.threads(), "isa": stage.isa().map(|i| i.name()) }))
    };
    match a.format {
        Format::Text => println!(),
        Format::Json => {
            let mut json = serde_json::json!({
                "prompt_tokens": req.prompt_tokens,
                "tokens": out.tokens,
                "text": tok.decode(&out.tokens),
                "logprobs": out.logprobs,
                "top_logprobs": out.top_logprobs,
                "finish_reason": out.finish_reason,
                "timings": out.timings,
            });
            if let (Some(j), serde_json::Value::Object(e)) = (json.as_object_mut(), extra) {
                j.extend(e);
            }
            println!("{json}");
        }
    }
    Ok(())
}
