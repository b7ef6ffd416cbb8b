//! The activations of a fast product: each column quantized to 16-bit integers per 32 values,
//! once per product, by portable code every instruction set shares (so the integers, scales and
//! sums are the same bits on every path).

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
    /// reusing its buffers.
    pub(crate) fn quantize(&mut self, xs: &[&[f32]], k: usize) {
        assert!(k.is_multiple_of(32) && xs.iter().all(|x| x.len() >= k));
        let n = xs.len();
        self.k = k;
        self.n = n;
        self.codes.resize(n * k, 0);
        self.scales.resize(n * k / 32, 0.0);
        self.sums16.resize(n * k / 16, 0.0);
        self.sums32.resize(n * k / 32, 0.0);
        for (c, x) in xs.iter().enumerate() {
            for (j, chunk) in x[..k].chunks_exact(32).enumerate() {
                let at = c * k / 32 + j;
                let codes = &mut self.codes[at * 32..][..32];
                self.scales[at] = quantize_chunk(chunk.try_into().expect("32 values"), codes.try_into().expect("32 codes"));
                let half = |h: usize| chunk[16 * h..16 * h + 16].iter().map(|&v| v as f64).sum::<f64>();
                let (lo, hi) = (half(0), half(1));
                self.sums16[2 * at] = lo as f32;
                self.sums16[2 * at + 1] = hi as f32;
                self.sums32[at] = (lo + hi) as f32;
            }
        }
        let groups = n.div_ceil(GROUP);
        self.pairs.resize(groups * GROUP * k / 2, 0);
        self.scales_t.resize(groups * GROUP * k / 32, 0.0);
        self.sums16_t.resize(groups * GROUP * k / 16, 0.0);
        self.sums32_t.resize(groups * GROUP * k / 32, 0.0);
        for c in 0..n {
            let (base, i) = (c / GROUP * GROUP, c % GROUP);
            let codes = &self.codes[c * k..][..k];
            for p in 0..k / 2 {
                self.pairs[(base * k / 2) + p * GROUP + i] = codes[2 * p] as u16 as u32 | (codes[2 * p + 1] as u16 as u32) << 16;
            }
            for j in 0..k / 32 {
                self.scales_t[base * k / 32 + j * GROUP + i] = self.scales[c * k / 32 + j];
                self.sums32_t[base * k / 32 + j * GROUP + i] = self.sums32[c * k / 32 + j];
            }
            for j in 0..k / 16 {
                self.sums16_t[base * k / 16 + j * GROUP + i] = self.sums16[c * k / 16 + j];
            }
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
