//! GGUF header parsing, from the whole file or from a prefix of it. Every count and length is
//! checked against the file's bytes left before it is used, allocations are bounded by the bytes
//! in hand, and all offset arithmetic is checked, so hostile input yields an error rather than a
//! panic, a huge allocation or a long loop.

use crate::error::GgufError;
use crate::tensor::{tensor_n_bytes, TensorInfo, MAX_DIMS};
use crate::types::GgmlType;
use crate::value::{min_encoded_size, type_id, Value, MAX_ARRAY_DEPTH};
use std::collections::HashMap;

pub(crate) const MAGIC: &[u8; 4] = b"GGUF";
pub(crate) const DEFAULT_ALIGNMENT: u64 = 32;
pub(crate) const ALIGNMENT_KEY: &str = "general.alignment";

/// Smallest tensor info: name length, n_dims, one dim, type, offset.
const MIN_TENSOR_INFO: u64 = 8 + 4 + 8 + 4 + 8;
/// Smallest metadata entry: key length, value type, a one-byte value.
const MIN_KV: u64 = 8 + 4 + 1;

/// Everything the header says, validated against the file's bytes.
pub(crate) struct Header {
    pub version: u32,
    pub alignment: u64,
    pub data_offset: u64,
    pub metadata: Vec<(String, Value)>,
    pub key_index: HashMap<String, usize>,
    pub tensors: Vec<TensorInfo>,
    pub tensor_index: HashMap<String, usize>,
}

/// Reads `buf`, the first bytes of a `file_len`-byte file (all of it, unless only the header was
/// read). Counts are checked against the whole file's remaining bytes, allocations only against
/// the bytes in hand, so a prefix never allocates for bytes it has not read.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    file_len: u64,
}

impl<'a> Cursor<'a> {
    fn offset(&self) -> u64 {
        self.pos as u64
    }

    /// Bytes left in the file (not just in `buf`).
    fn remaining(&self) -> u64 {
        self.file_len.saturating_sub(self.offset())
    }

    /// How many items of at least `min_size` bytes to preallocate for `count` of them: no more
    /// than the bytes in hand can hold.
    fn capacity(&self, count: usize, min_size: u64) -> usize {
        let in_hand = self.buf.len().saturating_sub(self.pos) as u64;
        count.min(usize::try_from(in_hand / min_size.max(1)).unwrap_or(usize::MAX))
    }

    fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], GgufError> {
        let slice = self.pos.checked_add(n).and_then(|end| self.buf.get(self.pos..end)).ok_or(GgufError::Truncated {
            field,
            offset: self.offset(),
            needed: n as u64,
            available: self.remaining(),
        })?;
        self.pos += n;
        Ok(slice)
    }

    fn bytes<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, field)?);
        Ok(out)
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, GgufError> {
        self.bytes(field).map(u32::from_le_bytes)
    }

    fn u64(&mut self, field: &'static str) -> Result<u64, GgufError> {
        self.bytes(field).map(u64::from_le_bytes)
    }

    /// Reads a u64 count of items each at least `min_size` bytes, rejecting counts the rest of
    /// the file cannot hold so callers may allocate `count` items.
    fn count(&mut self, field: &'static str, min_size: u64) -> Result<usize, GgufError> {
        let offset = self.offset();
        let count = self.u64(field)?;
        let remaining = self.remaining();
        let fits = count.checked_mul(min_size).is_some_and(|n| n <= remaining);
        match usize::try_from(count) {
            Ok(n) if fits => Ok(n),
            _ => Err(GgufError::CountTooLarge { field, offset, count, remaining }),
        }
    }

    fn string(&mut self, field: &'static str) -> Result<String, GgufError> {
        let offset = self.offset();
        let len = self.count(field, 1)?;
        let bytes = self.take(len, field)?;
        std::str::from_utf8(bytes).map(str::to_owned).map_err(|_| GgufError::InvalidUtf8 { field, offset })
    }

    /// Reads a value of type `id`; `depth` counts enclosing arrays.
    fn value(&mut self, id: u32, key: &str, id_offset: u64, depth: u32) -> Result<Value, GgufError> {
        const F: &str = "metadata value";
        Ok(match id {
            type_id::U8 => Value::U8(u8::from_le_bytes(self.bytes(F)?)),
            type_id::I8 => Value::I8(i8::from_le_bytes(self.bytes(F)?)),
            type_id::U16 => Value::U16(u16::from_le_bytes(self.bytes(F)?)),
            type_id::I16 => Value::I16(i16::from_le_bytes(self.bytes(F)?)),
            type_id::U32 => Value::U32(u32::from_le_bytes(self.bytes(F)?)),
            type_id::I32 => Value::I32(i32::from_le_bytes(self.bytes(F)?)),
            type_id::U64 => Value::U64(u64::from_le_bytes(self.bytes(F)?)),
            type_id::I64 => Value::I64(i64::from_le_bytes(self.bytes(F)?)),
            type_id::F32 => Value::F32(f32::from_le_bytes(self.bytes(F)?)),
            type_id::F64 => Value::F64(f64::from_le_bytes(self.bytes(F)?)),
            type_id::BOOL => {
                let offset = self.offset();
                match self.bytes::<1>(F)?[0] {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    value => return Err(GgufError::InvalidBool { key: key.to_owned(), value, offset }),
                }
            }
            type_id::STRING => Value::String(self.string("metadata string")?),
            type_id::ARRAY => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::ArrayTooDeep { key: key.to_owned(), max: MAX_ARRAY_DEPTH, offset: id_offset });
                }
                let elem_offset = self.offset();
                let elem_id = self.u32("array element type")?;
                let min_size = min_encoded_size(elem_id).ok_or_else(|| GgufError::UnknownValueType {
                    key: key.to_owned(),
                    id: elem_id,
                    offset: elem_offset,
                })?;
                let n = self.count("array length", min_size)?;
                let mut items = Vec::with_capacity(self.capacity(n, min_size));
                for _ in 0..n {
                    items.push(self.value(elem_id, key, elem_offset, depth + 1)?);
                }
                Value::Array(items)
            }
            _ => return Err(GgufError::UnknownValueType { key: key.to_owned(), id, offset: id_offset }),
        })
    }
}

fn parse_alignment(value: &Value, offset: u64) -> Result<u64, GgufError> {
    match *value {
        Value::U32(a) if a.is_power_of_two() => Ok(a.into()),
        ref other => Err(GgufError::InvalidAlignment { found: format!("{other:?}"), offset }),
    }
}

/// Parses the header of a `file_len`-byte file from `buf`, its first bytes. A `Truncated` error
/// while `buf` is shorter than the file may only mean that more of the file is needed.
pub(crate) fn parse(buf: &[u8], file_len: u64) -> Result<Header, GgufError> {
    let mut c = Cursor { buf, pos: 0, file_len };
    let magic = c.bytes::<4>("magic")?;
    if &magic != MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion { version });
    }
    let n_tensors = c.count("tensor count", MIN_TENSOR_INFO)?;
    let n_kv = c.count("metadata count", MIN_KV)?;

    let mut metadata = Vec::with_capacity(c.capacity(n_kv, MIN_KV));
    let mut key_index = HashMap::with_capacity(c.capacity(n_kv, MIN_KV));
    let mut alignment = DEFAULT_ALIGNMENT;
    for _ in 0..n_kv {
        let key_offset = c.offset();
        let key = c.string("metadata key")?;
        let id_offset = c.offset();
        let id = c.u32("metadata value type")?;
        let value = c.value(id, &key, id_offset, 0)?;
        if key == ALIGNMENT_KEY {
            alignment = parse_alignment(&value, id_offset)?;
        }
        if key_index.insert(key.clone(), metadata.len()).is_some() {
            return Err(GgufError::DuplicateKey { key, offset: key_offset });
        }
        metadata.push((key, value));
    }

    let mut tensors = Vec::with_capacity(c.capacity(n_tensors, MIN_TENSOR_INFO));
    let mut tensor_index = HashMap::with_capacity(c.capacity(n_tensors, MIN_TENSOR_INFO));
    for _ in 0..n_tensors {
        let info_offset = c.offset();
        let name = c.string("tensor name")?;
        let at = Some(info_offset);
        let n_dims = c.u32("tensor n_dims")?;
        if n_dims == 0 || n_dims as usize > MAX_DIMS {
            return Err(GgufError::InvalidDimCount { tensor: name, n_dims: n_dims.into(), offset: at });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64("tensor dim")?);
        }
        let type_id = c.u32("tensor type")?;
        let ty =
            GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType { tensor: name.clone(), id: type_id, offset: at })?;
        let offset = c.u64("tensor offset")?;
        let n_bytes = tensor_n_bytes(&name, ty, &dims, at)?;
        if offset % alignment != 0 {
            return Err(GgufError::MisalignedOffset { tensor: name, data_offset: offset, alignment });
        }
        if tensor_index.insert(name.clone(), tensors.len()).is_some() {
            return Err(GgufError::DuplicateTensor { tensor: name, offset: at });
        }
        tensors.push(TensorInfo { name, ty, dims, offset, n_bytes });
    }

    let header_end = c.offset();
    let data_offset =
        header_end.checked_next_multiple_of(alignment).ok_or(GgufError::Overflow { what: "data section start", offset: header_end })?;
    check_tensor_ranges(&tensors, data_offset, file_len)?;
    Ok(Header { version, alignment, data_offset, metadata, key_index, tensors, tensor_index })
}

/// Every tensor must lie inside the file and no two may share a byte.
fn check_tensor_ranges(tensors: &[TensorInfo], data_offset: u64, file_len: u64) -> Result<(), GgufError> {
    for t in tensors {
        let start = data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.n_bytes));
        if !matches!(end, Some(end) if end <= file_len) {
            return Err(GgufError::TensorOutOfBounds {
                tensor: t.name.clone(),
                start: start.unwrap_or(u64::MAX),
                n_bytes: t.n_bytes,
                file_len,
            });
        }
    }
    let mut by_offset: Vec<&TensorInfo> = tensors.iter().collect();
    by_offset.sort_unstable_by_key(|t| t.offset);
    for pair in by_offset.windows(2) {
        if pair[0].offset.saturating_add(pair[0].n_bytes) > pair[1].offset {
            return Err(GgufError::TensorOverlap { first: pair[0].name.clone(), second: pair[1].name.clone() });
        }
    }
    Ok(())
}
