use crate::model::{ModelArg, NumericsArg, ThreadsArg};
use anyhow::{bail, Context, Result};
use dgr_engine::{open_engine, Engine, Input, LogitRows, SeqInput};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArg,
    #[command(flatten)]
    threads: ThreadsArg,
    #[command(flatten)]
    numerics: NumericsArg,
    /// The prompt (tokenized as for a completion)
    #[arg(long, short = 'p')]
    prompt: String,
    /// The continuation to score, as comma-separated token ids
    #[arg(long)]
    continuation: String,
    /// How many most likely tokens to report per step
    #[arg(long, default_value_t = 5)]
    top_logprobs: usize,
    /// Output format (json only)
    #[arg(long, default_value = "json")]
    format: String,
}

pub fn run(a: Args) -> Result<()> {
    if a.format != "json" {
        bail!("score prints json only");
    }
    let continuation: Vec<u32> = a
        .continuation
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse::<u32>().with_context(|| format!("bad token id {s:?} in --continuation")))
        .collect::<Result<_>>()?;
    if continuation.is_empty() {
        bail!("--continuation needs at least one token id");
    }
    let g = a.model.open()?;
    let tok = a.model.tokenizer(&g)?;
    let prompt_tokens = tok.encode_prompt(&a.prompt)?;
    if prompt_tokens.is_empty() {
        bail!("the prompt is empty");
    }
    let n_layers = dgr_engine::ModelConfig::from_gguf(&g)?.n_layers;
    let stage = open_engine(g, 0..n_layers, a.numerics.spec(a.threads.get()))?;
    let vocab = stage.config().vocab;
    if let Some(t) = continuation.iter().find(|&&t| t as usize >= vocab) {
        bail!("token id {t} in --continuation is outside the vocabulary of {vocab}");
    }
    let steps = score(&stage, &prompt_tokens, &continuation, a.top_logprobs)?;
    println!("{}", serde_json::json!({ "prompt_tokens": prompt_tokens, "steps": steps }));
    Ok(())
}

/// Teacher-forced scoring: one forward over the prompt and all but the last continuation token;
/// the logits after position i give the distribution of continuation token i.
pub fn score(stage: &impl Engine, prompt: &[u32], continuation: &[u32], top: usize) -> Result<Vec<serde_json::Value>> {
    let mut input = prompt.to_vec();
    input.extend_from_slice(&continuation[..continuation.len() - 1]);
    let mut kv = stage.new_state(input.len(), stage.layers())?;
    let out = stage.forward(&mut [SeqInput { kv: &mut kv, input: Input::Tokens(&input), logits: LogitRows::All }])?;
    let vocab = stage.config().vocab;
    let logits = &out[0].logits;
    Ok(continuation
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            let row = prompt.len() - 1 + i;
            let (lp, top) = dgr_engine::logprobs(&logits[row * vocab..(row + 1) * vocab], t, top);
            serde_json::json!({ "token": t, "logprob": lp, "top": top })
        })
        .collect())
}
