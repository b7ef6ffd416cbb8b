use anyhow::{Context, Result};
use dgr_engine::{BackendKind, EngineId, Format, KvDtype, Numerics};
use dgr_gguf::Value;
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The GGUF file, or a Transformers checkpoint directory
    file: PathBuf,
}

fn show(v: &Value) -> String {
    match v {
        Value::String(s) if s.chars().count() > 80 => format!("{:?}… ({} bytes)", s.chars().take(80).collect::<String>(), s.len()),
        Value::String(s) => format!("{s:?}"),
        Value::Array(a) if a.len() > 8 => format!("[{} × {}]", a.len(), a.first().map_or("?", |x| x.type_name())),
        Value::Array(a) => format!("[{}]", a.iter().map(show).collect::<Vec<_>>().join(", ")),
        other => format!("{other:?}").split('(').nth(1).map(|s| s.trim_end_matches(')').to_string()).unwrap_or_default(),
    }
}

pub fn run(a: Args) -> Result<()> {
    let (g, id) = dgr_hf::describe(&a.file).with_context(|| format!("reading and hashing {}", a.file.display()))?;
    let format = Format::of(&g);
    // The default numerics first.
    let mut numerics = dgr_engine::available_numerics(BackendKind::Cpu).to_vec();
    numerics.sort_by_key(|&n| n != Numerics::default());
    let mut engines: Vec<String> = numerics
        .iter()
        .flat_map(|&numerics| {
            KvDtype::ALL.iter().map(move |&kv| EngineId { format, backend: BackendKind::Cpu, numerics, kv, adapter: None }.to_string())
        })
        .collect();
    let adapters = dgr_engine::adapters();
    for a in &adapters {
        for &numerics in dgr_engine::available_numerics(BackendKind::Gpu) {
            for &kv in KvDtype::ALL {
                engines.push(EngineId { format, backend: BackendKind::Gpu, numerics, kv, adapter: Some(a.digest()) }.to_string());
            }
        }
    }
    if g.is_assembled() {
        println!("checkpoint: {} (Transformers layout; names and metadata below in GGUF's terms)", a.file.display());
    } else {
        println!("file: {} (GGUF v{}, alignment {})", a.file.display(), g.version(), g.alignment());
    }
    println!("engines: {} (the first is the default on the CPU)", engines.join(", "));
    if adapters.is_empty() {
        println!("gpu adapters: none (no Vulkan, Metal or DX12 device)");
    }
    for (i, a) in adapters.iter().enumerate() {
        println!("gpu:{i}: {a}{}", if a.software { " (never picked by --device auto)" } else { "" });
    }
    let (codes, floats) = g.tensors().iter().filter(|t| t.dims.len() == 2).partition::<Vec<_>, _>(|t| t.ty.block_size() > 1);
    println!(
        "numerics: {} matrices of integer codes meet fast numerics' integer activations; {} float matrices compute exactly in every numerics",
        codes.len(),
        floats.len()
    );
    match g.slice() {
        Some(s) => println!(
            "slice: layers {}..{} of model {} ({} of its {} tensors here, every one verified)",
            s.layer_start,
            s.layer_end,
            id.id,
            g.tensors().len(),
            id.tensors.len()
        ),
        None => println!("model: {} (the whole model)", id.id),
    }
    match dgr_engine::ModelConfig::from_gguf(&g) {
        Ok(c) => println!(
            "architecture: {}  layers {}  hidden {}  ffn {}  heads {} (kv {})  head dim {}  rope {:?} dim {} base {}  rms eps {:e}  vocab {}  context {}",
            c.arch, c.n_layers, c.hidden, c.ffn, c.n_head, c.n_head_kv, c.head_dim, c.rope_style, c.rope_dim, c.rope_base, c.rms_eps, c.vocab, c.context
        ),
        Err(e) => println!("architecture: not runnable by dgr's engine: {e}"),
    }
    println!("\nmetadata:");
    for (k, v) in g.metadata().iter().filter(|(k, _)| k != "dgr.slice.tensors") {
        println!("  {k} = {}", show(v));
    }
    let mut by_type: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
    let mut by_layer: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    for t in g.tensors() {
        let e = by_type.entry(t.ty.name()).or_default();
        e.0 += 1;
        e.1 += t.n_bytes;
        let layer = t
            .name
            .strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .map_or("(outside layers)".to_string(), |n| format!("blk.{n:>0width$}", width = 3));
        let e = by_layer.entry(layer).or_default();
        e.0 += 1;
        e.1 += t.n_bytes;
    }
    let total: u64 = g.tensors().iter().map(|t| t.n_bytes).sum();
    println!("\ntensors by type ({} tensors, {} bytes):", g.tensors().len(), total);
    for (ty, (n, b)) in &by_type {
        println!("  {ty:<6} {n:>5} tensors {b:>12} bytes");
    }
    println!("\ntensors by layer:");
    for (l, (n, b)) in &by_layer {
        println!("  {l:<17} {n:>3} tensors {b:>12} bytes");
    }
    println!("\ntensors:");
    for t in g.tensors() {
        println!("  {:<28} {:<5} {:?} {} bytes", t.name, t.ty.name(), t.dims, t.n_bytes);
    }
    Ok(())
}
