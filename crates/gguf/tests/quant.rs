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
    assert!(matches!(quantize_row(GgmlType::Q2_K, &[0.0; 256], &mut Vec::new()), Err(GgufError::UnsupportedType { .. })));
    assert!(matches!(quantize_row(GgmlType::Q8_0, &[0.0; 33], &mut Vec::new()), Err(GgufError::PartialBlock { .. })));
    let mut out = vec![9u8];
    quantize_row(GgmlType::F32, &[1.0], &mut out).expect("f32");
    assert_eq!(out, [9, 0, 0, 0x80, 0x3F], "quantize_row appends");
}
