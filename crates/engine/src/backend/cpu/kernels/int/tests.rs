use super::super::tests::{bits, random_row, Rng, TYPES};
use super::*;
use crate::backend::cpu::pool::ThreadPool;
use dgr_gguf::GgmlType;

/// The block types: the ones with an integer kernel.
fn block_types() -> impl Iterator<Item = (GgmlType, FastType)> {
    TYPES.into_iter().map(|t| (t, FastType::of(t).unwrap())).filter(|(_, f)| has_int(*f))
}

/// Columns of `k` values with chunks of very different magnitudes (and a zero chunk), as
/// activations have.
fn columns(rng: &mut Rng, n: usize, k: usize) -> Vec<Vec<f32>> {
    (0..n)
        .map(|c| {
            (0..k)
                .map(|e| {
                    let chunk = e / 32;
                    if (c + chunk) % 11 == 5 {
                        0.0
                    } else {
                        rng.f32() * [1.0, 30.0, 1e-3, 4.0][(c + chunk) % 4]
                    }
                })
                .collect()
        })
        .collect()
}

/// `xs` quantized on two threads with the instruction set the tests run (`DGR_ISA`).
fn quantized(xs: &[&[f32]], k: usize) -> Activations {
    let mut a = Activations::default();
    a.quantize(&ThreadPool::new(2), Isa::detect(), xs, k);
    a
}

fn products(flavor: Flavor, ty: FastType, rows: &[u8], n: usize, k: usize, acts: &Activations) -> Vec<f32> {
    let w = Rows { ty, bytes: rows, row_bytes: rows.len() / n, n_rows: n };
    let mut out = vec![f32::NAN; acts.n * n];
    // SAFETY: outputs `c * n + r` for c < acts.n and r < n, all inside `out`, which nothing
    // else touches meanwhile; the flavor is one this CPU runs.
    unsafe { gemv_with(flavor, &w, k, acts, out.as_mut_ptr(), n) };
    out
}

#[test]
fn codes_factors_and_offsets_are_the_dequantized_weights() {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    for (ty, fast) in block_types() {
        let row = random_row(&mut rng, ty, 1024);
        let mut want = vec![0f32; 1024];
        dgr_gguf::quant::dequantize_row(ty, &row, &mut want).unwrap();
        let (e, g) = (elems(fast), group(fast));
        for (blk, b) in row.chunks_exact(fast.block_bytes()).enumerate() {
            let (mut q, mut m, mut o) = ([0i16; 256], [0f32; 16], [0f32; 16]);
            unpack(fast, b, &mut q, &mut m, &mut o);
            for i in 0..e {
                let got = m[i / g] as f64 * q[i] as f64 + o[i / g] as f64;
                let w = want[blk * e + i] as f64;
                assert!((got - w).abs() <= 1e-6 * w.abs(), "{ty:?} element {}: {got} vs {w}", blk * e + i);
            }
            assert!(offset(fast) || o[..e / g].iter().all(|&v| v == 0.0), "{ty:?} has offsets");
        }
    }
}

#[test]
fn quantized_values_are_within_half_a_step() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let cols = columns(&mut rng, 3, 512);
    let xs: Vec<&[f32]> = cols.iter().map(|c| &c[..]).collect();
    let mut a = quantized(&xs, 512);
    // Every instruction set and thread count quantizes to the same bits.
    for isa in Isa::available() {
        for threads in [1, 3] {
            let mut b = Activations::default();
            b.quantize(&ThreadPool::new(threads), isa, &xs, 512);
            assert_eq!(
                (&a.codes, &a.pairs, &a.quads, &a.isums16),
                (&b.codes, &b.pairs, &b.quads, &b.isums16),
                "{isa:?}, {threads} threads"
            );
            let floats = |a: &Activations| [&a.scales, &a.sums16, &a.sums32, &a.scales_t, &a.sums16_t, &a.sums32_t].map(|v| bits(v));
            assert_eq!(floats(&a), floats(&b), "{isa:?}, {threads} threads");
        }
    }
    for (c, x) in cols.iter().enumerate() {
        for (i, v) in x.iter().enumerate() {
            let s = a.scales[c * 16 + i / 32];
            assert!(s >= 0.0);
            let back = s * a.codes[c * 512 + i] as f32;
            assert!((back - v).abs() <= 0.5 * s + 2e-7 * v.abs() + 1e-30, "column {c} element {i}: {v} read back as {back}");
        }
    }
    // Each code is its two bytes' `256 * hi + lo`, and each 16 codes sum to their integer sum
    // (a group of 3 columns: quads and sums 3 apart).
    for c in 0..3 {
        let codes = &a.codes[c * 512..][..512];
        for (i, &code) in codes.iter().enumerate() {
            let q = i / 4;
            let byte = |at: usize| (a.quads[at] >> (8 * (i % 4))) as u8 as i8 as i32;
            assert_eq!(256 * byte(2 * q * 3 + c) + byte((2 * q + 1) * 3 + c), code as i32, "column {c} code {i}");
        }
        for (j, sixteen) in codes.chunks_exact(16).enumerate() {
            assert_eq!(a.isums16[j * 3 + c], sixteen.iter().map(|&q| q as i32).sum::<i32>(), "column {c} sum {j}");
        }
    }
    // A NaN or an infinity makes its chunk's scale NaN, so every product it meets is NaN.
    let mut bad = cols[0].clone();
    bad[40] = f32::INFINITY;
    a = quantized(&[&bad], 512);
    assert!(a.scales[1].is_nan() && a.scales[0].is_finite() && a.codes[32..64].iter().all(|&q| q == 0));
    bad[40] = f32::NAN;
    a = quantized(&[&bad], 512);
    assert!(a.scales[1].is_nan());
}

#[test]
fn every_flavor_and_every_width_gives_the_scalar_bits_close_to_exact() {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let n = 37;
    for (ty, fast) in block_types() {
        // 352: eleven legacy blocks, which a one-column product reads eight and then three.
        for k in [256usize, 512, 3584].into_iter().chain((elems(fast) == 32).then_some(352)) {
            let rows: Vec<Vec<u8>> = (0..n).map(|_| random_row(&mut rng, ty, k)).collect();
            let cols = columns(&mut rng, 19, k);
            let xs: Vec<&[f32]> = cols.iter().map(|c| &c[..]).collect();
            let acts = quantized(&xs, k);
            let all_rows = rows.concat();
            let want = products(Flavor::Scalar, fast, &all_rows, n, k, &acts);
            // Each product is within its quantization's bound of the exact one: every value
            // moves at most half its chunk's step, and the float steps add a few roundings.
            for (r, row) in rows.iter().enumerate() {
                let mut w = vec![0f32; k];
                dgr_gguf::quant::dequantize_row(ty, row, &mut w).unwrap();
                for (c, x) in xs.iter().enumerate() {
                    let exact: f64 = w.iter().zip(x.iter()).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let mag: f64 = w.iter().zip(x.iter()).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
                    let step: f64 = w.iter().enumerate().map(|(i, a)| a.abs() as f64 * acts.scales[c * k / 32 + i / 32] as f64).sum();
                    let got = want[c * n + r] as f64;
                    assert!((got - exact).abs() <= 0.5 * step + 1e-5 * mag + 1e-30, "{ty:?} k={k} row {r} column {c}: {got} vs {exact}");
                }
            }
            for flavor in Flavor::available() {
                for width in [1, 2, 3, 4, 7, 8, 11, 16, 19] {
                    let part = quantized(&xs[..width], k);
                    let out = products(flavor, fast, &all_rows, n, k, &part);
                    assert_eq!(bits(&out), bits(&want[..width * n]), "{ty:?} {flavor:?} k={k} width={width}");
                }
                // A cut of the rows gives the same bits (threads take rows in chunks).
                let cut = 17 * all_rows.len() / n;
                let lo = products(flavor, fast, &all_rows[..cut], 17, k, &acts);
                assert_eq!(bits(&lo[..17]), bits(&want[..17]), "{ty:?} {flavor:?} k={k} cut");
            }
        }
    }
}

#[test]
fn packed_tiles_give_the_scalar_bits_for_every_width() {
    let mut rng = Rng(0x0dd_ba11_cafe_f00d);
    let n = 53; // three tiles, and five rows the packed form leaves to the others
    for (ty, fast) in block_types() {
        for k in [256usize, 512, 3584] {
            let mut rows: Vec<Vec<u8>> = (0..n).map(|_| random_row(&mut rng, ty, k)).collect();
            // A subnormal f16 factor, which the packed kernels widen by instruction.
            rows[3][..2].copy_from_slice(&1u16.to_le_bytes());
            let all_rows = rows.concat();
            let w = Rows { ty: fast, bytes: &all_rows, row_bytes: all_rows.len() / n, n_rows: n };
            let cols = columns(&mut rng, 19, k);
            let xs: Vec<&[f32]> = cols.iter().map(|c| &c[..]).collect();
            for flavor in Flavor::available().into_iter().filter(|f| matches!(f, Flavor::Avx512 | Flavor::Vnni)) {
                let Some(p) = packed::Packed::for_flavor(flavor, &w, k, 2) else {
                    assert!(!packed::packable(fast), "{ty:?} packs");
                    continue;
                };
                assert_eq!(p.tiles(), 3);
                for width in [1, 2, 3, 7, 8, 9, 16, 19] {
                    let acts = quantized(&xs[..width], k);
                    let want = products(Flavor::Scalar, fast, &all_rows, n, k, &acts);
                    let mut out = vec![f32::NAN; width * n];
                    // Tiles 1 and 2: rows 16..48 of each column, written from row 16 on.
                    // SAFETY: outputs `16 + c * n + r` for c < width and r < 32, inside `out`.
                    unsafe { packed::gemv(&p, 1..3, &acts, out.as_mut_ptr().add(16), n) };
                    for c in 0..width {
                        let (got, want) = (&out[c * n + 16..c * n + 48], &want[c * n + 16..c * n + 48]);
                        assert_eq!(bits(got), bits(want), "{ty:?} {flavor:?} k={k} width={width} column {c}");
                    }
                }
            }
        }
    }
}
