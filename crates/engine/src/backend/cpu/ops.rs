//! The small per-row operations between matrix products. Each reduces in a fixed order, so a
//! row's result depends only on that row.

use crate::backend::cpu::kernels::Isa;
#[cfg(target_arch = "x86_64")]
use crate::backend::cpu::kernels::Level;
use crate::backend::cpu::kv::{f16_value, hadamard, Store};
use crate::config::{Activation, RopeStyle};
use std::ops::Range;

/// `out = x / rms(x) * w`, the mean of squares summed in f64 over eight fixed lanes.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let scale = inv_rms(x, eps);
    for ((o, v), g) in out.iter_mut().zip(x).zip(w) {
        *o = ((*v as f64 * scale) as f32) * g;
    }
}

/// `rms_norm` in place on each head of `x` (heads of `w.len()`), as gemma3 and qwen3 norm
/// queries and keys.
pub fn rms_norm_heads(x: &mut [f32], w: &[f32], eps: f32) {
    for head in x.chunks_exact_mut(w.len()) {
        let scale = inv_rms(head, eps);
        for (v, g) in head.iter_mut().zip(w) {
            *v = ((*v as f64 * scale) as f32) * g;
        }
    }
}

/// `1 / sqrt(mean(x²) + eps)`, the squares summed in f64 over eight fixed lanes.
fn inv_rms(x: &[f32], eps: f32) -> f64 {
    let mut lanes = [0f64; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            lanes[l] += c[l] as f64 * c[l] as f64;
        }
    }
    let mut ss = lanes.iter().sum::<f64>();
    for v in tail {
        ss += *v as f64 * *v as f64;
    }
    1.0 / (ss / x.len() as f64 + eps as f64).sqrt()
}

/// Cosines and sines of one position's rotation angles, one pair per rotated dimension pair;
/// `scale` multiplies the position (linear RoPE scaling; 1 leaves it as it is).
pub fn rope_angles(pos: usize, rope_dim: usize, base: f32, scale: f64, out: &mut Vec<(f64, f64)>) {
    out.clear();
    for i in 0..rope_dim / 2 {
        let theta = pos as f64 * scale * (base as f64).powf(-2.0 * i as f64 / rope_dim as f64);
        let (s, c) = theta.sin_cos();
        out.push((c, s));
    }
}

/// Rotates each head of `x` (heads of `head_dim`, first `2 * angles.len()` dims rotated).
pub fn rope(x: &mut [f32], head_dim: usize, angles: &[(f64, f64)], style: RopeStyle) {
    let half = angles.len();
    for head in x.chunks_exact_mut(head_dim) {
        for (i, (c, s)) in angles.iter().enumerate() {
            let (a, b) = match style {
                RopeStyle::Adjacent => (2 * i, 2 * i + 1),
                RopeStyle::Halves => (i, i + half),
            };
            let (x0, x1) = (head[a] as f64, head[b] as f64);
            head[a] = (x0 * c - x1 * s) as f32;
            head[b] = (x0 * s + x1 * c) as f32;
        }
    }
}

/// `g = act(g) * u`, in place, compiled for the widest vectors this CPU has: the same plain
/// operations in the same order on every instruction set, so every version gives the same bits.
pub fn activate(isa: Isa, act: Activation, g: &mut [f32], u: &[f32]) {
    match isa.level() {
        // SAFETY: an `Isa` at the AVX-512 level exists only where detection found AVX-512F/BW,
        // FMA and F16C on this CPU (its field is private); the kernels the body calls need the
        // bounds checked above.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { activate_avx512(act, g, u) },
        // SAFETY: likewise, detection found AVX2, FMA and F16C.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { activate_avx2(act, g, u) },
        _ => activate_body(act, g, u),
    }
}

/// `activate_body` compiled for AVX-512.
///
/// # Safety
/// The CPU has AVX-512F/BW, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
unsafe fn activate_avx512(act: Activation, g: &mut [f32], u: &[f32]) {
    activate_body(act, g, u)
}

/// `activate_body` compiled for AVX2.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn activate_avx2(act: Activation, g: &mut [f32], u: &[f32]) {
    activate_body(act, g, u)
}

#[inline(always)]
fn activate_body(act: Activation, g: &mut [f32], u: &[f32]) {
    match act {
        Activation::Silu => g.iter_mut().zip(u).for_each(|(a, b)| *a = flush(*a * sigmoid(*a) * b)),
        // GELU's tanh form (ggml's `gelu`): 0.5 x (1 + tanh(y)) = x sigmoid(2y).
        Activation::GeluTanh => g.iter_mut().zip(u).for_each(|(a, b)| {
            const SQRT_2_OVER_PI: f32 = 0.797_884_6;
            let x = *a;
            *a = flush(x * sigmoid(2.0 * SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x)) * b)
        }),
    }
}

/// Magnitudes below this are taken as zero where they leave for a matrix product (an FFN
/// activation, an attention weight). An activation of a large negative gate underflows, and a
/// multiply-add whose operand or product is subnormal takes a microcode assist on x86 (about a
/// hundred times one that is not): flushed here, every such product has a normal operand times a
/// weight that keeps it normal (any weight above 2^-62). No global floating-point mode is set
/// (Rust assumes the default one, so changing MXCSR would be undefined behaviour). A term this
/// small, times a weight below 1, is under half the f32 step of any sum above 2^-40: it moves
/// none of them.
const TINY: f32 = 1.0 / 18_446_744_073_709_551_616.0; // 2^-64

/// `x`, or zero when it is below [`TINY`] in magnitude: a select, so it vectorizes.
#[inline(always)]
fn flush(x: f32) -> f32 {
    if x.abs() < TINY {
        0.0
    } else {
        x
    }
}

/// 1 / (1 + e^-x), through `exp` of a value ≤ 0 only (so nothing overflows) and without
/// cancellation on either side: a few ulp, branch-free so it vectorizes.
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    let e = exp(-x.abs());
    let s = 1.0 / (1.0 + e);
    if x >= 0.0 {
        s
    } else {
        e * s
    }
}

/// Causal attention of the query heads in `q` that share one KV head, over the cached positions
/// in slots `ctx` of that head, whose slice starts at `offset` of each key and value row of `kv`.
/// `q` and `out` hold `q.len() / hd` heads of `hd` side by side. Scores are scaled by `scale`;
/// `scratch` holds the scores (and q8_0 key scales).
///
/// Compiled once per instruction set for the wider vectors. Every reduction runs element by
/// element in a fixed order (scores over the head's dimensions in turn, values over positions in
/// turn) with plain multiplies and adds, so every version gives the same bits, and a head's bits
/// do not depend on the heads beside it: up to `HEADS` heads go together only so that each key
/// and value read serves them all. A stored f16 or q8_0 value is read as the f32 it stands for
/// (exactly: an f16 widened, an int8 times its f16 scale), so such a cache attends bitwise as an
/// f32 cache holding those values would. On AVX-512 an f32 cache, the default, runs its two
/// sums in a kernel of its own (`sums_f32_avx512`) with the same operations in the same order.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    isa: Isa,
    q: &[f32],
    hd: usize,
    kv: &Store,
    ctx: Range<usize>,
    offset: usize,
    scale: f32,
    scratch: &mut Scratch,
    out: &mut [f32],
) {
    let fits = |width: usize, stride: usize, k: usize, v: usize, cols: Range<usize>| {
        cols.end <= width && ctx.end <= stride && k >= width * stride && v >= ctx.end * width
    };
    let (ok, stride) = match kv {
        Store::F32(p) => (fits(p.width, p.stride, p.k.len(), p.v.len(), offset..offset + hd), p.stride),
        Store::F16(p) => (fits(p.width, p.stride, p.k.len(), p.v.len(), offset..offset + hd), p.stride),
        Store::Q8_0 { q: p, scale: s, block } => {
            // A block is a head or whole runs of `BLOCK` of its columns (see `KvDtype::q8_block`).
            let ok = offset.is_multiple_of(*block)
                && (block.is_multiple_of(BLOCK) || *block == hd)
                && fits(p.width, p.stride, p.k.len(), p.v.len(), offset..offset + hd)
                && fits(s.width, s.stride, s.k.len(), s.v.len(), offset / block..(offset + hd).div_ceil(*block));
            (ok, p.stride)
        }
    };
    assert!(hd > 0 && q.len().is_multiple_of(hd) && q.len() == out.len() && ctx.start < ctx.end && ok);
    let at = Head { stride, start: ctx.start, offset, hd, n: ctx.len() };
    match isa.level() {
        // SAFETY: an `Isa` at the AVX-512 level exists only where detection found AVX-512F/BW,
        // FMA and F16C on this CPU (its field is private); the kernels the body calls need the
        // bounds checked above.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { attend_avx512(q, kv, at, scale, scratch, out) },
        // SAFETY: likewise, detection found AVX2, FMA and F16C.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { attend_avx2(q, kv, at, scale, scratch, out) },
        _ => attend_body::<false>(q, kv, at, scale, scratch, out),
    }
}

/// Per thread: attention's scores, and for q8_0 the f32 of a head's key scales and the rotated
/// queries, so no job allocates.
#[derive(Default)]
pub struct Scratch {
    scores: Vec<f32>,
    key_scales: Vec<f32>,
    query: Vec<f32>,
}

/// Where a job's KV head lies in its layer: elements per key row, the first visible slot and
/// how many are visible, the head's first column of each key and value row, and its size.
#[derive(Clone, Copy)]
struct Head {
    stride: usize,
    start: usize,
    offset: usize,
    hd: usize,
    n: usize,
}

/// The most query heads attended together: their sums of a `BLOCK` in registers (eight AVX-512
/// vectors, sixteen AVX2).
const HEADS: usize = 4;

/// `attend_body` compiled for AVX-512.
///
/// # Safety
/// The CPU has AVX-512F/BW, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
unsafe fn attend_avx512(q: &[f32], kv: &Store, at: Head, scale: f32, scratch: &mut Scratch, out: &mut [f32]) {
    attend_body::<true>(q, kv, at, scale, scratch, out)
}

/// `attend_body` compiled for AVX2.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_avx2(q: &[f32], kv: &Store, at: Head, scale: f32, scratch: &mut Scratch, out: &mut [f32]) {
    attend_body::<false>(q, kv, at, scale, scratch, out)
}

#[inline(always)]
fn attend_body<const WIDE: bool>(q: &[f32], kv: &Store, at: Head, scale: f32, scratch: &mut Scratch, out: &mut [f32]) {
    let Head { start, offset, hd, n, .. } = at;
    let Scratch { scores, key_scales, query } = scratch;
    // q8_0 keys are rotated (`kv::rotated`): the queries are rotated alike and scaled by 1/block
    // (exact, a power of two), so that q'·k' = q·H·H·k / block = q·k.
    let q = match kv {
        Store::Q8_0 { block, .. } if block.is_power_of_two() => {
            query.clear();
            query.extend_from_slice(q);
            query.chunks_exact_mut(*block).for_each(|b| {
                hadamard(b);
                b.iter_mut().for_each(|x| *x /= *block as f32);
            });
            &query[..]
        }
        _ => q,
    };
    if let Store::Q8_0 { scale: sc, block, .. } = kv {
        // The head's key scales as f32, a row per q8_0 block of the head over the visible slots,
        // padded to whole `BLOCK`s so that each run of them is an array.
        let padded = n.div_ceil(BLOCK) * BLOCK;
        key_scales.clear();
        for r in offset / block..(offset + hd).div_ceil(*block) {
            let from = r * sc.stride + start;
            key_scales.extend(sc.k[from..from + n].iter().map(|&h| f16_value(h)));
            key_scales.resize(key_scales.len() + padded - n, 0.0);
        }
    }
    let heads = q.len() / hd;
    scores.clear();
    scores.resize(HEADS.min(heads) * n, 0.0);
    let mut h0 = 0;
    while h0 < heads {
        let g = (heads - h0).min(HEADS);
        let (q, out, s) = (&q[h0 * hd..(h0 + g) * hd], &mut out[h0 * hd..(h0 + g) * hd], &mut scores[..g * n]);
        match g {
            1 => heads_body::<1, WIDE>(q, kv, at, scale, key_scales, s, out),
            2 => heads_body::<2, WIDE>(q, kv, at, scale, key_scales, s, out),
            3 => heads_body::<3, WIDE>(q, kv, at, scale, key_scales, s, out),
            _ => heads_body::<HEADS, WIDE>(q, kv, at, scale, key_scales, s, out),
        }
        h0 += g;
    }
    // The rotated values sum to the rotated output: rotated back, H·H = block·I.
    if let Store::Q8_0 { block, .. } = kv {
        if block.is_power_of_two() {
            out.chunks_exact_mut(*block).for_each(|b| {
                hadamard(b);
                b.iter_mut().for_each(|x| *x /= *block as f32);
            });
        }
    }
}

/// `G` query heads (`q`, `out`) over one KV head: each head's scores, then weights, in its `n`
/// of `s`.
#[inline(always)]
fn heads_body<const G: usize, const WIDE: bool>(
    q: &[f32],
    kv: &Store,
    at: Head,
    scale: f32,
    key_scales: &[f32],
    s: &mut [f32],
    out: &mut [f32],
) {
    let Head { stride, start, offset, hd, n } = at;
    // Term t's coefficient of each head: value t of each head's `len` in `x`.
    let c = |t: usize, x: &[f32], len: usize| -> [f32; G] { std::array::from_fn(|i| x[i * len + t]) };
    // Key row r's slot j (j from the first visible slot) is k[r * stride + start + j].
    let key = |d: usize, j0: usize, len: usize| (offset + d) * stride + start + j0..(offset + d) * stride + start + j0 + len;
    let padded = n.div_ceil(BLOCK) * BLOCK;
    match kv {
        #[cfg(target_arch = "x86_64")]
        Store::F32(p) if WIDE => {
            let keys = p.k.as_ptr();
            let row = |d: usize| keys.wrapping_add((offset + d) * stride + start);
            // SAFETY: `sums_f32_avx512` asks for i < G and d < hd; `q` holds G heads of hd.
            let coef = |i: usize, d: usize| unsafe { *q.get_unchecked(i * hd + d) };
            // SAFETY: `WIDE` is set only by `attend_avx512`, which runs where AVX-512F exists;
            // `attend` checked that the head's key rows hold its visible slots.
            unsafe { sums_f32_avx512::<G>(s, n, n, hd, row, coef) }
        }
        _ => {
            for j0 in (0..n).step_by(BLOCK) {
                let len = BLOCK.min(n - j0);
                match kv {
                    Store::F32(p) => sums(s, n, j0, len, hd, |d| (c(d, q, hd), &p.k[key(d, j0, len)], ()), |x, _, _| x),
                    Store::F16(p) => sums(s, n, j0, len, hd, |d| (c(d, q, hd), &p.k[key(d, j0, len)], ()), |x, _, _| f16_value(x)),
                    Store::Q8_0 { q: p, block, .. } => {
                        let lanes = |d: usize| -> &[f32; BLOCK] {
                            let from = d / block * padded + j0;
                            key_scales[from..from + BLOCK].try_into().unwrap_or(&[0.0; BLOCK])
                        };
                        let term = |d: usize| (c(d, q, hd), &p.k[key(d, j0, len)], lanes(d));
                        sums(s, n, j0, len, hd, term, |x: i8, l: &[f32; BLOCK], i| x as f32 * l[i])
                    }
                }
            }
        }
    }
    for s in s.chunks_exact_mut(n) {
        let mut max = f32::NEG_INFINITY;
        for x in s.iter_mut() {
            *x *= scale;
            max = max.max(*x);
        }
        for x in s.iter_mut() {
            *x = exp(*x - max);
        }
        let sum: f64 = s.iter().map(|&x| x as f64).sum();
        let inv = (1.0 / sum) as f32;
        for x in s.iter_mut() {
            *x = flush(*x * inv);
        }
    }
    let s = &*s;
    match kv {
        #[cfg(target_arch = "x86_64")]
        Store::F32(p) if WIDE => {
            let values = p.v.as_ptr();
            let row = |j: usize| values.wrapping_add((start + j) * p.width + offset);
            // SAFETY: likewise, i < G and j < n; `s` holds G rows of n.
            let coef = |i: usize, j: usize| unsafe { *s.get_unchecked(i * n + j) };
            // SAFETY: as above; `attend` checked that the values hold the visible positions' rows.
            unsafe { sums_f32_avx512::<G>(out, hd, hd, n, row, coef) }
        }
        _ => {
            for o0 in (0..hd).step_by(BLOCK) {
                let len = BLOCK.min(hd - o0);
                let value = |width: usize, j: usize| (start + j) * width + offset + o0..(start + j) * width + offset + o0 + len;
                match kv {
                    Store::F32(p) => sums(out, hd, o0, len, n, |j| (c(j, s, n), &p.v[value(p.width, j)], ()), |x, _, _| x),
                    Store::F16(p) => sums(out, hd, o0, len, n, |j| (c(j, s, n), &p.v[value(p.width, j)], ()), |x, _, _| f16_value(x)),
                    Store::Q8_0 { q: p, scale: sc, block } => {
                        // A run of at most `BLOCK` of a head's columns lies in one q8_0 block.
                        let b = (offset + o0) / block;
                        let term = |j: usize| (c(j, s, n), &p.v[value(p.width, j)], f16_value(sc.v[(start + j) * sc.width + b]));
                        sums(out, hd, o0, len, n, term, |x: i8, d: f32, _| x as f32 * d)
                    }
                }
            }
        }
    }
}

/// `sums` for an f32 cache on AVX-512: for each of `G` heads `i`, `dst[i * stride + l] = Σ
/// coef(i, t) * row(t)[l]` for `l < len`, over the terms `t < count` in order, `RUN` registers
/// of sixteen lanes a head at a time, the heads sharing each row's load, and a last short run
/// masked rather than summed in memory. The multiplies and adds are `sums`' in the same order,
/// so the bits are the same. A head's scores are such sums over its dimensions, its outputs over
/// the positions.
///
/// # Safety
/// The CPU has AVX-512F; each `row(t)` may be read for `len` values, `dst` written at those
/// places, and `coef` is called only with `i < G`, `t < count`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn sums_f32_avx512<const G: usize>(
    dst: &mut [f32],
    stride: usize,
    len: usize,
    count: usize,
    row: impl Fn(usize) -> *const f32,
    coef: impl Fn(usize, usize) -> f32,
) {
    use std::arch::x86_64::*;
    debug_assert!(dst.len() >= (G - 1) * stride + len);
    for l0 in (0..len).step_by(16 * RUN) {
        let m: [u16; RUN] = std::array::from_fn(|r| lanes((len - l0).saturating_sub(16 * r)));
        let mut acc = [[_mm512_setzero_ps(); RUN]; G];
        // SAFETY: the CPU has AVX-512F; every lane read or written lies where the caller
        // promises, and the masked lanes are neither read nor written.
        unsafe {
            for t in 0..count {
                let row = row(t).wrapping_add(l0);
                let x: [__m512; RUN] = std::array::from_fn(|r| _mm512_maskz_loadu_ps(m[r], row.wrapping_add(16 * r)));
                for (i, a) in acc.iter_mut().enumerate() {
                    let c = _mm512_set1_ps(coef(i, t));
                    for r in 0..RUN {
                        a[r] = _mm512_add_ps(a[r], _mm512_mul_ps(c, x[r]));
                    }
                }
            }
            for (i, a) in acc.into_iter().enumerate() {
                for r in 0..RUN {
                    _mm512_mask_storeu_ps(dst.as_mut_ptr().wrapping_add(i * stride + l0 + 16 * r), m[r], a[r]);
                }
            }
        }
    }
}

/// Registers of sixteen lanes each head sums at once in `sums_f32_avx512`: four lines of a key
/// or value row for each coefficient loaded. Over a 512-position prefill's attention
/// (4 heads of 256), measured on Zen 4: ~25 G multiply-adds a second with one, ~31 with four.
const RUN: usize = 4;

/// The first `min(left, 16)` of sixteen lanes.
#[cfg(target_arch = "x86_64")]
fn lanes(left: usize) -> u16 {
    if left >= 16 {
        u16::MAX
    } else {
        (1u16 << left) - 1
    }
}

/// Scores or outputs `attend_body` keeps in registers at a time for each head: four AVX2
/// vectors, two AVX-512.
const BLOCK: usize = 32;

/// For each of `G` heads `i`, `dst[i * stride + at + l] = Σ c[i] * value(row[l], extra, l)` for
/// `l < len` (at most `BLOCK`), over the terms `term(0..count)` = (c, row, extra) in order (a
/// multiply, then an add), each row `len` long. A whole `BLOCK` keeps the sums in registers
/// rather than loading and storing them again for each term, for every head at once: a chain of
/// adds per head in flight (one head's waits on each add), each its own array of sums (an array
/// indexed by head the compiler does not keep in registers), each row converted once for all.
#[inline(always)]
fn sums<'a, T: Copy + 'a, E: Copy, const G: usize>(
    dst: &mut [f32],
    stride: usize,
    at: usize,
    len: usize,
    count: usize,
    term: impl Fn(usize) -> ([f32; G], &'a [T], E),
    value: impl Fn(T, E, usize) -> f32,
) {
    const { assert!(G >= 1 && G <= HEADS, "the arms below name every head") };
    if len < BLOCK {
        for i in 0..G {
            let dst = &mut dst[i * stride + at..i * stride + at + len];
            dst.fill(0.0);
            for t in 0..count {
                let (c, row, e) = term(t);
                for (l, (a, x)) in dst.iter_mut().zip(row).enumerate() {
                    *a += c[i] * value(*x, e, l);
                }
            }
        }
        return;
    }
    macro_rules! heads {
        ($($a:ident $i:literal),+) => {{
            $(let mut $a = [0f32; BLOCK];)+
            for t in 0..count {
                let (c, row, e) = term(t);
                let Some(row) = row.first_chunk::<BLOCK>() else { unreachable!("a whole block's rows are BLOCK long") };
                for l in 0..BLOCK {
                    let x = value(row[l], e, l);
                    $($a[l] += c[$i] * x;)+
                }
            }
            $(dst[$i * stride + at..$i * stride + at + BLOCK].copy_from_slice(&$a);)+
        }};
    }
    match G {
        1 => heads!(a0 0),
        2 => heads!(a0 0, a1 1),
        3 => heads!(a0 0, a1 1, a2 2),
        _ => heads!(a0 0, a1 1, a2 2, a3 3),
    }
}

/// e^x for x ≤ 0 (softmax's shifted scores), within about 2 ulp: Cephes' range reduction and
/// polynomial in plain multiplies and adds, so it vectorizes and gives the same bits everywhere.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    let xc = x.max(-87.0);
    let n = (xc * LOG2E + 0.5).floor();
    let r = xc - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let z = r * r;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 1.666_666_5e-1) * r + 0.5;
    let y = p * z + r + 1.0;
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else {
        y * scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KvDtype;

    #[test]
    fn rms_norm_of_constant_row_is_the_weight() {
        let x = vec![3.0f32; 20];
        let w: Vec<f32> = (0..20).map(|i| i as f32).collect();
        let mut out = vec![0f32; 20];
        rms_norm(&x, &w, 0.0, &mut out);
        for (o, g) in out.iter().zip(&w) {
            assert!((o - g).abs() < 1e-6);
        }
    }

    #[test]
    fn rope_at_position_zero_is_identity_and_preserves_norm_elsewhere() {
        let mut angles = Vec::new();
        let x0: Vec<f32> = (0..16).map(|i| i as f32 - 7.5).collect();
        for style in [RopeStyle::Adjacent, RopeStyle::Halves] {
            rope_angles(0, 8, 10000.0, 1.0, &mut angles);
            let mut x = x0.clone();
            rope(&mut x, 8, &angles, style);
            assert_eq!(x, x0);
            rope_angles(37, 8, 10000.0, 1.0, &mut angles);
            rope(&mut x, 8, &angles, style);
            let n0: f32 = x0.iter().map(|v| v * v).sum();
            let n1: f32 = x.iter().map(|v| v * v).sum();
            assert!((n0 - n1).abs() < 1e-3);
        }
    }

    #[test]
    fn attention_over_one_position_returns_its_value() {
        // One position, kv_dim 4 (two heads of 2); keys transposed with capacity 1.
        let q = [1.0f32, 2.0];
        let kv =
            Store::F32(crate::backend::cpu::kv::Plane { k: vec![0.5, 0.5, 9.0, 9.0], v: vec![7.0, -1.0, 3.0, 4.0], width: 4, stride: 1 });
        let mut out = [0f32; 2];
        attend(Isa::SCALAR, &q, 2, &kv, 0..1, 2, 0.5, &mut Scratch::default(), &mut out);
        assert_eq!(out, [3.0, 4.0]);
    }

    #[test]
    fn attention_matches_a_float64_softmax_on_every_isa_over_any_window_in_every_kv_dtype() {
        // Head sizes below and past a whole block of outputs (q8_0 blocks of the whole head, and
        // of 32), over more positions than a block, for query groups of one head up to past
        // `HEADS` (7, as Qwen2-7B's).
        for (hd, n, cap) in [(8usize, 37usize, 40usize), (40, 70, 72), (64, 70, 72)] {
            for &dtype in KvDtype::ALL {
                for heads in [1, 3, 7] {
                    attention_case(dtype, hd, n, cap, heads);
                }
            }
        }
    }

    /// `heads` query heads over the second of three KV heads, over `n` positions of a cache of
    /// `cap` slots: each head as a float64 softmax would give it, and bitwise as it alone would.
    fn attention_case(dtype: KvDtype, hd: usize, n: usize, cap: usize, heads: usize) {
        let (off, width) = (hd, 3 * hd);
        let f = |i: usize| ((i * 7919 % 101) as f32 / 50.0) - 1.0;
        let q: Vec<f32> = (0..heads * hd).map(|i| f(i + 3)).collect();
        let keys: Vec<f32> = (0..width * n).map(f).collect();
        let values: Vec<f32> = (0..width * n).map(|i| f(i + 11)).collect();
        let mut kv = Store::new(dtype, width, cap, KvDtype::q8_block(hd));
        kv.append(0, &keys, &values);
        // The values the cache stands for, which it must attend over as an f32 cache would.
        let exactly = kv.dequantized();
        let Store::F32(stood) = &exactly else { unreachable!() };
        let (kt, v) = (&stood.k, &stood.v);
        let scale = 1.0 / (hd as f32).sqrt();
        let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for lo in [0, 5, n - 1] {
            let (mut want, mut first) = (vec![0f32; heads * hd], None::<Vec<f32>>);
            attend(Isa::SCALAR, &q, hd, &exactly, lo..n, off, scale, &mut Scratch::default(), &mut want);
            for isa in Isa::available() {
                let mut out = vec![0f32; heads * hd];
                attend(isa, &q, hd, &kv, lo..n, off, scale, &mut Scratch::default(), &mut out);
                for h in 0..heads {
                    let (q, out) = (&q[h * hd..(h + 1) * hd], &out[h * hd..(h + 1) * hd]);
                    let scores: Vec<f64> = (lo..n)
                        .map(|p| (0..hd).map(|d| q[d] as f64 * kt[(off + d) * stood.stride + p] as f64).sum::<f64>() * scale as f64)
                        .collect();
                    let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let total: f64 = w.iter().sum();
                    let exact: Vec<f64> =
                        (0..hd).map(|d| (lo..n).map(|p| w[p - lo] / total * v[p * width + off + d] as f64).sum()).collect();
                    for (o, e) in out.iter().zip(&exact) {
                        assert!((*o as f64 - e).abs() < 1e-5, "{dtype} hd {hd} {isa:?} head {h} from {lo}: {o} vs {e}");
                    }
                    let mut alone = vec![0f32; hd];
                    attend(isa, q, hd, &kv, lo..n, off, scale, &mut Scratch::default(), &mut alone);
                    assert_eq!(bits(&alone), bits(out), "{dtype} hd {hd} {isa:?} head {h} of {heads} from {lo}");
                }
                // f16 attends bitwise as f32 over the values it stands for; q8_0 through its
                // rotation, the same bits on every instruction set.
                if dtype != KvDtype::Q8_0 {
                    assert_eq!(bits(&want), bits(&out), "{dtype} hd {hd} {isa:?} from {lo}");
                }
                match &first {
                    None => first = Some(out),
                    Some(f) => assert_eq!(bits(f), bits(&out), "{dtype} hd {hd} {isa:?} from {lo}"),
                }
            }
        }
    }

    #[test]
    fn head_norms_are_per_head_rms_norms() {
        let x: Vec<f32> = (0..24).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let w: Vec<f32> = (0..8).map(|i| 0.5 + i as f32 * 0.1).collect();
        let mut heads = x.clone();
        rms_norm_heads(&mut heads, &w, 1e-6);
        for (h, xh) in heads.chunks(8).zip(x.chunks(8)) {
            let mut want = vec![0f32; 8];
            rms_norm(xh, &w, 1e-6, &mut want);
            assert_eq!(h, &want[..]);
        }
    }

    #[test]
    fn activations_are_near_exact_and_the_same_bits_on_every_isa() {
        // Every gate value from -100 to 100 in small steps, and the extremes.
        let xs: Vec<f32> = (-200_000..=200_000).map(|i| i as f32 * 5e-4).chain([-1e30, -87.5, 87.5, 1e30]).collect();
        let u: Vec<f32> = (0..xs.len()).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        for act in [Activation::Silu, Activation::GeluTanh] {
            let mut want = xs.clone();
            activate(Isa::SCALAR, act, &mut want, &u);
            for ((x, b), got) in xs.iter().zip(&u).zip(&want) {
                let (x, b) = (*x as f64, *b as f64);
                let exact = match act {
                    Activation::Silu => x / (1.0 + (-x).exp()) * b,
                    // 0.5 x (1 + tanh y), written as x / (1 + e^-2y): in f64, tanh y rounds to
                    // -1 long before the product underflows.
                    Activation::GeluTanh => x / (1.0 + (-2.0 * (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).exp()) * b,
                };
                assert!((*got as f64 - exact).abs() <= 1e-5 * exact.abs() + 1e-12, "{act:?}({x}) * {b} = {got}, want {exact}");
            }
            for isa in Isa::available() {
                let mut got = xs.clone();
                activate(isa, act, &mut got, &u);
                assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{act:?} on {isa:?}");
            }
        }
    }

    #[test]
    fn underflowing_activations_leave_as_zero_never_subnormal() {
        let xs: Vec<f32> = (0..=40_000).map(|i| -(i as f32) * 5e-3).collect();
        let u = vec![1e-3; xs.len()];
        for act in [Activation::Silu, Activation::GeluTanh] {
            let mut g = xs.clone();
            activate(Isa::SCALAR, act, &mut g, &u);
            assert!(g.iter().all(|y| *y == 0.0 || y.abs() >= TINY), "{act:?}");
            assert!(g.contains(&0.0) && g.iter().any(|y| y.abs() < 1e-10 && *y != 0.0), "{act:?}: the range crosses TINY");
        }
    }

    #[test]
    fn linear_rope_scaling_divides_positions() {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        rope_angles(40, 16, 1e6, 0.125, &mut a);
        rope_angles(5, 16, 1e6, 1.0, &mut b);
        assert_eq!(a, b);
    }

    #[test]
    fn exp_is_within_two_ulp_of_f64_for_softmax_inputs() {
        let mut x = 0.0f32;
        while x > -100.0 {
            let e = (x as f64).exp();
            let got = exp(x) as f64;
            if e > 1e-37 {
                assert!((got - e).abs() <= 2.5e-7 * e, "exp({x}) = {got}, want {e}");
            } else {
                assert!(got < 1e-36);
            }
            x -= 0.0137;
        }
    }
}
