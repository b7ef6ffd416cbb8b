//! `dgr slice`: cut the part of a model one stage needs into its own GGUF file.

use anyhow::{Context, Result};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The model (a whole GGUF file, or a slice holding the range)
    #[arg(long, short = 'm')]
    model: PathBuf,
    /// The layers the slice serves, A..B: their blocks, plus the embedding when A is 0 and the
    /// final norm and head when B is the model's layer count
    #[arg(long)]
    layers: String,
    /// Where to write the slice
    #[arg(long)]
    out: PathBuf,
}

pub fn run(a: Args) -> Result<()> {
    let layers = crate::worker::parse_layers(&a.layers)?;
    let g = dgr_gguf::Gguf::open(&a.model).with_context(|| format!("opening {}", a.model.display()))?;
    let id = dgr_gguf::identity(&a.model, &g).with_context(|| format!("hashing the tensors of {}", a.model.display()))?;
    let (start, end) = (u32::try_from(layers.start)?, u32::try_from(layers.end)?);
    dgr_gguf::write_slice(&g, &id, start, end, &a.out).with_context(|| format!("writing {}", a.out.display()))?;
    let bytes = std::fs::metadata(&a.out).map(|m| m.len()).unwrap_or(0);
    println!("{}", serde_json::json!({ "slice": a.out, "layers": [start, end], "model_id": id.id, "bytes": bytes }));
    Ok(())
}
