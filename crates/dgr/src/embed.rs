//! `dgr embed`: a text's embedding in one process, the reference the gateway's
//! `/v1/embeddings` is checked against.

use crate::model::{ModelArg, NumericsArg, ThreadsArg};
use anyhow::{bail, Context, Result};
use dgr_bench::local;
use dgr_engine::open_engine;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArg,
    #[command(flatten)]
    threads: ThreadsArg,
    #[command(flatten)]
    numerics: NumericsArg,
    /// The text to embed (tokenized as a completion prompt is, as /v1/embeddings does)
    #[arg(long, conflicts_with = "file")]
    text: Option<String>,
    /// A file whose text to embed
    #[arg(long)]
    file: Option<std::path::PathBuf>,
}

pub fn run(a: Args) -> Result<()> {
    let text = match (&a.text, &a.file) {
        (Some(t), None) => t.clone(),
        (None, Some(f)) => std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?,
        _ => bail!("give --text or --file"),
    };
    let g = a.model.open()?;
    let tok = a.model.tokenizer(&g)?;
    let tokens = tok.encode_prompt(&text)?;
    let cfg = dgr_engine::ModelConfig::from_gguf(&g)?;
    let stage = open_engine(g, 0..cfg.n_layers, a.numerics.spec(a.threads.get()))?;
    let embedding = local::embed(&stage, &tokens)?;
    let json = serde_json::json!({
        "embedding": embedding,
        "tokens": tokens,
        "pooling": cfg.pooling.name(),
        "dimensions": cfg.hidden,
    });
    println!("{json}");
    Ok(())
}
