//! AVX-512 kernels: one zmm register holds the 16 canonical lanes.
//!
//! Every function here is compiled for AVX-512F/BW, FMA and F16C, so calling one requires that
//! the CPU has them; `Isa` guarantees it (an `Isa` at the AVX-512 level exists only after
//! detection).

use super::FastType;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// The two f16 values at `p`, widened (in lanes 0 and 1).
///
/// # Safety
/// The CPU has AVX-512F/BW, FMA and F16C; `p` is valid for reading 4 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
unsafe fn f16_pair(p: *const u8) -> __m128 {
    // SAFETY: the caller vouches for 4 readable bytes; the read is unaligned.
    let bits = unsafe { std::ptr::read_unaligned(p as *const i32) };
    _mm_cvtph_ps(_mm_cvtsi32_si128(bits))
}

/// The two halves (elements 0..16 and 16..32) of one 32-element chunk, dequantized exactly.
///
/// # Safety
/// The CPU has AVX-512F/BW, FMA and F16C; `p` is valid for reading `ty.chunk_bytes()` bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
unsafe fn dequant(ty: FastType, p: *const u8) -> (__m512, __m512) {
    // SAFETY: every read below lies inside the chunk the caller vouches for: f32 reads 16 floats
    // at bytes 0 and 64 (128 in all); f16 and bf16 32 bytes at 0 and 32 (64); Q4_0 the scale at
    // 0..2 and 16 bytes at 2 (18); Q4_1 the scales at 0..4 and 16 bytes at 4 (20); Q8_0 the scale
    // at 0..2 and 16 bytes at 2 and 18 (34).
    unsafe {
        match ty {
            FastType::F32 => (_mm512_loadu_ps(p as *const f32), _mm512_loadu_ps((p as *const f32).add(16))),
            FastType::F16 => {
                (_mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)), _mm512_cvtph_ps(_mm256_loadu_si256(p.add(32) as *const __m256i)))
            }
            FastType::Bf16 => {
                let lo = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i)), 16);
                let hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.add(32) as *const __m256i)), 16);
                (_mm512_castsi512_ps(lo), _mm512_castsi512_ps(hi))
            }
            FastType::Q4_0 => {
                let d = _mm512_broadcastss_ps(f16_pair(p));
                let q = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(2) as *const __m128i));
                let eight = _mm512_set1_epi32(8);
                let lo = _mm512_sub_epi32(_mm512_and_si512(q, _mm512_set1_epi32(0xF)), eight);
                let hi = _mm512_sub_epi32(_mm512_srli_epi32(q, 4), eight);
                (_mm512_mul_ps(_mm512_cvtepi32_ps(lo), d), _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d))
            }
            FastType::Q4_1 => {
                let dm = f16_pair(p);
                let d = _mm512_broadcastss_ps(dm);
                let m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
                let q = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(4) as *const __m128i));
                let lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0xF)));
                let hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
                (_mm512_fmadd_ps(lo, d, m), _mm512_fmadd_ps(hi, d, m))
            }
            FastType::Q8_0 => {
                let d = _mm512_broadcastss_ps(f16_pair(p));
                let lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(2) as *const __m128i)));
                let hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(18) as *const __m128i)));
                (_mm512_mul_ps(lo, d), _mm512_mul_ps(hi, d))
            }
        }
    }
}

/// The canonical reduction of the 16 lanes of `v`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
fn reduce(v: __m512) -> f32 {
    let mut l = [0f32; 16];
    // SAFETY: the store writes 16 floats, unaligned, into the 16-float array `l`.
    unsafe { _mm512_storeu_ps(l.as_mut_ptr(), v) };
    super::reduce16(&l)
}

/// How far ahead of the current block to prefetch weights, in bytes.
#[cfg(target_arch = "x86_64")]
pub(super) const PREFETCH: usize = 1024;

/// # Safety
/// The CPU has AVX-512F/BW, FMA and F16C; `w` holds `n_rows` rows of `row_bytes` bytes, each at least `nb` chunks; each `x[c]`
/// holds `32 * nb` floats; `out` has room for index `(N - 1) * stride + n_rows - 1`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
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
        let (mut lo_acc, mut hi_acc) = ([_mm512_setzero_ps(); N], [_mm512_setzero_ps(); N]);
        for b in 0..nb {
            // Ask for the weights a few hundred bytes ahead: one core's stream of misses,
            // not its arithmetic, is what bounds decode. (A prefetch never faults, so the
            // address may lie past the row.)
            _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(b * cb + PREFETCH) as *const i8);
            // SAFETY: `r < n_rows` and `b < nb`, so chunk `b` of row `r` lies inside `w`, and
            // floats `32 b .. 32 b + 32` inside each column, as the caller vouches.
            unsafe {
                let (lo, hi) = dequant(ty, row.add(b * cb));
                for c in 0..N {
                    let xb = x[c].add(b * 32);
                    lo_acc[c] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), lo_acc[c]);
                    hi_acc[c] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb.add(16)), hi_acc[c]);
                }
            }
        }
        for c in 0..N {
            // SAFETY: `c < N` and `r < n_rows`: an index the caller gave room for.
            unsafe { *out.add(c * stride + r) = reduce(_mm512_add_ps(lo_acc[c], hi_acc[c])) };
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
