//! GGUF writer, for fixtures and synthetic models. It writes what it is given: metadata the
//! reader would reject (a bad alignment, over-deep arrays, version 1) is written as is, which
//! lets tests build hostile files.

use crate::error::GgufError;
use crate::read::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC};
use crate::tensor::tensor_n_bytes;
use crate::types::GgmlType;
use crate::value::{type_id, Value};
use std::io::Write;
use std::path::Path;

struct PendingTensor {
    name: String,
    ty: GgmlType,
    dims: Vec<u64>,
    data: Vec<u8>,
}

pub struct GgufWriter {
    version: u32,
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// Version 3, alignment 32 unless a valid `general.alignment` is added.
    pub fn new() -> Self {
        GgufWriter { version: 3, metadata: Vec::new(), tensors: Vec::new() }
    }

    /// Sets the header's version field (2 and 3 share a layout).
    pub fn set_version(&mut self, version: u32) {
        self.version = version;
    }

    /// Adds a key, or replaces its value in place if already present. An array (at any depth)
    /// that mixes element types cannot be encoded (GGUF arrays are homogeneous) and is refused.
    pub fn add_metadata(&mut self, key: &str, value: Value) -> Result<(), GgufError> {
        if !is_homogeneous(&value) {
            return Err(GgufError::MixedArray { key: key.to_owned() });
        }
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some((_, v)) => *v = value,
            None => self.metadata.push((key.to_owned(), value)),
        }
        Ok(())
    }

    /// Adds a tensor; `data` must be exactly the bytes its type and dims call for.
    pub fn add_tensor(&mut self, name: &str, ty: GgmlType, dims: &[u64], data: Vec<u8>) -> Result<(), GgufError> {
        let n_bytes = tensor_n_bytes(name, ty, dims, None)?;
        if data.len() as u64 != n_bytes {
            return Err(GgufError::LengthMismatch { what: "tensor data", expected: n_bytes, found: data.len() as u64 });
        }
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(GgufError::DuplicateTensor { tensor: name.to_owned(), offset: None });
        }
        self.tensors.push(PendingTensor { name: name.to_owned(), ty, dims: dims.to_vec(), data });
        Ok(())
    }

    /// The file: header, padding to the alignment, then each tensor at an aligned offset.
    /// Nothing follows the last tensor, so every proper prefix of a file with tensors is invalid.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.write(&mut out).expect("writing to memory cannot fail");
        out
    }

    /// The same bytes as `to_bytes`, streamed to `path`: a multi-gigabyte model is not copied
    /// in memory a second time.
    pub fn write_to_path(&self, path: &Path) -> std::io::Result<()> {
        let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
        self.write(&mut f)?;
        f.flush()
    }

    fn write(&self, out: &mut impl Write) -> std::io::Result<()> {
        let align = alignment_of(&self.metadata);
        // The tensors are in memory, so their offsets cannot overflow.
        let (offsets, _) = place(self.tensors.iter().map(|t| t.data.len() as u64), align).unwrap_or_default();
        let infos: Vec<HeaderTensor> =
            self.tensors.iter().zip(&offsets).map(|(t, &offset)| HeaderTensor { name: &t.name, ty: t.ty, dims: &t.dims, offset }).collect();
        out.write_all(&encode_header(self.version, &self.metadata, &infos, align))?;
        let mut at = 0u64;
        for (t, &offset) in self.tensors.iter().zip(&offsets) {
            out.write_all(&vec![0u8; (offset - at) as usize])?;
            out.write_all(&t.data)?;
            at = offset + t.data.len() as u64;
        }
        Ok(())
    }
}

/// The alignment `general.alignment` sets, or the default when it is absent or invalid (a
/// reader rejects the invalid ones).
pub(crate) fn alignment_of(metadata: &[(String, Value)]) -> u64 {
    match metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
        Some((_, Value::U32(a))) if a.is_power_of_two() => (*a).into(),
        _ => DEFAULT_ALIGNMENT,
    }
}

/// A tensor info as the header records it; `offset` is relative to the data section.
pub(crate) struct HeaderTensor<'a> {
    pub name: &'a str,
    pub ty: GgmlType,
    pub dims: &'a [u64],
    pub offset: u64,
}

/// Each tensor's offset in a data section that puts them in order, each at a multiple of
/// `align`, and the section's length; None on overflow.
pub(crate) fn place(sizes: impl Iterator<Item = u64>, align: u64) -> Option<(Vec<u64>, u64)> {
    let mut offsets = Vec::new();
    let mut len = 0u64;
    for n in sizes {
        len = len.checked_next_multiple_of(align)?;
        offsets.push(len);
        len = len.checked_add(n)?;
    }
    Some((offsets, len))
}

/// Magic, version, counts, metadata and tensor infos, zero-padded to a multiple of `align`
/// (where the data section starts).
pub(crate) fn encode_header(version: u32, metadata: &[(String, Value)], tensors: &[HeaderTensor], align: u64) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (key, value) in metadata {
        write_kv(&mut out, key, value);
    }
    for t in tensors {
        write_str(&mut out, t.name);
        out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in t.dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&t.ty.id().to_le_bytes());
        out.extend_from_slice(&t.offset.to_le_bytes());
    }
    out.resize(out.len().next_multiple_of(align as usize), 0);
    out
}

/// A metadata entry as GGUF encodes it: key, value type id, value.
pub(crate) fn write_kv(out: &mut Vec<u8>, key: &str, value: &Value) {
    write_str(out, key);
    out.extend_from_slice(&value.type_id().to_le_bytes());
    write_value(out, value);
}

pub(crate) fn is_homogeneous(value: &Value) -> bool {
    match value {
        Value::Array(items) => {
            let first = items.first().map(Value::type_id);
            items.iter().all(|v| Some(v.type_id()) == first && is_homogeneous(v))
        }
        _ => true,
    }
}

pub(crate) fn write_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn write_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => out.push(*v),
        Value::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(*v)),
        Value::String(s) => write_str(out, s),
        Value::Array(items) => {
            // An empty array's element type is not recoverable; u8 is as good as any.
            let elem = items.first().map_or(type_id::U8, Value::type_id);
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                write_value(out, item);
            }
        }
    }
}
