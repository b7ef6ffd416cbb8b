//! A model described in GGUF's terms whose tensors live in another format's files (a
//! Transformers checkpoint's safetensors): its metadata and tensor table are built by a loader,
//! its held tensors are mapped from their files or owned, and everything downstream (the engine,
//! identities of parts, planning) reads it as it reads an opened GGUF file.

use crate::error::GgufError;
use crate::gguf::{Bytes, Gguf};
use crate::mapping::{map_range, Held, Runs};
use crate::read::{Header, DEFAULT_ALIGNMENT};
use crate::tensor::{tensor_n_bytes, TensorInfo};
use crate::types::GgmlType;
use crate::value::Value;
use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

/// One tensor of an assembled model, in ggml's terms.
pub struct Part<'a> {
    pub name: String,
    pub ty: GgmlType,
    /// ggml order: `dims[0]` is the row length.
    pub dims: Vec<u64>,
    /// Its bytes, if this process holds the tensor.
    pub bytes: Option<PartBytes<'a>>,
}

/// Where a held tensor's bytes are.
pub enum PartBytes<'a> {
    /// In `file` (named `path`, for errors) from byte `offset`, mapped read-only.
    File { file: &'a File, path: &'a Path, offset: u64 },
    /// Already in memory (transformed at load).
    Owned(Vec<u8>),
}

/// Virtual offsets of tensors are multiples of this, as a GGUF data section's are.
const ALIGN: u64 = 64;

impl Gguf {
    /// A model from `metadata` and `parts`, validated as an opened file is: unique keys and
    /// names, shapes whose sizes do not overflow, and held bytes that exist (in the file, or
    /// exactly `n_bytes` owned). Tensors without bytes are listed but not held.
    pub fn assemble(metadata: Vec<(String, Value)>, parts: Vec<Part>) -> Result<Gguf, GgufError> {
        let mut key_index = HashMap::with_capacity(metadata.len());
        for (i, (k, _)) in metadata.iter().enumerate() {
            if key_index.insert(k.clone(), i).is_some() {
                return Err(GgufError::DuplicateKey { key: k.clone(), offset: 0 });
            }
        }
        let mut tensors = Vec::with_capacity(parts.len());
        let mut tensor_index = HashMap::with_capacity(parts.len());
        let mut held = Vec::new();
        let mut end = 0u64;
        for (i, p) in parts.into_iter().enumerate() {
            let n_bytes = tensor_n_bytes(&p.name, p.ty, &p.dims, None)?;
            if tensor_index.insert(p.name.clone(), i).is_some() {
                return Err(GgufError::DuplicateTensor { tensor: p.name, offset: None });
            }
            let offset = end.next_multiple_of(ALIGN);
            end = offset.checked_add(n_bytes).ok_or_else(|| GgufError::ShapeOverflow { tensor: p.name.clone(), offset: None })?;
            match p.bytes {
                None => {}
                Some(PartBytes::Owned(v)) => {
                    if v.len() as u64 != n_bytes {
                        return Err(GgufError::LengthMismatch {
                            what: "an assembled tensor's bytes",
                            expected: n_bytes,
                            found: v.len() as u64,
                        });
                    }
                    held.push((offset, 0, Held::Owned(v)));
                }
                Some(PartBytes::File { file, path, offset: at }) => {
                    let io = |source| GgufError::Io { path: path.to_owned(), source };
                    let file_len = file.metadata().map_err(io)?.len();
                    let stop = at.checked_add(n_bytes).filter(|&e| e <= file_len);
                    let Some(stop) = stop else {
                        return Err(GgufError::TensorOutOfBounds { tensor: p.name, start: at, n_bytes, file_len });
                    };
                    let (map, skip) = map_range(file, at, stop).map_err(io)?;
                    held.push((offset, skip, Held::Map(map)));
                }
            }
            tensors.push(TensorInfo { name: p.name, ty: p.ty, dims: p.dims, offset, n_bytes });
        }
        let header = Header { version: 3, alignment: DEFAULT_ALIGNMENT, data_offset: 0, metadata, key_index, tensors, tensor_index };
        Gguf::new(Bytes::Assembled(Runs::from_held(held)), header, end)
    }
}
