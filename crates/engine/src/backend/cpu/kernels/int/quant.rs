//! The activations of a fast product: each column quantized to 16-bit integers per 32 values,
//! once per product, by portable code every instruction set shares (so the integers, scales and
//! sums are the same bits on every path).

use crate::backend::cpu::kernels::Isa;
#[cfg(target_arch = "x86_64")]
use crate::backend::cpu::kernels::Level;
use crate::backend::cpu::pool::ThreadPool;
use std::sync::Mutex;

/// The largest code: a 32-value chunk's largest magnitude maps to it.
const QMAX: f32 = 32767.0;

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
        self.scales_t.resize(groups * GROUP * k / 32, 0.0);
        self.sums16_t.resize(groups * GROUP * k / 16, 0.0);
        self.sums32_t.resize(groups * GROUP * k / 32, 0.0);
        let (per16, per32) = (GROUP * k / 16, GROUP * k / 32);
        let mut parts: Vec<Mutex<Group>> = Vec::with_capacity(groups);
        let mut codes = self.codes.chunks_mut(GROUP * k);
        let (mut scales, mut sums16, mut sums32) =
            (self.scales.chunks_mut(per32), self.sums16.chunks_mut(per16), self.sums32.chunks_mut(per32));
        let mut pairs = self.pairs.chunks_mut(GROUP * k / 2);
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
                    _ => group_body(&mut g, k),
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
    scales_t: &'a mut [f32],
    sums16_t: &'a mut [f32],
    sums32_t: &'a mut [f32],
}

/// `group_body` compiled for AVX-512 (portable operations: the same bits as every other build).
///
/// # Safety
/// The CPU has AVX-512F/BW, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
unsafe fn group_avx512(g: &mut Group, k: usize) {
    group_body(g, k)
}

/// `group_body` compiled for AVX2.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_avx2(g: &mut Group, k: usize) {
    group_body(g, k)
}

#[inline(always)]
fn group_body(g: &mut Group, k: usize) {
    for (c, x) in g.xs.iter().enumerate() {
        for (j, chunk) in x[..k].chunks_exact(32).enumerate() {
            let at = c * k / 32 + j;
            let codes = &mut g.codes[at * 32..][..32];
            g.scales[at] = quantize_chunk(chunk.try_into().expect("32 values"), codes.try_into().expect("32 codes"));
            let half = |h: usize| chunk[16 * h..16 * h + 16].iter().map(|&v| v as f64).sum::<f64>();
            let (lo, hi) = (half(0), half(1));
            g.sums16[2 * at] = lo as f32;
            g.sums16[2 * at + 1] = hi as f32;
            g.sums32[at] = (lo + hi) as f32;
        }
    }
    for c in 0..g.xs.len() {
        let codes = &g.codes[c * k..][..k];
        for p in 0..k / 2 {
            g.pairs[p * GROUP + c] = codes[2 * p] as u16 as u32 | (codes[2 * p + 1] as u16 as u32) << 16;
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

/// `v` rounded to the nearest integer, ties to even, for |v| < 2^22: adding and taking away
/// 1.5 × 2^23 rounds once in the default mode. (`round_ties_even` is a library call where the
/// baseline instruction set has no rounding instruction.)
#[inline(always)]
fn round(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (v + MAGIC) - MAGIC
}

/// Writes a chunk's codes and returns its scale. A chunk of zeros has scale 0 and codes 0; one
/// holding a NaN or an infinity has scale NaN (and codes 0), so the products it meets are NaN on
/// every path, as an exact product would be.
#[inline(always)]
fn quantize_chunk(x: &[f32; 32], codes: &mut [i16; 32]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if !amax.is_finite() || x.iter().any(|v| v.is_nan()) {
        codes.fill(0);
        return f32::NAN;
    }
    if amax == 0.0 {
        codes.fill(0);
        return 0.0;
    }
    // A chunk so small that the reciprocal overflows is scaled in two steps.
    let (pre, amax) = if amax < 1e-30 { (2f32.powi(64), amax * 2f32.powi(64)) } else { (1.0, amax) };
    let inv = QMAX / amax;
    for (q, v) in codes.iter_mut().zip(x) {
        let v = v * pre;
        // |v * inv| is at most QMAX and a rounding: the clamp only guards that rounding.
        *q = round(v * inv).clamp(-QMAX, QMAX) as i16;
    }
    amax / QMAX / pre
}
