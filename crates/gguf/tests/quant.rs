mod common;

use common::XorShift;
use dgr_gguf::quant::{dequantize_row, quantize_row};
use dgr_gguf::{GgmlType, GgufError};
use half::f16;

fn h(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_le_bytes()
}

fn dequant(ty: GgmlType, src: &[u8], n: usize) -> Vec<f32> {
    let mut y = vec![0.0; n];
    dequantize_row(ty, src, &mut y).expect("dequantize");
    y
}

#[test]
fn q4_0_known_answer() {
    // value = d * (q - 8); element j is the low nibble of qs[j], element j+16 the high nibble.
    let mut block = h(0.5).to_vec();
    block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let y = dequant(GgmlType::Q4_0, &block, 32);
    for j in 0..16 {
        assert_eq!(y[j], 0.5 * (j as f32 - 8.0));
        assert_eq!(y[j + 16], 0.5 * (7.0 - j as f32));
    }
}

#[test]
fn q4_1_known_answer() {
    // value = d * q + m with d = 0.5, m = -1.
    let mut block = h(0.5).to_vec();
    block.extend(h(-1.0));
    block.extend((0..16u8).map(|j| j | ((j / 2) << 4)));
    let y = dequant(GgmlType::Q4_1, &block, 32);
    for j in 0..16 {
        assert_eq!(y[j], 0.5 * j as f32 - 1.0);
        assert_eq!(y[j + 16], 0.5 * (j / 2) as f32 - 1.0);
    }
}

#[test]
fn q8_0_known_answer() {
    // value = d * q with q signed.
    let mut block = h(0.25).to_vec();
    block.extend((0..32i32).map(|j| ((j - 16) * 8) as i8 as u8));
    let y = dequant(GgmlType::Q8_0, &block, 32);
    for (j, v) in y.iter().enumerate() {
        assert_eq!(*v, 0.25 * ((j as f32 - 16.0) * 8.0));
    }
}

#[test]
fn q5_0_and_q5_1_known_answers() {
    // Fifth bit of element j is bit j of qh; value = d * (q - 16) (Q5_0) or d * q + m (Q5_1).
    let qh: u32 = 0xF0F0_0F0F;
    let codes = |j: usize| {
        let nib = if j < 16 { j as u32 } else { 31 - j as u32 };
        nib | ((qh >> j) & 1) << 4
    };
    let nibbles = (0..16u8).map(|j| j | ((15 - j) << 4));
    let mut q5_0 = h(0.5).to_vec();
    q5_0.extend(qh.to_le_bytes());
    q5_0.extend(nibbles.clone());
    let mut q5_1 = h(0.25).to_vec();
    q5_1.extend(h(-2.0));
    q5_1.extend(qh.to_le_bytes());
    q5_1.extend(nibbles);
    let (y0, y1) = (dequant(GgmlType::Q5_0, &q5_0, 32), dequant(GgmlType::Q5_1, &q5_1, 32));
    for j in 0..32 {
        assert_eq!(y0[j], 0.5 * (codes(j) as f32 - 16.0), "Q5_0 {j}");
        assert_eq!(y1[j], 0.25 * codes(j) as f32 - 2.0, "Q5_1 {j}");
    }
}

/// Packs eight 6-bit (scale, min) pairs as Q4_K and Q5_K hold them: pairs 0..4 in the low six
/// bits of bytes 0..4 and 4..8, pairs 4..8 as nibbles of bytes 8..12 with their top two bits in
/// the top bits of bytes 0..8.
fn pack_k4(sc: [u8; 8], mn: [u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..4 {
        q[j] = sc[j] | (sc[j + 4] >> 4) << 6;
        q[j + 4] = mn[j] | (mn[j + 4] >> 4) << 6;
        q[j + 8] = (sc[j + 4] & 0x0F) | (mn[j + 4] & 0x0F) << 4;
    }
    q
}

#[test]
fn q4_k_and_q5_k_known_answers() {
    // Sub-block i (32 elements) is d * sc[i] * q - dmin * mn[i]; the 32 bytes of run r hold
    // sub-block 2r in low nibbles and 2r+1 in high ones; Q5_K's bit i of qh[l] is the fifth bit
    // of element l of sub-block i.
    let sc = [1, 7, 20, 33, 40, 52, 63, 9];
    let mn = [0, 5, 17, 30, 44, 50, 61, 63];
    let nib = |e: usize| ((e * 7 + e / 32) % 16) as u8;
    let qh: Vec<u8> = (0..32).map(|l| (l * 37 + 11) as u8).collect();
    let qs: Vec<u8> = (0..128).map(|b| nib(64 * (b / 32) + b % 32) | nib(64 * (b / 32) + 32 + b % 32) << 4).collect();
    for five in [false, true] {
        let mut block = h(0.5).to_vec();
        block.extend(h(0.25));
        block.extend(pack_k4(sc, mn));
        if five {
            block.extend(&qh);
        }
        block.extend(&qs);
        let ty = if five { GgmlType::Q5_K } else { GgmlType::Q4_K };
        let y = dequant(ty, &block, 256);
        for (e, v) in y.iter().enumerate() {
            let (i, l) = (e / 32, e % 32);
            let q = nib(e) + if five { ((qh[l] >> i) & 1) * 16 } else { 0 };
            assert_eq!(*v, 0.5 * sc[i] as f32 * q as f32 - 0.25 * mn[i] as f32, "{ty} {e}");
        }
    }
}

#[test]
fn q6_k_known_answer() {
    // Element 128n + 32c + l (l < 32) has low nibble (ql[64n + 32(c % 2) + l] >> 4(c / 2)) and
    // high bits (qh[32n + l] >> 2c) & 3; value d * scale[e / 16] * (q - 32), scales signed.
    let code = |e: usize| ((e * 13 + 5) % 64) as u8;
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for e in 0..256 {
        let (n, c, l) = (e / 128, e % 128 / 32, e % 32);
        ql[64 * n + 32 * (c % 2) + l] |= (code(e) & 0x0F) << (4 * (c / 2));
        qh[32 * n + l] |= (code(e) >> 4) << (2 * c);
    }
    let scales: [i8; 16] = std::array::from_fn(|i| (i as i8 - 8) * 15);
    let mut block = ql.to_vec();
    block.extend(qh);
    block.extend(scales.iter().map(|&s| s as u8));
    block.extend(h(0.5));
    let y = dequant(GgmlType::Q6_K, &block, 256);
    for (e, v) in y.iter().enumerate() {
        assert_eq!(*v, 0.5 * scales[e / 16] as f32 * (code(e) as f32 - 32.0), "{e}");
    }
}

#[test]
fn q2_k_known_answer() {
    // Element 128g + 32s + l (l < 32) is bits 2s..2s+2 of qs[32g + l]; sub-block e / 16 has
    // scale byte sc | mn << 4; value d * sc * q - dmin * mn.
    let code = |e: usize| ((e * 5 + e / 64) % 4) as u8;
    let mut qs = [0u8; 64];
    for e in 0..256 {
        qs[32 * (e / 128) + e % 32] |= code(e) << (2 * (e % 128 / 32));
    }
    let (sc, mn) = (|i: usize| (i * 3 % 16) as u8, |i: usize| (15 - i) as u8);
    let mut block: Vec<u8> = (0..16).map(|i| sc(i) | mn(i) << 4).collect();
    block.extend(qs);
    block.extend(h(0.5));
    block.extend(h(0.25));
    let y = dequant(GgmlType::Q2_K, &block, 256);
    for (e, v) in y.iter().enumerate() {
        let i = e / 16;
        assert_eq!(*v, 0.5 * sc(i) as f32 * code(e) as f32 - 0.25 * mn(i) as f32, "{e}");
    }
}

#[test]
fn q3_k_known_answer() {
    // Element 128g + 32s + l (l < 32): two low bits at bits 2s..2s+2 of qs[32g + l], a third at
    // bit 4g + s of hmask[l]; value d * (scale - 32) * (code - 4). The 6-bit scales: scale i's
    // low nibble in byte i % 8 (high nibble when i >= 8), its top bits in byte 8 + i % 4 at bit
    // 2 * (i / 4).
    let code = |e: usize| ((e * 3 + e / 32) % 8) as u8;
    let (mut hmask, mut qs) = ([0u8; 32], [0u8; 64]);
    for e in 0..256 {
        let (g, s, l) = (e / 128, e % 128 / 32, e % 32);
        qs[32 * g + l] |= (code(e) & 3) << (2 * s);
        hmask[l] |= (code(e) >> 2) << (4 * g + s);
    }
    let scale = |i: usize| (i * 9 % 64) as u8;
    let mut packed = [0u8; 12];
    for i in 0..16 {
        packed[i % 8] |= (scale(i) & 0x0F) << (4 * (i / 8));
        packed[8 + i % 4] |= (scale(i) >> 4) << (2 * (i / 4));
    }
    let mut block = hmask.to_vec();
    block.extend(qs);
    block.extend(packed);
    block.extend(h(0.5));
    let y = dequant(GgmlType::Q3_K, &block, 256);
    for (e, v) in y.iter().enumerate() {
        assert_eq!(*v, 0.5 * (scale(e / 16) as f32 - 32.0) * (code(e) as f32 - 4.0), "{e}");
    }
}

#[test]
fn q8_k_known_answer() {
    let mut block = 0.5f32.to_le_bytes().to_vec();
    block.extend((0..256i32).map(|j| (j - 128) as i8 as u8));
    block.extend([0u8; 32]);
    let y = dequant(GgmlType::Q8_K, &block, 256);
    for (j, v) in y.iter().enumerate() {
        assert_eq!(*v, 0.5 * (j as f32 - 128.0));
    }
}

/// Four blocks of pseudo-random bytes with the f16 (f32 for Q8_K) scales forced to small
/// positive values; the same recipe produced the expected hashes with the `gguf` Python
/// package's numpy dequantizers (gguf 0.19.0, which mirror ggml-quants.c).
fn random_blocks(ty: GgmlType, scale_offsets: &[usize]) -> Vec<u8> {
    let ts = ty.type_size();
    let mut rng = XorShift(0xC0FFEE ^ ts as u64);
    let mut buf = Vec::new();
    for _ in 0..4 {
        let mut block: Vec<u8> = (0..ts).map(|_| rng.next_u64() as u8).collect();
        for &o in scale_offsets {
            let bits = 0x1C00 + (rng.next_u64() % 0x1000) as u16;
            block[o..o + 2].copy_from_slice(&bits.to_le_bytes());
        }
        buf.extend(block);
    }
    buf
}

fn fnv1a(values: &[f32]) -> u64 {
    values.iter().flat_map(|v| v.to_le_bytes()).fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

#[test]
fn dequantize_matches_reference_vectors() {
    let cases: [(GgmlType, &[usize], u64, f32, f32); 10] = [
        (GgmlType::Q4_0, &[0], 0x61e9a21033eaad15, 0.045639038, 0.036483765),
        (GgmlType::Q4_1, &[0, 2], 0x87d865b1f34aae5e, 0.7383728, 0.08850479),
        (GgmlType::Q5_0, &[0], 0xf2e3b3c52cc50df2, -0.16741943, 0.005519867),
        (GgmlType::Q5_1, &[0, 2], 0x5235803e86d9be70, 1.8062744, 1.3216248),
        (GgmlType::Q8_0, &[0], 0xcb3fc2e3a4671575, 0.97435, -1.8352356),
        (GgmlType::Q2_K, &[80, 82], 0x5e6731e30791ab86, -0.07392883, -0.34951782),
        (GgmlType::Q3_K, &[108], 0xfeb75adfdc37a6fa, -0.60498047, 0.0),
        (GgmlType::Q4_K, &[0, 2], 0xf31d83c68ad5917e, 0.65467834, 0.84586334),
        (GgmlType::Q5_K, &[0, 2], 0x9efc2bdd397d2d03, 7.911438, 2.3413734),
        (GgmlType::Q6_K, &[208], 0x09656c208fbc11bb, 95.04053, -80.43164),
    ];
    for (ty, scales, hash, first, last) in cases {
        let src = random_blocks(ty, scales);
        let y = dequant(ty, &src, 4 * ty.block_size());
        assert_eq!((y[0], y[y.len() - 1]), (first, last), "{ty}");
        assert_eq!(fnv1a(&y), hash, "{ty}");
    }
}

#[test]
fn quantize_then_dequantize_is_close() {
    // Worst-case error relative to the data's max magnitude, per type.
    let tolerances = [
        (GgmlType::F32, 0.0),
        (GgmlType::F16, 1e-3),
        (GgmlType::BF16, 8e-3),
        (GgmlType::Q8_0, 1e-2),
        (GgmlType::Q4_0, 0.13),
        (GgmlType::Q4_1, 0.07),
        (GgmlType::Q5_0, 0.07),
        (GgmlType::Q5_1, 0.035),
        (GgmlType::Q2_K, 0.3),
        (GgmlType::Q3_K, 0.2),
        (GgmlType::Q4_K, 0.1),
        (GgmlType::Q5_K, 0.05),
        (GgmlType::Q6_K, 0.03),
    ];
    let mut rng = XorShift(42);
    for (ty, tol) in tolerances {
        for scale in [1.0f32, 1e-3, 100.0] {
            let mut x: Vec<f32> = (0..1024).map(|_| rng.signed_unit() * scale).collect();
            // A skewed sub-block and an all-zero one exercise the min/zero-scale paths.
            x[..32].iter_mut().for_each(|v| *v = v.abs() + scale);
            x[256..512].iter_mut().for_each(|v| *v = 0.0);
            let mut q = Vec::new();
            quantize_row(ty, &x, &mut q).expect("quantize");
            assert_eq!(Some(q.len() as u64), ty.row_bytes(x.len() as u64), "{ty}");
            let y = dequant(ty, &q, x.len());
            let max_err = x.iter().zip(&y).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert!(max_err <= tol * amax, "{ty} scale {scale}: max error {max_err} > {tol} * {amax}");
            assert!(y[256..512].iter().all(|&v| v == 0.0), "{ty}: zeros not preserved");
        }
    }
}

#[test]
fn length_and_type_errors() {
    let mut y = [0.0f32; 32];
    assert!(matches!(dequantize_row(GgmlType::Q4_0, &[0; 17], &mut y), Err(GgufError::LengthMismatch { expected: 18, found: 17, .. })));
    assert!(matches!(dequantize_row(GgmlType::Q4_0, &[0; 18], &mut y[..31]), Err(GgufError::PartialBlock { .. })));
    assert!(matches!(dequantize_row(GgmlType::I32, &[0; 128], &mut y), Err(GgufError::UnsupportedType { .. })));
    assert!(matches!(quantize_row(GgmlType::Q8_K, &[0.0; 256], &mut Vec::new()), Err(GgufError::UnsupportedType { .. })));
    assert!(matches!(quantize_row(GgmlType::Q8_0, &[0.0; 33], &mut Vec::new()), Err(GgufError::PartialBlock { .. })));
    let mut out = vec![9u8];
    quantize_row(GgmlType::F32, &[1.0], &mut out).expect("f32");
    assert_eq!(out, [9, 0, 0, 0x80, 0x3F], "quantize_row appends");
}
