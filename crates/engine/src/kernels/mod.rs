//! Matrix–vector kernels over GGUF's quantized blocks.
//!
//! Every kernel computes a row's dot product in one canonical order: two sets of 16 lanes, where
//! lane `l` of the first accumulates element `32b + l` and lane `l` of the second element
//! `32b + 16 + l` of each 32-element block `b`, in block order, with fused multiply-adds; then the
//! two sets are added lane by lane, the 16 lanes reduced in a fixed tree, and any tail added in
//! order. (Two sets, not one, so consecutive blocks form two independent dependency chains.) Weights are
//! dequantized exactly (`q * d + m` fits in an f32 mantissa), so the scalar, AVX2 and AVX-512
//! paths give bitwise identical results, and a row's result never depends on how many columns
//! (sequences) are computed beside it or on which thread computes it.

// The kernels index accumulators, columns and outputs by the same column number.
#![allow(clippy::needless_range_loop)]

mod avx2;
mod avx512;
mod isa;
mod scalar;

pub use isa::Isa;
pub(crate) use isa::Level;

use dgr_gguf::GgmlType;

/// Block types with a dedicated SIMD dequantizer; the rest go through an f32 row.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum FastType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q8_0,
}

impl FastType {
    pub(crate) fn of(ty: GgmlType) -> Option<FastType> {
        Some(match ty {
            GgmlType::F32 => FastType::F32,
            GgmlType::F16 => FastType::F16,
            GgmlType::BF16 => FastType::Bf16,
            GgmlType::Q4_0 => FastType::Q4_0,
            GgmlType::Q4_1 => FastType::Q4_1,
            GgmlType::Q8_0 => FastType::Q8_0,
            _ => return None,
        })
    }

    /// Bytes holding 32 consecutive elements of a row.
    pub(crate) const fn chunk_bytes(self) -> usize {
        match self {
            FastType::F32 => 128,
            FastType::F16 | FastType::Bf16 => 64,
            FastType::Q4_0 => 18,
            FastType::Q4_1 => 20,
            FastType::Q8_0 => 34,
        }
    }
}

/// The widest column group a kernel call handles.
pub(crate) const MAX_COLS: usize = 8;

/// `n_rows` rows in `ty`'s layout, each starting `row_bytes` after the previous one in `bytes`
/// (a row may be shorter than the stride, as a head's slice of a KV row is).
pub(crate) struct Rows<'a> {
    pub ty: FastType,
    pub bytes: &'a [u8],
    pub row_bytes: usize,
    pub n_rows: usize,
}

/// `out[c * stride + r] = row r · xs[c]` for every row of `w` and every column, where each row
/// has `k` elements (`k` a multiple of 32 for block types). Panics if `w.bytes` holds fewer than
/// `w.n_rows` rows of `k` elements or a column fewer than `k` floats.
///
/// # Safety
/// `out` is valid for writes at every such index, and nothing else accesses those elements
/// during the call (other threads may write other rows of the same buffer).
pub(crate) unsafe fn gemv(isa: Isa, w: &Rows, k: usize, xs: &[&[f32]], out: *mut f32, stride: usize) {
    // SAFETY: the caller's contract is passed on unchanged, except that the last arm hands
    // column `c` alone, whose outputs start at `out + c * stride`, inside what the caller vouched
    // for.
    unsafe {
        match xs.len() {
            8 => dispatch::<8>(isa, w, k, xs, out, stride),
            4 => dispatch::<4>(isa, w, k, xs, out, stride),
            2 => dispatch::<2>(isa, w, k, xs, out, stride),
            1 => dispatch::<1>(isa, w, k, xs, out, stride),
            n => {
                for c in 0..n {
                    dispatch::<1>(isa, w, k, &xs[c..c + 1], out.add(c * stride), stride);
                }
            }
        }
    }
}

/// The widest group (8, 4, 2 or 1 columns) that `n` remaining columns fill.
pub(crate) fn group(n: usize) -> usize {
    match n {
        n if n >= 8 => 8,
        n if n >= 4 => 4,
        n if n >= 2 => 2,
        _ => 1,
    }
}

/// # Safety
/// As for `gemv`.
unsafe fn dispatch<const N: usize>(isa: Isa, w: &Rows, k: usize, xs: &[&[f32]], out: *mut f32, stride: usize) {
    let nb = k / 32;
    let n_rows = w.n_rows;
    assert!(N > 0 && xs.len() == N && xs.iter().all(|x| x.len() >= k));
    // At most 4 bytes an element, and a column of `k` floats exists, so this cannot overflow.
    let row_len = nb * w.ty.chunk_bytes() + (k - nb * 32) * w.ty.chunk_bytes() / 32;
    // Checked arithmetic: a wrapped product must not let a short buffer through.
    let needed = n_rows.checked_sub(1).map_or(Some(0), |last| last.checked_mul(w.row_bytes).and_then(|b| b.checked_add(row_len)));
    assert!(needed.is_some_and(|n| w.bytes.len() >= n), "{n_rows} rows of {row_len} bytes every {} in {}", w.row_bytes, w.bytes.len());
    let xp: [*const f32; N] = std::array::from_fn(|i| xs[i].as_ptr());
    let (p, rb) = (w.bytes.as_ptr(), w.row_bytes);
    // SAFETY: the asserts above keep every read in bounds (each of the `n_rows` rows holds `nb`
    // whole chunks, each column `32 * nb` floats); the caller vouches for every write; and an
    // `Isa` above scalar exists only where detection found that set on this CPU (its field is
    // private), so the instructions each kernel is compiled for are present.
    unsafe {
        match isa.level() {
            Level::Avx512 => avx512::gemv::<N>(w.ty, p, rb, n_rows, &xp, nb, out, stride),
            Level::Avx2 => avx2::gemv::<N>(w.ty, p, rb, n_rows, &xp, nb, out, stride),
            Level::Scalar => scalar::gemv::<N>(w.ty, p, rb, n_rows, &xp, nb, out, stride),
        }
    }
    // Plain rows whose length is not a multiple of 32 finish sequentially.
    for r in 0..n_rows {
        let row = &w.bytes[r * rb..r * rb + row_len];
        for (c, x) in xs.iter().enumerate() {
            for j in nb * 32..k {
                // SAFETY: `c < N` and `r < n_rows`, so this is one of the outputs the caller
                // vouched for, and no other thread touches it during the call.
                unsafe {
                    let o = out.add(c * stride + r);
                    *o = scalar::element(w.ty, row, j).mul_add(x[j], *o);
                }
            }
        }
    }
}

/// The canonical reduction of 16 lanes: halves, then quarters, then pairs, then the last two.
#[inline(always)]
pub(crate) fn reduce16(l: &[f32; 16]) -> f32 {
    let mut a = [0f32; 8];
    for i in 0..8 {
        a[i] = l[i] + l[i + 8];
    }
    let b = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let c = [b[0] + b[2], b[1] + b[3]];
    c[0] + c[1]
}

#[cfg(test)]
mod tests;
