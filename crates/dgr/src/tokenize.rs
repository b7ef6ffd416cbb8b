use crate::model::ModelArg;
use anyhow::Result;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArg,
    /// The text to tokenize
    #[arg(long)]
    text: String,
}

pub fn run(a: Args) -> Result<()> {
    let g = a.model.open()?;
    let tok = a.model.tokenizer(&g)?;
    let tokens = tok.encode(&a.text, false, true)?;
    println!("{}", serde_json::json!({ "tokens": tokens }));
    Ok(())
}
