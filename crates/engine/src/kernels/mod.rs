//! Matrix–vector kernels over GGUF's quantized blocks.
//!
//! Every kernel computes a row's dot product in one canonical order: 16 lanes, where lane `l`
//! accumulates elements `32b + l` then `32b + 16 + l` of each 32-element block `b` with a fused
//! multiply-add, followed by a fixed tree reduction of the lanes and a sequential tail. Weights are
//! dequantized exactly (`q * d + m` fits in an f32 mantissa), so the scalar, AVX2 and AVX-512
//! paths give bitwise identical results, and a row's result never depends on how many columns
//! (sequences) are computed beside it or on which thread computes it.

mod avx2;
mod avx512;
mod isa;
mod scalar;

pub use isa::Isa;

use dgr_gguf::GgmlType;

/// Block types with a dedicated SIMD dequantizer; the rest go through an f32 row.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum FastType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q8_0,
}

impl FastType {
    pub(crate) fn of(ty: GgmlType) -> Option<FastType> {
        Some(match ty {
            GgmlType::F32 => FastType::F32,
            GgmlType::F16 => FastType::F16,
            GgmlType::BF16 => FastType::Bf16,
            GgmlType::Q4_0 => FastType::Q4_0,
            GgmlType::Q4_1 => FastType::Q4_1,
            GgmlType::Q8_0 => FastType::Q8_0,
            _ => return None,
        })
    }

    /// Bytes holding 32 consecutive elements of a row.
    pub(crate) const fn chunk_bytes(self) -> usize {
        match self {
            FastType::F32 => 128,
            FastType::F16 | FastType::Bf16 => 64,
            FastType::Q4_0 => 18,
            FastType::Q4_1 => 20,
            FastType::Q8_0 => 34,
        }
    }
}

/// The widest column group a kernel call handles; wider batches are split into groups of 8/4/2/1.
pub(crate) const MAX_COLS: usize = 8;

/// Dot products of one weight row with `xs.len()` activation columns, each of length `k`.
/// `row` holds the row's bytes in `ty`'s layout; `k` is a multiple of 32 for block types.
pub(crate) fn dot_row(isa: Isa, ty: FastType, row: &[u8], k: usize, xs: &[&[f32]], out: &mut [f32]) {
    debug_assert_eq!(xs.len(), out.len());
    let mut c = 0;
    while c < xs.len() {
        let n = match xs.len() - c {
            n if n >= 8 => 8,
            n if n >= 4 => 4,
            n if n >= 2 => 2,
            _ => 1,
        };
        let group = &xs[c..c + n];
        let dst = &mut out[c..c + n];
        match n {
            8 => dispatch::<8>(isa, ty, row, k, group, dst),
            4 => dispatch::<4>(isa, ty, row, k, group, dst),
            2 => dispatch::<2>(isa, ty, row, k, group, dst),
            _ => dispatch::<1>(isa, ty, row, k, group, dst),
        }
        c += n;
    }
}

fn dispatch<const N: usize>(isa: Isa, ty: FastType, row: &[u8], k: usize, xs: &[&[f32]], out: &mut [f32]) {
    let nb = k / 32;
    assert!(row.len() >= nb * ty.chunk_bytes() && xs.iter().all(|x| x.len() >= k));
    let xp: [*const f32; N] = std::array::from_fn(|i| xs[i].as_ptr());
    // SAFETY: the assert above bounds every read; `isa` was detected on this CPU.
    let sums: [f32; N] = unsafe {
        match isa {
            Isa::Avx512 => avx512::dot::<N>(ty, row.as_ptr(), &xp, nb),
            Isa::Avx2 => avx2::dot::<N>(ty, row.as_ptr(), &xp, nb),
            Isa::Scalar => scalar::dot::<N>(ty, row.as_ptr(), &xp, nb),
        }
    };
    let tail = k - nb * 32;
    for i in 0..N {
        let mut s = sums[i];
        if tail > 0 {
            let t0 = nb * 32;
            for j in 0..tail {
                s = scalar::element(ty, row, t0 + j).mul_add(xs[i][t0 + j], s);
            }
        }
        out[i] = s;
    }
}

/// The canonical reduction of 16 lanes: halves, then quarters, then pairs, then the last two.
#[inline(always)]
pub(crate) fn reduce16(l: &[f32; 16]) -> f32 {
    let mut a = [0f32; 8];
    for i in 0..8 {
        a[i] = l[i] + l[i + 8];
    }
    let b = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let c = [b[0] + b[2], b[1] + b[3]];
    c[0] + c[1]
}

#[cfg(test)]
mod tests;
