//! A model's identity: a SHA-256 over its metadata and its tensors' names, types, shapes and
//! SHA-256s. Built from per-tensor hashes rather than the file's bytes, so a slice that holds
//! some of the tensors (and lists the hashes of all of them) has the same identity as the whole
//! file, and proves it for the tensors it holds.

use crate::error::GgufError;
use crate::gguf::Gguf;
use crate::sidecar::{self, Key};
use crate::slice::PREFIX;
use crate::tensor::TensorInfo;
use crate::types::GgmlType;
use crate::value::Value;
use crate::write::{write_kv, write_str};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Reads are this large: big enough to hash at full speed, small enough to not matter.
const READ_BUF: usize = 1 << 20;

/// Keeps identities of this scheme apart from any other SHA-256 of the same bytes.
const DOMAIN: &[u8] = b"dgr-model-identity-v1\0";

/// Hex SHA-256 of the file at `path`. Read with plain reads, not through a memory map, so that
/// hashing does not make every tensor resident in the caller's address space.
pub fn file_sha256(path: &Path) -> std::io::Result<String> {
    let mut f = File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; READ_BUF];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// One tensor of a model: what it is and the SHA-256 of its bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorHash {
    pub name: String,
    pub ty: GgmlType,
    pub dims: Vec<u64>,
    pub sha256: [u8; 32],
}

impl TensorHash {
    /// Its data's size in bytes (a shape too large for the address space is an error).
    pub fn n_bytes(&self) -> Result<u64, GgufError> {
        crate::tensor::tensor_n_bytes(&self.name, self.ty, &self.dims, None)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelIdentity {
    /// 64 lowercase hex chars.
    pub id: String,
    /// The whole model's tensors, in the whole model's file order.
    pub tensors: Vec<TensorHash>,
}

impl ModelIdentity {
    /// id = SHA-256 over: the domain tag; the count (u64) of metadata keys not starting with
    /// "dgr.slice." and each of them in order as GGUF encodes it (key, value type id u32,
    /// value); the tensor count (u64) and per tensor its name as a GGUF string, type id (u32),
    /// n_dims (u32), dims (u64 each) and SHA-256. All integers little-endian.
    pub fn compute(metadata: &[(String, Value)], tensors: Vec<TensorHash>) -> ModelIdentity {
        let mut h = Sha256::new();
        h.update(DOMAIN);
        let kept: Vec<&(String, Value)> = metadata.iter().filter(|(k, _)| !k.starts_with(PREFIX)).collect();
        h.update((kept.len() as u64).to_le_bytes());
        // One entry at a time: a vocabulary array can be megabytes.
        let mut buf = Vec::new();
        for (key, value) in kept {
            buf.clear();
            write_kv(&mut buf, key, value);
            h.update(&buf);
        }
        h.update((tensors.len() as u64).to_le_bytes());
        for t in &tensors {
            buf.clear();
            write_str(&mut buf, &t.name);
            buf.extend_from_slice(&t.ty.id().to_le_bytes());
            buf.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                buf.extend_from_slice(&d.to_le_bytes());
            }
            buf.extend_from_slice(&t.sha256);
            h.update(&buf);
        }
        ModelIdentity { id: hex::encode(h.finalize()), tensors }
    }

    pub fn get(&self, name: &str) -> Option<&TensorHash> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// SHA-256 of each of `tensors` of the file at `path` (opened as `file`; tensor `t`'s bytes are
/// `t.n_bytes` at `base + t.offset`, inside the file), read with positioned reads (never through
/// a map, so hashing leaves the caller's address space alone) — or, on a file unchanged since
/// they were hashed, taken from the cache beside it (see `sidecar`) without reading a tensor
/// byte. Freshly computed hashes are cached, unless the file changed while they were computed.
pub fn cached_tensor_hashes(path: &Path, file: &File, base: u64, tensors: &[TensorInfo]) -> Result<Vec<[u8; 32]>, GgufError> {
    let io = |source| GgufError::Io { path: path.to_owned(), source };
    let key = Key::of(&file.metadata().map_err(io)?);
    if let Some(hashes) = key.and_then(|k| sidecar::load(path, k, tensors)) {
        return Ok(hashes);
    }
    let hashes = tensors
        .iter()
        .map(|t| sha256_range(file, base.saturating_add(t.offset), t.n_bytes))
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(io)?;
    let after = file.metadata().map_err(io)?;
    if let Some(k) = key.filter(|&k| Key::of(&after) == Some(k)) {
        sidecar::store(path, k, tensors, &hashes);
    }
    Ok(hashes)
}

/// SHA-256 of `len` bytes of `file` from offset `at`, with plain positioned reads (never through
/// a map, so hashing does not make the bytes resident in the caller's address space).
pub fn sha256_range(file: &File, mut at: u64, mut len: u64) -> std::io::Result<[u8; 32]> {
    let mut buf = vec![0u8; READ_BUF];
    let mut h = Sha256::new();
    while len > 0 {
        let n = usize::try_from(len).map_or(READ_BUF, |l| l.min(READ_BUF));
        file.read_exact_at(&mut buf[..n], at)?;
        h.update(&buf[..n]);
        at += n as u64;
        len -= n as u64;
    }
    Ok(h.finalize().into())
}

fn own_table(tensors: &[TensorInfo], hashes: Vec<[u8; 32]>) -> Vec<TensorHash> {
    tensors.iter().zip(hashes).map(|(t, sha256)| TensorHash { name: t.name.clone(), ty: t.ty, dims: t.dims.clone(), sha256 }).collect()
}

/// The identity of the model in the GGUF at `path`: its header read, its tensors hashed (or
/// their hashes taken from the cache beside it; a slice's checked against its table).
pub fn model_identity(path: &Path) -> Result<ModelIdentity, GgufError> {
    identity(path, &Gguf::read_header(path)?)
}

impl ModelIdentity {
    /// The identity a slice's table claims, before any tensor is checked against it: for a
    /// manifest (a slice holding no tensors) that is all there is to check. None for a file
    /// that is not a slice.
    pub fn claimed(g: &Gguf) -> Option<ModelIdentity> {
        Some(ModelIdentity::compute(g.metadata(), g.slice_table()?.tensors.clone()))
    }
}

/// The identity of the model in the GGUF at `path`, already opened (wholly or in part) as `g`.
/// A whole file's tensors are hashed; a slice's table comes from its metadata and the tensors
/// it holds are checked against it. Either way the hashes of the file's own tensors are cached
/// beside it (see `sidecar`), so on an unchanged file no tensor byte is read.
pub fn identity(path: &Path, g: &Gguf) -> Result<ModelIdentity, GgufError> {
    let io = |source| GgufError::Io { path: path.to_owned(), source };
    let file = File::open(path).map_err(io)?;
    let before = file.metadata().map_err(io)?;
    if before.len() != g.file_len() {
        return Err(GgufError::LengthMismatch { what: "file length since it was opened", expected: g.file_len(), found: before.len() });
    }
    // Ranges were checked against the file's length at open.
    let hashes = cached_tensor_hashes(path, &file, g.data_offset(), g.tensors())?;
    let own = own_table(g.tensors(), hashes);
    let Some(table) = g.slice_table() else {
        return Ok(ModelIdentity::compute(g.metadata(), own));
    };
    // Type and shape were checked against the table at open; the bytes are checked here.
    for t in own {
        if table.get(&t.name).map(|e| e.sha256) != Some(t.sha256) {
            return Err(GgufError::TensorHashMismatch { tensor: t.name });
        }
    }
    Ok(ModelIdentity::compute(g.metadata(), table.tensors.clone()))
}
