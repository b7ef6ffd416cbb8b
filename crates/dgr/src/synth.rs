use anyhow::{bail, Context, Result};
use dgr_engine::synth::SynthSpec;
use dgr_gguf::GgmlType;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Where to write the GGUF
    #[arg(long, short = 'o')]
    out: PathBuf,
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
    /// Vocabulary size (at least 258: 256 byte tokens, BOS and EOS)
    #[arg(long, default_value_t = 320)]
    vocab: usize,
    /// Matrix type: f32, f16, bf16, q4_0, q4_1, q8_0, q4_k, q5_k, q6_k
    #[arg(long = "type", default_value = "q4_1")]
    ty: String,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long, default_value_t = 2048)]
    context: usize,
    /// Write a qwen2-style model (half-split RoPE, q/k/v biases) instead of a llama one
    #[arg(long)]
    qwen2: bool,
}

pub fn run(a: Args) -> Result<()> {
    let ty = match a.ty.to_ascii_lowercase().as_str() {
        "f32" => GgmlType::F32,
        "f16" => GgmlType::F16,
        "bf16" => GgmlType::BF16,
        "q4_0" => GgmlType::Q4_0,
        "q4_1" => GgmlType::Q4_1,
        "q8_0" => GgmlType::Q8_0,
        "q4_k" => GgmlType::Q4_K,
        "q5_k" => GgmlType::Q5_K,
        "q6_k" => GgmlType::Q6_K,
        other => bail!("unknown tensor type {other:?}"),
    };
    let block = ty.block_size();
    if a.heads == 0 || a.kv_heads == 0 || !a.hidden.is_multiple_of(a.heads) || !a.heads.is_multiple_of(a.kv_heads) {
        bail!("heads ({}) and kv heads ({}) must divide the hidden size ({})", a.heads, a.kv_heads, a.hidden);
    }
    if !a.hidden.is_multiple_of(block) || !a.ffn.is_multiple_of(block) {
        bail!("hidden ({}) and ffn ({}) must be multiples of {}'s block of {block}", a.hidden, a.ffn, ty.name());
    }
    if a.layers == 0 || a.vocab < 258 {
        bail!("need at least one layer and a vocabulary of at least 258");
    }
    let spec = SynthSpec {
        layers: a.layers,
        hidden: a.hidden,
        ffn: a.ffn,
        heads: a.heads,
        kv_heads: a.kv_heads,
        vocab: a.vocab,
        ty,
        seed: a.seed,
        context: a.context,
        arch: if a.qwen2 { "qwen2" } else { "llama" },
    };
    let bytes = spec.to_gguf()?;
    std::fs::write(&a.out, &bytes).with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!("wrote {} ({} bytes)", a.out.display(), bytes.len());
    Ok(())
}
