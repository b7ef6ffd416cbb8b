//! Each block type as integer codes and per-group factors: element `e` of group `g` of a block
//! is `m[g] * q[e] + o[g]`, with `q` a small integer and `m`, `o` exact f32 (a small integer
//! times an f16), the same values ggml's `dequantize_row_*` gives up to that rearrangement.

use super::super::layout::{self as at, F16_TO_F32};
use super::super::FastType;

/// The f16 at byte `i` of `b`, widened.
#[inline(always)]
fn h(b: &[u8], i: usize) -> f32 {
    F16_TO_F32[u16::from_le_bytes([b[i], b[i + 1]]) as usize]
}

/// Elements of a block: a K-quant's 256, a legacy type's 32.
pub(super) const fn elems(ty: FastType) -> usize {
    32 * ty.block_chunks()
}

/// Elements sharing a factor: 16 for the K-quants with 16 scales a block, else 32.
pub(super) const fn group(ty: FastType) -> usize {
    match ty {
        FastType::Q2_K | FastType::Q3_K | FastType::Q6_K => 16,
        _ => 32,
    }
}

/// Whether the type's elements have an offset `o` besides the factor (the rest have `o = 0`).
pub(super) const fn offset(ty: FastType) -> bool {
    matches!(ty, FastType::Q4_1 | FastType::Q5_1 | FastType::Q2_K | FastType::Q4_K | FastType::Q5_K)
}

/// The codes, factors and offsets of block `b` (of type `ty`, a block type) into the first
/// `elems(ty)` codes and `elems(ty) / group(ty)` factors.
#[inline(always)]
pub(super) fn unpack(ty: FastType, b: &[u8], q: &mut [i16; 256], m: &mut [f32; 16], o: &mut [f32; 16]) {
    factors(ty, b, m, o);
    codes(ty, b, q);
}

/// The factors and offsets of block `b`: the first `elems(ty) / group(ty)` of each (offsets 0
/// where the type has none).
#[inline(always)]
pub(super) fn factors(ty: FastType, b: &[u8], m: &mut [f32; 16], o: &mut [f32; 16]) {
    let twelve = |at: usize| -> [u8; 12] { std::array::from_fn(|i| b[at + i]) };
    match ty {
        FastType::Q4_0 | FastType::Q5_0 | FastType::Q8_0 => {
            m[0] = h(b, 0);
            o[0] = 0.0;
        }
        FastType::Q4_1 | FastType::Q5_1 => {
            m[0] = h(b, 0);
            o[0] = h(b, 2);
        }
        FastType::Q4_K | FastType::Q5_K => {
            let s = at::q45k_scales(twelve(at::Q45K_SCALES));
            let (d, dmin) = (h(b, 0), h(b, 2));
            for j in 0..8 {
                m[j] = s[j] as f32 * d;
                o[j] = s[8 + j] as f32 * -dmin;
            }
        }
        FastType::Q6_K => {
            let d = h(b, at::Q6K_D);
            for i in 0..16 {
                m[i] = b[at::Q6K_SCALES + i] as i8 as f32 * d;
                o[i] = 0.0;
            }
        }
        FastType::Q3_K => {
            let s = at::q3k_scales(twelve(at::Q3K_SCALES));
            let d = h(b, at::Q3K_D);
            for i in 0..16 {
                m[i] = (s[i] as i32 - 32) as f32 * d;
                o[i] = 0.0;
            }
        }
        FastType::Q2_K => {
            let (d, dmin) = (h(b, at::Q2K_D), h(b, at::Q2K_D + 2));
            for i in 0..16 {
                m[i] = (b[i] & 15) as f32 * d;
                o[i] = (b[i] >> 4) as f32 * -dmin;
            }
        }
        // Plain types have no integer kernel (see `super::has_int`).
        FastType::F32 | FastType::F16 | FastType::Bf16 => unreachable!("no codes for plain values"),
    }
}

/// The codes of block `b`: its first `elems(ty)` elements as small integers.
#[inline(always)]
pub(super) fn codes(ty: FastType, b: &[u8], q: &mut [i16; 256]) {
    match ty {
        FastType::Q4_0 | FastType::Q4_1 => {
            let one = ty == FastType::Q4_1;
            let qs = if one { 4 } else { 2 };
            let sub = if one { 0 } else { 8 };
            for j in 0..16 {
                q[j] = (b[qs + j] & 0xF) as i16 - sub;
                q[j + 16] = (b[qs + j] >> 4) as i16 - sub;
            }
        }
        FastType::Q5_0 | FastType::Q5_1 => {
            let one = ty == FastType::Q5_1;
            let qh_at = if one { 4 } else { 2 };
            let qh = u32::from_le_bytes([b[qh_at], b[qh_at + 1], b[qh_at + 2], b[qh_at + 3]]);
            let sub = if one { 0 } else { 16 };
            for j in 0..32 {
                let v = (b[qh_at + 4 + j % 16] >> (4 * (j / 16))) as u32 & 0xF | ((qh >> j) & 1) << 4;
                q[j] = v as i16 - sub;
            }
        }
        FastType::Q8_0 => {
            for j in 0..32 {
                q[j] = b[2 + j] as i8 as i16;
            }
        }
        FastType::Q4_K | FastType::Q5_K => {
            let five = ty == FastType::Q5_K;
            let qs = if five { at::Q5K_QS } else { at::Q4K_QS };
            for j in 0..8 {
                // Each 32 bytes hold two chunks: the first in the low nibbles, the next in the high.
                for e in 0..32 {
                    let mut v = (b[qs + 32 * (j / 2) + e] >> (4 * (j % 2))) & 0xF;
                    if five {
                        v |= ((b[at::Q5K_QH + e] >> j) & 1) << 4;
                    }
                    q[32 * j + e] = v as i16;
                }
            }
        }
        FastType::Q6_K => {
            for j in 0..8 {
                // Each 128 elements: low nibbles of 64 bytes (two chunks' worth in the low
                // nibbles, two in the high) and a pair of high bits per element from 32 bytes.
                let (n, c) = (j / 4, j % 4);
                for e in 0..32 {
                    let lo = (b[64 * n + 32 * (c % 2) + e] >> (4 * (c / 2))) & 0xF;
                    let hi = (b[at::Q6K_QH + 32 * n + e] >> (2 * c)) & 3;
                    q[32 * j + e] = (lo | hi << 4) as i16 - 32;
                }
            }
        }
        FastType::Q3_K | FastType::Q2_K => {
            // Four chunks per 32 code bytes, two bits each; Q3_K adds a third bit per element
            // (bit `j` of its mask byte), clear meaning 4 less.
            let three = ty == FastType::Q3_K;
            let qs = if three { at::Q3K_QS } else { at::Q2K_QS };
            for j in 0..8 {
                for e in 0..32 {
                    let mut v = ((b[qs + 32 * (j / 4) + e] >> (2 * (j % 4))) & 3) as i16;
                    if three {
                        v -= (((b[e] >> j) & 1) ^ 1) as i16 * 4;
                    }
                    q[32 * j + e] = v;
                }
            }
        }
        // Plain types have no integer kernel (see `super::has_int`).
        FastType::F32 | FastType::F16 | FastType::Bf16 => unreachable!("no codes for plain values"),
    }
}
