//! The small per-row operations between matrix products. Each reduces in a fixed order, so a
//! row's result depends only on that row.

use crate::config::RopeStyle;
use crate::kernels::{self, FastType, Isa, Rows};
use crate::matrix::as_bytes;

/// `out = x / rms(x) * w`, the mean of squares summed in f64 over eight fixed lanes.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
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
    let scale = 1.0 / (ss / x.len() as f64 + eps as f64).sqrt();
    for ((o, v), g) in out.iter_mut().zip(x).zip(w) {
        *o = ((*v as f64 * scale) as f32) * g;
    }
}

/// Cosines and sines of one position's rotation angles, one pair per rotated dimension pair.
pub fn rope_angles(pos: usize, rope_dim: usize, base: f32, out: &mut Vec<(f64, f64)>) {
    out.clear();
    for i in 0..rope_dim / 2 {
        let theta = pos as f64 * (base as f64).powf(-2.0 * i as f64 / rope_dim as f64);
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

/// `g = silu(g) * u`, in place.
pub fn silu_mul(g: &mut [f32], u: &[f32]) {
    for (a, b) in g.iter_mut().zip(u) {
        *a = *a / (1.0 + (-*a).exp()) * b;
    }
}

/// A dot product in sixteen fixed lanes. Plain multiply-adds, not `mul_add`: without FMA in the
/// compile target that would be a libm call, and the order is fixed either way.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let n = a.len().min(b.len());
    let whole = n / 16 * 16;
    for (ca, cb) in a[..whole].chunks_exact(16).zip(b[..whole].chunks_exact(16)) {
        for l in 0..16 {
            lanes[l] += ca[l] * cb[l];
        }
    }
    let mut s = crate::kernels::reduce16(&lanes);
    for i in whole..n {
        s += a[i] * b[i];
    }
    s
}

/// Causal attention of one query head over `n_ctx` cached positions of one KV head.
/// `k` and `v` hold rows of `stride` floats; this head's slice starts at `offset` in each row.
/// The scores are one matrix–vector product over the key rows (the kernels' canonical order);
/// the softmax sums in f64; the weighted sum of values runs position by position.
#[allow(clippy::too_many_arguments)]
pub fn attend(isa: Isa, q: &[f32], k: &[f32], v: &[f32], n_ctx: usize, stride: usize, offset: usize, scores: &mut Vec<f32>, out: &mut [f32]) {
    let hd = q.len();
    scores.clear();
    scores.resize(n_ctx, 0.0);
    if n_ctx == 0 {
        return;
    }
    assert!(k.len() >= (n_ctx - 1) * stride + offset + hd && v.len() >= (n_ctx - 1) * stride + offset + hd);
    let keys = Rows { ty: FastType::F32, bytes: as_bytes(&k[offset..]), row_bytes: 4 * stride, n_rows: n_ctx };
    // SAFETY: `scores` holds n_ctx floats, one per row, and nothing else writes it.
    unsafe { kernels::gemv(isa, &keys, hd, &[q], scores.as_mut_ptr(), n_ctx) };
    let scale = 1.0 / (hd as f32).sqrt();
    let mut max = f32::NEG_INFINITY;
    for s in scores.iter_mut() {
        *s *= scale;
        max = max.max(*s);
    }
    let mut sum = 0f64;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s as f64;
    }
    let inv = (1.0 / sum) as f32;
    match isa {
        // SAFETY: `isa` was detected on this CPU.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { weigh_values_avx512(scores, inv, v, stride, offset, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { weigh_values_avx2(scores, inv, v, stride, offset, out) },
        _ => weigh_values(scores, inv, v, stride, offset, out),
    }
}

/// `out = Σ_j p_j · inv · v_j`, position by position. Compiled once per instruction set for the
/// wider vectors; plain multiplies and adds, element by element, so every version gives the same
/// bits.
#[inline(always)]
fn weigh_values(p: &[f32], inv: f32, v: &[f32], stride: usize, offset: usize, out: &mut [f32]) {
    let hd = out.len();
    out.iter_mut().for_each(|o| *o = 0.0);
    for (j, p) in p.iter().enumerate() {
        let vr = &v[j * stride + offset..j * stride + offset + hd];
        let w = p * inv;
        for (o, x) in out.iter_mut().zip(vr) {
            *o += w * x;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
unsafe fn weigh_values_avx512(p: &[f32], inv: f32, v: &[f32], stride: usize, offset: usize, out: &mut [f32]) {
    weigh_values(p, inv, v, stride, offset, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn weigh_values_avx2(p: &[f32], inv: f32, v: &[f32], stride: usize, offset: usize, out: &mut [f32]) {
    weigh_values(p, inv, v, stride, offset, out)
}

#[cfg(test)]
mod tests {
    use super::*;

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
            rope_angles(0, 8, 10000.0, &mut angles);
            let mut x = x0.clone();
            rope(&mut x, 8, &angles, style);
            assert_eq!(x, x0);
            rope_angles(37, 8, 10000.0, &mut angles);
            rope(&mut x, 8, &angles, style);
            let n0: f32 = x0.iter().map(|v| v * v).sum();
            let n1: f32 = x.iter().map(|v| v * v).sum();
            assert!((n0 - n1).abs() < 1e-3);
        }
    }

    #[test]
    fn attention_over_one_position_returns_its_value() {
        let q = [1.0f32, 2.0];
        let k = [0.5f32, 0.5, 9.0, 9.0];
        let v = [7.0f32, -1.0, 3.0, 4.0];
        let mut out = [0f32; 2];
        attend(Isa::Scalar, &q, &k, &v, 1, 4, 2, &mut Vec::new(), &mut out);
        assert_eq!(out, [3.0, 4.0]);
    }
}
