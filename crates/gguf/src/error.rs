//! The crate's error type. Positional variants carry the absolute byte offset of the field that
//! failed, so a bad file can be inspected with a hex dump.

use crate::types::GgmlType;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("metadata key {key:?}: a GGUF array cannot mix element types")]
    MixedArray { key: String },
    #[error("cannot read {path:?}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("bad magic {found:02x?} at offset 0 (expected \"GGUF\")")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported GGUF version {version} at offset 4 (supported: 2, 3)")]
    UnsupportedVersion { version: u32 },
    #[error("file truncated in {field} at offset {offset}: need {needed} bytes, {available} left")]
    Truncated { field: &'static str, offset: u64, needed: u64, available: u64 },
    #[error("{field} at offset {offset} is {count}, more than the {remaining} bytes left can hold")]
    CountTooLarge { field: &'static str, offset: u64, count: u64, remaining: u64 },
    #[error("{field} at offset {offset} is not valid UTF-8")]
    InvalidUtf8 { field: &'static str, offset: u64 },
    #[error("{what} overflows at offset {offset}")]
    Overflow { what: &'static str, offset: u64 },
    #[error("metadata key {key:?}: unknown value type id {id} at offset {offset}")]
    UnknownValueType { key: String, id: u32, offset: u64 },
    #[error("metadata key {key:?}: bool value {value} at offset {offset} is neither 0 nor 1")]
    InvalidBool { key: String, value: u8, offset: u64 },
    #[error("metadata key {key:?}: arrays nested deeper than {max} levels at offset {offset}")]
    ArrayTooDeep { key: String, max: u32, offset: u64 },
    #[error("duplicate metadata key {key:?} at offset {offset}")]
    DuplicateKey { key: String, offset: u64 },
    #[error("general.alignment at offset {offset} must be a nonzero power-of-two u32, found {found}")]
    InvalidAlignment { found: String, offset: u64 },
    #[error("tensor {tensor:?}{}: unknown ggml type id {id}", at(.offset))]
    UnknownTensorType { tensor: String, id: u32, offset: Option<u64> },
    #[error("duplicate tensor name {tensor:?}{}", at(.offset))]
    DuplicateTensor { tensor: String, offset: Option<u64> },
    #[error("tensor {tensor:?}{}: {n_dims} dimensions, expected 1 to 4", at(.offset))]
    InvalidDimCount { tensor: String, n_dims: u64, offset: Option<u64> },
    #[error("tensor {tensor:?}{}: dimension {index} is zero", at(.offset))]
    ZeroDim { tensor: String, index: usize, offset: Option<u64> },
    #[error("tensor {tensor:?}{}: element count or byte size overflows u64", at(.offset))]
    ShapeOverflow { tensor: String, offset: Option<u64> },
    #[error("tensor {tensor:?}{}: row length {row_len} is not a multiple of {ty:?}'s block size {block_size}", at(.offset))]
    RowNotBlockMultiple { tensor: String, ty: GgmlType, row_len: u64, block_size: usize, offset: Option<u64> },
    #[error("tensor {tensor:?}: data offset {data_offset} is not a multiple of the alignment {alignment}")]
    MisalignedOffset { tensor: String, data_offset: u64, alignment: u64 },
    #[error("tensor {tensor:?}: bytes [{start}, {start}+{n_bytes}) lie outside the {file_len}-byte file")]
    TensorOutOfBounds { tensor: String, start: u64, n_bytes: u64, file_len: u64 },
    #[error("tensors {first:?} and {second:?} overlap in the data section")]
    TensorOverlap { first: String, second: String },
    #[error("metadata key {key:?} is missing")]
    MissingKey { key: String },
    #[error("metadata key {key:?} has type {found}, expected {expected}")]
    WrongType { key: String, expected: &'static str, found: &'static str },
    #[error("{op} does not support {ty:?}")]
    UnsupportedType { ty: GgmlType, op: &'static str },
    #[error("{ty:?}: {n_elems} elements is not a whole number of {block_size}-element blocks")]
    PartialBlock { ty: GgmlType, n_elems: u64, block_size: usize },
    #[error("{what}: expected {expected} bytes, got {found}")]
    LengthMismatch { what: &'static str, expected: u64, found: u64 },
    #[error("tensor {tensor:?}: its bytes do not hash to the model's table")]
    TensorHashMismatch { tensor: String },
    #[error("dgr.slice.tensors entry {index}: {reason}")]
    BadSliceTable { index: usize, reason: String },
    #[error("layers [{start}, {end}) are not a nonempty range within [{lo}, {hi})")]
    BadLayerRange { start: u32, end: u32, lo: u32, hi: u32 },
    #[error("tensor {tensor:?}: {reason}")]
    SliceTensorMismatch { tensor: String, reason: &'static str },
    #[error("tensor {tensor:?} is not mapped")]
    TensorNotMapped { tensor: String },
}

/// Formats an optional header offset; the writer reports shape errors before any offset exists.
fn at(offset: &Option<u64>) -> String {
    offset.map_or_else(String::new, |o| format!(" (tensor info at offset {o})"))
}
