//! AVX-512 kernels: one zmm register holds the 16 canonical lanes.
//!
//! Every function here is compiled for AVX-512F/BW, FMA and F16C, so calling one requires that
//! the CPU has them; `Isa` guarantees it (an `Isa` at the AVX-512 level exists only after
//! detection).

use super::panel::{Tile, Tiling};
use super::{layout as at, FastType, Part};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// The f16 at `p`, widened and broadcast.
///
/// # Safety
/// The CPU has AVX-512F/BW, FMA and F16C; `p` is valid for reading 2 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
unsafe fn f16x1(p: *const u8) -> __m512 {
    // SAFETY: the caller vouches for 2 readable bytes; the read is unaligned.
    let bits = unsafe { std::ptr::read_unaligned(p as *const u16) };
    _mm512_set1_ps(at::F16_TO_F32[bits as usize])
}

/// The two f16 values at `p`, widened and broadcast.
///
/// # Safety
/// The CPU has AVX-512F/BW, FMA and F16C; `p` is valid for reading 4 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
unsafe fn f16x2(p: *const u8) -> (__m512, __m512) {
    // SAFETY: as the caller vouches.
    unsafe { (f16x1(p), f16x1(p.add(2))) }
}

/// Sixteen bytes at `p`, widened to i32 lanes (unsigned).
///
/// # Safety
/// The CPU has AVX-512F/BW, FMA and F16C; `p` is valid for reading 16 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
unsafe fn u8x16(p: *const u8) -> __m512i {
    // SAFETY: the caller vouches for 16 readable bytes; the load is unaligned.
    _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(p as *const __m128i) })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
fn splat(v: i32) -> __m512i {
    _mm512_set1_epi32(v)
}

/// `a | (b & c)`, bitwise.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
fn or_and(a: __m512i, b: __m512i, c: __m512i) -> __m512i {
    _mm512_ternarylogic_epi32::<0xF8>(a, b, c)
}

/// 0, 1, .. 15: the codes of a nibble.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
fn iota() -> __m512 {
    _mm512_setr_ps(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0)
}

/// Entry `q & 15` of the 16-entry table `t`, lane by lane: a nibble's weight looked up rather
/// than computed (the table holds each code's exact dequantization, so the value is the same).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
fn nib(q: __m512i, t: __m512) -> __m512 {
    _mm512_permutexvar_ps(q, t)
}

/// `-v`, as a sign flip (so a zero's sign flips too, as the scalar kernel's does).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
fn neg(v: __m512) -> __m512 {
    _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), splat(i32::MIN)))
}

/// `q * s + o` for integer codes `q`: an exact dequantization (see the module docs).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
fn deq(q: __m512i, s: f32, o: f32) -> __m512 {
    _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(s), _mm512_set1_ps(o))
}

/// A K-quant super-block's factor table (see `scalar::table`): `a * d` in entries 0..16 and
/// `b * m` in 16..32, for 16 integer lanes `a` and `b`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
fn table(a: __m512i, d: __m512, b: __m512i, m: __m512) -> [f32; 32] {
    let mut t = [0f32; 32];
    // SAFETY: the two stores write 16 floats each, unaligned, into the 32-float array `t`.
    unsafe {
        _mm512_storeu_ps(t.as_mut_ptr(), _mm512_mul_ps(_mm512_cvtepi32_ps(a), d));
        _mm512_storeu_ps(t.as_mut_ptr().add(16), _mm512_mul_ps(_mm512_cvtepi32_ps(b), m));
    }
    t
}

/// Calls `f` with the two halves (elements 0..16 and 16..32) of each 32-element chunk of the
/// block at `p`, in order, dequantized exactly as the scalar kernel does.
///
/// # Safety
/// The CPU has AVX-512F/BW, FMA and F16C; `p` is valid for reading `ty.block_bytes()` bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
unsafe fn block(ty: FastType, p: *const u8, f: &mut impl FnMut(__m512, __m512)) {
    // SAFETY: every read below lies inside the block the caller vouches for; the offsets are
    // given per type (block sizes in `FastType::block_bytes`).
    unsafe {
        match ty {
            // 16 floats at bytes 0 and 64 (128).
            FastType::F32 => f(_mm512_loadu_ps(p as *const f32), _mm512_loadu_ps((p as *const f32).add(16))),
            // 32 bytes at 0 and 32 (64).
            FastType::F16 => f(
                _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
                _mm512_cvtph_ps(_mm256_loadu_si256(p.add(32) as *const __m256i)),
            ),
            FastType::Bf16 => {
                let lo = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i)));
                let hi = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.add(32) as *const __m256i)));
                f(_mm512_castsi512_ps(lo), _mm512_castsi512_ps(hi))
            }
            // The f16 scale at 0..2, then Q4_1's and Q5_1's minimum at 2..4 (the rest: `legacy`).
            FastType::Q4_0 | FastType::Q4_1 | FastType::Q5_0 | FastType::Q5_1 | FastType::Q8_0 => {
                let (d, m) = f16x2(p);
                let (lo, hi) = legacy(ty, p, d, m);
                f(lo, hi)
            }
            // d, dmin at 0..4, scales at 4..16, (Q5_K: fifth bits at 16..48,) nibbles (144, 176).
            FastType::Q4_K | FastType::Q5_K => {
                let five = ty == FastType::Q5_K;
                let (d, dmin) = f16x2(p);
                let s = at::q45k_scales(std::ptr::read_unaligned(p.add(at::Q45K_SCALES) as *const [u8; 12]));
                let s = _mm512_cvtepu8_epi32(_mm_loadu_si128(s.as_ptr() as *const __m128i));
                // Lanes 0..8 scale by d, 8..16 by -dmin.
                let unit = _mm512_mask_blend_ps(0xFF00, d, neg(dmin));
                let t = table(s, unit, splat(0), unit);
                let qs = p.add(if five { at::Q5K_QS } else { at::Q4K_QS });
                // Fifth bits, moved down one bit per chunk so each chunk's is bit 0.
                let (mut h0, mut h1) = if five { (u8x16(p.add(at::Q5K_QH)), u8x16(p.add(at::Q5K_QH + 16))) } else { (splat(0), splat(0)) };
                for i in 0..4 {
                    let (a, b) = (u8x16(qs.add(32 * i)), u8x16(qs.add(32 * i + 16)));
                    for (j, (a, b)) in [(2 * i, (a, b)), (2 * i + 1, (_mm512_srli_epi32::<4>(a), _mm512_srli_epi32::<4>(b)))] {
                        if five {
                            let (a, b) = (_mm512_and_si512(a, splat(0xF)), _mm512_and_si512(b, splat(0xF)));
                            let (a, b) =
                                (or_and(a, _mm512_slli_epi32::<4>(h0), splat(16)), or_and(b, _mm512_slli_epi32::<4>(h1), splat(16)));
                            (h0, h1) = (_mm512_srli_epi32::<1>(h0), _mm512_srli_epi32::<1>(h1));
                            f(deq(a, t[j], t[8 + j]), deq(b, t[j], t[8 + j]));
                        } else {
                            let t = _mm512_fmadd_ps(iota(), _mm512_set1_ps(t[j]), _mm512_set1_ps(t[8 + j]));
                            f(nib(a, t), nib(b, t));
                        }
                    }
                }
            }
            // Low nibbles at 0..128, high bit pairs at 128..192, signed scales at 192..208,
            // d at 208..210 (210).
            FastType::Q6_K => {
                let d = f16x1(p.add(at::Q6K_D));
                let s = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(at::Q6K_SCALES) as *const __m128i));
                let t = table(s, d, s, _mm512_mul_ps(d, _mm512_set1_ps(-32.0)));
                for n in 0..2 {
                    // The high bit pairs, moved up to bits 4..6 for chunk 0 and down two bits per
                    // chunk after it.
                    let qh = p.add(at::Q6K_QH + 32 * n);
                    let (mut h0, mut h1) = (_mm512_slli_epi32::<4>(u8x16(qh)), _mm512_slli_epi32::<4>(u8x16(qh.add(16))));
                    for c in 0..4 {
                        let ql = p.add(64 * n + 32 * (c % 2));
                        let (a, b) = (u8x16(ql), u8x16(ql.add(16)));
                        let (a, b) = if c < 2 {
                            (_mm512_and_si512(a, splat(0xF)), _mm512_and_si512(b, splat(0xF)))
                        } else {
                            (_mm512_srli_epi32::<4>(a), _mm512_srli_epi32::<4>(b))
                        };
                        let (a, b) = (or_and(a, h0, splat(0x30)), or_and(b, h1, splat(0x30)));
                        (h0, h1) = (_mm512_srli_epi32::<2>(h0), _mm512_srli_epi32::<2>(h1));
                        let i = 2 * (4 * n + c);
                        f(deq(a, t[i], t[16 + i]), deq(b, t[i + 1], t[17 + i]));
                    }
                }
            }
            // Q3_K: high-bit mask at 0..32, codes at 32..96, packed scales at 96..108, d at
            // 108..110 (110). Q2_K: scales at 0..16, codes at 16..80, d and dmin at 80..84 (84).
            FastType::Q3_K | FastType::Q2_K => {
                let three = ty == FastType::Q3_K;
                let (t, qs) = if three {
                    let d = f16x1(p.add(at::Q3K_D));
                    let s = at::q3k_scales(std::ptr::read_unaligned(p.add(at::Q3K_SCALES) as *const [u8; 12]));
                    let s = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(s.as_ptr() as *const __m128i)), splat(32));
                    (table(s, d, s, _mm512_mul_ps(d, _mm512_set1_ps(-4.0))), p.add(at::Q3K_QS))
                } else {
                    let (d, dmin) = f16x2(p.add(at::Q2K_D));
                    let s = u8x16(p);
                    let t = table(_mm512_and_si512(s, splat(0xF)), d, _mm512_srli_epi32::<4>(s), neg(dmin));
                    (t, p.add(at::Q2K_QS))
                };
                // The third bits, moved up to bit 2 for chunk 0 and down one bit per chunk.
                let (mut h0, mut h1) =
                    if three { (_mm512_slli_epi32::<2>(u8x16(p)), _mm512_slli_epi32::<2>(u8x16(p.add(16)))) } else { (splat(0), splat(0)) };
                for g in 0..2 {
                    let (a, b) = (u8x16(qs.add(32 * g)), u8x16(qs.add(32 * g + 16)));
                    for s in 0..4 {
                        let sh = _mm_cvtsi32_si128(2 * s as i32);
                        let (a, b) =
                            (_mm512_and_si512(_mm512_srl_epi32(a, sh), splat(3)), _mm512_and_si512(_mm512_srl_epi32(b, sh), splat(3)));
                        let (a, b) = if three {
                            let ab = (or_and(a, h0, splat(4)), or_and(b, h1, splat(4)));
                            (h0, h1) = (_mm512_srli_epi32::<1>(h0), _mm512_srli_epi32::<1>(h1));
                            ab
                        } else {
                            (a, b)
                        };
                        let i = 2 * (4 * g + s);
                        f(deq(a, t[i], t[16 + i]), deq(b, t[i + 1], t[17 + i]));
                    }
                }
            }
        }
    }
}

/// The two halves of a 32-element block of the legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0),
/// dequantized exactly, given its f16 scale `d` and (Q4_1, Q5_1) minimum `m` already widened
/// and broadcast.
///
/// # Safety
/// The CPU has AVX-512F/BW, FMA and F16C; `p` is valid for reading `ty.block_bytes()` bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
unsafe fn legacy(ty: FastType, p: *const u8, d: __m512, m: __m512) -> (__m512, __m512) {
    // SAFETY: every read lies inside the block the caller vouches for: Q4_0 16 bytes at 2 (of
    // 18), Q4_1 16 at 4 (of 20), Q5_0 4 at 2 and 16 at 6 (of 22), Q5_1 4 at 4 and 16 at 8 (of
    // 24), Q8_0 16 at 2 and 18 (of 34).
    unsafe {
        match ty {
            FastType::Q4_0 => {
                let t = _mm512_mul_ps(_mm512_sub_ps(iota(), _mm512_set1_ps(8.0)), d);
                let q = u8x16(p.add(2));
                (nib(q, t), nib(_mm512_srli_epi32::<4>(q), t))
            }
            FastType::Q4_1 => {
                let t = _mm512_fmadd_ps(iota(), d, m);
                let q = u8x16(p.add(4));
                (nib(q, t), nib(_mm512_srli_epi32::<4>(q), t))
            }
            FastType::Q5_0 | FastType::Q5_1 => {
                let one = ty == FastType::Q5_1;
                let qh_at = if one { 4 } else { 2 };
                let qh = std::ptr::read_unaligned(p.add(qh_at) as *const u32);
                let q = u8x16(p.add(qh_at + 4));
                // The fifth bit of element j is bit j of `qh`: a lane mask.
                let (lo, hi) = (_mm512_and_si512(q, splat(0xF)), _mm512_srli_epi32::<4>(q));
                let lo = _mm512_mask_or_epi32(lo, qh as u16, lo, splat(16));
                let hi = _mm512_mask_or_epi32(hi, (qh >> 16) as u16, hi, splat(16));
                if one {
                    (_mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), d, m), _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), d, m))
                } else {
                    let (lo, hi) = (_mm512_sub_epi32(lo, splat(16)), _mm512_sub_epi32(hi, splat(16)));
                    (_mm512_mul_ps(_mm512_cvtepi32_ps(lo), d), _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d))
                }
            }
            _ => {
                let lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(2) as *const __m128i)));
                let hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(18) as *const __m128i)));
                (_mm512_mul_ps(lo, d), _mm512_mul_ps(hi, d))
            }
        }
    }
}

/// The kernel for type number `T` (`p.ty`, specialized so each block's dequantization is inlined).
///
/// # Safety
/// The CPU has AVX-512F/BW, FMA and F16C; `p.w` holds `p.n_rows` rows of `p.row_bytes` bytes,
/// each at least `p.blocks.end` blocks; each column holds that many blocks' elements; `p.acc`
/// has room for `p.n_rows * N * 32` floats when `p.resume` or `p.suspend`; `p.out` is valid for
/// the writes at `c * p.stride + r` otherwise.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
pub(super) unsafe fn gemv<const N: usize, const T: u8>(p: &Part<N>) {
    // Each row's sums (the two sets added), reduced four rows at a time.
    let mut pending = [[_mm512_setzero_ps(); 4]; N];
    let mut r = 0;
    while r < p.n_rows {
        // Four rows of the legacy 4- and 5-bit types side by side (where their sums fit in
        // registers): each lane's sum is one chain of multiply-adds in a fixed order, and a row
        // alone, with these types' few instructions a block, waits on the latency of each.
        let four = N <= 2
            && p.n_rows - r >= 4
            && matches!(FastType::ALL[T as usize], FastType::Q4_0 | FastType::Q4_1 | FastType::Q5_0 | FastType::Q5_1);
        // SAFETY: the rows passed are below `n_rows`; the rest as the caller vouches.
        r += unsafe {
            if four {
                rows::<N, T, 4>(p, r, &mut pending)
            } else {
                rows::<N, T, 1>(p, r, &mut pending)
            }
        };
    }
}

/// Rows `r..r + R` multiplied by the columns, block by block, each row's chunks in order;
/// returns `R`.
///
/// # Safety
/// As for `gemv`, and `r + R <= p.n_rows`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
unsafe fn rows<const N: usize, const T: u8, const R: usize>(p: &Part<N>, r: usize, pending: &mut [[__m512; 4]; N]) -> usize {
    let ty = FastType::ALL[T as usize];
    let (bb, per) = (ty.block_bytes(), ty.block_chunks());
    let row: [*const u8; R] = std::array::from_fn(|i| p.w.wrapping_add((r + i) * p.row_bytes));
    let mut sums: [([__m512; N], [__m512; N]); R] = std::array::from_fn(|i| start(p, r + i));
    for b in p.blocks.clone() {
        for (row, (lo_acc, hi_acc)) in row.iter().zip(&mut sums) {
            let blk = row.wrapping_add(b * bb);
            super::prefetch(blk, bb);
            let mut xo = b * per * 32;
            let mut chunk = |lo, hi| {
                for c in 0..N {
                    // SAFETY: chunk `xo / 32` is inside `blocks`, so its 32 floats are inside
                    // each column, as the caller vouches.
                    let xb = unsafe { p.x[c].add(xo) };
                    // SAFETY: as above.
                    unsafe {
                        lo_acc[c] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), lo_acc[c]);
                        hi_acc[c] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb.add(16)), hi_acc[c]);
                    }
                }
                xo += 32;
            };
            // SAFETY: the row is below `n_rows` and `b < blocks.end`, so the block lies inside
            // `w`, as the caller vouches.
            unsafe { block(ty, blk, &mut chunk) };
        }
    }
    for (i, (lo, hi)) in sums.into_iter().enumerate() {
        finish(p, r + i, lo, hi, pending);
    }
    R
}

/// Row `r`'s running sums: zero, or those a previous part left.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
fn start<const N: usize>(p: &Part<N>, r: usize) -> ([__m512; N], [__m512; N]) {
    let (mut lo, mut hi) = ([_mm512_setzero_ps(); N], [_mm512_setzero_ps(); N]);
    if p.resume {
        let acc = p.acc.wrapping_add(r * N * 32);
        for c in 0..N {
            // SAFETY: the caller of `gemv` gave room for row `r`'s sums, `N * 32` floats at `acc`.
            unsafe { (lo[c], hi[c]) = (_mm512_loadu_ps(acc.add(c * 32)), _mm512_loadu_ps(acc.add(c * 32 + 16))) };
        }
    }
    (lo, hi)
}

/// Row `r`'s sums kept for the next part, or added and, every four rows, reduced into `out`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
fn finish<const N: usize>(p: &Part<N>, r: usize, lo: [__m512; N], hi: [__m512; N], pending: &mut [[__m512; 4]; N]) {
    let acc = p.acc.wrapping_add(r * N * 32);
    for c in 0..N {
        if p.suspend {
            // SAFETY: as for the loads in `start`.
            unsafe {
                _mm512_storeu_ps(acc.add(c * 32), lo[c]);
                _mm512_storeu_ps(acc.add(c * 32 + 16), hi[c]);
            }
        } else {
            pending[c][r % 4] = _mm512_add_ps(lo[c], hi[c]);
        }
    }
    if !p.suspend && (r % 4 == 3 || r + 1 == p.n_rows) {
        let r0 = r / 4 * 4;
        for c in 0..N {
            let mut sums = [0f32; 4];
            // SAFETY: the store writes 4 floats into the 4-float array `sums`.
            unsafe { _mm_storeu_ps(sums.as_mut_ptr(), reduce4(pending[c])) };
            for (i, v) in sums.iter().enumerate().take(r + 1 - r0) {
                // SAFETY: `c < N` and `r0 + i <= r < n_rows`: an index the caller gave room for.
                unsafe { *p.out.add(c * p.stride + r0 + i) = *v };
            }
        }
    }
}

/// Dequantizes the `n_blocks` blocks of type number `T` at `p` into `out`, 32 floats a chunk.
///
/// # Safety
/// The CPU has AVX-512F/BW, FMA and F16C; `p` is valid for reading `n_blocks` blocks and `out`
/// for writing their elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
pub(super) unsafe fn dequant<const T: u8>(p: *const u8, n_blocks: usize, out: *mut f32) {
    let ty = FastType::ALL[T as usize];
    let mut o = out;
    for b in 0..n_blocks {
        // SAFETY: block `b < n_blocks` lies inside what the caller vouches for, and its chunks'
        // 32 floats each inside `out`.
        unsafe {
            block(ty, p.add(b * ty.block_bytes()), &mut |lo, hi| {
                _mm512_storeu_ps(o, lo);
                _mm512_storeu_ps(o.add(16), hi);
                o = o.add(32);
            })
        };
    }
}

/// Dequantizes `TILING.rows` rows of type number `T`, `row_bytes` apart from `p` and `n_blocks`
/// blocks each, into the layout `tiles` reads: set by set (the first halves of the chunks, then
/// the second halves), chunk by chunk, the six rows' 16 floats side by side.
///
/// # Safety
/// The CPU has AVX-512F/BW, FMA and F16C; `p` is valid for reading the rows and `out` for
/// writing their `TILING.rows * k` elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
pub(super) unsafe fn dequant_tile<const T: u8>(p: *const u8, row_bytes: usize, n_blocks: usize, out: *mut f32) {
    let ty = FastType::ALL[T as usize];
    let nb = n_blocks * ty.block_chunks();
    for r in 0..TILING.rows {
        let (mut first, mut second) = (out.wrapping_add(16 * r), out.wrapping_add(16 * (r + TILING.rows * nb)));
        for b in 0..n_blocks {
            // SAFETY: block `b` of row `r` lies inside what the caller vouches for, and each
            // chunk's two halves go to their places among the `TILING.rows * k` floats at `out`.
            unsafe {
                block(ty, p.add(r * row_bytes + b * ty.block_bytes()), &mut |lo, hi| {
                    _mm512_storeu_ps(first, lo);
                    _mm512_storeu_ps(second, hi);
                    (first, second) = (first.add(16 * TILING.rows), second.add(16 * TILING.rows));
                })
            };
        }
    }
}

/// Six rows by four columns, one set of 16 lanes at a time: the 24 sums of a set fill the
/// registers, and each vector loaded feeds four or six multiply-adds.
pub(super) const TILING: Tiling = Tiling { rows: 6, cols: 4, lanes: 16 };

/// Runs `t` over its first `n` columns (1 to 4).
///
/// # Safety
/// The CPU has AVX-512F/BW, FMA and F16C; the tile's rows, columns, sums and outputs are valid
/// as `panel::tiles` lays them out.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
pub(super) unsafe fn tile(t: &Tile, n: usize) {
    // SAFETY: as the caller vouches.
    unsafe {
        match n {
            1 => sets::<1>(t),
            2 => sets::<2>(t),
            3 => sets::<3>(t),
            _ => sets::<4>(t),
        }
    }
}

/// Both sets of the tile's sums over its first `N` columns.
///
/// # Safety
/// As for `tile`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
unsafe fn sets<const N: usize>(t: &Tile) {
    // SAFETY: as the caller vouches.
    unsafe {
        set::<N>(t, 0);
        set::<N>(t, 1);
    }
}

/// The set `h` (lanes from the first or second half of each chunk) of the tile's sums over its
/// first `N` columns.
///
/// # Safety
/// As for `tile`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
unsafe fn set<const N: usize>(t: &Tile, h: usize) {
    const R: usize = TILING.rows;
    const C: usize = TILING.cols;
    let acc = t.acc.wrapping_add(h * TILING.sums() / 2);
    let mut a = [[_mm512_setzero_ps(); N]; R];
    if t.resume {
        for r in 0..R {
            for c in 0..N {
                // SAFETY: sum `(r, c)` of set `h`, inside the floats the caller vouches for.
                a[r][c] = unsafe { _mm512_loadu_ps(acc.add((C * r + c) * 16)) };
            }
        }
    }
    let at = h * t.nb + t.chunks.start;
    let (mut w, mut x) = (t.w.wrapping_add(at * R * 16), t.x.wrapping_add(at * C * 16));
    for _ in t.chunks.clone() {
        // SAFETY: this chunk's half of each row and column is inside what the caller vouches
        // for.
        unsafe {
            let xv: [__m512; N] = std::array::from_fn(|c| _mm512_loadu_ps(x.add(16 * c)));
            for r in 0..R {
                let wv = _mm512_loadu_ps(w.add(16 * r));
                for c in 0..N {
                    a[r][c] = _mm512_fmadd_ps(wv, xv[c], a[r][c]);
                }
            }
        }
        (w, x) = (w.wrapping_add(16 * R), x.wrapping_add(16 * C));
    }
    if h == 0 || !t.last {
        for r in 0..R {
            for c in 0..N {
                // SAFETY: as for the loads above.
                unsafe { _mm512_storeu_ps(acc.add((C * r + c) * 16), a[r][c]) };
            }
        }
        return;
    }
    let first = t.acc;
    for c in 0..N {
        // SAFETY: the first set's sum `(r, c)`, stored by `set(0)` above.
        let row = |r: usize| _mm512_add_ps(unsafe { _mm512_loadu_ps(first.add((C * r + c) * 16)) }, a[r][c]);
        let head = reduce4([row(0), row(1), row(2), row(3)]);
        let tail = reduce4([row(4), row(5), row(4), row(5)]);
        let mut s = [0f32; 4];
        // SAFETY: `s` holds 4 floats.
        unsafe { _mm_storeu_ps(s.as_mut_ptr(), tail) };
        // SAFETY: `c < N`: outputs `c * stride + r` for r < 6, six of this tile's, adjacent.
        unsafe {
            _mm_storeu_ps(t.out.add(c * t.stride), head);
            *t.out.add(c * t.stride + 4) = s[0];
            *t.out.add(c * t.stride + 5) = s[1];
        }
    }
}

/// The canonical reductions (`reduce16`) of four vectors at once, side by side: lanes 0..8
/// added to 8..16, then 0..4 to 4..8, 0..2 to 2..4 and 0 to 1, each vector's pairs exactly as
/// `reduce16` pairs them (IEEE addition commutes, so the operands' order in a pair is free).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
fn reduce4(v: [__m512; 4]) -> __m128 {
    // 128-bit quarters: q0 q1 of each vector against q2 q3, two vectors per register.
    let halves =
        |a: __m512, b: __m512| _mm512_add_ps(_mm512_shuffle_f32x4::<0b01_00_01_00>(a, b), _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b));
    let (h01, h23) = (halves(v[0], v[1]), halves(v[2], v[3]));
    // Each vector's 8 sums: first 4 against last 4, one vector per quarter.
    let q = _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(h01, h23), _mm512_shuffle_f32x4::<0b11_01_11_01>(h01, h23));
    // Within each quarter: elements 0 1 against 2 3, then 0 against 1.
    let p = _mm512_add_ps(q, _mm512_permute_ps::<0b01_00_11_10>(q));
    let s = _mm512_add_ps(p, _mm512_permute_ps::<0b10_11_00_01>(p));
    _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), s))
}

/// # Safety
/// As for the x86-64 version, less the CPU features: elsewhere this is the scalar kernel.
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn gemv<const N: usize, const T: u8>(p: &Part<N>) {
    // SAFETY: the scalar kernel asks the same of its arguments as this one.
    unsafe { super::scalar::gemv::<N, T>(p) }
}

/// # Safety
/// As for the x86-64 version, less the CPU features.
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn dequant<const T: u8>(p: *const u8, n_blocks: usize, out: *mut f32) {
    // SAFETY: the scalar version asks the same of its arguments as this one.
    unsafe { super::scalar::dequant::<T>(p, n_blocks, out) }
}

/// # Safety
/// Never called: elsewhere no `Isa` has the AVX-512 level.
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn tile(_: &Tile, _: usize) {
    unreachable!("AVX-512 tiles off x86-64")
}

/// # Safety
/// Never called: elsewhere no `Isa` has the AVX-512 level.
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn dequant_tile<const T: u8>(_: *const u8, _: usize, _: usize, _: *mut f32) {
    unreachable!("AVX-512 tiles off x86-64")
}
