//! Portable kernels: the reference order, written out lane by lane.

use super::{reduce16, FastType};
use half::f16;

/// The little-endian u16 at `p`.
///
/// # Safety
/// `p` is valid for reading 2 bytes.
#[inline(always)]
unsafe fn rd16(p: *const u8) -> u16 {
    // SAFETY: the caller vouches for bytes `p` and `p + 1`.
    unsafe { u16::from_le_bytes([*p, *p.add(1)]) }
}

/// Dequantizes the 32 elements starting at `p` (one block, or 32 plain values) exactly.
///
/// # Safety
/// `p` is valid for reading `ty.chunk_bytes()` bytes.
#[inline(always)]
unsafe fn dequant(ty: FastType, p: *const u8, w: &mut [f32; 32]) {
    // SAFETY: every read below lies inside the chunk the caller vouches for: f32 reads bytes
    // `4i..4i + 4` for i < 32 (128 in all); f16 and bf16 bytes `2i..2i + 2` (64); Q4_0 the scale at
    // 0..2 and bytes 2..18 (18); Q4_1 the scales at 0..4 and bytes 4..20 (20); Q8_0 the scale at
    // 0..2 and bytes 2..34 (34).
    unsafe {
        match ty {
            FastType::F32 => {
                for (i, v) in w.iter_mut().enumerate() {
                    *v = f32::from_le_bytes(std::ptr::read_unaligned(p.add(4 * i) as *const [u8; 4]));
                }
            }
            FastType::F16 => {
                for (i, v) in w.iter_mut().enumerate() {
                    *v = f16::from_bits(rd16(p.add(2 * i))).to_f32();
                }
            }
            FastType::Bf16 => {
                for (i, v) in w.iter_mut().enumerate() {
                    *v = f32::from_bits((rd16(p.add(2 * i)) as u32) << 16);
                }
            }
            FastType::Q4_0 => {
                let d = f16::from_bits(rd16(p)).to_f32();
                for j in 0..16 {
                    let q = *p.add(2 + j);
                    w[j] = ((q & 0xF) as i32 - 8) as f32 * d;
                    w[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
                }
            }
            FastType::Q4_1 => {
                let d = f16::from_bits(rd16(p)).to_f32();
                let m = f16::from_bits(rd16(p.add(2))).to_f32();
                for j in 0..16 {
                    let q = *p.add(4 + j);
                    w[j] = ((q & 0xF) as f32).mul_add(d, m);
                    w[j + 16] = ((q >> 4) as f32).mul_add(d, m);
                }
            }
            FastType::Q8_0 => {
                let d = f16::from_bits(rd16(p)).to_f32();
                for (j, v) in w.iter_mut().enumerate() {
                    *v = (*p.add(2 + j) as i8) as f32 * d;
                }
            }
        }
    }
}

/// # Safety
/// `w` holds `n_rows` rows of `row_bytes` bytes, each at least `nb` chunks; each `x[c]`
/// holds `32 * nb` floats; `out` has room for index `(N - 1) * stride + n_rows - 1`.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemv<const N: usize>(
    ty: FastType,
    w: *const u8,
    row_bytes: usize,
    n_rows: usize,
    x: &[*const f32; N],
    nb: usize,
    out: *mut f32,
    stride: usize,
) {
    let cb = ty.chunk_bytes();
    for r in 0..n_rows {
        let row = w.wrapping_add(r * row_bytes);
        let (mut lo_acc, mut hi_acc) = ([[0f32; 16]; N], [[0f32; 16]; N]);
        let mut w = [0f32; 32];
        for b in 0..nb {
            // SAFETY: `r < n_rows` and `b < nb`, so chunk `b` of row `r` lies inside `w`, and
            // floats `32 b .. 32 b + 32` inside each column, as the caller vouches.
            unsafe {
                dequant(ty, row.add(b * cb), &mut w);
                for c in 0..N {
                    let xb = x[c].add(b * 32);
                    for l in 0..16 {
                        lo_acc[c][l] = w[l].mul_add(*xb.add(l), lo_acc[c][l]);
                    }
                    for l in 0..16 {
                        hi_acc[c][l] = w[16 + l].mul_add(*xb.add(16 + l), hi_acc[c][l]);
                    }
                }
            }
        }
        for c in 0..N {
            // SAFETY: `c < N` and `r < n_rows`: an index the caller gave room for.
            unsafe { *out.add(c * stride + r) = reduce16(&std::array::from_fn(|l| lo_acc[c][l] + hi_acc[c][l])) };
        }
    }
}

/// Element `i` of a plain (non-block) row, for the tail past the last whole 32.
pub(super) fn element(ty: FastType, row: &[u8], i: usize) -> f32 {
    match ty {
        FastType::F32 => f32::from_le_bytes([row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]]),
        FastType::F16 => f16::from_bits(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])).to_f32(),
        FastType::Bf16 => f32::from_bits((u16::from_le_bytes([row[2 * i], row[2 * i + 1]]) as u32) << 16),
        // Block types have no tail: their rows are whole blocks of 32.
        FastType::Q4_0 | FastType::Q4_1 | FastType::Q8_0 => 0.0,
    }
}
