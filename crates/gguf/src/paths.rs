//! Where the default model lives; the same rule as scripts/fetch-model.sh.

use std::ffi::OsString;
use std::path::PathBuf;

pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// `$DGR_MODEL_DIR/<file>`, else `${XDG_CACHE_HOME:-$HOME/.cache}/dgr/models/<file>`.
/// Empty variables count as unset, as `${VAR:-default}` does in the script.
pub fn default_model_path() -> PathBuf {
    let var = |name| std::env::var_os(name).filter(|v: &OsString| !v.is_empty());
    let dir = var("DGR_MODEL_DIR").map(PathBuf::from).unwrap_or_else(|| {
        let cache =
            var("XDG_CACHE_HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(var("HOME").unwrap_or_default()).join(".cache"));
        cache.join("dgr").join("models")
    });
    dir.join(DEFAULT_MODEL_FILE)
}
