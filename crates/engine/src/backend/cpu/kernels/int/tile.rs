//! AVX-512 tiles: 16 rows, one per 32-bit lane, by up to 8 columns. The rows' codes are first
//! laid out as a panel where each vector holds one pair of neighbouring codes of each row
//! (`vpdpwssd`'s operand), so a group's integer sums build up lane by lane with no horizontal
//! step, and one conversion and multiply-add per group and column applies the canonical float
//! steps (see `super`) to 16 rows at once.

use super::codes::{elems, group, offset, unpack};
use super::quant::GROUP;
use super::{Activations, FastType, Rows};

/// Rows a tile holds: one per lane.
pub(super) const TILE_ROWS: usize = 16;
/// Columns a tile multiplies at once: a group of the activations' tiled layout.
const TILE_COLS: usize = GROUP;

/// Sixteen rows' codes, factors and offsets, laid out for the tiles.
#[derive(Default)]
pub(super) struct Panel {
    /// Pair `t` of chunk `j` of row `r` (codes `32j + 2t` and `32j + 2t + 1`, low half first)
    /// at `(16j + t) * 16 + r`: one vector per pair of columns.
    pairs: Vec<u32>,
    /// Factor and offset of group `g` of row `r` at `16g + r`.
    m: Vec<f32>,
    o: Vec<f32>,
}

impl Panel {
    /// Lays out rows `r0..r0 + 16` of `w` (type `ty`, `n_blocks` blocks each): each row's
    /// block unpacked in order, then each chunk's 16 rows of 16 pairs transposed.
    ///
    /// # Safety
    /// The CPU has AVX-512 F.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub(super) unsafe fn fill(&mut self, ty: FastType, w: &Rows, r0: usize, n_blocks: usize) {
        use std::arch::x86_64::*;
        let (e, g, bb) = (elems(ty), group(ty), ty.block_bytes());
        let chunks = n_blocks * e / 32;
        let groups = n_blocks * e / g;
        self.pairs.resize(chunks * 16 * TILE_ROWS, 0);
        self.m.resize(groups * TILE_ROWS, 0.0);
        self.o.resize(groups * TILE_ROWS, 0.0);
        let mut stage = [[0i16; 256]; TILE_ROWS];
        let (mut m, mut o) = ([0f32; 16], [0f32; 16]);
        for blk in 0..n_blocks {
            for (r, q) in stage.iter_mut().enumerate() {
                let at = (r0 + r) * w.row_bytes + blk * bb;
                unpack(ty, &w.bytes[at..at + bb], q, &mut m, &mut o);
                for i in 0..e / g {
                    self.m[(blk * e / g + i) * TILE_ROWS + r] = m[i];
                    self.o[(blk * e / g + i) * TILE_ROWS + r] = o[i];
                }
            }
            for j in 0..e / 32 {
                let dst = &mut self.pairs[(blk * e / 32 + j) * 16 * TILE_ROWS..][..16 * TILE_ROWS];
                // SAFETY: each row's chunk `j` is 32 codes (64 bytes) of its 256, and `dst` holds
                // 16 vectors; the CPU has AVX-512 F, as the caller vouches.
                unsafe {
                    let rows: [__m512i; 16] = std::array::from_fn(|r| _mm512_loadu_si512(stage[r].as_ptr().add(32 * j) as *const __m512i));
                    for (t, v) in transpose(rows).into_iter().enumerate() {
                        _mm512_storeu_si512(dst.as_mut_ptr().add(16 * t) as *mut __m512i, v);
                    }
                }
            }
        }
    }
}

/// A 16 × 16 matrix of 32-bit lanes, one row a vector, transposed: pairs within 128-bit lanes,
/// then quads, then the lanes themselves, twice.
///
/// # Safety
/// The CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn transpose(r: [std::arch::x86_64::__m512i; 16]) -> [std::arch::x86_64::__m512i; 16] {
    use std::arch::x86_64::*;
    // SAFETY: register shuffles, with the features the caller vouches for.
    unsafe {
        let t: [__m512i; 16] = std::array::from_fn(|i| {
            let (a, b) = (r[i & !1], r[i | 1]);
            if i % 2 == 0 {
                _mm512_unpacklo_epi32(a, b)
            } else {
                _mm512_unpackhi_epi32(a, b)
            }
        });
        // u[4i + m]: in 128-bit lane L, column 4L + m of rows 4i..4i + 4.
        let u: [__m512i; 16] = std::array::from_fn(|i| {
            let (base, m) = (i / 4 * 4, i % 4);
            let (a, b) = (t[base + m / 2], t[base + 2 + m / 2]);
            if m % 2 == 0 {
                _mm512_unpacklo_epi64(a, b)
            } else {
                _mm512_unpackhi_epi64(a, b)
            }
        });
        let mut out = [_mm512_setzero_si512(); 16];
        for m in 0..4 {
            let v1 = _mm512_shuffle_i32x4::<0x44>(u[m], u[4 + m]);
            let v2 = _mm512_shuffle_i32x4::<0xEE>(u[m], u[4 + m]);
            let w1 = _mm512_shuffle_i32x4::<0x44>(u[8 + m], u[12 + m]);
            let w2 = _mm512_shuffle_i32x4::<0xEE>(u[8 + m], u[12 + m]);
            out[m] = _mm512_shuffle_i32x4::<0x88>(v1, w1);
            out[4 + m] = _mm512_shuffle_i32x4::<0xDD>(v1, w1);
            out[8 + m] = _mm512_shuffle_i32x4::<0x88>(v2, w2);
            out[12 + m] = _mm512_shuffle_i32x4::<0xDD>(v2, w2);
        }
        out
    }
}

/// `out[c * stride + r]` for the panel's 16 rows and every column of `acts`, `TILE_COLS` at a
/// time.
///
/// # Safety
/// The CPU has AVX-512 F and BW (and VNNI when `VNNI`); `out` is valid for the writes at
/// `c * stride + r` (c < acts.n, r < 16), which nothing else accesses meanwhile; the panel was
/// filled for type number `T` and `acts.k` elements.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn panel_times<const T: u8, const VNNI: bool>(p: &Panel, acts: &Activations, out: *mut f32, stride: usize) {
    let mut c0 = 0;
    while c0 < acts.n {
        let n = TILE_COLS.min(acts.n - c0);
        // SAFETY: as the caller vouches, for columns `c0..c0 + n`.
        unsafe {
            let out = out.add(c0 * stride);
            match n {
                8 => tile::<T, VNNI, 8>(p, acts, c0, out, stride),
                7 => tile::<T, VNNI, 7>(p, acts, c0, out, stride),
                6 => tile::<T, VNNI, 6>(p, acts, c0, out, stride),
                5 => tile::<T, VNNI, 5>(p, acts, c0, out, stride),
                4 => tile::<T, VNNI, 4>(p, acts, c0, out, stride),
                3 => tile::<T, VNNI, 3>(p, acts, c0, out, stride),
                2 => tile::<T, VNNI, 2>(p, acts, c0, out, stride),
                _ => tile::<T, VNNI, 1>(p, acts, c0, out, stride),
            }
        }
        c0 += n;
    }
}

/// # Safety
/// As for `panel_times`, for columns `c0..c0 + C` and their outputs at `out`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tile<const T: u8, const VNNI: bool, const C: usize>(p: &Panel, acts: &Activations, c0: usize, out: *mut f32, stride: usize) {
    use std::arch::x86_64::*;
    let ty = FastType::ALL[T as usize];
    let (g, off) = (group(ty), offset(ty));
    let k = acts.k;
    let chunks = k / 32;
    assert!(p.pairs.len() >= chunks * 16 * TILE_ROWS && p.m.len() >= k / g * TILE_ROWS);
    // The columns' group: codes as pairs (one 32-bit broadcast a pair), scales and group sums,
    // each `GROUP` columns side by side.
    let a = &acts.pairs[c0 * k / 2..][..GROUP * k / 2];
    let s = &acts.scales_t[c0 * chunks..][..GROUP * chunks];
    let x = if g == 16 { &acts.sums16_t[c0 * k / 16..][..GROUP * k / 16] } else { &acts.sums32_t[c0 * chunks..][..GROUP * chunks] };
    let (a, s, x) = (a.as_ptr(), s.as_ptr(), x.as_ptr());
    let pairs = p.pairs.as_ptr();
    // SAFETY: the CPU has the features (the caller vouches); every load is inside the panel
    // (the assert above) or the columns' group (pair `16j + t` of `k / 2`, chunk `j`, group
    // `gi` of each of its `GROUP` columns).
    unsafe {
        let mut acc = [_mm512_setzero_ps(); C];
        for j in 0..chunks {
            for half in 0..32 / g {
                let mut sums = [_mm512_setzero_si512(); C];
                for t in half * g / 2..(half + 1) * g / 2 {
                    let wv = _mm512_loadu_si512(pairs.add((16 * j + t) * TILE_ROWS) as *const __m512i);
                    for c in 0..C {
                        let xv = _mm512_set1_epi32(*a.add((16 * j + t) * GROUP + c) as i32);
                        sums[c] =
                            if VNNI { _mm512_dpwssd_epi32(sums[c], wv, xv) } else { _mm512_add_epi32(sums[c], _mm512_madd_epi16(wv, xv)) };
                    }
                }
                let gi = j * 32 / g + half;
                let mv = _mm512_loadu_ps(p.m.as_ptr().add(gi * TILE_ROWS));
                let ov = _mm512_loadu_ps(p.o.as_ptr().add(gi * TILE_ROWS));
                for c in 0..C {
                    let f = _mm512_mul_ps(mv, _mm512_set1_ps(*s.add(j * GROUP + c)));
                    acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[c]), f, acc[c]);
                    if off {
                        acc[c] = _mm512_fmadd_ps(ov, _mm512_set1_ps(*x.add(gi * GROUP + c)), acc[c]);
                    }
                }
            }
        }
        for c in 0..C {
            _mm512_storeu_ps(out.add(c * stride), acc[c]);
        }
    }
}
