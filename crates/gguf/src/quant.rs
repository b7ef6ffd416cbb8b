//! Reference scalar (de)quantization of ggml block types. Dequantization is bit-exact with
//! ggml's `dequantize_row_*` (ggml-quants.c): same block layouts and the same f32 operation
//! order. Quantization uses simple round-to-nearest schemes that produce valid blocks; it is
//! not ggml's search-based quantizer and need not match it bit for bit.

use crate::error::GgufError;
use crate::types::{GgmlType, QK, QK_K};
use half::{bf16, f16};

/// Dequantizes `dst.len()` elements; `src` must hold exactly that many.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), GgufError> {
    let expected = row_bytes(ty, dst.len())?;
    if src.len() as u64 != expected {
        return Err(GgufError::LengthMismatch { what: "dequantize source", expected, found: src.len() as u64 });
    }
    let block: fn(&[u8], &mut [f32]) = match ty {
        GgmlType::F32 => |b, y| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => |b, y| y[0] = f16_at(b, 0),
        GgmlType::BF16 => |b, y| y[0] = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
        GgmlType::Q4_0 => dequant_q4_0,
        GgmlType::Q4_1 => dequant_q4_1,
        GgmlType::Q5_0 => dequant_q5_0,
        GgmlType::Q5_1 => dequant_q5_1,
        GgmlType::Q8_0 => dequant_q8_0,
        GgmlType::Q2_K => dequant_q2_k,
        GgmlType::Q3_K => dequant_q3_k,
        GgmlType::Q4_K => dequant_q4_k,
        GgmlType::Q5_K => dequant_q5_k,
        GgmlType::Q6_K => dequant_q6_k,
        GgmlType::Q8_K => dequant_q8_k,
        _ => return Err(GgufError::UnsupportedType { ty, op: "dequantize_row" }),
    };
    for (b, y) in src.chunks_exact(ty.type_size()).zip(dst.chunks_exact_mut(ty.block_size())) {
        block(b, y);
    }
    Ok(())
}

/// Quantizes `src` (whole blocks) and appends the blocks to `dst`.
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut Vec<u8>) -> Result<(), GgufError> {
    let n_bytes = row_bytes(ty, src.len())?;
    let block: fn(&[f32], &mut Vec<u8>) = match ty {
        GgmlType::F32 => |x, out| out.extend_from_slice(&x[0].to_le_bytes()),
        GgmlType::F16 => |x, out| out.extend_from_slice(&f16::from_f32(x[0]).to_le_bytes()),
        GgmlType::BF16 => |x, out| out.extend_from_slice(&bf16::from_f32(x[0]).to_le_bytes()),
        GgmlType::Q4_0 => quant_q4_0,
        GgmlType::Q4_1 => quant_q4_1,
        GgmlType::Q5_0 => quant_q5_0,
        GgmlType::Q5_1 => quant_q5_1,
        GgmlType::Q8_0 => quant_q8_0,
        GgmlType::Q2_K => quant_q2_k,
        GgmlType::Q3_K => quant_q3_k,
        GgmlType::Q4_K => |x, out| quant_q45_k(x, out, false),
        GgmlType::Q5_K => |x, out| quant_q45_k(x, out, true),
        GgmlType::Q6_K => quant_q6_k,
        _ => return Err(GgufError::UnsupportedType { ty, op: "quantize_row" }),
    };
    dst.reserve(usize::try_from(n_bytes).unwrap_or(0));
    for x in src.chunks_exact(ty.block_size()) {
        block(x, dst);
    }
    Ok(())
}

fn row_bytes(ty: GgmlType, n_elems: usize) -> Result<u64, GgufError> {
    ty.row_bytes(n_elems as u64).ok_or(GgufError::PartialBlock { ty, n_elems: n_elems as u64, block_size: ty.block_size() })
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

fn push_f16(out: &mut Vec<u8>, v: f32) {
    out.extend_from_slice(&f16::from_f32(v).to_le_bytes());
}

// ---- legacy 32-element blocks -------------------------------------------------------------

// block_q4_0 { f16 d; u8 qs[16] }: element j is the low nibble of qs[j], j+16 the high one.
fn dequant_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..QK / 2 {
        let q = b[2 + j];
        y[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
        y[j + QK / 2] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

// block_q4_1 { f16 d; f16 m; u8 qs[16] }
fn dequant_q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for j in 0..QK / 2 {
        let q = b[4 + j];
        y[j] = (q & 0x0F) as f32 * d + m;
        y[j + QK / 2] = (q >> 4) as f32 * d + m;
    }
}

// block_q5_0 { f16 d; u8 qh[4]; u8 qs[16] }: bit j of qh is the fifth bit of element j.
fn dequant_q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for j in 0..QK / 2 {
        let q = b[6 + j];
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        y[j] = (((q & 0x0F) as u32 | h0) as i32 - 16) as f32 * d;
        y[j + QK / 2] = (((q >> 4) as u32 | h1) as i32 - 16) as f32 * d;
    }
}

// block_q5_1 { f16 d; f16 m; u8 qh[4]; u8 qs[16] }
fn dequant_q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for j in 0..QK / 2 {
        let q = b[8 + j];
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        y[j] = ((q & 0x0F) as u32 | h0) as f32 * d + m;
        y[j + QK / 2] = ((q >> 4) as u32 | h1) as f32 * d + m;
    }
}

// block_q8_0 { f16 d; i8 qs[32] }
fn dequant_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..QK {
        y[j] = (b[2 + j] as i8) as f32 * d;
    }
}

fn quant_q4_0(x: &[f32], out: &mut Vec<u8>) {
    // The signed value of largest magnitude maps to -8, so the full 16 levels are used.
    let max = x.iter().copied().fold(0.0f32, |m, v| if v.abs() > m.abs() { v } else { m });
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    push_f16(out, d);
    for j in 0..QK / 2 {
        let lo = ((x[j] * id + 8.5) as i8).min(15) as u8;
        let hi = ((x[j + QK / 2] * id + 8.5) as i8).min(15) as u8;
        out.push(lo | (hi << 4));
    }
}

fn quant_q4_1(x: &[f32], out: &mut Vec<u8>) {
    let min = x.iter().copied().fold(f32::INFINITY, f32::min);
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    push_f16(out, d);
    push_f16(out, min);
    for j in 0..QK / 2 {
        let lo = (((x[j] - min) * id + 0.5) as i8).min(15) as u8;
        let hi = (((x[j + QK / 2] - min) * id + 0.5) as i8).min(15) as u8;
        out.push(lo | (hi << 4));
    }
}

/// The fifth bits of 32 codes, bit j for code j, as Q5_0 and Q5_1 store them; then the low
/// nibbles, element j in the low half of byte j and element j+16 in the high half.
fn push_q5_codes(q: &[u8; QK], out: &mut Vec<u8>) {
    let qh = q.iter().enumerate().fold(0u32, |h, (j, &v)| h | ((v as u32 >> 4) << j));
    out.extend_from_slice(&qh.to_le_bytes());
    out.extend((0..QK / 2).map(|j| (q[j] & 0x0F) | ((q[j + QK / 2] & 0x0F) << 4)));
}

fn quant_q5_0(x: &[f32], out: &mut Vec<u8>) {
    // As Q4_0: the signed value of largest magnitude maps to -16.
    let max = x.iter().copied().fold(0.0f32, |m, v| if v.abs() > m.abs() { v } else { m });
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    push_f16(out, d);
    push_q5_codes(&std::array::from_fn(|j| ((x[j] * id + 16.5) as i8).clamp(0, 31) as u8), out);
}

fn quant_q5_1(x: &[f32], out: &mut Vec<u8>) {
    let min = x.iter().copied().fold(f32::INFINITY, f32::min);
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let d = (max - min) / 31.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    push_f16(out, d);
    push_f16(out, min);
    push_q5_codes(&std::array::from_fn(|j| (((x[j] - min) * id + 0.5) as i8).clamp(0, 31) as u8), out);
}

fn quant_q8_0(x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    push_f16(out, d);
    out.extend(x.iter().map(|v| ((v * id).round() as i8) as u8));
}

// ---- k-quants: 256-element super-blocks -------------------------------------------------

// block_q2_K { u8 scales[16] (low nibble scale, high nibble min); u8 qs[64]; f16 d; f16 dmin }
fn dequant_q2_k(b: &[u8], y: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, min) = (f16_at(b, 80), f16_at(b, 82));
    let mut is = 0;
    let mut yi = 0;
    for q in qs.chunks_exact(32) {
        for shift in [0, 2, 4, 6] {
            for half in [&q[..16], &q[16..]] {
                let sc = scales[is];
                is += 1;
                let dl = d * (sc & 0x0F) as f32;
                let ml = min * (sc >> 4) as f32;
                for &ql in half {
                    y[yi] = dl * ((ql >> shift) & 3) as f32 - ml;
                    yi += 1;
                }
            }
        }
    }
}

// block_q3_K { u8 hmask[32]; u8 qs[64]; u8 scales[12] (16 packed 6-bit scales); f16 d }
fn dequant_q3_k(b: &[u8], y: &mut [f32]) {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let (hm, qs) = (&b[0..32], &b[32..96]);
    let word = |i: usize| u32::from_le_bytes([b[96 + 4 * i], b[97 + 4 * i], b[98 + 4 * i], b[99 + 4 * i]]);
    let (a0, a1, tmp) = (word(0), word(1), word(2));
    let aux = [
        (a0 & KMASK2) | ((tmp & KMASK1) << 4),
        (a1 & KMASK2) | (((tmp >> 2) & KMASK1) << 4),
        ((a0 >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4),
        ((a1 >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4),
    ];
    let mut scales = [0i8; 16];
    for (s, byte) in scales.iter_mut().zip(aux.iter().flat_map(|a| a.to_le_bytes())) {
        *s = byte as i8;
    }
    let d_all = f16_at(b, 108);
    let mut is = 0;
    let mut yi = 0;
    let mut m = 1u8;
    for q in qs.chunks_exact(32) {
        for shift in [0, 2, 4, 6] {
            for (ql, hl) in [(&q[..16], &hm[..16]), (&q[16..], &hm[16..])] {
                let dl = d_all * (scales[is] as i32 - 32) as f32;
                is += 1;
                for (&qv, &hv) in ql.iter().zip(hl) {
                    let v = ((qv >> shift) & 3) as i32 - if hv & m != 0 { 0 } else { 4 };
                    y[yi] = dl * v as f32;
                    yi += 1;
                }
            }
            m <<= 1;
        }
    }
}

/// ggml's get_scale_min_k4: the j-th 6-bit scale and min of a Q4_K/Q5_K block.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Inverse of [`scale_min_k4`] for all eight 6-bit (scale, min) pairs.
fn pack_scale_min_k4(sc: &[u8; 8], mn: &[u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            q[j] |= sc[j] & 63;
            q[j + 4] |= mn[j] & 63;
        } else {
            q[j + 4] = (sc[j] & 0x0F) | ((mn[j] & 0x0F) << 4);
            q[j - 4] |= (sc[j] >> 4) << 6;
            q[j] |= (mn[j] >> 4) << 6;
        }
    }
    q
}

// block_q4_K { f16 d; f16 dmin; u8 scales[12]; u8 qs[128] }: each 32-byte run of qs holds
// 64 elements, the first 32 in low nibbles and the next 32 in high nibbles.
fn dequant_q4_k(b: &[u8], y: &mut [f32]) {
    let (d, min) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    for (j, (q, y)) in b[16..144].chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * j, scales);
        let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        for l in 0..32 {
            y[l] = d1 * (q[l] & 0x0F) as f32 - m1;
            y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

// block_q5_K { f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128] }: as Q4_K, plus a fifth
// bit per element in qh, bits 2j and 2j+1 for the j-th 64-element run.
fn dequant_q5_k(b: &[u8], y: &mut [f32]) {
    let (d, min) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qh) = (&b[4..16], &b[16..48]);
    for (j, (ql, y)) in b[48..176].chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * j, scales);
        let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        let (u1, u2) = (1u8 << (2 * j), 2u8 << (2 * j));
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[l] = d1 * ((ql[l] & 0x0F) + h1) as f32 - m1;
            y[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
        }
    }
}

// block_q6_K { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d }: per 128 elements, 64 bytes of
// ql (low nibbles), 32 of qh (two high bits each for four elements) and 8 scales.
fn dequant_q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    let chunks = b[0..128].chunks_exact(64).zip(b[128..192].chunks_exact(32)).zip(b[192..208].chunks_exact(8));
    for (((ql, qh), sc), y) in chunks.zip(y.chunks_exact_mut(128)) {
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

// block_q8_K { f32 d; i8 qs[256]; i16 bsums[16] }
fn dequant_q8_k(b: &[u8], y: &mut [f32]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (y, &q) in y.iter_mut().zip(&b[4..4 + QK_K]) {
        *y = d * (q as i8) as f32;
    }
}

/// Q4_K (`five_bit` false) or Q5_K: per 32-element sub-block a minimum (clamped to <= 0, as the
/// format subtracts it) and a step, each a 6-bit index times an f16 super-block unit. Units and
/// indices round up, so the codes always cover the sub-block's range without clipping.
fn quant_q45_k(x: &[f32], out: &mut Vec<u8>, five_bit: bool) {
    let levels = if five_bit { 31.0 } else { 15.0 };
    let lo: [f32; 8] = std::array::from_fn(|i| x[32 * i..32 * i + 32].iter().copied().fold(0.0f32, f32::min));
    let hi: [f32; 8] = std::array::from_fn(|i| x[32 * i..32 * i + 32].iter().copied().fold(lo[i], f32::max));
    let dmin = f16_round_up(lo.iter().fold(0.0f32, |m, v| m.max(-v)) / 63.0);
    let mn: [u8; 8] = std::array::from_fn(|i| index_up(-lo[i], dmin, 63.0) as u8);
    let m: [f32; 8] = std::array::from_fn(|i| dmin * mn[i] as f32);
    let scale: [f32; 8] = std::array::from_fn(|i| (hi[i] + m[i]) / levels);
    let d = f16_round_up(scale.iter().copied().fold(0.0, f32::max) / 63.0);
    let sc: [u8; 8] = std::array::from_fn(|i| index_up(scale[i], d, 63.0) as u8);
    push_f16(out, d);
    push_f16(out, dmin);
    out.extend_from_slice(&pack_scale_min_k4(&sc, &mn));

    let mut q = [0u8; QK_K];
    for (i, (sub, qs)) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)).enumerate() {
        let step = d * sc[i] as f32;
        for (qv, &v) in qs.iter_mut().zip(sub) {
            *qv = if step > 0.0 { ((v + m[i]) / step).round().clamp(0.0, levels) as u8 } else { 0 };
        }
    }
    if five_bit {
        let mut qh = [0u8; 32];
        for (j, run) in q.chunks_exact(64).enumerate() {
            for l in 0..32 {
                qh[l] |= ((run[l] >> 4) << (2 * j)) | ((run[l + 32] >> 4) << (2 * j + 1));
            }
        }
        out.extend_from_slice(&qh);
    }
    for run in q.chunks_exact(64) {
        out.extend((0..32).map(|l| (run[l] & 0x0F) | ((run[l + 32] & 0x0F) << 4)));
    }
}

/// Q2_K: per 16-element sub-block a minimum (clamped to <= 0) and a step, each a 4-bit index
/// times an f16 super-block unit, rounded up as for Q4_K; codes 0..=3.
fn quant_q2_k(x: &[f32], out: &mut Vec<u8>) {
    let lo: [f32; 16] = std::array::from_fn(|i| x[16 * i..16 * i + 16].iter().copied().fold(0.0f32, f32::min));
    let hi: [f32; 16] = std::array::from_fn(|i| x[16 * i..16 * i + 16].iter().copied().fold(lo[i], f32::max));
    let dmin = f16_round_up(lo.iter().fold(0.0f32, |m, v| m.max(-v)) / 15.0);
    let mn: [u8; 16] = std::array::from_fn(|i| index_up(-lo[i], dmin, 15.0) as u8);
    let m: [f32; 16] = std::array::from_fn(|i| dmin * mn[i] as f32);
    let scale: [f32; 16] = std::array::from_fn(|i| (hi[i] + m[i]) / 3.0);
    let d = f16_round_up(scale.iter().copied().fold(0.0, f32::max) / 15.0);
    let sc: [u8; 16] = std::array::from_fn(|i| index_up(scale[i], d, 15.0) as u8);
    out.extend((0..16).map(|i| sc[i] | (mn[i] << 4)));
    // Element 128g + 32s + l (l < 32) is bits 2s..2s+2 of code byte 32g + l.
    let mut qs = [0u8; 64];
    for (i, sub) in x.chunks_exact(16).enumerate() {
        let step = d * sc[i] as f32;
        for (l, &v) in sub.iter().enumerate() {
            let q = if step > 0.0 { ((v + m[i]) / step).round().clamp(0.0, 3.0) as u8 } else { 0 };
            let e = 16 * i + l;
            qs[32 * (e / 128) + e % 32] |= q << (2 * (e % 128 / 32));
        }
    }
    out.extend_from_slice(&qs);
    push_f16(out, d);
    push_f16(out, dmin);
}

/// Q3_K: per 16-element sub-block a symmetric step (amax / 3, codes in [-3, 3] of the format's
/// [-4, 3]) as a 6-bit index (stored offset by 32) times the f16 super-block d, rounded up.
fn quant_q3_k(x: &[f32], out: &mut Vec<u8>) {
    let scale: [f32; 16] = std::array::from_fn(|i| x[16 * i..16 * i + 16].iter().fold(0.0f32, |m, v| m.max(v.abs())) / 3.0);
    let d = f16_round_up(scale.iter().copied().fold(0.0, f32::max) / 31.0);
    let sc: [u8; 16] = std::array::from_fn(|i| index_up(scale[i], d, 31.0) as u8);
    // Code c + 4 of element 128g + 32s + l (l < 32): its low two bits at bits 2s..2s+2 of byte
    // 32g + l of the codes, its third bit at bit 4g + s of mask byte l.
    let (mut hmask, mut qs) = ([0u8; 32], [0u8; 64]);
    for (i, sub) in x.chunks_exact(16).enumerate() {
        let step = d * sc[i] as f32;
        for (l, &v) in sub.iter().enumerate() {
            let q = if step > 0.0 { (v / step).round().clamp(-4.0, 3.0) as i32 } else { 0 } + 4;
            let e = 16 * i + l;
            let (g, s) = (e / 128, e % 128 / 32);
            qs[32 * g + e % 32] |= ((q & 3) as u8) << (2 * s);
            hmask[e % 32] |= ((q >> 2) as u8) << (4 * g + s);
        }
    }
    out.extend_from_slice(&hmask);
    out.extend_from_slice(&qs);
    // Scale i's low nibble in byte i % 8 (the high nibble for i >= 8), its top two bits in byte
    // 8 + i % 4 at bit 2 * (i / 4): the inverse of the unpacking in `dequant_q3_k`.
    let mut packed = [0u8; 12];
    for (i, &s) in sc.iter().enumerate() {
        let u = s + 32;
        packed[i % 8] |= (u & 0x0F) << (4 * (i / 8));
        packed[8 + i % 4] |= (u >> 4) << (2 * (i / 4));
    }
    out.extend_from_slice(&packed);
    push_f16(out, d);
}

/// Q6_K: per 16-element sub-block a symmetric step (amax / 31, codes in [-32, 31] stored offset
/// by 32) as an i8 index times the f16 super-block d; both round up so codes never clip.
fn quant_q6_k(x: &[f32], out: &mut Vec<u8>) {
    let scale: [f32; 16] = std::array::from_fn(|i| x[16 * i..16 * i + 16].iter().fold(0.0f32, |m, v| m.max(v.abs())) / 31.0);
    let d = f16_round_up(scale.iter().copied().fold(0.0, f32::max) / 127.0);
    let sc: [i8; 16] = std::array::from_fn(|i| index_up(scale[i], d, 127.0) as i8);
    let mut q = [0u8; QK_K];
    for (i, (sub, qs)) in x.chunks_exact(16).zip(q.chunks_exact_mut(16)).enumerate() {
        let step = d * sc[i] as f32;
        for (qv, &v) in qs.iter_mut().zip(sub) {
            let code = if step != 0.0 { (v / step).round().clamp(-32.0, 31.0) as i32 } else { 0 };
            *qv = (code + 32) as u8;
        }
    }
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for (n, run) in q.chunks_exact(128).enumerate() {
        for l in 0..32 {
            let (a, b, c, e) = (run[l], run[l + 32], run[l + 64], run[l + 96]);
            ql[64 * n + l] = (a & 0x0F) | ((c & 0x0F) << 4);
            ql[64 * n + l + 32] = (b & 0x0F) | ((e & 0x0F) << 4);
            qh[32 * n + l] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6);
        }
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(sc.iter().map(|&s| s as u8));
    push_f16(out, d);
}

/// The smallest f16 >= `v` (for finite, non-negative `v`), as f32, so `v / unit` stays in range.
fn f16_round_up(v: f32) -> f32 {
    let h = f16::from_f32(v);
    if h.to_f32() < v {
        f16::from_bits(h.to_bits() + 1).to_f32()
    } else {
        h.to_f32()
    }
}

/// `ceil(v / unit)` clamped to [0, max]; 0 when the unit is 0.
fn index_up(v: f32, unit: f32, max: f32) -> f32 {
    if unit > 0.0 {
        (v / unit).ceil().clamp(0.0, max)
    } else {
        0.0
    }
}
