//! AVX2 kernels: a pair of ymm registers holds the 16 canonical lanes (0..8, 8..16).
//!
//! Every function here is compiled for AVX2, FMA and F16C, so calling one requires that the CPU
//! has them; `Isa` guarantees it (an `Isa` at the AVX2 level exists only after detection).

use super::panel::{Tile, Tiling};
use super::{layout as at, FastType, Part};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// 16 float lanes.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct V16(__m256, __m256);

/// 16 integer lanes.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct I16(__m256i, __m256i);

#[cfg(target_arch = "x86_64")]
impl I16 {
    /// Sixteen bytes at `p`, widened (unsigned).
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `p` is valid for reading 16 bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn u8s(p: *const u8) -> I16 {
        // SAFETY: the two 8-byte loads read bytes 0..16 at `p`, unaligned, which the caller vouches for.
        unsafe {
            I16(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i)),
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(8) as *const __m128i)),
            )
        }
    }

    /// Sixteen bytes at `p`, widened (signed).
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `p` is valid for reading 16 bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn i8s(p: *const u8) -> I16 {
        // SAFETY: the two 8-byte loads read bytes 0..16 at `p`, unaligned, which the caller vouches for.
        unsafe {
            I16(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)),
                _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(8) as *const __m128i)),
            )
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn splat(v: i32) -> I16 {
        I16(_mm256_set1_epi32(v), _mm256_set1_epi32(v))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn and(self, m: i32) -> I16 {
        let m = _mm256_set1_epi32(m);
        I16(_mm256_and_si256(self.0, m), _mm256_and_si256(self.1, m))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn or(self, o: I16) -> I16 {
        I16(_mm256_or_si256(self.0, o.0), _mm256_or_si256(self.1, o.1))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn sub(self, v: i32) -> I16 {
        let v = _mm256_set1_epi32(v);
        I16(_mm256_sub_epi32(self.0, v), _mm256_sub_epi32(self.1, v))
    }

    /// Shifted right by `n` bits.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn shr(self, n: i32) -> I16 {
        let n = _mm_cvtsi32_si128(n);
        I16(_mm256_srl_epi32(self.0, n), _mm256_srl_epi32(self.1, n))
    }

    /// Shifted left by `n` bits.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn shl(self, n: i32) -> I16 {
        let n = _mm_cvtsi32_si128(n);
        I16(_mm256_sll_epi32(self.0, n), _mm256_sll_epi32(self.1, n))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn float(self) -> V16 {
        V16(_mm256_cvtepi32_ps(self.0), _mm256_cvtepi32_ps(self.1))
    }

    /// `self * s + o`: an exact dequantization (see the module docs of `kernels`).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn deq(self, s: f32, o: f32) -> V16 {
        let (s, o) = (_mm256_set1_ps(s), _mm256_set1_ps(o));
        V16(_mm256_fmadd_ps(_mm256_cvtepi32_ps(self.0), s, o), _mm256_fmadd_ps(_mm256_cvtepi32_ps(self.1), s, o))
    }
}

#[cfg(target_arch = "x86_64")]
impl V16 {
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn mul(self, d: __m256) -> V16 {
        V16(_mm256_mul_ps(self.0, d), _mm256_mul_ps(self.1, d))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn fma(self, d: __m256, m: __m256) -> V16 {
        V16(_mm256_fmadd_ps(self.0, d, m), _mm256_fmadd_ps(self.1, d, m))
    }

    /// Writes the 16 lanes to `t`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn store(self, t: &mut [f32; 16]) {
        // SAFETY: each store writes 8 floats, unaligned, into the 16-float array `t`, at 0 and 8.
        unsafe {
            _mm256_storeu_ps(t.as_mut_ptr(), self.0);
            _mm256_storeu_ps(t.as_mut_ptr().add(8), self.1);
        }
    }
}

/// The f16 at `p`, widened and broadcast.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `p` is valid for reading 2 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn f16x1(p: *const u8) -> __m256 {
    // SAFETY: the caller vouches for 2 readable bytes; the read is unaligned.
    let bits = unsafe { std::ptr::read_unaligned(p as *const u16) };
    _mm256_set1_ps(at::F16_TO_F32[bits as usize])
}

/// The two f16 values at `p`, widened and broadcast.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `p` is valid for reading 4 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn f16x2(p: *const u8) -> (__m256, __m256) {
    // SAFETY: as the caller vouches.
    unsafe { (f16x1(p), f16x1(p.add(2))) }
}

/// `-v`, as a sign flip (so a zero's sign flips too, as the scalar kernel's does).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn neg(v: __m256) -> __m256 {
    _mm256_xor_ps(v, _mm256_set1_ps(-0.0))
}

/// A K-quant super-block's factor table (see `scalar::table`): `a * d` in entries 0..16 and
/// `b * m` in 16..32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn table(a: V16, d: __m256, b: V16, m: __m256) -> [f32; 32] {
    let (mut lo, mut hi) = ([0f32; 16], [0f32; 16]);
    a.mul(d).store(&mut lo);
    b.mul(m).store(&mut hi);
    // Opaque, so each factor is broadcast from memory (a load) rather than shuffled out of
    // registers (the shuffle unit is the dequantization's bottleneck).
    std::hint::black_box(std::array::from_fn(|i| if i < 16 { lo[i] } else { hi[i - 16] }))
}

/// The fifth bits of a Q5_0/Q5_1 block's elements `16h..16h + 16` (bit `e` of `qh` for element
/// `e`), at bit 4 of each lane.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn fifth_bits(qh: u32, h: i32) -> I16 {
    // Bit `16h + e` is moved to bit 4 by one shift right by `e`: the half's bits start at bit 4.
    let q = _mm256_set1_epi32((if h == 0 { qh << 4 } else { qh >> 12 }) as i32);
    let lanes = |e: i32| _mm256_setr_epi32(e, e + 1, e + 2, e + 3, e + 4, e + 5, e + 6, e + 7);
    let bit = |e| _mm256_and_si256(_mm256_srlv_epi32(q, lanes(e)), _mm256_set1_epi32(16));
    I16(bit(0), bit(8))
}

/// Calls `f` with the two halves (elements 0..16 and 16..32) of each 32-element chunk of the
/// block at `p`, in order, dequantized exactly as the scalar kernel does.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `p` is valid for reading `ty.block_bytes()` bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn block(ty: FastType, p: *const u8, f: &mut impl FnMut(V16, V16)) {
    // SAFETY: every read below lies inside the block the caller vouches for; the offsets are
    // given per type (block sizes in `FastType::block_bytes`).
    unsafe {
        let f32x8 = |o: usize| _mm256_loadu_ps((p as *const f32).add(o));
        let f16x8 = |o: usize| _mm256_cvtph_ps(_mm_loadu_si128(p.add(o) as *const __m128i));
        let bf16x8 =
            |o: usize| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(o) as *const __m128i))));
        match ty {
            // 8 floats at each of bytes 0, 32, 64, 96 (128).
            FastType::F32 => f(V16(f32x8(0), f32x8(8)), V16(f32x8(16), f32x8(24))),
            // 16 bytes at 0, 16, 32, 48 (64).
            FastType::F16 => f(V16(f16x8(0), f16x8(16)), V16(f16x8(32), f16x8(48))),
            FastType::Bf16 => f(V16(bf16x8(0), bf16x8(16)), V16(bf16x8(32), bf16x8(48))),
            // The scale at 0..2 and 16 bytes at 2 (18).
            FastType::Q4_0 => {
                let d = f16x1(p);
                let q = I16::u8s(p.add(2));
                f(q.and(0xF).sub(8).float().mul(d), q.shr(4).sub(8).float().mul(d))
            }
            // The scales at 0..4 and 16 bytes at 4 (20).
            FastType::Q4_1 => {
                let (d, m) = f16x2(p);
                let q = I16::u8s(p.add(4));
                f(q.and(0xF).float().fma(d, m), q.shr(4).float().fma(d, m))
            }
            // The scale at 0..2, fifth bits at 2..6, 16 bytes at 6 (22); Q5_1 adds a minimum
            // at 2..4 and shifts the rest by 2 (24).
            FastType::Q5_0 | FastType::Q5_1 => {
                let one = ty == FastType::Q5_1;
                let qh_at = if one { 4 } else { 2 };
                let qh = std::ptr::read_unaligned(p.add(qh_at) as *const u32);
                let q = I16::u8s(p.add(qh_at + 4));
                let (lo, hi) = (q.and(0xF).or(fifth_bits(qh, 0)), q.shr(4).or(fifth_bits(qh, 1)));
                if one {
                    let (d, m) = f16x2(p);
                    f(lo.float().fma(d, m), hi.float().fma(d, m))
                } else {
                    let d = f16x1(p);
                    f(lo.sub(16).float().mul(d), hi.sub(16).float().mul(d))
                }
            }
            // The scale at 0..2 and 16 bytes at 2 and 18 (34).
            FastType::Q8_0 => {
                let d = f16x1(p);
                f(I16::i8s(p.add(2)).float().mul(d), I16::i8s(p.add(18)).float().mul(d))
            }
            // d, dmin at 0..4, scales at 4..16, (Q5_K: fifth bits at 16..48,) nibbles (144, 176).
            FastType::Q4_K | FastType::Q5_K => {
                let five = ty == FastType::Q5_K;
                let (d, dmin) = f16x2(p);
                let s = at::q45k_scales(std::ptr::read_unaligned(p.add(at::Q45K_SCALES) as *const [u8; 12]));
                let s = I16::u8s(s.as_ptr()).float();
                // Entries 0..8 scale by d, 8..16 by -dmin.
                let mut t = [0f32; 16];
                V16(_mm256_mul_ps(s.0, d), _mm256_mul_ps(s.1, neg(dmin))).store(&mut t);
                // Opaque, as `table`'s.
                let t = std::hint::black_box(t);
                let qs = p.add(if five { at::Q5K_QS } else { at::Q4K_QS });
                // Fifth bits, moved down one bit per chunk so each chunk's is bit 0.
                let (mut h0, mut h1) =
                    if five { (I16::u8s(p.add(at::Q5K_QH)), I16::u8s(p.add(at::Q5K_QH + 16))) } else { (I16::splat(0), I16::splat(0)) };
                for i in 0..4 {
                    let (a, b) = (I16::u8s(qs.add(32 * i)), I16::u8s(qs.add(32 * i + 16)));
                    for (j, (a, b)) in [(2 * i, (a.and(0xF), b.and(0xF))), (2 * i + 1, (a.shr(4), b.shr(4)))] {
                        let (a, b) = if five {
                            let ab = (a.or(h0.shl(4).and(16)), b.or(h1.shl(4).and(16)));
                            (h0, h1) = (h0.shr(1), h1.shr(1));
                            ab
                        } else {
                            (a, b)
                        };
                        f(a.deq(t[j], t[8 + j]), b.deq(t[j], t[8 + j]));
                    }
                }
            }
            // Low nibbles at 0..128, high bit pairs at 128..192, signed scales at 192..208,
            // d at 208..210 (210).
            FastType::Q6_K => {
                let d = f16x1(p.add(at::Q6K_D));
                let s = I16::i8s(p.add(at::Q6K_SCALES)).float();
                let t = table(s, d, s, _mm256_mul_ps(d, _mm256_set1_ps(-32.0)));
                for n in 0..2 {
                    // The high bit pairs, moved up to bits 4..6 for chunk 0 and down two bits per
                    // chunk after it.
                    let qh = p.add(at::Q6K_QH + 32 * n);
                    let (mut h0, mut h1) = (I16::u8s(qh).shl(4), I16::u8s(qh.add(16)).shl(4));
                    for c in 0..4 {
                        let ql = p.add(64 * n + 32 * (c % 2));
                        let (a, b) = (I16::u8s(ql), I16::u8s(ql.add(16)));
                        let (a, b) = if c < 2 { (a.and(0xF), b.and(0xF)) } else { (a.shr(4), b.shr(4)) };
                        let (a, b) = (a.or(h0.and(0x30)), b.or(h1.and(0x30)));
                        (h0, h1) = (h0.shr(2), h1.shr(2));
                        let i = 2 * (4 * n + c);
                        f(a.deq(t[i], t[16 + i]), b.deq(t[i + 1], t[17 + i]));
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
                    let s = I16::u8s(s.as_ptr()).sub(32).float();
                    (table(s, d, s, _mm256_mul_ps(d, _mm256_set1_ps(-4.0))), p.add(at::Q3K_QS))
                } else {
                    let (d, dmin) = f16x2(p.add(at::Q2K_D));
                    let s = I16::u8s(p);
                    (table(s.and(0xF).float(), d, s.shr(4).float(), neg(dmin)), p.add(at::Q2K_QS))
                };
                // The third bits, moved up to bit 2 for chunk 0 and down one bit per chunk.
                let (mut h0, mut h1) =
                    if three { (I16::u8s(p).shl(2), I16::u8s(p.add(16)).shl(2)) } else { (I16::splat(0), I16::splat(0)) };
                for g in 0..2 {
                    let (a, b) = (I16::u8s(qs.add(32 * g)), I16::u8s(qs.add(32 * g + 16)));
                    for s in 0..4 {
                        let (a, b) = (a.shr(2 * s as i32).and(3), b.shr(2 * s as i32).and(3));
                        let (a, b) = if three {
                            let ab = (a.or(h0.and(4)), b.or(h1.and(4)));
                            (h0, h1) = (h0.shr(1), h1.shr(1));
                            ab
                        } else {
                            (a, b)
                        };
                        let i = 2 * (4 * g + s);
                        f(a.deq(t[i], t[16 + i]), b.deq(t[i + 1], t[17 + i]));
                    }
                }
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

/// The kernel for type number `T` (`p.ty`, specialized so each block's dequantization is inlined).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `p.w` holds `p.n_rows` rows of `p.row_bytes` bytes, each at
/// least `p.blocks.end` blocks; each column holds that many blocks' elements; `p.acc` has room
/// for `p.n_rows * N * 32` floats when `p.resume` or `p.suspend`; `p.out` is valid for the
/// writes at `c * p.stride + r` otherwise.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn gemv<const N: usize, const T: u8>(p: &Part<N>) {
    let ty = FastType::ALL[T as usize];
    let (bb, per) = (ty.block_bytes(), ty.block_chunks());
    for r in 0..p.n_rows {
        let row = p.w.wrapping_add(r * p.row_bytes);
        let acc = p.acc.wrapping_add(r * N * 32);
        let zero = V16(_mm256_setzero_ps(), _mm256_setzero_ps());
        let (mut lo_acc, mut hi_acc) = ([zero; N], [zero; N]);
        if p.resume {
            for c in 0..N {
                let a = acc.wrapping_add(c * 32);
                // SAFETY: the caller gave room for row `r`'s sums, `N * 32` floats at `acc`.
                unsafe {
                    lo_acc[c] = V16(_mm256_loadu_ps(a), _mm256_loadu_ps(a.add(8)));
                    hi_acc[c] = V16(_mm256_loadu_ps(a.add(16)), _mm256_loadu_ps(a.add(24)));
                }
            }
        }
        let mut xo = p.blocks.start * per * 32;
        for b in p.blocks.clone() {
            let blk = row.wrapping_add(b * bb);
            super::prefetch(blk, bb);
            // SAFETY: `r < n_rows` and `b < blocks.end`, so block `b` of row `r` lies inside
            // `w`, and its chunks' floats inside each column, as the caller vouches.
            unsafe {
                block(ty, blk, &mut |lo, hi| {
                    for c in 0..N {
                        let xb = p.x[c].add(xo);
                        lo_acc[c] = fma16(lo, xb, lo_acc[c]);
                        hi_acc[c] = fma16(hi, xb.add(16), hi_acc[c]);
                    }
                    xo += 32;
                    // A compiler-only fence: without it a K-quant's eight chunks are dequantized
                    // all at once, spilling most of them to the stack, before any is multiplied.
                    std::arch::asm!("", options(nostack, preserves_flags));
                })
            };
        }
        for c in 0..N {
            let a = acc.wrapping_add(c * 32);
            if p.suspend {
                // SAFETY: as for the loads above.
                unsafe {
                    _mm256_storeu_ps(a, lo_acc[c].0);
                    _mm256_storeu_ps(a.add(8), lo_acc[c].1);
                    _mm256_storeu_ps(a.add(16), hi_acc[c].0);
                    _mm256_storeu_ps(a.add(24), hi_acc[c].1);
                }
            } else {
                let mut l = [0f32; 16];
                V16(_mm256_add_ps(lo_acc[c].0, hi_acc[c].0), _mm256_add_ps(lo_acc[c].1, hi_acc[c].1)).store(&mut l);
                // SAFETY: `c < N` and `r < n_rows`: an index the caller gave room for.
                unsafe { *p.out.add(c * p.stride + r) = super::reduce16(&l) };
            }
        }
    }
}

/// Dequantizes the `n_blocks` blocks of type number `T` at `p` into `out`, 32 floats a chunk.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `p` is valid for reading `n_blocks` blocks and `out` for
/// writing their elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dequant<const T: u8>(p: *const u8, n_blocks: usize, out: *mut f32) {
    let ty = FastType::ALL[T as usize];
    let mut o = out;
    for b in 0..n_blocks {
        // SAFETY: block `b < n_blocks` lies inside what the caller vouches for, and its chunks'
        // 32 floats each inside `out`.
        unsafe {
            block(ty, p.add(b * ty.block_bytes()), &mut |lo, hi| {
                for (i, v) in [lo.0, lo.1, hi.0, hi.1].into_iter().enumerate() {
                    _mm256_storeu_ps(o.add(8 * i), v);
                }
                o = o.add(32);
            })
        };
    }
}

/// Dequantizes `TILING.rows` rows of type number `T`, `row_bytes` apart from `p` and `n_blocks`
/// blocks each, into the layout the tiles read: piece by piece (elements 0..8 of every chunk,
/// then 8..16, 16..24, 24..32), chunk by chunk, the rows' 8 floats side by side.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `p` is valid for reading the rows and `out` for writing
/// their `TILING.rows * k` elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dequant_tile<const T: u8>(p: *const u8, row_bytes: usize, n_blocks: usize, out: *mut f32) {
    const R: usize = TILING.rows;
    let ty = FastType::ALL[T as usize];
    let nb = n_blocks * ty.block_chunks();
    for r in 0..R {
        let mut o = out.wrapping_add(8 * r);
        for b in 0..n_blocks {
            // SAFETY: block `b` of row `r` lies inside what the caller vouches for, and each
            // chunk's four pieces go to their places among the `R * k` floats at `out`.
            unsafe {
                block(ty, p.add(r * row_bytes + b * ty.block_bytes()), &mut |lo, hi| {
                    for (h, v) in [lo.0, lo.1, hi.0, hi.1].into_iter().enumerate() {
                        _mm256_storeu_ps(o.add(h * nb * R * 8), v);
                    }
                    o = o.add(8 * R);
                })
            };
        }
    }
}

/// Four rows by three columns, one piece (8 of the 32 lanes) at a time: 12 sums, three columns
/// and a row fill the 16 registers, and each of the 7 vectors loaded feeds three or four
/// multiply-adds.
pub(super) const TILING: Tiling = Tiling { rows: 4, cols: 3, lanes: 8 };

/// Runs `t` over its first `n` columns (1 to 3).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; the tile's rows, columns, sums and outputs are valid as
/// `panel::tiles` lays them out.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tile(t: &Tile, n: usize) {
    // SAFETY: as the caller vouches.
    unsafe {
        match n {
            1 => pieces::<1>(t),
            2 => pieces::<2>(t),
            _ => pieces::<3>(t),
        }
    }
}

/// The four pieces of the tile's sums over its first `N` columns.
///
/// # Safety
/// As for `tile`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn pieces<const N: usize>(t: &Tile) {
    for h in 0..4 {
        // SAFETY: as the caller vouches.
        unsafe { piece::<N>(t, h) };
    }
}

/// Piece `h` of the tile's sums over its first `N` columns; after the last piece of the last
/// part, the four pieces reduced into the outputs.
///
/// # Safety
/// As for `tile`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn piece<const N: usize>(t: &Tile, h: usize) {
    const R: usize = TILING.rows;
    const C: usize = TILING.cols;
    const SUMS: usize = R * C * 8;
    let acc = t.acc.wrapping_add(h * SUMS);
    let mut a = [[_mm256_setzero_ps(); N]; R];
    if t.resume {
        for r in 0..R {
            for c in 0..N {
                // SAFETY: sum `(r, c)` of piece `h`, inside the floats the caller vouches for.
                a[r][c] = unsafe { _mm256_loadu_ps(acc.add((C * r + c) * 8)) };
            }
        }
    }
    let at = h * t.nb + t.chunks.start;
    let (mut w, mut x) = (t.w.wrapping_add(at * R * 8), t.x.wrapping_add(at * C * 8));
    for _ in t.chunks.clone() {
        // SAFETY: this chunk's piece of each row and column is inside what the caller vouches
        // for.
        unsafe {
            let xv: [__m256; N] = std::array::from_fn(|c| _mm256_loadu_ps(x.add(8 * c)));
            for r in 0..R {
                let wv = _mm256_loadu_ps(w.add(8 * r));
                for c in 0..N {
                    a[r][c] = _mm256_fmadd_ps(wv, xv[c], a[r][c]);
                }
            }
        }
        (w, x) = (w.wrapping_add(8 * R), x.wrapping_add(8 * C));
    }
    if h < 3 || !t.last {
        for r in 0..R {
            for c in 0..N {
                // SAFETY: as for the loads above.
                unsafe { _mm256_storeu_ps(acc.add((C * r + c) * 8), a[r][c]) };
            }
        }
        return;
    }
    for r in 0..R {
        for c in 0..N {
            // SAFETY: the sums `(r, c)` of pieces 0..3, stored above.
            let p = |i: usize| unsafe { _mm256_loadu_ps(t.acc.add(i * SUMS + (C * r + c) * 8)) };
            // The two sets of 16 (pieces 0 1 and 2 3) added lane by lane, then `reduce16`: its
            // halves (8 + 8), quarters, pairs and the last two.
            let a8 = _mm256_add_ps(_mm256_add_ps(p(0), p(2)), _mm256_add_ps(p(1), a[r][c]));
            let b4 = _mm_add_ps(_mm256_castps256_ps128(a8), _mm256_extractf128_ps::<1>(a8));
            let c2 = _mm_add_ps(b4, _mm_movehl_ps(b4, b4));
            let d = _mm_add_ss(c2, _mm_shuffle_ps::<0b01>(c2, c2));
            // SAFETY: `c < N` and `r < R`: one of this tile's outputs.
            unsafe { *t.out.add(c * t.stride + r) = _mm_cvtss_f32(d) };
        }
    }
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
/// Never called: elsewhere no `Isa` has the AVX2 level.
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn tile(_: &Tile, _: usize) {
    unreachable!("AVX2 tiles off x86-64")
}

/// # Safety
/// Never called: elsewhere no `Isa` has the AVX2 level.
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn dequant_tile<const T: u8>(_: *const u8, _: usize, _: usize, _: *mut f32) {
    unreachable!("AVX2 tiles off x86-64")
}
