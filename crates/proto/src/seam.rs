//! How hidden rows are laid out in a `Forward` frame. f32 is lossless and the default; f16 and
//! bf16 halve the bytes at a seam and are opt-in.

use half::{bf16, f16};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, prost::Enumeration)]
#[repr(i32)]
pub enum SeamDtype {
    F32 = 0,
    F16 = 1,
    Bf16 = 2,
}

impl SeamDtype {
    pub fn size(self) -> usize {
        match self {
            SeamDtype::F32 => 4,
            SeamDtype::F16 | SeamDtype::Bf16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            SeamDtype::F32 => "f32",
            SeamDtype::F16 => "f16",
            SeamDtype::Bf16 => "bf16",
        }
    }

    pub fn parse(s: &str) -> Option<SeamDtype> {
        match s {
            "f32" => Some(SeamDtype::F32),
            "f16" => Some(SeamDtype::F16),
            "bf16" => Some(SeamDtype::Bf16),
            _ => None,
        }
    }
}

/// Little-endian bytes of `rows` in `dtype`.
pub fn encode_rows(rows: &[f32], dtype: SeamDtype) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows.len() * dtype.size());
    for &v in rows {
        match dtype {
            SeamDtype::F32 => out.extend_from_slice(&v.to_le_bytes()),
            SeamDtype::F16 => out.extend_from_slice(&f16::from_f32(v).to_le_bytes()),
            SeamDtype::Bf16 => out.extend_from_slice(&bf16::from_f32(v).to_le_bytes()),
        }
    }
    out
}

/// The inverse of `encode_rows`; `bytes.len()` must be a multiple of the dtype's size
/// (checked by `check_forward` before this is called).
pub fn decode_rows(bytes: &[u8], dtype: SeamDtype) -> Vec<f32> {
    match dtype {
        SeamDtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        SeamDtype::F16 => bytes.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        SeamDtype::Bf16 => bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
    }
}
