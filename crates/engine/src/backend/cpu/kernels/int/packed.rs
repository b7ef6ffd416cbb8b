//! Weights repacked at load for the AVX-512 integer kernels, as llama.cpp repacks its CPU
//! weights. A matrix's rows are taken 16 at a time (a tile, one row per 32-bit lane) and each
//! block of the 16 rows is stored as one record: the rows' factors side by side (f16 as in the
//! file, Q4_K's 6-bit scales and mins as bytes), then the codes laid out so that one widening
//! load gives `vpdpwssd` a pair of neighbouring codes of each row, or, for the unsigned nibbles
//! of Q4_1 and Q4_K (and Q6_K's six bits, a nibble and two bits apart, taken as unsigned), so
//! that one masking gives `vpdpbusd` four codes of each row as bytes. A product then needs
//! neither the tiles' panel nor the one-column kernel's staging and 16-way reduction: per 32
//! codes of 16 rows, 8 (nibbles) or 16 (bytes) loads and one `vpdpwssd` per pair and column, or
//! 4 loads (Q6_K: 6) and two `vpdpbusd` per four codes and column (an activation code is
//! `256 * hi + lo`, two signed bytes: twice the dots a byte activation would take, but a
//! quarter of the unpacking, which is what a one-column product waits on).
//!
//! The records are the file's size (Q4_K's 2.8% more), on huge pages where the kernel gives them
//! (`cpu::pages`), and fast numerics never reads a packed matrix's whole tiles from the file
//! again, so `Matrix::pack` releases their mapped pages: resident memory stays about the file's.
//! The integer sums are the same integers and the float steps the canonical ones (see `super`), so
//! the results are the scalar path's bits.

use super::codes::{codes, elems, offset};
use super::quant::GROUP;
use super::{Activations, FastType, Flavor, Rows};
use crate::backend::cpu::kernels::{layout as at, Isa};
use crate::backend::cpu::pages::Pages;
use std::ops::Range;

/// Rows a tile holds: one per lane.
pub(crate) const TILE: usize = 16;

/// A matrix's whole tiles of 16 rows, repacked; its last `rows % 16` rows are not here.
pub(crate) struct Packed {
    /// The kernels' flavor: AVX-512, with or without VNNI.
    flavor: Flavor,
    ty: FastType,
    n_blocks: usize,
    tiles: usize,
    records: Pages,
}

/// Whether `ty` has a packed form: the types whose codes are nibbles (with a fifth bit) or
/// bytes, which SmolLM2's, gemma-3's and the 7B Q4_K_M's matrices are made of.
pub(super) fn packable(ty: FastType) -> bool {
    matches!(ty, FastType::Q4_0 | FastType::Q4_1 | FastType::Q5_0 | FastType::Q4_K | FastType::Q8_0 | FastType::Q6_K)
}

/// Whether the codes are unsigned nibbles laid out four to a row's 32-bit lane, for `vpdpbusd`
/// (Q6_K's with its two high bits apart, its codes stored plus 32).
const fn quads(ty: FastType) -> bool {
    matches!(ty, FastType::Q4_1 | FastType::Q4_K | FastType::Q6_K)
}

/// Whether the codes are stored a byte each (Q8_0's), else as nibbles.
const fn bytes(ty: FastType) -> bool {
    matches!(ty, FastType::Q8_0)
}

/// What the kernel takes off a stored code: Q4_0's and Q5_0's codes are stored unsigned.
const fn bias(ty: FastType) -> i16 {
    match ty {
        FastType::Q4_0 => 8,
        FastType::Q5_0 => 16,
        _ => 0,
    }
}

/// Bytes of a record's factors: f16 `d` per row, then Q4_1's f16 mins; Q4_K's f16 `dmin` and
/// its 8 scales and 8 mins per row as bytes; Q6_K's 16 signed scales per row (scale `j` of row
/// `r` at `16j + r`).
const fn head_bytes(ty: FastType) -> usize {
    match ty {
        FastType::Q4_1 => 64,
        FastType::Q4_K => 64 + 256,
        FastType::Q6_K => 32 + 256,
        _ => 32,
    }
}

/// Bytes of 32 codes of 16 rows: bytes, or nibbles (and Q5_0's fifth bits, Q6_K's two high bits).
const fn chunk_bytes(ty: FastType) -> usize {
    match ty {
        FastType::Q8_0 => 512,
        FastType::Q5_0 => 256 + 64,
        FastType::Q6_K => 256 + 128,
        _ => 256,
    }
}

const fn record_bytes(ty: FastType) -> usize {
    head_bytes(ty) + elems(ty) / 32 * chunk_bytes(ty)
}

impl std::fmt::Debug for Packed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Packed({:?}, {} tiles of {} blocks)", self.ty, self.tiles, self.n_blocks)
    }
}

impl Packed {
    /// The whole tiles of `w` (rows of `k` elements) packed on `threads` threads, where the
    /// kernels that read them run on `isa` and `w`'s type has a packed form; else None.
    pub(crate) fn new(isa: Isa, w: &Rows, k: usize, threads: usize) -> Option<Packed> {
        Packed::for_flavor(Flavor::of(isa), w, k, threads)
    }

    /// As `new`, for the kernels of `flavor`.
    pub(super) fn for_flavor(flavor: Flavor, w: &Rows, k: usize, threads: usize) -> Option<Packed> {
        let ty = w.ty;
        if !matches!(flavor, Flavor::Avx512 | Flavor::Vnni) || !packable(ty) || !k.is_multiple_of(elems(ty)) {
            return None;
        }
        let (tiles, n_blocks) = (w.n_rows / TILE, k / elems(ty));
        if tiles == 0 || w.bytes.len() < tiles * TILE * w.row_bytes {
            return None;
        }
        let rec = record_bytes(ty);
        let tile_bytes = n_blocks * rec;
        let mut records = Pages::zeroed(tiles * tile_bytes);
        let out = records.bytes_mut();
        let bb = ty.block_bytes();
        // Load time: the threads take a share of the tiles each.
        let per_thread = tiles.div_ceil(threads.max(1));
        std::thread::scope(|s| {
            for (part, dst) in out.chunks_mut(per_thread * tile_bytes).enumerate() {
                s.spawn(move || {
                    let mut q = [0i16; 256];
                    for (i, tile) in dst.chunks_exact_mut(tile_bytes).enumerate() {
                        let t = part * per_thread + i;
                        for (b, dst) in tile.chunks_exact_mut(rec).enumerate() {
                            for r in 0..TILE {
                                let src = &w.bytes[(t * TILE + r) * w.row_bytes + b * bb..][..bb];
                                pack_row(ty, src, r, dst, &mut q);
                            }
                        }
                    }
                });
            }
        });
        Some(Packed { flavor, ty, n_blocks, tiles, records })
    }

    /// Whole tiles packed: rows `0..16 * tiles`.
    pub(crate) fn tiles(&self) -> usize {
        self.tiles
    }

    #[cfg(target_arch = "x86_64")]
    fn record(&self, tile: usize) -> *const u8 {
        self.records.bytes()[tile * self.n_blocks * record_bytes(self.ty)..].as_ptr()
    }
}

/// Row `r`'s block `src` into its place in the tile's record `dst`.
fn pack_row(ty: FastType, src: &[u8], r: usize, dst: &mut [u8], q: &mut [i16; 256]) {
    let d_at = if ty == FastType::Q6_K { at::Q6K_D } else { 0 };
    dst[2 * r..2 * r + 2].copy_from_slice(&src[d_at..d_at + 2]);
    match ty {
        FastType::Q4_1 => dst[32 + 2 * r..34 + 2 * r].copy_from_slice(&src[2..4]),
        FastType::Q4_K => {
            dst[32 + 2 * r..34 + 2 * r].copy_from_slice(&src[2..4]);
            let s = at::q45k_scales(std::array::from_fn(|i| src[at::Q45K_SCALES + i]));
            for j in 0..16 {
                dst[64 + 16 * j + r] = s[j];
            }
        }
        FastType::Q6_K => {
            for j in 0..16 {
                dst[32 + 16 * j + r] = src[at::Q6K_SCALES + j];
            }
        }
        _ => {}
    }
    codes(ty, src, q);
    let (head, cb) = (head_bytes(ty), chunk_bytes(ty));
    for j in 0..elems(ty) / 32 {
        let chunk = &mut dst[head + j * cb..][..cb];
        let q = &q[32 * j..32 * j + 32];
        if quads(ty) {
            // Byte `64i + 4r + b`: code `4i + b` in the low nibble, `16 + 4i + b` in the high.
            // Q6_K's codes plus 32 (six bits), their two high bits after: byte `256 + 64p + 4r
            // + b` holds at bits `2f..2f + 2` those of the code whose nibble is in half `f % 2`
            // of byte `64(2p + f / 2) + 4r + b`.
            let u = |e: usize| (q[e] + if ty == FastType::Q6_K { 32 } else { 0 }) as u8;
            for i in 0..4 {
                for b in 0..4 {
                    chunk[64 * i + 4 * r + b] = u(4 * i + b) & 0xF | (u(16 + 4 * i + b) & 0xF) << 4;
                    if ty == FastType::Q6_K {
                        for half in 0..2 {
                            let f = 2 * (i % 2) + half;
                            chunk[256 + 64 * (i / 2) + 4 * r + b] |= (u(16 * half + 4 * i + b) >> 4) << (2 * f);
                        }
                    }
                }
            }
        } else if bytes(ty) {
            // Pair `p`: bytes `32p + 2r` and `32p + 2r + 1`, codes `2p` and `2p + 1`.
            for p in 0..16 {
                chunk[32 * p + 2 * r] = q[2 * p] as i8 as u8;
                chunk[32 * p + 2 * r + 1] = q[2 * p + 1] as i8 as u8;
            }
        } else {
            // Byte `32i + 2r + h`: code `2i + h` in the low nibble (pair `i`), code
            // `16 + 2i + h` in the high (pair `8 + i`); Q5_0's fifth bits of the same codes
            // at bit `2r + h` of word `2i` (low) and `2i + 1` (high) after the nibbles.
            let v = |e: usize| (q[e] + bias(ty)) as u8;
            for i in 0..8 {
                for h in 0..2 {
                    let (lo, hi) = (v(2 * i + h), v(16 + 2 * i + h));
                    chunk[32 * i + 2 * r + h] = lo & 0xF | (hi & 0xF) << 4;
                    for (word, code) in [(2 * i, lo), (2 * i + 1, hi)] {
                        if code & 0x10 != 0 {
                            let bit = 2 * r + h;
                            chunk[256 + 4 * word + bit / 8] |= 1 << (bit % 8);
                        }
                    }
                }
            }
        }
    }
}

/// Tiles `tiles` of `p` times every column of `acts`: `out[c * stride + r]` for row `r` counted
/// from the first tile's first row.
///
/// # Safety
/// `acts` has `p`'s `k`; `out` is valid for those writes, which nothing else accesses
/// meanwhile. (The CPU runs `p`'s flavor: `Packed::new` found it.)
pub(crate) unsafe fn gemv(p: &Packed, tiles: Range<usize>, acts: &Activations, out: *mut f32, stride: usize) {
    assert!(tiles.end <= p.tiles && acts.k == p.n_blocks * elems(p.ty));
    #[cfg(target_arch = "x86_64")]
    {
        let vnni = p.flavor == Flavor::Vnni;
        // SAFETY: as the caller vouches; `packed_vnni` only where the CPU has VNNI.
        unsafe {
            by_type!(p.ty, T => if vnni { packed_vnni::<T>(p, tiles, acts, out, stride) } else { packed_avx512::<T>(p, tiles, acts, out, stride) })
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("only AVX-512 packs ({out:?}, {stride})")
}

/// Where each of up to `GROUP` columns' activation pairs, scales and 32-value sums are, and the
/// step from one pair (or chunk) to the next: a lone column's own arrays, or the tiles' layout of
/// a group of columns side by side.
#[cfg(target_arch = "x86_64")]
struct Cols {
    pair: [*const u32; GROUP],
    /// The group's byte quads (`Activations::quads`), its `width` columns side by side.
    quads: *const u32,
    /// The group's integer sums of 16 codes (`Activations::isums16`).
    isums: *const i32,
    width: usize,
    scale: [*const f32; GROUP],
    sum: [*const f32; GROUP],
    step: usize,
}

#[cfg(target_arch = "x86_64")]
impl Cols {
    /// The one column of `acts` (in every slot; only the first is read).
    fn lone(acts: &Activations) -> Cols {
        Cols {
            pair: [acts.codes.as_ptr() as *const u32; GROUP],
            quads: acts.quads.as_ptr(),
            isums: acts.isums16.as_ptr(),
            width: 1,
            scale: [acts.scales.as_ptr(); GROUP],
            sum: [acts.sums32.as_ptr(); GROUP],
            step: 1,
        }
    }

    /// Columns `c0..c0 + GROUP` (`c0` a multiple of `GROUP`) in the tiles' layout.
    fn group(acts: &Activations, c0: usize) -> Cols {
        let (half, chunks) = (acts.k / 2, acts.k / 32);
        Cols {
            pair: std::array::from_fn(|c| acts.pairs[c0 * half + c..].as_ptr()),
            quads: acts.quads[c0 * half..].as_ptr(),
            isums: acts.isums16[c0 * acts.k / 16..].as_ptr(),
            width: (acts.n - c0).min(GROUP),
            scale: std::array::from_fn(|c| acts.scales_t[c0 * chunks + c..].as_ptr()),
            sum: std::array::from_fn(|c| acts.sums32_t[c0 * chunks + c..].as_ptr()),
            step: GROUP,
        }
    }
}

macro_rules! packed {
    ($name:ident, $features:literal, $vnni:literal) => {
        /// # Safety
        /// As for `gemv`, and the CPU has the features.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name<const T: u8>(p: &Packed, tiles: Range<usize>, acts: &Activations, out: *mut f32, stride: usize) {
            if acts.n == 1 {
                let cols = Cols::lone(acts);
                for t in tiles.clone() {
                    // SAFETY: as the caller vouches, for tile `t`'s rows of the one column.
                    unsafe { tile::<T, $vnni, 1>(p, t, &cols, out.add((t - tiles.start) * TILE), stride, true) };
                }
                return;
            }
            // Each group's pointers once, not once a tile.
            let groups: Vec<Cols> = (0..acts.n).step_by(GROUP).map(|c0| Cols::group(acts, c0)).collect();
            for t in tiles.clone() {
                for (cols, c0) in groups.iter().zip((0..acts.n).step_by(GROUP)) {
                    // SAFETY: as the caller vouches, for tile `t`'s rows of columns `c0..`.
                    unsafe {
                        let out = out.add(c0 * stride + (t - tiles.start) * TILE);
                        match (acts.n - c0).min(GROUP) {
                            8 => tile::<T, $vnni, 8>(p, t, cols, out, stride, c0 == 0),
                            7 => tile::<T, $vnni, 7>(p, t, cols, out, stride, c0 == 0),
                            6 => tile::<T, $vnni, 6>(p, t, cols, out, stride, c0 == 0),
                            5 => tile::<T, $vnni, 5>(p, t, cols, out, stride, c0 == 0),
                            4 => tile::<T, $vnni, 4>(p, t, cols, out, stride, c0 == 0),
                            3 => tile::<T, $vnni, 3>(p, t, cols, out, stride, c0 == 0),
                            2 => tile::<T, $vnni, 2>(p, t, cols, out, stride, c0 == 0),
                            _ => tile::<T, $vnni, 1>(p, t, cols, out, stride, c0 == 0),
                        }
                    }
                }
            }
        }
    };
}

packed!(packed_avx512, "avx512f,avx512bw,avx512vl,fma,f16c", false);
packed!(packed_vnni, "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c", true);

/// Tile `t` of `p` (type number `T`) times `C` columns; with `fetch` (the first group of columns
/// to read the tile, which then stays in L2 for the others), each block asks for the records
/// ahead, as the other kernels do: without it a decode step read the weights at ~70% of the
/// machine's streaming bandwidth on Zen 5.
///
/// # Safety
/// As for `gemv`, with `cols` holding `C` columns of `acts` and `out` their outputs for the
/// tile's 16 rows.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tile<const T: u8, const VNNI: bool, const C: usize>(
    p: &Packed,
    t: usize,
    cols: &Cols,
    out: *mut f32,
    stride: usize,
    fetch: bool,
) {
    use std::arch::x86_64::*;
    let ty = FastType::ALL[T as usize];
    let (rec, head, cb, per_block) = (record_bytes(ty), head_bytes(ty), chunk_bytes(ty), elems(ty) / 32);
    let off = offset(ty);
    let base = p.record(t);
    // SAFETY: every load is inside tile `t`'s records (`n_blocks` of `rec` bytes) or the
    // columns' arrays (pair `16 * chunk + i`, chunk `chunk` of `k / 32`, each `step` apart;
    // quad `q < k / 4` of column `c < width` at `2q * width + c` and `(2q + 1) * width + c`;
    // integer sum `j < k / 16` at `j * width + c`); the CPU has the features, as the caller
    // vouches.
    unsafe {
        let (low, sub, fifth) = (_mm512_set1_epi16(0x0F), _mm512_set1_epi16(bias(ty)), _mm512_set1_epi16(0x10));
        let mut acc = [_mm512_setzero_ps(); C];
        for b in 0..p.n_blocks {
            let r = base.add(b * rec);
            if fetch {
                super::super::prefetch(r, rec);
            }
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(r as *const __m256i));
            let second = _mm512_cvtph_ps(_mm256_loadu_si256(r.add(32) as *const __m256i));
            for j in 0..per_block {
                let chunk = b * per_block + j;
                let (m, o) = match ty {
                    FastType::Q4_K => {
                        let neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(second), _mm512_set1_epi32(i32::MIN)));
                        (_mm512_mul_ps(widen(r.add(64 + 16 * j), false), d), _mm512_mul_ps(widen(r.add(64 + 128 + 16 * j), false), neg))
                    }
                    FastType::Q6_K => (_mm512_mul_ps(widen(r.add(32 + 32 * j), true), d), d),
                    _ => (d, second),
                };
                let q = r.add(head + j * cb);
                // Two chains of dots a column, joined at each group's end (see `broadcast_dots`).
                let (mut s0, mut s1) = ([_mm512_setzero_si512(); C], [_mm512_setzero_si512(); C]);
                if ty == FastType::Q6_K {
                    // A group a nibble half: codes `4i..` (low nibbles, the first 16), then
                    // `16 + 4i..`, each with its two high bits (see `pack_row`) at bits 4 and 5.
                    let (low, top) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x30));
                    for half in 0..2 {
                        // The codes were stored plus 32: the `lo` sums start at 32 times the
                        // activations' sum taken off.
                        let mut sh = [_mm512_setzero_si512(); C];
                        let mut sl: [__m512i; C] =
                            std::array::from_fn(|c| _mm512_set1_epi32(-32 * *cols.isums.add((2 * chunk + half) * cols.width + c)));
                        for i in 0..4 {
                            let w = _mm512_loadu_si512(q.add(64 * i) as *const __m512i);
                            let bits = _mm512_loadu_si512(q.add(256 + 64 * (i / 2)) as *const __m512i);
                            let (nibble, bits) = match (half, i % 2) {
                                (0, 0) => (w, _mm512_slli_epi16::<4>(bits)),
                                (0, _) => (w, bits),
                                (_, 0) => (_mm512_srli_epi16::<4>(w), _mm512_slli_epi16::<2>(bits)),
                                _ => (_mm512_srli_epi16::<4>(w), _mm512_srli_epi16::<2>(bits)),
                            };
                            // (bits & 0x30) | (nibble & 0x0F)
                            let u = _mm512_ternarylogic_epi32::<0xEA>(bits, top, _mm512_and_si512(nibble, low));
                            let quad = cols.quads.add((8 * chunk + 4 * half + i) * 2 * cols.width);
                            quad_dots::<VNNI, C>(&mut sh, &mut sl, u, quad, cols.width);
                        }
                        let m = if half == 0 { m } else { _mm512_mul_ps(widen(r.add(32 + 32 * j + 16), true), d) };
                        for c in 0..C {
                            sh[c] = _mm512_slli_epi32::<8>(sh[c]);
                        }
                        steps::<C>(&mut acc, &joined(&sh, &sl), m, o, cols, chunk, off);
                    }
                } else if quads(ty) {
                    let low = _mm512_set1_epi8(0x0F);
                    for i in 0..4 {
                        let w = _mm512_loadu_si512(q.add(64 * i) as *const __m512i);
                        let (lo, hi) = (_mm512_and_si512(w, low), _mm512_and_si512(_mm512_srli_epi16::<4>(w), low));
                        // Codes `4i..` (low nibbles), then `16 + 4i..` (high).
                        let quad = |q: usize| cols.quads.add(q * 2 * cols.width);
                        quad_dots::<VNNI, C>(&mut s0, &mut s1, lo, quad(8 * chunk + i), cols.width);
                        quad_dots::<VNNI, C>(&mut s0, &mut s1, hi, quad(8 * chunk + 4 + i), cols.width);
                    }
                    // `s0` holds the sums of the `hi` bytes, which weigh 256, `s1` of the `lo`.
                    for c in 0..C {
                        s0[c] = _mm512_slli_epi32::<8>(s0[c]);
                    }
                    steps::<C>(&mut acc, &joined(&s0, &s1), m, o, cols, chunk, off);
                } else if bytes(ty) {
                    for i in (0..16).step_by(2) {
                        let w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(q.add(32 * i) as *const __m256i));
                        let w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(q.add(32 * i + 32) as *const __m256i));
                        dots::<VNNI, C>(&mut s0, w0, cols, 16 * chunk + i);
                        dots::<VNNI, C>(&mut s1, w1, cols, 16 * chunk + i + 1);
                    }
                    steps::<C>(&mut acc, &joined(&s0, &s1), m, o, cols, chunk, off);
                } else {
                    for i in 0..8 {
                        let w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(q.add(32 * i) as *const __m256i));
                        let (mut lo, mut hi) = (_mm512_and_si512(w, low), _mm512_srli_epi16::<4>(w));
                        if ty == FastType::Q5_0 {
                            // The fifth bit: 16 added where it is set (the nibble is below 16).
                            let bits = q.add(256 + 8 * i) as *const u32;
                            lo = _mm512_mask_add_epi16(lo, bits.read_unaligned(), lo, fifth);
                            hi = _mm512_mask_add_epi16(hi, bits.add(1).read_unaligned(), hi, fifth);
                        }
                        if bias(ty) != 0 {
                            lo = _mm512_sub_epi16(lo, sub);
                            hi = _mm512_sub_epi16(hi, sub);
                        }
                        dots::<VNNI, C>(&mut s0, lo, cols, 16 * chunk + i);
                        dots::<VNNI, C>(&mut s1, hi, cols, 16 * chunk + 8 + i);
                    }
                    steps::<C>(&mut acc, &joined(&s0, &s1), m, o, cols, chunk, off);
                }
            }
        }
        for c in 0..C {
            _mm512_storeu_ps(out.add(c * stride), acc[c]);
        }
    }
}

// The kernel's steps as functions, not closures: a closure does not take on the kernel's target
// features, so the intrinsics in it would be calls.

/// Each column's `s` plus the lane sums of the products of `w`'s 16-bit pairs and the column's
/// pair `p` (a lone column's pairs are two i16 codes, not necessarily 4-byte aligned).
///
/// # Safety
/// As for `tile`: the pairs are inside the columns' arrays; the CPU has AVX-512 BW (and VNNI
/// when `VNNI`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dots<const VNNI: bool, const C: usize>(
    s: &mut [std::arch::x86_64::__m512i; C],
    w: std::arch::x86_64::__m512i,
    cols: &Cols,
    p: usize,
) {
    use std::arch::x86_64::*;
    // SAFETY: as the caller vouches.
    unsafe {
        if VNNI {
            // A group's columns lie side by side, 4 bytes apart (`Cols::group`).
            broadcast_dots::<false, C>(s, w, cols.pair[0].add(p * cols.step));
        } else {
            for c in 0..C {
                let a = _mm512_set1_epi32(cols.pair[c].add(p * cols.step).read_unaligned() as i32);
                s[c] = _mm512_add_epi32(s[c], _mm512_madd_epi16(w, a));
            }
        }
    }
}

/// `vpdpwssd` of `w` and the pair of each of the `C` columns at `a`, `a + 4` … broadcast from
/// memory, or with `BYTES` `vpdpbusd` of `w`'s unsigned bytes and the columns' four signed bytes,
/// written out: LLVM otherwise turns dots into `vpmaddwd` + `vpaddd` to shorten a chain on CPUs
/// it does not know to be fast at them (its `fast-dpwssd` tuning, which `target_feature` cannot
/// name), and that pair takes 1.4 times a dot's time on Zen 4. The kernels keep two chains a
/// column instead. One block for all the columns, so that one address serves them.
///
/// # Safety
/// The `4 * C` bytes at `a` are readable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
#[inline]
unsafe fn broadcast_dots<const BYTES: bool, const C: usize>(
    s: &mut [std::arch::x86_64::__m512i; C],
    w: std::arch::x86_64::__m512i,
    a: *const u32,
) {
    macro_rules! dots {
        ($insn:literal: $($c:literal $at:literal),+) => {
            // SAFETY: reads the `4 * C` bytes at `a`, as the caller vouches; the features are
            // this function's.
            unsafe {
                std::arch::asm!(
                    $(concat!($insn, " {", $c, "}, {w}, dword ptr [{a} + ", $at, "]{{1to16}}"),)+
                    $(inout(zmm_reg) s[$c],)+
                    w = in(zmm_reg) w,
                    a = in(reg) a,
                    options(pure, readonly, nostack, preserves_flags)
                )
            }
        };
    }
    macro_rules! columns {
        ($($c:literal $at:literal),+) => {
            if BYTES {
                dots!("vpdpbusd": $($c $at),+)
            } else {
                dots!("vpdpwssd": $($c $at),+)
            }
        };
    }
    match C {
        1 => columns!(0 0),
        2 => columns!(0 0, 1 4),
        3 => columns!(0 0, 1 4, 2 8),
        4 => columns!(0 0, 1 4, 2 8, 3 12),
        5 => columns!(0 0, 1 4, 2 8, 3 12, 4 16),
        6 => columns!(0 0, 1 4, 2 8, 3 12, 4 16, 5 20),
        7 => columns!(0 0, 1 4, 2 8, 3 12, 4 16, 5 20, 6 24),
        _ => columns!(0 0, 1 4, 2 8, 3 12, 4 16, 5 20, 6 24, 7 28),
    }
}

/// Each column's sums of the products of `w`'s bytes (four unsigned codes a row) with its quad
/// at `a`: those of the `hi` bytes into `sh`, of the `lo` bytes (`width` quads on) into `sl`
/// (`Activations::quads`).
///
/// # Safety
/// As for `dots`: the quads are inside the columns' arrays.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn quad_dots<const VNNI: bool, const C: usize>(
    sh: &mut [std::arch::x86_64::__m512i; C],
    sl: &mut [std::arch::x86_64::__m512i; C],
    w: std::arch::x86_64::__m512i,
    a: *const u32,
    width: usize,
) {
    use std::arch::x86_64::*;
    // SAFETY: as the caller vouches.
    unsafe {
        if VNNI {
            broadcast_dots::<true, C>(sh, w, a);
            broadcast_dots::<true, C>(sl, w, a.add(width));
        } else {
            // Byte pairs summed in 16 bits (at most 2 * 63 * 128), then in 32.
            let ones = _mm512_set1_epi16(1);
            for c in 0..C {
                let (h, l) = (_mm512_set1_epi32(a.add(c).read() as i32), _mm512_set1_epi32(a.add(width + c).read() as i32));
                sh[c] = _mm512_add_epi32(sh[c], _mm512_madd_epi16(_mm512_maddubs_epi16(w, h), ones));
                sl[c] = _mm512_add_epi32(sl[c], _mm512_madd_epi16(_mm512_maddubs_epi16(w, l), ones));
            }
        }
    }
}

/// Each column's two chains added up.
///
/// # Safety
/// The CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn joined<const C: usize>(
    s0: &[std::arch::x86_64::__m512i; C],
    s1: &[std::arch::x86_64::__m512i; C],
) -> [std::arch::x86_64::__m512i; C] {
    let mut out = *s0;
    for c in 0..C {
        // SAFETY: a register add, with the caller's features.
        out[c] = unsafe { std::arch::x86_64::_mm512_add_epi32(s0[c], s1[c]) };
    }
    out
}

/// The canonical float steps (see `super`) for one group's integer sums of `C` columns: its
/// factors `m`, offsets `o` (when `off`), in chunk `chunk`.
///
/// # Safety
/// As for `tile`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn steps<const C: usize>(
    acc: &mut [std::arch::x86_64::__m512; C],
    sums: &[std::arch::x86_64::__m512i; C],
    m: std::arch::x86_64::__m512,
    o: std::arch::x86_64::__m512,
    cols: &Cols,
    chunk: usize,
    off: bool,
) {
    use std::arch::x86_64::*;
    // SAFETY: the chunk is inside the columns' arrays, as the caller vouches.
    unsafe {
        for c in 0..C {
            let f = _mm512_mul_ps(m, _mm512_set1_ps(*cols.scale[c].add(chunk * cols.step)));
            acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[c]), f, acc[c]);
            if off {
                acc[c] = _mm512_fmadd_ps(o, _mm512_set1_ps(*cols.sum[c].add(chunk * cols.step)), acc[c]);
            }
        }
    }
}

/// Sixteen bytes of factors (one a row) as floats.
///
/// # Safety
/// The 16 bytes at `at` are readable; the CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn widen(at: *const u8, signed: bool) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // SAFETY: as the caller vouches.
    unsafe {
        let v = _mm_loadu_si128(at as *const __m128i);
        _mm512_cvtepi32_ps(if signed { _mm512_cvtepi8_epi32(v) } else { _mm512_cvtepu8_epi32(v) })
    }
}
