//! AVX2 kernels: a pair of ymm registers holds the 16 canonical lanes (0..8, 8..16).
//!
//! Every function here is compiled for AVX2, FMA and F16C, so calling one requires that the CPU
//! has them; `Isa` guarantees it (an `Isa` at the AVX2 level exists only after detection).

use super::FastType;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct V16(__m256, __m256);

/// The two f16 values at `p`, widened (in lanes 0 and 1).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `p` is valid for reading 4 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn f16_pair(p: *const u8) -> __m128 {
    // SAFETY: the caller vouches for 4 readable bytes; the read is unaligned.
    let bits = unsafe { std::ptr::read_unaligned(p as *const i32) };
    _mm_cvtph_ps(_mm_cvtsi32_si128(bits))
}

/// Eight bytes at `p`, widened to i32 lanes.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `p` is valid for reading 8 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn u8x8(p: *const u8) -> __m256i {
    // SAFETY: `_mm_loadl_epi64` reads 8 bytes, unaligned, which the caller vouches for.
    _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(p as *const __m128i) })
}

/// Eight signed bytes at `p`, as floats.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `p` is valid for reading 8 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn i8x8(p: *const u8) -> __m256 {
    // SAFETY: `_mm_loadl_epi64` reads 8 bytes, unaligned, which the caller vouches for.
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(unsafe { _mm_loadl_epi64(p as *const __m128i) }))
}

/// Eight bf16 values at `p`, as floats.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `p` is valid for reading 16 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn bf16x8(p: *const u8) -> __m256 {
    // SAFETY: `_mm_loadu_si128` reads 16 bytes, unaligned, which the caller vouches for.
    let w = _mm256_cvtepu16_epi32(unsafe { _mm_loadu_si128(p as *const __m128i) });
    _mm256_castsi256_ps(_mm256_slli_epi32(w, 16))
}

/// Eight f16 values at `p`, as floats.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `p` is valid for reading 16 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn f16x8(p: *const u8) -> __m256 {
    // SAFETY: `_mm_loadu_si128` reads 16 bytes, unaligned, which the caller vouches for.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p as *const __m128i) })
}

/// `(q & 0xF) + bias` and `(q >> 4) + bias`, times `d`: Q4_0's two nibbles of eight bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn nib_lo(q: __m256i, d: __m256, bias: i32) -> __m256 {
    let v = _mm256_add_epi32(_mm256_and_si256(q, _mm256_set1_epi32(0xF)), _mm256_set1_epi32(bias));
    _mm256_mul_ps(_mm256_cvtepi32_ps(v), d)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn nib_hi(q: __m256i, d: __m256, bias: i32) -> __m256 {
    let v = _mm256_add_epi32(_mm256_srli_epi32(q, 4), _mm256_set1_epi32(bias));
    _mm256_mul_ps(_mm256_cvtepi32_ps(v), d)
}

/// Q4_1's nibble at bit `shift` (0 or 4) of eight bytes, as `q * d + m`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn nib_fma(q: __m256i, shift: i32, d: __m256, m: __m256) -> __m256 {
    let v = _mm256_and_si256(_mm256_srlv_epi32(q, _mm256_set1_epi32(shift)), _mm256_set1_epi32(0xF));
    _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), d, m)
}

/// The two halves (elements 0..16 and 16..32) of one 32-element chunk, dequantized exactly.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `p` is valid for reading `ty.chunk_bytes()` bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dequant(ty: FastType, p: *const u8) -> (V16, V16) {
    // SAFETY: every read below lies inside the chunk the caller vouches for: f32 reads 8 floats
    // at each of bytes 0, 32, 64, 96 (128 in all); f16 and bf16 16 bytes at 0, 16, 32, 48 (64);
    // Q4_0 the scale at 0..2 and 8 bytes at 2 and 10 (18); Q4_1 the scales at 0..4 and 8 bytes at
    // 4 and 12 (20); Q8_0 the scale at 0..2 and 8 bytes at 2, 10, 18, 26 (34).
    unsafe {
        match ty {
            FastType::F32 => {
                let f = p as *const f32;
                (V16(_mm256_loadu_ps(f), _mm256_loadu_ps(f.add(8))), V16(_mm256_loadu_ps(f.add(16)), _mm256_loadu_ps(f.add(24))))
            }
            FastType::F16 => (V16(f16x8(p), f16x8(p.add(16))), V16(f16x8(p.add(32)), f16x8(p.add(48)))),
            FastType::Bf16 => (V16(bf16x8(p), bf16x8(p.add(16))), V16(bf16x8(p.add(32)), bf16x8(p.add(48)))),
            FastType::Q4_0 => {
                let d = _mm256_broadcastss_ps(f16_pair(p));
                let (q0, q1) = (u8x8(p.add(2)), u8x8(p.add(10)));
                (V16(nib_lo(q0, d, -8), nib_lo(q1, d, -8)), V16(nib_hi(q0, d, -8), nib_hi(q1, d, -8)))
            }
            FastType::Q4_1 => {
                let dm = f16_pair(p);
                let d = _mm256_broadcastss_ps(dm);
                let m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
                let (q0, q1) = (u8x8(p.add(4)), u8x8(p.add(12)));
                (V16(nib_fma(q0, 0, d, m), nib_fma(q1, 0, d, m)), V16(nib_fma(q0, 4, d, m), nib_fma(q1, 4, d, m)))
            }
            FastType::Q8_0 => {
                let d = _mm256_broadcastss_ps(f16_pair(p));
                (
                    V16(_mm256_mul_ps(i8x8(p.add(2)), d), _mm256_mul_ps(i8x8(p.add(10)), d)),
                    V16(_mm256_mul_ps(i8x8(p.add(18)), d), _mm256_mul_ps(i8x8(p.add(26)), d)),
                )
            }
        }
    }
}

/// `acc + w * x[0..16]`, lane by lane.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `x` is valid for reading 16 floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn fma16(w: V16, x: *const f32, acc: V16) -> V16 {
    // SAFETY: the two unaligned loads read floats 0..8 and 8..16 of `x`, which the caller vouches for.
    let (x0, x1) = unsafe { (_mm256_loadu_ps(x), _mm256_loadu_ps(x.add(8))) };
    V16(_mm256_fmadd_ps(w.0, x0, acc.0), _mm256_fmadd_ps(w.1, x1, acc.1))
}

/// # Safety
/// The CPU has AVX2, FMA and F16C; `w` holds `n_rows` rows of `row_bytes` bytes, each at least `nb` chunks; each `x[c]`
/// holds `32 * nb` floats; `out` has room for index `(N - 1) * stride + n_rows - 1`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
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
        let zero = V16(_mm256_setzero_ps(), _mm256_setzero_ps());
        let (mut lo_acc, mut hi_acc) = ([zero; N], [zero; N]);
        for b in 0..nb {
            // As in the AVX-512 kernel: keep a stream of weight misses in flight. (A prefetch
            // never faults, so the address may lie past the row.)
            _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(b * cb + super::avx512::PREFETCH) as *const i8);
            // SAFETY: `r < n_rows` and `b < nb`, so chunk `b` of row `r` lies inside `w`, and
            // floats `32 b .. 32 b + 32` inside each column, as the caller vouches.
            unsafe {
                let (lo, hi) = dequant(ty, row.add(b * cb));
                for c in 0..N {
                    let xb = x[c].add(b * 32);
                    lo_acc[c] = fma16(lo, xb, lo_acc[c]);
                    hi_acc[c] = fma16(hi, xb.add(16), hi_acc[c]);
                }
            }
        }
        for c in 0..N {
            let mut l = [0f32; 16];
            // SAFETY: each store writes 8 floats into the 16-float array `l`, at 0 and at 8.
            unsafe {
                _mm256_storeu_ps(l.as_mut_ptr(), _mm256_add_ps(lo_acc[c].0, hi_acc[c].0));
                _mm256_storeu_ps(l.as_mut_ptr().add(8), _mm256_add_ps(lo_acc[c].1, hi_acc[c].1));
            }
            // SAFETY: `c < N` and `r < n_rows`: an index the caller gave room for.
            unsafe { *out.add(c * stride + r) = super::reduce16(&l) };
        }
    }
}

/// # Safety
/// As for the x86-64 version, less the CPU features: elsewhere this is the scalar kernel.
#[cfg(not(target_arch = "x86_64"))]
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
    // SAFETY: the scalar kernel asks the same of its arguments as this one.
    unsafe { super::scalar::gemv::<N>(ty, w, row_bytes, n_rows, x, nb, out, stride) }
}
