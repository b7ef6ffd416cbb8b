//! The activations of a fast product: each column quantized to 16-bit integers per 32 values
//! (each also as two signed bytes, `256 * hi + lo`, for `vpdpbusd`), once per product, by
//! portable code every instruction set shares (so the integers, scales and sums are the same
//! bits on every path).

use crate::backend::cpu::kernels::Isa;
#[cfg(target_arch = "x86_64")]
use crate::backend::cpu::kernels::Level;
use crate::backend::cpu::pool::ThreadPool;
use std::sync::Mutex;

/// The largest code: a 32-value chunk's largest magnitude maps to it. 127 * 257 rather than
/// 32767 (0.4% coarser), so every code is `256 * hi + lo` with `hi` and `lo` signed bytes, the
/// operands of a byte dot product (`vpdpbusd`) whose integer sums are the 16-bit products'.
const QMAX: f32 = 32639.0;

/// `n` columns of `k` values (`k` a multiple of 32): value `e` of column `c` is about
/// `scale(c, e / 32) * code`, with each chunk's exact sums kept for the weights' offsets.
#[derive(Default)]
pub(crate) struct Activations {
    pub(super) k: usize,
    pub(super) n: usize,
    /// `n * k` codes, column by column.
    pub(super) codes: Vec<i16>,
    /// `n * k / 32` scales: a chunk's largest magnitude over `QMAX`.
    pub(super) scales: Vec<f32>,
    /// `n * k / 16` sums of each 16 values and `n * k / 32` of each 32 (of the values, not the
    /// codes: a weight's offset meets the activations exactly), each summed in f64 and rounded.
    pub(super) sums16: Vec<f32>,
    pub(super) sums32: Vec<f32>,
    /// The same, laid out for the tiles: columns in groups of `GROUP`, each group's codes pair
    /// by pair (pair `p` of its column `c` at `p * GROUP + c`, two codes in one word), and its
    /// scales and sums chunk by chunk (or half-chunk by half-chunk) likewise.
    pub(super) pairs: Vec<u32>,
    /// Each group's codes four at a time as bytes (a code is `256 * hi + lo`, see `QMAX`): in a
    /// group of `w` columns (`GROUP`, or fewer in the last), quad `q` (codes `4q..4q + 4`) of its
    /// column `c` as `hi` bytes at `2 * q * w + c` and `lo` bytes at `(2 * q + 1) * w + c`, so a
    /// lone column's are compact.
    pub(super) quads: Vec<u32>,
    /// Each group's exact integer sums of each 16 codes, laid out as `quads` (sum `j` of column
    /// `c` at `j * w + c`): what the packed Q6_K kernel, its codes stored plus 32, takes off 32
    /// times of.
    pub(super) isums16: Vec<i32>,
    pub(super) scales_t: Vec<f32>,
    pub(super) sums16_t: Vec<f32>,
    pub(super) sums32_t: Vec<f32>,
}

/// Columns a group of the tiles' layout holds.
pub(super) const GROUP: usize = 8;

impl Activations {
    /// Quantizes the columns `xs` (each at least `k` values, `k` a multiple of 32) into `self`,
    /// reusing its buffers, a group of `GROUP` columns a job on `pool` (each group's values are
    /// in ranges of their own in every array).
    pub(crate) fn quantize(&mut self, pool: &ThreadPool, isa: Isa, xs: &[&[f32]], k: usize) {
        assert!(k.is_multiple_of(32) && xs.iter().all(|x| x.len() >= k));
        let n = xs.len();
        let groups = n.div_ceil(GROUP);
        self.k = k;
        self.n = n;
        self.codes.resize(n * k, 0);
        self.scales.resize(n * k / 32, 0.0);
        self.sums16.resize(n * k / 16, 0.0);
        self.sums32.resize(n * k / 32, 0.0);
        self.pairs.resize(groups * GROUP * k / 2, 0);
        self.quads.resize(groups * GROUP * k / 2, 0);
        self.isums16.resize(groups * GROUP * k / 16, 0);
        self.scales_t.resize(groups * GROUP * k / 32, 0.0);
        self.sums16_t.resize(groups * GROUP * k / 16, 0.0);
        self.sums32_t.resize(groups * GROUP * k / 32, 0.0);
        let (per16, per32) = (GROUP * k / 16, GROUP * k / 32);
        let mut parts: Vec<Mutex<Group>> = Vec::with_capacity(groups);
        let mut codes = self.codes.chunks_mut(GROUP * k);
        let (mut scales, mut sums16, mut sums32) =
            (self.scales.chunks_mut(per32), self.sums16.chunks_mut(per16), self.sums32.chunks_mut(per32));
        let mut pairs = self.pairs.chunks_mut(GROUP * k / 2);
        let mut quads = self.quads.chunks_mut(GROUP * k / 2);
        let mut isums16 = self.isums16.chunks_mut(per16);
        let mut scales_t = self.scales_t.chunks_mut(per32);
        let (mut sums16_t, mut sums32_t) = (self.sums16_t.chunks_mut(per16), self.sums32_t.chunks_mut(per32));
        for xs in xs.chunks(GROUP) {
            let mut next = || -> Option<Group> {
                Some(Group {
                    xs,
                    codes: codes.next()?,
                    scales: scales.next()?,
                    sums16: sums16.next()?,
                    sums32: sums32.next()?,
                    pairs: pairs.next()?,
                    quads: quads.next()?,
                    isums16: isums16.next()?,
                    scales_t: scales_t.next()?,
                    sums16_t: sums16_t.next()?,
                    sums32_t: sums32_t.next()?,
                })
            };
            parts.push(Mutex::new(next().expect("every array has a range per group")));
        }
        pool.run(groups, 1, &|range| {
            for g in &parts[range] {
                let mut g = g.lock().unwrap_or_else(|p| p.into_inner());
                match isa.level() {
                    // SAFETY: an `Isa` at the AVX-512 level exists only where detection found
                    // AVX-512F/BW, FMA and F16C on this CPU; the body itself is safe code.
                    #[cfg(target_arch = "x86_64")]
                    Level::Avx512 => unsafe { group_avx512(&mut g, k) },
                    // SAFETY: likewise, detection found AVX2, FMA and F16C.
                    #[cfg(target_arch = "x86_64")]
                    Level::Avx2 => unsafe { group_avx2(&mut g, k) },
                    _ => group_body::<false>(&mut g, k),
                }
            }
        });
    }
}

/// One group's columns and its ranges of the arrays (see `Activations`).
struct Group<'a, 'x> {
    xs: &'a [&'x [f32]],
    codes: &'a mut [i16],
    scales: &'a mut [f32],
    sums16: &'a mut [f32],
    sums32: &'a mut [f32],
    pairs: &'a mut [u32],
    quads: &'a mut [u32],
    isums16: &'a mut [i32],
    scales_t: &'a mut [f32],
    sums16_t: &'a mut [f32],
    sums32_t: &'a mut [f32],
}

/// `group_body` compiled for AVX-512, its chunks quantized by `chunk_avx512`.
///
/// # Safety
/// The CPU has AVX-512F/BW, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
unsafe fn group_avx512(g: &mut Group, k: usize) {
    group_body::<true>(g, k)
}

/// `group_body` compiled for AVX2.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_avx2(g: &mut Group, k: usize) {
    group_body::<false>(g, k)
}

/// The group's columns chunk by chunk, then the tiles' layout of them. With `AVX512`, only
/// from `group_avx512`.
#[inline(always)]
fn group_body<const AVX512: bool>(g: &mut Group, k: usize) {
    for (c, x) in g.xs.iter().enumerate() {
        for (j, values) in x[..k].chunks_exact(32).enumerate() {
            let at = c * k / 32 + j;
            let (x, codes) = (values.try_into().expect("32 values"), (&mut g.codes[at * 32..][..32]).try_into().expect("32 codes"));
            #[cfg(target_arch = "x86_64")]
            // SAFETY: only `group_avx512` asks for it, where the CPU has AVX-512F/BW.
            let (scale, lo, hi) = if AVX512 { unsafe { chunk_avx512(x, codes) } } else { chunk(x, codes) };
            #[cfg(not(target_arch = "x86_64"))]
            let (scale, lo, hi) = chunk(x, codes);
            g.scales[at] = scale;
            g.sums16[2 * at] = lo as f32;
            g.sums16[2 * at + 1] = hi as f32;
            g.sums32[at] = (lo + hi) as f32;
        }
    }
    let w = g.xs.len();
    // A whole group's pairs and the quads of its whole runs of 64 codes, in vectors.
    #[cfg(target_arch = "x86_64")]
    // SAFETY: only `group_avx512` asks for it, where the CPU has AVX-512F/BW.
    let (pairs_done, quads_done) = if AVX512 && w == GROUP { unsafe { layout_avx512(g, k) } } else { (0, 0) };
    #[cfg(not(target_arch = "x86_64"))]
    let (pairs_done, quads_done) = (0, 0);
    for c in 0..w {
        let codes = &g.codes[c * k..][..k];
        for p in pairs_done..k / 2 {
            g.pairs[p * GROUP + c] = codes[2 * p] as u16 as u32 | (codes[2 * p + 1] as u16 as u32) << 16;
        }
        for (q, four) in codes.chunks_exact(4).enumerate().skip(quads_done) {
            let (hi, lo) = bytes(four);
            g.quads[2 * q * w + c] = hi;
            g.quads[(2 * q + 1) * w + c] = lo;
        }
        for (j, sixteen) in codes.chunks_exact(16).enumerate() {
            g.isums16[j * w + c] = sixteen.iter().map(|&q| q as i32).sum();
        }
        for j in 0..k / 32 {
            g.scales_t[j * GROUP + c] = g.scales[c * k / 32 + j];
            g.sums32_t[j * GROUP + c] = g.sums32[c * k / 32 + j];
        }
        for j in 0..k / 16 {
            g.sums16_t[j * GROUP + c] = g.sums16[c * k / 16 + j];
        }
    }
}

/// Four codes as `vpdpbusd` takes them: their `hi` bytes and their `lo` bytes (a code is
/// `256 * hi + lo`, both signed), each four as one little-endian word.
#[inline(always)]
fn bytes(four: &[i16]) -> (u32, u32) {
    let lo: [i8; 4] = std::array::from_fn(|i| four[i] as i8);
    let hi: [i8; 4] = std::array::from_fn(|i| ((four[i] - lo[i] as i16) >> 8) as i8);
    (u32::from_le_bytes(hi.map(|b| b as u8)), u32::from_le_bytes(lo.map(|b| b as u8)))
}

/// A whole group's (`GROUP` columns) `pairs`, and its `quads` for each whole run of 64 codes,
/// laid out in vectors: a pair is two codes' 32-bit word as memory holds them, and a quad's
/// bytes are what `bytes` makes, so each array is an 8-column transpose of words. Returns how
/// many pairs and quads of each column it wrote (the first ones); the portable loops write the
/// rest. The scalar loops' stores, 32 bytes apart, took most of a product's quantization.
///
/// # Safety
/// The CPU has AVX-512F/BW; `g` holds `GROUP` columns of `k` codes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn layout_avx512(g: &mut Group, k: usize) -> (usize, usize) {
    use std::arch::x86_64::*;
    debug_assert!(g.codes.len() >= GROUP * k && g.pairs.len() >= GROUP * k / 2 && g.quads.len() >= GROUP * k / 2);
    let codes = g.codes.as_ptr();
    // SAFETY: each load reads codes of one column inside `g.codes` (a column's `k` codes hold
    // its `k / 2` pairs and the runs of 64 counted below); each transpose writes inside `pairs`
    // or `quads`, at the places the portable loops would.
    unsafe {
        for p0 in (0..k / 2).step_by(16) {
            let rows: [__m512i; GROUP] = std::array::from_fn(|c| _mm512_loadu_si512(codes.add(c * k + 2 * p0) as *const _));
            transpose_8x16(rows, g.pairs.as_mut_ptr().add(p0 * GROUP), GROUP);
        }
        let runs = k / 64;
        for r in 0..runs {
            let (mut his, mut los) = ([_mm512_setzero_si512(); GROUP], [_mm512_setzero_si512(); GROUP]);
            for c in 0..GROUP {
                let half = |h: usize| {
                    let x = _mm512_loadu_si512(codes.add(c * k + 64 * r + 32 * h) as *const _);
                    let lo = _mm512_srai_epi16::<8>(_mm512_slli_epi16::<8>(x));
                    (_mm512_cvtepi16_epi8(_mm512_srai_epi16::<8>(_mm512_sub_epi16(x, lo))), _mm512_cvtepi16_epi8(x))
                };
                let ((hi0, lo0), (hi1, lo1)) = (half(0), half(1));
                his[c] = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(hi0), hi1);
                los[c] = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo0), lo1);
            }
            // Quads 16r..16r + 16: the hi words of quad q at 2q * GROUP, the lo words after them.
            let at = g.quads.as_mut_ptr().add(2 * 16 * r * GROUP);
            transpose_8x16(his, at, 2 * GROUP);
            transpose_8x16(los, at.add(GROUP), 2 * GROUP);
        }
        (k / 2, 16 * runs)
    }
}

/// Writes word `i` of `rows[c]` to `dst[i * stride + c]`, for 16 words of 8 rows: words paired,
/// then pairs of pairs, within each 128-bit lane, then the lanes moved into place.
///
/// # Safety
/// The CPU has AVX-512F; `dst` may be written at those 128 places.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn transpose_8x16(rows: [std::arch::x86_64::__m512i; GROUP], dst: *mut u32, stride: usize) {
    use std::arch::x86_64::*;
    let r = rows;
    // Lane l of t[2j] holds words 4l, 4l + 1 of rows 2j, 2j + 1 interleaved; t[2j + 1] words
    // 4l + 2, 4l + 3.
    let t: [__m512i; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_epi32(a, b)
        } else {
            _mm512_unpackhi_epi32(a, b)
        }
    });
    // Lane l of u[i] (i < 4) holds word 4l + i of rows 0..4; u[4 + i] of rows 4..8.
    let u: [__m512i; 8] = std::array::from_fn(|i| {
        let base = if i < 4 { 0 } else { 4 };
        let (a, b) = (t[base + (i % 4) / 2], t[base + 2 + (i % 4) / 2]);
        if i % 2 == 0 {
            _mm512_unpacklo_epi64(a, b)
        } else {
            _mm512_unpackhi_epi64(a, b)
        }
    });
    for i in 0..4 {
        // Word i + 4l of all 8 rows is lane l of u[i] then lane l of u[4 + i].
        let a = _mm512_shuffle_i32x4::<0b01_00_01_00>(u[i], u[4 + i]);
        let a = _mm512_shuffle_i32x4::<0b11_01_10_00>(a, a);
        let b = _mm512_shuffle_i32x4::<0b11_10_11_10>(u[i], u[4 + i]);
        let b = _mm512_shuffle_i32x4::<0b11_01_10_00>(b, b);
        // SAFETY: the caller's promise: words i, 4 + i, 8 + i, 12 + i of the rows.
        unsafe {
            _mm256_storeu_si256(dst.add(i * stride) as *mut __m256i, _mm512_castsi512_si256(a));
            _mm256_storeu_si256(dst.add((4 + i) * stride) as *mut __m256i, _mm512_extracti64x4_epi64::<1>(a));
            _mm256_storeu_si256(dst.add((8 + i) * stride) as *mut __m256i, _mm512_castsi512_si256(b));
            _mm256_storeu_si256(dst.add((12 + i) * stride) as *mut __m256i, _mm512_extracti64x4_epi64::<1>(b));
        }
    }
}

/// `v` rounded to the nearest integer, ties to even, for |v| < 2^22: adding and taking away
/// 1.5 × 2^23 rounds once in the default mode. (`round_ties_even` is a library call where the
/// baseline instruction set has no rounding instruction.)
#[inline(always)]
fn round(v: f32) -> f32 {
    (v + MAGIC) - MAGIC
}

/// 1.5 × 2^23 (see `round`).
const MAGIC: f32 = 12_582_912.0;

/// Writes a chunk's codes and returns its scale and the sums of its halves. A chunk of zeros
/// has scale 0 and codes 0; one holding a NaN or an infinity has scale NaN (and codes 0), so the
/// products it meets are NaN on every path, as an exact product would be.
#[inline(always)]
fn chunk(x: &[f32; 32], codes: &mut [i16; 32]) -> (f32, f64, f64) {
    let sums = (sum16(&x[..16]), sum16(&x[16..]));
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if !amax.is_finite() || x.iter().any(|v| v.is_nan()) {
        codes.fill(0);
        return (f32::NAN, sums.0, sums.1);
    }
    if amax == 0.0 {
        codes.fill(0);
        return (0.0, sums.0, sums.1);
    }
    let (pre, inv, scale) = factors(amax);
    for (q, v) in codes.iter_mut().zip(x) {
        let v = v * pre;
        // |v * inv| is at most QMAX and a rounding: the clamp only guards that rounding.
        *q = round(v * inv).clamp(-QMAX, QMAX) as i16;
    }
    (scale, sums.0, sums.1)
}

/// For a chunk's largest magnitude (finite, not 0): what its values are multiplied by first and
/// then to become codes, and its scale. A chunk so small that the reciprocal overflows is scaled
/// in two steps.
#[inline(always)]
fn factors(amax: f32) -> (f32, f32, f32) {
    let (pre, amax) = if amax < 1e-30 { (2f32.powi(64), amax * 2f32.powi(64)) } else { (1.0, amax) };
    (pre, QMAX / amax, amax / QMAX / pre)
}

/// The sum of 16 values in f64 in a fixed tree (each value and its eighth neighbour, then
/// halves): what `chunk_avx512` does in vectors.
#[inline(always)]
fn sum16(x: &[f32]) -> f64 {
    let l: [f64; 8] = std::array::from_fn(|i| x[i] as f64 + x[i + 8] as f64);
    let q: [f64; 4] = std::array::from_fn(|i| l[i] + l[i + 4]);
    (q[0] + q[2]) + (q[1] + q[3])
}

/// `chunk` in AVX-512 vectors: the same operations on the same values in the same order (a
/// maximum and a conversion of an integer-valued float are exact in any order), so the same
/// bits; the portable version leaves much of it scalar.
///
/// # Safety
/// The CPU has AVX-512F/BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn chunk_avx512(x: &[f32; 32], codes: &mut [i16; 32]) -> (f32, f64, f64) {
    use std::arch::x86_64::*;
    // SAFETY: loads and stores of the 32 values and codes.
    unsafe {
        let v = [_mm512_loadu_ps(x.as_ptr()), _mm512_loadu_ps(x.as_ptr().add(16))];
        let sums = (sum16_avx512(v[0]), sum16_avx512(v[1]));
        let mask = _mm512_set1_epi32(0x7fff_ffff);
        let mags = [_mm512_and_si512(_mm512_castps_si512(v[0]), mask), _mm512_and_si512(_mm512_castps_si512(v[1]), mask)];
        let inf = _mm512_set1_epi32(0x7f80_0000);
        if _mm512_cmpge_epi32_mask(mags[0], inf) | _mm512_cmpge_epi32_mask(mags[1], inf) != 0 {
            codes.fill(0);
            return (f32::NAN, sums.0, sums.1);
        }
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_castsi512_ps(mags[0]), _mm512_castsi512_ps(mags[1])));
        if amax == 0.0 {
            codes.fill(0);
            return (0.0, sums.0, sums.1);
        }
        let (pre, inv, scale) = factors(amax);
        for (h, v) in v.into_iter().enumerate() {
            let t = _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(pre)), _mm512_set1_ps(inv));
            let r = _mm512_sub_ps(_mm512_add_ps(t, _mm512_set1_ps(MAGIC)), _mm512_set1_ps(MAGIC));
            let r = _mm512_max_ps(_mm512_min_ps(r, _mm512_set1_ps(QMAX)), _mm512_set1_ps(-QMAX));
            _mm256_storeu_si256(codes.as_mut_ptr().add(16 * h) as *mut __m256i, _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(r)));
        }
        (scale, sums.0, sums.1)
    }
}

/// `sum16` of the 16 values of `v`, in the same tree.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn sum16_avx512(v: std::arch::x86_64::__m512) -> f64 {
    use std::arch::x86_64::*;
    let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let l = _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(v)), _mm512_cvtps_pd(high));
    let q = _mm256_add_pd(_mm512_castpd512_pd256(l), _mm512_extractf64x4_pd::<1>(l));
    let h = _mm_add_pd(_mm256_castpd256_pd128(q), _mm256_extractf128_pd::<1>(q));
    _mm_cvtsd_f64(h) + _mm_cvtsd_f64(_mm_unpackhi_pd(h, h))
}
