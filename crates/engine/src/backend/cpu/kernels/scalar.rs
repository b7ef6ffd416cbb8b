//! Portable kernels: the reference order, written out lane by lane.

use super::{layout as at, reduce16, FastType, Part};
use half::f16;

/// The f16 at byte `i` of `b`, widened.
fn h(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// A K-quant super-block's factors: chunk `j`'s half `h` (elements `16h..16h + 16`) is
/// `q * t[2j + h] + t[16 + 2j + h]`, except for Q4_K and Q5_K (one pair per chunk: `t[j]`,
/// `t[8 + j]`). Every entry is a small integer times an f16 (or a power of two times one), so
/// exact; the SIMD kernels compute the same products.
fn table(ty: FastType, b: &[u8]) -> [f32; 32] {
    let mut t = [0f32; 32];
    let twelve = |at: usize| -> [u8; 12] { std::array::from_fn(|i| b[at + i]) };
    match ty {
        FastType::Q4_K | FastType::Q5_K => {
            let s = at::q45k_scales(twelve(at::Q45K_SCALES));
            let (d, dmin) = (h(b, 0), h(b, 2));
            for i in 0..8 {
                t[i] = s[i] as f32 * d;
                t[8 + i] = s[8 + i] as f32 * -dmin;
            }
        }
        FastType::Q6_K => {
            let d = h(b, at::Q6K_D);
            for i in 0..16 {
                let s = b[at::Q6K_SCALES + i] as i8 as f32;
                t[i] = s * d;
                t[16 + i] = s * (-32.0 * d);
            }
        }
        FastType::Q3_K => {
            let s = at::q3k_scales(twelve(at::Q3K_SCALES));
            let d = h(b, at::Q3K_D);
            for i in 0..16 {
                let s = (s[i] as i32 - 32) as f32;
                t[i] = s * d;
                t[16 + i] = s * (-4.0 * d);
            }
        }
        FastType::Q2_K => {
            let (d, dmin) = (h(b, at::Q2K_D), h(b, at::Q2K_D + 2));
            for i in 0..16 {
                t[i] = (b[i] & 15) as f32 * d;
                t[16 + i] = (b[i] >> 4) as f32 * -dmin;
            }
        }
        _ => {}
    }
    t
}

/// Calls `f` with each 32-element chunk of block `b`, in order, dequantized exactly.
#[inline(always)]
fn block(ty: FastType, b: &[u8], f: &mut impl FnMut(&[f32; 32])) {
    let mut w = [0f32; 32];
    match ty {
        FastType::F32 => {
            for (i, v) in w.iter_mut().enumerate() {
                *v = f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
            }
            f(&w);
        }
        FastType::F16 => {
            for (i, v) in w.iter_mut().enumerate() {
                *v = h(b, 2 * i);
            }
            f(&w);
        }
        FastType::Bf16 => {
            for (i, v) in w.iter_mut().enumerate() {
                *v = f32::from_bits((u16::from_le_bytes([b[2 * i], b[2 * i + 1]]) as u32) << 16);
            }
            f(&w);
        }
        FastType::Q4_0 => {
            let d = h(b, 0);
            for j in 0..16 {
                w[j] = ((b[2 + j] & 0xF) as i32 - 8) as f32 * d;
                w[j + 16] = ((b[2 + j] >> 4) as i32 - 8) as f32 * d;
            }
            f(&w);
        }
        FastType::Q4_1 => {
            let (d, m) = (h(b, 0), h(b, 2));
            for j in 0..16 {
                w[j] = ((b[4 + j] & 0xF) as f32).mul_add(d, m);
                w[j + 16] = ((b[4 + j] >> 4) as f32).mul_add(d, m);
            }
            f(&w);
        }
        FastType::Q5_0 | FastType::Q5_1 => {
            // Q5_1 adds a minimum after d; the fifth bits of the 32 elements follow, then nibbles.
            let one = ty == FastType::Q5_1;
            let (d, m) = (h(b, 0), if one { h(b, 2) } else { 0.0 });
            let qh_at = if one { 4 } else { 2 };
            let qh = u32::from_le_bytes([b[qh_at], b[qh_at + 1], b[qh_at + 2], b[qh_at + 3]]);
            for j in 0..32 {
                let q = (b[qh_at + 4 + j % 16] >> (4 * (j / 16))) as u32 & 0xF | ((qh >> j) & 1) << 4;
                w[j] = if one { (q as f32).mul_add(d, m) } else { (q as i32 - 16) as f32 * d };
            }
            f(&w);
        }
        FastType::Q8_0 => {
            let d = h(b, 0);
            for (j, v) in w.iter_mut().enumerate() {
                *v = (b[2 + j] as i8) as f32 * d;
            }
            f(&w);
        }
        FastType::Q4_K | FastType::Q5_K => {
            let t = table(ty, b);
            let five = ty == FastType::Q5_K;
            let qs = if five { at::Q5K_QS } else { at::Q4K_QS };
            for j in 0..8 {
                // Each 32 bytes hold two chunks: the first in the low nibbles, the next in the high.
                for e in 0..32 {
                    let mut q = (b[qs + 32 * (j / 2) + e] >> (4 * (j % 2))) & 0xF;
                    if five {
                        q |= ((b[at::Q5K_QH + e] >> j) & 1) << 4;
                    }
                    w[e] = (q as f32).mul_add(t[j], t[8 + j]);
                }
                f(&w);
            }
        }
        FastType::Q6_K => {
            let t = table(ty, b);
            for j in 0..8 {
                // Each 128 elements: low nibbles of 64 bytes (two chunks' worth in the low
                // nibbles, two in the high) and a pair of high bits per element from 32 bytes.
                let (n, c) = (j / 4, j % 4);
                for e in 0..32 {
                    let lo = (b[64 * n + 32 * (c % 2) + e] >> (4 * (c / 2))) & 0xF;
                    let hi = (b[at::Q6K_QH + 32 * n + e] >> (2 * c)) & 3;
                    let i = 2 * j + e / 16;
                    w[e] = ((lo | hi << 4) as f32).mul_add(t[i], t[16 + i]);
                }
                f(&w);
            }
        }
        FastType::Q3_K | FastType::Q2_K => {
            // Four chunks per 32 code bytes, two bits each; Q3_K adds a third bit per element
            // (bit `j` of its mask byte) and stores `code - 4`, which the factors account for.
            let t = table(ty, b);
            let three = ty == FastType::Q3_K;
            let qs = if three { at::Q3K_QS } else { at::Q2K_QS };
            for j in 0..8 {
                for e in 0..32 {
                    let mut q = (b[qs + 32 * (j / 4) + e] >> (2 * (j % 4))) & 3;
                    if three {
                        q |= ((b[e] >> j) & 1) << 2;
                    }
                    let i = 2 * j + e / 16;
                    w[e] = (q as f32).mul_add(t[i], t[16 + i]);
                }
                f(&w);
            }
        }
    }
}

/// The kernel for type number `T` (`p.ty`).
///
/// # Safety
/// `p.w` holds `p.n_rows` rows of `p.row_bytes` bytes, each at least `p.blocks.end` blocks; each
/// column holds that many blocks' elements; `p.acc` has room for `p.n_rows * N * 32` floats when
/// `p.resume` or `p.suspend`; `p.out` is valid for the writes at `c * p.stride + r` otherwise.
pub(super) unsafe fn gemv<const N: usize, const T: u8>(p: &Part<N>) {
    let ty = FastType::ALL[T as usize];
    let (bb, per) = (ty.block_bytes(), ty.block_chunks());
    for r in 0..p.n_rows {
        // SAFETY: row `r < n_rows` holds `blocks.end` blocks of `bb` bytes, as the caller vouches.
        let row = unsafe { std::slice::from_raw_parts(p.w.add(r * p.row_bytes), p.blocks.end * bb) };
        let acc = p.acc.wrapping_add(r * N * 32);
        let (mut lo, mut hi) = ([[0f32; 16]; N], [[0f32; 16]; N]);
        if p.resume {
            for c in 0..N {
                // SAFETY: the caller gave room for row `r`'s sums, `N * 32` floats at `acc`.
                unsafe {
                    lo[c] = std::ptr::read(acc.add(c * 32) as *const [f32; 16]);
                    hi[c] = std::ptr::read(acc.add(c * 32 + 16) as *const [f32; 16]);
                }
            }
        }
        let mut xo = p.blocks.start * per * 32;
        for b in p.blocks.clone() {
            block(ty, &row[b * bb..(b + 1) * bb], &mut |w| {
                for c in 0..N {
                    // SAFETY: chunk `xo / 32` is inside `blocks`, so its 32 floats are inside
                    // each column, as the caller vouches.
                    let x = unsafe { &*(p.x[c].add(xo) as *const [f32; 32]) };
                    for l in 0..16 {
                        lo[c][l] = w[l].mul_add(x[l], lo[c][l]);
                    }
                    for l in 0..16 {
                        hi[c][l] = w[16 + l].mul_add(x[16 + l], hi[c][l]);
                    }
                }
                xo += 32;
            });
        }
        for c in 0..N {
            if p.suspend {
                // SAFETY: as for the reads above.
                unsafe {
                    std::ptr::write(acc.add(c * 32) as *mut [f32; 16], lo[c]);
                    std::ptr::write(acc.add(c * 32 + 16) as *mut [f32; 16], hi[c]);
                }
            } else {
                // SAFETY: `c < N` and `r < n_rows`: an index the caller gave room for.
                unsafe { *p.out.add(c * p.stride + r) = reduce16(&std::array::from_fn(|l| lo[c][l] + hi[c][l])) };
            }
        }
    }
}

/// Dequantizes the `n_blocks` blocks of type number `T` at `p` into `out`, 32 floats a chunk.
///
/// # Safety
/// `p` is valid for reading `n_blocks` blocks and `out` for writing their elements.
pub(super) unsafe fn dequant<const T: u8>(p: *const u8, n_blocks: usize, out: *mut f32) {
    let ty = FastType::ALL[T as usize];
    let bb = ty.block_bytes();
    // SAFETY: the caller vouches for both buffers: `n_blocks` blocks of `bb` bytes, and
    // `32 * block_chunks` floats for each.
    let (w, out) =
        unsafe { (std::slice::from_raw_parts(p, n_blocks * bb), std::slice::from_raw_parts_mut(out, n_blocks * ty.block_chunks() * 32)) };
    let mut chunks = out.chunks_exact_mut(32);
    for b in w.chunks_exact(bb) {
        block(ty, b, &mut |v| chunks.next().expect("a chunk per 32 elements").copy_from_slice(v));
    }
}

/// Element `i` of a plain (non-block) row, for the tail past the last whole 32.
pub(super) fn element(ty: FastType, row: &[u8], i: usize) -> f32 {
    match ty {
        FastType::F32 => f32::from_le_bytes([row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]]),
        FastType::F16 => h(row, 2 * i),
        FastType::Bf16 => f32::from_bits((u16::from_le_bytes([row[2 * i], row[2 * i + 1]]) as u32) << 16),
        // Block types have no tail: their rows are whole blocks.
        _ => 0.0,
    }
}
