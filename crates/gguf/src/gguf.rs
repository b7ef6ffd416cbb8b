//! An opened, validated GGUF file: all of it mapped (or held), or only its header read and
//! then the tensors a process keeps mapped.

use crate::error::GgufError;
use crate::mapping::Runs;
use crate::read::{parse, Header};
use crate::slice::{read_slice, SliceInfo, SliceTable};
use crate::tensor::TensorInfo;
use crate::value::Value;
use memmap2::Mmap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The header is first read as this many bytes, then twice as many while they fall short.
const FIRST_HEADER_READ: u64 = 1 << 20;

/// The file's bytes: mapped for real models, owned for tests and fuzzing, (from
/// [`Gguf::read_header`]) the header's bytes and the runs of tensors mapped so far, or (from
/// [`Gguf::assemble`]) no file at all, only the held tensors.
pub(crate) enum Bytes {
    Mapped(Mmap),
    Owned(Vec<u8>),
    Partial { header: Vec<u8>, file: File, path: PathBuf, runs: Runs },
    Assembled(Runs),
}

impl Bytes {
    /// The bytes held from the file's start: all of them, or just the header.
    fn prefix(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
            Bytes::Partial { header, .. } => header,
            Bytes::Assembled(_) => &[],
        }
    }

    /// File bytes [start, end), if held.
    fn get(&self, start: u64, end: u64) -> Option<&[u8]> {
        match self {
            Bytes::Partial { runs, .. } | Bytes::Assembled(runs) => runs.get(start, end),
            whole => whole.prefix().get(usize::try_from(start).ok()?..usize::try_from(end).ok()?),
        }
    }
}

/// A GGUF file whose header, metadata and tensor layout were fully validated when it was opened.
pub struct Gguf {
    bytes: Bytes,
    header: Header,
    file_len: u64,
    slice: Option<SliceTable>,
}

impl Gguf {
    /// Maps `path` read-only and validates it.
    ///
    /// # The file must not change while it is mapped
    ///
    /// This and every other map of a model file (a slice's runs, a checkpoint's shards) assume
    /// that no process writes to or truncates the file while the `Gguf` lives: a write would
    /// change bytes behind a `&[u8]` (undefined behaviour), a truncation faults the reader
    /// (SIGBUS). dgr itself never does either: it writes every model file, slice and fetched
    /// tensor to a temporary file and renames it into place, which leaves an open map on the
    /// old file. This is the one thing the safe API takes on trust from its environment (as
    /// ARCHITECTURE.md says); keep model files out of reach of other writers.
    pub fn open(path: &Path) -> Result<Gguf, GgufError> {
        let io = |source| GgufError::Io { path: path.to_owned(), source };
        let file = File::open(path).map_err(io)?;
        // SAFETY: read-only, and the file does not change while mapped (see above).
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::whole(Bytes::Mapped(map))
    }

    /// Validates an in-memory file exactly as [`Gguf::open`] does.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Gguf, GgufError> {
        Self::whole(Bytes::Owned(bytes))
    }

    fn whole(bytes: Bytes) -> Result<Gguf, GgufError> {
        let file_len = bytes.prefix().len() as u64;
        let header = parse(bytes.prefix(), file_len)?;
        Self::new(bytes, header, file_len)
    }

    pub(crate) fn new(bytes: Bytes, header: Header, file_len: u64) -> Result<Gguf, GgufError> {
        let slice = read_slice(&header.metadata, &header.tensors)?;
        Ok(Gguf { bytes, header, file_len, slice })
    }

    /// Reads and validates only the header and maps no tensor bytes (see
    /// [`Gguf::map_tensors`]). The header is read with plain reads of a growing prefix, never
    /// past the file's end; tensor ranges are checked against the file's real length.
    pub fn read_header(path: &Path) -> Result<Gguf, GgufError> {
        let io = |source| GgufError::Io { path: path.to_owned(), source };
        let file = File::open(path).map_err(io)?;
        let file_len = file.metadata().map_err(io)?.len();
        let mut want = file_len.min(FIRST_HEADER_READ);
        let mut buf = Vec::new();
        loop {
            let have = buf.len();
            buf.resize(usize::try_from(want).map_err(|e| io(std::io::Error::other(e)))?, 0);
            file.read_exact_at(&mut buf[have..], have as u64).map_err(io)?;
            match parse(&buf, file_len) {
                // Short of the file's end, a truncated field only means the prefix was.
                Err(GgufError::Truncated { offset, needed, .. }) if want < file_len => {
                    want = want.saturating_mul(2).max(offset.saturating_add(needed)).min(file_len);
                }
                Err(e) => return Err(e),
                Ok(header) => {
                    buf.truncate(usize::try_from(header.data_offset).unwrap_or(usize::MAX));
                    buf.shrink_to_fit();
                    return Self::new(Bytes::Partial { header: buf, file, path: path.to_owned(), runs: Runs::default() }, header, file_len);
                }
            }
        }
    }

    /// Maps exactly the tensors `keep` selects (dropping any mapped before): one read-only map
    /// per run of tensors adjacent in the file, so the address space holds only those bytes.
    /// A Gguf from [`Gguf::open`] or [`Gguf::from_bytes`] already holds every tensor, and is
    /// left as it is.
    pub fn map_tensors(&mut self, keep: impl Fn(&TensorInfo) -> bool) -> Result<(), GgufError> {
        let Bytes::Partial { file, path, runs, .. } = &mut self.bytes else { return Ok(()) };
        let io = |source| GgufError::Io { path: path.clone(), source };
        let mut by_offset: Vec<&TensorInfo> = self.header.tensors.iter().collect();
        by_offset.sort_unstable_by_key(|t| t.offset);
        // Absolute ranges; a kept tensor right after a kept one extends its run.
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        let mut extend = false;
        for t in by_offset {
            if !keep(t) {
                extend = false;
                continue;
            }
            // Checked against the file's length when the header was read.
            let start = self.header.data_offset + t.offset;
            let end = start + t.n_bytes;
            match ranges.last_mut() {
                Some(last) if extend => last.1 = end,
                _ => ranges.push((start, end)),
            }
            extend = true;
        }
        let found = file.metadata().map_err(io)?.len();
        if found < self.file_len {
            return Err(GgufError::LengthMismatch { what: "file length since the header was read", expected: self.file_len, found });
        }
        *runs = Runs::map(file, &ranges).map_err(io)?;
        Ok(())
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

    /// `f` of each of the first `layers` layers' tensors summed, and of the head (`per_layer`).
    pub fn per_layer(&self, layers: usize, f: impl Fn(&TensorInfo) -> u64) -> (Vec<u64>, u64) {
        crate::slice::per_layer(self.tensors().iter().map(|t| (t.name.as_str(), f(t))), layers)
    }

    fn held(&self, t: &TensorInfo) -> Option<&[u8]> {
        let start = self.header.data_offset.checked_add(t.offset)?;
        self.bytes.get(start, start.checked_add(t.n_bytes)?)
    }

    /// The tensor's bytes. Ranges of this file's tensors were checked at open; a tensor not
    /// mapped (see [`Gguf::map_tensors`]) or an info from elsewhere that does not fit yields an
    /// empty slice rather than a panic.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        self.held(t).unwrap_or(&[])
    }

    /// Where t's bytes lie, for code that keeps a tensor's place rather than a borrow of it: a
    /// region index for [`Gguf::region`] and the offset of t's first byte in it. None if t is
    /// not held.
    pub fn tensor_location(&self, t: &TensorInfo) -> Option<(usize, usize)> {
        let start = self.header.data_offset.checked_add(t.offset)?;
        let end = start.checked_add(t.n_bytes)?;
        match &self.bytes {
            Bytes::Partial { runs, .. } | Bytes::Assembled(runs) => runs.locate(start, end),
            whole => whole.get(start, end).map(|_| (0, start as usize)),
        }
    }

    /// Region `i` of the held bytes (see [`Gguf::tensor_location`]): the whole file for a file
    /// held whole, else one mapped run of tensors; empty for an index that names none.
    pub fn region(&self, i: usize) -> &[u8] {
        match &self.bytes {
            Bytes::Partial { runs, .. } | Bytes::Assembled(runs) => runs.region(i),
            whole if i == 0 => whole.prefix(),
            _ => &[],
        }
    }

    /// Lets the OS drop this process's resident copy of bytes `range` of region `i` (for bytes
    /// an engine copied and will not read again): they stay mapped, and read the same from the
    /// file if touched. Nothing happens to bytes not mapped from a file.
    pub fn release(&self, i: usize, range: std::ops::Range<usize>) {
        match &self.bytes {
            Bytes::Partial { runs, .. } | Bytes::Assembled(runs) => runs.release(i, range),
            Bytes::Mapped(map) if i == 0 && range.end <= map.len() => crate::mapping::release(map, range.start, range.len()),
            _ => {}
        }
    }

    /// Whether [`Gguf::tensor_data`] can return t's bytes.
    pub fn is_mapped(&self, t: &TensorInfo) -> bool {
        self.held(t).is_some()
    }

    /// The file's bytes from its start: all of them from [`Gguf::open`] and
    /// [`Gguf::from_bytes`]; from [`Gguf::read_header`], only the header (up to the data
    /// section), whatever tensors are mapped; none for a model from [`Gguf::assemble`].
    pub fn file_bytes(&self) -> &[u8] {
        self.bytes.prefix()
    }

    pub(crate) fn file_len(&self) -> u64 {
        self.file_len
    }

    /// Whether the model was assembled from another format's files rather than read from GGUF.
    pub fn is_assembled(&self) -> bool {
        matches!(self.bytes, Bytes::Assembled(_))
    }

    /// Some when the file is a slice (its dgr.slice.* keys were validated at open).
    pub fn slice(&self) -> Option<&SliceInfo> {
        self.slice.as_ref().map(|s| &s.info)
    }

    pub(crate) fn slice_table(&self) -> Option<&SliceTable> {
        self.slice.as_ref()
    }

    /// The dims of a tensor of the whole model: this file's own, or for a slice, its table's.
    pub fn model_tensor_dims(&self, name: &str) -> Option<&[u64]> {
        match &self.slice {
            Some(s) => s.get(name).map(|t| t.dims.as_slice()),
            None => self.tensor(name).map(|t| t.dims.as_slice()),
        }
    }

    /// Whether the whole model has this tensor (for a slice, per its table).
    pub fn model_has_tensor(&self, name: &str) -> bool {
        self.model_tensor_dims(name).is_some()
    }
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("version", &self.header.version)
            .field("len", &self.file_len)
            .field("slice", &self.slice())
            .field("metadata", &self.header.metadata.len())
            .field("tensors", &self.header.tensors.len())
            .finish()
    }
}
