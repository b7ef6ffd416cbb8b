//! Products with integer activations (`--numerics fast`): each column is quantized once per
//! product to 16-bit codes per 32 values (`quant`), each block type is read as integer codes
//! with per-group factors (`codes`), and a row's products with a column are integer dot products
//! per group, which are exact, so only the float steps around them can round.
//!
//! The canonical order, the same on every path: for row `r` and column `c`, a sum starting at
//! zero takes, group by group in order (`g` elements a group, 16 or 32),
//! `sum = fma(I as f32, m * s, sum)`, where `I` is the group's exact integer dot product of
//! weight codes with activation codes, `m` the weights' factor and `s` the activations' scale
//! for that chunk of 32 (the product `m * s` rounded once), then, for types with an offset `o`,
//! `sum = fma(o, X, sum)` with `X` the sum of the group's activation values. That sum is the
//! result. An integer sum has one value however its terms are grouped, so the scalar code, AVX2
//! (`vpmaddwd`), AVX-512 (`vpmaddwd`, or `vpmaddubsw` on codes split into bytes) and AVX-512
//! VNNI (`vpdpwssd`, or `vpdpbusd` on those bytes) give bitwise identical results, for any
//! number of columns, any cut of the rows among threads and any split of the model.
//!
//! Plain float weights (F32, F16, BF16) have no integer kernel: their products stay exact in
//! fast mode too ("fast" means integer kernels where the weights are integer codes).

mod codes;
#[cfg(target_arch = "x86_64")]
mod column;
pub(crate) mod packed;
mod quant;
mod tile;

pub(crate) use packed::Packed;
pub(crate) use quant::Activations;

use super::{FastType, Isa, Level, Rows};
use codes::{elems, group, offset, unpack};

/// Whether products with `ty` rows have an integer kernel.
pub(crate) fn has_int(ty: FastType) -> bool {
    !ty.plain()
}

/// The instruction sets the integer kernels are compiled for: AVX-512 splits by whether the
/// CPU has VNNI (`vpdpwssd`), which the exact kernels do not use.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Flavor {
    Scalar,
    Avx2,
    Avx512,
    Vnni,
}

impl Flavor {
    /// The best flavor `isa` allows on this CPU.
    pub(super) fn of(isa: Isa) -> Flavor {
        match isa.level() {
            Level::Scalar => Flavor::Scalar,
            Level::Avx2 => Flavor::Avx2,
            Level::Avx512 if has_vnni() => Flavor::Vnni,
            Level::Avx512 => Flavor::Avx512,
        }
    }

    /// Every flavor this CPU runs, weakest first (for the tests).
    #[cfg(test)]
    pub(super) fn available() -> Vec<Flavor> {
        let mut all: Vec<Flavor> = Isa::available().into_iter().map(Flavor::of).collect();
        if all.contains(&Flavor::Vnni) {
            all.insert(all.len() - 1, Flavor::Avx512);
        }
        all
    }
}

fn has_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[c * stride + r] = row r · column c` for every row of `w` (a block type, rows of `k`
/// elements) and every column of `acts` (quantized with the same `k`). Panics if `w.bytes`
/// holds fewer than `w.n_rows` rows.
///
/// # Safety
/// `out` is valid for writes at every such index, and nothing else accesses those elements
/// during the call (other threads may write other rows of the same buffer).
pub(crate) unsafe fn gemv(isa: Isa, w: &Rows, k: usize, acts: &Activations, out: *mut f32, stride: usize) {
    // SAFETY: as the caller vouches.
    unsafe { gemv_with(Flavor::of(isa), w, k, acts, out, stride) }
}

/// `gemv` with the flavor named.
///
/// # Safety
/// As for `gemv`, and the CPU runs `flavor` (`Flavor::of` or `Flavor::available` gave it).
pub(super) unsafe fn gemv_with(flavor: Flavor, w: &Rows, k: usize, acts: &Activations, out: *mut f32, stride: usize) {
    let ty = w.ty;
    assert!(has_int(ty) && acts.k == k && k.is_multiple_of(elems(ty)), "{k} elements are not whole {ty:?} blocks");
    let n_blocks = k / elems(ty);
    let row_len = n_blocks * ty.block_bytes();
    let needed = w.n_rows.checked_sub(1).map_or(Some(0), |last| last.checked_mul(w.row_bytes).and_then(|b| b.checked_add(row_len)));
    assert!(needed.is_some_and(|n| w.bytes.len() >= n), "{} rows of {row_len} bytes every {} in {}", w.n_rows, w.row_bytes, w.bytes.len());
    // AVX-512 takes whole groups of 16 rows, in tiles, or a column at a time where there are
    // too few columns to pay for the tiles' panel; the rest go the portable way.
    let tiled = if matches!(flavor, Flavor::Avx512 | Flavor::Vnni) { w.n_rows / tile::TILE_ROWS * tile::TILE_ROWS } else { 0 };
    if tiled > 0 {
        // SAFETY: the rows are in bounds (above), the outputs of rows `0..tiled` are the
        // caller's, and the flavor's features are this CPU's.
        unsafe { sixteens(flavor, w, tiled, n_blocks, acts, out, stride) };
    }
    let rest = Rows { ty, bytes: &w.bytes[tiled * w.row_bytes..], row_bytes: w.row_bytes, n_rows: w.n_rows - tiled };
    let (w, out) = (&rest, out.wrapping_add(tiled));
    let mut c0 = 0;
    while c0 < acts.n {
        let g = super::group(acts.n - c0);
        // SAFETY: rows and columns are in bounds (the asserts above, and `acts` holds `n`
        // columns of `k`); the outputs of columns `c0..c0 + g` are the caller's.
        unsafe {
            let out = out.add(c0 * stride);
            match g {
                8 => dispatch::<8>(flavor, w, n_blocks, acts, c0, out, stride),
                4 => dispatch::<4>(flavor, w, n_blocks, acts, c0, out, stride),
                2 => dispatch::<2>(flavor, w, n_blocks, acts, c0, out, stride),
                _ => dispatch::<1>(flavor, w, n_blocks, acts, c0, out, stride),
            }
        }
        c0 += g;
    }
}

/// # Safety
/// As for `gemv_with`, with columns `c0..c0 + N` of `acts` and their outputs at `out`.
unsafe fn dispatch<const N: usize>(flavor: Flavor, w: &Rows, n_blocks: usize, acts: &Activations, c0: usize, out: *mut f32, stride: usize) {
    // SAFETY: as the caller vouches; the flavor's instructions are this CPU's.
    unsafe {
        by_type!(w.ty, T => match flavor {
            Flavor::Scalar => body::<N, T>(w, n_blocks, acts, c0, out, stride),
            #[cfg(target_arch = "x86_64")]
            Flavor::Avx2 => avx2::<N, T>(w, n_blocks, acts, c0, out, stride),
            #[cfg(target_arch = "x86_64")]
            Flavor::Avx512 => avx512::<N, T>(w, n_blocks, acts, c0, out, stride),
            #[cfg(target_arch = "x86_64")]
            Flavor::Vnni => vnni::<N, T>(w, n_blocks, acts, c0, out, stride),
            #[cfg(not(target_arch = "x86_64"))]
            _ => body::<N, T>(w, n_blocks, acts, c0, out, stride),
        })
    }
}

/// Columns below which AVX-512 takes them one at a time rather than by tiles.
const TILE_MIN_COLUMNS: usize = 2;

/// Rows `0..n_rows` (a multiple of 16) of `w` by AVX-512, 16 rows at a time.
///
/// # Safety
/// As for `gemv_with`, and `flavor` is AVX-512 (with or without VNNI).
unsafe fn sixteens(flavor: Flavor, w: &Rows, n_rows: usize, n_blocks: usize, acts: &Activations, out: *mut f32, stride: usize) {
    #[cfg(target_arch = "x86_64")]
    if acts.n < TILE_MIN_COLUMNS {
        return COLUMN.with_borrow_mut(|sc| {
            for c in 0..acts.n {
                // SAFETY: as the caller vouches, for column `c`'s outputs.
                unsafe {
                    let out = out.add(c * stride);
                    by_type!(w.ty, T => match flavor {
                        Flavor::Vnni => column_vnni::<T>(w, n_rows, n_blocks, acts, c, out, sc),
                        Flavor::Avx512 => column_avx512::<T>(w, n_rows, n_blocks, acts, c, out, sc),
                        _ => unreachable!("columns are AVX-512's"),
                    })
                }
            }
        });
    }
    PANEL.with_borrow_mut(|panel| {
        // SAFETY: as the caller vouches.
        unsafe {
            by_type!(w.ty, T => match flavor {
                #[cfg(target_arch = "x86_64")]
                Flavor::Vnni => tiles_vnni::<T>(w, n_rows, n_blocks, acts, out, stride, panel),
                #[cfg(target_arch = "x86_64")]
                Flavor::Avx512 => tiles_avx512::<T>(w, n_rows, n_blocks, acts, out, stride, panel),
                _ => unreachable!("tiles are AVX-512's"),
            })
        }
    })
}

thread_local! {
    /// Each thread's panel, kept between calls.
    static PANEL: std::cell::RefCell<tile::Panel> = std::cell::RefCell::new(tile::Panel::default());
    /// Each thread's scratch for one-column products, kept between calls.
    #[cfg(target_arch = "x86_64")]
    static COLUMN: std::cell::RefCell<column::Scratch> = std::cell::RefCell::new(column::Scratch::default());
}

macro_rules! tiled {
    ($name:ident, $features:literal, $vnni:literal) => {
        /// # Safety
        /// As for `tiles`, and the CPU has the features.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name<const T: u8>(
            w: &Rows,
            n_rows: usize,
            n_blocks: usize,
            acts: &Activations,
            out: *mut f32,
            stride: usize,
            panel: &mut tile::Panel,
        ) {
            let ty = FastType::ALL[T as usize];
            for r0 in (0..n_rows).step_by(tile::TILE_ROWS) {
                // SAFETY: rows `r0..r0 + 16` are among the caller's; the features are this CPU's.
                unsafe {
                    panel.fill(ty, w, r0, n_blocks);
                    tile::panel_times::<T, $vnni>(panel, acts, out.add(r0), stride);
                }
            }
        }
    };
}

tiled!(tiles_avx512, "avx512f,avx512bw,avx512vl,fma,f16c", false);
tiled!(tiles_vnni, "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c", true);

macro_rules! columned {
    ($name:ident, $features:literal, $vnni:literal) => {
        /// # Safety
        /// As for `column::column`, and the CPU has the features.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name<const T: u8>(
            w: &Rows,
            n_rows: usize,
            n_blocks: usize,
            acts: &Activations,
            c: usize,
            out: *mut f32,
            sc: &mut column::Scratch,
        ) {
            // SAFETY: as the caller vouches; the features are this CPU's.
            unsafe { column::column::<T, $vnni>(w, n_rows, n_blocks, acts, c, out, sc) }
        }
    };
}

columned!(column_avx512, "avx512f,avx512bw,avx512vl,fma,f16c", false);
columned!(column_vnni, "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c", true);

/// The same portable body compiled for each instruction set: the integer sums vectorize
/// however the compiler likes (they are exact), and the float steps are written one by one,
/// which no compiler may reorder.
macro_rules! flavored {
    ($name:ident, $features:literal) => {
        /// # Safety
        /// As for `body`, and the CPU has the features.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name<const N: usize, const T: u8>(
            w: &Rows,
            n_blocks: usize,
            acts: &Activations,
            c0: usize,
            out: *mut f32,
            stride: usize,
        ) {
            // SAFETY: as the caller vouches.
            unsafe { body::<N, T>(w, n_blocks, acts, c0, out, stride) }
        }
    };
}

flavored!(avx2, "avx2,fma,f16c");
flavored!(avx512, "avx512f,avx512bw,avx512vl,fma,f16c");
flavored!(vnni, "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c");

/// The exact integer dot product of `G` codes.
#[inline(always)]
fn dot<const G: usize>(q: &[i16], a: &[i16]) -> i32 {
    let (q, a): (&[i16; G], &[i16; G]) = (q[..G].try_into().expect("G codes"), a[..G].try_into().expect("G codes"));
    let mut s = 0i32;
    for i in 0..G {
        s += q[i] as i32 * a[i] as i32;
    }
    s
}

/// Rows of `w` (type number `T`, `n_blocks` blocks each) times columns `c0..c0 + N` of `acts`,
/// in the canonical order.
///
/// # Safety
/// Rows and columns are in bounds, and `out` is valid for the writes at `c * stride + r`
/// (c < N, r < w.n_rows), which nothing else accesses meanwhile.
#[inline(always)]
unsafe fn body<const N: usize, const T: u8>(w: &Rows, n_blocks: usize, acts: &Activations, c0: usize, out: *mut f32, stride: usize) {
    let ty = FastType::ALL[T as usize];
    let (bb, e, g) = (ty.block_bytes(), elems(ty), group(ty));
    let k = acts.k;
    let (mut q, mut m, mut o) = ([0i16; 256], [0f32; 16], [0f32; 16]);
    let codes: [&[i16]; N] = std::array::from_fn(|c| &acts.codes[(c0 + c) * k..][..k]);
    let scales: [&[f32]; N] = std::array::from_fn(|c| &acts.scales[(c0 + c) * k / 32..][..k / 32]);
    let sums: [&[f32]; N] = std::array::from_fn(|c| {
        if g == 16 {
            &acts.sums16[(c0 + c) * k / 16..][..k / 16]
        } else {
            &acts.sums32[(c0 + c) * k / 32..][..k / 32]
        }
    });
    for r in 0..w.n_rows {
        let row = &w.bytes[r * w.row_bytes..][..n_blocks * bb];
        let mut acc = [0f32; N];
        for (blk, b) in row.chunks_exact(bb).enumerate() {
            #[cfg(target_arch = "x86_64")]
            super::prefetch(b.as_ptr(), bb);
            unpack(ty, b, &mut q, &mut m, &mut o);
            for c in 0..N {
                let a = &codes[c][blk * e..][..e];
                for gi in 0..e / g {
                    let i = if g == 16 { dot::<16>(&q[gi * g..], &a[gi * g..]) } else { dot::<32>(&q[gi * g..], &a[gi * g..]) };
                    let at = blk * e + gi * g;
                    acc[c] = (i as f32).mul_add(m[gi] * scales[c][at / 32], acc[c]);
                    if offset(ty) {
                        acc[c] = o[gi].mul_add(sums[c][at / g], acc[c]);
                    }
                }
            }
        }
        for (c, v) in acc.into_iter().enumerate() {
            // SAFETY: `c < N` and `r < n_rows`: an output the caller vouches for.
            unsafe { *out.add(c * stride + r) = v };
        }
    }
}

#[cfg(test)]
mod tests;
