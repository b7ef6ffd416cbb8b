//! The safetensors files of a checkpoint: `model.safetensors`, or the shards its
//! `model.safetensors.index.json` names. Headers are read with plain reads, bounded, and
//! validated by the `safetensors` crate (offsets contiguous, sizes matching dtypes and shapes);
//! the data section must end exactly at the file's end.

use crate::HfError;
use safetensors::tensor::{Metadata, TensorInfo};
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The safetensors crate's own bound on a header.
const MAX_HEADER: u64 = 100_000_000;
/// An index is a name → file map: a few MB even for the largest models.
pub(crate) const MAX_JSON: u64 = 64 << 20;

pub(crate) struct Shard {
    pub path: PathBuf,
    pub file: File,
    /// File offset of the data section.
    pub data_start: u64,
    pub tensors: Vec<(String, TensorInfo)>,
}

/// Reads a small JSON file whole, refusing one past `MAX_JSON`.
pub(crate) fn read_small(path: &Path) -> Result<Vec<u8>, HfError> {
    let io = |source| HfError::Io { path: path.to_owned(), source };
    let len = std::fs::metadata(path).map_err(io)?.len();
    if len > MAX_JSON {
        return Err(HfError::TooLarge { path: path.to_owned(), max: MAX_JSON });
    }
    std::fs::read(path).map_err(io)
}

fn read_shard(path: PathBuf) -> Result<Shard, HfError> {
    let io = |source| HfError::Io { path: path.clone(), source };
    let bad = |reason: String| HfError::BadHeader { path: path.clone(), reason };
    let file = File::open(&path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    let mut n = [0u8; 8];
    if len < 8 {
        return Err(bad(format!("{len} bytes, shorter than the header's length field")));
    }
    file.read_exact_at(&mut n, 0).map_err(io)?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER || n > len - 8 {
        return Err(bad(format!("a header of {n} bytes in a file of {len}")));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact_at(&mut header, 8).map_err(io)?;
    let meta: Metadata = serde_json::from_slice(&header).map_err(|e| bad(e.to_string()))?;
    let data_start = 8 + n;
    if data_start + meta.data_len() as u64 != len {
        return Err(bad(format!("tensors end at byte {}, the file at {len}", data_start + meta.data_len() as u64)));
    }
    let by_name = meta.tensors();
    let mut tensors: Vec<(String, TensorInfo)> = meta.offset_keys().into_iter().map(|k| (k.clone(), by_name[&k].clone())).collect();
    tensors.sort_by_key(|(_, t)| t.data_offsets.0);
    Ok(Shard { path, file, data_start, tensors })
}

/// The checkpoint's shards, in the order the index names them first (or the one file).
pub(crate) fn open_shards(dir: &Path) -> Result<Vec<Shard>, HfError> {
    let index = dir.join("model.safetensors.index.json");
    if !index.exists() {
        return Ok(vec![read_shard(dir.join("model.safetensors"))?]);
    }
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: HashMap<String, String>,
    }
    let text = read_small(&index)?;
    let map: Index = serde_json::from_slice(&text).map_err(|source| HfError::Json { path: index.clone(), source })?;
    let mut files: Vec<&String> = map.weight_map.values().collect();
    files.sort();
    files.dedup();
    let mut shards = Vec::with_capacity(files.len());
    for f in files {
        // A plain file name beside the index: never a path that leaves the directory.
        if f.is_empty() || f.contains('/') || f.contains('\\') || f == "." || f == ".." {
            return Err(HfError::BadHeader { path: index.clone(), reason: format!("shard name {f:?} is not a file name") });
        }
        shards.push(read_shard(dir.join(f))?);
    }
    // The index and the shards must agree on where each tensor is.
    for (name, f) in &map.weight_map {
        let shard = shards.iter().find(|s| s.path.file_name().is_some_and(|n| n == f.as_str()));
        if !shard.is_some_and(|s| s.tensors.iter().any(|(n, _)| n == name)) {
            return Err(HfError::BadHeader { path: index.clone(), reason: format!("tensor {name:?} is not in {f:?}") });
        }
    }
    Ok(shards)
}
