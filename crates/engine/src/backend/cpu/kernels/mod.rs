//! Matrix–vector kernels over GGUF's quantized blocks.
//!
//! Every kernel computes a row's dot product in one canonical order: two sets of 16 lanes, where
//! lane `l` of the first accumulates element `32b + l` and lane `l` of the second element
//! `32b + 16 + l` of each 32-element chunk `b`, in chunk order, with fused multiply-adds; then the
//! two sets are added lane by lane, the 16 lanes reduced in a fixed tree, and any tail added in
//! order. (Two sets, not one, so consecutive chunks form two independent dependency chains.)
//!
//! Weights are dequantized exactly to ggml's values: each is `q * s + o` for an integer code `q`
//! and per-chunk (for some types per-half-chunk) f32 factors whose product with `q` needs no
//! rounding, so one fused multiply-add (or a lookup in a table of such values) rounds once, as
//! ggml's `dequantize_row_*` does. The scalar, AVX2 and AVX-512 paths therefore give bitwise
//! identical results, and a row's result never depends on how many columns (sequences) are
//! computed beside it, on which thread computes it, or on how the work is cut: up to 8 columns
//! at a time against blocks dequantized on the fly, the row split into parts whose running sums
//! wait in memory, or, for many columns, rows dequantized to f32 once and multiplied in tiles of
//! a few rows by a few columns (`panel`: six by four, 16 lanes at a time, on AVX-512; four by
//! three, 8 lanes at a time, on AVX2). Each shape performs the same operations on each lane.

// The kernels index accumulators, columns and outputs by the same column number.
#![allow(clippy::needless_range_loop)]

mod avx2;
mod avx512;
mod isa;
mod layout;
mod scalar;

pub use isa::Isa;
pub(crate) use isa::Level;
pub(crate) use panel::Columns;

use dgr_gguf::GgmlType;
use std::ops::Range;

/// `$body` with `$t` bound to the number of type `$ty` as a constant: each type gets its own
/// copy of the kernel `$body` calls, with that type's dequantization inlined.
macro_rules! by_type {
    ($ty:expr, $t:ident => $body:expr) => {
        by_type!(@ $ty, $t, $body, F32, F16, Bf16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)
    };
    (@ $ty:expr, $t:ident, $body:expr, $($v:ident),*) => {
        match $ty {
            $(FastType::$v => {
                const $t: u8 = FastType::$v as u8;
                $body
            })*
        }
    };
}

// After `by_type!`, which they use.
pub(crate) mod int;
mod panel;

/// The element types the kernels read directly.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum FastType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
}

impl FastType {
    pub(crate) fn of(ty: GgmlType) -> Option<FastType> {
        Some(match ty {
            GgmlType::F32 => FastType::F32,
            GgmlType::F16 => FastType::F16,
            GgmlType::BF16 => FastType::Bf16,
            GgmlType::Q4_0 => FastType::Q4_0,
            GgmlType::Q4_1 => FastType::Q4_1,
            GgmlType::Q5_0 => FastType::Q5_0,
            GgmlType::Q5_1 => FastType::Q5_1,
            GgmlType::Q8_0 => FastType::Q8_0,
            GgmlType::Q2_K => FastType::Q2_K,
            GgmlType::Q3_K => FastType::Q3_K,
            GgmlType::Q4_K => FastType::Q4_K,
            GgmlType::Q5_K => FastType::Q5_K,
            GgmlType::Q6_K => FastType::Q6_K,
            _ => return None,
        })
    }

    /// Every type, at the index of its discriminant: the kernels are specialized per type by
    /// that number.
    const ALL: [FastType; 13] = [
        FastType::F32,
        FastType::F16,
        FastType::Bf16,
        FastType::Q4_0,
        FastType::Q4_1,
        FastType::Q5_0,
        FastType::Q5_1,
        FastType::Q8_0,
        FastType::Q2_K,
        FastType::Q3_K,
        FastType::Q4_K,
        FastType::Q5_K,
        FastType::Q6_K,
    ];

    /// Bytes of one block: a super-block of 256 elements for the K-quants, 32 elements otherwise
    /// (plain types count 32 values as a block).
    pub(crate) const fn block_bytes(self) -> usize {
        match self {
            FastType::F32 => 128,
            FastType::F16 | FastType::Bf16 => 64,
            FastType::Q4_0 => 18,
            FastType::Q4_1 => 20,
            FastType::Q5_0 => 22,
            FastType::Q5_1 => 24,
            FastType::Q8_0 => 34,
            FastType::Q2_K => 84,
            FastType::Q3_K => 110,
            FastType::Q4_K => 144,
            FastType::Q5_K => 176,
            FastType::Q6_K => 210,
        }
    }

    /// 32-element chunks per block.
    pub(crate) const fn block_chunks(self) -> usize {
        match self {
            FastType::Q2_K | FastType::Q3_K | FastType::Q4_K | FastType::Q5_K | FastType::Q6_K => 8,
            _ => 1,
        }
    }

    /// Plain values (no blocks): rows may end in a tail shorter than 32.
    const fn plain(self) -> bool {
        matches!(self, FastType::F32 | FastType::F16 | FastType::Bf16)
    }
}

/// A cache line of floats, for buffers the kernels load 16 floats at a time from: a load that
/// straddles two lines costs twice as much.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct Line(pub [f32; 16]);

impl Line {
    pub(crate) fn floats(lines: &[Line]) -> &[f32] {
        // SAFETY: a `Line` is 16 f32s with no padding (size 64, the alignment), so the lines are
        // `16 * len` initialized, suitably aligned floats, borrowed for the slice's lifetime.
        unsafe { std::slice::from_raw_parts(lines.as_ptr() as *const f32, 16 * lines.len()) }
    }

    fn bytes(lines: &[Line]) -> &[u8] {
        // SAFETY: as for `floats`: initialized bytes, and u8 has alignment 1.
        unsafe { std::slice::from_raw_parts(lines.as_ptr() as *const u8, 64 * lines.len()) }
    }

    pub(crate) fn floats_mut(lines: &mut [Line]) -> &mut [f32] {
        // SAFETY: as for `floats`, and the slice holds the lines' unique borrow.
        unsafe { std::slice::from_raw_parts_mut(lines.as_mut_ptr() as *mut f32, 16 * lines.len()) }
    }
}

/// The widest column group a kernel call handles.
const MAX_COLS: usize = 8;

/// `n_rows` rows in `ty`'s layout, each starting `row_bytes` after the previous one in `bytes`
/// (a row may be shorter than the stride, as a head's slice of a KV row is).
pub(crate) struct Rows<'a> {
    pub ty: FastType,
    pub bytes: &'a [u8],
    pub row_bytes: usize,
    pub n_rows: usize,
}

/// One call of an instruction set's kernel: rows `0..n_rows` of `w` against `N` columns, over
/// blocks `blocks` of each row.
struct Part<const N: usize> {
    ty: FastType,
    w: *const u8,
    row_bytes: usize,
    n_rows: usize,
    /// Each column's element 0.
    x: [*const f32; N],
    blocks: Range<usize>,
    /// Running sums, 32 lanes (the 16 of the first set, then the second's) per row and column,
    /// at `(r * N + c) * 32`: read at the start when `resume`, written at the end when
    /// `suspend`. Otherwise sums start at zero, and end reduced in `out[c * stride + r]`.
    acc: *mut f32,
    resume: bool,
    suspend: bool,
    out: *mut f32,
    stride: usize,
}

/// Bytes of activations one part may hold per call, so a column group's slice of them stays in
/// L1 while every row of a row group is multiplied by it.
const PART_BYTES: usize = 24 * 1024;
/// Rows whose running sums one call keeps, when a row's chunks are split into parts.
const ROW_GROUP: usize = 16;

/// `out[c * stride + r] = row r · xs[c]` for every row of `w` and every column, where each row
/// has `k` elements (`k` a multiple of the block size for block types). Panics if `w.bytes` holds
/// fewer than `w.n_rows` rows of `k` elements or a column fewer than `k` floats.
///
/// # Safety
/// `out` is valid for writes at every such index, and nothing else accesses those elements
/// during the call (other threads may write other rows of the same buffer).
pub(crate) unsafe fn gemv(isa: Isa, w: &Rows, k: usize, cols: &Columns, out: *mut f32, stride: usize) {
    let xs = &cols.xs[..];
    let (ty, per) = (w.ty, w.ty.block_chunks());
    let nb = k / 32;
    assert!(ty.plain() || k.is_multiple_of(32 * per), "{k} elements are not whole {ty:?} blocks");
    assert!(xs.iter().all(|x| x.len() >= k));
    let n_blocks = nb / per;
    // At most 4 bytes an element, and a column of `k` floats exists, so this cannot overflow.
    let row_len = n_blocks * ty.block_bytes() + (k - nb * 32) * ty.block_bytes() / 32;
    let n_rows = w.n_rows;
    // Checked arithmetic: a wrapped product must not let a short buffer through.
    let needed = n_rows.checked_sub(1).map_or(Some(0), |last| last.checked_mul(w.row_bytes).and_then(|b| b.checked_add(row_len)));
    assert!(needed.is_some_and(|n| w.bytes.len() >= n), "{n_rows} rows of {row_len} bytes every {} in {}", w.row_bytes, w.bytes.len());
    // F32 rows are already what a panel holds; F16/BF16 rows of whole chunks convert as blocks do.
    if ty != FastType::F32 && k.is_multiple_of(32) && xs.len() >= panel::PANEL_COLS {
        // SAFETY: as the caller vouches, with the reads kept in bounds by the asserts above.
        unsafe { panel::panels(isa, w, n_blocks, k, cols, out, stride) };
        return;
    }
    // SAFETY: as the caller vouches, with the reads kept in bounds by the asserts above.
    unsafe { direct(isa, w, k, row_len, xs, out, stride) };
}

/// `gemv` by the kernels that read the rows' blocks directly, up to 8 columns at a time; `row_len`
/// is the bytes of a row's `k` elements.
///
/// # Safety
/// As for `gemv`, and each row and column holds its `k` elements.
unsafe fn direct(isa: Isa, w: &Rows, k: usize, row_len: usize, xs: &[&[f32]], out: *mut f32, stride: usize) {
    let (ty, nb) = (w.ty, k / 32);
    let n_blocks = nb / ty.block_chunks();
    let mut c0 = 0;
    while c0 < xs.len() {
        let g = group(xs.len() - c0);
        let cols = &xs[c0..c0 + g];
        // SAFETY: each of the rows holds `n_blocks` whole blocks and each column `32 * nb`
        // floats, as the caller vouches; the outputs of columns `c0..c0 + g` are among those the
        // caller vouches for, starting at `out + c0 * stride`.
        unsafe {
            match g {
                8 => columns::<8>(isa, w, n_blocks, cols, out.add(c0 * stride), stride),
                4 => columns::<4>(isa, w, n_blocks, cols, out.add(c0 * stride), stride),
                2 => columns::<2>(isa, w, n_blocks, cols, out.add(c0 * stride), stride),
                _ => columns::<1>(isa, w, n_blocks, cols, out.add(c0 * stride), stride),
            }
        }
        c0 += g;
    }
    // Plain rows whose length is not a multiple of 32 finish sequentially.
    for r in (0..w.n_rows).filter(|_| nb * 32 < k) {
        let row = &w.bytes[r * w.row_bytes..r * w.row_bytes + row_len];
        for (c, x) in xs.iter().enumerate() {
            for j in nb * 32..k {
                // SAFETY: `c < xs.len()` and `r < n_rows`, so this is one of the outputs the caller
                // vouched for, and no other thread touches it during the call.
                unsafe {
                    let o = out.add(c * stride + r);
                    *o = scalar::element(ty, row, j).mul_add(x[j], *o);
                }
            }
        }
    }
}

/// How far ahead of the current block to prefetch weights, in bytes: far enough that rows
/// streaming from L3 arrive in time (a model's layers outgrow L2; 1 KiB ahead left decode 20%
/// slower there, and no faster in L2).
#[cfg(target_arch = "x86_64")]
const PREFETCH: usize = 4096;

/// Asks for the weights `PREFETCH` bytes past block `blk` (`bb` bytes): one core's stream of
/// misses, not its arithmetic, is what bounds decode. (A prefetch never faults, so the address
/// may lie past the row.)
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch(blk: *const u8, bb: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    // Blocks shorter than a line: only the first block starting in a line asks for it (every
    // block asking would ask for each line two or three times).
    if bb < 64 && (blk as usize + PREFETCH) % 64 >= bb {
        return;
    }
    for o in (0..bb).step_by(64) {
        // SAFETY: SSE is part of x86-64; a prefetch reads nothing and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(o + PREFETCH) as *const i8) };
    }
}

/// Makes `v` at least `len` long, zeroing only what it never held: a scratch buffer reused for
/// products of every size would otherwise be zeroed, megabytes at a time, before being
/// overwritten.
pub(crate) fn grow(v: &mut Vec<Line>, len: usize) {
    if v.len() < len {
        v.resize(len, Line([0.0; 16]));
    }
}

/// The widest group (8, 4, 2 or 1 columns) that `n` remaining columns fill.
fn group(n: usize) -> usize {
    match n {
        n if n >= 8 => 8,
        n if n >= 4 => 4,
        n if n >= 2 => 2,
        _ => 1,
    }
}

/// Every row of `w` against `N` columns, over `n_blocks` blocks: in one pass when the columns'
/// activations fit `PART_BYTES`, otherwise in parts of the row, a group of rows at a time.
///
/// # Safety
/// Each row of `w` holds `n_blocks` whole blocks, each column that many blocks' elements, and
/// `out` is valid for the writes at `c * stride + r` (c < N, r < w.n_rows), which nothing else
/// accesses meanwhile.
unsafe fn columns<const N: usize>(isa: Isa, w: &Rows, n_blocks: usize, xs: &[&[f32]], out: *mut f32, stride: usize) {
    let ty = w.ty;
    let x: [*const f32; N] = std::array::from_fn(|i| xs[i].as_ptr());
    let part = (PART_BYTES / (N * 128 * ty.block_chunks())).max(1);
    let base = |n_rows, blocks, out| Part {
        ty,
        w: w.bytes.as_ptr(),
        row_bytes: w.row_bytes,
        n_rows,
        x,
        blocks,
        acc: std::ptr::null_mut(),
        resume: false,
        suspend: false,
        out,
        stride,
    };
    if n_blocks <= part {
        // SAFETY: as the caller vouches; no running sums are kept.
        unsafe { kernel(isa, &base(w.n_rows, 0..n_blocks, out)) };
        return;
    }
    let mut lines = [Line([0.0; 16]); ROW_GROUP * MAX_COLS * 2];
    let acc = Line::floats_mut(&mut lines);
    for r0 in (0..w.n_rows).step_by(ROW_GROUP) {
        let n_rows = ROW_GROUP.min(w.n_rows - r0);
        for b0 in (0..n_blocks).step_by(part) {
            let end = (b0 + part).min(n_blocks);
            let p = Part {
                w: w.bytes.as_ptr().wrapping_add(r0 * w.row_bytes),
                acc: acc.as_mut_ptr(),
                resume: b0 > 0,
                suspend: end < n_blocks,
                ..base(n_rows, b0..end, out.wrapping_add(r0))
            };
            // SAFETY: rows `r0..r0 + n_rows` of `w`, inside what the caller vouches for, and
            // their outputs; `acc` holds `ROW_GROUP * N * 32` floats, the sums of that many rows.
            unsafe { kernel(isa, &p) };
        }
    }
}

/// # Safety
/// `p.w` holds `p.n_rows` rows of `p.row_bytes` bytes, each at least `p.blocks.end` blocks; each
/// column holds that many blocks' elements; `p.acc` has room for `p.n_rows * N * 32` floats when
/// the sums are kept; `p.out` is valid for the writes at `c * p.stride + r`.
unsafe fn kernel<const N: usize>(isa: Isa, p: &Part<N>) {
    // SAFETY: the caller vouches for the memory; an `Isa` above scalar exists only where
    // detection found that set on this CPU (its field is private), so the instructions each
    // kernel is compiled for are present.
    unsafe {
        by_type!(p.ty, T => match isa.level() {
            Level::Avx512 => avx512::gemv::<N, T>(p),
            Level::Avx2 => avx2::gemv::<N, T>(p),
            Level::Scalar => scalar::gemv::<N, T>(p),
        })
    }
}

/// Dequantizes the `n_blocks` blocks of type `ty` at `p` into `out`, exactly.
///
/// # Safety
/// `p` is valid for reading `n_blocks` blocks and `out` for writing their elements.
unsafe fn dequant(isa: Isa, ty: FastType, p: *const u8, n_blocks: usize, out: *mut f32) {
    // SAFETY: as for `kernel`.
    unsafe {
        by_type!(ty, T => match isa.level() {
            Level::Avx512 => avx512::dequant::<T>(p, n_blocks, out),
            Level::Avx2 => avx2::dequant::<T>(p, n_blocks, out),
            Level::Scalar => scalar::dequant::<T>(p, n_blocks, out),
        })
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
pub(crate) mod tests;
