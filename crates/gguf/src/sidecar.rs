//! The hashes of a file's tensors, cached beside it in `<file>.dgr-hashes` so that a restart
//! reads no tensor bytes. The cache is keyed by the file's length and modification time and
//! lists the tensors it hashed; a cache that is not exactly what this file would get (another
//! version, key or tensor list, a bad checksum, truncated, foreign) is ignored. Writing it is
//! best effort: a read-only directory only costs the next start a rehash.
//!
//! Format (little-endian): magic "DGRHASH\0", version u32, file length u64, mtime ns i128,
//! tensor count u64, per tensor its name (u64 length + bytes), type id u32, n_dims u32, dims
//! u64 each and SHA-256 (32 bytes), then the SHA-256 of everything before it.

use crate::temp::write_atomically;
use crate::tensor::TensorInfo;
use crate::write::write_str;
use sha2::{Digest, Sha256};
use std::fs::{File, Metadata};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

const MAGIC: &[u8; 8] = b"DGRHASH\0";
const VERSION: u32 = 1;

/// What the cache is valid for: the file as it was when hashed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Key {
    len: u64,
    mtime_ns: i128,
}

impl Key {
    /// None where the platform reports no modification time: then nothing is cached.
    pub fn of(meta: &Metadata) -> Option<Key> {
        let mtime = meta.modified().ok()?;
        let mtime_ns = match mtime.duration_since(UNIX_EPOCH) {
            Ok(after) => i128::try_from(after.as_nanos()).ok()?,
            Err(before) => -i128::try_from(before.duration().as_nanos()).ok()?,
        };
        Some(Key { len: meta.len(), mtime_ns })
    }
}

fn sidecar_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".dgr-hashes");
    PathBuf::from(name)
}

/// The cache's bytes, less the checksum, with every hash zeroed; and where each hash goes.
fn skeleton(key: Key, tensors: &[TensorInfo]) -> (Vec<u8>, Vec<usize>) {
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&key.len.to_le_bytes());
    out.extend_from_slice(&key.mtime_ns.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    let mut at = Vec::with_capacity(tensors.len());
    for t in tensors {
        write_str(&mut out, &t.name);
        out.extend_from_slice(&t.ty.id().to_le_bytes());
        out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        at.push(out.len());
        out.extend_from_slice(&[0; 32]);
    }
    (out, at)
}

/// The cached hashes of `tensors` (the file's own, in its order), if the cache matches `key`.
pub(crate) fn load(path: &Path, key: Key, tensors: &[TensorInfo]) -> Option<Vec<[u8; 32]>> {
    let (mut body, at) = skeleton(key, tensors);
    let side = sidecar_path(path);
    // A FIFO or device there could block or never end: only a regular file is read, and no
    // more of it than a match can be.
    if !std::fs::metadata(&side).ok()?.is_file() {
        return None;
    }
    let mut bytes = Vec::with_capacity(body.len() + 32);
    File::open(&side).ok()?.take(body.len() as u64 + 33).read_to_end(&mut bytes).ok()?;
    let (content, sum) = bytes.split_at_checked(body.len())?;
    let mut hashes = Vec::with_capacity(at.len());
    for &i in &at {
        let h: [u8; 32] = content.get(i..i + 32)?.try_into().ok()?;
        body.get_mut(i..i + 32)?.copy_from_slice(&h);
        hashes.push(h);
    }
    (body == content && sum == Sha256::digest(&body).as_slice()).then_some(hashes)
}

/// Caches `hashes` of `tensors` under `key`, replacing any cache there; failures are ignored.
pub(crate) fn store(path: &Path, key: Key, tensors: &[TensorInfo], hashes: &[[u8; 32]]) {
    let (mut body, at) = skeleton(key, tensors);
    for (&i, h) in at.iter().zip(hashes) {
        if let Some(slot) = body.get_mut(i..i + 32) {
            slot.copy_from_slice(h);
        }
    }
    let sum = Sha256::digest(&body);
    body.extend_from_slice(&sum);
    let side = sidecar_path(path);
    let _ = write_atomically(&side, |f| f.write_all(&body).map_err(|source| crate::GgufError::Io { path: side.clone(), source }));
}
