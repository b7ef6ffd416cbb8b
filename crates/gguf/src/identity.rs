//! A model's identity: the SHA-256 of its file's bytes (metadata and tensor data alike), so two
//! processes agree they hold the same model whatever the file is called.

use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::Path;

/// Hex SHA-256 of the file at `path`. Read with plain reads, not through a memory map, so that
/// hashing does not make every tensor resident in the caller's address space.
pub fn model_id(path: &Path) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}
