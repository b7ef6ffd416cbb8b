//! AVX-512, one column at a time (a decode step): 16 rows at once, each row's codes multiplied
//! with the column's by `vpdpwssd` in its own vector, then the 16 vectors' lanes summed into one
//! vector holding each row's integer sum per group, so the canonical float steps (see `super`)
//! run on 16 rows at once. The tiles' panel is not built: with one column its layout would cost
//! more than the products.

use super::super::layout as at;
use super::codes::{codes, elems, factors, group, offset};
use super::tile::TILE_ROWS as ROWS;
use super::{Activations, FastType, Rows};
use std::arch::x86_64::*;

/// `out[r]` = row `r` · column `c` of `acts`, for rows `0..n_rows` (a multiple of 16) of `w`
/// (type number `T`, `n_blocks` blocks each).
///
/// # Safety
/// The CPU has AVX-512 F and BW (and VNNI when `VNNI`); the rows are in bounds; `out` is valid
/// for writes at `0..n_rows`, which nothing else accesses meanwhile; `c < acts.n`.
#[inline(always)]
pub(super) unsafe fn column<const T: u8, const VNNI: bool>(
    w: &Rows,
    n_rows: usize,
    n_blocks: usize,
    acts: &Activations,
    c: usize,
    out: *mut f32,
    sc: &mut Scratch,
) {
    let ty = FastType::ALL[T as usize];
    let (e, g, bb, off) = (elems(ty), group(ty), ty.block_bytes(), offset(ty));
    let k = acts.k;
    let codes = &acts.codes[c * k..][..k];
    let scales = &acts.scales[c * k / 32..][..k / 32];
    let sums = if g == 16 { &acts.sums16[c * k / 16..][..k / 16] } else { &acts.sums32[c * k / 32..][..k / 32] };
    // A row is read `VISIT` codes at a time (a K-quant block, eight legacy ones), each block
    // prefetched ahead as the exact kernels do: the 16 rows' staged codes stay in L1 (longer
    // visits measured slower), and the reads run on in each row.
    let per_visit = (VISIT / e).max(1);
    let Scratch { codes: stage, m, o } = sc;
    let visit_codes = per_visit * e;
    stage.resize(ROWS * visit_codes, 0);
    m.resize(visit_codes / g * ROWS, 0.0);
    o.resize(visit_codes / g * ROWS, 0.0);
    let (mut rm, mut ro) = ([0f32; 16], [0f32; 16]);
    for r0 in (0..n_rows).step_by(ROWS) {
        // SAFETY: the features are this CPU's, and every load is inside `stage` (row `r`'s
        // codes at `r * visit_codes`), `m`, `o` or the column's codes (chunk `first + j` of
        // `k / 32`); the store is to rows `r0..r0 + 16`, the caller's.
        unsafe {
            let mut acc = _mm512_setzero_ps();
            for v0 in (0..n_blocks).step_by(per_visit) {
                let nb = per_visit.min(n_blocks - v0);
                for (r, q) in stage.chunks_exact_mut(visit_codes).enumerate() {
                    for bi in 0..nb {
                        let at = (r0 + r) * w.row_bytes + (v0 + bi) * bb;
                        let b = &w.bytes[at..at + bb];
                        super::super::prefetch(b.as_ptr(), bb);
                        factors(ty, b, &mut rm, &mut ro);
                        simd_codes(ty, b, &mut q[bi * e..]);
                        for i in 0..e / g {
                            m[(bi * e / g + i) * ROWS + r] = rm[i];
                            o[(bi * e / g + i) * ROWS + r] = ro[i];
                        }
                    }
                }
                let first = v0 * e / 32;
                for j in 0..nb * e / 32 {
                    let a = _mm512_loadu_si512(codes.as_ptr().add(32 * (first + j)) as *const __m512i);
                    let v: [__m512i; ROWS] = std::array::from_fn(|r| {
                        let q = _mm512_loadu_si512(stage.as_ptr().add(r * visit_codes + 32 * j) as *const __m512i);
                        if VNNI {
                            _mm512_dpwssd_epi32(_mm512_setzero_si512(), q, a)
                        } else {
                            _mm512_madd_epi16(q, a)
                        }
                    });
                    let (lo, hi) = halves(v);
                    let s = _mm512_set1_ps(scales[first + j]);
                    // Group by group in order: a chunk is one group, or two of 16.
                    let parts: &[__m512i] = if g == 16 { &[lo, hi] } else { &[_mm512_add_epi32(lo, hi)] };
                    for (h, &sum) in parts.iter().enumerate() {
                        let gi = j * 32 / g + h;
                        let f = _mm512_mul_ps(_mm512_loadu_ps(m.as_ptr().add(gi * ROWS)), s);
                        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), f, acc);
                        if off {
                            let x = _mm512_set1_ps(sums[v0 * e / g + gi]);
                            acc = _mm512_fmadd_ps(_mm512_loadu_ps(o.as_ptr().add(gi * ROWS)), x, acc);
                        }
                    }
                }
            }
            _mm512_storeu_ps(out.add(r0), acc);
        }
    }
}

/// Codes of a row read in one visit (a K-quant block's 256 at least).
const VISIT: usize = 256;

/// Each thread's codes of the 16 rows' visit, and their groups' factors and offsets (group `i`
/// of row `r` at `16 * i + r`), kept between calls.
#[derive(Default)]
pub(super) struct Scratch {
    codes: Vec<i16>,
    m: Vec<f32>,
    o: Vec<f32>,
}

/// Sixteen rows' lane sums, lane `r` of each result row `r`'s: over its lanes 0–7 (the first 16
/// codes of a chunk) and over its lanes 8–15 (the last 16). Integer sums, so the order of the
/// additions does not matter.
#[inline(always)]
unsafe fn halves(v: [__m512i; ROWS]) -> (__m512i, __m512i) {
    // SAFETY: register operations, with the features the caller vouches for.
    unsafe {
        // Pairs of rows: in each 128-bit lane, [a0+a2, b0+b2, a1+a3, b1+b3].
        let t: [__m512i; 8] = std::array::from_fn(|i| {
            let (a, b) = (v[2 * i], v[2 * i + 1]);
            _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b))
        });
        // Quads of rows: in 128-bit lane L, rows 4i..4i + 4 summed over that lane's 4 elements.
        let u: [__m512i; 4] = std::array::from_fn(|i| {
            let (a, b) = (t[2 * i], t[2 * i + 1]);
            _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b))
        });
        // [quad 0 over lanes 0+1, over 2+3, quad 1 over 0+1, over 2+3], and for quads 2 and 3.
        let pair = |a: __m512i, b: __m512i| {
            _mm512_add_epi32(_mm512_shuffle_i32x4::<0b10_00_10_00>(a, b), _mm512_shuffle_i32x4::<0b11_01_11_01>(a, b))
        };
        let (s01, s23) = (pair(u[0], u[1]), pair(u[2], u[3]));
        (_mm512_shuffle_i32x4::<0b10_00_10_00>(s01, s23), _mm512_shuffle_i32x4::<0b11_01_11_01>(s01, s23))
    }
}

/// `codes::codes` into the first `elems(ty)` of `q`, by vector instructions for the types a
/// decode meets most (the legacy types, Q4_K, Q5_K, Q6_K); the same integers, so the same
/// results.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VL; `b` is one whole block of `ty`.
#[inline(always)]
unsafe fn simd_codes(ty: FastType, b: &[u8], q: &mut [i16]) {
    assert!(b.len() == ty.block_bytes() && q.len() >= elems(ty));
    let (p, out) = (b.as_ptr(), q.as_mut_ptr());
    // SAFETY: every load is inside the block (its layout, per type, in `layout` and `codes`),
    // every store inside `q`, and the features are the caller's.
    unsafe {
        let low = _mm256_set1_epi8(0x0F);
        match ty {
            FastType::Q8_0 => {
                let z = _mm512_cvtepi8_epi16(_mm256_loadu_si256(p.add(2) as *const __m256i));
                _mm512_storeu_si512(out as *mut __m512i, z);
            }
            FastType::Q4_0 => store(out, 0, nibbles(p, 2), 8),
            FastType::Q4_1 => store(out, 0, nibbles(p, 4), 0),
            FastType::Q5_0 | FastType::Q5_1 => {
                let one = ty == FastType::Q5_1;
                let qh_at = if one { 4 } else { 2 };
                let qh = u32::from_le_bytes([b[qh_at], b[qh_at + 1], b[qh_at + 2], b[qh_at + 3]]);
                let high = _mm256_maskz_mov_epi8(qh, _mm256_set1_epi8(0x10));
                store(out, 0, _mm256_or_si256(nibbles(p, qh_at + 4), high), if one { 0 } else { 16 });
            }
            FastType::Q4_K | FastType::Q5_K => {
                let five = ty == FastType::Q5_K;
                let qs = if five { at::Q5K_QS } else { at::Q4K_QS };
                let qh = _mm256_loadu_si256(p.add(at::Q5K_QH) as *const __m256i);
                for j in 0..8 {
                    let x = _mm256_loadu_si256(p.add(qs + 32 * (j / 2)) as *const __m256i);
                    let mut v = shifted(x, 4 * (j % 2), low);
                    if five {
                        v = _mm256_or_si256(v, _mm256_slli_epi16::<4>(shifted(qh, j, _mm256_set1_epi8(1))));
                    }
                    store(out, 32 * j, v, 0);
                }
            }
            FastType::Q6_K => {
                for j in 0..8 {
                    let (n, c) = (j / 4, j % 4);
                    let lo = shifted(_mm256_loadu_si256(p.add(64 * n + 32 * (c % 2)) as *const __m256i), 4 * (c / 2), low);
                    let hi = shifted(_mm256_loadu_si256(p.add(at::Q6K_QH + 32 * n) as *const __m256i), 2 * c, _mm256_set1_epi8(3));
                    store(out, 32 * j, _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi)), 32);
                }
            }
            _ => codes(ty, b, (&mut q[..256]).try_into().expect("a K-quant's 256 codes")),
        }
    }
}

/// Codes `at..at + 32` of `out`: the 32 bytes of `v`, widened, less `sub`.
///
/// # Safety
/// As for `simd_codes`, and `at + 32 <= 256`.
#[inline(always)]
unsafe fn store(out: *mut i16, at: usize, v: __m256i, sub: i16) {
    // SAFETY: as the caller vouches.
    unsafe {
        let z = _mm512_sub_epi16(_mm512_cvtepu8_epi16(v), _mm512_set1_epi16(sub));
        _mm512_storeu_si512(out.add(at) as *mut __m512i, z);
    }
}

/// The 16 bytes at `p + at` as 32 nibbles: the low nibbles first, then the high.
///
/// # Safety
/// As for `simd_codes`, and the 16 bytes are the block's.
#[inline(always)]
unsafe fn nibbles(p: *const u8, at: usize) -> __m256i {
    // SAFETY: as the caller vouches.
    unsafe {
        let x = _mm_loadu_si128(p.add(at) as *const __m128i);
        let m = _mm_set1_epi8(0x0F);
        _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(x), m), _mm_and_si128(x, m))
    }
}

/// Each byte of `v` shifted right by `by` bits and masked.
///
/// # Safety
/// As for `simd_codes`.
#[inline(always)]
unsafe fn shifted(v: __m256i, by: usize, mask: __m256i) -> __m256i {
    // SAFETY: register operations, with the caller's features.
    unsafe { _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(by as i32)), mask) }
}
