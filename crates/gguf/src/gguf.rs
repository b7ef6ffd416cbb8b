//! An opened, validated GGUF file.

use crate::error::GgufError;
use crate::read::{parse, Header};
use crate::tensor::TensorInfo;
use crate::value::Value;
use memmap2::Mmap;
use std::path::Path;

/// The file's bytes: mapped for real models, owned for tests and fuzzing.
enum Bytes {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// A GGUF file whose header, metadata and tensor layout were fully validated when it was opened.
pub struct Gguf {
    bytes: Bytes,
    header: Header,
}

impl Gguf {
    /// Maps `path` read-only and validates it.
    pub fn open(path: &Path) -> Result<Gguf, GgufError> {
        let io = |source| GgufError::Io { path: path.to_owned(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the mapping is read-only; as with any mmap, another process truncating or
        // rewriting the file while it is mapped is outside what this crate can guard against.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::new(Bytes::Mapped(map))
    }

    /// Validates an in-memory file exactly as [`Gguf::open`] does.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Gguf, GgufError> {
        Self::new(Bytes::Owned(bytes))
    }

    fn new(bytes: Bytes) -> Result<Gguf, GgufError> {
        let header = parse(bytes.as_slice())?;
        Ok(Gguf { bytes, header })
    }

    pub fn version(&self) -> u32 {
        self.header.version
    }

    pub fn alignment(&self) -> u64 {
        self.header.alignment
    }

    /// Absolute file offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.header.data_offset
    }

    /// Metadata in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.header.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        let i = *self.header.key_index.get(key)?;
        self.header.metadata.get(i).map(|(_, v)| v)
    }

    fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey { key: key.to_owned() })
    }

    fn wrong_type(key: &str, expected: &'static str, found: &Value) -> GgufError {
        GgufError::WrongType { key: key.to_owned(), expected, found: found.type_name() }
    }

    /// A non-negative integer of any width.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.require(key)?;
        v.as_u64().ok_or_else(|| Self::wrong_type(key, "non-negative integer", v))
    }

    /// A float or integer, converted to f32.
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        let v = self.require(key)?;
        v.as_f32().ok_or_else(|| Self::wrong_type(key, "number", v))
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| Self::wrong_type(key, "string", v))
    }

    /// Tensor descriptors in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.header.tensors.get(*self.header.tensor_index.get(name)?)
    }

    /// The tensor's bytes. Ranges of this file's tensors were checked at open; an info from
    /// elsewhere that does not fit yields an empty slice rather than a panic.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let range = self
            .header
            .data_offset
            .checked_add(t.offset)
            .and_then(|start| Some((usize::try_from(start).ok()?, usize::try_from(t.n_bytes).ok()?)))
            .and_then(|(start, len)| Some(start..start.checked_add(len)?));
        range.and_then(|r| self.bytes.as_slice().get(r)).unwrap_or(&[])
    }

    pub fn file_bytes(&self) -> &[u8] {
        self.bytes.as_slice()
    }
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("version", &self.header.version)
            .field("len", &self.bytes.as_slice().len())
            .field("metadata", &self.header.metadata.len())
            .field("tensors", &self.header.tensors.len())
            .finish()
    }
}
