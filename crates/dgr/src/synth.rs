use anyhow::{bail, Context, Result};
use clap::builder::PossibleValuesParser;
use dgr_engine::synth::{Mixture, SynthSpec, MIN_VOCAB};
use dgr_engine::Arch;
use dgr_gguf::GgmlType;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Where to write the GGUF
    #[arg(long, short = 'o')]
    out: PathBuf,
    /// Architecture: llama, mistral (a llama file with a SentencePiece vocabulary and its own
    /// head), qwen2, qwen3 or gemma3
    #[arg(long, default_value = "llama", value_parser = PossibleValuesParser::new(Arch::ALL.map(Arch::as_str)))]
    arch: String,
    #[arg(long, default_value_t = 4)]
    layers: usize,
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    #[arg(long, default_value_t = 128)]
    ffn: usize,
    #[arg(long, default_value_t = 4)]
    heads: usize,
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    /// Width of each attention head (qwen3 and gemma3 only; default hidden / heads)
    #[arg(long)]
    head_dim: Option<usize>,
    /// Vocabulary size (at least 259: 256 byte tokens and the special tokens)
    #[arg(long, default_value_t = 320)]
    vocab: usize,
    /// Type of the matrices and the embedding: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0,
    /// q2_k, q3_k, q4_k, q5_k, q6_k (those dgr can quantize to), or q4_k_m: llama.cpp's Q4_K_M
    /// mixture of Q4_K and Q6_K (Q5_0 and Q8_0 where rows are not whole 256-blocks)
    #[arg(long = "type", default_value = "q4_1")]
    ty: String,
    /// A head of its own (output.weight) where the architecture's default ties it to the
    /// embedding (qwen2, as Qwen2.5-7B has)
    #[arg(long)]
    untied_head: bool,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long, default_value_t = 2048)]
    context: usize,
    /// A Jinja chat template to write as tokenizer.chat_template (e.g. a Qwen template, to test
    /// tool calls in that family's format)
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// Write `{arch}.pooling_type` (llama.cpp's numbers: 0 none, 1 mean, 2 cls, 3 last, 4 rank),
    /// how embeddings pool; absent: none
    #[arg(long)]
    pooling_type: Option<u32>,
}

pub fn run(a: Args) -> Result<()> {
    let (ty, mixture) = if a.ty.eq_ignore_ascii_case("q4_k_m") {
        (GgmlType::Q4_K, Mixture::Q4KM)
    } else {
        match GgmlType::ALL.into_iter().find(|t| t.name().eq_ignore_ascii_case(&a.ty)) {
            Some(ty) => (ty, Mixture::Pure),
            None => bail!("unknown tensor type {:?}", a.ty),
        }
    };
    let arch: Arch = a.arch.parse()?;
    if a.heads == 0 || a.kv_heads == 0 || !a.heads.is_multiple_of(a.kv_heads) {
        bail!("kv heads ({}) must divide heads ({})", a.kv_heads, a.heads);
    }
    if a.head_dim.is_none() && !a.hidden.is_multiple_of(a.heads) {
        bail!("heads ({}) must divide the hidden size ({})", a.heads, a.hidden);
    }
    let head_dim = a.head_dim.unwrap_or(a.hidden / a.heads);
    // The mixture picks, for each matrix, a type whose block divides its rows.
    let block = if mixture == Mixture::Pure { ty.block_size() } else { 1 };
    for (what, n) in [("hidden", a.hidden), ("ffn", a.ffn), ("heads × head dim", a.heads * head_dim)] {
        if n == 0 || !n.is_multiple_of(block) {
            bail!("{what} ({n}) must be a positive multiple of {}'s block of {block}", ty.name());
        }
    }
    if a.layers == 0 || a.vocab < MIN_VOCAB {
        bail!("need at least one layer and a vocabulary of at least {MIN_VOCAB}");
    }
    let spec = SynthSpec {
        layers: a.layers,
        hidden: a.hidden,
        ffn: a.ffn,
        heads: a.heads,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
        vocab: a.vocab,
        ty,
        mixture,
        untied_head: a.untied_head,
        seed: a.seed,
        context: a.context,
        arch,
    };
    let mut w = spec.writer()?;
    if let Some(path) = &a.chat_template {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        w.add_metadata("tokenizer.chat_template", dgr_gguf::Value::String(text))?;
    }
    if let Some(n) = a.pooling_type {
        w.add_metadata(&format!("{arch}.pooling_type"), dgr_gguf::Value::U32(n))?;
    }
    w.write_to_path(&a.out).with_context(|| format!("writing {}", a.out.display()))?;
    let len = std::fs::metadata(&a.out).with_context(|| format!("reading {}", a.out.display()))?.len();
    eprintln!("wrote {} ({len} bytes)", a.out.display());
    Ok(())
}
