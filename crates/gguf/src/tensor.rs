//! Tensor descriptors and the shape arithmetic shared by reader and writer.

use crate::error::GgufError;
use crate::types::GgmlType;

/// Most dimensions a ggml tensor has.
pub const MAX_DIMS: usize = 4;

#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    pub ty: GgmlType,
    /// ggml order: `dims[0]` is the row length (contiguous in memory).
    pub dims: Vec<u64>,
    /// Byte offset relative to the data section.
    pub offset: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    // Saturating: the fields are public, so an info not produced by the reader may be anything.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().fold(1u64, |a, &d| a.saturating_mul(d))
    }

    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(0)
    }

    pub fn n_rows(&self) -> u64 {
        self.dims.iter().skip(1).fold(1u64, |a, &d| a.saturating_mul(d))
    }
}

/// Validates a tensor shape and returns its byte size. `offset` locates the tensor info in the
/// file when the shape came from one.
pub(crate) fn tensor_n_bytes(name: &str, ty: GgmlType, dims: &[u64], offset: Option<u64>) -> Result<u64, GgufError> {
    if dims.is_empty() || dims.len() > MAX_DIMS {
        return Err(GgufError::InvalidDimCount { tensor: name.to_owned(), n_dims: dims.len() as u64, offset });
    }
    if let Some(index) = dims.iter().position(|&d| d == 0) {
        return Err(GgufError::ZeroDim { tensor: name.to_owned(), index, offset });
    }
    let overflow = || GgufError::ShapeOverflow { tensor: name.to_owned(), offset };
    let mut n_rows = 1u64;
    for &d in &dims[1..] {
        n_rows = n_rows.checked_mul(d).ok_or_else(overflow)?;
    }
    let row_len = dims[0];
    row_len.checked_mul(n_rows).ok_or_else(overflow)?;
    if !row_len.is_multiple_of(ty.block_size() as u64) {
        return Err(GgufError::RowNotBlockMultiple { tensor: name.to_owned(), ty, row_len, block_size: ty.block_size(), offset });
    }
    let row_bytes = ty.row_bytes(row_len).ok_or_else(overflow)?;
    row_bytes.checked_mul(n_rows).ok_or_else(overflow)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_checks() {
        assert_eq!(tensor_n_bytes("t", GgmlType::Q8_0, &[64, 3], None).ok(), Some(2 * 34 * 3));
        assert!(matches!(tensor_n_bytes("t", GgmlType::F32, &[], None), Err(GgufError::InvalidDimCount { .. })));
        assert!(matches!(tensor_n_bytes("t", GgmlType::F32, &[1; 5], None), Err(GgufError::InvalidDimCount { .. })));
        assert!(matches!(tensor_n_bytes("t", GgmlType::F32, &[2, 0], None), Err(GgufError::ZeroDim { index: 1, .. })));
        assert!(matches!(tensor_n_bytes("t", GgmlType::F32, &[1 << 40, 1 << 40], None), Err(GgufError::ShapeOverflow { .. })));
        assert!(matches!(tensor_n_bytes("t", GgmlType::F32, &[1 << 62, 1], None), Err(GgufError::ShapeOverflow { .. })));
        assert!(matches!(tensor_n_bytes("t", GgmlType::Q4_0, &[48], None), Err(GgufError::RowNotBlockMultiple { row_len: 48, .. })));
        let info = TensorInfo { name: "t".into(), ty: GgmlType::F32, dims: vec![3, 4, 5], offset: 0, n_bytes: 240 };
        assert_eq!((info.n_elements(), info.row_len(), info.n_rows()), (60, 3, 20));
    }
}
