//! The record each benchmark run writes beside its result: enough to rerun and to compare.

use crate::error::{BenchError, Context, Result};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

fn cpu() -> Value {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |k: &str| {
        info.lines().find(|l| l.starts_with(k)).and_then(|l| l.split(':').nth(1)).map(|s| s.trim().to_string()).unwrap_or_default()
    };
    json!({ "model": field("model name"), "flags": field("flags"), "logical_cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0) })
}

/// A model file's name and SHA-256; for a Transformers checkpoint directory, its name and
/// identity (a hash over its config and tensors).
pub fn model_field(m: &Path) -> Result<Value> {
    let name = m.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
    Ok(if m.is_dir() {
        json!({ "dir": name, "identity": dgr_hf::identity(m).map_err(|e| hash_error(m, e))?.id })
    } else {
        json!({ "file": name, "sha256": dgr_gguf::file_sha256(m).map_err(|e| hash_error(m, e))? })
    })
}

fn hash_error(m: &Path, e: impl std::error::Error + Send + Sync + 'static) -> BenchError {
    BenchError::Hash { path: m.display().to_string(), source: Box::new(e) }
}

/// Writes `{the common fields} + extra` as `<dir>/<name>-<unix seconds>.json` and returns the path.
pub fn write(dir: &Path, name: &str, model: &Path, extra: Value) -> Result<PathBuf> {
    write_maybe_model(dir, name, Some(model), extra)
}

/// As `write`, for a run whose model file may be unknown (a remote endpoint): `"model": null` then.
pub fn write_maybe_model(dir: &Path, name: &str, model: Option<&Path>, extra: Value) -> Result<PathBuf> {
    let model = match model {
        Some(m) => model_field(m)?,
        None => Value::Null,
    };
    let mut rec = json!({
        "bench": name,
        "model": model,
        "dgr": { "version": env!("CARGO_PKG_VERSION"), "commit": env!("DGR_COMMIT") },
        "cpu": cpu(),
        "command": std::env::args().collect::<Vec<_>>(),
        "unix_time": dgr_telemetry::unix_secs(),
    });
    if let (Some(r), Value::Object(e)) = (rec.as_object_mut(), extra) {
        r.extend(e);
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(format!("{name}-{}.json", rec["unix_time"]));
    let text = serde_json::to_string_pretty(&rec).context("the record")?;
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}
