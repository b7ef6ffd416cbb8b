//! Where dgr keeps state that is not a model: the tracker's database, join tokens, worker
//! identity keys. `$DGR_STATE_DIR`, else `$XDG_STATE_HOME/dgr`, else `~/.local/state/dgr`.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

pub fn state_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("DGR_STATE_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_STATE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("dgr");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".local/state/dgr")
}

/// A secret kept in a file: its first line, trimmed.
pub fn read_secret(path: &Path) -> Result<String> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let token = text.lines().next().unwrap_or("").trim().to_string();
    anyhow::ensure!(!token.is_empty(), "{} is empty", path.display());
    Ok(token)
}

/// Reads the secret at `path`, or writes a new random one there (mode 0600) if there is none.
pub fn read_or_create_secret(path: &Path) -> Result<String> {
    if path.exists() {
        return read_secret(path);
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut bytes = [0u8; 24];
    getrandom::fill(&mut bytes).map_err(|e| anyhow::anyhow!("randomness: {e}"))?;
    let token = hex::encode(bytes);
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    std::io::Write::write_all(&mut f, format!("{token}\n").as_bytes())?;
    Ok(token)
}
